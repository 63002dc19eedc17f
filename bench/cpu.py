"""Where the CPU goes while peers train: each peer's training loop against hivemind's background work (Linux).

A thread's CPU time in ``/proc`` only grows, so sampling the peers' process trees now and then and keeping each
thread's latest value gives the CPU that each kind of work used between two moments, threads that ended in between
included. ``CpuSampler.cores_between(start, end)`` divides that by the time between the samples: cores in use.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from trainer.local import process_tree, stat_fields

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
TRAINING_LOOP = "training loop"  # the trainer's main thread: forward, backward, clipping, hivemind.Optimizer.step
TRAINER_THREADS = "trainer's other threads"  # delayed Lamb step, progress tracker, hivemind's event loop
HIVEMIND_PROCESSES = "hivemind processes"  # the DHT and the gradient and state averagers, each its own process
P2PD = "p2pd"  # libp2p daemon (Go), one per DHT
KINDS = (TRAINING_LOOP, TRAINER_THREADS, HIVEMIND_PROCESSES, P2PD)


def thread_cpu_seconds(pid: int, tid: int) -> float | None:
    """User + system CPU seconds of one thread so far (fields 14 and 15 of its stat), None once it is gone."""
    fields = stat_fields(f"/proc/{pid}/task/{tid}/stat")
    return None if fields is None else (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def kind_of(root: int, pid: int, tid: int) -> str:
    if pid == root:
        return TRAINING_LOOP if tid == root else TRAINER_THREADS
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        comm = ""
    return P2PD if comm == "p2pd" else HIVEMIND_PROCESSES


class CpuSampler(threading.Thread):
    """Samples the CPU time of each kind of work in the trees under ``roots`` every ``period`` seconds."""

    def __init__(self, roots: Sequence[int], period: float = 1.0):
        super().__init__(daemon=True)
        self.roots, self.period = list(roots), period
        self.latest: dict[tuple[int, int], tuple[str, float]] = {}
        self.history: list[tuple[float, dict[str, float]]] = []
        self._stopped = threading.Event()

    def sample(self) -> None:
        for root in self.roots:
            for pid in process_tree(root):
                try:
                    tids = [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
                except OSError:
                    continue
                for tid in tids:
                    seconds = thread_cpu_seconds(pid, tid)
                    if seconds is not None:
                        self.latest[pid, tid] = (kind_of(root, pid, tid), seconds)
        totals = dict.fromkeys(KINDS, 0.0)
        for kind, seconds in self.latest.values():
            totals[kind] += seconds
        self.history.append((time.time(), totals))

    def run(self) -> None:
        while not self._stopped.is_set():
            self.sample()
            self._stopped.wait(self.period)

    def stop(self) -> None:
        """Stop sampling, after one last sample."""
        self._stopped.set()
        self.join()
        self.sample()

    def cores_between(self, start: float, end: float) -> dict[str, float] | None:
        """Cores each kind of work used between the first sample at or after ``start`` and the last at or before
        ``end`` (wall-clock seconds, as ``time.time()``), or None when fewer than two samples fall in between."""
        inside = [(at, totals) for at, totals in self.history if start <= at <= end]
        if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
            return None
        (t0, first), (t1, last) = inside[0], inside[-1]
        return {kind: (last[kind] - first[kind]) / (t1 - t0) for kind in KINDS}
