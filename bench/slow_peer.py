"""A slow peer among fast ones: how many of its global steps averaged its gradients with the others.

``python -m bench.slow_peer [--seconds S] [--accumulation N]`` starts two peers at the defaults and a third with
``--gradient_accumulation_steps N``, one thread each, on 127.0.0.1; choose N so that the slow peer's optimizer steps
are further apart than ``matchmaking_time`` (3 s by default) on your machine. They train for S seconds
after the slow peer's first global step; the last line printed is one JSON object with each peer's counts. A peer
whose steps are further apart than ``matchmaking_time`` can step past the window in which hivemind pre-schedules its
round, and then misses its epoch's group (docs/RELIABILITY.md). Figures, not a test: about 4 minutes.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path

from bench.procs import ONE_THREAD
from trainer.local import LocalProcess, PeerProcess, wait_until

COUNTED = {
    "steps": "step_begun",
    "out_of_sync": "out_of_sync",
    "pre_scheduled": "round_scheduled",
    "given_up": "round_given_up",
}


def peer_counts(events: list[dict], peers: int) -> dict:
    """A peer's global steps, its gradient rounds averaged (with every peer, and at all), and its other events."""
    sizes = [
        record["group_size"] for record in events if record["event"] == "averaged" and record["kind"] == "gradients"
    ]
    seen = Counter(record["event"] for record in events)
    counts = {name: seen[event] for name, event in COUNTED.items()}
    return {**counts, "averaged": len(sizes), "averaged_with_all": sizes.count(peers)}


def run(seconds: float, accumulation: int, log_dir: Path) -> dict:
    """Start the three peers, train ``seconds`` after the slow one's first step, stop them (SIGTERM); each peer's
    counts and exit code (0 after a clean stop)."""
    common = ["--experiment_prefix", f"bench_slow_{int(time.time())}"]
    flags = {"fast_0": [], "fast_1": [], "slow": ["--gradient_accumulation_steps", str(accumulation)]}
    peers: dict[str, LocalProcess] = {}
    exit_codes: dict[str, int | None] = {}
    try:
        for name, own_flags in flags.items():
            join = peers["fast_0"].join_flags(120) if peers else []
            argv = [*common, *join, *own_flags, "--output_dir", str(log_dir / name)]
            peers[name] = PeerProcess(argv, log_dir / f"{name}.log", ONE_THREAD)
        wait_until(lambda: peers["slow"].latest_epoch() >= 0, 300, "the slow peer's first global step", poll=1)
        deadline = time.monotonic() + seconds
        wait_until(
            lambda: time.monotonic() >= deadline or any(p.process.poll() is not None for p in peers.values()),
            seconds + 10,
            "the measured window",
            poll=1,
        )
    finally:
        for name, peer in peers.items():
            exit_codes[name] = peer.stop(30)
    return {
        name: {**peer_counts(peer.events(), len(peers)), "exit_code": exit_codes[name]} for name, peer in peers.items()
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.slow_peer", description=__doc__)
    parser.add_argument("--seconds", type=float, default=150.0, help="time measured after the slow peer's first step")
    parser.add_argument("--accumulation", type=int, default=16, help="the slow peer's --gradient_accumulation_steps")
    parser.add_argument("--log_dir", type=Path, default=Path("outputs/bench/slow_peer"), help="every peer's log")
    args = parser.parse_args(argv)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    counts = run(args.seconds, args.accumulation, args.log_dir)
    for name, peer in counts.items():
        print(f"{name}: {peer['averaged_with_all']} of {peer['steps']} global steps averaged with every peer, {peer}")
    print(json.dumps(counts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
