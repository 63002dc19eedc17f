"""Model and tokenizer from --model_name_or_path, or the built-in tiny BERT that needs no download."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoTokenizer,
    BertConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_MASKED_LM_MAPPING_NAMES

from arguments import DatasetArguments
from collab.entry import SetupError

logger = logging.getLogger(__name__)

MASKED_LM, CAUSAL_LM = "mlm", "clm"


def language_modeling_task(model_type: str) -> str:
    """Masked LM for BERT-like models (BERT, ALBERT, RoBERTa, DistilBERT...), causal LM for GPT-2-like ones."""
    if model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        return MASKED_LM
    if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return CAUSAL_LM
    raise SetupError(f"--model_name_or_path: model type {model_type!r} has no masked- or causal-LM head")


def tiny_bert_config(vocab_size: int) -> BertConfig:
    """The default model: a 2-layer BERT small enough to train on two CPU cores (about 1.5M parameters)."""
    return BertConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=512,
        max_position_embeddings=512,
    )


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


def build_model(
    dataset_args: DatasetArguments, tokenizer: PreTrainedTokenizerBase, seed: int
) -> tuple[PreTrainedModel, str]:
    """The model to train and its task (``mlm`` or ``clm``); pretrained weights when the source has them."""
    torch.manual_seed(seed)
    source: str | None = dataset_args.model_name_or_path
    if source is None:
        config = tiny_bert_config(len(tokenizer))
        return AutoModelForMaskedLM.from_config(config), MASKED_LM
    try:
        config = AutoConfig.from_pretrained(source)
    except (OSError, ValueError) as e:
        raise SetupError(f"--model_name_or_path: cannot load a model config from {source!r} ({e})") from None
    task = language_modeling_task(config.model_type)
    model_class = AutoModelForMaskedLM if task == MASKED_LM else AutoModelForCausalLM
    try:
        model = model_class.from_pretrained(source)
    except OSError:
        logger.warning("%s has a config but no weights: initialising the model from scratch", source)
        model = model_class.from_config(config)
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        logger.warning("Tokenizer has %d tokens, more than the model's embeddings: resizing", len(tokenizer))
        model.resize_token_embeddings(len(tokenizer))
    return model, task
