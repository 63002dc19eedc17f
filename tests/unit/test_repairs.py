"""Parameter rounds on demand for a peer catching up (collab/repairs.py): the pure rules, the signed requests between
two real DHT nodes, and two real low-communication optimizers on 127.0.0.1 that run one at the requested epoch."""

from __future__ import annotations

import threading
import time

import torch
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.schema import SchemaValidator
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer
from hivemind.utils.crypto import RSAPrivateKey
from transformers import AutoModelForMaskedLM

from arguments import AveragerArguments, OptimizerArguments, PeerArguments, ProgressTrackerArguments, TrainingArguments
from collab.optim import build_optimizer
from collab.repairs import (
    LEFT_APART_REPAIR_SHARE,
    REPAIR_GRANULARITY,
    RepairRequests,
    honoured_epochs,
    next_epoch_in_reach,
    repair_epoch,
    repairs_key,
    worth_a_repair,
)
from collab.schema import MAX_STEP, MetricSchema
from tests.local_dht import two_dhts
from trainer.local import wait_until
from trainer.model import tiny_bert_config


def test_a_request_names_the_first_even_epoch_past_the_next_one_or_past_the_swarm_s_when_in_reach():
    assert REPAIR_GRANULARITY == 2
    assert [repair_epoch(epoch) for epoch in (0, 1, 2, 5, 6, 31)] == [2, 4, 4, 8, 8, 34]
    assert [repair_epoch(epoch, in_reach=True) for epoch in (0, 1, 2, 5, 6, 31)] == [2, 2, 4, 6, 8, 32]


def test_the_next_epoch_is_in_reach_with_two_matchmaking_times_and_five_seconds_left():
    assert next_epoch_in_reach(15.1, matchmaking_time=5.0) and not next_epoch_in_reach(15.0, matchmaking_time=5.0)
    assert not next_epoch_in_reach(60.0, matchmaking_time=30.0) and next_epoch_in_reach(66.0, matchmaking_time=30.0)


def test_only_plain_ints_on_the_grid_within_bounds_are_honoured():
    values = [4, 7, -2, MAX_STEP + 1, True, 6.0, "8", None, [10], 2**62, 12]
    assert honoured_epochs(values) == {4, 12}


def test_a_round_that_kept_one_percent_of_the_values_local_or_more_is_worth_a_repair_and_fewer_wait():
    assert LEFT_APART_REPAIR_SHARE == 0.01
    values = 1_007_744  # the default model's parameters; 1 % of them is 10,077.44
    assert worth_a_repair(values, values) and worth_a_repair(values // 3, values) and worth_a_repair(10_078, values)
    assert not worth_a_repair(10_077, values)
    assert not worth_a_repair(384, values)  # a reducer's reply three parts short (bench.wan, H 25)
    assert not worth_a_repair(0, values) and not worth_a_repair(0, 0)


def repair_record(value, subkey: bytes = b"[owner:peer]") -> DHTRecord:
    key = DHTID.generate(source=repairs_key("schema_test")).to_bytes()
    return DHTRecord(key, MSGPackSerializer.dumps(subkey), MSGPackSerializer.dumps(value), time.time() + 60)


def test_the_dht_schema_takes_one_bounded_int_per_signed_subkey():
    schema = SchemaValidator(MetricSchema, prefix="schema_test")
    for epoch in (0, 8, MAX_STEP):
        assert schema.validate(repair_record(epoch))
    for bad in (-1, MAX_STEP + 1, "8", 8.0, True, [8], None):
        assert not schema.validate(repair_record(bad)), bad
    assert not schema.validate(repair_record(8, subkey=b"no owner"))


def signature_of_a_new_key() -> tuple[RSASignatureValidator, bytes]:
    signature = RSASignatureValidator(RSAPrivateKey())
    return signature, signature.local_public_key


def test_a_request_reaches_another_node_and_nobody_can_make_it_for_someone_else():
    """Two nodes that each sign with their own key and check every record's signature and schema."""
    prefix = f"repairs{time.time_ns()}"
    (first_signature, first_key), (second_signature, second_key) = signature_of_a_new_key(), signature_of_a_new_key()
    with two_dhts([SchemaValidator(MetricSchema, prefix=prefix)], [second_signature]) as (first, second):
        first.add_validators([first_signature])
        asking, reading = RepairRequests(first, prefix, first_key), RepairRequests(second, prefix, second_key)
        assert asking.request(swarm_epoch=5) == 8 and asking.due(8) and not asking.due(6)

        def read_sees_it() -> bool:
            reading.refresh()
            return reading.due(8)

        wait_until(read_sees_it, 30, "the other node to read the request")
        assert not reading.due(6) and not reading.due(10)
        # a request under another peer's key, or of a value that is not a bounded int, is refused
        assert not first.store(repairs_key(prefix), 10, time.time() + 60, subkey=second_key)
        assert not first.store(repairs_key(prefix), "10", time.time() + 60, subkey=first_key)
        assert not first.store(repairs_key(prefix), -2, time.time() + 60, subkey=first_key)


LOCAL_STEPS = 2
ROUND_DEADLINE_S = 120


def lowcomm_peer(dht, prefix: str, averaging_timeout: float = 20.0):
    torch.manual_seed(0)  # both peers start from one model, as after a download
    model = AutoModelForMaskedLM.from_config(tiny_bert_config(100))
    optimizer = build_optimizer(
        model,
        dht,
        PeerArguments(experiment_prefix=prefix),
        # parameter rounds only every 1000 epochs: any within this test is a repair
        OptimizerArguments(
            target_batch_size=8,
            local_steps=LOCAL_STEPS,
            matchmaking_time=1.0,
            average_state_every=1000,
            averaging_timeout=averaging_timeout,
        ),
        AveragerArguments(),
        ProgressTrackerArguments(),
        TrainingArguments(per_device_train_batch_size=4, gradient_accumulation_steps=1),
        tracker_private_key=RSAPrivateKey(),  # two peers in one process: one progress key each
    )
    return model, optimizer


def train_until(model, optimizer, done, stop: threading.Event, errors: list) -> None:
    batch = {"input_ids": torch.randint(0, 100, (4, 8)), "labels": torch.randint(0, 100, (4, 8))}
    try:
        while not stop.is_set() and not done():
            model(**batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    except Exception as e:  # reported by the test's thread
        errors.append(e)


def has_samples(optimizer):
    return lambda: optimizer.local_progress.samples_accumulated > 0


def reached(optimizer, epoch: int):
    return lambda: optimizer.local_epoch >= epoch


def test_a_peer_catching_up_is_made_whole_at_the_epoch_it_asked_for():
    """A: a full member; B: catching up (as after a download that ended epochs behind). B asks for a parameter round;
    both run one at that epoch though regular ones come every 1000, and B is then a full member again."""
    prefix = f"repairround{time.time_ns()}"
    stop, errors = threading.Event(), []
    with two_dhts() as (first, second):
        (model_a, a), (model_b, b) = lowcomm_peer(first, prefix), lowcomm_peer(second, prefix)
        try:
            for model, optimizer in ((model_a, a), (model_b, b)):  # a first step publishes each one's progress
                train_until(model, optimizer, has_samples(optimizer), stop, errors)
            wait_until(lambda: min(o.tracker.global_progress.num_peers for o in (a, b)) >= 2, 60, "the peers' records")
            warmup = [
                threading.Thread(target=train_until, args=(model, optimizer, reached(optimizer, 2), stop, errors))
                for model, optimizer in ((model_a, a), (model_b, b))
            ]
            for thread in warmup:
                thread.start()
            for thread in warmup:
                thread.join(ROUND_DEADLINE_S)
            assert not errors and a.local_epoch >= 2 and b.local_epoch >= 2, errors

            swarm_epoch = max(a.local_epoch, b.local_epoch)
            b._begin_catching_up(state_epoch=swarm_epoch - 2, swarm_epoch=swarm_epoch)
            # B asks at its next step, unless a warm-up round cancelled by the next left it apart and a request for an
            # epoch still to come stands: that round makes it whole too (the assertions below hold for either)
            assert b.catching_up_since is not None

            caught_up_at = []

            def b_caught_up() -> bool:
                if b.catching_up_since is None and not caught_up_at:
                    caught_up_at.append(b.local_epoch)
                return bool(caught_up_at)

            trainers = [
                threading.Thread(target=train_until, args=(model_a, a, lambda: bool(caught_up_at), stop, errors)),
                threading.Thread(target=train_until, args=(model_b, b, b_caught_up, stop, errors)),
            ]
            for thread in trainers:
                thread.start()
            try:
                wait_until(lambda: caught_up_at or errors, ROUND_DEADLINE_S, "B to be made whole")
            finally:
                stop.set()
                for thread in trainers:
                    thread.join(60)
            assert not errors, errors
            requested = b.repairs.requested
            # the round at the start of the requested epoch made B whole (its first request, or a renewed one)
            assert requested >= repair_epoch(swarm_epoch, in_reach=True)
            assert requested <= caught_up_at[0] <= requested + 1, (requested, caught_up_at)
            assert b.state_averager.state_lag.value == 0
        finally:
            stop.set()
            a.shutdown()
            b.shutdown()


def anchors(optimizer) -> list[torch.Tensor]:
    return [anchor.detach().clone() for anchor in optimizer.state_averager._anchors()]


def largest_difference(first: list[torch.Tensor], second: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(first, second, strict=True))


def train_in_background(pairs, done, stop: threading.Event, errors: list) -> list[threading.Thread]:
    threads = [threading.Thread(target=train_until, args=(m, o, done, stop, errors)) for m, o in pairs]
    for thread in threads:
        thread.start()
    return threads


# Tries at a clean start: in the joint epochs (two steps each) a round is sometimes cancelled by the next one, which
# leaves B apart, and asking, before A pauses (seen once, in a CI run of 2026-11-29).
CLEAN_START_TRIES = 3


def pause_after_joint_epochs() -> bool:
    """One try of the test below, on DHTs of its own: a DHT signs records with the first tracker key it was given and
    ignores later ones, so a second try on the same DHTs could publish no progress. False where B was apart from A
    already after the joint epochs (not a clean start), True once its assertions held."""
    with two_dhts() as dhts:
        return pause_after_joint_epochs_on(*dhts)


def pause_after_joint_epochs_on(first, second) -> bool:
    prefix, stop, errors = f"leftapart{time.time_ns()}", threading.Event(), []
    (model_a, a), (model_b, b) = (lowcomm_peer(dht, prefix, averaging_timeout=5.0) for dht in (first, second))
    try:
        for model, optimizer in ((model_a, a), (model_b, b)):  # a first step publishes each one's progress
            train_until(model, optimizer, has_samples(optimizer), stop, errors)
        wait_until(lambda: min(o.tracker.global_progress.num_peers for o in (a, b)) >= 2, 60, "the peers' records")
        pairs = ((model_a, a), (model_b, b))
        for thread in train_in_background(pairs, lambda: min(a.local_epoch, b.local_epoch) >= 2, stop, errors):
            thread.join(ROUND_DEADLINE_S)
        assert not errors and a.local_epoch >= 2 and b.local_epoch >= 2, errors
        if b.repairs.requested is not None:
            return False

        # A pauses (its record stays fresh): B's round finds no groupmate, and B asks for a parameter round
        (alone,) = train_in_background([(model_b, b)], lambda: b.repairs.requested is not None, stop, errors)
        alone.join(ROUND_DEADLINE_S)
        assert not errors and b.repairs.requested is not None, errors
        apart = largest_difference(anchors(a), anchors(b))
        assert apart > 1e-3, apart  # B's own outer step moved its anchor away from A's
        return True
    finally:
        stop.set()
        a.shutdown()
        b.shutdown()


def test_a_peer_whose_round_found_no_groupmate_asks_for_a_parameter_round():
    """A and B train together to epoch 2; then A pauses, so B's next round finds no groupmate and B applies its own
    pseudo-gradient: its anchor leaves A's, and B asks for a parameter round (``left_apart``). That a requested round
    runs is the test above's; whether the anchors then agree is not asserted here: in epochs of two steps some later
    rounds are cancelled by the next one, which leaves them apart again (and asking again)."""
    clean = any(pause_after_joint_epochs() for _ in range(CLEAN_START_TRIES))
    assert clean, f"B was apart from A after the joint epochs in each of {CLEAN_START_TRIES} tries"
