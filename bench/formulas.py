"""Pure formulas of the benchmarks: bandwidth bounds, throughput windows, round times and the JSON summary."""

from __future__ import annotations

import itertools
import json
import math
import statistics
from collections.abc import Mapping, Sequence

MBIT = 1e6 / 8  # bytes per second in one Mbit/s
FP16_BYTES = 2
SUMMARY_KEYS = (
    "collab_efficiency",
    "anchor_efficiency",
    "allreduce_vs_bound",
    "join_vs_bound",
    "allreduce_8bit_vs_bound",
    "aggregate_ms_10k",
    "parity_loss_ratio",
    "scaling",
    "gpu",
)


def allreduce_bytes_per_peer(params: int, peers: int, bytes_per_value: int = FP16_BYTES) -> float:
    """Bytes each peer sends (and receives) in a butterfly all-reduce: 2·(N−1)/N · P · bytes per value."""
    if peers < 2:
        return 0.0
    return 2 * (peers - 1) / peers * params * bytes_per_value


def allreduce_bound_s(params: int, peers: int, bandwidth_mbit: float, bytes_per_value: int = FP16_BYTES) -> float:
    """The bandwidth bound of one all-reduce round: bytes per peer / bandwidth (seconds)."""
    return allreduce_bytes_per_peer(params, peers, bytes_per_value) / (bandwidth_mbit * MBIT)


def transfer_bound_s(num_bytes: float, bandwidth_mbit: float) -> float:
    """Seconds to move ``num_bytes`` over a link of ``bandwidth_mbit`` Mbit/s."""
    return num_bytes / (bandwidth_mbit * MBIT)


def ratio(measured: float | None, reference: float | None) -> float | None:
    """measured / reference, or None when either side is missing or the reference is not positive."""
    if measured is None or reference is None or not reference > 0 or not math.isfinite(measured):
        return None
    return measured / reference


def mean(values: list[float] | None) -> float | None:
    """The arithmetic mean, or None for no values (a run that produced none)."""
    return sum(values) / len(values) if values else None


def epoch_target_batch_size(samples_per_second: float, epoch_seconds: float, minimum: int = 1024) -> int:
    """The power of two of samples (at least ``minimum``) that peers training at ``samples_per_second`` in all
    take about ``epoch_seconds`` or more to gather: long epochs keep averaging a small share of the time."""
    wanted = max(float(minimum), samples_per_second * epoch_seconds)
    return 2 ** math.ceil(math.log2(wanted))


def median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def steady_window(peers_steps: Sequence[Sequence[tuple[float, int, int]]], warmup_epochs: int = 1):
    """The time window in which every peer trains together in steady state: (start, end), or None.

    Each peer's steps are ``(time, samples, epoch)``. The window opens once every peer has reached the epoch at
    which the last peer joined plus ``warmup_epochs`` (start-up, state download and the first rounds are behind
    it) and closes at the first peer's last step.
    """
    if not peers_steps or not all(peers_steps):
        return None
    first_common = max(steps[0][2] for steps in peers_steps) + warmup_epochs
    starts, ends = [], []
    for steps in peers_steps:
        warm = [t for t, _, epoch in steps if epoch >= first_common]
        if not warm:
            return None
        starts.append(warm[0])
        ends.append(steps[-1][0])
    start, end = max(starts), min(ends)
    return (start, end) if end > start else None


def total_samples_per_second(peers_steps: Sequence[Sequence[tuple[float, int, int]]], warmup_epochs: int = 1):
    """Samples/s of all peers together inside their common steady window; None when there is no such window."""
    window = steady_window(peers_steps, warmup_epochs)
    if window is None:
        return None
    start, end = window
    samples = sum(n for steps in peers_steps for t, n, _ in steps if start < t <= end)
    return samples / (end - start)


def time_split(peers_steps: Sequence[Sequence[tuple[float, int, int]]], warmup_epochs: int = 1) -> dict | None:
    """Where a pair's steady window went: the typical micro-step, and the seconds each global epoch adds on top.

    Per peer, over the whole epochs inside the window (from the first step of one epoch to the first step of the
    next): the median gap between two steps is the micro-step as it runs between averaging rounds (``step_s``), and
    what an epoch lasts beyond its steps at that median is the cost of its boundary (``extra_s_per_epoch``: the
    averaging rounds and the background Lamb step taking CPU from the loop, and any wait for them). Means over the
    peers; None unless every peer has a whole epoch in the window.
    """
    window = steady_window(peers_steps, warmup_epochs)
    if window is None:
        return None
    start, end = window
    splits = []
    for steps in peers_steps:
        inside = [(t, epoch) for t, _, epoch in steps if start <= t <= end]
        firsts = [i for i in range(1, len(inside)) if inside[i][1] != inside[i - 1][1]]
        if len(firsts) < 2:
            return None
        times = [t for t, _ in inside[firsts[0] : firsts[-1] + 1]]
        step = statistics.median(later - earlier for earlier, later in itertools.pairwise(times))
        epochs = len(firsts) - 1
        epoch_s = (times[-1] - times[0]) / epochs
        splits.append((step, epoch_s - step * (len(times) - 1) / epochs, epoch_s))
    count = len(splits)
    return {
        "step_s": sum(step for step, _, _ in splits) / count,
        "extra_s_per_epoch": sum(extra for _, extra, _ in splits) / count,
        "epoch_s": sum(epoch for _, _, epoch in splits) / count,
        "samples_per_step": statistics.median(n for steps in peers_steps for _, n, _ in steps),
    }


def round_times(peers_rounds: Sequence[Sequence[tuple[float, float]]]) -> list[float]:
    """Duration of each all-reduce round from every peer's ``(trigger_time, done_time)``.

    A round cannot start before its last peer lets it, so it lasts from the latest trigger to the latest finish.
    """
    counts = {len(rounds) for rounds in peers_rounds}
    if len(counts) != 1:
        raise ValueError(f"peers report different numbers of rounds: {sorted(counts)}")
    return [
        max(done for _, done in rounds) - max(trigger for trigger, _ in rounds)
        for rounds in zip(*peers_rounds, strict=True)
    ]


def paper_scaling(
    params: int, peers: Sequence[int], bandwidth_mbit: float, aggregate_ms_per_record: float
) -> list[dict]:
    """The bandwidth model carried to larger swarms: all-reduce bound and monitor aggregation per swarm size."""
    return [
        {
            "peers": n,
            "allreduce_bound_s": allreduce_bound_s(params, n, bandwidth_mbit),
            "aggregate_ms": aggregate_ms_per_record * n,
        }
        for n in peers
    ]


def summary_json(figures: Mapping[str, object]) -> str:
    """The one-line JSON object ``make bench`` prints last: every summary key, None where not measured."""
    unknown = set(figures) - set(SUMMARY_KEYS) - {"details"}
    if unknown:
        raise KeyError(f"not a summary key: {sorted(unknown)}")
    return json.dumps({key: rounded(figures.get(key)) for key in SUMMARY_KEYS}, sort_keys=False)


def rounded(value):
    """Figures to 4 decimals for a summary line, in dicts and lists too; a non-finite float becomes None."""
    if isinstance(value, float):
        return round(value, 4) if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: rounded(item) for key, item in value.items()}
    if isinstance(value, list):
        return [rounded(item) for item in value]
    return value
