"""The monitor's held-out evaluation of the checkpoints it saves (the metric functions are in trainer/evaluate.py)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from datasets import Dataset
from transformers import PreTrainedModel

if TYPE_CHECKING:
    from arguments import DatasetArguments
    from trainer.tasks import Task

logger = logging.getLogger(__name__)


class CheckpointEvaluator:
    """The monitor's evaluation: every ``every`` saved checkpoints, the task's metrics on a bounded validation set.

    The validation set (``--validation_path``, else the ``validation`` split of ``--dataset_path``; at most
    ``max_examples`` examples) is read and prepared at the first evaluation. Any failure is logged and gives no
    metrics: the monitor goes on. Raise ``--eval_max_examples`` for a steadier figure, lower it if the monitor
    falls behind the collaboration's steps.
    """

    def __init__(self, task: Task, dataset_args: DatasetArguments, tokenizer, every: int, max_examples: int):
        self.task, self.dataset_args, self.tokenizer = task, dataset_args, tokenizer
        self.every, self.max_examples = every, max_examples
        self.saved = 0
        self._dataset: Dataset | None = None

    def after_checkpoint(self, model: PreTrainedModel) -> dict[str, float]:
        """Count one saved checkpoint; the ``eval_*`` metrics of ``model`` when an evaluation is due, else {}."""
        self.saved += 1
        if self.every <= 0 or self.saved % self.every:
            return {}
        try:
            if self._dataset is None:
                self._dataset = self.task.validation(self.dataset_args, self.tokenizer, self.max_examples)
            metrics = self.task.evaluate(model, self._dataset, self.tokenizer)
        except Exception as e:
            logger.warning("Evaluation failed (%s: %s); the next checkpoint will try again", type(e).__name__, e)
            return {}
        logger.info("Evaluation: %s", "  ".join(f"{k} {v:.4g}" for k, v in metrics.items()))
        return metrics
