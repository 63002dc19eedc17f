"""A forced exit tells the truth (collab/signals.py): its exit code and ``shutdown`` event say whether the final state
was saved. Each case runs in a fresh interpreter, since a forced exit ends the process."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from collab.events import read_events
from collab.signals import EXIT_NOT_SAVED
from trainer.local import ROOT

FORCED_EXIT = """
from collab import events
from collab.signals import Shutdown

events.open_event_log({events!r})
shutdown = Shutdown()
{steps}
shutdown.force_exit()
"""


def forced_exit(tmp_path, steps: str) -> tuple[int, list[dict]]:
    """Exit code and shutdown events of a process that runs ``steps`` on a ``Shutdown``, then is forced out."""
    events = tmp_path / "events.jsonl"
    code = textwrap.dedent(FORCED_EXIT).format(events=str(events), steps=textwrap.dedent(steps))
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, timeout=120)
    return result.returncode, read_events(events, "shutdown")


def test_a_forced_exit_before_the_final_save_exits_non_zero_and_says_saved_false(tmp_path):
    code, shutdown = forced_exit(tmp_path, 'shutdown.expect_final_save(epoch=None, folder="out")')
    assert code == EXIT_NOT_SAVED != 0
    assert [(r["saved"], r["forced"], r["folder"], r["epoch"]) for r in shutdown] == [(False, True, "out", None)]


def test_a_forced_exit_after_the_final_save_exits_0_with_the_program_s_own_event(tmp_path):
    steps = """
    shutdown.expect_final_save(epoch=None, folder="out")
    shutdown.leave(saved=True, epoch=7, folder="out")
    """
    code, shutdown = forced_exit(tmp_path, steps)
    assert code == 0
    assert [(r["saved"], r.get("forced"), r["epoch"]) for r in shutdown] == [(True, None, 7)]


def test_a_forced_exit_in_the_teardown_after_the_save_exits_0_and_says_saved_and_forced(tmp_path):
    steps = """
    shutdown.expect_final_save(epoch=None, folder="out")
    shutdown.final_state_saved(epoch=7)
    """
    code, shutdown = forced_exit(tmp_path, steps)
    assert code == 0
    assert [(r["saved"], r["forced"], r["epoch"], r["folder"]) for r in shutdown] == [(True, True, 7, "out")]


def test_a_program_that_failed_before_its_save_and_then_hung_still_exits_non_zero_with_one_event(tmp_path):
    steps = """
    shutdown.expect_final_save(epoch=None, folder="out")
    shutdown.leave(saved=False, epoch=None, folder="out")
    """
    code, shutdown = forced_exit(tmp_path, steps)
    assert code == EXIT_NOT_SAVED
    assert [(r["saved"], r.get("forced")) for r in shutdown] == [(False, None)]


def test_a_program_with_no_final_save_exits_0_when_forced(tmp_path):
    code, shutdown = forced_exit(tmp_path, "pass")  # the monitor: its checkpoints are written as they come
    assert code == 0 and shutdown == []


SIGNALLED = """
import os, signal, threading, time
from collab import signals

stop = threading.Event()
signals.install_stop_handlers(stop)
signals.set_shutdown_deadline(30.0)
print(signals.seconds_left())
os.kill(os.getpid(), signal.SIGTERM)
stop.wait(10)
time.sleep(1.0)
print(signals.seconds_left())
"""


def test_the_seconds_left_before_the_forced_exit_count_from_the_first_stop_signal():
    result = subprocess.run([sys.executable, "-c", SIGNALLED], cwd=ROOT, capture_output=True, text=True, timeout=120)
    before, after = result.stdout.split()
    assert before == "None"  # no signal, no deadline: a peer that reached its max_steps waits its whole last round
    assert 27.0 < float(after) <= 29.0  # 30 s from the signal, a second or so later
