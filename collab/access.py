"""Access tokens: only peers the experiment's web app let in can read or write the experiment's DHT records.

The pattern of hivemind's ``TokenAuthorizerBase`` as sahajBERT used it. The web app holds an RSA *authority key*
per experiment. A peer proves it holds the experiment token by calling ``POST /api/experiments/{id}/join`` with
its own public key and gets back an ``AccessToken`` (its public key, an expiry, the authority's signature) and the
authority's public key. Every DHT request and response then carries the sender's token and a signature by the
sender's key; a peer accepts only those whose token the authority signed and that have not expired. Tokens are
refreshed a minute before they expire.

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

from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils.auth import TokenAuthorizerBase
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

logger = logging.getLogger(__name__)

REFRESH_BEFORE_EXPIRY = datetime.timedelta(minutes=1)


class AccessError(RuntimeError):
    """The web app refused to issue a token: the message says which setting to check."""


def _signed_bytes(token: AccessToken) -> bytes:
    return b"\n".join([token.username.encode(), token.public_key, token.expiration_time.encode()])


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

    ``fetch_first_token()`` is called in the main process before the DHT starts, so a wrong URL or experiment
    token fails at once with a clear message; the DHT process then refreshes the token by itself.
    """

    def __init__(self, join_url: str, experiment_token: str | None, username: str = "peer", timeout: float = 30.0):
        super().__init__()
        self.join_url, self.experiment_token = join_url, experiment_token
        self.username, self.timeout = username, timeout
        self.authority_public_key: RSAPublicKey | None = None

    def _request_token(self) -> AccessToken:
        import requests

        headers = {"Authorization": f"Bearer {self.experiment_token}"} if self.experiment_token else {}
        body = {"public_key": base64.b64encode(self.local_public_key.to_bytes()).decode(), "username": self.username}
        try:
            response = requests.post(self.join_url, json=body, headers=headers, timeout=self.timeout)
        except requests.RequestException as e:
            raise AccessError(f"--authorization_url: could not reach {self.join_url} ({e})") from None
        if response.status_code in (401, 403):
            raise AccessError(
                f"--authorization_url: {self.join_url} refused to let this peer in ({response.status_code}); "
                "check the experiment token (--web_token or --config_token)"
            )
        if response.status_code >= 400:
            raise AccessError(
                f"--authorization_url: {self.join_url} answered {response.status_code}: {response.text[:200]}"
            )
        data = response.json()
        self.authority_public_key = RSAPublicKey.from_bytes(base64.b64decode(data["authority_public_key"]))
        token = token_from_json(data["access_token"])
        logger.info("Got an access token valid until %s", token.expiration_time)
        return token

    def fetch_first_token(self) -> None:
        self._local_access_token = self._request_token()
        if not self.is_token_valid(self._local_access_token):
            raise AccessError(f"--authorization_url: {self.join_url} sent a token that does not verify")

    async def get_token(self) -> AccessToken:
        return await asyncio.get_running_loop().run_in_executor(None, self._request_token)

    def is_token_valid(self, access_token: AccessToken) -> bool:
        return self.authority_public_key is not None and is_token_valid(access_token, self.authority_public_key)

    def does_token_need_refreshing(self, access_token: AccessToken) -> bool:
        expiration = token_expiration(access_token)
        return expiration is None or expiration - REFRESH_BEFORE_EXPIRY <= datetime.datetime.now(datetime.timezone.utc)
