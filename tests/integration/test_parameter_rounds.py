"""Parameter rounds repair drift: a peer whose parameters moved away from the others' (what a missed gradient round
leaves behind) agrees with them again after the next parameter round (``--average_state_every``, default 2).

Peers apply the same averaged gradients, so nothing but a parameter round brings a drifted peer back: with parameter
rounds turned off (``--average_state_every 1000``) this test fails, A's LayerNorm weight stays DRIFT away from B's.

A scenario (about 40 s on two cores: make scenarios). make test's fast tests: two state averagers apart agree after
one round (tests/unit/test_state_download.py), and the rounds come every second epoch (tests/unit/test_lowcomm.py).
"""

from __future__ import annotations

import signal
import time

import pytest

from collab.lowcomm import SYNC_PARAMETER_ROUND_EVERY
from tests.faults import DRIFT
from tests.integration.agreement import assert_parameters_agree, evened_out, saved_parameters
from trainer.local import PeerProcess, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.scenario, pytest.mark.timeout(600)]

DRIFT_EPOCH = 3
# The learning rate decays to 0 at LR_ZERO_EPOCH (--total_steps), two parameter rounds after the drift, so that one
# failed round does not fail the test. The peers are stopped once both have averaged their parameters together in a
# complete round after it (their events say so), and from there on an update changes nothing.
LR_ZERO_EPOCH = DRIFT_EPOCH + 2 * SYNC_PARAMETER_ROUND_EVERY + 2
# Epochs last 2-3 s: matchmaking_time 1 keeps them several matchmaking times long, as the trainer asks.
SETTINGS = [
    *("--target_batch_size", "128", "--matchmaking_time", "1", "--averaging_timeout", "15"),
    *("--total_steps", str(LR_ZERO_EPOCH)),
]


def test_a_drifted_peer_agrees_again_after_the_next_parameter_round(tmp_path, sample_data):
    common = ["--experiment_prefix", f"drift{int(time.time())}", *SETTINGS]
    a = PeerProcess(
        ["--faults", f"drift_parameters@{DRIFT_EPOCH}", *common, "--output_dir", str(tmp_path / "A")],
        tmp_path / "A.log",
        script="tests/faulty_peer.py",
    )
    peers = [a]
    try:
        b = PeerProcess([*common, *a.join_flags(120), "--output_dir", str(tmp_path / "B")], tmp_path / "B.log")
        peers.append(b)
        wait_until(lambda: a.events("fault_injected"), 240, f"A's parameters to drift in epoch {DRIFT_EPOCH}")
        wait_until(
            lambda: all(evened_out(p, 2, LR_ZERO_EPOCH + 1) for p in peers),
            240,
            "both peers to average their parameters together, completely, at learning rate 0",
        )
        for peer in peers:
            peer.process.send_signal(signal.SIGTERM)
        codes = [peer.wait(timeout=60) for peer in peers]
    finally:
        for peer in peers:
            peer.stop()
    assert codes == [0, 0]

    (drifted,) = [fault["parameter"] for fault in a.events("fault_injected")]
    # fp16 averaging's rounding apart at most: far below DRIFT
    assert_parameters_agree(
        saved_parameters(tmp_path / "A"),
        saved_parameters(tmp_path / "B"),
        "A and B",
        f" (A drifted {drifted} by {DRIFT})",
    )
