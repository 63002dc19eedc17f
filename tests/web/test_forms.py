"""The form generated from arguments.py (pure functions, milliseconds after the first validation)."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Literal

import pytest

from arguments import (
    EXPERIMENT_ARGUMENTS,
    LOCAL_SETTINGS,
    SECRET_SETTINGS,
    OptimizerArguments,
    to_config,
    validate_config,
)
from collab.errors import ConfigError
from tests.web.helpers import default_form
from web.forms import config_from_form, display_values, form_sections, validated_config, widget_kind
from web.pages import join_commands

pytestmark = pytest.mark.light

SECTIONS = form_sections()
FIELDS = {f.name: f for section in SECTIONS for f in section.fields}


def test_one_section_per_dataclass_in_order_without_secrets():
    assert [s.name for s in SECTIONS] == [d.__name__ for d in EXPERIMENT_ARGUMENTS]
    assert SECTIONS[0].title == "Peer" and SECTIONS[1].title == "Optimizer"
    assert SECTIONS[3].title == "Progress Tracker"
    every = {f.name for d in EXPERIMENT_ARGUMENTS for f in dataclasses.fields(d)}
    assert set(FIELDS) == every - SECRET_SETTINGS - LOCAL_SETTINGS
    assert "web_token" not in FIELDS


def test_labels_help_defaults_and_widgets_come_from_the_dataclasses():
    peers = FIELDS["initial_peers"]
    assert (peers.kind, peers.default, peers.label) == ("list", [], "Initial peers")
    assert peers.help.startswith("Multiaddrs of running peers")
    assert FIELDS["host_maddrs"].default == ["/ip4/127.0.0.1/tcp/0"]
    assert (FIELDS["target_batch_size"].kind, FIELDS["target_batch_size"].default) == (
        "int",
        OptimizerArguments.target_batch_size,
    )
    assert (FIELDS["learning_rate"].kind, FIELDS["learning_rate"].optional) == ("float", False)
    assert (FIELDS["use_ipfs"].kind, FIELDS["use_ipfs"].default) == ("bool", False)
    assert (FIELDS["authorization_url"].kind, FIELDS["authorization_url"].optional) == ("text", True)
    assert not LOCAL_SETTINGS & FIELDS.keys()  # paths and names are each peer's to choose
    assert (FIELDS["upload_interval"].kind, FIELDS["upload_interval"].optional) == ("float", True)


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


@dataclass
class Choices:
    mode: Literal["fast", "slow"] = "fast"
    color: Color = Color.RED
    precision: str | None = field(default=None, metadata={"help": "h", "choices": ["fp16", "bf16"]})


def test_choices_from_literal_enum_and_metadata():
    (section,) = form_sections([Choices], frozenset())
    assert [(f.kind, f.choices, f.optional) for f in section.fields] == [
        ("choice", ("fast", "slow"), False),
        ("choice", ("red", "blue"), False),
        ("choice", ("fp16", "bf16"), True),
    ]


def test_a_type_without_a_widget_is_refused():
    with pytest.raises(TypeError, match="no form widget"):
        widget_kind(dict[str, int], {})


def test_unchecked_box_is_false_lists_split_by_line_empty_optional_is_none():
    form = default_form(
        initial_peers="\n /ip4/1.2.3.4/tcp/1/p2p/X \n\n/ip4/5.6.7.8/tcp/2/p2p/Y\n", authorization_url=" "
    )
    form.pop("fp16")
    config = config_from_form(form, SECTIONS)
    assert config["fp16"] is False and config["offload_optimizer"] is True
    assert config["initial_peers"] == ["/ip4/1.2.3.4/tcp/1/p2p/X", "/ip4/5.6.7.8/tcp/2/p2p/Y"]
    assert config["authorization_url"] is None
    assert config["target_batch_size"] == str(OptimizerArguments.target_batch_size)


def test_display_values_show_defaults_and_keep_what_was_typed():
    values = display_values({}, SECTIONS)
    assert values["host_maddrs"] == "/ip4/127.0.0.1/tcp/0"
    assert values["offload_optimizer"] is True and values["authorization_url"] == ""
    assert display_values({"target_batch_size": "-1x"}, SECTIONS)["target_batch_size"] == "-1x"


def test_the_untouched_form_stores_the_command_line_defaults():
    stored = validated_config(config_from_form(default_form(), SECTIONS))
    expected = to_config(*validate_config({}))
    for key in SECRET_SETTINGS | LOCAL_SETTINGS:
        expected.pop(key)
    assert stored == expected


def test_invalid_values_fail_like_the_command_line_naming_the_field():
    with pytest.raises(ConfigError) as error:
        validated_config(config_from_form(default_form(target_batch_size="-1"), SECTIONS))
    assert (error.value.field, str(error.value)) == (
        "target_batch_size",
        "--target_batch_size: must be a positive number (got -1)",
    )
    with pytest.raises(ConfigError, match="invalid int value") as error:
        validated_config({"warmup_steps": "two"})
    assert error.value.field == "warmup_steps"


@pytest.mark.parametrize(
    "config, field_name",
    [
        ({"web_token": "s3cret"}, "web_token"),
        ({"initial_peers": ["--config", "http://169.254.169.254/"]}, "initial_peers"),
        ({"no_such_setting": 1}, "no_such_setting"),
        ({"output_dir": "/home"}, "output_dir"),
        ({"events_path": "/root/.bashrc"}, "events_path"),
    ],
)
def test_secrets_flag_like_values_and_unknown_keys_are_refused(config, field_name):
    with pytest.raises(ConfigError) as error:
        validated_config(config)
    assert error.value.field == field_name


def test_a_value_that_looks_like_a_flag_stays_a_value():
    assert validated_config({"model_name_or_path": "-h", "experiment_prefix": "--x"})["model_name_or_path"] == "-h"


def test_join_commands_are_ready_to_paste():
    commands = join_commands("http://10.0.0.5:8000", 3, "peer-tok", "monitor-tok")
    api = "http://10.0.0.5:8000/api/experiments/3"
    assert commands["trainer"] == f"python run_trainer.py --config {api}/config --config_token peer-tok"
    assert commands["monitor"] == (
        f"python run_training_monitor.py --config {api}/config --config_token monitor-tok --report_url {api}/metrics"
    )
    assert commands["monitor_with_uploads"].endswith(
        f"--store_checkpoints --upload_interval 60 --upload_to {api}/checkpoints"
    )
