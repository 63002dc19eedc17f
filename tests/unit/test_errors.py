"""collab.errors: every user error kind is one line and exit 2 through run_program; any other exception is a bug."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from collab import errors

pytestmark = pytest.mark.light

ROOT = Path(__file__).resolve().parents[2]

PROGRAM = textwrap.dedent(
    """
    import sys
    from dataclasses import dataclass

    from collab import errors
    from collab.entry import run_program

    @dataclass
    class Nothing:
        pass

    def raiser(kind):
        def run(nothing, stop):
            if kind is errors.PrepareError:  # data.prepare's errors take the option and the message apart
                raise kind("--some_flag", "what to do\\nforged line")
            raise kind("--some_flag: what to do\\nforged line")
        return run

    for kind in sys.argv[1:]:
        print(kind, run_program("probe", Nothing, raiser(getattr(errors, kind)), argv=[]), flush=True)
    run_program("probe", Nothing, raiser(RuntimeError), argv=[])
    """
)


def user_error_kinds() -> list[str]:
    return [
        name
        for name, value in vars(errors).items()
        if isinstance(value, type) and issubclass(value, errors.UserError) and value is not errors.UserError
    ]


def test_every_user_error_is_one_line_and_exit_2_and_a_bug_keeps_its_traceback():
    kinds = user_error_kinds()
    assert {"SetupError", "CheckpointError", "DHTStartError", "AccessError", "InputError"} <= set(kinds)
    result = subprocess.run(
        [sys.executable, "-c", PROGRAM, *kinds], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.stdout.split() == [word for kind in kinds for word in (kind, "2")], result.stderr
    refusals = [line for line in result.stderr.splitlines() if line.startswith("probe: error:")]
    assert refusals == ["probe: error: --some_flag: what to do\\nforged line"] * len(kinds)
    assert result.returncode == 1 and "Traceback" in result.stderr and "RuntimeError" in result.stderr


def test_a_bad_flag_is_answered_before_hivemind_and_torch_load():
    # Loading hivemind (torch with it) takes seconds: a volunteer's typo should not wait for it.
    probe = textwrap.dedent(
        """
        import sys, run_trainer, run_training_monitor

        codes = []
        for main, argv in [(run_trainer.main, ["--target_batch_size", "-1"]), (run_training_monitor.main, ["--x"])]:
            try:
                codes.append(main(argv))
            except SystemExit as stop:
                codes.append(stop.code)
        print(codes, sorted({"hivemind", "torch"} & set(sys.modules)))
        """
    )
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.stdout.splitlines()[-1] == "[2, 2] []", result.stdout + result.stderr
    assert "--target_batch_size: must be a positive number" in result.stderr
