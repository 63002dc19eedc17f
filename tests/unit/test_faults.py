"""tests/faults.py: the test-only fault spec, its one-shot triggers and the checkpoint-write pause."""

import ast
from pathlib import Path

import pytest

import collab.checkpoint
from collab import events
from collab.checkpoint import read_manifest, write_checkpoint
from tests.conftest import optimizer_state
from tests.faults import parse_faults, pause_checkpoint_writes, split_faults_flag

pytestmark = pytest.mark.light


def test_spec_is_parsed_and_each_fault_fires_once():
    faults = parse_faults("nan_loss@3, nan_parameters@5,drift_parameters@4,pause_checkpoint_write@2=2.5")
    assert faults.at_epoch == {"nan_loss": 3, "nan_parameters": 5, "drift_parameters": 4}
    assert (faults.pause_write_number, faults.pause_seconds) == (2, 2.5)
    assert [faults.fire("nan_loss", epoch) for epoch in (1, 2, 3, 4)] == [False, False, True, False]
    assert not faults.fire("nan_parameters", 4) and faults.fire("nan_parameters", 9)
    assert not faults.fire("something_else", 100)


def test_empty_spec_is_inactive():
    faults = parse_faults("")
    assert (faults.at_epoch, faults.pause_write_number) == ({}, 0)


@pytest.mark.parametrize(
    "spec", ["nan_loss@x", "explode@3", "pause_checkpoint_write@2=soon", "pause_checkpoint_write=5", "nan_loss"]
)
def test_malformed_spec_names_the_item(spec):
    with pytest.raises(ValueError, match="--faults: cannot read"):
        parse_faults(spec)


def test_the_wrapper_flag_comes_first():
    faults, rest = split_faults_flag(["--faults", "nan_loss@3", "--experiment_prefix", "x"])
    assert (faults.at_epoch, rest) == ({"nan_loss": 3}, ["--experiment_prefix", "x"])
    with pytest.raises(ValueError, match="--faults: give it first"):
        split_faults_flag(["--experiment_prefix", "x"])


def test_only_the_configured_write_pauses_between_its_files_and_its_manifest(tmp_path, model, monkeypatch):
    monkeypatch.setattr(collab.checkpoint, "stage_checkpoint_files", collab.checkpoint.stage_checkpoint_files)
    pause_checkpoint_writes(parse_faults("pause_checkpoint_write@2=0"))
    events_path = tmp_path.parent / f"{tmp_path.name}.events.jsonl"  # beside the checkpoints' folder
    events.open_event_log(events_path)
    try:
        for step in (1, 2, 3):
            write_checkpoint(tmp_path, step, model, None, optimizer_state(step))
    finally:
        events.open_event_log(None)
    paused = events.read_events(events_path, "fault_injected")
    assert len(paused) == 1 and ".tmp-2-" in paused[0]["folder"], paused
    assert [read_manifest(tmp_path / str(step)).step for step in (1, 2, 3)] == [1, 2, 3]


def test_production_code_has_no_fault_hooks():
    """A variable in a volunteer's environment or a stray flag cannot inject faults: only tests/ knows them."""
    root = Path(__file__).resolve().parents[2]
    packages = ("collab", "trainer", "monitor", "web", "data")
    production = [*root.glob("*.py"), *(path for package in packages for path in (root / package).rglob("*.py"))]
    for path in production:
        tree = ast.parse(path.read_text())
        imported = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
        imported += [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
        assert not [name for name in imported if name.split(".")[0] in ("tests", "faults")], path
        assert "COLLAB_TEST_FAULTS" not in path.read_text() and "pause_checkpoint_write" not in path.read_text(), path
