"""A lying donor cannot hang or poison a newcomer's state download: pure checks, then real averagers on 127.0.0.1."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import math
import multiprocessing as mp
import os
import signal
import threading
import time
import warnings
from typing import AsyncIterator  # noqa: UP035 (hivemind recognises streaming handlers by typing.AsyncIterator)

import hivemind
import torch
from hivemind.optim.progress_tracker import LocalTrainingProgress, ProgressTracker
from hivemind.optim.state_averager import TrainingStateAverager, dump_optimizer_state
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import ValueWithExpiration, get_dht_time
from torch.optim.lr_scheduler import LambdaLR

from collab.averagers import (
    MAX_CONTRIBUTING_LAG,
    DownloadTry,
    FiniteAverager,
    FiniteGradientAverager,
    FiniteTrainingStateAverager,
    bring_scheduler_to_epoch,
    catches_up_after_a_load,
    catching_up_weight,
    choose_donor,
    honest_progress_epoch,
    spans_left,
    state_refusal,
)
from collab.hivemind_fixes import SpacedProgressTracker, progress_key, records_within_reach
from collab.prefetch import StatePrefetch
from tests.local_dht import average_parameters_once, two_dhts
from trainer.local import wait_until

LIAR_EPOCH = 2**39
LOAD_BOUND = 60.0  # seconds: three donors on 127.0.0.1 take about two; a newcomer stepping 2^39 times never ends


def progress(epoch: int, peer_id: bytes = b"peer") -> dict:
    return LocalTrainingProgress(
        peer_id=peer_id, epoch=epoch, samples_accumulated=0, samples_per_second=1.0, time=0.0, client_mode=False
    ).dict()


def test_the_swarm_epoch_is_the_honest_majority_s_not_a_liar_s():
    live = get_dht_time() + 60
    records = {key: ValueWithExpiration(progress(epoch), live) for key, epoch in ((b"a", 7), (b"b", 8), (b"c", 2**39))}
    assert honest_progress_epoch(records, get_dht_time(), step_lag=2) == 8
    records[b"d"] = ValueWithExpiration({"epoch": "many"}, live)  # malformed: ignored
    records[b"e"] = ValueWithExpiration(progress(2**40), get_dht_time() - 1)  # expired: ignored
    assert honest_progress_epoch(records, get_dht_time(), step_lag=2) == 8
    assert honest_progress_epoch({}, get_dht_time()) is None


def test_a_peer_s_own_record_is_left_out_of_the_swarm_s_epoch():
    """A newcomer at epoch 0 and one honest peer at 100: the swarm is at 100, not at the lower median 0."""
    live = get_dht_time() + 60
    records = {
        b"new": ValueWithExpiration(progress(0, b"newcomer"), live),
        b"old": ValueWithExpiration(progress(100), live),
    }
    assert honest_progress_epoch(records, get_dht_time(), exclude_peer=b"newcomer") == 100
    assert honest_progress_epoch(records, get_dht_time()) == 0


def test_the_tracker_s_global_epoch_ignores_a_record_far_past_the_honest_majority():
    live = get_dht_time() + 60
    records = {
        key: ValueWithExpiration(progress(epoch), live) for key, epoch in ((b"a", 5), (b"b", 6), (b"liar", LIAR_EPOCH))
    }
    assert set(records_within_reach(records, get_dht_time())) == {b"a", b"b"}
    # a veteran at 25 and a newcomer still at 0: the veteran keeps its own record and the newcomer's
    pair = {key: ValueWithExpiration(progress(epoch, key), live) for key, epoch in ((b"veteran", 25), (b"new", 0))}
    assert set(records_within_reach(pair, get_dht_time(), own_peer=b"veteran")) == {b"veteran", b"new"}
    assert set(records_within_reach(pair, get_dht_time(), own_peer=b"new")) == {b"veteran", b"new"}
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        plain = ProgressTracker(dht, "liar_progress", target_batch_size=64, start=False)
        spaced = SpacedProgressTracker(dht, "liar_progress", target_batch_size=64, start=False)
        assert plain._parse_swarm_progress_data(records).epoch == LIAR_EPOCH
        assert spaced._parse_swarm_progress_data(records).epoch == 6
    finally:
        dht.shutdown()


def test_the_donor_is_the_highest_epoch_within_the_limit_and_not_excluded():
    peers = [PeerID(bytes([index]) * 34) for index in range(4)]
    live = get_dht_time() + 60
    epochs = (7, 8, LIAR_EPOCH, float("nan"))
    advertised = {peer.to_bytes(): ValueWithExpiration(epoch, live) for peer, epoch in zip(peers, epochs, strict=True)}
    assert choose_donor(advertised, float("inf"), set()) == peers[2]
    assert choose_donor(advertised, 20, set()) == peers[1]
    assert choose_donor(advertised, 20, {peers[1]}) == peers[0]
    assert choose_donor(advertised, 20, {peers[0], peers[1]}) is None


def test_a_state_is_refused_for_its_epoch_its_values_or_its_structure():
    params = [torch.zeros(3, 2), torch.zeros(2)]
    adam = torch.optim.Adam(params)
    adam.step()  # creates its state
    optimizer_metadata, optimizer_tensors = dump_optimizer_state(adam)
    tensors = [*params, *optimizer_tensors]
    shapes = [tensor.shape for tensor in tensors]

    def refusal(epoch=7, sent=tensors, metadata=optimizer_metadata, max_epoch=20):
        state = {"epoch": epoch, "optimizer_metadata": metadata}
        return state_refusal(state, sent, shapes, optimizer_metadata, min_epoch=0, max_epoch=max_epoch)

    assert refusal() is None
    assert refusal(max_epoch=None, epoch=LIAR_EPOCH) is None  # no swarm epoch known: no limit
    assert "past 20" in refusal(epoch=LIAR_EPOCH)
    assert "not an integer" in refusal(epoch=7.0) and "not an integer" in refusal(epoch=True)
    assert "non-finite" in refusal(sent=[torch.full_like(tensors[0], float("inf")), *tensors[1:]])
    assert "non-finite" in refusal(sent=[*tensors[:-1], torch.full_like(tensors[-1], float("nan"))])
    assert "shape" in refusal(sent=[torch.zeros(6), *tensors[1:]])
    assert "tensors" in refusal(sent=tensors[:-1])
    poisoned = [dict(entry) for entry in optimizer_metadata]
    lr_entry = next(index for index, entry in enumerate(poisoned) if entry.get("value") == 1e-3)
    poisoned[lr_entry]["value"] = float("inf")
    assert "non-finite number" in refusal(metadata=poisoned)
    assert "does not match" in refusal(metadata=optimizer_metadata[:-1])


def test_the_scheduler_reaches_a_huge_epoch_at_once_as_hivemind_s_loop_would():
    def scheduler():
        return LambdaLR(torch.optim.SGD([torch.zeros(1)], lr=1.0), lambda epoch: 1 / (1 + epoch))

    stepped, jumped = scheduler(), scheduler()
    while stepped._step_count <= 37:  # hivemind's _update_scheduler
        stepped.step()
    bring_scheduler_to_epoch(jumped, 37)
    assert (jumped.last_epoch, jumped._step_count, jumped.get_last_lr()) == (37, 38, stepped.get_last_lr())
    assert jumped.optimizer.param_groups[0]["lr"] == stepped.optimizer.param_groups[0]["lr"] == 1 / 38
    started = time.monotonic()
    bring_scheduler_to_epoch(jumped, LIAR_EPOCH)
    assert time.monotonic() - started < 1 and jumped.get_last_lr() == [1 / (1 + LIAR_EPOCH)]
    jumped.step()  # hivemind's next epoch steps it on from there
    assert jumped.get_last_lr() == [1 / (2 + LIAR_EPOCH)]


def test_a_scheduler_brought_to_epoch_1_before_any_step_gives_the_rate_and_no_warning():
    """A newcomer that loads a state of epoch 1 sets its schedule before its optimizer ever stepped: PyTorch's warning
    about a scheduler stepped first (its first rate skipped) was printed in every such peer's log."""
    optimizer = torch.optim.SGD([torch.zeros(1)], lr=1.0)
    scheduler = LambdaLR(optimizer, lambda epoch: 1 / (1 + epoch))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bring_scheduler_to_epoch(scheduler, 1)
    assert scheduler.get_last_lr() == [0.5] and optimizer.param_groups[0]["lr"] == 0.5


def test_a_gradient_averager_downloads_no_state_hivemind_would_drop():
    unused_averager = object()  # nothing of the averager is touched: no donor is asked
    assert FiniteGradientAverager.load_state_from_peers(unused_averager, timeout=None) is None


def make_averager(averager_class, dht: hivemind.DHT, fill: float, **kwargs) -> TrainingStateAverager:
    """A state averager over a small model whose parameters all hold ``fill``, with a LambdaLR scheduler."""
    model = torch.nn.Linear(16, 8)
    with torch.no_grad():
        for param in model.parameters():
            param.fill_(fill)
    return averager_class(
        dht=dht,
        prefix="download_test_state_averager",
        optimizer=functools.partial(torch.optim.Adam, lr=1e-3),
        params=model.parameters(),
        scheduler=functools.partial(LambdaLR, lr_lambda=lambda epoch: 1 / (1 + epoch)),
        start=True,
        **kwargs,
    )


def test_a_newcomer_gets_the_honest_state_past_a_liar_of_epoch_2_39_and_one_serving_inf():
    """Two plain hivemind liars and an honest donor serve their state: one claims epoch 2^39, one holds inf in its
    parameters, and both advertise a higher epoch than the honest one, so hivemind asks them first. The newcomer
    ends with the honest state within ``LOAD_BOUND`` seconds (plain hivemind steps its scheduler 2^39 times)."""
    dhts, averagers = [hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])], []
    executor = concurrent.futures.ThreadPoolExecutor(1)
    try:
        dhts += [
            hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=dhts[0].get_visible_maddrs())
            for _ in range(3)
        ]
        # (parameters, epoch served, epoch advertised): honest, liar far ahead, liar serving inf
        donors = ((1.0, 7, 7), (2.0, LIAR_EPOCH, 9), (float("inf"), 8, 8))
        for dht, (fill, epoch, advertised) in zip(dhts, donors, strict=False):
            donor = make_averager(TrainingStateAverager, dht, fill)
            donor.optimizer.param_groups[0]["weight_decay"] = 1e30  # finite and absurd: passes every check
            donor.local_epoch, donor.state_sharing_priority = epoch, advertised
            donor.allow_state_sharing = True
            averagers.append(donor)
            dht.store(
                progress_key("download_test"), progress(epoch), get_dht_time() + 300, subkey=dht.peer_id.to_bytes()
            )
        newcomer = make_averager(
            FiniteTrainingStateAverager, dhts[3], 0.0, run_id="download_test", allow_state_sharing=False
        )
        averagers.append(newcomer)
        wait_until(
            lambda: len((dhts[3].get("download_test_state_averager.all_averagers", latest=True) or [{}])[0]) == 3,
            30,
            "the three donors to declare their state",
            poll=0.1,
        )
        started = time.monotonic()
        executor.submit(newcomer.load_state_from_peers, timeout=10).result(timeout=LOAD_BOUND)
        assert time.monotonic() - started < LOAD_BOUND
        assert newcomer.local_epoch == 7 and newcomer.scheduler._step_count == 8
        assert newcomer.download_tries == 3  # the liar of epoch 9, the one of epoch 8, then the honest donor
        assert [group["weight_decay"] for group in newcomer.optimizer.param_groups] == [0.0]  # its own
        for param in newcomer.main_parameters:
            assert torch.equal(param, torch.ones_like(param))
    finally:
        executor.shutdown(wait=False, cancel_futures=True)
        for averager in averagers:
            with contextlib.suppress(Exception):
                averager.shutdown()
        for dht in dhts:
            dht.shutdown()


@contextlib.contextmanager
def declared_donor(
    first: hivemind.DHT, second: hivemind.DHT, epoch: int = 5, averager_class: type = FiniteTrainingStateAverager
):
    """A donor (an ``averager_class``) on ``first`` whose parameters hold 1.0, at ``epoch`` (its progress record too,
    which bounds the epoch a newcomer accepts), once ``second`` sees its state declared; shut down afterwards (again,
    if a test did)."""
    donor = make_averager(averager_class, first, 1.0)
    try:
        donor.local_epoch = donor.state_sharing_priority = epoch
        donor.allow_state_sharing = True
        first.store(progress_key("download_test"), progress(epoch), get_dht_time() + 300, subkey=b"donor")
        wait_until(
            lambda: len((second.get("download_test_state_averager.all_averagers", latest=True) or [{}])[0]) == 1,
            30,
            "the donor to declare its state",
            poll=0.1,
        )
        yield donor
    finally:
        with contextlib.suppress(Exception):
            donor.shutdown()


def test_a_download_begun_at_start_up_is_applied_by_the_first_load_after_its_donor_left():
    """``StatePrefetch`` downloads before the newcomer has an averager (as a peer's optimizer is still being built);
    the donor then leaves, and the newcomer's first load applies what was downloaded, counted as one try begun when
    the download did. Without it the load finds no donor left and keeps the newcomer's own state."""
    with two_dhts() as (first, second), declared_donor(first, second) as donor:
        newcomer = None
        try:
            prefetch = StatePrefetch.start(second, "download_test", FiniteTrainingStateAverager, 10.0, 5.0)
            wait_until(prefetch.done, 30, "the download begun at start-up", poll=0.1)
            donor.shutdown()
            newcomer = make_averager(
                FiniteTrainingStateAverager, second, 0.0, run_id="download_test", allow_state_sharing=False
            )
            newcomer.prefetch = prefetch
            assert newcomer.load_state_from_peers(timeout=10) is True
            assert newcomer.local_epoch == 5 and newcomer.download_tries == 1
            assert newcomer.download_began == prefetch.began
            for param in newcomer.main_parameters:
                assert torch.equal(param, torch.ones_like(param))
            assert newcomer.prefetch is None  # taken once: a later load downloads afresh
        finally:
            if newcomer is not None:
                newcomer.shutdown()


NEWCOMER_CHUNK_TIMEOUT = 1.0


@contextlib.contextmanager
def lone_donor_and_newcomer(donor_class: type = FiniteTrainingStateAverager):
    """A donor (a ``donor_class``, ``declared_donor``) and a newcomer (parameters 0.0, chunk timeout
    ``NEWCOMER_CHUNK_TIMEOUT``) whose only donor it is; both shut down afterwards."""
    with two_dhts() as (first, second), declared_donor(first, second, averager_class=donor_class) as donor:
        newcomer = make_averager(
            FiniteTrainingStateAverager,
            second,
            0.0,
            run_id="download_test",
            allow_state_sharing=False,
            next_chunk_timeout=NEWCOMER_CHUNK_TIMEOUT,
        )
        try:
            yield donor, newcomer
        finally:
            newcomer.shutdown()


@contextlib.contextmanager
def newcomer_during_a_round(round_s: float, first_chunk_timeout: float):
    """``lone_donor_and_newcomer``'s newcomer, with ``first_chunk_timeout``, while its donor is in a parameter round
    for ``round_s`` from now: it holds its averaged tensors' lock, as hivemind's all-reduce does."""
    with lone_donor_and_newcomer() as (donor, newcomer):
        newcomer.first_chunk_timeout = first_chunk_timeout
        donor.lock_averaged_tensors.acquire()  # a parameter round begins
        threading.Timer(round_s, donor.lock_averaged_tensors.release).start()
        yield newcomer


def test_a_download_asked_during_the_donor_s_parameter_round_waits_for_the_round_s_end():
    """hivemind's all-reduce holds the averaged tensors' lock for the whole round, and a donor serves its state only
    under that lock: here the lock is held 3 s, as by a round. The newcomer waits up to its ``first_chunk_timeout``
    (20 s) for the first chunk and gets the state; with the chunk timeout (1 s) for it, the try failed and the load
    kept its own."""
    with newcomer_during_a_round(3.0, first_chunk_timeout=20.0) as newcomer:
        started = time.monotonic()
        assert newcomer.load_state_from_peers(timeout=15) is True
        assert time.monotonic() - started > 2.5, "the state was served during the round"
        assert newcomer.local_epoch == 5 and newcomer.download_tries == 1


ROUND_S = 4.5  # how long the lone donor below is in a parameter round


def test_a_lone_donor_busy_past_the_first_chunk_s_wait_is_asked_again_with_twice_the_wait():
    """The only donor is in a parameter round for ``ROUND_S``: the first try waits 1.5 s for its first chunk and
    fails; after the 1 s backoff the load asks that donor again (it may be busy, not gone) and waits 3 s, past the
    round's end, and applies its state. Before, the load skipped the donor, found no other and kept the newcomer's
    own state; with the same 1.5 s wait the second try would have ended before the round did."""
    with newcomer_during_a_round(ROUND_S, first_chunk_timeout=1.5) as newcomer:
        started = time.monotonic()
        assert newcomer.load_state_from_peers(timeout=15) is True
        assert time.monotonic() - started > ROUND_S - 0.5, "the state was served during the round"
        assert (newcomer.local_epoch, newcomer.download_tries) == (5, 2)
        for param in newcomer.main_parameters:
            assert torch.equal(param, torch.ones_like(param))


def test_a_founder_s_download_at_start_up_finds_no_donor_and_ends_at_once():
    with two_dhts() as (_, dht):
        started = time.monotonic()
        prefetch = StatePrefetch.start(dht, "no_swarm_yet", FiniteTrainingStateAverager, 10.0, 5.0)
        assert prefetch.result() is None
        assert time.monotonic() - started < 5.0


def test_a_download_at_start_up_stops_once_cancelled_and_counts_as_its_donor_s_failed_try():
    """A peer asked to stop while its download at start-up waits on a donor that does not answer (its averager's
    process stopped by SIGSTOP, its p2p daemon still accepting) is not held by it: the download stops within a poll,
    as a failed try of that donor, which a load would then skip."""
    with two_dhts() as (first, second), declared_donor(first, second) as donor:
        try:
            os.kill(donor.pid, signal.SIGSTOP)
            prefetch = StatePrefetch.start(second, "download_test", FiniteTrainingStateAverager, 60.0, 30.0)
            wait_until(lambda: prefetch.donor is not None, 30, "the download to choose its donor", poll=0.05)
            assert not prefetch._done.wait(1.0), "the download from a donor that does not answer ended"
            cancelled = time.monotonic()
            prefetch.cancel()
            assert prefetch.result() == DownloadTry(first.peer_id)  # no state, and not a download that broke off
            assert time.monotonic() - cancelled < 5.0
        finally:
            os.kill(donor.pid, signal.SIGCONT)


def test_peers_whose_parameters_drifted_apart_agree_after_one_parameter_round():
    """Two peers whose parameters are 1.0 apart (what missed gradient rounds leave) both hold their mean after one
    parameter round. Make test's fast test of tests/integration/test_parameter_rounds.py, a scenario, with the
    round's schedule (tests/unit/test_lowcomm.py)."""
    options = dict(target_group_size=2, min_matchmaking_time=1.0)
    with two_dhts() as (first, second):
        averagers = [
            make_averager(FiniteTrainingStateAverager, dht, fill, **options)
            for dht, fill in ((first, 1.0), (second, 0.0))
        ]
        try:
            assert [averager.parameter_rounds_joined.value for averager in averagers] == [0, 0]
            average_parameters_once(averagers)
            for averager in averagers:
                for param in averager.main_parameters:
                    assert torch.equal(param, torch.full_like(param, 0.5)), "the peers do not hold their mean"
            # what lets a peer that missed an update miss another (collab.averagers.may_miss_one_update)
            assert [averager.parameter_rounds_joined.value for averager in averagers] == [1, 1]
        finally:
            for averager in averagers:
                averager.shutdown()


def test_a_catching_up_peer_takes_the_groups_parameters_and_adds_none_of_its_own():
    """A peer whose state is old (``state_lag`` above 0, as ``BoundedLoadOptimizer`` sets it) averages with
    weight 0: it ends with the other's parameters (1.0) and the other keeps its own; with every peer of the group
    catching up no value is averaged (0/0), each keeps its own and stays behind."""
    options = dict(target_group_size=2, min_matchmaking_time=1.0)
    with two_dhts() as (first, second):
        current = make_averager(FiniteTrainingStateAverager, first, 1.0, **options)
        behind = make_averager(FiniteTrainingStateAverager, second, 0.0, **options)
        try:
            behind.state_lag.value = 3
            average_parameters_once([current, behind])
            for averager in (current, behind):
                for param in averager.main_parameters:
                    assert torch.equal(param, torch.ones_like(param)), "not the current peer's parameters"
            assert behind.state_lag.value == current.state_lag.value == 0

            with torch.no_grad():
                for param in behind.main_parameters:
                    param.fill_(0.0)
            current.state_lag.value = behind.state_lag.value = 1
            average_parameters_once([current, behind])
            for averager, fill in ((current, 1.0), (behind, 0.0)):
                for param in averager.main_parameters:
                    assert torch.equal(param, torch.full_like(param, fill)), "a value of a peer catching up was used"
                assert averager.state_lag.value == 1
        finally:
            current.shutdown()
            behind.shutdown()


def test_the_values_a_catching_up_peer_still_holds_from_its_old_state_are_those_every_round_kept():
    assert spans_left([(0, 100)], []) == []
    assert spans_left([(0, 100)], [(30, 60)]) == [(30, 60)]
    assert spans_left([(0, 100)], [(90, 120), (0, 10)]) == [(0, 10), (90, 100)]
    assert spans_left([(0, 10), (90, 100)], [(5, 95)]) == [(5, 10), (90, 95)]
    assert spans_left([(30, 60)], [(0, 30), (60, 90)]) == []  # replaced in this round
    assert spans_left([(0, 100)], [(10, 40), (30, 50)]) == [(10, 50)]  # a failed part and a non-finite tensor overlap


class NoReducer(FiniteTrainingStateAverager):
    """Reduces the span of its groupmates' values it is given, as any peer, but answers with an error instead of the
    averages: each groupmate keeps its own values for that span, as when a groupmate drops out of a round. (Refusing
    the parts at once would leave its own reduction waiting for them, and its rounds growing longer.)"""

    _rpc_handlers = None  # its own, not a parent's cached ones

    async def rpc_aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        async for _ in super().rpc_aggregate_part(stream, context):
            pass
        yield averaging_pb2.AveragingData(code=averaging_pb2.INTERNAL_ERROR)


def test_a_catching_up_peer_is_made_whole_by_rounds_that_each_lose_a_groupmate_s_part():
    """A newcomer catching up took only parameter rounds whose every value came from groupmates: in a swarm with
    churn most rounds lose a part (a groupmate drops), and one newcomer of 460 in bench.swarm never caught up so.
    Here every round loses one groupmate's third; the rounds together replace every value, and the peer is whole;
    the rounds before its values were put back (a rollback) do not count."""
    options = dict(target_group_size=3, min_matchmaking_time=2.0)
    dhts = [hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])]
    averagers = []
    try:
        for _ in range(2):
            dhts.append(
                hivemind.DHT(
                    start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=dhts[0].get_visible_maddrs()
                )
            )
        # twelve tensors of 100 values, one part each: each peer of a group of three reduces a third
        models = [
            torch.nn.ParameterList(torch.nn.Parameter(torch.full((100,), fill)) for _ in range(12))
            for fill in (1.0, 0.0, 1.0)
        ]
        for dht, model, averager_class, chunk_timeout in zip(
            dhts,
            models,
            (FiniteTrainingStateAverager, FiniteTrainingStateAverager, NoReducer),
            (10.0, 10.0, 1.0),
            strict=True,
        ):
            averagers.append(
                averager_class(
                    dht=dht,
                    prefix="partial_rounds_state_averager",
                    optimizer=functools.partial(torch.optim.SGD, lr=0.0),
                    params=model.parameters(),
                    next_chunk_timeout=chunk_timeout,
                    start=True,
                    **options,
                )
            )
        current, behind, _ = averagers
        behind.state_lag.value = 3

        def behind_values() -> torch.Tensor:
            return torch.cat([param.detach().flatten() for param in behind.main_parameters])

        average_parameters_once(averagers)
        replaced = int((behind_values() == 1.0).sum())
        assert replaced == 800, "the first round did not replace all but the third the failing groupmate held"
        assert behind.state_lag.value == 3, "made whole by a round that left a third of its old values"
        # a rollback puts back older values (BoundedLoadOptimizer.values_put_back): the catch-up counts from here
        behind.catch_ups.value += 1
        average_parameters_once(averagers)
        assert behind.state_lag.value == 3, "the round before the values were put back still counted"
        for _ in range(11):  # each round's failing third is at a random place: 1 chance in 3 it is the same again
            if behind.state_lag.value == 0:
                break
            average_parameters_once(averagers)
        assert behind.state_lag.value == 0, "never made whole by rounds that each lost a part"
        assert torch.equal(behind_values(), torch.ones(1200)), "made whole while still holding old values"
        assert current.state_lag.value == 0
    finally:
        for averager in averagers:
            averager.shutdown()
        for dht in dhts:
            dht.shutdown()


def test_a_state_one_epoch_old_is_caught_up_with_only_where_the_mode_says_so():
    """hivemind takes the swarm's epoch after a state one epoch old and loads again after an older one; here any older
    one is caught up with, and one epoch old too in the low-communication mode (LowCommOptimizer's flag)."""
    for one_behind in (False, True):
        assert not catches_up_after_a_load(5, 5, one_behind)
        assert catches_up_after_a_load(3, 5, one_behind) and catches_up_after_a_load(0, 40, one_behind)
    assert not catches_up_after_a_load(4, 5, from_one_epoch_behind=False)
    assert catches_up_after_a_load(4, 5, from_one_epoch_behind=True)


def test_a_catching_up_peer_weighs_only_pseudo_gradients_from_a_state_a_few_rounds_old():
    assert catching_up_weight("pseudo-gradient", 512.0, 1) == 256.0
    assert catching_up_weight("pseudo-gradient", 512.0, 3) == 128.0
    assert catching_up_weight("pseudo-gradient", 500.0, MAX_CONTRIBUTING_LAG) == 100.0
    assert catching_up_weight("pseudo-gradient", 512.0, MAX_CONTRIBUTING_LAG + 1) == 0.0
    assert catching_up_weight("gradient", 512.0, 1) == 0.0
    assert catching_up_weight("parameter", 512.0, 1) == 0.0


class PseudoGradientRounds(FiniteAverager):
    """Averages its tensors as a low-communication peer's pseudo-gradients, ``state_lag`` epochs behind."""

    round_kind = "pseudo-gradient"

    def __init__(self, *args, state_lag, **kwargs):
        self.state_lag = state_lag  # before the averager's process starts
        super().__init__(*args, **kwargs)


def test_a_catching_up_peer_adds_its_pseudo_gradients_weighted_down_by_its_lag():
    """Two real averagers, the same samples each: a peer 3 epochs behind adds its pseudo-gradient (0.0) with a quarter
    of its weight to a full member's (1.0), so both hold 1 / 1.25 = 0.8; past ``MAX_CONTRIBUTING_LAG`` it adds nothing
    and both hold 1.0."""
    options = dict(prefix="catching_up_rounds", target_group_size=2, min_matchmaking_time=1.0, start=True)
    with two_dhts() as (first, second):
        lags = [mp.Value("i", 0), mp.Value("i", 3)]
        pair = [
            PseudoGradientRounds([torch.zeros(64)], dht=dht, state_lag=lag, **options)
            for dht, lag in zip((first, second), lags, strict=True)
        ]
        try:
            for behind, expected in ((3, 0.8), (MAX_CONTRIBUTING_LAG + 1, 1.0)):
                lags[1].value = behind
                for averager, value in zip(pair, (1.0, 0.0), strict=True):
                    with averager.get_tensors() as tensors:
                        tensors[0].fill_(value)
                with concurrent.futures.ThreadPoolExecutor(2) as pool:
                    rounds = [pool.submit(averager.step, weight=512.0, timeout=30) for averager in pair]
                    assert all(done.result(timeout=60) for done in rounds), "the round did not complete"
                for averager in pair:
                    with averager.get_tensors() as tensors:
                        assert torch.allclose(tensors[0], torch.full_like(tensors[0], expected)), (behind, tensors[0])
        finally:
            for averager in pair:
                averager.shutdown()


def test_a_load_whose_only_donor_failed_its_download_at_start_up_says_so_and_counts_the_try():
    """The download begun at start-up fails (cancelled while its donor does not answer): the load that takes it skips
    that donor, finds no other, keeps the newcomer's own state, and says why and how many donors it asked (its
    ``state_not_loaded`` event: the bytes of a failed download crossed the link all the same)."""
    with two_dhts() as (first, second), declared_donor(first, second) as donor:
        newcomer = None
        try:
            os.kill(donor.pid, signal.SIGSTOP)
            prefetch = StatePrefetch.start(second, "download_test", FiniteTrainingStateAverager, 60.0, 30.0)
            wait_until(lambda: prefetch.donor is not None, 30, "the download to choose its donor", poll=0.05)
            prefetch.cancel()
            newcomer = make_averager(
                FiniteTrainingStateAverager, second, 0.0, run_id="download_test", allow_state_sharing=False
            )
            newcomer.prefetch = prefetch
            assert newcomer.load_state_from_peers(timeout=10) is False
            assert (newcomer.local_epoch, newcomer.download_tries, newcomer.load_failure) == (0, 1, "download failed")
            for param in newcomer.main_parameters:
                assert torch.equal(param, torch.zeros_like(param))
        finally:
            os.kill(donor.pid, signal.SIGCONT)
            if newcomer is not None:
                newcomer.shutdown()


BREAK_SECONDS = 3.0  # how long the donor below goes silent: past the newcomer's chunk timeout


class BreaksOff(FiniteTrainingStateAverager):
    """A donor whose first ``downloads_to_break`` state downloads send one message and then go silent past the
    newcomer's chunk timeout, as a donor whose link stalls midway; it serves later downloads whole."""

    _rpc_handlers = None  # its own, not a parent's cached ones
    downloads_to_break = 1
    downloads_begun = 0  # in the averager's process, which serves every download

    async def rpc_download_state(
        self, request: averaging_pb2.DownloadRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        self.downloads_begun += 1
        breaks_off = self.downloads_begun <= self.downloads_to_break
        async for message in super().rpc_download_state(request, context):
            yield message
            if breaks_off:
                await asyncio.sleep(BREAK_SECONDS)
                return


class EndsMidTensor(BreaksOff):
    """A donor whose first state download ends with its last tensor short of its bytes, as a stream that a closed
    connection ended between two of a tensor's parts (``bench.streams``); it serves later downloads whole."""

    _rpc_handlers = None

    async def rpc_download_state(
        self, request: averaging_pb2.DownloadRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        self.downloads_begun += 1
        served = FiniteTrainingStateAverager.rpc_download_state(self, request, context)
        messages = [message async for message in served]
        if self.downloads_begun <= self.downloads_to_break:
            last = messages[-1]
            kept = len(last.tensor_part.buffer) // 2 // 8 * 8  # whole values, as p2pd's whole 32 KiB blocks
            last.tensor_part.buffer = last.tensor_part.buffer[:kept]
        for message in messages:
            yield message


class BreaksOffAlways(BreaksOff):
    _rpc_handlers = None
    downloads_to_break = math.inf


@contextlib.contextmanager
def newcomer_of_a_lone(donor_class: type):
    """``lone_donor_and_newcomer``'s newcomer, its donor a ``donor_class``."""
    with lone_donor_and_newcomer(donor_class) as (_, newcomer):
        yield newcomer


def test_a_lone_donor_whose_download_broke_off_midway_is_asked_once_more_and_its_state_applied():
    """The only donor sends the first part of its state, then nothing for longer than the chunk timeout: the load
    asks it again after the backoff (it was serving a moment ago) and applies its whole state, in one load of two
    tries. Before, the load skipped that donor, found no other and kept the newcomer's own state, so its next load
    downloaded everything again."""
    with newcomer_of_a_lone(BreaksOff) as newcomer:
        started = time.monotonic()
        assert newcomer.load_state_from_peers(timeout=20) is True
        assert time.monotonic() - started < 15
        assert (newcomer.local_epoch, newcomer.download_tries, newcomer.load_failure) == (5, 2, "download failed")
        for param in newcomer.main_parameters:
            assert torch.equal(param, torch.ones_like(param))


def test_a_lone_donor_whose_stream_ended_mid_tensor_is_asked_once_more_and_its_state_applied():
    """A download whose last tensor came short (the silent stream end of slow or loaded links) broke off midway: the
    lone donor is asked again and its whole state applied. Before, the short tensor's RuntimeError ("shape ... is
    invalid for input of size ...") counted as a plain failure, and the load kept the newcomer's own state."""
    with newcomer_of_a_lone(EndsMidTensor) as newcomer:
        assert newcomer.load_state_from_peers(timeout=20) is True
        assert (newcomer.local_epoch, newcomer.download_tries, newcomer.load_failure) == (5, 2, "download failed")
        for param in newcomer.main_parameters:
            assert torch.equal(param, torch.ones_like(param))


def test_a_donor_that_breaks_off_every_download_is_asked_twice_in_a_load_not_more():
    """A lone donor that breaks off each download: the load asks it once more, then keeps the newcomer's own state
    (two tries, not one per ``MAX_DONORS_PER_LOAD``)."""
    with newcomer_of_a_lone(BreaksOffAlways) as newcomer:
        assert newcomer.load_state_from_peers(timeout=20) is False
        assert (newcomer.local_epoch, newcomer.download_tries, newcomer.load_failure) == (0, 2, "download failed")
        for param in newcomer.main_parameters:
            assert torch.equal(param, torch.zeros_like(param))
