"""What every program's ``main`` does: logging, parsing, clean stop on signals, one-line errors for bad input."""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable, Sequence

from hivemind.utils.logging import use_hivemind_log_handler

from arguments import PeerArguments, parse_args_or_exit, split_config_flags
from collab.access import AccessError
from collab.checkpoint import CheckpointError
from collab.dht import DHTStartError
from collab.signals import install_stop_handlers


class SetupError(RuntimeError):
    """A missing or unusable input: the message names the flag and says what to do."""


def run_program(
    prog: str, dataclass_types: Sequence[type], run: Callable[..., object], argv: Sequence[str] | None = None
) -> int:
    """Parse ``argv`` into ``dataclass_types``, call ``run(*arguments, stop=event)``; 0 on success, 2 on bad input."""
    use_hivemind_log_handler("in_root_logger")
    logging.getLogger().setLevel(logging.INFO)
    argv = list(sys.argv[1:] if argv is None else argv)
    arguments = parse_args_or_exit(dataclass_types, argv, prog=prog)
    _, config_token, _ = split_config_flags(argv)
    for args in arguments:
        if isinstance(args, PeerArguments) and args.web_token is None:
            args.web_token = config_token  # one credential for the config, the join endpoint and the reports
    stop = threading.Event()
    install_stop_handlers(stop)
    try:
        run(*arguments, stop=stop)
    except (SetupError, DHTStartError, CheckpointError, AccessError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    return 0
