"""The name a volunteer may show beside its contribution (``--public_name``), checked by one rule everywhere.

The rule runs on the command line, on the DHT record (collab/schema.py) and in the web app, because a name arrives
from strangers: bounded, and printable only, so it cannot reflow a log line, a terminal or a table.
Standard library only: arguments.py imports it.
"""

from __future__ import annotations

MAX_PUBLIC_NAME_CHARS = 32


def public_name_problem(name: object) -> str | None:
    """What is wrong with ``name`` as a public name, or None: 1 to MAX_PUBLIC_NAME_CHARS printable characters
    (no control, format or line-break characters, no space other than U+0020), not starting or ending with a space."""
    if not isinstance(name, str):
        return f"must be text (got {type(name).__name__})"
    if not 1 <= len(name) <= MAX_PUBLIC_NAME_CHARS:
        return f"must be 1 to {MAX_PUBLIC_NAME_CHARS} characters (got {len(name)})"
    if not name.isprintable():
        return f"must be printable characters only: no control, format or line-break characters (got {name!r})"
    if name != name.strip():
        return f"must not start or end with a space (got {name!r})"
    return None
