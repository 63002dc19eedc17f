"""Plain PyTorch + Lamb on the default model, no hivemind: the other side of the efficiency and parity ratios.

``python -m bench.plain throughput OUT.json --seconds S``: step Lamb after every micro-batch for S seconds.
``python -m bench.plain reference OUT.json --steps K --target_batch_size B``: K steps of B samples each (micro-batches
accumulated, each clipped as the trainer does), then the held-out loss.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from arguments import DatasetArguments, OptimizerArguments, TrainingArguments
from collab.optim import lamb_factory, parameter_groups, scheduler_factory
from trainer.data import batch_stream, load_split, load_train_split, make_collator
from trainer.evaluate import language_model_loss
from trainer.model import build_model, load_tokenizer


def setup(seed: int):
    dataset_args, training_args = DatasetArguments(), TrainingArguments()
    tokenizer = load_tokenizer(dataset_args)
    model, task = build_model(dataset_args, tokenizer, training_args.seed)
    optimizer = lamb_factory(training_args)(parameter_groups(model, training_args.weight_decay))
    batches = batch_stream(
        load_train_split(dataset_args.dataset_path),
        make_collator(tokenizer, task),
        training_args.per_device_train_batch_size,
        seed,
        task,
    )
    return model, task, tokenizer, optimizer, batches, training_args


def backward(model, batch, max_grad_norm: float) -> int:
    loss = model(**batch).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    return len(batch["input_ids"])


def throughput(seconds: float, seed: int) -> dict:
    """Samples/s of micro-batch training with a Lamb step after each, after a short warm-up."""
    model, _, _, optimizer, batches, args = setup(seed)
    model.train()
    samples, start = 0, None
    for step in range(10**9):
        if step == 3:
            samples, start = 0, time.monotonic()
        samples += backward(model, next(batches), args.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad()
        if start is not None and time.monotonic() - start >= seconds:
            break
    return {"samples_per_second": samples / (time.monotonic() - start), "threads": torch.get_num_threads()}


def reference(steps: int, target_batch_size: int, seed: int) -> dict:
    """One process, the collaboration's effective batch: accumulate clipped micro-batch gradients, then step."""
    model, task, tokenizer, optimizer, batches, args = setup(seed)
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
    args = parser.parse_args(argv)
    if args.mode == "throughput":
        result = throughput(args.seconds, args.seed)
    else:
        result = reference(args.steps, args.target_batch_size, args.seed)
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
