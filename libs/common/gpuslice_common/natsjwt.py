"""NATS JWTs (the v2 claims nats-server reads), encoded, signed and verified.

A NATS JWT is ``header.claims.signature``, each part base64url without padding:
the header ``{"typ":"JWT","alg":"ed25519-nkey"}``, the claims JSON (``iss`` the
signer's public nkey, ``sub``, ``aud``, ``iat``, ``exp``, ``jti`` and the
NATS-specific part under ``nats`` with its ``type`` and ``version: 2``), and the
Ed25519 signature of ``header.claims`` by the key named in ``iss``.

The auth callout receives an *authorization request* (signed by the server) and
answers with an *authorization response* that carries a *user* JWT; both are
signed by the account key nats-server's ``auth_callout.issuer`` names.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import time
from collections.abc import Sequence
from typing import Any

from gpuslice_common.nkeys import KeyPair, Role, public_role, verify

__all__ = [
    "JwtError",
    "JwtExpired",
    "authorization_response",
    "decode",
    "encode",
    "user_claims",
]

HEADER = {"typ": "JWT", "alg": "ed25519-nkey"}
NO_LIMIT = -1


class JwtError(ValueError):
    """Not a valid NATS JWT, or not one of the expected kind."""


class JwtExpired(JwtError):
    """A valid NATS JWT whose ``exp`` has passed."""


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError):
        raise JwtError("not base64url") from None


def _json(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def encode(claims: dict[str, Any], signer: KeyPair) -> str:
    """Sign ``claims`` (``iss``, ``iat`` and ``jti`` are filled in) as a NATS JWT."""
    body = dict(claims)
    body["iss"] = signer.public_key
    body.setdefault("iat", int(time.time()))
    body.pop("jti", None)
    # an id that is the hash of the claims without it (the server does not check it)
    body["jti"] = base64.b32encode(hashlib.sha256(_json(body)).digest()).decode().rstrip("=")
    signing_input = f"{_b64(_json(HEADER))}.{_b64(_json(body))}"
    return f"{signing_input}.{_b64(signer.sign(signing_input.encode()))}"


def decode(token: str, issuer_role: Role | None = None, now: float | None = None) -> dict[str, Any]:
    """The claims of a NATS JWT whose signature verifies with its own ``iss``
    (of ``issuer_role``, if given) and that is neither expired nor early.

    The caller decides whether that issuer is to be trusted.
    """
    parts = token.split(".")
    if len(parts) != 3:
        raise JwtError("not a JWT: expected three parts")
    try:
        header = json.loads(_unb64(parts[0]))
        claims = json.loads(_unb64(parts[1]))
    except ValueError:
        raise JwtError("not a JWT: a part is not JSON") from None
    if not isinstance(header, dict) or not isinstance(claims, dict):
        raise JwtError("not a JWT: a part is not an object")
    if str(header.get("typ", "")).upper() != "JWT" or header.get("alg") != HEADER["alg"]:
        raise JwtError(f"not a NATS JWT: header {header}")
    issuer = claims.get("iss")
    if not isinstance(issuer, str) or public_role(issuer) is None:
        raise JwtError("the issuer is not a public nkey")
    if issuer_role is not None and public_role(issuer) != issuer_role:
        raise JwtError(f"the issuer is not a {issuer_role.name.lower()} key")
    signing_input = f"{parts[0]}.{parts[1]}".encode()
    if not verify(issuer, signing_input, _unb64(parts[2])):
        raise JwtError("bad signature")
    at = time.time() if now is None else now
    expires, not_before = claims.get("exp"), claims.get("nbf")
    if isinstance(expires, int) and expires > 0 and at > expires:
        raise JwtExpired("expired")
    if isinstance(not_before, int) and not_before > at:
        raise JwtError("not yet valid")
    return claims


def user_claims(
    user_key: str,
    account: str,
    name: str,
    *,
    publish: Sequence[str],
    subscribe: Sequence[str],
    expires: int | None = None,
    payload: int = NO_LIMIT,
    subs: int = NO_LIMIT,
) -> dict[str, Any]:
    """A user JWT's claims: the user ``user_key`` (the server's nkey for the
    client) placed in ``account`` (in server-configured accounts, ``aud`` names
    it), allowed to publish and subscribe to exactly the given subjects. An
    empty list allows nothing (the server would read an empty allow list as
    everything: it is written as deny ``>``). ``payload`` caps a message's
    bytes and ``subs`` the subscriptions (0: none), ``NO_LIMIT`` by default;
    ``expires`` (epoch seconds) ends the user: the server then closes its
    connection."""
    if payload != NO_LIMIT and payload < 1:
        raise ValueError("payload must be positive or NO_LIMIT")
    if subs != NO_LIMIT and subs < 0:
        raise ValueError("subs must be at least 0 or NO_LIMIT")

    def permission(allowed: Sequence[str]) -> dict[str, list[str]]:
        return {"allow": list(allowed)} if allowed else {"deny": [">"]}

    claims: dict[str, Any] = {
        "sub": user_key,
        "aud": account,
        "name": name,
        "nats": {
            "pub": permission(publish),
            "sub": permission(subscribe),
            "subs": subs,
            "data": NO_LIMIT,
            "payload": payload,
            "type": "user",
            "version": 2,
        },
    }
    if expires is not None:
        claims["exp"] = expires
    return claims


def authorization_response(
    user_key: str, server_id: str, *, user_jwt: str = "", error: str = ""
) -> dict[str, Any]:
    """The callout's answer for ``user_key`` to the server ``server_id``: the
    user's JWT, or why it is refused."""
    if bool(user_jwt) == bool(error):
        raise ValueError("an authorization response carries a user JWT or an error")
    nats: dict[str, Any] = {"type": "authorization_response", "version": 2}
    if user_jwt:
        nats["jwt"] = user_jwt
    else:
        nats["error"] = error
    return {"sub": user_key, "aud": server_id, "nats": nats}
