"""bench/cpu.py against a real process tree: CPU time lands on the right kind of work."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from bench.cpu import HIVEMIND_PROCESSES, KINDS, P2PD, TRAINER_THREADS, TRAINING_LOOP, CpuSampler
from trainer.local import wait_until

pytestmark = pytest.mark.light

# A stand-in for a trainer: its main thread burns 0.4 s of CPU, a forked child process (as hivemind's DHT and
# averagers are) burns 0.3 s, then both wait until the test closes stdin.
TREE = textwrap.dedent(
    """
    import os, sys, time

    def burn(seconds, clock):
        start = clock()
        while clock() - start < seconds:
            pass

    child = os.fork()
    if child == 0:
        burn(0.3, time.process_time)
        print("child done", flush=True)
        sys.stdin.read()
        os._exit(0)
    burn(0.4, time.thread_time)
    print("main done", flush=True)
    sys.stdin.read()
    os.waitpid(child, 0)
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_cpu_time_is_split_between_the_main_thread_and_child_processes():
    process = subprocess.Popen([sys.executable, "-c", TREE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert sorted(process.stdout.readline().strip() for _ in range(2)) == ["child done", "main done"]
        sampler = CpuSampler([process.pid], period=0.05)
        sampler.start()  # samples in the background until stopped, then once more
        wait_until(lambda: len(sampler.history) >= 2, timeout=30, what="two samples")
        sampler.stop()
        _, totals = sampler.history[-1]
        assert totals[TRAINING_LOOP] >= 0.35  # 0.4 s burned, at the clock tick's resolution
        assert 0.25 <= totals[HIVEMIND_PROCESSES] < totals[TRAINING_LOOP]
        assert totals[P2PD] == 0.0
    finally:
        process.communicate(input="", timeout=30)


def test_cores_are_cpu_seconds_over_wall_seconds_between_samples_inside_the_window():
    sampler = CpuSampler([])
    zero = dict.fromkeys(KINDS, 0.0)
    sampler.history = [
        (10.0, {**zero, TRAINING_LOOP: 1.0}),
        (12.0, {**zero, TRAINING_LOOP: 2.8, TRAINER_THREADS: 0.2}),
        (14.0, {**zero, TRAINING_LOOP: 4.6, TRAINER_THREADS: 0.4, HIVEMIND_PROCESSES: 0.6}),
        (16.0, {**zero, TRAINING_LOOP: 9.0}),  # after the window: not counted
    ]
    cores = sampler.cores_between(11.0, 15.0)  # samples at 12 and 14
    assert cores[TRAINING_LOOP] == pytest.approx(0.9)
    assert cores[TRAINER_THREADS] == pytest.approx(0.1)
    assert cores[HIVEMIND_PROCESSES] == pytest.approx(0.3)
    assert sampler.cores_between(11.0, 13.0) is None  # one sample is not an interval
