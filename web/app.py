"""The FastAPI application: JSON API, HTML pages, static assets (all served locally: it works offline)."""

from __future__ import annotations

import re
from pathlib import Path

import jinja2
from fastapi import FastAPI, HTTPException, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from collab.wire import json_safe
from web.settings import WebSettings
from web.store import Store
from web.upload import remove_interrupted_uploads, remove_unlisted_archives

HERE = Path(__file__).resolve().parent
UPLOAD_PATH = re.compile(r"/api/experiments/\d+/checkpoints")
CSP = (
    "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; object-src 'none'; "
    "base-uri 'none'; frame-ancestors 'none'; form-action 'self'"
)
# Swagger UI's page starts itself with an inline script.
DOCS_CSP = CSP.replace("style-src 'self'", "style-src 'self' 'unsafe-inline'").replace(
    "script-src 'self'", "script-src 'self' 'unsafe-inline'"
)


async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    """FastAPI's 422 body, which would fail to encode a rejected NaN (a 500 instead of a 422)."""
    return JSONResponse({"detail": json_safe(jsonable_encoder(exc.errors()))}, 422)


class BodyLimit:
    """Refuse request bodies over a bound with 413, whether or not the client sent Content-Length."""

    def __init__(self, app: ASGIApp, max_bytes: int, max_upload_bytes: int):
        self.app, self.max_bytes, self.max_upload_bytes = app, max_bytes, max_upload_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        upload = scope["method"] == "POST" and UPLOAD_PATH.fullmatch(scope["path"])
        limit = self.max_upload_bytes if upload else self.max_bytes
        detail = f"request body larger than {limit} bytes"
        length = dict(scope["headers"]).get(b"content-length", b"0")
        if not length.isdigit() or int(length) > limit:
            await JSONResponse({"detail": detail}, 413)(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > limit:
                raise HTTPException(413, detail)
            return message

        await self.app(scope, limited_receive, send)


class SecurityHeaders:
    """Content-Security-Policy and friends on every response: no inline script, no framing, no sniffing."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        csp = DOCS_CSP if scope["path"] == "/docs" else CSP

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                message["headers"] += [
                    (b"content-security-policy", csp.encode()),
                    (b"x-content-type-options", b"nosniff"),
                    (b"x-frame-options", b"DENY"),
                    (b"referrer-policy", b"same-origin"),
                ]
            await send(message)

        await self.app(scope, receive, send_with_headers)


def create_app(settings: WebSettings) -> FastAPI:
    """The app for these settings; creates the database and the upload folder if missing."""
    from web.api import router as api_router
    from web.pages import router as pages_router

    app = FastAPI(
        title="collab-train experiments",
        description="Configure collaborative training experiments, serve their configs to peers and the monitor, "
        "collect the monitor's metrics and checkpoints. Send `Authorization: Bearer <token>`: the admin token "
        "for creating and editing, an experiment's peer token for its config and /join, its monitor token for "
        "that and posting metrics and checkpoints.",
        docs_url=None,
        redoc_url=None,
    )
    app.add_exception_handler(RequestValidationError, validation_error)
    app.state.settings = settings
    app.state.store = Store(settings.db)
    settings.upload_dir.mkdir(parents=True, exist_ok=True)
    remove_interrupted_uploads(settings.upload_dir)
    remove_unlisted_archives(settings.upload_dir, app.state.store.checkpoint_paths())
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(HERE / "templates"), autoescape=True)
    app.state.templates = Jinja2Templates(env=env)
    app.mount("/static", StaticFiles(directory=HERE / "static"), name="static")
    app.include_router(api_router)
    app.include_router(pages_router)

    @app.get("/docs", include_in_schema=False)
    def docs() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url="/openapi.json",
            title="collab-train API",
            swagger_js_url="/static/swagger/swagger-ui-bundle.js",
            swagger_css_url="/static/swagger/swagger-ui.css",
            swagger_favicon_url="/static/swagger/favicon-32x32.png",
        )

    app.add_middleware(SecurityHeaders)
    app.add_middleware(
        BodyLimit,
        max_bytes=settings.max_request_kb * 1024,
        max_upload_bytes=settings.max_upload_mb * 1024 * 1024 + 64 * 1024,
    )
    return app
