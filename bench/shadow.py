"""A bench-only peer with shadow compute: ``python -m bench.shadow STEPS.jsonl [trainer flags] [--layers N]
[--micro_batch_s S]``.

Forward and backward are a calibrated wait (``--micro_batch_s``, the time the GPU represented takes for a
micro-batch); the gradients have GPT-2 small's shapes (124M parameters with 12 layers), so real-size payloads cross
the link, through the same optimizer as real peers (``collab.optim.build_optimizer``: hivemind.Optimizer over Lamb).
In the low-communication mode the inner optimizer's step is part of the wait too (``ShadowInnerStep``).
Valid for utilisation and traffic, never for loss. Appends ``[time, samples, epoch]`` to STEPS.jsonl per step, as
``bench.probe`` does. Memory: about 9 copies of the parameters in fp32 per peer (model, gradients, offloaded
parameters and gradients, Lamb's two moments, the averagers' buffers), 4.5 GB with 12 layers.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from pathlib import Path

import torch

from trainer.local import wait_until

GPT2_VOCAB, GPT2_POSITIONS, GPT2_HIDDEN = 50257, 1024, 768
START_TIMEOUT = 600.0
MICRO_BATCH = 16  # samples a shadow step counts, as the trainer's default per_device_train_batch_size

logger = logging.getLogger(__name__)


def gpt2_shapes(layers: int = 12) -> list[tuple[int, ...]]:
    """GPT-2 small's parameter shapes (tied output embedding), with ``layers`` transformer blocks."""
    h = GPT2_HIDDEN
    block = [(h,), (h,), (h, 3 * h), (3 * h,), (h, h), (h,), (h,), (h,), (h, 4 * h), (4 * h,), (4 * h, h), (h,)]
    return [(GPT2_VOCAB, h), (GPT2_POSITIONS, h), *block * layers, (h,), (h,)]


def shadow_numel(layers: int = 12) -> int:
    return sum(torch.Size(shape).numel() for shape in gpt2_shapes(layers))


@dataclasses.dataclass
class ShadowArguments:
    layers: int = dataclasses.field(default=12, metadata={"help": "GPT-2 blocks whose shapes the gradients take"})
    micro_batch_s: float = dataclasses.field(
        default=0.2, metadata={"help": "Seconds of emulated forward and backward per micro-batch (the GPU's time)"}
    )
    ready_file: str | None = dataclasses.field(
        default=None, metadata={"help": "Created once this peer's optimizer is built"}
    )
    start_file: str | None = dataclasses.field(
        default=None,
        metadata={
            "help": "Wait for this file before the first step, so that peers start together at epoch 0 and none "
            "has to download a 124M-parameter state while the others run ahead"
        },
    )

    def __post_init__(self) -> None:
        from collab.errors import ConfigError

        if not 1 <= self.layers <= 48:
            raise ConfigError(f"--layers: must be 1 to 48 (got {self.layers})")
        if not 0 < self.micro_batch_s <= 60:
            raise ConfigError(f"--micro_batch_s: must be over 0 and at most 60 seconds (got {self.micro_batch_s})")


class ShadowModel(torch.nn.Module):
    """Parameters of GPT-2's shapes with fixed random gradients; nothing is ever computed from them."""

    def __init__(self, layers: int):
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.weights = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(shape, generator=generator) * 0.02) for shape in gpt2_shapes(layers)
        )
        for param in self.weights:
            param.grad = torch.randn(param.shape, generator=generator) * 1e-3


class ShadowInnerStep:
    """The low-communication mode's inner optimizer step as the GPU represented takes it: inside ``--micro_batch_s``.

    The real inner step is Lamb over every parameter on these CPUs, far longer than the wait it stands beside, so the
    figures would measure it instead of the link. Once every ``local_steps`` calls (once a round) the parameters take
    one SGD step on their fixed gradients, so a round's pseudo-gradients are real values, not zeros, for the codec."""

    def __init__(self, model: torch.nn.Module, local_steps: int, learning_rate: float = 1e-2):
        self.params = [param for param in model.parameters() if param.grad is not None]
        self.local_steps, self.learning_rate, self.calls = local_steps, learning_rate, 0

    @torch.no_grad()
    def step(self) -> None:
        if self.calls % self.local_steps == 0:
            torch._foreach_add_(self.params, [param.grad for param in self.params], alpha=-self.learning_rate)
        self.calls += 1


def run_shadow(config, stop) -> None:
    """One shadow peer from its root config (``main``'s ``ShadowConfig``) until ``stop``."""
    from collab import events
    from collab.dht import joined_fields, start_dht
    from collab.optim import build_optimizer, collaboration_timeouts, finish_delayed_updates, start_state_prefetch
    from collab.schema import make_validators

    events.open_event_log(config.peer.events_path)
    config.training.per_device_train_batch_size = MICRO_BATCH
    config.training.gradient_accumulation_steps = 1
    model = ShadowModel(config.shadow.layers)
    logger.info("Shadow model: %.1fM parameters", shadow_numel(config.shadow.layers) / 1e6)
    validators, _ = make_validators(config.peer.experiment_prefix)
    dht = start_dht(config.peer, validators)
    events.emit("joined", **joined_fields(dht, config.peer.client_mode))
    optimizer = prefetch = None
    try:
        # as the trainer: the state's download begins beside the optimizer's build, and the first load takes it
        timeouts = collaboration_timeouts(model, config.optimizer, config.averager)
        prefetch = start_state_prefetch(dht, config.peer, config.optimizer, timeouts)
        groups = (config.peer, config.optimizer, config.averager, config.tracker, config.training)
        optimizer = build_optimizer(model, dht, *groups, timeouts=timeouts, prefetch=prefetch)
        optimizer.leaving = stop
        optimizer.load_state_from_peers()
        if config.optimizer.local_steps > 0:
            optimizer.inner_optimizer = ShadowInnerStep(model, config.optimizer.local_steps)
        if config.shadow.ready_file:
            Path(config.shadow.ready_file).touch()
        if config.shadow.start_file:
            started = Path(config.shadow.start_file)
            wait_until(lambda: stop.is_set() or started.exists(), START_TIMEOUT, "the start file")
        while not stop.is_set():
            time.sleep(config.shadow.micro_batch_s)  # the GPU's forward and backward
            optimizer.step(batch_size=MICRO_BATCH)
    finally:
        if prefetch is not None:
            prefetch.cancel()
        if optimizer is not None:
            finish_delayed_updates(optimizer, timeout=10)
            optimizer.shutdown()
        dht.shutdown()


def main(argv=None) -> int:
    from arguments import (
        AveragerArguments,
        OptimizerArguments,
        PeerArguments,
        ProgressTrackerArguments,
        TrainingArguments,
    )
    from bench.probe import instrument
    from collab.entry import run_program

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-"):
        print("bench.shadow: error: the first argument is the steps file (STEPS.jsonl)", file=sys.stderr)
        return 2

    def run(config, stop) -> None:  # the steps file is opened only once every flag has passed its checks
        instrument(argv[0])
        run_shadow(config, stop=stop)

    groups = {
        "peer": PeerArguments,
        "optimizer": OptimizerArguments,
        "averager": AveragerArguments,
        "tracker": ProgressTrackerArguments,
        "training": TrainingArguments,
        "shadow": ShadowArguments,
    }
    return run_program("bench.shadow", dataclasses.make_dataclass("ShadowConfig", groups.items()), run, argv[1:])


if __name__ == "__main__":
    sys.exit(main())
