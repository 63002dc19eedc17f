"""``HIVEMIND_LOGLEVEL`` reaches hivemind's loggers in our programs, and only theirs."""

import subprocess
import sys
import textwrap

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.light

PROGRAM = textwrap.dedent(
    """
    import logging, os, sys
    from dataclasses import dataclass
    from hivemind.utils.logging import get_logger
    from collab.entry import run_program

    @dataclass
    class Nothing:
        pass

    def run(nothing, stop):
        level = os.environ.get("HIVEMIND_LOGLEVEL", "-")
        get_logger("hivemind.averaging.matchmaking").debug("hivemind-debug " + level)
        logging.getLogger("trainer.loop").debug("ours-debug")
        logging.getLogger("trainer.loop").info("ours-info")

    os.environ.pop("HIVEMIND_LOGLEVEL", None)
    assert run_program("probe", Nothing, run, argv=[]) == 0
    os.environ["HIVEMIND_LOGLEVEL"] = "debug"
    assert run_program("probe", Nothing, run, argv=[]) == 0
    """
)


def test_hivemind_loglevel_debug_shows_hivemind_debug_lines_and_not_ours():
    result = subprocess.run([sys.executable, "-c", PROGRAM], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    assert [line.split("hivemind-debug ")[1] for line in lines if "hivemind-debug" in line] == ["debug"], lines
    assert sum("ours-info" in line for line in lines) == 2, lines
    assert not any("ours-debug" in line for line in lines), lines
