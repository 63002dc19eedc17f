"""make test's lanes (tests/lanes.py): every test of its selection runs in exactly one lane, the light lane holds no
test that races real averagers, and the exit code is the first failing lane's."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.lanes import INTEGRATION, LIGHT, NO_TESTS_COLLECTED, SELECTED, TIMED, overall_exit_code

pytestmark = pytest.mark.light

MARKERS = ("light", "integration", "scenario", "upstream", "browser")


def matches(expression: str, marks: dict[str, bool]) -> bool:
    # a -m expression of names, and, or, not: Python's own grammar reads it the same way
    return eval(expression, {"__builtins__": {}}, marks)  # noqa: S307 - our constants, no input


@pytest.mark.parametrize("marked", itertools.product([False, True], repeat=len(MARKERS)))
def test_a_test_make_test_selects_runs_in_exactly_one_lane_and_no_other_test_runs(marked):
    marks = dict(zip(MARKERS, marked, strict=True))
    lanes = [lane.name for lane in (LIGHT, TIMED, INTEGRATION) if matches(lane.marks, marks)]
    assert len(lanes) == (1 if matches(SELECTED, marks) else 0), (marks, lanes)


def test_an_integration_test_in_a_light_module_runs_alone_and_an_unmarked_unit_test_runs_timed():
    assert matches(INTEGRATION.marks, {**dict.fromkeys(MARKERS, False), "light": True, "integration": True})
    assert matches(TIMED.marks, dict.fromkeys(MARKERS, False))  # unmarked: the safe lane, not the shared one


# What a test that races the clock with real peers uses: such a module is never light.
PEERS_RACED = re.compile(r"Averager\(|local_dht|PeerProcess|MonitorProcess|averager_pair|two_dhts")


def test_no_light_module_starts_an_averager_or_a_peer():
    modules = [path for path in (ROOT / "tests").rglob("test_*.py") if path.resolve() != Path(__file__).resolve()]
    light = [path for path in modules if "pytest.mark.light" in path.read_text()]
    assert len(light) > 40  # the marker is read where it is written
    assert [path.name for path in light if PEERS_RACED.search(path.read_text())] == []


def test_the_exit_code_is_the_first_failing_lanes_and_an_empty_lane_fails_nothing():
    assert overall_exit_code([0, 0, 0]) == 0
    assert overall_exit_code([0, 1, 2]) == 1
    assert overall_exit_code([NO_TESTS_COLLECTED, 0, NO_TESTS_COLLECTED]) == 0  # a path given to one lane's tests
    assert overall_exit_code([NO_TESTS_COLLECTED, 2, 0]) == 2
    assert overall_exit_code([NO_TESTS_COLLECTED] * 3) == NO_TESTS_COLLECTED
