"""Access tokens with real processes: a live run_web.py issues them, two trainers require them.

Peers started with --authorization_url train together and refresh their short-lived tokens; an outsider without
a token can neither read nor write the experiment's records; a peer with a wrong experiment token stops at once
with one line.
"""

from __future__ import annotations

import time

import hivemind
import pytest
import requests
from hivemind.utils import get_dht_time

from arguments import PeerArguments
from collab.dht import start_dht
from collab.schema import LocalMetrics, make_validators, metrics_key, read_metrics
from tests.web.live import running_web_server
from trainer.local import PeerProcess, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

ADMIN = "access-admin-token"
LIFETIME = 70  # seconds: peers refresh a minute before expiry, so about every 10 s here
STEPS = 10


@pytest.fixture(scope="module")
def guarded(tmp_path_factory, sample_data):
    out = tmp_path_factory.mktemp("access")
    with running_web_server(out, ADMIN, "--access_token_lifetime", str(LIFETIME)) as web:
        created = requests.post(
            f"{web.url}/api/experiments",
            json={"name": "guarded", "config": {}},
            headers={"Authorization": f"Bearer {ADMIN}"},
            timeout=30,
        )
        token = created.json()["token"]
        join_url = f"{web.url}/api/experiments/{created.json()['id']}/join"
        prefix = f"guarded{int(time.time())}"
        access = ["--authorization_url", join_url, "--web_token", token]
        common = [
            "--experiment_prefix",
            prefix,
            "--target_batch_size",
            "128",
            "--matchmaking_time",
            "2",
            "--max_steps",
            str(STEPS),
            *access,
        ]
        peers = {"A": PeerProcess([*common, "--output_dir", str(out / "A")], out / "A.log")}
        member = outsider = None
        try:
            join = peers["A"].join_flags(timeout=120)
            peers["B"] = PeerProcess([*common, *join, "--output_dir", str(out / "B")], out / "B.log")
            validators, _ = make_validators(prefix)
            member = start_dht(
                PeerArguments(
                    experiment_prefix=prefix, initial_peers=join[1:], authorization_url=join_url, web_token=token
                ),
                validators,
                client_mode=True,
            )
            outsider_validators, outsider_key = make_validators(
                prefix
            )  # a valid, signed record: only the token is missing
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
                if len(seen_by_member[-1]) == 2 and not outsider_reads:  # both peers alive and publishing
                    outsider_reads.append(outsider.get(metrics_key(prefix), latest=True))
                    outsider.store(metrics_key(prefix), forged.dict(), get_dht_time() + 60, subkey=outsider_key)
                return all(peer.process.poll() is not None for peer in peers.values())

            wait_until(poll, timeout=300, what="both guarded peers to reach max_steps", poll=1.0)
            yield {
                "exit_codes": {name: peer.wait(30) for name, peer in peers.items()},
                "peers": peers,
                "seen_by_member": seen_by_member,
                "outsider_reads": outsider_reads,
                "outsider_key": outsider_key,
                "web_log": web.log_path.read_text(),
                "join_url": join_url,
            }
        finally:
            for peer in peers.values():
                peer.stop()
            for dht in (member, outsider):
                if dht is not None:
                    dht.shutdown()


def test_peers_with_tokens_train_together(guarded):
    assert guarded["exit_codes"] == {"A": 0, "B": 0}
    for peer in guarded["peers"].values():
        assert peer.averaging_group_sizes(), "a guarded peer never averaged with the other"


def test_a_member_with_a_token_reads_both_peers_records(guarded):
    assert max(len(records) for records in guarded["seen_by_member"]) == 2


def test_an_outsider_without_a_token_can_neither_read_nor_write(guarded):
    assert guarded["outsider_reads"] == [None], "the outsider read records while both peers were publishing"
    assert not any(guarded["outsider_key"] in records for records in guarded["seen_by_member"])


def test_tokens_are_refreshed_before_they_expire(guarded):
    issued = guarded["web_log"].count("Issued an access token")
    assert issued >= 4, f"expected refreshes beyond the 2 first tokens, the web app issued {issued}"


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
