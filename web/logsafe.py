"""Text from users (experiment names, peer usernames) made safe to log: it cannot forge or split log lines."""

from __future__ import annotations


def printable(text: str) -> str:
    """``text`` with every non-printable character (newlines, ANSI escapes, ...) written as its Python escape."""
    return "".join(char if char.isprintable() else repr(char)[1:-1] for char in text)
