"""What every program's ``main`` does: logging, parsing, clean stop on signals, one-line errors for bad input."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence

from arguments import PeerArguments, argument_groups, parse_args_or_exit, split_config_flags
from collab.errors import UserError

# C0 controls but tab, DEL, C1 controls and the Unicode line separators: each can end a log line, rewrite one already
# printed (\r, ANSI escapes start with ESC) or split a line in a log viewer.
_CONTROL_ESCAPES = {
    code: ascii(chr(code))[1:-1]
    for code in (*range(0x00, 0x20), *range(0x7F, 0xA0), 0x2028, 0x2029)
    if code != ord("\t")
}


def escape_control_characters(text: str) -> str:
    """``text`` on one line: control characters written as Python escapes (``\\n``, ``\\x1b``, ``\\u2028``)."""
    return text.translate(_CONTROL_ESCAPES)


class ControlEscapingFormatter(logging.Formatter):
    """Wraps a handler's formatter so that a record's message is one line: a string a peer, a file or a URL put in
    a message (``"...\\n2026-11-25 ... INFO forged"``) cannot forge a log line. A traceback stays multi-line."""

    def __init__(self, inner: logging.Formatter):
        super().__init__()
        self.inner = inner

    def format(self, record: logging.LogRecord) -> str:
        msg, args = record.msg, record.args
        record.msg, record.args = escape_control_characters(record.getMessage()), None
        try:
            return self.inner.format(record)
        finally:
            record.msg, record.args = msg, args


def escape_log_messages() -> None:
    """Every handler of the root logger (hivemind's, once ``use_hivemind_log_handler("in_root_logger")``) and of the
    loggers that do not propagate to it (transformers') formats messages through ControlEscapingFormatter."""
    loggers = [
        logging.getLogger(),
        *(found for found in logging.root.manager.loggerDict.values() if isinstance(found, logging.Logger)),
    ]
    for handler in {handler for logger in loggers for handler in logger.handlers}:
        if not isinstance(handler.formatter, ControlEscapingFormatter):
            handler.setFormatter(ControlEscapingFormatter(handler.formatter or logging.Formatter()))


def configure_logging() -> None:
    """INFO through hivemind's handler for every logger; hivemind's own loggers at ``HIVEMIND_LOGLEVEL`` when it is
    set, as hivemind documents (DEBUG tells why matchmaking tries fail: rejected, no answer in time)."""
    from hivemind.utils.logging import use_hivemind_log_handler

    use_hivemind_log_handler("in_root_logger")
    logging.getLogger().setLevel(logging.INFO)
    hivemind_level = os.environ.get("HIVEMIND_LOGLEVEL", "").strip().upper()
    logging.getLogger("hivemind").setLevel(hivemind_level or logging.NOTSET)
    escape_log_messages()


# seconds a finished program's interpreter gets to exit before it is ended. The program has saved its state and
# shut down what it started; a hivemind thread still running then waits on an averager already shut down (a round
# given up in ``collab.optim.finish_delayed_updates``), and would hold the exit up to averaging_timeout, then abort.
LEAVE_GRACE_S = 3.0


def exit_by_then(code: int, grace: float) -> None:
    """End the process with ``code`` after ``grace`` seconds unless it has exited by then (a daemon thread): Python
    joins every non-daemon thread at exit, those of hivemind's executors too."""

    def exit_now() -> None:
        time.sleep(grace)
        logging.getLogger(__name__).info("Exiting without waiting longer for background threads (%.0f s)", grace)
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(code)

    threading.Thread(target=exit_now, name="exit-by-then", daemon=True).start()


def run_program(prog: str, config_type: type, run: Callable[..., object], argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` into the root config ``config_type`` (a dataclass of argument groups: ``PeerConfig``), call
    ``run(config, stop=event)``; 0 on success, 2 on bad input."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # hivemind (torch with it) loads only once the flags have passed: bad input is answered without waiting for it
    config = config_type(*parse_args_or_exit(argument_groups(config_type), argv, prog=prog))
    from collab.hivemind_fixes import apply_entry_point_patches
    from collab.signals import install_stop_handlers

    apply_entry_point_patches()
    configure_logging()
    _, config_token, _ = split_config_flags(argv)
    for args in vars(config).values():
        if isinstance(args, PeerArguments) and args.web_token is None:
            args.web_token = config_token  # one credential for the config, the join endpoint and the reports
    stop = threading.Event()
    install_stop_handlers(stop)
    before = set(threading.enumerate())
    code = 0
    try:
        run(config, stop=stop)
    except UserError as e:
        print(f"{prog}: error: {escape_control_characters(str(e))}", file=sys.stderr)
        code = 2
    if any(not thread.daemon for thread in set(threading.enumerate()) - before):
        exit_by_then(code, LEAVE_GRACE_S)
    return code
