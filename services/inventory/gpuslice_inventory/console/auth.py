"""Who is looking at the console, and which namespaces' pods they may see.

The console shows every tenant's pods, so who may look is decided by the
Kubernetes API itself, in one of two modes (``console_auth``):

* ``none``: no authentication. Every caller is ``Viewer("port-forward", None)``,
  cluster-wide. The settings refuse this mode unless the console listens on
  loopback only: it is reached with ``kubectl port-forward``, so whoever may
  port-forward into gpuslice's namespace is an operator.
* ``tokenreview``: every API call carries ``Authorization: Bearer <token>``.
  The token is reviewed with a TokenReview (no audiences: the API server's
  own, so a token minted for another audience, such as a node agent's for
  NATS, is refused), then the user it names is the subject of a
  SubjectAccessReview of ``list pods`` cluster-wide. Allowed: a cluster-wide
  viewer, who sees everything. Refused: a namespaced viewer.

Which namespaces a namespaced viewer sees is resolved lazily. A
SubjectAccessReview answers one question about one namespace; it cannot list
the namespaces where a user may list pods, and listing every namespace with
the inventory's own credentials to ask about each would need a grant the
inventory has no other use for, and a review per namespace per viewer, mostly
about namespaces with no GPU pod at all. So a namespaced viewer is
``Viewer(user, frozenset())`` and :meth:`Authenticator.may_see` asks about a
namespace when data of that namespace is about to be shown
(:meth:`Authenticator.visible` for several at once); each answer is kept per
identity and namespace for ``cache_ttl_s``. The pods of a namespace it may not
see are never shown, only summed (``scope.py``). For the same reason
:meth:`Authenticator.viewer` does not answer 403 for a user who may list pods
nowhere: no review can tell "nowhere" without asking about every namespace;
such a user sees the totals every viewer sees and no pod.

A review's outcome is kept by the token's SHA-256 (the token itself is never
kept, nor logged): an accepted token for ``cache_ttl_s``, in a least recently
used cache of ``max_cached`` tokens; a refused one for a few seconds only. An
API server that does not answer is 503, never an open door, and nothing about
it is kept. A token longer than 16 KiB, or with characters no bearer token has
(RFC 6750), is refused with 401 before the API is asked. At most
``reviews_at_once`` reviews are asked at once; beyond ``reviews_queued`` under
way or waiting, another is refused with 503 (anyone who reaches the port can
make up new tokens, each a TokenReview).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from gpuslice_common.kube import KubeApi, KubeError

__all__ = [
    "MAX_TOKEN",
    "PORT_FORWARD",
    "AccessDenied",
    "Authenticator",
    "Viewer",
    "dependency",
    "install_error_responses",
]

log = logging.getLogger(__name__)

MAX_TOKEN = 16 * 1024  # characters; longer is refused without asking the API
# RFC 6750's b64token: what a bearer token may be made of
TOKEN_CHARACTERS = re.compile(r"[A-Za-z0-9\-._~+/]+=*")
# a namespace name (RFC 1123 label): anything else names no namespace
NAMESPACE_NAME = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
REFUSAL_TTL_S = 5.0  # a refused token is refused again without asking, this long at most
NAMESPACES_PER_VIEWER = 32  # namespace answers kept: this many per cached token
CONCURRENT_REVIEWS = 16  # access reviews asked at once for one visible() call
# Token and access reviews of the whole console under way at once, and under
# way or waiting: a flood of new tokens (anyone who reaches the port can make
# them up) is refused beyond these, never queued without end. The Kubernetes
# client's review threads are shared with the NATS auth callout, which node
# agents need to connect: the console takes a part of them only.
REVIEWS_AT_ONCE = 16
REVIEWS_QUEUED = 256
PORT_FORWARD = "port-forward"

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


@dataclass(frozen=True)
class Viewer:
    """Who is looking: ``namespaces`` None for a cluster-wide viewer; else the
    namespaces known to be visible without asking (``frozenset()`` from a token
    review: they are asked about as data is shown, see :meth:`Authenticator.may_see`).

    ``groups``, ``uid`` and ``extra`` are the identity the token review gave,
    which each later access review names; they take no part in equality.
    """

    user: str
    namespaces: frozenset[str] | None
    groups: tuple[str, ...] = field(default=(), compare=False, repr=False)
    uid: str = field(default="", compare=False, repr=False)
    extra: tuple[tuple[str, tuple[str, ...]], ...] = field(default=(), compare=False, repr=False)


class AccessDenied(Exception):
    """The caller may not look: ``status`` is the HTTP status to answer
    (401 no or no valid token, 403 not allowed, 503 the API could not tell),
    ``message`` says why, fit to show the caller."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class _Expiring(Generic[K, V]):
    """Values until their own deadline (monotonic seconds); at most ``size``,
    the least recently used dropped first."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._entries: OrderedDict[K, tuple[float, V]] = OrderedDict()

    def get(self, key: K) -> V | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        if time.monotonic() >= entry[0]:
            del self._entries[key]
            return None
        self._entries.move_to_end(key)
        return entry[1]

    def put(self, key: K, value: V, seconds: float) -> None:
        if seconds <= 0:
            return
        self._entries[key] = (time.monotonic() + seconds, value)
        self._entries.move_to_end(key)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)

    def discard(self, key: K) -> None:
        self._entries.pop(key, None)

    def __len__(self) -> int:
        return len(self._entries)


class _Once(Generic[K, V]):
    """One piece of work per key at a time: callers asking for a key whose work
    is under way wait for that work instead of starting it again (a page opens
    several requests with the same new token at once)."""

    def __init__(self) -> None:
        self._pending: dict[K, asyncio.Future[V]] = {}

    async def run(self, key: K, work: Callable[[], Awaitable[V]]) -> V:
        pending = self._pending.get(key)
        if pending is None:
            pending = asyncio.ensure_future(work())
            self._pending[key] = pending
            pending.add_done_callback(lambda done: self._finished(key, done))
        # a caller that goes away does not cancel the work the others wait for
        return await asyncio.shield(pending)

    def _finished(self, key: K, done: asyncio.Future[V]) -> None:
        self._pending.pop(key, None)
        if not done.cancelled():
            done.exception()  # retrieved: no "never retrieved" warning when no one waits


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def bearer_token(authorization_header: str | None) -> str:
    """The token of an ``Authorization: Bearer <token>`` header; AccessDenied
    (401) for anything else, before any API is asked."""
    if not authorization_header or not authorization_header.strip():
        raise AccessDenied(401, "an Authorization: Bearer <token> header is required")
    if len(authorization_header) > MAX_TOKEN + 64:
        raise AccessDenied(401, f"the bearer token is longer than {MAX_TOKEN // 1024} KiB")
    scheme, _, token = authorization_header.strip().partition(" ")
    if scheme.lower() != "bearer":
        raise AccessDenied(401, "the Authorization header must be Bearer <token>")
    token = token.strip(" ")
    if not token:
        raise AccessDenied(401, "an Authorization: Bearer <token> header is required")
    if len(token) > MAX_TOKEN:
        raise AccessDenied(401, f"the bearer token is longer than {MAX_TOKEN // 1024} KiB")
    if not TOKEN_CHARACTERS.fullmatch(token):
        raise AccessDenied(401, "the bearer token has characters no token has")
    return token


def _strings(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list):
        return ()
    return tuple(item for item in value if isinstance(item, str))


def _extra(value: Any) -> tuple[tuple[str, tuple[str, ...]], ...]:
    if not isinstance(value, Mapping):
        return ()
    return tuple(
        sorted((key, _strings(values)) for key, values in value.items() if isinstance(key, str))
    )


class Authenticator:
    """Turns a request's ``Authorization`` header into a :class:`Viewer` and
    answers which namespaces a namespaced viewer may see (module docstring)."""

    def __init__(
        self,
        mode: Literal["none", "tokenreview"],
        kube: KubeApi | None,
        cache_ttl_s: float = 60.0,
        max_cached: int = 1000,
        reviews_at_once: int = REVIEWS_AT_ONCE,
        reviews_queued: int = REVIEWS_QUEUED,
    ) -> None:
        if mode not in ("none", "tokenreview"):
            raise ValueError(f"console_auth must be none or tokenreview, not {mode!r}")
        if mode == "tokenreview" and kube is None:
            raise ValueError("console_auth tokenreview needs the Kubernetes API to review tokens")
        if cache_ttl_s < 0:
            raise ValueError("cache_ttl_s must not be negative")
        if max_cached < 1:
            raise ValueError("max_cached must be at least 1")
        self.mode = mode
        self.kube = kube
        self.cache_ttl_s = cache_ttl_s
        self._viewers: _Expiring[str, Viewer] = _Expiring(max_cached)
        self._refused: _Expiring[str, str] = _Expiring(max_cached)
        self._answers: _Expiring[tuple[Hashable, ...], bool] = _Expiring(
            max_cached * NAMESPACES_PER_VIEWER
        )
        self._token_reviews: _Once[str, Viewer] = _Once()
        self._gate = asyncio.Semaphore(max(1, reviews_at_once))
        self._queue_bound = max(1, reviews_queued)
        self.queued = 0  # reviews under way or waiting for the gate
        self._full = False  # reviews were refused since the queue was last empty
        self._access_reviews: _Once[tuple[Hashable, ...], bool] = _Once()

    async def viewer(self, authorization_header: str | None) -> Viewer:
        """Who sends this header; AccessDenied 401 for no token or one the API
        does not accept, 503 when the API does not answer (never 403: see the
        module docstring)."""
        if self.mode == "none":
            return Viewer(PORT_FORWARD, None)
        token = bearer_token(authorization_header)
        key = _digest(token)
        known = self._viewers.get(key)
        if known is not None:
            return known
        refused = self._refused.get(key)
        if refused is not None:
            raise AccessDenied(401, refused)
        return await self._token_reviews.run(key, lambda: self._review(token, key))

    async def _review(self, token: str, key: str) -> Viewer:
        assert self.kube is not None
        kube = self.kube
        try:
            status = await self._bounded(lambda: kube.review_token(token))
        except KubeError as error:
            log.warning("console: cannot review a token: %s", error)
            raise AccessDenied(
                503, "cannot check the token now: the Kubernetes API did not answer"
            ) from None
        user = status.get("user")
        username = user.get("username") if isinstance(user, dict) else None
        if status.get("authenticated") is not True or not isinstance(username, str) or not username:
            why = status.get("error")
            log.info(
                "console: token sha256:%s… refused by TokenReview: %s",
                key[:12],
                why if isinstance(why, str) else "not authenticated",
            )
            message = "the token was not accepted by the Kubernetes API"
            self._refused.put(key, message, min(REFUSAL_TTL_S, self.cache_ttl_s))
            raise AccessDenied(401, message)
        assert isinstance(user, dict)
        uid = user.get("uid")
        viewer = Viewer(
            username,
            frozenset(),
            groups=_strings(user.get("groups")),
            uid=uid if isinstance(uid, str) else "",
            extra=_extra(user.get("extra")),
        )
        if await self._allowed(viewer, None):
            viewer = Viewer(
                viewer.user, None, groups=viewer.groups, uid=viewer.uid, extra=viewer.extra
            )
        log.info(
            "console: %s looks %s",
            viewer.user,
            "cluster-wide" if viewer.namespaces is None else "at namespaces it may list pods of",
        )
        self._viewers.put(key, viewer, self.cache_ttl_s)
        return viewer

    async def may_see(self, viewer: Viewer, namespace: str) -> bool:
        """Whether ``viewer`` may see the pods of ``namespace``: always for a
        cluster-wide viewer; else whether the API lets it ``list pods`` there
        (cached per identity and namespace). Never for what is no namespace name.
        AccessDenied (503) when the API does not answer."""
        if viewer.namespaces is None:
            return True
        if not isinstance(namespace, str) or not NAMESPACE_NAME.fullmatch(namespace):
            return False
        if namespace in viewer.namespaces:
            return True
        if self.mode == "none" or self.kube is None:
            return False
        return await self._allowed(viewer, namespace)

    async def visible(self, viewer: Viewer, namespaces: Iterable[str]) -> set[str] | None:
        """Which of ``namespaces`` the viewer may see; None for a cluster-wide
        viewer (every one, and data of no namespace too). AccessDenied (503)
        when the API does not answer about one of them."""
        if viewer.namespaces is None:
            return None
        wanted = {ns for ns in namespaces if isinstance(ns, str)}
        gate = asyncio.Semaphore(CONCURRENT_REVIEWS)

        async def ask(namespace: str) -> bool:
            async with gate:
                return await self.may_see(viewer, namespace)

        names = sorted(wanted)
        answers = await asyncio.gather(*(ask(ns) for ns in names))
        return {ns for ns, seen in zip(names, answers, strict=True) if seen}

    async def _allowed(self, viewer: Viewer, namespace: str | None) -> bool:
        """``list pods`` for the viewer's identity in ``namespace`` (None:
        cluster-wide), from the cache or a SubjectAccessReview."""
        key = (viewer.user, viewer.uid, viewer.groups, viewer.extra, namespace)
        known = self._answers.get(key)
        if known is not None:
            return known
        return await self._access_reviews.run(key, lambda: self._ask(viewer, namespace, key))

    async def _ask(self, viewer: Viewer, namespace: str | None, key: tuple[Hashable, ...]) -> bool:
        assert self.kube is not None
        kube = self.kube
        try:
            allowed = await self._bounded(
                lambda: kube.access_review(
                    viewer.user,
                    viewer.groups,
                    "list",
                    "pods",
                    namespace,
                    {name: list(values) for name, values in viewer.extra},
                    uid=viewer.uid,
                )
            )
        except KubeError as error:
            log.warning("console: cannot ask what %s may see: %s", viewer.user, error)
            raise AccessDenied(
                503, "cannot check what you may see now: the Kubernetes API did not answer"
            ) from None
        self._answers.put(key, allowed, self.cache_ttl_s)
        return allowed

    async def _bounded(self, call: Callable[[], Awaitable[V]]) -> V:
        """``call`` (one review) when fewer than ``reviews_queued`` are under way
        or waiting, at most ``reviews_at_once`` at a time; AccessDenied (503) else."""
        if self.queued >= self._queue_bound:
            if not self._full:  # once per burst: a flood does not flood the log
                log.warning("console: %d reviews are waiting: more are refused", self.queued)
                self._full = True
            raise AccessDenied(503, "too many token reviews are under way: try again soon")
        self.queued += 1
        try:
            async with self._gate:
                return await call()
        finally:
            self.queued -= 1
            if self.queued == 0:
                self._full = False


def _error(status: int, message: str, headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=dict(headers or {}))


def _challenge(status: int) -> dict[str, str]:
    return {"WWW-Authenticate": "Bearer"} if status == 401 else {}


def dependency(authenticator: Authenticator) -> Callable[[Request], Awaitable[Viewer]]:
    """A FastAPI dependency giving the request's :class:`Viewer`. A refusal is
    raised as an HTTPException with the status and message (and
    ``WWW-Authenticate: Bearer`` on 401), which the handlers of
    :func:`install_error_responses` answer as ``{"error": message}``."""

    async def authenticate(request: Request) -> Viewer:
        try:
            return await authenticator.viewer(request.headers.get("authorization"))
        except AccessDenied as denied:
            raise HTTPException(
                denied.status, detail=denied.message, headers=_challenge(denied.status)
            ) from None

    return authenticate


def install_error_responses(app: FastAPI) -> None:
    """Answer every HTTP error of ``app`` (its own 404 and 405 included), and an
    AccessDenied raised by a route (from :meth:`Authenticator.may_see`), as
    JSON ``{"error": message}`` with its status and headers."""

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        message = exc.detail if isinstance(exc.detail, str) else "the request failed"
        return _error(exc.status_code, message, exc.headers)

    async def access_denied(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, AccessDenied)
        return _error(exc.status, exc.message, _challenge(exc.status))

    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(AccessDenied, access_denied)
