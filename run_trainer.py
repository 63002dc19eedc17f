"""A volunteer peer: join the collaboration over the DHT and train the shared model.

python run_trainer.py --experiment_prefix my_run                        # first peer: logs --initial_peers ...
python run_trainer.py --experiment_prefix my_run --initial_peers /ip4/...   # every other peer
python run_trainer.py my_config.json                                     # same, from a JSON config
python run_trainer.py --config http://HOST:8000/api/experiments/1/config --config_token TOKEN  # from the web app
torchrun --standalone --nproc_per_node 4 run_trainer.py ...              # one peer on all 4 GPUs of this machine
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from arguments import PeerConfig
from collab.entry import run_program


def run(config: PeerConfig, stop) -> None:
    # imported once the flags have passed their checks: bad input is answered without loading the model code
    from trainer.follower import run_rank

    run_rank(config, stop=stop)


def main(argv: Sequence[str] | None = None) -> int:
    return run_program("run_trainer.py", PeerConfig, run, argv)


if __name__ == "__main__":
    sys.exit(main())
