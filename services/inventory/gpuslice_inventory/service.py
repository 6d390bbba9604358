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
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from fastapi import FastAPI, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import ValidationError

from gpuslice_common.bus import Bus, BusError
from gpuslice_common.config import InventorySettings
from gpuslice_common.kube import KubeApi, KubeError, KubernetesApi
from gpuslice_common.ledger import Ledger, LedgerError
from gpuslice_common.models import NVIDIA, NodeInventory, PodEnded
from gpuslice_common.nkeys import KeyPair, Role
from gpuslice_common.outbox import Outbox
from gpuslice_common.service import (
    HAMI_PATH,
    SharedCheck,
    every,
    hami_answer,
    http_server,
    plain_http,
)
from gpuslice_common.subjects import node_from_token
from gpuslice_inventory.authcallout import AuthCallout
from gpuslice_inventory.console.auditfeed import AuditFeed
from gpuslice_inventory.console.auth import Authenticator
from gpuslice_inventory.console.hub import Hub
from gpuslice_inventory.console.routes import create_console_app
from gpuslice_inventory.console.snapshot import SnapshotBuilder
from gpuslice_inventory.gateway import NodeGateway, TokenIssuer
from gpuslice_inventory.lease import Lease
from gpuslice_inventory.lifecycle import PodWatcher, WatchStats, release_ended
from gpuslice_inventory.metrics import (
    ClusterMetrics,
    HamiMetrics,
    WorkMetrics,
    WorkStats,
    registry_for,
)
from gpuslice_inventory.reconcile import Reconciler
from gpuslice_inventory.telemetry import TelemetryStore
from gpuslice_inventory.upkeep import SOURCE, Upkeep
from gpuslice_inventory.vendorsync import VendorSync, load_device_config

log = logging.getLogger(__name__)
STOP_TIMEOUT_S = 5.0
READY_TIMEOUT_S = 1.0
READY_CHECK_TTL_S = 1.0  # how long callers of /readyz share the ledger's answer
AUDIT_STREAM_RETRY_S = 2.0


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
    hami_registry: CollectorRegistry | None = None  # /metrics/hami; None while off
    reconciler: Reconciler | None = None
    watcher: PodWatcher | None = None
    callout: AuthCallout | None = None
    work: WorkStats = field(default_factory=WorkStats)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    next_reconcile: float = 0.0  # loop time
    # registrations (node -> ``registered@epoch``) a pass has already seen unstamped
    rebuild_seen: dict[str, str] = field(default_factory=dict)
    vendors: VendorSync | None = None  # other vendors' cards from node annotations
    console: Hub | None = None  # the web console's snapshot and feed; None while off

    async def on_inventory_message(self, msg: Msg) -> None:
        """A message on ``<prefix>.inventory.<node>``: checked, then registered.

        Refused, counted by reason and logged in one line: a payload that is
        not JSON (``malformed``), one outside :class:`NodeInventory`'s bounds
        (``invalid``), or one whose node is not exactly the subject's (``subject``).
        """
        try:
            inventory = NodeInventory.model_validate_json(msg.data)
        except ValidationError as exc:
            malformed = any(e["type"] == "json_invalid" for e in exc.errors())
            self._refuse(msg.subject, "malformed" if malformed else "invalid", _summary(exc))
            return
        token = msg.subject.rsplit(".", 1)[-1]
        if node_from_token(token) != inventory.node:
            self._refuse(msg.subject, "subject", f"it describes node {inventory.node}")
            return
        if inventory.vendor != NVIDIA:  # other vendors' cards come from node objects only
            self._refuse(msg.subject, "invalid", f"it lists {inventory.vendor} cards")
            return
        await self.on_inventory(msg.subject, inventory)

    def _refuse(self, subject: str, reason: str, why: str) -> None:
        self.work.refused[reason] += 1
        log.warning("refused the inventory on %s (%s): %s", _one_line(subject), reason, why)

    async def on_inventory(self, subject: str, inventory: NodeInventory) -> None:
        """A node agent's inventory (its heartbeat), already checked: write it to the ledger."""
        try:
            # without the Kubernetes API there is no record to restore: rebuilt at once
            await self.ledger.register_node(inventory, rebuilt=self.reconciler is None)
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
        every sweep; reconciliation at start, every ``reconcile_interval``, and
        as soon as a registered node waits for its rebuilt stamp."""
        if not self.lease.held:
            return
        await self.upkeep.sweep()
        now = asyncio.get_running_loop().time()
        if self.reconciler is None:
            return
        waiting = await self._waiting()
        if any(self.rebuild_seen.get(node) != reg for node, reg in waiting.items()):
            self.next_reconcile = now  # a node waits for its first pass: run one now
        if now >= self.next_reconcile and self.lease.held:
            self.next_reconcile = now + self.settings.reconcile_interval.total_seconds()
            result = await self.reconciler.run_once()
            self.rebuild_seen = waiting
            self.work.nodes_rebuilt += result.stamped
            self.work.restore_conflicts += result.conflicts
            if result.failed:
                # restores refused (nodes not registered again yet): soon again
                retry = 2 * self.settings.heartbeat_interval.total_seconds()
                self.next_reconcile = min(self.next_reconcile, now + retry)
            log.info(
                "reconciled %d pods in %.2fs: %d restored, %d released, %d conflicts; "
                "%d nodes stamped rebuilt, %d waiting",
                result.pods,
                result.seconds,
                result.restored,
                result.released,
                result.conflicts,
                result.stamped,
                result.waiting,
            )

    async def sync_vendors_if_leader(self) -> None:
        """Other vendors' cards as their nodes announce them, in the lease holder."""
        if self.vendors is None or not self.lease.held:
            return
        await self.vendors.run_once()

    async def _waiting(self) -> dict[str, str]:
        """Registered nodes not stamped rebuilt in this epoch, with their
        registrations and the epoch. One that no pass has seen yet (new,
        registered afresh after Redis lost its data, or stale after a failover or
        restart) gets a pass at once; one whose restores failed is tried again on
        the failed-pass schedule."""
        return {
            node: f"{status.registered}@{status.epoch}"
            for node, status in (await self.ledger.rebuild_status()).items()
            if status.rebuilt_at is None
        }

    def work_values(self) -> dict[str, float | Counter[str]]:
        t = self.telemetry.stats
        watch = self.watcher.stats if self.watcher is not None else WatchStats()
        values: dict[str, float | Counter[str]] = {
            "registrations": self.work.registrations,
            "registration_errors": self.work.registration_errors,
            "inventories_refused": Counter(self.work.refused),
            "releases": Counter(self.upkeep.stats.released),
            "pod_watch_events": watch.events,
            "pod_watch_restarts": watch.restarts,
            # KubernetesApi counts them (LocalKubeApi always streams a watch from now)
            "pod_watch_listed_first": getattr(
                self.watcher.kube if self.watcher is not None else None, "watches_listed_first", 0
            ),
            "nodes_marked_unavailable": self.upkeep.stats.nodes_marked,
            "sweeps": self.upkeep.stats.sweeps,
            "nodes_rebuilt": self.work.nodes_rebuilt,
            "restore_conflicts": self.work.restore_conflicts,
            "telemetry_samples": t.received,
            "telemetry_stored": t.stored,
            "telemetry_malformed": t.malformed,
            "telemetry_dropped": Counter(t.dropped_by),
            "node_request_errors": Counter(self.gateway.stats.errors),
            "node_requests_dropped": Counter(
                {
                    "no_reply_subject": self.gateway.stats.unanswerable,
                    "reply_outside_the_node_inbox": self.gateway.stats.foreign_replies,
                }
            ),
            "node_failures_repeated": self.gateway.stats.repeated_failures,
            "node_enforce_reports_dropped": self.gateway.stats.enforce_dropped,
            "change_notices_refused": self.ledger.refused_notices,
            "bus_messages_malformed": self.bus.stats.malformed,
        }
        if self.callout is not None:
            c = self.callout.stats
            values["callout_nodes_accepted"] = c.accepted["node"]
            values["callout_containers_accepted"] = c.accepted["telemetry"]
            values["callout_refusals"] = Counter(c.refused)
        return values

    @property
    def issue_telemetry_token(self) -> Callable[[str, str], str] | None:
        """``(node, pod_uid) -> token`` for a GPU container, when the callout runs."""
        return self.callout.issue_telemetry_token if self.callout is not None else None


def _one_line(text: str, limit: int = 200) -> str:
    """``text`` safe for one log line: escapes instead of line breaks, at most ``limit``."""
    return repr(text[:limit])[1:-1]


def _summary(exc: ValidationError) -> str:
    """The first few problems of a validation error, in one line (no input values)."""
    return "; ".join(
        f"{'.'.join(_one_line(str(p), 64) for p in e['loc']) or 'message'}: {e['msg']}"
        for e in exc.errors()[:5]
    )


def _report_stopped(task: asyncio.Task[None]) -> None:
    """A background task that ended on its own is a bug: say so (and /healthz fails)."""
    if not task.cancelled() and (error := task.exception()) is not None:
        log.error("task %s stopped: %r", task.get_name(), error)


def create_app(state: Running) -> FastAPI:
    app = FastAPI(title="gpuslice inventory", docs_url=None, redoc_url=None)

    async def ledger_answers() -> bool:
        try:
            # the ledger's own retries would outlast a probe's timeout
            return bool(await asyncio.wait_for(state.ledger.ping(), READY_TIMEOUT_S))
        except (LedgerError, TimeoutError):
            return False

    # /readyz is open to the cluster network with /metrics: one Redis ping a second
    ledger_ping = SharedCheck(ledger_answers, ttl=READY_CHECK_TTL_S)

    @app.get("/healthz")
    async def healthz() -> Response:
        dead = [t.get_name() for t in state.tasks if t.done()]
        if dead:
            return JSONResponse({"status": "failed", "stopped": dead}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/readyz")
    async def readyz() -> Response:
        ok = await ledger_ping()
        if not ok or not state.bus.connected:
            why = "ledger unreachable" if not ok else "NATS unreachable"
            return JSONResponse({"status": "not ready", "reason": why}, status_code=503)
        return JSONResponse({"status": "ready", "leader": state.lease.held})

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        return Response(generate_latest(state.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get(HAMI_PATH)
    async def hami_metrics() -> Response:
        """HAMi's scheduler names (``GPUDeviceMemoryAllocated``, ...); 404 while off."""
        hami = state.hami_registry
        status, body, kind = hami_answer(None if hami is None else lambda: generate_latest(hami))
        return Response(body, status_code=status, media_type=kind.decode())

    return app


def kube_api(settings: InventorySettings) -> KubeApi | None:
    if settings.kube_api == "none":
        return None
    return KubernetesApi.from_environment()


def console_hub(
    settings: InventorySettings,
    bus: Bus,
    ledger: Ledger,
    telemetry: TelemetryStore,
    authenticator: Authenticator,
) -> Hub:
    """The web console's shared snapshot and audit feed (one per process)."""
    builder = SnapshotBuilder(ledger, telemetry, settings.ledger_prefix)
    feed = AuditFeed(bus, settings.console_audit_events)
    tick = settings.console_tick.total_seconds()
    return Hub(ledger, builder, feed, authenticator, tick)


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
    (node, pod UID) gives each allocated container its own telemetry credential:
    by default the auth callout's, when it runs; without either, containers get
    none (a NATS without users)."""
    vendor_types = None  # read first: a bad file stops the start before anything opens
    authenticator = None
    if serve_http and settings.console_port:  # tokenreview without the API: no start
        authenticator = Authenticator(settings.console_auth, kube)
    if kube is not None and settings.device_config:
        vendor_types = load_device_config(settings.device_config).announced()
    ledger = Ledger.from_settings(settings)
    telemetry = TelemetryStore(
        ledger.redis,
        settings.ledger_prefix,
        ttl=settings.telemetry_ttl.total_seconds(),
        subjects=bus.subjects,
        placements=ledger.placement,
        placement_cache=settings.telemetry_placement_cache.total_seconds(),
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
    cluster = ClusterMetrics(
        ledger, telemetry, active=lambda: lease.held, hami=settings.hami_metrics
    )
    callout = None
    if settings.callout_issuer_seed:
        callout = AuthCallout(
            settings,
            KeyPair.from_seed(settings.callout_issuer_seed, Role.ACCOUNT),
            kube=kube,
            ledger=ledger,
            subjects=bus.subjects,
        )
        if issue_telemetry_token is None:  # containers get tokens the callout accepts
            issue_telemetry_token = callout.issue_telemetry_token
    gateway = NodeGateway(
        ledger,
        bus.subjects,
        outbox,
        issue_telemetry_token=issue_telemetry_token,
        kube=kube,
        release=upkeep.release,
    )
    state = Running(
        settings, bus, ledger, telemetry, upkeep, lease, cluster, CollectorRegistry(), gateway
    )
    state.callout = callout
    state.registry = registry_for(cluster, WorkMetrics(state.work_values))
    if settings.hami_metrics:
        state.hami_registry = CollectorRegistry()
        state.hami_registry.register(HamiMetrics(cluster))
    if kube is not None:
        state.reconciler = Reconciler(ledger, kube, upkeep, settings.reconcile_grace)
        state.watcher = PodWatcher(kube, upkeep, lambda: lease.held)
        if vendor_types is not None:
            state.vendors = VendorSync(
                ledger, kube, vendor_types, report_timeout=settings.vendor_report_timeout
            )
    queue = f"{settings.subject_prefix}-inventory"
    subscriptions: list[Subscription] = []
    try:
        if state.callout is not None:
            await state.callout.start()
        subscriptions += [
            await bus.nc.subscribe(
                bus.subjects.inventory_all, queue=queue, cb=state.on_inventory_message
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
        if state.callout is not None:
            await state.callout.close()
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
    if state.vendors is not None:
        job = every(
            settings.vendor_interval.total_seconds(),
            state.sync_vendors_if_leader,
            "vendor nodes",
            expected=(LedgerError, KubeError),
        )
        state.tasks.append(asyncio.create_task(job, name="vendor-nodes"))
    if authenticator is not None:
        state.console = console_hub(settings, bus, ledger, telemetry, authenticator)
        state.tasks += [
            asyncio.create_task(state.console.run(), name="console"),
            asyncio.create_task(state.console.feed.run(), name="console-audit-feed"),
        ]
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
                    http_server(
                        config,
                        "inventory-http",
                        max_body=settings.max_request_body,
                        handle_signals=False,
                    )
                )
            if state.console is not None:
                console = plain_http(
                    create_console_app(state.console, bus, state.console.authenticator),
                    settings.console_host,
                    settings.console_port,
                    settings.log_level,
                )
                await stack.enter_async_context(
                    http_server(
                        console,
                        "inventory-console",
                        max_body=settings.max_request_body,
                        handle_signals=False,
                    )
                )
                # on the way out, before the server waits for its connections to close
                stack.callback(state.console.close)
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
        if state.callout is not None:
            await state.callout.close()
        await outbox.close()
        await ledger.close()


async def wait_for_audit_stream(bus: Bus, stop: asyncio.Event) -> None:
    """Wait until the audit stream exists and is fit; the inventory only checks it.

    It is made at install with the admin credential (``gpuslice audit init``); no
    service may create, change or delete it.
    """
    said = ""
    while not stop.is_set():
        try:
            await bus.check_audit_stream()
        except BusError as exc:
            if str(exc) != said:
                log.warning("waiting for the audit stream: %s", exc)
                said = str(exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), AUDIT_STREAM_RETRY_S)
            continue
        if said:
            log.info("the audit stream is there")
        return


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
        await wait_for_audit_stream(bus, stop)
        async with running(settings, bus, kube=kube):
            log.info("inventory listening on %s:%d", settings.listen_host, settings.listen_port)
            if settings.console_port:
                log.info("console on http://%s:%d/", settings.console_host, settings.console_port)
            await stop.wait()
            log.info("stopping")
    finally:
        try:
            if kube is not None:
                await kube.close()
        finally:
            await bus.close()
