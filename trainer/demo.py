"""`make demo`: a monitor and two peers on 127.0.0.1 train the tiny model together for a few global steps.

The monitor starts first (as on real machines) and the peers join through the address in its ``joined`` event
(docs/EVENTS.md). Progress comes
from the monitor's metrics file; the demo ends by loading the monitor's last checkpoint with
``AutoModelForMaskedLM.from_pretrained`` and printing its loss on held-out sample text next to an untrained
model's. Logs, metrics and checkpoints go to --output_dir.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from tqdm.auto import tqdm

from arguments import MASKED_LM, DatasetArguments, TrainingArguments
from collab.checkpoint import latest_checkpoint
from trainer.local import LocalProcess, MonitorProcess, PeerProcess

logger = logging.getLogger("demo")


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m trainer.demo", description=__doc__)
    parser.add_argument("--steps", type=int, default=8, help="Global steps to train (default: 8)")
    parser.add_argument("--output_dir", default="outputs/demo", help="Folder for logs, metrics and checkpoints")
    parser.add_argument("--timeout", type=float, default=600, help="Give up after this many seconds (default: 600)")
    return parser.parse_args(argv)


def read_metrics_lines(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def watch(peers: list[LocalProcess], metrics_path: Path, steps: int, deadline: float) -> list[dict]:
    """Show the monitor's progress until every peer exits; returns the metrics lines."""
    with tqdm(total=steps, desc="global steps", unit="step") as bar:
        while any(peer.process.poll() is None for peer in peers):
            if time.monotonic() > deadline:
                raise TimeoutError("the demo ran past --timeout")
            lines = read_metrics_lines(metrics_path)
            if lines:
                last = lines[-1]
                bar.n = min(last["step"], steps)
                bar.set_postfix(
                    loss="n/a" if last["loss"] is None else f"{last['loss']:.3f}", peers=last["alive_peers"]
                )
            time.sleep(1.0)
    return read_metrics_lines(metrics_path)


def held_out_losses(checkpoint: Path) -> tuple[float, float]:
    """Held-out loss of an untrained model and of the checkpoint, on the sample data's validation split."""
    from transformers import AutoModelForMaskedLM

    from trainer.data import load_split
    from trainer.evaluate import language_model_loss
    from trainer.model import build_model, load_tokenizer

    dataset_args = DatasetArguments()
    tokenizer = load_tokenizer(dataset_args)
    validation = load_split(dataset_args.dataset_path, "validation")
    untrained, _ = build_model(dataset_args, tokenizer, TrainingArguments.seed)
    trained = AutoModelForMaskedLM.from_pretrained(checkpoint)
    return (
        language_model_loss(untrained, validation, tokenizer, MASKED_LM),
        language_model_loss(trained, validation, tokenizer, MASKED_LM),
    )


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING)
    args = parse(argv)
    if not Path(DatasetArguments.dataset_path).exists():
        print(
            f"demo: error: no sample data at {DatasetArguments.dataset_path}: run `make data` first", file=sys.stderr
        )
        return 2
    prefix, out = f"demo{int(time.time())}", Path(args.output_dir)
    metrics_path, repo = out / "metrics.jsonl", out / "checkpoints"
    metrics_path.unlink(missing_ok=True)
    deadline = time.monotonic() + args.timeout
    print(f"Starting a monitor and two peers on 127.0.0.1 for {args.steps} global steps (logs in {out}/)")
    monitor = MonitorProcess(
        [
            "--experiment_prefix",
            prefix,
            "--refresh_period",
            "2",
            "--metrics_path",
            str(metrics_path),
            "--store_checkpoints",
            "--repo_path",
            str(repo),
            "--save_checkpoint_step_interval",
            "4",
        ],
        out / "monitor.log",
    )
    peers: list[LocalProcess] = []
    try:
        join = monitor.join_flags(timeout=120)
        print("Monitor is up; peers join with", " ".join(join))
        for i in range(2):
            argv = [
                "--experiment_prefix",
                prefix,
                *join,
                "--max_steps",
                str(args.steps),
                "--output_dir",
                str(out / f"peer{i}"),
            ]
            peers.append(PeerProcess(argv, out / f"peer{i}.log"))
        lines = watch(peers, metrics_path, args.steps, deadline)
        codes = [peer.wait(timeout=60) for peer in peers]
    finally:
        for process in [*peers, monitor]:
            process.stop()
    return summarize(lines, peers, codes, args.steps, repo)


def summarize(lines: list[dict], peers: list[LocalProcess], codes: list[int], steps: int, repo: Path) -> int:
    rounds = [peer.averaging_group_sizes() for peer in peers]
    losses = [(line["step"], line["loss"]) for line in lines if line["loss"] is not None]
    print("\nDemo summary")
    print(f"  global steps reached : {max((line['step'] for line in lines), default=0)} of {steps}")
    for i, (peer_rounds, code) in enumerate(zip(rounds, codes, strict=True)):
        print(
            f"  peer {i}               : exit code {code}, {len(peer_rounds)} gradient-averaging rounds, "
            f"with up to {max(peer_rounds, default=1)} peers"
        )
    if losses:
        print(
            f"  loss (monitor)       : {losses[0][1]:.3f} at step {losses[0][0]} -> {losses[-1][1]:.3f} "
            f"at step {losses[-1][0]}"
        )
    found = latest_checkpoint(repo)
    held_out = None
    if found:
        held_out = held_out_losses(found[0])
        print(f"  last checkpoint      : {found[0]} (global step {found[1].step})")
        print(f"  held-out loss        : untrained {held_out[0]:.3f} -> checkpoint {held_out[1]:.3f}")
    ok = (
        all(code == 0 for code in codes)
        and all(rounds)
        and len(losses) >= 2
        and losses[-1][1] < losses[0][1]
        and held_out is not None
        and held_out[1] < held_out[0]
    )
    print("  result               :", "OK, the peers trained together and the loss fell" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
