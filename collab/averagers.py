"""Averaging rounds that refuse non-finite values, so one groupmate cannot poison every peer's step.

hivemind averages whatever its groupmates send: one peer that sends inf or NaN in a gradient round makes every
peer's averaged gradients non-finite, and Lamb turns them into NaN parameters everywhere (the same through a
parameter round, which writes the average straight into the parameters). The classes here check both directions of
each all-reduce, inside the averager's own process, before anything is applied:

- what a groupmate sends to this peer to be averaged: its first part holding a non-finite value, or a non-finite or
  negative weight, drops that groupmate from the rest of the round on this peer (hivemind's own path for a sender that
  stops answering), so the other peers still average among themselves. That groupmate keeps its own values for the
  parts this peer reduces.
- what a groupmate sends back as the average of the part it reduces: each non-finite value is replaced by this
  peer's own value, as hivemind does for a part whose reducer failed.

A round with anything dropped logs one WARNING naming its kind (gradient or parameter round). The round itself goes
on, so nothing is raised into the training loop. This peer's own values are not checked here: they are its own
(the callback rolls back non-finite parameters, the loop drops a NaN loss).

Limits. Only non-finite values are refused: a groupmate can still send finite garbage (huge, wrong-signed or random
gradients, parameters of another model, an inflated weight that gives it nearly all of the average), and the
average moves by its share; a reducer can send back a finite wrong average for the part it reduces, and its own
finite values always enter that part. hivemind does not authenticate averaging traffic: any peer ID may join a group,
a new one costs nothing, so a refused peer comes back under another identity, or several at once. A refused peer is
refused for the rest of that round only. Bounding a contribution (median or trimmed mean, norm clipping) would need
every peer to see all contributions of a part, which butterfly all-reduce does not give.

The subclasses keep hivemind's RPC names (hivemind names each handler after the class), so they average with plain
hivemind averagers and the monitor's ``TrainingStateAverager`` can still download their state.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import logging
import math
import multiprocessing as mp
import os
import random
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from concurrent.futures import InvalidStateError
from functools import partial
from itertools import chain
from typing import Any, AsyncIterator, NamedTuple  # noqa: UP035 (hivemind recognises streaming handlers by typing.AsyncIterator)

import hivemind
import torch
from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode
from hivemind.averaging.control import AveragingStage, StepControl
from hivemind.averaging.partition import AllreduceException, BannedException, TensorPartReducer
from hivemind.compression import deserialize_torch_tensor
from hivemind.optim.grad_averager import GradientAverager
from hivemind.optim.state_averager import TrainingStateAverager, dump_optimizer_state, load_optimizer_state
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture, ValueWithExpiration, get_dht_time
from hivemind.utils.asyncio import as_aiter, azip
from hivemind.utils.streaming import combine_from_streaming
from torch.optim.lr_scheduler import LambdaLR

from collab import events
from collab.averaging_events import OptimizerEventsMixin, TrafficCountingMixin
from collab.callback import all_finite
from collab.hivemind_fixes import (
    EPOCH_LEAD_LIMIT,
    FixedDecentralizedAverager,
    SpacedProgressTracker,
    hivemind_class,
    honest_progress_epoch,
    read_progress_records,
)
from collab.matchmaking import WINDOW_LOG_STEP, gathered_part_timeout, gathered_shared_average
from collab.shared_average import SharedAverageRunnerMixin
from collab.timeouts import (
    CHUNKS_PER_ROUND_TIMEOUT,
    MAX_NEXT_CHUNK_TIMEOUT,
    PART_TIMEOUT_MEMORY,
    download_backoff,
    group_part_timeout,
    part_timeout,
    part_timeout_need,
    widened_first_chunk_timeout,
)

logger = logging.getLogger(__name__)


def is_acceptable_contribution(tensor_part: torch.Tensor, weight: float) -> bool:
    """Whether a groupmate's part may enter an average: finite values and a finite, non-negative weight."""
    return math.isfinite(weight) and weight >= 0 and all_finite([tensor_part])


@torch.no_grad()
def keep_local_where_non_finite(delta: torch.Tensor) -> tuple[torch.Tensor, int]:
    """An all-reduce result (``average - local``) with each non-finite value replaced by 0, so that this peer keeps
    its own value there, and how many were replaced."""
    if all_finite([delta]):
        return delta, 0
    finite = torch.isfinite(delta)
    return torch.where(finite, delta, torch.zeros((), dtype=delta.dtype)), int(finite.numel() - finite.sum())


class FiniteTensorPartReducer(TensorPartReducer):
    """hivemind's reducer, refusing a groupmate from the first part it sends with a non-finite value or weight.

    Raising ``BannedException`` makes the ``AllReduceRunner`` ban that sender (``_ban_sender``) exactly as it bans one
    that stops sending: the parts still to come are averaged without it. ``trusted_sender_index`` is this peer's own
    index, never checked (see the module docstring).
    """

    def __init__(self, part_shapes: Sequence[torch.Size], num_senders: int, trusted_sender_index: int | None):
        super().__init__(part_shapes, num_senders)
        self.trusted_sender_index = trusted_sender_index
        self.refused_senders: set[int] = set()

    async def accumulate_part(
        self, sender_index: int, part_index: int, tensor_part: torch.Tensor, weight: float = 1.0
    ) -> torch.Tensor:
        """hivemind's, with the part's average awaited through ``asyncio.shield``.

        Every sender of a part awaits the same future. Cancelling a task that awaits a future cancels the future
        itself, so hivemind's stream handler, which cancels a sender's handler when its stream closes, cancelled the
        part for all its senders: this peer's own span then ended without its averages, and the round waited for
        them until hivemind cancelled it whole (docs/benchmarks/2026-12-07-amd-epyc-2core-swarm-own-span.md)."""
        if sender_index != self.trusted_sender_index and not is_acceptable_contribution(tensor_part, weight):
            self.refused_senders.add(sender_index)
            raise BannedException(f"sender {sender_index} sent non-finite values or weight in part {part_index}")
        assert 0 <= sender_index < self.num_senders, "invalid sender index"
        assert 0 <= part_index < self.num_parts, "invalid part index"
        self.num_parts_received[sender_index] += 1
        while part_index > self.current_part_index:  # the parts before it are still being averaged
            finished = asyncio.create_task(self.finished.wait())
            try:
                await asyncio.wait({self.current_part_future, finished}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                finished.cancel()
            if self.finished.is_set():
                raise AllreduceException(f"attempted to aggregate part in a finalized {self.__class__.__name__}")
        if self.sender_failed_after[sender_index] != float("inf"):
            raise BannedException(f"sender {sender_index} was banned in background")
        assert part_index == self.current_part_index
        current_part_future = self.current_part_future
        if part_index < self.sender_failed_after[sender_index]:
            self.accumulator.add_(tensor_part, alpha=weight)
            self.current_part_accumulated_from += 1
            self.denominator += weight
            self.check_current_part_finished()
        return await asyncio.shield(current_part_future)


def is_refusal(error: BaseException, peer_id: PeerID) -> bool:
    """Whether a groupmate's answer to this peer's parts reads as "not in this group": BAD_GROUP_ID, or its stream
    reset (it answers at once and closes, and the reset can reach this peer before the answer). An error answer to
    parts it did receive (INTERNAL_ERROR: this peer's parts were cut short) is not one."""
    refused = f"{peer_id} sent {averaging_pb2.MessageCode.Name(averaging_pb2.BAD_GROUP_ID)}"
    return isinstance(error, (BrokenPipeError, ConnectionResetError)) or (
        isinstance(error, AllreduceException) and str(error) == refused
    )


class FiniteAllReduceRunner(SharedAverageRunnerMixin, TrafficCountingMixin, AllReduceRunner):
    """hivemind's all-reduce with a ``FiniteTensorPartReducer`` and non-finite averaged values kept local; one
    WARNING per round that dropped anything, naming ``round_kind``. With ``shared_average``, one average for the whole
    group (``collab.shared_average``)."""

    def __init__(self, *, round_kind: str, ends_by: float | None = None, **kwargs):
        super().__init__(**kwargs)
        self.round_kind = round_kind
        self.ends_by = ends_by  # time.monotonic() by which the round ends with what came (``_communicate_with_peer``)
        own_index = self.sender_peer_ids.index(self.peer_id) if self.peer_id in self.sender_peer_ids else None
        unused = self.tensor_part_reducer
        unused.finished.set()  # never used: its finalizer would report that it received none of its parts
        self.tensor_part_reducer = FiniteTensorPartReducer(unused.part_shapes, unused.num_senders, own_index)
        self.non_finite_kept_local = 0
        # flat [start, end) spans of this peer's values the round left as they were (``kept_local_spans``)
        self._kept_local_spans: list[tuple[int, int]] = []
        self._failed_size_seen = 0
        self.started = time.monotonic()
        self.sender_starts: dict[PeerID, float] = {}  # seconds after this peer's start that each sender's part came
        self.over = asyncio.Event()  # set once this peer needs nothing more from its groupmates in this round
        self._exchanges: dict[PeerID, asyncio.Task] = {}  # the task exchanging each reducer's span
        self.replies_sent: dict[PeerID, int] = {}  # replies that each sender's stream took from this reducer

    def finalize(self, **kwargs) -> None:
        super().finalize(**kwargs)  # run() calls it once its outputs are in, and on every failure or cancel
        self.over.set()

    async def rpc_aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        self.sender_starts.setdefault(context.remote_id, time.monotonic() - self.started)
        if context.remote_id in self.sender_peer_ids:
            self._note_senders_started(starting=context.remote_id)  # hivemind's handler adds it to active_senders
        replies = 0
        try:
            async for message in super().rpc_aggregate_part(stream, context):
                replies += 1
                yield message
                self.replies_sent[context.remote_id] = replies  # the stream's writer took it
        except asyncio.CancelledError:
            # hivemind's stream handler cancels this, silently, when the sender's stream closes under it (or the
            # round or this peer stops): the sender only sees the replies end short and keeps its own values
            if replies < self.tensor_part_reducer.num_parts:
                logger.warning(
                    "%s round: the stream of parts from %s was closed after %d of its %d replies (its connection "
                    "closed, or this round stopped); it keeps its own values for the rest of this peer's span",
                    self.round_kind.capitalize(),
                    context.remote_id,
                    replies,
                    self.tensor_part_reducer.num_parts,
                )
            raise

    def latest_start(self) -> float:
        """Seconds after this peer's start that the last groupmate to start sent its first part (0 if none did)."""
        return max(self.sender_starts.values(), default=0.0)

    def dropped_a_groupmate(self) -> bool:
        """Whether the round dropped a sender (not for non-finite values) or lost a reducer's part: a groupmate came
        later than the timeouts, or never."""
        refused = {self.sender_peer_ids[index] for index in self.tensor_part_reducer.refused_senders}
        return bool(set(self.banned_senders) - refused) or super().values_kept_local() > 0

    def values_kept_local(self) -> int:
        return super().values_kept_local() + self.non_finite_kept_local

    def kept_local_spans(self) -> list[tuple[int, int]]:
        """Flat ``[start, end)`` spans (over the round's tensors in order) holding every value this round left as
        this peer had it: the parts of a reducer that failed, and each tensor with a non-finite average."""
        return list(self._kept_local_spans)

    async def _communicate_with_peer(self, peer_id: PeerID):
        """hivemind's exchange of one reducer's span, ended at ``ends_by`` with the parts that came by then.

        hivemind's averager cancels the whole round once ``allreduce_timeout`` has passed: a reducer that answers
        slowly but within its reducer timeout (a loaded machine, a slow link) then costs every groupmate every
        average, the spans that came in full included (a round of the 16-peer swarm lost 74 % of its results so).
        Ended a little before, the round keeps the averages it got and this peer its own values for the rest of
        that span, as for a reducer that failed."""
        self._exchanges[peer_id] = asyncio.current_task()
        if self.ends_by is None:
            return await self._exchange_span(peer_id)
        try:
            await asyncio.wait_for(self._exchange_span(peer_id), max(0.0, self.ends_by - time.monotonic()))
        except asyncio.TimeoutError:
            self._end_span_unanswered(peer_id)

    def _end_span_unanswered(self, peer_id: PeerID) -> None:
        """The round's time ran out before ``peer_id``'s span was averaged: the rest of it stays this peer's own
        (hivemind registers a remote reducer's failure itself when cancelled, not this peer's own span's)."""
        peer_index = self.ordered_peer_ids.index(peer_id)
        container = self.tensor_part_container
        if container._outputs_registered_by_peer[peer_index] < container.num_parts_by_peer[peer_index]:
            container.register_failed_reducer(peer_index)
            self._note_kept_local(peer_id)
        logger.warning(
            "%s round: its time ran out before the averages of %s's span were all in; this peer keeps its own values "
            "for the rest of that span and the round ends with the averages it got",
            self.round_kind.capitalize(),
            "this peer" if peer_id == self.peer_id else peer_id,
        )

    async def _exchange_span(self, peer_id: PeerID):
        try:
            await super()._communicate_with_peer(peer_id)
        except BaseException as error:
            unanswered = self._note_kept_local(peer_id)  # at once: hivemind registered the failure just before
            if isinstance(error, Exception) and peer_id != self.peer_id:
                # hivemind logs why at DEBUG only; its WARNING says how much came back, not from whom or why
                logger.warning(
                    "%s round: no averaged values from %s for the rest of its span (%r); this peer keeps its own "
                    "values there",
                    self.round_kind.capitalize(),
                    peer_id,
                    error,
                )
                if (
                    unanswered
                    and is_refusal(error, peer_id)
                    and peer_id in self.sender_peer_ids
                    and peer_id not in self.active_senders
                ):
                    # not in this round, so it sends no parts either: this peer's reducer stops waiting for them
                    await self._ban_sender(peer_id)
            raise

    async def _ban_sender(self, peer_id: PeerID):
        await super()._ban_sender(peer_id)
        self._note_senders_started()

    def _note_senders_started(self, starting: PeerID | None = None) -> None:
        """hivemind's watcher of missing senders holds the round's end until every sender has started, or for the
        sender timeout, and its handler checks only for all senders active: a banned sender never will be, so the
        check runs at each ban and at each sender's start (``starting``), whichever comes last."""
        starting_senders = {starting} if starting is not None else set()
        if set(self.sender_peer_ids) <= self.active_senders | self.banned_senders | starting_senders:
            self.all_senders_started.set()

    def _note_kept_local(self, peer_id: PeerID) -> bool:
        """Record the span of ``peer_id``'s that a failure left as this peer had it (hivemind registers a failed
        reducer's remaining parts, the tail of its span); whether that is the whole span: not one part answered."""
        failed = self.tensor_part_container.failed_size - self._failed_size_seen
        if not failed:
            return False
        self._failed_size_seen += failed
        peer_index = self.ordered_peer_ids.index(peer_id)
        end = self._reducer_span_end(peer_index)
        self._kept_local_spans.append((end - failed, end))
        start = self._reducer_span_end(peer_index - 1) if peer_index > 0 else 0
        return failed == end - start

    async def _generate_input_for_peer(self, peer_index: int) -> AsyncIterator[averaging_pb2.AveragingData]:
        """hivemind's parts for the groupmate at ``peer_index``, ending the stream at once if one cannot be encoded.

        hivemind's stream writer keeps an encoding error to itself: the reducer waited for this peer's parts until
        its sender timeout, and this peer for the replies until its reducer timeout. Here the stream ends short (its
        first message an error if no part went), so the reducer drops this sender and answers what came, and this
        peer keeps its own values for the rest of that reducer's span (hivemind's handling of a failed reducer)."""
        sent_any = False
        try:
            async for message in super()._generate_input_for_peer(peer_index):
                sent_any = True
                yield message
        except Exception as error:
            logger.warning(
                "%s round: could not encode a part for %s (%r); this peer keeps its own values for the rest of "
                "that groupmate's span",
                self.round_kind.capitalize(),
                self.ordered_peer_ids[peer_index],
                error,
            )
            if not sent_any:
                yield averaging_pb2.AveragingData(code=averaging_pb2.INTERNAL_ERROR, group_id=self.group_id)

    def _reducer_span_end(self, peer_index: int) -> int:
        """Where the flat span of values that the groupmate at ``peer_index`` reduces ends: each reducer's parts are
        one contiguous span, in the group's order (hivemind's TensorPartContainer)."""
        parts_by_peer = self.tensor_part_container._input_parts_by_peer[: peer_index + 1]
        return sum(part.numel() for parts in parts_by_peer for part, _ in parts)

    async def run(self):
        offset = 0
        overdue = None if self.ends_by is None else asyncio.create_task(self._report_overdue_spans())
        try:
            async for delta in super().run():
                delta, replaced = keep_local_where_non_finite(delta)
                self.non_finite_kept_local += replaced
                if replaced:
                    self._kept_local_spans.append((offset, offset + delta.numel()))
                offset += delta.numel()
                yield delta
        except asyncio.CancelledError:
            self._report_cancelled_whole()
            raise
        finally:
            if overdue is not None:
                overdue.cancel()
            self._report_dropped(self.non_finite_kept_local)

    def _spans_missing(self) -> list[PeerID]:
        """The groupmates (this peer included) whose spans' averages are not all in yet."""
        container = self.tensor_part_container
        return [
            peer_id
            for index, peer_id in enumerate(self.ordered_peer_ids)
            if container._outputs_registered_by_peer[index] < container.num_parts_by_peer[index]
        ]

    def _name(self, peer_id: PeerID) -> str:
        return "this peer" if peer_id == self.peer_id else str(peer_id)

    async def _report_overdue_spans(self) -> None:
        """One WARNING if spans are still missing ``OVERDUE_REPORT_S`` after ``ends_by``, where each one's exchange
        waits: the ends at ``ends_by`` should have filled them (what held them is not known yet)."""
        await asyncio.sleep(max(0.0, self.ends_by - time.monotonic()) + OVERDUE_REPORT_S)
        missing = self._spans_missing()
        if missing:
            logger.warning(
                "%s round: %.1f s past its end, the averages of the span(s) of %s are not in (%s)",
                self.round_kind.capitalize(),
                time.monotonic() - self.ends_by,
                ", ".join(map(self._name, missing)),
                "; ".join(
                    f"{self._name(peer_id)}: {where_waiting(self._exchanges.get(peer_id))}" for peer_id in missing
                ),
            )

    def _report_cancelled_whole(self) -> None:
        """One WARNING where hivemind cancelled the round (its allreduce_timeout, the step given up, a shutdown)
        before every span's averages were in: whose were missing, and when this round's own end (``ends_by``) was
        due. Due well before the cancel, it says the event loop ran that late (a loaded machine)."""
        missing = self._spans_missing()
        if not missing:
            return
        now = time.monotonic()
        due = "" if self.ends_by is None else f"; its own end was due {now - self.ends_by:.1f} s before"
        logger.warning(
            "%s round: cancelled whole %.1f s after it began, before the averages of the span(s) of %s were in%s",
            self.round_kind.capitalize(),
            now - self.started,
            ", ".join(map(self._name, missing)),
            due,
        )

    def _report_dropped(self, kept_local: int) -> None:
        refused = [str(self.sender_peer_ids[index]) for index in sorted(self.tensor_part_reducer.refused_senders)]
        if refused or kept_local:
            logger.warning(
                "%s round: dropped the contribution of %d groupmate(s) that sent non-finite values (%s); kept this "
                "peer's own value for %d non-finite averaged value(s)",
                self.round_kind.capitalize(),
                len(refused),
                ", ".join(refused) or "none",
                kept_local,
            )
            events.emit("refused", kind=f"{self.round_kind}s", groupmates=len(refused), kept_local=kept_local)


# Seconds past a round's end (``ends_by``) after which spans still missing are reported with where they wait.
OVERDUE_REPORT_S = 2.0
ASYNCIO_DIR = os.path.dirname(asyncio.__file__)


def where_waiting(task: asyncio.Task | None) -> str:
    """Where ``task`` waits: the innermost frame outside asyncio's own code in its chain of awaits that can be
    followed (into the task that ``asyncio.wait_for`` runs, not into an async generator), as ``file:line function``;
    or that it ended."""
    if task is None:
        return "no exchange began"
    if task.done():
        return "ended" if task.cancelled() or task.exception() is None else f"ended with {task.exception()!r}"
    awaitable, frame = task.get_coro(), None
    for _ in range(64):  # a bound on the chain, not a limit met in practice
        inner_frame = getattr(awaitable, "cr_frame", None)
        if inner_frame is None:
            break
        if not inner_frame.f_code.co_filename.startswith(ASYNCIO_DIR):
            frame = inner_frame
        awaitable = awaitable.cr_await
        if inner_frame.f_code is asyncio.wait_for.__code__ and isinstance(
            inner_frame.f_locals.get("fut"), asyncio.Task
        ):
            awaitable = inner_frame.f_locals["fut"].get_coro()  # the task that asyncio.wait_for runs
    if frame is None:
        return "waiting"
    return f"waiting in {frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno} {frame.f_code.co_name}"


# The share of allreduce_timeout after which a round ends with the averages it got: hivemind cancels the round at the
# whole, and the rest is slack for an event loop that runs seconds late on a loaded machine.
ALLREDUCE_END_SHARE = 0.9

# A departing peer's question to a groupmate (``rpc_round_over``): seconds the groupmate waits for its round at most
# (the round's own timeouts end it sooner), and the averager's process's slack past the departing peer's timeout.
GROUPMATES_WAIT_CAP = 600.0
GROUPMATES_ANSWER_SLACK = 5.0


class FiniteAveragingMixin:
    """Runs this averager's all-reduce rounds with ``FiniteAllReduceRunner``; put it before the hivemind class."""

    round_kind: str  # named in the warning of a round that dropped values
    # Whether this averager's rounds are of fresh quantities that every groupmate should end with alike
    # (``collab.shared_average``); it gathers the ask, and a round is shared when every groupmate asked.
    asks_shared_average = False
    # Shared with the optimizer and the other averager (an mp.Value(c_int)): how many epochs the state this peer
    # catches up from was behind the swarm's when it took it (``BoundedLoadOptimizer``); 0 once it holds the swarm's.
    # None: always a full member.
    state_lag = None
    # In parameter averagers (an mp.Value(c_int)): how many catch-ups this peer has (re)started from old values.
    catch_ups = None
    # In parameter averagers (an mp.Value(c_int)): parameter rounds this peer averaged with groupmates, each of which
    # left it holding what they hold (``BoundedLoadOptimizer``'s bound on the updates a full member may have missed).
    parameter_rounds_joined = None
    # in the averager's process, while this peer catches up: the flat spans of its values that no parameter round has
    # replaced with its groupmates' yet, for the (round size, ``catch_ups``) of ``_still_old_key``
    _still_old: list[tuple[int, int]] | None = None
    _still_old_key: tuple[int, int] | None = None

    # hivemind caches each class's RPC handlers on first use: a parent's cache would hide rpc_round_over
    _rpc_handlers = None
    _stub_type = None

    def __init__(self, *args, **kwargs):
        # The sender timeout this averager's process sized after its last round (0: none yet), shared with the
        # process that calls step(), which gathers it with each round (``current_part_timeout``).
        self._sized_part_timeout = mp.Value(ctypes.c_double, 0.0)  # before hivemind starts the averager's process
        # values of this peer that its last completed round averaged with no one, set in the averager's process
        self.kept_local_last_round = mp.Value(ctypes.c_long, 0)
        # (group ID, its peers, time.monotonic() at its start) of the last round, set in the averager's process
        self._last_group: tuple[bytes, tuple[PeerID, ...], float] | None = None
        self._allreduce_began: dict[bytes, float] = {}  # group ID -> time.monotonic() as its all-reduce began
        super().__init__(*args, **kwargs)

    def wait_for_groupmates(self, timeout: float) -> int:
        """Before leaving, at most ``timeout`` seconds: until each groupmate of this averager's last round says it
        needs nothing more from this peer in it. Returns how many said so.

        A peer has its own average once the groupmates' replies are in, while its replies to them (the average of the
        part it reduces) may still be queued on its side of a slow link; leaving then cuts them, and each groupmate
        keeps its own values for that part: the round's models disagree (``rpc_round_over``)."""
        if timeout <= 0 or not self.is_alive():
            return 0
        future = MPFuture()
        self._outer_pipe.send(("_wait_for_groupmates", [], dict(timeout=timeout, future=future)))
        try:
            return future.result(timeout + GROUPMATES_ANSWER_SLACK)
        except (TimeoutError, concurrent.futures.TimeoutError):  # two classes until Python 3.11
            return 0

    async def _wait_for_groupmates(self, timeout: float, future: MPFuture) -> None:
        confirmed = 0
        try:
            # a groupmate still in that round is within its averaging timeout of the round's start
            recent = self._last_group is not None and (
                self._allreduce_timeout is None or time.monotonic() - self._last_group[2] < self._allreduce_timeout
            )
            if recent:
                group_id, peer_ids, _ = self._last_group
                request = averaging_pb2.AveragingData(group_id=group_id)
                asks = [
                    self.get_stub(self._p2p, peer, namespace=self.prefix).rpc_round_over(request, timeout=timeout)
                    for peer in peer_ids
                    if peer != self.peer_id
                ]
                answers = await asyncio.gather(*asks, return_exceptions=True)
                confirmed = sum(not isinstance(each, BaseException) for each in answers)
        finally:
            answer(future, confirmed)

    async def rpc_round_over(
        self, request: averaging_pb2.AveragingData, context: P2PContext
    ) -> averaging_pb2.AveragingData:
        """A groupmate about to leave asks whether this peer still needs anything from it in round
        ``request.group_id``: answered once this peer's part of that round is over (at once if it is not in it; a
        groupmate of a plain hivemind averager gets an error, which it takes as no answer)."""
        registered = self._running_groups.get(request.group_id)
        if registered is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                runner = await asyncio.wait_for(asyncio.shield(registered), GROUPMATES_WAIT_CAP)
                await asyncio.wait_for(runner.over.wait(), GROUPMATES_WAIT_CAP)
        return averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, group_id=request.group_id)

    def current_part_timeout(self) -> float | None:
        """The sender timeout this averager would use in its next round (None: no ``next_chunk_timeout``)."""
        sized = self._sized_part_timeout.value
        return sized if sized > 0 else self.allreduce_kwargs.get("sender_timeout")

    @classmethod
    def _get_handle_name(cls, namespace: str | None, method_name: str) -> str:
        """hivemind's RPC names (``{namespace}::GradientAverager.rpc_...``), not the subclass's: peers and monitors
        that run hivemind's classes must still reach this averager."""
        return hivemind_class(cls)._get_handle_name(namespace, method_name)

    async def _run_allreduce_inplace_(self, tensors, group_info, group_id: bytes | None = None, **kwargs):
        """hivemind's ``DecentralizedAverager._run_allreduce_inplace_`` with ``FiniteAllReduceRunner``.

        While this peer catches up its weight is ``catching_up_weight``'s: 0 in parameter rounds, where it receives
        the group's average and adds nothing from its old state. It is whole once each of its values has come from
        groupmates with weight in some parameter round (``_take_groupmates_values``)."""
        lag = 0 if self.state_lag is None else self.state_lag.value
        if lag:
            kwargs["weight"] = catching_up_weight(self.round_kind, kwargs.get("weight", 1.0), lag)
        if kwargs.get("sender_timeout") is not None:
            gathered = map(gathered_part_timeout, group_info.gathered)
            seconds = group_part_timeout(kwargs["sender_timeout"], gathered, self._part_timeout_sizer().cap)
            kwargs.update(sender_timeout=seconds, reducer_timeout=2 * seconds)
        group_id = group_info.group_id if group_id is None else group_id
        shared = self.asks_shared_average and all(map(gathered_shared_average, group_info.gathered))
        runner = FiniteAllReduceRunner(
            round_kind=self.round_kind,
            ends_by=self._round_ends_by(group_info.group_id),
            shared_average=shared,
            p2p=self._p2p,
            servicer_type=type(self),
            prefix=self.prefix,
            tensors=tensors,
            group_id=group_id,
            ordered_peer_ids=group_info.peer_ids,
            **kwargs,
        )
        assert group_id in self._running_groups, f"Group id {group_id} was not registered in _register_allreduce_group"
        self._running_groups[group_id].set_result(runner)
        self._last_group = (group_id, tuple(group_info.peer_ids), runner.started)

        try:
            if runner.modes[group_info.peer_ids.index(self.peer_id)] != AveragingMode.AUX:
                async for tensor, update in azip(as_aiter(*tensors), runner):
                    tensor.add_(update, alpha=self._averaging_alpha)
                    self.last_updated = get_dht_time()
                    self._state_updated.set()
            else:
                async for _ in runner:
                    raise ValueError("aux peers should not receive averaged tensors")
        finally:
            self._size_part_timeout(runner)
        self.kept_local_last_round.value = runner.values_kept_local()
        if self.round_kind == "parameter" and runner.group_size >= 2 and self.parameter_rounds_joined is not None:
            self.parameter_rounds_joined.value += 1
        if lag and self.round_kind == "parameter":
            self._take_groupmates_values(runner)

    @contextlib.contextmanager
    def _register_allreduce_group(self, group_info):
        """hivemind's, noting when the group's all-reduce began: hivemind's ``allreduce_timeout`` counts from here,
        before the round waits for this peer's averaged tensors, which its trainer may hold for seconds. A context
        manager's frame is not kept in the traceback hivemind logs of a failed all-reduce (an override of
        ``_aggregate_with_group`` was)."""
        self._allreduce_began[group_info.group_id] = time.monotonic()
        try:
            with super()._register_allreduce_group(group_info):
                yield
        finally:
            self._allreduce_began.pop(group_info.group_id, None)

    def _round_ends_by(self, group_id: bytes) -> float | None:
        """When the all-reduce of ``group_id`` ends with the averages that came (``FiniteAllReduceRunner.ends_by``):
        ``ALLREDUCE_END_SHARE`` of ``allreduce_timeout`` after it began, ahead of hivemind's cancel of the whole."""
        if self._allreduce_timeout is None:
            return None
        began = self._allreduce_began.get(group_id, time.monotonic())
        return began + ALLREDUCE_END_SHARE * self._allreduce_timeout

    def _take_groupmates_values(self, runner: FiniteAllReduceRunner) -> None:
        """After a parameter round of this peer catching up: its values that came from groupmates are the swarm's,
        and the peer is whole (``state_lag`` 0) once every value has, in this round or an earlier one of the same
        catch-up. Parameter rounds where some groupmate dropped are common in a swarm with churn: waiting for one
        that completes could keep a newcomer out for good."""
        total = runner.tensor_part_container.total_size
        key = (total, 0 if self.catch_ups is None else self.catch_ups.value)
        still_old = self._still_old if self._still_old is not None and self._still_old_key == key else [(0, total)]
        if runner.group_size >= 2:
            still_old = spans_left(still_old, runner.kept_local_spans())
        self._still_old, self._still_old_key = still_old, key
        if not still_old:
            self.state_lag.value = 0
            self._still_old = None

    def _size_part_timeout(self, runner: FiniteAllReduceRunner) -> None:
        """The next rounds' sender and reducer timeouts, sized by this round's late starts (``PartTimeout``); hivemind
        reads them from ``allreduce_kwargs`` at each round, and so does the wait for a group that has not registered
        yet (``collab.hivemind_fixes``)."""
        if self.allreduce_kwargs.get("sender_timeout") is None:
            return  # no next_chunk_timeout: hivemind waits without a timeout
        sizer = self._part_timeout_sizer()
        seconds = sizer.observe(runner.latest_start(), runner.dropped_a_groupmate(), runner.sender_timeout)
        self.allreduce_kwargs.update(sender_timeout=seconds, reducer_timeout=2 * seconds)
        self._sized_part_timeout.value = seconds

    def _part_timeout_sizer(self) -> PartTimeout:
        """This averager's ``PartTimeout``, made at its first round from the configured sender timeout."""
        sizer = self.__dict__.get("_part_timeout")
        if sizer is None:
            configured = self.allreduce_kwargs["sender_timeout"]
            round_time = self._allreduce_timeout or MAX_NEXT_CHUNK_TIMEOUT * CHUNKS_PER_ROUND_TIMEOUT
            sizer = self.__dict__["_part_timeout"] = PartTimeout(
                configured, max(configured, round_time / CHUNKS_PER_ROUND_TIMEOUT), self.round_kind
            )
        return sizer


class PartTimeout:
    """One averager's all-reduce sender timeout, sized by how late its groupmates started in its recent rounds
    (``collab.timeouts.part_timeout``); logged when it changes by a quarter."""

    def __init__(self, configured: float, cap: float, round_kind: str):
        self.configured, self.cap, self.round_kind = configured, cap, round_kind
        self.needs: deque[float] = deque(maxlen=PART_TIMEOUT_MEMORY)
        self.seconds = self.logged = configured

    def observe(self, latest_start: float, dropped: bool, used: float) -> float:
        """One round's latest start of a groupmate's part, whether it dropped one and the timeout it ``used`` (its
        group's, ``group_part_timeout``); returns this averager's next timeout."""
        self.needs.append(part_timeout_need(latest_start, dropped, used))
        self.seconds = part_timeout(self.configured, self.needs, self.cap)
        if not self.logged / WINDOW_LOG_STEP < self.seconds < self.logged * WINDOW_LOG_STEP:
            self.logged = self.seconds
            logger.info(
                f"{self.round_kind.capitalize()} rounds wait {self.seconds:.1f} s for a groupmate's part "
                f"(--next_chunk_timeout {self.configured:.1f}): in the last round the latest groupmate started "
                f"{latest_start:.1f} s after this peer" + (" and one was dropped" if dropped else "")
            )
        return self.seconds


# A low-communication peer catching up adds its pseudo-gradients, measured from the state it took, while that state
# was at most this many outer rounds behind the swarm's, weighted down by the lag (bounded staleness, as asynchronous
# DiLoCo variants allow): its samples count from its first round instead of after the parameter round that repairs it.
MAX_CONTRIBUTING_LAG = 4


def catches_up_after_a_load(state_epoch: int, swarm_epoch: int, from_one_epoch_behind: bool) -> bool:
    """Whether a state of ``state_epoch`` downloaded while the swarm is at ``swarm_epoch`` leaves the peer catching up
    (``BoundedLoadOptimizer._begin_catching_up``): two or more epochs behind, or one where the mode catches up
    ``from_one_epoch_behind`` (``BoundedLoadOptimizer.catches_up_from_one_epoch_behind``)."""
    return swarm_epoch - state_epoch > (0 if from_one_epoch_behind else 1)


def one_epoch_past_the_load(epoch_of_last_load: int | None, local_epoch: int, swarm_epoch: int) -> bool:
    """Whether a peer still at the epoch its last load left it at sees the swarm one epoch past it: the case a load
    settles by taking the swarm's epoch, not by loading again."""
    return epoch_of_last_load is not None and local_epoch == epoch_of_last_load and swarm_epoch == local_epoch + 1


def may_miss_one_update(
    local_epoch: int, swarm_epoch: int, rounds_joined: int, rounds_at_last_miss: int | None
) -> bool:
    """Whether a peer that finds the swarm one epoch past it (its step ended after the swarm's next one) may take the
    swarm's epoch without the update it missed, instead of downloading the whole state: only where a parameter round
    with groupmates (``rounds_joined`` counts them) has averaged away its last such miss, so that it is never more
    than one update apart from the swarm."""
    if swarm_epoch != local_epoch + 1:
        return False
    return rounds_at_last_miss is None or rounds_joined > rounds_at_last_miss


def catching_up_weight(round_kind: str, weight: float, lag: int) -> float:
    """The weight of a peer ``lag`` epochs behind in a round whose own weight would be ``weight`` (its samples):
    ``weight / (1 + lag)`` in pseudo-gradient rounds up to ``MAX_CONTRIBUTING_LAG``, else 0. Gradients and
    parameters from an old state stay out: a synchronous epoch is one step, so its lag is many steps."""
    if round_kind != "pseudo-gradient" or not 0 < lag <= MAX_CONTRIBUTING_LAG:
        return 0.0
    return weight / (1 + lag)


def spans_left(spans: Sequence[tuple[int, int]], kept: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of ``spans`` (sorted, disjoint ``[start, end)``) inside some span of ``kept``: what a round that
    replaced every value outside ``kept`` left of them."""
    left = []
    for start, end in spans:
        for kept_start, kept_end in sorted(kept):
            low, high = max(start, kept_start), min(end, kept_end)
            if low < high:
                if left and left[-1][1] >= low:
                    left[-1] = (left[-1][0], max(left[-1][1], high))
                else:
                    left.append((low, high))
    return left


class FiniteAverager(FiniteAveragingMixin, FixedDecentralizedAverager):
    """A plain averager of any tensors with the trainers' fixes and checks (the benchmarks' all-reduce rounds)."""

    round_kind = "tensor"


class FiniteGradientAverager(FiniteAveragingMixin, GradientAverager, FixedDecentralizedAverager):
    """hivemind's ``GradientAverager`` whose rounds refuse non-finite values (``grad_averager_factory=``)."""

    round_kind = "gradient"

    def __init__(self, *args, state_lag=None, **kwargs):
        self.state_lag = state_lag  # before hivemind starts the averager's process, which reads it
        super().__init__(*args, **kwargs)

    def load_state_from_peers(self, wait: bool = True, timeout: float | None = None) -> None:
        """Downloads nothing. hivemind's ``Optimizer.load_state_from_peers`` downloads a donor's gradient buffers here
        and drops them (a ``GradientAverager`` applies no state), and a donor trickling them until the timeout made
        the optimizer's reload loop, which retries on that timeout, pick the same donor forever."""
        return None


MAX_DONORS_PER_LOAD = 8  # tries per load_state_from_peers, a different donor each: a failed or refused one is skipped
ABANDON_POLL = 0.5  # seconds between two looks of the averager's process at whether the peer abandoned a download


def state_refusal(
    metadata: Any,
    tensors: Sequence[torch.Tensor],
    expected_shapes: Sequence[torch.Size],
    expected_optimizer_metadata: Sequence[dict],
    min_epoch: int,
    max_epoch: int | None,
) -> str | None:
    """Why a downloaded state must not be applied, or None if it may.

    The state must have this peer's structure (the same tensors with the same shapes, the same optimizer entries),
    an integer epoch in ``[min_epoch, max_epoch]`` and only finite tensors and numbers: a donor can claim any epoch
    and send anything, and the state is applied as it is.
    """
    if not isinstance(metadata, dict):
        return "its metadata is not a dict"
    epoch = metadata.get("epoch")
    if type(epoch) is not int or epoch < min_epoch:
        return f"its epoch {epoch!r} is not an integer at least this peer's epoch {min_epoch}"
    if max_epoch is not None and epoch > max_epoch:
        return f"its epoch {epoch} is past {max_epoch}, the swarm's epoch plus the lead allowed"
    if len(tensors) != len(expected_shapes):
        return f"it has {len(tensors)} tensors, not {len(expected_shapes)}"
    for index, (tensor, shape) in enumerate(zip(tensors, expected_shapes, strict=True)):
        if tensor.shape != shape:
            return f"its tensor {index} has shape {tuple(tensor.shape)}, not {tuple(shape)}"
    optimizer_metadata = metadata.get("optimizer_metadata")
    if not isinstance(optimizer_metadata, list) or len(optimizer_metadata) != len(expected_optimizer_metadata):
        return "its optimizer metadata does not match this peer's optimizer"
    for received, expected in zip(optimizer_metadata, expected_optimizer_metadata, strict=True):
        if not isinstance(received, dict) or received.get("type") != expected["type"]:
            return "its optimizer metadata does not match this peer's optimizer"
        if expected["type"] == "tensor" and received.get("index") != expected["index"]:
            return "its optimizer metadata does not match this peer's optimizer"
        if expected["type"] == "value" and not is_finite_value(received.get("value")):
            return "its optimizer metadata holds a non-finite number"
    if not all_finite(tensors):
        return "it holds non-finite values"
    return None


def is_finite_value(value: Any) -> bool:
    """Whether every number in ``value`` (nested lists, tuples and dicts) is finite; other leaves count as finite."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, (list, tuple)):
        return all(is_finite_value(item) for item in value)
    if isinstance(value, dict):
        return all(is_finite_value(item) for item in value.values())
    return True


def bring_scheduler_to_epoch(scheduler, epoch: int) -> None:
    """Where hivemind's ``_update_scheduler`` leaves ``scheduler`` (stepped until ``_step_count > epoch``), set at
    once by LambdaLR's own rule for a ``LambdaLR``: its rate is a function of the epoch alone, one ``step()`` per
    epoch would take months for a large epoch, and a ``step()`` before the optimizer's first makes PyTorch warn
    that a first rate is skipped, which means nothing here. Other schedulers are stepped as hivemind does."""
    if scheduler is None or scheduler._step_count > epoch:
        return
    if isinstance(scheduler, LambdaLR):
        rates = [base * rate_at(epoch) for rate_at, base in zip(scheduler.lr_lambdas, scheduler.base_lrs, strict=True)]
        for group, rate in zip(scheduler.optimizer.param_groups, rates, strict=True):
            group["lr"] = rate
        scheduler.last_epoch, scheduler._step_count, scheduler._last_lr = epoch, epoch + 1, rates
        return
    while scheduler._step_count <= epoch:
        scheduler.step()


def choose_donor(advertised: Mapping[Any, Any], max_epoch: float, excluded: set[PeerID]) -> PeerID | None:
    """The peer to download the state from: the highest epoch advertised (``{peer ID bytes: ValueWithExpiration(
    epoch)}``, hivemind's ``all_averagers`` record) that is at most ``max_epoch``, ties broken at random, not
    ``excluded``; None if there is none."""
    candidates = [
        (float(info.value), random.random(), PeerID(peer_id))
        for peer_id, info in advertised.items()
        if isinstance(info, ValueWithExpiration) and type(info.value) in (int, float) and info.value <= max_epoch
    ]
    allowed = [candidate for candidate in candidates if candidate[2] not in excluded]
    return max(allowed)[2] if allowed else None


async def until_done(future: MPFuture, poll: float = ABANDON_POLL) -> None:
    """Returns once ``future`` is done, here in a process other than its origin: once the origin cancelled it.
    An MPFuture's state lives in shared memory, which hivemind's averager polls the same way (``step.done()``)."""
    while not future.done():
        await asyncio.sleep(poll)


def answer(future: MPFuture, result: Any) -> None:
    """``future.set_result(result)`` unless it is done: the origin may have cancelled it meanwhile."""
    if not future.done():
        with contextlib.suppress(InvalidStateError):
            future.set_result(result)


def swarm_epoch(dht: hivemind.DHT, run_id: str, own_peer_id: PeerID) -> int | None:
    """The swarm's honest global epoch from the peers' progress records under ``run_id`` but ``own_peer_id``'s, or
    None if unknown."""
    records = read_progress_records(dht, run_id)
    if not records:
        return None
    return honest_progress_epoch(records, get_dht_time(), exclude_peer=own_peer_id.to_bytes())


def max_donor_epoch(swarm_epoch: int | None, timeout: float | None) -> int | None:
    """The highest epoch a donor's state may claim: the swarm's plus the lead allowed, plus one per second of the
    download's ``timeout`` (epochs the swarm may make meanwhile); None where the swarm's epoch is unknown."""
    return None if swarm_epoch is None else swarm_epoch + EPOCH_LEAD_LIMIT + math.ceil(timeout or 0)


def find_donor(dht: hivemind.DHT, prefix: str, max_epoch: float | None, excluded: set[PeerID]) -> PeerID | None:
    """``choose_donor`` among the state averagers under ``prefix`` that advertise their state in the DHT."""
    found = dht.get(f"{prefix}.all_averagers", latest=True)
    advertised = found.value if found is not None and isinstance(found.value, dict) else {}
    return choose_donor(advertised, math.inf if max_epoch is None else max_epoch, excluded)


class DownloadTry(NamedTuple):
    """One try of a state download: ``donor`` (None where the try never reached one) and, where it succeeded, the
    state's ``metadata`` and ``tensors``; ``broke_off``: the donor began sending, then a chunk came late or the stream
    broke (``DownloadBrokeOff``); ``silent``: the donor sent nothing within the first chunk's wait (busy in a round,
    or gone)."""

    donor: PeerID | None
    metadata: Any = None
    tensors: list[torch.Tensor] | None = None
    broke_off: bool = False
    silent: bool = False

    @classmethod
    def failed(cls, donor: PeerID, error: BaseException) -> DownloadTry:
        """The try of a download from ``donor`` that ended with ``error`` (``download_state``'s)."""
        return cls(donor, broke_off=isinstance(error, DownloadBrokeOff), silent=isinstance(error, TimeoutError))


class DownloadBrokeOff(Exception):
    """A donor that began streaming its state stopped before the end. Unlike a donor that never answers (gone, or
    never serving), it was alive and serving a moment ago, so a load with no other donor asks it once more."""


async def download_state(
    p2p,
    averager_class: type,
    prefix: str,
    donor: PeerID,
    chunk_timeout: float | None,
    first_chunk_timeout: float | None = None,
) -> tuple[Any, list[torch.Tensor]]:
    """The metadata and tensors ``donor``'s state averager (of ``averager_class``: hivemind names its handlers by
    class) streams, each chunk within ``chunk_timeout`` (hivemind's loop of ``_load_state_from_peers``) but the
    first, within ``first_chunk_timeout`` where longer: a donor serves its state only between its parameter rounds
    (hivemind's all-reduce holds the averaged tensors' lock), so a download asked during one may wait for its end
    (``Timeouts.first_chunk_timeout``) instead of failing after a chunk's time."""
    stub = averager_class.get_stub(p2p, donor, namespace=prefix)
    stream = (await stub.rpc_download_state(averaging_pb2.DownloadRequest())).__aiter__()
    metadata, parts, tensors = None, [], []
    timeout = chunk_timeout if first_chunk_timeout is None else max(first_chunk_timeout, chunk_timeout or 0.0)
    received = 0  # messages so far
    while True:
        try:
            message = await asyncio.wait_for(stream.__anext__(), timeout=timeout)
        except StopAsyncIteration:
            break
        except Exception as e:
            if received:
                raise DownloadBrokeOff(f"after {received} message(s): {e!r}") from e
            raise
        received += 1
        timeout = chunk_timeout
        if message.metadata:
            metadata = averager_class.serializer.loads(message.metadata)
        if message.tensor_part.dtype and parts:
            tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
            parts = []
        parts.append(message.tensor_part)
    if parts:
        try:
            tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
        except (RuntimeError, ValueError) as e:  # the stream ended mid-tensor: its connection closed (bench.streams)
            raise DownloadBrokeOff(f"the stream ended within tensor {len(tensors)}: {e}") from e
    return metadata, tensors


class FiniteTrainingStateAverager(FiniteAveragingMixin, TrainingStateAverager, FixedDecentralizedAverager):
    """hivemind's ``TrainingStateAverager`` whose parameter rounds refuse non-finite values and whose state downloads
    refuse a lying donor.

    hivemind downloads from the peer that advertises the highest epoch and applies whatever it sends, then steps the
    scheduler once per epoch of it: a donor claiming epoch 2^39 would be picked first and hang the newcomer for
    months, one serving inf would poison it. Here a state is refused (``state_refusal``) when its epoch is more than
    ``EPOCH_LEAD_LIMIT`` (plus one per second of the timeout) past the swarm's honest epoch, read from the peers'
    signed progress records under ``run_id`` but this peer's own (``honest_progress_epoch``), or when it has a
    non-finite value or another structure; a donor advertising such an epoch is not even asked. The next donor is
    then tried after a backoff (``download_backoff``: 1 s, doubling), up to ``MAX_DONORS_PER_LOAD`` tries in all,
    and failing all of them the peer keeps its own state. Where no donor is left but one whose download broke off
    midway (``DownloadBrokeOff``: often the only donor of a small swarm) or sent nothing within the first chunk's
    wait (busy in a round), that one is asked once more, after the backoff, rather than leaving the whole state for
    the next load; each try whose donor sent nothing doubles that wait for the next (``widened_first_chunk_timeout``).
    A try that fails or outlives its timeout is stopped in the averager's process, so no abandoned download keeps the
    link busy. The scheduler is brought to the new epoch in one step (``bring_scheduler_to_epoch``).
    Without ``run_id`` no epoch is too far ahead (the other checks still apply).
    """

    round_kind = "parameter"
    # A download begun before the first load (collab.prefetch.StatePrefetch), which that load's first try takes
    prefetch = None
    download_began: float | None = None  # time.monotonic() when the last load's download began, for its event
    download_tries = 0  # donors the last load asked (the prefetch included), for its state_loaded or state_not_loaded
    load_failure: str | None = None  # why the last load applied no state, for its state_not_loaded event
    first_chunk_timeout: float | None = None  # Timeouts.first_chunk_timeout; None: next_chunk_timeout

    def __init__(self, *, run_id: str | None = None, **kwargs):
        self.run_id = run_id
        self._max_donor_epoch = mp.Value(ctypes.c_double, math.inf)  # read by the averager's process
        self.state_lag = mp.Value(ctypes.c_int, 0)
        # bumped by the optimizer each time a catch-up (re)starts from old values: the rounds before count for nothing
        self.catch_ups = mp.Value(ctypes.c_int, 0)
        self.parameter_rounds_joined = mp.Value(ctypes.c_int, 0)
        super().__init__(**kwargs)

    def swarm_epoch(self) -> int | None:
        """The swarm's honest global epoch from the peers' progress records, or None if unknown."""
        return None if self.run_id is None else swarm_epoch(self.dht, self.run_id, self.peer_id)

    def load_state_from_peers(self, wait: bool = True, timeout: float | None = None) -> bool:
        """hivemind's ``TrainingStateAverager.load_state_from_peers``, refusing a lying donor (see the class);
        whether a donor's state was applied."""
        assert wait, "FiniteTrainingStateAverager.load_state_from_peers waits for the state"
        max_epoch = max_donor_epoch(self.swarm_epoch(), timeout)
        parameters = tuple(
            chain((p for group in self.optimizer.param_groups for p in group["params"]), self.extra_tensors)
        )
        optimizer_metadata, optimizer_tensors = dump_optimizer_state(self.optimizer)
        expected_shapes = [tensor.shape for tensor in chain(parameters, optimizer_tensors)]
        skipped: list[PeerID] = []  # donors not to ask again in this load
        # donors asked once whose download broke off midway or never began in time (alive a moment ago, or busy in a
        # round): each may be asked again where no other donor is left
        retryable: list[PeerID] = []
        first_chunk = self.first_chunk_timeout  # widened after each try whose donor sent nothing in time
        prefetch, self.prefetch = self.prefetch, None  # a download begun before this load serves its first try
        self.download_began = prefetch.began if prefetch is not None else time.monotonic()
        self.download_tries, self.load_failure = 0, None
        for tries in range(MAX_DONORS_PER_LOAD):
            time.sleep(download_backoff(tries))
            self._max_donor_epoch.value = math.inf if max_epoch is None else max_epoch
            downloaded = prefetch.result() if prefetch is not None and tries == 0 else None
            if downloaded is None:
                downloaded = self._try_download(timeout, skipped, first_chunk)
            if downloaded is None and retryable:
                again = retryable.pop(0)
                logger.info("No other donor: asking peer %s again, whose download broke off or began late", again)
                downloaded = self._try_download(timeout, [peer for peer in skipped if peer != again], first_chunk)
            if downloaded is None:
                logger.info("No other peer could send its state; keeping this peer's own")
                self.load_failure = self.load_failure or "no donor"
                return False
            donor, metadata, tensors = downloaded.donor, downloaded.metadata, downloaded.tensors
            self.download_tries += 1
            if donor is not None and donor not in skipped:
                skipped.append(donor)
                if downloaded.broke_off or downloaded.silent:
                    retryable.append(donor)
            if downloaded.silent:
                first_chunk = self._widened_first_chunk_timeout(first_chunk, timeout)
                logger.info("The next try waits up to %.1f s for its donor's first chunk", first_chunk)
            if tensors is None:
                self.load_failure = "download failed"  # the try's own warning says how
                continue
            reason = state_refusal(metadata, tensors, expected_shapes, optimizer_metadata, self.local_epoch, max_epoch)
            if reason is None:
                self._apply_state(metadata, tensors[: len(parameters)], tensors[len(parameters) :], parameters)
                return True
            logger.warning("Refused the state of peer %s: %s; trying another peer", donor, reason)
            self.load_failure = f"refused: {reason}"
        logger.warning("No acceptable state in %d tries; keeping this peer's own", MAX_DONORS_PER_LOAD)
        return False

    def _widened_first_chunk_timeout(self, seconds: float | None, timeout: float | None) -> float:
        """``widened_first_chunk_timeout`` of the wait a try had for its first chunk (``seconds``, where longer than
        the chunk timeout: ``download_state``), within the averaging timeout and the try's ``timeout``."""
        chunk = self.next_chunk_timeout if self.next_chunk_timeout is not None else self.request_timeout
        cap = min((t for t in (self._allreduce_timeout, timeout) if t), default=math.inf)
        return widened_first_chunk_timeout(max(seconds or 0.0, chunk), cap)

    def _try_download(
        self, timeout: float | None, skipped: Sequence[PeerID], first_chunk_timeout: float | None
    ) -> DownloadTry | None:
        """One try in the averager's process (``_load_state_from_peers``), None if no donor is left; its first chunk
        waits up to ``first_chunk_timeout`` (where longer than the chunk timeout). A try the averager's process has not
        answered within twice ``timeout`` is cancelled: that process sees it and stops the download."""
        future = MPFuture()
        self._outer_pipe.send(
            (
                "_load_state_from_peers",
                [],
                dict(
                    timeout=timeout,
                    future=future,
                    skipped=tuple(peer.to_base58() for peer in skipped),
                    first_chunk_timeout=first_chunk_timeout,  # this try's: set after the averager's process began
                ),
            )
        )
        try:
            return future.result(timeout=None if timeout is None else 2 * timeout)
        except TimeoutError:
            future.cancel()
            logger.warning("A state download got no answer within %.0f s: cancelled", 2 * timeout)
            return DownloadTry(None)

    def _apply_state(self, metadata: dict, loaded_parameters, loaded_optimizer_tensors, parameters) -> None:
        """The second half of hivemind's ``TrainingStateAverager.load_state_from_peers``: apply a checked state.

        The optimizer keeps this peer's hyperparameters (learning rate, betas, weight decay, ...): they come from its
        own configuration, and a donor's finite but absurd ones (a learning rate of 1e30) would pass every check."""
        own_hyperparameters = [
            {k: v for k, v in group.items() if k != "params"} for group in self.optimizer.param_groups
        ]
        with torch.no_grad(), self.lock_averaged_tensors:
            load_optimizer_state(self.optimizer, metadata["optimizer_metadata"], loaded_optimizer_tensors)
            for group, own in zip(self.optimizer.param_groups, own_hyperparameters, strict=True):
                group.update(own)
            for local, loaded in zip(parameters, loaded_parameters, strict=True):
                local.copy_(loaded, non_blocking=True)
        if self.offload_optimizer:
            self._apply_optimizer_parameters_()
        if not self.reuse_tensors:
            self._load_local_tensors_into_averager_()
        self.local_epoch = metadata["epoch"]
        self._update_scheduler()

    def _update_scheduler(self):
        bring_scheduler_to_epoch(self.scheduler, self.local_epoch)

    async def _load_state_from_peers(
        self,
        future: MPFuture,
        timeout: float | None = None,
        skipped: Sequence[str] = (),
        first_chunk_timeout: float | None = None,
    ):
        """Runs in the averager's process: download from the one donor advertising the highest epoch not past the
        limit (ties broken at random), other than this peer and ``skipped``; result a ``DownloadTry``, None if there
        is no donor. Each chunk waits at most ``next_chunk_timeout`` (else ``request_timeout``; the first,
        ``first_chunk_timeout``: ``download_state``) and the whole download at most ``timeout``, so a donor that
        trickles its state cannot hold the newcomer; a download the peer cancelled (``_try_download``) stops."""
        try:
            excluded = {self.peer_id, *map(PeerID.from_base58, skipped)}
            donor = find_donor(self.dht, self.prefix, self._max_donor_epoch.value, excluded)
            if donor is None:
                return
            logger.info("Downloading the state from peer %s", donor)
            download = asyncio.create_task(self._download_state_from(donor, first_chunk_timeout))
            abandoned = asyncio.create_task(until_done(future))
            try:
                await asyncio.wait({download, abandoned}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            finally:
                download.cancel()
                abandoned.cancel()
            if future.done():
                logger.info("Stopped the state download from peer %s: the peer abandoned it", donor)
            elif not download.done():
                logger.warning("Downloading the state from peer %s took over %.0f s: stopped", donor, timeout)
                answer(future, DownloadTry(donor))
            elif download.exception() is not None:
                logger.warning("Downloading the state from peer %s failed: %s", donor, repr(download.exception()))
                answer(future, DownloadTry.failed(donor, download.exception()))
            else:
                answer(future, DownloadTry(donor, *download.result()))
        finally:
            answer(future, None)

    async def _download_state_from(
        self, donor: PeerID, first_chunk_timeout: float | None = None
    ) -> tuple[Any, list[torch.Tensor]]:
        chunk_timeout = self.next_chunk_timeout if self.next_chunk_timeout is not None else self.request_timeout
        return await download_state(self._p2p, type(self), self.prefix, donor, chunk_timeout, first_chunk_timeout)


class BoundedLoadOptimizer(hivemind.Optimizer):
    """``hivemind.Optimizer`` whose loads of the state from peers end, and whose newcomer catches up with a state
    several epochs old instead of loading it again (``load_state_from_peers``). Its state averager is a
    ``FiniteTrainingStateAverager`` and its gradient averager a ``FiniteGradientAverager``."""

    catching_up_since: float | None = None  # time.monotonic() when the catch-up began; None when a full member
    epoch_of_last_load: int | None = None  # the epoch a load of the state left this peer at; None: no load applied
    # The state averager's ``parameter_rounds_joined`` when this peer last took the swarm's epoch as a full member
    # without the update of the epoch it skipped (``may_miss_one_update``); None: it holds every update it knows of.
    rounds_at_last_miss: int | None = None
    # How a peer takes a state one epoch behind the swarm's, at its load or at the first check after it: at the
    # swarm's epoch as a full member (False: one-step-old parameters, averaged back by the next parameter round two
    # epochs away) or catching up (True: the low-communication mode, whose anchor one outer step old would otherwise
    # wait up to 32 rounds for a parameter round; catching up asks for one). Never by downloading the state again.
    catches_up_from_one_epoch_behind = False

    def load_state_from_peers(self, **kwargs) -> None:
        """hivemind's ``Optimizer.load_state_from_peers`` with one bounded load instead of its retry loop.

        hivemind retried a failed load at once and forever, while the abandoned download kept running. Here the state
        averager makes the tries (at most ``MAX_DONORS_PER_LOAD``, a different donor each, with backoff, each bounded
        by ``load_state_timeout`` and stopped when abandoned) and an error ends the load with this peer's own state.
        The gradient averager's buffers are not downloaded (``FiniteGradientAverager``).

        hivemind takes the swarm's epoch after a state one epoch old, and loads again after an older one: where a
        download outlasts several epochs, every load ends behind and the newcomer never trains. Here it takes the
        swarm's epoch after any state it downloaded and catches up (``_begin_catching_up``)."""
        if self.scheduled_grads is not None and not self.scheduled_grads.done():
            self._tag_along_with_zero_weight(self.scheduled_grads)  # as hivemind: do not stall a round already begun
            self.scheduled_grads = None
        self.state_averager.step(wait_for_delayed_updates=True)
        with self.tracker.pause_updates():
            loaded = False
            try:
                loaded = self.state_averager.load_state_from_peers(timeout=self.load_state_timeout, **kwargs)
            except Exception as e:
                logger.exception("Loading the state from peers failed (%r); keeping this peer's own", e)
            state_epoch, swarm_epoch = self.local_epoch, self._swarm_epoch_now()
            if loaded and catches_up_after_a_load(state_epoch, swarm_epoch, self.catches_up_from_one_epoch_behind):
                self._begin_catching_up(state_epoch, swarm_epoch)
            one_behind = swarm_epoch - state_epoch == 1
            takes_swarm_epoch = one_behind or (self.catching_up_since is not None and swarm_epoch > state_epoch)
            self._enter_epoch(swarm_epoch if takes_swarm_epoch else self.local_epoch)
            self.epoch_of_last_load = self.local_epoch if loaded else None
            if loaded:
                missed_one = one_behind and self.catching_up_since is None
                self.rounds_at_last_miss = self._parameter_rounds_joined() if missed_one else None

    def _enter_epoch(self, epoch: int) -> None:
        """Train on at ``epoch`` from the parameters this peer holds, with nothing accumulated: the end of a load."""
        if epoch != self.local_epoch:
            logger.log(self.status_loglevel, f"Catching up with collaboration step {epoch}")
            self.state_averager.local_epoch = epoch
        self.tracker.report_local_progress(local_epoch=self.local_epoch, samples_accumulated=0)
        if not self.client_mode:
            self.state_averager.state_sharing_priority = self.local_epoch
        if self.use_gradient_averaging:
            self.grad_averager.reset_accumulated_grads_()
            if not self.client_mode:
                self.grad_averager.state_sharing_priority = self.local_epoch

    def _swarm_epoch_now(self) -> int:
        """The collaboration's epoch after a load: the tracker's stood still during it (its updates were paused), so
        the peers' progress records are read again."""
        fresh = self.state_averager.swarm_epoch()
        return self.tracker.global_epoch if fresh is None else max(self.tracker.global_epoch, fresh)

    def _tracked_swarm_epoch(self) -> int | None:
        """The swarm's epoch as the progress tracker sees it now: the stale-round watchdog's, read every 0.1 s. None
        while it sees no other peer: a round then waits for a groupmate that may have died, and the swarm's epoch, this
        peer's own, cannot move on while it waits, so the watchdog goes by time."""
        return self.tracker.global_epoch if self.tracker.global_progress.num_peers > 1 else None

    def _begin_catching_up(self, state_epoch: int, swarm_epoch: int) -> None:
        """Train on from a downloaded state of ``state_epoch``, older than ``swarm_epoch``, without letting its
        parameters into the swarm.

        Until a parameter round has given this peer the swarm's parameters, its rounds take part with the weight of
        ``catching_up_weight`` (0 but for low-communication pseudo-gradients from a state a few rounds old: it receives
        the averages, adds nothing else), it reports no samples toward the swarm's batch (but still publishes its
        progress, so that the others average with it) and it shares no state with newcomers. ``step`` sees the end of
        it."""
        if self.catching_up_since is None:
            self.catching_up_since = time.monotonic()
        self.state_averager.catch_ups.value += 1
        self.state_averager.state_lag.value = max(1, swarm_epoch - state_epoch)
        self.tracker.counts_no_samples = True
        if self.state_averager.allow_state_sharing:
            self.state_averager.allow_state_sharing = False
        logger.warning(
            "The state downloaded (epoch %d) is behind the collaboration's epoch %d: catching up at its next "
            "parameter round",
            state_epoch,
            swarm_epoch,
        )
        events.emit("catching_up", epoch=state_epoch, global_epoch=swarm_epoch)

    def values_put_back(self) -> None:
        """After this peer's values were put back to an earlier copy (a rollback): while it catches up, what its
        parameter rounds gave it before may be undone, and the catch-up counts from the next round again."""
        if self.catching_up_since is not None:
            self.state_averager.catch_ups.value += 1

    def _finish_catching_up(self) -> None:
        """After the parameter round that made this peer whole (``state_lag`` back to 0 by its averager)."""
        if self.catching_up_since is None or self.state_averager.state_lag.value:
            return
        seconds, self.catching_up_since = time.monotonic() - self.catching_up_since, None
        self.tracker.counts_no_samples = False
        if not self.client_mode and not self.auxiliary:
            self.state_averager.allow_state_sharing = True
        logger.log(self.status_loglevel, f"Caught up with the swarm at epoch {self.local_epoch}")
        events.emit("caught_up", epoch=self.local_epoch, seconds=round(seconds, 3))

    def _should_load_state_from_peers(self) -> bool:
        """hivemind's, except while catching up: then being epochs behind calls for no new download (it would end
        behind again), the next epoch's step takes the swarm's epoch and a parameter round its parameters.

        And where the swarm is one epoch past this peer, the load's own rule for a state one epoch old holds
        (``catches_up_from_one_epoch_behind``): it takes the swarm's epoch and trains on, as a full member or
        catching up, instead of downloading the whole state again as hivemind does. That happens in two ways:
        - right after a load, which read the swarm's epoch from the DHT before the record of the first peer past it
          was there (on loaded machines stores took seconds;
          docs/benchmarks/2026-12-01-amd-epyc-2core-pair-match-and-swarm-start.md);
        - right after its own step, which ended once the swarm had finished the next epoch (its delayed update waited
          for a slow parameter round): a full member then lacks that one update, which the next parameter round
          averages away, and may miss another only after one has (``may_miss_one_update``)."""
        if self.catching_up_since is not None:
            return False
        behind = super()._should_load_state_from_peers()
        swarm_epoch, rounds_joined = self.tracker.global_epoch, self._parameter_rounds_joined()
        if not behind:
            return False
        if one_epoch_past_the_load(self.epoch_of_last_load, self.local_epoch, swarm_epoch):
            after = "load"
        elif may_miss_one_update(self.local_epoch, swarm_epoch, rounds_joined, self.rounds_at_last_miss):
            after = "step"
        else:
            return True
        # A round pre-scheduled for the epoch skipped is given up; the round its own step triggered is left to the
        # delayed update that waits for it, which its groupmates share.
        if self.scheduled_grads is not None and not self.scheduled_grads.triggered and not self.scheduled_grads.done():
            self.scheduled_grads.cancel()
        self.scheduled_grads = None
        logger.log(self.status_loglevel, f"The collaboration is one epoch past this peer's {after}: not loading again")
        events.emit("took_swarm_epoch", epoch=self.local_epoch, global_epoch=swarm_epoch, after=after)
        with self.tracker.pause_updates():
            if self.catches_up_from_one_epoch_behind:
                self._begin_catching_up(self.local_epoch, swarm_epoch)
            else:
                self.rounds_at_last_miss = rounds_joined
            self._enter_epoch(swarm_epoch)
        return False

    def _parameter_rounds_joined(self) -> int:
        return self.state_averager.parameter_rounds_joined.value

    def is_synchronized_with_peers(self) -> bool:
        """hivemind's, and not while catching up: its epochs then contribute nothing to the swarm's."""
        return self.catching_up_since is None and super().is_synchronized_with_peers()

    def step(self, *args, **kwargs):
        self._finish_catching_up()
        return super().step(*args, **kwargs)

    def _make_gradient_averager(self, factory, **kwargs):
        """The factory's averager, sharing ``state_lag``, tagging each round with the epoch it averages (the
        local epoch when the round is scheduled or begun, before the step that ends that epoch) and giving up a round
        once the swarm's epoch shows that its group formed without this peer."""
        state_averager = self.state_averager
        # hivemind hands averager_opts to the state averager only: the follower's wait for a leader's answer, sized by
        # the link (collab.timeouts), is the gradient averager's too
        request_timeout = state_averager.matchmaking_kwargs["request_timeout"]
        factory = partial(factory, state_lag=state_averager.state_lag, request_timeout=request_timeout)
        averager = super()._make_gradient_averager(factory, **kwargs)
        averager.round_epoch = lambda: state_averager.local_epoch
        averager.tracked_swarm_epoch = self._tracked_swarm_epoch
        return averager


class AllReduceFinishingControl:
    """A step's gradient round (its ``StepControl``) as the step waits for it: hivemind's ``control.result(
    averaging_timeout)``, except that a round still in its all-reduce when that timeout runs out is waited for up to
    ``allreduce_timeout`` more, within which the averager ends it either way.

    hivemind's fallback to the local gradients waits for that all-reduce all the same: the round holds the averaged
    tensors' lock to its end, and the fallback takes that lock to load the local gradients, which then overwrite the
    averages the round wrote. The peer lost its groupmates' gradients and stepped apart from them, having waited as
    long as their averages took. Every other attribute is the control's."""

    def __init__(self, control: StepControl, allreduce_timeout: float | None):
        self._control, self._allreduce_timeout = control, allreduce_timeout

    def __getattr__(self, name: str):
        return getattr(self._control, name)

    def result(self, timeout: float | None = None):
        try:
            return self._control.result(timeout)
        except (TimeoutError, concurrent.futures.TimeoutError):  # two classes until Python 3.11
            if self._control.stage != AveragingStage.RUNNING_ALLREDUCE:
                raise
            logger.info("The gradient round is still in its all-reduce after %s s: waiting for its averages", timeout)
            return self._control.result(self._allreduce_timeout)


LEAVE_POLL_S = 0.1  # seconds between two looks at whether a peer waiting for its background update is asked to leave


class FiniteAveragingOptimizer(OptimizerEventsMixin, BoundedLoadOptimizer):
    """``hivemind.Optimizer`` whose parameter rounds run in a ``FiniteTrainingStateAverager`` and whose state loads
    are bounded (``BoundedLoadOptimizer``); pass ``grad_averager_factory=FiniteGradientAverager`` for its gradient
    rounds."""

    state_averager_class: type[TrainingStateAverager] = FiniteTrainingStateAverager
    # Set once the peer is asked to stop (trainer.peer): it triggers no further round, so it pre-schedules none. A
    # round pre-scheduled then is one hivemind's shutdown tags along at weight 0, for up to averaging_timeout.
    leaving: threading.Event | None = None
    # time.monotonic() by which a departing peer stops waiting for its rounds (``collab.optim.finish_delayed_updates``)
    leave_by: float | None = None

    def _is_leaving(self) -> bool:
        return self.leaving is not None and self.leaving.is_set()

    def _tag_along_with_zero_weight(self, control: StepControl) -> None:
        """hivemind's, but a departing peer tags along only until ``leave_by``, then cancels the round.

        A round pre-scheduled before the stop has a group whose members begin it at the epoch's end, which the peer
        no longer reaches: hivemind waits for them up to averaging_timeout, past the shutdown deadline, and the peer
        exits without saving its model. Until ``leave_by`` its groupmates' round stays whole (weight 0)."""
        if self.leave_by is None:
            return super()._tag_along_with_zero_weight(control)
        if not control.triggered:
            control.weight = 0
            control.allow_allreduce()
        try:
            control.result(max(0.0, self.leave_by - time.monotonic()))
        except BaseException as e:  # as hivemind's: a round that failed or timed out is given up either way
            if not control.done():
                logger.info("Leaving a round that its groupmates had not finished (weight 0)")
                control.cancel()
            elif not isinstance(e, concurrent.futures.CancelledError):
                logger.debug("The round tagged along at weight 0 failed: %r", e)

    def _maybe_schedule_gradient_averaging(self) -> None:
        if not self._is_leaving():
            super()._maybe_schedule_gradient_averaging()

    def _average_gradients_and_load_into_optimizer(self, maybe_step_control: StepControl | None) -> None:
        """hivemind's, waiting for a round in its all-reduce to the end (``AllReduceFinishingControl``)."""
        if maybe_step_control is not None:
            maybe_step_control = AllReduceFinishingControl(maybe_step_control, self.allreduce_timeout)
        super()._average_gradients_and_load_into_optimizer(maybe_step_control)

    def _update_global_epoch(self, grad_scaler) -> None:
        """hivemind's, once the last epoch's background update (its optimizer step and parameter round) has finished.
        hivemind waits for it with the progress tracker paused, where the swarm's epoch stands still: the stale-round
        watchdog could then never see that a parameter round's group formed without this peer, and a peer whose round
        found no groupmate stalled for the whole averaging timeout while the swarm went on.

        A peer asked to leave during that wait takes no step: the wait is ``collab.optim.finish_delayed_updates``'s
        then, bounded by the leave's deadline (hivemind's lasts up to the averaging timeout, past that deadline)."""
        if self.delay_optimizer_step:
            if not self._background_update_ended_unless_leaving():
                logger.info("Asked to stop while the last epoch's background update runs: no step at this epoch")
                return
            self.state_averager.step(wait_for_delayed_updates=True)
        super()._update_global_epoch(grad_scaler)

    def _background_update_ended_unless_leaving(self) -> bool:
        """Wait as hivemind's ``TrainingStateAverager.step`` does for the background updates, up to the averaging
        timeout, looking every ``LEAVE_POLL_S`` at whether the peer is asked to leave: False then, with one still
        running. After the timeout hivemind's own wait takes over (True)."""
        pending = list(self.state_averager.pending_updates)
        deadline = time.monotonic() + (self.state_averager._allreduce_timeout or math.inf)
        while pending and time.monotonic() < deadline:
            if self._is_leaving():
                return False
            _, still = concurrent.futures.wait(pending, timeout=min(LEAVE_POLL_S, deadline - time.monotonic()))
            pending = list(still)
        return True

    def _maybe_schedule_state_averaging(self) -> None:
        if not self._is_leaving():
            super()._maybe_schedule_state_averaging()

    def _state_averager_options(self) -> dict:
        """Keyword arguments of ``state_averager_class`` beyond hivemind's (a subclass adds its own)."""
        return {}

    def _make_progress_tracker(self, target_batch_size: int, **kwargs) -> SpacedProgressTracker:
        """hivemind's ``Optimizer._make_progress_tracker``, with ``SpacedProgressTracker``."""
        return SpacedProgressTracker(
            dht=self.dht,
            prefix=self.run_id,
            target_batch_size=target_batch_size,
            client_mode=self.client_mode,
            status_loglevel=self.status_loglevel,
            start=True,
            **kwargs,
        )

    def _make_state_averager(self, **kwargs) -> TrainingStateAverager:
        """hivemind's ``Optimizer._make_state_averager``, with ``state_averager_class`` and its own options; its rounds
        are given up by the swarm's epoch (``collab.hivemind_fixes.is_stale_round``)."""
        averager = self.state_averager_class(
            **self._state_averager_options(),
            dht=self.dht,
            prefix=f"{self.run_id}_state_averager",
            min_matchmaking_time=self.matchmaking_time,
            allreduce_timeout=self.allreduce_timeout,
            shutdown_timeout=self.shutdown_timeout,
            offload_optimizer=self.offload_optimizer,
            custom_gradients=self.offload_optimizer,
            status_loglevel=self.status_loglevel,
            next_chunk_timeout=self.next_chunk_timeout,
            client_mode=self.client_mode,
            auxiliary=self.auxiliary,
            run_id=self.run_id,
            start=True,
            **kwargs,
        )
        averager.tracked_swarm_epoch = self._tracked_swarm_epoch  # its parameter rounds given up by epoch
        return averager
