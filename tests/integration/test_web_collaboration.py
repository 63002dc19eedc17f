"""The whole story with real processes: a live run_web.py configures and guards an experiment.

The admin creates the experiment through the API with access control on (``authorization_url`` in its config).
The monitor (monitor token) and two trainers (peer token) start with ``--config URL --config_token TOKEN`` as the
experiment page shows; each gets a short-lived access token from the web app and refreshes it. The monitor reports
every step to the dashboard API and uploads checkpoints there. A member with a token reads the peers' records; an
outsider with a valid, signed record but no token can neither read nor write them; a wrong token stops a peer at
once. Mid-run the web app is frozen (SIGSTOP) for OUTAGE seconds, long enough for refreshes to fall due and shorter
than what is left of any token: the peers keep stepping.
"""

from __future__ import annotations

import hashlib
import signal
import time

import hivemind
import pytest
import requests
from hivemind.utils import get_dht_time

from arguments import PeerArguments
from collab.dht import start_dht
from collab.schema import LocalMetrics, make_validators, metrics_key, read_metrics
from tests.web.live import running_web_server
from trainer.local import MonitorProcess, PeerProcess, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

ADMIN = "integration-admin-token"
LIFETIME = 32  # seconds: processes refresh at a quarter of it, so every 8 s here
# seconds the web app is frozen: longer than the refresh interval, so every process has a refresh fail, and shorter
# than the 24 s that any token held at its start has left: 10 s to spare for the refresh after it, as at 40 and 20
OUTAGE = 14
STEPS = 13  # about 2 s each: the run outlasts the outage (from step 2) and the refresh after it by several steps
A_NAME = 'peer <A> "one"'  # A's --public_name: the dashboard shows it escaped


class Outage:
    """Freezes the web app once both peers have reached ``from_step``, for OUTAGE seconds; records their steps."""

    def __init__(self, web, from_step: int = 2):
        self.web, self.from_step = web, from_step
        self.started: float | None = None
        self.steps_at_start: int | None = None
        self.steps_at_end: int | None = None

    def observe(self, records: dict) -> None:
        """Called with each read of the peers' DHT records (by a member, through access control)."""
        if len(records) < 2:
            return
        steps = min(value["step"] for value, _ in records.values())
        if self.started is None and steps >= self.from_step:
            self.web.process.send_signal(signal.SIGSTOP)
            self.started, self.steps_at_start = time.monotonic(), steps
        elif self.steps_at_end is None and self.started is not None:
            if time.monotonic() - self.started >= OUTAGE:
                self.steps_at_end = steps
                self.end()

    def end(self) -> None:
        self.web.process.send_signal(signal.SIGCONT)


@pytest.fixture(scope="module")
def guarded(tmp_path_factory, sample_data):
    out = tmp_path_factory.mktemp("web_collab")
    with running_web_server(out, ADMIN, "--access_token_lifetime", str(LIFETIME)) as web:
        admin = {"Authorization": f"Bearer {ADMIN}"}
        config = {
            "experiment_prefix": f"guarded{int(time.time())}",
            "target_batch_size": 128,
            "matchmaking_time": 2.0,
            "max_steps": STEPS,
            "statistics_expiration": 120.0,
        }
        created = requests.post(
            f"{web.url}/api/experiments", json={"name": "guarded", "config": config}, headers=admin, timeout=30
        ).json()
        api = f"{web.url}/api/experiments/{created['id']}"
        config["authorization_url"] = f"{api}/join"  # access control on: a new version of the experiment
        updated = requests.put(api, json={"config": config}, headers=admin, timeout=30)
        assert updated.status_code == 200, updated.text
        token, prefix = created["token"], config["experiment_prefix"]
        from_web = ["--config", f"{api}/config", "--config_token", token]
        monitor = MonitorProcess(
            [
                "--config",
                f"{api}/config",
                "--config_token",
                created["monitor_token"],
                "--report_url",
                f"{api}/metrics",
                "--refresh_period",
                "1",
                "--store_checkpoints",
                "--save_checkpoint_step_interval",
                "2",
                "--repo_path",
                str(out / "checkpoints"),
                "--upload_interval",
                "2",
                "--upload_to",
                f"{api}/checkpoints",
            ],
            out / "M.log",
        )
        peers, member, outsider, outage = {}, None, None, Outage(web)
        try:
            join = monitor.join_flags(timeout=120)
            for name in "AB":
                named = ["--public_name", A_NAME] if name == "A" else []
                peers[name] = PeerProcess(
                    [*from_web, *join, *named, "--output_dir", str(out / name)], out / f"{name}.log"
                )
            validators, _ = make_validators(prefix)
            member = start_dht(
                PeerArguments(
                    experiment_prefix=prefix,
                    initial_peers=join[1:],
                    authorization_url=config["authorization_url"],
                    web_token=token,
                ),
                validators,
                client_mode=True,
            )
            outsider_validators, outsider_key = make_validators(prefix)  # a valid, signed record; no token
            outsider = hivemind.DHT(
                initial_peers=join[1:],
                client_mode=True,
                start=True,
                ensure_bootstrap_success=False,
                record_validators=outsider_validators,
            )
            seen_by_member: list[dict] = []
            outsider_reads: list = []
            forged = LocalMetrics(step=1, samples_per_second=1.0, samples_accumulated=1, loss=1.0, mini_steps=1)

            def poll():
                seen_by_member.append(read_metrics(member, prefix))
                outage.observe(seen_by_member[-1])
                if len(seen_by_member[-1]) == 2 and not outsider_reads:  # both peers alive and publishing
                    outsider_reads.append(outsider.get(metrics_key(prefix), latest=True))
                    outsider.store(metrics_key(prefix), forged.model_dump(), get_dht_time() + 60, subkey=outsider_key)
                return all(peer.process.poll() is not None for peer in peers.values())

            wait_until(poll, timeout=400, what="both guarded peers to reach max_steps", poll=1.0)
            exit_codes = {name: peer.wait(30) for name, peer in peers.items()}
            outage.end()
            wait_until(
                lambda: requests.get(f"{api}/checkpoints", timeout=10).json(),
                60,
                "a checkpoint uploaded by the monitor",
            )
            yield {
                "exit_codes": exit_codes,
                "peers": peers,
                "monitor": monitor,
                "api": api,
                "token": token,
                "web_url": web.url,
                "seen_by_member": seen_by_member,
                "outsider_reads": outsider_reads,
                "outsider_key": outsider_key,
                "join_url": config["authorization_url"],
                "outage": outage,
            }
        finally:
            outage.end()
            for process in [*peers.values(), monitor]:
                process.stop()
            for dht in (member, outsider):
                if dht is not None:
                    dht.shutdown()


def test_peers_configured_and_admitted_by_the_web_app_train_together(guarded):
    assert guarded["exit_codes"] == {"A": 0, "B": 0}
    for peer in guarded["peers"].values():
        assert peer.averaging_group_sizes(), "a guarded peer never averaged with the other"


def test_the_monitors_metrics_arrive_on_the_dashboard_api(guarded):
    rows = requests.get(f"{guarded['api']}/metrics", timeout=10).json()
    steps = [row["step"] for row in rows]
    assert steps == sorted(steps) and len(steps) >= 3 and max(steps) >= STEPS - 1
    assert max(row["alive_peers"] for row in rows) == 2
    losses = [row["loss"] for row in rows if row["loss"] is not None]
    assert losses[-1] < losses[0]


def test_the_dashboard_lists_both_peers_and_the_name_a_chose(guarded):
    contributors = requests.get(f"{guarded['api']}/contributors", timeout=10).json()["contributors"]
    assert sorted(c["name"] or "" for c in contributors) == ["", A_NAME]
    assert all(c["rounds"] >= 1 and c["samples"] >= c["rounds"] for c in contributors)
    page = requests.get(guarded["api"].replace("/api/", "/"), timeout=10).text  # the experiment's page
    assert "<td>peer &lt;A&gt; &#34;one&#34;</td>" in page and A_NAME not in page


def test_a_checkpoint_the_monitor_uploaded_downloads_intact(guarded):
    uploaded = requests.get(f"{guarded['api']}/checkpoints", timeout=10).json()
    archive = requests.get(
        f"{guarded['web_url']}{uploaded[-1]['url']}",
        headers={"Authorization": f"Bearer {guarded['token']}"},
        timeout=30,
    )
    assert archive.status_code == 200
    assert hashlib.sha256(archive.content).hexdigest() == uploaded[-1]["sha256"]


def test_a_member_with_a_token_reads_both_peers_records(guarded):
    assert max(len(records) for records in guarded["seen_by_member"]) == 2


def test_an_outsider_without_a_token_can_neither_read_nor_write(guarded):
    assert guarded["outsider_reads"] == [None], "the outsider read records while both peers were publishing"
    assert not any(guarded["outsider_key"] in records for records in guarded["seen_by_member"])


def test_tokens_are_refreshed_before_they_expire(guarded):
    processes = {**guarded["peers"], "M": guarded["monitor"]}
    for name, process in processes.items():
        expiries = [token["valid_until"] for token in process.events("access_token")]
        assert len(expiries) >= 2, f"{name} got no token beyond its first: {expiries}"
        assert expiries == sorted(set(expiries)), f"{name}'s tokens did not each last longer: {expiries}"


def test_a_wrong_experiment_token_stops_the_peer_with_one_line(guarded, tmp_path):
    peer = PeerProcess(
        ["--authorization_url", guarded["join_url"], "--web_token", "not-the-token"], tmp_path / "intruder.log"
    )
    try:
        assert peer.wait(timeout=120) == 2
    finally:
        peer.stop()
    last = peer.log().strip().splitlines()[-1]
    assert last.startswith("run_trainer.py: error: --authorization_url:") and "(403)" in last


def test_peers_keep_stepping_while_the_web_app_is_frozen(guarded):
    outage = guarded["outage"]
    assert outage.steps_at_end is not None, "the run ended before the outage did: lower from_step or raise STEPS"
    assert outage.steps_at_end > outage.steps_at_start, (
        f"no global step during the {OUTAGE} s web-app outage (steps {outage.steps_at_start})"
    )
    for name, peer in guarded["peers"].items():
        assert len(peer.events("access_refresh_failed")) == 1, f"{name} did not see the outage once"
