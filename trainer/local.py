"""The one launcher of child processes on this machine: trainers and monitors for `make demo` and the integration
tests, and any ``python -m MODULE`` for the benchmarks (bench.procs). A trainer or monitor started here writes its
events (docs/EVENTS.md) next to its log, and what happened is read from them, never from log wording."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from collab.events import read_events

ROOT = Path(__file__).resolve().parent.parent
TORCHRUN = ("-m", "torch.distributed.run", "--standalone")  # torchrun, one machine: a port of its own per run
JOIN_LINE = re.compile(r"(--initial_peers (?:/\S+\s?)+)")  # for bench.wan; read the ``joined`` event instead


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


# Errors that reach this project's code from elsewhere: a round cut by a timeout, a groupmate killed mid-stream.
CANCELLATIONS = ("asyncio.exceptions.CancelledError", "concurrent.futures._base.CancelledError")
CONNECTION_ERRORS = ("ConnectionResetError", "BrokenPipeError", "ConnectionAbortedError")


def stat_fields(path: str) -> list[str] | None:
    """Fields of a /proc stat file after the command name (which may hold spaces): index 0 is field 3, the state."""
    try:
        return Path(path).read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def process_tree(root: int) -> list[int]:
    """``root`` and every live descendant (``root`` alone where there is no /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit() and (fields := stat_fields(f"/proc/{entry}/stat")) is not None:
            children.setdefault(int(fields[1]), []).append(int(entry))
    tree, queue = [], [root]
    while queue:
        pid = queue.pop()
        tree.append(pid)
        queue.extend(children.get(pid, []))
    return tree


def is_shared_memory_manager(pid: int) -> bool:
    """Whether ``pid`` runs torch's shared-memory manager, which unlinks the /dev/shm files of the processes it served
    once they are gone (hivemind shares tensors through such files)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].endswith(b"torch_shm_manager")
    except OSError:
        return False


def tracebacks_from_our_code(log: str) -> list[str]:
    """The tracebacks in ``log`` that pass through this project's code and end in an error there. A cancellation or a
    connection error is not one: hivemind logs a round whose groupmate died with the error that reached whatever was
    reading from it, our all-reduce runner and byte counter included."""
    ours = re.compile(rf'File "{re.escape(str(ROOT))}/(?!\.venv/)')
    found = []
    for chunk in log.split("Traceback (most recent call last):")[1:]:
        frames = chunk.split("\n\n")[0]
        # the exception's line is the first one after the frames, which are indented
        raised = next((line for line in frames.splitlines() if line and not line[0].isspace()), "")
        error = raised.split(":", 1)[0].strip()
        if ours.search(frames) and error not in CANCELLATIONS + CONNECTION_ERRORS:
            found.append(chunk)
    return found


def events_path_for(log_path: Path) -> Path:
    """Where a process logging to ``log_path`` writes its events: ``A.log`` -> ``A.events.jsonl``."""
    return Path(log_path).with_suffix(".events.jsonl")


# The processes started here share one machine (a demo, a test's swarm): one compute thread each unless the caller's
# environment says otherwise, since torch's default of one per core has them compete for the same cores.
SHARED_MACHINE_ENV = {"OMP_NUM_THREADS": "1"}


class LocalProcess:
    """``python SCRIPT ARGV`` (or ``python -m MODULE ARGV``) in its own session, its output going to ``log_path``.

    ``prefix`` runs it through another command, e.g. ``("ip", "netns", "exec", "ns1")``, and ``launcher`` through a
    Python module that starts the script, e.g. ``TORCHRUN + ("--nproc_per_node", "2")``. With ``events_path`` the
    program gets ``--events_path`` (a file left there earlier is deleted first, as the log is truncated) and
    ``events``/``wait_for_event`` read that file. With ``timeout`` the process
    has a deadline: ``running`` and ``wait()`` kill it once it is past.
    """

    def __init__(
        self,
        argv: Sequence[str],
        log_path: Path,
        env: dict | None = None,
        script: str = "run_trainer.py",
        prefix: Sequence[str] = (),
        module: str | None = None,
        events_path: Path | None = None,
        timeout: float | None = None,
        launcher: Sequence[str] = (),
    ):
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.events_path = None if events_path is None else Path(events_path)
        self.deadline = None if timeout is None else time.monotonic() + timeout
        program = ["-m", module] if module is not None else [str(ROOT / script)]
        own_flags = [] if self.events_path is None else ["--events_path", str(self.events_path)]
        if self.events_path is not None:
            self.events_path.unlink(missing_ok=True)  # programs append: a file left by an earlier run is not theirs
        self._log = open(self.log_path, "wb")
        self.process = subprocess.Popen(
            [*prefix, sys.executable, *launcher, *program, *map(str, argv), *own_flags],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env={**SHARED_MACHINE_ENV, **os.environ, **(env or {})},
            start_new_session=True,  # a Ctrl-C in the terminal reaches the demo, which stops peers itself
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def events(self, event: str | None = None) -> list[dict]:
        """The events this process wrote so far (all, or those named ``event``), oldest first."""
        return [] if self.events_path is None else read_events(self.events_path, event)

    def rank_events(self, rank: int, event: str | None = None) -> list[dict]:
        """The events rank ``rank`` of a torchrun peer wrote so far (``trainer.ranks.rank_events_path``; rank 0's are
        ``events``)."""
        from trainer.ranks import rank_events_path  # torch, only where a torchrun peer is read

        if self.events_path is None:
            return []
        return read_events(Path(rank_events_path(str(self.events_path), rank)), event)

    def rank_pid(self, rank: int) -> int | None:
        """The process a torchrun launcher started as ``rank`` (its child with RANK=rank in its environment)."""
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                parent = int(stat.read_text().rpartition(")")[2].split()[1])
                environment = (stat.parent / "environ").read_bytes().split(b"\0")
            except (OSError, ValueError, IndexError):
                continue  # a process that ended meanwhile
            if parent == self.process.pid and f"RANK={rank}".encode() in environment:
                return int(stat.parent.name)
        return None

    def wait_for_event(
        self, event: str, timeout: float, where: Callable[[dict], bool] = lambda record: True, poll: float = 0.2
    ) -> dict:
        """The first ``event`` for which ``where`` holds, waiting at most ``timeout`` seconds; RuntimeError as soon
        as the process exits without it."""

        def found():
            matches = [record for record in self.events(event) if where(record)]
            if not matches and self.process.poll() is not None:
                matches = [record for record in self.events(event) if where(record)]  # written just before exiting
                if not matches:
                    raise RuntimeError(
                        f"{self.log_path.stem} exited with code {self.process.returncode} before its {event!r} event; "
                        f"see {self.log_path}"
                    )
            return matches[0] if matches else None

        return wait_until(found, timeout, f"{self.log_path.stem}'s {event!r} event (see {self.log_path})", poll)

    def join_flags(self, timeout: float) -> list[str]:
        """The ``--initial_peers ...`` flags that join this peer, waiting at most ``timeout`` seconds."""
        return ["--initial_peers", *self.wait_for_event("joined", timeout)["address"]]

    def tracebacks_from_our_code(self) -> list[str]:
        """Tracebacks in the log that pass through this project's code (hivemind logs its own network errors)."""
        return tracebacks_from_our_code(self.log())

    def averaging_group_sizes(self, kind: str = "gradients") -> list[int]:
        """Group size of every completed averaging round of ``kind`` (an ``averaged`` event's: gradients,
        pseudo-gradients, parameters)."""
        return [record["group_size"] for record in self.events("averaged") if record["kind"] == kind]

    def latest_epoch(self) -> int:
        """The last global epoch this peer reported, -1 before its first."""
        epochs = self.events("epoch")
        return epochs[-1]["epoch"] if epochs else -1

    def running(self) -> bool:
        """Whether the process runs, killing it first if it is past its deadline."""
        if self.process.poll() is None and self.deadline is not None and time.monotonic() > self.deadline:
            self.kill()
        return self.process.poll() is None

    def wait(self, timeout: float | None = None) -> int:
        """The exit code. With ``timeout``, subprocess.TimeoutExpired after that many seconds; without, the process
        is killed at its deadline (if it has one)."""
        try:
            if timeout is None and self.deadline is not None:
                try:
                    return self.process.wait(max(0.0, self.deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    self.kill()
            return self.process.wait(timeout)
        finally:
            if self.process.returncode is not None:
                self._log.close()

    def crash(self) -> int:
        """SIGKILL the process and every process it started (the hivemind helpers too), as a machine that loses power
        would."""
        self.kill()
        return self.process.wait(30)

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM to the process (a clean shutdown), then ``kill`` if it still runs after ``timeout``."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()
        return self.process.returncode

    def terminate(self, grace: float = 30.0) -> int | None:
        """SIGTERM to the whole process group (a clean stop), SIGKILL after ``grace`` seconds."""
        if self.process.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self.process.wait(grace)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.process.poll()

    def kill(self) -> None:
        """SIGKILL the process group and every descendant: hivemind's helpers run in process groups of their own.
        torch's shared-memory manager is spared: it cleans up after them and exits (killed, it left their /dev/shm
        files in memory until the machine restarted)."""
        tree = process_tree(self.process.pid) if self.process.poll() is None else []
        tree = [pid for pid in tree if not is_shared_memory_manager(pid)]
        self._signal_group(signal.SIGKILL)
        for pid in tree:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(10)

    def close(self) -> None:
        """``terminate`` with 10 s of grace, and close the log."""
        self.terminate(grace=10)
        self._log.close()

    def _signal_group(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signum)


def PeerProcess(  # noqa: N802
    argv: Sequence[str],
    log_path: Path,
    env: dict | None = None,
    prefix: Sequence[str] = (),
    script: str = "run_trainer.py",
    launcher: Sequence[str] = (),
) -> LocalProcess:
    """A ``run_trainer.py`` process (or ``script``, a wrapper that runs it) writing its events next to its log; with
    ``launcher``, started by it (``TORCHRUN``: the launcher's own process, with the ranks as its children)."""
    return LocalProcess(argv, log_path, env, script, prefix, events_path=events_path_for(log_path), launcher=launcher)


def MonitorProcess(  # noqa: N802
    argv: Sequence[str],
    log_path: Path,
    env: dict | None = None,
    script: str = "run_training_monitor.py",
    prefix: Sequence[str] = (),
) -> LocalProcess:
    """A ``run_training_monitor.py`` process (or ``script``, a wrapper that runs it) writing its events next to its
    log; ``prefix`` runs it through a command (``ip netns exec NAME``)."""
    return LocalProcess(argv, log_path, env, script, prefix, events_path=events_path_for(log_path))
