"""Running the inventory: subscriptions, the leased periodic jobs, HTTP.

Every replica takes a share of the node inventories, the telemetry and the
dev stack's pod-ended reports (NATS queue group ``<prefix>-inventory``), so the
work splits across replicas and each message is handled once; the node agents'
requests to the ledger (:mod:`gpuslice_inventory.gateway`) are served the same
way. The periodic
jobs (liveness, expiry, reconciliation) and the Kubernetes pod watch run only
in the replica holding the lease in Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import FastAPI, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from gpuslice_common.bus import Bus
from gpuslice_common.config import InventorySettings
from gpuslice_common.kube import KubeApi, KubernetesApi
from gpuslice_common.ledger import Ledger, LedgerError
from gpuslice_common.models import NodeInventory, PodEnded
from gpuslice_common.outbox import Outbox
from gpuslice_common.service import every, http_server, plain_http
from gpuslice_inventory.gateway import NodeGateway, TokenIssuer
from gpuslice_inventory.lease import Lease
from gpuslice_inventory.lifecycle import PodWatcher, WatchStats, release_ended
from gpuslice_inventory.metrics import ClusterMetrics, WorkMetrics, WorkStats, registry_for
from gpuslice_inventory.reconcile import Reconciler
from gpuslice_inventory.telemetry import TelemetryStore
from gpuslice_inventory.upkeep import SOURCE, Upkeep

log = logging.getLogger(__name__)
STOP_TIMEOUT_S = 5.0
READY_TIMEOUT_S = 1.0


@dataclass
class Running:
    """The inventory while it runs; tests look inside."""

    settings: InventorySettings
    bus: Bus
    ledger: Ledger
    telemetry: TelemetryStore
    upkeep: Upkeep
    lease: Lease
    cluster: ClusterMetrics
    registry: CollectorRegistry
    gateway: NodeGateway
    reconciler: Reconciler | None = None
    watcher: PodWatcher | None = None
    work: WorkStats = field(default_factory=WorkStats)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    next_reconcile: float = 0.0  # loop time

    async def on_inventory(self, subject: str, inventory: NodeInventory) -> None:
        """A node agent's inventory (its heartbeat): write it to the ledger."""
        if subject != self.bus.subjects.inventory(inventory.node):
            log.warning("inventory of node %s arrived on %s; dropped", inventory.node, subject)
            return
        try:
            await self.ledger.register_node(inventory)
        except LedgerError as exc:
            self.work.registration_errors += 1
            log.warning("cannot register node %s: %s", inventory.node, exc)
            return
        self.work.registrations += 1

    async def on_pod_ended(self, subject: str, ended: PodEnded) -> None:
        """The dev stack's stand-in for the API server reports a pod ended."""
        await release_ended(self.upkeep, ended)

    async def on_telemetry(self, msg: Msg) -> None:
        self.telemetry.ingest(msg.subject, msg.data)

    async def sweep_if_leader(self) -> None:
        """The periodic jobs, in the replica holding the lease: liveness and expiry
        every sweep; reconciliation at start and every ``reconcile_interval``."""
        if not self.lease.held:
            return
        await self.upkeep.sweep()
        now = asyncio.get_running_loop().time()
        if self.reconciler is not None and now >= self.next_reconcile and self.lease.held:
            self.next_reconcile = now + self.settings.reconcile_interval.total_seconds()
            result = await self.reconciler.run_once()
            if result.failed:
                # restores refused (nodes not registered again yet): soon again
                retry = 2 * self.settings.heartbeat_interval.total_seconds()
                self.next_reconcile = min(self.next_reconcile, now + retry)
            log.info(
                "reconciled %d pods in %.2fs: %d restored, %d released",
                result.pods,
                result.seconds,
                result.restored,
                result.released,
            )

    def work_values(self) -> dict[str, float | Counter[str]]:
        t = self.telemetry.stats
        watch = self.watcher.stats if self.watcher is not None else WatchStats()
        return {
            "registrations": self.work.registrations,
            "registration_errors": self.work.registration_errors,
            "releases": Counter(self.upkeep.stats.released),
            "pod_watch_events": watch.events,
            "pod_watch_restarts": watch.restarts,
            "nodes_marked_unavailable": self.upkeep.stats.nodes_marked,
            "sweeps": self.upkeep.stats.sweeps,
            "telemetry_samples": t.received,
            "telemetry_stored": t.stored,
            "telemetry_malformed": t.malformed,
            "telemetry_dropped": t.dropped,
        }


def _report_stopped(task: asyncio.Task[None]) -> None:
    """A background task that ended on its own is a bug: say so (and /healthz fails)."""
    if not task.cancelled() and (error := task.exception()) is not None:
        log.error("task %s stopped: %r", task.get_name(), error)


def create_app(state: Running) -> FastAPI:
    app = FastAPI(title="gpuslice inventory", docs_url=None, redoc_url=None)

    @app.get("/healthz")
    async def healthz() -> Response:
        dead = [t.get_name() for t in state.tasks if t.done()]
        if dead:
            return JSONResponse({"status": "failed", "stopped": dead}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/readyz")
    async def readyz() -> Response:
        try:
            # the ledger's own retries would outlast a probe's timeout
            ok = await asyncio.wait_for(state.ledger.ping(), READY_TIMEOUT_S)
        except (LedgerError, TimeoutError):
            ok = False
        if not ok or not state.bus.connected:
            why = "ledger unreachable" if not ok else "NATS unreachable"
            return JSONResponse({"status": "not ready", "reason": why}, status_code=503)
        return JSONResponse({"status": "ready", "leader": state.lease.held})

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        return Response(generate_latest(state.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def kube_api(settings: InventorySettings) -> KubeApi | None:
    if settings.kube_api == "none":
        return None
    return KubernetesApi.from_environment()


@contextlib.asynccontextmanager
async def running(
    settings: InventorySettings,
    bus: Bus,
    *,
    kube: KubeApi | None = None,
    serve_http: bool = True,
    name: str = "",
    issue_telemetry_token: TokenIssuer | None = None,
) -> AsyncIterator[Running]:
    """The inventory working until the block ends. ``bus`` and ``kube`` stay the
    caller's; without ``kube`` there is no reconciliation. ``issue_telemetry_token``
    (node, pod UID) gives each allocated container its own telemetry credential;
    without it containers use the node's static one."""
    ledger = Ledger.from_settings(settings)
    telemetry = TelemetryStore(
        ledger.redis,
        settings.ledger_prefix,
        ttl=settings.telemetry_ttl.total_seconds(),
        subjects=bus.subjects,
    )
    outbox = Outbox(settings, SOURCE, bus=bus)
    upkeep = Upkeep(
        ledger,
        settings.heartbeat_interval,
        settings.reservation_ttl,
        outbox,
        on_release=lambda record: telemetry.forget_pod(record.node, record.pod.uid),
    )
    lease = Lease(
        ledger.redis,
        f"{settings.ledger_prefix}:inventory:lease",
        int(settings.lease_ttl.total_seconds() * 1000),
        holder=name,
    )
    cluster = ClusterMetrics(ledger, telemetry, active=lambda: lease.held)
    gateway = NodeGateway(ledger, bus.subjects, outbox, issue_telemetry_token=issue_telemetry_token)
    state = Running(
        settings, bus, ledger, telemetry, upkeep, lease, cluster, CollectorRegistry(), gateway
    )
    state.registry = registry_for(cluster, WorkMetrics(state.work_values))
    if kube is not None:
        state.reconciler = Reconciler(ledger, kube, upkeep, settings.reconcile_grace)
        state.watcher = PodWatcher(kube, upkeep, lambda: lease.held)
    queue = f"{settings.subject_prefix}-inventory"
    subscriptions: list[Subscription] = []
    try:
        subscriptions += [
            await bus.subscribe(
                bus.subjects.inventory_all, NodeInventory, state.on_inventory, queue
            ),
            await bus.subscribe(bus.subjects.pod_ended, PodEnded, state.on_pod_ended, queue),
            await bus.nc.subscribe(bus.subjects.telemetry_all, queue=queue, cb=state.on_telemetry),
            await gateway.start(bus.nc, queue),
        ]
        await outbox.start()
    except BaseException:
        for sub in subscriptions:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        await outbox.close()
        await ledger.close()
        raise
    sweep = settings.sweep_interval.total_seconds()
    state.tasks = [
        asyncio.create_task(lease.run(), name="lease"),
        asyncio.create_task(telemetry.run(), name="telemetry-flush"),
        asyncio.create_task(
            every(sweep, state.sweep_if_leader, "upkeep", expected=(LedgerError,)), name="upkeep"
        ),
        asyncio.create_task(
            every(
                settings.metrics_interval.total_seconds(),
                cluster.refresh,
                "metrics",
                expected=(LedgerError,),
            ),
            name="metrics",
        ),
    ]
    if state.watcher is not None:
        state.tasks.append(asyncio.create_task(state.watcher.run(sweep), name="pod-watch"))
    for task in state.tasks:
        task.add_done_callback(_report_stopped)
    try:
        async with contextlib.AsyncExitStack() as stack:
            if serve_http:
                config = plain_http(
                    create_app(state),
                    settings.listen_host,
                    settings.listen_port,
                    settings.log_level,
                )
                await stack.enter_async_context(
                    http_server(config, "inventory-http", handle_signals=False)
                )
            yield state
    finally:
        for sub in subscriptions:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        await gateway.close()
        for task in state.tasks:
            task.cancel()
        _, stuck = await asyncio.wait(state.tasks, timeout=STOP_TIMEOUT_S)
        for task in stuck:
            log.error("task %s did not stop", task.get_name())
        await lease.release()
        await outbox.close()
        await ledger.close()


async def main(settings: InventorySettings) -> None:
    """Run until SIGTERM or SIGINT."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    kube = kube_api(settings)  # missing credentials: before waiting for NATS
    try:
        bus = await Bus.connect(settings, "inventory")
    except BaseException:
        if kube is not None:
            await kube.close()
        raise
    try:
        await bus.ensure_audit_stream(settings.audit_max_age)
        async with running(settings, bus, kube=kube):
            log.info("inventory listening on %s:%d", settings.listen_host, settings.listen_port)
            await stop.wait()
            log.info("stopping")
    finally:
        try:
            if kube is not None:
                await kube.close()
        finally:
            await bus.close()
