"""The monitor's outputs: JSON lines, web reports, uploads (folder and HTTP, with a retry), wandb offline."""

import hashlib
import io
import json
import shutil
import struct
import tarfile
import threading

import pytest
import torch
from transformers import AutoModelForMaskedLM

from arguments import MetricsArguments
from collab.checkpoint import read_manifest, write_checkpoint
from monitor.checkpoints import is_due
from monitor.run import is_new_step
from monitor.sinks import HttpReportSink, JsonLinesSink, build_sinks, last_step_in
from monitor.upload import FolderTarget, HttpTarget, Uploader, backoff_delays, make_target
from trainer.local import wait_until
from trainer.model import tiny_bert_config

pytestmark = pytest.mark.light

CONTRIBUTOR = {"peer": "0123456789ab", "name": "volunteer", "samples": 256, "rounds": 3, "seconds_online": 20.0}
STEP = {
    "step": 3,
    "loss": 4.5,
    "alive_peers": 2,
    "samples": 256,
    "samples_per_second": 31.5,
    "time": 1.0e9,
    "contributors": [{**CONTRIBUTOR, "last_seen": 1.0e9}],
}


@pytest.fixture(scope="module")
def checkpoint_repo(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    model = AutoModelForMaskedLM.from_config(tiny_bert_config(64))
    write_checkpoint(repo, 4, model, None, {"optimizer": None}, loss=3.5, peers=2)
    return repo


def test_json_lines_file_gets_one_object_per_step(tmp_path):
    sink = JsonLinesSink(tmp_path / "sub" / "metrics.jsonl")
    sink.write(STEP)
    sink.write({**STEP, "step": 4, "loss": float("nan")})
    sink.close()
    lines = [json.loads(line) for line in (tmp_path / "sub" / "metrics.jsonl").read_text().splitlines()]
    assert lines == [STEP, {**STEP, "step": 4, "loss": None}]


def test_a_restarted_monitor_goes_on_after_the_last_complete_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert last_step_in(path) is None and last_step_in(None) is None
    path.write_text(json.dumps(STEP) + "\n" + json.dumps({**STEP, "step": 4}) + '\n{"step": 5, "lo')
    assert last_step_in(path) == 4
    sink = JsonLinesSink(path)
    sink.write({**STEP, "step": 6})
    sink.close()
    assert last_step_in(path) == 6 and path.read_text().splitlines()[-2] == '{"step": 5, "lo'


def test_sinks_are_chosen_once_from_the_settings(tmp_path):
    names = [type(s).__name__ for s in build_sinks(MetricsArguments(), "run", None, {})]
    assert names == ["ConsoleSink"]
    args = MetricsArguments(metrics_path=str(tmp_path / "m.jsonl"), report_url="http://127.0.0.1:1/x")
    sinks = build_sinks(args, "run", "tok", {})
    assert [type(s).__name__ for s in sinks] == ["ConsoleSink", "JsonLinesSink", "HttpReportSink"]
    for sink in sinks:
        sink.close()


def test_web_report_is_retried_until_the_app_accepts_it(recording_server):
    recording_server.statuses = [503]
    sink = HttpReportSink(recording_server.url + "/api/experiments/1/metrics", "secret-token")
    sink.write(STEP)
    try:
        [request] = recording_server.wait_for(1, timeout=30)
    finally:
        sink.close()
    assert len(recording_server.refused) == 1
    assert request.path == "/api/experiments/1/metrics"
    assert request.headers["Authorization"] == "Bearer secret-token"
    assert json.loads(request.body) == STEP


def test_http_upload_retries_after_a_refusal(recording_server, checkpoint_repo):
    recording_server.statuses = [503]
    target = make_target(recording_server.url + "/api/experiments/1/checkpoints", "tok", keep=3)
    assert isinstance(target, HttpTarget)
    uploader = Uploader(str(checkpoint_repo), target, interval=3600, first_delay=0.1)
    assert uploader.upload_latest() is True
    assert uploader.upload_latest() is False  # nothing new since
    assert len(recording_server.refused) == 1 and len(recording_server.accepted) == 1
    form = recording_server.accepted[0].form()
    assert (form["step"], float(form["loss"])) == (b"4", 3.5)
    assert hashlib.sha256(form["archive"]).hexdigest() == form["sha256"].decode()
    with tarfile.open(fileobj=io.BytesIO(form["archive"])) as tar:
        tar.extractall(checkpoint_repo.parent / "extracted", filter="data")
    assert read_manifest(checkpoint_repo.parent / "extracted" / "4").step == 4
    assert recording_server.accepted[0].headers["Authorization"] == "Bearer tok"


def test_upload_gives_up_after_its_retries_and_tries_again_later(recording_server, checkpoint_repo):
    recording_server.statuses = [500, 500, 500]
    uploader = Uploader(
        str(checkpoint_repo), HttpTarget(recording_server.url, None), 3600, retries=2, first_delay=0.05
    )
    assert uploader.upload_latest() is False
    assert len(recording_server.refused) == 3
    assert uploader.upload_latest() is True


def test_a_retry_uploads_the_newest_checkpoint_when_the_failed_one_was_removed(recording_server, tmp_path):
    """The monitor keeps --keep_checkpoints: while an upload waits to retry, a newer checkpoint can replace the one
    that failed. The retry uploads the newer one instead of failing on a folder that is gone."""
    repo, staging = tmp_path / "repo", tmp_path / "staging"
    model = AutoModelForMaskedLM.from_config(tiny_bert_config(64))
    write_checkpoint(repo, 4, model, None, {"optimizer": None}, loss=3.5, peers=2)
    write_checkpoint(staging, 6, model, None, {"optimizer": None}, loss=3.0, peers=2)  # the newer one, ready to move
    recording_server.statuses = [503]
    uploader = Uploader(str(repo), HttpTarget(recording_server.url, None), 3600, retries=1, first_delay=3.0)
    result = {}
    upload = threading.Thread(target=lambda: result.update(uploaded=uploader.upload_latest()))
    upload.start()
    wait_until(lambda: recording_server.refused, 30, "the first upload to be refused", poll=0.05)
    (staging / "6").rename(repo / "6")  # the rotation, well inside the 3 s backoff: a rename and a removal
    shutil.rmtree(repo / "4")
    upload.join(timeout=30)
    assert result == {"uploaded": True} and uploader.last_uploaded_step == 6
    assert recording_server.accepted[0].form()["step"] == b"6"


def test_folder_upload_copies_a_verified_checkpoint(tmp_path, checkpoint_repo):
    uploader = Uploader(str(checkpoint_repo), FolderTarget(str(tmp_path / "backup"), keep=2), 3600)
    assert uploader.upload_latest() is True
    assert read_manifest(tmp_path / "backup" / "4").loss == 3.5


def test_backoff_doubles_up_to_a_cap():
    assert backoff_delays(5, first=2.0, cap=10.0) == [2.0, 4.0, 8.0, 10.0, 10.0]


def test_only_a_step_past_the_last_reported_one_is_new():
    assert is_new_step(0, None) and is_new_step(26, 25)
    assert not is_new_step(25, 25)
    assert not is_new_step(25, 26)  # the peer at 26 left and its record expired


def test_checkpoint_is_due_at_the_first_step_then_every_interval():
    assert is_due(7, None, 5)
    assert not is_due(11, 7, 5)
    assert is_due(12, 7, 5)


def wandb_history(run_file) -> list[dict]:
    """The history rows of an offline wandb run file (a LevelDB-style log of wandb's protobuf Records).

    The file may still be being written: a record cut short at the end is not read.
    """
    from wandb.proto import wandb_internal_pb2

    data, pos, chunks, rows = run_file.read_bytes(), 7, b"", []  # 7 bytes of ":W&B" header
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a record header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if (kind, length) == (0, 0) or pos > len(data):
            break
        chunks = chunk if kind in (1, 2) else chunks + chunk  # FULL or FIRST start a record
        if kind in (1, 4):  # FULL or LAST end it
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            if record.WhichOneof("record_type") == "history":
                items = record.history.item
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items})
    return rows


def test_wandb_offline_run_holds_the_logged_steps(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    args = MetricsArguments(wandb_project="collab-test", wandb_run_name="offline-check")
    [_, sink] = build_sinks(args, "run", None, {"target_batch_size": 128})
    for step in (1, 2, 3):
        sink.write({**STEP, "step": step, "loss": 5.0 - step})
    sink.close()
    [run_file] = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    # wandb's service process may flush the file a moment after finish() returns (seen on a loaded CI machine)
    wait_until(lambda: len(wandb_history(run_file)) >= 3, timeout=60, what="wandb to flush the offline run file")
    rows = wandb_history(run_file)
    assert [(row["_step"], row["loss"], row["alive_peers"], row["samples"]) for row in rows] == [
        (1, 4.0, 2, 256),
        (2, 3.0, 2, 256),
        (3, 2.0, 2, 256),
    ]


def test_tensors_are_untouched_by_the_module_fixture(checkpoint_repo):
    assert torch.load(checkpoint_repo / "4" / "optimizer.pt", weights_only=True) == {"optimizer": None}
