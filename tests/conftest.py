"""Shared fixtures: the sample data every trainer test uses (built by `make setup`) and a recording HTTP server."""

from __future__ import annotations

import contextlib
import email.parser
import email.policy
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "data" / "sample"


def _project_warnings_to_stderr() -> None:
    """In a process forked from the tests (hivemind's averagers): the project's warnings on stderr, which pytest shows
    with a failed test. The handler the child inherits is pytest's in-memory capture, lost with the child."""
    project = logging.getLogger("collab")
    if any(handler.get_name() == "forked-child-stderr" for handler in project.handlers):
        return  # a child's child keeps the one it inherited
    handler = logging.StreamHandler(sys.stderr)
    handler.set_name("forked-child-stderr")
    handler.setLevel(logging.WARNING)
    handler.setFormatter(logging.Formatter("%(asctime)s [%(levelname)s] [%(name)s] %(message)s"))
    project.addHandler(handler)


os.register_at_fork(after_in_child=_project_warnings_to_stderr)


@pytest.fixture(scope="session")
def sample_data() -> Path:
    if not (SAMPLE / "tokenized").exists():
        pytest.fail(f"no sample data at {SAMPLE}: run `make data` (make test does it)")
    return SAMPLE


@pytest.fixture(scope="module")
def model():
    """A tiny BERT masked LM with the same weights in every module (seed 0): what the checkpoint tests save."""
    import torch
    from transformers import AutoModelForMaskedLM

    from trainer.model import tiny_bert_config

    torch.manual_seed(0)
    return AutoModelForMaskedLM.from_config(tiny_bert_config(64))


def optimizer_state(epoch: int) -> dict:
    """The smallest valid ``optimizer.pt`` content: plain data at local epoch ``epoch``."""
    return {"optimizer": {"state": {"local_epoch": epoch}, "param_groups": []}, "scheduler": None}


def metrics_record(step: int = 1, loss=8.0, mini_steps=4, samples=64, sps=10.0) -> dict:
    """A peer's LocalMetrics record as it arrives from the DHT (a plain dict)."""
    return {
        "step": step,
        "samples_per_second": sps,
        "samples_accumulated": samples,
        "loss": loss,
        "mini_steps": mini_steps,
    }


@dataclass
class Request:
    path: str
    headers: dict
    body: bytes

    def form(self) -> dict[str, bytes]:
        """multipart/form-data fields and files by name (their raw bytes)."""
        message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
            b"Content-Type: " + self.headers["Content-Type"].encode() + b"\r\n\r\n" + self.body
        )
        return {
            part.get_param("name", header="content-disposition"): part.get_payload(decode=True)
            for part in message.iter_parts()
        }


@dataclass
class RecordingServer:
    """An HTTP server on 127.0.0.1 that answers POSTs with the next status of ``statuses`` (then 201)."""

    url: str
    statuses: list[int] = field(default_factory=list)
    accepted: list[Request] = field(default_factory=list)
    refused: list[Request] = field(default_factory=list)

    def wait_for(self, count: int, timeout: float) -> list[Request]:
        deadline = time.monotonic() + timeout
        while len(self.accepted) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(self.accepted)} of {count} requests accepted within {timeout:.0f} s")
            time.sleep(0.1)
        return self.accepted


@contextlib.contextmanager
def serve_recording() -> Iterator[RecordingServer]:
    """Run a RecordingServer on 127.0.0.1 (any free port) for the duration of the block."""
    state: dict = {}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            request = Request(self.path, dict(self.headers), body)
            server: RecordingServer = state["server"]
            status = server.statuses.pop(0) if server.statuses else 201
            (server.accepted if status < 400 else server.refused).append(request)
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    state["server"] = RecordingServer(f"http://127.0.0.1:{httpd.server_address[1]}")
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield state["server"]
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture
def recording_server() -> Iterator[RecordingServer]:
    with serve_recording() as server:
        yield server
