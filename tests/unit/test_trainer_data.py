"""Per-peer data order and batches from the sample dataset."""

import itertools

import pytest
import torch

from arguments import CAUSAL_LM, MASKED_LM, DatasetArguments
from collab.errors import SetupError
from trainer.data import batch_stream, load_train_split, make_collator, peer_data_seed
from trainer.model import language_modeling_task, load_tokenizer

pytestmark = pytest.mark.light


def test_each_peer_has_its_own_reproducible_order():
    assert peer_data_seed(42, b"peer-a") == peer_data_seed(42, b"peer-a")
    assert peer_data_seed(42, b"peer-a") != peer_data_seed(42, b"peer-b")
    assert peer_data_seed(42, b"peer-a") != peer_data_seed(43, b"peer-a")


def test_masked_lm_batches(sample_data):
    tokenizer = load_tokenizer(DatasetArguments(tokenizer_path=str(sample_data / "tokenizer")))
    dataset = load_train_split(str(sample_data / "tokenized"))
    collator = make_collator(tokenizer, MASKED_LM)

    def first_batches(seed):
        # the original tokens (masking draws from torch's global RNG; the order is what the seed fixes)
        batches = itertools.islice(batch_stream(dataset, collator, 4, seed, MASKED_LM), 2)
        return [torch.where(b["labels"] == -100, b["input_ids"], b["labels"]) for b in batches]

    batch = next(batch_stream(dataset, collator, 4, 0, MASKED_LM))
    assert set(batch) == {"input_ids", "attention_mask", "labels"}
    assert batch["input_ids"].shape == (4, 128)
    masked = batch["labels"] != -100
    assert 0 < masked.float().mean() < 0.3
    assert (batch["input_ids"][masked] == tokenizer.mask_token_id).any()
    same, other = first_batches(1), first_batches(2)
    assert all(torch.equal(a, b) for a, b in zip(first_batches(1), same, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(same, other, strict=True))


def test_task_follows_the_model_type():
    assert language_modeling_task("bert") == MASKED_LM
    assert language_modeling_task("albert") == MASKED_LM
    assert language_modeling_task("gpt2") == CAUSAL_LM
    with pytest.raises(SetupError, match="--model_name_or_path"):
        language_modeling_task("not-a-model")


def test_missing_data_says_what_to_do(tmp_path):
    with pytest.raises(SetupError, match="--dataset_path: no tokenized dataset .* run `make data` first"):
        load_train_split(str(tmp_path / "nothing"))
