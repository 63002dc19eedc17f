"""What a trainer does around each step besides training: publish metrics, keep a backup, roll back on NaN."""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import hivemind
import pydantic
import torch
from hivemind.utils import get_dht_time

from collab import events
from collab.checkpoint import OPTIMIZER_STATE, load_model, load_optimizer_state, opened_checkpoint
from collab.errors import CheckpointError
from collab.schema import LocalMetrics, metrics_key

if TYPE_CHECKING:  # collab.averagers imports this module (all_finite)
    from collab.averagers import BoundedLoadOptimizer

logger = logging.getLogger(__name__)


@dataclass
class EpochReport:
    """What the peer did during the global epoch that just ended."""

    epoch: int
    loss: float  # mean over the epoch's mini-steps
    mini_steps: int
    samples: int
    samples_per_second: float
    published: bool


@torch.no_grad()
def all_finite(tensors: Iterable[torch.Tensor], fused: bool | None = None) -> bool:
    """Whether every value of every tensor is finite, with a single device sync.

    A float32 sum of absolute values is NaN or infinite whenever one of its values is; finite values can only make it
    overflow beyond about 1e32 per value, which we count as diverged too. ``fused`` (the default off the CPU, where a
    step is bound by kernel launches): torch's multi-tensor norm, a few kernels for the whole model; else one
    reduction per tensor, ten times faster than ``isfinite(p).all()`` per tensor on the CPU."""
    tensors = list(tensors)
    if not tensors:
        return True
    if fused is None:
        fused = tensors[0].device.type != "cpu"
    if fused:
        sums = torch._foreach_norm(tensors, 1, dtype=torch.float32)
    else:
        sums = [tensor.sum(dtype=torch.float32) for tensor in tensors]
    return bool(torch.isfinite(torch.stack(sums)).all())


@dataclass(frozen=True)
class ResumePoint:
    """A verified monitor checkpoint read into memory: what ``--resume_from`` puts into place."""

    path: str
    step: int
    weights: dict
    optimizer_state: dict


def read_resume_point(path: str, model_class: type) -> ResumePoint:
    """Verify ``path`` (a folder, or the web app's ``checkpoint-<step>.tar.gz``) against its manifest and read it;
    nothing in it is unpickled beyond tensors and plain data. Read before the DHT starts: bad input costs nothing."""
    try:
        with opened_checkpoint(path) as (folder, manifest):
            weights = load_model(folder, model_class).state_dict()
            state = load_optimizer_state(folder)
    except CheckpointError as e:
        raise CheckpointError(f"--resume_from: {e}") from None
    if not isinstance(state, dict) or "optimizer" not in state:
        raise CheckpointError(f"--resume_from: {path}: {OPTIMIZER_STATE} holds no optimizer state")
    return ResumePoint(path, manifest.step, weights, state["optimizer"])


# a rollback event's reason, and what the log says of it
ROLLBACK_REASONS = {
    "nonfinite_parameters": "Parameters became NaN or infinite",
    "nonfinite_batches": "--nonfinite_batch_limit mini-batches in a row had a non-finite loss or gradients",
}


class CollaborativeCallback:
    """Publishes this peer's LocalMetrics once per new global epoch and guards the parameters.

    - ``on_train_begin``: download the collaboration's state (bounded tries, a different donor each: averagers.py).
    - ``on_step_end``: sum losses; when the global epoch changes, publish LocalMetrics (only while in sync, so a
      lagging peer does not report stale loss); every ``backup_every_steps`` epochs keep an in-memory backup.
    - non-finite parameters are replaced by the last backup, so a bad step never spreads to the next round.
    """

    def __init__(
        self,
        dht: hivemind.DHT,
        optimizer: BoundedLoadOptimizer,
        model: torch.nn.Module,
        local_public_key: bytes,
        experiment_prefix: str,
        statistics_expiration: float,
        backup_every_steps: int,
        public_name: str | None = None,
    ):
        self.dht, self.optimizer, self.model = dht, optimizer, model
        self.local_public_key, self.key = local_public_key, metrics_key(experiment_prefix)
        self.statistics_expiration, self.backup_every_steps = statistics_expiration, backup_every_steps
        self.last_epoch = optimizer.local_epoch
        self.loss_sum, self.mini_steps, self.samples = 0.0, 0, 0
        # what this peer has contributed: the epochs it published, in sync with the swarm, and their samples
        self.public_name, self.contributed_samples, self.contributed_epochs = public_name, 0, 0
        self.backup = None
        self.rollbacks = 0

    def on_train_begin(self, resume: ResumePoint | None = None) -> None:
        """Start from ``resume`` (a verified monitor checkpoint) if given, then take any newer state the peers have."""
        if resume is not None:
            self.resume_from(resume)
        logger.info("Loading the collaboration's state from peers (if any)")
        self.optimizer.load_state_from_peers()
        self.last_epoch = self.optimizer.local_epoch
        self.backup = self._take_backup()
        logger.info("Starting at global epoch %d", self.last_epoch)
        events.emit("started", epoch=self.last_epoch)

    def on_step_end(self, loss: float, samples: int) -> EpochReport | None:
        """Record one optimizer.step of ``samples`` samples; returns a report when a new global epoch began."""
        if not self.parameters_are_finite():
            self.restore_backup()
            return None
        self.loss_sum += loss
        self.mini_steps += 1
        self.samples += samples
        if self.optimizer.local_epoch == self.last_epoch:
            return None
        report = self._end_epoch()
        if self.optimizer.local_epoch % self.backup_every_steps == 0:
            self.backup = self._take_backup()
        return report

    def _end_epoch(self) -> EpochReport:
        self.last_epoch = epoch = self.optimizer.local_epoch
        samples_per_second = float(self.optimizer.local_progress.samples_per_second)
        if not math.isfinite(samples_per_second):
            samples_per_second = 0.0
        in_sync = self.optimizer.is_synchronized_with_peers()
        metrics = self._metrics(epoch, samples_per_second, in_sync)
        published = in_sync and metrics is not None
        if published:
            self.dht.store(
                key=self.key,
                subkey=self.local_public_key,
                value=metrics.to_record(),
                expiration_time=get_dht_time() + self.statistics_expiration,
                return_future=True,
            )
        report = EpochReport(
            epoch=epoch,
            loss=self.loss_sum / max(1, self.mini_steps),
            mini_steps=self.mini_steps,
            samples=self.samples,
            samples_per_second=samples_per_second,
            published=published,
        )
        self.loss_sum, self.mini_steps, self.samples = 0.0, 0, 0
        events.emit(
            "epoch",
            epoch=epoch,
            samples=report.samples,
            loss=report.loss,
            mini_steps=report.mini_steps,
            samples_per_second=report.samples_per_second,
            published=published,
        )
        return report

    def _metrics(self, epoch: int, samples_per_second: float, in_sync: bool) -> LocalMetrics | None:
        """This epoch's record (its samples counted as contributed when ``in_sync``), or None with a warning when a
        value is past the record's bounds: a diverged loss must not stop the peer, nor reach the swarm's records."""
        contributed_samples = self.contributed_samples + (self.samples if in_sync else 0)
        contributed_epochs = self.contributed_epochs + int(in_sync)
        try:
            metrics = LocalMetrics(
                step=epoch,
                samples_per_second=samples_per_second,
                samples_accumulated=self.samples,
                loss=float(self.loss_sum),
                mini_steps=self.mini_steps,
                contributed_samples=contributed_samples,
                contributed_epochs=contributed_epochs,
                public_name=self.public_name,
            )
        except pydantic.ValidationError as e:
            problems = "; ".join(error["msg"] for error in e.errors())
            logger.warning("Not publishing the metrics of epoch %d (training may have diverged): %s", epoch, problems)
            return None
        if in_sync:
            self.contributed_samples, self.contributed_epochs = contributed_samples, contributed_epochs
        return metrics

    def parameters_are_finite(self) -> bool:
        return all_finite(self.model.parameters())

    @torch.no_grad()
    def _take_backup(self) -> dict:
        """Copies in host memory: on a GPU peer a backup on the device would take as much GPU memory as the model."""
        return {
            "model": {name: tensor.detach().to("cpu", copy=True) for name, tensor in self.model.state_dict().items()},
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
        }

    def restore_backup(self, reason: str = "nonfinite_parameters") -> None:
        """Put back the last in-memory backup of the model and the optimizer, for ``reason`` (``ROLLBACK_REASONS``)."""
        self.rollbacks += 1
        logger.warning("%s: restoring the backup (rollback #%d)", ROLLBACK_REASONS[reason], self.rollbacks)
        events.emit("rollback", epoch=self.optimizer.local_epoch, rollbacks=self.rollbacks, reason=reason)
        self._load_training_state(self.backup["model"], copy.deepcopy(self.backup["optimizer"]))
        self.optimizer.values_put_back()

    def resume_from(self, resume: ResumePoint) -> None:
        """Put a checkpoint's model and optimizer state into place, at the checkpoint's global epoch."""
        try:
            self._load_training_state(resume.weights, resume.optimizer_state)
        except (KeyError, ValueError, TypeError, RuntimeError) as e:
            raise CheckpointError(
                f"--resume_from: {resume.path}: the model or {OPTIMIZER_STATE} does not fit this model "
                f"({type(e).__name__}); resume with the --task and --model_name_or_path it was trained with"
            ) from None
        self.optimizer.state_averager.local_epoch = resume.step
        self.optimizer.state_averager._update_scheduler()
        logger.info("Resumed from checkpoint %s (global epoch %d)", resume.path, resume.step)
        events.emit("resumed", epoch=resume.step, path=str(resume.path))

    @torch.no_grad()
    def _load_training_state(self, model_state: dict, optimizer_state: dict) -> None:
        """Model weights and ``hivemind.Optimizer.state_dict()`` into place, offloaded copies and buffers included."""
        self.optimizer.state_averager.step(wait_for_delayed_updates=True)
        self.model.load_state_dict(model_state)
        self.optimizer.load_state_dict(optimizer_state)
        optimized = [param for group in self.optimizer.opt.param_groups for param in group["params"]]
        main = [param for group in self.optimizer.param_groups for param in group["params"]]
        for opt_param, main_param in zip(optimized, main, strict=True):
            if opt_param is not main_param:
                opt_param.copy_(main_param)
        if self.optimizer.grad_averager is not None:
            self.optimizer.grad_averager.reset_accumulated_grads_()
        self.loss_sum, self.mini_steps, self.samples = 0.0, 0, 0
