"""Batches for one peer: a dataset from disk, a file or the Hub, the matching collator, and a per-peer data order.

Language-model tasks read the tokenized blocks that ``python -m data.prepare`` saves; fine-tuning tasks read raw
rows (``datasets`` names, folders saved with ``save_to_disk``, or json/jsonl/csv files) that their task prepares.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from datasets import Dataset, DatasetDict, load_dataset, load_from_disk
from torch.utils.data import DataLoader
from transformers import DataCollatorForLanguageModeling, PreTrainedTokenizerBase

from arguments import MASKED_LM
from collab.errors import SetupError

logger = logging.getLogger(__name__)

MODEL_INPUTS = (
    "input_ids",
    "attention_mask",
    "token_type_ids",
    "special_tokens_mask",
    "labels",
    "start_positions",
    "end_positions",
)
DATA_FILE_TYPES = {".json": "json", ".jsonl": "json", ".csv": "csv"}


def _is_local(source: str) -> bool:
    """A path (absolute, relative with ./, nested, or a data file), as opposed to a ``datasets`` name like owner/x."""
    return (
        Path(source).exists()
        or os.path.isabs(source)
        or source.startswith(".")
        or source.count("/") > 1
        or Path(source).suffix in DATA_FILE_TYPES
    )


def load_rows(source: str, split: str = "train", flag: str = "--dataset_path") -> Dataset:
    """One split of ``source``: a folder saved with ``save_to_disk``, a json/jsonl/csv file, or a ``datasets`` name.

    A data file or a saved plain Dataset has one split: it is the ``train`` split of --dataset_path and the whole
    of --validation_path. ``flag`` names the setting in error messages.
    """
    single_split_ok = split == "train" or flag == "--validation_path"
    if not _is_local(source):
        try:
            return load_dataset(source, split=split)
        except Exception as e:  # network, unknown name, missing split: all mean "this setting is wrong here"
            raise SetupError(f"{flag}: cannot load the {split!r} split of dataset {source!r} ({e})") from None
    path = Path(source)
    if not path.exists():
        raise SetupError(
            f"{flag}: no tokenized dataset or data file at {source}: run `make data` first "
            "(`python -m data.tasks` for the seq-cls/qa examples)"
        )
    if path.is_file():
        if path.suffix not in DATA_FILE_TYPES:
            raise SetupError(f"{flag}: {source} is not a .json, .jsonl or .csv file")
        dataset = _read_data_file(path, flag)
    else:
        try:
            dataset = load_from_disk(source)
        except Exception as e:
            raise SetupError(f"{flag}: {source} is not a dataset saved with save_to_disk ({e})") from None
        if isinstance(dataset, DatasetDict):
            if split not in dataset:
                raise SetupError(f"{flag}: {source} has no {split!r} split (found {list(dataset)})")
            return dataset[split]
    if not single_split_ok:
        raise SetupError(f"{flag}: {source} holds a single split; save a DatasetDict with {split!r}")
    return dataset


def _read_data_file(path: Path, flag: str) -> Dataset:
    try:
        return load_dataset(DATA_FILE_TYPES[path.suffix], data_files=str(path), split="train")
    except Exception as e:
        raise SetupError(f"{flag}: cannot read {path} ({e})") from None


def load_split(dataset_path: str, split: str = "train") -> Dataset:
    """One split of a tokenized dataset saved with ``save_to_disk`` (a plain Dataset is taken as the train split)."""
    return require_tokenized(load_rows(dataset_path, split), dataset_path)


def require_tokenized(dataset: Dataset, source: str, flag: str = "--dataset_path") -> Dataset:
    if "input_ids" not in dataset.column_names or len(dataset) == 0:
        raise SetupError(
            f"{flag}: {source} must hold tokenized rows with an 'input_ids' column (build them with `make data`)"
        )
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
    """The dataset as torch tensors of the columns the model and collator use (other columns stay in python)."""
    columns = [
        c for c in MODEL_INPUTS if c in dataset.column_names and (task == MASKED_LM or c != "special_tokens_mask")
    ]
    return dataset.with_format("torch", columns=columns)


def batch_stream(
    dataset: Dataset,
    collator,
    batch_size: int,
    data_seed: int,
    task: str,
    num_workers: int = 0,
    pin_memory: bool = False,
) -> Iterator[dict[str, torch.Tensor]]:
    """Endless batches, reshuffled on every pass over the data (in page-locked memory with ``pin_memory``, so the
    copy to a GPU runs asynchronously)."""
    dataset = model_inputs(dataset, task)
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=True,
        drop_last=len(dataset) >= batch_size,
        collate_fn=collator,
        generator=torch.Generator().manual_seed(data_seed),
        num_workers=num_workers,
        pin_memory=pin_memory,
    )
    while True:
        yield from loader


def one_pass(dataset: Dataset, collator, batch_size: int, task: str) -> DataLoader:
    """Every row once, in order (evaluation)."""
    return DataLoader(model_inputs(dataset, task), batch_size=batch_size, shuffle=False, collate_fn=collator)
