"""The web app's own settings (not an experiment's): where it listens, stores and who its admin is."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from collab.errors import SettingsError, StoreError
from web.store import check_database

MIN_ADMIN_TOKEN_CHARS = 8
MAX_KEEP_CHECKPOINTS = 1000


@dataclass(frozen=True)
class WebSettings:
    admin_token: str
    db: Path = Path("experiments.sqlite")
    data_dir: Path | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    public_url: str | None = None
    max_upload_mb: int = 4096
    max_request_kb: int = 1024
    access_token_lifetime: float = 3600.0
    keep_checkpoints: int = 5

    @property
    def upload_dir(self) -> Path:
        """Uploaded checkpoints: --data_dir, by default a folder next to the database (experiments_data/)."""
        return self.data_dir or self.db.with_name(f"{self.db.stem}_data")

    @property
    def base_url(self) -> str:
        """The URL peers and people use, without a trailing slash: --public_url or http://HOST:PORT."""
        return (self.public_url or f"http://{self.host}:{self.port}").rstrip("/")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="run_web.py", description="Web form and live dashboard for collaborative training experiments."
    )
    parser.add_argument("--host", default="127.0.0.1", help="Address to listen on; 0.0.0.0 for every interface")
    parser.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    parser.add_argument("--db", type=Path, default=Path("experiments.sqlite"), help="SQLite file of experiments")
    parser.add_argument(
        "--data_dir", type=Path, default=None, help="Folder for uploaded checkpoints (default: <db name>_data/)"
    )
    parser.add_argument(
        "--admin_token",
        default=None,
        help="Secret that lets a person create and edit experiments (default: $COLLAB_ADMIN_TOKEN)",
    )
    parser.add_argument("--max_upload_mb", type=int, default=4096, help="Largest checkpoint upload (MiB)")
    parser.add_argument(
        "--max_request_kb", type=int, default=1024, help="Largest request body other than uploads (KiB)"
    )
    parser.add_argument(
        "--access_token_lifetime",
        type=float,
        default=3600.0,
        help="Seconds an access token issued by /api/experiments/ID/join stays valid (peers refresh it)",
    )
    parser.add_argument(
        "--keep_checkpoints",
        type=int,
        default=5,
        help=f"Uploaded checkpoints kept per experiment (1..{MAX_KEEP_CHECKPOINTS}); older archives are deleted",
    )
    parser.add_argument(
        "--public_url",
        default=None,
        help="URL peers use to reach this app, shown in the join commands (default: http://HOST:PORT)",
    )
    return parser


def parse_web_args(argv: Sequence[str] | None = None, environ: dict | None = None) -> WebSettings:
    """Settings from flags and COLLAB_ADMIN_TOKEN; raises SettingsError (one line naming the flag)."""
    environ = os.environ if environ is None else environ
    args = _parser().parse_args(argv)
    token = args.admin_token or environ.get("COLLAB_ADMIN_TOKEN", "")
    if not token:
        raise SettingsError(
            "--admin_token: required (or set COLLAB_ADMIN_TOKEN); e.g. --admin_token $(openssl rand -hex 16)"
        )
    if len(token) < MIN_ADMIN_TOKEN_CHARS:
        raise SettingsError(f"--admin_token: use at least {MIN_ADMIN_TOKEN_CHARS} characters")
    for flag in ("port", "max_upload_mb", "max_request_kb", "access_token_lifetime"):
        if getattr(args, flag) <= 0:
            raise SettingsError(f"--{flag}: must be a positive number (got {getattr(args, flag)})")
    if not 1 <= args.keep_checkpoints <= MAX_KEEP_CHECKPOINTS:
        raise SettingsError(f"--keep_checkpoints: must be 1..{MAX_KEEP_CHECKPOINTS} (got {args.keep_checkpoints})")
    if not 10 <= args.access_token_lifetime <= 7 * 24 * 3600:
        raise SettingsError(f"--access_token_lifetime: must be 10..604800 seconds (got {args.access_token_lifetime})")
    try:
        check_database(args.db)
    except StoreError as e:
        raise SettingsError(f"--db: {e}") from None
    if args.public_url and not args.public_url.startswith(("http://", "https://")):
        raise SettingsError(f"--public_url: must be an http(s):// URL (got {args.public_url!r})")
    return WebSettings(**{**vars(args), "admin_token": token})
