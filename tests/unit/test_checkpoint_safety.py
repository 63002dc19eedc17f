"""Checkpoints from an attacker: nothing in them runs code, and a manifest or archive that reaches outside its folder,
or leaves files out, is refused with one line naming the folder and the file."""

import io
import json
import os
import re
import shlex
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import hivemind
import pytest
import torch
from transformers import AutoModelForMaskedLM, AutoTokenizer

from arguments import AveragerArguments, OptimizerArguments, PeerArguments, ProgressTrackerArguments, TrainingArguments
from collab.callback import CollaborativeCallback, read_resume_point
from collab.checkpoint import (
    MANIFEST,
    extract_archive,
    load_model,
    load_optimizer_state,
    opened_checkpoint,
    read_manifest,
    sha256_file,
    write_checkpoint,
)
from collab.errors import CheckpointError
from collab.optim import build_optimizer, lamb_factory, parameter_groups, scheduler_factory
from tests.conftest import optimizer_state
from trainer.model import tiny_bert_config
from trainer.predict import main as predict_main

pytestmark = pytest.mark.light

ROOT = Path(__file__).resolve().parents[2]


class ShellPayload:
    """Pickles as a call of ``os.system``: what an attacker puts in ``optimizer.pt``."""

    def __init__(self, marker: Path):
        self.command = f"touch {shlex.quote(str(marker))}"

    def __reduce__(self):
        return os.system, (self.command,)


def rewrite_manifest(folder: Path, files: dict[str, str]) -> None:
    manifest = json.loads((folder / MANIFEST).read_text())
    (folder / MANIFEST).write_text(json.dumps({**manifest, "files": files}))


def resume_through_the_cli(folder: Path, output_dir: Path) -> list[str]:
    """``run_trainer.py --resume_from folder`` in a real process, which must exit 2 having written nothing to
    ``output_dir``; its one-line errors."""
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "run_trainer.py", "--experiment_prefix", "safety", "--resume_from", str(folder)]
        + ["--output_dir", str(output_dir), "--host_maddrs", "/ip4/127.0.0.1/tcp/0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert not output_dir.exists()
    print(f"CLI refusal took {time.monotonic() - started:.1f} s")
    return [line for line in result.stderr.splitlines() if line.startswith("run_trainer.py: error:")]


def test_a_pickle_payload_in_optimizer_state_is_refused_by_the_trainer_cli(tmp_path, model):
    marker = tmp_path / "payload-ran"
    folder = write_checkpoint(tmp_path / "repo", 5, model, None, {"optimizer": ShellPayload(marker)})
    read_manifest(folder)  # the manifest is right: only the loader stands between the payload and a shell
    assert resume_through_the_cli(folder, tmp_path / "out") == [
        f"run_trainer.py: error: --resume_from: {folder}: optimizer.pt is not tensors and plain data "
        "(refused unread: UnpicklingError)"
    ]
    assert not marker.exists(), "the payload ran"


def test_a_manifest_listing_a_file_outside_its_folder_is_refused_by_the_trainer_cli(tmp_path, model):
    folder = write_checkpoint(tmp_path / "repo", 5, model, None, optimizer_state(5))
    outside = tmp_path / "outside.txt"
    outside.write_text("secret")
    files = json.loads((folder / MANIFEST).read_text())["files"]
    rewrite_manifest(folder, {**files, "../outside.txt": sha256_file(outside)})
    assert resume_through_the_cli(folder, tmp_path / "out") == [
        f"run_trainer.py: error: --resume_from: {folder}: manifest.json lists '../outside.txt', not a plain file name "
        "in the folder"
    ]


def test_pickled_model_weights_are_refused_by_predict(tmp_path, model, capsys):
    marker = tmp_path / "payload-ran"
    folder = tmp_path / "plain"
    model.config.save_pretrained(folder)
    AutoTokenizer.from_pretrained(ROOT / "data" / "sample" / "tokenizer").save_pretrained(folder)
    torch.save({"weights": ShellPayload(marker)}, folder / "pytorch_model.bin")
    argv = ["--checkpoint", str(folder), "--task", "seq-cls", "--text", "x"]
    assert predict_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err == f"python -m trainer.predict: error: --checkpoint: {folder}: pytorch_model.bin holds pickled "
        "weights (refused: save with safetensors)"
    )
    assert not marker.exists()


def test_predict_verifies_a_monitor_checkpoint_against_its_manifest(tmp_path, model, capsys):
    folder = write_checkpoint(tmp_path, 3, model, None, optimizer_state(3))
    (folder / "extra.json").write_text("{}")
    assert predict_main(["--checkpoint", str(folder), "--task", "seq-cls", "--text", "x"]) == 2
    assert capsys.readouterr().err.strip().endswith(f"{folder}: extra.json is not listed in {MANIFEST} (refused)")


@pytest.mark.parametrize(
    "damage, message",
    [
        ("unlisted_file", "extra.bin is not listed in manifest.json"),
        ("omitted_file", "optimizer.pt is not listed in manifest.json"),
        ("dotdot", "manifest.json lists '../outside.txt', not a plain file name"),
        ("absolute", "manifest.json lists '/etc/hostname', not a plain file name"),
        ("symlinked_file", "optimizer.pt is a symbolic link"),
        ("symlinked_folder", "sub is a symbolic link"),
        ("backslash", "'a\\\\b' is not a plain file name"),
        ("newline", "'a\\nb' is not a plain file name"),
    ],
)
def test_a_manifest_must_list_exactly_the_plain_files_of_its_folder(tmp_path, model, damage, message):
    folder = write_checkpoint(tmp_path / "repo", 2, model, None, optimizer_state(2))
    files = json.loads((folder / MANIFEST).read_text())["files"]
    outside = tmp_path / "outside.txt"
    outside.write_text("secret")
    if damage == "unlisted_file":
        (folder / "extra.bin").write_bytes(b"x")
    elif damage == "omitted_file":
        rewrite_manifest(folder, {k: v for k, v in files.items() if k != "optimizer.pt"})
    elif damage == "dotdot":
        rewrite_manifest(folder, {**files, "../outside.txt": sha256_file(outside)})
    elif damage == "absolute":
        rewrite_manifest(folder, {**files, "/etc/hostname": "0" * 64})
    elif damage == "symlinked_file":
        real = tmp_path / "optimizer.pt"
        (folder / "optimizer.pt").rename(real)
        (folder / "optimizer.pt").symlink_to(real)  # same bytes, so the sha256 alone would pass
    elif damage == "symlinked_folder":
        (folder / "sub").symlink_to(tmp_path)
    else:
        (folder / ("a\\b" if damage == "backslash" else "a\nb")).write_text("x")
    with pytest.raises(CheckpointError, match=re.escape(message)) as refused:
        read_manifest(folder)
    assert str(refused.value).startswith(f"{folder}: ") and "\n" not in str(refused.value)


def make_archive(path: Path, members: list[tuple[tarfile.TarInfo, bytes]]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for info, data in members:
            info.size = len(data) if info.isreg() else 0
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return path


def member(name: str, kind=tarfile.REGTYPE, target: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode = kind, target, 0o644
    return info


@pytest.mark.parametrize(
    "bad, message",
    [
        (member("../evil"), "member '../evil' is not a plain relative name"),
        (member("/ABS/evil"), "member '/ABS/evil' is not a plain relative name"),
        (member("4/link", tarfile.SYMTYPE, "/etc/passwd"), "member 4/link is a link or a device"),
        (member("4/hard", tarfile.LNKTYPE, "4/config.json"), "member 4/hard is a link or a device"),
        (member("4/dev", tarfile.CHRTYPE), "member 4/dev is a link or a device"),
        (member("5/other"), "member 5/other is outside the archive's one top folder"),
        (member("4/config.json"), "member 4/config.json appears twice"),
    ],
)
def test_a_malicious_archive_is_refused_and_writes_nothing(tmp_path, bad, message):
    destination = tmp_path / "unpack" / "inner"
    destination.mkdir(parents=True)
    bad.name = bad.name.replace("/ABS", str(tmp_path))
    message = message.replace("/ABS", str(tmp_path))
    archive = make_archive(
        tmp_path / "checkpoint-4.tar.gz",
        [(member("4", tarfile.DIRTYPE), b""), (member("4/config.json"), b"{}"), (bad, b"pwn")],
    )
    with pytest.raises(CheckpointError, match=re.escape(message)) as refused:
        extract_archive(archive, destination)
    assert str(refused.value).startswith(f"{archive}: member ")
    assert not list(destination.iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-4.tar.gz", "unpack"]
    assert [p.name for p in (tmp_path / "unpack").iterdir()] == ["inner"]


def test_an_archive_over_its_size_or_member_bound_is_refused(tmp_path):
    archive = make_archive(
        tmp_path / "a.tar.gz",
        [(member("4", tarfile.DIRTYPE), b""), (member("4/a"), b"x" * 100), (member("4/b"), b"y")],
    )
    with pytest.raises(CheckpointError, match="unpacks to more than 100 bytes"):
        extract_archive(archive, tmp_path / "out", max_bytes=100)
    with pytest.raises(CheckpointError, match="more than 2 members"):
        extract_archive(archive, tmp_path / "out", max_members=2)
    assert not (tmp_path / "out").exists()


SCHEDULE = TrainingArguments(learning_rate=0.01, warmup_steps=2, total_steps=10)


def lamb_and_scheduler(model):
    lamb = lamb_factory(SCHEDULE)(parameter_groups(model, SCHEDULE.weight_decay))
    return lamb, scheduler_factory(SCHEDULE)(lamb)


def train_steps(model, lamb, scheduler, steps: int) -> None:
    for step in range(steps):
        torch.manual_seed(step)
        model.zero_grad()
        model(input_ids=torch.randint(0, 64, (2, 8)), labels=torch.randint(0, 64, (2, 8))).loss.backward()
        lamb.step()
        scheduler.step()


def test_lamb_and_scheduler_state_round_trip_weights_only_and_resume_the_same(tmp_path):
    torch.manual_seed(0)
    model = AutoModelForMaskedLM.from_config(tiny_bert_config(64))
    lamb, scheduler = lamb_and_scheduler(model)
    train_steps(model, lamb, scheduler, 3)
    state = lamb.state_dict()
    state["state"]["local_epoch"] = 3  # as hivemind.Optimizer.state_dict() and the monitor store it
    folder = write_checkpoint(tmp_path, 3, model, None, {"optimizer": state, "scheduler": scheduler.state_dict()})

    with opened_checkpoint(folder) as (verified, manifest):
        loaded = load_optimizer_state(verified)
        resumed = load_model(verified, AutoModelForMaskedLM)
    assert manifest.step == 3 and loaded["optimizer"]["state"]["local_epoch"] == 3
    assert loaded["scheduler"]["last_epoch"] == 3 and loaded["scheduler"]["_last_lr"] == scheduler.get_last_lr()
    resumed.train()
    resumed_lamb, resumed_scheduler = lamb_and_scheduler(resumed)
    loaded["optimizer"]["state"].pop("local_epoch")
    resumed_lamb.load_state_dict(loaded["optimizer"])
    resumed_scheduler.load_state_dict(loaded["scheduler"])
    train_steps(model, lamb, scheduler, 2)
    train_steps(resumed, resumed_lamb, resumed_scheduler, 2)
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[name], tensor, rtol=0, atol=0)
    assert resumed_lamb.state_dict()["state"][0]["step"] == lamb.state_dict()["state"][0]["step"] == 5


def test_resume_accepts_the_web_apps_archive_and_removes_what_it_unpacked(tmp_path, model):
    folder = write_checkpoint(tmp_path / "repo", 8, model, None, optimizer_state(8))
    archive = tmp_path / "checkpoint-8.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(folder, arcname="8")
    with opened_checkpoint(archive) as (unpacked, manifest):
        assert manifest.step == 8 and load_optimizer_state(unpacked)["optimizer"]["state"]["local_epoch"] == 8
        assert unpacked.name == "8" and unpacked.parent != folder.parent
    assert not unpacked.exists()

    (folder / "optimizer.pt").write_bytes(b"tampered")
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(folder, arcname="8")
    with pytest.raises(CheckpointError) as refused, opened_checkpoint(archive):
        pass
    assert str(refused.value) == f"{archive}/8: optimizer.pt does not match its sha256 in {MANIFEST} (corrupted)"


def test_a_real_peer_resumes_from_the_web_apps_archive(tmp_path):
    """``--resume_from checkpoint-3.tar.gz`` into a real hivemind.Optimizer: weights, Lamb state, epoch, schedule."""
    torch.manual_seed(0)
    model = AutoModelForMaskedLM.from_config(tiny_bert_config(64))
    lamb, scheduler = lamb_and_scheduler(model)
    train_steps(model, lamb, scheduler, 3)
    saved = lamb.state_dict()
    saved["state"]["local_epoch"] = 3
    folder = write_checkpoint(tmp_path, 3, model, None, {"optimizer": saved, "scheduler": scheduler.state_dict()})
    archive = tmp_path / "checkpoint-3.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(folder, arcname="3")

    torch.manual_seed(1)
    peer_model = AutoModelForMaskedLM.from_config(tiny_bert_config(64))
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        optimizer = build_optimizer(
            peer_model,
            dht,
            PeerArguments(experiment_prefix="resume_archive"),
            OptimizerArguments(target_batch_size=32),
            AveragerArguments(),
            ProgressTrackerArguments(),
            SCHEDULE,
        )
        try:
            CollaborativeCallback(dht, optimizer, peer_model, b"peer", "resume_archive", 600.0, 10).resume_from(
                read_resume_point(str(archive), type(peer_model))
            )
            resumed = optimizer.state_dict()
            last_lr = optimizer.state_averager.scheduler.get_last_lr()
        finally:
            optimizer.shutdown()
    finally:
        dht.shutdown()
    assert resumed["state"].pop("local_epoch") == 3 and last_lr == scheduler.get_last_lr()
    for name, tensor in model.state_dict().items():
        assert torch.equal(peer_model.state_dict()[name], tensor), name
    saved["state"].pop("local_epoch")
    assert resumed["state"].keys() == saved["state"].keys()
    for index, values in saved["state"].items():
        for key, value in values.items():
            assert torch.equal(torch.as_tensor(resumed["state"][index][key]).cpu(), torch.as_tensor(value)), (
                index,
                key,
            )
