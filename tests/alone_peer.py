"""One peer trained in this process on CPU as ``run_peer`` assembles it: the trainer's own ``train()`` against a real
hivemind.Optimizer on 127.0.0.1, alone in its swarm."""

from __future__ import annotations

import threading
from collections.abc import Callable

import hivemind
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
from trainer.loop import TrainingSummary, train
from trainer.model import build_model, load_tokenizer
from trainer.tasks import TASKS

STEPS = 3
# Runs that must take their steps on the same micro-batches avoid two kinds of timing. A delayed step lands on
# whichever micro-batch follows the end of the background step, and a progress read from the DHT can replace the
# peer's own sample count with its last published record plus an extrapolation, so an epoch may take a fifth
# micro-batch (measured: fp16 against fp32 cosine 0.970-0.982 in such runs, 1.00001 in every run without).
# Steps land at their epoch's end here and the tracker reads the DHT once, at start.
NO_DELAY = {"delay_optimizer_step": False, "delay_grad_averaging": False}
NO_REFRESH = {"min_refresh_period": 60.0, "max_refresh_period": 60.0, "default_refresh_period": 60.0}

Weights = dict[str, torch.Tensor]


def alone_training(**overrides) -> TrainingArguments:
    """The training arguments of ``train_alone``'s peer: STEPS global steps of micro-batches of 4, seed 7."""
    return TrainingArguments(**{"max_steps": STEPS, "per_device_train_batch_size": 4, "seed": 7, **overrides})


def train_alone(
    amp_dtype: torch.dtype | None,
    prefix: str,
    training_args: TrainingArguments | None = None,
    spoil: Callable[[torch.nn.Module], None] | None = None,
    spoil_backup: bool = False,
) -> tuple[TrainingSummary, Weights, Weights]:
    """``training_args.max_steps`` (default STEPS) global steps of one peer on CPU under ``amp_dtype`` autocast (None:
    fp32); the summary, weights before and after. ``spoil`` changes the model once the peer has taken its first
    backup, or before (``spoil_backup``)."""
    dataset_args = DatasetArguments()
    training_args = training_args or alone_training()
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
            OptimizerArguments(target_batch_size=16, matchmaking_time=0.5, averaging_timeout=5.0, **NO_DELAY),
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
            if spoil is not None and spoil_backup:
                spoil(model)
            callback.on_train_begin(None)
            if spoil is not None and not spoil_backup:
                spoil(model)
            batches = batch_stream(
                task.train_dataset(dataset_args, tokenizer),
                task.collator(tokenizer),
                training_args.per_device_train_batch_size,
                data_seed=11,
                task=task.name,
            )
            cpu = torch.device("cpu")
            summary = train(model, optimizer, callback, batches, training_args, cpu, threading.Event(), amp_dtype)
        finally:
            optimizer.shutdown()
    finally:
        dht.shutdown()
    return summary, before, {name: param.detach().clone() for name, param in model.named_parameters()}
