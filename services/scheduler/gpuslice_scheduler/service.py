"""Running the extender: connect the ledger, the bus and the Kubernetes API, serve HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
from collections.abc import AsyncIterator

from gpuslice_common.bus import Bus
from gpuslice_common.config import SchedulerSettings
from gpuslice_common.devicetypes import read_vendors
from gpuslice_common.kube import KubeApi, KubernetesApi, LocalKubeApi
from gpuslice_common.ledger import Ledger, LedgerError
from gpuslice_common.outbox import Outbox
from gpuslice_common.service import http_server, metrics_server, plain_http
from gpuslice_scheduler import core
from gpuslice_scheduler.app import create_app, render_hami, render_metrics
from gpuslice_scheduler.extender import SOURCE, Extender
from gpuslice_scheduler.report import ReportPublisher
from gpuslice_scheduler.resources import NodeResources
from gpuslice_scheduler.view import ClusterView

log = logging.getLogger(__name__)


def kube_api(settings: SchedulerSettings) -> KubeApi:
    if settings.kube_api == "local":
        return LocalKubeApi()
    return KubernetesApi.from_environment()


@contextlib.asynccontextmanager
async def running(
    settings: SchedulerSettings,
    kube: KubeApi,
    *,
    bus: Bus | None = None,
    handle_signals: bool = True,
) -> AsyncIterator[tuple[Extender, asyncio.Task[None]]]:
    """The extender serving on ``settings.listen_host:listen_port`` until the block ends;
    its events go out on ``bus`` through an outbox (none without a bus)."""
    core.load()  # a missing placement engine stops the start, not the first pod
    ledger = Ledger.from_settings(settings)
    resources = NodeResources(kube) if settings.node_resources else None
    view = ClusterView(
        ledger,
        settings.sync_interval.total_seconds(),
        settings.resync_interval.total_seconds(),
        resources,
    )
    events = Outbox(settings, SOURCE, bus=bus) if bus is not None else None
    if events is not None:
        await events.start()
    extender = Extender(settings, ledger, view, kube, events)
    try:
        await view.sync()
    except LedgerError as exc:  # serve anyway; /readyz says not ready until a sync works
        log.warning("ledger not reachable at start: %s", exc)
    gc.freeze()  # what exists now lives as long as the process: keep it out of collections
    syncing = asyncio.create_task(view.run(), name="ledger-sync")
    background = [syncing]
    if resources is not None:
        background.append(asyncio.create_task(resources.run(), name="node-resources"))
    if extender.preemptor is not None:
        nominations = extender.preemptor.run(settings.sync_interval.total_seconds())
        background.append(asyncio.create_task(nominations, name="nominations"))
    report = ReportPublisher(
        ledger, view, lambda: extender.learner.mix, settings.requests.default_gpu_policy
    )
    background.append(asyncio.create_task(report.run(), name="scheduler-report"))
    config = plain_http(
        create_app(extender), settings.listen_host, settings.listen_port, settings.log_level
    )
    try:
        async with (
            http_server(
                config,
                "extender-http",
                max_body=settings.max_request_body,
                handle_signals=handle_signals,
            ) as (_, serving),
            metrics_server(
                lambda: render_metrics(extender),
                settings.metrics_host,
                settings.metrics_port,
                "extender-metrics",
                hami=render_hami(extender),
                log_level=settings.log_level,
            ),
        ):
            yield extender, serving
    finally:
        for task in background:
            task.cancel()
        for task in background:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await extender.close()
        if events is not None:
            await events.close()
        await ledger.close()


async def main(settings: SchedulerSettings) -> None:
    """Serve until SIGTERM or SIGINT, then stop cleanly and exit 0."""
    settings = read_vendors(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    bus = await Bus.connect(settings, SOURCE)
    kube = kube_api(settings)
    try:
        async with running(settings, kube, bus=bus, handle_signals=False) as (_, serving):
            log.info("extender listening on %s:%d", settings.listen_host, settings.listen_port)
            log.info(
                "metrics on http://%s:%d/metrics", settings.metrics_host, settings.metrics_port
            )
            stopping = asyncio.create_task(stop.wait())
            await asyncio.wait([serving, stopping], return_when=asyncio.FIRST_COMPLETED)
            stopping.cancel()
            log.info("stopping")
    finally:
        await kube.close()
        await bus.close()
