"""collab.hivemind_fixes: a task waiting on a weakly-held future survives garbage collection and completes."""

import asyncio
import gc
import weakref

from collab.hivemind_fixes import _original_switch_to_uvloop, switch_to_uvloop_keeping_tasks


def run_task_waiting_on_weakly_held_future(make_loop) -> tuple[bool, str | None]:
    """hivemind's pattern: the task's only owner is a weak registry (MPFuture's) and a dropped local variable."""
    loop = make_loop()
    registry: dict[str, weakref.ref] = {}
    results: list[str] = []

    async def wait_for_answer():
        future = loop.create_future()
        registry["answer"] = weakref.ref(future)
        results.append(await future)

    async def main():
        asyncio.create_task(wait_for_answer())  # reference dropped, as in DecentralizedAverager._run_internal
        await asyncio.sleep(0.01)
        gc.collect()
        future = registry["answer"]()
        if future is not None:
            future.set_result("answered")
            await asyncio.sleep(0.01)

    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
    return registry["answer"]() is not None or bool(results), results[0] if results else None


def test_plain_hivemind_loop_loses_the_task():
    survived, answer = run_task_waiting_on_weakly_held_future(_original_switch_to_uvloop)
    assert (survived, answer) == (False, None)


def test_patched_loop_keeps_the_task_until_it_is_answered():
    survived, answer = run_task_waiting_on_weakly_held_future(switch_to_uvloop_keeping_tasks)
    assert (survived, answer) == (True, "answered")


def test_starting_an_averager_keeps_the_callers_sigint_handler():
    import signal

    import hivemind
    import torch

    calls = []
    previous = signal.signal(signal.SIGINT, lambda *_: calls.append("handled"))
    dht = hivemind.DHT(start=True)
    averager = None
    try:
        averager = hivemind.averaging.DecentralizedAverager([torch.zeros(2)], dht=dht, prefix="sigint", start=True)
        signal.raise_signal(signal.SIGINT)
        assert calls == ["handled"]
    finally:
        signal.signal(signal.SIGINT, previous)
        if averager is not None:
            averager.shutdown()
        dht.shutdown()
