"""collab.wire: one spelling of the bearer header and of JSON-safe values for every program."""

import json
import math

import pytest

from collab.wire import bearer_header, json_safe

pytestmark = pytest.mark.light


def test_bearer_header_only_with_a_token():
    assert bearer_header("t0k") == {"Authorization": "Bearer t0k"}
    assert bearer_header(None) == {} and bearer_header("") == {}


def test_non_finite_numbers_become_null_at_any_depth():
    value = {"loss": math.nan, "rows": [1.5, math.inf, ({"x": -math.inf},)], "name": "nan", "step": 3}
    safe = json_safe(value)
    assert safe == {"loss": None, "rows": [1.5, None, [{"x": None}]], "name": "nan", "step": 3}
    json.dumps(safe, allow_nan=False)
