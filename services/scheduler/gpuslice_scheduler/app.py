"""HTTP face of the extender: the verbs kube-scheduler calls (a bare ASGI app),
then health and metrics (FastAPI).

Filter and bind answer 200 with an ``Error`` field when the request is bad or
the verb fails, as kube-scheduler expects; prioritize and preempt, whose replies
have no such field, answer 400 with ``{"Error": ...}``. No traceback ever reaches the caller: an
unexpected exception is logged and answered as an ``Error`` too.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from fastapi import FastAPI, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gpuslice_common.ledger import LedgerError
from gpuslice_common.requests import RequestError
from gpuslice_common.service import HAMI_PATH, AsgiApp, Receive, Scope, Send, hami_answer
from gpuslice_scheduler.extender import BindError, Extender
from gpuslice_scheduler.wire import (
    BindingArgs,
    ExtenderArgs,
    PreemptionArgs,
    WireError,
    filter_error,
)

log = logging.getLogger(__name__)
SKIPPED_SHOWN = 50  # nodes named in /readyz's "skipped" (all are counted)


Handler = Callable[[bytes], Awaitable[Any]]
BOUND = b'{"Error":""}'  # a bind that happened


class Verbs:
    """The extender's verbs as a bare ASGI app in front of ``fallback``.

    kube-scheduler waits on every call, one pod at a time, so the verbs skip
    FastAPI's routing, dependency and middleware layers: POST ``/<verb>`` is
    read, answered and measured here; any other request (health, metrics, a
    GET of a verb's path) goes on to ``fallback``.
    """

    def __init__(self, extender: Extender, fallback: AsgiApp) -> None:
        self.fallback = fallback
        self.metrics = extender.metrics

        async def filter_(body: bytes) -> Any:
            return await extender.filter_preempting(ExtenderArgs.parse(body, "filter"))

        async def prioritize(body: bytes) -> Any:
            return extender.prioritize(ExtenderArgs.parse(body, "prioritize"))

        async def bind(body: bytes) -> Any:
            await extender.bind(BindingArgs.parse(body))
            return BOUND

        async def preempt(body: bytes) -> Any:
            return await extender.preempt(PreemptionArgs.parse(body))

        # path -> (verb, handler, reply for an error, HTTP status of an error reply)
        self.verbs: dict[str, tuple[str, Handler, Callable[[str], Any], int]] = {
            "/filter": ("filter", filter_, filter_error, 200),
            "/prioritize": ("prioritize", prioritize, lambda e: {"Error": e}, 400),
            "/bind": ("bind", bind, lambda e: {"Error": e}, 200),
            # ExtenderPreemptionResult has no Error field: an error must be a non-200.
            "/preempt": ("preempt", preempt, lambda e: {"Error": e}, 400),
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        verb = self.verbs.get(scope["path"]) if scope["type"] == "http" else None
        if verb is None or scope["method"] != "POST":
            await self.fallback(scope, receive, send)
            return
        body = await _body(receive)
        if body is None:  # the client went away: no one to answer
            return
        status, reply = await self._answer(verb, body)
        await send({"type": "http.response.start", "status": status, "headers": _headers(reply)})
        await send({"type": "http.response.body", "body": reply})

    async def _answer(
        self, verb: tuple[str, Handler, Callable[[str], Any], int], body: bytes
    ) -> tuple[int, bytes]:
        name, handler, on_error, status = verb
        started = time.perf_counter()
        try:
            reply, code, outcome = await handler(body), 200, "ok"
        except (WireError, BindError, LedgerError, RequestError) as exc:
            log.info("%s: %s", name, exc)
            reply, code, outcome = on_error(str(exc)), status, "error"
        except Exception as exc:  # an engine bug must not become a 500 with a traceback
            log.exception("%s failed unexpectedly", name)
            reply, code, outcome = (
                on_error(f"internal error: {type(exc).__name__}"),
                status,
                "error",
            )
        payload = reply if isinstance(reply, bytes) else orjson.dumps(reply)
        self.metrics.requests.labels(name, outcome).inc()
        self.metrics.latency.labels(name).observe(time.perf_counter() - started)
        return code, payload


async def _body(receive: Receive) -> bytes | None:
    """The whole request body (BodyLimit in front has bounded it), or None when the
    client disconnected first."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def _headers(body: bytes) -> list[tuple[bytes, bytes]]:
    return [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]


def create_app(extender: Extender) -> AsgiApp:
    """The extender's HTTP face: the verbs (:class:`Verbs`) before a FastAPI app
    serving the probes and metrics."""
    app = FastAPI(title="gpuslice scheduler extender", docs_url=None, redoc_url=None)
    for verb in ("filter", "prioritize", "bind", "preempt"):
        # reached only by another method than POST: FastAPI answers 405
        app.add_api_route(f"/{verb}", _unreachable, methods=["POST"], name=verb)

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> Response:
        try:
            ok = await extender.ledger.ping()
        except LedgerError:
            ok = False
        if not ok or not extender.view.synced:
            why = "ledger unreachable" if not ok else "ledger copy not loaded yet"
            return JSONResponse({"status": "not ready", "reason": why}, status_code=503)
        # One unreadable node must not take the extender out: ready, and named.
        skipped = extender.view.skipped
        return JSONResponse(
            {
                "status": "ready",
                "nodes": extender.view.cluster.node_count,
                "skipped": {node: skipped[node] for node in sorted(skipped)[:SKIPPED_SHOWN]},
                "skipped_count": len(skipped),
            }
        )

    @app.get("/metrics")
    async def metrics_() -> Response:
        """As on the plain-HTTP ``metrics_port``, the one Prometheus scrapes."""
        return Response(render_metrics(extender), media_type=CONTENT_TYPE_LATEST)

    @app.get(HAMI_PATH)
    async def hami_metrics() -> Response:
        """As on the plain-HTTP ``metrics_port``."""
        status, body, kind = hami_answer(render_hami(extender))
        return Response(body, status_code=status, media_type=kind.decode())

    return Verbs(extender, app)


def render_metrics(extender: Extender) -> bytes:
    """The extender's metrics as Prometheus text, its copy's node counts read now."""
    metrics = extender.metrics
    metrics.nodes.set(extender.view.cluster.node_count)
    metrics.skipped_nodes.set(len(extender.view.skipped))
    metrics.refused_notices.set(extender.view.ledger.refused_notices)
    return generate_latest(metrics.registry)


def render_hami(extender: Extender) -> Callable[[], bytes] | None:
    """What renders ``/metrics/hami``: HAMi's scheduler names come from the
    inventory, which holds the ledger, so the extender has none (an empty text);
    None while ``hami_metrics`` is off."""
    return (lambda: b"") if extender.settings.hami_metrics else None


async def _unreachable() -> None:  # pragma: no cover - Verbs answers every POST
    raise AssertionError("a verb's POST reached FastAPI")
