"""A newcomer whose download of the state outlasts several epochs still joins, and its old state never enters the
swarm, where the machine allows network namespaces (root).

Two trainers in their own namespaces on bench.procs' hub, every link shaped to LINK_MBIT. A trains alone; B joins
once A has made some epochs. B's download (parameters and Lamb's moments) takes several of A's epochs, so the state it
gets is epochs old when it arrives: plain hivemind loads it again at the next step, and again, and B never trains
(docs/RELIABILITY.md). Here B takes the collaboration's epoch and catches up: its rounds have weight 0 until a
parameter round gives it A's parameters, and only then does it add its own gradients (in the low-communication mode
its pseudo-gradients from a state a few rounds old count before, weighted down). Its Lamb statistics stay those
of the state it downloaded (parameter rounds carry parameters only), so it drifts from A more than a full member
would until they converge, and each parameter round evens that out: the test does not compare the final models.
"""

from __future__ import annotations

import signal
import time

import pytest

from collab.averagers import MAX_CONTRIBUTING_LAG
from tests.integration.sites import hub_or_skip, peer_at
from trainer.local import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.scenario, pytest.mark.timeout(300)]

LINK_MBIT = 4.0  # the state, about 6 MB in fp16, takes over 12 s: several of A's epochs
JOIN_S = 60
A_EPOCHS_FIRST = 1  # epochs A makes alone before B starts: a swarm with progress
CATCH_UP_S = 150  # from B's start to its caught_up event: start-up, download, the next parameter round
# Epochs of 2-3 s while A trains alone; once both train, a gradient round over the link (2 MB each way, about 4.5 s)
# and matchmaking set their pace. The state (6 MB, about 14 s) takes several epochs to download.
SETTINGS = [
    *("--target_batch_size", "128", "--matchmaking_time", "2", "--bandwidth", str(LINK_MBIT)),
    *("--warmup_steps", "0"),
]


@pytest.fixture
def two_sites():
    with hub_or_skip(2, LINK_MBIT, prefix="catchup", subnet="10.79.0") as network:
        yield network


def rounds(peer, kind: str) -> list[dict]:
    return [record for record in peer.events("averaged") if record["kind"] == kind]


def a_then_b_until_b_contributes(sites, folder, flags: list[str], kind: str):
    """A trains alone behind ``sites``' first link, B joins it behind the second once A has made some epochs; both
    stop (SIGTERM) once B, caught up, has added its own values to a round of ``kind``. Returns A, B and B's
    ``caught_up`` event; both must have exited with 0."""
    a_site, b_site = sites.peers
    peers = [peer_at(a_site, flags, folder, "A")]
    try:
        join = peers[0].join_flags(timeout=JOIN_S)
        wait_until(lambda: peers[0].latest_epoch() >= A_EPOCHS_FIRST, 120, f"A to reach epoch {A_EPOCHS_FIRST}")
        b = peer_at(b_site, [*flags, *join], folder, "B")
        peers.append(b)
        caught_up = b.wait_for_event("caught_up", CATCH_UP_S)
        wait_until(
            lambda: any(r["time"] > caught_up["time"] and r["weight"] > 0 for r in rounds(b, kind)),
            60,
            f"B to add its own {kind} to a round",
        )
        for p in peers:
            p.process.send_signal(signal.SIGTERM)
        codes = [p.wait(timeout=60) for p in peers]
    finally:
        for p in peers:
            p.stop()
    assert codes == [0, 0]
    return peers[0], b, caught_up


def test_a_newcomer_slower_to_download_than_an_epoch_catches_up_without_harming_the_swarm(
    two_sites, tmp_path, sample_data
):
    flags = ["--experiment_prefix", f"catchup{int(time.time())}", *SETTINGS]
    a, b, caught_up = a_then_b_until_b_contributes(two_sites, tmp_path, flags, "gradients")

    # the precondition: the state B downloaded was epochs old when it arrived
    loaded, catching_up = b.events("state_loaded")[0], b.events("catching_up")[0]
    assert catching_up["global_epoch"] - catching_up["epoch"] >= 2, catching_up
    assert b.events("started")[0]["epoch"] == catching_up["global_epoch"]
    assert len(b.events("state_loaded")) == 1, "B loaded the state again instead of catching up"
    # B averaged nothing before it held the swarm's state, and added nothing of its own until it caught up
    b_rounds = rounds(b, "gradients") + rounds(b, "parameters")
    assert min(r["time"] for r in b_rounds) > loaded["time"]
    assert all(r["weight"] == 0 for r in b_rounds if r["time"] < caught_up["time"])
    assert not any(r["published"] for r in b.events("epoch") if r["time"] < caught_up["time"])
    # the parameter rounds that made B whole (weight 0: one complete round, or partial ones whose values together
    # cover the model; their events may come after caught_up, once B's replies to A are counted) moved B to A's
    # parameters and A by no more than fp16 rounding (with B's weight at 1 they would have moved A toward B's old ones)
    catch_up_rounds = [
        r
        for r in rounds(b, "parameters")
        if r["group_size"] >= 2 and r["weight"] == 0 and r["values_kept_local"] < r["values"]
    ]
    assert catch_up_rounds, rounds(b, "parameters")
    taken = sum(r["values"] - r["values_kept_local"] for r in catch_up_rounds)
    assert taken >= catch_up_rounds[0]["values"], catch_up_rounds
    for b_round in catch_up_rounds:
        a_same_round = min(rounds(a, "parameters"), key=lambda r: abs(r["time"] - b_round["time"]))
        assert a_same_round["group_size"] == 2, (a_same_round, b_round)
        assert a_same_round["update_norm"] < 0.01 * b_round["update_norm"], (a_same_round, b_round)
    assert not a.tracebacks_from_our_code() and not b.tracebacks_from_our_code()


# The low-communication mode: parameter rounds come every 1000 rounds here, so only a repair round it asks for
# (collab/repairs.py) can make B whole within the bound. Rounds of 2 x 64 samples, a few seconds each; B's state
# (anchor, outer momentum, Lamb's moments: about 8 MB) takes several of them to download.
LOWCOMM_SETTINGS = [
    *("--local_steps", "2", "--target_batch_size", "64", "--pseudo_grad_compression", "8bit"),
    *("--average_state_every", "1000", "--matchmaking_time", "2", "--bandwidth", str(LINK_MBIT)),
    *("--warmup_steps", "0"),
]


def test_a_low_communication_newcomer_asks_for_the_parameter_round_that_makes_it_whole(
    two_sites, tmp_path, sample_data
):
    flags = ["--experiment_prefix", f"repair{int(time.time())}", *LOWCOMM_SETTINGS]
    a, b, caught_up = a_then_b_until_b_contributes(two_sites, tmp_path, flags, "pseudo-gradients")

    catching_up, requests = b.events("catching_up")[0], b.events("repair_requested")
    # the state B downloaded: anchor, outer momentum and Lamb's two moments, 4 values a parameter in fp32
    assert b.events("state_loaded")[0]["bytes"] == 16 * b.events("averaged")[0]["values"]
    assert catching_up["global_epoch"] - catching_up["epoch"] >= 2, catching_up
    # asked at its first step with the swarm's progress read again, for the next even epoch or the one after
    assert requests and requests[0]["global_epoch"] - catching_up["global_epoch"] <= 1, (catching_up, requests)
    assert requests[0]["epoch"] - requests[0]["global_epoch"] in (1, 2, 3), requests
    # made whole at the start of the epoch it asked for (its event comes at its next step: that epoch or the next)
    assert requests[-1]["epoch"] <= caught_up["epoch"] <= requests[-1]["epoch"] + 1, (requests, caught_up)
    assert len(requests) <= 2, requests  # one request, or one renewed after a round that formed no group
    # A ran that parameter round with B, though its regular ones come every 1000 epochs
    assert any(r["group_size"] == 2 for r in rounds(a, "parameters")), rounds(a, "parameters")
    # until then its parameters stay out; its pseudo-gradients from the state it took count, weighted down by how far
    # behind that state was, where that is within MAX_CONTRIBUTING_LAG (collab.averagers.catching_up_weight)
    assert all(r["weight"] == 0 for r in rounds(b, "parameters") if r["time"] < caught_up["time"])
    lag = catching_up["global_epoch"] - catching_up["epoch"]
    early = [r for r in rounds(b, "pseudo-gradients") if r["time"] < caught_up["time"] and r["group_size"] == 2]
    assert all((r["weight"] > 0) == (lag <= MAX_CONTRIBUTING_LAG) for r in early), (lag, early)
    assert not any(r["published"] for r in b.events("epoch") if r["time"] < caught_up["time"])
    assert not a.tracebacks_from_our_code() and not b.tracebacks_from_our_code()
