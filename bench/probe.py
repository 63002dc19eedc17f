"""``run_trainer.py`` with a stopwatch: ``python -m bench.probe STEPS.jsonl [--snapshot_epochs A:B] [flags]``.

Appends ``[time, samples, epoch]`` to STEPS.jsonl after every ``hivemind.Optimizer.step`` the trainer makes, so the
benchmark counts the samples the peer really processed, not hivemind's smoothed estimate. With
``--snapshot_epochs A:B`` the peer also saves its model (``save_pretrained``) to ``OUTPUT_DIR.snapshots/E`` at the
first step at which it holds global epoch E, for each E from A to B: the models from which a benchmark picks the one
of the epoch at which the swarm had processed a given count of samples. A delayed optimizer step lands a step or more
after its epoch began, so the snapshot of E may not hold the update that made it E yet.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import hivemind

SNAPSHOT_FLAG = "--snapshot_epochs"


def snapshots_dir(output_dir: str | Path) -> Path:
    """Where a peer writing its model to ``output_dir`` saves its snapshots, one folder per epoch."""
    return Path(f"{output_dir}.snapshots")


def pop_flag(argv: list[str], flag: str) -> str | None:
    """The value of ``flag`` in ``argv``, removing both; None where absent."""
    if flag not in argv:
        return None
    index = argv.index(flag)
    value = argv[index + 1]
    del argv[index : index + 2]
    return value


def instrument(path: str, snapshot_epochs: range = range(0), snapshot_to: Path | None = None) -> None:
    original = hivemind.Optimizer.step
    sink = open(path, "a", buffering=1)
    models: list = []  # the trainer's model, kept for the snapshots
    if snapshot_epochs:
        import trainer.model

        build_model = trainer.model.build_model

        def build_and_keep(*args, **kwargs):
            model, name = build_model(*args, **kwargs)
            models.append(model)
            return model, name

        trainer.model.build_model = build_and_keep  # before trainer.peer imports it

    def step(self, closure=None, batch_size=None, grad_scaler=None):
        result = original(self, closure, batch_size=batch_size, grad_scaler=grad_scaler)
        sink.write(json.dumps([time.time(), batch_size or self.batch_size_per_step, self.local_epoch]) + "\n")
        folder = None if snapshot_to is None else snapshot_to / str(self.local_epoch)
        if self.local_epoch in snapshot_epochs and not folder.exists():
            models[-1].save_pretrained(folder)
        return result

    hivemind.Optimizer.step = step


def main() -> int:
    argv = sys.argv[2:]
    epochs = pop_flag(argv, SNAPSHOT_FLAG)
    if epochs is None:
        instrument(sys.argv[1])
    else:  # the bench names each peer's --output_dir
        first, last = map(int, epochs.split(":"))
        instrument(sys.argv[1], range(first, last + 1), snapshots_dir(argv[argv.index("--output_dir") + 1]))
    import run_trainer

    return run_trainer.main(argv)


if __name__ == "__main__":
    sys.exit(main())
