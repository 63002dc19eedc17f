"""Test faults, installed by the wrapper entry points tests/faulty_peer.py and tests/faulty_monitor.py only.

``python tests/faulty_peer.py --faults nan_loss@3,nan_parameters@5,drift_parameters@4 [run_trainer.py flags]``
``python tests/faulty_monitor.py --faults pause_checkpoint_write@2=60 [run_training_monitor.py flags]``
``python tests/faulty_peer.py --faults pause_model_save@1=60 [run_trainer.py flags]``

- ``nan_loss@E``: the first forward pass in global epoch E returns a NaN loss (so NaN gradients): the loop must
  drop that mini-batch before it reaches an averaging round.
- ``nan_parameters@E``: after the first optimizer step in global epoch E one parameter is filled with NaN (a bad
  step): the callback must roll back to its in-memory backup.
- ``drift_parameters@E``: after the first optimizer step in global epoch E, DRIFT is added to one LayerNorm weight
  (what a missed gradient round leaves behind: finite, same epoch, different parameters): the next parameter round
  (``--average_state_every``) must bring the peers back into agreement.
- ``pause_checkpoint_write@N=S``: the N-th checkpoint write of the process stops S seconds after the weights,
  before the manifest, so a test can kill the monitor in the middle of a save.
- ``pause_model_save@N=S``: the N-th save of the model to ``--output_dir`` by the process stops S seconds before it
  is written, so a test can see a peer's shutdown run out of time before its final save.
- ``pause_teardown@N=S``: the N-th optimizer of the process stops S seconds before its shutdown (hivemind's goodbye
  to the swarm), as on a slow DHT, so a test can see the watchdog cut a teardown that comes after the final save.

Each ``@E`` fault fires once. Each fault, as it fires, writes a ``fault_injected`` event (``fault``, and ``epoch``,
``folder`` or the drifted ``parameter``) to the program's ``--events_path``: tests read that, not the log. The
production code knows nothing of them: the wrappers patch names in their own
process (``trainer.peer.train``, ``trainer.peer.atomic_directory``, ``trainer.peer.build_optimizer``,
``collab.checkpoint.stage_checkpoint_files``), then call the real ``main(argv)``.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from collab import events

logger = logging.getLogger(__name__)

FLAG = "--faults"
EPOCH_FAULTS = ("nan_loss", "nan_parameters", "drift_parameters")  # the faults written NAME@EPOCH
DRIFT = 0.1  # added by drift_parameters; the peers' LayerNorm weights start at 1.0


@dataclass
class Faults:
    at_epoch: dict[str, int] = field(default_factory=dict)  # fault name -> global epoch
    pause_write_number: int = 0  # which checkpoint write pauses (1 = the first); 0: none
    pause_seconds: float = 0.0
    writes: int = 0
    pause_save_number: int = 0  # which save of the model pauses (1 = the first); 0: none
    pause_save_seconds: float = 0.0
    saves: int = 0
    pause_teardown_number: int = 0  # which optimizer's shutdown pauses (1 = the first built); 0: none
    pause_teardown_seconds: float = 0.0
    optimizers: int = 0
    fired: set[str] = field(default_factory=set)

    def fire(self, name: str, epoch: int) -> bool:
        """True once, the first time ``name`` is asked for at or after its epoch."""
        if name in self.fired or name not in self.at_epoch or epoch < self.at_epoch[name]:
            return False
        self.fired.add(name)
        return True


def injected(fault: str, **fields) -> None:
    """Say that ``fault`` fired: a log line, and a ``fault_injected`` event for tests to read."""
    logger.warning("Test fault %s injected (%s)", fault, ", ".join(f"{key} {value}" for key, value in fields.items()))
    events.emit("fault_injected", fault=fault, **fields)


def parse_faults(spec: str) -> Faults:
    """``"nan_loss@3,pause_checkpoint_write@2=60"`` -> Faults; ValueError names a malformed item."""
    faults = Faults()
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, when = item.partition("@")
        number, eq, seconds = when.partition("=")
        try:
            if name in EPOCH_FAULTS and not eq:
                faults.at_epoch[name] = int(when)
            elif name == "pause_checkpoint_write" and eq:
                faults.pause_write_number, faults.pause_seconds = int(number), float(seconds)
            elif name == "pause_model_save" and eq:
                faults.pause_save_number, faults.pause_save_seconds = int(number), float(seconds)
            elif name == "pause_teardown" and eq:
                faults.pause_teardown_number, faults.pause_teardown_seconds = int(number), float(seconds)
            else:
                raise ValueError
        except ValueError:
            raise ValueError(f"{FLAG}: cannot read {item!r}") from None
    return faults


def split_faults_flag(argv: Sequence[str]) -> tuple[Faults, list[str]]:
    """``["--faults", SPEC, *rest]`` -> (parsed SPEC, rest): the wrapper's own flag comes first."""
    if len(argv) < 2 or argv[0] != FLAG:
        raise ValueError(f"{FLAG}: give it first, e.g. {FLAG} nan_loss@3, then the program's own flags")
    return parse_faults(argv[1]), list(argv[2:])


def run_with_faults(
    prog: str, argv: Sequence[str], install: Callable[[Faults], None], program_main: Callable[[list[str]], int]
) -> int:
    """A wrapper's ``main``: read ``--faults SPEC``, ``install`` them in this process, run ``program_main(rest)``."""
    try:
        faults, rest = split_faults_flag(argv)
    except ValueError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    install(faults)
    return program_main(rest)


def pause_checkpoint_writes(faults: Faults) -> None:
    """The configured checkpoint write of this process pauses between its files and its manifest."""
    import collab.checkpoint

    stage_files = collab.checkpoint.stage_checkpoint_files

    def stage_files_then_pause(staging, *args, **kwargs):
        stage_files(staging, *args, **kwargs)
        faults.writes += 1
        if faults.writes == faults.pause_write_number:
            injected("pause_checkpoint_write", folder=str(staging), seconds=faults.pause_seconds)
            time.sleep(faults.pause_seconds)

    collab.checkpoint.stage_checkpoint_files = stage_files_then_pause


def inject_training_faults(faults: Faults) -> None:
    """Every training run of this process (``trainer.peer.train``) gets the configured faults first; the configured
    save of the model (``trainer.peer.atomic_directory``) pauses before it is written, and the configured optimizer
    (``trainer.peer.build_optimizer``) before it shuts down."""
    import trainer.peer

    train = trainer.peer.train
    atomic_directory = trainer.peer.atomic_directory
    build_optimizer = trainer.peer.build_optimizer

    def build_optimizer_pausing_its_shutdown(*args, **kwargs):
        optimizer = build_optimizer(*args, **kwargs)
        faults.optimizers += 1
        if faults.optimizers == faults.pause_teardown_number:
            shutdown = optimizer.shutdown

            def pause_then_shutdown():
                injected("pause_teardown", seconds=faults.pause_teardown_seconds)
                time.sleep(faults.pause_teardown_seconds)
                shutdown()

            optimizer.shutdown = pause_then_shutdown
        return optimizer

    @contextlib.contextmanager
    def pause_then_atomic_directory(target, *args, **kwargs):
        faults.saves += 1
        if faults.saves == faults.pause_save_number:
            injected("pause_model_save", folder=str(target), seconds=faults.pause_save_seconds)
            time.sleep(faults.pause_save_seconds)
        with atomic_directory(target, *args, **kwargs) as folder:
            yield folder

    def train_with_faults(model, optimizer, callback, *args, **kwargs):
        install_training_faults(faults, model, optimizer, callback)
        return train(model, optimizer, callback, *args, **kwargs)

    trainer.peer.train = train_with_faults
    trainer.peer.atomic_directory = pause_then_atomic_directory
    trainer.peer.build_optimizer = build_optimizer_pausing_its_shutdown


def install_training_faults(faults: Faults, model: torch.nn.Module, optimizer, callback) -> None:
    """Hook the configured training faults into the model and the callback."""

    def poison_loss(module, inputs, output):
        if faults.fire("nan_loss", optimizer.local_epoch):
            output.loss = output.loss * float("nan")
            injected("nan_loss", epoch=optimizer.local_epoch)
        return output

    model.register_forward_hook(poison_loss)
    on_step_end = callback.on_step_end

    def poison_parameters_then_step_end(*args, **kwargs):
        if faults.fire("nan_parameters", optimizer.local_epoch):
            with torch.no_grad():
                next(model.parameters()).fill_(float("nan"))
            injected("nan_parameters", epoch=optimizer.local_epoch)
        if faults.fire("drift_parameters", optimizer.local_epoch):
            parameter = drift_parameters(model, optimizer)
            injected("drift_parameters", epoch=optimizer.local_epoch, parameter=parameter, drift=DRIFT)
        return on_step_end(*args, **kwargs)

    callback.on_step_end = poison_parameters_then_step_end


@torch.no_grad()
def drift_parameters(model: torch.nn.Module, optimizer) -> str:
    """Add DRIFT to the model's first LayerNorm weight and to the optimizer's copy of it (the one hivemind averages
    and steps when the optimizer is offloaded); returns the parameter's name."""
    optimizer.state_averager.step(wait_for_delayed_updates=True)  # no background step may overwrite it meanwhile
    name, param = next((n, p) for n, p in model.named_parameters() if n.endswith("LayerNorm.weight"))
    main = [p for group in optimizer.param_groups for p in group["params"]]
    optimized = [p for group in optimizer.opt.param_groups for p in group["params"]]
    copy = optimized[next(i for i, p in enumerate(main) if p is param)]
    param.add_(DRIFT)
    if copy is not param:
        copy.add_(DRIFT)
    return name
