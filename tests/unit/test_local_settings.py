"""Paths on a peer's own machine come from its command line or a local file, never from a config URL."""

import json

import pytest

from arguments import TRAINER_ARGUMENTS, TrainingArguments, parse_args, parse_args_or_exit
from tests.http_server import QuietHandler, serving

pytestmark = pytest.mark.light

CONFIGS = {
    "/hostile": {"target_batch_size": 64, "output_dir": "/home"},
    "/events": {"target_batch_size": 64, "events_path": "/root/.bashrc"},
    "/named": {"target_batch_size": 64, "public_name": "everyone"},
    # what older web apps stored: every key, the local ones at their defaults
    "/old": {"target_batch_size": 64, "output_dir": TrainingArguments.output_dir, "identity_path": None},
}


class ConfigHandler(QuietHandler):
    def do_GET(self):
        body = json.dumps(CONFIGS[self.path]).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def training_arguments(argv: list[str]) -> TrainingArguments:
    return next(a for a in parse_args(TRAINER_ARGUMENTS, argv) if isinstance(a, TrainingArguments))


@pytest.mark.parametrize(
    "path, flag", [("/hostile", "output_dir"), ("/events", "events_path"), ("/named", "public_name")]
)
def test_a_config_url_cannot_choose_a_path_or_the_name_of_this_peer(path, flag, capsys):
    with serving(ConfigHandler) as url, pytest.raises(SystemExit) as exit_info:
        parse_args_or_exit(TRAINER_ARGUMENTS, ["--config", url + path], prog="run_trainer.py")
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (
        f"run_trainer.py: error: --{flag}: a setting of this machine is never taken from a config URL ({url}{path}); "
        "pass it on the command line\n"
    )


def test_a_config_url_s_defaults_are_ignored_and_the_command_line_chooses(tmp_path):
    with serving(ConfigHandler) as url:
        assert training_arguments(["--config", url + "/old"]).output_dir == TrainingArguments.output_dir
        chosen = str(tmp_path / "mine")
        assert training_arguments(["--config", url + "/hostile", "--output_dir", chosen]).output_dir == chosen


def test_a_local_config_file_may_name_paths(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"output_dir": str(tmp_path / "out")}))
    assert training_arguments([str(config)]).output_dir == str(tmp_path / "out")
