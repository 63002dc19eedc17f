"""The fp16 path every GPU volunteer takes (autocast, loss scaling, unscale before clipping, hivemind.Optimizer).

CI has no GPU, but PyTorch runs fp16 autocast and GradScaler on CPU too, so these tests drive the trainer's own
``train()`` with ``use_amp=True`` on CPU against a real hivemind.Optimizer (one peer, 127.0.0.1) and compare it
with the fp32 path on the same model, data and seed.
"""

from __future__ import annotations

import threading

import hivemind
import pytest
import torch

from arguments import (
    AveragerArguments,
    CollaborationArguments,
    DatasetArguments,
    OptimizerArguments,
    PeerArguments,
    ProgressTrackerArguments,
    TrainingArguments,
)
from collab.callback import CollaborativeCallback
from collab.optim import build_optimizer
from collab.schema import make_validators
from trainer.data import batch_stream
from trainer.loop import TrainingSummary, mixed_precision, train
from trainer.model import build_model, load_tokenizer
from trainer.tasks import TASKS

STEPS = 3
# Both paths must take their steps on the same micro-batches; two kinds of timing would move them apart. A delayed
# step lands on whichever micro-batch follows the end of the background step, and a progress read from the DHT can
# replace the peer's own sample count with its last published record plus an extrapolation, so an epoch may take a
# fifth micro-batch (measured: fp16 against fp32 cosine 0.970-0.982 in such runs, 1.00001 in every run without).
# Steps land at their epoch's end here and the tracker reads the DHT once, at start: what is left is fp16's effect.
NO_DELAY = {"delay_optimizer_step": False, "delay_grad_averaging": False}
NO_REFRESH = {"min_refresh_period": 60.0, "max_refresh_period": 60.0, "default_refresh_period": 60.0}


def test_fp16_applies_on_cuda_only():
    assert mixed_precision(True, torch.device("cuda"))
    assert not mixed_precision(True, torch.device("cpu"))
    assert not mixed_precision(False, torch.device("cuda"))


Weights = dict[str, torch.Tensor]


def train_alone(use_amp: bool, prefix: str) -> tuple[TrainingSummary, Weights, Weights]:
    """STEPS global steps of one peer on CPU, as run_peer assembles it; the summary, weights before and after."""
    dataset_args = DatasetArguments()
    training_args = TrainingArguments(fp16=use_amp, max_steps=STEPS, per_device_train_batch_size=8, seed=7)
    task = TASKS[dataset_args.task]
    tokenizer = load_tokenizer(dataset_args)
    model, _ = build_model(dataset_args, tokenizer, training_args.seed)
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    validators, public_key = make_validators(prefix)
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], record_validators=validators)
    try:
        optimizer = build_optimizer(
            model,
            dht,
            PeerArguments(experiment_prefix=prefix),
            OptimizerArguments(target_batch_size=32, matchmaking_time=0.5, averaging_timeout=5.0, **NO_DELAY),
            AveragerArguments(),
            ProgressTrackerArguments(**NO_REFRESH),
            training_args,
        )
        try:
            collaboration = CollaborationArguments()
            callback = CollaborativeCallback(
                dht,
                optimizer,
                model,
                public_key,
                prefix,
                collaboration.statistics_expiration,
                collaboration.backup_every_steps,
            )
            callback.on_train_begin(None)
            batches = batch_stream(
                task.train_dataset(dataset_args, tokenizer),
                task.collator(tokenizer),
                training_args.per_device_train_batch_size,
                data_seed=11,
                task=task.name,
            )
            summary = train(
                model, optimizer, callback, batches, training_args, torch.device("cpu"), threading.Event(), use_amp
            )
        finally:
            optimizer.shutdown()
    finally:
        dht.shutdown()
    return summary, before, {name: param.detach().clone() for name, param in model.named_parameters()}


@pytest.mark.timeout(240)
def test_fp16_path_takes_the_same_steps_as_fp32():
    fp32, start, fp32_after = train_alone(False, "amp_fp32")
    fp16, fp16_start, fp16_after = train_alone(True, "amp_fp16")
    assert all(torch.equal(start[name], fp16_start[name]) for name in start)  # same seed, same initial model

    for summary in (fp32, fp16):
        assert summary.end_epoch == STEPS and summary.rollbacks == 0
        assert summary.last_loss is not None and summary.last_loss < summary.first_loss
    assert fp32.skipped_batches == 0
    assert fp16.skipped_batches <= 2  # the loss scale may start too high for a batch or two, then backs off
    assert all(torch.isfinite(param).all() for param in fp16_after.values())
    assert [r.mini_steps for r in fp16.reports] == [r.mini_steps for r in fp32.reports]  # the same micro-batches

    # Same data, same Lamb steps: fp16 rounding moves the updates a little, never their direction.
    fp32_update = torch.cat([(fp32_after[name] - start[name]).flatten() for name in start])
    fp16_update = torch.cat([(fp16_after[name] - start[name]).flatten() for name in start])
    assert fp32_update.norm() > 0
    cosine = torch.nn.functional.cosine_similarity(fp32_update, fp16_update, dim=0)
    assert cosine > 0.99, cosine
    assert abs(fp16.last_loss / fp32.last_loss - 1) < 0.01, (fp16.last_loss, fp32.last_loss)
