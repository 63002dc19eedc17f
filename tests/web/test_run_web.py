"""run_web.py's own settings: refuses to start without an admin token, with one line naming the flag."""

from __future__ import annotations

from pathlib import Path

import pytest

import run_web
from collab.errors import SettingsError
from web.settings import parse_web_args

pytestmark = pytest.mark.light


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
        (["--admin_token", "long-enough", "--port", "abc"], "--port: invalid int value: 'abc'"),
        (["--admin_token", "long-enough", "--prot", "9000"], "--prot: unknown flag"),
        (
            ["--admin_token", "long-enough", "--max_upload_mb", "0"],
            "--max_upload_mb: must be a positive number (got 0)",
        ),
        (["--admin_token", "long-enough", "--public_url", "collab:8000"], "--public_url: must be an http(s):// URL"),
        (["--admin_token", "long-enough", "--keep_checkpoints", "0"], "--keep_checkpoints: must be 1..1000 (got 0)"),
        (
            ["--admin_token", "long-enough", "--access_token_lifetime", "inf"],
            "--access_token_lifetime: must be 10..604800 seconds (got inf)",
        ),
    ],
)
def test_bad_settings_name_the_flag(argv, message):
    with pytest.raises(SettingsError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        parse_web_args(argv, {})


def test_a_corrupt_database_stops_start_up_with_one_line(tmp_path, capsys):
    db = tmp_path / "experiments.sqlite"
    db.write_bytes(b"this is not a database" * 100)
    assert run_web.main(["--admin_token", "long-enough", "--db", str(db)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"run_web.py: error: --db: {db} is not a readable SQLite database") and err.count("\n") == 1
    assert db.read_bytes() == b"this is not a database" * 100


def test_a_database_from_before_the_token_split_is_migrated(tmp_path):
    import sqlite3

    from web.store import Store

    db = tmp_path / "old.sqlite"
    with sqlite3.connect(db) as conn:
        conn.executescript(
            "CREATE TABLE experiments (id INTEGER PRIMARY KEY AUTOINCREMENT, name TEXT NOT NULL, token TEXT NOT NULL,"
            " created REAL NOT NULL);"
            "CREATE TABLE versions (experiment_id INTEGER NOT NULL, version INTEGER NOT NULL, config TEXT NOT NULL,"
            " created REAL NOT NULL, PRIMARY KEY (experiment_id, version));"
            "INSERT INTO experiments VALUES (1, 'old', 'the-old-token', 1.0);"
            "INSERT INTO versions VALUES (1, 1, '{}', 1.0);"
        )
    conn.close()
    experiment = Store(db).experiment(1)
    assert experiment.token == "the-old-token"  # every peer had it: it stays the peer token
    assert len(experiment.monitor_token) >= 32 and Store(db).experiment(1).monitor_token == experiment.monitor_token
