"""Stopping a long-running process cleanly: the first SIGINT/SIGTERM asks it to finish, a watchdog makes sure.

The watchdog forces the exit once the clean shutdown has taken longer than the deadline, which a program raises to
what its state needs (``set_shutdown_deadline``: ``collab.timeouts`` derives it from the model and the link). The
exit code then tells the truth: a program that saves its final state (``expect_final_save``) and has not finished
saving it exits ``EXIT_NOT_SAVED`` and its ``shutdown`` event says ``saved: false``; otherwise it exits 0.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import signal
import threading
import time

from collab import events
from collab.timeouts import SHUTDOWN_DEADLINE_FLOOR

logger = logging.getLogger(__name__)

EXIT_NOT_SAVED = 3  # a forced exit before the final state was saved (2 is bad input, 1 an error)
WATCHDOG_POLL = 0.2  # seconds between two looks of the watchdog at the deadline, which may change meanwhile


class Shutdown:
    """This process's shutdown: the deadline after the first signal, and whether a final save is still due.

    The ``shutdown`` event is written once: by the program as it leaves (``leave``) or by the forced exit."""

    def __init__(self, deadline: float = SHUTDOWN_DEADLINE_FLOOR):  # until the program knows its state's size
        self.deadline = deadline
        self.signalled: float | None = None  # time.monotonic() of the first stop signal
        self._lock = threading.Lock()
        self._fields: dict | None = None  # the shutdown event's fields in a program that saves a final state
        self._saved = False  # the final state is on disk: a forced exit from then on exits 0
        self._left = False

    def seconds_left(self) -> float | None:
        """Seconds until the forced exit; None before a stop signal (no deadline runs)."""
        if self.signalled is None:
            return None
        return self.signalled + self.deadline - time.monotonic()

    def expect_final_save(self, **fields) -> None:
        """From now on a forced exit means the final state was not saved; ``fields`` go into its shutdown event."""
        with self._lock:
            self._fields, self._saved = fields, False

    def final_state_saved(self, **fields) -> None:
        """The final state is on disk, before the program's teardown: a forced exit from now on exits 0, and its
        ``shutdown`` event says ``saved`` with ``fields`` added to ``expect_final_save``'s."""
        with self._lock:
            self._fields, self._saved = {**(self._fields or {}), **fields}, True

    def leave(self, saved: bool, **fields) -> None:
        """The program leaves: write its ``shutdown`` event (``saved`` and ``fields``) unless a forced exit did, and
        let a forced exit from now on exit 0 when ``saved`` (the final state is on disk)."""
        with self._lock:
            if self._left:
                return
            self._left = True
            if saved:
                self._saved = True
            events.emit("shutdown", saved=saved, **fields)

    def force_exit(self) -> None:
        """Exit now: kill the child processes, exit ``EXIT_NOT_SAVED`` if the final save is still due, else 0. Unless
        the program wrote its own, the ``shutdown`` event says ``forced`` and whether the final state was saved."""
        with self._lock:
            unsaved = self._fields is not None and not self._saved
            if self._fields is not None and not self._left:
                events.emit("shutdown", **{**self._fields, "saved": not unsaved, "forced": True})
            state = ""
            if self._fields is not None:
                state = ", without the final state saved" if unsaved else "; the final state was saved before"
            logger.warning("Clean shutdown took over %.0f s: exiting now%s", self.deadline, state)
            for child in mp.active_children():
                child.kill()
            os._exit(EXIT_NOT_SAVED if unsaved else 0)


_shutdown = Shutdown()  # one per process, as signal handlers are


def leave_the_process_group() -> None:
    """Move this process, and what it starts from now on, into a process group of its own: a signal to the group it
    was in (a terminal's Ctrl-C, ``kill -- -PGID``, torchrun stopping a rank) no longer reaches it. For helper
    processes that their parent stops itself, after its last round."""
    with contextlib.suppress(OSError):  # a group or session leader already
        os.setpgid(0, 0)


def set_shutdown_deadline(seconds: float) -> None:
    """How long the clean shutdown may take after the first signal (a signal already received counts from then)."""
    _shutdown.deadline = seconds


def seconds_left() -> float | None:
    """See ``Shutdown.seconds_left``."""
    return _shutdown.seconds_left()


def expect_final_save(**fields) -> None:
    """See ``Shutdown.expect_final_save``."""
    _shutdown.expect_final_save(**fields)


def final_state_saved(**fields) -> None:
    """See ``Shutdown.final_state_saved``."""
    _shutdown.final_state_saved(**fields)


def leave(saved: bool, **fields) -> None:
    """See ``Shutdown.leave``."""
    _shutdown.leave(saved, **fields)


def watch(shutdown: Shutdown) -> None:
    """The watchdog: force the exit once ``shutdown.deadline`` seconds have passed since the stop signal."""
    while shutdown.seconds_left() > 0:
        time.sleep(WATCHDOG_POLL)
    shutdown.force_exit()


def install_stop_handlers(stop: threading.Event) -> None:
    """First SIGINT/SIGTERM: finish the current step and shut down cleanly; a second one interrupts at once.

    A watchdog forces the exit if the clean shutdown takes longer than the deadline (``set_shutdown_deadline``).
    """
    owner = os.getpid()

    def on_signal(signum, frame) -> None:
        if os.getpid() != owner:  # a forked hivemind child (DHT, averager): behave as if we never touched signals
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if stop.is_set():
            raise KeyboardInterrupt
        logger.info(
            "Received %s: finishing the current step, then shutting down (at most %.0f s)",
            signal.Signals(signum).name,
            _shutdown.deadline,
        )
        events.emit("stop_requested", signal=signal.Signals(signum).name, deadline_s=_shutdown.deadline)
        stop.set()
        _shutdown.signalled = time.monotonic()
        threading.Thread(target=watch, args=(_shutdown,), name="shutdown-watchdog", daemon=True).start()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
