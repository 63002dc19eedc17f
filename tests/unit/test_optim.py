"""The optimizer definition: parameter groups, schedule, local batch size."""

import contextlib
import dataclasses
import threading
import time

import hivemind
import pytest
import torch
from hivemind.averaging.control import AveragingStage, StepControl
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.optim.state_averager import dump_optimizer_state, initialize_optimizer_state_, load_optimizer_state
from hivemind.utils import MPFuture, get_dht_time
from hivemind.utils.crypto import RSAPrivateKey
from torch_optimizer import Lamb
from transformers import AutoModelForCausalLM, AutoModelForMaskedLM, GPT2Config

from arguments import (
    AveragerArguments,
    OptimizerArguments,
    PeerArguments,
    ProgressTrackerArguments,
    TrainingArguments,
)
from collab import events
from collab.averaging_events import failed_round_reason
from collab.callback import CollaborativeCallback
from collab.events import read_events
from collab.lowcomm import LowCommOptimizer
from collab.optim import (
    EIGHT_BIT_MIN_VALUES,
    SameLayoutLamb,
    build_optimizer,
    finish_delayed_updates,
    foreach_chunk_elements,
    gradient_compression,
    lamb_factory,
    local_batch_size,
    parameter_groups,
    scheduler_factory,
)
from tests.local_dht import steps_matched_in_advance, two_dhts
from trainer.model import tiny_bert_config


def optimizer_with_defaults(model, dht: hivemind.DHT, prefix: str):
    """The trainer's optimizer with every flag at its default, under experiment ``prefix``."""
    return build_optimizer(
        model,
        dht,
        PeerArguments(experiment_prefix=prefix),
        OptimizerArguments(),
        AveragerArguments(),
        ProgressTrackerArguments(),
        TrainingArguments(),
    )


def group_names(model, groups):
    names = {id(p): n for n, p in model.named_parameters()}
    return [{names[id(p)] for p in group["params"]} for group in groups]


@pytest.mark.parametrize(
    "model",
    [
        AutoModelForMaskedLM.from_config(tiny_bert_config(100)),
        AutoModelForCausalLM.from_config(GPT2Config(vocab_size=100, n_embd=32, n_layer=1, n_head=2)),
    ],
)
def test_no_weight_decay_on_biases_and_norms(model):
    groups = parameter_groups(model, weight_decay=0.01)
    decayed, not_decayed = group_names(model, groups)
    assert groups[0]["weight_decay"] == 0.01 and groups[1]["weight_decay"] == 0.0
    assert decayed.isdisjoint(not_decayed)
    assert decayed | not_decayed == {n for n, _ in model.named_parameters()}
    assert all(n.endswith("bias") or "LayerNorm" in n or ".ln_" in n for n in not_decayed)
    assert not any(n.endswith("bias") for n in decayed)
    assert any("LayerNorm.weight" in n or ".ln_1.weight" in n for n in not_decayed)
    assert any(n.endswith("query.weight") or n.endswith("c_attn.weight") for n in decayed)


def test_linear_warmup_then_linear_decay():
    args = TrainingArguments(learning_rate=0.1, warmup_steps=4, total_steps=12)
    model = torch.nn.Linear(2, 2)
    optimizer = lamb_factory(args)(parameter_groups(model, args.weight_decay))
    scheduler = scheduler_factory(args)(optimizer)
    rates = []
    for _ in range(13):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert rates[0] == 0.0
    assert rates[2] == pytest.approx(0.05)
    assert rates[4] == pytest.approx(0.1)
    assert rates[8] == pytest.approx(0.05)
    assert rates[12] == pytest.approx(0.0)


def test_lamb_uses_the_training_arguments():
    args = TrainingArguments(learning_rate=0.03, adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-7, clamp_value=5.0)
    optimizer = lamb_factory(args)([torch.nn.Parameter(torch.ones(2))])
    defaults = optimizer.defaults
    assert (defaults["lr"], defaults["betas"], defaults["eps"]) == (0.03, (0.8, 0.95), 1e-7)
    assert optimizer.clamp_value == 5.0 and optimizer.debias is True


def test_local_batch_size_counts_accumulation_on_the_one_device_a_peer_uses():
    args = TrainingArguments(per_device_train_batch_size=8, gradient_accumulation_steps=3)
    assert local_batch_size(args) == 24  # however many GPUs the machine has: the peer trains on the first


def wire_bytes_and_error(name: str, tensor: torch.Tensor) -> tuple[int, float]:
    """Bytes ``--grad_compression name`` sends for ``tensor``, and its relative error after the round trip."""
    from hivemind.compression import CompressionInfo, deserialize_torch_tensor

    message = gradient_compression(name).compress(tensor, CompressionInfo.from_tensor(tensor))
    restored = deserialize_torch_tensor(message)
    return len(message.buffer), ((restored - tensor).norm() / tensor.norm()).item()


def test_8bit_gradients_take_one_byte_a_value_for_large_tensors_only():
    torch.manual_seed(0)
    large, small = torch.randn(EIGHT_BIT_MIN_VALUES), torch.randn(EIGHT_BIT_MIN_VALUES - 1)
    fp16_bytes, fp16_error = wire_bytes_and_error("fp16", large)
    eight_bit_bytes, eight_bit_error = wire_bytes_and_error("8bit", large)
    assert fp16_bytes >= 2 * large.numel() and eight_bit_bytes < 0.6 * fp16_bytes
    assert fp16_error < 1e-3 and eight_bit_error < 0.05  # about 1/256 of the ±6 sigma range per value
    assert wire_bytes_and_error("8bit", small)[0] == wire_bytes_and_error("fp16", small)[0]


@pytest.mark.upstream
def test_plain_hivemind_initialization_shrinks_the_decayed_weights():
    model = AutoModelForMaskedLM.from_config(tiny_bert_config(100))
    args = TrainingArguments()
    lamb = Lamb(parameter_groups(model, args.weight_decay), lr=args.learning_rate, weight_decay=args.weight_decay)
    weight = model.bert.encoder.layer[0].attention.self.query.weight
    before = weight.detach().clone()
    initialize_optimizer_state_(lamb)  # what TrainingStateAverager does to an optimizer without state tensors
    assert torch.linalg.norm(weight) < 0.97 * torch.linalg.norm(before)


def test_our_lamb_starts_with_fresh_state_and_steps_as_a_fresh_lamb():
    torch.manual_seed(0)
    models = [AutoModelForMaskedLM.from_config(tiny_bert_config(100)) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    args = TrainingArguments()
    ours = lamb_factory(args)(parameter_groups(models[0], args.weight_decay))
    fresh = lamb_factory(args)(parameter_groups(models[1], args.weight_decay))
    fresh.state.clear()  # as torch_optimizer's Lamb starts: it creates its state on the first step
    assert all(state["step"] == 0 and not state["exp_avg"].any() for state in ours.state.values())
    assert len(ours.state) == sum(1 for _ in models[0].parameters())
    for _ in range(2):
        for model in models:
            for param in model.parameters():
                param.grad = torch.full_like(param, 0.01) + 0.001 * torch.arange(param.numel()).view_as(param)
        ours.step()
        fresh.step()
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.timeout(120)
def test_hivemind_optimizer_starts_lamb_from_the_initial_weights():
    model = AutoModelForMaskedLM.from_config(tiny_bert_config(100))
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        optimizer = optimizer_with_defaults(model, dht, "fresh_state")
        try:
            # the copies Lamb steps (offloaded), which hivemind writes back into the model after each global step
            names = {id(param): name for name, param in model.named_parameters()}
            model_order = [names[id(p)] for group in parameter_groups(model, 0.01) for p in group["params"]]
            stepped = [param for group in optimizer.opt.param_groups for param in group["params"]]
            for name, param in zip(model_order, stepped, strict=True):
                assert torch.equal(param, before[name]), name
            assert all(state["step"] == 0 for state in optimizer.opt.state.values())
        finally:
            optimizer.shutdown()
    finally:
        dht.shutdown()


def test_a_departing_peer_does_not_wait_twice_for_a_hung_background_round():
    """SIGTERM's path: finish_delayed_updates gives up on a round that never answers, and hivemind's shutdown must
    not wait for it again (up to averaging_timeout, 60 s), or the peer passes its deadline without saving."""
    model = AutoModelForMaskedLM.from_config(tiny_bert_config(100))
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    release = threading.Event()
    try:
        optimizer = optimizer_with_defaults(model, dht, "hung_round")
        averager = optimizer.state_averager
        # a background update stuck in its averaging round, as when the partner left mid-round
        averager.pending_updates.add(averager.step_executor.submit(release.wait))
        finish_delayed_updates(optimizer, timeout=0.2)
        shutdown = threading.Thread(target=optimizer.shutdown, daemon=True)
        shutdown.start()
        shutdown.join(timeout=20)
        assert not shutdown.is_alive(), "hivemind's shutdown waited for the round finish_delayed_updates gave up on"
    finally:
        release.set()
        dht.shutdown()


def test_a_departing_peer_cancels_the_rounds_it_leaves_so_that_no_thread_waits_for_them():
    """A background update left waiting on its round kept the process from exiting for 12 s after the model was
    saved (Python joins hivemind's executor threads), until the shutdown watchdog ended it. Leaving cancels the
    averagers' rounds: the update's thread ends, and a round begun afterwards is cancelled as it starts."""
    model = AutoModelForMaskedLM.from_config(tiny_bert_config(100))
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        optimizer = optimizer_with_defaults(model, dht, "left_round")
        try:
            averager = optimizer.state_averager
            # the last step's update, waiting on its gradient round (no groupmate ever comes), as hivemind's does
            round_ = optimizer.grad_averager.schedule_step(timeout=60)
            update = averager.step_executor.submit(round_.result, 60)
            averager.pending_updates.add(update)
            finish_delayed_updates(optimizer, timeout=0.5)
            assert round_.cancelled() and update.done(), "the update's thread still waits for its round"
            assert optimizer.grad_averager.schedule_step(timeout=60).cancelled()  # begun after leaving
            assert not averager.pending_updates
        finally:
            optimizer.shutdown()
    finally:
        dht.shutdown()


def test_a_peer_asked_to_stop_pre_schedules_no_gradient_round():
    """A leaving peer triggers no further round: one pre-scheduled after the stop is one hivemind's shutdown tags
    along at weight 0, holding the peer's exit up to averaging_timeout (a newcomer leaving that way was forced out
    unsaved after 25 s)."""
    model = AutoModelForMaskedLM.from_config(tiny_bert_config(100))
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        optimizer = optimizer_with_defaults(model, dht, "leaving")
        optimizer.leaving = threading.Event()
        tracker = optimizer.tracker

        def epoch_ends_now_and_maybe_schedule():
            with tracker.lock_global_progress:  # the tracker's own refresh does not overwrite the estimate meanwhile
                tracker.global_progress = dataclasses.replace(tracker.global_progress, eta_next_epoch=get_dht_time())
                optimizer._maybe_schedule_gradient_averaging()

        try:
            optimizer.leaving.set()
            epoch_ends_now_and_maybe_schedule()
            assert optimizer.scheduled_grads is None
            optimizer.leaving.clear()
            epoch_ends_now_and_maybe_schedule()
            assert optimizer.scheduled_grads is not None  # a peer that stays pre-schedules the same round
        finally:
            optimizer.shutdown()
    finally:
        dht.shutdown()


def formed_round() -> StepControl:
    """A pre-scheduled round whose group formed (hivemind's stage AWAITING_TRIGGER) and whose groupmates begin it
    only when ``.set_result`` is called: they have not reached the epoch's end."""
    control = StepControl(
        scheduled_time=get_dht_time(),
        deadline=get_dht_time() + 60,
        allow_retries=False,
        weight=1.0,
        data_for_gather=b"",
    )
    control.attach(MPFuture(), MPFuture())
    control.stage = AveragingStage.AWAITING_TRIGGER
    return control


@pytest.mark.parametrize("groupmates_finish", [False, True])
def test_a_departing_peer_tags_along_a_pre_scheduled_round_only_within_its_wait(groupmates_finish):
    """SIGTERM's path with a gradient round pre-scheduled before the stop: hivemind's shutdown tags along at weight 0
    until the groupmates finish, up to averaging_timeout (60 s here), past the shutdown deadline (a leaving newcomer
    was forced out unsaved after 25 s). It waits until finish_delayed_updates' deadline only, then cancels."""
    model = AutoModelForMaskedLM.from_config(tiny_bert_config(100))
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        optimizer = optimizer_with_defaults(model, dht, "tag_along")
        assert optimizer.averaging_timeout >= 60
        control = optimizer.scheduled_grads = formed_round()
        if groupmates_finish:  # within the wait: the round ends as it would in hivemind, with this peer at weight 0
            threading.Timer(1.0, control.set_result, args=({},)).start()
        started = time.monotonic()
        finish_delayed_updates(optimizer, timeout=3.0)
        shutdown = threading.Thread(target=optimizer.shutdown, daemon=True)
        shutdown.start()
        shutdown.join(timeout=40)
        assert not shutdown.is_alive(), "hivemind's shutdown tagged along past the departing peer's wait"
        assert control.triggered and control.weight == 0
        if groupmates_finish:
            assert control.done() and not control.cancelled()
        else:
            assert control.cancelled()
            assert time.monotonic() - started >= 3.0, "the round was not tagged along until the wait's end"
    finally:
        dht.shutdown()


def test_a_rollback_during_a_catch_up_restarts_its_count_of_values_replaced():
    """A backup put back while a newcomer catches up may undo what its parameter rounds gave it: the averager's count
    of the values still old restarts (collab.averagers' catch_ups, tests/unit/test_state_download.py); a rollback of
    a full member changes nothing there."""
    model = AutoModelForMaskedLM.from_config(tiny_bert_config(100))
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        optimizer = optimizer_with_defaults(model, dht, "rollback_catch_up")
        try:
            callback = CollaborativeCallback(dht, optimizer, model, b"peer", "rollback_catch_up", 600.0, 1)
            callback.on_train_begin(None)
            catch_ups = optimizer.state_averager.catch_ups
            callback.restore_backup()
            assert catch_ups.value == 0
            optimizer._begin_catching_up(state_epoch=3, swarm_epoch=6)
            assert catch_ups.value == 1
            callback.restore_backup()
            assert catch_ups.value == 2
        finally:
            optimizer.shutdown()
    finally:
        dht.shutdown()


def loads_at_check(optimizer, swarm_epoch: int) -> bool:
    """The step's check of synchronization (hivemind's, due once an epoch) with the swarm at ``swarm_epoch``; the
    optimizer's tracker must be shut down, or its reads of the DHT would overwrite that epoch."""
    optimizer.tracker.global_progress.epoch = swarm_epoch
    optimizer.tracker.fetched_global_progress_this_epoch.set()
    optimizer._should_check_synchronization_on_update = True
    return optimizer._should_load_state_from_peers()


def test_a_peer_one_epoch_behind_right_after_its_load_trains_on_at_the_swarm_s_epoch():
    """A load that read the swarm's epoch before the first peer past it was in the DHT leaves the peer at the state's
    epoch, and the step's check once an epoch then finds the swarm one epoch past it. The peer takes the swarm's
    epoch, as the load does for a state one epoch old, instead of downloading the whole state again (hivemind's): as
    a full member in the synchronous mode, catching up (so asking for a parameter round) in the low-communication
    mode. A peer that loaded nothing and has missed an update since its last parameter round, and one two epochs
    behind, load again."""
    model = AutoModelForMaskedLM.from_config(tiny_bert_config(100))
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        optimizer = optimizer_with_defaults(model, dht, "past_the_load")
        try:
            optimizer.tracker.shutdown()  # its reads of the DHT would overwrite the swarm's epoch set below

            def loads_again(swarm_epoch: int, epoch_of_last_load: int | None) -> bool:
                optimizer.epoch_of_last_load = epoch_of_last_load
                return loads_at_check(optimizer, swarm_epoch)

            optimizer.rounds_at_last_miss = optimizer._parameter_rounds_joined()
            assert loads_again(1, epoch_of_last_load=None) and optimizer.local_epoch == 0
            assert loads_again(2, epoch_of_last_load=0) and optimizer.local_epoch == 0
            assert not loads_again(1, epoch_of_last_load=0)
            assert optimizer.local_epoch == 1 and optimizer.tracker.local_progress.epoch == 1
            assert optimizer.catching_up_since is None and not optimizer.tracker.counts_no_samples
            optimizer.catches_up_from_one_epoch_behind = LowCommOptimizer.catches_up_from_one_epoch_behind
            assert not loads_again(2, epoch_of_last_load=1)
            assert optimizer.local_epoch == 2 and optimizer.tracker.local_progress.epoch == 2
            assert optimizer.catching_up_since is not None and optimizer.tracker.counts_no_samples
            assert optimizer.state_averager.state_lag.value == 1
        finally:
            optimizer.shutdown()
    finally:
        dht.shutdown()


def test_a_peer_one_epoch_behind_after_its_step_misses_one_update_until_a_parameter_round(tmp_path):
    """A step that ended once the swarm had finished the next epoch (its delayed update waited for a slow parameter
    round) leaves the peer one epoch behind at the step's check. In the synchronous mode it takes the swarm's epoch
    as a full member without that update (``took_swarm_epoch``, no ``out_of_sync``), instead of downloading the whole
    state as hivemind does; a second such miss before a parameter round with groupmates has averaged the first away
    loads the state, and one after it does not. Two epochs behind always loads."""
    model = AutoModelForMaskedLM.from_config(tiny_bert_config(100))
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    path = tmp_path / "events.jsonl"
    events.open_event_log(path)
    try:
        optimizer = optimizer_with_defaults(model, dht, "past_the_step")
        try:
            optimizer.tracker.shutdown()  # its reads of the DHT would overwrite the swarm's epoch set below
            rounds_joined = optimizer.state_averager.parameter_rounds_joined

            assert not loads_at_check(optimizer, 1)
            assert optimizer.local_epoch == 1 and optimizer.tracker.local_progress.epoch == 1
            assert optimizer.catching_up_since is None and optimizer.is_synchronized_with_peers()
            assert loads_at_check(optimizer, 2) and optimizer.local_epoch == 1, "a second miss with no parameter round"
            rounds_joined.value += 1  # as the state averager's process counts a parameter round with groupmates
            assert not loads_at_check(optimizer, 2) and optimizer.local_epoch == 2
            assert loads_at_check(optimizer, 4) and optimizer.local_epoch == 2
        finally:
            optimizer.shutdown()
    finally:
        events.open_event_log(None)
        dht.shutdown()
    written = [(record["event"], record.get("after")) for record in read_events(path)]
    assert [entry for entry in written if entry[0] in ("took_swarm_epoch", "out_of_sync")] == [
        ("took_swarm_epoch", "step"),
        ("out_of_sync", None),
        ("took_swarm_epoch", "step"),
        ("out_of_sync", None),
    ]


def test_a_peer_that_takes_the_swarm_s_epoch_after_its_step_leaves_that_step_s_round_running():
    """The step that ended one epoch behind triggered its gradient round, which its delayed update still waits for
    with its groupmates in the all-reduce: taking the swarm's epoch at the next check must not cancel it (the update
    then fell back to the local gradients, and hivemind raised InvalidStateError as the round ended). A round only
    pre-scheduled for the epoch the peer skips is cancelled."""
    model = AutoModelForMaskedLM.from_config(tiny_bert_config(100))
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        optimizer = optimizer_with_defaults(model, dht, "past_the_step_round")
        try:
            optimizer.tracker.shutdown()
            steps_round = pending_step_control()
            steps_round.allow_allreduce()
            optimizer.scheduled_grads = steps_round
            assert not loads_at_check(optimizer, 1) and optimizer.local_epoch == 1
            assert not steps_round.done() and optimizer.scheduled_grads is None
            skipped_round = pending_step_control()
            optimizer.scheduled_grads = skipped_round
            optimizer.state_averager.parameter_rounds_joined.value += 1
            assert not loads_at_check(optimizer, 2) and optimizer.local_epoch == 2
            assert skipped_round.cancelled() and optimizer.scheduled_grads is None
            steps_round.set_result([])
        finally:
            optimizer.shutdown()
    finally:
        dht.shutdown()


@dataclasses.dataclass
class WaitingStep:
    """A global step (``_update_global_epoch``) running in ``thread``, waiting for ``update``, the previous epoch's
    background update, which ends only once ``release`` is set; ``events_path`` holds the peer's events."""

    optimizer: hivemind.Optimizer
    update: object
    release: threading.Event
    thread: threading.Thread
    events_path: object


@contextlib.contextmanager
def step_waiting_for_the_last_update(tmp_path, prefix: str):
    model = AutoModelForMaskedLM.from_config(tiny_bert_config(100))
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    release = threading.Event()
    path = tmp_path / "events.jsonl"
    events.open_event_log(path)
    try:
        optimizer = optimizer_with_defaults(model, dht, prefix)
        optimizer.leaving = threading.Event()  # the trainer's stop event
        try:
            averager = optimizer.state_averager
            update = averager.step_executor.submit(release.wait)
            averager.pending_updates.add(update)
            thread = threading.Thread(target=optimizer._update_global_epoch, args=(None,), daemon=True)
            thread.start()
            yield WaitingStep(optimizer, update, release, thread, path)
        finally:
            release.set()
            optimizer.shutdown()
    finally:
        events.open_event_log(None)
        dht.shutdown()


def test_a_stop_during_the_wait_for_the_last_background_update_ends_the_step_at_once(tmp_path):
    """A global step first waits for the previous epoch's background update, up to averaging_timeout: a SIGTERM that
    came then held the loop there past the shutdown deadline (one peer of 39 in bench.swarm was forced out so, after
    23 s in that wait). Asked to leave, the step ends without stepping; finish_delayed_updates waits, bounded."""
    with step_waiting_for_the_last_update(tmp_path, "stop_in_step") as step:
        assert step.optimizer.averaging_timeout >= 60
        step.thread.join(timeout=1.0)
        assert step.thread.is_alive(), "a peer not asked to leave waits for its background update"
        asked = time.monotonic()
        step.optimizer.leaving.set()
        step.thread.join(timeout=30)
        assert not step.thread.is_alive()
        assert time.monotonic() - asked < 2.0, "the step kept waiting after the peer was asked to leave"
        assert step.optimizer.local_epoch == 0 and read_events(step.events_path, "step_begun") == []
        assert step.optimizer.state_averager.pending_updates == {step.update}  # left to finish_delayed_updates


def test_step_begun_is_written_when_the_round_is_triggered_not_before_the_previous_update_is_applied(tmp_path):
    """hivemind enters a global step, then waits for the previous step's delayed update (its round and optimizer
    step) before it triggers this step's gradient round: ``step_begun`` must come after that wait, or a round of the
    previous step that ends during it reads as this step's (bench.swarm's attribution)."""
    with step_waiting_for_the_last_update(tmp_path, "step_begun") as step:
        time.sleep(1.0)
        assert read_events(step.events_path, "step_begun") == [], "step_begun written while the last update ran"
        released_at = time.time()
        step.release.set()
        step.thread.join(timeout=30)
        assert not step.thread.is_alive()
        [begun] = read_events(step.events_path, "step_begun")
        assert begun["epoch"] == 0 and begun["time"] >= round(released_at, 3) - 0.001


def test_the_swarm_s_progress_is_read_while_a_step_waits_for_the_last_background_round():
    """A global step first waits for the previous step's background update (its parameter round). hivemind waited with
    the progress tracker paused: the swarm's epoch stood still, so the stale-round watchdog, which gives up a round
    once the swarm is two epochs past it, never could, and a peer whose parameter round found no groupmate stalled for
    its whole averaging timeout (161 s in tests/integration/test_last_round.py) while the swarm went on."""
    model = AutoModelForMaskedLM.from_config(tiny_bert_config(100))
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        optimizer = optimizer_with_defaults(model, dht, "unpaused_wait")
        try:
            tracker_free, step_waits = threading.Event(), threading.Event()
            tracker, averager = optimizer.tracker, optimizer.state_averager
            step_of_averager = averager.step

            def step_noting_the_wait(*args, **kwargs):  # the step's first call waits for the background round
                step_waits.set()
                return step_of_averager(*args, **kwargs)

            def background_round():  # once the step waits for it, the tracker must get its lock within 1 s
                step_waits.wait(timeout=10)
                if tracker.lock_global_progress.acquire(timeout=1.0):
                    tracker.lock_global_progress.release()
                    tracker_free.set()

            averager.step = step_noting_the_wait
            averager.pending_updates.add(averager.step_executor.submit(background_round))
            optimizer._update_global_epoch(None)
            assert tracker_free.is_set(), "the tracker stayed paused while the step waited"
            assert optimizer.local_epoch == 1
        finally:
            optimizer.shutdown()
    finally:
        dht.shutdown()


def test_a_newcomer_loads_the_state_of_a_peer_that_has_stepped():
    torch.manual_seed(0)
    models = [AutoModelForMaskedLM.from_config(tiny_bert_config(100)) for _ in range(2)]
    args = TrainingArguments()
    veteran, newcomer = (lamb_factory(args)(parameter_groups(model, args.weight_decay)) for model in models)
    for param in models[0].parameters():
        param.grad = torch.randn_like(param)
    veteran.step()
    load_optimizer_state(newcomer, *dump_optimizer_state(veteran))  # what load_state_from_peers does
    for got, sent in zip(newcomer.state.values(), veteran.state.values(), strict=True):
        assert got["step"] == 1
        assert torch.equal(got["exp_avg"], sent["exp_avg"]) and torch.equal(got["exp_avg_sq"], sent["exp_avg_sq"])
    for param in models[1].parameters():
        param.grad = torch.randn_like(param)
    newcomer.step()


def test_lamb_state_keeps_one_layout_when_a_gradient_is_zero():
    # A parameter whose gradient is all zeros (a head no batch reached yet) gets trust_ratio 1 from plain Lamb, a
    # Python number: its state would pack into fewer tensors than a peer's whose gradient was not zero.
    def stepped(optimizer_class):
        params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
        optimizer = optimizer_class(params, lr=0.1)
        params[0].grad, params[1].grad = torch.ones(3), torch.zeros(2)
        optimizer.step()
        return [optimizer.state[p]["trust_ratio"] for p in params]

    assert not torch.is_tensor(stepped(Lamb)[1])
    assert all(torch.is_tensor(ratio) for ratio in stepped(SameLayoutLamb))


@pytest.mark.parametrize(
    "options", [{"debias": True}, {"debias": False}, {"adam": True}, {"debias": True, "clamp_value": 0.5}]
)
@pytest.mark.parametrize("chunk_elements", [None, 40])
def test_lamb_steps_as_torch_optimizer_lamb_does(options, chunk_elements):
    # SameLayoutLamb steps tensors together, in runs of at most chunk_elements values (None: the device's choice, all
    # at once here; 40: the 35-value tensor alone, then the rest); torch_optimizer's Lamb, one by one, is the
    # reference. Two groups (weight decay or none), a gradient of zeros (trust ratio 1) and a tensor that misses a
    # step (its own count).

    def fresh():
        generator = torch.Generator().manual_seed(1)
        params = [
            torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in [(5, 7), (7,), (3,), (11, 2)]
        ]
        return params, [{"params": params[:2], "weight_decay": 0.01}, {"params": params[2:], "weight_decay": 0.0}]

    (reference, reference_groups), (ours, our_groups) = fresh(), fresh()
    reference_lamb, our_lamb = (
        Lamb(reference_groups, lr=0.1, **options),
        SameLayoutLamb(our_groups, lr=0.1, chunk_elements=chunk_elements, **options),
    )
    for step in range(6):
        generator = torch.Generator().manual_seed(step)
        for index, (theirs, mine) in enumerate(zip(reference, ours, strict=True)):
            if step == 1 and index == 3:
                theirs.grad = mine.grad = None
                continue
            grad = torch.randn(theirs.shape, generator=generator) * (0 if step == 0 and index == 2 else 1)
            theirs.grad, mine.grad = grad.clone(), grad.clone()
        reference_lamb.step()
        our_lamb.step()
    for theirs, mine, initial in zip(reference, ours, fresh()[0], strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-6)
        assert not torch.equal(mine, initial)
    assert [our_lamb.state[param]["step"] for param in ours] == [6, 6, 6, 5]
    assert float(our_lamb.state[ours[2]]["trust_ratio"]) != 1.0  # recomputed after the zero gradient of step 0


def test_a_gpu_steps_longer_runs_of_tensors_than_the_cpu():
    # on the CPU a model-sized scratch was handed back and refaulted every step; on a GPU each run costs a dozen
    # kernel launches from Python (docs/benchmarks/2026-11-28-nvidia-h200-gpu.md)
    cpu, gpu = foreach_chunk_elements(torch.device("cpu")), foreach_chunk_elements(torch.device("cuda", 0))
    assert cpu == 1 << 22
    assert gpu >= 16 * cpu
    assert gpu * 4 <= 256 * 2**20  # the fp32 scratch of one run stays within 256 MB


def pending_step_control() -> StepControl:
    """A gradient round's control as hivemind makes it, not yet ended. hivemind's MPFuture backend must first start
    from an MPFuture itself: started from a subclass, it keeps its table of futures on that subclass."""
    trigger, cancel = MPFuture(), MPFuture()
    now = get_dht_time()
    control = StepControl(scheduled_time=now, deadline=now + 60, allow_retries=False, weight=1.0, data_for_gather=b"")
    control.attach(trigger, cancel)
    return control


def test_why_a_gradient_round_gave_no_averages_is_read_from_its_control():
    """``failed_round_reason``: a round still running when the step stopped waiting outlasted averaging_timeout, a
    cancelled one was given up, a failed one names its error; one that averaged, or no round at all, is no failure."""
    assert failed_round_reason(None) is None
    assert failed_round_reason(pending_step_control()) == "timeout"
    cancelled = pending_step_control()
    cancelled.cancel()
    assert failed_round_reason(cancelled) == "cancelled"
    failed = pending_step_control()
    failed.set_exception(MatchmakingException("Unable to run All-Reduce: "))
    assert failed_round_reason(failed) == "MatchmakingException"
    averaged = pending_step_control()
    averaged.set_result([])
    assert failed_round_reason(averaged) is None


def test_a_gradient_round_that_outlasts_the_averaging_timeout_is_written_as_round_failed(tmp_path):
    """hivemind logs a gradient round it stopped waiting for and steps with the local gradients; ``round_failed``
    says so in the events, where bench.swarm splits the epochs that lost their round by cause. A lone peer's
    round finds no group: with averaging_timeout 1 s, the step waits 1 s and writes ``timeout``."""
    model = AutoModelForMaskedLM.from_config(tiny_bert_config(100))
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    path = tmp_path / "events.jsonl"
    events.open_event_log(path)
    try:
        optimizer = optimizer_with_defaults(model, dht, "round_failed")
        try:
            optimizer.averaging_timeout = 1.0
            control = optimizer.grad_averager.schedule_step(timeout=30)
            control.allow_allreduce()
            began = time.monotonic()
            optimizer._average_gradients_and_load_into_optimizer(control)
            assert 0.95 <= time.monotonic() - began < 10.0  # timers may end a fraction of a ms early by this clock
            assert [(r["epoch"], r["reason"]) for r in read_events(path, "round_failed")] == [(0, "timeout")]
            control.cancel()
        finally:
            optimizer.shutdown()
    finally:
        events.open_event_log(None)
        dht.shutdown()


def synchronous_peer(dht: hivemind.DHT, prefix: str, part_timeout: float):
    """A tiny BERT and the trainer's synchronous-mode optimizer with its own progress key (two in one process)."""
    model = AutoModelForMaskedLM.from_config(tiny_bert_config(100))
    optimizer = build_optimizer(
        model,
        dht,
        PeerArguments(experiment_prefix=prefix),
        OptimizerArguments(target_batch_size=8, matchmaking_time=2.0, next_chunk_timeout=part_timeout),
        AveragerArguments(),
        ProgressTrackerArguments(),
        TrainingArguments(per_device_train_batch_size=4, gradient_accumulation_steps=1),
        tracker_private_key=RSAPrivateKey(),
    )
    return model, optimizer


@pytest.mark.timeout(240)
def test_a_gradient_round_still_in_its_all_reduce_after_the_averaging_timeout_gives_its_averages(tmp_path):
    """A and B match a gradient round in advance; B starts its part LATE seconds after A, within the part timeout but
    after A's averaging timeout (1 s), so A's round is in its all-reduce when A's step stops waiting for it. hivemind
    then fell back to A's local gradients (zeros here) once the round let go of the tensors, and overwrote the
    average that B applied too; A now takes the round's average of its zeros and B's twos, and writes no
    ``round_failed``."""
    late, part_timeout = 4.0, 30.0
    prefix = f"allreducelate{time.time_ns()}"
    path = tmp_path / "events.jsonl"
    events.open_event_log(path)
    with two_dhts() as dhts:
        peers = [synchronous_peer(dht, prefix, part_timeout) for dht in dhts]
        try:
            for (model, optimizer), value in zip(peers, (0.0, 2.0), strict=True):
                for param in model.parameters():
                    param.grad = torch.full_like(param, value)
                optimizer.grad_averager.accumulate_grads_(batch_size=1)
            (_, a), (_, b) = peers
            controls = steps_matched_in_advance(
                [a.grad_averager, b.grad_averager], schedule=lambda averager: averager.schedule_step(timeout=60)
            )
            a.averaging_timeout = 1.0
            a.grad_averager.step(control=controls[0], wait=False)
            b_starts = threading.Timer(late, b.grad_averager.step, kwargs=dict(control=controls[1], wait=False))
            b_starts.start()
            began = time.monotonic()
            a._average_gradients_and_load_into_optimizer(controls[0])
            waited = time.monotonic() - began
            b_starts.join()
            with a.grad_averager.get_tensors() as averaged:
                values = torch.cat([tensor.flatten() for tensor in averaged])
            assert controls[0].done() and controls[0].exception() is None, controls[0]
            assert late - 1.0 <= waited < part_timeout, waited
            assert read_events(path, "round_failed") == []
            assert torch.all(values == 1.0), values.unique()  # the mean of 0 and 2, one sample each
        finally:
            events.open_event_log(None)
            for _, optimizer in peers:
                optimizer.shutdown()
