"""A real ``run_web.py`` process on 127.0.0.1 for the browser and integration tests."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import requests

from trainer.local import LocalProcess, free_port, wait_until  # noqa: F401  (wait_until: re-exported)


class WebServer:
    """``python run_web.py`` with its own database, started by the project's one launcher; ``url`` once it answers."""

    def __init__(self, folder: Path, admin_token: str, *extra: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = folder / "run_web.log"
        argv = ["--port", str(self.port), "--db", str(folder / "experiments.sqlite"), "--admin_token", admin_token]
        self.launched = LocalProcess([*argv, *extra], self.log_path, {"PYTHONUNBUFFERED": "1"}, script="run_web.py")
        self.process = self.launched.process

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"run_web.py exited with {self.process.returncode}: {self.log_path.read_text()}")
            try:
                if requests.get(self.url + "/", timeout=5).status_code == 200:
                    return
            except requests.RequestException:  # not listening yet, or busy starting up
                pass
            time.sleep(0.2)
        raise TimeoutError(f"run_web.py did not answer within {timeout:.0f} s; see {self.log_path}")

    def stop(self) -> None:
        self.launched.stop(timeout=15)


@contextmanager
def running_web_server(folder: Path, admin_token: str, *extra: str) -> Iterator[WebServer]:
    """A started and answering run_web.py (with ``extra`` flags), stopped on exit."""
    server = WebServer(folder, admin_token, *extra)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()
