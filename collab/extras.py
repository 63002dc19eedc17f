"""Optional parts of the install (pyproject's extras): a missing one stops the program with one line naming it."""

from __future__ import annotations

import importlib

from collab.errors import MissingExtraError

PACKAGE = "collab-train"
# The modules each extra of pyproject.toml installs: a lean ``pip install .`` has none of them.
EXTRA_MODULES = {
    "web": ("fastapi", "uvicorn", "jinja2", "python_multipart"),
    "wandb": ("wandb",),
    "hub": ("huggingface_hub",),
}


def missing_extra_message(extra: str, needed_by: str) -> str:
    return f"{needed_by} needs the '{extra}' extra: pip install '{PACKAGE}[{extra}]'"


def require_extra(extra: str, needed_by: str) -> None:
    """Import every module of ``extra`` or raise MissingExtraError; call it where the option is chosen, at start-up.

    Only a missing module counts: an installed package that fails to import raises its own error, so it is not
    mistaken for an absent one."""
    for module in EXTRA_MODULES[extra]:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise
            raise MissingExtraError(missing_extra_message(extra, needed_by)) from None
