"""collab.hivemind_fixes: each hivemind bug it works around, shown with plain hivemind and fixed with the patch."""

import asyncio
import contextlib
import gc
import time
import weakref

import hivemind
import pytest
import torch
from hivemind.averaging.averager import DecentralizedAverager
from hivemind.averaging.control import AveragingStage
from hivemind.utils import get_dht_time

from collab import hivemind_fixes
from collab.hivemind_fixes import _original_switch_to_uvloop, switch_to_uvloop_keeping_tasks
from trainer.local import wait_until


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


@contextlib.contextmanager
def plain_group_registration():
    """Averagers started inside use hivemind's own rpc_aggregate_part (their processes fork from this one)."""
    patched = DecentralizedAverager._register_allreduce_group, DecentralizedAverager.rpc_aggregate_part
    DecentralizedAverager._register_allreduce_group = hivemind_fixes._original_register_allreduce_group
    DecentralizedAverager.rpc_aggregate_part = hivemind_fixes._original_rpc_aggregate_part
    try:
        yield
    finally:
        DecentralizedAverager._register_allreduce_group, DecentralizedAverager.rpc_aggregate_part = patched


LATE_TRIGGER_SECONDS = 1.0  # the second peer starts its all-reduce this much later (the skew under test)


def average_with_a_late_groupmate() -> tuple[torch.Tensor, torch.Tensor]:
    """What hivemind.Optimizer does with delayed averaging: round 2 is matched while round 1 is still pending; after
    round 1, one peer triggers round 2 a second before the other. Returns both peers' tensors after round 2."""
    size = 1_000_000  # large enough for each peer to reduce a part, so each sends to the other
    dht1 = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    dht2 = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=dht1.get_visible_maddrs())
    options = dict(prefix="late", target_group_size=2, min_matchmaking_time=1.0, request_timeout=0.5, start=True)
    averagers = []
    try:
        averagers = [
            DecentralizedAverager([torch.zeros(size)], dht=dht1, next_chunk_timeout=6.0, **options),
            DecentralizedAverager([torch.full((size,), 2.0)], dht=dht2, next_chunk_timeout=6.0, **options),
        ]
        when = get_dht_time() + 1.5
        first = [a.step(scheduled_time=when, require_trigger=True, wait=False) for a in averagers]
        second = [a.step(scheduled_time=when + 1.5, require_trigger=True, wait=False) for a in averagers]
        wait_until(
            lambda: all(step.stage == AveragingStage.AWAITING_TRIGGER for step in first + second),
            timeout=60,
            what="both rounds to be matched",
            poll=0.1,
        )
        for step in first:
            step.allow_allreduce()
        for step in first:
            step.result(timeout=30)
        for averager, value in zip(averagers, (0.0, 2.0), strict=True):
            with averager.get_tensors() as (tensor,):
                tensor.fill_(value)
        second[0].allow_allreduce()
        time.sleep(LATE_TRIGGER_SECONDS)
        second[1].allow_allreduce()
        for step in second:
            step.result(timeout=30)
        results = []
        for averager in averagers:
            with averager.get_tensors() as (tensor,):
                results.append(tensor.clone())
        return tuple(results)
    finally:
        for averager in averagers:
            averager.shutdown()
        dht2.shutdown()
        dht1.shutdown()


@pytest.mark.timeout(180)
def test_plain_hivemind_leaves_half_of_the_tensor_unaveraged_when_a_groupmate_is_late():
    with plain_group_registration():
        first, second = average_with_a_late_groupmate()
    averaged = (first == 1.0) & (second == 1.0)
    unaveraged = (first == 0.0) & (second == 2.0)
    assert averaged.any() and unaveraged.any() and (averaged | unaveraged).all()


@pytest.mark.timeout(180)
def test_patched_averager_waits_for_a_late_groupmate_and_averages_everything():
    first, second = average_with_a_late_groupmate()
    assert torch.equal(first, torch.ones_like(first)) and torch.equal(second, torch.ones_like(second))
