"""``python -m bench [--quick]``: measure every figure of docs/BENCHMARKS.md and print the JSON summary last."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import logging
import os
import platform
import shlex
import signal
import sys
import time
from pathlib import Path

from tqdm.auto import tqdm

from bench import wan
from bench.formulas import paper_scaling, summary_json
from bench.gpu import GPU_MODES
from bench.procs import ROOT
from bench.training import VARIANTS

DEFAULT_PARAMS = 1_450_000  # the default tiny BERT (vocabulary 4096), for the paper model
FULL = {
    "targets": [256, 1024],  # the default and a small target, where rounds cost most (above it, efficiency stays ~1)
    "seconds": 45,
    "parity_steps": 8,
    "sizes": [1_000_000, 10_000_000, 50_000_000],
    "rounds": 3,
    "peer_counts": [2, 4, 8],
}
QUICK = {
    "targets": [1024],
    "seconds": 20,
    "parity_steps": 3,
    "sizes": [1_000_000, 10_000_000],
    "rounds": 2,
    "peer_counts": [2, 4],
}
BANDWIDTH_MBIT = 100.0
PARTS = ["training", "variants", "link", "records", "scaling", "gpu", "wan"]
# Not in make bench (under an hour on two cores): variants, settings tried against the defaults, each beside the
# training part's runs (--only training variants); gpu where no CUDA device is seen.


def parse(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a short smoke run (about 5 minutes), fewer points")
    parser.add_argument("--output", default="docs/BENCHMARKS.md", help="where to write the report")
    parser.add_argument("--log_dir", default="outputs/bench", help="logs of every process the benchmark starts")
    parser.add_argument(
        "--render",
        metavar="FIGURES_JSON",
        help="only rewrite the report from a run's figures (kept beside the report: docs/BENCHMARKS.json)",
    )
    parser.add_argument(
        "--only",
        nargs="*",
        default=None,
        choices=PARTS,
        help="measure only these parts (the others are reported as not measured); gpu runs by default on CUDA; "
        "variants adds the settings tried to the training part",
    )
    return parser.parse_args(argv)


def main(argv=None) -> int:
    logging.basicConfig(level=logging.WARNING)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the clean-ups: children, network namespaces
    args = parse(argv)
    if args.render:
        figures = json.loads(Path(args.render).read_text())
        summary = json.dumps(figures.pop("summary"))
        write_report(ROOT / args.output, figures, summary, args, figures.pop("header"))
        print(summary)
        return 0
    plan = QUICK if args.quick else FULL
    log_dir = ROOT / args.log_dir
    log_dir.mkdir(parents=True, exist_ok=True)
    parts = args.only or default_parts()
    started = time.monotonic()
    figures: dict = {}
    wan_plan = wan.QUICK if args.quick else wan.FULL
    ticks = {
        "training": 3 + len(plan["targets"]),
        "variants": len(VARIANTS),
        "link": 2,
        "records": 2,
        "scaling": 1,
        "gpu": 3 + len(GPU_MODES) + 2,  # the loss comparison: one step per mode
    }
    ticks["wan"] = wan.progress_ticks(wan_plan)
    training_ticks = ticks["training"] if "variants" in parts and "training" not in parts else 0
    with tqdm(total=sum(ticks[p] for p in parts) + training_ticks, desc="bench", unit="part") as bar:

        def progress(what: str) -> None:
            bar.set_postfix_str(what)
            bar.update()

        if "training" in parts or "variants" in parts:
            from arguments import OptimizerArguments
            from bench.training import efficiency_and_parity

            figures["training"] = efficiency_and_parity(
                plan["targets"],
                OptimizerArguments.target_batch_size,
                plan["seconds"],
                plan["parity_steps"],
                log_dir,
                progress,
                VARIANTS if "variants" in parts else {},
            )
        if "link" in parts:
            from bench.network import link_goodput_mbit, shaped_link_bench

            figures["link"] = shaped_link_bench(plan["sizes"], plan["rounds"], BANDWIDTH_MBIT, log_dir)
            progress("shaped link")
            figures["link"]["goodput_mbit"] = link_goodput_mbit(BANDWIDTH_MBIT, log_dir)
            progress("link goodput")
        if "records" in parts:
            from bench.records import aggregate_ms, dht_read_ms

            figures["records"] = {"aggregate_ms_10k": aggregate_ms(10_000)}
            progress("aggregation")
            figures["records"]["dht_1000"] = dht_read_ms(1000)
            progress("DHT read")
        if "scaling" in parts:
            from bench.network import scaling_bench

            per_record = figures.get("records", {}).get("aggregate_ms_10k")
            figures["scaling"] = {
                "measured": scaling_bench(plan["peer_counts"], DEFAULT_PARAMS, plan["rounds"], log_dir),
                "paper": paper_scaling(DEFAULT_PARAMS, [2, 8, 64, 256], BANDWIDTH_MBIT, (per_record or 0.0) / 10_000),
            }
            progress("scaling")
        if "gpu" in parts:
            from bench.gpu import gpu_efficiency

            figures["gpu"] = gpu_efficiency(plan["seconds"], log_dir, progress)
        if "wan" in parts:
            figures["wan"] = wan.measure(wan_plan, log_dir / "wan", progress)
    figures["wall_s"] = time.monotonic() - started
    summary = summarize(figures)
    header = run_header(figures["wall_s"], args)
    saved = {**figures, "summary": json.loads(summary), "header": header}
    # Beside the report, so a change to the report's text can be rendered again without measuring again.
    (ROOT / args.output).with_suffix(".json").write_text(json.dumps(saved, default=str, indent=1) + "\n")
    write_report(ROOT / args.output, figures, summary, args, header)
    print(f"Wrote {args.output} in {figures['wall_s'] / 60:.1f} min; logs in {args.log_dir}/", file=sys.stderr)
    print(summary)
    return 0


def summarize(figures: dict) -> str:
    """The summary JSON: the default's efficiency, the largest model's link ratios, the 10k aggregation."""
    training, link = figures.get("training"), figures.get("link", {})
    out: dict = {}
    if training:
        from arguments import OptimizerArguments

        default = next(r for r in training["sweep"] if r["target_batch_size"] == OptimizerArguments.target_batch_size)
        out["collab_efficiency"] = default["efficiency"]
        out["anchor_efficiency"] = training["anchor"]["efficiency"]
        out["parity_loss_ratio"] = training["parity"]["ratio"]
    if link.get("rows"):
        largest = link["rows"][-1]
        out["allreduce_vs_bound"] = largest["allreduce_vs_bound"]
        out["join_vs_bound"] = largest["join_vs_bound"]
        out["allreduce_8bit_vs_bound"] = link["eight_bit"]["allreduce_vs_fp16_bound"]
    if "records" in figures:
        out["aggregate_ms_10k"] = figures["records"]["aggregate_ms_10k"]
    if "scaling" in figures:
        out["scaling"] = {str(r["peers"]): r["allreduce_s"] for r in figures["scaling"]["measured"]}
    if figures.get("gpu"):
        gpu = figures["gpu"]
        out["gpu"] = {
            "device": gpu["device"],
            "per_peer_samples_per_second": gpu["per_peer_samples_per_second"],
            "plain_samples_per_second": sum(gpu["plain_per_loop"]) / 2,
            "efficiency": gpu["efficiency"],
        }
    # The wan part's keys follow the others (bench.wan.SUMMARY_KEYS), None where it was not measured.
    line = json.loads(summary_json(out))
    line |= wan.rounded(wan.summarize(figures.get("wan") or {"skipped": "not measured"}))
    return json.dumps(line)


def default_parts() -> list[str]:
    """Every part but the settings tried (variants); item 7 (gpu) only where PyTorch sees a CUDA device."""
    from bench.gpu import cuda_device_name

    return [part for part in PARTS if part != "variants" and (part != "gpu" or cuda_device_name() is not None)]


def run_header(wall_s: float, args) -> dict:
    # make bench runs every part; a part alone is python -m bench's own flag
    flags = (["--quick"] if args.quick else []) + (["--only", *args.only] if args.only else [])
    command = shlex.join(["python", "-m", "bench", *flags]) if flags else "make bench"
    return {
        "date": datetime.date.today().isoformat(),
        "command": command,
        "wall_min": wall_s / 60,
        "machine": f"{cpu_model()}, {platform.machine()}, {os.cpu_count()} CPU cores, "
        f"Python {platform.python_version()}",
    }


def cpu_model() -> str:
    """The processor's name (``model name`` in /proc/cpuinfo): CPU ratios differ from one host to another."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def write_report(path: Path, figures: dict, summary: str, args, header: dict) -> None:
    from bench import report

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(report.render(header, figures, summary))


if __name__ == "__main__":
    sys.exit(main())
