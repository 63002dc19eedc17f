"""Unit tests run hivemind as the programs do: with the entry point's patches (``collab.entry.run_program``)."""

from __future__ import annotations

import pytest

from collab.hivemind_fixes import apply_entry_point_patches


@pytest.fixture(scope="session", autouse=True)
def hivemind_entry_point_patches() -> None:
    apply_entry_point_patches()
