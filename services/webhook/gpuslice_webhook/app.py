"""HTTP face of the webhook (FastAPI): ``POST /mutate``, health, readiness, metrics.

``/mutate`` answers 200 with an AdmissionReview for every body that is one, and
400 with ``{"error": ...}`` for one that is not; the OpenAPI document
(``/openapi.json``) describes both.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gpuslice_common.service import HAMI_PATH, hami_answer
from gpuslice_webhook.admission import Admission
from gpuslice_webhook.review import AdmissionReviewRequest, AdmissionReviewResponse, Problem
from gpuslice_webhook.tls import ReloadingTls

JSON = "application/json"


def _body_schema() -> dict[str, Any]:
    """The request body's OpenAPI description; the body itself is read by hand."""
    return {
        "requestBody": {
            "required": True,
            "content": {JSON: {"schema": {"$ref": "#/components/schemas/AdmissionReviewRequest"}}},
        }
    }


def create_app(admission: Admission, tls: ReloadingTls | None = None) -> FastAPI:
    app = FastAPI(
        title="gpuslice admission webhook",
        version="1",
        docs_url=None,
        redoc_url=None,
        separate_input_output_schemas=False,
    )
    metrics = admission.metrics

    @app.post(
        "/mutate",
        response_model=AdmissionReviewResponse,
        responses={
            400: {"model": Problem, "description": "not an AdmissionReview request"},
            413: {
                "model": Problem,
                "description": "a body over GPUSLICE_MAX_REQUEST_BODY (8 MiB), refused unread",
            },
        },
        openapi_extra=_body_schema(),
        summary="Admit a pod: validate its GPU request, fill defaults, route it",
    )
    async def mutate(request: Request) -> Response:
        # bodies over the limit were refused before (gpuslice_common.service.BodyLimit)
        status, answer = await admission.handle(await request.body())
        return Response(answer, status_code=status, media_type=JSON)

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> dict[str, Any]:
        """Ready while serving: admission needs neither NATS nor Redis to answer."""
        outbox = admission.outbox
        events = {} if outbox is None else {"nats": outbox.connected, "pending": outbox.pending}
        return {"status": "ready", "events": events}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics_() -> Response:
        """As on the plain-HTTP ``metrics_port``, the one Prometheus scrapes."""
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get(HAMI_PATH, response_class=PlainTextResponse)
    async def hami_metrics() -> Response:
        """HAMi's names, as on the plain-HTTP ``metrics_port``."""
        status, body, kind = hami_answer(metrics.render_hami())
        return Response(body, status_code=status, media_type=kind.decode())

    original_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = original_openapi()
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            request_schema = AdmissionReviewRequest.model_json_schema(
                ref_template="#/components/schemas/{model}"
            )
            components.update(request_schema.pop("$defs", {}))
            components["AdmissionReviewRequest"] = request_schema
        assert app.openapi_schema is not None  # set by FastAPI's own openapi()
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app
