"""Telemetry tokens: what a GPU container proves its pod with when it connects to NATS.

A token is ``gst1.<claims>.<signature>``: the claims are base64url (no
padding) of ``{"n": node, "p": pod UID, "i": issued (Unix seconds)}`` and the
signature is Ed25519 over ``gst1.<claims>`` by a key only the inventory holds.
That key is derived from the callout's account seed (HKDF-SHA256 with a label
of its own), so no second secret is needed and the two keys never sign each
other's messages. The version tag also keeps a token from being read as a
NATS or Kubernetes JWT, which start with ``eyJ``.

The token does not expire: a container keeps the environment it started with.
Whether its pod still holds its devices is the callout's check, in the ledger.
"""

from __future__ import annotations

import base64
import binascii
import json
import time
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from gpuslice_common.nkeys import KeyPair
from gpuslice_common.subjects import node_token, uid_token

TAG = "gst1"
_LABEL = b"gpuslice telemetry token v1"
MAX_TOKEN = 1000  # the interposer's buffer holds 1023 characters


class TokenRefused(Exception):
    """The token is not one the inventory issued; the message says why."""


@dataclass(frozen=True)
class TelemetryClaims:
    node: str
    pod_uid: str
    issued: int


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    try:
        return base64.b64decode(text + "=" * (-len(text) % 4), altchars=b"-_", validate=True)
    except (binascii.Error, ValueError):
        raise TokenRefused("not base64url") from None


def is_telemetry_token(token: str) -> bool:
    return token.startswith(TAG + ".")


class TelemetryTokens:
    """Issues and verifies telemetry tokens with one Ed25519 key."""

    def __init__(self, key: Ed25519PrivateKey) -> None:
        self._key = key
        self._public = key.public_key()

    @classmethod
    def from_account(cls, account: KeyPair) -> TelemetryTokens:
        """The key derived from the callout's account seed."""
        derived = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_LABEL).derive(
            account.raw_seed
        )
        return cls(Ed25519PrivateKey.from_private_bytes(derived))

    def issue(self, node: str, pod_uid: str) -> str:
        """A token that lets one container of ``pod_uid`` on ``node`` publish its telemetry."""
        node_token(node)  # raises ValueError for what is no node name
        uid_token(pod_uid)
        claims = {"n": node, "p": pod_uid, "i": int(time.time())}
        body = f"{TAG}.{_b64(json.dumps(claims, separators=(',', ':')).encode())}"
        token = f"{body}.{_b64(self._key.sign(body.encode()))}"
        if len(token) > MAX_TOKEN:
            raise ValueError(f"node name too long for a telemetry token: {node!r}")
        return token

    def verify(self, token: str) -> TelemetryClaims:
        """The claims of a token this key issued; TokenRefused otherwise."""
        parts = token.split(".")
        if len(parts) != 3 or parts[0] != TAG:
            raise TokenRefused("not a telemetry token")
        try:
            self._public.verify(_unb64(parts[2]), f"{parts[0]}.{parts[1]}".encode())
        except InvalidSignature:
            raise TokenRefused("bad signature") from None
        try:
            claims = json.loads(_unb64(parts[1]))
            node, pod_uid, issued = claims["n"], claims["p"], claims["i"]
        except (ValueError, KeyError, TypeError):
            raise TokenRefused("malformed claims") from None
        if not (isinstance(node, str) and isinstance(pod_uid, str) and isinstance(issued, int)):
            raise TokenRefused("malformed claims")
        try:
            node_token(node)
            uid_token(pod_uid)
        except ValueError as exc:
            raise TokenRefused(str(exc)) from None
        return TelemetryClaims(node, pod_uid, issued)
