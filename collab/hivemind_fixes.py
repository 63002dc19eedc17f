"""Fixes for hivemind 1.1.12 bugs that hang a collaboration, applied when ``collab`` is imported.

Pending asyncio tasks collected by the garbage collector. hivemind's averager and DHT processes start each
command with ``task = asyncio.create_task(...)`` and drop the reference at the next command. asyncio keeps
only weak references to tasks, and hivemind's ``MPFuture`` registry is weak too, so a task that waits for an
answer from another process can form an unreachable cycle; the garbage collector then destroys it
("Task was destroyed but it is pending!" in the log) and the averaging round it belonged to hangs until
``averaging_timeout``, after which the peer falls out of sync. We give the event loops of hivemind's processes
a task factory that holds every task until it is done. The processes are forked from ours, so the patch applied
here is inherited by them.

Ctrl-C ignored by the trainer. ``DecentralizedAverager.run_in_background`` sets SIGINT to "ignore" in the
process that calls it, meaning the averager child it is about to fork, so after the optimizer is built the
trainer itself no longer stops on Ctrl-C. We let the child start with SIGINT ignored and give the caller its
handler back.
"""

from __future__ import annotations

import asyncio
import signal
import threading

import hivemind.averaging.averager
import hivemind.dht.dht
from hivemind.utils import asyncio as hivemind_asyncio

_running_tasks: set[asyncio.Task] = set()
_original_switch_to_uvloop = hivemind_asyncio.switch_to_uvloop


def _task_factory(loop: asyncio.AbstractEventLoop, coro, **kwargs) -> asyncio.Task:
    task = asyncio.Task(coro, loop=loop, **kwargs)
    _running_tasks.add(task)
    task.add_done_callback(_running_tasks.discard)
    return task


def switch_to_uvloop_keeping_tasks() -> asyncio.AbstractEventLoop:
    """hivemind's ``switch_to_uvloop``, with a loop that keeps a strong reference to each task until it ends."""
    loop = _original_switch_to_uvloop()
    loop.set_task_factory(_task_factory)
    return loop


_original_run_in_background = hivemind.averaging.averager.DecentralizedAverager.run_in_background


def run_in_background_keeping_sigint(self, *args, **kwargs):
    """Start the averager's process with SIGINT ignored there, and leave the caller's SIGINT handler as it was."""
    if threading.current_thread() is not threading.main_thread():
        return _original_run_in_background(self, *args, **kwargs)  # signal handlers live in the main thread only
    handler = signal.getsignal(signal.SIGINT)
    try:
        return _original_run_in_background(self, *args, **kwargs)
    finally:
        signal.signal(signal.SIGINT, handler)


def apply() -> None:
    for module in (hivemind.averaging.averager, hivemind.dht.dht):
        module.switch_to_uvloop = switch_to_uvloop_keeping_tasks
    hivemind.averaging.averager.DecentralizedAverager.run_in_background = run_in_background_keeping_sigint


apply()
