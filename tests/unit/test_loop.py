"""trainer.loop's pure helpers, and its CPU math setting."""

import subprocess
import sys

import pytest

from trainer.loop import IntervalTimer, NonFiniteStreak, short_epoch_warning, slow_step_warning

pytestmark = pytest.mark.light


def test_epochs_much_longer_than_matchmaking_get_no_warning():
    assert short_epoch_warning([10.0, 11.0, 9.5], matchmaking_time=3.0) is None
    assert short_epoch_warning([2.0, 2.0], matchmaking_time=3.0) is None  # too few epochs to judge


def test_short_epochs_name_the_flags_to_change():
    warning = short_epoch_warning([12.0, 3.1, 4.0, 3.5], matchmaking_time=3.0)  # the last three: median 3.5 s
    assert warning is not None and "3.5 s" in warning
    assert "--target_batch_size" in warning and "--matchmaking_time (3 s)" in warning
    assert short_epoch_warning([3.0, 3.0, 6.0, 6.5, 7.0], matchmaking_time=3.0) is None  # recovered


def test_a_peer_stepping_less_often_than_matchmaking_time_is_told_which_flags_to_lower():
    assert slow_step_warning([0.5] * 10, matchmaking_time=3.0) is None
    assert slow_step_warning([7.0] * 4, matchmaking_time=3.0) is None  # too few steps to judge
    warning = slow_step_warning([0.5, 6.0, 7.0, 40.0, 5.5, 6.5], matchmaking_time=3.0)  # a reload among the last five
    assert warning is not None and "every 6.5 s" in warning and "--matchmaking_time (3 s)" in warning
    assert "--gradient_accumulation_steps" in warning and "--per_device_train_batch_size" in warning


def test_the_timer_warns_once(caplog):
    timer = IntervalTimer(short_epoch_warning, matchmaking_time=3.0)
    for now in (0.0, 3.0, 6.0, 9.0, 12.0, 15.0):
        timer.ended(now)
    assert timer.seconds == [3.0] * 5
    for step in range(1000):
        timer.ended(18.0 + step)
    assert len(timer.seconds) == IntervalTimer.KEPT and timer.seconds[-1] == 1.0
    assert [r.getMessage() for r in caplog.records].count(short_epoch_warning([3.0] * 3, 3.0)) == 1


FLUSH_CHECK = """
import threading, torch
from trainer.loop import flush_denormals
def product():
    return (torch.tensor([1e-39]) * 3.0).item()
before = product()
supported = flush_denormals()
seen = []
worker = threading.Thread(target=lambda: seen.append(product()))
worker.start(); worker.join()
print(before, supported, product(), seen[0])
"""


def test_flushed_subnormals_compute_as_zero_here_and_in_threads_started_later():
    # A fresh interpreter: the setting is per process and must not leak into the other tests.
    result = subprocess.run([sys.executable, "-c", FLUSH_CHECK], capture_output=True, text=True, timeout=120)
    before, supported, after, in_thread = result.stdout.split()
    assert float(before) == pytest.approx(3e-39, rel=1e-3)  # subnormal, computed exactly (and slowly) by default
    if supported == "True":
        assert float(after) == 0.0 and float(in_thread) == 0.0


def test_a_streak_of_dropped_batches_restores_once_then_reports_divergence():
    streak = NonFiniteStreak(limit=3)
    assert [streak.dropped() for _ in range(3)] == [None, None, NonFiniteStreak.RESTORE]
    assert [streak.dropped() for _ in range(3)] == [None, None, NonFiniteStreak.DIVERGED]


def test_a_restored_state_must_step_a_whole_limit_in_a_row_before_a_streak_restores_again():
    streak = NonFiniteStreak(limit=2)
    assert [streak.dropped(), streak.dropped()] == [None, NonFiniteStreak.RESTORE]
    streak.stepped()
    assert [streak.dropped(), streak.dropped()] == [None, NonFiniteStreak.DIVERGED]  # one step in between: still bad
    streak = NonFiniteStreak(limit=2)
    assert [streak.dropped(), streak.dropped()] == [None, NonFiniteStreak.RESTORE]
    streak.stepped()
    streak.stepped()
    assert [streak.dropped(), streak.stepped(), streak.dropped()] == [None, None, None]  # a step ends a streak
    assert streak.dropped() == NonFiniteStreak.RESTORE  # the restored state stepped 2 in a row: restore, not stop
