"""``python -m bench.stale_lamb``: how far a newcomer that caught up steps from the swarm while its Lamb state is the
one it downloaded, some epochs old. Prints one JSON line per case.

In the synchronous mode a newcomer whose download outlasted several epochs catches up: a parameter round gives it the
swarm's parameters, and parameter rounds carry parameters only, so its Lamb moments stay those of the downloaded state
(docs/RELIABILITY.md). Every peer applies the same averaged gradients, so the difference can only come from those
moments. Here a veteran trains the default tiny BERT for ``warm`` steps; the newcomer takes the veteran's parameters
at that point and its Lamb state from ``stale`` steps before. Both then apply the same gradients (the veteran's, on
random token batches). Per case: the newcomer's update minus the veteran's, over the veteran's (norms), at its first
step and after; the steps until it is under ``CLOSE`` of an update; and how far the parameters drift apart, in
updates, at the largest and at a parameter-round period (``--period``) after the catch-up.
"""

from __future__ import annotations

import argparse
import copy
import json

import torch
from transformers import AutoModelForMaskedLM

from arguments import TrainingArguments
from collab.optim import lamb_factory, parameter_groups
from trainer.model import tiny_bert_config

VOCABULARY = 4096  # the sample tokenizer's
BATCH, LENGTH = 8, 32  # random token batches: the gradients of a real model, not of a real corpus
CASES = ((20, 5), (200, 5), (200, 20))  # (warm, stale) in optimizer steps (global epochs)
STEPS_AFTER = 60
CLOSE = 0.1  # "converged": the newcomer's update within this fraction of the veteran's


def flat(tensors) -> torch.Tensor:
    return torch.cat([tensor.detach().reshape(-1) for tensor in tensors])


def gradients(model: torch.nn.Module, generator: torch.Generator) -> list[torch.Tensor]:
    """The gradients of one MLM batch of random tokens at ``model``'s parameters."""
    input_ids = torch.randint(0, VOCABULARY, (BATCH, LENGTH), generator=generator)
    model.zero_grad()
    model(input_ids=input_ids, labels=input_ids).loss.backward()
    return [param.grad.detach().clone() for param in model.parameters()]


def step_with(model: torch.nn.Module, optimizer: torch.optim.Optimizer, grads: list[torch.Tensor]) -> torch.Tensor:
    """Apply ``grads`` with ``optimizer``; the update it made, flattened."""
    before = flat(model.parameters())
    for param, grad in zip(model.parameters(), grads, strict=True):
        param.grad = grad.clone()
    optimizer.step()
    return flat(model.parameters()) - before


def measure(warm: int, stale: int, period: int, steps_after: int = STEPS_AFTER, seed: int = 0) -> dict:
    torch.manual_seed(seed)
    args = TrainingArguments()
    veteran = AutoModelForMaskedLM.from_config(tiny_bert_config(VOCABULARY))
    veteran_lamb = lamb_factory(args)(parameter_groups(veteran, args.weight_decay))
    generator = torch.Generator().manual_seed(seed)
    downloaded = None
    for step in range(warm):
        if step == warm - stale:
            downloaded = copy.deepcopy(veteran_lamb.state_dict())
        step_with(veteran, veteran_lamb, gradients(veteran, generator))
    if stale == 0:
        downloaded = copy.deepcopy(veteran_lamb.state_dict())
    newcomer = copy.deepcopy(veteran)  # the catch-up round: the swarm's parameters
    newcomer_lamb = lamb_factory(args)(parameter_groups(newcomer, args.weight_decay))
    newcomer_lamb.load_state_dict(downloaded)

    differences, drifts = [], []
    for _ in range(steps_after):
        grads = gradients(veteran, generator)
        veteran_update = step_with(veteran, veteran_lamb, grads)
        newcomer_update = step_with(newcomer, newcomer_lamb, grads)
        size = float(veteran_update.norm())
        differences.append(float((newcomer_update - veteran_update).norm()) / size)
        drifts.append(float((flat(newcomer.parameters()) - flat(veteran.parameters())).norm()) / size)
    return summarize(warm, stale, period, differences, drifts)


def summarize(warm: int, stale: int, period: int, differences: list[float], drifts: list[float]) -> dict:
    """One case's figures from its per-step update differences and drifts (both in updates of the veteran)."""
    close_from = next((i + 1 for i in range(len(differences)) if max(differences[i:]) < CLOSE), None)
    return {
        "warm_steps": warm,
        "stale_steps": stale,
        "first_update_difference": round(differences[0], 3),
        "update_difference_at_end": round(differences[-1], 3),
        "steps_until_within": close_from,
        "within": CLOSE,
        "largest_drift_in_updates": round(max(drifts), 2),
        "drift_after_one_period": round(drifts[period - 1], 2),
        "period": period,
        "steps_after": len(differences),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.stale_lamb", description=__doc__)
    parser.add_argument("--period", type=int, default=2, help="global epochs between parameter rounds (sync: 2)")
    args = parser.parse_args(argv)
    if not 1 <= args.period <= STEPS_AFTER:
        parser.error(f"--period: must be 1 to {STEPS_AFTER} (got {args.period})")
    torch.set_num_threads(1)
    for warm, stale in CASES:
        print(json.dumps(measure(warm, stale, args.period)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
