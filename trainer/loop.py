"""The local training loop: forward, backward, clip, optimizer.step, metrics. One readable story."""

from __future__ import annotations

import contextlib
import logging
import math
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import hivemind
import torch
from tqdm.auto import tqdm

from arguments import TrainingArguments
from collab import events
from collab.callback import CollaborativeCallback, EpochReport
from collab.errors import ConfigError
from trainer.ranks import RankSync, ShardedRankSync, StepStart

logger = logging.getLogger(__name__)

LOSS_SCALE_INIT = 2.0**16  # fp16's first loss scale (torch's default), also after a restored backup


@dataclass
class TrainingSummary:
    """What this peer did, for the closing log line and the demo."""

    start_epoch: int
    end_epoch: int = 0
    reports: list[EpochReport] = field(default_factory=list)
    skipped_batches: int = 0
    rollbacks: int = 0

    @property
    def first_loss(self) -> float | None:
        return self.reports[0].loss if self.reports else None

    @property
    def last_loss(self) -> float | None:
        return self.reports[-1].loss if self.reports else None


def format_report(report: EpochReport, peers: int) -> str:
    """The one line per global epoch that people read: ``epoch 12 | loss 3.412 | 88.1 samples/s | 3 peers``."""
    return f"epoch {report.epoch} | loss {report.loss:.4f} | {report.samples_per_second:.1f} samples/s | {peers} peers"


class NonFiniteStreak:
    """Mini-batches dropped in a row for a non-finite loss or gradients, and what the peer does about them.

    A streak of ``limit`` means the state itself is broken (fp16's loss scale halves at every such batch, so by then no
    scale is left to blame): the peer restores its last backup. Another streak before the restored state has taken
    ``limit`` steps in a row means it is broken too, and the peer stops: a peer that drops (almost) every batch
    computes for nothing and looks alive.
    """

    RESTORE, DIVERGED = "restore", "diverged"

    def __init__(self, limit: int):
        self.limit, self.dropped_in_a_row, self.stepped_in_a_row, self.restored = limit, 0, 0, False

    def dropped(self) -> str | None:
        """Count one dropped mini-batch; ``RESTORE`` or ``DIVERGED`` once a streak reaches the limit, else None."""
        self.dropped_in_a_row += 1
        self.stepped_in_a_row = 0
        if self.dropped_in_a_row < self.limit:
            return None
        self.dropped_in_a_row = 0
        if self.restored:
            return self.DIVERGED
        self.restored = True
        return self.RESTORE

    def stepped(self) -> None:
        self.dropped_in_a_row = 0
        self.stepped_in_a_row += 1
        if self.stepped_in_a_row >= self.limit:
            self.restored = False  # the restored state proved itself


def diverged_error(limit: int, learning_rate: float) -> ConfigError:
    return ConfigError(
        f"--learning_rate: training diverged ({limit} mini-batches in a row had a non-finite loss or gradients, "
        f"also after restoring the last backup); lower --learning_rate (now {learning_rate:g}) and start again",
        field="learning_rate",
    )


SHORT_EPOCH_FACTOR = 2.0  # epochs shorter than this many matchmaking_times make averaging rounds overlap
SHORT_EPOCH_WINDOW = 3  # epochs whose median length is judged


def short_epoch_warning(epoch_seconds: list[float], matchmaking_time: float) -> str | None:
    """The operator's fix when the last epochs were too short for matchmaking, else None.

    An epoch cannot end before the previous epoch's background update has finished, and hivemind 1.1.12 starts
    matching a parameter round only when its epoch ends, so that round takes at least ``matchmaking_time``: shorter
    epochs stall, and shorter still, rounds pair up across epochs (docs/benchmarks/2026-11-25-amd-epyc-2core.md)."""
    if len(epoch_seconds) < SHORT_EPOCH_WINDOW:
        return None
    typical = statistics.median(epoch_seconds[-SHORT_EPOCH_WINDOW:])
    if typical >= SHORT_EPOCH_FACTOR * matchmaking_time:
        return None
    return (
        f"Global epochs last {typical:.1f} s, less than {SHORT_EPOCH_FACTOR:g}x --matchmaking_time "
        f"({matchmaking_time:g} s): averaging rounds overlap and fall out of step. Raise --target_batch_size "
        "(or lower --matchmaking_time) so that an epoch lasts several times matchmaking_time"
    )


SLOW_STEP_WINDOW = 5  # optimizer steps whose median interval is judged


def slow_step_warning(step_seconds: list[float], matchmaking_time: float) -> str | None:
    """The operator's fix when this peer's optimizer steps are further apart than ``matchmaking_time``, else None.

    hivemind arranges a peer's gradient round at a step within ``matchmaking_time`` of the epoch's end, and checks
    the peer's epoch at the first step of each: a peer whose steps are further apart misses its epoch's group and
    often reloads the state, losing the samples it had accumulated (``python -m bench.slow_peer``,
    docs/RELIABILITY.md)."""
    if len(step_seconds) < SLOW_STEP_WINDOW:
        return None
    typical = statistics.median(step_seconds[-SLOW_STEP_WINDOW:])
    if typical <= matchmaking_time:
        return None
    return (
        f"This peer calls the optimizer every {typical:.1f} s, more than --matchmaking_time ({matchmaking_time:g} s): "
        "its averaging rounds start after the others' groups have formed and it falls out of sync with faster peers. "
        "Lower --gradient_accumulation_steps (hivemind accumulates toward --target_batch_size by itself) or "
        "--per_device_train_batch_size so that a step takes less than matchmaking_time"
    )


@dataclass
class IntervalTimer:
    """Times the intervals between calls of ``ended`` (global epochs, optimizer steps) and logs ``warning``'s
    advice on them once. Keeps the last ``KEPT`` intervals: a peer steps millions of times in a long run."""

    KEPT = 100

    warning: Callable[[list[float], float], str | None]
    matchmaking_time: float
    seconds: list[float] = field(default_factory=list)
    last_end: float | None = None
    warned: bool = False

    def ended(self, now: float) -> None:
        if self.last_end is not None:
            self.seconds.append(now - self.last_end)
            del self.seconds[: -self.KEPT]
        self.last_end = now
        advice = None if self.warned else self.warning(self.seconds, self.matchmaking_time)
        if advice is not None:
            logger.warning(advice)
            self.warned = True


def flush_denormals() -> bool:
    """Compute with subnormal floats (below 1.2e-38) as zeros on this CPU; call before any other thread starts.

    x86 CPUs can take many times longer over subnormal values, training meets them after some Lamb steps, and values
    that small are rounding noise next to the weights they update (docs/benchmarks/2026-11-25-amd-epyc-2core.md).
    Threads started later (OpenMP's pool, hivemind's background step) inherit the setting. Returns whether
    the CPU supports it (x86 with SSE3; elsewhere it does nothing)."""
    return torch.set_flush_denormal(True)


def autocast_dtype(training_args: TrainingArguments, device: torch.device) -> torch.dtype | None:
    """The dtype the forward pass autocasts to on ``device``, None for fp32.

    ``--bf16`` (which takes the place of ``--fp16``, on by default): bfloat16 on GPUs that have it (compute capability
    8.0 and newer) and on CPUs, without loss scaling (bfloat16 has fp32's range); ``--fp16``: float16 with loss
    scaling on GPUs, while CPUs train in fp32."""
    if training_args.bf16:
        if device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
            raise ConfigError(
                f"--bf16: GPU {device} has no bfloat16 arithmetic (it needs compute capability 8.0+: A100, RTX 30xx "
                "or newer): leave --bf16 out to train in fp16"
            )
        return torch.bfloat16
    if training_args.fp16 and device.type == "cuda":
        return torch.float16
    return None


def amp_context(device: torch.device, enabled: bool, dtype: torch.dtype = torch.float16):
    return torch.autocast(device_type=device.type, dtype=dtype) if enabled else contextlib.nullcontext()


def accumulate_gradients(
    model: torch.nn.Module,
    batches: Iterator[dict[str, torch.Tensor]],
    accumulation: int,
    device: torch.device,
    amp_dtype: torch.dtype | None,
    scale: Callable[[torch.Tensor], torch.Tensor],
) -> float:
    """Forward and backward ``accumulation`` mini-batches, each loss multiplied by ``scale`` (the fp16 loss scale);
    returns their mean loss."""
    loss_value = 0.0
    for _ in range(accumulation):
        batch = {name: tensor.to(device, non_blocking=True) for name, tensor in next(batches).items()}
        with amp_context(device, amp_dtype is not None, amp_dtype or torch.float16):
            loss = model(**batch).loss / accumulation
        scale(loss).backward()
        loss_value += loss.item()
    return loss_value


def train(
    model: torch.nn.Module,
    optimizer: hivemind.Optimizer,
    callback: CollaborativeCallback,
    batches: Iterator[dict[str, torch.Tensor]],
    training_args: TrainingArguments,
    device: torch.device,
    stop: threading.Event,
    amp_dtype: torch.dtype | None,
    sharded_model: torch.nn.Module | None = None,
) -> TrainingSummary:
    """Train until ``stop`` is set or the global epoch reaches ``max_steps``.

    Mini-batches with a non-finite loss or gradient are dropped before they reach the optimizer, so one bad batch
    never enters an averaging round. With ``amp_dtype`` (see ``autocast_dtype``) the forward pass runs under autocast;
    for float16 each mini-batch is also scaled and unscaled before clipping: plain PyTorch AMP, as hivemind advises
    when reuse_grad_buffers is off (its GradScaler is only needed with reuse_grad_buffers, which we do not use).

    Under torchrun this is rank 0's loop: the other ranks run ``follow``, and every step starts from rank 0's
    parameters and steps on the gradients of all ranks (``trainer.ranks``). With ``sharded_model`` (``--shard_model``)
    the ranks compute on their shards of it, and ``model`` is the whole model in host memory that hivemind trains.
    """
    scaler = torch.amp.GradScaler(device.type, init_scale=LOSS_SCALE_INIT, enabled=amp_dtype == torch.float16)
    streak = NonFiniteStreak(training_args.nonfinite_batch_limit)
    sync = RankSync(model, device) if sharded_model is None else ShardedRankSync(sharded_model, device, model)
    samples_per_step = optimizer.batch_size_per_step * sync.ranks.world_size
    accumulation = training_args.gradient_accumulation_steps
    summary = TrainingSummary(start_epoch=optimizer.local_epoch)
    model.train()
    sync.model.train()
    epochs = IntervalTimer(short_epoch_warning, optimizer.matchmaking_time)
    steps = IntervalTimer(slow_step_warning, optimizer.matchmaking_time)
    bar = tqdm(
        total=optimizer.target_batch_size, unit="samples", desc="global batch", disable=None, dynamic_ncols=True
    )

    def step_start() -> StepStart:
        keep_going = not stop.is_set() and not reached_max_steps(optimizer.local_epoch, training_args.max_steps)
        return StepStart(keep_going, optimizer.local_epoch, scaler.get_scale())

    try:
        while sync.start_step(step_start()).keep_going:
            loss_value = accumulate_gradients(sync.model, batches, accumulation, device, amp_dtype, scaler.scale)
            # before unscaling: a rank's overflow reaches this scaler, which then backs off for every rank
            loss_value = sync.reduce_gradients(loss_value)
            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), training_args.max_grad_norm)
            if not (math.isfinite(loss_value) and torch.isfinite(grad_norm)):
                summary.skipped_batches += 1
                logger.warning("Dropping a mini-batch with non-finite loss or gradients (loss %s)", loss_value)
                events.emit("batch_dropped", epoch=optimizer.local_epoch, skipped_batches=summary.skipped_batches)
                scaler.update()
                optimizer.zero_grad()
                action = streak.dropped()
                if action == NonFiniteStreak.DIVERGED:
                    raise diverged_error(streak.limit, training_args.learning_rate)
                if action == NonFiniteStreak.RESTORE:
                    callback.restore_backup("nonfinite_batches")
                    scaler.update(LOSS_SCALE_INIT)  # the streak halved the scale to nothing
                continue
            streak.stepped()
            scaler.step(optimizer, batch_size=samples_per_step)
            scaler.update()
            optimizer.zero_grad()
            steps.ended(time.monotonic())

            report = callback.on_step_end(loss_value, samples_per_step)
            progress = optimizer.tracker.global_progress
            if report is not None:
                epochs.ended(time.monotonic())
                summary.reports.append(report)
                bar.reset(total=optimizer.target_batch_size)
                logger.info(format_report(report, progress.num_peers))
            bar.n = min(progress.samples_accumulated, optimizer.target_batch_size)
            bar.set_postfix(
                epoch=optimizer.local_epoch, loss=f"{loss_value:.3f}", peers=progress.num_peers, refresh=False
            )
            bar.refresh()
    finally:
        bar.close()
    summary.end_epoch = optimizer.local_epoch
    summary.rollbacks = callback.rollbacks
    return summary


def follow(
    model: torch.nn.Module,
    batches: Iterator[dict[str, torch.Tensor]],
    training_args: TrainingArguments,
    device: torch.device,
    amp_dtype: torch.dtype | None,
    sharded: bool = False,
) -> int:
    """The loop of a torchrun rank other than 0: gradients on its own mini-batches, averaged into rank 0's step, and
    rank 0's parameters at the start of each step. Returns rank 0's last global epoch once rank 0 stops; signals are
    rank 0's to act on (torchrun sends them to every rank). ``sharded``: ``model`` is this rank's shard of it."""
    sync = ShardedRankSync(model, device) if sharded else RankSync(model, device)
    model.train()
    while (start := sync.start_step(None)).keep_going:
        loss_value = accumulate_gradients(
            model,
            batches,
            training_args.gradient_accumulation_steps,
            device,
            amp_dtype,
            lambda loss, scale=start.loss_scale: loss * scale,
        )
        sync.reduce_gradients(loss_value)
        model.zero_grad(set_to_none=False)
    return start.epoch


def reached_max_steps(epoch: int, max_steps: int) -> bool:
    return max_steps > 0 and epoch >= max_steps
