"""Churn at scale, measured: ``python -m bench.swarm [--quick]``; the last line is one JSON object.

A swarm of real ``run_trainer.py`` peers (the default tiny model, one thread each, started through
``python -m bench.swarm peer``: bench.probe's stopwatch, and the training thread at ``TRAINING_NICENESS``, below the
peers' DHT and averager processes as on a machine of its own) in network namespaces on bench.procs' hub, each
behind an access link of its own, the speeds a cycle of ``LINK_RATES``. The monitor, in a namespace of its own, is
the bootstrap every peer joins through (``--initial_peers``). One peer is ``SLOWDOWN`` times slower than the rest:
after each optimizer step it sleeps twice as long as its forward and backward took (``--gradient_accumulation_steps``
would make its steps coarser, not the peer slower). Once the swarm has formed, it runs ``--epochs`` global epochs
while a seeded schedule (``churn_schedule``):

- kills peers with SIGKILL at ``KILL_RATE`` of the peers per hour-equivalent, ``--hour_epochs`` global epochs (60 by
  default: one epoch stands for a minute of a real swarm), and restarts each ``RESTART_EPOCHS`` later with its own
  identity; never more than ``max_down`` at once, never the slow peer;
- brings a newcomer (a new identity, nothing on disk, its link one of ``LINK_RATES``) every ``--newcomer_every``
  epochs, which leaves cleanly (SIGTERM) when the second one after it arrives: at most two newcomers at once; or,
  with ``--joins_in_flight K`` (``--joins``: a run for join tries), keeps K newcomers live at all times, each leaving
  once productive or ``GIVE_UP_AFTER_S`` after its fair chance (a failed join), another taking its place.

The figures, from the peers' events (docs/EVENTS.md) and steps files (``bench.probe``), over the measured epochs:

- ``goodput``: samples that reached an applied update / samples computed (``computed_samples``,
  ``applied_samples``), and ``samples_by_outcome``: the share of the computed samples that each outcome took
  (``samples_by_outcome``: applied, or lost where), and of the ``no_round`` ones, why their round gave no averages
  (``no_round_by_cause``: ``no_round_cause``); ``values_averaged_median`` and ``complete_rounds`` say how much
  of those rounds was averaged (``round_completeness``);
- ``join_success``: joins (restarts and newcomers) that became productive / joins tried (``join_outcome``);
  ``--history`` keeps each run's counts so that they add up across runs;
- ``join_seconds_vs_bound``: per productive join, the time from its ``joined`` event (DHT up; the Python start-up
  before it is CPU, not the swarm) to its first gradient round with its own samples, over the state's bytes on the
  wire through its download link (median, and ``_max``);
- ``stalls``: global epochs that took over twice the median epoch.

Every process has a deadline and is killed on exit, and the run has one (``--max_minutes``). Network namespaces need
root and iproute2; without them the run says so and its JSON line is ``{"skipped": ...}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import shlex
import shutil
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from bench.formulas import rounded, transfer_bound_s
from bench.procs import ONE_THREAD, Child, HubNetwork, NamespacesUnavailable, children, hub_network, read_json_lines
from collab.events import read_events
from trainer.local import LocalProcess

HOUR_EPOCHS = 60  # global epochs in an hour-equivalent: one epoch stands for a minute of a real swarm
KILL_RATE = 0.3  # peers killed per hour-equivalent, as a fraction of the swarm (the churn)
RESTART_EPOCHS = 2  # a killed peer comes back this many epochs later, as a rebooted machine would
NEWCOMERS_AT_ONCE = 2  # a newcomer leaves when the second one after it arrives
SLOWDOWN = 3.0  # the slow peer's step time over its compute time
WARMUP_EPOCHS = 2  # epochs between the swarm's forming and the measured window, for the initial downloads to settle
# Epochs the swarm runs on after the window before it is stopped: the window's last epoch ends for the slower peers
# (their step, their round) after the first peer has moved on, and stopping at once would count it as lost.
SETTLE_EPOCHS = 1
# (upload, download) in Mbit/s, home and office links. The default model's state (1.01M parameters and Lamb's two
# moments, 12.1 MB as state_loaded counts them) takes 8, 3.9, 1.9 and 1 s to download at these rates; a gradient
# round's upload (fp16, 2 MB) 2.7 s on the slowest.
LINK_RATES = ((6.0, 12.0), (10.0, 25.0), (20.0, 50.0), (50.0, 100.0))
FAST_MBIT = 1000.0  # the monitor's link, and every link while the swarm forms (its downloads are not measured)
JOIN_GOAL = 1.5  # join_seconds_vs_bound's goal
# state_loaded counts the state in memory (fp32); downloads carry it in fp16 (load_state_compression), half as many
# bytes: the bound is the time of those through the link.
STATE_WIRE_FRACTION = 0.5
# A join killed (or ended by the run) before JOIN_GOAL x its bound plus an allowance after its joined event had no
# fair chance: the allowance covers what the bound leaves out, the wait for the epoch's end and a round, so it is this
# many of the swarm's median epochs, and at least STARTUP_ALLOWANCE_S (sized when epochs took 31-35 s; on a host
# where they took 60 s a newcomer ended 90 s after joining was still in its first epoch, and counted as failed).
STARTUP_ALLOWANCE_S = 60.0
EPOCHS_TO_A_FIRST_ROUND = 2
# With --joins_in_flight, a newcomer still not productive this long after its fair chance leaves: a failed join,
# whose slot goes to the next newcomer. Three averaging timeouts (60 s): a first round caught in a round that timed
# out gets more, as a newcomer of the churn schedule (alive some eight epochs) does.
GIVE_UP_AFTER_S = 180.0
MAX_JOINS_IN_FLIGHT = 8  # each newcomer is a namespace and a process start on the machine's few cores
GOALS = {"goodput": 0.95, "join_success": 0.995, "join_seconds_vs_bound": JOIN_GOAL, "stalls": 0}
# The peers' training threads run at this niceness: the swarm's peers share a few cores, where their forward and
# backward passes starved each other's DHT and averager processes (lookups of 20-35 s, rounds finding no group); on
# a peer's own machine those have the CPU its training leaves (a GPU peer's is mostly idle).
TRAINING_NICENESS = 10
STALL_FACTOR = 2.0  # an epoch over this many times the median is a stall
KINDS = ("restart", "kill", "leave", "newcomer")  # within one epoch: a peer back before another goes down
POLL_S = 1.0


@dataclasses.dataclass(frozen=True)
class Plan:
    """One run's size and length; ``QUICK`` is a smoke run of a few minutes."""

    peers: int = 16
    epochs: int = 60  # measured global epochs
    hour_epochs: int = HOUR_EPOCHS
    newcomer_every: int = 4
    target_batch_size: int = 1024
    trainer_flags: tuple[str, ...] = ()  # given to every peer after the bench's own (``--trainer_flags``)
    # 0: a newcomer every ``newcomer_every`` epochs (the churn schedule); K > 0: K newcomers at all times, each
    # leaving once productive (``newcomer_verdict``), for many join tries in one run
    joins_in_flight: int = 0
    max_minutes: float = 45.0  # the whole run, start-up included
    seed: int = 0


FULL = Plan()
# Kills at 30 % an hour-equivalent among 6 peers would be 0.45 in 15 epochs: a shorter hour-equivalent makes some.
QUICK = Plan(peers=6, epochs=15, hour_epochs=10, newcomer_every=3, max_minutes=9.0)
# Join tries, many a run: four newcomers at all times in a small swarm (a newcomer's start is the machine's CPU),
# the kills and restarts of the full plan's rate.
JOINS = Plan(peers=6, epochs=200, joins_in_flight=4, max_minutes=50.0)


@dataclasses.dataclass(frozen=True, order=True)
class Action:
    """What the schedule does when the swarm reaches ``epoch`` (counted from the measured window's first)."""

    epoch: int
    order: int  # KINDS' index: restarts, kills, leaves, then arrivals within one epoch
    kind: str
    who: int  # a regular peer's rank, or a newcomer's number


def kills_due(peers: int, epochs: int, hour_epochs: int, kill_rate: float = KILL_RATE) -> int:
    """Kills in ``epochs`` global epochs at ``kill_rate`` of ``peers`` per hour-equivalent, to the nearest."""
    return round(kill_rate * peers * epochs / hour_epochs)


def max_down(peers: int) -> int:
    """Peers the schedule may have down at once: one in eight (two of sixteen), at least one."""
    return max(1, peers // 8)


def churn_schedule(
    seed: int,
    peers: int,
    epochs: int,
    hour_epochs: int = HOUR_EPOCHS,
    newcomer_every: int = 4,
    restart_epochs: int = RESTART_EPOCHS,
    kill_rate: float = KILL_RATE,
    spared: Sequence[int] = (),
) -> list[Action]:
    """The run's kills, restarts, newcomers and their leaving, sorted, from ``random.Random(seed)``.

    ``kills_due`` kills, one at a random epoch of each of as many equal stretches of the run (so the rate holds over
    any part of it, not only the whole), of a random peer not in ``spared`` and up since before that epoch; a kill
    that would put more than ``max_down`` peers down at once, or finds no such peer, moves to the next epoch where
    it does not (and is dropped past the run's end). Each killed peer restarts ``restart_epochs`` later. A newcomer
    arrives every ``newcomer_every`` epochs from the first; the one that arrived ``NEWCOMERS_AT_ONCE`` arrivals
    earlier leaves then.
    """
    if not (peers >= 2 and epochs >= 1 and hour_epochs >= 1 and newcomer_every >= 1 and restart_epochs >= 1):
        raise ValueError(f"a schedule needs 2+ peers and positive epochs, not {peers}, {epochs}, {hour_epochs}")
    rng = random.Random(seed)
    actions: list[Action] = []
    down: list[tuple[int, int, int]] = []  # (kill epoch, restart epoch, rank) of every kill so far
    bound, kills = max_down(peers), kills_due(peers, epochs, hour_epochs, kill_rate)

    def victims(epoch: int) -> list[int]:
        """Peers that may be killed at ``epoch``: up until their restart, and never above the bound meanwhile."""
        span = range(epoch, epoch + restart_epochs)
        if any(sum(kill <= t < back for kill, back, _ in down) >= bound for t in span):
            return []
        # a peer is killed neither while down nor at an epoch it goes down or comes back at
        busy = {rank for kill, back, rank in down if kill <= span.stop and epoch <= back}
        return [rank for rank in range(peers) if rank not in busy and rank not in spared]

    for i in range(kills):
        low, high = i * epochs // kills, (i + 1) * epochs // kills
        wanted = rng.randrange(low, max(high, low + 1))
        epoch = next((e for e in range(wanted, epochs) if victims(e)), None)
        if epoch is None:
            continue
        rank = rng.choice(victims(epoch))
        down.append((epoch, epoch + restart_epochs, rank))
        actions.append(Action(epoch, KINDS.index("kill"), "kill", rank))
        if epoch + restart_epochs < epochs:
            actions.append(Action(epoch + restart_epochs, KINDS.index("restart"), "restart", rank))
    for number, epoch in enumerate(range(0, epochs, newcomer_every)):
        if number >= NEWCOMERS_AT_ONCE:
            actions.append(Action(epoch, KINDS.index("leave"), "leave", number - NEWCOMERS_AT_ONCE))
        actions.append(Action(epoch, KINDS.index("newcomer"), "newcomer", number))
    return sorted(actions)


@dataclasses.dataclass
class PeerRun:
    """One process of one peer, from its start to its end, and what it wrote."""

    name: str
    kind: str  # "initial", "restart" or "newcomer"
    started: float  # Unix time of the launch
    download_mbit: float
    events: list[dict] = dataclasses.field(default_factory=list)
    steps: list[list[float]] = dataclasses.field(default_factory=list)  # bench.probe's [time, samples, epoch after]
    ended: float | None = None  # when it was killed, told to leave, found exited, or the window closed
    ended_by: str | None = None  # "kill", "leave", "exit" (by itself) or "end"


# rounds that carry a peer's samples: gradients (synchronous mode), pseudo-gradients (low-communication mode)
CONTRIBUTING_ROUND_KINDS = ("gradients", "pseudo-gradients")


def weighted_gradient_round(record: dict) -> bool:
    """A gradient or pseudo-gradient round that took this peer's own samples (weight > 0: not catching up), with or
    without groupmates."""
    return (
        record["event"] == "averaged"
        and record["kind"] in CONTRIBUTING_ROUND_KINDS
        and (record.get("weight") or 0) > 0
    )


def own_round(record: dict) -> bool:
    """A ``weighted_gradient_round`` with at least one groupmate."""
    return weighted_gradient_round(record) and (record.get("group_size") or 0) >= 2


def started_epoch(run: PeerRun) -> int | None:
    """The global epoch the run began training at (its ``started`` event), else its first step's."""
    epochs = [record["epoch"] for record in run.events if record["event"] == "started"]
    if epochs:
        return epochs[0]
    return int(run.steps[0][2]) if run.steps else None


def samples_by_epoch(run: PeerRun, first: int, last: int) -> dict[int, int]:
    """Samples the run computed while at each epoch of ``first`` to ``last - 1``, killed runs' partial epochs included.

    A steps record's epoch is the one after its step, so a step belongs to the epoch its previous record ended at.
    """
    epoch, made = started_epoch(run), {}
    for _, samples, after in run.steps:
        if epoch is not None and first <= epoch < last:
            made[epoch] = made.get(epoch, 0) + int(samples)
        epoch = int(after)
    return made


def computed_samples(run: PeerRun, first: int, last: int) -> int:
    """Samples the run computed while at epochs ``first`` to ``last - 1`` (``samples_by_epoch``)."""
    return sum(samples_by_epoch(run, first, last).values())


def alone_round(record: dict) -> bool:
    """A ``weighted_gradient_round`` that found no groupmate: its group was this peer only."""
    return weighted_gradient_round(record) and record.get("group_size") == 1


def contributed_epochs(events: Sequence[dict], which: Callable[[dict], bool] = own_round) -> set[int]:
    """Epochs whose gradient round took this run's own samples (``own_round``; ``which`` picks other rounds). A round
    belongs to the last ``step_begun`` before its all-reduce began (its end minus its ``seconds``): hivemind triggers
    a step's round as the step begins, and the next step's only after waiting for it, so a round that ends after the
    next step began (it outlasted an epoch) still began before it."""
    begun = [record for record in events if record["event"] == "step_begun"]
    epochs = set()
    for record in filter(which, events):
        began = record["time"] - (record.get("seconds") or 0.0)
        steps = [step["epoch"] for step in begun if step["time"] <= began]
        if steps:
            epochs.add(steps[-1])
    return epochs


def applied_samples(run: PeerRun, first: int, last: int) -> int:
    """Samples of epochs ``first`` to ``last - 1`` that reached an applied update: those an ``epoch`` event reports for
    the epoch just before it (not after a jump: a state download dropped them) while in sync (``published``), whose
    gradient round took them (``contributed_epochs``). A peer catching up publishes nothing: its samples count
    nowhere."""
    contributed, epoch, total = contributed_epochs(run.events), started_epoch(run), 0
    for record in run.events:
        if record["event"] != "epoch":
            continue
        ended = epoch
        if ended is not None and record["epoch"] == ended + 1 and first <= ended < last:
            if record["published"] and ended in contributed:
                total += int(record["samples"])
        epoch = record["epoch"]
    return total


SAMPLE_OUTCOMES = ("applied", "alone", "no_round", "unpublished", "dropped_by_download", "unfinished")
# why an epoch's round gave no averages (``no_round_cause``)
NO_ROUND_CAUSES = ("given_up", "timeout", "failed", "no_step", "unexplained")


def epoch_outcomes(run: PeerRun) -> dict[int, str]:
    """The outcome (``SAMPLE_OUTCOMES``) of each epoch the run ended, by epoch: ``applied`` (the epoch ended published
    after an own round), ``alone`` (its gradient round's group was this peer only), ``no_round`` (no round completed:
    it found no group, failed or was given up), ``unpublished`` (the peer was catching up or out of sync),
    ``dropped_by_download`` (a state download moved the peer past the epoch). Epochs it did not end are absent."""
    contributed, alone = contributed_epochs(run.events), contributed_epochs(run.events, alone_round)
    outcome: dict[int, str] = {}
    epoch = started_epoch(run)
    for record in run.events:
        if record["event"] != "epoch":
            continue
        if epoch is not None and epoch not in outcome:
            if record["epoch"] != epoch + 1:
                outcome[epoch] = "dropped_by_download"
            elif not record["published"]:
                outcome[epoch] = "unpublished"
            elif epoch in contributed:
                outcome[epoch] = "applied"
            else:
                outcome[epoch] = "alone" if epoch in alone else "no_round"
        epoch = record["epoch"]
    return outcome


def samples_by_outcome(run: PeerRun, first: int, last: int) -> dict[str, int]:
    """Where the samples the run computed at epochs ``first`` to ``last - 1`` went, by the epoch they were made in
    (``samples_by_epoch``): ``epoch_outcomes``, or ``unfinished`` (the run ended first: killed, left, or the window
    closed)."""
    outcome = epoch_outcomes(run)
    totals = dict.fromkeys(SAMPLE_OUTCOMES, 0)
    for made_at, samples in samples_by_epoch(run, first, last).items():
        totals[outcome.get(made_at, "unfinished")] += samples
    return totals


def no_round_cause(events: Sequence[dict], epoch: int) -> str:
    """Why the gradient round of ``epoch`` gave this run no averages (one of ``NO_ROUND_CAUSES``), from its events:
    ``round_failed`` of that epoch says ``timeout`` (it outlasted averaging_timeout) or another error (``failed``:
    matchmaking or the all-reduce broke), or ``cancelled``, which is ``given_up`` like a ``round_given_up`` between the
    epoch's ``step_begun`` and the next; ``no_step``: the run began no step at that epoch (it moved to the swarm's
    next epoch without its own round); ``unexplained``: a step began and no event says what became of its round."""
    for record in events:
        if record["event"] == "round_failed" and record.get("epoch") == epoch:
            reason = record.get("reason")
            return {"cancelled": "given_up", "timeout": "timeout"}.get(reason, "failed")
    steps = [record["time"] for record in events if record["event"] == "step_begun"]
    begun = [record["time"] for record in events if record["event"] == "step_begun" and record["epoch"] == epoch]
    if not begun:
        return "no_step"
    later = [moment for moment in steps if moment > begun[0]]
    until = later[0] if later else math.inf
    if any(record["event"] == "round_given_up" and begun[0] <= record["time"] < until for record in events):
        return "given_up"
    return "unexplained"


def samples_without_round(run: PeerRun, first: int, last: int) -> dict[str, int]:
    """The run's ``no_round`` samples of epochs ``first`` to ``last - 1`` by ``no_round_cause``."""
    outcome = epoch_outcomes(run)
    totals = dict.fromkeys(NO_ROUND_CAUSES, 0)
    for made_at, samples in samples_by_epoch(run, first, last).items():
        if outcome.get(made_at) == "no_round":
            totals[no_round_cause(run.events, made_at)] += samples
    return totals


def round_completeness(runs: Sequence[PeerRun]) -> dict:
    """How complete the gradient rounds with groupmates were, over every peer's ``own_round``s that report their size
    (``values``): the median share of values averaged (not kept local because their reducer failed), and the share
    of rounds where nothing was kept local and no sender was dropped. A round counts toward goodput however partial
    it was: these say how much of it was averaged."""
    rounds = [record for run in runs for record in run.events if own_round(record) and record.get("values")]
    if not rounds:
        return {"values_averaged_median": None, "complete_rounds": None}
    averaged = [1.0 - record["values_kept_local"] / record["values"] for record in rounds]
    complete = sum(record["values_kept_local"] == 0 and record["senders_dropped"] == 0 for record in rounds)
    return {"values_averaged_median": statistics.median(averaged), "complete_rounds": complete / len(rounds)}


def goodput(runs: Sequence[PeerRun], first: int, last: int) -> float | None:
    """Applied samples over computed samples of every run, over epochs ``first`` to ``last - 1``."""
    computed = sum(computed_samples(run, first, last) for run in runs)
    return sum(applied_samples(run, first, last) for run in runs) / computed if computed else None


def epoch_starts(runs: Sequence[PeerRun]) -> dict[int, float]:
    """Each global epoch's start: the first time any peer's ``epoch`` event reached it."""
    starts: dict[int, float] = {}
    for run in runs:
        for record in run.events:
            if record["event"] == "epoch":
                starts[record["epoch"]] = min(starts.get(record["epoch"], math.inf), record["time"])
    return starts


def epoch_durations(starts: dict[int, float], first: int, last: int) -> list[float]:
    """Seconds of epochs ``first`` to ``last - 1``, each from its start to the next one's (where both are known)."""
    return [starts[e + 1] - starts[e] for e in range(first, last) if e in starts and e + 1 in starts]


def truncated_window_end(planned: int | None, reached: int) -> int:
    """The end (exclusive) of the measured window of a run stopped early once the swarm reached global epoch
    ``reached``: its last epoch has ``SETTLE_EPOCHS`` after it, as in a whole run. Cut at ``reached``, the rounds of
    the epoch just before it were still running at the stop and counted as lost
    (docs/benchmarks/2026-12-07-amd-epyc-2core-swarm-round-timeouts.md)."""
    return min(planned if planned is not None else reached, reached - SETTLE_EPOCHS)


def stall_count(durations: Sequence[float]) -> int:
    """Epochs that took over ``STALL_FACTOR`` times the median epoch."""
    if not durations:
        return 0
    median = statistics.median(durations)
    return sum(duration > STALL_FACTOR * median for duration in durations)


def first_contribution(run: PeerRun) -> float | None:
    """When the run's first ``own_round`` ended: it became productive."""
    return min((record["time"] for record in run.events if own_round(record)), default=None)


def loaded_bytes(run: PeerRun) -> int | None:
    """The state's bytes from the run's first ``state_loaded`` event; None where it downloaded none."""
    return next((record["bytes"] for record in run.events if record["event"] == "state_loaded"), None)


def fair_chance_s(bound_s: float, epoch_s: float = 0.0) -> float:
    """How long a join must have run before a failure to become productive counts against it, in a swarm whose median
    epoch lasts ``epoch_s`` (0: not known yet)."""
    return JOIN_GOAL * bound_s + max(STARTUP_ALLOWANCE_S, EPOCHS_TO_A_FIRST_ROUND * epoch_s)


def joined_at(run: PeerRun) -> float:
    """When the run's ``joined`` event came (its DHT up, asking for the state), or its launch where it wrote none."""
    return next((record["time"] for record in run.events if record["event"] == "joined"), run.started)


def fair_chance_ends(run: PeerRun, state_bytes: int | None, epoch_s: float = 0.0) -> float:
    """When (Unix time) the join's fair chance ends: ``fair_chance_s`` of its own state's download bound, or of the
    swarm's ``state_bytes`` for a run that has not downloaded one, from its ``joined_at``: the Python start-up before
    it is the host's CPU (70-90 s on two cores running 17 peers), not the join's, as for ``join_seconds_vs_bound``."""
    size = loaded_bytes(run) or state_bytes
    return joined_at(run) + fair_chance_s(transfer_bound_s(size, run.download_mbit) if size else 0.0, epoch_s)


def join_outcome(run: PeerRun, state_bytes: int | None, grace_s: float = 0.0, epoch_s: float = 0.0) -> bool | None:
    """True when the join became productive, False when it did not though it had a fair chance and ``grace_s`` more
    (or exited by itself), None when the schedule or the run's end stopped it before (it counts neither way).
    ``state_bytes`` is the swarm's state size, for a run that died before its own download ended; ``grace_s`` is the
    plan's wait past the fair chance before it gives a join up (``GIVE_UP_AFTER_S`` with ``--joins_in_flight``);
    ``epoch_s`` the swarm's median epoch (``fair_chance_s``)."""
    if first_contribution(run) is not None:
        return True
    if run.ended_by == "exit":
        return False
    ended = run.ended if run.ended is not None else math.inf
    return None if ended < fair_chance_ends(run, state_bytes, epoch_s) + grace_s else False


def newcomer_verdict(run: PeerRun, state_bytes: int | None, now: float, epoch_s: float = 0.0) -> str | None:
    """What becomes of a live newcomer under ``--joins_in_flight``: its ``join_outcome`` were it ended ``now`` with
    the plan's grace, ``GIVE_UP_AFTER_S``: "productive" once it had an own round, "gave up" once that grace is over
    without one (it leaves either way), None meanwhile."""
    outcome = join_outcome(dataclasses.replace(run, ended=now), state_bytes, GIVE_UP_AFTER_S, epoch_s)
    return None if outcome is None else "productive" if outcome else "gave up"


def newcomer_slots(plan: Plan) -> int:
    """Namespaces for newcomers: the schedule's live ones and one for a leaver still shutting down, or, with
    ``joins_in_flight``, as many for leavers as for the live ones (several may leave at once)."""
    return max(NEWCOMERS_AT_ONCE + 1, 2 * plan.joins_in_flight)


def free_slot(slots: int, held: Sequence[int], leaving: Sequence[int]) -> int:
    """The newcomer slot (0 to ``slots - 1``) for the next newcomer: none of the live newcomers' (``held``), without a
    leaver if one is, else the slot of the earliest of ``leaving`` (the leavers' slots, in the order they left)."""
    free = [slot for slot in range(slots) if slot not in held]
    empty = [slot for slot in free if slot not in leaving]
    if empty:
        return empty[0]
    return min(free, key=list(leaving).index)


def join_seconds_vs_bound(run: PeerRun) -> float | None:
    """A productive join's time from its ``joined`` event (its DHT is up and it asks for the state; the process's
    start when it wrote none) to its first own round, over its state download's bound: the state's bytes on the
    wire (``STATE_WIRE_FRACTION`` of ``state_loaded``'s) through its download link. None where it downloaded
    nothing or never became productive."""
    productive, size = first_contribution(run), loaded_bytes(run)
    if productive is None or not size:
        return None
    return (productive - joined_at(run)) / transfer_bound_s(size * STATE_WIRE_FRACTION, run.download_mbit)


def join_phases(run: PeerRun) -> dict[str, float]:
    """Where a join's time went, in seconds: from its start to its ``joined`` event (the process's start and the
    DHT's), its download (``state_loaded``'s ``seconds``), and from its ``started`` event to its first own round."""
    first = {}
    for record in run.events:
        first.setdefault(record["event"], record)
    phases = {}
    if "joined" in first:
        phases["start_to_joined"] = first["joined"]["time"] - run.started
    if "state_loaded" in first:
        phases["download"] = first["state_loaded"]["seconds"]
    productive = first_contribution(run)
    if "started" in first and productive is not None:
        phases["started_to_round"] = productive - first["started"]["time"]
    return phases


def leaves_saved(runs: Sequence[PeerRun]) -> tuple[int, int]:
    """Of the peers told to leave (SIGTERM) that wrote their ``shutdown`` event, how many saved their final state,
    and how many there were: the others passed their shutdown deadline and were forced out."""
    last_shutdowns = [
        next((record for record in reversed(run.events) if record["event"] == "shutdown"), None)
        for run in runs
        if run.ended_by == "leave"
    ]
    found = [record for record in last_shutdowns if record is not None]
    return sum(bool(record["saved"]) for record in found), len(found)


def summarize(runs: Sequence[PeerRun], first: int, last: int, grace_s: float = 0.0) -> dict:
    """The figures of one run over the measured epochs ``first`` to ``last - 1``; joins are the runs that are not
    the initial peers, judged by ``join_outcome`` with ``grace_s``."""
    sizes = [size for size in map(loaded_bytes, runs) if size]
    state_bytes = int(statistics.median(sizes)) if sizes else None
    joins = [run for run in runs if run.kind != "initial"]
    durations = epoch_durations(epoch_starts(runs), first, last)
    epoch_s = statistics.median(durations) if durations else 0.0
    outcomes = [join_outcome(run, state_bytes, grace_s, epoch_s) for run in joins]
    ratios = sorted(r for r in map(join_seconds_vs_bound, joins) if r is not None)
    computed = sum(computed_samples(run, first, last) for run in runs)
    applied = sum(applied_samples(run, first, last) for run in runs)
    tried = sum(outcome is not None for outcome in outcomes)
    phases = [join_phases(run) for run, outcome in zip(joins, outcomes, strict=True) if outcome]
    names = ("start_to_joined", "download", "started_to_round")
    values = {name: [phase[name] for phase in phases if name in phase] for name in names}
    medians = {name: statistics.median(found) if found else None for name, found in values.items()}
    productive = sum(outcome is True for outcome in outcomes)
    saved, shut_down = leaves_saved(runs)
    by_outcome, by_cause = dict.fromkeys(SAMPLE_OUTCOMES, 0), dict.fromkeys(NO_ROUND_CAUSES, 0)
    for run in runs:
        for name, samples in samples_by_outcome(run, first, last).items():
            by_outcome[name] += samples
        for name, samples in samples_without_round(run, first, last).items():
            by_cause[name] += samples
    return {
        "goodput": applied / computed if computed else None,
        "join_success": productive / tried if tried else None,
        "join_tries": tried,
        "join_productive": productive,
        "joins_without_fair_chance": sum(outcome is None for outcome in outcomes),
        "join_seconds_vs_bound": statistics.median(ratios) if ratios else None,
        "join_seconds_vs_bound_max": ratios[-1] if ratios else None,
        "join_phases_median_s": medians,
        "stalls": stall_count(durations),
        "epoch_median_s": epoch_s if durations else None,
        "epoch_max_s": max(durations, default=None),
        "epochs_measured": len(durations),
        "samples_computed": computed,
        "samples_applied": applied,
        "samples_by_outcome": {name: samples / computed for name, samples in by_outcome.items()} if computed else None,
        "no_round_by_cause": {name: samples / computed for name, samples in by_cause.items()} if computed else None,
        **round_completeness(runs),
        "leaves_saved": saved,
        "leaves_shut_down": shut_down,
        "state_bytes": state_bytes,
    }


def history_totals(records: Sequence[dict]) -> dict:
    """Runs, join tries and productive joins added up over ``--history``'s records, and their ratio."""
    tried = sum(record.get("join_tries") or 0 for record in records)
    productive = sum(record.get("join_productive") or 0 for record in records)
    return {
        "history_runs": len(records),
        "history_join_tries": tried,
        "history_join_productive": productive,
        "history_join_success": productive / tried if tried else None,
    }


def link_rate(index: int) -> tuple[float, float]:
    """The ``index``-th peer's (upload, download) Mbit/s: ``LINK_RATES`` in turn."""
    return LINK_RATES[index % len(LINK_RATES)]


class EventTail:
    """A growing events file read incrementally: complete lines only, each parsed once."""

    def __init__(self, path: Path):
        self.path, self.offset, self.records = Path(path), 0, []

    def read(self) -> list[dict]:
        """The records added since the last read (all are kept in ``records``)."""
        try:
            with open(self.path, "rb") as file:
                file.seek(self.offset)
                data = file.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1  # a last line still being written is read next time
        self.offset += end
        text = data[:end].decode("ascii", errors="replace")
        new = [json.loads(line) for line in text.split("\n") if line.strip()]
        self.records.extend(new)
        return new


def read_steps(path: Path) -> list[list[float]]:
    """bench.probe's records; a last line cut short by a SIGKILL is left out."""
    records = []
    for line in Path(path).read_text().splitlines() if Path(path).exists() else []:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return records


class RunDeadline(Exception):
    """The run's own deadline (``--max_minutes``) passed."""


class SwarmNotFormed(Exception):
    """A peer exited before every initial peer was training: nothing would be measured (a bad flag, missing data)."""


def last_line(text: str) -> str:
    """The last line of a log that says something, for a one-line report."""
    return next((line.strip() for line in reversed(text.splitlines()) if line.strip()), "(empty log)")


def split_key(key: str) -> tuple[str, int]:
    """``"peer3"`` -> ``("peer", 3)``, ``"new5"`` -> ``("new", 5)``."""
    kind = "peer" if key.startswith("peer") else "new"
    return kind, int(key[len(kind) :])


class Swarm:
    """The peers of one run: regular peers ``peerR`` (namespace ``1 + R``), newcomers ``newN`` (namespace ``1 + peers
    + slot``, ``free_slot``), every process recorded as a PeerRun as it starts; ``tick`` keeps the books, and keeps
    ``plan.joins_in_flight`` newcomers live once ``joining`` is set."""

    def __init__(self, network: HubNetwork, plan: Plan, log_dir: Path, prefix: str, join: list[str], deadline: float):
        self.network, self.plan, self.log_dir, self.prefix, self.join = network, plan, log_dir, prefix, join
        self.deadline = deadline  # time.monotonic() of the run's end
        self.began = time.monotonic()
        self.processes: list[LocalProcess] = []  # every process started: children()'s list, which stops them
        self.live: dict[str, tuple[LocalProcess, PeerRun, EventTail]] = {}
        self.leaving: dict[str, LocalProcess] = {}  # newcomers told to leave, maybe still shutting down
        self.runs: list[PeerRun] = []
        self.files: dict[str, tuple[Path, Path]] = {}  # run name -> its events and steps files
        self.epoch = -1  # the swarm's global epoch: the highest any peer reached
        self.epoch_starts: dict[int, float] = {}  # global epoch -> when a peer first reached it (its event's time)
        self.pending_restarts: dict[int, int] = {}  # rank -> global epoch: regular peers that exited by themselves
        self.counts = {"kills": 0, "restarts": 0, "newcomers": 0, "leaves": 0, "exits": 0, "gave_up": 0}
        self.slots: dict[str, int] = {}  # newcomer -> its slot
        self.state_bytes: int | None = None  # the first downloaded state's size, for a newcomer's fair chance
        self.joining = False  # keep plan.joins_in_flight newcomers live
        self.formed = False  # every initial peer trains: from now on an exit is churn, before it a failed start
        self.progress: Callable[[str], None] = lambda line: None

    def namespace(self, key: str) -> int:
        kind, number = split_key(key)
        return 1 + number if kind == "peer" else 1 + self.plan.peers + self.slots[key]

    def arrive(self, key: str) -> None:
        """Start newcomer ``key`` in a ``free_slot``, killing a leaver still shutting down there."""
        held = [self.slots[other] for other in self.live if other in self.slots]
        leaving = [self.slots[other] for other, process in self.leaving.items() if process.running()]
        self.slots[key] = free_slot(newcomer_slots(self.plan), held, leaving)
        self.free_namespace(self.namespace(key))
        self.start(key, "newcomer")
        self.counts["newcomers"] += 1

    def start(self, key: str, kind: str) -> None:
        """Start peer ``key`` in its namespace as a new run of kind ``kind``."""
        number, index = split_key(key)[1], self.namespace(key)
        upload, download = link_rate(number)
        if kind == "newcomer":
            self.network.set_peer_rate(index, upload, download)  # the newcomers' slots take every speed in turn
        name = f"{key}.{sum(run.name.startswith(key + '.') for run in self.runs)}"
        steps, events = self.log_dir / f"{name}.steps.jsonl", self.log_dir / f"{name}.events.jsonl"
        output = self.log_dir / f"{name}.out"
        steps.unlink(missing_ok=True)
        shutil.rmtree(output, ignore_errors=True)  # a newcomer has nothing on disk
        flags = [
            *("--experiment_prefix", self.prefix, "--target_batch_size", str(self.plan.target_batch_size)),
            *("--host_maddrs", f"/ip4/{self.network.peers[index].address}/tcp/0", *self.join),
            *("--identity_path", str(self.log_dir / f"{key}.key"), "--output_dir", str(output)),
            *("--bandwidth", f"{upload:g}"),
            *self.plan.trainer_flags,
        ]
        slowdown = SLOWDOWN if key == f"peer{self.plan.peers - 1}" else 1.0
        run = PeerRun(name, kind, time.time(), download)
        process = Child(
            "bench.swarm",
            ["peer", steps, slowdown, *flags],
            self.log_dir / f"{name}.log",
            self.deadline - time.monotonic() + 120,
            env=ONE_THREAD,
            netns=self.network.peers[index].netns,
            events_path=events,
        )
        self.processes.append(process)
        self.runs.append(run)
        self.files[name] = (events, steps)
        self.live[key] = (process, run, EventTail(events))

    def end(self, key: str, how: str) -> None:
        """``key``'s run ends now (``how``): a kill is a SIGKILL of its processes (``LocalProcess.crash``), a leave a
        SIGTERM (a clean shutdown), the end of the window a SIGKILL."""
        process, run, _ = self.live.pop(key)
        run.ended, run.ended_by = time.time(), how
        if how == "kill":
            process.crash()
        elif how == "leave":
            process.process.send_signal(signal.SIGTERM)
            self.leaving[key] = process
        elif how == "end":
            process.kill()

    def say(self, what: str) -> None:
        """A progress line: the run's seconds, the swarm's epoch, ``what`` happened."""
        self.progress(f"[{time.monotonic() - self.began:5.0f} s] epoch {self.epoch}: {what}")

    def do(self, action: Action) -> None:
        """Carry out one action of the schedule (a kill of a peer that is down already does nothing)."""
        key = f"{'new' if action.kind in ('leave', 'newcomer') else 'peer'}{action.who}"
        if action.kind == "kill" and key in self.live:
            self.end(key, "kill")
            self.counts["kills"] += 1
        elif action.kind == "restart" and key not in self.live:
            self.pending_restarts.pop(action.who, None)
            self.start(key, "restart")
            self.counts["restarts"] += 1
        elif action.kind == "leave" and key in self.live:
            self.end(key, "leave")
            self.counts["leaves"] += 1
        elif action.kind == "newcomer":
            self.arrive(key)
        else:
            return
        self.say(f"{action.kind} {key}")

    def keep_joining(self) -> None:
        """``plan.joins_in_flight``: newcomers with a verdict (``newcomer_verdict``) leave, and new ones arrive in
        their place."""
        for key in [key for key in self.live if key in self.slots]:
            process, run, tail = self.live[key]
            run_now = dataclasses.replace(run, events=tail.records)
            verdict = newcomer_verdict(run_now, self.state_bytes, time.time(), self.epoch_median_s())
            if verdict is not None:
                self.end(key, "leave")
                self.counts["leaves"] += 1
                self.counts["gave_up"] += verdict == "gave up"
                self.say(f"{key} {verdict}, left")
        while sum(key in self.slots for key in self.live) < self.plan.joins_in_flight:
            key = f"new{self.counts['newcomers']}"
            self.arrive(key)
            self.say(f"newcomer {key}")

    def epoch_median_s(self) -> float:
        """The median of the global epochs seen so far (0 before two have begun): a newcomer's fair chance is sized
        by it during the run as ``summarize`` sizes it at the end."""
        durations = epoch_durations(self.epoch_starts, min(self.epoch_starts, default=0), self.epoch)
        return statistics.median(durations) if durations else 0.0

    def free_namespace(self, index: int) -> None:
        """SIGKILL a leaver still shutting down in namespace ``index``: its slot is wanted."""
        for key, process in list(self.leaving.items()):
            if self.namespace(key) == index:
                process.kill()
                del self.leaving[key]

    def tick(self) -> None:
        """Read the new events, note processes that exited by themselves (a regular peer then restarts
        ``RESTART_EPOCHS`` later), start the restarts due; RunDeadline once the run's deadline passed."""
        for key, (process, _, tail) in list(self.live.items()):
            for record in tail.read():
                if record["event"] == "epoch":
                    self.epoch = max(self.epoch, record["epoch"])
                    started = self.epoch_starts.get(record["epoch"], math.inf)
                    self.epoch_starts[record["epoch"]] = min(started, record["time"])
                if record["event"] == "state_loaded" and self.state_bytes is None:
                    self.state_bytes = record["bytes"]
            if not process.running():
                if not self.formed:
                    said, code = last_line(process.log()), process.process.returncode
                    raise SwarmNotFormed(f"{key} exited ({code}) before the swarm formed: {said} ({process.log_path})")
                self.end(key, "exit")
                self.counts["exits"] += 1
                kind, number = split_key(key)
                if kind == "peer":
                    self.pending_restarts[number] = self.epoch + RESTART_EPOCHS
        for rank, due in list(self.pending_restarts.items()):
            if self.epoch >= due and f"peer{rank}" not in self.live:
                del self.pending_restarts[rank]
                self.start(f"peer{rank}", "restart")
                self.counts["restarts"] += 1
        if self.joining:
            self.keep_joining()
        if time.monotonic() > self.deadline:
            raise RunDeadline(f"the run's deadline passed at global epoch {self.epoch}")

    def wait(self, condition: Callable[[], bool], seconds: float, what: str) -> None:
        """Tick until ``condition()`` holds; TimeoutError once ``seconds`` pass without it and without a new global
        epoch: a swarm that moves on is not stalled, however far off the epoch waited for (the run's deadline bounds
        the whole)."""
        epoch, until = self.epoch, time.monotonic() + seconds
        while True:
            self.tick()
            if condition():
                return
            if self.epoch != epoch:
                epoch, until = self.epoch, time.monotonic() + seconds
            if time.monotonic() > until:
                raise TimeoutError(f"{seconds:.0f} s without a new global epoch (at {self.epoch}) waiting for {what}")
            time.sleep(POLL_S)

    def has(self, key: str, event: str) -> bool:
        """Whether ``key``'s live run wrote ``event``."""
        return key in self.live and any(record["event"] == event for record in self.live[key][2].records)

    def finish(self) -> None:
        """Close the window: every process is killed, every live run ended by the end; then every run's files are
        read in full."""
        for key in list(self.live):
            self.end(key, "end")
        for process in self.leaving.values():
            process.kill()
        for run in self.runs:
            events, steps = self.files[run.name]
            run.events, run.steps = read_events(events), read_steps(steps)


def run(plan: Plan, log_dir: Path, progress: Callable[[str], None]) -> dict:
    """Form the swarm, run the schedule over ``plan.epochs`` measured epochs, and return the figures."""
    log_dir.mkdir(parents=True, exist_ok=True)
    for pattern in ("peer*", "new*", "monitor.*", "metrics.jsonl"):  # an earlier run's files and identities
        for path in log_dir.glob(pattern):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    slow = plan.peers - 1
    schedule = churn_schedule(
        plan.seed, plan.peers, plan.epochs, plan.hour_epochs, plan.newcomer_every, spared=(slow,)
    )
    if plan.joins_in_flight:  # newcomers come and go by keep_joining instead
        schedule = [action for action in schedule if action.kind in ("kill", "restart")]
    began = time.monotonic()
    deadline = began + plan.max_minutes * 60
    prefix = f"swarm{int(time.time())}"
    first = last = truncated = None
    namespaces = 1 + plan.peers + newcomer_slots(plan)
    with hub_network(namespaces, FAST_MBIT, FAST_MBIT, prefix="swarm", subnet="10.80.0") as net:
        with children() as started:
            monitor = Child(
                "run_training_monitor",
                [
                    *("--experiment_prefix", prefix, "--host_maddrs", f"/ip4/{net.peers[0].address}/tcp/0"),
                    *("--refresh_period", "5", "--metrics_path", log_dir / "metrics.jsonl"),
                ],
                log_dir / "monitor.log",
                plan.max_minutes * 60 + 120,
                env=ONE_THREAD,
                netns=net.peers[0].netns,
                events_path=log_dir / "monitor.events.jsonl",
            )
            started.append(monitor)
            swarm = Swarm(net, plan, log_dir, prefix, monitor.join_flags(180), deadline)
            swarm.processes = started  # stopped when the block ends, however it ends
            swarm.progress = progress
            try:
                swarm.start("peer0", "initial")
                swarm.wait(lambda: swarm.has("peer0", "started"), 300, "the first peer to start training")
                progress("the first peer trains; the others join")
                for rank in range(1, plan.peers):
                    swarm.start(f"peer{rank}", "initial")
                everyone = [f"peer{rank}" for rank in range(plan.peers)]
                swarm.wait(lambda: all(swarm.has(key, "started") for key in everyone), 900, "every peer training")
                swarm.formed = True
                for rank in range(plan.peers):
                    net.set_peer_rate(1 + rank, *link_rate(rank))
                first = max(swarm.epoch, 0) + WARMUP_EPOCHS  # -1: no global step yet
                progress(f"the swarm formed at epoch {swarm.epoch}, links shaped; measuring from epoch {first}")
                swarm.wait(lambda: swarm.epoch >= first, 600, f"global epoch {first}")
                swarm.joining = plan.joins_in_flight > 0
                for action in schedule:
                    target = first + action.epoch
                    swarm.wait(lambda target=target: swarm.epoch >= target, 600, f"global epoch {target}")
                    swarm.do(action)
                last = first + plan.epochs
                swarm.wait(lambda: swarm.epoch >= last, 600, f"global epoch {last}")
                swarm.joining = False  # a join begun now would end with the run, before its fair chance
                swarm.wait(lambda: swarm.epoch >= last + SETTLE_EPOCHS, 600, f"global epoch {last + SETTLE_EPOCHS}")
            except (RunDeadline, TimeoutError) as e:
                truncated = str(e)
                progress(f"stopped early: {e}")
                if first is not None:
                    last = truncated_window_end(last, swarm.epoch)
            swarm.finish()
            monitor_alive = monitor.running()
    grace = GIVE_UP_AFTER_S if plan.joins_in_flight else 0.0  # the run's end judges a join as the plan would
    measured = first is not None and last is not None and last > first
    figures = summarize(swarm.runs, first, last, grace) if measured else {}
    return {
        **figures,
        "peers": plan.peers,
        **swarm.counts,
        "epochs": plan.epochs,
        "first_epoch": first,
        "last_epoch": last,
        "wall_s": time.monotonic() - began,
        "hour_epochs": plan.hour_epochs,
        "kill_rate_per_hour": KILL_RATE,
        "newcomer_every": plan.newcomer_every,
        "joins_in_flight": plan.joins_in_flight,
        "slowdown": SLOWDOWN,
        "slow_peer": f"peer{slow}",
        "link_rates_mbit": [list(rate) for rate in LINK_RATES],
        "target_batch_size": plan.target_batch_size,
        "trainer_flags": " ".join(plan.trainer_flags),
        "seed": plan.seed,
        "monitor_alive": monitor_alive,
        "truncated": truncated,
    }


def slow_down(factor: float) -> None:
    """Make this process's training ``factor`` times slower: after each ``hivemind.Optimizer.step``, sleep
    ``factor - 1`` times the time since the previous step returned (the forward and backward; the step itself, which
    may wait for a round or a download, is not stretched)."""
    import hivemind

    original = hivemind.Optimizer.step
    returned: list[float] = []

    def step(self, *args, **kwargs):
        called = time.monotonic()
        result = original(self, *args, **kwargs)
        if returned:
            time.sleep((factor - 1) * (called - returned[-1]))
        returned[:] = [time.monotonic()]
        return result

    hivemind.Optimizer.step = step


def lower_training_priority(niceness: int = TRAINING_NICENESS) -> None:
    """From its first ``hivemind.Optimizer.step`` on, run the thread that trains at ``niceness`` (Linux nices each
    thread): the DHT, averager and tracker processes and threads, started before it, keep theirs."""
    import hivemind

    original = hivemind.Optimizer.step
    lowered: set[int] = set()

    def step(self, *args, **kwargs):
        thread = threading.get_native_id()
        if thread not in lowered:
            os.setpriority(os.PRIO_PROCESS, thread, niceness)
            lowered.add(thread)
        return original(self, *args, **kwargs)

    hivemind.Optimizer.step = step


def run_peer(argv: Sequence[str]) -> int:
    """``python -m bench.swarm peer STEPS.jsonl FACTOR [trainer flags]``: bench.probe's peer, FACTOR times slower,
    training at ``TRAINING_NICENESS``."""
    from bench.probe import instrument

    instrument(argv[0])
    if float(argv[1]) != 1.0:
        slow_down(float(argv[1]))
    lower_training_priority()
    import run_trainer

    return run_trainer.main(list(argv[2:]))


def report_lines(figures: dict, totals: dict) -> list[str]:
    """The human lines: each figure beside its goal, then the counts."""
    lines = []
    for name, goal in GOALS.items():
        value = figures.get(name)
        shown = "n/a" if value is None else f"{value:.4g}"
        sign = ">=" if name in ("goodput", "join_success") else "<="
        lines.append(f"{name}: {shown} (goal {sign} {goal})")
    lines.append(
        f"joins: {figures.get('join_productive')} of {figures.get('join_tries')} productive "
        f"({figures.get('joins_without_fair_chance')} stopped before a fair chance); across "
        f"{totals['history_runs']} runs: {totals['history_join_productive']} of {totals['history_join_tries']}"
    )
    phases = figures.get("join_phases_median_s") or {}
    lines.append(
        "a productive join's median seconds: "
        + ", ".join(f"{name} {'n/a' if value is None else f'{value:.1f}'}" for name, value in phases.items())
        + f"; epochs: median {figures.get('epoch_median_s') or 0:.1f} s, max {figures.get('epoch_max_s') or 0:.1f} s"
    )
    shares = figures.get("samples_by_outcome") or {}
    lines.append(
        "where the computed samples went: " + ", ".join(f"{name} {share:.1%}" for name, share in shares.items())
    )
    causes = figures.get("no_round_by_cause") or {}
    if causes:
        lines.append("no_round by cause: " + ", ".join(f"{name} {share:.1%}" for name, share in causes.items()))
    if figures.get("complete_rounds") is not None:
        lines.append(
            f"gradient rounds with groupmates: {figures['values_averaged_median']:.1%} of the values averaged at the "
            f"median, {figures['complete_rounds']:.1%} complete (nothing kept local, no sender dropped)"
        )
    if figures.get("leaves_shut_down"):
        lines.append(
            f"leaves that saved their final state: {figures['leaves_saved']} of {figures['leaves_shut_down']} (the "
            "others passed their shutdown deadline)"
        )
    counts = ("peers", "kills", "restarts", "newcomers", "leaves", "gave_up", "exits", "epochs", "hour_epochs")
    lines.append(", ".join(f"{name} {figures.get(name)}" for name in counts) + f", wall {figures['wall_s']:.0f} s")
    return lines


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["peer"]:
        return run_peer(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m bench.swarm", description=__doc__.split("\n\n")[0])
    presets = parser.add_mutually_exclusive_group()
    presets.add_argument("--quick", action="store_true", help="a smoke run: 6 peers, 15 epochs, a few minutes")
    presets.add_argument(
        "--joins", action="store_true", help="join tries: 6 peers and 4 newcomers at all times, under an hour"
    )
    for name, what in (
        ("peers", "regular peers"),
        ("epochs", "measured global epochs"),
        ("hour_epochs", "global epochs in an hour-equivalent"),
        ("newcomer_every", "epochs between newcomers"),
        ("joins_in_flight", "newcomers live at all times, each leaving once productive (0: one every newcomer_every)"),
        ("target_batch_size", "samples per global epoch"),
        ("max_minutes", "the whole run's deadline, start-up included"),
    ):
        default, quick, joins = getattr(FULL, name), getattr(QUICK, name), getattr(JOINS, name)
        kind = float if isinstance(default, float) else int
        shown = f"default {default:g}, quick {quick:g}, joins {joins:g}"
        parser.add_argument(f"--{name}", type=kind, help=f"{what} ({shown})")
    parser.add_argument("--seed", type=int, help="the churn schedule's seed (default: the time)")
    parser.add_argument(
        "--trainer_flags", default="", help='more run_trainer.py flags for every peer, e.g. "--matchmaking_time 10"'
    )
    parser.add_argument("--log_dir", type=Path, default=Path("outputs/bench/swarm"), help="every process's log")
    parser.add_argument(
        "--history", type=Path, default=Path("outputs/bench/swarm_history.jsonl"), help="join counts of every run"
    )
    args = parser.parse_args(argv)
    plan = JOINS if args.joins else QUICK if args.quick else FULL
    chosen = {field.name: getattr(args, field.name) for field in dataclasses.fields(Plan)}
    chosen["trainer_flags"] = tuple(shlex.split(args.trainer_flags))  # one string on the command line
    plan = dataclasses.replace(plan, **{key: value for key, value in chosen.items() if value is not None})
    if args.seed is None:
        plan = dataclasses.replace(plan, seed=int(time.time()))
    if plan.peers < 4 or plan.epochs < 2:
        parser.error("--peers must be 4 or more and --epochs 2 or more")
    if min(plan.hour_epochs, plan.newcomer_every, plan.target_batch_size, plan.max_minutes) <= 0:
        parser.error("--hour_epochs, --newcomer_every, --target_batch_size and --max_minutes must be positive")
    if not 0 <= plan.joins_in_flight <= MAX_JOINS_IN_FLIGHT:
        parser.error(f"--joins_in_flight must be 0 to {MAX_JOINS_IN_FLIGHT}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the clean-ups: children, network namespaces

    def progress(line: str) -> None:
        print(line, flush=True)

    if os.geteuid() != 0 or shutil.which("ip") is None:
        print("network namespaces need root and iproute2's `ip`: not measured")
        print(json.dumps({"skipped": "network namespaces need root and iproute2"}))
        return 0
    try:
        figures = run(plan, args.log_dir, progress)
    except NamespacesUnavailable as e:
        print(f"not measured: {e}")
        print(json.dumps({"skipped": str(e)}))
        return 0
    except SwarmNotFormed as e:
        print(f"python -m bench.swarm: {e}", file=sys.stderr)
        return 1
    args.history.parent.mkdir(parents=True, exist_ok=True)
    kept = ("join_tries", "join_productive", "goodput", "stalls", "peers", "joins_in_flight")
    record = {key: figures.get(key) for key in kept}
    with open(args.history, "a") as file:
        file.write(json.dumps({"time": time.time(), "seed": plan.seed, "quick": args.quick, **record}) + "\n")
    totals = history_totals(read_json_lines(args.history))
    for line in report_lines(figures, totals):
        print(line)
    print(json.dumps(rounded({**figures, **totals})))
    return 0


if __name__ == "__main__":
    sys.exit(main())
