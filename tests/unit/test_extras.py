"""A lean install (no extras) runs peers and monitors; an option that needs an extra stops with one line naming it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from arguments import MetricsArguments
from collab.errors import MissingExtraError, SetupError
from collab.extras import EXTRA_MODULES, require_extra
from monitor.sinks import build_sinks

pytestmark = pytest.mark.light

ROOT = Path(__file__).resolve().parents[2]


def test_every_extra_of_pyproject_is_known_and_installed_by_make():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert set(extras) == {"dev", *EXTRA_MODULES}
    installed = re.search(r"pip install [^\n]*-e '\.\[([a-z,]+)\]'", (ROOT / "Makefile").read_text())
    assert installed is not None and set(installed.group(1).split(",")) == set(extras)


def test_web_app_without_the_web_extra_exits_2_with_one_line():
    # The real entry point, in a process where fastapi cannot be imported (as after a lean `pip install .`).
    prelude = "import sys; sys.modules['fastapi'] = None; import run_web; sys.exit(run_web.main(['--port', '0']))"
    done = subprocess.run([sys.executable, "-c", prelude], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "run_web.py: error: the web app needs the 'web' extra: pip install 'collab-train[web]'"
    ]


def test_wandb_project_without_wandb_is_a_setup_error_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(MissingExtraError) as raised:
        build_sinks(MetricsArguments(wandb_project="p"), "run", None, {})
    assert str(raised.value) == "--wandb_project needs the 'wandb' extra: pip install 'collab-train[wandb]'"
    assert isinstance(raised.value, SetupError)  # run_program prints it as one line and returns 2


def test_a_package_that_fails_on_its_own_import_is_not_reported_as_a_missing_extra(monkeypatch, tmp_path):
    (tmp_path / "half_installed").mkdir()
    (tmp_path / "half_installed" / "__init__.py").write_text("import its_missing_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(EXTRA_MODULES, "example", ("half_installed",))
    with pytest.raises(ModuleNotFoundError) as raised:
        require_extra("example", "--example")
    assert raised.value.name == "its_missing_dependency" and not isinstance(raised.value, MissingExtraError)
