"""What a collaboration trains, chosen once at start-up with ``--task``: the model head, data, collator and metrics.

=========  ========================================  ===========================================  ====================
task       model class                               data (--dataset_path, --validation_path)     evaluation
=========  ========================================  ===========================================  ====================
mlm        AutoModelForMaskedLM                      tokenized blocks from ``python -m data.prepare``  loss, perplexity
clm        AutoModelForCausalLM                      the same                                     loss, perplexity
seq-cls    AutoModelForSequenceClassification        question, passage, label (BoolQ) or text, label   loss, accuracy
qa         AutoModelForQuestionAnswering             id, question, context, answers (SQuAD)       loss, exact match, F1
=========  ========================================  ===========================================  ====================

The training loop never looks at the task: every batch is ``model(**batch).loss``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from datasets import Dataset
from transformers import (
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    DataCollatorWithPadding,
    PreTrainedTokenizerBase,
)

from arguments import CAUSAL_LM, MASKED_LM, QUESTION_ANSWERING, SEQUENCE_CLASSIFICATION, DatasetArguments
from collab.errors import SetupError
from trainer.data import load_rows, make_collator, require_tokenized
from trainer.evaluate import classification_metrics, language_model_metrics, qa_metrics
from trainer.qa import qa_windows


@dataclass(frozen=True)
class Task:
    """One kind of training: the Auto class of its model and the functions that feed and score it.

    ``prepare(rows, tokenizer, dataset_args)`` turns raw rows into model inputs; ``collator(tokenizer)`` batches
    them; ``evaluate(model, prepared_rows, tokenizer)`` returns ``eval_*`` metrics; ``head_config(dataset_args)``
    holds config overrides the head needs (e.g. ``num_labels``).
    """

    name: str
    model_class: type
    prepare: Callable[[Dataset, PreTrainedTokenizerBase, DatasetArguments], Dataset]
    collator: Callable[[PreTrainedTokenizerBase], Callable]
    evaluate: Callable[..., dict[str, float]]
    head_config: Callable[[DatasetArguments], dict] = field(default=lambda args: {})

    def train_dataset(self, dataset_args: DatasetArguments, tokenizer: PreTrainedTokenizerBase) -> Dataset:
        """The ``train`` split of --dataset_path, prepared."""
        return self.prepare(load_rows(dataset_args.dataset_path, "train"), tokenizer, dataset_args)

    def validation(self, dataset_args: DatasetArguments, tokenizer, max_examples: int | None = None) -> Dataset:
        """--validation_path, else the ``validation`` split of --dataset_path: its first ``max_examples``, prepared."""
        if dataset_args.validation_path:
            rows = load_rows(dataset_args.validation_path, "validation", flag="--validation_path")
        else:
            rows = load_rows(dataset_args.dataset_path, "validation")
        if max_examples is not None and len(rows) > max_examples:
            rows = rows.select(range(max_examples))
        return self.prepare(rows, tokenizer, dataset_args)


def prepare_blocks(rows: Dataset, tokenizer, dataset_args: DatasetArguments) -> Dataset:
    """Language modelling reads blocks already tokenized by ``python -m data.prepare``."""
    return require_tokenized(rows, dataset_args.dataset_path)


def masked_lm_collator(tokenizer: PreTrainedTokenizerBase):
    if tokenizer.mask_token is None:
        raise SetupError("--task: mlm needs a tokenizer with a mask token; use --task clm for GPT-2-like models")
    return make_collator(tokenizer, MASKED_LM)


def classification_columns(column_names: list[str]) -> tuple[tuple[str, ...], str]:
    """(text columns, label column) of a classification dataset; a BoolQ ``answer`` (bool) serves as the label."""
    texts = ("question", "passage") if {"question", "passage"} <= set(column_names) else ("text",)
    label = next((c for c in ("label", "answer") if c in column_names), None)
    if not set(texts) <= set(column_names) or label is None:
        raise SetupError(
            "--task: seq-cls needs columns question, passage and label (BoolQ) or text and label; "
            f"the dataset has {', '.join(column_names)}"
        )
    return texts, label


def prepare_classification(rows: Dataset, tokenizer, dataset_args: DatasetArguments) -> Dataset:
    """Tokenized (question, passage) pairs or texts, cut at --max_seq_length tokens, with integer ``labels``."""
    texts, label = classification_columns(rows.column_names)

    def encode(batch):
        encoded = tokenizer(*(batch[c] for c in texts), truncation=True, max_length=dataset_args.max_seq_length)
        encoded["labels"] = [int(y) for y in batch[label]]
        return encoded

    prepared = rows.map(encode, batched=True, remove_columns=rows.column_names, desc="tokenizing")
    labels = set(prepared["labels"])
    if not labels <= set(range(dataset_args.num_labels)):
        raise SetupError(
            f"--num_labels: labels must be 0..{dataset_args.num_labels - 1}; the dataset has {sorted(labels)}"
        )
    return prepared


def prepare_qa(rows: Dataset, tokenizer, dataset_args: DatasetArguments) -> Dataset:
    return qa_windows(rows, tokenizer, dataset_args.max_seq_length, dataset_args.doc_stride)


def padding_collator(tokenizer: PreTrainedTokenizerBase) -> DataCollatorWithPadding:
    """Pads each batch to its longest row."""
    return DataCollatorWithPadding(tokenizer)


def _with_collator(metrics: Callable, collator: Callable) -> Callable[..., dict[str, float]]:
    return lambda model, dataset, tokenizer: metrics(model, dataset, tokenizer, collator(tokenizer))


TASKS: dict[str, Task] = {
    MASKED_LM: Task(
        MASKED_LM,
        AutoModelForMaskedLM,
        prepare_blocks,
        masked_lm_collator,
        partial(language_model_metrics, task=MASKED_LM),
    ),
    CAUSAL_LM: Task(
        CAUSAL_LM,
        AutoModelForCausalLM,
        prepare_blocks,
        partial(make_collator, task=CAUSAL_LM),
        partial(language_model_metrics, task=CAUSAL_LM),
        head_config=lambda args: {"is_decoder": True},  # BERT-like encoders need it to attend causally
    ),
    SEQUENCE_CLASSIFICATION: Task(
        SEQUENCE_CLASSIFICATION,
        AutoModelForSequenceClassification,
        prepare_classification,
        padding_collator,
        _with_collator(classification_metrics, padding_collator),
        head_config=lambda args: {"num_labels": args.num_labels},
    ),
    QUESTION_ANSWERING: Task(
        QUESTION_ANSWERING,
        AutoModelForQuestionAnswering,
        prepare_qa,
        padding_collator,
        _with_collator(qa_metrics, padding_collator),
    ),
}
