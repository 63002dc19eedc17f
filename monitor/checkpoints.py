"""The monitor's checkpoints: download the collaboration's state from peers and keep it on disk.

The state is downloaded into a ``TrainingStateAverager`` built by the same factory as the trainers' optimizer
(``collab.optim.build_state_averager``), so the checkpoint is exactly what the peers train. A download that fails
or times out is logged and retried at the next refresh; the monitor never hangs or dies of it.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from collab.checkpoint import latest_checkpoint, prune_checkpoints, remove_partial_saves, write_checkpoint

logger = logging.getLogger(__name__)


def is_due(step: int, last_saved_step: int | None, interval: int) -> bool:
    """A checkpoint is due at the first step seen, then whenever ``interval`` global steps have passed."""
    return last_saved_step is None or step - last_saved_step >= interval


class CheckpointSaver:
    """Every ``interval`` global steps: load the state from peers, write ``<repo_path>/<step>/``, keep the last N.

    ``retry_period`` bounds how often a failed download is tried again (seconds). ``evaluator`` scores the
    downloaded model in memory after a save (see ``evaluate``).
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
    ):
        self.averager, self.model, self.tokenizer = state_averager, model, tokenizer
        self.repo_path, self.interval, self.keep = Path(repo_path), interval, keep
        self.load_timeout, self.retry_period = load_timeout, retry_period
        self._next_try = 0.0
        self.evaluator = evaluator  # trainer.evaluate.CheckpointEvaluator, or None: never evaluate
        remove_partial_saves(self.repo_path)
        found = latest_checkpoint(self.repo_path)
        self.last_saved_step: int | None = found[1].step if found else None
        if found:
            logger.info(
                "Latest valid checkpoint: %s (global step %d); saving goes on from there", found[0], found[1].step
            )

    def maybe_save(self, step: int, loss: float | None, peers: int) -> Path | None:
        """Save a checkpoint if one is due at this global ``step``; returns its folder, or None."""
        if not is_due(step, self.last_saved_step, self.interval) or time.monotonic() < self._next_try:
            return None
        epoch = self.download()
        if epoch is None or (self.last_saved_step is not None and epoch <= self.last_saved_step):
            self._next_try = time.monotonic() + self.retry_period
            return None
        folder = write_checkpoint(
            self.repo_path, epoch, self.model, self.tokenizer, self.optimizer_state(epoch), loss=loss, peers=peers
        )
        self.last_saved_step = epoch
        removed = prune_checkpoints(self.repo_path, self.keep)
        logger.info("Saved checkpoint %s%s", folder, f" (removed {len(removed)} older)" if removed else "")
        return folder

    def evaluate(self) -> dict[str, float]:
        """``eval_*`` metrics of the model just saved when an evaluation is due (the evaluator counts saves)."""
        return self.evaluator.after_checkpoint(self.model) if self.evaluator is not None else {}

    def download(self) -> int | None:
        """The global epoch of the state downloaded from peers, or None if no peer delivered one in time."""
        averager = self.averager
        previous_epoch = averager.local_epoch
        averager.local_epoch = -1  # accept any peer's state; a stale one is rejected below by its epoch
        started = time.monotonic()
        try:
            averager.load_state_from_peers(timeout=self.load_timeout)
        except Exception as e:  # a timeout, a peer that left mid-download, ...: try again later
            logger.warning("Downloading the state from peers failed (%s: %s); will retry", type(e).__name__, e)
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
