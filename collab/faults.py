"""Test-only fault injection, driven by the ``COLLAB_TEST_FAULTS`` environment variable; off and free otherwise.

``COLLAB_TEST_FAULTS="nan_loss@3,nan_parameters@5,pause_checkpoint_write@2=60"``

- ``nan_loss@E``: the first forward pass in global epoch E returns a NaN loss (so NaN gradients): the loop must
  drop that mini-batch before it reaches an averaging round.
- ``nan_parameters@E``: after the first optimizer step in global epoch E one parameter is filled with NaN (a bad
  step): the callback must roll back to its in-memory backup.
- ``pause_checkpoint_write@N=S``: the N-th checkpoint write of the process stops S seconds after the weights,
  before the manifest, so a test can kill the monitor in the middle of a save.

Each ``@E`` fault fires once. The tests of docs/RELIABILITY.md use them; nothing else should.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

import torch

logger = logging.getLogger(__name__)

ENVIRONMENT_VARIABLE = "COLLAB_TEST_FAULTS"


@dataclass
class Faults:
    at_epoch: dict[str, int] = field(default_factory=dict)  # fault name -> global epoch
    pause_write_number: int = 0  # which checkpoint write pauses (1 = the first); 0: none
    pause_seconds: float = 0.0
    writes: int = 0
    fired: set[str] = field(default_factory=set)

    def fire(self, name: str, epoch: int) -> bool:
        """True once, the first time ``name`` is asked for at or after its epoch."""
        if name in self.fired or name not in self.at_epoch or epoch < self.at_epoch[name]:
            return False
        self.fired.add(name)
        logger.warning("Test fault %s injected at global epoch %d", name, epoch)
        return True


def parse_faults(spec: str) -> Faults:
    """``"nan_loss@3,pause_checkpoint_write@2=60"`` -> Faults; ValueError names a malformed item."""
    faults = Faults()
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, when = item.partition("@")
        number, eq, seconds = when.partition("=")
        try:
            if name in ("nan_loss", "nan_parameters") and not eq:
                faults.at_epoch[name] = int(when)
            elif name == "pause_checkpoint_write" and eq:
                faults.pause_write_number, faults.pause_seconds = int(number), float(seconds)
            else:
                raise ValueError
        except ValueError:
            raise ValueError(f"{ENVIRONMENT_VARIABLE}: cannot read {item!r}") from None
    return faults


FAULTS = parse_faults(os.environ.get(ENVIRONMENT_VARIABLE, ""))


def pause_checkpoint_write(folder) -> None:
    """Called between a checkpoint's weights and its manifest; sleeps only in the configured write."""
    FAULTS.writes += 1
    if FAULTS.writes == FAULTS.pause_write_number:
        logger.warning("Test fault: pausing the checkpoint write of %s for %.0f s", folder, FAULTS.pause_seconds)
        time.sleep(FAULTS.pause_seconds)


def install_training_faults(model: torch.nn.Module, optimizer, callback) -> None:
    """Hook the configured training faults into the model and the callback (nothing when none is configured)."""
    if not FAULTS.at_epoch:
        return

    def poison_loss(module, inputs, output):
        if FAULTS.fire("nan_loss", optimizer.local_epoch):
            output.loss = output.loss * float("nan")
        return output

    model.register_forward_hook(poison_loss)
    on_step_end = callback.on_step_end

    def poison_parameters_then_step_end(*args, **kwargs):
        if FAULTS.fire("nan_parameters", optimizer.local_epoch):
            with torch.no_grad():
                next(model.parameters()).fill_(float("nan"))
        return on_step_end(*args, **kwargs)

    callback.on_step_end = poison_parameters_then_step_end
