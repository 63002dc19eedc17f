"""What our programs send each other over HTTP: the bearer credential header and JSON-safe values.

Kept free of imports beyond the standard library, so the web app, the monitor's sinks and uploads, the peers' token
requests and the config loader share one spelling.
"""

from __future__ import annotations

import math
from typing import Any


def bearer_header(token: str | None) -> dict[str, str]:
    """``{"Authorization": "Bearer TOKEN"}``, or no header when there is no token."""
    return {"Authorization": f"Bearer {token}"} if token else {}


def json_safe(value: Any) -> Any:
    """``value`` with every NaN or infinity, at any depth of dicts, lists and tuples, written as None (JSON null):
    JSON has no such numbers, and a metrics line or an error body must still be written."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    return value
