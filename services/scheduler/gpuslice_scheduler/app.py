"""HTTP face of the extender (FastAPI): the verbs kube-scheduler calls, health, metrics.

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
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gpuslice_common.ledger import LedgerError
from gpuslice_common.requests import RequestError
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


def create_app(extender: Extender) -> FastAPI:
    app = FastAPI(title="gpuslice scheduler extender", docs_url=None, redoc_url=None)
    metrics = extender.metrics

    async def filter_(body: bytes) -> Any:
        return extender.filter(ExtenderArgs.parse(body, "filter"))

    async def prioritize(body: bytes) -> Any:
        return extender.prioritize(ExtenderArgs.parse(body, "prioritize"))

    async def bind(body: bytes) -> Any:
        await extender.bind(BindingArgs.parse(body))
        return {"Error": ""}

    async def preempt(body: bytes) -> Any:
        return extender.preempt(PreemptionArgs.parse(body))

    # verb -> (handler, reply for an error, HTTP status of an error reply)
    verbs: dict[str, tuple[Callable[[bytes], Awaitable[Any]], Callable[[str], Any], int]] = {
        "filter": (filter_, filter_error, 200),
        "prioritize": (prioritize, lambda e: {"Error": e}, 400),
        "bind": (bind, lambda e: {"Error": e}, 200),
        # ExtenderPreemptionResult has no Error field: an error must be a non-200.
        "preempt": (preempt, lambda e: {"Error": e}, 400),
    }

    def route(verb: str) -> Callable[[Request], Awaitable[Response]]:
        handler, on_error, status = verbs[verb]

        async def answer(request: Request) -> Response:
            started = time.perf_counter()
            try:
                body, code, outcome = await handler(await request.body()), 200, "ok"
            except (WireError, BindError, LedgerError, RequestError) as exc:
                log.info("%s: %s", verb, exc)
                body, code, outcome = on_error(str(exc)), status, "error"
            except Exception as exc:  # an engine bug must not become a 500 with a traceback
                log.exception("%s failed unexpectedly", verb)
                body, code, outcome = (
                    on_error(f"internal error: {type(exc).__name__}"),
                    status,
                    "error",
                )
            reply = Response(orjson.dumps(body), status_code=code, media_type="application/json")
            metrics.requests.labels(verb, outcome).inc()
            metrics.latency.labels(verb).observe(time.perf_counter() - started)
            return reply

        return answer

    for verb in verbs:
        app.add_api_route(f"/{verb}", route(verb), methods=["POST"], name=verb)

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
        metrics.nodes.set(extender.view.cluster.node_count)
        metrics.skipped_nodes.set(len(extender.view.skipped))
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
