"""Who may do what: the admin (token or browser session) and each experiment's peer and monitor tokens.

- The admin (``--admin_token``) creates, edits and clones experiments, reads and rotates their tokens. API clients
  send ``Authorization: Bearer <admin token>``; a browser signs in once at /login and gets an HttpOnly,
  SameSite=Strict cookie holding a random session id. The server keeps a keyed hash of it with its creation time:
  a session ends after SESSION_MAX_AGE, at sign-out, or when the app restarts with another admin token.
- A request authenticated by the session cookie that changes anything (any method but GET/HEAD/OPTIONS) must come
  from the app's own origin (``Origin``, else ``Sec-Fetch-Site: same-origin``): SameSite does not separate two
  ports or sibling hosts, so a page elsewhere on the same host could otherwise post forms as the admin.
  Bearer-authenticated requests need no such check: a browser never adds that header by itself.
- The *peer token* reads the experiment's config, joins its DHT (``/join``) and downloads checkpoints. The *monitor
  token* does all of that and also posts metrics and uploads checkpoints. The admin may do everything.
- No credentials: 401 with ``WWW-Authenticate: Bearer``. Wrong credentials: 403. Secrets are compared with
  ``hmac.compare_digest``.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Collection
from urllib.parse import urlsplit

from fastapi import HTTPException, Request

from web.store import MONITOR, PEER, Experiment

SESSION_COOKIE = "collab_admin_session"
SESSION_MAX_AGE = 12 * 3600
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
CROSS_ORIGIN = "cross-origin request refused: send it from this app's own pages, or use Authorization: Bearer"
ANY_MEMBER = (PEER, MONITOR)
MONITOR_ONLY = (MONITOR,)


def new_session_id() -> str:
    return secrets.token_urlsafe(32)


def session_key(admin_token: str, session_id: str) -> str:
    """What the store keeps of a session: keyed by the admin token, so a new admin token ends every session."""
    return hmac.new(admin_token.encode(), session_id.encode(), hashlib.sha256).hexdigest()


def same(a: str | None, b: str) -> bool:
    return a is not None and hmac.compare_digest(a.encode(), b.encode())


def bearer_token(request: Request) -> str | None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def origin_of(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}".lower()


def is_same_origin(origin: str | None, fetch_site: str | None, own_origins: Collection[str]) -> bool:
    """Whether a browser says the request comes from one of ``own_origins`` (Origin first, then Sec-Fetch-Site)."""
    if origin is not None:
        return origin.lower() in own_origins
    return fetch_site == "same-origin"


def _own_origins(request: Request) -> set[str]:
    """The public URL's origin and the one the browser addressed (Host), which differ behind a proxy."""
    return {origin_of(request.app.state.settings.base_url), f"{request.url.scheme}://{request.headers.get('host')}"}


def _has_live_session(request: Request) -> bool:
    session_id = request.cookies.get(SESSION_COOKIE)
    if not session_id or len(session_id) > 128:
        return False
    key = session_key(request.app.state.settings.admin_token, session_id)
    return request.app.state.store.session_is_live(key, SESSION_MAX_AGE)


def is_admin(request: Request) -> bool:
    """Admin bearer token, or a live session; a session's unsafe request from another origin is a 403."""
    if same(bearer_token(request), request.app.state.settings.admin_token):
        return True
    if not _has_live_session(request):
        return False
    if request.method not in SAFE_METHODS and not is_same_origin(
        request.headers.get("origin"), request.headers.get("sec-fetch-site"), _own_origins(request)
    ):
        raise HTTPException(403, CROSS_ORIGIN)
    return True


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
    if bearer_token(request) is None:
        raise HTTPException(403, "the admin session has expired or ended: sign in again")
    raise HTTPException(403, "wrong admin token")


def check_experiment_access(request: Request, experiment: Experiment, roles: Collection[str]) -> None:
    """Allow a token of one of ``roles`` (PEER, MONITOR) or the admin; 401 without credentials, 403 otherwise."""
    tokens = {PEER: experiment.token, MONITOR: experiment.monitor_token}
    given = bearer_token(request)
    if any(same(given, tokens[role]) for role in roles) or is_admin(request):
        return
    if not _has_credentials(request):
        raise HTTPException(
            401,
            f"token required: send Authorization: Bearer <{' or '.join(roles)} token of experiment {experiment.id}>",
            {"WWW-Authenticate": "Bearer"},
        )
    if roles == MONITOR_ONLY and same(given, experiment.token):
        raise HTTPException(403, f"the peer token cannot do this: use the monitor token of experiment {experiment.id}")
    raise HTTPException(403, f"wrong token for experiment {experiment.id}")
