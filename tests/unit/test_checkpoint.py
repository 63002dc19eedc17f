"""collab.checkpoint: atomic saves, manifests with sha256, corrupted and partial folders skipped, pruning."""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForMaskedLM

from collab.checkpoint import (
    MANIFEST,
    folder_files,
    latest_checkpoint,
    list_checkpoints,
    load_optimizer_state,
    prune_checkpoints,
    read_manifest,
    remove_partial_saves,
    write_checkpoint,
)
from collab.checkpoint import _verify as verify_listed_files
from collab.errors import CheckpointError
from tests.conftest import optimizer_state

pytestmark = pytest.mark.light

ROOT = Path(__file__).resolve().parents[2]


def test_round_trip(tmp_path, model):
    folder = write_checkpoint(tmp_path, 7, model, None, optimizer_state(7), loss=3.25, peers=2)
    assert folder == tmp_path / "7"
    manifest = read_manifest(folder)
    assert (manifest.step, manifest.loss, manifest.peers) == (7, 3.25, 2)
    assert {"model.safetensors", "config.json", "optimizer.pt"} <= set(manifest.files)
    assert load_optimizer_state(folder)["optimizer"]["state"]["local_epoch"] == 7
    loaded = AutoModelForMaskedLM.from_pretrained(folder)
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_corrupted_file_is_detected_and_skipped(tmp_path, model):
    write_checkpoint(tmp_path, 1, model, None, optimizer_state(1))
    write_checkpoint(tmp_path, 2, model, None, optimizer_state(2))
    weights = tmp_path / "2" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="model.safetensors does not match its sha256"):
        read_manifest(tmp_path / "2")
    valid, invalid = list_checkpoints(tmp_path)
    assert [m.step for _, m in valid] == [1] and [f.name for f, _ in invalid] == ["2"]
    assert latest_checkpoint(tmp_path)[1].step == 1


def test_a_checkpoint_removed_while_it_is_read_is_skipped(tmp_path, model):
    """Another process (the monitor rotating old checkpoints) removes a folder after it was listed, before its files
    are hashed: it is no longer there, neither valid nor invalid, and no error reaches the reader (a FileNotFoundError
    once broke the collaboration test's poll)."""
    write_checkpoint(tmp_path, 1, model, None, optimizer_state(1))

    def rotated_away_midway(folder: Path):
        files = folder_files(folder)
        if folder.name == "2":
            shutil.rmtree(folder)
        return verify_listed_files(folder, files)

    write_checkpoint(tmp_path, 2, model, None, optimizer_state(2))
    valid, invalid = list_checkpoints(tmp_path, verify=rotated_away_midway)
    assert [m.step for _, m in valid] == [1] and invalid == []
    write_checkpoint(tmp_path, 2, model, None, optimizer_state(2))
    assert latest_checkpoint(tmp_path, verify=rotated_away_midway)[1].step == 1


@pytest.mark.parametrize("damage", ["delete_manifest", "garble_manifest", "delete_file"])
def test_folder_without_a_valid_manifest_is_not_a_checkpoint(tmp_path, model, damage):
    folder = write_checkpoint(tmp_path, 3, model, None, optimizer_state(3))
    if damage == "delete_manifest":
        (folder / MANIFEST).unlink()
    elif damage == "garble_manifest":
        (folder / MANIFEST).write_text("{not json")
    else:
        (folder / "optimizer.pt").unlink()
    assert latest_checkpoint(tmp_path) is None
    with pytest.raises(CheckpointError):
        read_manifest(folder)


def test_prune_keeps_the_newest(tmp_path, model):
    for step in (1, 5, 10, 12):
        write_checkpoint(tmp_path, step, model, None, optimizer_state(step))
    removed = prune_checkpoints(tmp_path, keep=2)
    assert sorted(p.name for p in removed) == ["1", "5"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["10", "12"]


SLOW_SAVE = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    import torch
    from transformers import AutoModelForMaskedLM
    from collab.checkpoint import write_checkpoint
    from trainer.model import tiny_bert_config

    class StuckTokenizer:  # a save that stops halfway, after the weights are written
        def save_pretrained(self, folder):
            (Path(folder) / "tokenizer.json").write_text("{}")
            Path(sys.argv[2]).write_text("halfway")
            time.sleep(600)

    model = AutoModelForMaskedLM.from_config(tiny_bert_config(64))
    write_checkpoint(sys.argv[1], 2, model, StuckTokenizer(), {"optimizer": None})
    """
)


def test_a_save_killed_midway_leaves_the_previous_checkpoint_intact(tmp_path, model):
    repo = tmp_path / "repo"
    write_checkpoint(repo, 1, model, None, optimizer_state(1))
    before = json.loads((repo / "1" / MANIFEST).read_text())
    halfway = tmp_path / "halfway"
    saver = subprocess.Popen([sys.executable, "-c", SLOW_SAVE, str(repo), str(halfway)], cwd=ROOT)
    try:
        deadline = time.monotonic() + 120
        while not halfway.exists():
            assert saver.poll() is None, "the saving process died before reaching the middle of its save"
            assert time.monotonic() < deadline, "the save never reached its middle"
            time.sleep(0.1)
        os.kill(saver.pid, signal.SIGKILL)
        saver.wait(30)
    finally:
        if saver.poll() is None:
            saver.kill()
    assert not (repo / "2").exists()
    assert [p.name for p in repo.iterdir() if p.name.startswith(".tmp-")], "the partial save should be on disk"
    assert latest_checkpoint(repo)[1].step == 1
    assert json.loads((repo / "1" / MANIFEST).read_text()) == before
    read_manifest(repo / "1")
    assert [p.name.startswith(".tmp-") for p in remove_partial_saves(repo)] == [True]
    write_checkpoint(repo, 2, model, None, optimizer_state(2))
    assert [m.step for _, m in list_checkpoints(repo)[0]] == [1, 2]
