"""Held-out metrics of a model, one function per kind of task: the trainer's demo, the bench and the monitor use them.

Language models report ``eval_loss`` and ``eval_perplexity`` (comparable across checkpoints because the masking
is seeded), classifiers ``eval_loss`` and ``eval_accuracy``, extractive QA ``eval_loss``, ``eval_exact_match`` and
``eval_f1`` (SQuAD definitions, fractions in [0, 1]). These keys are what the web app's metrics API accepts.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from datasets import Dataset
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from arguments import QUESTION_ANSWERING, SEQUENCE_CLASSIFICATION
from trainer.data import make_collator, one_pass
from trainer.metrics import accuracy, squad_scores
from trainer.qa import predict_answers

EVAL_BATCH_SIZE = 16


@torch.no_grad()
def language_model_loss(
    model: PreTrainedModel,
    dataset: Dataset,
    tokenizer: PreTrainedTokenizerBase,
    task: str,
    batch_size: int = EVAL_BATCH_SIZE,
    seed: int = 0,
) -> float:
    """Mean loss over every block of ``dataset`` (masked or causal LM); the same ``seed`` masks the same tokens."""
    model.eval()
    total, count = 0.0, 0
    rng_state = torch.get_rng_state()
    torch.manual_seed(seed)  # the masked-LM collator masks with torch's global generator
    try:
        for batch in one_pass(dataset, make_collator(tokenizer, task), batch_size, task):
            batch = {name: tensor.to(model.device) for name, tensor in batch.items()}
            rows = len(batch["input_ids"])
            total += model(**batch).loss.item() * rows
            count += rows
    finally:
        torch.set_rng_state(rng_state)
    return total / count


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))


def language_model_metrics(model, dataset, tokenizer, task: str) -> dict[str, float]:
    loss = language_model_loss(model, dataset, tokenizer, task)
    return {"eval_loss": loss, "eval_perplexity": perplexity(loss)}


@torch.no_grad()
def _outputs(model: PreTrainedModel, dataset: Dataset, collator, task: str):
    """(mean loss, per-batch model outputs) over every row of ``dataset``, in order."""
    model.eval()
    total, count, outputs = 0.0, 0, []
    for batch in one_pass(dataset, collator, EVAL_BATCH_SIZE, task):
        batch = {name: tensor.to(model.device) for name, tensor in batch.items()}
        output = model(**batch)
        rows = len(batch["input_ids"])
        total += output.loss.item() * rows
        count += rows
        outputs.append((batch, output))
    return total / max(count, 1), outputs


def classification_metrics(model, dataset: Dataset, tokenizer, collator) -> dict[str, float]:
    """Loss and accuracy of the arg-max class."""
    loss, outputs = _outputs(model, dataset, collator, SEQUENCE_CLASSIFICATION)
    predictions = [p for _, out in outputs for p in out.logits.argmax(-1).tolist()]
    labels = [y for batch, _ in outputs for y in batch["labels"].tolist()]
    return {"eval_loss": loss, "eval_accuracy": accuracy(predictions, labels)}


def qa_metrics(model, features: Dataset, tokenizer, collator) -> dict[str, float]:
    """Loss, exact match and F1 of the best span over each example's windows."""
    loss, outputs = _outputs(model, features, collator, QUESTION_ANSWERING)
    starts, ends = [], []
    for _, out in outputs:
        starts += list(out.start_logits.float().cpu().numpy().astype(np.float32))
        ends += list(out.end_logits.float().cpu().numpy().astype(np.float32))
    answers = predict_answers(features, starts, ends)
    scores = squad_scores([p for p, _ in answers.values()], [gold for _, gold in answers.values()])
    return {"eval_loss": loss, "eval_exact_match": scores["exact_match"], "eval_f1": scores["f1"]}
