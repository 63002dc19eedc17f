"""Items 2, 3 and 6: all-reduce rounds and state downloads on a shaped link, and swarms of 2 to 8 local peers."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from bench.formulas import allreduce_bound_s, median, ratio, round_times, transfer_bound_s
from bench.procs import ONE_THREAD, Child, children, read_json, shaped_link, wait_for
from collab.hivemind_fixes import FixedDHT
from collab.schema import make_validators, read_metrics


def run_peers(
    peers: int,
    sizes: list[int],
    rounds: int,
    log_dir: Path,
    timeout: float,
    hosts=None,
    join_state: bool = False,
    prefix: str = "bench",
    on_ready=None,
    compression: str = "fp16",
) -> list[dict]:
    """Start ``peers`` netpeer processes (rank i on ``hosts[i]``, or loopback) and return their result files.

    ``on_ready(initial_peers)`` runs while every peer is up and has published its metrics record.
    """
    sync_dir = Path(tempfile.mkdtemp(prefix="sync_", dir=log_dir))
    with children() as started:
        for rank in range(peers):
            host, netns = hosts[rank] if hosts else ("127.0.0.1", None)
            args = [
                "--rank",
                rank,
                "--peers",
                peers,
                "--host",
                host,
                "--sync_dir",
                sync_dir,
                "--rounds",
                rounds,
                "--metrics_prefix",
                prefix,
                "--compression",
                compression,
                "--sizes",
                *sizes,
            ]
            args += (["--join_state"] if join_state else []) + (["--hold"] if on_ready else [])
            started.append(
                Child(
                    "bench.netpeer", args, log_dir / f"netpeer{peers}_{rank}.log", timeout, env=ONE_THREAD, netns=netns
                )
            )
        if on_ready is not None:
            maddrs = wait_for(
                lambda: read_json(sync_dir / "maddrs.json"), 120, "the first peer's address", alive=started
            )
            wait_for(
                lambda: len(list(sync_dir.glob("published.*"))) == peers, 120, "every peer's record", alive=started
            )
            try:
                on_ready(maddrs)
            finally:
                (sync_dir / "release").touch()
        codes = [child.wait() for child in started]
    if any(codes):
        raise RuntimeError(f"averaging peers exited with {codes}; see {log_dir}/netpeer{peers}_*.log")
    return [read_json(sync_dir / f"rank{rank}.json") for rank in range(peers)]


def link_figures(
    rounds: list[dict], joins: dict[int, dict], sizes: list[int], bandwidth_mbit: float, eight_bit: list[dict]
) -> dict:
    """Median round time and state download per model size, each next to its bandwidth bound; the largest model's
    rounds with ``--grad_compression 8bit`` (``eight_bit``, the peers' results) next to the same fp16 bound."""
    rows = []
    for size in sizes:
        key = str(size)
        numel = rounds[0]["numel"][key]
        seconds = median(round_times([r["rounds"][key] for r in rounds]))
        bound = allreduce_bound_s(numel, len(rounds), bandwidth_mbit)
        join = joins.get(size)
        join_bound = transfer_bound_s(join["bytes"], bandwidth_mbit) if join else None
        rows.append(
            {
                "params": numel,
                "allreduce_s": seconds,
                "allreduce_bound_s": bound,
                "allreduce_vs_bound": ratio(seconds, bound),
                "join_s": join and join["seconds"],
                "join_bytes": join and join["bytes"],
                "join_bound_s": join_bound,
                "join_vs_bound": ratio(join and join["seconds"], join_bound),
            }
        )
    key = str(sizes[-1])
    eight_bit_s = median(round_times([r["rounds"][key] for r in eight_bit]))
    largest = rows[-1]
    return {
        "bandwidth_mbit": bandwidth_mbit,
        "delay_ms": 0,
        "rows": rows,
        "eight_bit": {
            "params": largest["params"],
            "allreduce_s": eight_bit_s,
            "allreduce_vs_fp16_bound": ratio(eight_bit_s, largest["allreduce_bound_s"]),
            "speedup_over_fp16": ratio(largest["allreduce_s"], eight_bit_s),
        },
    }


def shaped_link_bench(sizes: list[int], rounds: int, bandwidth_mbit: float, log_dir: Path) -> dict:
    """Two peers in two network namespaces joined by a veth pair shaped to ``bandwidth_mbit`` (tbf, both ends)."""
    try:
        with shaped_link(bandwidth_mbit) as (address_a, address_b):
            hosts = [(address_a, "bench_a"), (address_b, "bench_b")]
            averaged = [{"rounds": {}, "numel": {}} for _ in hosts]
            joins = {}
            for size in sizes:  # fresh processes for every averager (see bench.netpeer)
                for merged, result in zip(averaged, run_peers(2, [size], rounds, log_dir, 600, hosts), strict=True):
                    merged["rounds"].update(result["rounds"])
                    merged["numel"].update(result["numel"])
                result = run_peers(2, [size], rounds, log_dir, timeout=600, hosts=hosts, join_state=True)
                joins[size] = result[1]["join"].get(str(size))
            eight_bit = run_peers(2, sizes[-1:], rounds, log_dir, 600, hosts, compression="8bit")
    except OSError as e:
        return {"skipped": str(e)}
    return link_figures(averaged, joins, sizes, bandwidth_mbit, eight_bit)


def monitor_refresh_ms(initial_peers: list[str], prefix: str, expected: int, repeats: int = 5) -> float | None:
    """Median time of one ``monitor.run.refresh`` (read the metrics key, aggregate) from a new DHT node."""

    from arguments import MetricsArguments
    from monitor.run import MonitorState, refresh

    validators, _ = make_validators(prefix)
    reader = FixedDHT(start=True, initial_peers=initial_peers, client_mode=True, record_validators=validators)
    try:
        wait_for(lambda: len(read_metrics(reader, prefix)) >= expected, 60, f"{expected} metric records")
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            refresh(reader, prefix, MonitorState(), sinks=[], saver=None, step_lag=MetricsArguments.alive_step_lag)
            times.append(1000 * (time.perf_counter() - started))
        return median(times)
    finally:
        reader.shutdown()


def scaling_bench(peer_counts: list[int], params: int, rounds: int, log_dir: Path) -> list[dict]:
    """Round time of the tiny model and the monitor's refresh with 2, 4, 8 peers on this machine (loopback)."""
    rows = []
    for peers in peer_counts:
        prefix = f"bench_scale{peers}_{int(time.time())}"
        refresh: list[float | None] = []

        def measure_refresh(maddrs, prefix=prefix, peers=peers, refresh=refresh):
            refresh.append(monitor_refresh_ms(maddrs, prefix, peers))

        results = run_peers(peers, [params], rounds, log_dir, timeout=600, prefix=prefix, on_ready=measure_refresh)
        seconds = median(round_times([r["rounds"][str(params)] for r in results]))
        rows.append({"peers": peers, "allreduce_s": seconds, "monitor_refresh_ms": refresh[0] if refresh else None})
    return rows


def link_goodput_mbit(bandwidth_mbit: float, log_dir: Path, megabytes: float = 25) -> float | None:
    """Raw TCP goodput each way over the shaped link with both directions busy (plain sockets, bench.linktest)."""
    try:
        with shaped_link(bandwidth_mbit) as (address_a, _), children() as started:
            for role, netns in (("serve", "bench_a"), ("send", "bench_b")):
                started.append(
                    Child(
                        "bench.linktest",
                        [role, address_a, 5999, megabytes],
                        log_dir / f"linktest_{role}.log",
                        120,
                        netns=netns,
                    )
                )
            if any(child.wait() for child in started):
                return None
            rates = []
            for child in started:
                received, seconds = child.log().split()[-2:]
                rates.append(int(received) * 8 / float(seconds) / 1e6)
            return min(rates)
    except OSError:
        return None
