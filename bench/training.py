"""Items 1 and 5: samples/s of two collaborating peers against two plain loops, and the loss they reach.

``python -m bench.training [--seconds S] TRAINER_FLAGS...`` measures one setting alone: two peers started with those
flags, divided by the plain pairs before and after them (about 3 minutes), e.g. ``python -m bench.training
--target_batch_size 256 --matchmaking_time 1``. The last line it prints is the run as JSON.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from bench.cpu import CpuSampler
from bench.formulas import ratio, steady_window, time_split, total_samples_per_second
from bench.procs import ONE_THREAD, Child, children, read_json, read_json_lines, wait_for
from trainer.local import events_path_for

# The seed's hivemind.Optimizer settings, spelled out so the anchor stays put when our defaults move.
SEED_FLAGS = [
    "--offload_optimizer",
    "true",
    "--delay_optimizer_step",
    "true",
    "--delay_grad_averaging",
    "true",
    "--average_state_every",
    "1",
    "--matchmaking_time",
    "3",
    "--batch_size_lead",
    "0",
]


# Settings tried against the defaults, each alone, between the same two plain-loop pairs as the default's run.
VARIANTS = {
    "average_state_every 4": ["--average_state_every", "4"],
    "matchmaking_time 1": ["--matchmaking_time", "1"],
    "no delayed step or averaging": ["--delay_optimizer_step", "false", "--delay_grad_averaging", "false"],
    "grad_compression 8bit": ["--grad_compression", "8bit"],
}


PAIR = 2  # loops in a plain pair and peers in a collaborative one


def plain_seconds(collab_seconds: float) -> float:
    """How long each plain pair runs beside collaborative runs of ``collab_seconds`` of steady state."""
    return max(collab_seconds * 2 / 3, 10.0)


def against_plain(run: dict, before: dict, after: dict) -> dict:
    """``run`` with the plain pairs that ran just before and after it, and its efficiency against their mean.

    Where the run has a ``time_split``, it gains the plain loops' own micro-step (``plain_step_s``), so that the
    efficiency reads as (plain step / peer's step) x (1 - extra per epoch / epoch)."""
    run["plain_around"] = [before["samples_per_second"], after["samples_per_second"]]
    plain = sum(run["plain_around"]) / 2
    run["efficiency"] = ratio(run["samples_per_second"], plain)
    if run.get("time_split"):
        run["time_split"]["plain_step_s"] = PAIR * run["time_split"]["samples_per_step"] / plain
    return run


def plain_pair(seconds: float, log_dir: Path, tag: str, flags: Sequence[str] = ()) -> dict:
    """Total samples/s of two plain PyTorch + Lamb loops, one thread each, side by side, and the cores they used.

    ``flags`` go to ``bench.plain throughput`` (``--device cuda --fp16`` for the GPU figures)."""
    outs = [log_dir / f"plain_{tag}_{i}.json" for i in range(PAIR)]
    with children() as started:
        for i, out in enumerate(outs):
            started.append(
                Child(
                    "bench.plain",
                    ["throughput", out, "--seconds", seconds, "--seed", i, *flags],
                    log_dir / f"plain_{tag}_{i}.log",
                    seconds + 180,
                    env=ONE_THREAD,
                )
            )
        sampler = CpuSampler([child.process.pid for child in started])
        sampler.start()
        try:
            codes = [child.wait() for child in started]
        finally:
            sampler.stop()
    if any(codes):
        raise RuntimeError(f"plain loops exited with {codes}; see {log_dir}/plain_{tag}_*.log")
    results = [read_json(out) for out in outs]
    if any(r["threads"] != 1 for r in results):
        raise RuntimeError(f"OMP_NUM_THREADS=1 not honoured: {results}")
    return {
        "samples_per_second": sum(r["samples_per_second"] for r in results),
        "cpu": sampler.cores_between(0.0, time.time()),
    }


def collab_pair(
    name: str,
    flags: list[str],
    log_dir: Path,
    seconds: float | None = None,
    max_steps: int | None = None,
    timeout: float = 400,
) -> dict:
    """Two run_trainer.py peers (one thread each) on 127.0.0.1; their total samples/s in steady state.

    Stops after ``seconds`` of steady state, or when both reach ``max_steps`` (then their saved models are kept).
    """
    prefix = f"bench_{name}_{int(time.time())}"
    steps = [log_dir / f"{name}_{i}.steps.jsonl" for i in range(PAIR)]
    for path in steps:
        path.unlink(missing_ok=True)
    outputs = [log_dir / f"{name}_{i}_model" for i in range(PAIR)]
    common = ["--experiment_prefix", prefix, *flags] + (["--max_steps", max_steps] if max_steps else [])
    with children() as started:
        logs = [log_dir / f"{name}_{i}.log" for i in range(PAIR)]
        first = Child(
            "bench.probe",
            [steps[0], *common, "--output_dir", outputs[0]],
            logs[0],
            timeout,
            env=ONE_THREAD,
            events_path=events_path_for(logs[0]),
        )
        started.append(first)
        join = wait_for(lambda: first.events("joined"), 120, "the first peer's address", alive=started)
        started.append(
            Child(
                "bench.probe",
                [steps[1], *common, "--initial_peers", *join[0]["address"], "--output_dir", outputs[1]],
                logs[1],
                timeout,
                env=ONE_THREAD,
                events_path=events_path_for(logs[1]),
            )
        )

        def records():
            return [[tuple(step) for step in read_json_lines(path)] for path in steps]

        sampler = CpuSampler([child.process.pid for child in started])
        sampler.start()
        try:
            if max_steps:
                codes = [child.wait() for child in started]
                if any(codes):
                    raise RuntimeError(f"{name} peers exited with {codes}; see {log_dir}/{name}_*.log")
            else:
                wait_for(lambda: steady_window(records(), 1), timeout / 2, f"{name}: steady training", alive=started)
                time.sleep(seconds)
                sampler.sample()
                for child in started:
                    child.terminate()
        finally:
            sampler.stop()
    peers_steps = records()
    window = steady_window(peers_steps, 1)
    rounds = [len(child.averaging_group_sizes()) for child in started]
    return {
        "samples_per_second": total_samples_per_second(peers_steps, 1),
        "time_split": time_split(peers_steps, 1),
        "window_s": window and window[1] - window[0],
        "averaging_rounds": rounds,
        "outer_rounds": [len(child.averaging_group_sizes("pseudo-gradients")) for child in started],
        "dropped_batches": [len(child.events("batch_dropped")) for child in started],
        "cpu": window and sampler.cores_between(*window),
        "models": outputs,
    }


def held_out_loss(folder: Path, device: str = "cpu") -> float:
    """The validation split's loss of the masked-LM model saved in ``folder``, evaluated on ``device``."""
    from transformers import AutoModelForMaskedLM

    from arguments import MASKED_LM, DatasetArguments
    from trainer.data import load_split
    from trainer.evaluate import language_model_loss
    from trainer.model import load_tokenizer

    dataset_args = DatasetArguments()
    validation = load_split(dataset_args.dataset_path, "validation")
    model = AutoModelForMaskedLM.from_pretrained(folder).to(device)
    return language_model_loss(model, validation, load_tokenizer(dataset_args), MASKED_LM)


def reference_loss(
    steps: int, target_batch_size: int, log_dir: Path, flags: Sequence[str] = (), timeout: float = 900
) -> float:
    """Held-out loss of one process after ``steps`` steps of ``target_batch_size`` samples (two threads); ``flags``:
    ``bench.plain``'s training flags (``--learning_rate``)."""
    out = log_dir / "reference.json"
    with children() as started:
        started.append(
            Child(
                "bench.plain",
                ["reference", out, "--steps", steps, "--target_batch_size", target_batch_size, *flags],
                log_dir / "reference.log",
                timeout,
                env={"OMP_NUM_THREADS": "2"},
            )
        )
        if started[0].wait():
            raise RuntimeError(f"the reference run failed; see {log_dir}/reference.log")
    return read_json(out)["loss"]


def efficiency_and_parity(
    targets: list[int],
    default_target: int,
    seconds: float,
    parity_steps: int,
    log_dir: Path,
    progress,
    variants: dict[str, list[str]] = VARIANTS,
) -> dict:
    """The efficiency sweep over target_batch_size, the seed's anchor at the default, ``variants`` (settings tried
    against the defaults, by name) and the loss parity.

    A pair of plain loops runs before the first collaborative run and after each one; every collaborative run is
    divided by the mean of the two plain pairs around it, so a machine that slows down or speeds up during the
    benchmark moves both sides of each ratio alike.
    """
    plain = [plain_pair(plain_seconds(seconds), log_dir, "0")]
    progress("plain loops")
    runs: list[tuple[str, dict]] = []  # (kind, run) in the order they ran

    def collab_then_plain(kind: str, name: str, flags: list, **how) -> dict:
        run = collab_pair(name, ["--target_batch_size", *flags], log_dir, **how)
        plain.append(plain_pair(plain_seconds(seconds), log_dir, str(len(plain))))
        runs.append((kind, against_plain(run, plain[-2], plain[-1])))
        return run

    default = collab_then_plain(
        "sweep", f"collab{default_target}", [default_target], max_steps=parity_steps, timeout=180 + parity_steps * 60
    )
    default["target_batch_size"] = default_target
    progress(f"collaboration at target_batch_size {default_target}")
    collab_then_plain("anchor", "anchor", [default_target, *SEED_FLAGS], seconds=seconds)
    progress("seed anchor")
    for index, (name, flags) in enumerate(variants.items()):
        collab_then_plain("variant", f"variant{index}", [default_target, *flags], seconds=seconds)["setting"] = name
        progress(name)
    for target in targets:
        if target != default_target:
            collab_then_plain("sweep", f"collab{target}", [target], seconds=seconds)["target_batch_size"] = target
            progress(f"collaboration at target_batch_size {target}")
    collab_losses = [held_out_loss(folder) for folder in default["models"]]
    reference = reference_loss(parity_steps, default_target, log_dir)
    progress("parity reference")
    return {
        "plain_samples_per_second": [run["samples_per_second"] for run in plain],
        "plain_cpu": [run["cpu"] for run in plain],
        "default_target": default_target,
        "anchor": next(_public(run) for kind, run in runs if kind == "anchor"),
        "variants": [_public(run) for kind, run in runs if kind == "variant"],
        "sweep": sorted((_public(run) for kind, run in runs if kind == "sweep"), key=lambda r: r["target_batch_size"]),
        "parity": {
            "steps": parity_steps,
            "collab_losses": collab_losses,
            "reference_loss": reference,
            "ratio": ratio(sum(collab_losses) / len(collab_losses), reference),
        },
    }


def _public(run: dict) -> dict:
    return {key: value for key, value in run.items() if key != "models"}


def one_setting(flags: list[str], seconds: float, log_dir: Path) -> dict:
    """Two peers with ``flags`` for ``seconds`` of steady state, between two plain pairs."""
    before = plain_pair(plain_seconds(seconds), log_dir, "before")
    run = collab_pair("setting", flags, log_dir, seconds=seconds)
    after = plain_pair(plain_seconds(seconds), log_dir, "after")
    return _public(against_plain(run, before, after))


def explain(run: dict) -> str:
    """One line for an operator: the efficiency, and the step and epoch-boundary costs it comes from."""
    if run["efficiency"] is None:
        return "no steady window (see the peers' logs)"
    split = run.get("time_split")
    if not split:
        return f"efficiency {run['efficiency']:.2f}"
    return (
        f"efficiency {run['efficiency']:.2f}: a micro-step takes {split['step_s']:.3f} s against the plain loops' "
        f"{split['plain_step_s']:.3f} s, and each {split['epoch_s']:.1f} s epoch adds "
        f"{split['extra_s_per_epoch']:.2f} s at its boundary"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.training",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument("--seconds", type=float, default=45, help="steady-state seconds of the collaborative run")
    parser.add_argument("--log_dir", type=Path, default=Path("outputs/bench/setting"), help="every process's log")
    args, trainer_flags = parser.parse_known_args(argv)
    run = one_setting(trainer_flags, args.seconds, args.log_dir)
    print(f"{shlex.join(trainer_flags) or 'defaults'}: {explain(run)}", file=sys.stderr)
    print(json.dumps({"flags": trainer_flags, **run}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
