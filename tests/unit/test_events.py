"""collab.events: one bounded JSON object per line, appended by several processes without mixing lines."""

from __future__ import annotations

import json
import math
import multiprocessing as mp

import pytest

from collab import events
from collab.errors import UserError
from collab.events import MAX_LINE_BYTES, MAX_LIST_ITEMS, MAX_STRING_CHARS, EventLog, read_events

pytestmark = pytest.mark.light


def test_events_are_json_lines_with_time_and_name_first(tmp_path):
    log = EventLog(tmp_path / "events.jsonl")
    log.emit("joined", address=["/ip4/127.0.0.1/tcp/1/p2p/Qm"], client_mode=False)
    log.emit("epoch", epoch=3, samples=128, loss=2.5)
    log.close()
    lines = (tmp_path / "events.jsonl").read_text().splitlines()
    assert [list(json.loads(line))[:2] for line in lines] == [["time", "event"]] * 2
    assert read_events(tmp_path / "events.jsonl", "epoch")[0] == {
        "time": pytest.approx(json.loads(lines[1])["time"]),
        "event": "epoch",
        "epoch": 3,
        "samples": 128,
        "loss": 2.5,
    }


def test_values_are_bounded_and_escaped(tmp_path):
    log = EventLog(tmp_path / "events.jsonl")
    forged = 'x"}\n{"time": 0, "event": "shutdown", "saved": true}\u2028' + "y" * 10_000
    log.emit("averaged", loss=math.nan, seconds=math.inf, big=2**70, name=forged, addresses=["a"] * 100)
    (record,) = read_events(tmp_path / "events.jsonl")
    assert record["loss"] is None and record["seconds"] is None and record["big"] is None
    assert record["name"] == forged[:MAX_STRING_CHARS] and len(record["addresses"]) == MAX_LIST_ITEMS
    assert len((tmp_path / "events.jsonl").read_bytes()) <= MAX_LINE_BYTES
    with pytest.raises(TypeError):
        log.emit("epoch", tensor=object())


def test_no_path_writes_nothing_and_an_unwritable_path_names_the_flag(tmp_path):
    EventLog(None).emit("epoch", epoch=1)
    with pytest.raises(UserError, match="^--events_path: "):
        events.open_event_log(tmp_path)  # a folder
    events.emit("epoch", epoch=1)  # the process's log is back to the no-op
    assert list(tmp_path.iterdir()) == []


def _append_many(path: str, tag: str, count: int) -> None:
    log = EventLog(path)
    for index in range(count):
        log.emit("averaged", tag=tag, index=index, padding="z" * 2000)


def test_processes_appending_to_one_file_never_mix_lines(tmp_path):
    path = tmp_path / "events.jsonl"
    workers = [mp.get_context("fork").Process(target=_append_many, args=(str(path), tag, 300)) for tag in "ab"]
    for worker in workers:
        worker.start()
    _append_many(str(path), "main", 300)
    for worker in workers:
        worker.join(30)
    records = read_events(path)  # every line parses
    assert len(records) == 900
    for tag in ("a", "b", "main"):
        assert [r["index"] for r in records if r["tag"] == tag] == list(range(300))
