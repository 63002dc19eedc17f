"""JSON API: experiments and their configs (admin), metrics and checkpoints (the monitor), read by the dashboard.

Reading the metrics and the checkpoint list is public (the dashboard is read-only); everything else needs a token,
see web/auth.py. Errors: 401/403 (token), 404 (no such experiment), 413 (too large), 422 (invalid input, with the
field names in ``loc``), 400 (upload whose sha256 does not match).
"""

from __future__ import annotations

import asyncio
import base64
import logging
import math
import os
import re
import time
from typing import Any

from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.responses import FileResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from arguments import ConfigError
from collab.access import issue_token, load_authority_key, new_authority_key, token_to_json
from web.auth import check_experiment_access, is_admin, require_admin
from web.forms import validated_config
from web.store import Checkpoint, Experiment, Store
from web.upload import receive_upload

logger = logging.getLogger(__name__)
router = APIRouter(prefix="/api", tags=["experiments"])
SHA256 = re.compile(r"[0-9a-f]{64}")
_upload_locks: dict[int, asyncio.Lock] = {}


class ExperimentIn(BaseModel):
    """A new experiment: a name and any settings of arguments.py (missing ones take their defaults)."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=200)
    config: dict[str, Any] = Field(default_factory=dict)


class ExperimentUpdate(BaseModel):
    """A new version: the whole config (missing settings take their defaults), optionally a new name."""

    model_config = ConfigDict(extra="forbid")
    name: str | None = Field(default=None, min_length=1, max_length=200)
    config: dict[str, Any] = Field(default_factory=dict)


class CloneIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str | None = Field(default=None, min_length=1, max_length=200)


class JoinIn(BaseModel):
    """A peer asking for an access token: its RSA public key (base64 DER, as hivemind serializes it)."""

    model_config = ConfigDict(extra="forbid")
    public_key: str = Field(min_length=1, max_length=4096)
    username: str = Field(default="peer", min_length=1, max_length=200)


class MetricsIn(BaseModel):
    """One aggregated global step, as the monitor posts it; evaluation results are optional."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    step: int = Field(ge=0)
    loss: float | None
    alive_peers: int = Field(ge=0)
    samples: int = Field(ge=0)
    samples_per_second: float = Field(ge=0)
    time: float
    eval_loss: float | None = None
    eval_perplexity: float | None = None
    eval_accuracy: float | None = None
    eval_exact_match: float | None = None
    eval_f1: float | None = None


def store_of(request: Request) -> Store:
    return request.app.state.store


def find_experiment(request: Request, experiment_id: int) -> Experiment:
    experiment = store_of(request).experiment(experiment_id)
    if experiment is None:
        raise HTTPException(404, f"no experiment {experiment_id}")
    return experiment


def experiment_for_token(request: Request, experiment_id: int) -> Experiment:
    """Dependency: the experiment, if the request carries its token (or the admin's)."""
    experiment = find_experiment(request, experiment_id)
    check_experiment_access(request, experiment_id, experiment.token)
    return experiment


def config_or_422(config: dict[str, Any]) -> dict[str, Any]:
    try:
        return validated_config(config)
    except ConfigError as e:
        loc = ["body", "config", e.field] if e.field else ["body", "config"]
        raise HTTPException(422, [{"type": "config_error", "loc": loc, "msg": str(e)}]) from None


def experiment_json(request: Request, experiment: Experiment) -> dict[str, Any]:
    """The experiment as the API returns it; its token only for the admin."""
    body = {
        "id": experiment.id,
        "name": experiment.name,
        "version": experiment.version,
        "created": experiment.created,
        "updated": experiment.updated,
        "config": experiment.config,
        "config_url": f"/api/experiments/{experiment.id}/config",
        "dashboard_url": f"/experiments/{experiment.id}",
    }
    if is_admin(request):
        body["token"] = experiment.token
    return body


def checkpoint_json(experiment_id: int, checkpoint: Checkpoint) -> dict[str, Any]:
    url = f"/api/experiments/{experiment_id}/checkpoints/{checkpoint.step}/archive"
    return {
        "step": checkpoint.step,
        "loss": checkpoint.loss,
        "size": checkpoint.size,
        "sha256": checkpoint.sha256,
        "url": url,
        "time": checkpoint.time,
    }


@router.post("/experiments", status_code=201, dependencies=[Depends(require_admin)])
def create_experiment(body: ExperimentIn, request: Request) -> dict[str, Any]:
    """Create an experiment (admin). 422 names the setting to fix in ``detail[0].loc``."""
    experiment = store_of(request).create_experiment(body.name, config_or_422(body.config))
    return experiment_json(request, experiment)


@router.get("/experiments")
def list_experiments(request: Request) -> list[dict[str, Any]]:
    """Every experiment's id, name, version and last update (public: no configs, no tokens)."""
    return store_of(request).experiments()


@router.get("/experiments/{experiment_id}")
def get_experiment(request: Request, experiment: Experiment = Depends(experiment_for_token)) -> dict[str, Any]:
    """The experiment with its latest config and version list (experiment token or admin)."""
    return {**experiment_json(request, experiment), "versions": store_of(request).versions(experiment.id)}


@router.put("/experiments/{experiment_id}", dependencies=[Depends(require_admin)])
def update_experiment(experiment_id: int, body: ExperimentUpdate, request: Request) -> dict[str, Any]:
    """Save a new version of the config (admin); older versions stay readable with ?version=N."""
    experiment = find_experiment(request, experiment_id)
    config = config_or_422(body.config)
    return experiment_json(
        request, store_of(request).save_version(experiment_id, body.name or experiment.name, config)
    )


@router.post("/experiments/{experiment_id}/clone", status_code=201, dependencies=[Depends(require_admin)])
def clone_experiment(experiment_id: int, body: CloneIn, request: Request) -> dict[str, Any]:
    """A new experiment with the same config and a new token (admin)."""
    source = find_experiment(request, experiment_id)
    return experiment_json(
        request, store_of(request).create_experiment(body.name or f"{source.name} (copy)", source.config)
    )


@router.post("/experiments/{experiment_id}/token", dependencies=[Depends(require_admin)])
def rotate_token(experiment_id: int, request: Request) -> dict[str, str]:
    """Issue a new experiment token (admin); the old one stops working at once."""
    find_experiment(request, experiment_id)
    return {"token": store_of(request).rotate_token(experiment_id)}


@router.get("/experiments/{experiment_id}/config")
def get_config(
    request: Request, version: int | None = None, experiment: Experiment = Depends(experiment_for_token)
) -> dict[str, Any]:
    """The JSON config for ``run_trainer.py --config URL`` and ``run_training_monitor.py --config URL``."""
    if version is None:
        return experiment.config
    old = store_of(request).experiment(experiment.id, version)
    if old is None:
        raise HTTPException(404, f"experiment {experiment.id} has no version {version}")
    return old.config


@router.post("/experiments/{experiment_id}/join")
def join(body: JoinIn, request: Request, experiment: Experiment = Depends(experiment_for_token)) -> dict[str, Any]:
    """A signed, expiring access token for this peer's public key (experiment token), and the authority's key.

    Peers started with ``--authorization_url`` call this and accept DHT requests only from token holders.
    """
    try:
        peer_key = base64.b64decode(body.public_key, validate=True)
        authority = load_authority_key(store_of(request).authority_key(experiment.id, new_authority_key))
        token = issue_token(authority, peer_key, body.username, request.app.state.settings.access_token_lifetime)
    except ValueError:
        raise HTTPException(
            422, [{"type": "value_error", "loc": ["body", "public_key"], "msg": "not a base64 RSA public key"}]
        ) from None
    logger.info(
        "Issued an access token for experiment %d to %s (until %s)",
        experiment.id,
        body.username,
        token.expiration_time,
    )
    return {
        "access_token": token_to_json(token),
        "authority_public_key": base64.b64encode(authority.get_public_key().to_bytes()).decode(),
    }


@router.post("/experiments/{experiment_id}/metrics")
def post_metrics(
    body: MetricsIn, request: Request, experiment: Experiment = Depends(experiment_for_token)
) -> dict[str, Any]:
    """One aggregated global step from the monitor (experiment token); posting a step again replaces it."""
    record = body.model_dump()
    store_of(request).put_metrics(experiment.id, record)
    return record


@router.get("/experiments/{experiment_id}/metrics")
def get_metrics(experiment_id: int, request: Request, after: int = -1) -> list[dict[str, Any]]:
    """Every reported step after ``after``, ordered by step (public: the dashboard polls it)."""
    find_experiment(request, experiment_id)
    return store_of(request).metrics(experiment_id, after)


def _upload_fields(fields: dict[str, str]) -> tuple[int, float | None, str]:
    errors = []
    for name in fields.keys() - {"step", "loss", "sha256"}:
        errors.append({"type": "extra_forbidden", "loc": ["body", name], "msg": "Extra inputs are not permitted"})
    step_text, loss_text = fields.get("step", "").strip(), fields.get("loss", "").strip()
    sha256 = fields.get("sha256", "").strip().lower()
    if not (step_text.isdigit() and len(step_text) < 16):
        errors.append({"type": "int_parsing", "loc": ["body", "step"], "msg": "step: a whole number >= 0 is required"})
    loss = None
    if loss_text:
        try:
            loss = float(loss_text)
        except ValueError:
            loss = math.nan
        if not math.isfinite(loss):
            errors.append({"type": "finite_number", "loc": ["body", "loss"], "msg": "loss: a finite number or empty"})
    if not SHA256.fullmatch(sha256):
        errors.append({"type": "value_error", "loc": ["body", "sha256"], "msg": "sha256: 64 hex digits required"})
    if errors:
        raise HTTPException(422, errors)
    return int(step_text), loss, sha256


@router.post("/experiments/{experiment_id}/checkpoints", status_code=201)
async def upload_checkpoint(request: Request, experiment: Experiment = Depends(experiment_for_token)) -> dict:
    """Upload ``checkpoint-<step>.tar.gz`` (multipart: step, loss, sha256, file ``archive``; experiment token).

    Streamed to the data folder, bounded by --max_upload_mb (413), checked against ``sha256`` (400, nothing
    stored), renamed into place atomically; uploading the same step again replaces it.
    """
    settings = request.app.state.settings
    folder = settings.upload_dir / "experiments" / str(experiment.id)
    fields, received = await receive_upload(request, folder, settings.max_upload_mb * 1024 * 1024, "archive")
    try:
        step, loss, sha256 = _upload_fields(fields)
        if received.sha256 != sha256:
            raise HTTPException(
                400,
                f"sha256 mismatch: the archive hashes to {received.sha256}, the form says {sha256}; nothing stored",
            )
        final = folder / f"checkpoint-{step}.tar.gz"
        checkpoint = Checkpoint(step, loss, received.size, sha256, str(final), time.time())
        async with _upload_locks.setdefault(experiment.id, asyncio.Lock()):
            os.replace(received.path, final)
            await run_in_threadpool(_fsync_dir, folder)
            await run_in_threadpool(store_of(request).put_checkpoint, experiment.id, checkpoint)
    finally:
        received.path.unlink(missing_ok=True)
    body = checkpoint_json(experiment.id, checkpoint)
    body.pop("time")
    return body


def _fsync_dir(folder) -> None:
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


@router.get("/experiments/{experiment_id}/checkpoints")
def list_checkpoints(experiment_id: int, request: Request) -> list[dict[str, Any]]:
    """Uploaded checkpoints ordered by step (public); ``url`` downloads one with the token or an admin session."""
    find_experiment(request, experiment_id)
    return [checkpoint_json(experiment_id, c) for c in store_of(request).checkpoints(experiment_id)]


@router.get("/experiments/{experiment_id}/checkpoints/{step}/archive")
def download_checkpoint(
    step: int, request: Request, experiment: Experiment = Depends(experiment_for_token)
) -> FileResponse:
    """The archive of one checkpoint (experiment token or admin)."""
    checkpoint = store_of(request).checkpoint(experiment.id, step)
    if checkpoint is None or not os.path.exists(checkpoint.path):
        raise HTTPException(404, f"experiment {experiment.id} has no checkpoint at step {step}")
    return FileResponse(
        checkpoint.path,
        media_type="application/gzip",
        filename=f"checkpoint-{step}.tar.gz",
        headers={"X-Checkpoint-SHA256": checkpoint.sha256},
    )
