"""Running the webhook: TLS, the Kubernetes API, the event outbox, the HTTP server."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import uvicorn
from prometheus_client import generate_latest

from gpuslice_common.config import WebhookSettings
from gpuslice_common.devicetypes import read_vendors
from gpuslice_common.kube import KubeApi, KubernetesApi, LocalKubeApi
from gpuslice_common.outbox import Outbox
from gpuslice_common.service import bound_port, http_server, metrics_server
from gpuslice_webhook.admission import SOURCE, Admission
from gpuslice_webhook.app import create_app
from gpuslice_webhook.metrics import Metrics
from gpuslice_webhook.namespaces import NamespaceCache
from gpuslice_webhook.tls import ReloadingTls

log = logging.getLogger(__name__)


def kube_api(settings: WebhookSettings) -> KubeApi | None:
    if settings.kube_api == "none":
        return None
    if settings.kube_api == "local":
        return LocalKubeApi()
    return KubernetesApi.from_environment(timeout=settings.kube_timeout.total_seconds())


@dataclass
class Running:
    """The webhook while it serves; tests look inside."""

    settings: WebhookSettings
    admission: Admission
    tls: ReloadingTls | None
    server: uvicorn.Server
    serving: asyncio.Task[None]
    metrics_port: int  # plain HTTP: /metrics for Prometheus
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    @property
    def port(self) -> int:
        """The port actually bound (``listen_port`` 0 picks a free one)."""
        return bound_port(self.server, self.settings.listen_port)


@contextlib.asynccontextmanager
async def running(
    settings: WebhookSettings, kube: KubeApi | None, outbox: Outbox | None
) -> AsyncIterator[Running]:
    """The webhook serving on ``settings.listen_host:listen_port`` until the block ends.

    Raises TlsError for unusable certificate files and OSError when the port is taken.
    """
    metrics = Metrics(hami=settings.hami_metrics)
    tls = None
    if settings.tls_cert_file is not None and settings.tls_key_file is not None:
        tls = ReloadingTls(settings.tls_cert_file, settings.tls_key_file)
    else:
        log.warning("no GPUSLICE_TLS_CERT_FILE: serving plain HTTP (the API server needs HTTPS)")
    namespaces = None
    if kube is not None:
        namespaces = NamespaceCache(kube, settings.kube_cache_ttl.total_seconds())
    admission = Admission(settings, metrics, namespaces=namespaces, outbox=outbox)
    metrics.readings.outbox, metrics.readings.tls = outbox, tls
    config = uvicorn.Config(
        create_app(admission, tls),
        host=settings.listen_host,
        port=settings.listen_port,
        log_level=settings.log_level.lower(),
        access_log=False,
        lifespan="off",
        ssl_context_factory=(lambda _config, _default: tls.context) if tls else None,
    )
    gc.freeze()  # what exists now lives as long as the process
    async with contextlib.AsyncExitStack() as stack:
        server, serving = await stack.enter_async_context(
            http_server(
                config,
                "webhook-http",
                max_body=settings.max_request_body,
                on_refused=metrics.admissions.labels("too_large").inc,
            )
        )
        metrics_port = await stack.enter_async_context(
            metrics_server(
                lambda: generate_latest(metrics.registry),
                settings.metrics_host,
                settings.metrics_port,
                "webhook-metrics",
                hami=metrics.render_hami(),
                log_level=settings.log_level,
            )
        )
        state = Running(settings, admission, tls, server, serving, metrics_port)
        if tls is not None:
            interval = settings.tls_reload_interval.total_seconds()
            watching = asyncio.create_task(tls.watch(interval), name="tls-watch")
            state.tasks.append(watching)
            stack.push_async_callback(_stop, watching)
        yield state


async def _stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def main(settings: WebhookSettings) -> None:
    """Serve until SIGTERM or SIGINT. NATS being down never holds admission up."""
    settings = read_vendors(settings)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        # uvicorn handles the signal while it serves, then raises it again once it
        # has stopped: this handler takes that one, so the outbox still gets to
        # publish what is queued and the process exits 0.
        loop.add_signal_handler(sig, lambda: None)
    kube = kube_api(settings)
    outbox = Outbox(settings, SOURCE, capacity=settings.event_queue_size)
    await outbox.start()
    try:
        async with running(settings, kube, outbox) as state:
            scheme = "https" if state.tls else "http"
            log.info("webhook listening on %s://%s:%d", scheme, settings.listen_host, state.port)
            where = f"http://{settings.metrics_host}:{state.metrics_port}"
            log.info("metrics on %s/metrics, HAMi's names on %s/metrics/hami", where, where)
            await state.serving  # uvicorn returns on SIGINT/SIGTERM
            log.info("stopping")
    finally:
        try:
            await outbox.close()
        finally:
            if kube is not None:
                await kube.close()
