"""A peer's access token against a live run_web.py that stops answering: kept while valid, refreshed after."""

from __future__ import annotations

import asyncio
import logging
import signal
import time

import pytest
import requests

from collab.access import WebAppAuthorizer, next_retry_delay, within_time_left
from tests.web.live import running_web_server

pytestmark = pytest.mark.light

ADMIN_TOKEN = "refresh-admin-token"
LIFETIME = 16  # seconds: the token is due for a refresh after 4; failed refreshes retry after 1 s, then 2 s


@pytest.fixture
def web(tmp_path):
    with running_web_server(tmp_path, ADMIN_TOKEN, "--access_token_lifetime", str(LIFETIME)) as server:
        created = requests.post(
            f"{server.url}/api/experiments",
            json={"name": "refresh"},
            headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
            timeout=10,
        ).json()
        server.peer_token, server.monitor_token = created["token"], created["monitor_token"]
        server.join_url = f"{server.url}/api/experiments/1/join"
        yield server


def test_a_stopped_web_app_does_not_stop_signing_and_the_token_is_refreshed_after(web, caplog):
    caplog.set_level(logging.INFO, logger="collab.access")
    authorizer = WebAppAuthorizer(web.join_url, web.peer_token, timeout=10.0)
    authorizer.fetch_first_token()
    first = authorizer._local_access_token
    # requests to the stopped app give up soon, so the outage fits the token's lifetime; the others may take their time
    # on a loaded machine
    patient, outage_timeout = authorizer.timeout, 0.5

    async def scenario() -> list[float]:
        call_seconds = []

        async def call() -> None:
            started = time.monotonic()
            await authorizer.refresh_token_if_needed()
            call_seconds.append(time.monotonic() - started)

        await call()
        while time.time() < authorizer._refresh_after:  # the first refresh falls due during the outage
            await asyncio.sleep(0.05)
        authorizer.timeout = outage_timeout
        web.process.send_signal(signal.SIGSTOP)
        try:
            deadline = time.monotonic() + LIFETIME
            while not (caplog.text.count("Could not refresh") == 1 and authorizer._retry_delay >= 2.0):
                assert time.monotonic() < deadline, "no failed refresh while the web app was stopped"
                await call()
                await asyncio.sleep(0.05)
            assert authorizer._local_access_token is first
        finally:
            web.process.send_signal(signal.SIGCONT)
            authorizer.timeout = patient
        deadline = time.monotonic() + LIFETIME
        while authorizer._local_access_token is first:
            assert time.monotonic() < deadline, "the token was not refreshed after the web app came back"
            await call()
            await asyncio.sleep(0.05)
        return call_seconds

    call_seconds = asyncio.run(scenario())
    assert max(call_seconds) < 0.5, "a DHT call waited for the stopped web app"
    assert caplog.text.count("Could not refresh the access token") == 1, "the outage was logged more than once"
    assert "Refreshed the access token again" in caplog.text
    assert authorizer.is_token_valid(authorizer._local_access_token)


def test_a_refresh_signed_by_another_authority_is_refused(web, caplog):
    caplog.set_level(logging.WARNING, logger="collab.access")
    authorizer = WebAppAuthorizer(web.join_url, web.monitor_token, timeout=5.0)
    authorizer.fetch_first_token()
    pinned, first = authorizer.authority_public_key.to_bytes(), authorizer._local_access_token
    rotated = requests.post(
        f"{web.url}/api/experiments/1/token?role=peer", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=10
    )
    assert rotated.status_code == 200  # replaces the authority key; the monitor token still lets it in

    async def refresh_once() -> None:
        authorizer._refresh_after = 0.0  # due now, rather than waiting a quarter of the lifetime
        await authorizer.refresh_token_if_needed()
        await authorizer._refreshing

    asyncio.run(refresh_once())
    assert authorizer.authority_public_key.to_bytes() == pinned and authorizer._local_access_token is first
    assert "now signs with another authority key" in caplog.text


def test_retries_double_up_to_a_minute_and_come_closer_as_the_token_nears_expiry():
    delays, previous = [], 0.0
    for _ in range(8):  # an hour's token with most of its life left: doubling, then the one-minute cap
        previous = next_retry_delay(previous, seconds_left=3000.0)
        delays.append(previous)
    assert delays == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0]
    assert next_retry_delay(32.0, seconds_left=100.0) == 25.0  # a quarter of what is left, not 64 s
    assert next_retry_delay(8.0, seconds_left=2.0) == 1.0  # never faster than once a second
    # retries from the refresh's due time (a quarter of a 40-s lifetime, 30 s left) reach past 28 s before expiry
    spent, delay = 0.0, 0.0
    while spent < 28.0:
        delay = next_retry_delay(delay, 30.0 - spent)
        spent += delay
    assert spent < 30.0
    # a refresh request to an app that hangs gives up as soon: the authorizer's 30 s, or a quarter of what is left
    assert within_time_left(30.0, seconds_left=2700.0) == 30.0
    assert within_time_left(30.0, seconds_left=30.0) == 7.5
