"""LocalMetrics: the strict record every peer publishes."""

import math

import pytest

from collab.schema import (
    MAX_LOSS_PER_MINI_STEP,
    MAX_MINI_STEPS,
    MAX_SAMPLES_ACCUMULATED,
    MAX_SAMPLES_PER_SECOND,
    MAX_STEP,
    LocalMetrics,
    MetricSchema,
    make_validators,
    metrics_key,
    parse_metrics,
)

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


AT_THE_BOUNDS = [
    {"step": MAX_STEP},
    {"samples_per_second": MAX_SAMPLES_PER_SECOND},
    {"samples_accumulated": MAX_SAMPLES_ACCUMULATED},
    {"mini_steps": MAX_MINI_STEPS},
    {"loss": MAX_LOSS_PER_MINI_STEP * GOOD["mini_steps"]},
    {"loss": 0.0, "mini_steps": 0},
]
PAST_THE_BOUNDS = [
    {"step": MAX_STEP + 1},
    {"step": 2**62},
    {"samples_per_second": math.nextafter(MAX_SAMPLES_PER_SECOND, math.inf)},
    {"samples_per_second": 1e300},
    {"samples_accumulated": MAX_SAMPLES_ACCUMULATED + 1},
    {"mini_steps": MAX_MINI_STEPS + 1},
    {"loss": math.nextafter(MAX_LOSS_PER_MINI_STEP * GOOD["mini_steps"], math.inf)},
    {"loss": 1e-9, "mini_steps": 0},  # no mini-step, no loss
]


@pytest.mark.parametrize("change", AT_THE_BOUNDS)
def test_values_at_the_bounds_are_accepted_by_the_monitor_and_on_the_wire(change):
    value = {**GOOD, **change}
    assert parse_metrics(value) == LocalMetrics(**value)
    assert MetricSchema.parse_obj({"metrics": {b"[owner:peer]": value}}).dict()["metrics"][b"[owner:peer]"] == value


@pytest.mark.parametrize("change", PAST_THE_BOUNDS)
def test_values_just_past_the_bounds_are_rejected_by_the_monitor_and_on_the_wire(change):
    assert parse_metrics({**GOOD, **change}) is None
    with pytest.raises(ValueError):
        MetricSchema.parse_obj({"metrics": {b"[owner:peer]": {**GOOD, **change}}})
