"""Importing any module of the project changes nothing in hivemind: only an entry point applies the patches."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from collab.errors import HivemindVersionError
from collab.hivemind_fixes import ENTRY_POINT_PATCHES, check_hivemind_version

pytestmark = pytest.mark.light

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("collab", "trainer", "monitor", "web", "data", "bench")
TOP_LEVEL_MODULES = ("arguments", "run_trainer", "run_training_monitor", "run_web")

# In a fresh interpreter: import every hivemind module, fingerprint each module's and class's attributes, import every
# module of the project, fingerprint again; prints what changed.
COMPARE = textwrap.dedent(
    """
    import importlib, inspect, json, pkgutil, sys
    import hivemind

    def walk(package):
        names = [package.__name__]
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            names.append(info.name)
        return names

    def fingerprint():
        seen = {}
        for name, module in list(sys.modules.items()):
            if not name.startswith("hivemind") or module is None:
                continue
            seen[name] = {key: id(value) for key, value in vars(module).items()}
            for key, value in vars(module).items():
                if inspect.isclass(value) and value.__module__ == name:
                    seen[f"{name}.{key}"] = {attr: id(item) for attr, item in vars(value).items()}
        return seen

    for name in walk(hivemind):
        try:
            importlib.import_module(name)
        except Exception:
            pass  # optional extras hivemind does not need here
    before = fingerprint()
    packages, modules = json.loads(sys.argv[1]), json.loads(sys.argv[2])
    for package in packages:
        for name in walk(importlib.import_module(package)):
            importlib.import_module(name)
    for name in modules:
        importlib.import_module(name)
    after = fingerprint()
    changed = sorted(
        f"{owner}.{attr}"
        for owner, attrs in before.items()
        for attr in set(attrs) | set(after.get(owner, {}))
        if attrs.get(attr) != after.get(owner, {}).get(attr)
    )
    print(json.dumps(changed))
    """
)


@pytest.mark.timeout(120)
def test_importing_every_module_of_the_project_changes_nothing_in_hivemind():
    result = subprocess.run(
        [sys.executable, "-c", COMPARE, json.dumps(PACKAGES), json.dumps(TOP_LEVEL_MODULES)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == []


# In a fresh interpreter (this session's tests run with the patches applied: tests/unit/conftest.py): whether each
# patched attribute is hivemind's own before, the patch inside the context, and hivemind's own again after.
APPLY_AND_UNDO = textwrap.dedent(
    """
    import json
    from collab.hivemind_fixes import ENTRY_POINT_PATCHES
    from tests.hivemind_patches import entry_point_patches_applied

    originals = [owner.__dict__[name] for owner, name, _ in ENTRY_POINT_PATCHES]
    untouched = all(original is not patch for original, (_, _, patch) in zip(originals, ENTRY_POINT_PATCHES))
    with entry_point_patches_applied():
        applied = all(owner.__dict__[name] is patch for owner, name, patch in ENTRY_POINT_PATCHES)
    undone = [owner.__dict__[name] for owner, name, _ in ENTRY_POINT_PATCHES] == originals
    print(json.dumps([len(ENTRY_POINT_PATCHES), untouched, applied, undone]))
    """
)


@pytest.mark.timeout(120)
def test_the_entry_point_patches_are_applied_and_undone():
    result = subprocess.run(
        [sys.executable, "-c", APPLY_AND_UNDO], cwd=ROOT, capture_output=True, text=True, timeout=110
    )
    assert result.returncode == 0, result.stderr[-2000:]
    count, untouched, applied, undone = json.loads(result.stdout.strip().splitlines()[-1])
    assert count == len(ENTRY_POINT_PATCHES) > 0 and (untouched, applied, undone) == (True, True, True)


def test_another_hivemind_version_stops_with_one_line_unless_allowed():
    with pytest.raises(HivemindVersionError) as stopped:
        check_hivemind_version("1.2.0", environ={})
    message = str(stopped.value)
    assert "\n" not in message and "hivemind==1.1.12" in message and "COLLAB_ALLOW_HIVEMIND_VERSION=1" in message
    check_hivemind_version("1.2.0", environ={"COLLAB_ALLOW_HIVEMIND_VERSION": "1"})
    check_hivemind_version("1.1.12", environ={})
