"""What ``run_trainer.py`` runs in each process: a plain peer, or one rank of a torchrun peer (``trainer.ranks``).

Rank 0 of a torchrun peer is a whole peer (``trainer.peer.run_peer``); the other ranks build the same model, read
their own share of the data and follow rank 0's steps, with nothing of hivemind.
"""

from __future__ import annotations

import logging
import os
import threading

from arguments import PeerConfig
from collab import events
from collab.averagers import MAX_DONORS_PER_LOAD
from collab.optim import collaboration_timeouts
from collab.timeouts import rank_wait_timeout
from trainer import ranks
from trainer.data import batch_stream, peer_data_seed
from trainer.loop import autocast_dtype, flush_denormals, follow
from trainer.model import build_model, load_tokenizer, model_skeleton
from trainer.peer import run_peer
from trainer.tasks import TASKS

logger = logging.getLogger(__name__)


def run_rank(config: PeerConfig, stop: threading.Event) -> None:
    """``run_peer`` in a plain process and on rank 0 of a torchrun peer, ``run_follower`` on the other ranks."""
    layout = ranks.ranks_from_env(os.environ)
    timeout = rank_wait_seconds(config) if layout.distributed else None
    with ranks.process_group(layout, timeout):
        program = run_peer if layout.rank == 0 else run_follower
        program(config, stop=stop)


def rank_wait_seconds(config: PeerConfig) -> float:
    """``--ddp_timeout``, else the wait derived from the model's size and ``--bandwidth`` (``rank_wait_timeout``),
    computed on the model's skeleton before any weight is loaded: every rank derives the same value."""
    if config.training.ddp_timeout is not None:
        return config.training.ddp_timeout
    skeleton = model_skeleton(config.dataset, load_tokenizer(config.dataset))
    timeouts = collaboration_timeouts(skeleton, config.optimizer, config.averager)
    return rank_wait_timeout(timeouts, MAX_DONORS_PER_LOAD)


def run_follower(config: PeerConfig, stop: threading.Event) -> None:
    """A rank other than 0: train until rank 0 stops. Its events go to its own file (``ranks.rank_events_path``).

    ``stop`` is left to rank 0, which finishes the step, saves and then stops every rank: torchrun signals all."""
    rank = ranks.current().rank
    events.open_event_log(ranks.rank_events_path(config.peer.events_path, rank))
    try:
        flush_denormals()
        device = ranks.training_device()
        amp_dtype = autocast_dtype(config.training, device)
        task = TASKS[config.dataset.task]
        tokenizer = load_tokenizer(config.dataset)
        model, _ = build_model(config.dataset, tokenizer, config.training.seed)
        sharded = config.training.shard_model
        model = ranks.shard(model, device) if sharded else model.to(device)
        batches = batch_stream(
            task.train_dataset(config.dataset, tokenizer),
            task.collator(tokenizer),
            config.training.per_device_train_batch_size,
            # a key of its own, as rank 0's data order is keyed by its peer's (process-wide, fresh) public key
            peer_data_seed(config.training.seed, os.urandom(32)),
            task.name,
            config.training.dataloader_num_workers,
            pin_memory=device.type == "cuda",
        )
        epoch = follow(model, batches, config.training, device, amp_dtype, sharded)
        logger.info("Rank %d stopped with rank 0 at global epoch %d", rank, epoch)
    finally:
        events.open_event_log(None)
