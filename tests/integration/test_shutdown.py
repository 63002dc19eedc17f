"""A peer's shutdown tells the truth: when SIGTERM's clean shutdown runs out of time before the final model is saved,
the watchdog's forced exit says so in the exit code and in the ``shutdown`` event (docs/EVENTS.md).

A normal SIGTERM, which saves the model and exits 0, is test_collaboration.py's
``test_sigterm_and_sigint_shut_down_cleanly_and_save_the_model``.
"""

from __future__ import annotations

import signal
import time

from collab.signals import EXIT_NOT_SAVED
from collab.timeouts import SHUTDOWN_DEADLINE_FLOOR
from trainer.local import PeerProcess, wait_until

SAVE_PAUSE = ["--faults", "pause_model_save@1=600"]  # tests/faulty_peer.py: the final save waits 10 minutes
EXIT_BOUND = 60.0  # seconds past the tiny model's deadline (about 26 s) for the forced exit on a loaded machine


def test_a_peer_whose_final_save_cannot_finish_in_time_exits_non_zero_and_says_it_did_not_save(tmp_path, sample_data):
    out = tmp_path / "out"
    peer = PeerProcess(
        [*SAVE_PAUSE, "--experiment_prefix", f"unsaved{int(time.time())}", "--target_batch_size", "100000"]
        + ["--output_dir", str(out)],
        tmp_path / "peer.log",
        script="tests/faulty_peer.py",
    )
    try:
        wait_until(lambda: peer.events("started") or peer.process.poll() is not None, 120, "the peer to start")
        assert peer.process.poll() is None, f"the peer exited before training; see {peer.log_path}"
        peer.process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        code = peer.wait(timeout=SHUTDOWN_DEADLINE_FLOOR + EXIT_BOUND)
        waited = time.monotonic() - signalled
    finally:
        peer.stop()
    assert code == EXIT_NOT_SAVED
    assert waited >= SHUTDOWN_DEADLINE_FLOOR, "the forced exit came before the shutdown deadline"
    shutdown = peer.events("shutdown")
    assert len(shutdown) == 1 and shutdown[0]["saved"] is False and shutdown[0]["forced"] is True
    assert shutdown[0]["folder"] == str(out) and shutdown[0]["epoch"] is None
    assert not (out / "model.safetensors").exists()
