"""HTML pages: sign-in, the experiment form (new, edit, clone) and the experiment page with its live dashboard.

The form posts to the same validation as the API and the command line; on an error the form comes back with the
user's input and the message beside the field it names (status 422).
"""

from __future__ import annotations

import math
import shlex
import time
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from collab.errors import ConfigError
from web.api import ExperimentId
from web.auth import SESSION_COOKIE, SESSION_MAX_AGE, is_admin, new_session_id, same, session_key
from web.forms import config_from_form, display_values, form_sections, validated_config
from web.store import MONITOR, PEER, Experiment, Store

router = APIRouter(include_in_schema=False)
SECTIONS = form_sections()
MAX_NAME_CHARS = 200


def join_commands(base_url: str, experiment_id: int, peer_token: str, monitor_token: str) -> dict[str, str]:
    """The commands the experiment page shows, ready to paste: peers (peer token), the monitor (monitor token)."""
    api = f"{base_url}/api/experiments/{experiment_id}"
    config = f"--config {shlex.quote(api + '/config')}"
    monitor = (
        f"python run_training_monitor.py {config} --config_token {shlex.quote(monitor_token)} "
        f"--report_url {shlex.quote(api + '/metrics')}"
    )
    return {
        "trainer": f"python run_trainer.py {config} --config_token {shlex.quote(peer_token)}",
        "monitor": monitor,
        "monitor_with_uploads": f"{monitor} --store_checkpoints --upload_interval 60 "
        f"--upload_to {shlex.quote(api + '/checkpoints')}",
    }


def duration_text(seconds: float) -> str:
    """``2 h 5 min``, ``3 min 20 s`` or ``40 s``: as dashboard.js's ``duration`` writes it."""
    total = max(0, math.floor(seconds + 0.5))
    hours, minutes = total // 3600, total % 3600 // 60
    return f"{hours} h {minutes} min" if hours else f"{minutes} min {total % 60} s" if minutes else f"{total} s"


def utc_text(timestamp: float) -> str:
    """``2026-11-25 19:11:02 UTC``: as dashboard.js's ``utc`` writes it."""
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(timestamp))


def contributor_rows(contributors: list[dict[str, Any]]) -> list[dict[str, str]]:
    """The Contributors table's cells as text (the template escapes them); dashboard.js refreshes them alike."""
    return [
        {
            "contributor": c["name"] or c["peer"],
            "peer": c["peer"],
            "samples": str(c["samples"]),
            "rounds": str(c["rounds"]),
            "online": duration_text(c["seconds_online"]),
            "last_seen": utc_text(c["last_seen"]),
        }
        for c in contributors
    ]


def _store(request: Request) -> Store:
    return request.app.state.store


def _render(request: Request, template: str, status_code: int = 200, **context: Any) -> HTMLResponse:
    context.setdefault("admin", is_admin(request))
    return request.app.state.templates.TemplateResponse(request, template, context, status_code=status_code)


def _login_redirect(request: Request) -> RedirectResponse:
    return RedirectResponse(f"/login?next={request.url.path}", 303)


def _experiment_or_404(request: Request, experiment_id: int) -> Experiment:
    experiment = _store(request).experiment(experiment_id)
    if experiment is None:
        raise HTTPException(404, f"no experiment {experiment_id}")
    return experiment


def _safe_next(target: str | None) -> str:
    """Only same-site paths: never redirect a signed-in admin to another site."""
    return target if target and target.startswith("/") and not target.startswith(("//", "/\\")) else "/"


@router.get("/", response_class=HTMLResponse)
def index(request: Request) -> HTMLResponse:
    return _render(request, "index.html", experiments=_store(request).experiments())


@router.get("/login", response_class=HTMLResponse)
def login_page(request: Request, next: str = "/") -> HTMLResponse:
    return _render(request, "login.html", next=_safe_next(next), error=None)


@router.post("/login")
async def login(request: Request) -> Response:
    form = await request.form()
    target = _safe_next(str(form.get("next", "/")))
    admin_token = request.app.state.settings.admin_token
    if not same(str(form.get("token", "")), admin_token):
        return _render(request, "login.html", 403, next=target, error="Wrong admin token.")
    session_id = new_session_id()
    _store(request).add_session(session_key(admin_token, session_id), SESSION_MAX_AGE)
    response = RedirectResponse(target, 303)
    response.set_cookie(
        SESSION_COOKIE,
        session_id,
        max_age=SESSION_MAX_AGE,
        httponly=True,
        samesite="strict",
        secure=request.app.state.settings.base_url.startswith("https://"),
    )
    return response


@router.post("/logout")
def logout(request: Request) -> Response:
    """End the session on the server too: a copy of the cookie stops working."""
    session_id = request.cookies.get(SESSION_COOKIE)
    if session_id:
        _store(request).end_session(session_key(request.app.state.settings.admin_token, session_id))
    response = RedirectResponse("/", 303)
    response.delete_cookie(SESSION_COOKIE, httponly=True, samesite="strict")
    return response


NEW_FORM = ("New experiment", "/experiments/new")  # (title, where the form posts)


def _edit_form(experiment: Experiment) -> tuple[str, str]:
    title = f"Edit experiment {experiment.id} (saving makes version {experiment.version + 1})"
    return title, f"/experiments/{experiment.id}/edit"


def _form_page(
    request: Request, form: tuple[str, str], name: str, config: dict, errors: dict | None = None, status: int = 200
) -> HTMLResponse:
    title, action = form
    return _render(
        request,
        "form.html",
        status,
        title=title,
        action=action,
        name=name,
        sections=SECTIONS,
        values=display_values(config, SECTIONS),
        errors=errors or {},
    )


async def _submitted(request: Request) -> tuple[str, dict[str, Any], dict[str, Any] | None, dict[str, str]]:
    """(name, config as typed, validated config or None, errors by field; "" is the whole form)."""
    form = await request.form()
    values = {key: value for key, value in form.items() if isinstance(value, str)}
    name = values.get("name", "").strip()
    config = config_from_form(values, SECTIONS)
    errors: dict[str, str] = {}
    if not name or len(name) > MAX_NAME_CHARS:
        errors["name"] = f"Give the experiment a name (1 to {MAX_NAME_CHARS} characters)."
    try:
        stored = validated_config(config)
    except ConfigError as e:
        stored = None
        errors[e.field if e.field in config else ""] = str(e)
    return name, config, (None if errors else stored), errors


@router.get("/experiments/new", response_class=HTMLResponse)
def new_form(request: Request) -> Response:
    if not is_admin(request):
        return _login_redirect(request)
    return _form_page(request, NEW_FORM, "", {})


async def _save_form(request: Request, form: tuple[str, str], save: Callable[[str, dict], Experiment]) -> Response:
    """The form again with its errors (422), or ``save(name, config)`` and on to the experiment's page."""
    name, config, stored, errors = await _submitted(request)
    if stored is None:
        return _form_page(request, form, name, config, errors, 422)
    return RedirectResponse(f"/experiments/{save(name, stored).id}", 303)


def _require_admin_session(request: Request) -> None:
    if not is_admin(request):
        raise HTTPException(403, "sign in as the admin first")


@router.post("/experiments/new")
async def create(request: Request) -> Response:
    _require_admin_session(request)
    return await _save_form(request, NEW_FORM, _store(request).create_experiment)


@router.get("/experiments/{experiment_id}/edit", response_class=HTMLResponse)
def edit_form(experiment_id: ExperimentId, request: Request) -> Response:
    if not is_admin(request):
        return _login_redirect(request)
    experiment = _experiment_or_404(request, experiment_id)
    return _form_page(request, _edit_form(experiment), experiment.name, experiment.config)


@router.post("/experiments/{experiment_id}/edit")
async def edit(experiment_id: ExperimentId, request: Request) -> Response:
    _require_admin_session(request)
    experiment = _experiment_or_404(request, experiment_id)
    return await _save_form(
        request, _edit_form(experiment), lambda name, config: _store(request).save_version(experiment_id, name, config)
    )


@router.get("/experiments/{experiment_id}/clone", response_class=HTMLResponse)
def clone_form(experiment_id: ExperimentId, request: Request) -> Response:
    if not is_admin(request):
        return _login_redirect(request)
    experiment = _experiment_or_404(request, experiment_id)
    clone = (f"Clone experiment {experiment_id}", "/experiments/new")
    return _form_page(request, clone, f"{experiment.name} (copy)", experiment.config)


@router.post("/experiments/{experiment_id}/token")
async def rotate(experiment_id: ExperimentId, request: Request) -> Response:
    _require_admin_session(request)
    _experiment_or_404(request, experiment_id)
    role = (await request.form()).get("role", PEER)
    if role not in (PEER, MONITOR):
        raise HTTPException(422, f"role: {PEER} or {MONITOR}")
    _store(request).rotate_token(experiment_id, role)
    return RedirectResponse(f"/experiments/{experiment_id}", 303)


@router.get("/experiments/{experiment_id}", response_class=HTMLResponse)
def experiment_page(experiment_id: ExperimentId, request: Request) -> HTMLResponse:
    """The dashboard (anyone) plus, for the admin, the token, the join commands and the edit/clone buttons."""
    experiment = _experiment_or_404(request, experiment_id)
    admin = is_admin(request)
    base_url = request.app.state.settings.base_url
    return _render(
        request,
        "experiment.html",
        experiment=experiment,
        admin=admin,
        commands=join_commands(base_url, experiment.id, experiment.token, experiment.monitor_token) if admin else None,
        versions=_store(request).versions(experiment.id) if admin else [],
        max_steps=int(experiment.config.get("max_steps") or 0),
        contributors=contributor_rows(_store(request).contributors(experiment.id)["contributors"]),
    )
