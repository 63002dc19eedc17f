"""Processes and network namespaces for the benchmarks: every child has a deadline and is killed on exit."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from trainer.local import wait_until

ROOT = Path(__file__).resolve().parent.parent
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


class Child:
    """``python -m MODULE ARGS`` (optionally inside a network namespace) logging to a file, killed after a deadline."""

    def __init__(
        self,
        module: str,
        args: Sequence[str],
        log_path: Path,
        timeout: float,
        env: dict | None = None,
        netns: str | None = None,
    ):
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.deadline = time.monotonic() + timeout
        prefix = ["ip", "netns", "exec", netns] if netns else []
        self._log = open(self.log_path, "wb")
        self.process = subprocess.Popen(
            [*prefix, sys.executable, "-m", module, *map(str, args)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            start_new_session=True,
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def running(self) -> bool:
        if self.process.poll() is None and time.monotonic() > self.deadline:
            self.kill()
        return self.process.poll() is None

    def wait(self) -> int:
        """The exit code, killing the child if it runs past its deadline."""
        try:
            return self.process.wait(max(0.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.kill()
            return self.process.wait(10)

    def terminate(self, grace: float = 30.0) -> int | None:
        """SIGTERM to the whole process group (a clean stop), SIGKILL after ``grace`` seconds."""
        if self.process.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.process.wait(grace)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.process.poll()

    def kill(self) -> None:
        self._signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(10)

    def _signal(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signum)

    def close(self) -> None:
        self.terminate(grace=10)
        self._log.close()


@contextlib.contextmanager
def children() -> Iterator[list[Child]]:
    """A list to put children in; every one still running is stopped when the block ends, however it ends."""
    started: list[Child] = []
    try:
        yield started
    finally:
        for child in started:
            child.close()


def wait_for(condition, timeout: float, what: str, poll: float = 0.5, alive: Sequence[Child] = ()):
    """``wait_until(condition)``, with a RuntimeError as soon as one of ``alive`` fails before it holds."""

    def check():
        for child in alive:
            if not child.running() and child.process.returncode != 0:
                raise RuntimeError(f"{child.log_path.name} exited ({child.process.returncode}) before {what}")
        return condition()

    return wait_until(check, timeout, what, poll)


def read_json(path: Path):
    return json.loads(Path(path).read_text()) if Path(path).exists() else None


def read_json_lines(path: Path) -> list:
    if not Path(path).exists():
        return []
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=20)


def _tc(netns: str, device: str, rate_mbit: float) -> None:
    subprocess.run(
        [
            "ip",
            "netns",
            "exec",
            netns,
            "tc",
            "qdisc",
            "add",
            "dev",
            device,
            "root",
            "tbf",
            "rate",
            f"{rate_mbit:g}mbit",
            "burst",
            "32kbit",
            "latency",
            "400ms",
        ],
        check=True,
        capture_output=True,
        timeout=20,
    )


@contextlib.contextmanager
def shaped_link(rate_mbit: float, names: tuple[str, str] = ("bench_a", "bench_b")) -> Iterator[tuple[str, str]]:
    """Two network namespaces joined by a veth pair shaped with tbf on both ends; yields their addresses.

    Deletes both namespaces (and with them the veth pair) on exit. Raises OSError where namespaces are unavailable.
    """
    addresses = ("10.77.0.1", "10.77.0.2")
    created = []
    try:
        for name in names:
            _ip("netns", "add", name)
            created.append(name)
        _ip("link", "add", "bench_va", "type", "veth", "peer", "name", "bench_vb")
        for name, device, address in zip(names, ("bench_va", "bench_vb"), addresses, strict=True):
            _ip("link", "set", device, "netns", name)
            _ip("-n", name, "addr", "add", f"{address}/24", "dev", device)
            _ip("-n", name, "link", "set", device, "up")
            _ip("-n", name, "link", "set", "lo", "up")
            _tc(name, device, rate_mbit)
        yield addresses
    except (subprocess.CalledProcessError, FileNotFoundError) as e:
        detail = getattr(e, "stderr", b"") or b""
        raise OSError(f"network namespaces unavailable: {e} {detail.decode(errors='replace').strip()}") from None
    finally:
        with contextlib.suppress(subprocess.CalledProcessError, subprocess.TimeoutExpired):
            _ip("link", "del", "bench_va")
        for name in created:
            with contextlib.suppress(subprocess.CalledProcessError, subprocess.TimeoutExpired):
                _ip("netns", "del", name)
