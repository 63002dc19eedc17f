"""arguments.py: flags, JSON configs and their one-line errors."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from arguments import TRAINER_ARGUMENTS, config_to_argv, parse_args, to_config
from collab.errors import ConfigError

pytestmark = pytest.mark.light

ROOT = Path(__file__).resolve().parents[2]
PEER = "/ip4/127.0.0.1/tcp/31337/p2p/12D3KooWGSiXnbyZEN46UhS1odotVQFtBHtxH5gfoJHwGhNiwYDd"


def parse(*argv):
    return dict(
        zip(
            ["peer", "optimizer", "averager", "tracker", "collab", "data", "training"],
            parse_args(TRAINER_ARGUMENTS, list(argv)),
            strict=True,
        )
    )


def test_defaults_are_valid_and_listen_on_loopback():
    args = parse()
    assert args["peer"].host_maddrs == ["/ip4/127.0.0.1/tcp/0"]
    assert args["optimizer"].target_batch_size > args["optimizer"].batch_size_lead
    assert args["data"].model_name_or_path is None  # the tiny built-in model, no download


def test_flags_override_json_config(tmp_path):
    config = tmp_path / "run.json"
    config.write_text(
        json.dumps(
            {
                "target_batch_size": 512,
                "learning_rate": 0.01,
                "initial_peers": [PEER],
                "fp16": False,
                "experiment_prefix": "from_file",
            }
        )
    )
    args = parse(str(config), "--learning_rate", "0.05")
    assert args["optimizer"].target_batch_size == 512
    assert args["training"].learning_rate == 0.05
    assert args["peer"].initial_peers == [PEER]
    assert args["training"].fp16 is False
    assert parse("--config", str(config))["peer"].experiment_prefix == "from_file"


def test_config_round_trips_through_to_config(tmp_path):
    args = parse("--target_batch_size", "300", "--initial_peers", PEER, "--no_fp16")
    config = tmp_path / "round.json"
    config.write_text(json.dumps(to_config(*args.values())))
    assert parse(str(config)) == args


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--target_batch_size", "-5"], "--target_batch_size"),
        (["--target_batch_size", "abc"], "--target_batch_size"),
        (["--batch_size_lead", "256", "--target_batch_size", "256"], "--batch_size_lead"),
        (["--next_chunk_timeout", "30", "--averaging_timeout", "60"], "--next_chunk_timeout"),
        (["--next_chunk_timeout", "0"], "--next_chunk_timeout"),
        (["--shutdown_timeout", "0"], "--shutdown_timeout"),
        (["--shutdown_timeout", "3601"], "--shutdown_timeout"),
        (["--initial_peers", "not-an-address"], "--initial_peers"),
        (["--initial_peers", "/ip4/127.0.0.1/tcp/31337"], "--initial_peers"),
        (["--host_maddrs", "/ip4/999.0.0.1/tcp/0"], "--host_maddrs"),
        (["--learning_rate", "nan"], "--learning_rate"),
        (["--adam_beta1", "1.0"], "--adam_beta1"),
        (["--warmup_steps", "50", "--total_steps", "10"], "--warmup_steps"),
        (["--no_offload_optimizer"], "--delay_optimizer_step"),
        (["--experiment_prefix", "bad prefix!"], "--experiment_prefix"),
        (["--per_device_train_batch_size", "0"], "--per_device_train_batch_size"),
        (["--progress_report_period", "0"], "--progress_report_period"),
        (["--max_refresh_period", "0"], "--max_refresh_period"),
        (["--min_refresh_period", "20", "--max_refresh_period", "5"], "--min_refresh_period"),
        (["--targt_batch_size", "5"], "--targt_batch_size"),
    ],
)
def test_bad_values_name_the_flag(argv, flag):
    with pytest.raises(ConfigError) as error:
        parse(*argv)
    assert flag in str(error.value)
    assert "\n" not in str(error.value)


def test_json_config_errors_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match="--not_a_setting: unknown setting"):
        config_to_argv({"not_a_setting": 1}, TRAINER_ARGUMENTS)
    with pytest.raises(ConfigError, match="--target_batch_size: in"):
        config_to_argv({"target_batch_size": {"nested": 1}}, TRAINER_ARGUMENTS)
    with pytest.raises(ConfigError, match="--host_maddrs"):
        config_to_argv({"host_maddrs": []}, TRAINER_ARGUMENTS)
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ConfigError, match="--config: .* is not valid JSON"):
        parse(str(broken))
    with pytest.raises(ConfigError, match="--config: no such file"):
        parse("--config", str(tmp_path / "missing.json"))


def test_every_field_has_a_help_string():
    import dataclasses

    for dtype in TRAINER_ARGUMENTS:
        for field in dataclasses.fields(dtype):
            assert len(field.metadata.get("help", "")) > 10, f"{dtype.__name__}.{field.name} has no help"


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--target_batch_size", "-5"], "--target_batch_size"),
        (["--initial_peers", "garbage"], "--initial_peers"),
        (["--unknown_flag", "1"], "--unknown_flag"),
    ],
)
def test_command_line_errors_are_one_line_without_traceback(argv, flag):
    result = subprocess.run(
        [sys.executable, "run_trainer.py", *argv], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("run_trainer.py: error: ") and flag in lines[-1]
    assert "Traceback" not in result.stderr


def test_help_lists_flags_with_units():
    result = subprocess.run(
        [sys.executable, "run_trainer.py", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0
    assert "--target_batch_size" in result.stdout and "Samples the whole collaboration" in result.stdout
    assert "--matchmaking_time" in result.stdout and "Seconds" in result.stdout


def test_monitor_flags_are_checked_and_named():
    from arguments import MONITOR_ARGUMENTS, MetricsArguments

    parsed = parse_args(MONITOR_ARGUMENTS, ["--alive_step_lag", "5"])
    monitor = next(a for a in parsed if isinstance(a, MetricsArguments))
    assert monitor.alive_step_lag == 5
    for argv, flag in [
        (["--alive_step_lag", "-1"], "--alive_step_lag"),
        (["--upload_interval", "60", "--upload_to", "out"], "--upload_interval"),  # needs --store_checkpoints
    ]:
        with pytest.raises(ConfigError, match=flag):
            parse_args(MONITOR_ARGUMENTS, argv)
