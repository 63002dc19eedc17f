"""A peer's shutdown tells the truth: when SIGTERM's clean shutdown runs out of time before the final model is saved,
the watchdog's forced exit says so in the exit code and in the ``shutdown`` event (docs/EVENTS.md).

A normal SIGTERM, which saves the model and exits 0, is test_collaboration.py's
``test_sigterm_and_sigint_shut_down_cleanly_and_save_the_model``.
"""

from __future__ import annotations

import signal
import time

from collab.signals import EXIT_NOT_SAVED
from trainer.local import PeerProcess, wait_until

SAVE_PAUSE = ["--faults", "pause_model_save@1=600"]  # tests/faulty_peer.py: the final save waits 10 minutes
DEADLINE = 3.0  # --shutdown_timeout: well inside the 10 s a volunteer under docker stop has
EXIT_BOUND = 60.0  # seconds past the deadline for the forced exit on a loaded machine
TEARDOWN_PAUSE = ["--faults", "pause_teardown@1=600"]  # hivemind's shutdown waits 10 minutes first
TEARDOWN_DEADLINE = 10.0  # --shutdown_timeout: the step in progress and the save of a tiny model, with room


def stopped_by_sigterm(tmp_path, faults: list[str], prefix: str, deadline: float) -> tuple[PeerProcess, int, float]:
    """A lone faulty peer (tests/faulty_peer.py) with ``--shutdown_timeout deadline``, sent SIGTERM once it trains:
    the peer, its exit code and the seconds from the signal to its exit. Its --output_dir is ``tmp_path / "out"``."""
    peer = PeerProcess(
        [*faults, "--experiment_prefix", f"{prefix}{int(time.time())}", "--target_batch_size", "100000"]
        + ["--shutdown_timeout", str(deadline), "--output_dir", str(tmp_path / "out")],
        tmp_path / "peer.log",
        script="tests/faulty_peer.py",
    )
    try:
        wait_until(lambda: peer.events("started") or peer.process.poll() is not None, 120, "the peer to start")
        assert peer.process.poll() is None, f"the peer exited before training; see {peer.log_path}"
        peer.process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        code = peer.wait(timeout=deadline + EXIT_BOUND)
        return peer, code, time.monotonic() - signalled
    finally:
        peer.stop()


def test_a_peer_whose_final_save_cannot_finish_in_time_exits_non_zero_and_says_it_did_not_save(tmp_path, sample_data):
    out = tmp_path / "out"
    peer, code, waited = stopped_by_sigterm(tmp_path, SAVE_PAUSE, "unsaved", DEADLINE)
    assert code == EXIT_NOT_SAVED
    assert waited >= DEADLINE, "the forced exit came before the shutdown deadline"
    assert f"shutdown deadline {DEADLINE:.0f} s" in peer.log(), "the start-up line does not give the deadline used"
    shutdown = peer.events("shutdown")
    assert len(shutdown) == 1 and shutdown[0]["saved"] is False and shutdown[0]["forced"] is True
    assert shutdown[0]["folder"] == str(out) and shutdown[0]["epoch"] is None
    assert not (out / "model.safetensors").exists()


def test_a_teardown_cut_by_the_watchdog_after_the_save_exits_0_and_says_the_model_was_saved(tmp_path, sample_data):
    """The model is saved before hivemind's and the DHT's shutdown (the goodbye to the swarm): a last step that ran
    into the deadline, or a slow DHT, costs that teardown, not the volunteer's model. Here the teardown hangs."""
    out = tmp_path / "out"
    peer, code, waited = stopped_by_sigterm(tmp_path, TEARDOWN_PAUSE, "teardown", TEARDOWN_DEADLINE)
    assert [record["fault"] for record in peer.events("fault_injected")] == ["pause_teardown"]
    assert code == 0, f"exit {code}; see {peer.log_path}"
    assert waited >= TEARDOWN_DEADLINE, "the teardown's pause did not last to the forced exit"
    (shutdown,) = peer.events("shutdown")
    assert (shutdown["saved"], shutdown["forced"], shutdown["epoch"], shutdown["folder"]) == (True, True, 0, str(out))
    assert (out / "model.safetensors").exists()
