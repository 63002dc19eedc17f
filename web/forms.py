"""The experiment form, generated from the dataclasses of arguments.py (pure functions, no I/O).

One section per dataclass, one widget per field: its label, help text, default and widget kind all come from the
dataclass, so a new setting in arguments.py appears in the form with no change here. Submitted values go through
``validated_config``: the same ``validate_config`` path as the command line, so a value the CLI rejects is rejected
here with the same one-line message, placed beside the field it names.
"""

from __future__ import annotations

import dataclasses
import enum
import re
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from arguments import EXPERIMENT_ARGUMENTS, LOCAL_SETTINGS, SECRET_SETTINGS, to_config, validate_config
from collab.errors import ConfigError

TRUE_VALUES = frozenset({"on", "true", "1", "yes"})


# A value the command-line parser would read as a flag (e.g. "--config URL" or "-h"): never let it through.
@dataclass(frozen=True)
class FormField:
    """One widget: ``kind`` is int, float, bool, text, list or choice; ``optional`` means empty is None."""

    name: str
    label: str
    help: str
    kind: str
    optional: bool
    default: Any
    choices: tuple[str, ...] = ()


@dataclass(frozen=True)
class FormSection:
    """One dataclass of arguments.py: a fieldset titled after it, introduced by its docstring."""

    name: str
    title: str
    doc: str
    fields: tuple[FormField, ...]


def _label(name: str) -> str:
    return name.replace("_", " ").capitalize()


def _section_title(class_name: str) -> str:
    words = re.findall(r"[A-Z][a-z]*", class_name.removesuffix("Arguments"))
    return " ".join(words) or class_name


def _default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None if f.default is dataclasses.MISSING else f.default


def widget_kind(annotation: Any, metadata: Mapping[str, Any]) -> tuple[str, bool, tuple[str, ...]]:
    """(kind, optional, choices) for a field's resolved type; raises TypeError for a type with no widget."""
    optional = False
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        members = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        optional = len(members) < len(typing.get_args(annotation))
        if len(members) != 1:
            raise TypeError(f"no form widget for {annotation!r}")
        annotation = members[0]
    if metadata.get("choices"):
        return "choice", optional, tuple(str(choice) for choice in metadata["choices"])
    if typing.get_origin(annotation) is typing.Literal:
        return "choice", optional, tuple(str(choice) for choice in typing.get_args(annotation))
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return "choice", optional, tuple(str(member.value) for member in annotation)
    if typing.get_origin(annotation) in (list, tuple) or annotation in (list, tuple):
        return "list", optional, ()
    kinds = {bool: "bool", int: "int", float: "float", str: "text"}
    if annotation not in kinds:
        raise TypeError(f"no form widget for {annotation!r}")
    return kinds[annotation], optional, ()


def form_sections(
    dataclass_types: Sequence[type] = EXPERIMENT_ARGUMENTS, secret: frozenset[str] = SECRET_SETTINGS | LOCAL_SETTINGS
) -> tuple[FormSection, ...]:
    """The form's sections, in the order of ``dataclass_types``, without the secret and machine-local settings."""
    sections = []
    for dtype in dataclass_types:
        hints = typing.get_type_hints(dtype)
        fields = []
        for f in dataclasses.fields(dtype):
            if f.name in secret:
                continue
            kind, optional, choices = widget_kind(hints[f.name], f.metadata)
            fields.append(
                FormField(f.name, _label(f.name), f.metadata.get("help", ""), kind, optional, _default(f), choices)
            )
        doc = (dtype.__doc__ or "").strip().split("\n\n")[0]
        sections.append(FormSection(dtype.__name__, _section_title(dtype.__name__), doc, tuple(fields)))
    return tuple(sections)


def _all_fields(sections: Sequence[FormSection]) -> list[FormField]:
    return [f for section in sections for f in section.fields]


def config_from_form(form: Mapping[str, str], sections: Sequence[FormSection]) -> dict[str, Any]:
    """A config dict from submitted form values: an absent checkbox is False, a textarea gives one item per line,
    an empty optional field is None; other values stay strings for the command-line parser to convert."""
    config: dict[str, Any] = {}
    for f in _all_fields(sections):
        raw = form.get(f.name)
        if f.kind == "bool":
            config[f.name] = raw is not None and raw.strip().lower() in TRUE_VALUES
        elif f.kind == "list":
            config[f.name] = [line.strip() for line in (raw or "").splitlines() if line.strip()]
        elif f.optional and not (raw or "").strip():
            config[f.name] = None
        else:
            config[f.name] = (raw or "").strip()
    return config


def display_values(config: Mapping[str, Any], sections: Sequence[FormSection]) -> dict[str, str | bool]:
    """What each widget shows for a config (stored or just submitted): defaults for missing keys."""
    values: dict[str, str | bool] = {}
    for f in _all_fields(sections):
        value = config.get(f.name, f.default)
        if f.kind == "bool":
            values[f.name] = value if isinstance(value, bool) else str(value).strip().lower() in TRUE_VALUES
        elif f.kind == "list":
            values[f.name] = "\n".join(map(str, value or []))
        else:
            values[f.name] = "" if value is None else str(value)
    return values


def validated_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The config to store: every setting, validated exactly as the command line does, secrets left out.

    Raises ConfigError (``.field`` names the setting) for a secret, a path on the peers' machines, an unknown key
    or any invalid value.
    """
    for key in SECRET_SETTINGS & config.keys():
        raise ConfigError(
            f"--{key}: a credential is never stored in an experiment config; pass it on the command line", key
        )
    for key in sorted(LOCAL_SETTINGS & config.keys()):
        raise ConfigError(
            f"--{key}: a setting of each peer's own machine is never stored in an experiment config; "
            "each peer passes it on its command line",
            key,
        )
    instances = validate_config(dict(config))  # values go in as --key=value: one that starts with '-' stays a value
    return served_config(to_config(*instances))


def served_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """What peers get: no secrets and no machine-local paths (configs stored by older versions still hold them)."""
    return {key: value for key, value in config.items() if key not in SECRET_SETTINGS | LOCAL_SETTINGS}
