"""Held-out loss of a language model: comparable across checkpoints because the masking is seeded."""

from __future__ import annotations

import math

import torch
from datasets import Dataset
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from trainer.data import make_collator, one_pass


@torch.no_grad()
def language_model_loss(
    model: PreTrainedModel,
    dataset: Dataset,
    tokenizer: PreTrainedTokenizerBase,
    task: str,
    batch_size: int = 16,
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
