"""A peer whose every mini-batch has a non-finite loss (finite parameters, so the parameter check never fires): it
restores its backup after ``--nonfinite_batch_limit`` dropped batches in a row, and stops with one line when the
backup drops as many. Seen on a GPU: a BERT-base peer at the tiny model's learning rate dropped 1391 batches in 72 s,
stepping 12 times between them (docs/benchmarks/2026-11-27-nvidia-h100-gpu.md)."""

from __future__ import annotations

import pytest
import torch

from collab import events
from collab.errors import ConfigError
from tests.alone_peer import STEPS, alone_training, train_alone

pytestmark = pytest.mark.light

LIMIT = 3


def overflow_layer_norms(model: torch.nn.Module) -> None:
    """LayerNorm gains of 1e30: every parameter finite, every forward pass's attention scores infinite."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.weight.fill_(1e30)


@pytest.fixture
def events_path(tmp_path):
    """This process's event log, for the peer trained in it; closed afterwards."""
    path = tmp_path / "events.jsonl"
    events.open_event_log(path)
    yield path
    events.open_event_log(None)


def dropped_and_rollback_reasons(path) -> tuple[int, list[str]]:
    return len(events.read_events(path, "batch_dropped")), [r["reason"] for r in events.read_events(path, "rollback")]


@pytest.mark.timeout(120)
def test_a_peer_that_drops_every_batch_goes_back_to_its_backup_and_trains(events_path):
    training = alone_training(nonfinite_batch_limit=LIMIT)
    summary, _, after = train_alone(None, "streak_restore", training, spoil=overflow_layer_norms)
    assert (summary.skipped_batches, summary.rollbacks) == (LIMIT, 1)
    assert summary.end_epoch == STEPS
    assert all(torch.isfinite(param).all() for param in after.values())
    assert max(param.abs().max() for name, param in after.items() if "LayerNorm" in name) < 100
    assert dropped_and_rollback_reasons(events_path) == (LIMIT, ["nonfinite_batches"])


@pytest.mark.timeout(120)
def test_a_peer_whose_backup_drops_every_batch_too_stops_naming_the_learning_rate(events_path):
    training = alone_training(nonfinite_batch_limit=LIMIT, learning_rate=0.05)
    with pytest.raises(ConfigError) as stopped:
        train_alone(None, "streak_diverged", training, spoil=overflow_layer_norms, spoil_backup=True)
    message = str(stopped.value)
    assert message.startswith("--learning_rate: training diverged (3 mini-batches in a row") and "\n" not in message
    assert "now 0.05" in message and stopped.value.field == "learning_rate"
    assert dropped_and_rollback_reasons(events_path) == (2 * LIMIT, ["nonfinite_batches"])
