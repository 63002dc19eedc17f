"""collab.hivemind_fixes: each hivemind bug it works around, shown with plain hivemind and fixed by its subclass (or,
where no subclass reaches, by its entry-point patch)."""

import asyncio
import contextlib
import gc
import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time
import weakref
from pathlib import Path

import hivemind
import pytest
import torch
from hivemind.averaging.averager import DecentralizedAverager
from hivemind.averaging.control import AveragingStage, StepControl
from hivemind.averaging.key_manager import GroupKeyManager
from hivemind.averaging.matchmaking import PotentialLeaders
from hivemind.optim.progress_tracker import LocalTrainingProgress, ProgressTracker
from hivemind.proto import averaging_pb2
from hivemind.utils import ValueWithExpiration, get_dht_time
from hivemind.utils.mpfuture import MPFuture

from collab import hivemind_fixes
from collab.hivemind_fixes import (
    EPOCH_LEAD_LIMIT,
    PROGRESS_REPORT_PERIOD,
    FixedDecentralizedAverager,
    SpacedProgressTracker,
    _original_switch_to_uvloop,
    honest_progress_epoch,
    records_within_reach,
    run_leaving_no_task_pending,
    stale_progress_after,
    switch_to_uvloop_keeping_tasks,
    without_stale_contributions,
)
from tests.hivemind_patches import entry_point_patches_applied
from tests.local_dht import STALE_TEST_MATCHMAKING, matched_averager, two_dhts
from trainer.local import process_tree, stat_fields, wait_until

ROOT = Path(__file__).resolve().parents[2]


def run_task_waiting_on_weakly_held_future(make_loop) -> tuple[bool, str | None]:
    """hivemind's pattern: the task's only owner is a weak registry (MPFuture's) and a dropped local variable."""
    loop = make_loop()
    registry: dict[str, weakref.ref] = {}
    results: list[str] = []

    async def wait_for_answer():
        future = loop.create_future()
        registry["answer"] = weakref.ref(future)
        results.append(await future)

    async def main():
        asyncio.create_task(wait_for_answer())  # reference dropped, as in DecentralizedAverager._run_internal
        await asyncio.sleep(0.01)
        gc.collect()
        future = registry["answer"]()
        if future is not None:
            future.set_result("answered")
            await asyncio.sleep(0.01)

    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
    return registry["answer"]() is not None or bool(results), results[0] if results else None


@pytest.mark.upstream
def test_plain_hivemind_loop_loses_the_task():
    survived, answer = run_task_waiting_on_weakly_held_future(_original_switch_to_uvloop)
    assert (survived, answer) == (False, None)


def test_patched_loop_keeps_the_task_until_it_is_answered():
    survived, answer = run_task_waiting_on_weakly_held_future(switch_to_uvloop_keeping_tasks)
    assert (survived, answer) == (True, "answered")


def tasks_destroyed_pending(run) -> list[str]:
    """What asyncio logs when ``run(loop, main)`` returns and the loop is dropped, where ``main`` ends as hivemind's
    progress fetcher can: with a task it started still pending (its shutdown checker, whose result has not reached
    the loop; here a future that never completes, so that no thread's timing decides)."""
    logged: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())
    asyncio_logger = logging.getLogger("asyncio")
    # earlier tests may have configured logging (a dictConfig disables the loggers it does not name)
    disabled, level = asyncio_logger.disabled, asyncio_logger.level
    asyncio_logger.disabled, asyncio_logger.level = False, logging.ERROR
    asyncio_logger.addHandler(handler)
    try:
        loop = asyncio.new_event_loop()

        async def fetcher():
            never = asyncio.get_running_loop().create_future()
            asyncio.create_task(asyncio.wait_for(never, None))
            await asyncio.sleep(0)

        run(loop, fetcher())
        del loop
        gc.collect()
    finally:
        asyncio_logger.removeHandler(handler)
        asyncio_logger.disabled, asyncio_logger.level = disabled, level
    return [message for message in logged if "Task was destroyed but it is pending" in message]


@pytest.mark.upstream
def test_plain_hivemind_loop_ends_with_a_task_pending():
    assert tasks_destroyed_pending(lambda loop, main: loop.run_until_complete(main))


def test_the_tracker_thread_ends_with_no_task_pending():
    assert tasks_destroyed_pending(run_leaving_no_task_pending) == []
    assert SpacedProgressTracker.run is hivemind_fixes.tracker_run_leaving_no_task_pending


def test_starting_an_averager_keeps_the_callers_sigint_handler():
    import signal

    import hivemind
    import torch

    calls = []
    previous = signal.signal(signal.SIGINT, lambda *_: calls.append("handled"))
    dht = hivemind.DHT(start=True)
    averager = None
    try:
        averager = FixedDecentralizedAverager([torch.zeros(2)], dht=dht, prefix="sigint", start=True)
        signal.raise_signal(signal.SIGINT)
        assert calls == ["handled"]
    finally:
        signal.signal(signal.SIGINT, previous)
        if averager is not None:
            averager.shutdown()
        dht.shutdown()


LATE_TRIGGER_SECONDS = 1.0  # the second peer starts its all-reduce this much later (the skew under test)
# Matchmaking is not under test here, and a round with no deadline that is not matched looks for a group forever: the
# matching is set up anew, with fresh nodes, a bounded number of times. (Its failure seen in CI, two groups formed at
# once, is fixed where it arose: docs/RELIABILITY.md, "Two rounds each ran an all-reduce with a groupmate...")
MATCHING_TRIES = 3
MATCHING_PATIENCE = 30.0  # seconds a try waits for both rounds of both peers to be matched


class RoundsNotMatched(Exception):
    """Both rounds of both peers were not matched within MATCHING_PATIENCE."""


def average_with_a_late_groupmate(averager_class) -> tuple[torch.Tensor, torch.Tensor]:
    """What hivemind.Optimizer does with delayed averaging: round 2 is matched while round 1 is still pending; after
    round 1, one peer triggers round 2 a second before the other. Returns both peers' tensors after round 2."""
    for attempt in range(1, MATCHING_TRIES):
        try:
            return average_with_a_late_groupmate_once(averager_class)
        except RoundsNotMatched as error:
            logging.getLogger(__name__).warning("try %d: %s; setting the rounds up again", attempt, error)
    return average_with_a_late_groupmate_once(averager_class)


def average_with_a_late_groupmate_once(averager_class) -> tuple[torch.Tensor, torch.Tensor]:
    """One try of ``average_with_a_late_groupmate``: RoundsNotMatched where the rounds were not matched in time."""
    size = 1_000_000  # large enough for each peer to reduce a part, so each sends to the other
    dht1 = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    dht2 = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=dht1.get_visible_maddrs())
    options = dict(prefix="late", target_group_size=2, min_matchmaking_time=1.0, request_timeout=0.5, start=True)
    averagers = []
    try:
        averagers = [
            averager_class([torch.zeros(size)], dht=dht1, next_chunk_timeout=6.0, **options),
            averager_class([torch.full((size,), 2.0)], dht=dht2, next_chunk_timeout=6.0, **options),
        ]
        when = get_dht_time() + 1.5
        first = [a.step(scheduled_time=when, require_trigger=True, wait=False) for a in averagers]
        second = [a.step(scheduled_time=when + 1.5, require_trigger=True, wait=False) for a in averagers]
        try:
            wait_until(
                lambda: all(step.stage == AveragingStage.AWAITING_TRIGGER for step in first + second),
                timeout=MATCHING_PATIENCE,
                what="both rounds to be matched",
                poll=0.1,
            )
        except TimeoutError as error:
            raise RoundsNotMatched(str(error)) from error
        for step in first:
            step.allow_allreduce()
        for step in first:
            step.result(timeout=30)
        for averager, value in zip(averagers, (0.0, 2.0), strict=True):
            with averager.get_tensors() as (tensor,):
                tensor.fill_(value)
        second[0].allow_allreduce()
        time.sleep(LATE_TRIGGER_SECONDS)
        second[1].allow_allreduce()
        for step in second:
            step.result(timeout=30)
        results = []
        for averager in averagers:
            with averager.get_tensors() as (tensor,):
                results.append(tensor.clone())
        return tuple(results)
    finally:
        for averager in averagers:
            averager.shutdown()
        dht2.shutdown()
        dht1.shutdown()


@pytest.mark.upstream
@pytest.mark.timeout(180)
def test_plain_hivemind_leaves_half_of_the_tensor_unaveraged_when_a_groupmate_is_late():
    first, second = average_with_a_late_groupmate(DecentralizedAverager)
    averaged = (first == 1.0) & (second == 1.0)
    unaveraged = (first == 0.0) & (second == 2.0)
    assert averaged.any() and unaveraged.any() and (averaged | unaveraged).all()


@pytest.mark.timeout(180)
def test_fixed_averager_waits_for_a_late_groupmate_and_averages_everything():
    first, second = average_with_a_late_groupmate(FixedDecentralizedAverager)
    assert torch.equal(first, torch.ones_like(first)) and torch.equal(second, torch.ones_like(second))


MATCHMAKING_SECONDS = 2.0


def leader_lookups_in_one_round(update_queue) -> tuple[int, float]:
    """Two averagers match and average once with ``update_queue`` as PotentialLeaders' lookup loop; returns the DHT
    lookups of potential leaders both made (counted in their processes, which fork from this one) and the seconds
    the round took."""
    lookups = multiprocessing.Value("i", 0)
    patched = GroupKeyManager.get_averagers, PotentialLeaders._update_queue_periodically
    original_get_averagers = patched[0]

    async def counted_get_averagers(self, *args, **kwargs):
        with lookups.get_lock():
            lookups.value += 1
        return await original_get_averagers(self, *args, **kwargs)

    GroupKeyManager.get_averagers, PotentialLeaders._update_queue_periodically = counted_get_averagers, update_queue
    dht1 = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    dht2 = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=dht1.get_visible_maddrs())
    options = dict(prefix="lookups", target_group_size=256, min_matchmaking_time=MATCHMAKING_SECONDS, start=True)
    averagers = []
    try:
        averagers = [DecentralizedAverager([torch.zeros(8)], dht=dht, **options) for dht in (dht1, dht2)]
        started = time.monotonic()
        when = get_dht_time() + MATCHMAKING_SECONDS  # as hivemind.Optimizer schedules its rounds ahead
        steps = [averager.step(scheduled_time=when, wait=False) for averager in averagers]
        groups = [step.result(timeout=60) for step in steps]
        assert all(group is not None and len(group) == 2 for group in groups), f"no round: {groups}"
        return lookups.value, time.monotonic() - started
    finally:
        for averager in averagers:
            averager.shutdown()
        dht2.shutdown()
        dht1.shutdown()
        GroupKeyManager.get_averagers, PotentialLeaders._update_queue_periodically = patched


def spaced_bound(seconds: float) -> float:
    """Most lookups two averagers can make in ``seconds`` when each spaces them by a tenth of the matchmaking time."""
    return 2 * (seconds / (MATCHMAKING_SECONDS / hivemind_fixes.LEADER_LOOKUPS_PER_MATCHMAKING) + 1)


@pytest.mark.upstream
@pytest.mark.timeout(180)
def test_plain_hivemind_looks_up_leaders_back_to_back_while_matchmaking():
    lookups, seconds = leader_lookups_in_one_round(hivemind_fixes._original_update_queue_periodically)
    assert lookups > spaced_bound(seconds), f"{lookups} lookups in {seconds:.1f} s"


@pytest.mark.timeout(180)
def test_patched_matchmaking_spaces_its_lookups_and_still_forms_the_group():
    lookups, seconds = leader_lookups_in_one_round(hivemind_fixes.update_queue_with_spaced_lookups)
    assert lookups <= spaced_bound(seconds), f"{lookups} lookups in {seconds:.1f} s"


STEPS, STEP_SECONDS = 40, 0.05  # a fast peer's optimizer steps, 2 s of them
LONG_REPORT_PERIOD = 30.0  # longer than the test: a record published within it was not held back by the period


def progress_publications(patched: bool) -> tuple[int, float | None, float]:
    """A new tracker reports STEPS steps, then a new epoch. Returns the DHT stores made during the steps, the seconds
    until the new epoch could be read from the DHT (None if never within 10 s), and the seconds its shutdown took."""
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    stores = []
    real_store = dht.store

    def counted_store(*args, **kwargs):
        stores.append(time.monotonic())
        return real_store(*args, **kwargs)

    dht.store = counted_store
    options = {"progress_report_period": LONG_REPORT_PERIOD} if patched else {}
    try:
        tracker_class = SpacedProgressTracker if patched else ProgressTracker
        tracker = tracker_class(dht, "reports", target_batch_size=10**6, start=True, **options)
        try:
            for step in range(1, STEPS + 1):
                tracker.report_local_progress(0, samples_accumulated=16 * step)
                time.sleep(STEP_SECONDS)  # the step's compute
            during_steps = len(stores)

            with tracker.pause_updates():
                tracker.update_epoch(1)
            started = time.monotonic()
            new_epoch_seen = None
            while new_epoch_seen is None and time.monotonic() - started < 10:
                record = dht.get(tracker.training_progress_key, latest=True)
                mine = record and record.value.get(tracker._local_public_key)
                if mine and mine.value["epoch"] == 1:
                    new_epoch_seen = time.monotonic() - started
            started = time.monotonic()
            tracker.shutdown(timeout=10)
            return during_steps, new_epoch_seen, time.monotonic() - started
        finally:
            tracker.shutdown(timeout=10)
    finally:
        dht.shutdown()


@pytest.mark.upstream
@pytest.mark.timeout(120)
def test_plain_hivemind_publishes_progress_after_every_step():
    during_steps, new_epoch_seen, _ = progress_publications(patched=False)
    assert during_steps > STEPS / 4, f"{during_steps} stores for {STEPS} steps"
    assert new_epoch_seen is not None


@pytest.mark.timeout(120)
def test_spaced_tracker_publishes_once_per_period_but_a_new_epoch_at_once():
    during_steps, new_epoch_seen, shutdown_seconds = progress_publications(patched=True)
    assert during_steps == 1, f"{during_steps} stores for {STEPS} steps within one {LONG_REPORT_PERIOD:g} s period"
    assert new_epoch_seen is not None, f"the new epoch was held back by the {LONG_REPORT_PERIOD:g} s period"
    assert shutdown_seconds < LONG_REPORT_PERIOD / 3, f"shutdown waited out the period ({shutdown_seconds:.1f} s)"


def progress_record(epoch: int, samples: int, rate: float, published: float) -> ValueWithExpiration:
    progress = LocalTrainingProgress(
        peer_id=b"peer",
        epoch=epoch,
        samples_accumulated=samples,
        samples_per_second=rate,
        time=published,
        client_mode=False,
    )
    return ValueWithExpiration(progress.dict(), published + 60)  # hivemind's default metadata_expiration


def test_a_killed_peer_s_last_record_brings_the_swarm_s_next_step_no_closer():
    """Two peers at epoch 5 of a 256-sample batch: one trains (64 samples, 32 samples/s, published 0.5 s ago), one was
    SIGKILLed 30 s ago (96 samples, 64 samples/s), its record alive for 30 s more. hivemind adds the dead peer's
    samples, extrapolates them over its silence and counts its rate: the step is due at once, with 80 real samples.
    The fixed tracker leaves the dead peer's share out: 176 samples to go at 32 samples/s."""
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        plain = ProgressTracker(dht, "dead_peer", target_batch_size=256, start=False)
        spaced = SpacedProgressTracker(dht, "dead_peer", target_batch_size=256, start=False)
        now = get_dht_time()
        records = {
            b"live": progress_record(5, 64, 32.0, now - 0.5),
            b"killed": progress_record(5, 96, 64.0, now - 30),
        }
        hivemind_view, fixed_view = (tracker._parse_swarm_progress_data(records) for tracker in (plain, spaced))
    finally:
        dht.shutdown()
    assert (hivemind_view.samples_accumulated, hivemind_view.eta_next_epoch - now) == (160, pytest.approx(0, abs=0.1))
    assert (fixed_view.epoch, fixed_view.num_peers, fixed_view.samples_accumulated) == (5, 2, 64)
    # 64 published and 16 extrapolated over the live peer's 0.5 s: 176 to go
    assert fixed_view.eta_next_epoch - now == pytest.approx(176 / 32, abs=0.1)
    # a record renewed within the bound keeps its share: a live peer between two publications
    stale_after = stale_progress_after(PROGRESS_REPORT_PERIOD)
    assert stale_after == 11.0  # 3 periods of 2 s and 5 s of slack, as docs/RELIABILITY.md states
    records[b"killed"] = progress_record(5, 96, 64.0, now - stale_after + 1)
    assert without_stale_contributions(records, now, stale_after) == records
    malformed = {b"odd": ValueWithExpiration({"time": "yesterday"}, now + 60), b"none": ValueWithExpiration(None, now)}
    assert without_stale_contributions(malformed, now, stale_after) == malformed


def test_a_killed_peer_s_old_epoch_does_not_outvote_the_one_live_peer_left():
    """Three peers, one SIGKILLed at epoch 4 and the two others at epoch 10, each reading the records. Its own record
    left out, a survivor's vote was the lower median of the dead record's 4 and the other survivor's 10: 4, so the
    other survivor looked 6 epochs ahead (more than EPOCH_LEAD_LIMIT) and was dropped. Each survivor then counted
    only its own samples and stepped on twice the batch. The fixed tracker lets the fresh records vote."""
    assert 10 - 4 > EPOCH_LEAD_LIMIT
    stale_after = stale_progress_after(PROGRESS_REPORT_PERIOD)
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        me = dht.peer_id.to_bytes()
        spaced = SpacedProgressTracker(dht, "two_survivors", target_batch_size=256, start=False)
        now = get_dht_time()
        mine = progress_record(10, 64, 32.0, now - 0.5)
        records = {
            me: ValueWithExpiration({**mine.value, "peer_id": me}, mine.expiration_time),
            b"other": progress_record(10, 96, 32.0, now - 1.0),
            b"killed": progress_record(4, 128, 32.0, now - 30),
        }
        assert set(records_within_reach(records, now, me)) == {me, b"killed"}  # hivemind_fixes before the fix
        assert set(records_within_reach(records, now, me, stale_after)) == {me, b"other", b"killed"}
        view = spaced._parse_swarm_progress_data(records)
    finally:
        dht.shutdown()
    assert (view.epoch, view.num_peers, view.samples_accumulated) == (10, 3, 64 + 96)
    # 160 published, 16 and 32 extrapolated over the survivors' 0.5 s and 1 s: 48 to go at 64 samples/s
    assert view.eta_next_epoch - now == pytest.approx(48 / 64, abs=0.1)
    # where no record is fresh, all of them vote, as before
    silent = {b"other": progress_record(10, 96, 32.0, now - 30), b"killed": progress_record(4, 128, 32.0, now - 30)}
    assert honest_progress_epoch(silent, now, stale_after=stale_after) == honest_progress_epoch(silent, now) == 4


# A stand-in for a trainer: a DHT (with its p2pd) and an averager in child processes, as hivemind.Optimizer starts
# them, and signal handlers as run_trainer.py installs them. It prints the children's pids; after a SIGINT or SIGTERM
# and a line on stdin (the test has looked at its children meanwhile) it stops them itself and exits 0.
STAND_IN_PEER = textwrap.dedent(
    """
    import sys, threading
    import hivemind, torch
    from collab.hivemind_fixes import FixedDecentralizedAverager, FixedDHT
    from collab.signals import install_stop_handlers
    fixed = sys.argv[1] == "fixed"
    stop = threading.Event()
    install_stop_handlers(stop)
    dht = (FixedDHT if fixed else hivemind.DHT)(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    averager_class = FixedDecentralizedAverager if fixed else hivemind.DecentralizedAverager
    averager = averager_class([torch.zeros(4)], dht=dht, prefix="stand_in", target_group_size=2, start=True)
    print(dht.pid, averager.pid, flush=True)
    stop.wait(300)
    sys.stdin.readline()
    averager.shutdown()
    dht.shutdown()
    """
)


def running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie stays until the container's init reaps it)."""
    fields = stat_fields(f"/proc/{pid}/stat")
    return fields is not None and fields[0] != "Z"


def start_stand_in_peer(variant: str) -> tuple[subprocess.Popen, list[int]]:
    """``STAND_IN_PEER`` in a session of its own, and its running children: the DHT process, its p2pd, the
    averager."""
    peer = subprocess.Popen(
        [sys.executable, "-c", STAND_IN_PEER, variant],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        dht_pid, averager_pid = map(int, peer.stdout.readline().split())
        children = [*process_tree(dht_pid), averager_pid]
        assert len(children) == 3 and all(map(running, children)), children
    except BaseException:
        peer.kill()
        peer.wait(timeout=30)
        raise
    return peer, children


def children_of_a_killed_peer(variant: str) -> list[int]:
    """SIGKILL a peer; returns the pids of its hivemind children (DHT, p2pd, averager), for the caller to check."""
    peer, children = start_stand_in_peer(variant)
    peer.kill()
    peer.wait(timeout=30)
    return children


@pytest.mark.upstream
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.timeout(120)
def test_plain_hivemind_leaves_orphans_when_the_peer_is_killed():
    children = children_of_a_killed_peer("plain")
    try:
        time.sleep(3 * hivemind_fixes.PARENT_CHECK_PERIOD + 2)  # what the patched children need to notice
        assert all(map(running, children)), "plain hivemind's children ended with their parent"
    finally:
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.timeout(120)
def test_patched_children_end_with_their_killed_peer_p2pd_included():
    children = children_of_a_killed_peer("fixed")
    try:
        wait_until(lambda: not any(map(running, children)), timeout=30, what="the killed peer's children to end")
    finally:
        for pid in filter(running, children):
            os.kill(pid, signal.SIGKILL)


def helpers_after_a_signal_to_the_group(variant: str, signum: int) -> tuple[list[int], list[int], int | None]:
    """Signal a stand-in peer's process group; returns its helpers (DHT, p2pd, averager), those still running 2 s
    later, and, for the fixed variant, the stand-in's exit code once it has stopped them (None if it did not exit;
    plain hivemind's stand-in is killed: its shutdown waits out grace periods on the dead helpers)."""
    peer, helpers = start_stand_in_peer(variant)
    try:
        os.killpg(peer.pid, signum)  # as Ctrl-C in a terminal or kill -- -PGID: the stand-in leads its group
        time.sleep(2.0)  # a helper killed by the signal is gone within milliseconds
        survivors = list(filter(running, helpers))
        if variant != "fixed":
            return helpers, survivors, None
        peer.stdin.write("stop your helpers\n")
        peer.stdin.flush()
        with contextlib.suppress(subprocess.TimeoutExpired):
            peer.wait(timeout=60)
        return helpers, survivors, peer.returncode
    finally:
        for pid in [peer.pid, *helpers]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        peer.wait(timeout=30)


@pytest.mark.upstream
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.timeout(120)
def test_plain_hivemind_helpers_die_of_a_sigterm_meant_for_their_peer():
    # SIGTERM, not Ctrl-C: whether p2pd dies of a SIGINT depends on what the test's own parent ignores (a shell's
    # background job starts with SIGINT ignored), while SIGTERM reaches the helpers through the peer's own handler
    helpers, survivors, _ = helpers_after_a_signal_to_the_group("plain", signal.SIGTERM)
    assert survivors != helpers, "every plain hivemind helper outlived the SIGTERM"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.timeout(120)
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm-to-the-group"])
def test_helpers_outlive_a_signal_to_their_peers_group_and_are_stopped_by_the_peer(signum):
    helpers, survivors, exit_code = helpers_after_a_signal_to_the_group("fixed", signum)
    assert survivors == helpers, f"helpers {sorted(set(helpers) - set(survivors))} died of the signal"
    assert exit_code == 0
    wait_until(lambda: not any(map(running, helpers)), timeout=30, what="the peer's helpers to end")


TENSORS = 40  # an averaged model's tensors: hivemind re-declared after each averaged part


def download_declarations(patched: bool) -> tuple[int, float | None]:
    """Two averagers that share their state average TENSORS tensors once, then one raises its priority. Returns the
    state-download declarations both stored (counted in their processes, which fork from this one) up to the end
    of the round, and the priority the DHT then shows for the one that raised it (None if not within 10 s)."""
    declarations = multiprocessing.Value("i", 0)
    real_store = hivemind.DHT.store

    def counted_store(self, key, *args, **kwargs):
        if str(key).endswith(".all_averagers"):
            with declarations.get_lock():
                declarations.value += 1
        return real_store(self, key, *args, **kwargs)

    hivemind.DHT.store = counted_store
    averager_class = FixedDecentralizedAverager if patched else DecentralizedAverager
    options = dict(prefix="declare", target_group_size=2, min_matchmaking_time=1.0, request_timeout=0.5, start=True)
    averagers = []
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(setattr, hivemind.DHT, "store", real_store)
        dht1, dht2 = cleanup.enter_context(two_dhts())
        cleanup.callback(lambda: [averager.shutdown() for averager in averagers])
        averagers += [
            averager_class([torch.full((64,), float(i)) for _ in range(TENSORS)], dht=dht, **options)
            for i, dht in enumerate((dht1, dht2))
        ]
        when = get_dht_time() + 1.0
        steps = [averager.step(scheduled_time=when, wait=False) for averager in averagers]
        assert all(step.result(timeout=60) for step in steps), "no averaging round"
        during_round = declarations.value

        averagers[1].state_sharing_priority = 5.0
        key, subkey = "declare.all_averagers", dht2.peer_id.to_bytes()
        started, priority = time.monotonic(), None
        while priority is None and time.monotonic() - started < 10:
            record = dht1.get(key, latest=True)
            entry = record and record.value.get(subkey)
            priority = entry.value if entry and entry.value == 5.0 else None
        return during_round, priority


@pytest.mark.upstream
@pytest.mark.timeout(120)
def test_plain_hivemind_redeclares_its_state_after_every_averaged_part():
    during_round, _ = download_declarations(patched=False)
    assert during_round > TENSORS, f"{during_round} declarations for one round of {TENSORS} tensors"


@pytest.mark.timeout(120)
def test_fixed_averager_declares_once_and_again_when_its_priority_changes():
    during_round, priority = download_declarations(patched=True)
    assert during_round == 2, f"{during_round} declarations (one per averager expected)"
    assert priority == 5.0, "the raised priority never reached the DHT"


def test_a_round_is_stale_only_while_it_still_looks_for_a_group_after_its_time():
    looking, running = AveragingStage.LOOKING_FOR_GROUP, AveragingStage.RUNNING_ALLREDUCE
    assert hivemind_fixes.is_stale_round(looking, done=False, seconds_since_trigger=4.0, stale_after=4.0)
    assert not hivemind_fixes.is_stale_round(looking, done=False, seconds_since_trigger=3.9, stale_after=4.0)
    # an all-reduce under way is a slow link or a late groupmate, not a missed group
    assert not hivemind_fixes.is_stale_round(running, done=False, seconds_since_trigger=60.0, stale_after=4.0)
    assert not hivemind_fixes.is_stale_round(looking, done=True, seconds_since_trigger=60.0, stale_after=4.0)


def test_a_round_of_one_epoch_is_stale_once_the_swarm_has_begun_the_next_epochs_round():
    looking, running = AveragingStage.LOOKING_FOR_GROUP, AveragingStage.RUNNING_ALLREDUCE
    # the swarm at 8: the others' round of 7 may still be forming, whatever the time
    assert not hivemind_fixes.is_stale_round(looking, False, 600.0, stale_after=4.0, round_epoch=7, swarm_epoch=8)
    assert hivemind_fixes.is_stale_round(looking, False, 0.0, stale_after=4.0, round_epoch=7, swarm_epoch=9)
    assert not hivemind_fixes.is_stale_round(running, False, 0.0, stale_after=4.0, round_epoch=7, swarm_epoch=9)
    assert not hivemind_fixes.is_stale_round(looking, True, 0.0, stale_after=4.0, round_epoch=7, swarm_epoch=9)
    # no swarm epoch known (a peer without a tracker): by time
    assert hivemind_fixes.is_stale_round(looking, False, 4.0, stale_after=4.0, round_epoch=7, swarm_epoch=None)


@pytest.fixture
def entry_point_patches():
    """The StepControl patches of the stale-round watchdog, as a program's entry point applies them."""
    with entry_point_patches_applied():
        yield


@pytest.mark.timeout(120)
def test_a_round_that_finds_no_group_is_given_up_after_two_and_a_half_matchmaking_times(entry_point_patches):
    # hivemind alone retries matchmaking until the round's timeout (60 s here, averaging_timeout in the Optimizer)
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    averager = matched_averager(dht, 1.0, prefix="nobody_else")
    try:
        step = averager.step(require_trigger=True, wait=False, timeout=60)
        step.allow_allreduce()
        wait_until(step.done, timeout=30, what="the round without a group to be given up", poll=0.1)
        assert step.cancelled()
    finally:
        averager.shutdown()
        dht.shutdown()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["gradients", "parameters"])
def test_a_round_of_a_known_epoch_waits_for_its_group_until_the_swarm_is_two_epochs_on(entry_point_patches, kind):
    """Epoch 7's gradient round (gathering its epoch) or the parameter round after it (hivemind gathers the epoch its
    step begins, 8), alone: kept past the time rule while the swarm is at 8, given up at 9."""
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    averager = matched_averager(dht, 1.0, prefix=f"epoch_watch_{kind}")
    swarm = {"epoch": 8}
    averager.tracked_swarm_epoch = lambda: swarm["epoch"]
    gather = None
    if kind == "gradients":
        averager.round_epoch = lambda: 7
    else:
        gather = 8
    try:
        step = averager.step(gather=gather, require_trigger=True, wait=False, timeout=60)
        step.allow_allreduce()
        time.sleep(2 * hivemind_fixes.STALE_ROUND_FACTOR * STALE_TEST_MATCHMAKING)
        assert not step.done(), "a round of epoch 7 was given up while the swarm was at epoch 8"
        swarm["epoch"] = 9
        wait_until(step.done, timeout=5, what="the round to be given up at epoch 9", poll=0.1)
        assert step.cancelled()
    finally:
        averager.shutdown()
        dht.shutdown()


@pytest.mark.timeout(120)
def test_a_round_is_not_given_up_while_it_waits_for_a_late_groupmate(entry_point_patches):
    """The first peer triggers before its group has assembled, the second 3 s later (more than the 2.5 s after which a
    round still looking for a group is given up): the group formed in time, so both average."""
    with two_dhts() as (dht1, dht2):
        averagers = [matched_averager(dht, value, prefix="late_mate") for dht, value in ((dht1, 0.0), (dht2, 2.0))]
        try:
            steps = [averager.step(require_trigger=True, wait=False, timeout=60) for averager in averagers]
            steps[0].allow_allreduce()
            time.sleep(3.0)  # the skew under test: the second peer is this much later
            steps[1].allow_allreduce()
            assert [len(step.result(timeout=30)) for step in steps] == [2, 2]
            for averager in averagers:
                with averager.get_tensors() as (tensor,):
                    assert torch.equal(tensor, torch.ones_like(tensor))
        finally:
            for averager in averagers:
                averager.shutdown()


def test_a_round_whose_all_reduce_failed_and_went_back_to_matchmaking_is_still_given_up(entry_point_patches):
    trigger, cancel = MPFuture(), MPFuture()
    now = get_dht_time()
    control = StepControl(scheduled_time=now, deadline=now + 60, allow_retries=True, weight=1.0, data_for_gather=b"")
    control.attach(trigger, cancel)
    watchdog = hivemind_fixes.StaleRoundWatchdog(period=None)
    control.stage = AveragingStage.RUNNING_ALLREDUCE
    watchdog.watch(control, hivemind_fixes.RoundWatch(stale_after=0.0))
    assert watchdog.check() == [] and not control.done(), "an all-reduce under way was given up"
    control.stage = AveragingStage.LOOKING_FOR_GROUP  # the all-reduce failed and hivemind retries matchmaking
    assert watchdog.check() == [control] and control.cancelled()
    assert watchdog.check() == [], "a round given up is forgotten"
    assert control.cancel() is False  # as Optimizer.shutdown cancels a round still marked as looking: no error


class AwaitedFuture(asyncio.Future):
    """A group's future that tells when something starts waiting for it (an ``await`` or a shield adds a callback)."""

    def __init__(self) -> None:
        super().__init__()
        self.awaited = asyncio.Event()

    def add_done_callback(self, fn, *, context=None) -> None:
        self.awaited.set()
        super().add_done_callback(fn, context=context)


@pytest.mark.parametrize(
    ("averager_class", "group_cancelled"),
    [
        pytest.param(DecentralizedAverager, True, id="plain-hivemind", marks=pytest.mark.upstream),
        pytest.param(FixedDecentralizedAverager, False, id="fixed"),
    ],
)
def test_a_sender_that_gives_up_waiting_for_the_runner_leaves_this_peers_round_whole(averager_class, group_cancelled):
    """A groupmate's part can come before this peer's round has its runner. When that sender gives up (its request is
    cancelled), plain hivemind's handler cancels the group's future with it, and this peer's own round then fails as
    it sets its runner (InvalidStateError, "Unable to run All-Reduce: invalid state", seen in a CI run)."""
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        averager = averager_class([torch.zeros(10)], dht=dht, prefix=f"gave_up_{averager_class.__name__}", start=False)

        async def sender_gives_up() -> asyncio.Future:
            group_id = b"registered, no runner yet"
            future = averager._running_groups[group_id] = AwaitedFuture()

            async def parts():
                yield averaging_pb2.AveragingData(group_id=group_id)
                await asyncio.Event().wait()  # the sender's next part never comes

            handler = asyncio.ensure_future(anext(averager.rpc_aggregate_part(parts(), None)))
            await asyncio.wait_for(future.awaited.wait(), 10)  # the handler now waits for the group's runner
            handler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await handler
            return future

        assert asyncio.run(sender_gives_up()).cancelled() is group_cancelled
    finally:
        dht.shutdown()


HIVEMIND_SHUTDOWN_ERROR = "object has no attribute 'finalize'"
# Two averagers match a round and both trigger it, but the second's process is stopped (SIGSTOP), so the first's
# all-reduce runs, waiting for the second, when the first is shut down (a peer leaving mid-round). In a process of its
# own: the averagers' threads write their errors to the stderr they inherit, which pytest does not capture.
SHUT_DOWN_IN_ITS_ALL_REDUCE = """
import os, signal, sys
from hivemind.averaging.averager import DecentralizedAverager
from hivemind.averaging.control import AveragingStage
from hivemind.utils import get_dht_time
from collab.hivemind_fixes import FixedDecentralizedAverager
from tests.local_dht import STALE_TEST_MATCHMAKING, matched_averager, two_dhts
from trainer.local import wait_until

averager_class = {"plain": DecentralizedAverager, "fixed": FixedDecentralizedAverager}[sys.argv[1]]
with two_dhts() as (first_dht, second_dht):
    pair = ((first_dht, 0.0), (second_dht, 2.0))
    averagers = [matched_averager(dht, value, "leaving", averager_class) for dht, value in pair]
    when = get_dht_time() + STALE_TEST_MATCHMAKING
    steps = [each.step(scheduled_time=when, require_trigger=True, wait=False) for each in averagers]
    try:
        wait_until(lambda: all(step.stage == AveragingStage.AWAITING_TRIGGER for step in steps), 30, "a match", 0.1)
    except TimeoutError:
        sys.exit(75)  # not matched: the caller tries again
    os.kill(averagers[1].pid, signal.SIGSTOP)
    for step in steps:
        step.allow_allreduce()
    # hivemind registers the group before it marks the round running; the round waits for the stopped peer
    wait_until(lambda: steps[0].stage == AveragingStage.RUNNING_ALLREDUCE, 10, "the all-reduce", 0.05)
    averagers[0].shutdown()
    os.kill(averagers[1].pid, signal.SIGCONT)
    averagers[1].shutdown()
"""


def shut_down_in_its_all_reduce(kind: str) -> str:
    """What ``SHUT_DOWN_IN_ITS_ALL_REDUCE`` with ``kind`` ("plain" or "fixed") averagers wrote to stderr."""
    for _ in range(MATCHING_TRIES):
        done = subprocess.run(
            [sys.executable, "-c", SHUT_DOWN_IN_ITS_ALL_REDUCE, kind],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=Path(__file__).resolve().parents[2],
        )
        if done.returncode != 75:
            assert done.returncode == 0, done.stderr[-2000:]
            return done.stderr
    raise RoundsNotMatched(f"no try of {MATCHING_TRIES} matched the two rounds")


@pytest.mark.upstream
@pytest.mark.timeout(400)
def test_plain_hivemind_fails_to_shut_down_an_averager_in_its_all_reduce():
    assert HIVEMIND_SHUTDOWN_ERROR in shut_down_in_its_all_reduce("plain")


@pytest.mark.timeout(400)
def test_fixed_averager_shuts_down_in_its_all_reduce_cancelling_the_round():
    assert HIVEMIND_SHUTDOWN_ERROR not in shut_down_in_its_all_reduce("fixed")


def test_a_read_whose_reader_gave_up_is_not_lost_and_the_drain_reads_to_the_end():
    """hivemind's runner reads a part with a timeout that cancels the read: the part still arrives for the next
    read, and ``drain`` reads the rest to the stream's end instead of closing the stream under it."""

    async def scenario():
        gate, taken = asyncio.Event(), []

        async def sender():
            for item in ("first", "second", "third"):
                if item == "second":
                    await gate.wait()  # comes after the reader gave up on it
                taken.append(item)
                yield item

        requests = hivemind_fixes.LingeringRequests(sender())
        assert await anext(requests) == "first"
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(anext(requests), 0.05)
        gate.set()
        assert await anext(requests) == "second"
        started = time.monotonic()
        await requests.drain(5.0)
        return taken, time.monotonic() - started

    taken, drain_seconds = asyncio.run(scenario())
    assert taken == ["first", "second", "third"]
    assert drain_seconds < 1.0  # it ended with the stream, not at its linger


def test_replies_come_first_and_the_stream_is_read_to_its_end_before_the_handler_returns():
    async def scenario():
        consumed = []

        async def stream():
            for item in ("part 0", "part 1", "part 2", "part 3"):
                consumed.append(item)
                yield item

        async def refuse(requests):
            await anext(requests)
            yield "refused"

        replies = [reply async for reply in hivemind_fixes.answered_in_full(refuse, stream(), linger=5.0)]
        return replies, consumed

    replies, consumed = asyncio.run(scenario())
    assert replies == ["refused"]
    assert consumed == ["part 0", "part 1", "part 2", "part 3"]


def test_the_drain_ends_at_its_linger_when_the_sender_neither_writes_nor_closes():
    async def scenario():
        async def sender_still_there():
            yield "part 0"
            await asyncio.sleep(60)

        requests = hivemind_fixes.LingeringRequests(sender_still_there())
        assert await anext(requests) == "part 0"
        started = time.monotonic()
        await requests.drain(0.3)
        elapsed = time.monotonic() - started
        pending = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        await asyncio.sleep(0)  # the cancelled read finishes unwinding
        return elapsed, [task for task in pending if not task.done()]

    elapsed, still_pending = asyncio.run(scenario())
    # waited its linger, not returned at once; CI's VM ended the loop's 0.3-s timer 0.16 ms early by this clock
    assert 0.25 <= elapsed < 2.0, elapsed
    assert still_pending == []  # the read left waiting on the sender was cancelled, not leaked
