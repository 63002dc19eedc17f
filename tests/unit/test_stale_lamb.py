"""bench.stale_lamb: the harness that measures a caught-up newcomer's stale Lamb state."""

from __future__ import annotations

import pytest

from bench.stale_lamb import measure, summarize

pytestmark = pytest.mark.light


def test_a_newcomer_with_the_veterans_own_lamb_state_steps_exactly_as_the_veteran():
    same = measure(warm=3, stale=0, period=2, steps_after=3)
    assert same["first_update_difference"] == same["largest_drift_in_updates"] == 0.0
    assert same["steps_until_within"] == 1


def test_a_stale_lamb_state_makes_the_newcomer_step_elsewhere():
    stale = measure(warm=6, stale=3, period=2, steps_after=3)
    assert stale["first_update_difference"] > 0.05 and stale["largest_drift_in_updates"] > 0.05


def test_the_summary_counts_the_steps_until_the_difference_stays_small():
    figures = summarize(10, 2, 2, differences=[0.9, 0.05, 0.2, 0.08, 0.01], drifts=[0.9, 1.5, 1.2, 1.0, 0.8])
    assert figures["steps_until_within"] == 4  # 0.05 at step 2 does not count: step 3 is back over 0.1
    assert figures["largest_drift_in_updates"] == 1.5 and figures["drift_after_one_period"] == 1.5
    assert summarize(10, 2, 1, differences=[0.5, 0.4], drifts=[0.5, 0.6])["steps_until_within"] is None
