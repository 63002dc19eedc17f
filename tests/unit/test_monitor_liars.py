"""A peer that signs its records but lies about its step cannot stop or steer the monitor's report."""

import json
import logging

import hivemind
import pytest
from hivemind.utils import get_dht_time
from transformers import AutoModelForMaskedLM

from arguments import AveragerArguments, OptimizerArguments, PeerArguments, TrainingArguments
from collab import events
from collab.checkpoint import latest_checkpoint, read_manifest, write_checkpoint
from collab.optim import build_state_averager
from collab.schema import metrics_key
from monitor.checkpoints import CheckpointSaver, default_epoch_tolerance, epoch_in_reach, set_aside_checkpoints_past
from monitor.run import MonitorState, last_step_within_reach, refresh
from monitor.sinks import JsonLinesSink, last_step_in
from tests.conftest import metrics_record
from trainer.local import wait_until
from trainer.model import tiny_bert_config

PREFIX = "liar_test"
LIAR_STEP = 2**39


def test_a_last_step_far_past_the_swarm_s_is_forgotten():
    assert last_step_within_reach(None, 7, 2) is None
    assert last_step_within_reach(9, 7, 2) == 9  # the newest peer left: not progress to report again
    assert last_step_within_reach(10, 7, 2) is None
    assert last_step_within_reach(2**62, 7, 2) is None
    assert last_step_within_reach(3, 7, 2) == 3
    # records of dead peers drag the swarm's step a few epochs below the last one reported: that is no liar's
    assert last_step_within_reach(25, 22, MonitorState().step_tolerance) == 25


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

        publish(b"liar", metrics_record(LIAR_STEP, loss=0.0, samples=2**39, sps=1e7))
        with caplog.at_level(logging.WARNING, logger="monitor.run"):
            for step in (7, 8):
                for peer in (b"a", b"b", b"c"):
                    publish(peer, metrics_record(step))
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


def test_a_state_far_from_the_swarm_s_step_is_not_the_swarm_s():
    assert default_epoch_tolerance(2, 120.0) == 122
    assert epoch_in_reach(130, 8, 122) and epoch_in_reach(8, 8, 0)
    assert not epoch_in_reach(131, 8, 122) and not epoch_in_reach(2**39, 8, 122)
    assert not epoch_in_reach(9, 130, 120)  # far behind: not the swarm's state either


def test_a_checkpoint_far_past_the_swarm_is_set_aside_and_saving_goes_on(tmp_path):
    """A folder an older monitor saved under a liar's epoch would be the newest checkpoint forever: never due
    again, never pruned, uploaded and resumed from. Seen against the swarm's step, it is renamed and forgotten."""
    model = AutoModelForMaskedLM.from_config(tiny_bert_config(64))
    for step in (4, 2**39):
        write_checkpoint(tmp_path, step, model, None, {"optimizer": None}, loss=3.5, peers=2)
    saver = CheckpointSaver(None, model, None, str(tmp_path), interval=5, keep=3, load_timeout=10, epoch_tolerance=12)
    assert saver.last_saved_step == 2**39
    assert saver.maybe_save(step=6, loss=3.0, peers=2) is None  # step 4 was saved 2 steps ago: not due yet
    assert saver.last_saved_step == 4 and latest_checkpoint(tmp_path)[1].step == 4
    assert read_manifest(tmp_path / f"rejected-{2**39}").step == 2**39  # kept for a person to look at
    write_checkpoint(tmp_path, 2**39, model, None, {"optimizer": None}, loss=3.5, peers=2)
    assert set_aside_checkpoints_past(tmp_path, 18) == [tmp_path / f"rejected-{2**39}-1"]
    assert set_aside_checkpoints_past(tmp_path, 3) == [tmp_path / "rejected-4"]


def test_the_saver_skips_a_liar_s_state_promptly_and_saves_the_swarm_s(tmp_path):
    """A real peer serves its state under epoch 2^39: the monitor's saver downloads it without stepping the
    scheduler 2^39 times, saves nothing, and saves the next state whose epoch is the swarm's."""
    prefix = "liar_state_test"
    peer_args = PeerArguments(experiment_prefix=prefix)
    settings = (OptimizerArguments(), AveragerArguments(), TrainingArguments(warmup_steps=2, total_steps=100))
    serving_dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    monitor_dht = hivemind.DHT(
        start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=serving_dht.get_visible_maddrs()
    )
    serving = monitor = None
    try:
        model = AutoModelForMaskedLM.from_config(tiny_bert_config(64))
        serving = build_state_averager(model, serving_dht, peer_args, *settings)
        serving.allow_state_sharing = True
        serving.local_epoch = LIAR_STEP
        monitor_model = AutoModelForMaskedLM.from_config(tiny_bert_config(64))
        monitor = build_state_averager(monitor_model, monitor_dht, peer_args, *settings)
        saver = CheckpointSaver(
            monitor, monitor_model, None, str(tmp_path), 5, 2, load_timeout=10, retry_period=0, epoch_tolerance=12
        )
        events_path = tmp_path.parent / f"{tmp_path.name}.events.jsonl"  # beside the checkpoints' folder
        events.open_event_log(events_path)
        try:
            wait_until(
                lambda: saver.maybe_save(8, 3.0, 2) is None and events.read_events(events_path, "checkpoint_refused"),
                timeout=60,
                what="the monitor to download the liar's state",
                poll=0.1,
            )
        finally:
            events.open_event_log(None)
        assert saver.last_saved_step is None and not list(tmp_path.iterdir())
        refused = events.read_events(events_path, "checkpoint_refused")[0]
        assert (refused["epoch"], refused["step"]) == (LIAR_STEP, 8)
        serving.local_epoch = 9
        wait_until(lambda: saver.maybe_save(8, 3.0, 2) is not None, 60, "the swarm's state to be saved", poll=0.1)
        assert saver.last_saved_step == 9 and read_manifest(tmp_path / "9").step == 9
        assert monitor.scheduler._step_count == 10  # stepped once per epoch up to 9, as hivemind does
    finally:
        for averager in filter(None, (monitor, serving)):
            averager.shutdown()
        monitor_dht.shutdown()
        serving_dht.shutdown()
