"""A finished program exits even when a background thread it left behind still waits (collab.entry.exit_by_then)."""

import subprocess
import sys
import textwrap
import time

from tests.conftest import ROOT

PROGRAM = textwrap.dedent(
    """
    import sys, threading, time
    from dataclasses import dataclass
    import collab.entry
    from collab.entry import run_program

    @dataclass
    class Nothing:
        pass

    def run(nothing, stop):
        # as a background averaging round left behind: a non-daemon thread that Python's exit would wait for
        threading.Thread(target=time.sleep, args=(float(sys.argv[1]),), name="left-behind").start()

    collab.entry.LEAVE_GRACE_S = 1.0
    sys.exit(run_program("probe", Nothing, run, argv=[]))
    """
)


def run_leaving_a_thread(seconds: float) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", PROGRAM, str(seconds)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    return result, time.monotonic() - started


def test_a_thread_left_waiting_does_not_hold_the_exit_past_the_grace():
    quick, quick_seconds = run_leaving_a_thread(0.1)
    assert quick.returncode == 0, quick.stderr[-2000:]
    assert "Exiting without waiting" not in quick.stderr
    stuck, stuck_seconds = run_leaving_a_thread(90.0)
    assert stuck.returncode == 0, stuck.stderr[-2000:]
    assert "Exiting without waiting longer for background threads" in stuck.stderr
    assert stuck_seconds < quick_seconds + 15, (stuck_seconds, quick_seconds)  # not the thread's 90 s
