"""The checkpoint format: written by the monitor, read by ``run_trainer.py --resume_from`` and by people.

``<repo_path>/<step>/`` holds the ``save_pretrained`` model and tokenizer, ``optimizer.pt`` (the collaboration's
Lamb state in ``hivemind.Optimizer.state_dict()`` form, with ``local_epoch``, plus the scheduler) and, written
last, ``manifest.json``: step, loss, peers, time and the sha256 of every other file. The folder is filled under a
temporary name and renamed into place, so a reader sees a whole checkpoint or none; a folder whose manifest is
missing or whose files do not match it is not a checkpoint, and is reported and skipped.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from collab.faults import pause_checkpoint_write
from collab.storage import atomic_directory

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
OPTIMIZER_STATE = "optimizer.pt"
FORMAT_VERSION = 1


class CheckpointError(ValueError):
    """A folder that is not a valid checkpoint; the message says why."""


@dataclass(frozen=True)
class Manifest:
    step: int
    loss: float | None
    peers: int
    time: float
    files: dict[str, str] = field(default_factory=dict)  # relative path -> sha256
    format_version: int = FORMAT_VERSION


def sha256_file(path: str | os.PathLike, chunk_size: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_size):
            digest.update(chunk)
    return digest.hexdigest()


def _files_under(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_checkpoint(
    repo_path: str | os.PathLike,
    step: int,
    model,
    tokenizer,
    optimizer_state: dict[str, Any],
    loss: float | None = None,
    peers: int = 0,
) -> Path:
    """Write ``<repo_path>/<step>/`` atomically and return it; an existing checkpoint of that step is replaced."""
    target = Path(repo_path) / str(step)
    with atomic_directory(target) as staging:
        model.save_pretrained(staging)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        torch.save(optimizer_state, staging / OPTIMIZER_STATE)
        pause_checkpoint_write(target)
        files = {name: sha256_file(staging / name) for name in _files_under(staging)}
        manifest = Manifest(step=step, loss=loss, peers=peers, time=time.time(), files=files)
        with open(staging / MANIFEST, "w") as f:
            json.dump(asdict(manifest), f, indent=2)
            f.flush()
            os.fsync(f.fileno())
    return target


def read_manifest(folder: str | os.PathLike) -> Manifest:
    """The manifest of a checkpoint folder, after checking every file against its sha256."""
    folder = Path(folder)
    try:
        raw = json.loads((folder / MANIFEST).read_text())
        manifest = Manifest(**raw)
    except FileNotFoundError:
        raise CheckpointError(f"{folder}: no {MANIFEST} (an interrupted save?)") from None
    except (json.JSONDecodeError, TypeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{folder}: unreadable {MANIFEST} ({e})") from None
    if not isinstance(manifest.step, int) or not isinstance(manifest.files, dict) or not manifest.files:
        raise CheckpointError(f"{folder}: {MANIFEST} lacks a step or a file list")
    for name, expected in manifest.files.items():
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"{folder}: {name} is missing")
        if sha256_file(path) != expected:
            raise CheckpointError(f"{folder}: {name} does not match its sha256 in {MANIFEST} (corrupted)")
    return manifest


def list_checkpoints(repo_path: str | os.PathLike) -> tuple[list[tuple[Path, Manifest]], list[tuple[Path, str]]]:
    """Valid checkpoints oldest first, and the invalid step folders with the reason (temporary folders ignored)."""
    valid, invalid = [], []
    root = Path(repo_path)
    if not root.is_dir():
        return valid, invalid
    for folder in sorted((p for p in root.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name)):
        try:
            valid.append((folder, read_manifest(folder)))
        except CheckpointError as e:
            invalid.append((folder, str(e)))
    return valid, invalid


def latest_checkpoint(repo_path: str | os.PathLike) -> tuple[Path, Manifest] | None:
    """The newest valid checkpoint; invalid folders are reported in the log and skipped."""
    valid, invalid = list_checkpoints(repo_path)
    for _, reason in invalid:
        logger.warning("Ignoring a folder that is not a valid checkpoint: %s", reason)
    return valid[-1] if valid else None


def remove_partial_saves(repo_path: str | os.PathLike) -> list[Path]:
    """Delete what interrupted saves left behind (``.tmp-*`` and ``.old-*`` folders); returns them."""
    root = Path(repo_path)
    partial = sorted(p for p in root.glob(".*-*") if p.is_dir() and p.name.startswith((".tmp-", ".old-")))
    for folder in partial:
        logger.warning("Removing %s, left by an interrupted save", folder)
        shutil.rmtree(folder, ignore_errors=True)
    return partial


def prune_checkpoints(repo_path: str | os.PathLike, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` valid checkpoints; invalid folders are left for a person to look at."""
    valid, _ = list_checkpoints(repo_path)
    removed = [folder for folder, _ in valid[:-keep]] if keep > 0 else []
    for folder in removed:
        shutil.rmtree(folder, ignore_errors=True)
    return removed


def load_optimizer_state(folder: str | os.PathLike) -> dict[str, Any]:
    """``optimizer.pt`` of a verified checkpoint: ``{"optimizer": state_dict with local_epoch, "scheduler": ...}``."""
    return torch.load(Path(folder) / OPTIMIZER_STATE, map_location="cpu", weights_only=False)
