"""bench.swarm without processes: the churn schedule and the figures, on events written by hand."""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time

import pytest

from bench import swarm
from bench.swarm import (
    NO_ROUND_CAUSES,
    Action,
    EventTail,
    PeerRun,
    applied_samples,
    churn_schedule,
    computed_samples,
    contributed_epochs,
    epoch_durations,
    epoch_starts,
    free_slot,
    goodput,
    history_totals,
    join_outcome,
    join_phases,
    join_seconds_vs_bound,
    kills_due,
    leaves_saved,
    newcomer_verdict,
    no_round_cause,
    own_round,
    read_steps,
    samples_by_outcome,
    samples_without_round,
    stall_count,
    summarize,
)
from trainer.local import LocalProcess


def test_kills_due_are_30_percent_of_the_peers_per_hour_equivalent():
    assert kills_due(16, 60, 60) == 5  # 0.3 x 16 = 4.8 an hour
    assert kills_due(16, 600, 60) == 48  # ten hours
    assert kills_due(6, 15, 10) == 3  # --quick: 0.3 x 6 x 1.5 = 2.7


def test_schedule_worked_out_by_hand():
    # Two peers, peer 1 spared, so every kill is of peer 0 and one may be down at once; 0.3 x 2 x 10 = 6 kills due,
    # one in each of the stretches [0,1) [1,3) [3,5) [5,6) [6,8) [8,10). Peer 0 cannot be killed again until the
    # epoch after it is back: kills at 0, 3 (not 1 or 2), 6, 9; the fifth and sixth find no epoch left. Newcomers
    # at 0, 4 and 8, when the first leaves.
    actions = churn_schedule(seed=7, peers=2, epochs=10, hour_epochs=1, newcomer_every=4, spared=(1,))
    assert [(a.epoch, a.kind, a.who) for a in actions] == [
        (0, "kill", 0),
        (0, "newcomer", 0),
        (2, "restart", 0),
        (3, "kill", 0),
        (4, "newcomer", 1),
        (5, "restart", 0),
        (6, "kill", 0),
        (8, "restart", 0),
        (8, "leave", 0),
        (8, "newcomer", 2),
        (9, "kill", 0),  # back at 11, after the run
    ]


def replay(actions: list[Action], peers: int) -> tuple[int, int, set[int]]:
    """The most regular peers down at once, the most newcomers in at once, and every peer killed."""
    down, newcomers, killed = set(), set(), set()
    most_down = most_newcomers = 0
    for action in actions:
        if action.kind == "kill":
            assert action.who not in down
            down.add(action.who)
            killed.add(action.who)
        elif action.kind == "restart":
            down.remove(action.who)
        elif action.kind == "leave":
            newcomers.remove(action.who)
        else:
            newcomers.add(action.who)
        most_down, most_newcomers = max(most_down, len(down)), max(most_newcomers, len(newcomers))
    assert 0 <= min(killed, default=0) and max(killed, default=0) < peers
    return most_down, most_newcomers, killed


@pytest.mark.parametrize("seed", range(30))
def test_schedule_of_sixteen_peers_keeps_rate_and_bounds(seed):
    actions = churn_schedule(seed, peers=16, epochs=60, hour_epochs=60, newcomer_every=4, spared=(15,))
    kills = [a for a in actions if a.kind == "kill"]
    assert len(kills) == 5  # 30 % of 16 peers in an hour-equivalent of 60 epochs, to the nearest
    for i, epoch in enumerate(sorted(kill.epoch for kill in kills)):
        assert epoch >= 12 * i  # one in each fifth of the run, or moved later
    for kill in kills:  # back two epochs later
        restart = [a for a in actions if a.kind == "restart" and a.who == kill.who and a.epoch == kill.epoch + 2]
        assert restart or kill.epoch + 2 >= 60
    most_down, most_newcomers, killed = replay(actions, 16)
    assert most_down <= 2 and most_newcomers == 2 and 15 not in killed
    assert [a.epoch for a in actions if a.kind == "newcomer"] == list(range(0, 60, 4))
    assert [a.who for a in actions if a.kind == "leave"] == list(range(13))  # 15 arrivals, the last two stay


def test_schedule_holds_the_rate_over_each_part_of_a_long_run():
    actions = churn_schedule(3, peers=16, epochs=600, hour_epochs=60, spared=(15,))
    kills = [a.epoch for a in actions if a.kind == "kill"]
    assert len(kills) == 48  # 0.3 x 16 x 10 hours
    assert sum(epoch < 300 for epoch in kills) == 24  # one a stretch of 12.5 epochs: half in each half
    assert replay(actions, 16)[0] <= 2


@pytest.mark.parametrize("seed", range(20))
def test_quick_schedule_never_has_two_peers_down(seed):
    actions = churn_schedule(seed, peers=6, epochs=15, hour_epochs=10, newcomer_every=3, spared=(5,))
    assert sum(a.kind == "kill" for a in actions) == 3
    most_down, _, killed = replay(actions, 6)
    assert most_down == 1 and 5 not in killed


def test_schedule_refuses_nonsense():
    with pytest.raises(ValueError):
        churn_schedule(0, peers=1, epochs=10)
    with pytest.raises(ValueError):
        churn_schedule(0, peers=4, epochs=0)


def ev(event: str, time: float, **fields) -> dict:
    return {"time": time, "event": event, **fields}


def averaged(kind: str, time: float, weight: float, group: int, seconds: float) -> dict:
    return ev("averaged", time, kind=kind, group_size=group, weight=weight, seconds=seconds)


NOTHING = dict.fromkeys(swarm.SAMPLE_OUTCOMES, 0)
# A: a full member from epoch 10; its round of epoch 11 found no groupmate.
RUN_A = PeerRun(
    "peer0.0",
    "initial",
    0.0,
    50.0,
    events=[
        ev("started", 0.5, epoch=10),
        ev("step_begun", 3.0, epoch=10),
        ev("epoch", 3.01, epoch=11, samples=48, published=True),
        averaged("gradients", 3.5, 48, 3, 0.3),
        ev("step_begun", 5.0, epoch=11),
        ev("epoch", 5.01, epoch=12, samples=32, published=True),
        averaged("gradients", 5.5, 32, 1, 0.2),
    ],
    steps=[[1.0, 16, 10], [2.0, 16, 10], [3.0, 16, 11], [4.0, 16, 11], [5.0, 16, 12], [6.0, 16, 12]],
)
# B: a newcomer catching up: rounds at weight 0, epochs not published.
RUN_B = PeerRun(
    "new0.0",
    "newcomer",
    3.0,
    10.0,
    events=[
        ev("state_loaded", 3.2, epoch=8, epoch_before=0, bytes=12_500_000, seconds=0.1),
        ev("catching_up", 3.2, epoch=8, global_epoch=11),
        ev("started", 3.3, epoch=11),
        ev("step_begun", 5.2, epoch=11),
        ev("epoch", 5.21, epoch=12, samples=48, published=False),
        averaged("gradients", 5.6, 0, 3, 0.3),
    ],
    steps=[[3.5, 16, 11], [4.5, 16, 11], [5.2, 16, 12]],
)
# C: fell behind, and a download moved it from epoch 10 to 13: its samples were dropped.
RUN_C = PeerRun(
    "peer1.0",
    "initial",
    0.0,
    50.0,
    events=[
        ev("started", 0.5, epoch=10),
        ev("out_of_sync", 1.9, epoch=10, global_epoch=13),
        ev("epoch", 2.0, epoch=13, samples=32, published=True),
    ],
    steps=[[1.0, 16, 10], [2.0, 16, 13]],
)
# D: its round of epoch 10 outlasted the epoch (ended after step 11 began, but began before).
RUN_D = PeerRun(
    "peer2.0",
    "initial",
    0.0,
    50.0,
    events=[
        ev("started", 0.1, epoch=10),
        ev("step_begun", 1.0, epoch=10),
        ev("epoch", 1.01, epoch=11, samples=32, published=True),
        ev("step_begun", 10.0, epoch=11),
        ev("epoch", 10.5, epoch=12, samples=32, published=True),
        averaged("gradients", 11.0, 32, 2, 2.0),
        averaged("parameters", 11.5, 1, 2, 0.5),
        averaged("gradients", 12.5, 32, 2, 1.0),
    ],
    steps=[[1.0, 32, 11], [10.5, 32, 12], [12.0, 16, 12]],
)


def test_contributed_epochs_pair_each_round_with_the_step_it_began_in():
    assert contributed_epochs(RUN_A.events) == {10}  # epoch 11's round had no groupmate
    assert contributed_epochs(RUN_B.events) == set()  # weight 0 while catching up
    assert contributed_epochs(RUN_D.events) == {10, 11}  # round 10 began at 9.0, round 11 at 11.5
    gap = [ev("step_begun", 1.0, epoch=10), ev("step_begun", 10.0, epoch=11), ev("step_begun", 20.0, epoch=12)]
    gap += [averaged("gradients", 3.0, 16, 2, 1.0), averaged("gradients", 22.0, 16, 2, 1.0)]
    assert contributed_epochs(gap) == {10, 12}  # epoch 11's round failed: no averaged event


def test_computed_samples_count_every_step_by_the_epoch_it_was_made_in():
    # A's steps were made at epochs 10, 10, 10 (the third ended the epoch), 11, 11, 12
    assert computed_samples(RUN_A, 10, 13) == 96
    assert computed_samples(RUN_A, 11, 12) == 32
    assert computed_samples(RUN_B, 10, 13) == 48
    assert computed_samples(RUN_C, 10, 13) == 32  # both at epoch 10: the download came within the second
    assert computed_samples(RUN_D, 10, 13) == 80
    assert computed_samples(PeerRun("x", "restart", 0.0, 10.0), 0, 100) == 0  # killed before its first step


def test_applied_samples_need_a_published_epoch_after_an_own_round():
    assert applied_samples(RUN_A, 10, 13) == 48
    assert applied_samples(RUN_B, 10, 13) == 0
    assert applied_samples(RUN_C, 10, 13) == 0
    assert applied_samples(RUN_D, 10, 13) == 64
    assert applied_samples(RUN_D, 11, 12) == 32


def test_samples_by_outcome_say_where_each_epochs_samples_went():
    assert samples_by_outcome(RUN_A, 10, 13) == {**NOTHING, "applied": 48, "alone": 32, "unfinished": 16}
    assert samples_by_outcome(RUN_B, 10, 13) == {**NOTHING, "unpublished": 48}
    assert samples_by_outcome(RUN_C, 10, 13) == {**NOTHING, "dropped_by_download": 32}
    assert samples_by_outcome(RUN_D, 10, 13) == {**NOTHING, "applied": 64, "unfinished": 16}
    failed = dataclasses.replace(RUN_D, events=[e for e in RUN_D.events if e["time"] != 12.5])  # round 11 failed
    assert samples_by_outcome(failed, 11, 12) == {**NOTHING, "no_round": 32}


def test_an_epoch_that_lost_its_round_is_told_by_why():
    """``no_round_cause``: round_failed names the cause of its epoch; a round_given_up counts for the step it came
    in (between that step_begun and the next); an epoch with no step of its own is no_step."""
    steps = [ev("step_begun", 1.0, epoch=10), ev("step_begun", 10.0, epoch=11), ev("step_begun", 20.0, epoch=12)]
    assert no_round_cause([*steps, ev("round_failed", 60.0, epoch=10, reason="timeout")], 10) == "timeout"
    assert no_round_cause([*steps, ev("round_failed", 15.0, epoch=11, reason="cancelled")], 11) == "given_up"
    failed = ev("round_failed", 15.0, epoch=11, reason="MatchmakingException")
    assert no_round_cause([*steps, failed], 11) == "failed"
    assert no_round_cause([*steps, failed], 10) == "unexplained"  # the failure was epoch 11's
    given_up = ev("round_given_up", 12.0, seconds=2.0, reason="next_round")
    assert no_round_cause([*steps, given_up], 11) == "given_up"
    assert no_round_cause([*steps, given_up], 10) == "unexplained"  # it came after epoch 11's step began
    assert no_round_cause([*steps, given_up], 12) == "unexplained"
    assert no_round_cause(steps, 13) == "no_step"
    # RUN_D without its round of epoch 11 (ended 12.5), which timed out instead
    timed_out = [e for e in RUN_D.events if e["time"] != 12.5] + [ev("round_failed", 70.0, epoch=11, reason="timeout")]
    run = dataclasses.replace(RUN_D, events=timed_out)
    assert samples_without_round(run, 10, 13) == {**dict.fromkeys(NO_ROUND_CAUSES, 0), "timeout": 32}
    assert samples_without_round(RUN_A, 10, 13) == dict.fromkeys(NO_ROUND_CAUSES, 0)  # its lost epoch was alone


def test_round_completeness_is_the_share_of_values_averaged_in_rounds_with_groupmates():
    def round_of(group: int, weight: float, kept: int, dropped: int) -> dict:
        record = averaged("gradients", 1.0, weight, group, 0.5)
        return {**record, "values": 1000, "values_kept_local": kept, "senders_dropped": dropped}

    rounds = [round_of(3, 16, 0, 0), round_of(3, 16, 800, 1), round_of(4, 16, 0, 1), round_of(1, 16, 0, 0)]
    rounds.append(round_of(3, 0, 900, 2))  # catching up: not its own round
    run = PeerRun("p", "initial", 0.0, 10.0, events=rounds)
    figures = swarm.round_completeness([run])
    assert figures["values_averaged_median"] == pytest.approx(1.0)  # of 1.0, 0.2, 1.0
    assert figures["complete_rounds"] == pytest.approx(1 / 3)
    assert swarm.round_completeness([RUN_A]) == {"values_averaged_median": None, "complete_rounds": None}


def test_goodput_over_every_run():
    runs = [RUN_A, RUN_B, RUN_C, RUN_D]
    assert goodput(runs, 10, 13) == pytest.approx(112 / 256)  # (48 + 64) / (96 + 48 + 32 + 80)
    assert goodput(runs, 11, 12) == pytest.approx(32 / 112)  # D's epoch 11 / (32 + 48 + 0 + 32)
    assert goodput([], 0, 1) is None


def test_stalls_are_epochs_over_twice_the_median():
    first = PeerRun("a", "initial", 0.0, 10.0, events=[ev("epoch", t, epoch=e) for e, t in ((11, 10.0), (12, 20.0))])
    later = PeerRun("b", "initial", 0.0, 10.0, events=[ev("epoch", t, epoch=e) for e, t in ((11, 11.0), (13, 50.0))])
    third = PeerRun("c", "initial", 0.0, 10.0, events=[ev("epoch", t, epoch=e) for e, t in ((10, 0.0), (14, 60.0))])
    starts = epoch_starts([first, later, third])
    assert starts == {10: 0.0, 11: 10.0, 12: 20.0, 13: 50.0, 14: 60.0}
    durations = epoch_durations(starts, 10, 14)
    assert durations == [10.0, 10.0, 30.0, 10.0]
    assert stall_count(durations) == 1  # 30 > 2 x 10
    assert stall_count([10.0, 10.0, 20.0]) == 0  # twice the median is not over it
    assert epoch_durations(starts, 10, 20) == durations  # epochs not reached are left out
    assert stall_count([]) == 0


def joiner(kind, started, mbit, ended, ended_by, events) -> PeerRun:
    return PeerRun("j", kind, started, mbit, events=events, ended=ended, ended_by=ended_by)


LOADED = ev("state_loaded", 0.0, epoch=5, epoch_before=0, bytes=12_500_000, seconds=1.0)  # 12.5 MB


def test_join_outcomes_and_their_time_over_the_bound():
    # 12.5 MB in memory, 6.25 MB in fp16 through 10 Mbit/s (1.25 MB/s): a bound of 5 s; the first own round 15 s
    # after the process's start, 10 s after its joined event
    productive = joiner("newcomer", 100.0, 10.0, 300.0, "end", [LOADED, averaged("gradients", 115.0, 64, 5, 1.0)])
    assert join_outcome(productive, None) is True
    assert join_seconds_vs_bound(productive) == pytest.approx(3.0)  # no joined event: from the start
    events = [ev("joined", 105.0), LOADED, averaged("gradients", 115.0, 64, 5, 1.0)]
    assert join_seconds_vs_bound(joiner("newcomer", 100.0, 10.0, 300.0, "end", events)) == pytest.approx(2.0)
    # killed 30 s in, before its download: the swarm's 12.5 MB at 25 Mbit/s bound it to 4 s, a fair chance to 66 s
    early = joiner("restart", 100.0, 25.0, 130.0, "kill", [])
    assert join_outcome(early, 12_500_000) is None
    assert join_outcome(joiner("restart", 100.0, 25.0, 170.0, "kill", []), 12_500_000) is False  # 70 s > 66 s
    # ran 100 s to the end of the window (fair chance 1.5 x 2 + 60 = 63 s) at weight 0 only
    idle = joiner("newcomer", 100.0, 50.0, 200.0, "end", [LOADED, averaged("gradients", 150.0, 0, 5, 1.0)])
    assert join_outcome(idle, None) is False
    assert join_seconds_vs_bound(idle) is None
    assert join_outcome(joiner("newcomer", 100.0, 50.0, 105.0, "exit", []), None) is False  # failed by itself
    # its fair chance counts from its joined event: 80 s of Python start-up on a loaded host are not the join's
    started_late = joiner("restart", 100.0, 25.0, 230.0, "end", [ev("joined", 180.0), LOADED])
    assert join_outcome(started_late, 12_500_000) is None  # 50 s after joining, inside 1.5 x 4 + 60 = 66 s
    assert join_outcome(dataclasses.replace(started_late, ended=247.0), 12_500_000) is False  # 67 s after
    # productive without a download of its own: no ratio
    no_download = joiner("restart", 0.0, 10.0, 9.0, "end", [averaged("gradients", 5.0, 8, 2, 1)])
    assert join_outcome(no_download, None) is True and join_seconds_vs_bound(no_download) is None


def test_a_run_stopped_early_measures_up_to_an_epoch_that_had_one_more_after_it():
    # stopped at epoch 43 (its deadline), 60 planned from epoch 2: epochs 2 to 41, as a whole run settles its last
    assert swarm.truncated_window_end(62, 43) == 42
    assert swarm.truncated_window_end(None, 43) == 42  # stopped before the window's end was set
    assert swarm.truncated_window_end(10, 43) == 10  # stopped while settling: the planned window holds


def test_a_joins_fair_chance_spans_two_of_the_swarms_epochs_where_they_are_long():
    """The allowance past the download's bound is the wait for the epoch's end and a round: at least 60 s, and two
    median epochs where they last longer. A newcomer ended 90 s after joining a swarm of 60-s epochs had no fair
    chance yet (a run on a slower host counted one as failed); 127 s after, it had."""
    assert swarm.fair_chance_s(4.0) == pytest.approx(66.0)
    assert swarm.fair_chance_s(4.0, epoch_s=25.0) == pytest.approx(66.0)
    assert swarm.fair_chance_s(4.0, epoch_s=60.0) == pytest.approx(126.0)
    # the swarm's 12.5 MB at 25 Mbit/s: a bound of 4 s
    ended_early = joiner("newcomer", 100.0, 25.0, 270.0, "end", [ev("joined", 180.0), LOADED])
    assert join_outcome(ended_early, 12_500_000) is False
    assert join_outcome(ended_early, 12_500_000, epoch_s=60.0) is None
    assert join_outcome(dataclasses.replace(ended_early, ended=307.0), 12_500_000, epoch_s=60.0) is False
    # at the run's end it is the measured epochs' median that sizes it: epochs of 60 s from 0 to 300 s
    clock = PeerRun(
        "peer0.0",
        "initial",
        0.0,
        50.0,
        events=[ev("started", 0.0, epoch=0)]
        + [ev("epoch", 60.0 * e, epoch=e, samples=32, published=True) for e in range(1, 6)],
    )
    assert summarize([clock, ended_early], 0, 5)["joins_without_fair_chance"] == 1
    assert summarize([clock, dataclasses.replace(ended_early, ended=307.0)], 0, 5)["join_tries"] == 1


def test_a_newcomer_in_flight_leaves_once_productive_or_three_minutes_after_its_fair_chance():
    # 12.5 MB at 10 Mbit/s (1.25 MB/s): a bound of 10 s, a fair chance of 1.5 x 10 + 60 = 75 s from joining at 104 s,
    # given up 180 s later
    downloading = joiner("newcomer", 100.0, 10.0, None, None, [ev("joined", 104.0)])
    assert newcomer_verdict(downloading, 12_500_000, 358.0) is None
    assert newcomer_verdict(downloading, 12_500_000, 359.0) == "gave up"
    assert join_outcome(dataclasses.replace(downloading, ended=359.0, ended_by="leave"), 12_500_000) is False
    # the run's end judges a join as the plan does: still inside its grace, it had no fair chance yet
    ended = dataclasses.replace(downloading, ended=300.0, ended_by="end")
    assert join_outcome(ended, 12_500_000) is False and join_outcome(ended, 12_500_000, grace_s=180.0) is None
    assert join_outcome(dataclasses.replace(ended, ended=359.0), 12_500_000, grace_s=180.0) is False
    # its own download's size wins over the swarm's: 25 MB bound it to 20 s; no joined event: from its launch at 100 s,
    # giving up at 100 + 90 + 180
    loaded = dataclasses.replace(downloading, events=[{**LOADED, "bytes": 25_000_000}])
    assert newcomer_verdict(loaded, 12_500_000, 369.0) is None and newcomer_verdict(loaded, None, 370.0) == "gave up"
    # a round with a groupmate and its own samples: productive at once, however late
    productive = dataclasses.replace(loaded, events=[LOADED, averaged("gradients", 115.0, 64, 5, 1.0)])
    assert newcomer_verdict(productive, None, 116.0) == "productive"
    assert newcomer_verdict(productive, None, 1000.0) == "productive"
    # alone, or catching up at weight 0, is not yet a contribution
    alone = dataclasses.replace(loaded, events=[LOADED, averaged("gradients", 115.0, 64, 1, 1.0)])
    assert newcomer_verdict(alone, None, 116.0) is None


def test_a_newcomer_takes_a_slot_no_live_newcomer_holds_and_spares_the_latest_leaver():
    assert free_slot(3, held=[], leaving=[]) == 0
    assert free_slot(3, held=[0, 2], leaving=[]) == 1
    assert free_slot(3, held=[1], leaving=[0]) == 2  # a slot without a leaver first
    assert free_slot(3, held=[1], leaving=[2, 0]) == 2  # else the leaver that left first is killed
    assert free_slot(4, held=[0, 1, 3], leaving=[2]) == 2
    # the schedule's two newcomers and a leaver; four in flight and as many leaving at once
    assert swarm.newcomer_slots(swarm.QUICK) == 3 and swarm.newcomer_slots(swarm.JOINS) == 8


def test_a_join_plan_needs_a_sane_number_of_newcomers_in_flight():
    with pytest.raises(SystemExit):
        swarm.main(["--joins_in_flight", "-1"])
    with pytest.raises(SystemExit):
        swarm.main(["--joins_in_flight", str(swarm.MAX_JOINS_IN_FLIGHT + 1)])


def test_a_wait_times_out_on_a_stalled_swarm_not_on_a_long_one(tmp_path, monkeypatch):
    monkeypatch.setattr(swarm, "POLL_S", 0.01)
    waiting = swarm.Swarm(None, swarm.QUICK, tmp_path, "prefix", [], deadline=time.monotonic() + 60)
    calls = []

    def moving_on() -> bool:  # a new epoch every call, the condition true after 0.5 s, ten times the wait's seconds
        calls.append(time.monotonic())
        waiting.epoch += 1
        return calls[-1] - calls[0] > 0.5

    waiting.wait(moving_on, 0.05, "epoch 50")
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="without a new global epoch"):
        waiting.wait(lambda: False, 0.05, "epoch 1000")
    assert time.monotonic() - started < 5


def test_a_peer_that_exits_before_the_swarm_formed_stops_the_run_with_its_last_line(tmp_path, monkeypatch):
    """A swarm whose first peer cannot start (a bad flag, no sample data) is not waited for: the run stops at once and
    says which peer, its exit code and its log's last line. Once formed, an exit is churn and the peer restarts."""
    monkeypatch.setattr(swarm, "POLL_S", 0.01)
    waiting = swarm.Swarm(None, swarm.QUICK, tmp_path, "prefix", [], deadline=time.monotonic() + 60)
    failing = LocalProcess([str(tmp_path / "absent.json")], tmp_path / "peer0.log", module="json.tool")
    run = PeerRun("peer0.0", "initial", time.time(), 10.0)
    waiting.live["peer0"] = (failing, run, EventTail(tmp_path / "peer0.events.jsonl"))
    started = time.monotonic()
    with pytest.raises(swarm.SwarmNotFormed, match=r"peer0 exited \(2\) before the swarm formed: .*absent\.json"):
        waiting.wait(lambda: False, 300, "the first peer to start training")
    assert time.monotonic() - started < 10
    waiting.formed = True
    waiting.tick()
    assert "peer0" not in waiting.live and waiting.counts["exits"] == 1 and 0 in waiting.pending_restarts


def test_join_phases_say_where_the_time_went():
    events = [ev("joined", 104.0), LOADED, ev("started", 106.0, epoch=5), averaged("gradients", 115.0, 64, 5, 1.0)]
    run = joiner("newcomer", 100.0, 10.0, 300.0, "end", events)
    assert join_phases(run) == {"start_to_joined": 4.0, "download": 1.0, "started_to_round": 9.0}
    killed = joiner("restart", 100.0, 10.0, 130.0, "kill", [ev("joined", 101.0)])
    assert join_phases(killed) == {"start_to_joined": 1.0}


def test_summary_counts_joins_and_leaves_the_initial_peers_out():
    runs = [
        RUN_A,  # initial: neither a try nor a ratio
        joiner("newcomer", 100.0, 10.0, 300.0, "end", [LOADED, averaged("gradients", 115.0, 64, 5, 1.0)]),
        joiner("restart", 200.0, 25.0, 400.0, "end", [LOADED, averaged("gradients", 210.0, 64, 5, 1.0)]),
        joiner("restart", 100.0, 25.0, 130.0, "kill", []),  # no fair chance
        joiner("newcomer", 100.0, 50.0, 200.0, "end", [LOADED]),  # failed
    ]
    figures = summarize(runs, 10, 13)
    assert figures["join_tries"] == 3 and figures["join_productive"] == 2
    assert figures["join_success"] == pytest.approx(2 / 3)
    assert figures["joins_without_fair_chance"] == 1
    # bounds of 5 s (6.25 MB at 10 Mbit/s) and 2 s (at 25 Mbit/s): 15 / 5 and 10 / 2
    assert figures["join_seconds_vs_bound"] == pytest.approx(4.0)  # median of 3 and 5
    assert figures["join_seconds_vs_bound_max"] == pytest.approx(5.0)
    assert figures["state_bytes"] == 12_500_000
    # the productive joins downloaded in 1 s each (LOADED), and wrote neither joined nor started
    assert figures["join_phases_median_s"] == {"start_to_joined": None, "download": 1.0, "started_to_round": None}
    assert figures["goodput"] == pytest.approx(48 / 96)  # A alone computed and applied samples
    assert figures["samples_by_outcome"] == {**NOTHING, "applied": 0.5, "alone": 32 / 96, "unfinished": 16 / 96}
    assert figures["no_round_by_cause"] == dict.fromkeys(NO_ROUND_CAUSES, 0.0)  # no epoch lost its round


def test_leaves_saved_count_the_peers_told_to_leave_that_saved_their_state():
    runs = [
        joiner("newcomer", 100.0, 10.0, 300.0, "leave", [LOADED, ev("shutdown", 310.0, epoch=5, saved=True)]),
        joiner("newcomer", 100.0, 10.0, 300.0, "leave", [LOADED, ev("shutdown", 325.0, saved=False, forced=True)]),
        joiner("newcomer", 100.0, 10.0, 300.0, "leave", [LOADED]),  # killed in its slot before it shut down
        joiner("restart", 100.0, 10.0, 300.0, "kill", [ev("shutdown", 310.0, epoch=5, saved=True)]),
    ]
    assert leaves_saved(runs) == (1, 2)
    assert summarize(runs, 10, 13)["leaves_saved"] == 1 and summarize(runs, 10, 13)["leaves_shut_down"] == 2


def test_history_adds_up_joins_across_runs():
    records = [{"join_tries": 20, "join_productive": 19}, {"join_tries": 5, "join_productive": 5}, {}]
    totals = history_totals(records)
    assert totals == {
        "history_runs": 3,
        "history_join_tries": 25,
        "history_join_productive": 24,
        "history_join_success": pytest.approx(0.96),
    }
    assert history_totals([])["history_join_success"] is None


def test_event_tail_reads_complete_lines_once(tmp_path):
    path = tmp_path / "peer.events.jsonl"
    tail = EventTail(path)
    assert tail.read() == []
    path.write_text(json.dumps(ev("joined", 1.0)) + "\n" + '{"time": 2.0, "ev')
    assert [r["event"] for r in tail.read()] == ["joined"]
    with open(path, "a") as file:
        file.write('ent": "started", "epoch": 3}\n')
    assert [r["event"] for r in tail.read()] == ["started"]
    assert [r["event"] for r in tail.records] == ["joined", "started"]


def test_steps_cut_by_a_kill_keep_their_complete_records(tmp_path):
    path = tmp_path / "steps.jsonl"
    path.write_text("[1.0, 16, 3]\n[2.0, 16, 4]\n[3.0, 1")
    assert read_steps(path) == [[1.0, 16, 3], [2.0, 16, 4]]
    assert read_steps(tmp_path / "none.jsonl") == []


def test_the_slow_peer_sleeps_twice_its_compute_after_each_step(monkeypatch):
    import hivemind

    clock = {"now": 0.0}
    sleeps: list[float] = []

    def step(self, closure=None, batch_size=None, grad_scaler=None):
        clock["now"] += 0.5  # the step itself: not stretched
        return "stepped"

    def sleep(seconds):
        sleeps.append(seconds)
        clock["now"] += seconds

    monkeypatch.setattr(hivemind.Optimizer, "step", step)
    monkeypatch.setattr(swarm.time, "monotonic", lambda: clock["now"])
    monkeypatch.setattr(swarm.time, "sleep", sleep)
    swarm.slow_down(3.0)
    assert hivemind.Optimizer.step(None, batch_size=16) == "stepped"  # the first: nothing to measure yet
    for compute in (1.0, 2.0):
        clock["now"] += compute  # forward and backward
        hivemind.Optimizer.step(None, batch_size=16)
    assert sleeps == [2.0, 4.0]


def test_too_small_a_swarm_is_refused():
    with pytest.raises(SystemExit):
        swarm.main(["--peers", "3"])


def test_a_round_contributes_where_it_carried_this_peer_s_samples_in_either_mode():
    averaged = {"event": "averaged", "group_size": 2, "weight": 16}
    assert own_round({**averaged, "kind": "gradients"}) and own_round({**averaged, "kind": "pseudo-gradients"})
    assert not own_round({**averaged, "kind": "parameters"})
    assert not own_round({**averaged, "kind": "pseudo-gradients", "weight": 0})  # catching up
    assert not own_round({**averaged, "kind": "pseudo-gradients", "group_size": 1})  # alone


def test_a_peer_trains_below_the_priority_of_what_it_started_before(monkeypatch):
    import hivemind

    seen = {}
    monkeypatch.setattr(hivemind.Optimizer, "step", lambda self, *args, **kwargs: "stepped")
    swarm.lower_training_priority(swarm.TRAINING_NICENESS)
    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    def train():
        seen["before"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        seen["result"] = hivemind.Optimizer.step(None, batch_size=16)
        seen["after"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    trainer = threading.Thread(target=train)  # a thread of its own: a lowered priority cannot be raised back
    trainer.start()
    trainer.join(timeout=10)
    assert seen == {"before": before, "result": "stepped", "after": swarm.TRAINING_NICENESS}
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before  # the others keep theirs
