"""The low-communication mode's pure parts and one real peer alone in its swarm (collab/lowcomm.py)."""

import concurrent.futures
import contextlib
import threading
from collections.abc import Iterator

import hivemind
import pytest
import torch
from hivemind.optim.state_averager import dump_optimizer_state, load_optimizer_state
from transformers import AutoModelForMaskedLM

from arguments import (
    AveragerArguments,
    OptimizerArguments,
    PeerArguments,
    ProgressTrackerArguments,
    TrainingArguments,
)
from collab.averaging_events import served_state_bytes
from collab.errors import ConfigError
from collab.lowcomm import (
    LowCommOptimizer,
    OuterNesterov,
    inner_schedule_position,
    max_refresh_period,
    outer_optimizer_factory,
    parameter_round_every,
    progress_report_period,
    pseudo_gradient_,
    rebase_,
    round_target_samples,
)
from collab.optim import (
    build_optimizer,
    build_state_averager,
    create_lamb_state,
    inner_learning_rate,
    lamb_factory,
    parameter_groups,
)
from tests.local_dht import average_parameters_once, two_dhts
from trainer.model import tiny_bert_config


def test_outer_nesterov_step_matches_the_hand_computed_value():
    # buf = 0.9 buf + g; p -= 0.7 (g + 0.9 buf): from p = 1 with g = 0.5 twice, p = 0.335, then -0.6135
    param = torch.nn.Parameter(torch.tensor([1.0]))
    outer = OuterNesterov([{"params": [param]}], lr=0.7, momentum=0.9, inner=torch.optim.SGD([torch.zeros(1)], lr=1))
    param.grad = torch.tensor([0.5])
    outer.step()
    assert param.item() == pytest.approx(0.335)
    outer.step()
    assert param.item() == pytest.approx(-0.6135)


def test_outer_optimizer_ignores_the_inner_groups_weight_decay():
    model = torch.nn.Linear(3, 3)
    groups = parameter_groups(model, weight_decay=0.5)
    inner = lamb_factory(TrainingArguments())(groups)
    outer = outer_optimizer_factory(0.7, 0.0, inner)([dict(group) for group in groups])
    before = [p.detach().clone() for p in model.parameters()]
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    outer.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_pseudo_gradient_points_from_the_local_progress_back_to_the_anchor():
    out = torch.empty(2)
    pseudo_gradient_(out, anchor=torch.tensor([1.0, 2.0]), current=torch.tensor([0.5, 2.5]))
    assert out.tolist() == [0.5, -0.5]


def test_rebase_keeps_the_inner_progress_made_since_the_rounds_end():
    reference = torch.tensor([0.5, 2.5])  # the parameters when the round ended
    current = torch.tensor([0.25, 3.0])  # inner steps since moved them by (-0.25, +0.5)
    rebase_(current, new_anchor=torch.tensor([10.0, 20.0]), reference=reference)
    assert current.tolist() == [9.75, 20.5]
    assert reference.tolist() == [10.0, 20.0]
    rebase_(current, new_anchor=torch.tensor([10.0, 20.0]), reference=reference)  # applying it twice is a no-op
    assert current.tolist() == [9.75, 20.5]


def test_rebase_keeps_the_progress_while_a_background_round_changes_the_anchor():
    """A parameter round averages the anchor in place while the loop rebases on it: whatever the rebase reads, the
    progress made since the round's end (current - reference) stays exactly what it was (values are whole numbers,
    exact in float32), so no offset enters later pseudo-gradients."""
    anchor = torch.zeros(1 << 18)
    reference, current = torch.zeros_like(anchor), torch.full_like(anchor, 5.0)
    stop = threading.Event()

    def average_in_place():
        while not stop.is_set():
            anchor.add_(1.0)

    background = threading.Thread(target=average_in_place)
    background.start()
    try:
        for _ in range(300):
            rebase_(current, anchor, reference)
    finally:
        stop.set()
        background.join()
    rebase_(current, anchor, reference)
    assert anchor[0] > 0, "the background round never ran"
    assert torch.equal(current - reference, torch.full_like(anchor, 5.0))
    assert torch.equal(reference, anchor)


def test_a_round_is_local_steps_global_batches_of_swarm_samples():
    assert round_target_samples(local_steps=10, target_batch_size=384) == 3840


def test_the_inner_schedule_stands_at_the_swarms_global_batch_one_ahead():
    # round 3 of H 50 spans global batches 150..199; 600 samples of 256 into it: batch 152, its rate one ahead
    assert inner_schedule_position(epoch=3, local_steps=50, round_samples=600, target_batch_size=256) == 153
    assert inner_schedule_position(epoch=0, local_steps=50, round_samples=0, target_batch_size=256) == 1
    assert inner_schedule_position(epoch=0, local_steps=50, round_samples=255, target_batch_size=256) == 1
    assert inner_schedule_position(epoch=0, local_steps=50, round_samples=256, target_batch_size=256) == 2
    # the swarm past the round's samples (ahead of its end) stays within the round
    assert inner_schedule_position(epoch=0, local_steps=50, round_samples=10**6, target_batch_size=256) == 50
    assert inner_schedule_position(epoch=7, local_steps=1, round_samples=300, target_batch_size=256) == 8


def test_state_dict_carries_outer_momentum_and_inner_lamb_to_a_newcomer():
    """What load_state_from_peers and the monitor's checkpoint rely on: one structure with both optimizers."""
    torch.manual_seed(0)
    args = TrainingArguments()
    outers = []
    for _ in range(2):
        model = torch.nn.Linear(4, 4)
        inner = lamb_factory(args)(parameter_groups(model, args.weight_decay))
        anchors = [{"params": [p.detach().clone() for p in group["params"]]} for group in inner.param_groups]
        outers.append(outer_optimizer_factory(0.7, 0.9, inner)(anchors))
    veteran, newcomer = outers
    for group in veteran.inner.param_groups + veteran.param_groups:
        for param in group["params"]:
            param.grad = torch.randn_like(param)
    veteran.inner.step()
    veteran.step()
    load_optimizer_state(newcomer, *dump_optimizer_state(veteran))
    for mine, theirs in zip(newcomer.state.values(), veteran.state.values(), strict=True):
        assert torch.equal(mine["momentum_buffer"], theirs["momentum_buffer"])
    for mine, theirs in zip(newcomer.inner.state.values(), veteran.inner.state.values(), strict=True):
        assert mine["step"] == theirs["step"] == 1
        assert torch.equal(mine["exp_avg"], theirs["exp_avg"])


def test_the_shared_layout_does_not_depend_on_the_batches_a_peer_saw():
    """Lamb stores trust_ratio as a Python 1 where a gradient is 0: that must not change what peers exchange."""
    args = TrainingArguments()
    layouts = []
    for zero_grad in (False, True):
        model = torch.nn.Linear(4, 4)
        inner = lamb_factory(args)(parameter_groups(model, args.weight_decay))
        anchors = [{"params": [p.detach().clone() for p in group["params"]]} for group in inner.param_groups]
        outer = outer_optimizer_factory(0.7, 0.9, inner)(anchors)
        for param in model.parameters():
            param.grad = torch.zeros_like(param) if zero_grad else torch.randn_like(param)
        inner.step()
        layouts.append([entry["type"] for entry in dump_optimizer_state(outer)[0]])
    assert layouts[0] == layouts[1]


@pytest.mark.parametrize(
    ("settings", "flag"),
    [
        ({"local_steps": -1}, "local_steps"),
        ({"local_steps": 10**9}, "local_steps"),
        ({"outer_learning_rate": 0.0}, "outer_learning_rate"),
        ({"outer_learning_rate": float("inf")}, "outer_learning_rate"),
        ({"outer_momentum": 1.0}, "outer_momentum"),
        ({"topk_fraction": 1.5}, "topk_fraction"),
        (
            {
                "local_steps": 4,
                "offload_optimizer": False,
                "delay_optimizer_step": False,
                "delay_grad_averaging": False,
            },
            "offload_optimizer",
        ),
    ],
)
def test_bad_low_communication_settings_name_their_flag(settings, flag):
    with pytest.raises(ConfigError) as error:
        OptimizerArguments(**settings)
    assert error.value.field == flag and str(error.value).startswith(f"--{flag}:")


def test_inner_steps_take_the_rate_scaled_by_the_root_of_their_share_of_the_target_batch():
    assert inner_learning_rate(0.2, inner_batch=16, target_batch_size=256) == pytest.approx(0.05)
    assert inner_learning_rate(0.2, inner_batch=16, target_batch_size=1024) == pytest.approx(0.025)
    assert inner_learning_rate(0.2, inner_batch=512, target_batch_size=256) == 0.2  # never above the step's rate


def test_a_peer_alone_takes_inner_steps_then_an_outer_step_per_round():
    """Alone, a round's pseudo-gradient is this peer's own: once the background outer step is applied, anchor and
    parameters are the start moved by 0.7 x (1 + 0.9) x the pseudo-gradient (Nesterov's first step)."""
    torch.manual_seed(0)
    model = AutoModelForMaskedLM.from_config(tiny_bert_config(100))
    start = [p.detach().clone() for group in parameter_groups(model, 0.01) for p in group["params"]]
    optimizer_args = OptimizerArguments(target_batch_size=8, local_steps=3, matchmaking_time=1.0)
    training_args = TrainingArguments(per_device_train_batch_size=4, gradient_accumulation_steps=1)
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        optimizer = build_optimizer(
            model,
            dht,
            PeerArguments(experiment_prefix="lowcomm_alone"),
            optimizer_args,
            AveragerArguments(),
            ProgressTrackerArguments(),
            training_args,
        )
        try:
            assert isinstance(optimizer, LowCommOptimizer) and optimizer.target_batch_size == 24
            assert optimizer.tracker.progress_report_period == 6.0  # 2 s x 3 local steps
            assert optimizer.tracker.max_refresh_period == 30.0  # 10 s x 3 local steps
            # inner steps of 4 samples stand for steps of 8: the rate times sqrt(1/2)
            inner_rates = [group["initial_lr"] for group in optimizer.inner_optimizer.param_groups]
            assert inner_rates == pytest.approx([training_args.learning_rate * 0.5**0.5] * len(inner_rates))
            batch = {"input_ids": torch.randint(0, 100, (4, 8)), "labels": torch.randint(0, 100, (4, 8))}
            first_step_rates = None
            while optimizer.local_epoch == 0:
                model(**batch).loss.backward()
                optimizer.step()
                first_step_rates = first_step_rates or [g["lr"] for g in optimizer.inner_optimizer.param_groups]
                optimizer.zero_grad()
            # the schedule counts global batches of 8 (warmup 2, decay to 1000): the first at half the rate
            assert first_step_rates == pytest.approx([rate * 0.5 for rate in inner_rates])
            main = [p for group in optimizer.param_groups for p in group["params"]]
            at_round_end = [p.detach().clone() for p in main]  # the outer step runs in the background
            optimizer.state_averager.step(wait_for_delayed_updates=True)
            # round 1 begins with global batch 3 (3 a round), its rate one ahead: batch 4's of the linear decay
            assert [g["lr"] for g in optimizer.inner_optimizer.param_groups] == pytest.approx(
                [rate * (1000 - 4) / (1000 - 2) for rate in inner_rates]
            )
            anchors = [p for group in optimizer.opt.param_groups for p in group["params"]]
            for first, end, anchor, now in zip(start, at_round_end, anchors, main, strict=True):
                expected = first - 0.7 * 1.9 * (first - end)
                assert torch.allclose(anchor, expected, atol=1e-6)
                assert torch.allclose(now, expected, atol=1e-6)
            assert sum((a - s).abs().sum().item() for a, s in zip(anchors, start, strict=True)) > 0
            # a parameter round averages the anchors and the outer momentum: 4 bytes a parameter in fp16
            with optimizer.state_averager.get_tensors() as averaged:
                assert [t.shape for t in averaged] == [a.shape for a in anchors] * 2
            # the monitor's download builds the same layout as a trainer that has stepped (else it refuses the state)
            monitor = build_state_averager(
                AutoModelForMaskedLM.from_config(tiny_bert_config(100)),
                dht,
                PeerArguments(experiment_prefix="lowcomm_alone_monitor"),
                optimizer_args,
                AveragerArguments(),
                training_args,
            )
            try:
                served, wanted = dump_optimizer_state(optimizer.opt)[0], dump_optimizer_state(monitor.optimizer)[0]
                assert [entry["type"] for entry in served] == [entry["type"] for entry in wanted]
            finally:
                monitor.shutdown()
            assert optimizer.local_epoch == 1
        finally:
            optimizer.shutdown()
    finally:
        dht.shutdown()


def test_a_parameter_round_makes_anchors_and_outer_momentum_whole_after_a_missed_round():
    """After a given-up round each peer took the outer step on its own pseudo-gradient, so anchors and outer momenta
    differ. One parameter round (as a repair request starts one) leaves both peers with the mean of each: a momentum
    left apart would push the anchors apart again at every later outer step. The second peer loaded the first's state
    before, as a newcomer does: hivemind averages the momentum buffers it was built with, which a load must keep."""
    optimizer_args = OptimizerArguments(target_batch_size=8, local_steps=3, matchmaking_time=1.0)
    with two_dhts() as dhts, optimizers_on(dhts, "lowcomm_repair", optimizer_args) as optimizers:
        veteran, newcomer = (optimizer.state_averager.optimizer for optimizer in optimizers)
        load_optimizer_state(newcomer, *dump_optimizer_state(veteran))
        start = [anchor.detach().clone() for anchor in outer_parameters(optimizers[0])]
        for optimizer, own_pseudo_gradient in zip(optimizers, (1.0, 3.0), strict=True):
            for anchor in outer_parameters(optimizer):
                anchor.grad = torch.full_like(anchor, own_pseudo_gradient)
            optimizer.state_averager.optimizer.step()  # momentum = its own, anchor -= 0.7 x 1.9 x its own
        average_parameters_once([optimizer.state_averager for optimizer in optimizers])
        for optimizer in optimizers:
            outer = optimizer.state_averager.optimizer
            for first, anchor in zip(start, outer_parameters(optimizer), strict=True):
                assert torch.equal(outer.state[anchor]["momentum_buffer"], torch.full_like(anchor, 2.0))
                assert torch.allclose(anchor, first - 0.7 * 1.9 * 2.0, atol=1e-2)


def test_peers_end_a_pseudo_gradient_round_on_the_8bit_wire_with_the_same_average():
    """Each peer adds the round's average to its own pseudo-gradient: with hivemind's replies (compressed differences)
    two peers would end about a percent of the values apart on the 8-bit wire, and their anchors with them, at every
    round. The pseudo-gradient averager asks for a shared average (``collab.shared_average``): both end alike."""
    optimizer_args = OptimizerArguments(
        target_batch_size=8,
        local_steps=3,
        matchmaking_time=1.0,
        pseudo_grad_compression="8bit",
        # a groupmate's part late on a busy machine is waited for, not kept local (the property is about whole rounds)
        next_chunk_timeout=10.0,
    )
    with two_dhts() as dhts, optimizers_on(dhts, "lowcomm_shared", optimizer_args) as optimizers:
        generator = torch.Generator().manual_seed(11)
        own = []
        for optimizer in optimizers:  # each peer's contribution, as its round's capture leaves it
            contributions = optimizer.grad_averager._local_accumulators
            for tensor in contributions:
                tensor.copy_(torch.randn(tensor.shape, generator=generator))
            own.append([tensor.clone() for tensor in contributions])
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            rounds = [pool.submit(opt.grad_averager.step, weight=1.0, timeout=30) for opt in optimizers]
            assert all(len(done.result(timeout=60)) == 2 for done in rounds), "the peers did not average together"
        results = []
        for optimizer in optimizers:
            assert optimizer.grad_averager.kept_local_last_round.value == 0, "a reducer's parts came too late"
            with optimizer.grad_averager.get_tensors() as tensors:
                results.append([tensor.clone() for tensor in tensors])
        for first, second, mine, theirs in zip(*results, *own, strict=True):
            mean = (mine + theirs) / 2
            assert (first - mean).norm() <= 0.01 * mean.norm()  # the 8-bit wire's error on the average
            assert (second - first).abs().max() <= 4 * torch.finfo(torch.float32).eps * mine.abs().max()


@contextlib.contextmanager
def optimizers_on(dhts, prefix: str, optimizer_args: OptimizerArguments) -> Iterator[list[LowCommOptimizer]]:
    """A low-communication optimizer of the same tiny model (the same start) on each of ``dhts``, shut down after."""
    optimizers = []
    try:
        for dht in dhts:
            torch.manual_seed(0)
            optimizers.append(
                build_optimizer(
                    AutoModelForMaskedLM.from_config(tiny_bert_config(100)),
                    dht,
                    PeerArguments(experiment_prefix=prefix),
                    optimizer_args,
                    AveragerArguments(target_group_size=2),
                    ProgressTrackerArguments(),
                    TrainingArguments(per_device_train_batch_size=4, gradient_accumulation_steps=1),
                )
            )
        yield optimizers
    finally:
        for optimizer in optimizers:
            optimizer.shutdown()


def test_a_peer_that_stepped_alone_asks_for_a_repair_at_its_first_round_with_others():
    """Peers that start together each take their first outer steps alone (no other peer in sight yet), so their
    anchors differ from the start; none of those steps is a failed round with others, yet the first round with others
    must ask for a parameter round (``left_apart``), and only the first."""
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        optimizer = build_optimizer(
            AutoModelForMaskedLM.from_config(tiny_bert_config(100)),
            dht,
            PeerArguments(experiment_prefix="lowcomm_stepped_alone"),
            OptimizerArguments(target_batch_size=8, local_steps=3, matchmaking_time=1.0),
            AveragerArguments(),
            ProgressTrackerArguments(),
            TrainingArguments(per_device_train_batch_size=4, gradient_accumulation_steps=1),
        )
        try:
            assert optimizer.tracker.global_progress.num_peers <= 1  # none in sight (its own record unread yet)
            optimizer._load_local_gradients_into_optimizer()  # hivemind's step with no other peer: its own
            assert not optimizer.left_apart, "a step alone in a swarm of one left nothing apart yet"
            optimizer._load_local_gradients_into_optimizer()
            optimizer._load_averaged_gradients_into_optimizer_()  # the first round averaged with others
            assert optimizer.left_apart
            optimizer.left_apart = False  # as the next step's repair request does
            optimizer._load_averaged_gradients_into_optimizer_()
            assert not optimizer.left_apart, "a second round with others asked again"
        finally:
            optimizer.shutdown()
    finally:
        dht.shutdown()


def outer_parameters(optimizer: LowCommOptimizer) -> list[torch.Tensor]:
    return [anchor for group in optimizer.state_averager.optimizer.param_groups for anchor in group["params"]]


def test_progress_is_published_local_steps_times_less_often_between_outer_rounds():
    assert progress_report_period(None, 0, 60.0) == 2.0  # the synchronous mode
    assert progress_report_period(None, 5, 60.0) == 10.0  # 2 s x 5: as many records to a round
    assert progress_report_period(None, 50, 60.0) == 30.0  # capped at half the record's lifetime
    assert progress_report_period(None, 50, 300.0) == 100.0
    assert progress_report_period(0.5, 50, 60.0) == 0.5  # the flag wins


def test_progress_is_read_at_most_local_steps_times_less_often_far_from_an_outer_round():
    assert max_refresh_period(None, 0, 60.0, 0.5) == 10.0  # the synchronous mode, as before
    assert max_refresh_period(None, 0, 60.0, 12.0) == 12.0  # never under --min_refresh_period
    assert max_refresh_period(None, 2, 60.0, 0.5) == 20.0  # 10 s x 2
    assert max_refresh_period(None, 50, 60.0, 0.5) == 30.0  # every live record still read twice in its lifetime
    assert max_refresh_period(None, 50, 300.0, 0.5) == 150.0
    assert max_refresh_period(None, 50, 60.0, 40.0) == 40.0
    assert max_refresh_period(5.0, 50, 60.0, 0.5) == 5.0  # the flag wins


def test_parameter_rounds_come_every_second_epoch_in_sync_mode_and_rarely_between_pseudo_gradient_rounds():
    assert parameter_round_every(None, 0, "8bit") == 2
    # 4 bytes a parameter (anchor and momentum in fp16) at most an eighth of the pseudo-gradients' bytes per round
    assert parameter_round_every(None, 10, "fp16") == 16  # 4 / (0.125 x 2)
    assert parameter_round_every(None, 10, "8bit") == 32  # 4 / (0.125 x 1)
    assert parameter_round_every(None, 50, "topk") == 32  # 4 / (0.125 x 0.079) = 405, capped
    assert parameter_round_every(3, 50, "topk") == 3  # the flag wins
    assert parameter_round_every(1, 0, "fp16") == 1


@pytest.mark.parametrize("value", [0, -2])
def test_a_parameter_round_period_below_one_is_refused_naming_the_flag(value):
    with pytest.raises(ConfigError, match="average_state_every"):
        OptimizerArguments(average_state_every=value)


def test_a_served_low_communication_state_counts_anchor_momentum_and_both_lamb_moments():
    model = torch.nn.Linear(100, 10)  # 1,010 parameters
    inner = lamb_factory(TrainingArguments())(parameter_groups(model, 0.01))
    create_lamb_state(inner)
    anchors = [{"params": [p.detach().clone() for p in model.parameters()]}]
    outer = outer_optimizer_factory(0.7, 0.9, inner)(anchors)
    fp32 = 4 * 1010
    assert 4 * fp32 <= served_state_bytes(outer) <= 4 * fp32 + 64  # 64: Lamb's step counters, if tensors
