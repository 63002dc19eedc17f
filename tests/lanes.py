"""make test's runner: the light tests beside the timed unit tests, then the integration tests alone.

On two cores the unit tests that race real hivemind averagers and DHTs against the clock keep about a third of the
CPU busy, and they failed when another such test shared the cores (pytest-xdist, -n 2). The tests marked ``light``
start no averager and time no peer: they run in a second pytest process beside them, which hides their minutes. The
integration tests keep both cores busy with their peers' processes, so they run alone afterwards.

python -m tests.lanes [PYTEST_ARGS...]   # every lane, each given PYTEST_ARGS (a path, -k, -x)
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

SELECTED = "not scenario and not upstream"  # make test's tests; make scenarios runs the others
NO_TESTS_COLLECTED = 5  # pytest's exit code when a lane's selection holds no test


@dataclass(frozen=True)
class Lane:
    name: str
    marks: str
    durations: int  # slowest tests pytest lists at the lane's end


LIGHT = Lane("light", f"{SELECTED} and light and not integration", 10)
TIMED = Lane("timed", f"{SELECTED} and not light and not integration", 25)
INTEGRATION = Lane("integration", f"{SELECTED} and integration", 25)


def pytest_command(lane: Lane, args: Sequence[str]) -> list[str]:
    marks = ["-m", lane.marks, f"--durations={lane.durations}"]
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *marks, *args]


def overall_exit_code(codes: Sequence[int]) -> int:
    """The first failing lane's code; a lane with no test selected fails nothing, unless every lane selected none."""
    failed = [code for code in codes if code not in (0, NO_TESTS_COLLECTED)]
    if failed:
        return failed[0]
    return NO_TESTS_COLLECTED if codes and all(code == NO_TESTS_COLLECTED for code in codes) else 0


def run_beside(foreground: Lane, background: Lane, args: Sequence[str]) -> tuple[int, int, float, float]:
    """Both lanes at once: the foreground one prints as it goes, the background one's output follows it whole.
    Returns both exit codes and wall times (foreground first)."""
    with tempfile.TemporaryFile("w+") as background_output:
        started = time.monotonic()
        beside = subprocess.Popen(pytest_command(background, args), stdout=background_output, stderr=subprocess.STDOUT)
        ended: list[float] = []
        watcher = threading.Thread(target=lambda: (beside.wait(), ended.append(time.monotonic())), daemon=True)
        watcher.start()
        try:
            foreground_code = subprocess.call(pytest_command(foreground, args))
            foreground_seconds = time.monotonic() - started
            watcher.join()
        finally:
            if beside.poll() is None:  # interrupted: the lane beside stops with make test
                beside.terminate()
                beside.wait()
        background_output.seek(0)
        print(f"\n===== {background.name} lane (ran beside the {foreground.name} lane) =====", flush=True)
        sys.stdout.write(background_output.read())
    return foreground_code, beside.returncode, foreground_seconds, ended[0] - started


def main(args: Sequence[str]) -> int:
    timed_code, light_code, timed_seconds, light_seconds = run_beside(TIMED, LIGHT, args)
    print(f"\n===== {INTEGRATION.name} lane =====", flush=True)
    started = time.monotonic()
    integration_code = subprocess.call(pytest_command(INTEGRATION, args))
    integration_seconds = time.monotonic() - started
    codes = [timed_code, light_code, integration_code]
    print(
        f"\nlanes: timed {timed_seconds:.0f} s, light {light_seconds:.0f} s beside it, "
        f"integration {integration_seconds:.0f} s; exit codes {codes}"
    )
    return overall_exit_code(codes)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
