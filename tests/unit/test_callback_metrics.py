"""A peer whose epoch values are past the LocalMetrics bounds (a diverged loss) keeps training and publishes nothing
for that epoch; the next sound epoch is published. A real hivemind.Optimizer alone on a real DHT."""

from __future__ import annotations

import hivemind
import pytest
import torch
from transformers import AutoModelForMaskedLM

from arguments import AveragerArguments, OptimizerArguments, PeerArguments, ProgressTrackerArguments, TrainingArguments
from collab import events
from collab.callback import CollaborativeCallback
from collab.optim import build_optimizer
from collab.schema import make_validators, metrics_key
from trainer.model import tiny_bert_config

pytestmark = pytest.mark.light

PREFIX = "diverged_metrics"
SAMPLES = 4


def test_a_loss_past_the_records_bounds_is_not_published_and_training_goes_on(tmp_path, caplog):
    torch.manual_seed(0)
    model = AutoModelForMaskedLM.from_config(tiny_bert_config(100))
    validators, public_key = make_validators(PREFIX)
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], record_validators=validators)
    events.open_event_log(tmp_path / "events.jsonl")
    try:
        optimizer = build_optimizer(
            model,
            dht,
            PeerArguments(experiment_prefix=PREFIX),
            OptimizerArguments(target_batch_size=8, matchmaking_time=0.5, averaging_timeout=5.0),
            AveragerArguments(),
            ProgressTrackerArguments(),
            TrainingArguments(per_device_train_batch_size=SAMPLES),
        )
        try:
            callback = CollaborativeCallback(dht, optimizer, model, public_key, PREFIX, 600.0, 1)
            callback.on_train_begin(None)
            batch = {"input_ids": torch.randint(0, 100, (SAMPLES, 8)), "labels": torch.randint(0, 100, (SAMPLES, 8))}
            reports = []
            for loss in (1e9, 2.0):  # a mean loss of 1e9 per mini-step: past LocalMetrics' bound
                epoch = optimizer.local_epoch
                while optimizer.local_epoch == epoch:
                    model(**batch).loss.backward()
                    optimizer.step(batch_size=SAMPLES)
                    optimizer.zero_grad()
                    report = callback.on_step_end(loss, SAMPLES)
                reports.append(report)
                records = dht.get(metrics_key(PREFIX), latest=True)
                published = {} if records is None else records.value
                assert (public_key in published) == (loss < 1e6), f"epoch ended with loss {loss}: {published}"
        finally:
            optimizer.shutdown()
    finally:
        dht.shutdown()
        events.open_event_log(None)
    assert [report.published for report in reports] == [False, True]
    assert "Not publishing the metrics of epoch" in caplog.text
    assert [r["published"] for r in events.read_events(tmp_path / "events.jsonl", "epoch")] == [False, True]
