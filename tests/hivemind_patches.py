"""The program entry point's hivemind patches (``collab.hivemind_fixes.ENTRY_POINT_PATCHES``) for tests that run
hivemind in the test process."""

from __future__ import annotations

import contextlib

from collab.hivemind_fixes import ENTRY_POINT_PATCHES, apply_entry_point_patches


@contextlib.contextmanager
def entry_point_patches_applied():
    """``ENTRY_POINT_PATCHES`` applied inside the block, hivemind's own methods restored after it."""
    originals = [(owner, name, owner.__dict__[name]) for owner, name, _ in ENTRY_POINT_PATCHES]
    apply_entry_point_patches()
    try:
        yield
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)
