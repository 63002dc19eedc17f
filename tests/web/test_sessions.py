"""The admin session against a live run_web.py over HTTP: same-origin checks, server-side expiry and sign-out."""

from __future__ import annotations

import sqlite3
import time

import pytest
import requests

from tests.web.live import running_web_server

pytestmark = pytest.mark.light

ADMIN_TOKEN = "sessions-admin-token"
CROSS_ORIGIN = "cross-origin request refused: send it from this app's own pages, or use Authorization: Bearer"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_web_server(tmp_path_factory.mktemp("sessions"), ADMIN_TOKEN) as server:
        admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        created = requests.post(f"{server.url}/api/experiments", json={"name": "s"}, headers=admin, timeout=10)
        assert created.status_code == 201
        yield server


def signed_in(server) -> requests.Session:
    session = requests.Session()
    response = session.post(f"{server.url}/login", data={"token": ADMIN_TOKEN, "next": "/"}, allow_redirects=False)
    assert response.status_code == 303 and session.cookies.get("collab_admin_session")
    return session


def tokens(server) -> tuple[str, str]:
    body = requests.get(f"{server.url}/api/experiments/1", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}).json()
    return body["token"], body["monitor_token"]


def test_a_form_posted_from_another_origin_is_refused_and_changes_nothing(server):
    session, before = signed_in(server), tokens(server)
    other_port = server.url.rsplit(":", 1)[0] + ":1"
    for headers in ({"Origin": other_port}, {"Origin": "null"}, {"Sec-Fetch-Site": "same-site"}, {}):
        rotate = session.post(f"{server.url}/experiments/1/token", data={"role": "peer"}, headers=headers)
        assert (rotate.status_code, rotate.json()) == (403, {"detail": CROSS_ORIGIN}), headers
        edit = session.put(f"{server.url}/api/experiments/1", json={"config": {}}, headers=headers)
        assert edit.status_code == 403, headers
    assert tokens(server) == before
    assert (
        requests.get(f"{server.url}/api/experiments/1", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}).json()[
            "version"
        ]
        == 1
    )
    own = session.post(f"{server.url}/experiments/1/token", data={"role": "peer"}, headers={"Origin": server.url})
    assert own.status_code == 200 and tokens(server)[0] != before[0]
    fetch_site = session.post(
        f"{server.url}/experiments/1/token", data={"role": "monitor"}, headers={"Sec-Fetch-Site": "same-origin"}
    )
    assert fetch_site.status_code == 200 and tokens(server)[1] != before[1]


def test_sign_out_revokes_a_copied_cookie(server):
    session = signed_in(server)
    copied = {"collab_admin_session": session.cookies.get("collab_admin_session")}
    assert requests.get(f"{server.url}/experiments/new", cookies=copied, allow_redirects=False).status_code == 200
    session.post(f"{server.url}/logout", headers={"Origin": server.url})
    after = requests.get(f"{server.url}/experiments/new", cookies=copied, allow_redirects=False)
    assert after.status_code == 303 and after.headers["location"].startswith("/login")
    api = requests.post(f"{server.url}/api/experiments", json={"name": "x"}, cookies=copied)
    assert (api.status_code, api.json()) == (403, {"detail": "the admin session has expired or ended: sign in again"})


def test_a_session_expires_on_the_server_after_12_hours(server):
    session = signed_in(server)
    with sqlite3.connect(server.log_path.with_name("experiments.sqlite")) as db:
        db.execute("UPDATE sessions SET created = ?", (time.time() - 12 * 3600 - 1,))
    expired = session.get(f"{server.url}/experiments/new", allow_redirects=False)
    assert expired.status_code == 303
