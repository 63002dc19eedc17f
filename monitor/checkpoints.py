"""The monitor's checkpoints: download the collaboration's state from peers and keep it on disk.

The state is downloaded into a ``TrainingStateAverager`` built by the same factory as the trainers' optimizer
(``collab.optim.build_state_averager``), so the checkpoint is exactly what the peers train. A download that fails
or times out is logged and retried at the next refresh; the monitor never hangs or dies of it.

A peer can serve a state under any epoch: one more than ``epoch_tolerance`` global steps from the swarm's honest step
is not saved, and checkpoint folders that far past the swarm (a liar's, saved by an older version, or an earlier
run's) are renamed ``rejected-<step>`` so that saving, pruning and uploading go on from the swarm's step.
"""

from __future__ import annotations

import logging
import math
import os
import time
from pathlib import Path

from arguments import MetricsArguments
from collab import events
from collab.checkpoint import (
    VerifiedCheckpoints,
    latest_checkpoint,
    prune_checkpoints,
    remove_partial_saves,
    write_checkpoint,
)

logger = logging.getLogger(__name__)


def is_due(step: int, last_saved_step: int | None, interval: int) -> bool:
    """A checkpoint is due at the first step seen, then whenever ``interval`` global steps have passed."""
    return last_saved_step is None or step - last_saved_step >= interval


def epoch_in_reach(epoch: int, step: int, tolerance: int) -> bool:
    """A downloaded state's ``epoch`` is the swarm's when it is within ``tolerance`` global steps of its ``step``."""
    return abs(epoch - step) <= tolerance


def default_epoch_tolerance(step_lag: int, load_timeout: float) -> int:
    """How far an honest state's epoch can be from the step seen before downloading it: peers ``step_lag`` apart,
    plus the epochs that pass during a download of up to ``load_timeout`` seconds (at most one a second)."""
    return step_lag + math.ceil(load_timeout)


def set_aside_checkpoints_past(repo_path: str | os.PathLike, step: int) -> list[Path]:
    """Rename the checkpoint folders of steps past ``step`` to ``rejected-<step>`` (kept for a person to look at,
    no longer seen as checkpoints); returns their new paths."""
    moved = []
    for folder in Path(repo_path).iterdir():
        if folder.is_dir() and folder.name.isdigit() and int(folder.name) > step:
            target = folder.with_name(f"rejected-{folder.name}")
            suffix = 0
            while target.exists():
                suffix += 1
                target = folder.with_name(f"rejected-{folder.name}-{suffix}")
            moved.append(folder.rename(target))
    return moved


class CheckpointSaver:
    """Every ``interval`` global steps: load the state from peers, write ``<repo_path>/<step>/``, keep the last N.

    ``retry_period`` bounds how often a failed download is tried again (seconds). ``evaluator`` scores the
    downloaded model in memory after a save (see ``evaluate``). ``epoch_tolerance`` (global steps, see the module
    docstring and ``default_epoch_tolerance``) bounds how far a saved epoch may be from the swarm's step.
    """

    def __init__(
        self,
        state_averager,
        model,
        tokenizer,
        repo_path: str,
        interval: int,
        keep: int,
        load_timeout: float,
        retry_period: float = 30.0,
        evaluator=None,
        epoch_tolerance: int | None = None,
    ):
        self.averager, self.model, self.tokenizer = state_averager, model, tokenizer
        self.repo_path, self.interval, self.keep = Path(repo_path), interval, keep
        self.load_timeout, self.retry_period = load_timeout, retry_period
        if epoch_tolerance is None:
            epoch_tolerance = default_epoch_tolerance(MetricsArguments.alive_step_lag, load_timeout)
        self.epoch_tolerance = epoch_tolerance
        self._next_try = 0.0
        self.evaluator = evaluator  # monitor.evaluate.CheckpointEvaluator, or None: never evaluate
        self.verified = VerifiedCheckpoints()  # each kept checkpoint is hashed once, not at every save
        partial = remove_partial_saves(self.repo_path)
        found = latest_checkpoint(self.repo_path, self.verified.read_manifest)
        self.last_saved_step: int | None = found[1].step if found else None
        if found:
            logger.info(
                "Latest valid checkpoint: %s (global step %d); saving goes on from there", found[0], found[1].step
            )
        events.emit(
            "checkpoints_found",
            step=self.last_saved_step,
            folder=str(found[0]) if found else None,
            partial_saves_removed=len(partial),
        )

    def maybe_save(self, step: int, loss: float | None, peers: int) -> Path | None:
        """Save a checkpoint if one is due at the swarm's honest global ``step``; returns its folder, or None."""
        if self.last_saved_step is not None and self.last_saved_step - step > self.epoch_tolerance:
            self._forget_checkpoints_past(step + self.epoch_tolerance)
        if not is_due(step, self.last_saved_step, self.interval) or time.monotonic() < self._next_try:
            return None
        epoch = self.download()
        if epoch is not None and not epoch_in_reach(epoch, step, self.epoch_tolerance):
            logger.warning(
                "Not saving the state of global epoch %d: the swarm is at step %d (more than %d apart); will retry",
                epoch,
                step,
                self.epoch_tolerance,
            )
            events.emit("checkpoint_refused", epoch=epoch, step=step)
            epoch = None
        if epoch is None or (self.last_saved_step is not None and epoch <= self.last_saved_step):
            self._next_try = time.monotonic() + self.retry_period
            return None
        self.averager._update_scheduler()
        folder = write_checkpoint(
            self.repo_path, epoch, self.model, self.tokenizer, self.optimizer_state(epoch), loss=loss, peers=peers
        )
        self.last_saved_step = epoch
        removed = prune_checkpoints(self.repo_path, self.keep, self.verified.read_manifest)
        logger.info("Saved checkpoint %s%s", folder, f" (removed {len(removed)} older)" if removed else "")
        events.emit("checkpoint_saved", step=epoch, folder=str(folder), removed=len(removed))
        return folder

    def _forget_checkpoints_past(self, limit: int) -> None:
        moved = set_aside_checkpoints_past(self.repo_path, limit)
        found = latest_checkpoint(self.repo_path, self.verified.read_manifest)
        logger.warning(
            "Checkpoints past global step %d, where the swarm is not (a liar's state or an earlier run), renamed: "
            "%s; saving goes on from %s",
            limit,
            ", ".join(folder.name for folder in moved) or "none",
            f"step {found[1].step}" if found else "the swarm's step",
        )
        self.last_saved_step = found[1].step if found else None

    def evaluate(self) -> dict[str, float]:
        """``eval_*`` metrics of the model just saved when an evaluation is due (the evaluator counts saves)."""
        return self.evaluator.after_checkpoint(self.model) if self.evaluator is not None else {}

    def download(self) -> int | None:
        """The global epoch of the state downloaded from peers, or None if no peer delivered one in time."""
        averager = self.averager
        previous_epoch = averager.local_epoch
        averager.local_epoch = -1  # accept any peer's state; a stale one is rejected below by its epoch
        # hivemind steps the scheduler once per epoch of the state it loads: a liar's 2^39 would take months.
        # maybe_save brings it up to date once the epoch is known to be the swarm's.
        scheduler, averager.scheduler = averager.scheduler, None
        started = time.monotonic()
        try:
            averager.load_state_from_peers(timeout=self.load_timeout)
        except Exception as e:  # a timeout, a peer that left mid-download, ...: try again later
            logger.warning("Downloading the state from peers failed (%s: %s); will retry", type(e).__name__, e)
        finally:
            averager.scheduler = scheduler
        if averager.local_epoch < 0:
            averager.local_epoch = previous_epoch
            logger.warning("No peer sent its state within %.0f s; will retry", self.load_timeout)
            return None
        logger.info(
            "Downloaded the state of global epoch %d in %.1f s", averager.local_epoch, time.monotonic() - started
        )
        return averager.local_epoch

    def optimizer_state(self, epoch: int) -> dict:
        """``hivemind.Optimizer.state_dict()`` form (Lamb state with ``local_epoch``) plus the scheduler."""
        state = self.averager.optimizer.state_dict()
        state["state"]["local_epoch"] = epoch
        scheduler = self.averager.scheduler
        return {"optimizer": state, "scheduler": scheduler.state_dict() if scheduler is not None else None}
