"""Machine-readable events: one JSON object per line (``{"time": <unix s>, "event": "<name>", ...}``) in the file
given by ``--events_path``, for tests, benchmarks, the demo and operators' tools (docs/EVENTS.md is the interface).

There is one event log per process, like logging's root logger: a program opens it once at start-up
(``open_event_log``) and any code calls ``emit``; without ``--events_path`` it is a no-op. hivemind's averagers run
their rounds in processes forked from the peer, which inherit the open file and append to it too: each line goes out
in one ``write`` to a file opened with ``O_APPEND`` and is at most ``MAX_LINE_BYTES`` long, so lines from several
processes never mix. Values are bounded: numbers finite (else null), strings cut to ``MAX_STRING_CHARS`` and escaped
by JSON, lists cut to ``MAX_LIST_ITEMS``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path

from collab.errors import UserError

logger = logging.getLogger(__name__)

MAX_STRING_CHARS = 300  # a multiaddr with a peer ID is about 90 characters
MAX_LIST_ITEMS = 16
MAX_LINE_BYTES = 4096  # one write of this size to an O_APPEND file is not interleaved with another process's write
MAX_INTEGER = 2**63 - 1  # what a signed 64-bit reader (most JSON tools) can hold

Scalar = None | bool | int | float | str


def bounded(value) -> Scalar | list[Scalar]:
    """``value`` as a JSON-safe, bounded value; TypeError for anything but None, bool, int, float, str or a list or
    tuple of those (events carry facts, not objects: a field of another type is a bug in the caller)."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        return value if -MAX_INTEGER <= value <= MAX_INTEGER else None
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, str):
        return value[:MAX_STRING_CHARS]
    if isinstance(value, list | tuple):
        return [bounded(item) for item in value[:MAX_LIST_ITEMS] if not isinstance(item, list | tuple)]
    raise TypeError(f"event fields are numbers, strings, booleans or lists of them, not {type(value).__name__}")


def event_line(event: str, now: float, fields: dict) -> bytes:
    """One event as a JSON line of at most MAX_LINE_BYTES (newline included), ``time`` and ``event`` first."""
    record = {"time": round(now, 3), "event": bounded(event)}
    record.update((str(name)[:MAX_STRING_CHARS], bounded(value)) for name, value in fields.items())
    line = json.dumps(record, ensure_ascii=True, allow_nan=False, separators=(",", ":")) + "\n"
    if len(line) > MAX_LINE_BYTES:
        raise ValueError(f"event {event!r} is {len(line)} bytes, more than {MAX_LINE_BYTES}: send fewer fields")
    return line.encode("ascii")


class EventLog:
    """Appends events to ``path``; with ``path=None`` every ``emit`` does nothing."""

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = None if path is None else Path(path)
        self._fd = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)

    def emit(self, event: str, **fields) -> None:
        """Append ``{"time", "event", **fields}``. A failed write (full disk) is logged once and ends the log, so an
        events file never stops training."""
        if self._fd is None:
            return
        line = event_line(event, time.time(), fields)
        try:
            os.write(self._fd, line)
        except OSError as e:
            logger.warning("Could not write to the events file %s (%s): no more events are written", self.path, e)
            self.close()

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


_process_log = EventLog()


def open_event_log(path: str | os.PathLike | None) -> EventLog:
    """Make ``EventLog(path)`` this process's event log (the previous one is closed); returns it. A path that
    cannot be opened for appending is a UserError naming --events_path."""
    global _process_log
    _process_log.close()
    try:
        _process_log = EventLog(path)
    except OSError as e:
        _process_log = EventLog()
        raise UserError(f"--events_path: cannot append to {path} ({e.strerror}); give a writable file path") from None
    return _process_log


def emit(event: str, **fields) -> None:
    """``emit`` on this process's event log (see ``open_event_log``)."""
    _process_log.emit(event, **fields)


def read_events(path: str | os.PathLike, event: str | None = None) -> list[dict]:
    """The events in ``path`` (all, or those named ``event``), oldest first; [] while the file does not exist.
    A last line still being written (no newline yet) is left for the next read."""
    return list(_parse(path, event))


def _parse(path: str | os.PathLike, event: str | None) -> Iterator[dict]:
    try:
        text = Path(path).read_text(encoding="ascii", errors="replace")
    except FileNotFoundError:
        return
    for line in text.split("\n")[:-1]:
        if line.strip():
            record = json.loads(line)
            if event is None or record.get("event") == event:
                yield record
