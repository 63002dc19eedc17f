"""trainer.local's reading of a child's log: which tracebacks are errors in this project's code."""

from __future__ import annotations

from trainer.local import ROOT, tracebacks_from_our_code

OURS = f'  File "{ROOT}/collab/averagers.py", line 190, in _run_allreduce_inplace_\n    async for x in runner:\n'
HIVEMIND = f'  File "{ROOT}/.venv/lib/python3.11/site-packages/hivemind/averaging/averager.py", line 530, in _step\n'
HEAD = "Traceback (most recent call last):\n"


def test_an_error_raised_through_our_frames_is_reported_and_a_cancellation_is_not():
    cancelled = f"{HEAD}{HIVEMIND}{OURS}asyncio.exceptions.CancelledError\nNov 26 06:16:59 [INFO] epoch 11\n"
    chained = (
        f"{HEAD}{HIVEMIND}{OURS}asyncio.exceptions.CancelledError\n\n"
        "During handling of the above exception, another exception occurred:\n\n"
        f"{HEAD}{HIVEMIND}hivemind.averaging.matchmaking.MatchmakingException: Unable to run All-Reduce: \n"
    )
    bug = f"{HEAD}{HIVEMIND}{OURS}TypeError: unsupported operand type(s)\nNov 26 06:17:00 [INFO] epoch 12\n"
    theirs = f"{HEAD}{HIVEMIND}ConnectionResetError: reset by peer\n"
    assert tracebacks_from_our_code(cancelled + chained + theirs) == []
    found = tracebacks_from_our_code(cancelled + bug + theirs)
    assert len(found) == 1 and "TypeError" in found[0]
