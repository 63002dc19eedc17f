"""Stopping a long-running process cleanly: the first SIGINT/SIGTERM asks it to finish, a watchdog makes sure."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import threading

logger = logging.getLogger(__name__)

SHUTDOWN_DEADLINE = 25.0  # seconds between the first SIGINT/SIGTERM and a forced exit


def install_stop_handlers(stop: threading.Event) -> None:
    """First SIGINT/SIGTERM: finish the current step and shut down cleanly; a second one interrupts at once.

    A watchdog forces the exit if the clean shutdown takes longer than SHUTDOWN_DEADLINE seconds.
    """

    def force_exit() -> None:
        logger.warning("Clean shutdown took over %.0f s: exiting now", SHUTDOWN_DEADLINE)
        for child in mp.active_children():
            child.kill()
        os._exit(0)

    owner = os.getpid()

    def on_signal(signum, frame) -> None:
        if os.getpid() != owner:  # a forked hivemind child (DHT, averager): behave as if we never touched signals
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if stop.is_set():
            raise KeyboardInterrupt
        logger.info("Received %s: finishing the current step, then shutting down", signal.Signals(signum).name)
        stop.set()
        watchdog = threading.Timer(SHUTDOWN_DEADLINE, force_exit)
        watchdog.daemon = True
        watchdog.start()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
