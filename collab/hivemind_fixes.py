"""Fixes for hivemind 1.1.12 bugs that hang a collaboration or let peers drift apart.

Importing this module changes nothing in hivemind. The fixes live in subclasses that hivemind's hooks build
(``FixedDecentralizedAverager``, the last base of ``collab.averagers``' averagers; ``FixedDHT``, built by
``collab.dht.start_dht``; ``SpacedProgressTracker``, from ``FiniteAveragingOptimizer._make_progress_tracker``). What
no hook reaches is ``ENTRY_POINT_PATCHES``, applied by a program's entry point (``apply_entry_point_patches``) after
checking hivemind's version.

Each fix, the rule it keeps (what hivemind does instead, what that cost, and the test that shows it: the section
"hivemind bugs we fixed" of docs/RELIABILITY.md):

- tasks are held until done: a task whose only owners are weak references was garbage-collected mid-round;
- a sender waits for its group's registration (up to the sender timeout) instead of being answered BAD_GROUP_ID,
  which left half of a round's tensors unaveraged;
- a sender's stream is read to its end before its handler closes it: p2pd's reset lost the last replies, refusals
  among them;
- leader lookups are spaced by a tenth of ``matchmaking_time``, not back to back;
- progress is published once per ``progress_report_period`` within an epoch, a new epoch at once, not every step;
  a progress record far ahead of the honest majority is ignored;
- the state-download declaration is stored when it changes or expires, not after every averaged part;
- helpers (the DHT with its p2pd, the averagers) end with their peer, run in a process group of their own, and leave
  the caller's Ctrl-C handler in place;
- 8-bit parts are read with numpy 2;
- rounds meet only rounds of their own epoch, and a round whose group formed without this peer is given up;
- the tracker's thread ends with no task pending;
- an averager shut down mid-round cancels the round instead of dying of an AttributeError;
- the averager's process rebuilds torch's thread pool before its threads encode parts (``rebuild_torch_thread_pool``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import signal
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import InvalidStateError
from dataclasses import dataclass
from typing import Any, AsyncIterator  # noqa: UP035 (hivemind recognises streaming handlers by typing.AsyncIterator)

import hivemind.averaging.averager
import hivemind.averaging.matchmaking
import hivemind.compression.quantization
import hivemind.dht.dht
import hivemind.optim.progress_tracker
import numpy as np
import torch
from hivemind.averaging.control import AveragingStage, StepControl
from hivemind.optim.progress_tracker import LocalTrainingProgress
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2
from hivemind.utils import ValueWithExpiration, get_dht_time
from hivemind.utils import asyncio as hivemind_asyncio
from hivemind.utils.asyncio import achain, anext, as_aiter

from arguments import MetricsArguments
from collab import events, signals
from collab.errors import HivemindVersionError
from collab.matchmaking import EpochMatchmaking, round_gather
from collab.schema import honest_step

logger = logging.getLogger(__name__)

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


_original_rpc_aggregate_part = hivemind.averaging.averager.DecentralizedAverager.rpc_aggregate_part
_original_register_allreduce_group = hivemind.averaging.averager.DecentralizedAverager._register_allreduce_group
_GROUPS_CHANGED = "_collab_groups_changed"  # an asyncio.Event on the averager, set when a group registers


@contextlib.contextmanager
def register_allreduce_group_waking_senders(self, group_info):
    """hivemind's registration, which also wakes the requests waiting for this group (see rpc_aggregate_part)."""
    with _original_register_allreduce_group(self, group_info):
        event = self.__dict__.pop(_GROUPS_CHANGED, None)
        if event is not None:
            event.set()
        yield


GROUP_CHECK_PERIOD = 0.5  # seconds between two looks at whether a part's unregistered group may still be this peer's


def group_wait_seconds(averager) -> float:
    """The longest a groupmate's part waits for its group to register here: the sender timeout, as hivemind's
    runner waits for a sender's next part."""
    return averager.allreduce_kwargs.get("sender_timeout") or averager.matchmaking_kwargs["request_timeout"]


async def wait_for_group(averager, group_id: bytes, timeout: float) -> None:
    """Return once ``group_id`` is registered in ``averager``, once it cannot become one of its groups
    (``EpochMatchmaking.may_hold_group``, looked at every GROUP_CHECK_PERIOD), or after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while group_id not in averager._running_groups and (remaining := deadline - time.monotonic()) > 0:
        may_hold_group = getattr(getattr(averager, "_matchmaking", None), "may_hold_group", None)
        if may_hold_group is not None and not may_hold_group(group_id):
            return
        event = averager.__dict__.setdefault(_GROUPS_CHANGED, asyncio.Event())
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(event.wait(), min(remaining, GROUP_CHECK_PERIOD))


_STREAM_END = object()


async def _next_or_end(iterator):
    try:
        return await iterator.__anext__()
    except StopAsyncIteration:
        return _STREAM_END


class LingeringRequests:
    """A handler's request stream whose reads outlive their reader, so that what the sender still writes after the
    answer is done can be read to its end (``drain``).

    A handler that returns while its sender still writes can lose its last replies: p2pd resets a stream that
    receives data after its handler closed it, and the reset discards what the sender's daemon had not yet passed on
    (docs/benchmarks/2026-12-07-amd-epyc-2core-lost-refusals.md). hivemind's runner cancels its reads (a part's
    timeout, a reducer done with a sender); here the read goes on, for ``drain`` to finish."""

    def __init__(self, stream: AsyncIterator):
        self._iterator = stream.__aiter__()
        self._pending: asyncio.Future | None = None
        self._ended = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self._ended:
            raise StopAsyncIteration
        if self._pending is None:
            self._pending = asyncio.ensure_future(_next_or_end(self._iterator))
        pending = self._pending
        try:
            message = await asyncio.shield(pending)
        except asyncio.CancelledError:
            if pending.cancelled():  # the read itself, not only its reader: nothing more comes
                self._pending, self._ended = None, True
            raise
        except BaseException:
            self._pending, self._ended = None, True
            raise
        self._pending = None
        if message is _STREAM_END:
            self._ended = True
            raise StopAsyncIteration
        return message

    async def drain(self, timeout: float) -> None:
        """Read and drop what the sender still writes, until its stream ends or for ``timeout`` seconds."""

        async def read_to_end():
            async for _ in self:
                pass

        try:
            await asyncio.wait_for(read_to_end(), timeout)
        except Exception:  # asyncio.TimeoutError too: the sender is slow, or its stream broke; it closes either way
            pass
        finally:
            self.close()

    def close(self) -> None:
        """Read no more: a read still waiting for the sender is cancelled, not left pending."""
        if self._pending is not None:
            self._pending.cancel()
        self._pending, self._ended = None, True


async def answered_in_full(
    answer: Callable[[AsyncIterator], AsyncIterator], stream: AsyncIterator, linger: float
) -> AsyncIterator:
    """``answer(requests)``'s replies, then the sender's stream read to its end, for ``linger`` seconds at most, so
    that the stream closes only once the last reply can reach the sender (``LingeringRequests``)."""
    requests = LingeringRequests(stream)
    try:
        async for message in answer(requests):
            yield message
        await requests.drain(linger)
    finally:  # also when the stream was closed under the answer
        requests.close()


async def rpc_aggregate_part_waiting_for_group(
    self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
) -> AsyncIterator[averaging_pb2.AveragingData]:
    """hivemind's ``rpc_aggregate_part``, except that

    - a part for a group this peer has not registered yet waits for that group (``wait_for_group``: up to the sender
      timeout, while the group may still be this peer's) instead of waiting for whichever group registers next and
      then being refused with BAD_GROUP_ID;
    - it waits for the group's runner through a shield: hivemind's bare ``await`` cancelled the group's future when
      the sender gave up, and this peer's own round then failed ("Unable to run All-Reduce: invalid state");
    - once answered, the sender's stream is read to its end before it closes (``answered_in_full``, for as long as a
      sender may take between parts)."""

    async def answer(requests: AsyncIterator[averaging_pb2.AveragingData]):
        request = await anext(requests)
        await wait_for_group(self, request.group_id, group_wait_seconds(self))
        future = self._running_groups.get(request.group_id)
        if future is None:
            yield averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)
            return
        group = await asyncio.shield(future)
        async for message in group.rpc_aggregate_part(achain(as_aiter(request), requests), context):
            yield message

    async for message in answered_in_full(answer, stream, group_wait_seconds(self)):
        yield message


LEADER_LOOKUPS_PER_MATCHMAKING = 10
_original_update_queue_periodically = hivemind.averaging.matchmaking.PotentialLeaders._update_queue_periodically


class SpacedLookups:
    """A ``GroupKeyManager`` whose ``get_averagers`` starts at least ``period`` seconds after its previous call."""

    def __init__(self, key_manager, period: float):
        self._key_manager, self._period, self._last_lookup = key_manager, period, -math.inf

    def __getattr__(self, name):
        return getattr(self._key_manager, name)

    async def get_averagers(self, *args, **kwargs):
        await asyncio.sleep(max(0.0, self._last_lookup + self._period - time.monotonic()))
        self._last_lookup = time.monotonic()
        return await self._key_manager.get_averagers(*args, **kwargs)


async def update_queue_with_spaced_lookups(self, key_manager) -> None:
    """hivemind's ``PotentialLeaders._update_queue_periodically``, with its DHT lookups spaced by a tenth of
    ``min_matchmaking_time`` instead of back to back."""
    period = self.min_matchmaking_time / LEADER_LOOKUPS_PER_MATCHMAKING
    await _original_update_queue_periodically(self, SpacedLookups(key_manager, period))


# seconds between two publications of progress within an epoch when a caller passes none (the synchronous mode's):
# about an epoch of 256 samples on the CPU peers of the tests and the bench
PROGRESS_REPORT_PERIOD = 2.0
ProgressTracker = hivemind.optim.progress_tracker.ProgressTracker
_original_tracker_init = ProgressTracker.__init__
_original_report_local_progress = ProgressTracker.report_local_progress
_original_tracker_shutdown = ProgressTracker.shutdown
_original_progress_reporter = ProgressTracker._progress_reporter


def tracker_init_with_report_period(self, *args, progress_report_period: float = PROGRESS_REPORT_PERIOD, **kwargs):
    """hivemind's ``ProgressTracker.__init__``, taking ``progress_report_period`` (before its thread starts)."""
    self.progress_report_period, self.report_new_epoch = progress_report_period, threading.Event()
    # set while this peer catches up (collab.averagers): its samples count for nothing, yet it publishes its progress
    self.counts_no_samples = False
    _original_tracker_init(self, *args, **kwargs)


def report_local_progress_waking_on_new_epoch(self, local_epoch: int, samples_accumulated: int, *args, **kwargs):
    """hivemind's ``report_local_progress`` (0 samples while ``counts_no_samples``); a new local epoch also ends the
    reporter's wait."""
    new_epoch = local_epoch != self.local_progress.epoch
    samples_accumulated = 0 if self.counts_no_samples else samples_accumulated
    _original_report_local_progress(self, local_epoch, samples_accumulated, *args, **kwargs)
    if new_epoch:
        self.report_new_epoch.set()


def tracker_shutdown_waking_reporter(self, timeout: float | None = None):
    self.report_new_epoch.set()
    _original_tracker_shutdown(self, timeout)


async def progress_reporter_spaced(self) -> None:
    """hivemind's ``ProgressTracker._progress_reporter``, publishing at most once per ``progress_report_period``
    within a global epoch (a new epoch at once), instead of after every step."""
    loop = asyncio.get_event_loop()
    last_report_time = last_report_epoch = last_store_time = -math.inf
    last_published_epoch = store_task = None
    try:
        while not self.shutdown_triggered.is_set():
            wait_timeout = max(0.0, last_report_time - get_dht_time() + self.metadata_expiration / 2)
            await loop.run_in_executor(None, self.should_report_progress.wait, wait_timeout)
            pause = last_store_time + self.progress_report_period - get_dht_time()
            same_epoch = self.local_progress.epoch == last_published_epoch
            if self.should_report_progress.is_set() and same_epoch and pause > 0:
                await loop.run_in_executor(None, self.report_new_epoch.wait, pause)
            self.report_new_epoch.clear()
            self.should_report_progress.clear()

            local_progress = self.local_progress
            last_report_time = get_dht_time()
            if local_progress.samples_accumulated > 0 or self.counts_no_samples:
                last_report_epoch = self.global_epoch
            # as hivemind: only peers that are in sync and active; a peer catching up counts no samples, yet the
            # others must see it, or they average with no one and it never gets the parameter round it waits for
            if last_report_epoch >= self.global_epoch - 1:
                last_store_time, last_published_epoch = last_report_time, local_progress.epoch
                store_task = asyncio.create_task(
                    asyncio.wait_for(
                        self.dht.store(
                            key=self.training_progress_key,
                            subkey=self._local_public_key,
                            value=local_progress.dict(),
                            expiration_time=last_report_time + self.metadata_expiration,
                            return_future=True,
                        ),
                        timeout=self.metadata_expiration,
                    )
                )
    finally:
        hivemind.optim.progress_tracker.logger.log(
            self.status_loglevel, f"No longer reporting progress for {self.prefix}"
        )
        if store_task is not None:
            store_task.cancel()


def run_leaving_no_task_pending(loop: asyncio.AbstractEventLoop, main) -> None:
    """``loop.run_until_complete(main)``, then cancel and finish every task ``main`` left behind, and close ``loop``.

    A task still pending when its loop is dropped is destroyed by the garbage collector, which logs "Task was
    destroyed but it is pending!" at ERROR level: hivemind's progress fetcher leaves its shutdown checker so when its
    thread has returned but the result has not reached the loop yet, at a peer's clean exit."""
    try:
        loop.run_until_complete(main)
        leftovers = asyncio.all_tasks(loop)
        for task in leftovers:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*leftovers, return_exceptions=True))
    finally:
        loop.close()


def tracker_run_leaving_no_task_pending(self) -> None:
    """hivemind's ``ProgressTracker.run`` through ``run_leaving_no_task_pending``."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    run_leaving_no_task_pending(loop, asyncio.gather(self._progress_reporter(), self._progress_fetcher()))
    self.shutdown_complete.set()


_original_declare_for_download = hivemind.averaging.averager.DecentralizedAverager._declare_for_download_periodically


async def declare_for_download_when_changed(self) -> None:
    """hivemind's ``_declare_for_download_periodically``, storing the declaration only when what it declares
    (sharing allowed, and the priority: the peer's epoch) changed or the previous one expired.

    hivemind wakes this loop on ``_state_updated``, which the averager also sets after every part of every
    all-reduce, and stored the same declaration each time.
    """
    download_key = f"{self._matchmaking.group_key_manager.prefix}.all_averagers"
    sharing_was_allowed = self.allow_state_sharing
    declared, declared_until = None, -math.inf  # the value stored last, and when that record expires
    while True:
        now = get_dht_time()
        allowed = self.allow_state_sharing
        value = self.state_sharing_priority if allowed else None
        if (allowed or sharing_was_allowed) and (value != declared or now >= declared_until):
            declared, declared_until = value, now + self.declare_state_period
            store = self.dht.store(
                download_key,
                subkey=self.peer_id.to_bytes(),
                value=value,
                expiration_time=declared_until,
                return_future=True,
            )
            asyncio.create_task(asyncio.wait_for(store, timeout=self.declare_state_period))
            sharing_was_allowed = allowed
        wake_at = declared_until if declared_until > now else now + self.declare_state_period
        self._state_updated.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._state_updated.wait(), timeout=max(0.0, wake_at - get_dht_time()))


STALE_ROUND_FACTOR = 2.5  # matchmaking_times after its trigger that a round of no epoch may still look for a group
STALE_ROUND_CHECK_PERIOD = 0.1  # seconds between two looks at the triggered rounds
_ROUND_WATCH = "_collab_round_watch"  # on a StepControl: its RoundWatch
_original_averager_step = hivemind.averaging.averager.DecentralizedAverager.step
_original_allow_allreduce = StepControl.allow_allreduce
_original_step_control_cancel = StepControl.cancel


@dataclass(frozen=True)
class RoundWatch:
    """What the stale-round watchdog knows of a round: seconds after its trigger that a round of no known epoch may
    look for a group; the epoch it averages, if known, and a callable giving the swarm's epoch now."""

    stale_after: float
    epoch: int | None = None
    tracked_swarm_epoch: Callable[[], int | None] | None = None


def is_stale_round(
    stage: AveragingStage,
    done: bool,
    seconds_since_trigger: float,
    stale_after: float,
    round_epoch: int | None = None,
    swarm_epoch: int | None = None,
) -> bool:
    """Whether a triggered round still looking for a group should be given up.

    A round of a known epoch e (a gradient round of e, or the parameter round after it): once the swarm is at epoch
    e+2, where the others have begun the rounds that end e+1, so this round's group formed without this peer. Until
    then it may still be forming: a large swarm on busy machines takes longer than any fixed time, and a gradient round
    cannot meet another epoch's (``collab.matchmaking``). A round of no known epoch, or whose swarm's epoch is unknown
    (no other peer in sight): after ``stale_after`` seconds, when its own epoch's group would have assembled long
    before."""
    if done or stage != AveragingStage.LOOKING_FOR_GROUP:
        return False
    if round_epoch is not None and swarm_epoch is not None:
        return swarm_epoch >= round_epoch + 2
    return seconds_since_trigger >= stale_after


class StaleRoundWatchdog:
    """A daemon thread of the trainer's process that cancels triggered rounds once ``is_stale_round`` says so, every
    ``period`` seconds (``period=None``: no thread, the caller runs ``check``)."""

    def __init__(self, period: float | None = STALE_ROUND_CHECK_PERIOD):
        self.period = period
        self._rounds: dict[StepControl, tuple[float, RoundWatch]] = {}  # control -> (trigger time, what is known)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def watch(self, control: StepControl, watch: RoundWatch) -> None:
        with self._lock:
            self._rounds[control] = (time.monotonic(), watch)
            if self._thread is None and self.period is not None:
                self._thread = threading.Thread(target=self._run, name="stale-round-watchdog", daemon=True)
                self._thread.start()

    def check(self) -> list[StepControl]:
        """Cancel the stale rounds, forget the finished ones; return the rounds cancelled. A round stays watched
        while its all-reduce runs: if that fails, hivemind goes back to matchmaking, where a later epoch's round
        may be waiting."""
        now, cancelled = time.monotonic(), []
        with self._lock:
            rounds = list(self._rounds.items())
        for control, (triggered_at, watch) in rounds:
            done, seconds = control.done(), now - triggered_at
            swarm_epoch = None if watch.tracked_swarm_epoch is None else watch.tracked_swarm_epoch()
            stale = is_stale_round(control.stage, done, seconds, watch.stale_after, watch.epoch, swarm_epoch)
            if stale:
                control.cancel()
                cancelled.append(control)
                by_epoch = watch.epoch is not None and swarm_epoch is not None
                if by_epoch:
                    reason = (
                        f"the swarm is at epoch {swarm_epoch}: this round's group (epoch {watch.epoch}) formed "
                        "without it"
                    )
                else:
                    reason = "its epoch's group formed without it"
                logger.warning(
                    "Gave up an averaging round still looking for a group %.1f s after this peer was ready: %s. "
                    "This epoch goes on with this peer's own values",
                    seconds,
                    reason,
                )
                events.emit("round_given_up", seconds=seconds, reason="swarm_epoch" if by_epoch else "time")
            if done or stale:
                with self._lock:
                    self._rounds.pop(control, None)
        return cancelled

    def _run(self) -> None:
        while True:
            time.sleep(self.period)
            try:
                self.check()
            except Exception:  # keep watching the other rounds
                logger.debug("Stale-round check failed", exc_info=True)


STALE_ROUNDS = StaleRoundWatchdog()


def averager_step_marking_stale_time(self, gather=None, *args, **kwargs):
    """hivemind's ``DecentralizedAverager.step``; a round it returns unfinished (``wait=False``) carries what the
    stale-round watchdog needs (``RoundWatch``). With no ``gather``, an averager with a ``round_epoch`` source gathers
    its round's epoch (``collab.matchmaking``). A round of a known epoch is watched by the swarm's epoch when the
    averager has a ``tracked_swarm_epoch`` source."""
    epoch, round_epoch = None, getattr(self, "round_epoch", None)
    part_timeout = getattr(self, "current_part_timeout", None)
    if gather is None and (round_epoch is not None or part_timeout is not None):
        epoch = None if round_epoch is None else round_epoch()
        shared = getattr(self, "asks_shared_average", False)
        gather = round_gather(epoch, None if part_timeout is None else part_timeout(), shared)
    elif type(gather) is int:  # hivemind's parameter rounds gather the epoch their step begins, after the one averaged
        epoch = gather - 1
    result = _original_averager_step(self, gather, *args, **kwargs)
    if isinstance(result, StepControl):
        stale_after = STALE_ROUND_FACTOR * self.matchmaking_kwargs["min_matchmaking_time"]
        tracked = None if epoch is None else getattr(self, "tracked_swarm_epoch", None)
        setattr(result, _ROUND_WATCH, RoundWatch(stale_after, epoch, tracked))
    return result


def cancel_once(self) -> bool:
    """hivemind's ``StepControl.cancel``, which raises InvalidStateError when called a second time. The watchdog may
    cancel a round that hivemind cancels again later (``Optimizer.shutdown`` cancels a round still marked as looking
    for a group), and that second call made a trainer exit with code 1 after saving its model."""
    if self._cancel is not None and self._cancel.done():  # cancelled before
        return False
    try:
        return _original_step_control_cancel(self)
    except InvalidStateError:  # cancelled by the other thread between the check and the call
        return False


def allow_allreduce_watching_for_staleness(self) -> None:
    """hivemind's ``StepControl.allow_allreduce`` (this peer's trigger); the round is then watched for staleness."""
    _original_allow_allreduce(self)
    watch = getattr(self, _ROUND_WATCH, None)
    if watch is not None:
        STALE_ROUNDS.watch(self, watch)


PARENT_CHECK_PERIOD = 1.0  # seconds between two checks that a hivemind child's parent is still alive
_original_dht_run = hivemind.dht.dht.DHT.run
_original_averager_run = hivemind.averaging.averager.DecentralizedAverager.run


def exit_when_parent_dies(parent_pid: int, before_exit=lambda: None) -> threading.Thread:
    """A daemon thread that ends this process (after ``before_exit()``) once ``parent_pid`` is no longer its parent,
    which is what a child sees when the process that forked it died."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_CHECK_PERIOD)
        with contextlib.suppress(Exception):
            before_exit()
        os._exit(0)

    thread = threading.Thread(target=watch, name="exit-when-parent-dies", daemon=True)
    thread.start()
    return thread


def rebuild_torch_thread_pool() -> None:
    """In a process just forked, before it starts threads: rebuild torch's thread pool, in this thread alone.

    At fork torch marks its thread pool as corrupt and rebuilds it in the next call that asks for it. Once the thread
    count was set (``torch.set_num_threads``, in this process or the one that forked it), each new thread's first
    parallel op asks, and a thread that asks while another rebuilds gets none: "pool INTERNAL ASSERT FAILED ...
    Invalid thread pool!". In an averager that thread was encoding a part; hivemind's stream writer kept the error to
    itself and the part's reducer waited for it until its timeouts, leaving that span of the round unaveraged."""
    torch.set_num_threads(torch.get_num_threads())


def _stop_p2p_daemon(dht) -> None:
    node = getattr(dht, "_node", None)
    if node is not None:
        node.p2p._terminate()  # SIGTERM to the p2pd this DHT process started, if it started one


def dht_run_ending_with_parent(self) -> None:
    """hivemind's ``DHT.run`` (the DHT's own process), ending with the process that started it."""
    exit_when_parent_dies(self._parent_pid, lambda: _stop_p2p_daemon(self))
    _original_dht_run(self)


def averager_run_ending_with_parent(self) -> None:
    """hivemind's ``DecentralizedAverager.run`` (the averager's own process), ending with the process that started
    it."""
    exit_when_parent_dies(self._parent_pid)
    _original_averager_run(self)


async def averager_shutdown_cancelling_rounds(self, timeout: float | None) -> None:
    """hivemind's ``DecentralizedAverager._shutdown`` (in the averager's process), cancelling the rounds in progress.
    hivemind calls ``finalize`` on the values of ``_running_groups``, which are futures of the rounds' runners (and
    ``finalize`` returns None): an averager shut down mid-round, as a peer leaving in a round, died of an
    AttributeError with a traceback in the peer's log. Here a runner is finalized as cancelled, and a round whose
    runner is not made yet is cancelled; ``timeout`` is unused (nothing is left to wait for)."""
    if not self.client_mode:
        await self.remove_p2p_handlers(self._p2p, namespace=self.prefix)
    for future in list(self._running_groups.values()):
        if not future.done():
            future.cancel()
        elif not future.cancelled() and future.exception() is None:
            future.result().finalize(cancel=True)


def quantization_extract(self, serialized_tensor) -> torch.Tensor:
    """hivemind's ``Quantization.extract`` with the codebook size read as ``array[0]`` (numpy 2 compatible)."""
    buffer = serialized_tensor.buffer
    codebook_size = int(np.frombuffer(buffer, count=1, dtype=np.int64)[0])
    codebook = np.frombuffer(buffer, offset=8, count=codebook_size, dtype=self.codebook_dtype)
    quantized = np.frombuffer(buffer, offset=8 + codebook.nbytes, dtype=self.indices_dtype)
    quantized = torch.from_numpy(quantized.astype(np.int64)).reshape(tuple(serialized_tensor.size))
    codebook = torch.from_numpy(codebook.copy()).to(dtype=getattr(torch, serialized_tensor.dtype))
    return codebook[quantized].requires_grad_(serialized_tensor.requires_grad)


class FixedDecentralizedAverager(hivemind.averaging.averager.DecentralizedAverager):
    """hivemind's ``DecentralizedAverager`` with the fixes above that live in the averager: SIGINT kept, senders
    waiting for their group, declarations stored only when changed, rounds marked for the stale-round watchdog, a
    shutdown that cancels the rounds in progress, and a process that keeps its tasks, is spared the signals meant for
    its peer and ends with its parent. With
    ``round_epoch`` (a callable giving the epoch of the round that ``step`` begins) its rounds meet only rounds of
    their epoch (``collab.matchmaking``), and with ``tracked_swarm_epoch`` (a callable giving the swarm's epoch as the
    progress tracker sees it) its rounds of a known epoch are given up by epoch, not by time (``is_stale_round``).

    Put it last among the bases (``class A(Mixin, GradientAverager, FixedDecentralizedAverager)``) so that it sits
    under hivemind's own subclasses, whose ``step`` is another method that calls this one. RPC handlers keep
    hivemind's names (``_get_handle_name``), so these averagers average with plain hivemind ones.
    """

    @classmethod
    def _get_handle_name(cls, namespace: str | None, method_name: str) -> str:
        return hivemind_class(cls)._get_handle_name(namespace, method_name)

    run_in_background = run_in_background_keeping_sigint
    _register_allreduce_group = register_allreduce_group_waking_senders
    rpc_aggregate_part = rpc_aggregate_part_waiting_for_group
    _declare_for_download_periodically = declare_for_download_when_changed
    _shutdown = averager_shutdown_cancelling_rounds
    round_epoch = None
    tracked_swarm_epoch = None

    def __init__(self, *args, **kwargs):
        self._rounds_begun: weakref.WeakSet[StepControl] = weakref.WeakSet()  # for ``cancel_rounds``
        self._rounds_lock = threading.Lock()  # rounds begin in hivemind's threads, cancel_rounds runs in another
        self.rounds_cancelled = False  # set by ``cancel_rounds``: a round begun later is cancelled at once
        super().__init__(*args, **kwargs)

    def step(self, *args, **kwargs):
        """``averager_step_marking_stale_time``; a round returned unfinished is kept track of for ``cancel_rounds``."""
        result = averager_step_marking_stale_time(self, *args, **kwargs)
        if isinstance(result, StepControl):
            with self._rounds_lock:
                self._rounds_begun.add(result)
                cancelled = self.rounds_cancelled
            if cancelled and not result.done():
                result.cancel()
        return result

    def cancel_rounds(self) -> None:
        """A departing peer's: cancel this averager's unfinished rounds, and any it begins from now on, so that no
        thread waits for one (Python joins hivemind's executor threads at exit)."""
        with self._rounds_lock:
            self.rounds_cancelled = True
            begun = list(self._rounds_begun)
        for control in begun:
            if not control.done():
                control.cancel()

    def run(self) -> None:
        """The averager's own process: in a process group of its own, keeps its tasks, matches rounds of one epoch
        only (hivemind's module, in this process only) and ends with the process that started it."""
        rebuild_torch_thread_pool()  # first: hivemind starts the threads that encode parts
        signals.leave_the_process_group()  # the peer stops it after its last round
        exit_when_parent_dies(self._parent_pid)
        hivemind.averaging.averager.switch_to_uvloop = switch_to_uvloop_keeping_tasks
        hivemind.averaging.averager.Matchmaking = EpochMatchmaking
        super().run()


class FixedDHT(hivemind.DHT):
    """``hivemind.DHT`` whose process keeps its tasks (hivemind's module, in that process only), is spared with its
    p2pd the signals meant for its peer, and ends, p2pd first, with the process that started it."""

    def run(self) -> None:
        signals.leave_the_process_group()  # the peer stops it after its last round
        exit_when_parent_dies(self._parent_pid, lambda: _stop_p2p_daemon(self))
        hivemind.dht.dht.switch_to_uvloop = switch_to_uvloop_keeping_tasks
        super().run()


# A peer's progress record, or a downloaded state, may claim at most this many global epochs past the swarm's
# honest epoch: peers in sync are at most this far apart (the monitor's alive_step_lag).
EPOCH_LEAD_LIMIT = MetricsArguments.alive_step_lag


# A peer that trains publishes its progress at least every progress_report_period, a new epoch at once. A record not
# renewed for this many periods (plus a slow store's time) is a peer that died or stopped training: hivemind still
# counted its rate and extrapolated its samples until the record expired (metadata_expiration, 60 s), so after a
# SIGKILL the others' ETA came early and they stepped on a fraction of the batch, each at its own moment.
STALE_PROGRESS_PERIODS = 3
STALE_PROGRESS_SLACK_S = 5.0


def stale_progress_after(progress_report_period: float) -> float:
    """Seconds after which an unrenewed progress record adds no samples and no rate to the swarm's."""
    return STALE_PROGRESS_PERIODS * progress_report_period + STALE_PROGRESS_SLACK_S


def published_long_ago(value: Any, now: float, stale_after: float) -> bool:
    """Whether a progress record's value was published more than ``stale_after`` seconds before ``now``; False for a
    malformed value (hivemind's parsing judges it)."""
    published = value.get("time") if isinstance(value, dict) else None
    return isinstance(published, int | float) and not isinstance(published, bool) and now - published > stale_after


def progress_key(run_id: str) -> str:
    """The DHT key of hivemind's ``ProgressTracker`` records (``{run_id}_progress``, one signed subkey per peer)."""
    return f"{run_id}_progress"


def read_progress_records(dht, run_id: str) -> dict:
    """The progress records under ``run_id`` as the DHT holds them ({subkey: ``ValueWithExpiration``}), {} if none."""
    found = dht.get(progress_key(run_id), latest=True)
    return found.value if found is not None and isinstance(found.value, dict) else {}


def record_epoch(entry: Any) -> int | None:
    """The epoch of one progress record (``ValueWithExpiration`` of a ``LocalTrainingProgress`` dict), None if
    malformed."""
    try:
        return LocalTrainingProgress.parse_obj(entry.value).epoch
    except Exception:
        return None


def honest_progress_epoch(
    records: Mapping[Any, Any],
    now: float,
    exclude_peer: bytes | None = None,
    step_lag: int = EPOCH_LEAD_LIMIT,
    stale_after: float | None = None,
) -> int | None:
    """The swarm's global epoch by the honest majority of the live progress records (``honest_step``), or None when
    there is no valid one. Malformed and expired records are ignored, and so is the record of ``exclude_peer`` (a
    peer ID): a newcomer's own epoch 0 would otherwise hold a swarm of two at 0. With ``stale_after``, only records
    published within that many seconds vote while any is: a killed peer's record stays at its last epoch for a
    minute, and beside one live peer its lower median made that peer's record look too far ahead to count.
    """
    votes = []  # (epoch, fresh)
    for entry in records.values():
        if not isinstance(entry, ValueWithExpiration) or not entry.expiration_time > now:
            continue
        epoch = record_epoch(entry)
        if epoch is not None and not (exclude_peer is not None and entry.value.get("peer_id") == exclude_peer):
            votes.append((epoch, stale_after is None or not published_long_ago(entry.value, now, stale_after)))
    epochs = [epoch for epoch, fresh in votes if fresh] or [epoch for epoch, _ in votes]
    return honest_step(epochs, step_lag) if epochs else None


class SpacedProgressTracker(ProgressTracker):
    """hivemind's ``ProgressTracker`` publishing at most once per ``progress_report_period`` within an epoch and a
    new epoch at once (``hivemind.Optimizer._make_progress_tracker`` builds it in ``collab.averagers``), whose global
    epoch ignores records more than ``EPOCH_LEAD_LIMIT`` past the honest majority's.

    hivemind takes the highest epoch of any record as the swarm's: one peer claiming epoch 2^39 made every trainer
    see itself out of sync and download the state at every step. Its thread ends with no task left pending.
    """

    __init__ = tracker_init_with_report_period
    report_local_progress = report_local_progress_waking_on_new_epoch
    shutdown = tracker_shutdown_waking_reporter
    run = tracker_run_leaving_no_task_pending
    _progress_reporter = progress_reporter_spaced

    def _parse_swarm_progress_data(self, metadata):
        if isinstance(metadata, dict):
            now = get_dht_time()
            stale_after = stale_progress_after(self.progress_report_period)
            metadata = records_within_reach(metadata, now, self.dht.peer_id.to_bytes(), stale_after)
            metadata = without_stale_contributions(metadata, now, stale_after)
        return super()._parse_swarm_progress_data(metadata)


def without_stale_contributions(records: Mapping[Any, Any], now: float, stale_after: float) -> dict:
    """``records`` where each one last published more than ``stale_after`` seconds before ``now`` counts no samples and
    no rate: its peer still counts (its epoch, the number of peers), but the ETA and the batch's samples come from
    peers that train. Malformed records pass unchanged (hivemind's parsing judges them)."""
    kept = {}
    for key, entry in records.items():
        value = entry.value if isinstance(entry, ValueWithExpiration) else None
        if published_long_ago(value, now, stale_after):
            entry = ValueWithExpiration(
                {**value, "samples_accumulated": 0, "samples_per_second": 0.0}, entry.expiration_time
            )
        kept[key] = entry
    return kept


def records_within_reach(
    records: Mapping[Any, Any], now: float, own_peer: bytes | None = None, stale_after: float | None = None
) -> dict:
    """``records`` without those claiming an epoch more than ``EPOCH_LEAD_LIMIT`` past ``honest_progress_epoch``
    (fresh records voting, see there), ``own_peer``'s kept: a peer knows its own epoch, and with one other peer that
    lags behind (a newcomer) the limit would drop the veteran's own record and leave it counting no one but the
    newcomer."""
    swarm_epoch = honest_progress_epoch(records, now, exclude_peer=own_peer, stale_after=stale_after)
    if swarm_epoch is None:
        return dict(records)
    return {
        key: entry
        for key, entry in records.items()
        if (epoch := record_epoch(entry)) is None
        or epoch <= swarm_epoch + EPOCH_LEAD_LIMIT
        or (own_peer is not None and entry.value.get("peer_id") == own_peer)
    }


def hivemind_class(cls: type) -> type:
    """The first hivemind class in ``cls``'s method resolution order."""
    return next(base for base in cls.__mro__ if base.__module__.startswith("hivemind."))


# The patches no subclass can replace: hivemind builds these objects inside its own code (PotentialLeaders in its
# matchmaking, StepControl in DecentralizedAverager.step, decoders through a registry of instances by type).
REQUIRED_HIVEMIND_VERSION = "1.1.12"
ALLOW_VERSION_VARIABLE = "COLLAB_ALLOW_HIVEMIND_VERSION"
ENTRY_POINT_PATCHES = (
    (hivemind.averaging.matchmaking.PotentialLeaders, "_update_queue_periodically", update_queue_with_spaced_lookups),
    (StepControl, "allow_allreduce", allow_allreduce_watching_for_staleness),
    (StepControl, "cancel", cancel_once),
    (hivemind.compression.quantization.Quantization, "extract", quantization_extract),
)


def check_hivemind_version(version: str = hivemind.__version__, environ=os.environ) -> None:
    """Stop with one line unless hivemind is ``REQUIRED_HIVEMIND_VERSION``: the patches replace private internals
    that another release may have changed. ``COLLAB_ALLOW_HIVEMIND_VERSION=1`` runs anyway."""
    if version != REQUIRED_HIVEMIND_VERSION and environ.get(ALLOW_VERSION_VARIABLE) != "1":
        raise HivemindVersionError(
            f"hivemind {version} is installed; this program needs hivemind=={REQUIRED_HIVEMIND_VERSION} "
            f"(pip install hivemind=={REQUIRED_HIVEMIND_VERSION}), or set {ALLOW_VERSION_VARIABLE}=1 to run anyway"
        )


def apply_entry_point_patches() -> None:
    """Apply ``ENTRY_POINT_PATCHES`` (once; after ``check_hivemind_version``). Only a program's entry point calls this
    (``collab.entry.run_program``, bench/netpeer.py, bench/probe.py, tests): importing the project changes nothing."""
    check_hivemind_version()
    for owner, name, replacement in ENTRY_POINT_PATCHES:
        setattr(owner, name, replacement)
