"""run_web.py's own settings: refuses to start without an admin token, with one line naming the flag."""

from __future__ import annotations

from pathlib import Path

import pytest

import run_web
from web.settings import SettingsError, parse_web_args


def test_refuses_to_start_without_an_admin_token(monkeypatch, capsys):
    monkeypatch.delenv("COLLAB_ADMIN_TOKEN", raising=False)
    assert run_web.main(["--port", "8123"]) == 2
    assert capsys.readouterr().err == (
        "run_web.py: error: --admin_token: required (or set COLLAB_ADMIN_TOKEN); "
        "e.g. --admin_token $(openssl rand -hex 16)\n"
    )


def test_settings_defaults_and_environment():
    settings = parse_web_args(["--db", "runs/exp.sqlite", "--port", "9000"], {"COLLAB_ADMIN_TOKEN": "from-the-env"})
    assert settings.admin_token == "from-the-env"
    assert settings.upload_dir == Path("runs/exp_data")
    assert settings.base_url == "http://127.0.0.1:9000"
    public = parse_web_args(["--admin_token", "12345678", "--public_url", "https://collab.example/"], {})
    assert public.base_url == "https://collab.example"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--admin_token", "short"], "--admin_token: use at least 8 characters"),
        (
            ["--admin_token", "long-enough", "--max_upload_mb", "0"],
            "--max_upload_mb: must be a positive number (got 0)",
        ),
        (["--admin_token", "long-enough", "--public_url", "collab:8000"], "--public_url: must be an http(s):// URL"),
    ],
)
def test_bad_settings_name_the_flag(argv, message):
    with pytest.raises(SettingsError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        parse_web_args(argv, {})
