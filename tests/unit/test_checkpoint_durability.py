"""Checkpoints that survive a power cut, uploads that stream, and an uploader that hashes each checkpoint once."""

import contextlib
import email.parser
import email.policy
import hashlib
import os
import shutil
import tracemalloc
from pathlib import Path

import pytest

import collab.checkpoint
from collab.checkpoint import Manifest, list_checkpoints, read_manifest, remove_partial_saves, write_checkpoint
from monitor.upload import FolderTarget, HttpTarget, Uploader, write_archive
from tests.conftest import optimizer_state
from tests.http_server import QuietHandler, serving

pytestmark = pytest.mark.light


def test_folder_upload_removes_old_copies_only_after_the_new_one_is_on_disk(tmp_path, model, monkeypatch):
    """Order of the real calls on real files: every file and folder of the new copy is fsynced before its rename,
    the parent after it, and only then is the oldest copy deleted."""
    repo, backup = tmp_path / "repo", tmp_path / "backup"
    for step in (1, 2):
        write_checkpoint(backup, step, model, None, optimizer_state(step))
    new = write_checkpoint(repo, 3, model, None, optimizer_state(3))
    events = []
    real_fsync, real_rmtree = os.fsync, shutil.rmtree

    def recording_fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def recording_rmtree(path, *args, **kwargs):
        events.append(("rmtree", str(path)))
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    monkeypatch.setattr(shutil, "rmtree", recording_rmtree)
    FolderTarget(str(backup), keep=2).upload(new, read_manifest(new))

    assert sorted(p.name for p in backup.iterdir()) == ["2", "3"]
    synced = [path for kind, path in events if kind == "fsync"]
    parent_synced = events.index(("fsync", str(backup)))
    staging = [Path(path) for path in synced if Path(path).parent.name.startswith(".tmp-3-")]
    assert sorted(p.name for p in staging) == sorted([*read_manifest(backup / "3").files, "manifest.json"])
    staging_folder = str(staging[0].parent)
    assert events.index(("fsync", staging_folder)) < parent_synced, "the new copy's folder was not synced first"
    assert max(events.index(("fsync", str(p))) for p in staging) < parent_synced
    assert parent_synced < events.index(("rmtree", str(backup / "1"))), "the old copy went before the new was durable"


def test_an_old_copy_cut_off_between_the_two_renames_is_put_back(tmp_path, model):
    """A replacement of step 4 that died after moving the old copy aside and before moving the new one in."""
    write_checkpoint(tmp_path, 4, model, None, optimizer_state(4))
    (tmp_path / "4").rename(tmp_path / ".old-4-123")
    write_checkpoint(tmp_path / "other", 4, model, None, optimizer_state(4))
    (tmp_path / "other" / "4").rename(tmp_path / ".tmp-4-123")
    assert [p.name for p in remove_partial_saves(tmp_path)] == [".tmp-4-123"]
    assert [m.step for _, m in list_checkpoints(tmp_path)[0]] == [4]


@contextlib.contextmanager
def disk_server(body_path: Path):
    """An HTTP server on 127.0.0.1 that writes each POST body to ``body_path`` in 64 KiB pieces and answers 201."""

    class Handler(QuietHandler):
        def do_POST(self):
            left = int(self.headers["Content-Length"])
            with open(body_path, "wb") as f:
                while left:
                    piece = self.rfile.read(min(left, 1 << 16))
                    f.write(piece)
                    left -= len(piece)
            body_path.with_suffix(".type").write_text(self.headers["Content-Type"])
            self.send_response(201)
            self.send_header("Content-Length", "0")
            self.end_headers()

    with serving(Handler) as url:
        yield f"{url}/upload"


def test_http_upload_streams_the_archive_from_disk(tmp_path, model):
    """A 24 MiB checkpoint is posted with a few MiB of Python memory; the web app gets the archive and its sha256."""
    folder = tmp_path / "repo" / "5"
    write_checkpoint(tmp_path / "repo", 5, model, None, optimizer_state(5), loss=2.5)
    (folder / "blob.bin").write_bytes(os.urandom(24 << 20))  # incompressible: the archive is as large
    body = tmp_path / "body.bin"
    with disk_server(body) as url:
        tracemalloc.start()
        try:
            HttpTarget(url, "tok").upload(folder, Manifest(step=5, loss=2.5, peers=1, time=0.0))
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert peak < 8 << 20, f"the upload held {peak / 2**20:.1f} MiB in memory"
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
        b"Content-Type: " + body.with_suffix(".type").read_bytes() + b"\r\n\r\n" + body.read_bytes()
    )
    form = {
        part.get_param("name", header="content-disposition"): part.get_payload(decode=True)
        for part in message.iter_parts()
    }
    assert (form["step"], form["loss"]) == (b"5", b"2.5")
    assert hashlib.sha256(form["archive"]).hexdigest() == form["sha256"].decode()
    assert len(form["archive"]) > 24 << 20


def test_the_uploader_hashes_each_checkpoint_once(tmp_path, model, monkeypatch):
    """Every interval the uploader looks for the newest checkpoint: it hashes it once, and never the older ones."""
    repo = tmp_path / "repo"
    for step in (1, 2, 3):
        write_checkpoint(repo, step, model, None, optimizer_state(step))
    hashed = []
    real_sha256 = collab.checkpoint.sha256_file
    monkeypatch.setattr(collab.checkpoint, "sha256_file", lambda path: hashed.append(Path(path)) or real_sha256(path))
    uploader = Uploader(str(repo), FolderTarget(str(tmp_path / "backup"), keep=5), interval=3600)
    assert uploader.upload_latest() is True
    assert [uploader.upload_latest() for _ in range(3)] == [False, False, False]
    source = [p for p in hashed if p.parent.parent == repo]
    assert sorted(p.name for p in source) == sorted(read_manifest(repo / "3").files)
    assert {p.parent.name for p in source} == {"3"}

    (repo / "3" / "optimizer.pt").write_bytes(b"damaged")  # a changed file is noticed at the next look
    assert uploader.upload_latest() is True and uploader.last_uploaded_step == 2


def test_the_same_checkpoint_always_archives_to_the_same_bytes(tmp_path, model):
    # The web app answers 409 to another archive of a stored step: a retry must send identical bytes to be taken.
    folder = write_checkpoint(tmp_path / "repo", 4, model, None, {"optimizer": None})
    first, second = tmp_path / "a.tar.gz", tmp_path / "b.tar.gz"
    digests = write_archive(folder, 4, first), write_archive(folder, 4, second)
    assert first.read_bytes()[4:8] == b"\0\0\0\0"  # gzip's MTIME field: no time stamp
    assert digests[0] == digests[1] == hashlib.sha256(second.read_bytes()).hexdigest()
