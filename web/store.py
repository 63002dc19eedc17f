"""SQLite store of experiments, their config versions, metrics and checkpoints.

One connection per operation and one transaction per write (WAL journal, synchronous=FULL): once a request is
answered, its write survives a restart or a power cut. The file holds the experiment tokens in clear (the admin
must be able to read them back), so it is created readable by its owner only.
"""

from __future__ import annotations

import json
import os
import secrets
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS experiments (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    name TEXT NOT NULL,
    token TEXT NOT NULL,
    created REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS versions (
    experiment_id INTEGER NOT NULL REFERENCES experiments(id),
    version INTEGER NOT NULL,
    config TEXT NOT NULL,
    created REAL NOT NULL,
    PRIMARY KEY (experiment_id, version)
);
CREATE TABLE IF NOT EXISTS metrics (
    experiment_id INTEGER NOT NULL REFERENCES experiments(id),
    step INTEGER NOT NULL,
    record TEXT NOT NULL,
    PRIMARY KEY (experiment_id, step)
);
CREATE TABLE IF NOT EXISTS authority_keys (
    experiment_id INTEGER PRIMARY KEY REFERENCES experiments(id),
    private_key BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS checkpoints (
    experiment_id INTEGER NOT NULL REFERENCES experiments(id),
    step INTEGER NOT NULL,
    loss REAL,
    size INTEGER NOT NULL,
    sha256 TEXT NOT NULL,
    path TEXT NOT NULL,
    time REAL NOT NULL,
    PRIMARY KEY (experiment_id, step)
);
"""


def new_token() -> str:
    return secrets.token_urlsafe(24)


@dataclass(frozen=True)
class Experiment:
    id: int
    name: str
    token: str
    created: float
    version: int
    updated: float
    config: dict[str, Any]


@dataclass(frozen=True)
class Checkpoint:
    step: int
    loss: float | None
    size: int
    sha256: str
    path: str
    time: float


class Store:
    """All persistent state of the web app; safe to share between threads (no connection is shared)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not self.path.exists():
            os.close(os.open(self.path, os.O_CREAT | os.O_WRONLY, 0o600))
        with self._reader() as conn:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.executescript(SCHEMA)

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, timeout=30)
        conn.row_factory = sqlite3.Row
        conn.execute("PRAGMA synchronous=FULL")
        conn.execute("PRAGMA foreign_keys=ON")
        return conn

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        conn = self._connect()
        try:
            conn.execute("BEGIN IMMEDIATE")
            yield conn
            conn.commit()
        except BaseException:
            conn.rollback()
            raise
        finally:
            conn.close()

    @contextmanager
    def _reader(self) -> Iterator[sqlite3.Connection]:
        conn = self._connect()
        try:
            yield conn
        finally:
            conn.close()

    # experiments and versions

    def create_experiment(self, name: str, config: dict[str, Any]) -> Experiment:
        now = time.time()
        with self._transaction() as conn:
            cursor = conn.execute(
                "INSERT INTO experiments (name, token, created) VALUES (?, ?, ?)", (name, new_token(), now)
            )
            conn.execute(
                "INSERT INTO versions (experiment_id, version, config, created) VALUES (?, 1, ?, ?)",
                (cursor.lastrowid, json.dumps(config), now),
            )
            experiment_id = cursor.lastrowid
        return self.experiment(experiment_id)

    def save_version(self, experiment_id: int, name: str, config: dict[str, Any]) -> Experiment:
        """A new version of the config (older ones stay readable); also renames the experiment."""
        with self._transaction() as conn:
            (latest,) = conn.execute(
                "SELECT MAX(version) FROM versions WHERE experiment_id = ?", (experiment_id,)
            ).fetchone()
            conn.execute(
                "INSERT INTO versions (experiment_id, version, config, created) VALUES (?, ?, ?, ?)",
                (experiment_id, latest + 1, json.dumps(config), time.time()),
            )
            conn.execute("UPDATE experiments SET name = ? WHERE id = ?", (name, experiment_id))
        return self.experiment(experiment_id)

    def rotate_token(self, experiment_id: int) -> str:
        token = new_token()
        with self._transaction() as conn:
            conn.execute("UPDATE experiments SET token = ? WHERE id = ?", (token, experiment_id))
        return token

    def experiment(self, experiment_id: int, version: int | None = None) -> Experiment | None:
        """The experiment with its latest config (or the given version); None if either does not exist."""
        with self._reader() as conn:
            row = conn.execute(
                "SELECT e.id, e.name, e.token, e.created, v.version, v.created AS updated, v.config "
                "FROM experiments e JOIN versions v ON v.experiment_id = e.id WHERE e.id = ? "
                + ("AND v.version = ?" if version is not None else "ORDER BY v.version DESC LIMIT 1"),
                (experiment_id, version) if version is not None else (experiment_id,),
            ).fetchone()
        if row is None:
            return None
        return Experiment(**{**dict(row), "config": json.loads(row["config"])})

    def experiments(self) -> list[dict[str, Any]]:
        """Every experiment's id, name, latest version and last update, newest first (no tokens, no configs)."""
        with self._reader() as conn:
            rows = conn.execute(
                "SELECT e.id, e.name, MAX(v.version) AS version, MAX(v.created) AS updated "
                "FROM experiments e JOIN versions v ON v.experiment_id = e.id GROUP BY e.id ORDER BY e.id DESC"
            ).fetchall()
        return [dict(row) for row in rows]

    def versions(self, experiment_id: int) -> list[dict[str, Any]]:
        with self._reader() as conn:
            rows = conn.execute(
                "SELECT version, created FROM versions WHERE experiment_id = ? ORDER BY version", (experiment_id,)
            ).fetchall()
        return [dict(row) for row in rows]

    # metrics

    def put_metrics(self, experiment_id: int, record: dict[str, Any]) -> None:
        """Store one aggregated step; posting the same step again replaces it."""
        with self._transaction() as conn:
            conn.execute(
                "INSERT OR REPLACE INTO metrics (experiment_id, step, record) VALUES (?, ?, ?)",
                (experiment_id, record["step"], json.dumps(record)),
            )

    def metrics(self, experiment_id: int, after: int = -1) -> list[dict[str, Any]]:
        with self._reader() as conn:
            rows = conn.execute(
                "SELECT record FROM metrics WHERE experiment_id = ? AND step > ? ORDER BY step", (experiment_id, after)
            ).fetchall()
        return [json.loads(row["record"]) for row in rows]

    # checkpoints

    def put_checkpoint(self, experiment_id: int, checkpoint: Checkpoint) -> None:
        with self._transaction() as conn:
            conn.execute(
                "INSERT OR REPLACE INTO checkpoints (experiment_id, step, loss, size, sha256, path, time) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    experiment_id,
                    checkpoint.step,
                    checkpoint.loss,
                    checkpoint.size,
                    checkpoint.sha256,
                    checkpoint.path,
                    checkpoint.time,
                ),
            )

    def checkpoints(self, experiment_id: int) -> list[Checkpoint]:
        with self._reader() as conn:
            rows = conn.execute(
                "SELECT step, loss, size, sha256, path, time FROM checkpoints WHERE experiment_id = ? ORDER BY step",
                (experiment_id,),
            ).fetchall()
        return [Checkpoint(**dict(row)) for row in rows]

    def checkpoint(self, experiment_id: int, step: int) -> Checkpoint | None:
        with self._reader() as conn:
            row = conn.execute(
                "SELECT step, loss, size, sha256, path, time FROM checkpoints WHERE experiment_id = ? AND step = ?",
                (experiment_id, step),
            ).fetchone()
        return None if row is None else Checkpoint(**dict(row))

    def authority_key(self, experiment_id: int, new_key) -> bytes:
        """The experiment's access-token authority key (DER); ``new_key()`` makes it on first use."""
        with self._transaction() as db:
            query = "SELECT private_key FROM authority_keys WHERE experiment_id = ?"
            row = db.execute(query, (experiment_id,)).fetchone()
            if row is not None:
                return bytes(row[0])
            key = new_key()
            db.execute("INSERT INTO authority_keys (experiment_id, private_key) VALUES (?, ?)", (experiment_id, key))
            return key
