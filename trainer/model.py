"""Model and tokenizer from --model_name_or_path, or the built-in tiny BERT that needs no download; --task's head."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoTokenizer,
    BertConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_MASKED_LM_MAPPING_NAMES

from arguments import CAUSAL_LM, MASKED_LM, DatasetArguments
from collab.errors import SetupError
from trainer.tasks import TASKS

logger = logging.getLogger(__name__)

__all__ = ["build_model", "language_modeling_task", "load_tokenizer", "model_config", "model_skeleton"]


def language_modeling_task(model_type: str) -> str:
    """Masked LM for BERT-like models (BERT, ALBERT, RoBERTa, DistilBERT...), causal LM for GPT-2-like ones."""
    if model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        return MASKED_LM
    if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return CAUSAL_LM
    raise SetupError(f"--model_name_or_path: model type {model_type!r} has no masked- or causal-LM head")


def tiny_bert_config(vocab_size: int, **overrides) -> BertConfig:
    """The default model: a 2-layer BERT small enough to train on two CPU cores (about 1.5M parameters)."""
    settings = dict(
        vocab_size=vocab_size,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=512,
        max_position_embeddings=512,
    )
    return BertConfig(**{**settings, **overrides})


def load_tokenizer(dataset_args: DatasetArguments) -> PreTrainedTokenizerBase:
    """The model's own tokenizer when its folder or Hub repo has one, else --tokenizer_path."""
    sources = [dataset_args.model_name_or_path, dataset_args.tokenizer_path]
    for source in filter(None, sources):
        try:
            tokenizer = AutoTokenizer.from_pretrained(source)
        except (OSError, ValueError) as e:
            logger.debug("No tokenizer at %s: %s", source, e)
            continue
        if tokenizer.pad_token is None and tokenizer.eos_token is not None:
            tokenizer.pad_token = tokenizer.eos_token  # GPT-2 style tokenizers have no padding token
        return tokenizer
    if not Path(dataset_args.tokenizer_path).exists():
        raise SetupError(f"--tokenizer_path: no tokenizer at {dataset_args.tokenizer_path}: run `make data` first")
    raise SetupError(f"--tokenizer_path: {dataset_args.tokenizer_path} holds no loadable tokenizer")


def model_config(dataset_args: DatasetArguments, tokenizer: PreTrainedTokenizerBase):
    """The config of ``--model_name_or_path`` (the built-in tiny BERT without one), with ``--task``'s head settings."""
    head_config = TASKS[dataset_args.task].head_config(dataset_args)
    source = dataset_args.model_name_or_path
    if source is None:
        return tiny_bert_config(len(tokenizer), pad_token_id=tokenizer.pad_token_id or 0, **head_config)
    try:
        return AutoConfig.from_pretrained(source, **head_config)
    except (OSError, ValueError) as e:
        raise SetupError(f"--model_name_or_path: cannot load a model config from {source!r} ({e})") from None


def model_skeleton(dataset_args: DatasetArguments, tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
    """The model of ``--task`` with its shapes and no values (on the meta device): its sizes before anything is
    loaded, at no memory."""
    with torch.device("meta"):
        return TASKS[dataset_args.task].model_class.from_config(model_config(dataset_args, tokenizer))


def build_model(
    dataset_args: DatasetArguments, tokenizer: PreTrainedTokenizerBase, seed: int
) -> tuple[PreTrainedModel, str]:
    """The model of ``--task`` and the task's name; pretrained weights when the source has them.

    Weights the task's head needs and the checkpoint lacks (a classifier on a masked-LM checkpoint, say) are
    initialised from ``seed``, and a warning lists them: they must be trained before the model is useful.
    """
    task = TASKS[dataset_args.task]
    torch.manual_seed(seed)
    config = model_config(dataset_args, tokenizer)
    source: str | None = dataset_args.model_name_or_path
    if source is None:
        return task.model_class.from_config(config), task.name
    try:
        model, info = task.model_class.from_pretrained(
            source, config=config, ignore_mismatched_sizes=True, output_loading_info=True
        )
        new_weights = sorted({*info.get("missing_keys", ()), *(k for k, *_ in info.get("mismatched_keys", ()))})
        if new_weights:
            logger.warning(
                "%s has no weights for %d parameters of --task %s; initialised them (train before use): %s",
                source,
                len(new_weights),
                task.name,
                ", ".join(new_weights),
            )
    except ValueError as e:  # the Auto class has no head of this kind for this model type
        raise SetupError(f"--task: {config.model_type} models have no {task.name} head ({e})") from None
    except OSError:
        logger.warning("%s has a config but no weights: initialising the model from scratch", source)
        model = task.model_class.from_config(config)
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        logger.warning("Tokenizer has %d tokens, more than the model's embeddings: resizing", len(tokenizer))
        model.resize_token_embeddings(len(tokenizer))
    return model, task.name
