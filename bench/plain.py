"""Plain PyTorch + Lamb on the default model, no hivemind: the other side of the efficiency and parity ratios.

``python -m bench.plain throughput OUT.json --seconds S [--device cuda --fp16]``: step Lamb after every micro-batch
for S seconds (with ``--fp16``, under fp16 autocast with loss scaling, as a plain Hugging Face AMP loop).
``python -m bench.plain reference OUT.json --steps K --target_batch_size B``: K steps of B samples each (micro-batches
accumulated, each clipped as the trainer does), then the held-out loss.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch

from arguments import DatasetArguments, OptimizerArguments, TrainingArguments
from collab.optim import lamb_factory, parameter_groups, scheduler_factory
from trainer.data import batch_stream, load_split, load_train_split, make_collator
from trainer.evaluate import language_model_loss
from trainer.loop import amp_context, flush_denormals
from trainer.model import build_model, load_tokenizer


def setup(seed: int, device: str = "cpu", learning_rate: float | None = None):
    """The default model on ``device``, Lamb over it (its state made where the parameters are) and the batches;
    ``learning_rate`` where not the trainer's default."""
    flush_denormals()  # as the trainer does: both sides compute alike
    dataset_args, training_args = DatasetArguments(), TrainingArguments()
    if learning_rate is not None:
        training_args = dataclasses.replace(training_args, learning_rate=learning_rate)
    tokenizer = load_tokenizer(dataset_args)
    model, task = build_model(dataset_args, tokenizer, training_args.seed)
    model.to(device)
    optimizer = lamb_factory(training_args)(parameter_groups(model, training_args.weight_decay))
    batches = batch_stream(
        load_train_split(dataset_args.dataset_path),
        make_collator(tokenizer, task),
        training_args.per_device_train_batch_size,
        seed,
        task,
        pin_memory=torch.device(device).type == "cuda",  # as the trainer and HF's Trainer do
    )
    return model, task, tokenizer, optimizer, batches, training_args


def backward(model, batch, max_grad_norm: float, scaler: torch.amp.GradScaler | None = None, optimizer=None) -> int:
    """Forward and backward one micro-batch, clipped; with ``scaler``, under fp16 autocast and unscaled first."""
    with amp_context(next(model.parameters()).device, scaler is not None):
        loss = model(**batch).loss
    if scaler is None:
        loss.backward()
    else:
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    return len(batch["input_ids"])


def throughput(seconds: float, seed: int, device: str = "cpu", fp16: bool = False, warm_up_steps: int = 3) -> dict:
    """Samples/s of micro-batch training with a Lamb step after each, after ``warm_up_steps`` steps not timed."""
    model, _, _, optimizer, batches, args = setup(seed, device)
    model.train()
    scaler = torch.amp.GradScaler(torch.device(device).type) if fp16 else None
    samples, start = 0, None
    for step in range(10**9):
        if step == warm_up_steps:
            synchronize(device)
            samples, start = 0, time.monotonic()
        batch = {name: tensor.to(device, non_blocking=True) for name, tensor in next(batches).items()}
        samples += backward(model, batch, args.max_grad_norm, scaler, optimizer)
        if scaler is None:
            optimizer.step()
        else:
            scaler.step(optimizer)
            scaler.update()
        optimizer.zero_grad()
        if start is not None and time.monotonic() - start >= seconds:
            break
    synchronize(device)
    return {
        "samples_per_second": samples / (time.monotonic() - start),
        "threads": torch.get_num_threads(),
        "device": device,
        "loss_scale": scaler.get_scale() if scaler else None,
    }


def synchronize(device: str) -> None:
    """Wait for queued GPU work, so the clock measures work done rather than work launched."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def reference(steps: int, target_batch_size: int, seed: int, learning_rate: float | None = None) -> dict:
    """One process, the collaboration's effective batch: accumulate clipped micro-batch gradients, then step."""
    model, task, tokenizer, optimizer, batches, args = setup(seed, learning_rate=learning_rate)
    scheduler = scheduler_factory(args)(optimizer)
    params = [p for p in model.parameters() if p.requires_grad]
    model.train()
    for _ in range(steps):
        total = [torch.zeros_like(p) for p in params]
        samples = 0
        while samples < target_batch_size:
            n = backward(model, next(batches), args.max_grad_norm)
            for acc, p in zip(total, params, strict=True):
                acc.add_(p.grad, alpha=n)
            model.zero_grad()
            samples += n
        for acc, p in zip(total, params, strict=True):
            p.grad = acc / samples
        optimizer.step()
        scheduler.step()
        model.zero_grad()
    validation = load_split(DatasetArguments().dataset_path, "validation")
    return {"loss": language_model_loss(model, validation, tokenizer, task), "steps": steps}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.plain")
    parser.add_argument("mode", choices=["throughput", "reference"])
    parser.add_argument("out")
    parser.add_argument("--seconds", type=float, default=30)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--target_batch_size", type=int, default=OptimizerArguments.target_batch_size)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--learning_rate", type=float, default=None, help="reference: peak rate of Lamb")
    parser.add_argument("--device", default="cpu", help="throughput: where to train (cpu, cuda)")
    parser.add_argument("--fp16", action="store_true", help="throughput: fp16 autocast with loss scaling")
    args = parser.parse_args(argv)
    if args.mode == "throughput":
        result = throughput(args.seconds, args.seed, args.device, args.fp16)
    else:
        result = reference(args.steps, args.target_batch_size, args.seed, args.learning_rate)
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
