"""A peer that signs its records but lies about its step cannot stop or steer the monitor's report."""

import json
import logging

import hivemind
import pytest
from hivemind.utils import get_dht_time

from collab.schema import metrics_key
from monitor.run import MonitorState, last_step_within_reach, refresh
from monitor.sinks import JsonLinesSink, last_step_in

PREFIX = "liar_test"
LIAR_STEP = 2**39


def record(step, loss=8.0, mini_steps=4, samples=64, sps=10.0):
    return {
        "step": step,
        "samples_per_second": sps,
        "samples_accumulated": samples,
        "loss": loss,
        "mini_steps": mini_steps,
    }


def test_a_last_step_far_past_the_swarm_s_is_forgotten():
    assert last_step_within_reach(None, 7, 2) is None
    assert last_step_within_reach(9, 7, 2) == 9  # the newest peer left: not progress to report again
    assert last_step_within_reach(10, 7, 2) is None
    assert last_step_within_reach(2**62, 7, 2) is None
    assert last_step_within_reach(3, 7, 2) == 3


def test_lines_go_on_at_the_honest_step_with_a_liar_in_the_dht_and_a_liar_s_step_in_the_file(tmp_path, caplog):
    """The metrics file ends with a step 2^62 that an older monitor wrote for a liar; a liar's record at 2^39 sits
    among three honest ones. Every refresh writes the honest step; the liar is named in the log once."""
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 5, "loss": 2.0}) + "\n" + json.dumps({"step": 2**62, "loss": 0.0}) + "\n")
    state = MonitorState(last_step=last_step_in(path))
    assert state.last_step == 2**62
    sink = JsonLinesSink(path)
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:

        def publish(peer: bytes, value: dict) -> None:
            assert dht.store(metrics_key(PREFIX), value, get_dht_time() + 60, subkey=peer)

        publish(b"liar", record(LIAR_STEP, loss=0.0, samples=2**39, sps=1e7))
        with caplog.at_level(logging.WARNING, logger="monitor.run"):
            for step in (7, 8):
                for peer in (b"a", b"b", b"c"):
                    publish(peer, record(step))
                refresh(dht, PREFIX, state, [sink], saver=None, step_lag=2)
    finally:
        sink.close()
        dht.shutdown()
    lines = [json.loads(line) for line in path.read_text().splitlines()[2:]]
    assert [(line["step"], line["alive_peers"], line["samples"], line["loss"]) for line in lines] == [
        (7, 3, 192, 2.0),
        (8, 3, 192, 2.0),
    ]
    assert [line["samples_per_second"] for line in lines] == [pytest.approx(30.0)] * 2
    assert last_step_in(path) == 8
    warnings = [r.getMessage() for r in caplog.records]
    assert sum(str(LIAR_STEP) in message for message in warnings) == 1, warnings
    assert sum(str(2**62) in message for message in warnings) == 1, warnings
    assert all("\n" not in message for message in warnings)


def test_a_metrics_line_without_a_whole_number_step_is_skipped_on_restart(tmp_path):
    path = tmp_path / "metrics.jsonl"
    bad_steps = ['{"step": 1e400}', '{"step": "9"}', '{"step": true}', '{"step": -3}', '{"step": 4.5}']
    path.write_text(json.dumps({"step": 5}) + "\n" + "\n".join(bad_steps) + "\n")
    assert last_step_in(path) == 5
