"""`make demo`: two peers on 127.0.0.1 train the tiny model together for a few global steps.

An outside DHT client reads the peers' signed LocalMetrics (as the monitor does) to show progress; the demo
ends with a summary: global steps, peers averaged with, loss at start and end. Logs go to --output_dir.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from hivemind.utils import get_dht_time
from hivemind.utils.logging import use_hivemind_log_handler
from tqdm.auto import tqdm

from arguments import DatasetArguments, PeerArguments
from collab.dht import start_dht
from collab.schema import make_validators, read_metrics
from monitor.aggregate import SwarmMetrics, aggregate
from trainer.local import PeerProcess

logger = logging.getLogger("demo")


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m trainer.demo", description=__doc__)
    parser.add_argument("--steps", type=int, default=12, help="Global steps to train (default: 12)")
    parser.add_argument("--output_dir", default="outputs/demo", help="Folder for the peers' logs and models")
    parser.add_argument("--timeout", type=float, default=600, help="Give up after this many seconds (default: 600)")
    return parser.parse_args(argv)


def watch(peers, reader, prefix: str, steps: int, deadline: float) -> dict[int, SwarmMetrics]:
    """Poll the metrics until every peer exits; the first aggregate seen at each global step is kept."""
    history: dict[int, SwarmMetrics] = {}
    with tqdm(total=steps, desc="global steps", unit="step") as bar:
        while any(peer.process.poll() is None for peer in peers):
            if time.monotonic() > deadline:
                raise TimeoutError("the demo ran past --timeout")
            metrics = aggregate(read_metrics(reader, prefix), get_dht_time())
            if metrics is not None and metrics.step not in history:
                history[metrics.step] = metrics
                bar.n = min(metrics.step, steps)
                bar.set_postfix(loss=f"{metrics.loss:.3f}" if metrics.loss else "n/a", peers=metrics.alive_peers)
            time.sleep(1.0)
    return history


def main(argv: Sequence[str] | None = None) -> int:
    use_hivemind_log_handler("in_root_logger")
    logging.getLogger().setLevel(logging.WARNING)
    args = parse(argv)
    if not Path(DatasetArguments.dataset_path).exists():
        print(
            f"demo: error: no sample data at {DatasetArguments.dataset_path}: run `make data` first", file=sys.stderr
        )
        return 2
    prefix, out = f"demo{int(time.time())}", Path(args.output_dir)
    common = ["--experiment_prefix", prefix, "--max_steps", str(args.steps), "--statistics_expiration", "60"]
    deadline = time.monotonic() + args.timeout
    print(f"Starting two peers on 127.0.0.1 for {args.steps} global steps (logs in {out}/)")
    peers = [PeerProcess([*common, "--output_dir", str(out / "peer0")], out / "peer0.log")]
    reader = None
    try:
        join = peers[0].join_flags(timeout=120)
        print("Peer 0 is up; peer 1 joins with", " ".join(join))
        peers.append(PeerProcess([*common, *join, "--output_dir", str(out / "peer1")], out / "peer1.log"))
        validators, _ = make_validators(prefix)
        reader = start_dht(
            PeerArguments(experiment_prefix=prefix, initial_peers=join[1:]), validators, client_mode=True
        )
        history = watch(peers, reader, prefix, args.steps, deadline)
        codes = [peer.wait(timeout=60) for peer in peers]
    finally:
        for peer in peers:
            peer.stop()
        if reader is not None:
            reader.shutdown()
    return summarize(history, peers, codes, args.steps)


def summarize(history: dict[int, SwarmMetrics], peers, codes, steps: int) -> int:
    rounds = [peer.averaging_group_sizes() for peer in peers]
    losses = [(step, m.loss) for step, m in sorted(history.items()) if m.loss is not None]
    print("\nDemo summary")
    print(f"  global steps reached : {max(history, default=0)} of {steps}")
    for i, (peer_rounds, code) in enumerate(zip(rounds, codes, strict=True)):
        print(
            f"  peer {i}               : exit code {code}, {len(peer_rounds)} gradient-averaging rounds, "
            f"with up to {max(peer_rounds, default=1)} peers"
        )
    if losses:
        print(
            f"  loss                 : {losses[0][1]:.3f} at step {losses[0][0]} -> {losses[-1][1]:.3f} "
            f"at step {losses[-1][0]}"
        )
    ok = all(code == 0 for code in codes) and all(rounds) and len(losses) >= 2 and losses[-1][1] < losses[0][1]
    print("  result               :", "OK, the two peers trained together and the loss fell" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
