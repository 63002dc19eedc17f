"""JSON API: experiments and their configs (admin), metrics and checkpoints (the monitor), read by the dashboard.

Reading the metrics and the checkpoint list is public (the dashboard is read-only); everything else needs a token,
see web/auth.py for which. Errors: 401/403 (token), 404 (no such experiment), 409 (checkpoint step already stored
or older than every kept one), 413 (too large), 422 (invalid input, with the field names in ``loc``), 400 (upload
whose sha256 does not match). Every id, step and version is a whole number in ASCII digits up to 2**63 - 1.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import math
import os
import re
import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Path, Query, Request
from fastapi.responses import FileResponse, JSONResponse
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field
from pydantic_core import PydanticCustomError
from starlette.concurrency import run_in_threadpool

from collab.access import issue_token, load_authority_key, new_authority_key, token_to_json, verify_join_proof
from collab.errors import ConfigError
from collab.schema import MAX_CONTRIBUTED_SAMPLES, PublicName
from collab.schema import MAX_STEP as MAX_CONTRIBUTED_EPOCHS
from monitor.aggregate import MAX_CONTRIBUTORS_REPORTED
from web.auth import ANY_MEMBER, MONITOR_ONLY, check_experiment_access, is_admin, require_admin
from web.forms import served_config, validated_config
from web.logsafe import printable
from web.store import INT64_MAX, MONITOR, PEER, Checkpoint, Experiment, Store
from web.upload import receive_upload

logger = logging.getLogger(__name__)
router = APIRouter(prefix="/api", tags=["experiments"])
SHA256 = re.compile(r"[0-9a-f]{64}")
ASCII_INT = re.compile(r"-?[0-9]{1,19}")
MAX_STEP = 10**12
MAX_METRICS_PAGE = 1000


def ascii_int(value: Any) -> Any:
    """Text must be plain ASCII digits (Python's int() also takes other scripts' digits, and any length)."""
    if isinstance(value, str) and not ASCII_INT.fullmatch(value):
        raise PydanticCustomError("int_parsing", "a whole number in ASCII digits (at most 19) is required")
    return value


ExperimentId = Annotated[int, BeforeValidator(ascii_int), Path(ge=1, le=INT64_MAX)]
StepPath = Annotated[int, BeforeValidator(ascii_int), Path(ge=0, le=MAX_STEP)]
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
    proof: str = Field(min_length=1, max_length=4096, description="base64 signature of the join proof by the key")


class ContributorIn(BaseModel):
    """One peer's contribution as the monitor reports it (monitor.aggregate.top_contributors); the name is checked
    again here, by the same rule, since whoever holds the monitor token can post anything."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    peer: str = Field(pattern=r"^[0-9a-f]{12}$", description="first 12 hex digits of the sha256 of its public key")
    name: PublicName | None = None
    samples: int = Field(ge=0, le=MAX_CONTRIBUTED_SAMPLES)
    rounds: int = Field(ge=0, le=MAX_CONTRIBUTED_EPOCHS)
    seconds_online: float = Field(ge=0, le=1e11)
    last_seen: float = Field(ge=0, le=1e11)


class MetricsIn(BaseModel):
    """One aggregated global step, as the monitor posts it; evaluation results and contributors are optional."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    step: int = Field(ge=0, le=MAX_STEP)
    loss: float | None = Field(ge=-1e6, le=1e6)
    alive_peers: int = Field(ge=0, le=100_000)
    samples: int = Field(ge=0, le=10**15)
    samples_per_second: float = Field(ge=0, le=1e9)
    time: float = Field(ge=0, le=1e11)
    eval_loss: float | None = Field(default=None, ge=-1e6, le=1e6)
    eval_perplexity: float | None = Field(default=None, ge=0, le=1e30)
    eval_accuracy: float | None = Field(default=None, ge=0, le=100)
    eval_exact_match: float | None = Field(default=None, ge=0, le=100)
    eval_f1: float | None = Field(default=None, ge=0, le=100)
    contributors: list[ContributorIn] | None = Field(default=None, max_length=MAX_CONTRIBUTORS_REPORTED)


def store_of(request: Request) -> Store:
    return request.app.state.store


def find_experiment(request: Request, experiment_id: int) -> Experiment:
    experiment = store_of(request).experiment(experiment_id)
    if experiment is None:
        raise HTTPException(404, f"no experiment {experiment_id}")
    return experiment


def for_members(request: Request, experiment_id: ExperimentId) -> Experiment:
    """Dependency: the experiment, if the request carries its peer or monitor token (or the admin's)."""
    experiment = find_experiment(request, experiment_id)
    check_experiment_access(request, experiment, ANY_MEMBER)
    return experiment


def for_monitor(request: Request, experiment_id: ExperimentId) -> Experiment:
    """Dependency: the experiment, if the request carries its monitor token (or the admin's)."""
    experiment = find_experiment(request, experiment_id)
    check_experiment_access(request, experiment, MONITOR_ONLY)
    return experiment


def config_or_422(config: dict[str, Any]) -> dict[str, Any]:
    try:
        return validated_config(config)
    except ConfigError as e:
        loc = ["body", "config", e.field] if e.field else ["body", "config"]
        raise HTTPException(422, [{"type": "config_error", "loc": loc, "msg": str(e)}]) from None


def experiment_json(request: Request, experiment: Experiment) -> dict[str, Any]:
    """The experiment as the API returns it; its tokens only for the admin."""
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
        body["monitor_token"] = experiment.monitor_token
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
def get_experiment(request: Request, experiment: Experiment = Depends(for_members)) -> dict[str, Any]:
    """The experiment with its latest config and version list (peer or monitor token, or admin)."""
    return {**experiment_json(request, experiment), "versions": store_of(request).versions(experiment.id)}


@router.put("/experiments/{experiment_id}", dependencies=[Depends(require_admin)])
def update_experiment(experiment_id: ExperimentId, body: ExperimentUpdate, request: Request) -> dict[str, Any]:
    """Save a new version of the config (admin); older versions stay readable with ?version=N."""
    experiment = find_experiment(request, experiment_id)
    config = config_or_422(body.config)
    return experiment_json(
        request, store_of(request).save_version(experiment_id, body.name or experiment.name, config)
    )


@router.post("/experiments/{experiment_id}/clone", status_code=201, dependencies=[Depends(require_admin)])
def clone_experiment(experiment_id: ExperimentId, body: CloneIn, request: Request) -> dict[str, Any]:
    """A new experiment with the same config and new tokens (admin)."""
    source = find_experiment(request, experiment_id)
    return experiment_json(
        request, store_of(request).create_experiment(body.name or f"{source.name} (copy)", source.config)
    )


@router.post("/experiments/{experiment_id}/token", dependencies=[Depends(require_admin)])
def rotate_token(
    experiment_id: ExperimentId, request: Request, role: Annotated[str, Query(pattern=f"^({PEER}|{MONITOR})$")] = PEER
) -> dict[str, str]:
    """Issue a new peer (default) or monitor token (admin); the old one stops working at once.

    The experiment's authority key is replaced too, so DHT access tokens issued before stop verifying: restart the
    monitor and every peer with the current tokens.
    """
    find_experiment(request, experiment_id)
    return {"token": store_of(request).rotate_token(experiment_id, role), "role": role}


@router.get("/experiments/{experiment_id}/config")
def get_config(
    request: Request,
    version: Annotated[int | None, BeforeValidator(ascii_int), Query(ge=1, le=INT64_MAX)] = None,
    experiment: Experiment = Depends(for_members),
) -> dict[str, Any]:
    """The JSON config for ``run_trainer.py --config URL`` and ``run_training_monitor.py --config URL``."""
    if version is None:
        return served_config(experiment.config)
    old = store_of(request).experiment(experiment.id, version)
    if old is None:
        raise HTTPException(404, f"experiment {experiment.id} has no version {version}")
    return served_config(old.config)


@router.post("/experiments/{experiment_id}/join")
def join(body: JoinIn, request: Request, experiment: Experiment = Depends(for_members)) -> dict[str, Any]:
    """A signed, expiring access token for this peer's public key (peer or monitor token), and the authority's key.

    ``proof`` is the key's signature of the join proof (collab/access.py), so a token is only issued to the holder
    of the private key. Peers started with ``--authorization_url`` call this and accept DHT requests only from
    token holders.
    """
    try:
        peer_key = base64.b64decode(body.public_key, validate=True)
        if not verify_join_proof(peer_key, body.username, base64.b64decode(body.proof, validate=True)):
            raise ValueError("the proof is not this key's signature")
        authority = load_authority_key(store_of(request).authority_key(experiment.id, new_authority_key))
        token = issue_token(authority, peer_key, body.username, request.app.state.settings.access_token_lifetime)
    except ValueError:
        raise HTTPException(
            422,
            [
                {
                    "type": "value_error",
                    "loc": ["body", "public_key"],
                    "msg": "not a base64 RSA public key with a matching base64 proof signature",
                }
            ],
        ) from None
    logger.info(
        "Issued an access token for experiment %d to %s (until %s)",
        experiment.id,
        printable(body.username),
        token.expiration_time,
    )
    return {
        "access_token": token_to_json(token),
        "authority_public_key": base64.b64encode(authority.get_public_key().to_bytes()).decode(),
    }


@router.post("/experiments/{experiment_id}/metrics")
def post_metrics(body: MetricsIn, request: Request, experiment: Experiment = Depends(for_monitor)) -> dict[str, Any]:
    """One aggregated global step from the monitor (monitor token); posting a step again replaces it.

    ``contributors`` are kept apart (the latest list only, read with GET .../contributors): the step's record, as
    stored and returned, is without them."""
    record = body.model_dump(exclude={"contributors"})
    contributors = None if body.contributors is None else [c.model_dump() for c in body.contributors]
    store_of(request).put_metrics(experiment.id, record, contributors)
    return record


@router.get("/experiments/{experiment_id}/metrics")
def get_metrics(
    experiment_id: ExperimentId,
    request: Request,
    after: Annotated[int, BeforeValidator(ascii_int), Query(ge=-1, le=MAX_STEP)] = -1,
    limit: Annotated[int, BeforeValidator(ascii_int), Query(ge=1, le=MAX_METRICS_PAGE)] = MAX_METRICS_PAGE,
) -> list[dict[str, Any]]:
    """Up to ``limit`` reported steps after ``after``, ordered by step (public: the dashboard polls it).

    A full page means there may be more: ask again with ``after`` set to the last step received.
    """
    find_experiment(request, experiment_id)
    return store_of(request).metrics(experiment_id, after, limit)


@router.get("/experiments/{experiment_id}/contributors")
def get_contributors(experiment_id: ExperimentId, request: Request) -> dict[str, Any]:
    """The peers with the most samples, as the monitor last reported them (public: the dashboard shows them):
    ``{"step": N or null, "contributors": [{"peer", "name", "samples", "rounds", "seconds_online", "last_seen"}]}``.
    Samples and rounds are what each peer's signed records claim."""
    find_experiment(request, experiment_id)
    return store_of(request).contributors(experiment_id)


def _upload_fields(fields: dict[str, str]) -> tuple[int, float | None, str]:
    errors = []
    for name in fields.keys() - {"step", "loss", "sha256"}:
        errors.append({"type": "extra_forbidden", "loc": ["body", name], "msg": "Extra inputs are not permitted"})
    step_text, loss_text = fields.get("step", "").strip(), fields.get("loss", "").strip()
    sha256 = fields.get("sha256", "").strip().lower()
    if not (ASCII_INT.fullmatch(step_text) and 0 <= int(step_text) <= MAX_STEP):
        errors.append(
            {"type": "int_parsing", "loc": ["body", "step"], "msg": f"step: a whole number 0..{MAX_STEP} is required"}
        )
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
async def upload_checkpoint(request: Request, experiment: Experiment = Depends(for_monitor)) -> dict:
    """Upload ``checkpoint-<step>.tar.gz`` (multipart: step, loss, sha256, file ``archive``; monitor token).

    Streamed to the data folder, bounded by --max_upload_mb (413), checked against ``sha256`` (400, nothing
    stored), renamed into place atomically. A stored checkpoint is never replaced: the same step again is 409
    (200 if it is the same archive, as after a retry); so is a step older than all --keep_checkpoints kept ones.
    The app keeps the newest --keep_checkpoints and deletes older archives.
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
            kept = await run_in_threadpool(store_of(request).checkpoints, experiment.id)
            existing = next((c for c in kept if c.step == step), None)
            if existing is not None and existing.sha256 == sha256:
                return JSONResponse(_upload_json(experiment.id, existing), 200)
            _refuse_replacement(step, existing, kept, settings.keep_checkpoints)
            os.replace(received.path, final)
            await run_in_threadpool(_fsync_dir, folder)
            forgotten = await run_in_threadpool(
                store_of(request).put_checkpoint, experiment.id, checkpoint, settings.keep_checkpoints
            )
            await run_in_threadpool(_delete_archives, folder, forgotten)
    finally:
        received.path.unlink(missing_ok=True)
    return _upload_json(experiment.id, checkpoint)


def _upload_json(experiment_id: int, checkpoint: Checkpoint) -> dict[str, Any]:
    body = checkpoint_json(experiment_id, checkpoint)
    body.pop("time")
    return body


def _refuse_replacement(step: int, existing: Checkpoint | None, kept: list[Checkpoint], keep: int) -> None:
    """409 for a step already stored with another archive, or older than every one of ``keep`` kept checkpoints."""
    if existing is not None:
        raise HTTPException(409, f"a different checkpoint of step {step} is already stored; it is never replaced")
    if len(kept) >= keep and step < kept[0].step:
        raise HTTPException(
            409, f"step {step} is older than the {keep} kept checkpoints (oldest: step {kept[0].step}); not stored"
        )


def _delete_archives(folder, forgotten: list[Checkpoint]) -> None:
    """Delete archives the store no longer lists, durably (the folder is synced after the unlinks)."""
    for checkpoint in forgotten:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(checkpoint.path)
    if forgotten:
        _fsync_dir(folder)


def _fsync_dir(folder) -> None:
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


@router.get("/experiments/{experiment_id}/checkpoints")
def list_checkpoints(experiment_id: ExperimentId, request: Request) -> list[dict[str, Any]]:
    """Uploaded checkpoints ordered by step (public); ``url`` downloads one with the token or an admin session."""
    find_experiment(request, experiment_id)
    return [checkpoint_json(experiment_id, c) for c in store_of(request).checkpoints(experiment_id)]


@router.get("/experiments/{experiment_id}/checkpoints/{step}/archive")
def download_checkpoint(
    step: StepPath, request: Request, experiment: Experiment = Depends(for_members)
) -> FileResponse:
    """The archive of one checkpoint (peer or monitor token, or admin)."""
    checkpoint = store_of(request).checkpoint(experiment.id, step)
    if checkpoint is None or not os.path.exists(checkpoint.path):
        raise HTTPException(404, f"experiment {experiment.id} has no checkpoint at step {step}")
    return FileResponse(
        checkpoint.path,
        media_type="application/gzip",
        filename=f"checkpoint-{step}.tar.gz",
        headers={"X-Checkpoint-SHA256": checkpoint.sha256},
    )
