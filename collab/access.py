"""Access tokens: only peers the experiment's web app let in can read or write the experiment's DHT records.

The pattern of hivemind's ``TokenAuthorizerBase`` as sahajBERT used it. The web app holds an RSA *authority key*
per experiment. A peer proves it holds the experiment's peer (or monitor) token by calling
``POST /api/experiments/{id}/join`` with its own public key and that key's signature of a join proof, and gets back
an ``AccessToken`` (its public key, an expiry, the authority's signature) and the authority's public key. Every DHT
request and response then carries the sender's token and a signature by the sender's key; a peer accepts only those
whose token the authority signed and that have not expired.

Staying up while the web app is down: a peer refreshes its token once a quarter of its lifetime has passed, in the
background, and keeps using the current one while refreshes fail (retried with backoff, at least every quarter of
the time the token has left, logged once per outage), so an outage shorter than three quarters of the lifetime
(less a second's retry and one request's timeout) goes unnoticed. It pins the authority key it got first: a
refresh that brings another key (the admin rotated a token, or someone else answers at that URL) is refused and
logged, and the peer runs on until its token expires; restart it with the current token to let it in again. Clocks
must agree within hivemind's one minute (``TokenAuthorizerBase._MAX_CLIENT_SERVICER_TIME_DIFF``): a peer whose
clock is further off has its DHT requests refused.

What this does NOT cover: hivemind authorizes DHT calls only. Gradient and parameter averaging and state
downloads travel over libp2p streams that are not checked, so a peer that knows another's address can still
join an averaging group. Use it to keep strangers out of the experiment's records and off its DHT, not as a
defence against a peer that already knows where the others are.
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import logging
import time

from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils.auth import TokenAuthorizerBase
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from collab import events
from collab.errors import AccessError
from collab.wire import bearer_header

logger = logging.getLogger(__name__)

REFRESH_FRACTION = 0.25  # of a token's lifetime, after which the peer asks for the next one
FIRST_RETRY_DELAY, MAX_RETRY_DELAY = 1.0, 60.0  # seconds between failed refreshes, doubling
RETRY_SHARE_OF_TIME_LEFT = 0.25  # and at most this share of the time the current token has left


def within_time_left(seconds: float, seconds_left: float) -> float:
    """``seconds``, but at most a quarter of the current token's ``seconds_left`` (and FIRST_RETRY_DELAY at least):
    so a wait during an outage that ends in time still ends in time."""
    return max(FIRST_RETRY_DELAY, min(seconds, RETRY_SHARE_OF_TIME_LEFT * seconds_left))


def next_retry_delay(previous: float, seconds_left: float) -> float:
    """Seconds until the next refresh after a failed one: doubling from FIRST_RETRY_DELAY up to MAX_RETRY_DELAY,
    ``within_time_left``."""
    return within_time_left(min(MAX_RETRY_DELAY, max(FIRST_RETRY_DELAY, 2 * previous)), seconds_left)


JOIN_PROOF = b"collab-train join v1\n"


def _signed_bytes(token: AccessToken) -> bytes:
    return b"\n".join([token.username.encode(), token.public_key, token.expiration_time.encode()])


def _join_proof_bytes(public_key: bytes, username: str) -> bytes:
    return JOIN_PROOF + username.encode() + b"\n" + public_key


def sign_join_proof(private_key: RSAPrivateKey, username: str) -> bytes:
    """Proof that the joining peer holds the private key of the public key it asks a token for."""
    return private_key.sign(_join_proof_bytes(private_key.get_public_key().to_bytes(), username))


def verify_join_proof(public_key: bytes, username: str, proof: bytes) -> bool:
    """Whether ``proof`` is ``public_key``'s signature of the join proof; raises ValueError on a non-RSA key."""
    return RSAPublicKey.from_bytes(public_key).verify(_join_proof_bytes(public_key, username), proof)


def new_authority_key() -> bytes:
    """A fresh RSA authority key, serialized (DER) for storage."""
    return RSAPrivateKey().to_bytes()


def load_authority_key(der: bytes) -> RSAPrivateKey:
    key = RSAPrivateKey.__new__(RSAPrivateKey)
    key.__setstate__({"_private_key": der})
    return key


def issue_token(authority: RSAPrivateKey, peer_public_key: bytes, username: str, lifetime_s: float) -> AccessToken:
    """The authority's signed token for ``peer_public_key``, valid for ``lifetime_s`` seconds from now."""
    RSAPublicKey.from_bytes(peer_public_key)  # raises on anything that is not an RSA public key
    expiration = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=lifetime_s)
    token = AccessToken(username=username, public_key=peer_public_key, expiration_time=expiration.isoformat())
    token.signature = authority.sign(_signed_bytes(token))
    return token


def token_expiration(token: AccessToken) -> datetime.datetime | None:
    try:
        expiration = datetime.datetime.fromisoformat(token.expiration_time)
    except ValueError:
        return None
    return expiration if expiration.tzinfo is not None else None


def is_token_valid(token: AccessToken, authority_public_key: RSAPublicKey) -> bool:
    """Signed by the authority and not expired."""
    expiration = token_expiration(token)
    if expiration is None or expiration <= datetime.datetime.now(datetime.timezone.utc):
        return False
    return authority_public_key.verify(_signed_bytes(token), token.signature)


def token_to_json(token: AccessToken) -> dict[str, str]:
    return {
        "username": token.username,
        "public_key": base64.b64encode(token.public_key).decode(),
        "expiration_time": token.expiration_time,
        "signature": base64.b64encode(token.signature).decode(),
    }


def token_from_json(data: dict[str, str]) -> AccessToken:
    return AccessToken(
        username=data["username"],
        public_key=base64.b64decode(data["public_key"]),
        expiration_time=data["expiration_time"],
        signature=base64.b64decode(data["signature"]),
    )


class WebAppAuthorizer(TokenAuthorizerBase):
    """Gets this peer's access token from the web app's join endpoint and checks everyone else's.

    ``fetch_first_token()`` is called in the main process before the DHT starts, so a wrong URL or token fails at
    once with a clear message and the authority key is pinned; the DHT process then refreshes the token by itself,
    in the background, while the current one is still valid (see the module docstring).
    """

    def __init__(self, join_url: str, experiment_token: str | None, username: str = "peer", timeout: float = 30.0):
        super().__init__()
        self.join_url, self.experiment_token = join_url, experiment_token
        self.username, self.timeout = username, timeout
        self.authority_public_key: RSAPublicKey | None = None
        self._refresh_after = 0.0  # wall-clock time (s) after which the current token is due for a refresh
        self._retry_delay = 0.0  # 0 while refreshes succeed; else the wait before the next attempt
        self._refreshing: asyncio.Task | None = None

    def _request_token(self, timeout: float | None = None) -> tuple[AccessToken, RSAPublicKey]:
        """A new token from the web app, waiting at most ``timeout`` seconds (the authorizer's own by default)."""
        import requests

        headers = bearer_header(self.experiment_token)
        body = {
            "public_key": base64.b64encode(self.local_public_key.to_bytes()).decode(),
            "username": self.username,
            "proof": base64.b64encode(sign_join_proof(self._local_private_key, self.username)).decode(),
        }
        try:
            response = requests.post(self.join_url, json=body, headers=headers, timeout=timeout or self.timeout)
        except requests.RequestException as e:
            raise AccessError(f"--authorization_url: could not reach {self.join_url} ({e})") from None
        if response.status_code in (401, 403):
            raise AccessError(
                f"--authorization_url: {self.join_url} refused to let this peer in ({response.status_code}); "
                "check the experiment's peer token (--web_token or --config_token)"
            )
        if response.status_code >= 400:
            raise AccessError(
                f"--authorization_url: {self.join_url} answered {response.status_code}: {response.text[:200]}"
            )
        try:
            data = response.json()
            authority = RSAPublicKey.from_bytes(base64.b64decode(data["authority_public_key"]))
            token = token_from_json(data["access_token"])
        except (ValueError, KeyError, TypeError) as e:
            raise AccessError(f"--authorization_url: {self.join_url} sent no access token ({e!r})") from None
        return token, authority

    def _accept(self, token: AccessToken, authority: RSAPublicKey) -> None:
        """Take a token signed by the pinned authority (the first one seen); AccessError otherwise."""
        if self.authority_public_key is None:
            self.authority_public_key = authority
        elif authority.to_bytes() != self.authority_public_key.to_bytes():
            raise AccessError(
                f"--authorization_url: {self.join_url} now signs with another authority key (was a token rotated?); "
                "refused: restart this peer with the current peer token"
            )
        if not self.is_token_valid(token):
            raise AccessError(f"--authorization_url: {self.join_url} sent a token that does not verify")
        expiration = token_expiration(token).timestamp()
        now = time.time()
        self._local_access_token = token
        self._refresh_after = now + (expiration - now) * REFRESH_FRACTION
        logger.info("Got an access token valid until %s", token.expiration_time)
        events.emit("access_token", valid_until=token.expiration_time)

    @staticmethod
    def _seconds_left(token: AccessToken) -> float:
        expiration = token_expiration(token)
        return expiration.timestamp() - time.time() if expiration is not None else 0.0

    def fetch_first_token(self) -> None:
        self._accept(*self._request_token())

    async def get_token(self, timeout: float | None = None) -> AccessToken:
        token, authority = await asyncio.get_running_loop().run_in_executor(None, self._request_token, timeout)
        self._accept(token, authority)
        return token

    def is_token_valid(self, access_token: AccessToken) -> bool:
        return self.authority_public_key is not None and is_token_valid(access_token, self.authority_public_key)

    def does_token_need_refreshing(self, access_token: AccessToken) -> bool:
        return access_token is not self._local_access_token or time.time() >= self._refresh_after

    async def refresh_token_if_needed(self) -> None:
        """Wait for a token only when there is no valid one; otherwise refresh it in the background."""
        token = self._local_access_token
        if token is not None and self.is_token_valid(token):
            if self.does_token_need_refreshing(token) and (self._refreshing is None or self._refreshing.done()):
                self._refreshing = asyncio.create_task(self._refresh())
            return
        async with self._refresh_lock:
            if self._local_access_token is None or not self.is_token_valid(self._local_access_token):
                await self.get_token()

    async def _refresh(self) -> None:
        """One refresh attempt; a failure keeps the current token and sets the next attempt's time (backoff). An app
        that hangs (stopped, or a black-holed link) is given up on within a quarter of the time the token has left,
        as a retry would be, so the retries go on."""
        async with self._refresh_lock:
            current = self._local_access_token
            try:
                await self.get_token(timeout=within_time_left(self.timeout, self._seconds_left(current)))
            except AccessError as e:
                if not self._retry_delay:
                    logger.warning(
                        "Could not refresh the access token (%s); using the current one until %s and retrying",
                        e,
                        current.expiration_time,
                    )
                    events.emit("access_refresh_failed", valid_until=current.expiration_time)
                self._retry_delay = next_retry_delay(self._retry_delay, self._seconds_left(current))
                self._refresh_after = time.time() + self._retry_delay
                return
            if self._retry_delay:
                logger.info("Refreshed the access token again after failed attempts")
            self._retry_delay = 0.0
