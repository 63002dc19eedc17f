"""Evaluation metrics as pure functions: accuracy, and SQuAD's exact match and F1.

The SQuAD definitions follow the official evaluation script (v1.1): both sides are normalised (lower-case,
punctuation and the articles a/an/the removed, whitespace collapsed), F1 counts shared tokens with multiplicity,
and a prediction scores the best value over all gold answers. Scores are fractions in [0, 1], not percentages.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def accuracy(predictions: Sequence[int], labels: Sequence[int]) -> float:
    """Fraction of predictions equal to their label; 0.0 for no examples."""
    if len(predictions) != len(labels):
        raise ValueError(f"{len(predictions)} predictions for {len(labels)} labels")
    return sum(int(p == y) for p, y in zip(predictions, labels, strict=True)) / len(labels) if labels else 0.0


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower-case, drop punctuation, drop articles, collapse whitespace."""
    text = text.lower().translate(_PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, gold_answers: Sequence[str]) -> float:
    """1.0 if the normalised prediction equals any normalised gold answer, else 0.0."""
    return max((float(normalize_answer(prediction) == normalize_answer(gold)) for gold in gold_answers), default=0.0)


def _token_f1(prediction: str, gold: str) -> float:
    predicted, expected = normalize_answer(prediction).split(), normalize_answer(gold).split()
    common = sum((Counter(predicted) & Counter(expected)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(predicted), common / len(expected)
    return 2 * precision * recall / (precision + recall)


def f1_score(prediction: str, gold_answers: Sequence[str]) -> float:
    """Token-overlap F1 of the prediction against its best gold answer."""
    return max((_token_f1(prediction, gold) for gold in gold_answers), default=0.0)


def squad_scores(predictions: Sequence[str], gold_answers: Sequence[Sequence[str]]) -> dict[str, float]:
    """Mean exact match and F1 over examples: ``{"exact_match": ..., "f1": ...}`` (fractions)."""
    if len(predictions) != len(gold_answers):
        raise ValueError(f"{len(predictions)} predictions for {len(gold_answers)} examples")
    count = max(len(predictions), 1)
    return {
        "exact_match": sum(map(exact_match, predictions, gold_answers)) / count,
        "f1": sum(map(f1_score, predictions, gold_answers)) / count,
    }
