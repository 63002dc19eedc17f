"""SQLite store of experiments, their config versions, metrics, contributors and checkpoints.

One connection per operation and one transaction per write (WAL journal, synchronous=FULL): once a request is
answered, its write survives a restart or a power cut. The file holds the experiment tokens in clear (the admin
must be able to read them back), so it is created readable by its owner only.

Each experiment has two tokens: the *peer token* (read the config, join the DHT) and the *monitor token* (also post
metrics and upload checkpoints). A database from before the split is migrated on open: the old single token, which
every peer was given, becomes the peer token, and a fresh monitor token is generated (the monitor must be restarted
with it: the old token can no longer post metrics).
"""

from __future__ import annotations

import json
import os
import secrets
import sqlite3
import time
from collections.abc import Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from collab.errors import StoreError

SCHEMA = """
CREATE TABLE IF NOT EXISTS experiments (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    name TEXT NOT NULL,
    token TEXT NOT NULL,
    created REAL NOT NULL,
    monitor_token TEXT
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
CREATE TABLE IF NOT EXISTS contributors (
    experiment_id INTEGER PRIMARY KEY REFERENCES experiments(id),
    step INTEGER NOT NULL,
    record TEXT NOT NULL
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
CREATE TABLE IF NOT EXISTS sessions (
    key TEXT PRIMARY KEY,
    created REAL NOT NULL
);
"""
INT64_MAX = 2**63 - 1
PEER, MONITOR = "peer", "monitor"
TOKEN_COLUMNS = {PEER: "token", MONITOR: "monitor_token"}


def check_database(path: Path) -> None:
    """Raise StoreError unless ``path`` is missing (it will be created) or an intact SQLite database."""
    if not path.exists():
        return
    try:
        with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)) as conn:
            (result,) = conn.execute("PRAGMA quick_check").fetchone()
    except sqlite3.DatabaseError as e:
        raise StoreError(f"{path} is not a readable SQLite database ({e}); restore it from a backup") from None
    if result != "ok":
        raise StoreError(f"{path} is damaged (SQLite quick_check: {result[:200]}); restore it from a backup")


def new_token() -> str:
    return secrets.token_urlsafe(24)


@dataclass(frozen=True)
class Experiment:
    id: int
    name: str
    token: str
    monitor_token: str
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
        self._migrate()

    def _migrate(self) -> None:
        """Databases from before the peer/monitor split: add the column, give each experiment a monitor token."""
        with self._transaction() as conn:
            columns = {row["name"] for row in conn.execute("PRAGMA table_info(experiments)")}
            if "monitor_token" not in columns:
                conn.execute("ALTER TABLE experiments ADD COLUMN monitor_token TEXT")
            missing = conn.execute("SELECT id FROM experiments WHERE monitor_token IS NULL").fetchall()
            for row in missing:
                conn.execute("UPDATE experiments SET monitor_token = ? WHERE id = ?", (new_token(), row["id"]))

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
                "INSERT INTO experiments (name, token, monitor_token, created) VALUES (?, ?, ?, ?)",
                (name, new_token(), new_token(), now),
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

    def rotate_token(self, experiment_id: int, role: str) -> str:
        """A new token for ``role`` (PEER or MONITOR) and a new authority key.

        Both roles can get DHT access tokens, so the authority key that signed them goes too: access tokens issued
        before stop verifying for peers that hold the new authority key.
        """
        token = new_token()
        with self._transaction() as conn:
            conn.execute(f"UPDATE experiments SET {TOKEN_COLUMNS[role]} = ? WHERE id = ?", (token, experiment_id))
            conn.execute("DELETE FROM authority_keys WHERE experiment_id = ?", (experiment_id,))
        return token

    def experiment(self, experiment_id: int, version: int | None = None) -> Experiment | None:
        """The experiment with its latest config (or the given version); None if either does not exist."""
        with self._reader() as conn:
            row = conn.execute(
                "SELECT e.id, e.name, e.token, e.monitor_token, e.created, v.version, v.created AS updated, v.config "
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

    def put_metrics(
        self, experiment_id: int, record: dict[str, Any], contributors: list[dict[str, Any]] | None = None
    ) -> None:
        """Store one aggregated step; posting the same step again replaces it. ``contributors`` (validated and
        bounded by the caller) replace the experiment's list unless it is from a later step."""
        with self._transaction() as conn:
            conn.execute(
                "INSERT OR REPLACE INTO metrics (experiment_id, step, record) VALUES (?, ?, ?)",
                (experiment_id, record["step"], json.dumps(record)),
            )
            if contributors is not None:
                conn.execute(
                    "INSERT INTO contributors (experiment_id, step, record) VALUES (?, ?, ?) "
                    "ON CONFLICT (experiment_id) DO UPDATE SET step = excluded.step, record = excluded.record "
                    "WHERE excluded.step >= contributors.step",
                    (experiment_id, record["step"], json.dumps(contributors)),
                )

    def metrics(self, experiment_id: int, after: int = -1, limit: int = -1) -> list[dict[str, Any]]:
        """Steps after ``after`` in step order, at most ``limit`` of them (-1: all)."""
        with self._reader() as conn:
            rows = conn.execute(
                "SELECT record FROM metrics WHERE experiment_id = ? AND step > ? ORDER BY step LIMIT ?",
                (experiment_id, after, limit),
            ).fetchall()
        return [json.loads(row["record"]) for row in rows]

    def contributors(self, experiment_id: int) -> dict[str, Any]:
        """``{"step": the step they were reported with (None before the first report), "contributors": [...]}``."""
        with self._reader() as conn:
            row = conn.execute(
                "SELECT step, record FROM contributors WHERE experiment_id = ?", (experiment_id,)
            ).fetchone()
        if row is None:
            return {"step": None, "contributors": []}
        return {"step": row["step"], "contributors": json.loads(row["record"])}

    # checkpoints

    def put_checkpoint(self, experiment_id: int, checkpoint: Checkpoint, keep: int) -> list[Checkpoint]:
        """Add a checkpoint (its step must be new) and forget all but the ``keep`` newest; returns the forgotten.

        The caller deletes the forgotten files after this returns: a listed checkpoint always has its file.
        """
        with self._transaction() as conn:
            conn.execute(
                "INSERT INTO checkpoints (experiment_id, step, loss, size, sha256, path, time) "
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
            rows = conn.execute(
                "SELECT step, loss, size, sha256, path, time FROM checkpoints WHERE experiment_id = ? "
                "ORDER BY step DESC LIMIT -1 OFFSET ?",
                (experiment_id, keep),
            ).fetchall()
            forgotten = [Checkpoint(**dict(row)) for row in rows]
            conn.executemany(
                "DELETE FROM checkpoints WHERE experiment_id = ? AND step = ?",
                [(experiment_id, c.step) for c in forgotten],
            )
        return forgotten

    def checkpoints(self, experiment_id: int) -> list[Checkpoint]:
        with self._reader() as conn:
            rows = conn.execute(
                "SELECT step, loss, size, sha256, path, time FROM checkpoints WHERE experiment_id = ? ORDER BY step",
                (experiment_id,),
            ).fetchall()
        return [Checkpoint(**dict(row)) for row in rows]

    def checkpoint_paths(self) -> set[str]:
        """The archive paths of every listed checkpoint, of all experiments."""
        with self._reader() as conn:
            return {row["path"] for row in conn.execute("SELECT path FROM checkpoints")}

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

    # admin sessions

    def add_session(self, key: str, max_age: float) -> None:
        """Remember a session (by its keyed hash, never the cookie itself); drops sessions older than ``max_age``."""
        now = time.time()
        with self._transaction() as conn:
            conn.execute("DELETE FROM sessions WHERE created < ?", (now - max_age,))
            conn.execute("INSERT INTO sessions (key, created) VALUES (?, ?)", (key, now))

    def session_is_live(self, key: str, max_age: float) -> bool:
        with self._reader() as conn:
            row = conn.execute("SELECT created FROM sessions WHERE key = ?", (key,)).fetchone()
        return row is not None and time.time() - row["created"] < max_age

    def end_session(self, key: str) -> None:
        with self._transaction() as conn:
            conn.execute("DELETE FROM sessions WHERE key = ?", (key,))
