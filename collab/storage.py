"""Write a folder so that readers see either the old complete version or the new complete one, never half,
and so that the new one survives a power cut once ``atomic_directory`` returns."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path


def fsync_path(path: str | os.PathLike) -> None:
    """Flush one file or folder to disk (a folder's fsync makes the names in it, and renames into it, durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str | os.PathLike) -> None:
    """fsync every file under ``root``, then every folder deepest first, ``root`` last; links are not followed."""
    for folder, _, files in os.walk(root, topdown=False):
        for name in files:
            path = os.path.join(folder, name)
            if not os.path.islink(path):
                fsync_path(path)
        fsync_path(folder)


@contextlib.contextmanager
def atomic_directory(target: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary sibling folder to fill; on success it replaces ``target`` by rename, on error it is removed.

    A process killed midway leaves only a ``.tmp-*`` sibling, which readers ignore. Before the rename every file and
    folder of the new version is fsynced, and the parent folder after it: when this returns the new version is on
    disk, so a caller may then delete older copies (a power cut can otherwise keep the rename but lose the data).
    """
    target = Path(target)
    created = [folder for folder in (target.parent, *target.parent.parents) if not folder.exists()]
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(f".tmp-{target.name}-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        yield staging
        fsync_tree(staging)
        previous = target.with_name(f".old-{target.name}-{os.getpid()}")
        if target.exists():
            os.replace(target, previous)
        os.replace(staging, target)
        for folder in (target.parent, *(new.parent for new in created)):
            fsync_path(folder)
        shutil.rmtree(previous, ignore_errors=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
