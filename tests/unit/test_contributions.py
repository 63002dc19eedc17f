"""The monitor's refresh with a real DHT: each new step's metrics line lists the contributors, its event stays flat."""

from __future__ import annotations

import hashlib
import json

import hivemind
import pytest
from hivemind.utils import get_dht_time

from collab import events
from collab.schema import metrics_key
from monitor.run import MonitorState, refresh
from monitor.sinks import JsonLinesSink
from tests.conftest import metrics_record

pytestmark = pytest.mark.light

PREFIX = "contributions_test"


def contributed(step: int, samples: int, epochs: int, name: str | None = None) -> dict:
    record = {**metrics_record(step=step), "contributed_samples": samples, "contributed_epochs": epochs}
    return record if name is None else {**record, "public_name": name}


def test_each_new_step_writes_the_contributors_to_the_metrics_line_and_a_flat_event(tmp_path):
    """A DHT node without the schema validators holds a record with a terminal-clearing name, as a foreign node
    could: the monitor drops it when it reads the records."""
    path, events_path = tmp_path / "metrics.jsonl", tmp_path / "events.jsonl"
    events.open_event_log(events_path)
    state, sink = MonitorState(), JsonLinesSink(path)
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:

        def publish(peer: bytes, value: dict) -> None:
            assert dht.store(metrics_key(PREFIX), value, get_dht_time() + 60, subkey=peer)

        publish(b"alice-key", contributed(7, 448, 7, "alice <3"))
        publish(b"b-key", contributed(7, 64, 1))
        publish(b"hostile", contributed(7, 10**9, 7, "\x1b[2J\x1b[H" + "x" * 20))
        refresh(dht, PREFIX, state, [sink], saver=None, step_lag=2)
        publish(b"alice-key", contributed(8, 512, 8, "alice <3"))
        refresh(dht, PREFIX, state, [sink], saver=None, step_lag=2)
    finally:
        sink.close()
        dht.shutdown()
        events.open_event_log(None)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(line["step"], line["alive_peers"]) for line in lines] == [(7, 2), (8, 2)]
    first, last = lines[0]["contributors"], lines[1]["contributors"]
    keys = {hashlib.sha256(key).hexdigest()[:12]: key for key in (b"alice-key", b"b-key")}
    assert [(keys[c["peer"]], c["name"], c["samples"], c["rounds"]) for c in first] == [
        (b"alice-key", "alice <3", 448, 7),
        (b"b-key", None, 64, 1),
    ]
    assert [(keys[c["peer"]], c["name"], c["samples"], c["rounds"]) for c in last] == [
        (b"alice-key", "alice <3", 512, 8),
        (b"b-key", None, 64, 1),
    ]
    assert last[0]["seconds_online"] == last[0]["last_seen"] - first[0]["last_seen"] > 0
    assert last[1]["seconds_online"] == 0 and last[1]["last_seen"] == first[1]["last_seen"]  # b published no more
    reported = events.read_events(events_path, "step_reported")
    assert [record["step"] for record in reported] == [7, 8]
    assert all("contributors" not in record and record["alive_peers"] == 2 for record in reported)


class RecordingSaver:
    """Stands for monitor.checkpoints.CheckpointSaver, whose download takes minutes on a big state: it notes which
    steps the metrics file held when each save began, and saves (and evaluates) at step 8 only."""

    def __init__(self, path):
        self.path, self.reported_when_saving, self.last_saved_step = path, [], None

    def maybe_save(self, step, loss, peers):
        self.reported_when_saving.append([json.loads(line)["step"] for line in self.path.read_text().splitlines()])
        if step != 8:
            return None
        self.last_saved_step = step
        return self.path.parent / str(step)

    def evaluate(self):
        return {"eval_loss": 3.25}


def test_a_step_is_reported_before_its_checkpoint_is_saved_and_the_evaluation_rides_on_the_next(tmp_path):
    path, events_path = tmp_path / "metrics.jsonl", tmp_path / "events.jsonl"
    events.open_event_log(events_path)
    state, sink = MonitorState(), JsonLinesSink(path)
    saver = RecordingSaver(path)
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        for step in (7, 8, 9):
            assert dht.store(metrics_key(PREFIX), contributed(step, 64 * step, step), get_dht_time() + 60, b"a")
            refresh(dht, PREFIX, state, [sink], saver=saver, step_lag=2)
    finally:
        sink.close()
        dht.shutdown()
        events.open_event_log(None)
    assert saver.reported_when_saving == [[7], [7, 8], [7, 8, 9]]
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(line["step"], line.get("eval_loss")) for line in lines] == [(7, None), (8, None), (9, 3.25)]
    evaluated = events.read_events(events_path, "checkpoint_evaluated")
    assert [(event["step"], event["eval_loss"]) for event in evaluated] == [(8, 3.25)]
