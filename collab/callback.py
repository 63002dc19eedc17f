"""What a trainer does around each step besides training: publish metrics, keep a backup, roll back on NaN."""

from __future__ import annotations

import copy
import logging
import math
from dataclasses import dataclass

import hivemind
import torch
from hivemind.utils import get_dht_time

from collab.schema import LocalMetrics, metrics_key

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


class CollaborativeCallback:
    """Publishes this peer's LocalMetrics once per new global epoch and guards the parameters.

    - ``on_train_begin``: download the collaboration's state (hivemind retries with ``load_state_timeout`` each try).
    - ``on_step_end``: sum losses; when the global epoch changes, publish LocalMetrics (only while in sync, so a
      lagging peer does not report stale loss); every ``backup_every_steps`` epochs keep an in-memory backup.
    - non-finite parameters are replaced by the last backup, so a bad step never spreads to the next round.
    """

    def __init__(
        self,
        dht: hivemind.DHT,
        optimizer: hivemind.Optimizer,
        model: torch.nn.Module,
        local_public_key: bytes,
        experiment_prefix: str,
        statistics_expiration: float,
        backup_every_steps: int,
    ):
        self.dht, self.optimizer, self.model = dht, optimizer, model
        self.local_public_key, self.key = local_public_key, metrics_key(experiment_prefix)
        self.statistics_expiration, self.backup_every_steps = statistics_expiration, backup_every_steps
        self.last_epoch = optimizer.local_epoch
        self.loss_sum, self.mini_steps, self.samples = 0.0, 0, 0
        self.backup = None
        self.rollbacks = 0

    def on_train_begin(self) -> None:
        logger.info("Loading the collaboration's state from peers (if any)")
        self.optimizer.load_state_from_peers()
        self.last_epoch = self.optimizer.local_epoch
        self.backup = self._take_backup()
        logger.info("Starting at global epoch %d", self.last_epoch)

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
        metrics = LocalMetrics(
            step=epoch,
            samples_per_second=samples_per_second if math.isfinite(samples_per_second) else 0.0,
            samples_accumulated=self.samples,
            loss=float(self.loss_sum),
            mini_steps=self.mini_steps,
        )
        published = self.optimizer.is_synchronized_with_peers()
        if published:
            self.dht.store(
                key=self.key,
                subkey=self.local_public_key,
                value=metrics.dict(),
                expiration_time=get_dht_time() + self.statistics_expiration,
                return_future=True,
            )
        report = EpochReport(
            epoch=epoch,
            loss=self.loss_sum / max(1, self.mini_steps),
            mini_steps=self.mini_steps,
            samples=self.samples,
            samples_per_second=metrics.samples_per_second,
            published=published,
        )
        self.loss_sum, self.mini_steps, self.samples = 0.0, 0, 0
        return report

    @torch.no_grad()
    def parameters_are_finite(self) -> bool:
        return all(torch.isfinite(param).all() for param in self.model.parameters())

    @torch.no_grad()
    def _take_backup(self) -> dict:
        return {
            "model": {name: tensor.detach().clone() for name, tensor in self.model.state_dict().items()},
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
        }

    @torch.no_grad()
    def restore_backup(self) -> None:
        """Put back the last backup in the model and, when offloaded, in the optimizer's own parameter copies."""
        self.rollbacks += 1
        logger.warning("Parameters became NaN or infinite: restoring the backup (rollback #%d)", self.rollbacks)
        self.optimizer.state_averager.step(wait_for_delayed_updates=True)
        self.model.load_state_dict(self.backup["model"])
        self.optimizer.load_state_dict(copy.deepcopy(self.backup["optimizer"]))
        optimized = [param for group in self.optimizer.opt.param_groups for param in group["params"]]
        main = [param for group in self.optimizer.param_groups for param in group["params"]]
        for opt_param, main_param in zip(optimized, main, strict=True):
            if opt_param is not main_param:
                opt_param.copy_(main_param)
        if self.optimizer.grad_averager is not None:
            self.optimizer.grad_averager.reset_accumulated_grads_()
        self.loss_sum, self.mini_steps, self.samples = 0.0, 0, 0
