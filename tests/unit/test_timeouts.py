"""Timeouts sized by the state and the link (collab/timeouts.py): figures checked by hand, then read back from the
real hivemind objects; state-download backoff, and an abandoned download stopped in another process."""

from __future__ import annotations

import asyncio
import functools
import multiprocessing as mp
import os
import time

import hivemind
import pytest
import torch
from hivemind.p2p import PeerID
from hivemind.utils import MPFuture, get_dht_time
from transformers import AutoModelForMaskedLM

from arguments import AveragerArguments, OptimizerArguments, PeerArguments, ProgressTrackerArguments, TrainingArguments
from collab.averagers import FiniteTrainingStateAverager, until_done
from collab.optim import build_optimizer, build_state_averager
from collab.timeouts import (
    Timeouts,
    derive_timeouts,
    download_backoff,
    estimate_transfers,
    group_part_timeout,
    last_round_wait,
    part_timeout,
    part_timeout_need,
    rank_wait_timeout,
    widened_first_chunk_timeout,
)
from trainer.model import tiny_bert_config

MB = 1e6


def transfers_100m(bandwidth_mbit: float = 40.0, group_size: int = 8, round_values: int = 1, state_values: int = 3):
    """The issue's case: 100M parameters, fp16 on the wire, a round of one value a parameter, the state = parameters +
    Lamb's two moments, fp32 model."""
    return estimate_transfers(
        parameters=100_000_000,
        round_values_per_parameter=round_values,
        state_values_per_parameter=state_values,
        bytes_per_value=2,
        model_bytes=400_000_000,
        group_size=group_size,
        bandwidth_mbit=bandwidth_mbit,
    )


def transfers_small(parameters: int, bandwidth_mbit: float):
    """A small fp32 model in a big swarm (the butterfly's share tends to the whole round): fp16 on the wire, the
    state = parameters + Lamb's two moments."""
    return estimate_transfers(
        parameters=parameters,
        round_values_per_parameter=1,
        state_values_per_parameter=3,
        bytes_per_value=2,
        model_bytes=4 * parameters,
        group_size=256,
        bandwidth_mbit=bandwidth_mbit,
    )


def test_a_100m_parameter_state_over_40_mbit_s_gets_timeouts_it_can_meet():
    transfers = transfers_100m()
    # 40 Mbit/s = 5 MB/s. A round of 200 MB among 8: 2 x 7/8 x 200 MB = 350 MB leave this peer: 70 s.
    assert transfers.round_seconds == pytest.approx(70.0)
    # one 512 KiB part on each of 7 streams at once: 7 x 524288 B / 5 MB/s
    assert transfers.part_seconds == pytest.approx(7 * 524288 / 5e6)
    assert transfers.state_seconds == pytest.approx(120.0)  # 600 MB at 5 MB/s (the issue: "about 150 s")
    assert transfers.save_seconds == pytest.approx(8.0)  # 400 MB at 50 MB/s
    timeouts = derive_timeouts(transfers, matchmaking_time=3.0)
    assert timeouts.averaging_timeout == pytest.approx(3 + 2 * 70)  # matchmaking, then twice the round
    assert timeouts.first_chunk_timeout == pytest.approx(2 * 70)  # a donor's parameter round, twice its bytes' time
    assert timeouts.next_chunk_timeout == 3.0  # 2 x 0.73 s is under the floor, matchmaking_time
    assert timeouts.load_state_timeout == pytest.approx(240.0)  # twice 120 s: over the 150 s the download needs
    assert timeouts.shutdown_averaging_wait == pytest.approx(140.0)
    assert timeouts.shutdown_deadline == pytest.approx(140 + 15 + 2 * 8)
    assert timeouts.save_reserve == pytest.approx(12 + 2 * 8)  # the teardown, then twice the 8-s write
    line = timeouts.describe()
    assert "100.0M parameters" in line and "40 Mbit/s upload" in line and "load_state_timeout 240 s" in line


def test_the_issue_s_gradient_round_of_100m_parameters_among_8_at_50_mbit_s_takes_about_a_minute():
    assert transfers_100m(bandwidth_mbit=50.0).round_seconds == pytest.approx(56.0)  # 350 MB at 6.25 MB/s


def test_a_low_communication_parameter_round_carries_anchor_and_momentum_so_takes_twice_as_long():
    lowcomm = transfers_100m(bandwidth_mbit=50.0, round_values=2, state_values=4)
    assert lowcomm.round_seconds == pytest.approx(112.0)  # 700 MB at 6.25 MB/s
    assert derive_timeouts(lowcomm, 3.0).averaging_timeout == pytest.approx(3 + 2 * 112)


def test_a_follower_waits_for_its_leader_s_answer_as_long_as_a_part_takes_on_its_link():
    # the last-round scenario's peers: 1M parameters, fp16 anchors and momentum (4 MB a round), groups of up to 256,
    # 1 Mbit/s: a leader's answer may queue behind a part of 4 MB x 255/256 on the link, 32 s
    slow = estimate_transfers(
        parameters=1_007_744,
        round_values_per_parameter=2,
        state_values_per_parameter=4,
        bytes_per_value=2,
        model_bytes=4_000_000,
        group_size=256,
        bandwidth_mbit=1.0,
    )
    assert derive_timeouts(slow, 2.0).request_timeout == pytest.approx(1_007_744 * 4 * 255 / 256 / 125_000)
    assert derive_timeouts(slow, 2.0, next_chunk_timeout=10.0).request_timeout == 10.0  # within a chunk's time
    # on a LAN, hivemind's 3 s
    assert derive_timeouts(transfers_100m(bandwidth_mbit=1000.0), 3.0).request_timeout == 3.0


def test_a_small_model_on_a_lan_keeps_today_s_defaults():
    transfers = transfers_small(parameters=5_000_000, bandwidth_mbit=100.0)
    timeouts = derive_timeouts(transfers, matchmaking_time=3.0)
    assert (timeouts.averaging_timeout, timeouts.next_chunk_timeout, timeouts.load_state_timeout) == (60, 3, 120)
    assert timeouts.shutdown_averaging_wait == 10.0
    assert timeouts.shutdown_deadline == pytest.approx(10 + 15 + 2 * 0.4)  # 20 MB written at 50 MB/s, twice


def test_explicit_timeouts_win_and_the_others_stay_consistent_with_them():
    slow = transfers_100m(bandwidth_mbit=1.0)  # a round of 1750 s, 7 parts of 512 KiB in 29.4 s, a state in 4800 s
    given = derive_timeouts(slow, 3.0, averaging_timeout=20.0, next_chunk_timeout=5.0, load_state_timeout=90.0)
    assert (given.averaging_timeout, given.next_chunk_timeout, given.load_state_timeout) == (20.0, 5.0, 90.0)
    assert given.shutdown_averaging_wait == 20.0  # never longer than a round may last
    assert "averaging_timeout, next_chunk_timeout, load_state_timeout as given" in given.how
    # a derived chunk timeout (58.7 s) fits the round's explicit 20 s: a round waits twice it for results
    assert derive_timeouts(slow, 3.0, averaging_timeout=20.0).next_chunk_timeout == pytest.approx(20 / 2.5)
    # an explicit chunk timeout of 100 s makes the derived round timeout (143 s) 2.5 times it
    assert derive_timeouts(transfers_100m(), 3.0, next_chunk_timeout=100.0).averaging_timeout == 250.0


def test_an_explicit_shutdown_timeout_is_the_deadline_and_leaves_the_save_half_of_it():
    # derived: a last round of up to 140 s, then 15 s and twice 8 s of writing: 171 s, more than docker stop waits
    given = derive_timeouts(transfers_100m(), 3.0, shutdown_timeout=8.0)
    assert given.shutdown_deadline == 8.0
    assert given.shutdown_averaging_wait == 4.0
    assert given.save_reserve == 4.0  # the half the last round cannot take
    assert "shutdown_timeout as given" in given.how
    # a timeout longer than the derived one keeps the derived wait for the last round
    assert derive_timeouts(transfers_100m(), 3.0, shutdown_timeout=600.0).shutdown_averaging_wait == 140.0


def test_a_mistyped_bandwidth_is_capped_not_days():
    timeouts = derive_timeouts(transfers_100m(bandwidth_mbit=0.001), matchmaking_time=3.0)
    assert timeouts.averaging_timeout == 3600.0 and timeouts.next_chunk_timeout == 600.0
    assert timeouts.load_state_timeout == 4 * 3600.0 and timeouts.shutdown_deadline == 3600.0
    with pytest.raises(ValueError):
        transfers_100m(bandwidth_mbit=0.0)
    with pytest.raises(ValueError):
        transfers_100m(group_size=1)


def test_the_part_timeout_outlasts_the_latest_groupmate_of_recent_rounds_within_its_cap():
    assert part_timeout_need(latest_start=4.0, dropped=False, timeout=3.0) == 8.0  # twice the latest start
    assert part_timeout_need(latest_start=1.0, dropped=True, timeout=5.4) == 10.8  # a drop: twice the timeout it had
    assert part_timeout(5.4, [], cap=24.0) == 5.4  # no round yet
    assert part_timeout(5.4, [0.2, 1.0], cap=24.0) == 5.4  # on time: the configured timeout
    assert part_timeout(5.4, [0.2, 10.8, 8.0], cap=24.0) == 10.8  # the most a remembered round called for
    assert part_timeout(5.4, [43.2], cap=24.0) == 24.0  # within the round's time


def test_a_round_waits_as_long_as_its_most_patient_member_within_the_cap():
    assert group_part_timeout(3.0, [None, None], cap=24.0) == 3.0  # groupmates that named none: its own
    assert group_part_timeout(3.0, [12.0, None, 5.0], cap=24.0) == 12.0
    assert group_part_timeout(12.0, [3.0], cap=24.0) == 12.0  # a shorter groupmate does not shorten it
    assert group_part_timeout(3.0, [1e9], cap=24.0) == 24.0  # a groupmate cannot stall the round past the cap


def test_state_downloads_back_off_exponentially_up_to_30_s():
    assert [download_backoff(tries) for tries in range(8)] == [0, 1, 2, 4, 8, 16, 30, 30]
    assert download_backoff(10_000) == 30


def test_a_donor_silent_for_the_first_chunk_s_wait_gets_twice_as_long_next_try_within_the_averaging_timeout():
    assert widened_first_chunk_timeout(3.2, 60.0) == 6.4
    waits = [3.2]
    for _ in range(6):
        waits.append(widened_first_chunk_timeout(waits[-1], 60.0))
    assert waits == [3.2, 6.4, 12.8, 25.6, 51.2, 60.0, 60.0]
    assert widened_first_chunk_timeout(90.0, 60.0) == 90.0  # a wait given longer than the cap is never shortened


TINY_PARAMETERS_BANDWIDTH = 0.05  # Mbit/s: slow enough that the tiny model's timeouts leave their floors


@pytest.mark.timeout(180)
def test_derived_timeouts_reach_hivemind_s_optimizer_and_averagers_and_flags_still_win():
    model = AutoModelForMaskedLM.from_config(tiny_bert_config(100))
    parameters = sum(param.numel() for param in model.parameters())
    upload = TINY_PARAMETERS_BANDWIDTH * 1e6 / 8  # bytes per second
    # by hand: groups of 2 (1 x 2 bytes a parameter through the upload per round), a state of 3 fp16 values a parameter
    round_seconds = 2 * (1 / 2) * parameters * 2 / upload
    expected_chunk = 2 * min(524288, parameters * 2 / 2) / upload  # the whole half it sends is under one part here
    expected_averaging = max(3.0 + 2 * round_seconds, 2.5 * expected_chunk)  # a round waits twice a chunk for results
    expected_load = 2 * parameters * 3 * 2 / upload
    assert 60 < expected_averaging < 3600 and 120 < expected_load < 14400 and 3 < expected_chunk < 600
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    settings = (
        PeerArguments(experiment_prefix="derived_timeouts"),
        OptimizerArguments(bandwidth=TINY_PARAMETERS_BANDWIDTH),
        AveragerArguments(target_group_size=2),
    )
    optimizer = monitor = None
    try:
        optimizer = build_optimizer(model, dht, *settings, ProgressTrackerArguments(), TrainingArguments())
        assert optimizer.averaging_timeout == pytest.approx(expected_averaging)
        assert optimizer.state_averager._allreduce_timeout == pytest.approx(expected_averaging)
        assert optimizer.load_state_timeout == pytest.approx(expected_load)
        for averager in (optimizer.state_averager, optimizer.grad_averager):
            assert averager.next_chunk_timeout == pytest.approx(expected_chunk)
            # a follower waits for its leader's answer a part's time (half the chunk timeout), 3 s at least
            assert averager.matchmaking_kwargs["request_timeout"] == pytest.approx(max(3.0, expected_chunk / 2))
        expected_first_chunk = min(expected_averaging, max(expected_chunk, 2 * round_seconds))
        assert optimizer.state_averager.first_chunk_timeout == pytest.approx(expected_first_chunk)
        optimizer.shutdown()
        monitor = build_state_averager(model, dht, *settings, TrainingArguments())  # the same RPC names: one at a time
        assert monitor.next_chunk_timeout == pytest.approx(expected_chunk)
        monitor.shutdown()
        explicit = OptimizerArguments(bandwidth=0.05, averaging_timeout=17.0, load_state_timeout=9.0)
        optimizer = build_optimizer(
            model, dht, settings[0], explicit, settings[2], ProgressTrackerArguments(), TrainingArguments()
        )
        assert (optimizer.averaging_timeout, optimizer.load_state_timeout) == (17.0, 9.0)
        assert optimizer.state_averager.next_chunk_timeout == pytest.approx(17.0 / 2.5)  # fits the explicit round
    finally:
        for averager in (optimizer, monitor):
            if averager is not None:
                averager.shutdown()
        dht.shutdown()


VANISHED_DONORS = 3
TRY_TIMEOUT = 5.0  # seconds per try


@pytest.mark.timeout(120)
def test_a_newcomer_whose_donors_all_fail_stops_after_one_try_each_with_backoff_and_keeps_its_state():
    """Three donors are advertised and none answers (peers gone since): one try each, 1, 2 and 4 s apart, then the
    newcomer keeps its own state; hivemind's Optimizer retried such a load at once, forever."""
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    model = torch.nn.Linear(8, 4)
    before = [param.detach().clone() for param in model.parameters()]
    newcomer = FiniteTrainingStateAverager(
        dht=dht,
        prefix="vanished_state_averager",
        optimizer=functools.partial(torch.optim.Adam, lr=1e-3),
        params=model.parameters(),
        allow_state_sharing=False,
        start=True,
    )
    try:
        for _ in range(VANISHED_DONORS):  # sha2-256 multihash peer IDs that no process holds
            vanished = PeerID(b"\x12\x20" + os.urandom(32)).to_bytes()
            dht.store("vanished_state_averager.all_averagers", 5.0, get_dht_time() + 300, subkey=vanished)
        started = time.monotonic()
        assert newcomer.load_state_from_peers(timeout=TRY_TIMEOUT) is False  # no state applied
        elapsed = time.monotonic() - started
        assert elapsed >= 1 + 2 + 4, "the tries were not spaced by the backoff"
        assert elapsed < 1 + 2 + 4 + VANISHED_DONORS * 2 * TRY_TIMEOUT + 10
        assert newcomer.local_epoch == 0
        for param, old in zip(newcomer.main_parameters, before, strict=True):
            assert torch.equal(param, old)
    finally:
        newcomer.shutdown()
        dht.shutdown()


def _wait_in_another_process(future: MPFuture, started: mp.Event) -> None:
    started.set()
    asyncio.run(until_done(future, poll=0.05))


def test_a_download_the_peer_abandons_is_seen_as_abandoned_in_the_averager_s_process():
    """The averager's process stops an abandoned download once it sees its future cancelled by the peer: the same
    MPFuture, cancelled in the process that made it, is seen done in another (its state is in shared memory)."""
    future = MPFuture()
    started = mp.Event()
    child = mp.get_context("fork").Process(target=_wait_in_another_process, args=(future, started), daemon=True)
    child.start()
    try:
        assert started.wait(30)
        time.sleep(0.3)
        assert child.is_alive(), "the other process saw the download abandoned before it was"
        future.cancel()
        child.join(timeout=10)
        assert not child.is_alive(), "the other process did not see the download abandoned"
    finally:
        child.kill()


def test_other_ranks_wait_through_every_try_of_rank_0s_state_load():
    timeouts = Timeouts(60.0, 3.0, 120.0, 10.0, 25.0, "floors")
    # 8 tries of 120 s, backoffs 0+1+2+4+8+16+30+30 s, a 60 s round and a 25 s shutdown
    assert rank_wait_timeout(timeouts, 8) == 8 * 120 + 91 + 60 + 25
    assert rank_wait_timeout(timeouts, 1) == 120 + 60 + 25


def test_a_last_step_that_ran_long_shortens_the_wait_for_the_last_round_not_the_save():
    # bench.swarm's newcomers on a loaded 2-core host: 26-s deadlines of which the last step took 8-14 s; peers that
    # waited 10-11 s for the last round were forced out before they had saved (teardown and save took over 8 s)
    small = transfers_small(parameters=1_000_000, bandwidth_mbit=6.0)
    timeouts = derive_timeouts(small, matchmaking_time=3.0)
    assert small.save_seconds == pytest.approx(0.08)
    round_wait = 2 * (2 * 255 / 256 * 2e6) / 0.75e6  # twice a 2-MB round through 6 Mbit/s in a butterfly: 10.6 s
    assert timeouts.shutdown_averaging_wait == pytest.approx(round_wait)
    assert timeouts.shutdown_deadline == pytest.approx(round_wait + 15 + 0.16)
    assert timeouts.save_reserve == pytest.approx(12.16)
    assert last_round_wait(timeouts, None) == timeouts.shutdown_averaging_wait  # no stop signal: no deadline runs
    assert last_round_wait(timeouts, 25.0) == timeouts.shutdown_averaging_wait  # signalled between two steps
    assert last_round_wait(timeouts, 18.0) == pytest.approx(18.0 - 12.16)  # 8 s of 26 gone in the last step
    assert last_round_wait(timeouts, 11.0) == 0.0  # less than the save needs: the round is not waited for
