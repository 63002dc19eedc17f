"""A groupmate that sends inf in every averaging round poisons nobody: the honest peers refuse its values, average
among themselves, stay finite and can agree again.

Honest A and B and liar C (tests/liar_peer.py: every part C sends into a gradient or parameter round is inf) train
together until A or B has refused C's values in a gradient round and in a parameter round. C then leaves, and A and
B are compared after a complete parameter round of the two at learning rate 0, found in their events. While C takes
part they need not agree: C's own finite values still enter the part of each round that C reduces (the limit
collab/averagers.py states), and C, refused by the others, drifts. With hivemind's plain averagers this test fails:
A's and B's Lamb steps turn the inf gradients into NaN parameters and their callbacks roll back.

A scenario (about 55 s on two cores: make scenarios). make test's fast tests of the same refusal run real averagers
in one process: tests/unit/test_averagers.py (a liar's inf dropped in both directions of a round, and a plain
hivemind averager's inf refused by ours).
"""

from __future__ import annotations

import signal
import time

import pytest

from tests.integration.agreement import assert_finite, assert_parameters_agree, evened_out, saved_parameters
from trainer.local import LocalProcess, PeerProcess, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.scenario, pytest.mark.timeout(600)]

# The learning rate decays to 0 at LR_ZERO_EPOCH (--total_steps); A and B are stopped once both have averaged their
# parameters together after it and after C left (a round every 2nd epoch), so nothing moves them apart again.
LR_ZERO_EPOCH = 5
# Epochs last 2-3 s: matchmaking_time 1 keeps them several matchmaking times long, as the trainer asks.
SETTINGS = [
    *("--target_batch_size", "128", "--matchmaking_time", "1", "--averaging_timeout", "15"),
    *("--total_steps", str(LR_ZERO_EPOCH)),
]


def refused_in_both_kinds(peers: list[LocalProcess]) -> bool:
    """Whether one of ``peers`` refused a groupmate's values in a gradient round, and one in a parameter round."""
    refused = {record["kind"] for peer in peers for record in peer.events("refused") if record["groupmates"] >= 1}
    return refused == {"gradients", "parameters"}


def rolled_back(peer: LocalProcess) -> bool:
    return bool(peer.events("rollback"))


def test_honest_peers_refuse_a_groupmates_inf_and_still_agree(tmp_path, sample_data):
    common = ["--experiment_prefix", f"liar{int(time.time())}", *SETTINGS]
    a = PeerProcess([*common, "--output_dir", str(tmp_path / "A")], tmp_path / "A.log")
    peers = [a]
    try:
        join = a.join_flags(120)
        b = PeerProcess([*common, *join, "--output_dir", str(tmp_path / "B")], tmp_path / "B.log")
        peers.append(b)
        c = LocalProcess(
            [*common, *join, "--output_dir", str(tmp_path / "C")], tmp_path / "C.log", script="tests/liar_peer.py"
        )
        peers.append(c)
        honest = [a, b]
        wait_until(
            lambda: any(map(rolled_back, honest)) or refused_in_both_kinds(honest),
            240,
            "A or B to refuse C's values in a gradient and in a parameter round",
        )
        assert not any(map(rolled_back, honest)), "non-finite values reached A's or B's step: it rolled back"
        liar_code = c.stop(timeout=60)
        c_left = time.time()
        wait_until(
            lambda: all(evened_out(peer, 2, LR_ZERO_EPOCH + 1, c_left) for peer in honest),
            240,
            "A and B to average their parameters together at learning rate 0 after C left",
        )
        for peer in honest:
            peer.process.send_signal(signal.SIGTERM)
        codes = [peer.wait(timeout=60) for peer in honest]
    finally:
        for peer in peers:
            peer.stop()
    assert (codes, liar_code) == ([0, 0], 0)

    for peer in honest:
        assert not rolled_back(peer), f"{peer.log_path.stem} rolled back: non-finite values reached its step"
    first, second = saved_parameters(tmp_path / "A"), saved_parameters(tmp_path / "B")
    assert_finite(first, "A")
    assert_parameters_agree(first, second, "A and B", " (C sent inf in every round)")
