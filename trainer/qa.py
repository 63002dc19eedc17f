"""Extractive question answering (SQuAD): contexts cut into overlapping windows, answers mapped to token spans.

A context longer than ``max_seq_length`` (question included) becomes several windows that overlap by
``doc_stride`` tokens, so an answer near a window's edge is whole in at least one window. A training window that
does not hold the whole answer points both positions at the [CLS] token ("no answer here"). At prediction time
every window proposes its best span and the highest-scoring one wins; spans longer than ``max_answer_length``
tokens, or outside the context, are never proposed.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from datasets import Dataset
from transformers import PreTrainedTokenizerBase

from collab.errors import SetupError

QA_COLUMNS = ("id", "question", "context", "answers")
MAX_ANSWER_LENGTH = 30  # tokens
N_BEST = 20
QA_FEATURES = ("start_positions", "end_positions", "example_id", "context", "answer_texts", "offset_mapping")


def answer_token_span(
    offsets: Sequence[tuple[int, int]], sequence_ids: Sequence[int | None], start_char: int, end_char: int, cls_index=0
) -> tuple[int, int]:
    """Token positions (start, end) of the answer's characters [start_char, end_char) in one window.

    ``sequence_ids`` marks context tokens with 1. A window that does not hold the whole answer gives
    (cls_index, cls_index).
    """
    context = [i for i, sid in enumerate(sequence_ids) if sid == 1]
    if not context or offsets[context[0]][0] > start_char or offsets[context[-1]][1] < end_char:
        return cls_index, cls_index
    start = next(i for i in context if offsets[i][1] > start_char)
    end = next(i for i in reversed(context) if offsets[i][0] < end_char)
    return start, end


def check_qa_columns(dataset: Dataset, flag: str = "--dataset_path") -> None:
    missing = [c for c in QA_COLUMNS if c not in dataset.column_names]
    if missing:
        raise SetupError(
            f"{flag}: --task qa needs SQuAD's columns {', '.join(QA_COLUMNS)}; missing {', '.join(missing)} "
            f"(found {', '.join(dataset.column_names)})"
        )


def qa_windows(dataset: Dataset, tokenizer: PreTrainedTokenizerBase, max_seq_length: int, doc_stride: int) -> Dataset:
    """Tokenized windows with ``start_positions``/``end_positions`` for training and, for evaluation, the
    ``example_id``, the context's ``offset_mapping`` (None outside the context), ``context`` and gold ``answer_texts``.
    """
    if not tokenizer.is_fast:
        raise SetupError("--tokenizer_path: --task qa needs a fast tokenizer (it maps characters to tokens)")
    check_qa_columns(dataset)

    def encode(batch):
        encoded = tokenizer(
            [q.lstrip() for q in batch["question"]],
            batch["context"],
            truncation="only_second",
            max_length=max_seq_length,
            stride=doc_stride,
            return_overflowing_tokens=True,
            return_offsets_mapping=True,
        )
        features: dict[str, list] = {name: [] for name in QA_FEATURES}
        for i, offsets in enumerate(encoded["offset_mapping"]):
            row = encoded["overflow_to_sample_mapping"][i]
            sequence_ids = encoded.sequence_ids(i)
            input_ids = encoded["input_ids"][i]
            cls_index = input_ids.index(tokenizer.cls_token_id) if tokenizer.cls_token_id in input_ids else 0
            answers = batch["answers"][row]
            span = (cls_index, cls_index)
            if answers["text"]:
                start_char = answers["answer_start"][0]
                end_char = start_char + len(answers["text"][0])
                span = answer_token_span(offsets, sequence_ids, start_char, end_char, cls_index)
            features["start_positions"].append(span[0])
            features["end_positions"].append(span[1])
            features["example_id"].append(str(batch["id"][row]))
            features["context"].append(batch["context"][row])
            features["answer_texts"].append(list(answers["text"]))
            features["offset_mapping"].append(
                [tuple(o) if sid == 1 else None for o, sid in zip(offsets, sequence_ids, strict=True)]
            )
        encoded.pop("overflow_to_sample_mapping")
        encoded.pop("offset_mapping")
        return {**encoded, **features}

    return dataset.map(encode, batched=True, remove_columns=dataset.column_names, desc="QA windows")


def best_span(
    start_logits: np.ndarray,
    end_logits: np.ndarray,
    offsets: Sequence[tuple[int, int] | None],
    max_answer_length: int = MAX_ANSWER_LENGTH,
    n_best: int = N_BEST,
) -> tuple[float, int, int] | None:
    """(score, start_char, end_char) of the best span inside the context in one window, or None if there is none.

    The score is start logit + end logit; only the ``n_best`` highest start and end positions are tried.
    """
    length = len(offsets)
    starts = np.argsort(start_logits[:length])[::-1][:n_best]
    ends = np.argsort(end_logits[:length])[::-1][:n_best]
    best = None
    for s in starts:
        for e in ends:
            if offsets[s] is None or offsets[e] is None or e < s or e - s + 1 > max_answer_length:
                continue
            score = float(start_logits[s] + end_logits[e])
            if best is None or score > best[0]:
                best = (score, offsets[s][0], offsets[e][1])
    return best


def predict_answers(features: Dataset, start_logits: list[np.ndarray], end_logits: list[np.ndarray]) -> dict:
    """``{example_id: (answer text, gold answer texts)}``: the best span over every window of each example."""
    best: dict[str, tuple[float, str]] = {}
    gold: dict[str, list[str]] = {}
    for feature, starts, ends in zip(features, start_logits, end_logits, strict=True):
        example = feature["example_id"]
        gold.setdefault(example, feature["answer_texts"])
        span = best_span(starts, ends, feature["offset_mapping"])
        if span is not None and (example not in best or span[0] > best[example][0]):
            best[example] = (span[0], feature["context"][span[1] : span[2]])
    return {example: (best.get(example, (0.0, ""))[1], answers) for example, answers in gold.items()}
