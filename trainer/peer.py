"""One volunteer peer from start to finish: build everything from the arguments, train, shut down cleanly."""

from __future__ import annotations

import copy
import logging
import threading

import hivemind

from arguments import PeerConfig
from collab import events, signals
from collab.callback import CollaborativeCallback, read_resume_point
from collab.dht import joined_fields, start_dht
from collab.optim import build_optimizer, collaboration_timeouts, finish_delayed_updates, start_state_prefetch
from collab.schema import make_validators
from collab.storage import atomic_directory
from collab.timeouts import Timeouts, last_round_wait
from trainer import ranks
from trainer.data import batch_stream, peer_data_seed
from trainer.loop import TrainingSummary, autocast_dtype, flush_denormals, train
from trainer.model import build_model, load_tokenizer
from trainer.tasks import TASKS

logger = logging.getLogger(__name__)


def run_peer(config: PeerConfig, stop: threading.Event) -> TrainingSummary:
    """Join the collaboration, train until stopped or max_steps, save the model to output_dir, leave cleanly.
    Ends with the ``shutdown`` event, ``saved`` telling whether the model reached output_dir; a shutdown forced
    before that exits ``signals.EXIT_NOT_SAVED`` (the deadline is derived from the model: ``collab.timeouts``)."""
    events.open_event_log(config.peer.events_path)
    signals.expect_final_save(epoch=None, folder=str(config.training.output_dir))
    summary = None
    try:
        summary = _train_and_save(config, stop)
        return summary
    finally:
        signals.leave(
            saved=summary is not None,
            epoch=None if summary is None else summary.end_epoch,
            folder=str(config.training.output_dir),
        )


def _train_and_save(config: PeerConfig, stop: threading.Event) -> TrainingSummary:
    flush_denormals()
    device = ranks.training_device()
    amp_dtype = autocast_dtype(config.training, device)
    if config.training.fp16 and not config.training.bf16 and amp_dtype is None:
        logger.info("fp16 needs CUDA: training in fp32 on %s", device.type)
    task = TASKS[config.dataset.task]
    tokenizer = load_tokenizer(config.dataset)
    model, _ = build_model(config.dataset, tokenizer, config.training.seed)
    sharded_model = None
    if config.training.shard_model and ranks.current().distributed:
        # the whole model stays in host memory for hivemind; the ranks compute on their shards of a copy
        sharded_model = ranks.shard(copy.deepcopy(model), device)
    else:
        if config.training.shard_model:
            logger.info("--shard_model: this peer is one process (no torchrun), so nothing is sharded")
        model.to(device)
    dataset = task.train_dataset(config.dataset, tokenizer)
    collator = task.collator(tokenizer)
    logger.info(
        "Model %s (--task %s, %.2fM parameters); %d training rows from %s",
        type(model).__name__,
        task.name,
        sum(p.numel() for p in model.parameters()) / 1e6,
        len(dataset),
        config.dataset.dataset_path,
    )

    resume = None
    if config.collaboration.resume_from is not None:
        resume = read_resume_point(config.collaboration.resume_from, type(model))
    validators, public_key = make_validators(config.peer.experiment_prefix)
    dht = start_dht(config.peer, validators)
    events.emit("joined", **joined_fields(dht, config.peer.client_mode))
    optimizer = prefetch = None
    rounds_finished = False
    try:
        timeouts = collaboration_timeouts(model, config.optimizer, config.averager)
        signals.set_shutdown_deadline(timeouts.shutdown_deadline)
        prefetch = start_state_prefetch(dht, config.peer, config.optimizer, timeouts)
        optimizer = build_optimizer(
            model,
            dht,
            config.peer,
            config.optimizer,
            config.averager,
            config.tracker,
            config.training,
            timeouts=timeouts,
            prefetch=prefetch,
        )
        optimizer.leaving = stop
        callback = CollaborativeCallback(
            dht,
            optimizer,
            model,
            public_key,
            config.peer.experiment_prefix,
            config.collaboration.statistics_expiration,
            config.collaboration.backup_every_steps,
            config.collaboration.public_name,
        )
        callback.on_train_begin(resume)
        batches = batch_stream(
            dataset,
            collator,
            config.training.per_device_train_batch_size,
            peer_data_seed(config.training.seed, public_key),
            task.name,
            config.training.dataloader_num_workers,
            pin_memory=device.type == "cuda",
        )
        summary = train(model, optimizer, callback, batches, config.training, device, stop, amp_dtype, sharded_model)
        rounds_finished = True
        finish_last_rounds(optimizer, timeouts)
        # The save comes before the teardown: a step that ran into the shutdown deadline then cuts the goodbyes
        # to the swarm (which notices a peer gone), not the volunteer's model.
        with atomic_directory(config.training.output_dir) as folder:
            model.save_pretrained(folder)
            tokenizer.save_pretrained(folder)
        signals.final_state_saved(epoch=summary.end_epoch)
    finally:
        if prefetch is not None:
            prefetch.cancel()  # a download the peer stopped before taking
        if optimizer is not None:
            if not rounds_finished:  # an error: the groupmates of the last rounds still get this peer's parts
                finish_last_rounds(optimizer, timeouts)
            optimizer.shutdown()
        dht.shutdown()

    logger.info(
        "Stopped at global epoch %d (started at %d); loss %s -> %s; model saved to %s",
        summary.end_epoch,
        summary.start_epoch,
        _fmt(summary.first_loss),
        _fmt(summary.last_loss),
        config.training.output_dir,
    )
    return summary


def finish_last_rounds(optimizer: hivemind.Optimizer, timeouts: Timeouts) -> None:
    """Finish the rounds still running in the background (delayed averaging) before saying goodbye: hivemind's
    shutdown announces the departure first, and peers would then skip our last round. After a stop signal they get
    what the shutdown deadline leaves after ``timeouts.save_reserve``."""
    seconds_left = signals.seconds_left()
    wait = last_round_wait(timeouts, seconds_left)
    if wait < timeouts.shutdown_averaging_wait:
        logger.info(
            "The last step took most of the shutdown deadline: the last background round gets %.1f s of its "
            "%.1f s, the save and teardown %.1f s of their %.1f s",
            wait,
            timeouts.shutdown_averaging_wait,
            max(0.0, seconds_left - wait),
            timeouts.save_reserve,
        )
    finish_delayed_updates(optimizer, timeout=wait)


def _fmt(value) -> str:
    return "n/a" if value is None else f"{value:.4f}"
