"""Every error a person can fix: bad input or an unusable setup, told in one line that names the flag and what to do.

A program's entry point (``collab.entry.run_program``) catches ``UserError``, prints its message on one line and
exits 2; any other exception is a bug and keeps its traceback. Raise the kind that says where the input came from.
"""

from __future__ import annotations

import re


class UserError(Exception):
    """Bad input or setup: the message (one line) starts with the flag or file to fix and says what to do."""


class ConfigError(UserError, ValueError):
    """A bad setting: the message starts with the flag to fix and says what to do; ``field`` names it (or None)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        if field is None:
            match = re.match(r"(?:argument )?--(\w+)", message)
            field = match.group(1) if match else None
        self.field = field


class SetupError(UserError, RuntimeError):
    """A missing or unusable input (model, tokenizer, dataset): the message names the flag and says what to do."""


class MissingExtraError(SetupError):
    """An option needs an extra that is not installed; the message says which and how to install it."""


class CheckpointError(UserError, ValueError):
    """A folder that is not a valid checkpoint; the message (one line) says which folder and file, and why."""


class DHTStartError(UserError, RuntimeError):
    """The DHT could not start: the message says which setting to check."""


class AccessError(UserError, RuntimeError):
    """The web app refused to issue a token: the message says which setting to check."""


class PrepareError(UserError, ValueError):
    """A bad option of ``python -m data.prepare``, checked before anything is read or written."""

    def __init__(self, option: str, message: str):
        super().__init__(f"{option}: {message}")


class SettingsError(UserError, ValueError):
    """A bad web app setting; the message starts with the flag to fix."""


class StoreError(UserError, ValueError):
    """The web app's database file cannot be used; the message names the file and what to do."""


class InputError(UserError, ValueError):
    """Bad input to a command-line tool (trainer.predict): the message starts with the flag to fix."""


class HivemindVersionError(SystemExit):
    """hivemind is not the version the entry point's patches were written for (collab/hivemind_fixes.py): the
    message says what to install. A SystemExit: it stops the program before anything else runs."""
