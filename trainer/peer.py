"""One volunteer peer from start to finish: build everything from the arguments, train, shut down cleanly."""

from __future__ import annotations

import logging
import threading

from arguments import (
    AveragerArguments,
    CollaborationArguments,
    DatasetArguments,
    OptimizerArguments,
    PeerArguments,
    ProgressTrackerArguments,
    TrainingArguments,
)
from collab import events, signals
from collab.callback import CollaborativeCallback, read_resume_point
from collab.dht import joined_fields, start_dht
from collab.optim import build_optimizer, collaboration_timeouts, finish_delayed_updates
from collab.schema import make_validators
from collab.storage import atomic_directory
from trainer.data import batch_stream, peer_data_seed
from trainer.loop import TrainingSummary, autocast_dtype, flush_denormals, train
from trainer.model import build_model, load_tokenizer
from trainer.ranks import training_device
from trainer.tasks import TASKS

logger = logging.getLogger(__name__)


def run_peer(
    peer_args: PeerArguments,
    optimizer_args: OptimizerArguments,
    averager_args: AveragerArguments,
    tracker_args: ProgressTrackerArguments,
    collaboration_args: CollaborationArguments,
    dataset_args: DatasetArguments,
    training_args: TrainingArguments,
    stop: threading.Event,
) -> TrainingSummary:
    """Join the collaboration, train until stopped or max_steps, save the model to output_dir, leave cleanly.
    Ends with the ``shutdown`` event, ``saved`` telling whether the model reached output_dir; a shutdown forced
    before that exits ``signals.EXIT_NOT_SAVED`` (the deadline is derived from the model: ``collab.timeouts``)."""
    events.open_event_log(peer_args.events_path)
    signals.expect_final_save(epoch=None, folder=str(training_args.output_dir))
    summary = None
    try:
        summary = _train_and_save(
            peer_args,
            optimizer_args,
            averager_args,
            tracker_args,
            collaboration_args,
            dataset_args,
            training_args,
            stop,
        )
        return summary
    finally:
        signals.leave(
            saved=summary is not None,
            epoch=None if summary is None else summary.end_epoch,
            folder=str(training_args.output_dir),
        )


def _train_and_save(
    peer_args: PeerArguments,
    optimizer_args: OptimizerArguments,
    averager_args: AveragerArguments,
    tracker_args: ProgressTrackerArguments,
    collaboration_args: CollaborationArguments,
    dataset_args: DatasetArguments,
    training_args: TrainingArguments,
    stop: threading.Event,
) -> TrainingSummary:
    flush_denormals()
    device = training_device()
    amp_dtype = autocast_dtype(training_args, device)
    if training_args.fp16 and not training_args.bf16 and amp_dtype is None:
        logger.info("fp16 needs CUDA: training in fp32 on %s", device.type)
    task = TASKS[dataset_args.task]
    tokenizer = load_tokenizer(dataset_args)
    model, _ = build_model(dataset_args, tokenizer, training_args.seed)
    model.to(device)
    dataset = task.train_dataset(dataset_args, tokenizer)
    collator = task.collator(tokenizer)
    logger.info(
        "Model %s (--task %s, %.2fM parameters); %d training rows from %s",
        type(model).__name__,
        task.name,
        sum(p.numel() for p in model.parameters()) / 1e6,
        len(dataset),
        dataset_args.dataset_path,
    )

    resume = None
    if collaboration_args.resume_from is not None:
        resume = read_resume_point(collaboration_args.resume_from, type(model))
    validators, public_key = make_validators(peer_args.experiment_prefix)
    dht = start_dht(peer_args, validators)
    events.emit("joined", **joined_fields(dht, peer_args.client_mode))
    optimizer = None
    try:
        timeouts = collaboration_timeouts(model, optimizer_args, averager_args)
        signals.set_shutdown_deadline(timeouts.shutdown_deadline)
        optimizer = build_optimizer(
            model, dht, peer_args, optimizer_args, averager_args, tracker_args, training_args, timeouts=timeouts
        )
        callback = CollaborativeCallback(
            dht,
            optimizer,
            model,
            public_key,
            peer_args.experiment_prefix,
            collaboration_args.statistics_expiration,
            collaboration_args.backup_every_steps,
            collaboration_args.public_name,
        )
        callback.on_train_begin(resume)
        batches = batch_stream(
            dataset,
            collator,
            training_args.per_device_train_batch_size,
            peer_data_seed(training_args.seed, public_key),
            task.name,
            training_args.dataloader_num_workers,
            pin_memory=device.type == "cuda",
        )
        summary = train(model, optimizer, callback, batches, training_args, device, stop, amp_dtype)
    finally:
        if optimizer is not None:
            # Finish the rounds still running in the background (delayed averaging) before saying goodbye:
            # hivemind's shutdown announces the departure first, and peers would then skip our last round.
            finish_delayed_updates(optimizer, timeout=timeouts.shutdown_averaging_wait)
            optimizer.shutdown()
        dht.shutdown()

    with atomic_directory(training_args.output_dir) as folder:
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    logger.info(
        "Stopped at global epoch %d (started at %d); loss %s -> %s; model saved to %s",
        summary.end_epoch,
        summary.start_epoch,
        _fmt(summary.first_loss),
        _fmt(summary.last_loss),
        training_args.output_dir,
    )
    return summary


def _fmt(value) -> str:
    return "n/a" if value is None else f"{value:.4f}"
