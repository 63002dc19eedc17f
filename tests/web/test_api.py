"""The JSON API through FastAPI's TestClient: exact status codes and bodies, tokens enforced, nothing half-stored."""

from __future__ import annotations

import base64
import hashlib
import io
import logging

import pytest
from fastapi.testclient import TestClient
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from arguments import OptimizerArguments
from collab.access import is_token_valid, sign_join_proof, token_from_json
from tests.web.helpers import ADMIN, ADMIN_TOKEN, bearer
from web.app import create_app
from web.settings import WebSettings

pytestmark = pytest.mark.light

NO_ADMIN = {"detail": "admin token required: send Authorization: Bearer <admin token>"}
WRONG_ADMIN = {"detail": "wrong admin token"}


def metrics(step: int, **extra) -> dict:
    return {
        "step": step,
        "loss": 5.0 - step / 10,
        "alive_peers": 2,
        "samples": 128 * step,
        "samples_per_second": 40.5,
        "time": 1_700_000_000.0 + step,
        **extra,
    }


def upload(client, experiment, step=4, data=b"checkpoint bytes", sha256=None, token=None, loss="3.25"):
    sha256 = sha256 or hashlib.sha256(data).hexdigest()
    return client.post(
        f"/api/experiments/{experiment['id']}/checkpoints",
        data={"step": str(step), "loss": loss, "sha256": sha256},
        files={"archive": (f"checkpoint-{step}.tar.gz", io.BytesIO(data), "application/gzip")},
        headers=bearer(token or experiment["monitor_token"]),
    )


def test_create_returns_the_full_validated_config_and_the_token(client, experiment):
    assert experiment["id"] == 1 and experiment["version"] == 1 and experiment["name"] == "demo"
    assert (
        experiment["config"]["max_steps"] == 10
        and experiment["config"]["target_batch_size"] == OptimizerArguments.target_batch_size
    )
    assert "web_token" not in experiment["config"]
    assert len(experiment["token"]) >= 32
    assert client.get("/api/experiments").json()[0]["name"] == "demo"


def test_create_needs_the_admin_token_and_changes_nothing_without_it(client):
    body = {"name": "x", "config": {}}
    missing = client.post("/api/experiments", json=body)
    assert (missing.status_code, missing.json()) == (401, NO_ADMIN)
    assert missing.headers["www-authenticate"] == "Bearer"
    wrong = client.post("/api/experiments", json=body, headers=bearer("not-the-admin"))
    assert (wrong.status_code, wrong.json()) == (403, WRONG_ADMIN)
    assert client.get("/api/experiments").json() == []


def test_invalid_config_is_422_naming_the_field(client):
    response = client.post("/api/experiments", json={"name": "x", "config": {"target_batch_size": -1}}, headers=ADMIN)
    assert response.status_code == 422
    assert response.json() == {
        "detail": [
            {
                "type": "config_error",
                "loc": ["body", "config", "target_batch_size"],
                "msg": "--target_batch_size: must be a positive number (got -1)",
            }
        ]
    }
    unknown = client.post("/api/experiments", json={"name": "x", "config": {"batch": 1}}, headers=ADMIN)
    assert unknown.json()["detail"][0]["loc"] == ["body", "config", "batch"]
    secret = client.post("/api/experiments", json={"name": "x", "config": {"web_token": "t"}}, headers=ADMIN)
    assert secret.json()["detail"][0]["loc"] == ["body", "config", "web_token"]
    extra = client.post("/api/experiments", json={"name": "x", "owner": "me"}, headers=ADMIN)
    assert extra.status_code == 422 and extra.json()["detail"][0]["loc"] == ["body", "owner"]
    assert client.get("/api/experiments").json() == []


def test_config_needs_the_experiment_token(client, experiment):
    url = f"/api/experiments/{experiment['id']}/config"
    assert client.get(url, headers=bearer(experiment["token"])).json() == experiment["config"]
    assert client.get(url, headers=ADMIN).status_code == 200
    missing = client.get(url)
    assert (missing.status_code, missing.json()) == (
        401,
        {"detail": "token required: send Authorization: Bearer <peer or monitor token of experiment 1>"},
    )
    wrong = client.get(url, headers=bearer("guess"))
    assert (wrong.status_code, wrong.json()) == (403, {"detail": "wrong token for experiment 1"})
    other = client.post("/api/experiments", json={"name": "other"}, headers=ADMIN).json()
    assert client.get(url, headers=bearer(other["token"])).status_code == 403
    assert client.get("/api/experiments/99/config", headers=ADMIN).json() == {"detail": "no experiment 99"}


def test_each_save_is_a_new_version_and_old_versions_stay_readable(client, experiment):
    url = f"/api/experiments/{experiment['id']}"
    response = client.put(url, json={"config": {"max_steps": 20}}, headers=ADMIN)
    assert response.status_code == 200 and response.json()["version"] == 2
    assert client.put(url, json={"config": {}}, headers=bearer(experiment["token"])).status_code == 403
    token = bearer(experiment["token"])
    assert client.get(f"{url}/config", headers=token).json()["max_steps"] == 20
    assert client.get(f"{url}/config?version=1", headers=token).json()["max_steps"] == 10
    assert [v["version"] for v in client.get(url, headers=token).json()["versions"]] == [1, 2]
    assert "token" not in client.get(url, headers=token).json()


def test_clone_copies_the_config_with_a_new_token(client, experiment):
    clone = client.post(f"/api/experiments/{experiment['id']}/clone", json={}, headers=ADMIN)
    assert clone.status_code == 201
    body = clone.json()
    assert (body["id"], body["name"], body["config"]) == (2, "demo (copy)", experiment["config"])
    assert body["token"] != experiment["token"]


def test_rotating_the_token_locks_out_the_old_one(client, experiment):
    url = f"/api/experiments/{experiment['id']}"
    assert client.post(f"{url}/token", headers=bearer(experiment["token"])).status_code == 403
    new = client.post(f"{url}/token", headers=ADMIN).json()["token"]
    assert client.get(f"{url}/config", headers=bearer(experiment["token"])).status_code == 403
    assert client.get(f"{url}/config", headers=bearer(new)).status_code == 200


def test_metrics_are_stored_by_step_and_reposting_replaces(client, experiment):
    url = f"/api/experiments/{experiment['id']}/metrics"
    token = bearer(experiment["monitor_token"])
    for step in (3, 1, 2):
        assert client.post(url, json=metrics(step), headers=token).status_code == 200
    response = client.post(url, json=metrics(2, loss=None, eval_loss=2.5), headers=token)
    assert response.json() == {
        **metrics(2, loss=None, eval_loss=2.5),
        "eval_perplexity": None,
        "eval_accuracy": None,
        "eval_exact_match": None,
        "eval_f1": None,
    }
    rows = client.get(url).json()
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[1]["loss"] is None and rows[1]["eval_loss"] == 2.5
    assert [r["step"] for r in client.get(f"{url}?after=1").json()] == [2, 3]


def test_bad_metrics_are_422_and_wrong_tokens_store_nothing(client, experiment):
    url = f"/api/experiments/{experiment['id']}/metrics"
    token = bearer(experiment["monitor_token"])
    extra = client.post(url, json=metrics(1, gpu="h100"), headers=token)
    assert extra.status_code == 422
    assert extra.json() == {
        "detail": [
            {
                "type": "extra_forbidden",
                "loc": ["body", "gpu"],
                "msg": "Extra inputs are not permitted",
                "input": "h100",
            }
        ]
    }
    raw = '{"step": 1, "loss": NaN, "alive_peers": 1, "samples": 1, "samples_per_second": 1.0, "time": 1.0}'
    nan = client.post(url, content=raw, headers={**token, "Content-Type": "application/json"})
    assert nan.status_code == 422 and nan.json()["detail"][0]["loc"] == ["body", "loss"]
    assert nan.json()["detail"][0]["type"] == "finite_number"
    negative = client.post(url, json=metrics(-1), headers=token)
    assert negative.status_code == 422 and negative.json()["detail"][0]["loc"] == ["body", "step"]
    assert client.post(url, json=metrics(1), headers=bearer("nope")).status_code == 403
    assert client.post(url, json=metrics(1)).status_code == 401
    assert client.get(url).json() == []


def test_checkpoint_upload_list_and_download(client, experiment, settings):
    response = upload(client, experiment, data=b"v1")
    assert response.status_code == 201
    url = "/api/experiments/1/checkpoints/4/archive"
    sha = hashlib.sha256(b"v1").hexdigest()
    assert response.json() == {"step": 4, "loss": 3.25, "size": 2, "sha256": sha, "url": url}
    replaced = upload(client, experiment, data=b"version 2", loss="")
    assert (replaced.status_code, replaced.json()) == (
        409,
        {"detail": "a different checkpoint of step 4 is already stored; it is never replaced"},
    )
    retried = upload(client, experiment, data=b"v1")
    assert (retried.status_code, retried.json()) == (200, response.json())
    (listed,) = client.get("/api/experiments/1/checkpoints").json()
    assert (listed["step"], listed["loss"], listed["size"], listed["url"]) == (4, 3.25, 2, url)
    download = client.get(url, headers=bearer(experiment["token"]))
    assert download.content == b"v1"
    assert download.headers["content-disposition"] == 'attachment; filename="checkpoint-4.tar.gz"'
    assert client.get(url).status_code == 401
    assert client.get(url, headers=bearer("x")).status_code == 403
    assert sorted(p.name for p in (settings.upload_dir / "experiments" / "1").iterdir()) == ["checkpoint-4.tar.gz"]


def test_bad_uploads_store_nothing(client, experiment, settings):
    mismatch = upload(client, experiment, sha256="0" * 64)
    assert mismatch.status_code == 400
    assert mismatch.json()["detail"].startswith("sha256 mismatch: the archive hashes to ")
    too_big = upload(client, experiment, data=b"x" * (1024 * 1024 + 1))
    assert (too_big.status_code, too_big.json()) == (
        413,
        {"detail": "upload larger than the limit of 1048576 bytes (--max_upload_mb)"},
    )
    fields = upload(client, experiment, step=-3)
    assert fields.status_code == 422 and fields.json()["detail"][0]["loc"] == ["body", "step"]
    assert upload(client, experiment, token="wrong").status_code == 403
    assert client.get("/api/experiments/1/checkpoints").json() == []
    assert list((settings.upload_dir / "experiments" / "1").iterdir()) == []


def test_request_bodies_are_bounded(client):
    response = client.post("/api/experiments", json={"name": "x" * 70_000}, headers=ADMIN)
    assert (response.status_code, response.json()) == (413, {"detail": "request body larger than 65536 bytes"})


def test_everything_survives_a_restart(settings, experiment, client):
    client.post("/api/experiments/1/metrics", json=metrics(1), headers=bearer(experiment["monitor_token"]))
    with TestClient(create_app(settings)) as restarted:
        assert restarted.get("/api/experiments/1/config", headers=ADMIN).json() == experiment["config"]
        assert [r["step"] for r in restarted.get("/api/experiments/1/metrics").json()] == [1]


def test_openapi_and_docs_are_served_locally(client):
    paths = client.get("/openapi.json").json()["paths"]
    assert {
        "/api/experiments",
        "/api/experiments/{experiment_id}/config",
        "/api/experiments/{experiment_id}/metrics",
        "/api/experiments/{experiment_id}/checkpoints",
    } <= set(paths)
    docs = client.get("/docs").text
    assert "/static/swagger/swagger-ui-bundle.js" in docs and "cdn" not in docs.lower()
    assert client.get("/static/swagger/swagger-ui-bundle.js").status_code == 200
    assert "script-src 'self'" in client.get("/").headers["content-security-policy"]


def test_the_peer_token_cannot_post_metrics_or_upload(client, experiment):
    peer = experiment["token"]
    refused = client.post("/api/experiments/1/metrics", json=metrics(1), headers=bearer(peer))
    assert (refused.status_code, refused.json()) == (
        403,
        {"detail": "the peer token cannot do this: use the monitor token of experiment 1"},
    )
    assert upload(client, experiment, token=peer).status_code == 403
    assert client.get("/api/experiments/1/metrics").json() == []
    assert client.get("/api/experiments/1/checkpoints").json() == []
    monitor = experiment["monitor_token"]
    assert client.get("/api/experiments/1/config", headers=bearer(monitor)).status_code == 200
    assert client.post("/api/experiments/1/token", headers=bearer(monitor)).status_code == 403


def test_rotating_the_monitor_token_keeps_the_peer_token(client, experiment):
    rotated = client.post("/api/experiments/1/token?role=monitor", headers=ADMIN).json()
    assert rotated["role"] == "monitor" and rotated["token"] != experiment["monitor_token"]
    assert (
        client.post(
            "/api/experiments/1/metrics", json=metrics(1), headers=bearer(experiment["monitor_token"])
        ).status_code
        == 403
    )
    assert (
        client.post("/api/experiments/1/metrics", json=metrics(1), headers=bearer(rotated["token"])).status_code == 200
    )
    assert client.get("/api/experiments/1/config", headers=bearer(experiment["token"])).status_code == 200
    assert client.post("/api/experiments/1/token?role=owner", headers=ADMIN).status_code == 422


@pytest.mark.parametrize(
    "field, value",
    [
        ("alive_peers", 999_999),
        ("samples_per_second", 1e300),
        ("samples", 10**16),
        ("step", 10**13),
        ("loss", 1e300),
        ("time", 1e300),
        ("eval_accuracy", 101.0),
    ],
)
def test_metrics_beyond_their_bounds_are_422(client, experiment, field, value):
    response = client.post(
        "/api/experiments/1/metrics", json={**metrics(1), field: value}, headers=bearer(experiment["monitor_token"])
    )
    assert response.status_code == 422 and response.json()["detail"][0]["loc"] == ["body", field]
    assert client.get("/api/experiments/1/metrics").json() == []


def test_only_the_newest_checkpoints_are_kept_and_their_files_deleted(tmp_path):
    settings = WebSettings(admin_token=ADMIN_TOKEN, db=tmp_path / "e.sqlite", max_request_kb=64, keep_checkpoints=2)
    with TestClient(create_app(settings)) as client:
        experiment = client.post("/api/experiments", json={"name": "k"}, headers=ADMIN).json()
        for step in (2, 4, 6):
            assert upload(client, experiment, step=step, data=f"archive {step}".encode()).status_code == 201
        assert [c["step"] for c in client.get("/api/experiments/1/checkpoints").json()] == [4, 6]
        folder = settings.upload_dir / "experiments" / "1"
        assert sorted(p.name for p in folder.iterdir()) == ["checkpoint-4.tar.gz", "checkpoint-6.tar.gz"]
        old = upload(client, experiment, step=3, data=b"late")
        assert old.status_code == 409 and "older than the 2 kept checkpoints" in old.json()["detail"]
        assert sorted(p.name for p in folder.iterdir()) == ["checkpoint-4.tar.gz", "checkpoint-6.tar.gz"]


HUGE = "99999999999999999999999"


@pytest.mark.parametrize(
    "path",
    [
        f"/api/experiments/{HUGE}",
        f"/api/experiments/{HUGE}/config",
        f"/api/experiments/{HUGE}/metrics",
        f"/api/experiments/{HUGE}/checkpoints",
        "/api/experiments/9223372036854775808/metrics",
        "/api/experiments/\u0661\u0662\u0663/config",
        "/api/experiments/-1/config",
        "/api/experiments/0/config",
        f"/api/experiments/1/checkpoints/{HUGE}/archive",
        "/api/experiments/1/checkpoints/-1/archive",
        "/api/experiments/1/checkpoints/\u0664/archive",
        f"/api/experiments/1/config?version={HUGE}",
        "/api/experiments/1/config?version=0",
        "/api/experiments/1/config?version=\u0661",
        f"/api/experiments/1/metrics?after={HUGE}",
        "/api/experiments/1/metrics?after=-2",
        "/api/experiments/1/metrics?after=+1",
        "/api/experiments/1/metrics?after=\u0661",
        "/api/experiments/1/metrics?limit=0",
        "/api/experiments/1/metrics?limit=1001",
        f"/experiments/{HUGE}",
        f"/experiments/{HUGE}/edit",
        "/experiments/\u0661/clone",
    ],
)
def test_numbers_out_of_range_or_not_ascii_are_4xx(client, experiment, path):
    response = client.get(path, headers=ADMIN)
    assert 400 <= response.status_code < 500, (response.status_code, response.text)


def test_out_of_range_numbers_in_posts_are_4xx(client, experiment):
    for path in (
        f"/api/experiments/{HUGE}/metrics",
        f"/api/experiments/{HUGE}/token",
        f"/api/experiments/{HUGE}/join",
    ):
        assert 400 <= client.post(path, json={}, headers=ADMIN).status_code < 500
    assert client.put(f"/api/experiments/{HUGE}", json={"config": {}}, headers=ADMIN).status_code == 422
    assert upload(client, experiment, step=HUGE).status_code == 422
    assert upload(client, experiment, step="\u0661\u0662").status_code == 422


def test_metrics_are_paged(client, experiment):
    token = bearer(experiment["monitor_token"])
    for step in range(5):
        client.post("/api/experiments/1/metrics", json=metrics(step), headers=token)
    first = client.get("/api/experiments/1/metrics?limit=2").json()
    rest = client.get("/api/experiments/1/metrics?limit=2&after=1").json()
    assert [r["step"] for r in first] == [0, 1] and [r["step"] for r in rest] == [2, 3]


def join_body(key: RSAPrivateKey, username: str = "peer") -> dict:
    return {
        "public_key": base64.b64encode(key.get_public_key().to_bytes()).decode(),
        "username": username,
        "proof": base64.b64encode(sign_join_proof(key, username)).decode(),
    }


def test_join_needs_the_keys_own_proof_and_rotation_revokes_issued_tokens(client, experiment):
    url, peer = "/api/experiments/1/join", bearer(experiment["token"])
    key, outsider = RSAPrivateKey(), RSAPrivateKey()
    first = client.post(url, json=join_body(key), headers=peer).json()
    authority = RSAPublicKey.from_bytes(base64.b64decode(first["authority_public_key"]))
    assert is_token_valid(token_from_json(first["access_token"]), authority)
    borrowed = {**join_body(key), "public_key": join_body(outsider)["public_key"]}  # someone else's key
    assert client.post(url, json=borrowed, headers=peer).status_code == 422
    new_peer_token = client.post("/api/experiments/1/token", headers=ADMIN).json()["token"]
    assert client.post(url, json=join_body(key), headers=peer).status_code == 403
    second = client.post(url, json=join_body(key), headers=bearer(new_peer_token)).json()
    new_authority = RSAPublicKey.from_bytes(base64.b64decode(second["authority_public_key"]))
    assert not is_token_valid(token_from_json(first["access_token"]), new_authority)
    assert is_token_valid(token_from_json(second["access_token"]), new_authority)


def test_a_username_cannot_forge_log_lines(client, experiment, caplog):
    forged = "x\nINFO web.api: Issued an access token for experiment 1 to admin\x1b[2K"
    caplog.set_level(logging.INFO, logger="web.api")
    response = client.post("/api/experiments/1/join", json=join_body(RSAPrivateKey(), forged), headers=ADMIN)
    assert response.status_code == 200
    (line,) = [r.getMessage() for r in caplog.records if "Issued" in r.getMessage()]
    assert "\n" not in line and "\x1b" not in line and "x\\nINFO web.api" in line and "\\x1b[2K" in line


def test_archives_no_experiment_lists_are_removed_at_start_up(settings, experiment, client):
    assert upload(client, experiment, step=4, data=b"kept").status_code == 201
    folder = settings.upload_dir / "experiments" / "1"
    (folder / "checkpoint-9.tar.gz").write_bytes(b"renamed into place, never recorded")
    with TestClient(create_app(settings)) as restarted:
        assert [c["step"] for c in restarted.get("/api/experiments/1/checkpoints").json()] == [4]
    assert sorted(p.name for p in folder.iterdir()) == ["checkpoint-4.tar.gz"]
