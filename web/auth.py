"""Who may do what: the admin token, the admin's browser session, and each experiment's own token.

- The admin (``--admin_token``) creates, edits and clones experiments and reads their tokens. API clients send
  ``Authorization: Bearer <admin token>``; a browser signs in once at /login and gets an HttpOnly, SameSite=Strict
  cookie holding an HMAC of the admin token (never the token itself; restarting with a new token ends sessions).
- An experiment's token lets peers and the monitor read its config, post metrics and upload or download
  checkpoints of that experiment only. The admin may do all of that too.
- No credentials: 401 with ``WWW-Authenticate: Bearer``. Wrong credentials: 403. Tokens are compared with
  ``hmac.compare_digest``.
"""

from __future__ import annotations

import hashlib
import hmac

from fastapi import HTTPException, Request

SESSION_COOKIE = "collab_admin_session"
SESSION_MAX_AGE = 12 * 3600


def session_value(admin_token: str) -> str:
    """The admin session cookie's value: derived from the admin token, so the cookie never carries the token."""
    return hmac.new(admin_token.encode(), b"collab-web admin session v1", hashlib.sha256).hexdigest()


def same(a: str | None, b: str) -> bool:
    return a is not None and hmac.compare_digest(a.encode(), b.encode())


def bearer_token(request: Request) -> str | None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def is_admin(request: Request) -> bool:
    admin_token = request.app.state.settings.admin_token
    return same(bearer_token(request), admin_token) or same(
        request.cookies.get(SESSION_COOKIE), session_value(admin_token)
    )


def _has_credentials(request: Request) -> bool:
    return bearer_token(request) is not None or SESSION_COOKIE in request.cookies


def require_admin(request: Request) -> None:
    """FastAPI dependency: 401 without credentials, 403 with wrong ones."""
    if is_admin(request):
        return
    if not _has_credentials(request):
        raise HTTPException(
            401, "admin token required: send Authorization: Bearer <admin token>", {"WWW-Authenticate": "Bearer"}
        )
    raise HTTPException(403, "wrong admin token")


def check_experiment_access(request: Request, experiment_id: int, experiment_token: str) -> None:
    """Allow the experiment's token or the admin; 401 without credentials, 403 with wrong ones."""
    if same(bearer_token(request), experiment_token) or is_admin(request):
        return
    if not _has_credentials(request):
        raise HTTPException(
            401,
            f"token required: send Authorization: Bearer <token of experiment {experiment_id}>",
            {"WWW-Authenticate": "Bearer"},
        )
    raise HTTPException(403, f"wrong token for experiment {experiment_id}")
