"""Fixtures for the web app tests: a fresh app (own SQLite file and data folder) per test."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from web.app import create_app
from web.forms import display_values, form_sections
from web.settings import WebSettings

ADMIN_TOKEN = "admin-token-for-tests"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def default_form(**overrides) -> dict[str, str]:
    """What a browser submits for the untouched form: checked boxes only, lists one per line."""
    sections = form_sections()
    values = {**display_values({}, sections), **overrides}
    return {key: ("true" if value is True else value) for key, value in values.items() if value is not False}


@pytest.fixture
def settings(tmp_path: Path) -> WebSettings:
    return WebSettings(admin_token=ADMIN_TOKEN, db=tmp_path / "experiments.sqlite", max_upload_mb=1, max_request_kb=64)


@pytest.fixture
def client(settings: WebSettings):
    with TestClient(create_app(settings)) as test_client:
        yield test_client


@pytest.fixture
def experiment(client) -> dict:
    """A created experiment (as the admin sees it: with its token)."""
    response = client.post("/api/experiments", json={"name": "demo", "config": {"max_steps": 10}}, headers=ADMIN)
    assert response.status_code == 201, response.text
    return response.json()
