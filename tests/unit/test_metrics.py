"""Accuracy and SQuAD exact match / F1 against hand-worked examples."""

import pytest

from trainer.metrics import accuracy, exact_match, f1_score, normalize_answer, squad_scores

pytestmark = pytest.mark.light


def test_accuracy():
    assert accuracy([1, 0, 1, 1], [1, 1, 1, 0]) == 0.5
    assert accuracy([], []) == 0.0
    with pytest.raises(ValueError):
        accuracy([1], [1, 0])


def test_normalisation_drops_case_punctuation_articles_and_extra_spaces():
    assert normalize_answer("  The Eiffel-Tower, an  icon! ") == "eiffeltower icon"
    assert normalize_answer("A theory") == "theory"  # "the" inside a word stays


def test_exact_match_takes_the_best_gold_answer():
    assert exact_match("the Denver Broncos", ["Denver Broncos", "Broncos"]) == 1.0
    assert exact_match("Denver", ["Denver Broncos", "Broncos"]) == 0.0


def test_f1_by_hand():
    # prediction "denver broncos won" vs gold "broncos": common 1, precision 1/3, recall 1 -> F1 = 0.5
    assert f1_score("Denver Broncos won", ["Broncos"]) == pytest.approx(0.5)
    # vs gold "the denver broncos" -> "denver broncos": common 2, precision 2/3, recall 1 -> 0.8; best of both
    assert f1_score("Denver Broncos won", ["Broncos", "The Denver Broncos"]) == pytest.approx(0.8)
    assert f1_score("Carolina", ["Broncos"]) == 0.0
    # tokens count with multiplicity: "x x y" vs "x y": common 2, precision 2/3, recall 1
    assert f1_score("x x y", ["x y"]) == pytest.approx(2 * (2 / 3) * 1 / (2 / 3 + 1))


def test_squad_scores_average_over_examples():
    scores = squad_scores(["Broncos", "Denver Broncos won"], [["Broncos"], ["Broncos"]])
    assert scores == {"exact_match": pytest.approx(0.5), "f1": pytest.approx(0.75)}
