"""Fixtures for the web app tests: a fresh app (own SQLite file and data folder) per test."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from tests.web.helpers import ADMIN, ADMIN_TOKEN
from web.app import create_app
from web.settings import WebSettings


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
