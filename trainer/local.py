"""Run trainers and monitors as real processes on this machine: used by `make demo` and the integration tests."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
JOIN_LINE = re.compile(r"(--initial_peers (?:/\S+\s?)+)")
AVERAGED = re.compile(r"Averaged gradients with (\d+) peers")
STEP_BEGUN = re.compile(r"Beginning optimizer step")  # hivemind's line at each global step, as its round begins
EPOCH_REPORT = re.compile(r"epoch (\d+) \| loss")  # trainer.loop.format_report's line at each global epoch


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(condition, timeout: float, what: str, poll: float = 0.5):
    """The first truthy ``condition()``, polling every ``poll`` seconds; TimeoutError after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = condition()
        if result:
            return result
        time.sleep(poll)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


class LocalProcess:
    """One ``run_trainer.py`` (or ``script``) process whose output goes to a log file."""

    def __init__(
        self,
        argv: Sequence[str],
        log_path: Path,
        env: dict | None = None,
        script: str = "run_trainer.py",
        prefix: Sequence[str] = (),
    ):
        """``prefix`` runs the program through another command, e.g. ``("ip", "netns", "exec", "ns1")``."""
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")
        self.process = subprocess.Popen(
            [*prefix, sys.executable, str(ROOT / script), *argv],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env={**os.environ, **(env or {})},
            start_new_session=True,  # a Ctrl-C in the terminal reaches the demo, which stops peers itself
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def join_flags(self, timeout: float) -> list[str]:
        """The ``--initial_peers ...`` flags this peer logged, waiting at most ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = JOIN_LINE.search(self.log())
            if match:
                return match.group(1).split()
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"{self.log_path.stem} exited with code {self.process.returncode}; see {self.log_path}"
                )
            time.sleep(0.2)
        raise TimeoutError(f"no --initial_peers line logged within {timeout:.0f} s; see {self.log_path}")

    def tracebacks_from_our_code(self) -> list[str]:
        """Tracebacks in the log that pass through this project's code (hivemind logs its own network errors)."""
        ours = re.compile(rf'File "{re.escape(str(ROOT))}/(?!\.venv/)')
        chunks = self.log().split("Traceback (most recent call last):")[1:]
        return [chunk for chunk in chunks if ours.search(chunk.split("\n\n")[0])]

    def averaging_group_sizes(self) -> list[int]:
        """Group size of every successful gradient-averaging round, from hivemind's own log lines."""
        return [int(size) for size in AVERAGED.findall(self.log())]

    def latest_epoch(self) -> int:
        """The last global epoch this peer reported, -1 before its first."""
        epochs = EPOCH_REPORT.findall(self.log())
        return int(epochs[-1]) if epochs else -1

    def wait(self, timeout: float) -> int:
        try:
            return self.process.wait(timeout)
        finally:
            if self.process.returncode is not None:
                self._log.close()

    def crash(self) -> int:
        """SIGKILL the whole process group (the hivemind daemons too), as a machine that loses power would."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        return self.process.wait(30)

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM (clean shutdown), then SIGKILL if it is still running after ``timeout`` seconds."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)
        self._log.close()
        return self.process.returncode


def PeerProcess(  # noqa: N802
    argv: Sequence[str],
    log_path: Path,
    env: dict | None = None,
    prefix: Sequence[str] = (),
    script: str = "run_trainer.py",
) -> LocalProcess:
    """A ``run_trainer.py`` process, or ``script``: a wrapper such as tests/faulty_peer.py that runs it."""
    return LocalProcess(argv, log_path, env, script=script, prefix=prefix)


def MonitorProcess(  # noqa: N802
    argv: Sequence[str], log_path: Path, env: dict | None = None, script: str = "run_training_monitor.py"
) -> LocalProcess:
    """A ``run_training_monitor.py`` process, or ``script``: a wrapper such as tests/faulty_monitor.py that runs it."""
    return LocalProcess(argv, log_path, env, script=script)
