"""LocalMetrics: the strict record every peer publishes."""

import math

import pytest

from collab.schema import LocalMetrics, make_validators, metrics_key, parse_metrics

GOOD = {"step": 3, "samples_per_second": 12.5, "samples_accumulated": 128, "loss": 24.2, "mini_steps": 8}


def test_valid_record_parses():
    assert parse_metrics(GOOD) == LocalMetrics(**GOOD)


@pytest.mark.parametrize(
    "change",
    [
        {"step": -1},
        {"step": 1.0},
        {"step": "3"},
        {"samples_per_second": math.nan},
        {"step": True},
        {"loss": "1.5"},
        {"loss": math.inf},
        {"loss": -0.5},
        {"mini_steps": -2},
        {"samples_accumulated": None},
        {"extra_field": 1},
    ],
)
def test_bad_records_are_rejected(change):
    assert parse_metrics({**GOOD, **change}) is None


def test_an_int_where_a_float_belongs_is_a_number():
    assert parse_metrics({**GOOD, "samples_per_second": 3}).samples_per_second == 3.0


def test_the_dht_schema_accepts_exactly_what_the_model_does():
    """hivemind's SchemaValidator (pydantic v1) delegates to LocalMetrics and gets back a value equal to the input."""
    from collab.schema import MetricSchema

    key = b"[owner:peer]"
    assert MetricSchema.parse_obj({"metrics": {key: GOOD}}).dict()["metrics"][key] == GOOD
    for bad in ({**GOOD, "loss": math.nan}, {**GOOD, "extra_field": 1}, {**GOOD, "step": "3"}):
        with pytest.raises(ValueError):
            MetricSchema.parse_obj({"metrics": {key: bad}})


def test_missing_fields_and_wrong_shapes_are_rejected():
    assert parse_metrics({k: v for k, v in GOOD.items() if k != "loss"}) is None
    assert parse_metrics([1, 2, 3]) is None
    assert parse_metrics(None) is None


def test_key_and_validators():
    assert metrics_key("my_run") == "my_run_metrics"
    validators, public_key = make_validators("my_run")
    assert len(validators) == 2 and b"[owner:" in public_key
