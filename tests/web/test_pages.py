"""HTML pages through TestClient: sign-in cookie, the generated form, errors beside fields, escaping."""

from __future__ import annotations

import re

import pytest

from arguments import OptimizerArguments
from tests.web.helpers import ADMIN, ADMIN_TOKEN, default_form

pytestmark = pytest.mark.light


def sign_in(client) -> None:
    """Sign in as a browser does: its later form posts carry the app's own Origin."""
    response = client.post("/login", data={"token": ADMIN_TOKEN, "next": "/experiments/new"}, follow_redirects=False)
    assert response.status_code == 303 and response.headers["location"] == "/experiments/new"
    client.headers["Origin"] = "http://testserver"


def test_sign_in_sets_a_strict_httponly_cookie_without_the_token(client):
    wrong = client.post("/login", data={"token": "guess", "next": "/"}, follow_redirects=False)
    assert wrong.status_code == 403 and "Wrong admin token." in wrong.text
    assert "set-cookie" not in wrong.headers
    response = client.post("/login", data={"token": ADMIN_TOKEN, "next": "//evil.example"}, follow_redirects=False)
    assert response.headers["location"] == "/"
    cookie = response.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and ADMIN_TOKEN not in cookie
    own_origin = {"Origin": "http://testserver"}
    assert client.post("/api/experiments/1/token", headers=own_origin).status_code == 404  # an admin credential


def test_admin_pages_redirect_to_sign_in(client, experiment):
    for path in ("/experiments/new", "/experiments/1/edit", "/experiments/1/clone"):
        response = client.get(path, follow_redirects=False)
        assert (response.status_code, response.headers["location"]) == (303, f"/login?next={path}")
    assert client.post("/experiments/new", data=default_form(name="x")).status_code == 403
    page = client.get("/experiments/1").text
    assert experiment["token"] not in page and "run_trainer.py" not in page


def test_form_has_one_fieldset_per_dataclass_with_defaults(client):
    sign_in(client)
    page = client.get("/experiments/new").text
    assert page.count("<fieldset") == 10  # 7 groups of the peer, and the monitor's metrics, checkpoints, evaluation
    assert "<legend>Checkpoint</legend>" in page
    assert f'id="target_batch_size" name="target_batch_size" value="{OptimizerArguments.target_batch_size}"' in page
    assert re.search(r'<textarea id="host_maddrs"[^>]*>/ip4/127.0.0.1/tcp/0</textarea>', page)
    assert re.search(r'type="checkbox" id="offload_optimizer" name="offload_optimizer" value="true" checked', page)
    assert "Samples the whole collaboration accumulates per optimizer step" in page
    assert 'name="web_token"' not in page


def test_invalid_value_is_shown_beside_its_field_with_the_input_kept(client):
    sign_in(client)
    form = default_form(name="typo run", target_batch_size="-1", learning_rate="0.05")
    response = client.post("/experiments/new", data=form)
    assert response.status_code == 422
    field = re.search(r'<div class="field invalid" id="field-target_batch_size">(.*?)</div>', response.text, re.S)
    assert field, "the target_batch_size field is not marked invalid"
    assert 'value="-1"' in field.group(1)
    assert (
        '<p class="error" id="error-target_batch_size" role="alert">--target_batch_size: must be a positive '
        "number (got -1)</p>" in field.group(1)
    )
    assert 'value="0.05"' in response.text and 'value="typo run"' in response.text
    assert client.get("/api/experiments").json() == []


def test_save_with_an_unchecked_box_then_edit_makes_version_two(client):
    sign_in(client)
    form = default_form(name="run", max_steps="7")
    form.pop("fp16")
    response = client.post("/experiments/new", data=form, follow_redirects=False)
    assert (response.status_code, response.headers["location"]) == (303, "/experiments/1")
    config = client.get("/api/experiments/1/config", headers=ADMIN).json()
    assert config["fp16"] is False and config["max_steps"] == 7
    page = client.get("/experiments/1").text
    experiment = client.get("/api/experiments/1", headers=ADMIN).json()
    api = "http://127.0.0.1:8000/api/experiments/1"
    assert f"python run_trainer.py --config {api}/config --config_token {experiment['token']}" in page
    assert f"python run_training_monitor.py --config {api}/config --config_token {experiment['monitor_token']}" in page
    edit = client.get("/experiments/1/edit").text
    assert 'id="max_steps" name="max_steps" value="7"' in edit and "saving makes version 2" in edit
    client.post("/experiments/1/edit", data={**form, "max_steps": "9"})
    assert client.get("/api/experiments/1", headers=ADMIN).json()["version"] == 2
    clone = client.get("/experiments/1/clone").text
    assert 'value="run (copy)"' in clone and 'value="9"' in clone


def test_everything_typed_is_escaped(client):
    sign_in(client)
    name = '<script>alert("x")</script>'
    client.post("/experiments/new", data=default_form(name=name, model_name_or_path='"><img src=x onerror=alert(1)>'))
    for path in ("/", "/experiments/1", "/experiments/1/edit"):
        page = client.get(path).text
        assert "<script>alert" not in page and "<img src=x" not in page
    assert "&lt;script&gt;alert(&#34;x&#34;)&lt;/script&gt;" in client.get("/experiments/1").text


def test_rotate_from_the_page(client, experiment):
    sign_in(client)
    client.post("/experiments/1/token", data={"role": "peer"})
    page = client.get("/experiments/1").text
    assert experiment["token"] not in page and experiment["monitor_token"] in page
    client.post("/experiments/1/token", data={"role": "monitor"})
    assert experiment["monitor_token"] not in client.get("/experiments/1").text
    client.cookies.clear()
    old = client.get("/api/experiments/1/config", headers={"Authorization": f"Bearer {experiment['token']}"})
    assert old.status_code == 403
