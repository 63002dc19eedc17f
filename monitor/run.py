"""The monitor from start to finish: join the DHT, then every refresh_period read, aggregate, report, checkpoint.

The monitor is the collaboration's stable entry point (run it with --host_maddrs and --identity_path so its
address survives restarts) and the keeper of its checkpoints. Nothing a peer does, sends or fails to send stops
it: malformed records are ignored, state downloads are retried, uploads and web reports run in the background.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

from hivemind.utils import get_dht_time

from arguments import SECRET_SETTINGS, MetricsArguments, MonitorConfig, to_config
from collab import events
from collab.dht import joined_fields, start_dht
from collab.extras import require_extra
from collab.hivemind_fixes import read_progress_records
from collab.optim import build_state_averager, collaboration_timeouts
from collab.schema import make_validators, peer_fingerprint, read_metrics
from collab.timeouts import LOAD_STATE_TIMEOUT_FLOOR
from monitor.aggregate import (
    count_contributions,
    far_ahead,
    live_metrics,
    summarize,
    top_contributors,
    with_live_progress,
)
from monitor.checkpoints import CheckpointSaver, default_epoch_tolerance
from monitor.sinks import Sink, build_sinks, last_step_in, write_all
from monitor.upload import Uploader, make_target

logger = logging.getLogger(__name__)


# Report keys step_reported does not repeat: events carry flat facts in lines of at most 4 KiB (collab/events.py),
# so the contributors table stays in the metrics line.
EVENT_LEAVES_OUT = ("time", "contributors")
MAX_LOGGED_LIARS = 1000  # peers named in the log for a record far ahead; more are counted at DEBUG only


@dataclass
class MonitorState:
    """What the loop has seen so far: the last step reported, evaluation results waiting for the next one, and the
    peers already logged for a record far ahead of the swarm (each is named once)."""

    last_step: int | None = None
    pending_evaluation: dict[str, float] = field(default_factory=dict)
    logged_liars: set = field(default_factory=set)
    contributions: dict = field(default_factory=dict)  # by peer: monitor.aggregate.Contribution
    # how far the last step reported may be past the swarm's before it is taken for a liar's: the swarm's step dips
    # by a few epochs when records of dead peers drag the median down, and reporting must not go back then
    step_tolerance: int = default_epoch_tolerance(MetricsArguments.alive_step_lag, LOAD_STATE_TIMEOUT_FLOOR)


def is_new_step(step: int, last_step: int | None) -> bool:
    """Only a step past the last one reported is new: when the peer with the newest record leaves and its record
    expires, the newest live step can go back, and that is not progress to report again."""
    return last_step is None or step > last_step


def last_step_within_reach(last_step: int | None, step: int, tolerance: int) -> int | None:
    """``last_step``, or None when it is more than ``tolerance`` past the swarm's honest ``step``: a step no honest
    majority reported (a liar's, written by an older version, or a previous run's), so reporting goes on from the
    swarm's step instead of waiting forever to pass it."""
    return None if last_step is not None and last_step - step > tolerance else last_step


def log_far_ahead(alive: dict, step: int, logged: set) -> None:
    """Name once each peer whose record claims a step past the swarm's; they are left out of the report."""
    for peer in far_ahead(alive, step):
        if peer in logged:
            continue
        if len(logged) >= MAX_LOGGED_LIARS:
            logger.debug("One more peer far ahead of the swarm's step %d (not named: too many)", step)
            continue
        logged.add(peer)
        logger.warning(
            "Ignoring peer %s: its record claims global step %d, past the swarm's %d (alive_step_lag)",
            peer_fingerprint(peer),
            alive[peer].step,
            step,
        )


def progressing_peers(dht, prefix: str, now: float) -> set:
    """The peers (signing keys, as their metrics records' subkeys) whose training-progress record has not expired."""
    records = read_progress_records(dht, prefix)
    return {subkey for subkey, entry in records.items() if getattr(entry, "expiration_time", 0) > now}


def refresh(
    dht, prefix: str, state: MonitorState, sinks: list[Sink], saver: CheckpointSaver | None, step_lag: int
) -> None:
    """One refresh: read the records, report a new global step to every sink, then save a checkpoint when due (and
    evaluate it when that is due); an evaluation's ``eval_*`` keys ride on the first step reported after it."""
    now = get_dht_time()
    alive = with_live_progress(live_metrics(read_metrics(dht, prefix), now), progressing_peers(dht, prefix, now))
    metrics = summarize(alive, now, step_lag)
    if metrics is None:
        logger.debug("No live metrics records yet")
        return
    log_far_ahead(alive, metrics.step, state.logged_liars)
    state.contributions = count_contributions(state.contributions, alive, metrics.step, now)
    reachable = last_step_within_reach(state.last_step, metrics.step, state.step_tolerance)
    if reachable != state.last_step:
        logger.warning(
            "The last step reported, %d, is far past the swarm's %d: no honest majority "
            "reached it (a liar's record or an earlier run); reporting goes on from the swarm's step",
            state.last_step,
            metrics.step,
        )
        state.last_step = reachable
    if is_new_step(metrics.step, state.last_step):
        state.last_step = metrics.step
        report = {
            **metrics.to_dict(),
            "contributors": top_contributors(state.contributions),
            **state.pending_evaluation,
        }
        write_all(sinks, report)
        events.emit("step_reported", **{key: value for key, value in report.items() if key not in EVENT_LEAVES_OUT})
        state.pending_evaluation.clear()
    # after the report: a checkpoint's download and evaluation take minutes on a big state and a slow link, and the
    # dashboard must not wait for them
    if saver is not None and saver.maybe_save(metrics.step, metrics.loss, metrics.alive_peers) is not None:
        evaluation = saver.evaluate()
        if evaluation:
            events.emit("checkpoint_evaluated", step=saver.last_saved_step, **evaluation)
            state.pending_evaluation.update(evaluation)


def build_checkpointing(dht, config: MonitorConfig):
    """The state averager (the trainers' own optimizer factory) and the saver around it, evaluating as asked."""
    from monitor.evaluate import CheckpointEvaluator
    from trainer.model import build_model, load_tokenizer
    from trainer.tasks import TASKS

    tokenizer = load_tokenizer(config.dataset)
    model, _ = build_model(config.dataset, tokenizer, config.training.seed)
    evaluator = None
    if config.evaluation.eval_every_checkpoints > 0:
        task = TASKS[config.dataset.task]
        every, limit = config.evaluation.eval_every_checkpoints, config.evaluation.eval_max_examples
        evaluator = CheckpointEvaluator(task, config.dataset, tokenizer, every, limit)
    # the trainers' own timeouts, from the same model
    timeouts = collaboration_timeouts(model, config.optimizer, config.averager)
    averager = build_state_averager(
        model, dht, config.peer, config.optimizer, config.averager, config.training, timeouts
    )
    saver = CheckpointSaver(
        averager,
        model,
        tokenizer,
        config.checkpoints.repo_path,
        config.checkpoints.save_checkpoint_step_interval,
        config.checkpoints.keep_checkpoints,
        timeouts.load_state_timeout,
        retry_period=config.metrics.refresh_period,
        evaluator=evaluator,
        epoch_tolerance=default_epoch_tolerance(config.metrics.alive_step_lag, timeouts.load_state_timeout),
    )
    return averager, saver


def run_monitor(config: MonitorConfig, stop: threading.Event) -> MonitorState:
    """Run until ``stop`` is set. ``config.peer.web_token`` authenticates web reports and http uploads."""
    events.open_event_log(config.peer.events_path)
    token = config.peer.web_token
    validators, _ = make_validators(config.peer.experiment_prefix)
    if config.metrics.wandb_project is not None:
        require_extra("wandb", "--wandb_project")  # before the DHT starts: a missing extra is one line, nothing else
    dht = start_dht(config.peer, validators, client_mode=False)
    events.emit("joined", **joined_fields(dht, False))
    experiment_config = to_config(*vars(config).values())
    for secret in SECRET_SETTINGS:
        experiment_config.pop(secret, None)
    sinks = build_sinks(config.metrics, config.peer.experiment_prefix, token, experiment_config)
    averager = saver = uploader = None
    state = MonitorState(
        last_step=last_step_in(config.metrics.metrics_path),
        step_tolerance=default_epoch_tolerance(
            config.metrics.alive_step_lag, config.optimizer.load_state_timeout or LOAD_STATE_TIMEOUT_FLOOR
        ),
    )
    if state.last_step is not None and not config.peer.initial_peers:
        logger.warning(
            "Restarted without --initial_peers: the peers forgot this node when it went down. If the collaboration "
            "is still running, restart with --initial_peers of any live peer (every trainer logs its own address)"
        )
    try:
        if config.checkpoints.store_checkpoints:
            averager, saver = build_checkpointing(dht, config)
            state.step_tolerance = saver.epoch_tolerance  # with the load timeout derived from the model
        if config.checkpoints.upload_interval is not None:
            target = make_target(config.checkpoints.upload_to, token, config.checkpoints.keep_checkpoints)
            uploader = Uploader(config.checkpoints.repo_path, target, config.checkpoints.upload_interval).start()
        logger.info("Monitoring %s every %.0f s", config.peer.experiment_prefix, config.metrics.refresh_period)
        while not stop.is_set():
            try:
                refresh(dht, config.peer.experiment_prefix, state, sinks, saver, config.metrics.alive_step_lag)
            except Exception:
                logger.exception("Refresh failed; trying again in %.0f s", config.metrics.refresh_period)
            stop.wait(config.metrics.refresh_period)
    finally:
        for closeable in filter(None, (uploader, *sinks)):
            closeable.close()
        if averager is not None:
            averager.shutdown()
        dht.shutdown()
    logger.info("Monitor stopped at global step %s", state.last_step)
    events.emit("shutdown", step=state.last_step)
    return state
