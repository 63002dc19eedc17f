"""The checkpoint format: written by the monitor, read by ``run_trainer.py --resume_from`` and by people.

``<repo_path>/<step>/`` holds the ``save_pretrained`` model (``model.safetensors``) and tokenizer, ``optimizer.pt``
(the collaboration's Lamb state in ``hivemind.Optimizer.state_dict()`` form, with ``local_epoch``, plus the
scheduler: tensors and plain data only) and, written last, ``manifest.json``: step, loss, peers, time and the sha256
of every other file. The folder is filled under a temporary name, fsynced and renamed into place, so a reader sees a
whole checkpoint or none, and a power cut after the save keeps it.

A folder is a checkpoint only if its manifest lists exactly the files it holds, each with its sha256, under plain
names (letters, digits, ``._-``; no links, no ``..``, nothing absolute). Anything else is refused with a
``CheckpointError`` naming the folder and the file. Nothing read from a checkpoint can run code: ``optimizer.pt`` is
loaded with ``torch.load(weights_only=True)`` and the weights from ``model.safetensors`` only.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from collab.errors import CheckpointError
from collab.storage import atomic_directory

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
OPTIMIZER_STATE = "optimizer.pt"
FORMAT_VERSION = 1
PICKLED_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json")

# Bounds on what a reader accepts, far above any real checkpoint and far below what exhausts a machine.
MAX_FILES = 10_000
MAX_DEPTH = 4
MAX_MANIFEST_BYTES = 4 << 20
MAX_STEP = 10**12
MAX_PEERS = 10**6
MAX_ARCHIVE_MEMBERS = MAX_FILES
MAX_ARCHIVE_BYTES = 256 << 30

NAME_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
SHA256_HEX = re.compile(r"[0-9a-f]{64}")


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


def is_plain_name(name: str) -> bool:
    """A relative ``/``-separated path of at most MAX_DEPTH parts, each letters, digits and ``._-`` not starting with
    a dot: no absolute paths, ``..``, backslashes, hidden files or control characters."""
    parts = name.split("/")
    return len(parts) <= MAX_DEPTH and all(NAME_PART.fullmatch(part) for part in parts)


def folder_files(folder: str | os.PathLike) -> dict[str, os.stat_result]:
    """Every file under ``folder`` by relative name, with its ``lstat``; refuses links, devices and odd names."""
    folder = Path(folder)
    files: dict[str, os.stat_result] = {}
    pending = [(folder, "")]
    while pending:
        directory, prefix = pending.pop()
        try:
            entries = list(os.scandir(directory))
        except FileNotFoundError:
            raise CheckpointError(f"{folder}: no such folder") from None
        except NotADirectoryError:
            raise CheckpointError(f"{folder}: not a folder") from None
        for entry in entries:
            name = prefix + entry.name
            if not is_plain_name(name):
                raise CheckpointError(f"{folder}: {ascii(name)} is not a plain file name (refused)")
            if entry.is_symlink():
                raise CheckpointError(f"{folder}: {name} is a symbolic link (refused: a checkpoint holds plain files)")
            if entry.is_dir(follow_symlinks=False):
                pending.append((Path(entry.path), name + "/"))
            elif entry.is_file(follow_symlinks=False):
                files[name] = entry.stat(follow_symlinks=False)
            else:
                raise CheckpointError(f"{folder}: {name} is not a regular file (refused)")
            if len(files) > MAX_FILES:
                raise CheckpointError(f"{folder}: more than {MAX_FILES} files (refused)")
    return files


def _is_int(value: Any, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def parse_manifest(folder: Path, text: str) -> Manifest:
    """The manifest's fields, each checked for type and bounds; raises CheckpointError naming the first bad one."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{folder}: unreadable {MANIFEST} ({e.msg} at line {e.lineno})") from None
    known = {f.name for f in fields(Manifest)}
    if not isinstance(raw, dict) or not {"step", "files"} <= raw.keys() <= known:
        raise CheckpointError(f"{folder}: {MANIFEST} must be an object with step, files and only {sorted(known)}")
    raw.setdefault("loss", None)
    raw.setdefault("peers", 0)
    raw.setdefault("time", 0.0)
    if raw.get("format_version", FORMAT_VERSION) != FORMAT_VERSION:
        raise CheckpointError(f"{folder}: {MANIFEST} format_version is not {FORMAT_VERSION}")
    if not _is_int(raw["step"], 0, MAX_STEP):
        raise CheckpointError(f"{folder}: {MANIFEST} step must be an integer from 0 to {MAX_STEP}")
    if not _is_int(raw["peers"], 0, MAX_PEERS):
        raise CheckpointError(f"{folder}: {MANIFEST} peers must be an integer from 0 to {MAX_PEERS}")
    if not (raw["loss"] is None or _is_number(raw["loss"])) or not _is_number(raw["time"]):
        raise CheckpointError(f"{folder}: {MANIFEST} loss and time must be numbers")
    files = raw["files"]
    if not isinstance(files, dict) or not 0 < len(files) <= MAX_FILES:
        raise CheckpointError(f"{folder}: {MANIFEST} files must list 1 to {MAX_FILES} files")
    for name, digest in files.items():
        if not is_plain_name(name) or name == MANIFEST:
            raise CheckpointError(f"{folder}: {MANIFEST} lists {ascii(name)}, not a plain file name in the folder")
        if not isinstance(digest, str) or not SHA256_HEX.fullmatch(digest):
            raise CheckpointError(f"{folder}: {MANIFEST} gives {name} no sha256 (64 lowercase hex digits)")
    return Manifest(**raw)


def _verify(folder: Path, files: dict[str, os.stat_result]) -> Manifest:
    if MANIFEST not in files:
        raise CheckpointError(f"{folder}: no {MANIFEST} (an interrupted save?)")
    if files[MANIFEST].st_size > MAX_MANIFEST_BYTES:
        raise CheckpointError(f"{folder}: {MANIFEST} is over {MAX_MANIFEST_BYTES} bytes (refused)")
    try:
        text = (folder / MANIFEST).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise CheckpointError(f"{folder}: {MANIFEST} is not UTF-8 text") from None
    manifest = parse_manifest(folder, text)
    on_disk = set(files) - {MANIFEST}
    missing, unlisted = sorted(set(manifest.files) - on_disk), sorted(on_disk - set(manifest.files))
    if missing:
        raise CheckpointError(f"{folder}: {missing[0]} is missing")
    if unlisted:
        raise CheckpointError(f"{folder}: {unlisted[0]} is not listed in {MANIFEST} (refused)")
    for name, expected in manifest.files.items():
        if sha256_file(folder / name) != expected:
            raise CheckpointError(f"{folder}: {name} does not match its sha256 in {MANIFEST} (corrupted)")
    return manifest


def read_manifest(folder: str | os.PathLike) -> Manifest:
    """The manifest of a checkpoint folder, after checking that it lists every file, each with its sha256."""
    folder = Path(folder)
    return _verify(folder, folder_files(folder))


class VerifiedCheckpoints:
    """``read_manifest`` that hashes a folder once while its files stay the same (same names, sizes, inodes, mtimes
    and ctimes): the uploader looks at the newest checkpoint every interval, and hashing gigabytes each time wastes
    the disk. Refusals are remembered the same way. Holds at most ``capacity`` folders."""

    def __init__(self, capacity: int = 64):
        self.capacity = capacity
        self._known: dict[Path, tuple[tuple, Manifest | CheckpointError]] = {}

    def read_manifest(self, folder: str | os.PathLike) -> Manifest:
        folder = Path(folder)
        files = folder_files(folder)
        signature = tuple(
            (name, st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns) for name, st in sorted(files.items())
        )
        known = self._known.get(folder)
        if known is None or known[0] != signature:
            try:
                outcome: Manifest | CheckpointError = _verify(folder, files)
            except CheckpointError as e:
                outcome = e
            self._known.pop(folder, None)
            while len(self._known) >= self.capacity:
                self._known.pop(next(iter(self._known)))
            known = self._known[folder] = (signature, outcome)
        if isinstance(known[1], CheckpointError):
            raise CheckpointError(str(known[1]))
        return known[1]


Verify = Callable[[Path], Manifest]


def _step_folders(root: Path) -> list[Path]:
    """``<root>/<step>`` folders, oldest first (temporary ``.tmp-*``/``.old-*`` folders are not steps)."""
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.name.isdigit() and p.is_dir()), key=lambda p: int(p.name))


def _check(folder: Path, verify: Verify) -> Manifest:
    if folder.is_symlink():
        raise CheckpointError(f"{folder}: a symbolic link, not a checkpoint folder (refused)")
    return verify(folder)


def list_checkpoints(
    repo_path: str | os.PathLike, verify: Verify = read_manifest
) -> tuple[list[tuple[Path, Manifest]], list[tuple[Path, str]]]:
    """Valid checkpoints oldest first, and the invalid step folders with the reason (temporary folders ignored)."""
    valid, invalid = [], []
    for folder in _step_folders(Path(repo_path)):
        try:
            valid.append((folder, _check(folder, verify)))
        except CheckpointError as e:
            invalid.append((folder, str(e)))
        except FileNotFoundError:
            continue  # removed while it was read (the monitor rotates old checkpoints away): no longer there
    return valid, invalid


def latest_checkpoint(repo_path: str | os.PathLike, verify: Verify = read_manifest) -> tuple[Path, Manifest] | None:
    """The newest valid checkpoint, verifying newest first; invalid newer folders are logged and skipped."""
    for folder in reversed(_step_folders(Path(repo_path))):
        try:
            return folder, _check(folder, verify)
        except CheckpointError as e:
            logger.warning("Ignoring a folder that is not a valid checkpoint: %s", e)
        except FileNotFoundError:
            continue  # removed while it was read: no longer there
    return None


def remove_partial_saves(repo_path: str | os.PathLike) -> list[Path]:
    """Clear what interrupted saves left behind; returns the folders removed.

    ``.tmp-*`` folders are removed. An ``.old-<step>-<pid>`` folder is the previous complete copy of a step whose
    replacement was cut between its two renames: it is put back when ``<step>`` is missing, otherwise removed."""
    root = Path(repo_path)
    removed = []
    for folder in sorted(p for p in root.glob(".*-*") if p.is_dir() and p.name.startswith((".tmp-", ".old-"))):
        original = root / folder.name.removeprefix(".old-").rsplit("-", 1)[0]
        if folder.name.startswith(".old-") and original.name.isdigit() and not original.exists():
            logger.warning("Restoring %s from %s, left by an interrupted save", original, folder)
            os.replace(folder, original)
            continue
        logger.warning("Removing %s, left by an interrupted save", folder)
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed


def prune_checkpoints(repo_path: str | os.PathLike, keep: int, verify: Verify = read_manifest) -> list[Path]:
    """Delete all but the newest ``keep`` valid checkpoints; invalid folders are left for a person to look at.

    Call it only after the newest checkpoint is durable (``write_checkpoint`` has returned)."""
    valid, _ = list_checkpoints(repo_path, verify)
    removed = [folder for folder, _ in valid[:-keep]] if keep > 0 else []
    for folder in removed:
        shutil.rmtree(folder, ignore_errors=True)
    return removed


def write_checkpoint(
    repo_path: str | os.PathLike,
    step: int,
    model,
    tokenizer,
    optimizer_state: dict[str, Any],
    loss: float | None = None,
    peers: int = 0,
) -> Path:
    """Write ``<repo_path>/<step>/`` atomically and durably and return it; an existing one of that step is replaced.

    ``optimizer_state`` must hold only tensors and plain data (what ``torch.load(weights_only=True)`` reads back)."""
    target = Path(repo_path) / str(step)
    with atomic_directory(target) as staging:
        stage_checkpoint_files(staging, model, tokenizer, optimizer_state)
        files = {name: sha256_file(staging / name) for name in sorted(folder_files(staging))}
        manifest = Manifest(step=step, loss=loss, peers=peers, time=time.time(), files=files)
        (staging / MANIFEST).write_text(json.dumps(asdict(manifest), indent=2))
    return target


def stage_checkpoint_files(staging: Path, model, tokenizer, optimizer_state: dict[str, Any]) -> None:
    """Every file of a checkpoint but its manifest, written into the ``staging`` folder."""
    model.save_pretrained(staging)
    if tokenizer is not None:
        tokenizer.save_pretrained(staging)
    torch.save(optimizer_state, staging / OPTIMIZER_STATE)


def load_optimizer_state(folder: str | os.PathLike) -> dict[str, Any]:
    """``optimizer.pt`` of a verified checkpoint: ``{"optimizer": state_dict with local_epoch, "scheduler": ...}``.

    Read with ``weights_only=True``: a pickle that names any other object (a payload) is refused, not run."""
    path = Path(folder) / OPTIMIZER_STATE
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{folder}: {OPTIMIZER_STATE} is missing") from None
    except Exception as e:  # an UnpicklingError for a forbidden object, a RuntimeError for a broken zip
        raise CheckpointError(
            f"{folder}: {OPTIMIZER_STATE} is not tensors and plain data (refused unread: {type(e).__name__})"
        ) from None
    if not isinstance(state, dict) or not isinstance(state.get("optimizer"), dict):
        raise CheckpointError(f"{folder}: {OPTIMIZER_STATE} holds no optimizer state dict")
    return state


def load_model(folder: str | os.PathLike, model_class):
    """``model_class.from_pretrained(folder)`` from ``model.safetensors`` only: pickled weights are refused."""
    folder = Path(folder)
    for name in PICKLED_WEIGHTS:
        if (folder / name).exists():
            raise CheckpointError(f"{folder}: {name} holds pickled weights (refused: save with safetensors)")
    if not (folder / "config.json").is_file():
        raise CheckpointError(f"{folder}: config.json is missing")
    try:
        return model_class.from_pretrained(folder, use_safetensors=True)
    except OSError:
        raise CheckpointError(f"{folder}: model.safetensors is missing") from None


def _archive_members(archive: Path, tar: tarfile.TarFile, max_bytes: int, max_members: int) -> list[tarfile.TarInfo]:
    """The members of a checkpoint archive, if all are plain files and folders under one top folder, within bounds."""
    members, names, total, top = [], set(), 0, None
    for member in tar:
        name = member.name
        if len(members) >= max_members:
            raise CheckpointError(f"{archive}: more than {max_members} members (refused)")
        if not is_plain_name(name):
            raise CheckpointError(f"{archive}: member {ascii(name)} is not a plain relative name (refused)")
        if not (member.isreg() or member.isdir()):
            raise CheckpointError(f"{archive}: member {name} is a link or a device, not a file (refused)")
        if name in names:
            raise CheckpointError(f"{archive}: member {name} appears twice (refused)")
        first = name.split("/")[0]
        if top is not None and first != top or (name == first and not member.isdir()):
            raise CheckpointError(f"{archive}: member {name} is outside the archive's one top folder (refused)")
        top = first
        total += member.size
        if total > max_bytes:
            raise CheckpointError(f"{archive}: unpacks to more than {max_bytes} bytes (refused)")
        members.append(member)
        names.add(name)
    if top is None:
        raise CheckpointError(f"{archive}: empty archive")
    return members


def extract_archive(
    archive: str | os.PathLike,
    destination: str | os.PathLike,
    max_bytes: int = MAX_ARCHIVE_BYTES,
    max_members: int = MAX_ARCHIVE_MEMBERS,
) -> Path:
    """Unpack ``checkpoint-<step>.tar.gz`` (as the web app serves it) into ``destination``; returns its top folder.

    Every member is checked before anything is written: regular files and folders only, all under one top folder,
    plain relative names, at most ``max_members`` members and ``max_bytes`` bytes unpacked (and no more than the
    destination's free space, so a compressed bomb is refused instead of filling the disk)."""
    archive = Path(archive)
    existing = next(
        folder for folder in (Path(destination).absolute(), *Path(destination).absolute().parents) if folder.exists()
    )
    max_bytes = min(max_bytes, shutil.disk_usage(existing).free)
    try:
        with tarfile.open(archive, "r:gz") as tar:
            members = _archive_members(archive, tar, max_bytes, max_members)
            tar.extractall(destination, members=members, filter="data")
    except (tarfile.TarError, EOFError, OSError) as e:
        raise CheckpointError(f"{archive}: not a readable .tar.gz ({type(e).__name__})") from None
    return Path(destination) / members[0].name.split("/")[0]


def is_archive(path: str | os.PathLike) -> bool:
    return str(path).endswith(".tar.gz") and Path(path).is_file()


@contextlib.contextmanager
def opened_checkpoint(path: str | os.PathLike) -> Iterator[tuple[Path, Manifest]]:
    """A verified checkpoint ``(folder, manifest)`` from a checkpoint folder or a ``checkpoint-<step>.tar.gz``.

    An archive is unpacked into a temporary folder (removed on leaving) and verified like a folder; errors name the
    archive instead of the temporary folder."""
    path = Path(path)
    if not is_archive(path):
        if not path.is_dir():
            raise CheckpointError(f"{path}: not a checkpoint folder or a checkpoint-<step>.tar.gz")
        yield path, read_manifest(path)
        return
    with tempfile.TemporaryDirectory(prefix="checkpoint-") as tmp:
        try:
            folder = extract_archive(path, tmp)
            yield folder, read_manifest(folder)
        except CheckpointError as e:
            raise CheckpointError(str(e).replace(tmp, str(path))) from None
