"""A volunteer peer: join the collaboration over the DHT and train the shared model.

python run_trainer.py --experiment_prefix my_run                        # first peer: logs --initial_peers ...
python run_trainer.py --experiment_prefix my_run --initial_peers /ip4/...   # every other peer
python run_trainer.py my_config.json                                     # same, from a JSON config
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Sequence

from hivemind.utils.logging import use_hivemind_log_handler

from arguments import TRAINER_ARGUMENTS, parse_args_or_exit
from collab.dht import DHTStartError
from trainer.model import SetupError
from trainer.peer import install_stop_handlers, run_peer


def main(argv: Sequence[str] | None = None) -> int:
    use_hivemind_log_handler("in_root_logger")
    logging.getLogger().setLevel(logging.INFO)
    arguments = parse_args_or_exit(TRAINER_ARGUMENTS, argv, prog="run_trainer.py")
    stop = threading.Event()
    install_stop_handlers(stop)
    try:
        run_peer(*arguments, stop=stop)
    except (SetupError, DHTStartError) as e:
        print(f"run_trainer.py: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
