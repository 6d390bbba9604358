"""The NATS auth callout: node agents and GPU containers prove who they are.

nats-server sends every client that is not one of the static service users
(``auth_callout.auth_users``) to ``$SYS.REQ.USER.AUTH`` as an authorization
request JWT it signs; every inventory replica answers in one queue group. The
client's ``auth_token`` decides:

* a *telemetry token* (``gst1.``, :mod:`gpuslice_inventory.tokens`) that this
  inventory's key signed, for a pod the ledger holds on that node and has not
  released: a user that may publish ``<prefix>.telemetry.<node>.<pod uid>`` and
  subscribe to nothing;
* anything else is taken for a node agent's projected ServiceAccount token and
  sent to the API server's TokenReview for the node-agent audience: it must be
  authenticated, be the device plugin's ServiceAccount, and name its node
  (``authentication.kubernetes.io/node-name``). The user may publish
  ``<prefix>.inventory.<node>`` and ``<prefix>.node.<node>.>``, and subscribe
  only below its own inbox prefix ``_INBOX.<node>``. It expires with the token
  (the server then closes the connection; the agent reconnects with the token
  kubelet has rotated in).

The answer is a response JWT, signed by the account key whose public half is
the server's ``auth_callout.issuer``, carrying the user JWT (placed in the
services' account by its ``aud``) or the reason for refusing. Each refusal is
one log line and counted by reason.

The requests are not encrypted (no ``xkey``): they carry the clients' tokens
from nats-server to its own callout user over the cluster network, which is
where clients send those tokens anyway.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import Error as NatsError

from gpuslice_common import natsjwt
from gpuslice_common.bus import BusError
from gpuslice_common.config import InventorySettings
from gpuslice_common.kube import NODE_NAME_EXTRA, KubeApi, KubeError
from gpuslice_common.ledger import Ledger, LedgerError
from gpuslice_common.models import PlacementState
from gpuslice_common.nkeys import KeyPair, Role
from gpuslice_common.subjects import Subjects, node_token
from gpuslice_inventory.tokens import TelemetryTokens, TokenRefused, is_telemetry_token

log = logging.getLogger(__name__)

AUTH_SUBJECT = "$SYS.REQ.USER.AUTH"


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


@dataclass(frozen=True)
class Identity:
    kind: str  # "node" or "telemetry"
    name: str  # the user name the server logs
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    expires: int | None = None


def _token_expiry(token: str) -> int | None:
    """The ``exp`` of a JWT-shaped token, read without checking it (the API
    server's review has checked it); None when it has none."""
    parts = token.split(".")
    if len(parts) != 3:
        return None
    try:
        claims = json.loads(base64.urlsafe_b64decode(parts[1] + "=" * (-len(parts[1]) % 4)))
    except (binascii.Error, ValueError):
        return None
    expires = claims.get("exp") if isinstance(claims, dict) else None
    return expires if isinstance(expires, int) and expires > 0 else None


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
        return Identity(
            "telemetry",
            f"pod:{claims.pod_uid}",
            publish=(self.subjects.telemetry(claims.node, claims.pod_uid),),
            subscribe=(),
        )

    async def _node_agent(self, token: str) -> Identity:
        if self.kube is None:
            raise Refused("no-kube-api", "no Kubernetes API to review node agent tokens")
        audience = self.settings.node_agent_audience
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
            token_of_node = node_token(node)
        except ValueError as exc:
            raise Refused("no-node-name", str(exc)) from None
        prefix = self.subjects.prefix
        return Identity(
            "node",
            f"node:{node}",
            publish=(self.subjects.inventory(node), f"{prefix}.node.{token_of_node}.>"),
            subscribe=(f"_INBOX.{token_of_node}.>",),
            expires=_token_expiry(token),
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
            await self._nc.flush()
        except (TimeoutError, OSError, NatsError) as exc:
            await self.close()
            raise BusError(f"auth callout cannot connect to NATS: {exc!r}") from None

    async def _on_request(self, msg: Msg) -> None:
        try:
            response = await self.answer(msg.data.decode("utf-8", errors="replace"))
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
            return
        try:
            await nc.drain()
        except Exception as exc:
            log.debug("auth callout: drain failed (%r); closing", exc)
            try:
                await nc.close()
            except Exception as again:
                log.warning("auth callout: close failed: %r", again)


def _single(extra: Any, key: str) -> str | None:
    if not isinstance(extra, dict):
        return None
    values = extra.get(key)
    if isinstance(values, list) and len(values) == 1 and isinstance(values[0], str):
        return values[0]
    return None
