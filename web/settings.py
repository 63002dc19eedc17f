"""The web app's own settings (not an experiment's): where it listens, stores and who its admin is."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from arguments import parse_args
from collab.errors import ConfigError, SettingsError, StoreError
from web.store import check_database

MIN_ADMIN_TOKEN_CHARS = 8
MAX_KEEP_CHECKPOINTS = 1000


@dataclass(frozen=True)
class WebSettings:
    """The app's settings: each field is a flag of run_web.py (``parse_web_args``), its default declared here only."""

    admin_token: str | None = field(
        default=None, metadata={"help": "Secret that lets a person create and edit experiments ($COLLAB_ADMIN_TOKEN)"}
    )
    db: Path = field(default=Path("experiments.sqlite"), metadata={"help": "SQLite file of experiments"})
    data_dir: Path | None = field(
        default=None, metadata={"help": "Folder for uploaded checkpoints (default: <db name>_data/)"}
    )
    host: str = field(default="127.0.0.1", metadata={"help": "Address to listen on; 0.0.0.0 for every interface"})
    port: int = field(default=8000, metadata={"help": "TCP port to listen on"})
    public_url: str | None = field(
        default=None,
        metadata={"help": "URL peers use to reach this app, shown in the join commands (default: http://HOST:PORT)"},
    )
    max_upload_mb: int = field(default=4096, metadata={"help": "Largest checkpoint upload (MiB)"})
    max_request_kb: int = field(default=1024, metadata={"help": "Largest request body other than uploads (KiB)"})
    access_token_lifetime: float = field(
        default=3600.0,
        metadata={"help": "Seconds an access token issued by /api/experiments/ID/join stays valid (peers refresh it)"},
    )
    keep_checkpoints: int = field(
        default=5,
        metadata={
            "help": f"Uploaded checkpoints kept per experiment (1..{MAX_KEEP_CHECKPOINTS}); older archives are deleted"
        },
    )

    @property
    def upload_dir(self) -> Path:
        """Uploaded checkpoints: --data_dir, by default a folder next to the database (experiments_data/)."""
        return self.data_dir or self.db.with_name(f"{self.db.stem}_data")

    @property
    def base_url(self) -> str:
        """The URL peers and people use, without a trailing slash: --public_url or http://HOST:PORT."""
        return (self.public_url or f"http://{self.host}:{self.port}").rstrip("/")


def parse_web_args(argv: Sequence[str] | None = None, environ: dict | None = None) -> WebSettings:
    """Settings from flags and COLLAB_ADMIN_TOKEN; raises SettingsError (one line naming the flag)."""
    environ = os.environ if environ is None else environ
    try:
        (args,) = parse_args([WebSettings], argv, prog="run_web.py")
    except ConfigError as e:
        raise SettingsError(str(e)) from None
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
    return dataclasses.replace(args, admin_token=token)
