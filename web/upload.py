"""Stream a multipart upload straight to a temporary file, hashing and counting bytes as they arrive.

Starlette's ``request.form()`` spools files to the system temp folder with no size bound; a checkpoint can be
gigabytes, so the archive part is written under the app's data folder instead (the same filesystem as its final
place, so the caller can ``os.replace`` it atomically) and the upload stops at ``max_bytes``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from fastapi import HTTPException, Request
from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.concurrency import run_in_threadpool

logger = logging.getLogger(__name__)

MAX_FIELD_BYTES = 1024
MAX_FIELDS = 16


@dataclass
class ReceivedFile:
    """The uploaded file, still under its temporary name: rename it into place or delete it."""

    path: Path
    size: int = 0
    sha256: str = ""


@dataclass
class _State:
    folder: Path
    file_field: str
    max_bytes: int
    fields: dict[str, str] = field(default_factory=dict)
    file: ReceivedFile | None = None
    headers: dict[bytes, bytes] = field(default_factory=dict)
    header_name: bytes = b""
    header_value: bytes = b""
    name: str = ""
    buffer: bytearray = field(default_factory=bytearray)
    handle: BinaryIO | None = None
    digest: hashlib._Hash = field(default_factory=hashlib.sha256)


def _callbacks(state: _State) -> dict:
    def on_part_begin() -> None:
        state.headers, state.buffer = {}, bytearray()

    def on_header_field(data: bytes, start: int, end: int) -> None:
        state.header_name += data[start:end]

    def on_header_value(data: bytes, start: int, end: int) -> None:
        state.header_value += data[start:end]

    def on_header_end() -> None:
        state.headers[state.header_name.lower()] = state.header_value
        state.header_name, state.header_value = b"", b""

    def on_headers_finished() -> None:
        _, options = parse_options_header(state.headers.get(b"content-disposition", b""))
        state.name = options.get(b"name", b"").decode("utf-8", "replace")
        if b"filename" not in options:
            if len(state.fields) >= MAX_FIELDS:
                raise HTTPException(400, "too many form fields")
            return
        if state.name != state.file_field or state.file is not None:
            raise HTTPException(400, f"expected one file, in the form field {state.file_field!r}")
        handle = tempfile.NamedTemporaryFile(dir=state.folder, prefix=".upload-", suffix=".part", delete=False)
        state.handle, state.file = handle, ReceivedFile(Path(handle.name))

    def on_part_data(data: bytes, start: int, end: int) -> None:
        if state.handle is None:
            state.buffer += data[start:end]
            if len(state.buffer) > MAX_FIELD_BYTES:
                raise HTTPException(400, f"form field {state.name!r} is longer than {MAX_FIELD_BYTES} bytes")
            return
        state.file.size += end - start
        if state.file.size > state.max_bytes:
            raise HTTPException(413, f"upload larger than the limit of {state.max_bytes} bytes (--max_upload_mb)")
        state.handle.write(data[start:end])
        state.digest.update(data[start:end])

    def on_part_end() -> None:
        if state.handle is None:
            state.fields[state.name] = state.buffer.decode("utf-8", "replace")
            return
        state.handle.flush()
        os.fsync(state.handle.fileno())
        state.handle.close()
        state.handle = None
        state.file.sha256 = state.digest.hexdigest()

    return {name: function for name, function in locals().items() if name.startswith("on_")}


def remove_interrupted_uploads(folder: Path) -> list[Path]:
    """Delete the temporary files of uploads cut short by a crash of the app (``.upload-*.part``)."""
    leftovers = sorted(folder.rglob(".upload-*.part"))
    for path in leftovers:
        logger.warning("Removing %s, left by an upload interrupted by a restart", path)
        path.unlink(missing_ok=True)
    return leftovers


def remove_unlisted_archives(folder: Path, listed: set[str]) -> list[Path]:
    """Delete ``checkpoint-*.tar.gz`` files the store does not list (``listed``: their paths as stored).

    They are left when the app stops between renaming an upload into place and recording it, or between
    forgetting an old checkpoint and deleting its archive; nothing can download them. Files are matched by their
    place under the data folder (``experiments/<id>/<name>``), so a data folder given by another path is kept.
    """
    listed_places = {Path(path).parts[-3:] for path in listed}
    unlisted = sorted(
        path
        for path in folder.glob("experiments/*/checkpoint-*.tar.gz")
        if path.relative_to(folder).parts not in listed_places
    )
    for path in unlisted:
        logger.warning("Removing %s, an archive no experiment lists (left by a restart)", path)
        path.unlink(missing_ok=True)
    return unlisted


async def receive_upload(
    request: Request, folder: Path, max_bytes: int, file_field: str
) -> tuple[dict[str, str], ReceivedFile]:
    """The form's text fields and its one file, streamed to ``folder``; raises HTTPException 400 or 413."""
    content_type, options = parse_options_header(request.headers.get("content-type", ""))
    if content_type != b"multipart/form-data" or not options.get(b"boundary"):
        raise HTTPException(400, "expected a multipart/form-data body")
    folder.mkdir(parents=True, exist_ok=True)
    state = _State(folder, file_field, max_bytes)
    parser = MultipartParser(options[b"boundary"], _callbacks(state))
    try:
        try:
            async for chunk in request.stream():
                if chunk:
                    await run_in_threadpool(parser.write, chunk)
            parser.finalize()
        except MultipartParseError as e:
            raise HTTPException(400, f"malformed multipart body ({e})") from None
        if state.file is None or state.handle is not None:
            raise HTTPException(400, f"no complete file in the form field {file_field!r}")
    except BaseException:
        if state.handle is not None:
            state.handle.close()
        if state.file is not None:
            state.file.path.unlink(missing_ok=True)
        raise
    return state.fields, state.file
