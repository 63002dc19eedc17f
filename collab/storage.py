"""Write a folder so that readers see either the old complete version or the new complete one, never half."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_directory(target: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary sibling folder to fill; on success it replaces ``target`` by rename, on error it is removed.

    A process killed midway leaves only a ``.tmp-*`` sibling, which readers ignore.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(f".tmp-{target.name}-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        yield staging
        previous = target.with_name(f".old-{target.name}-{os.getpid()}")
        if target.exists():
            os.replace(target, previous)
        os.replace(staging, target)
        shutil.rmtree(previous, ignore_errors=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
