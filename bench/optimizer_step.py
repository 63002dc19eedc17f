"""``python -m bench.optimizer_step [--device cuda] [--threads N]``: milliseconds per Lamb step (the median of
several), torch_optimizer's per-tensor loop against the project's ``SameLayoutLamb`` (tensors stepped together),
side by side on the default model and on a BERT-base shape (``bench.gpu.BERT_BASE_SHAPE``). Prints one JSON line
per model; on a GPU also the same step in the CPU's shorter runs of tensors (``foreach_chunk_elements``). Beside
them, the per-mini-step check that every parameter is finite (``collab.callback.all_finite``), per tensor and fused.

The low-communication mode steps Lamb after every mini-batch, on the training device; the synchronous mode once
per global epoch, on the CPU (offloaded). Both pay this step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch_optimizer import Lamb
from transformers import AutoModelForMaskedLM

from bench.gpu import BERT_BASE_SHAPE
from collab.callback import all_finite
from collab.optim import SameLayoutLamb, foreach_chunk_elements, parameter_groups
from trainer.model import tiny_bert_config

VOCABULARY = 4096  # the sample tokenizer's
MODELS = {"tiny": ({}, 50), "base": (BERT_BASE_SHAPE, 9)}  # shape, timed steps


def seconds_per_step(optimizer_class, shape: dict, steps: int, device: str, **options) -> float:
    torch.manual_seed(0)
    model = AutoModelForMaskedLM.from_config(tiny_bert_config(VOCABULARY, **shape)).to(device)
    for param in model.parameters():
        param.grad = torch.randn_like(param) * 1e-3
    optimizer = optimizer_class(parameter_groups(model, 0.01), lr=1e-3, debias=True, **options)
    optimizer.step()  # creates the state: not timed
    seconds = []
    for _ in range(steps):
        _synchronize(device)
        start = time.perf_counter()
        optimizer.step()
        _synchronize(device)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)  # a step that meets the allocator returning memory is not the typical one


def seconds_per_finite_check(shape: dict, checks: int, device: str, fused: bool) -> float:
    """The median seconds of ``all_finite`` over the parameters of a model of ``shape`` on ``device``."""
    model = AutoModelForMaskedLM.from_config(tiny_bert_config(VOCABULARY, **shape)).to(device)
    params = list(model.parameters())
    all_finite(params, fused=fused)  # warm-up: not timed
    seconds = []
    for _ in range(checks):
        _synchronize(device)
        start = time.perf_counter()
        assert all_finite(params, fused=fused)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def _synchronize(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.optimizer_step", description=__doc__)
    parser.add_argument("--device", default="cpu", help="where the parameters live (cpu, cuda)")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (the trainer's offloaded Lamb: 1)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    on_cpu = torch.device(args.device).type == "cpu"
    for name, (shape, steps) in MODELS.items():
        loop, at_once = (seconds_per_step(cls, shape, steps, args.device) for cls in (Lamb, SameLayoutLamb))
        row = {
            "model": name,
            "device": args.device if on_cpu else torch.cuda.get_device_name(0),
            "threads": args.threads,
            "lamb_loop_ms": round(loop * 1000, 2),
            "lamb_at_once_ms": round(at_once * 1000, 2),
            "speedup": round(loop / at_once, 2),
        }
        per_tensor, one_pass = (seconds_per_finite_check(shape, steps, args.device, fused) for fused in (False, True))
        row.update(
            finite_check_per_tensor_ms=round(per_tensor * 1e3, 3), finite_check_fused_ms=round(one_pass * 1e3, 3)
        )
        if not on_cpu:  # the runs a GPU steps at once against the CPU's shorter ones, side by side
            cpu_runs = seconds_per_step(
                SameLayoutLamb, shape, steps, args.device, chunk_elements=foreach_chunk_elements(torch.device("cpu"))
            )
            row.update(lamb_cpu_runs_ms=round(cpu_runs * 1000, 2), speedup_over_cpu_runs=round(cpu_runs / at_once, 2))
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
