"""Constants and small helpers shared by the web tests."""

from __future__ import annotations

from web.forms import display_values, form_sections

ADMIN_TOKEN = "admin-token-for-tests"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def default_form(**overrides) -> dict[str, str]:
    """What a browser submits for the untouched form: checked boxes only, lists one per line."""
    values = {**display_values({}, form_sections()), **overrides}
    return {key: ("true" if value is True else value) for key, value in values.items() if value is not False}
