"""The low-communication mode (``--local_steps H``): DiLoCo on hivemind's Optimizer, averagers and progress tracker.

Each peer trains with its own Lamb (state and learning rate kept local) on the model's parameters. hivemind's
offloaded optimizer holds the *anchor*: the parameters every peer agreed on at the last outer round. When the round
ends, each peer contributes its pseudo-gradient (anchor minus its parameters now), weighted by the samples it
processed, through hivemind's gradient all-reduce; the averaged pseudo-gradient drives an outer SGD step with
Nesterov momentum on the anchor. A global epoch is one outer round, so the loop, metrics, monitor, checkpoints and
dashboard see the same epochs, records and state layout as in the synchronous mode.

Round trigger: a round ends when the swarm has processed ``H x target_batch_size`` samples since the last one
(hivemind's own ProgressTracker rule). A slow peer then never holds the fast ones, a peer that leaves only stops
adding samples, and each peer's pseudo-gradient counts by the samples behind it.

Overlap: the all-reduce and the outer step run in the background (hivemind's delayed optimizer step) while the peer
takes its next inner steps. The new anchor is applied as soon as it is ready, at the latest at the next round's end:
the parameters move by (new anchor - parameters at the round's end), so the inner progress made meanwhile is kept,
re-based on the new anchor (``rebase_``), and counts toward the next pseudo-gradient.

Newcomers download the anchor, the outer momentum and the serving peer's Lamb state (all in the outer optimizer's
``state_dict``, which is also what the monitor's checkpoints hold) and start at that round.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Sequence
from functools import partial

import torch
from hivemind.utils import get_dht_time

from collab.averagers import (
    FiniteAveragingOptimizer,
    FiniteGradientAverager,
    FiniteTrainingStateAverager,
    bring_scheduler_to_epoch,
)
from collab.compression import PseudoGradientCodec, WireAveragerMixin
from collab.hivemind_fixes import PROGRESS_REPORT_PERIOD
from collab.repairs import LEFT_APART_REPAIR_SHARE, RepairRequests, next_epoch_in_reach, worth_a_repair

logger = logging.getLogger(__name__)


def round_target_samples(local_steps: int, target_batch_size: int) -> int:
    """Samples the swarm processes per outer round: ``local_steps`` synchronous global batches' worth."""
    return local_steps * target_batch_size


# Synchronous mode: every peer applies the same averaged gradients, so parameters only drift apart when a peer misses a
# gradient round; a parameter round every second epoch brings it back within two (tests/integration/
# test_parameter_rounds.py) at a quarter less traffic than every epoch (docs/benchmarks/2026-11-25-amd-epyc-2core.md).
SYNC_PARAMETER_ROUND_EVERY = 2
# Low-communication mode: parameter rounds (the anchor and the outer momentum, each in fp16) only repair a peer that
# missed a round (whole pseudo-gradient rounds leave peers alike: collab/shared_average.py), so they come as rarely as
# keeps them at PARAMETER_TRAFFIC_SHARE of the pseudo-gradients' bytes (each compression's bytes a value: ``python -m
# bench.compression``), or every MAX_PARAMETER_ROUND_EVERY rounds, the longest a missed round stays unrepaired
# (docs/benchmarks/2026-11-26-amd-epyc-2core-wan-full.md, 2026-11-30-amd-epyc-2core-shared-average.md). A peer left
# apart and a newcomer ask for one sooner (collab/repairs.py).
PARAMETER_ROUND_VALUES = 2  # per parameter: its anchor and its outer momentum
PARAMETER_ROUND_BYTES_PER_PARAMETER = 2.0 * PARAMETER_ROUND_VALUES
PSEUDO_GRADIENT_BYTES_PER_VALUE = {"fp16": 2.0, "8bit": 1.0, "topk": 0.079}
PARAMETER_TRAFFIC_SHARE = 0.125
MAX_PARAMETER_ROUND_EVERY = 32
MAX_REFRESH_PERIOD = 10.0  # seconds: the synchronous mode's longest wait between progress reads


def parameter_round_every(explicit: int | None, local_steps: int, pseudo_grad_compression: str) -> int:
    """Global epochs between parameter rounds: ``explicit`` where given, else SYNC_PARAMETER_ROUND_EVERY in the
    synchronous mode (``local_steps`` 0), else the fewest rounds whose parameter traffic stays within
    PARAMETER_TRAFFIC_SHARE of the pseudo-gradients', at most MAX_PARAMETER_ROUND_EVERY."""
    if explicit is not None:
        return explicit
    if local_steps == 0:
        return SYNC_PARAMETER_ROUND_EVERY
    pseudo_gradient = PSEUDO_GRADIENT_BYTES_PER_VALUE[pseudo_grad_compression]
    every = math.ceil(PARAMETER_ROUND_BYTES_PER_PARAMETER / (PARAMETER_TRAFFIC_SHARE * pseudo_gradient))
    return min(every, MAX_PARAMETER_ROUND_EVERY)


def inner_schedule_position(epoch: int, local_steps: int, round_samples: int, target_batch_size: int) -> int:
    """Where the inner learning-rate schedule stands, in global batches of ``target_batch_size`` samples (the
    synchronous mode's epochs), so that ``--warmup_steps`` and ``--total_steps`` mean the same samples in both modes.
    Outer round ``epoch`` spans batches ``epoch x H`` to ``epoch x H + H - 1``; ``round_samples`` is what the swarm has
    processed of it. One batch ahead of the synchronous mode, whose first batch runs at the warmup's rate 0: at H 1
    that would waste the whole first round."""
    within = min(local_steps - 1, max(0, round_samples) // target_batch_size)
    return epoch * local_steps + within + 1


def stretched_by_rounds(synchronous: float, local_steps: int, metadata_expiration: float) -> float:
    """A period of the synchronous mode (seconds) in the mode of ``local_steps``: as is at 0, else ``local_steps``
    times it (an outer round is that many synchronous epochs), at most half of ``metadata_expiration`` (every live
    progress record is still published and read twice in its lifetime)."""
    if local_steps == 0:
        return synchronous
    return min(synchronous * local_steps, metadata_expiration / 2)


def progress_report_period(explicit: float | None, local_steps: int, metadata_expiration: float) -> float:
    """Seconds between two publications of a peer's progress within a global epoch: ``explicit`` where given, else
    PROGRESS_REPORT_PERIOD ``stretched_by_rounds`` (records stay as many to a round). Each publication is a signed DHT
    store, the largest traffic between rounds (docs/benchmarks/2026-11-28-amd-epyc-2core-wan-control-traffic.md)."""
    if explicit is not None:
        return explicit
    return stretched_by_rounds(PROGRESS_REPORT_PERIOD, local_steps, metadata_expiration)


def max_refresh_period(explicit: float | None, local_steps: int, metadata_expiration: float, shortest: float) -> float:
    """The longest wait between two reads of the swarm's progress: ``explicit`` where given, else MAX_REFRESH_PERIOD
    ``stretched_by_rounds``, never under ``shortest`` (``--min_refresh_period``). hivemind reads sooner as the next
    epoch nears (its estimate over the expected drift), so this cap only spaces the reads far from a round: each read
    fetches every peer's signed record, the largest traffic between outer rounds once publications are spaced
    (docs/benchmarks/2026-11-29-intel-xeon-2core-progress-reads.md)."""
    if explicit is not None:
        return explicit
    return max(stretched_by_rounds(MAX_REFRESH_PERIOD, local_steps, metadata_expiration), shortest)


@torch.no_grad()
def pseudo_gradient_(out: torch.Tensor, anchor: torch.Tensor, current: torch.Tensor) -> torch.Tensor:
    """``out = anchor - current``: the outer optimizer's gradient, pointing away from the local progress."""
    return out.copy_(anchor.to(out.device)).sub_(current.to(out.device))


@torch.no_grad()
def rebase_(current: torch.Tensor, new_anchor: torch.Tensor, reference: torch.Tensor) -> None:
    """Move ``current`` by ``new_anchor - reference`` and make ``new_anchor`` the reference.

    ``reference`` is what ``current`` was at the round's end, so the inner steps taken since stay on top of the new
    anchor; applying the same anchor again changes nothing. ``new_anchor`` is read once: a background parameter round
    averages the anchors in place while the loop applies the outer step, and two reads would leave ``current`` off
    by what changed in between, an offset every later round would send as a pseudo-gradient."""
    snapshot = new_anchor.detach().clone()
    current.add_((snapshot - reference).to(current.device, current.dtype))
    reference.copy_(snapshot)


def shared_inner_state(inner_state: dict) -> dict:
    """The inner optimizer's ``state_dict`` without Lamb's per-step outputs, which peers could not exchange: Lamb
    makes ``trust_ratio`` a Python 1 where a norm is 0, so peers that stepped on different batches would hold
    different layouts and refuse each other's state."""
    from collab.optim import LAMB_STEP_OUTPUTS  # collab.optim imports this module

    state = {
        index: {key: value for key, value in param_state.items() if key not in LAMB_STEP_OUTPUTS}
        for index, param_state in inner_state["state"].items()
    }
    return {**inner_state, "state": state}


class OuterNesterov(torch.optim.SGD):
    """The outer optimizer (SGD with Nesterov momentum, as DiLoCo) over the anchors; its ``state_dict`` also carries
    the inner optimizer's, so newcomers, the monitor and checkpoints get the whole training state in one structure.

    Momentum buffers exist from the start (zeros give the same first step as torch's lazy copy): hivemind would
    otherwise run a step on zero gradients to create them, and a newcomer's state must have the server's layout."""

    def __init__(self, params, lr: float, momentum: float, inner: torch.optim.Optimizer):
        super().__init__(params, lr=lr, momentum=momentum, nesterov=momentum > 0, weight_decay=0.0)  # 0: plain SGD
        self.inner = inner
        for group in self.param_groups:
            for param in group["params"]:
                self.state[param]["momentum_buffer"] = torch.zeros_like(param)

    def state_dict(self) -> dict:
        state = super().state_dict()
        state["inner"] = shared_inner_state(self.inner.state_dict())
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's, keeping each momentum buffer's tensor (the loaded values copied into it): hivemind's state averager
        averages the buffers it was built with in place (``reuse_tensors``), so a buffer replaced by a load would leave
        parameter rounds averaging a stale copy, and the peer's momentum out of them."""
        state_dict = dict(state_dict)
        if "inner" not in state_dict:
            raise ValueError("low-communication optimizer state without the inner optimizer's ('inner')")
        self.inner.load_state_dict(state_dict.pop("inner"))
        buffers = {
            param: self.state[param]["momentum_buffer"] for group in self.param_groups for param in group["params"]
        }
        super().load_state_dict(state_dict)
        with torch.no_grad():
            for param, buffer in buffers.items():
                buffer.copy_(self.state[param]["momentum_buffer"])
                self.state[param]["momentum_buffer"] = buffer


def outer_optimizer_factory(lr: float, momentum: float, inner: torch.optim.Optimizer) -> Callable:
    """``param_groups -> OuterNesterov`` for hivemind, which builds it over its offloaded copies (the anchors).

    Only the groups' parameters are kept: the inner groups' weight decay must not shrink pseudo-gradients."""

    def make_outer(param_groups):
        return OuterNesterov([{"params": group["params"]} for group in param_groups], lr, momentum, inner)

    return make_outer


class LowCommStateAverager(FiniteTrainingStateAverager):
    """hivemind's TrainingStateAverager over the anchors, whose offloaded step re-bases the parameters
    (``rebase_``) instead of overwriting them, and whose epoch sets the inner learning-rate schedule at the round's
    first batch (``inner_schedule_position``; the optimizer moves it on within the round)."""

    def __init__(self, *, inner_scheduler=None, local_steps: int = 1, global_batch_size: int = 1, **kwargs):
        self.inner_scheduler = inner_scheduler
        self.local_steps, self.global_batch_size = local_steps, global_batch_size
        # the loop's thread moves the schedule within a round, hivemind's step thread to the next round's start
        self._schedule_lock = threading.Lock()
        self._replace_parameters = False
        super().__init__(**kwargs)
        self.round_reference = [anchor.detach().clone() for anchor in self._anchors()]
        self._update_scheduler()

    def _anchors(self) -> list[torch.Tensor]:
        return [param for group in self.optimizer.param_groups for param in group["params"]]

    @torch.no_grad()
    def capture_pseudo_gradient_(self, outputs: Sequence[torch.Tensor]) -> None:
        """At a round's end: this peer's pseudo-gradients into ``outputs``; its parameters become the reference."""
        for out, anchor, current, reference in zip(
            outputs, self._anchors(), self.main_parameters, self.round_reference, strict=True
        ):
            pseudo_gradient_(out, anchor, current)
            reference.copy_(current)

    @torch.no_grad()
    def _apply_optimizer_parameters_(self):
        if self._replace_parameters:
            super()._apply_optimizer_parameters_()
            for reference, anchor in zip(self.round_reference, self._anchors(), strict=True):
                reference.copy_(anchor)
            return
        for current, anchor, reference in zip(
            self.main_parameters, self._anchors(), self.round_reference, strict=True
        ):
            rebase_(current, anchor, reference)

    def load_state_from_peers(self, **kwargs):
        """The swarm's state replaces this peer's parameters outright: its local progress was made elsewhere."""
        self._replace_parameters = True
        try:
            return super().load_state_from_peers(**kwargs)
        finally:
            self._replace_parameters = False

    def _update_scheduler(self):
        super()._update_scheduler()
        self.advance_inner_schedule(round_samples=0)

    def advance_inner_schedule(self, round_samples: int) -> None:
        """The inner schedule at the swarm's position in this round, ``round_samples`` in (never back: a stale read
        of the swarm's progress must not undo a step already taken at a later rate)."""
        position = inner_schedule_position(self.local_epoch, self.local_steps, round_samples, self.global_batch_size)
        with self._schedule_lock:  # bring_scheduler_to_epoch checks, then moves: one thread at a time
            bring_scheduler_to_epoch(self.inner_scheduler, position)


class PseudoGradientAverager(WireAveragerMixin, FiniteGradientAverager):
    """hivemind's GradientAverager averaging pseudo-gradients instead of accumulated gradients.

    Its accumulators hold this peer's encoded contribution of the current round (``codec.encode_``, error feedback
    inside the codec), captured once at the round's end; a round that fails falls back to it, as hivemind falls back
    to local gradients. Samples are counted, gradients are not (the inner optimizer consumes them)."""

    round_kind = "pseudo-gradient"
    asks_shared_average = True  # every peer applies the same averaged pseudo-gradient (collab.shared_average)

    def __init__(self, *args, state_averager: LowCommStateAverager, codec: PseudoGradientCodec, **kwargs):
        self.state_averager, self.codec = state_averager, codec
        self.capture_on_next_load = False
        super().__init__(*args, **kwargs)

    def accumulate_grads_(self, batch_size: int):
        self.local_samples_accumulated += batch_size
        self.local_times_accumulated += 1

    @torch.no_grad()
    def load_accumulators_into_averager_(self):
        contributions = self._local_accumulators
        if self.capture_on_next_load:
            self.capture_on_next_load = False
            self.state_averager.capture_pseudo_gradient_(contributions)
            for index, contribution in enumerate(contributions):
                self.codec.encode_(index, contribution)
        with self.get_tensors() as averaged:
            for contribution, averaged_grad in zip(contributions, averaged, strict=True):
                averaged_grad.copy_(contribution, non_blocking=True)

    @torch.no_grad()
    def reset_accumulated_grads_(self):
        """Resets the counts only: the contribution stays for a fallback until the next round's capture."""
        self._accumulators_used_in_step = False
        self.local_samples_accumulated = self.local_times_accumulated = 0
        self._anchor_batch_size = None


class LowCommOptimizer(FiniteAveragingOptimizer):
    """hivemind.Optimizer in the low-communication mode: ``inner_optimizer`` steps at every ``step()``, the outer
    Nesterov step runs once per round of ``local_steps x target_batch_size`` swarm samples (module docstring).

    Raise ``local_steps`` when rounds take longer than ``local_steps`` inner steps (the link cannot keep up). The
    outer step multiplies a round's progress by up to 0.7 x 1.9 / 0.1 = 13 at steady momentum: use a lower inner
    ``learning_rate`` than the synchronous mode's, and lower ``outer_learning_rate`` if parameters grow each round."""

    # an anchor one outer step old would wait for a parameter round up to 32 rounds away: catching up asks for one
    catches_up_from_one_epoch_behind = True

    def __init__(
        self,
        *,
        inner_optimizer: torch.optim.Optimizer,
        inner_scheduler,
        codec: PseudoGradientCodec,
        local_steps: int,
        target_batch_size: int,
        outer_learning_rate: float,
        outer_momentum: float,
        repairs: RepairRequests | None = None,
        **kwargs,
    ):
        self.inner_optimizer, self.codec, self._inner_scheduler = inner_optimizer, codec, inner_scheduler
        self.local_steps, self.global_batch_size = local_steps, target_batch_size  # a synchronous epoch's samples
        self.repairs = repairs
        self._read_repairs_near_end_of: int | None = None
        super().__init__(
            optimizer=outer_optimizer_factory(outer_learning_rate, outer_momentum, inner_optimizer),
            params=[{"params": group["params"]} for group in inner_optimizer.param_groups],
            scheduler=None,
            target_batch_size=round_target_samples(local_steps, target_batch_size),
            grad_compression=codec.wire,
            grad_averager_factory=FiniteGradientAverager,  # replaced in _make_gradient_averager
            # A parameter round repairs what a missed round left apart: the anchor and the outer momentum. A momentum
            # left apart fades by 0.9 a round, but meanwhile pushes the anchors apart by 0.7 x 0.9 / 0.1 = 6.3 times
            # the difference (docs/benchmarks/2026-11-30-intel-xeon-2core-outer-momentum.md).
            average_opt_statistics=("momentum_buffer",),
            **kwargs,
        )

    state_averager_class = LowCommStateAverager

    def _state_averager_options(self) -> dict:
        schedule = {"local_steps": self.local_steps, "global_batch_size": self.global_batch_size}
        return {"inner_scheduler": self._inner_scheduler, **schedule}

    def _make_gradient_averager(self, factory, **kwargs):
        factory = partial(PseudoGradientAverager, state_averager=self.state_averager, codec=self.codec)
        return super()._make_gradient_averager(factory, **kwargs)

    @property
    def average_state_every(self) -> int:
        """hivemind starts a parameter round with epoch ``e`` when ``e % average_state_every == 0``, deciding in
        ``_update_global_epoch`` and pre-scheduling in ``_maybe_schedule_state_averaging``, both with ``e = max(local
        epoch + 1, the tracker's epoch)``. For an epoch with a repair requested (collab/repairs.py) this answers 1,
        so both places run one then, as at a regular parameter round."""
        if self.repairs is not None and self.repairs.due(max(self.local_epoch + 1, self.tracker.global_epoch)):
            return 1
        return self.regular_state_every

    @average_state_every.setter
    def average_state_every(self, every: int) -> None:
        self.regular_state_every = every

    def _maybe_schedule_state_averaging(self) -> None:
        """hivemind's, after reading the repair requests once more as the epoch nears its end (one read when it
        began may predate a request made since)."""
        near_end = self.tracker.estimated_next_update_time - get_dht_time() <= self.matchmaking_time
        if self.repairs is not None and near_end and self._read_repairs_near_end_of != self.local_epoch:
            self._read_repairs_near_end_of = self.local_epoch
            self.repairs.refresh()
        super()._maybe_schedule_state_averaging()

    def _update_global_epoch(self, grad_scaler) -> None:
        self.grad_averager.capture_on_next_load = True  # after the previous outer step is applied, before averaging
        super()._update_global_epoch(grad_scaler)
        if self.repairs is not None:
            self.repairs.refresh()

    def step(self, closure=None, batch_size: int | None = None, grad_scaler=None):
        """One inner step on this peer's gradients, then hivemind's bookkeeping: count the samples, apply a finished
        outer step, end the round when the swarm has processed its samples."""
        if closure is not None:
            raise ValueError("LowCommOptimizer.step takes no closure: compute the gradients before calling it")
        self._advance_inner_schedule()
        self.inner_optimizer.step()
        self._maybe_request_repair()
        return super().step(batch_size=batch_size, grad_scaler=grad_scaler)

    def _advance_inner_schedule(self) -> None:
        """The inner rate for the swarm's samples in this round: the tracker's count (this peer's up to now, the
        others' as of its last read) while it counts this peer's epoch, else none yet."""
        progress = self.tracker.global_progress
        round_samples = progress.samples_accumulated if progress.epoch == self.local_epoch else 0
        self.state_averager.advance_inner_schedule(round_samples)

    # Set by the thread that ends a round (hivemind's delayed step) when the round left this peer's anchor apart from
    # the swarm's; the next step asks for a parameter round, as a newcomer catching up does.
    left_apart = False
    # Set when this peer took an outer step with no other peer in sight. Peers that start together each take their
    # first steps so, unaware of the others: the first round it then averages with others leaves it apart too.
    stepped_alone = False

    def _load_local_gradients_into_optimizer(self):
        """hivemind's fallback to this peer's own pseudo-gradient when its round failed or found no groupmate. With
        other peers in the swarm its anchor then differs from theirs, for up to ``average_state_every`` rounds."""
        alone = self.tracker.global_progress.num_peers <= 1
        if not alone:
            self.left_apart = True  # its repair covers an earlier step alone too
        # hivemind loads the fallback through _load_averaged_gradients_into_optimizer_, which must take it for no
        # round with others: neither the count of an earlier round whose average this one did not use nor a step alone
        self.grad_averager.kept_local_last_round.value = 0
        self.stepped_alone = False
        super()._load_local_gradients_into_optimizer()
        self.stepped_alone = alone

    def _load_averaged_gradients_into_optimizer_(self):
        """hivemind's, noting a round that averaged enough values with no one to ask for a repair (a groupmate dropped
        out of it: ``worth_a_repair``), or the first one with others after this peer stepped alone: this peer's anchor
        may differ from the swarm's (a needless repair when the others' state came from this peer, as a lone
        founder's newcomers' does)."""
        kept_local = self.grad_averager.kept_local_last_round.value
        values = sum(parameter.numel() for parameter in self.state_averager.main_parameters)
        if worth_a_repair(kept_local, values) or self.stepped_alone:
            self.left_apart = True
        elif kept_local:
            logger.info(
                "The pseudo-gradient round averaged %d of this peer's %d values (%.2g %%) with no one: under %g %%, "
                "so they wait for the next regular parameter round rather than a repair",
                kept_local,
                values,
                100 * kept_local / values,
                100 * LEFT_APART_REPAIR_SHARE,
            )
        self.stepped_alone = False
        super()._load_averaged_gradients_into_optimizer_()

    def _maybe_request_repair(self) -> None:
        """Ask for a parameter round (collab/repairs.py) while catching up, to be made whole, or after a round left
        this peer apart (``left_apart``): once the tracker has read the swarm's progress since the download or the
        round (it times the request), and, while catching up, again once a requested round has passed without making
        it whole (no group formed, or part of it was kept local)."""
        catching_up = self.catching_up_since is not None
        if self.repairs is None or not (catching_up or self.left_apart):
            return
        averager = self.state_averager
        if averager.averaging_in_progress or (catching_up and not averager.state_lag.value):
            return  # a round still running, or one that made it whole (the next step ends catching up)
        requested, now = self.repairs.requested, get_dht_time()
        if requested is not None and requested >= self.local_epoch:
            self.left_apart = False  # the requested round, still to come, repairs that too
            return  # its round has not ended: it begins with the requested epoch
        if self.tracker.global_progress.next_fetch_time <= now:
            return  # the swarm's progress is overdue for a read (as after a download): its estimate would be stale
        seconds_left = self.tracker.estimated_next_update_time - now
        swarm_epoch = max(self.local_epoch, self.tracker.global_epoch)
        reason = "catching_up" if catching_up else "left_apart"
        self.repairs.request(swarm_epoch, next_epoch_in_reach(seconds_left, self.matchmaking_time), reason)
        self.left_apart = False

    def load_state_from_peers(self, **kwargs):
        super().load_state_from_peers(**kwargs)
        self.codec.reset()  # values held back belong to a trajectory this peer has left
