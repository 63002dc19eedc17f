"""Upload the latest checkpoint every ``--upload_interval`` seconds to ``--upload_to``, in a background thread.

Targets: a local folder (``/mnt/backup/run1``), the web app (``http(s)://HOST/api/experiments/ID/checkpoints``,
a multipart POST of ``checkpoint-<step>.tar.gz`` with its sha256 and a bearer token), or the Hugging Face Hub
(``hf://owner/repo``, through ``huggingface_hub``; log in with ``huggingface-cli login`` or set ``HF_TOKEN``).
A failed upload is retried with exponential backoff and logged; the metrics loop never waits for an upload.
Archives are streamed from disk, never held whole in memory, and each checkpoint is hashed once, not every interval.
"""

from __future__ import annotations

import gzip
import hashlib
import logging
import secrets
import shutil
import tarfile
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

from collab.checkpoint import Manifest, VerifiedCheckpoints, latest_checkpoint, prune_checkpoints
from collab.extras import require_extra
from collab.storage import atomic_directory
from collab.wire import bearer_header

logger = logging.getLogger(__name__)


class UploadTarget(Protocol):
    def upload(self, folder: Path, manifest: Manifest) -> None:
        """Upload one verified checkpoint folder; raise on failure."""


class FolderTarget:
    """Copies each checkpoint to ``<folder>/<step>/`` atomically and durably, then keeps the newest ``keep`` there
    (older copies are removed only once the new one is on disk)."""

    def __init__(self, folder: str, keep: int):
        self.folder, self.keep = Path(folder), keep
        self.verified = VerifiedCheckpoints()

    def upload(self, folder: Path, manifest: Manifest) -> None:
        with atomic_directory(self.folder / str(manifest.step)) as staging:
            shutil.copytree(folder, staging, dirs_exist_ok=True)
        prune_checkpoints(self.folder, self.keep, self.verified.read_manifest)

    def __str__(self) -> str:
        return str(self.folder)


class HashingWriter:
    """A binary file wrapper that computes the sha256 of what goes through ``write``."""

    def __init__(self, file):
        self.file, self.digest = file, hashlib.sha256()

    def write(self, data) -> int:
        self.digest.update(data)
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()


def write_archive(folder: Path, step: int, archive: Path) -> str:
    """``tar.gz`` of ``folder`` as ``<step>/...`` into ``archive``; returns its sha256, computed while writing.

    The same folder always gives the same bytes (no time in the gzip header; tarfile adds members sorted), so a retry
    of an upload that did arrive is recognised by the web app, which never replaces a stored checkpoint."""
    with open(archive, "wb") as f:
        writer = HashingWriter(f)
        with (
            gzip.GzipFile(filename="", mode="wb", fileobj=writer, mtime=0) as gz,
            tarfile.open(fileobj=gz, mode="w") as tar,
        ):
            tar.add(folder, arcname=str(step))
    return writer.digest.hexdigest()


class MultipartBody:
    """A multipart/form-data body of text fields and one file, read from disk in 1 MiB chunks as it is sent.

    Its length is known up front (``len``), so requests sends a Content-Length, which the web app requires."""

    chunk_size = 1 << 20

    def __init__(self, fields: dict[str, str], file_field: str, path: Path, media_type: str):
        boundary = secrets.token_hex(16)
        self.content_type = f"multipart/form-data; boundary={boundary}"
        parts = [
            f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n' for k, v in fields.items()
        ]
        parts.append(
            f'--{boundary}\r\nContent-Disposition: form-data; name="{file_field}"; filename="{path.name}"\r\n'
            f"Content-Type: {media_type}\r\n\r\n"
        )
        self.head, self.tail = "".join(parts).encode(), f"\r\n--{boundary}--\r\n".encode()
        self.path, self.length = path, len(self.head) + path.stat().st_size + len(self.tail)

    def __len__(self) -> int:
        return self.length

    def __iter__(self) -> Iterator[bytes]:
        yield self.head
        with open(self.path, "rb") as f:
            while chunk := f.read(self.chunk_size):
                yield chunk
        yield self.tail


class HttpTarget:
    """POSTs ``checkpoint-<step>.tar.gz`` to the web app with fields step, loss and sha256 (multipart).

    The archive is written to a temporary file (hashed on the way) and streamed from it: memory stays at a few MiB
    whatever the model's size."""

    def __init__(self, url: str, token: str | None, timeout: float = 600.0):
        self.url, self.timeout = url, timeout
        self.headers = bearer_header(token)

    def upload(self, folder: Path, manifest: Manifest) -> None:
        import requests

        with tempfile.TemporaryDirectory(prefix="upload-") as tmp:
            archive = Path(tmp) / f"checkpoint-{manifest.step}.tar.gz"
            fields = {"step": str(manifest.step), "sha256": write_archive(folder, manifest.step, archive)}
            if manifest.loss is not None:
                fields["loss"] = repr(manifest.loss)
            body = MultipartBody(fields, "archive", archive, "application/gzip")
            response = requests.post(
                self.url,
                data=body,
                headers={**self.headers, "Content-Type": body.content_type},
                timeout=self.timeout,
            )
        if response.status_code == 409:  # the app keeps what it stored for this step: retrying cannot change that
            logger.warning("%s already holds another archive of step %d; not uploaded", self.url, manifest.step)
        elif response.status_code >= 400:
            raise RuntimeError(f"{self.url} answered {response.status_code}: {response.text[:200]}")

    def __str__(self) -> str:
        return self.url


class HubTarget:
    """Pushes the checkpoint folder to a Hugging Face Hub model repository (created if missing)."""

    def __init__(self, repo_id: str):
        self.repo_id = repo_id

    def upload(self, folder: Path, manifest: Manifest) -> None:
        from huggingface_hub import HfApi

        api = HfApi()
        api.create_repo(self.repo_id, exist_ok=True)
        loss = "n/a" if manifest.loss is None else f"{manifest.loss:.4f}"
        api.upload_folder(
            repo_id=self.repo_id, folder_path=str(folder), commit_message=f"Step {manifest.step}, loss {loss}"
        )

    def __str__(self) -> str:
        return f"hf://{self.repo_id}"


def make_target(upload_to: str, token: str | None, keep: int) -> UploadTarget:
    if upload_to.startswith(("http://", "https://")):
        return HttpTarget(upload_to, token)
    if upload_to.startswith("hf://"):
        require_extra("hub", "--upload_to hf://")
        return HubTarget(upload_to.removeprefix("hf://"))
    return FolderTarget(upload_to, keep)


def backoff_delays(retries: int, first: float = 2.0, cap: float = 60.0) -> list[float]:
    """Waits before each retry: 2, 4, 8, ... seconds, at most ``cap``."""
    return [min(first * 2**i, cap) for i in range(retries)]


class Uploader:
    """Background thread: every ``interval`` seconds, upload the newest valid checkpoint if not uploaded yet."""

    def __init__(self, repo_path: str, target: UploadTarget, interval: float, retries: int = 4, first_delay=2.0):
        self.repo_path, self.target, self.interval = repo_path, target, interval
        self.delays = backoff_delays(retries, first_delay)
        self.last_uploaded_step: int | None = None
        self.verified = VerifiedCheckpoints()  # the newest checkpoint is hashed once, not every interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="checkpoint-uploader", daemon=True)

    def start(self) -> Uploader:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.upload_latest()

    def upload_latest(self) -> bool:
        """Upload the newest checkpoint if it is new; True when one was uploaded.

        Each retry looks for the newest checkpoint again: the monitor keeps only ``--keep_checkpoints`` of them, so
        during the backoff the one that failed may have been replaced and removed."""
        manifest = None
        for attempt, delay in enumerate([0.0, *self.delays]):
            if delay and self._stop.wait(delay):
                return False
            found = latest_checkpoint(self.repo_path, self.verified.read_manifest)
            if found is None or found[1].step == self.last_uploaded_step:
                return False
            folder, manifest = found
            try:
                self.target.upload(folder, manifest)
            except Exception as e:
                logger.warning(
                    "Upload of step %d to %s failed (try %d): %s", manifest.step, self.target, attempt + 1, e
                )
                continue
            self.last_uploaded_step = manifest.step
            logger.info("Uploaded checkpoint of step %d to %s", manifest.step, self.target)
            return True
        logger.warning("Giving up on step %d until the next upload interval", manifest.step)
        return False

    def close(self, timeout: float = 30.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
