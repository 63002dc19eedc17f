"""The whole story: a live run_web.py serves the config; a monitor and two peers started with --config from it
train together; the monitor's metrics and an uploaded checkpoint arrive through the dashboard API."""

from __future__ import annotations

import hashlib
import time

import pytest
import requests

from tests.web.live import ROOT, running_web_server, wait_until
from trainer.local import MonitorProcess, PeerProcess

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

ADMIN_TOKEN = "integration-admin-token"
MAX_STEPS = 6
FAST = {"target_batch_size": 128, "matchmaking_time": 2.0, "max_steps": MAX_STEPS, "statistics_expiration": 120.0}


@pytest.fixture
def web(tmp_path):
    if not (ROOT / "run_training_monitor.py").exists():
        pytest.skip("run_training_monitor.py is not in this checkout yet")
    with running_web_server(tmp_path, ADMIN_TOKEN) as server:
        yield server


def test_monitor_and_two_peers_configured_by_the_web_app(web, tmp_path, sample_data):
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    config = {**FAST, "experiment_prefix": f"webtest{int(time.time())}"}
    created = requests.post(f"{web.url}/api/experiments", json={"name": "itest", "config": config}, headers=admin)
    assert created.status_code == 201, created.text
    token = created.json()["token"]
    api = f"{web.url}/api/experiments/1"
    common = ["--config", f"{api}/config", "--config_token", token]
    monitor_argv = [
        *common,
        "--report_url",
        f"{api}/metrics",
        "--refresh_period",
        "1",
        "--store_checkpoints",
        "--save_checkpoint_step_interval",
        "2",
        "--repo_path",
        str(tmp_path / "checkpoints"),
        "--upload_interval",
        "2",
        "--upload_to",
        f"{api}/checkpoints",
    ]
    monitor = MonitorProcess(monitor_argv, tmp_path / "monitor.log")
    peers = []
    try:
        join = monitor.join_flags(timeout=90)
        peers = [
            PeerProcess([*common, *join, "--output_dir", str(tmp_path / name)], tmp_path / f"{name}.log")
            for name in "AB"
        ]

        def progress():
            steps = [r["step"] for r in requests.get(f"{api}/metrics", timeout=5).json()]
            uploaded = requests.get(f"{api}/checkpoints", timeout=5).json()
            finished = all(p.process.poll() is not None for p in peers)
            return (steps, uploaded) if steps and max(steps) >= MAX_STEPS - 1 and (uploaded or finished) else None

        steps, uploaded = wait_until(progress, 150, "the monitor's metrics and a checkpoint on the dashboard API")
    finally:
        for process in [*peers, monitor]:
            process.stop()

    rows = requests.get(f"{api}/metrics", timeout=5).json()
    assert steps == sorted(steps) and len(steps) >= 2
    assert max(r["alive_peers"] for r in rows) == 2
    assert any(r["loss"] is not None for r in rows)
    assert uploaded, f"no checkpoint uploaded; monitor log:\n{monitor.log()[-3000:]}"
    archive = requests.get(f"{web.url}{uploaded[-1]['url']}", headers={"Authorization": f"Bearer {token}"})
    assert hashlib.sha256(archive.content).hexdigest() == uploaded[-1]["sha256"]
