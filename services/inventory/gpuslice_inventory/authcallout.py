"""The NATS auth callout: node agents and GPU containers prove who they are.

nats-server sends every client that is not one of the static service users
(``auth_callout.auth_users``) to ``$SYS.REQ.USER.AUTH`` as an authorization
request JWT it signs; every inventory replica answers in one queue group. The
client's ``auth_token`` decides:

* a *telemetry token* (``gst1.``, :mod:`gpuslice_inventory.tokens`) that this
  inventory's key signed, for a pod the ledger holds on that node and has not
  released: a user that may publish ``<prefix>.telemetry.<node>.<pod uid>`` and
  subscribe to nothing, for ``telemetry_session``: the server then closes the
  connection and the interposer reconnects through the callout, which checks
  the ledger again;
* anything else is taken for a node agent's projected ServiceAccount token and
  sent to the API server's TokenReview for the node-agent audience: it must be
  authenticated, be the device plugin's ServiceAccount, and name its node
  (``authentication.kubernetes.io/node-name``). The user may publish
  ``<prefix>.inventory.<node>`` and ``<prefix>.node.<node>.>``, and subscribe
  only below its own inbox prefix ``_INBOX.<node>``. It expires with the token
  (the server then closes the connection; the agent reconnects with the token
  kubelet has rotated in).

Users carry limits: a container 64 KiB a message and no subscriptions, a node
agent 1 MiB and 64 (nats-server 2.15.1 applies a callout user's permissions and
expiry but not these; the inventory bounds what it reads itself).

The answer is a response JWT, signed by the account key whose public half is
the server's ``auth_callout.issuer``, carrying the user JWT (placed in the
services' account by its ``aud``) or the reason for refusing. Each refusal is
one log line and counted by reason.

Anyone who reaches NATS's port can make the server ask, so the callout is built
not to be starved by junk: every request is answered in its own task, at most
``callout_concurrency`` at once (the subscription waits while that many run);
a request whose expiry (the server's own deadline for the answer) has passed
is dropped before any work; a token that is neither a telemetry token nor
JWT-shaped (three base64url parts, the first two JSON objects) is refused
without asking the API server; and TokenReview outcomes are remembered, keyed
by the token's SHA-256, in a bounded LRU: a node agent's acceptance until its
token's ``exp`` (read unverified, only for this) but at most
``REVIEW_CACHE_MAX_S``, a refusal for ``REFUSAL_CACHE_S``. A failed review (the
API server away) is not remembered.

The requests are not encrypted (no ``xkey``): they carry the clients' tokens
from nats-server to its own callout user over the cluster network, which is
where clients send those tokens anyway.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import json
import logging
import math
import re
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import Error as NatsError

from gpuslice_common import natsjwt
from gpuslice_common.bus import BusError, flush_client
from gpuslice_common.config import InventorySettings
from gpuslice_common.kube import NODE_NAME_EXTRA, KubeApi, KubeError
from gpuslice_common.ledger import Ledger, LedgerError
from gpuslice_common.models import PlacementState
from gpuslice_common.nkeys import KeyPair, Role
from gpuslice_common.subjects import Subjects, node_token
from gpuslice_inventory.tokens import TelemetryTokens, TokenRefused, is_telemetry_token

log = logging.getLogger(__name__)

AUTH_SUBJECT = "$SYS.REQ.USER.AUTH"

REVIEW_CACHE_MAX_S = 600.0  # a node agent's acceptance is remembered at most this long
REFUSAL_CACHE_S = 10.0  # a token the review refused is refused again without asking
REVIEW_CACHE_SIZE = 4096  # entries, least recently used dropped first
MAX_TOKEN = 16 * 1024  # bytes of a token worth looking at
# What one message of a callout user may carry. A container sends samples of at
# most 24 KiB (GS_NATS_PAYLOAD_MAX in native/src/nats.h); a node agent's largest
# message is its NodeInventory, about 360 KB at the model's bounds (1024 cards,
# every name at its longest).
CONTAINER_MAX_PAYLOAD = 64 * 1024
NODE_AGENT_MAX_PAYLOAD = 1024 * 1024
NODE_AGENT_MAX_SUBS = 64  # its replies come on one inbox subscription
_B64URL = re.compile(r"[A-Za-z0-9_-]+")
# refusals that are the review's verdict on the token itself (not a failure to ask)
_VERDICTS = frozenset(
    {"token-not-authenticated", "token-wrong-audience", "not-node-agent", "no-node-name"}
)


class Refused(Exception):
    """The client is not let in: ``reason`` is a short label (the metric's),
    the message the detail."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


@dataclass
class CalloutStats:
    accepted: Counter[str] = field(default_factory=Counter)  # by kind: node, telemetry
    refused: Counter[str] = field(default_factory=Counter)  # by reason
    errors: int = 0  # requests that could not be answered at all
    expired: int = 0  # requests dropped unanswered: the server had stopped waiting
    reviews: int = 0  # TokenReviews asked of the API server
    cached: int = 0  # node agent tokens decided from the review cache


@dataclass(frozen=True)
class Identity:
    kind: str  # "node" or "telemetry"
    name: str  # the user name the server logs
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    expires: int | None = None
    payload: int = natsjwt.NO_LIMIT  # bytes of one message
    subs: int = natsjwt.NO_LIMIT


def _json_part(part: str) -> Any:
    try:
        return json.loads(base64.urlsafe_b64decode(part + "=" * (-len(part) % 4)))
    except (binascii.Error, ValueError, RecursionError):  # nested too deep to parse
        return None


def _jwt_claims(token: str) -> dict[str, Any] | None:
    """The claims of a JWT-shaped token (three base64url parts, header and
    claims JSON objects), read without checking anything else; None when the
    token is not shaped so."""
    if len(token) > MAX_TOKEN:
        return None
    parts = token.split(".")
    if len(parts) != 3 or not all(_B64URL.fullmatch(part) for part in parts):
        return None
    header, claims = _json_part(parts[0]), _json_part(parts[1])
    if not isinstance(header, dict) or not isinstance(claims, dict):
        return None
    return claims


def _token_expiry(token: str) -> int | None:
    """The ``exp`` of a JWT-shaped token, read without checking it (the API
    server's review has checked it); None when it has none."""
    claims = _jwt_claims(token)
    expires = claims.get("exp") if claims is not None else None
    return expires if isinstance(expires, int) and expires > 0 else None


class _ReviewCache:
    """TokenReview outcomes by the token's SHA-256, each until its own deadline
    (monotonic seconds); at most ``size`` entries, the least recently used
    dropped first."""

    def __init__(self, size: int = REVIEW_CACHE_SIZE) -> None:
        self.size = size
        self._entries: OrderedDict[bytes, tuple[float, Identity | Refused]] = OrderedDict()

    @staticmethod
    def key(token: str) -> bytes:
        return hashlib.sha256(token.encode()).digest()

    def get(self, key: bytes) -> Identity | Refused | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        until, outcome = entry
        if time.monotonic() >= until:
            del self._entries[key]
            return None
        self._entries.move_to_end(key)
        return outcome

    def put(self, key: bytes, outcome: Identity | Refused, seconds: float) -> None:
        if seconds <= 0:
            return
        self._entries[key] = (time.monotonic() + seconds, outcome)
        self._entries.move_to_end(key)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)


class AuthCallout:
    """Decides who a connecting client is and what it may do."""

    def __init__(
        self,
        settings: InventorySettings,
        signer: KeyPair,
        *,
        kube: KubeApi | None,
        ledger: Ledger | None,
        subjects: Subjects,
    ) -> None:
        if signer.role != Role.ACCOUNT:
            raise ValueError("the callout signs with an account key")
        self.settings = settings
        self.signer = signer
        self.tokens = TelemetryTokens.from_account(signer)
        self.kube = kube
        self.ledger = ledger
        self.subjects = subjects
        self.stats = CalloutStats()
        self._nc: NATS | None = None
        self._sub: Subscription | None = None
        self._reviewed = _ReviewCache()
        self._slots = asyncio.Semaphore(settings.callout_concurrency)
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def issue_telemetry_token(self) -> Callable[[str, str], str]:
        """``(node, pod_uid) -> token``: what Allocate hands a GPU container."""
        return self.tokens.issue

    # ------------------------------------------------------------ deciding

    async def answer(self, request_jwt: str) -> str:
        """The signed response to one authorization request (a refusal included).

        Raises natsjwt.JwtError when the request itself is not one the server signed.
        """
        request = natsjwt.decode(request_jwt, Role.SERVER)
        nats_part = request.get("nats")
        if not isinstance(nats_part, dict) or nats_part.get("type") != "authorization_request":
            raise natsjwt.JwtError("not an authorization request")
        user_key = nats_part.get("user_nkey")
        server = nats_part.get("server_id")
        server_id = server.get("id") if isinstance(server, dict) else None
        if not isinstance(user_key, str) or not isinstance(server_id, str):
            raise natsjwt.JwtError("the request names no user key or server")
        if server_id != request.get("iss"):
            raise natsjwt.JwtError("the request is not signed by the server it names")
        options = nats_part.get("connect_opts")
        client = nats_part.get("client_info")
        token = options.get("auth_token") if isinstance(options, dict) else None
        where = client.get("host", "?") if isinstance(client, dict) else "?"
        try:
            identity = await self.identify(token if isinstance(token, str) else "")
        except Refused as refused:
            self.stats.refused[refused.reason] += 1
            log.warning("auth callout: refused a client from %s: %s", where, refused)
            response = natsjwt.authorization_response(
                user_key, server_id, error=f"gpuslice: {refused.reason}"
            )
            return natsjwt.encode(response, self.signer)
        self.stats.accepted[identity.kind] += 1
        log.debug("auth callout: %s from %s let in", identity.name, where)
        user = natsjwt.user_claims(
            user_key,
            self.settings.callout_account,
            identity.name,
            publish=identity.publish,
            subscribe=identity.subscribe,
            expires=identity.expires,
            payload=identity.payload,
            subs=identity.subs,
        )
        user_jwt = natsjwt.encode(user, self.signer)
        response = natsjwt.authorization_response(user_key, server_id, user_jwt=user_jwt)
        return natsjwt.encode(response, self.signer)

    async def identify(self, token: str) -> Identity:
        """Who the token proves the client is; Refused otherwise."""
        if not token:
            raise Refused("no-token", "the client sent no token")
        if is_telemetry_token(token):
            return await self._container(token)
        return await self._node_agent(token)

    async def _container(self, token: str) -> Identity:
        try:
            claims = self.tokens.verify(token)
        except TokenRefused as exc:
            raise Refused("telemetry-token-invalid", f"telemetry token: {exc}") from None
        pod = f"pod {claims.pod_uid} on node {claims.node}"
        if self.ledger is not None:
            try:
                placement = await self.ledger.placement(claims.pod_uid)
            except LedgerError as exc:
                why = f"{pod}: cannot read the ledger: {exc}"
                raise Refused("ledger-unavailable", why) from None
            if placement is None or placement.node != claims.node:
                raise Refused("pod-not-placed", f"telemetry token of {pod}: not placed there")
            if placement.state == PlacementState.RELEASED:
                raise Refused("pod-released", f"telemetry token of {pod}: released")
        session = self.settings.telemetry_session.total_seconds()
        return Identity(
            "telemetry",
            f"pod:{claims.pod_uid}",
            publish=(self.subjects.telemetry(claims.node, claims.pod_uid),),
            subscribe=(),
            expires=math.ceil(time.time() + session),
            payload=CONTAINER_MAX_PAYLOAD,
            subs=0,
        )

    async def _node_agent(self, token: str) -> Identity:
        claims = _jwt_claims(token)
        if claims is None:
            raise Refused("token-malformed", "the token is not a JWT")
        key = self._reviewed.key(token)
        known = self._reviewed.get(key)
        if known is not None:
            self.stats.cached += 1
            if isinstance(known, Refused):
                raise known
            return known
        try:
            identity = await self._review(token)
        except Refused as refused:
            if refused.reason in _VERDICTS:
                self._reviewed.put(key, refused, REFUSAL_CACHE_S)
            raise
        if identity.expires is not None:
            lifetime = min(identity.expires - time.time(), REVIEW_CACHE_MAX_S)
            self._reviewed.put(key, identity, lifetime)
        return identity

    async def _review(self, token: str) -> Identity:
        if self.kube is None:
            raise Refused("no-kube-api", "no Kubernetes API to review node agent tokens")
        audience = self.settings.node_agent_audience
        self.stats.reviews += 1
        try:
            status = await self.kube.review_token(token, [audience])
        except KubeError as exc:
            raise Refused("token-review-failed", f"TokenReview failed: {exc}") from None
        if status.get("authenticated") is not True:
            why = status.get("error") or "not authenticated"
            raise Refused("token-not-authenticated", f"TokenReview: {why}")
        audiences = status.get("audiences")
        if isinstance(audiences, list) and audiences and audience not in audiences:
            raise Refused("token-wrong-audience", f"TokenReview: audiences {audiences}")
        user = status.get("user") if isinstance(status.get("user"), dict) else {}
        assert isinstance(user, dict)
        username = user.get("username")
        if username != self.settings.node_agent_service_account:
            raise Refused("not-node-agent", f"token of {username!r}, not the node agent's")
        node = _single(user.get("extra"), NODE_NAME_EXTRA)
        if node is None:
            raise Refused("no-node-name", f"token of {username} names no node (pod-bound?)")
        try:
            node_token(node)  # a Kubernetes node name, one subject token
        except ValueError as exc:
            raise Refused("no-node-name", str(exc)) from None
        return Identity(
            "node",
            f"node:{node}",
            publish=(self.subjects.inventory(node), self.subjects.node_requests(node)),
            subscribe=(f"{Subjects.node_inbox(node)}.>",),
            expires=_token_expiry(token),
            payload=NODE_AGENT_MAX_PAYLOAD,
            subs=NODE_AGENT_MAX_SUBS,
        )

    # ------------------------------------------------------------ serving

    async def start(self) -> None:
        """Connect as the callout user and answer in the inventory's queue group."""
        options: dict[str, Any] = {
            "name": "gpuslice-inventory-callout",
            "user": self.settings.callout_nats_user,
            "password": self.settings.callout_nats_password or "",
            "allow_reconnect": True,
            "max_reconnect_attempts": -1,
            "reconnect_time_wait": 0.5,
            "connect_timeout": 2,
        }
        servers = [s.strip() for s in self.settings.nats_url.split(",")]
        try:
            self._nc = await nats.connect(servers, **options)
            self._sub = await self._nc.subscribe(
                AUTH_SUBJECT, queue=f"{self.subjects.prefix}-callout", cb=self._on_request
            )
            await flush_client(self._nc)
        except (TimeoutError, OSError, NatsError) as exc:
            await self.close()
            raise BusError(f"auth callout cannot connect to NATS: {exc!r}") from None

    async def _on_request(self, msg: Msg) -> None:
        """nats-py runs this for one message at a time: the work goes to a task
        of its own, and this waits only while ``callout_concurrency`` run."""
        await self._slots.acquire()
        try:
            task = asyncio.create_task(self._handle(msg), name="auth-callout")
        except BaseException:
            self._slots.release()
            raise
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._slots.release()

    async def _handle(self, msg: Msg) -> None:
        try:
            response = await self.answer(msg.data.decode("utf-8", errors="replace"))
        except natsjwt.JwtExpired:  # the server gave up on this client already
            self.stats.expired += 1
            log.debug("auth callout: a request that expired while it waited dropped")
            return
        except natsjwt.JwtError as exc:
            self.stats.errors += 1
            log.warning("auth callout: unreadable request ignored: %s", exc)
            return
        except Exception:
            self.stats.errors += 1
            log.exception("auth callout: request failed")
            return
        try:
            await msg.respond(response.encode())
        except NatsError as exc:
            self.stats.errors += 1
            log.warning("auth callout: cannot answer: %s", exc)

    async def close(self) -> None:
        nc, self._nc = self._nc, None
        if nc is None or nc.is_closed:
            await self._finish()
            return
        try:
            await nc.drain()
        except Exception as exc:
            log.debug("auth callout: drain failed (%r); closing", exc)
            try:
                await nc.close()
            except Exception as again:
                log.warning("auth callout: close failed: %r", again)
        await self._finish()

    async def _finish(self) -> None:
        """Cancel the requests still being decided (their clients are refused by
        the server's timeout)."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _single(extra: Any, key: str) -> str | None:
    if not isinstance(extra, dict):
        return None
    values = extra.get(key)
    if isinstance(values, list) and len(values) == 1 and isinstance(values[0], str):
        return values[0]
    return None
