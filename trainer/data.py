"""Batches for one peer: a tokenized dataset on disk, the matching collator, and a per-peer data order."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from datasets import Dataset, DatasetDict, load_from_disk
from torch.utils.data import DataLoader
from transformers import DataCollatorForLanguageModeling, PreTrainedTokenizerBase

from trainer.model import MASKED_LM, SetupError

logger = logging.getLogger(__name__)

MODEL_INPUTS = ("input_ids", "attention_mask", "special_tokens_mask")


def load_split(dataset_path: str, split: str = "train") -> Dataset:
    """One split of a dataset saved with ``save_to_disk`` (a plain Dataset is taken as the train split)."""
    if not Path(dataset_path).exists():
        raise SetupError(f"--dataset_path: no tokenized dataset at {dataset_path}: run `make data` first")
    try:
        dataset = load_from_disk(dataset_path)
    except Exception as e:
        raise SetupError(f"--dataset_path: {dataset_path} is not a dataset saved with save_to_disk ({e})") from None
    if isinstance(dataset, DatasetDict):
        if split not in dataset:
            raise SetupError(f"--dataset_path: {dataset_path} has no {split!r} split (found {list(dataset)})")
        dataset = dataset[split]
    elif split != "train":
        raise SetupError(f"--dataset_path: {dataset_path} holds a single split; save a DatasetDict with {split!r}")
    if "input_ids" not in dataset.column_names or len(dataset) == 0:
        raise SetupError(f"--dataset_path: {dataset_path} must hold tokenized rows with an 'input_ids' column")
    return dataset


def load_train_split(dataset_path: str) -> Dataset:
    return load_split(dataset_path, "train")


def make_collator(tokenizer: PreTrainedTokenizerBase, task: str) -> DataCollatorForLanguageModeling:
    """Random 15% masking for masked LM; shifted labels for causal LM."""
    return DataCollatorForLanguageModeling(tokenizer=tokenizer, mlm=task == MASKED_LM, mlm_probability=0.15)


def peer_data_seed(seed: int, peer_public_key: bytes) -> int:
    """Each peer reads the data in its own order, reproducibly: the seed mixed with the peer's public key."""
    digest = hashlib.sha256(seed.to_bytes(8, "little", signed=True) + peer_public_key).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def model_inputs(dataset: Dataset, task: str) -> Dataset:
    """The dataset as torch tensors of the columns the model and collator use."""
    columns = [
        c for c in MODEL_INPUTS if c in dataset.column_names and (task == MASKED_LM or c != "special_tokens_mask")
    ]
    return dataset.with_format("torch", columns=columns)


def batch_stream(
    dataset: Dataset, collator, batch_size: int, data_seed: int, task: str, num_workers: int = 0
) -> Iterator[dict[str, torch.Tensor]]:
    """Endless batches, reshuffled on every pass over the data."""
    dataset = model_inputs(dataset, task)
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=True,
        drop_last=len(dataset) >= batch_size,
        collate_fn=collator,
        generator=torch.Generator().manual_seed(data_seed),
        num_workers=num_workers,
    )
    while True:
        yield from loader


def one_pass(dataset: Dataset, collator, batch_size: int, task: str) -> DataLoader:
    """Every row once, in order (evaluation)."""
    return DataLoader(model_inputs(dataset, task), batch_size=batch_size, shuffle=False, collate_fn=collator)
