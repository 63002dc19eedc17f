"""The collaboration's optimizer, defined once: Lamb + parameter groups + linear warmup, wrapped by hivemind.

The trainer wraps it in ``hivemind.Optimizer``; the monitor rebuilds exactly the same optimizer inside a
``TrainingStateAverager`` to download the collaboration's state. Keep both on these builders.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import math
import time
from collections.abc import Callable

import hivemind
import torch
from hivemind.compression import (
    CompressionBase,
    Float16Compression,
    SizeAdaptiveCompression,
    Uniform8BitQuantization,
)
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.optim.state_averager import TrainingStateAverager
from torch_optimizer import Lamb
from transformers import get_linear_schedule_with_warmup

from arguments import (
    AveragerArguments,
    OptimizerArguments,
    PeerArguments,
    ProgressTrackerArguments,
    TrainingArguments,
)
from collab.averagers import (
    FiniteAveragingMixin,
    FiniteAveragingOptimizer,
    FiniteGradientAverager,
    FiniteTrainingStateAverager,
)
from collab.compression import make_codec
from collab.hivemind_fixes import FixedDecentralizedAverager
from collab.lowcomm import (
    PARAMETER_ROUND_VALUES,
    LowCommOptimizer,
    max_refresh_period,
    outer_optimizer_factory,
    parameter_round_every,
    progress_report_period,
)
from collab.prefetch import StatePrefetch
from collab.repairs import RepairRequests
from collab.timeouts import FP16_BYTES, Timeouts, derive_timeouts, estimate_transfers

logger = logging.getLogger(__name__)

NORM_LAYER_TYPES = (torch.nn.LayerNorm, torch.nn.GroupNorm, torch.nn.BatchNorm1d)


def _is_norm_layer(module: torch.nn.Module) -> bool:
    name = type(module).__name__
    return isinstance(module, NORM_LAYER_TYPES) or name.endswith(("LayerNorm", "RMSNorm"))


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: decayed weights, and biases plus normalisation weights that are never decayed."""
    no_decay = set()
    for module_name, module in model.named_modules():
        for param_name, _ in module.named_parameters(recurse=False):
            if param_name == "bias" or _is_norm_layer(module):
                no_decay.add(f"{module_name}.{param_name}" if module_name else param_name)
    named = [(name, param) for name, param in model.named_parameters() if param.requires_grad]
    return [
        {"params": [p for n, p in named if n not in no_decay], "weight_decay": weight_decay},
        {"params": [p for n, p in named if n in no_decay], "weight_decay": 0.0},
    ]


EIGHT_BIT_MIN_VALUES = 2**16  # smaller tensors (biases, norms) gain little from 8 bits and lose the most precision


def gradient_compression(name: str) -> CompressionBase:
    """``--grad_compression``: fp16 for every tensor, or 8-bit uniform quantization for tensors of
    ``EIGHT_BIT_MIN_VALUES`` values or more and fp16 for the rest (as sahajBERT averaged its gradients)."""
    if name == "8bit":
        return SizeAdaptiveCompression(
            threshold=EIGHT_BIT_MIN_VALUES, less=Float16Compression(), greater_equal=Uniform8BitQuantization()
        )
    return Float16Compression()


LAMB_STEP_OUTPUTS = ("weight_norm", "adam_norm", "trust_ratio")  # written by each Lamb step, never read by it


class SameLayoutLamb(Lamb):
    """torch_optimizer's Lamb (same arguments, same arithmetic), stepping all tensors of a group at once.

    - Same layout: the state always holds the step outputs as tensors. Lamb makes ``trust_ratio`` a Python 1 where a
      norm is 0 (a parameter with no gradient yet), which changes the tensors a peer shares: the monitor or a
      newcomer then refuses its state for the wrong layout (hivemind itself failed there with IndexError).
    - No host round trip: Lamb's ``if weight_norm == 0`` reads two values back from the device for every tensor, and
      launches a dozen kernels per tensor. On a GPU the low-communication mode steps Lamb after every mini-batch,
      where that loop cost more than the forward and backward of BERT-base; here one ``torch._foreach_*`` call per
      operation covers every tensor, and the zero-norm rule is a ``torch.where``.
    """

    def __init__(self, params, *args, chunk_elements: int | None = None, **kwargs):
        super().__init__(params, *args, **kwargs)
        self.chunk_elements = chunk_elements  # values stepped at once; None: ``foreach_chunk_elements``'s choice

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            by_step: dict[int, list[torch.Tensor]] = {}  # bias correction depends on each tensor's own step count
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    raise RuntimeError("Lamb does not support sparse gradients, please consider SparseAdam instead")
                state = self.state[param]
                if not state:
                    state.update(_zero_lamb_state(param))
                state["step"] += 1
                by_step.setdefault(int(state["step"]), []).append(param)
            for step, params in by_step.items():
                chunk_elements = self.chunk_elements or foreach_chunk_elements(params[0].device)
                for chunk in _chunks(params, chunk_elements):
                    self._step_tensors(group, chunk, step)
        return loss

    def _step_tensors(self, group: dict, params: list[torch.Tensor], step: int) -> None:
        beta1, beta2 = group["betas"]
        states = [self.state[param] for param in params]
        grads = [param.grad for param in params]
        exp_avgs = [state["exp_avg"] for state in states]
        exp_avg_sqs = [state["exp_avg_sq"] for state in states]
        torch._foreach_mul_(exp_avgs, beta1)
        torch._foreach_add_(exp_avgs, grads, alpha=1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
        bias_correction = math.sqrt(1 - beta2**step) / (1 - beta1**step) if self.debias else 1.0
        step_size = group["lr"] * bias_correction

        weight_norms = torch.stack(torch._foreach_norm(params)).clamp(0, self.clamp_value)
        adam_steps = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_add_(adam_steps, group["eps"])
        torch._foreach_div_(adam_steps, exp_avgs)
        torch._foreach_reciprocal_(adam_steps)  # exp_avg / (sqrt(exp_avg_sq) + eps), without another buffer
        if group["weight_decay"] != 0:
            torch._foreach_add_(adam_steps, params, alpha=group["weight_decay"])
        adam_norms = torch.stack(torch._foreach_norm(adam_steps))
        either_zero = (weight_norms == 0) | (adam_norms == 0)
        trust_ratios = torch.where(either_zero, torch.ones_like(weight_norms), weight_norms / adam_norms)
        for state, weight_norm, adam_norm, trust_ratio in zip(
            states, weight_norms.unbind(), adam_norms.unbind(), trust_ratios.unbind(), strict=True
        ):
            state["weight_norm"], state["adam_norm"], state["trust_ratio"] = weight_norm, adam_norm, trust_ratio
        scales = torch.ones_like(trust_ratios) if self.adam else trust_ratios
        torch._foreach_mul_(adam_steps, list((scales * -step_size).unbind()))
        torch._foreach_add_(params, adam_steps)


FOREACH_CHUNK_ELEMENTS = 1 << 22  # values per group of tensors stepped at once on the CPU
GPU_FOREACH_CHUNK_ELEMENTS = 1 << 26


def foreach_chunk_elements(device: torch.device) -> int:
    """Values that ``SameLayoutLamb`` steps at once on ``device``. On the CPU short runs keep the scratch small (a
    model-sized one was handed back and refaulted each step); on a GPU each run costs a dozen kernel launches from
    Python, so runs are 16 times longer there (a scratch of at most 256 MB)."""
    return FOREACH_CHUNK_ELEMENTS if device.type == "cpu" else GPU_FOREACH_CHUNK_ELEMENTS


def _chunks(tensors: list[torch.Tensor], max_elements: int) -> list[list[torch.Tensor]]:
    """``tensors`` in order, cut into runs of at most ``max_elements`` values (a larger tensor is a run alone)."""
    chunks: list[list[torch.Tensor]] = [[]]
    size = 0
    for tensor in tensors:
        if chunks[-1] and size + tensor.numel() > max_elements:
            chunks.append([])
            size = 0
        chunks[-1].append(tensor)
        size += tensor.numel()
    return chunks


def lamb_factory(training_args: TrainingArguments) -> Callable:
    """``params -> Lamb``: hivemind builds the optimizer itself (needed for offloading)."""

    def make_lamb(params):
        lamb = SameLayoutLamb(
            params,
            lr=training_args.learning_rate,
            betas=(training_args.adam_beta1, training_args.adam_beta2),
            eps=training_args.adam_epsilon,
            weight_decay=training_args.weight_decay,
            clamp_value=training_args.clamp_value,
            debias=True,
        )
        create_lamb_state(lamb)
        return lamb

    return make_lamb


@torch.no_grad()
def create_lamb_state(lamb: Lamb) -> None:
    """Lamb's state as its first step would create it (step 0, zero moments), made up front.

    hivemind's TrainingStateAverager needs optimizer state tensors from the start. Finding none, it creates them with
    one optimizer step on zero gradients, which for Lamb is not a no-op: the weight-decay term alone is scaled by the
    trust ratio to the weights' norm, so every decayed weight shrinks by the step size, and the step is counted,
    shifting the bias correction of every later step (held-out loss: docs/BENCHMARKS.md, parity). With the state made
    here hivemind skips that step.

    The state holds every key a step leaves (the last three are outputs Lamb never reads): hivemind packs the state a
    newcomer downloads into the newcomer's own state's structure, so both must have the same keys.
    """
    for group in lamb.param_groups:
        for param in group["params"]:
            lamb.state[param] = _zero_lamb_state(param)


def _zero_lamb_state(param: torch.Tensor) -> dict:
    return {
        "step": 0,
        "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
        "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
        "weight_norm": torch.tensor(0.0, device=param.device),
        "adam_norm": torch.tensor(0.0, device=param.device),
        "trust_ratio": torch.tensor(1.0, device=param.device),
    }


def scheduler_factory(training_args: TrainingArguments) -> Callable:
    """``optimizer -> LambdaLR``: linear warmup to learning_rate, then linear decay to 0 at total_steps.

    hivemind steps it once per global epoch, so both counts are global epochs.
    """

    def make_scheduler(optimizer):
        return get_linear_schedule_with_warmup(
            optimizer, num_warmup_steps=training_args.warmup_steps, num_training_steps=training_args.total_steps
        )

    return make_scheduler


def local_batch_size(training_args: TrainingArguments) -> int:
    """Samples one process adds per ``optimizer.step()``: per-device batch x accumulation. A torchrun peer's rank 0
    steps with ``world_size`` times this (trainer/loop.py), since every rank computed its own; a plain peer uses one
    device, so other GPUs of its machine add nothing unless it runs under torchrun."""
    return training_args.per_device_train_batch_size * training_args.gradient_accumulation_steps


# Values per model parameter in the state a newcomer downloads, fp16 on the wire as parameter rounds. The state is the
# parameters and Lamb's two moments; the low-communication mode's adds the outer momentum.
STATE_VALUES_PER_PARAMETER = {"sync": 3, "lowcomm": 4}
# Values per model parameter in the largest averaging round, fp16 (no gradient round is larger: 8-bit is about 1 byte a
# value): a parameter round, of the parameters, or in the low-communication mode of the anchors and outer momentum.
ROUND_VALUES_PER_PARAMETER = {"sync": 1, "lowcomm": PARAMETER_ROUND_VALUES}


def collaboration_timeouts(
    model: torch.nn.Module, optimizer_args: OptimizerArguments, averager_args: AveragerArguments
) -> Timeouts:
    """The averaging, chunk, state-download and shutdown timeouts for ``model`` over this peer's ``--bandwidth``
    (``collab.timeouts``), the flags given explicitly kept; logged in one line."""
    mode = "lowcomm" if optimizer_args.local_steps > 0 else "sync"
    transfers = estimate_transfers(
        parameters=sum(param.numel() for param in model.parameters() if param.requires_grad),
        round_values_per_parameter=ROUND_VALUES_PER_PARAMETER[mode],
        state_values_per_parameter=STATE_VALUES_PER_PARAMETER[mode],
        bytes_per_value=FP16_BYTES,
        model_bytes=sum(param.numel() * param.element_size() for param in model.parameters()),
        group_size=averager_args.target_group_size,
        bandwidth_mbit=optimizer_args.bandwidth,
    )
    timeouts = derive_timeouts(
        transfers,
        optimizer_args.matchmaking_time,
        averaging_timeout=optimizer_args.averaging_timeout,
        next_chunk_timeout=optimizer_args.next_chunk_timeout,
        load_state_timeout=optimizer_args.load_state_timeout,
        shutdown_timeout=optimizer_args.shutdown_timeout,
    )
    logger.info(timeouts.describe())
    return timeouts


def build_optimizer(
    model: torch.nn.Module,
    dht: hivemind.DHT,
    peer_args: PeerArguments,
    optimizer_args: OptimizerArguments,
    averager_args: AveragerArguments,
    tracker_args: ProgressTrackerArguments,
    training_args: TrainingArguments,
    tracker_private_key=None,
    timeouts: Timeouts | None = None,
    prefetch: StatePrefetch | None = None,
) -> hivemind.Optimizer:
    """hivemind.Optimizer over Lamb: accumulate to the collaboration's target batch, average fp16 gradients, step.
    With ``--local_steps`` > 0, the low-communication mode instead (``collab.lowcomm``, arguments from
    ``lowcomm_mode``): the same hivemind machinery, one global epoch per outer round.

    Its gradient and parameter rounds refuse a groupmate's non-finite values (``collab.averagers``).

    ``tracker_private_key``: the RSA key that signs this optimizer's progress records and repair requests, as
    hivemind's ProgressTracker takes it; the process's own key unless given, so two optimizers in one process need
    one each. ``timeouts``: ``collaboration_timeouts``' when not given. ``prefetch``: a state download begun before
    (``start_state_prefetch``), which the first load of the state from peers takes.
    """
    if timeouts is None:
        timeouts = collaboration_timeouts(model, optimizer_args, averager_args)
    # every field is an option of the tracker (hivemind's ProgressTracker, or SpacedProgressTracker's own period)
    tracker_opts = {
        **dataclasses.asdict(tracker_args),
        "progress_report_period": progress_report_period(
            tracker_args.progress_report_period, optimizer_args.local_steps, tracker_args.metadata_expiration
        ),
        "max_refresh_period": max_refresh_period(
            tracker_args.max_refresh_period,
            optimizer_args.local_steps,
            tracker_args.metadata_expiration,
            tracker_args.min_refresh_period,
        ),
    }
    if tracker_private_key is not None:
        tracker_opts["private_key"] = tracker_private_key
    if optimizer_args.local_steps > 0:
        mode = lowcomm_mode(model, optimizer_args, training_args)
        # signed with the tracker's key, which its DHT validates (the process's own unless given)
        subkey = RSASignatureValidator(tracker_private_key).local_public_key
        mode["repairs"] = RepairRequests(dht, peer_args.experiment_prefix, subkey)
    else:
        mode = dict(
            optimizer=lamb_factory(training_args),
            params=parameter_groups(model, training_args.weight_decay),
            scheduler=scheduler_factory(training_args),
            grad_compression=gradient_compression(optimizer_args.grad_compression),
            grad_averager_factory=FiniteGradientAverager,
        )
    state_every = parameter_round_every(
        optimizer_args.average_state_every, optimizer_args.local_steps, optimizer_args.pseudo_grad_compression
    )
    logger.info("Parameter rounds every %d global epochs", state_every)
    optimizer = optimizer_class(optimizer_args)(
        dht=dht,
        run_id=peer_args.experiment_prefix,
        target_batch_size=optimizer_args.target_batch_size - optimizer_args.batch_size_lead,
        batch_size_per_step=local_batch_size(training_args),
        matchmaking_time=optimizer_args.matchmaking_time,
        averaging_timeout=timeouts.averaging_timeout,
        next_chunk_timeout=timeouts.next_chunk_timeout,
        load_state_timeout=timeouts.load_state_timeout,
        offload_optimizer=optimizer_args.offload_optimizer,
        delay_optimizer_step=optimizer_args.delay_optimizer_step,
        delay_grad_averaging=optimizer_args.delay_grad_averaging,
        average_state_every=state_every,
        client_mode=peer_args.client_mode,
        state_averaging_compression=Float16Compression(),
        load_state_compression=Float16Compression(),
        averager_opts={
            "bandwidth": optimizer_args.bandwidth,
            "target_group_size": averager_args.target_group_size,
            "request_timeout": timeouts.request_timeout,
        },
        tracker_opts=tracker_opts,
        verbose=True,
        **mode,
    )
    optimizer.state_averager.prefetch = prefetch
    optimizer.state_averager.first_chunk_timeout = timeouts.first_chunk_timeout
    return optimizer


def optimizer_class(optimizer_args: OptimizerArguments) -> type[hivemind.Optimizer]:
    return LowCommOptimizer if optimizer_args.local_steps > 0 else FiniteAveragingOptimizer


def start_state_prefetch(
    dht: hivemind.DHT, peer_args: PeerArguments, optimizer_args: OptimizerArguments, timeouts: Timeouts
) -> StatePrefetch:
    """The peer's first download of the swarm's state, begun as soon as its DHT is up (``collab.prefetch``): pass it
    to ``build_optimizer``, and cancel it if the peer stops before its first load."""
    averager_class = optimizer_class(optimizer_args).state_averager_class
    return StatePrefetch.start(
        dht,
        peer_args.experiment_prefix,
        averager_class,
        timeouts.load_state_timeout,
        timeouts.next_chunk_timeout,
        first_chunk_timeout=timeouts.first_chunk_timeout,
    )


def inner_learning_rate(learning_rate: float, inner_batch: int, target_batch_size: int) -> float:
    """The low-communication mode's inner rate. ``--learning_rate`` is the rate of a step of ``target_batch_size``
    samples, the synchronous mode's step; an inner step takes ``inner_batch`` samples, so its rate is scaled by
    sqrt(inner_batch / target_batch_size), the square-root rule of Adam-family optimizers: many small noisy steps at
    the full rate move the parameters far more than the step they stand for."""
    return learning_rate * math.sqrt(min(1.0, inner_batch / target_batch_size))


def inner_lamb(
    model: torch.nn.Module, training_args: TrainingArguments, target_batch_size: int
) -> tuple[Lamb, Callable]:
    """The low-communication mode's inner Lamb over the model's parameters (at ``inner_learning_rate``) and its
    schedule. Trainers and the monitor both build the schedule: it adds ``initial_lr`` to Lamb's groups, part of the
    state layout they exchange."""
    rate = inner_learning_rate(training_args.learning_rate, local_batch_size(training_args), target_batch_size)
    inner_args = dataclasses.replace(training_args, learning_rate=rate)
    inner = lamb_factory(inner_args)(parameter_groups(model, training_args.weight_decay))
    return inner, scheduler_factory(inner_args)(inner)


def lowcomm_mode(model: torch.nn.Module, optimizer_args: OptimizerArguments, training_args: TrainingArguments) -> dict:
    """``LowCommOptimizer``'s own arguments: Lamb (and its schedule, by global epoch) as the inner optimizer over the
    model's parameters, the outer step's settings and the pseudo-gradient codec."""
    inner, inner_scheduler = inner_lamb(model, training_args, optimizer_args.target_batch_size)
    return dict(
        inner_optimizer=inner,
        inner_scheduler=inner_scheduler,
        codec=make_codec(optimizer_args.pseudo_grad_compression, topk_fraction=optimizer_args.topk_fraction),
        local_steps=optimizer_args.local_steps,
        outer_learning_rate=optimizer_args.outer_learning_rate,
        outer_momentum=optimizer_args.outer_momentum,
    )


CANCELLED_UPDATE_WAIT_S = 2.0  # seconds for a background update to end once its rounds are cancelled


def finish_delayed_updates(optimizer: hivemind.Optimizer, timeout: float) -> None:
    """Before leaving: let the background optimizer step and averaging round finish for at most ``timeout`` seconds,
    then apply what finished.

    The optimizer step comes first in the background update, so it is kept even when the averaging round hangs
    because the partner already left (hivemind would otherwise wait the whole ``averaging_timeout``). An update still
    running then has its rounds cancelled (``FixedDecentralizedAverager.cancel_rounds``) and is forgotten: its thread
    would otherwise hold the process's exit after the save, and ``hivemind.Optimizer.shutdown`` wait for it again, up
    to ``averaging_timeout`` more, and a peer stopped by SIGTERM pass its shutdown deadline.

    In what is left of ``timeout``, the groupmates of each averager's last round get what they still need from this
    peer (``FiniteAveragingMixin.wait_for_groupmates``), which leaving would cut; not after a round that hung. A
    round pre-scheduled before the stop is then tagged along at weight 0 by hivemind's shutdown until the same
    deadline (``FiniteAveragingOptimizer.leave_by``).
    """
    deadline = time.monotonic() + timeout
    optimizer.leave_by = deadline  # hivemind's shutdown tags along a pre-scheduled round only until then
    averager = optimizer.state_averager
    done, pending = concurrent.futures.wait(list(averager.pending_updates), timeout=timeout)
    if pending:
        logger.info("Leaving without the last background averaging round (no answer in %.0f s)", timeout)
        for each in (optimizer.grad_averager, averager):
            if isinstance(each, FixedDecentralizedAverager):
                each.cancel_rounds()
        concurrent.futures.wait(pending, timeout=CANCELLED_UPDATE_WAIT_S)  # so that a step it carried is applied
        averager.pending_updates = {update for update in averager.pending_updates if update.done()}
    averager.step(wait_for_delayed_updates=False, apply_delayed_updates=True)
    if pending:
        return
    for each in (optimizer.grad_averager, averager):
        if isinstance(each, FiniteAveragingMixin):
            started = time.monotonic()
            answered = each.wait_for_groupmates(deadline - started)
            if time.monotonic() - started >= 1.0:
                logger.info(
                    "Waited %.1f s for the groupmates of the last %s round (%d answered) before leaving",
                    time.monotonic() - started,
                    each.round_kind,
                    answered,
                )


def build_state_averager(
    model: torch.nn.Module,
    dht: hivemind.DHT,
    peer_args: PeerArguments,
    optimizer_args: OptimizerArguments,
    averager_args: AveragerArguments,
    training_args: TrainingArguments,
    timeouts: Timeouts | None = None,
) -> TrainingStateAverager:
    """The same optimizer as ``build_optimizer``'s, in a TrainingStateAverager that only downloads state.

    It shares the trainers' ``{experiment_prefix}_state_averager`` key, never joins averaging rounds and never
    serves its (possibly stale) copy to newcomers. Like a trainer's, it refuses a lying donor's state
    (``FiniteTrainingStateAverager``) and waits ``timeouts.next_chunk_timeout`` for each piece of it.
    """
    if timeouts is None:
        timeouts = collaboration_timeouts(model, optimizer_args, averager_args)
    if optimizer_args.local_steps > 0:  # the low-communication mode's state: anchors, outer momentum, inner Lamb
        inner, _ = inner_lamb(model, training_args, optimizer_args.target_batch_size)
        optimizer = outer_optimizer_factory(optimizer_args.outer_learning_rate, optimizer_args.outer_momentum, inner)
        scheduler = None
    else:
        optimizer, scheduler = lamb_factory(training_args), scheduler_factory(training_args)
    return FiniteTrainingStateAverager(
        dht=dht,
        run_id=peer_args.experiment_prefix,
        prefix=f"{peer_args.experiment_prefix}_state_averager",
        optimizer=optimizer,
        params=parameter_groups(model, training_args.weight_decay),
        scheduler=scheduler,
        offload_optimizer=optimizer_args.offload_optimizer,
        custom_gradients=optimizer_args.offload_optimizer,
        compression=Float16Compression(),
        state_compression=Float16Compression(),
        bandwidth=optimizer_args.bandwidth,
        target_group_size=averager_args.target_group_size,
        next_chunk_timeout=timeouts.next_chunk_timeout,
        allow_state_sharing=False,
        start=True,
    )
