"""A string put in a log message cannot forge a log line: every program's handlers escape control characters."""

import logging
import subprocess
import sys
import textwrap

import pytest
from hivemind.utils.logging import CustomFormatter

from collab.entry import ControlEscapingFormatter, escape_control_characters
from tests.conftest import ROOT

pytestmark = pytest.mark.light

FORGED = "peer-7\n2026-11-25 12:00:00.000 [INFO] Saved checkpoint /repo/999\r\x1b[2K\x1b[31mred\u2028\x85\x00"


def test_control_characters_are_written_as_escapes():
    assert escape_control_characters(FORGED) == (
        "peer-7\\n2026-11-25 12:00:00.000 [INFO] Saved checkpoint /repo/999\\r\\x1b[2K\\x1b[31mred\\u2028\\x85\\x00"
    )
    assert escape_control_characters("tab\tand ünïcode stay") == "tab\tand ünïcode stay"


def test_the_message_is_escaped_and_the_traceback_stays_multi_line():
    formatter = ControlEscapingFormatter(CustomFormatter(fmt="{levelname} {message}", style="{"))
    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.LogRecord("x", logging.ERROR, __file__, 1, "value %s %d%%", (FORGED, 5), sys.exc_info())
    text = formatter.format(record)
    first, *traceback = text.splitlines()
    assert first.startswith("ERROR value peer-7\\n2026") and first.endswith("\\x00 5%")
    assert traceback[0] == "Traceback (most recent call last):" and traceback[-1] == "ValueError: boom"
    assert (record.msg, record.args) == ("value %s %d%%", (FORGED, 5))  # other handlers see the record unchanged


PROGRAM = textwrap.dedent(
    """
    import logging, sys
    from dataclasses import dataclass
    import transformers
    from hivemind.utils.logging import get_logger
    from collab.entry import run_program

    @dataclass
    class Nothing:
        pass

    def run(nothing, stop):
        forged = sys.stdin.read()
        logging.getLogger("monitor.run").warning("Ignoring peer %s", forged)
        get_logger("hivemind.dht").warning(forged)
        transformers.logging.get_logger("transformers.trainer").warning(forged)

    sys.exit(run_program("probe", Nothing, run, argv=[]))
    """
)


def test_a_program_s_log_lines_cannot_be_forged():
    """Through run_program in a real process: our loggers, hivemind's and transformers' (its own handler)."""
    result = subprocess.run(
        [sys.executable, "-c", PROGRAM], input=FORGED, cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    # one line per logger at least (transformers may print through its own handler and the root's)
    tails = {line.split("peer-7", 1)[1] for line in lines if "peer-7" in line}
    assert tails == {
        "\\n2026-11-25 12:00:00.000 [INFO] Saved checkpoint /repo/999\\r\\x1b[2K\\x1b[31mred\\u2028\\x85\\x00"
    }, result.stderr
    assert sum("peer-7" in line for line in lines) >= 3, result.stderr
    assert not any(line.startswith("2026-11-25") for line in lines)
