"""The console's HTTP app (its own port): the page, its assets and the read-only API.

Only GET and HEAD are served (anything else: 405); every answer carries the
page's security headers; every ``/api/`` answer needs a viewer
(:class:`~gpuslice_inventory.console.auth.Authenticator`), and shows only the
namespaces it may see; refusals are JSON
``{"error": ...}``. Query parameters are checked by hand so that a bad one is
a 400 naming it, never a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from datetime import datetime
from pathlib import Path
from typing import Any

import orjson
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from nats.errors import Error as NatsError
from nats.js.errors import NotFoundError

from gpuslice_common.auditstream import (
    EventFilter,
    audit_events,
    parse_since,
    parse_types,
)
from gpuslice_common.bus import Bus, BusError
from gpuslice_inventory.console.auditfeed import stated_pod
from gpuslice_inventory.console.auth import (
    AccessDenied,
    Authenticator,
    Viewer,
    dependency,
    install_error_responses,
)
from gpuslice_inventory.console.errors import ConsoleError
from gpuslice_inventory.console.hub import AuditQuery, Hub, Slot, TooManyStreams
from gpuslice_inventory.console.pods import MAX_PODS
from gpuslice_inventory.console.scope import namespace_visible

log = logging.getLogger(__name__)

STATIC = Path(__file__).parent / "static"
CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
    ".ico": "image/x-icon",
    ".json": "application/json",
}
SECURITY_HEADERS = [
    (
        b"content-security-policy",
        b"default-src 'self'; style-src 'self'; script-src 'self'; connect-src 'self'; "
        b"img-src 'self' data:; frame-ancestors 'none'",
    ),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
]
READY_WAIT_S = 5.0
MAX_LIMIT = 5000
DEFAULT_LIMIT = 500
MAX_TEXT = 253  # a node, namespace or pod name (a uid is shorter)
EXPORTS_AT_ONCE = 4  # exports read the stream itself: a few at a time
DEFAULT_SINCE = "1h"
EXPORT_HEADERS = {
    "Content-Disposition": 'attachment; filename="gpuslice-audit.jsonl"',
    "Cache-Control": "no-store",
}
STREAM_HEADERS = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
Asgi = Callable[[Scope, Receive, Send], Awaitable[None]]


def loopback_host(host: str | None) -> bool:
    """Whether a ``Host`` header names this machine's loopback: ``localhost`` or a
    loopback address, with or without a port. A name that a DNS server answers
    (``evil.example`` rebound to 127.0.0.1) is not one."""
    if not host:
        return False
    name = host.strip().lower()
    if name.startswith("["):  # [::1]:8090
        name, bracket, rest = name[1:].partition("]")
        if not bracket or (rest and not (rest.startswith(":") and rest[1:].isdigit())):
            return False
    else:
        name, colon, port = name.partition(":")
        if colon and not (port.isascii() and port.isdigit()):
            return False
    if name.rstrip(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


class ReadOnly:
    """ASGI wrapper: GET and HEAD only (405 otherwise), security headers on every answer.

    With ``loopback_only`` (``console_auth: none``, where whoever is answered
    sees every tenant's pods) a request whose ``Host`` is not a loopback name
    is refused (403): a web page the operator opens cannot rebind its own
    host name to 127.0.0.1 and read the console as its own origin.
    """

    def __init__(self, app: Asgi, *, loopback_only: bool = False) -> None:
        self.app = app
        self.loopback_only = loopback_only

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["method"] not in ("GET", "HEAD"):
            body = b'{"error":"the console is read-only: only GET and HEAD"}'
            await _refuse(send, 405, body, [(b"allow", b"GET, HEAD")])
            return
        if self.loopback_only and not loopback_host(_header(scope, b"host")):
            body = (
                b'{"error":"without authentication the console answers only to a loopback '
                b'host name (localhost, 127.0.0.1, [::1]): open it through kubectl port-forward"}'
            )
            await _refuse(send, 403, body)
            return

        async def with_headers(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *SECURITY_HEADERS]
            await send(message)

        await self.app(scope, receive, with_headers)


def _header(scope: Scope, name: bytes) -> str | None:
    """The one value of header ``name``; None when absent or given more than once."""
    values = [v for k, v in scope.get("headers", []) if k.lower() == name]
    if len(values) != 1:
        return None
    return bytes(values[0]).decode("latin-1")


async def _refuse(
    send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *(headers or []),
                *SECURITY_HEADERS,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def _static_files() -> dict[str, tuple[bytes, str]]:
    """The assets shipped in ``static/``: name -> (content, type); nothing else is served."""
    files: dict[str, tuple[bytes, str]] = {}
    if STATIC.is_dir():
        for path in sorted(STATIC.iterdir()):
            kind = CONTENT_TYPES.get(path.suffix)
            if path.is_file() and not path.is_symlink() and kind is not None:
                files[path.name] = (path.read_bytes(), kind)
    return files


# ---------------------------------------------------------------- query parameters


def _one(request: Request, name: str) -> str | None:
    values = request.query_params.getlist(name)
    if not values:
        return None
    if len(values) > 1:
        raise ConsoleError(400, f"{name}: given more than once")
    return values[0]


def _text(request: Request, name: str) -> str | None:
    value = _one(request, name)
    if value is None or value == "":
        return None
    if len(value) > MAX_TEXT or any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise ConsoleError(400, f"{name}: not a name (at most {MAX_TEXT} printable characters)")
    return value


def _time(request: Request, name: str) -> datetime | None:
    value = _one(request, name)
    if value is None or value == "":
        return None
    if len(value) > 64:
        raise ConsoleError(400, f"{name}: not a time or a duration")
    try:
        return parse_since(value)
    except (ValueError, OverflowError) as exc:
        raise ConsoleError(400, f"{name}: {str(exc)[:200]}") from None


def _limit(request: Request) -> int | None:
    value = _one(request, "limit")
    if value is None or value == "":
        return None
    if not value.isascii() or not value.isdigit() or len(value) > 6:
        raise ConsoleError(400, f"limit: a whole number from 1 to {MAX_LIMIT}")
    limit = int(value)
    if not 1 <= limit <= MAX_LIMIT:
        raise ConsoleError(400, f"limit: a whole number from 1 to {MAX_LIMIT}")
    return limit


def audit_query(request: Request) -> tuple[AuditQuery, int | None]:
    """The audit filters of a request (400 naming the first bad one)."""
    since, until = _time(request, "since"), _time(request, "until")
    node, namespace, pod = (
        _text(request, "node"),
        _text(request, "namespace"),
        _text(request, "pod"),
    )
    types_text = _one(request, "type")
    if types_text is not None and len(types_text) > 1000:
        raise ConsoleError(400, "type: too long")
    try:
        types = parse_types([types_text] if types_text else [])
    except ValueError as exc:
        raise ConsoleError(400, f"type: {str(exc)[:300]}") from None
    limit = _limit(request)
    wanted = EventFilter(pod=pod, node=node, types=types, namespace=namespace)
    return AuditQuery(wanted, since, until), limit


def _json(body: bytes | dict[str, Any], status: int = 200) -> Response:
    if isinstance(body, dict):
        return JSONResponse(body, status_code=status, headers={"Cache-Control": "no-store"})
    return Response(
        body,
        status_code=status,
        media_type="application/json",
        headers={"Cache-Control": "no-store"},
    )


# ---------------------------------------------------------------- the app


def create_console_app(
    hub: Hub, bus: Bus, authenticator: Authenticator
) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    """The console's ASGI app over ``hub`` (snapshot, feed) and ``bus`` (exports)."""
    app = FastAPI(title="gpuslice console", docs_url=None, redoc_url=None, openapi_url=None)
    install_error_responses(app)  # 401/403/404/405/503 as {"error": ...}
    auth = authenticator.mode
    authenticate = dependency(authenticator)  # refusals: see install_error_responses
    files = _static_files()
    exports = asyncio.Semaphore(EXPORTS_AT_ONCE)

    @app.exception_handler(ConsoleError)
    async def refused(request: Request, exc: ConsoleError) -> Response:
        return _json({"error": exc.message}, exc.status)

    def asset(name: str) -> Response:
        found = files.get(name)
        if found is None:
            raise ConsoleError(404, "no such file")
        content, kind = found
        return Response(content, media_type=kind, headers={"Cache-Control": "no-cache"})

    @app.api_route("/", methods=["GET", "HEAD"])
    async def index() -> Response:
        return asset("index.html")

    @app.api_route("/static/{name}", methods=["GET", "HEAD"])
    async def static(name: str) -> Response:
        return asset(name)

    async def ready() -> None:
        try:
            await asyncio.wait_for(hub.ready.wait(), READY_WAIT_S)
        except TimeoutError:
            raise ConsoleError(503, "the console has not read the ledger yet") from None

    @app.api_route("/api/v1/session", methods=["GET", "HEAD"])
    async def session(request: Request) -> Response:
        viewer = await authenticate(request)
        namespaces = None if viewer.namespaces is None else sorted(viewer.namespaces)
        return _json({"user": viewer.user, "namespaces": namespaces, "auth": auth})

    @app.api_route("/api/v1/cluster", methods=["GET", "HEAD"])
    async def cluster(request: Request) -> Response:
        viewer = await authenticate(request)
        await ready()
        return _json(await hub.cluster_for(viewer))

    @app.api_route("/api/v1/pods", methods=["GET", "HEAD"])
    async def pods(request: Request) -> Response:
        viewer = await authenticate(request)
        await ready()
        summaries = hub.pod_summaries()
        visible = await hub.visible(viewer, {s.namespace for s in summaries})
        shown = [s.document() for s in summaries if namespace_visible(s.namespace, visible)]
        return _json({"pods": shown[:MAX_PODS]})

    @app.api_route("/api/v1/pods/{namespace}/{name}", methods=["GET", "HEAD"])
    async def pod(request: Request, namespace: str, name: str) -> Response:
        viewer = await authenticate(request)
        await ready()
        unknown = f"no pod {namespace[:MAX_TEXT]}/{name[:MAX_TEXT]} is known"
        if not await authenticator.may_see(viewer, namespace):
            raise ConsoleError(404, unknown)  # the same answer: no oracle of what exists
        body = hub.pod_bytes(namespace, name)
        if body is None:
            raise ConsoleError(404, unknown)
        return _json(body)

    @app.api_route("/api/v1/history", methods=["GET", "HEAD"])
    async def history(request: Request) -> Response:
        """The last hour of the cluster (no parameter), of a card (``node`` and
        ``card``, its UUID) or of a pod (``namespace`` and ``name``; 404 to a
        viewer who may not see its namespace, as for the pod itself); no points
        for what has none kept. A card's totals are in every viewer's snapshot:
        its history is too."""
        viewer = await authenticate(request)
        await ready()
        node, card = _text(request, "node"), _text(request, "card")
        namespace, name = _text(request, "namespace"), _text(request, "name")
        store = hub.builder.history
        if namespace is not None or name is not None:
            if namespace is None or name is None:
                raise ConsoleError(400, "namespace and name: both or neither")
            if node is not None or card is not None:
                raise ConsoleError(400, "node and card: not with namespace and name")
            if not await authenticator.may_see(viewer, namespace):  # as for the pod itself
                raise ConsoleError(404, f"no pod {namespace}/{name} is known")
            doc = store.document(("pod", namespace, name))
        elif node is not None or card is not None:
            if node is None or card is None:
                raise ConsoleError(400, "node and card: both or neither")
            doc = store.document(("card", node, card))
        else:
            doc = store.document(None)
        return _json(orjson.dumps(doc))

    @app.api_route("/api/v1/audit", methods=["GET", "HEAD"])
    async def audit(request: Request) -> Response:
        viewer = await authenticate(request)
        query, limit = audit_query(request)
        visible: set[str] | None = None
        if viewer.namespaces is not None:
            visible = await hub.visible(viewer, hub.feed.namespaces_to_ask(query.wanted))
        found, truncated = hub.feed.query(
            query.wanted,
            query.since,
            query.until,
            limit or DEFAULT_LIMIT,
            visible,
        )
        body = b'{"events":[' + b",".join(f.line for f in found) + b"],"
        body += b'"truncated":' + (b"true" if truncated else b"false") + b","
        body += b'"problem":' + orjson.dumps(hub.feed.problem()) + b"}"
        return _json(body)

    @app.api_route("/api/v1/audit/export", methods=["GET", "HEAD"])
    async def export(request: Request) -> Response:
        viewer = await authenticate(request)
        query, limit = audit_query(request)
        since = query.since or parse_since(DEFAULT_SINCE)
        if request.method == "HEAD":  # what a GET would answer, without reading the stream
            return Response(media_type="application/x-ndjson", headers=EXPORT_HEADERS)
        if exports.locked():
            raise ConsoleError(503, f"{EXPORTS_AT_ONCE} exports are running: try again soon")
        try:
            await bus.js.stream_info(bus.subjects.audit_stream)
        except NotFoundError:
            raise ConsoleError(503, "the audit stream does not exist (yet)") from None
        except (NatsError, TimeoutError):
            raise ConsoleError(503, "the audit stream cannot be read now") from None
        return StreamingResponse(
            _export_lines(bus, query, since, limit, viewer, authenticator, exports),
            media_type="application/x-ndjson",
            headers=EXPORT_HEADERS,
        )

    @app.api_route("/api/v1/stream", methods=["GET", "HEAD"])
    async def stream(request: Request) -> Response:
        viewer = await authenticate(request)
        header = request.headers.get("authorization")

        async def recheck() -> Viewer:
            return await authenticator.viewer(header)

        checks: dict[str, Any] = {}
        if auth != "none":
            checks = {"recheck": recheck, "recheck_s": authenticator.cache_ttl_s}
        view = _one(request, "view") or "cluster"
        if view not in ("cluster", "pod", "audit"):
            raise ConsoleError(400, "view: one of cluster, pod, audit")
        slot: Slot
        if view == "pod":
            namespace, name = _text(request, "namespace"), _text(request, "name")
            if namespace is None:
                raise ConsoleError(400, "namespace: required for view=pod")
            if name is None:
                raise ConsoleError(400, "name: required for view=pod")
            if not await authenticator.may_see(viewer, namespace):
                raise ConsoleError(404, f"no pod {namespace}/{name} is known")
            slot = Slot(viewer, "pod", namespace, name, **checks)
        elif view == "audit":
            query, _ = audit_query(request)
            slot = Slot(viewer, "audit", audit=query, **checks)
        else:
            slot = Slot(viewer, "cluster", **checks)
        await ready()
        if view == "cluster":  # what it may see is asked now: a refusal is an answer, not a cut
            await hub.cluster_for(viewer)
        if request.method == "HEAD":  # an answer that ends, holding no stream open
            return Response(media_type="text/event-stream", headers=STREAM_HEADERS)
        try:
            hub.check_room(viewer)
        except TooManyStreams as exc:
            raise ConsoleError(503, str(exc)) from None
        return StreamingResponse(
            hub.stream(slot), media_type="text/event-stream", headers=STREAM_HEADERS
        )

    return ReadOnly(app, loopback_only=auth == "none")


async def _export_lines(
    bus: Bus,
    query: AuditQuery,
    since: datetime,
    limit: int | None,
    viewer: Viewer,
    authenticator: Authenticator,
    exports: asyncio.Semaphore,
) -> AsyncIterator[bytes]:
    """JSON Lines of the matching events the stream holds from ``since``."""
    count = 0
    events = audit_events(bus, since, subject=query.wanted.subject(bus))
    async with exports:
        try:
            async for event in events:
                if query.until is not None and event.time > query.until:
                    continue
                if not query.wanted.matches(event):
                    continue
                if viewer.namespaces is not None:
                    pod = stated_pod(event)
                    if pod is None or not await authenticator.may_see(viewer, pod.namespace):
                        continue
                yield event.to_json() + b"\n"
                count += 1
                if limit is not None and count >= limit:
                    break
        except BusError as exc:
            log.warning("console: an audit export stopped early: %s", exc)
        except AccessDenied as exc:  # the Kubernetes API stopped answering: stop here
            log.warning("console: an audit export stopped early: %s", exc.message)
        finally:
            with contextlib.suppress(Exception):
                await events.aclose()
