"""LocalMetrics: the strict record every peer publishes."""

import math

import pytest

from arguments import TRAINER_ARGUMENTS, CollaborationArguments, parse_args
from collab.errors import ConfigError
from collab.names import MAX_PUBLIC_NAME_CHARS
from collab.schema import (
    MAX_CONTRIBUTED_SAMPLES,
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
    peer_fingerprint,
)

pytestmark = pytest.mark.light

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
    {"contributed_samples": MAX_CONTRIBUTED_SAMPLES, "contributed_epochs": MAX_STEP},
    {"public_name": "n" * MAX_PUBLIC_NAME_CHARS},
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
    {"contributed_samples": MAX_CONTRIBUTED_SAMPLES + 1},
    {"contributed_epochs": MAX_STEP + 1},
    {"contributed_samples": -1},
    {"public_name": "n" * (MAX_PUBLIC_NAME_CHARS + 1)},
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


CONTRIBUTING = {**GOOD, "contributed_samples": 1024, "contributed_epochs": 8, "public_name": "Zoë's GPU 🙂"}
HOSTILE_NAMES = [
    "",
    "x" * 33,
    "x" * 100_000,
    "tab\tname",
    "new\nline",
    "\x1b[31mred",
    "rtl\u202eeman",
    "zero\u200bwidth",
    " pad",
]


def test_a_contributing_record_goes_through_the_wire_unchanged_and_an_older_one_too():
    key = b"[owner:peer]"
    for value in (CONTRIBUTING, GOOD, {**GOOD, "public_name": None}):
        assert MetricSchema.parse_obj({"metrics": {key: value}}).dict()["metrics"][key] == value
    assert parse_metrics(GOOD).contributed_samples == 0 and parse_metrics(GOOD).public_name is None


def test_a_peer_without_a_name_publishes_no_name_field():
    assert "public_name" not in LocalMetrics(**GOOD).to_record()
    assert LocalMetrics(**CONTRIBUTING).to_record() == CONTRIBUTING


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_a_long_or_unprintable_name_is_refused_on_the_command_line_and_on_the_wire(name):
    with pytest.raises(ConfigError) as refused:
        parse_args(TRAINER_ARGUMENTS, ["--public_name", name])
    message = str(refused.value)
    assert message.startswith("--public_name: must ") and "\n" not in message and len(message) < 300
    assert parse_metrics({**CONTRIBUTING, "public_name": name}) is None
    with pytest.raises(ValueError):
        MetricSchema.parse_obj({"metrics": {b"[owner:peer]": {**CONTRIBUTING, "public_name": name}}})


def public_name_given(argv: list[str]) -> str | None:
    return next(a for a in parse_args(TRAINER_ARGUMENTS, argv) if isinstance(a, CollaborationArguments)).public_name


def test_a_printable_name_is_accepted_on_the_command_line():
    assert public_name_given(["--public_name", "volunteer <b>42</b>"]) == "volunteer <b>42</b>"
    assert public_name_given([]) is None


def test_peer_fingerprint_is_short_stable_and_hex():
    assert peer_fingerprint(b"alice-key") == "72ee9d4355cc" == peer_fingerprint(b"alice-key")
    assert peer_fingerprint(b"b-key") == "912cf63e4e97"
