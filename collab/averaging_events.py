"""Events of averaging: ``averaged`` from the all-reduce runner (with the bytes it really sent and received),
``step_begun`` and ``state_loaded`` from the optimizer (docs/EVENTS.md).

hivemind's ``AllReduceRunner`` streams ``averaging_pb2.AveragingData`` messages: this peer's parts to each reducer
(``_generate_input_for_peer``) and, as a reducer, the averaged parts back to each sender
(``_accumulate_parts_streaming``); it receives the senders' parts and the reducers' averages. Each message is counted
at its protobuf size (``ByteSize``, what goes on the wire without libp2p's framing), so compression and the group's
shares show in the figures. The counts live in the averager's own process, where the round runs.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from itertools import chain

import torch
from hivemind.averaging.control import StepControl
from hivemind.utils.nested import nested_flatten

from collab import events

# Seconds a finished round waits for its last replies to other senders before it reports its traffic without them:
# they are normally counted within milliseconds, and a sender that stopped reading must not keep the report back.
REPLIES_WAIT_SECONDS = 10.0


@dataclass
class RoundTraffic:
    """Serialized bytes of one round's messages, both directions, and the replies this peer owes as a reducer.

    This peer's own averaged parts can all be back while it still answers other senders' parts: every part received
    is owed a reply until one is counted, and the round's traffic is complete once none is owed (``when_replied``)."""

    sent: int = 0
    received: int = 0
    replies_owed: int = 0
    _on_replied: Callable[[], None] | None = None

    def owe(self, count: int) -> None:
        self.replies_owed += count

    def pay(self, count: int) -> None:
        self.replies_owed -= count
        if self.replies_owed <= 0:
            self._fire()

    def when_replied(self, callback: Callable[[], None], timeout: float) -> None:
        """Call ``callback`` once no reply is owed, or after ``timeout`` seconds, whichever comes first; runs in the
        round's event loop."""
        self._on_replied = callback
        if self.replies_owed <= 0:
            self._fire()
        else:
            asyncio.get_running_loop().call_later(timeout, self._fire)

    def _fire(self) -> None:
        callback, self._on_replied = self._on_replied, None
        if callback is not None:
            callback()


class ReplyLedger:
    """One sender's stream at this reducer: counts its parts as received and owed, and the replies as sent and paid.
    ``close`` when the stream ends: replies it will never get are owed no more, nor to parts that arrive after (a
    prefetch can still read the stream of a sender refused mid-way)."""

    def __init__(self, traffic: RoundTraffic):
        self.traffic, self.owed, self.closed = traffic, 0, False

    def received(self, size: int) -> None:
        self.traffic.received += size
        if not self.closed:
            self.owed += 1
            self.traffic.owe(1)

    def replied(self, size: int) -> None:
        self.traffic.sent += size
        if self.owed:  # a refusal answers a part that was never owed a reply of its own
            self.owed -= 1
            self.traffic.pay(1)

    def close(self) -> None:
        owed, self.owed, self.closed = self.owed, 0, True
        self.traffic.pay(owed)


async def ledgered_replies(requests: AsyncIterator, reduce, ledger: ReplyLedger) -> AsyncIterator:
    """``reduce(requests)``'s replies, with each request and reply entered in ``ledger``, closed when they end."""
    try:
        async for reply in reduce(counted(requests, ledger.received)):
            ledger.replied(reply.ByteSize())
            yield reply
    finally:
        ledger.close()


async def counted(messages: AsyncIterator, add) -> AsyncIterator:
    """``messages``, calling ``add(message.ByteSize())`` for each as it passes."""
    async for message in messages:
        add(message.ByteSize())
        yield message


class _CountingStub:
    """A reducer's stub whose ``rpc_aggregate_part`` answers are counted as received."""

    def __init__(self, stub, traffic: RoundTraffic):
        self._stub, self._traffic = stub, traffic

    def __getattr__(self, name: str):
        return getattr(self._stub, name)

    async def rpc_aggregate_part(self, requests: AsyncIterator, **kwargs) -> AsyncIterator:
        answers = await self._stub.rpc_aggregate_part(requests, **kwargs)
        return counted(answers, self._add_received)

    def _add_received(self, size: int) -> None:
        self._traffic.received += size


class TrafficCountingMixin:
    """Counts an ``AllReduceRunner``'s traffic and emits ``averaged`` (kind, group_size, weight, update_norm,
    bytes_sent, bytes_received, seconds, values, values_kept_local, senders_dropped) when its round completes; put it
    before ``AllReduceRunner``. The class sets ``round_kind``.

    A round "completes" also when groupmates failed in it: hivemind keeps this peer's own values for the parts a
    failed reducer held and averages a part without a sender that came too late. Only a round with both counts 0 at
    every peer left the group holding the same values."""

    round_kind: str

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.traffic = RoundTraffic()

    def _add_sent(self, size: int) -> None:
        self.traffic.sent += size

    def values_kept_local(self) -> int:
        """Values this round left as this peer had them: the parts whose reducer failed."""
        return self.tensor_part_container.failed_size

    def _get_peer_stub(self, peer):
        stub = super()._get_peer_stub(peer)
        if hasattr(stub, "wrap_wire_stub"):  # count the answers as they came, before they are decoded
            return stub.wrap_wire_stub(lambda wire_stub: _CountingStub(wire_stub, self.traffic))
        return _CountingStub(stub, self.traffic)

    def _generate_input_for_peer(self, peer_index: int) -> AsyncIterator:
        return counted(super()._generate_input_for_peer(peer_index), self._add_sent)

    def _accumulate_parts_streaming(self, stream: AsyncIterator, sender_index: int) -> AsyncIterator:
        if getattr(self._servicer_type, "counts_wire_bytes", False):  # it keeps the ledger of this side's messages
            return super()._accumulate_parts_streaming(stream, sender_index)
        reduce = super()._accumulate_parts_streaming
        return ledgered_replies(stream, lambda requests: reduce(requests, sender_index), ReplyLedger(self.traffic))

    async def run(self) -> AsyncIterator:
        started, update_square = time.monotonic(), 0.0
        async for delta in super().run():
            update_square += update_norm(delta) ** 2
            yield delta
        record = dict(
            kind=f"{self.round_kind}s",
            group_size=self.group_size,
            weight=self.weight,
            update_norm=round(math.sqrt(update_square), 6),
            seconds=round(time.monotonic() - started, 3),
            values=self.tensor_part_container.total_size,
            values_kept_local=self.values_kept_local(),
            senders_dropped=len(self.banned_senders),
        )
        traffic = self.traffic

        def report() -> None:
            events.emit("averaged", bytes_sent=traffic.sent, bytes_received=traffic.received, **record)

        # once this peer's replies to the other senders are counted too, without holding its step back
        traffic.when_replied(report, REPLIES_WAIT_SECONDS)


def update_norm(delta: torch.Tensor) -> float:
    """L2 norm of one all-reduce result (``average - local``) as the peer applies it: non-finite values count as 0,
    since they are kept local (``FiniteAllReduceRunner``). One pass without a copy when all are finite."""
    norm = float(torch.linalg.vector_norm(delta, dtype=torch.float32))
    if math.isfinite(norm):
        return norm
    finite = torch.nan_to_num(delta.float(), nan=0.0, posinf=0.0, neginf=0.0)
    return float(torch.linalg.vector_norm(finite, dtype=torch.float64))


def state_bytes(tensors) -> int:
    """The size of ``tensors`` in memory: what a state download carries with hivemind's default (no compression)."""
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors if isinstance(tensor, torch.Tensor))


def served_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """The in-memory size of what a donor serves of ``optimizer``: its parameters and every tensor of its
    ``state_dict``, which in the low-communication mode also holds the inner optimizer's statistics
    (collab.lowcomm.OuterNesterov), half of what travels there."""
    parameters = (param for group in optimizer.param_groups for param in group["params"])
    return state_bytes(chain(parameters, nested_flatten(optimizer.state_dict())))


def failed_round_reason(control: StepControl | None) -> str | None:
    """Why a step's gradient round gave no averages, as hivemind left its ``control`` once the step stopped waiting
    for it: ``"timeout"`` (still running after ``averaging_timeout``), ``"cancelled"`` (given up: ``round_given_up``)
    or the error's class name; None where it averaged, or where there was no round (no other peer)."""
    if control is None:
        return None
    if not control.done():
        return "timeout"
    if control.cancelled():
        return "cancelled"
    error = control.exception()
    return None if error is None else type(error).__name__


class OptimizerEventsMixin:
    """Emits ``step_begun`` as a global step triggers its gradient round, ``round_failed`` when that round gave no
    averages, ``round_scheduled`` when a gradient round is pre-scheduled, ``out_of_sync`` when the peer finds itself
    behind and ``state_loaded`` when a load of the state from peers moved it to a newer epoch; put it before
    ``hivemind.Optimizer``."""

    def _should_load_state_from_peers(self) -> bool:
        behind = super()._should_load_state_from_peers()
        if behind:
            events.emit("out_of_sync", epoch=self.local_epoch, global_epoch=self.tracker.global_epoch)
        return behind

    def _maybe_schedule_gradient_averaging(self) -> None:
        scheduled_before = self.scheduled_grads
        super()._maybe_schedule_gradient_averaging()
        if self.scheduled_grads is not scheduled_before:
            events.emit("round_scheduled", epoch=self.local_epoch)

    def _begin_averaging_gradients(self, grad_scaler) -> bool:
        # at the trigger, not as the step is entered: hivemind first waits (seconds under load) for the tracker's lock
        # and the previous step's delayed update, whose round must not read as this step's (bench.swarm's attribution)
        events.emit("step_begun", epoch=self.local_epoch)
        self._round_epoch = self.local_epoch  # the delayed step that reports the round runs once the epoch moved on
        return super()._begin_averaging_gradients(grad_scaler)

    def _average_gradients_and_load_into_optimizer(self, maybe_step_control: StepControl | None) -> None:
        # hivemind logs the failure and steps with local gradients: the event lets bench.swarm say why a round was lost
        super()._average_gradients_and_load_into_optimizer(maybe_step_control)
        reason = failed_round_reason(maybe_step_control)
        if reason is not None:
            events.emit("round_failed", epoch=getattr(self, "_round_epoch", self.local_epoch), reason=reason)

    def load_state_from_peers(self, **kwargs) -> None:
        epoch_before, started = self.local_epoch, time.monotonic()
        super().load_state_from_peers(**kwargs)
        averager = self.state_averager
        began = getattr(averager, "download_began", None)  # earlier than the load where begun at start-up
        started = started if began is None else min(started, began)
        tries = getattr(averager, "download_tries", None)
        if self.local_epoch > epoch_before:
            events.emit(
                "state_loaded",
                epoch=self.local_epoch,
                epoch_before=epoch_before,
                bytes=served_state_bytes(averager.optimizer),
                seconds=round(time.monotonic() - started, 3),
                tries=tries,
            )
        elif tries:  # donors were asked and none gave a state: its bytes crossed the link all the same
            events.emit(
                "state_not_loaded",
                epoch=self.local_epoch,
                seconds=round(time.monotonic() - started, 3),
                tries=tries,
                reason=getattr(averager, "load_failure", None),
            )
