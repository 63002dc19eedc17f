"""``run_trainer.py`` with a stopwatch: ``python -m bench.probe STEPS.jsonl [flags]``.

Appends ``[time, samples, epoch]`` to STEPS.jsonl after every ``hivemind.Optimizer.step`` the trainer makes, so the
benchmark counts the samples the peer really processed, not hivemind's smoothed estimate.
"""

from __future__ import annotations

import json
import sys
import time

import hivemind


def instrument(path: str) -> None:
    original = hivemind.Optimizer.step
    sink = open(path, "a", buffering=1)

    def step(self, closure=None, batch_size=None, grad_scaler=None):
        result = original(self, closure, batch_size=batch_size, grad_scaler=grad_scaler)
        sink.write(json.dumps([time.time(), batch_size or self.batch_size_per_step, self.local_epoch]) + "\n")
        return result

    hivemind.Optimizer.step = step


def main() -> int:
    instrument(sys.argv[1])
    import run_trainer

    return run_trainer.main(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
