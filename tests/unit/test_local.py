"""trainer.local: the environment of the processes it starts, and its reading of a child's log (which tracebacks
are errors in this project's code)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer.local import ROOT, LocalProcess, tracebacks_from_our_code, wait_until

pytestmark = pytest.mark.light

OURS = f'  File "{ROOT}/collab/averagers.py", line 190, in _run_allreduce_inplace_\n    async for x in runner:\n'
HIVEMIND = f'  File "{ROOT}/.venv/lib/python3.11/site-packages/hivemind/averaging/averager.py", line 530, in _step\n'
HEAD = "Traceback (most recent call last):\n"


def test_an_error_raised_through_our_frames_is_reported_and_a_cancellation_or_a_reset_is_not():
    cancelled = f"{HEAD}{HIVEMIND}{OURS}asyncio.exceptions.CancelledError\nNov 26 06:16:59 [INFO] epoch 11\n"
    chained = (
        f"{HEAD}{HIVEMIND}{OURS}asyncio.exceptions.CancelledError\n\n"
        "During handling of the above exception, another exception occurred:\n\n"
        f"{HEAD}{HIVEMIND}hivemind.averaging.matchmaking.MatchmakingException: Unable to run All-Reduce: \n"
    )
    bug = f"{HEAD}{HIVEMIND}{OURS}TypeError: unsupported operand type(s)\nNov 26 06:17:00 [INFO] epoch 12\n"
    theirs = f"{HEAD}{HIVEMIND}ConnectionResetError: reset by peer\n"
    # a groupmate killed mid-stream: the reset passes through our byte counter
    reset = (
        f"{HEAD}{HIVEMIND}{OURS}ConnectionResetError: [Errno 104] Connection reset by peer\nNov 26 [INFO] epoch 13\n"
    )
    assert tracebacks_from_our_code(cancelled + chained + theirs + reset) == []
    found = tracebacks_from_our_code(cancelled + bug + theirs)
    assert len(found) == 1 and "TypeError" in found[0]


def started_with_threads(tmp_path: Path, env: dict | None, monkeypatch, outer: str | None) -> str:
    """OMP_NUM_THREADS in the environment of a process LocalProcess started (``outer``: the caller's own value)."""
    if outer is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", outer)
    child = LocalProcess(["-n", "1", "import time; time.sleep(30)"], tmp_path / "child.log", env, module="timeit")
    try:
        environ = Path(f"/proc/{child.process.pid}/environ")
        wait_until(lambda: b"OMP_NUM_THREADS=" in environ.read_bytes(), 10, "the child's environment")
        variables = dict(item.split(b"=", 1) for item in environ.read_bytes().split(b"\0") if b"=" in item)
        return variables[b"OMP_NUM_THREADS"].decode()
    finally:
        child.stop()


@pytest.mark.parametrize(
    ("env", "outer", "expected"), [(None, None, "1"), (None, "4", "4"), ({"OMP_NUM_THREADS": "2"}, "4", "2")]
)
def test_processes_sharing_the_machine_get_one_thread_unless_told_otherwise(
    tmp_path, monkeypatch, env, outer, expected
):
    assert started_with_threads(tmp_path, env, monkeypatch, outer) == expected


SHARES_MEMORY_AS_HIVEMIND_DOES = """
import time
import torch
import torch.multiprocessing

torch.multiprocessing.set_sharing_strategy("file_system")  # hivemind.utils.mpfuture's choice
tensor = torch.zeros(1024).share_memory_()
print("shared", flush=True)
time.sleep(60)
"""


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm on this machine")
def test_a_crashed_process_leaves_no_shared_memory_behind(tmp_path):
    # torch's shared-memory manager unlinks a process's /dev/shm files once it is gone: killed with it, it left them
    # in memory for good (hundreds of MB a test run, over a GB a swarm benchmark)
    script = tmp_path / "shares.py"
    script.write_text(SHARES_MEMORY_AS_HIVEMIND_DOES)
    child = LocalProcess([], tmp_path / "shares.log", script=str(script))
    files = f"torch_{child.process.pid}_*"
    try:
        wait_until(lambda: "shared" in child.log(), 30, "the child's shared tensor")
        assert list(Path("/dev/shm").glob(files))
    finally:
        child.crash()
    wait_until(lambda: not list(Path("/dev/shm").glob(files)), 10, "the crashed child's /dev/shm files to go")
