"""The web app under faults, with a real run_web.py: killed under load, uploads cut off, leftovers from a crash."""

from __future__ import annotations

import json
import socket
import threading
import time
from urllib.parse import urlparse

import pytest
import requests

from tests.web.live import WebServer, wait_until

pytestmark = pytest.mark.light

ADMIN = "faults-admin-token"
POSTS = 400  # bounded load: this many metric posts at most, from two threads, within LOAD_SECONDS
LOAD_SECONDS = 60


def create_experiment(url: str) -> str:
    """A new experiment's monitor token (it posts metrics and uploads)."""
    created = requests.post(
        f"{url}/api/experiments",
        json={"name": "faults", "config": {}},
        headers={"Authorization": f"Bearer {ADMIN}"},
        timeout=30,
    )
    assert created.status_code == 201, created.text
    return created.json()["monitor_token"]


def record(step: int) -> dict:
    return {
        "step": step,
        "loss": 1.0 + step / 1000,
        "alive_peers": 2,
        "samples": step,
        "samples_per_second": 1.5,
        "time": 1.0e9 + step,
    }


def test_a_killed_app_loses_nothing_it_acknowledged(tmp_path):
    server = WebServer(tmp_path, ADMIN)
    acknowledged: list[int] = []
    try:
        server.wait_ready()
        token = create_experiment(server.url)
        lock, deadline = threading.Lock(), time.monotonic() + LOAD_SECONDS

        def post_metrics(first: int) -> None:
            session = requests.Session()
            for step in range(first, POSTS, 2):
                if time.monotonic() > deadline:
                    return
                try:
                    response = session.post(
                        f"{server.url}/api/experiments/1/metrics",
                        json=record(step),
                        headers={"Authorization": f"Bearer {token}"},
                        timeout=5,
                    )
                except requests.RequestException:
                    return  # the app is gone: what it answered before is what must survive
                if response.status_code == 200:
                    with lock:
                        acknowledged.append(step)

        threads = [threading.Thread(target=post_metrics, args=(first,)) for first in (0, 1)]
        for thread in threads:
            thread.start()
        wait_until(lambda: len(acknowledged) >= 100, timeout=LOAD_SECONDS, what="100 acknowledged posts", poll=0.05)
        server.process.kill()  # SIGKILL in the middle of the load
        for thread in threads:
            thread.join(30)
    finally:
        server.stop()
    assert 100 <= len(acknowledged) < POSTS
    restarted = WebServer(tmp_path, ADMIN)
    try:
        restarted.wait_ready()
        stored = {row["step"]: row for row in requests.get(f"{restarted.url}/api/experiments/1/metrics").json()}
    finally:
        restarted.stop()
    lost = sorted(set(acknowledged) - set(stored))
    assert not lost, f"{len(lost)} acknowledged steps lost: {lost[:10]}"
    assert all({key: stored[step][key] for key in record(step)} == record(step) for step in acknowledged)


def start_partial_upload(url: str, token: str, declared: int, sent: int) -> socket.socket:
    """A multipart upload that declares ``declared`` bytes and sends ``sent`` of them; the caller hangs up."""
    boundary = "cutcutcut"
    head = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="step"\r\n\r\n7\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="sha256"\r\n\r\n{"0" * 64}\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="archive"; filename="checkpoint-7.tar.gz"\r\n'
        "Content-Type: application/gzip\r\n\r\n"
    ).encode()
    target = urlparse(url)
    connection = socket.create_connection((target.hostname, target.port), timeout=30)
    connection.sendall(
        (
            f"POST /api/experiments/1/checkpoints HTTP/1.1\r\nHost: {target.netloc}\r\n"
            f"Authorization: Bearer {token}\r\nContent-Type: multipart/form-data; boundary={boundary}\r\n"
            f"Content-Length: {len(head) + declared}\r\n\r\n"
        ).encode()
        + head
        + b"x" * sent
    )
    return connection


@pytest.mark.parametrize("kill_app", [False, True], ids=["client-hangs-up", "app-killed"])
def test_an_upload_cut_midway_leaves_nothing(tmp_path, kill_app):
    server = WebServer(tmp_path, ADMIN)
    data = tmp_path / "experiments_data"
    try:
        server.wait_ready()
        token = create_experiment(server.url)
        with start_partial_upload(server.url, token, declared=4 << 20, sent=1 << 20):
            wait_until(lambda: list(data.rglob(".upload-*.part")), 30, "the partial upload on disk", poll=0.1)
            if kill_app:
                server.process.kill()
                server.stop()
        if kill_app:
            assert list(data.rglob(".upload-*.part")), "a killed app leaves its partial upload behind"
            server = WebServer(tmp_path, ADMIN)
            server.wait_ready()
        wait_until(lambda: not list(data.rglob(".upload-*.part")), 30, "the partial upload to be removed", poll=0.1)
        listed = requests.get(f"{server.url}/api/experiments/1/checkpoints", timeout=10).json()
        log = server.log_path.read_text()
    finally:
        server.stop()
    assert listed == []
    assert not [p for p in data.rglob("*") if p.is_file()], "a partial upload left a file behind"
    if kill_app:
        assert "left by an upload interrupted by a restart" in log


def test_malformed_upload_bodies_are_refused(tmp_path):
    server = WebServer(tmp_path, ADMIN)
    try:
        server.wait_ready()
        token = create_experiment(server.url)
        auth = {"Authorization": f"Bearer {token}"}
        url = f"{server.url}/api/experiments/1/checkpoints"
        not_multipart = requests.post(url, data=json.dumps({"step": 1}), headers=auth, timeout=10)
        garbage = requests.post(
            url,
            data=b"--x\r\ngarbage",
            timeout=10,
            headers={**auth, "Content-Type": "multipart/form-data; boundary=x"},
        )
        no_file = requests.post(url, files={"step": (None, "3"), "sha256": (None, "0" * 64)}, headers=auth, timeout=10)
    finally:
        server.stop()
    assert not_multipart.status_code == 400 and "multipart/form-data" in not_multipart.json()["detail"]
    assert garbage.status_code == 400
    assert no_file.status_code == 400
