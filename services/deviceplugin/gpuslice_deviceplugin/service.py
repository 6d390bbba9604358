"""Running the node agent: every part started, supervised and stopped together.

Parts: the kubelet link (plugin socket and registration), one more per
static MIG profile (:mod:`gpuslice_deviceplugin.static_mig`), the node agent
(discovery, configuration reload, inventory heartbeat), the coordinator (region
flags and heartbeat), the GPUs' physical figures (read every health interval),
the clean-up of container directories, the enforcer (NVML's processes held to
the grants: :mod:`gpuslice_deviceplugin.enforcer`; it thaws what it froze when
the agent stops), and an HTTP server for ``/healthz``, ``/readyz`` and ``/metrics``.

In DRA mode (``dra``) kubelet's device plugin for the GPU resource is not
registered, so no card is granted on both paths: the cards are published as
ResourceSlices (:mod:`gpuslice_deviceplugin.dra.slices`) and kubelet's DRA plugin
service prepares claims (:mod:`gpuslice_deviceplugin.dra.claims`) into the same
container directories, which the enforcer, the driver's limits and telemetry
hold as they hold the device plugin's. The slices are written through the
Kubernetes API, so DRA mode needs one (``kube_api`` other than ``none``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from gpuslice_common.bus import Bus, BusError
from gpuslice_common.config import ConfigError, DevicePluginSettings
from gpuslice_common.kube import KubeApi, KubeError, KubernetesApi, LocalKubeApi, PodNotFound
from gpuslice_common.models import PlacementState
from gpuslice_common.nodeapi import EnforcedRequest, NodeRequestError
from gpuslice_common.service import (
    HAMI_PATH,
    SharedCheck,
    every,
    hami_answer,
    http_server,
    plain_http,
)
from gpuslice_common.subjects import Subjects
from gpuslice_deviceplugin import driverlimits
from gpuslice_deviceplugin.agent import NodeAgent
from gpuslice_deviceplugin.containers import ContainerOwner, HostDir
from gpuslice_deviceplugin.coordinator import Coordinator, CoordinatorSnapshot
from gpuslice_deviceplugin.discovery import open_backend
from gpuslice_deviceplugin.dra.claims import Claims
from gpuslice_deviceplugin.dra.contract import ClaimPreparer
from gpuslice_deviceplugin.dra.kubelet import DraPluginServer
from gpuslice_deviceplugin.dra.slices import SlicePublisher, check_node_name
from gpuslice_deviceplugin.enforcer import Enforcer, open_sampler
from gpuslice_deviceplugin.gateway import InventoryGateway
from gpuslice_deviceplugin.kubelet import KubeletLink, LinkTiming
from gpuslice_deviceplugin.metrics import (
    EnforcerMetrics,
    Names,
    NodeCollector,
    NodeView,
    PluginMetrics,
    registry_with,
)
from gpuslice_deviceplugin.mig import MigInstances
from gpuslice_deviceplugin.nodeconfig import NodeConfig, load_node_config
from gpuslice_deviceplugin.physical import BusyMeter, ContainerKey, GpuFigures, Load
from gpuslice_deviceplugin.plugin import DevicePlugin
from gpuslice_deviceplugin.static_mig import StaticMig

log = logging.getLogger(__name__)

CLEANUP_INTERVAL_S = 60.0
ENFORCED_REPORT_S = 30.0  # how long an enforcement report is sent again while the inventory is away
GONE_PODS_INTERVAL_S = 2.0
READY_CHECK_TTL_S = 1.0  # how long callers of /readyz share the inventory's answer


def kube_api(settings: DevicePluginSettings) -> KubeApi | None:
    if settings.kube_api == "none":
        return None
    if settings.kube_api == "local":
        return LocalKubeApi()
    return KubernetesApi.from_environment()


@dataclass
class Running:
    """The parts of a running agent, for the process and for tests."""

    settings: DevicePluginSettings
    agent: NodeAgent
    plugin: DevicePlugin
    link: KubeletLink
    coordinator: Coordinator
    host: HostDir
    gateway: InventoryGateway
    registry: CollectorRegistry
    mig: MigInstances
    static: StaticMig
    kube: KubeApi | None = None
    dra: DraParts | None = None  # DRA mode's parts; None in device plugin mode
    enforcer: Enforcer | None = None
    hami_registry: CollectorRegistry | None = None  # /metrics/hami; None while off
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    snapshot: CoordinatorSnapshot | None = None
    gone: frozenset[str] = frozenset()  # pods with a directory here known to have ended
    figures: tuple[GpuFigures, ...] = ()  # the GPUs' physical figures, last read
    busy: dict[ContainerKey, float] = field(default_factory=dict)  # percent, last read
    meter: BusyMeter = field(default_factory=BusyMeter)
    # /readyz is open to the cluster network with /metrics: its inventory
    # ping is shared by the callers of a second
    inventory_answers: SharedCheck = field(init=False)

    def __post_init__(self) -> None:
        self.inventory_answers = SharedCheck(self._ping_inventory, ttl=READY_CHECK_TTL_S)

    async def report_enforced(self, request: EnforcedRequest) -> None:
        """Hand an enforcement action to the inventory, which records its event."""
        deadline = asyncio.get_running_loop().time() + ENFORCED_REPORT_S
        await self.gateway.enforced(request, deadline)

    async def coordinate(self) -> None:
        """One coordination pass (also run every ``coordinate_interval``)."""
        self.snapshot = await asyncio.to_thread(self.coordinator.tick, self.gone)

    async def advertise_static_mig(self) -> None:
        """Keep the static MIG resources in step with the devices (every health
        interval); ends with the error of a link that gave up."""
        while True:
            await self.static.update(self.agent.devices)
            error = self.static.failed()
            if error is not None:
                raise error
            await asyncio.sleep(self.settings.health_interval.total_seconds())

    async def read_figures(self) -> None:
        """Read the GPUs' physical figures (also run every ``health_interval``): in a
        worker thread, as an NVML call may take long, so a scrape never waits on one."""
        snapshot = self.snapshot
        self.busy = self.meter.update(snapshot)
        load = Load.of(snapshot, self.busy)
        devices = list(self.agent.devices)
        self.figures = tuple(await asyncio.to_thread(self.agent.backend.figures, devices, load))

    def view(self) -> NodeView:
        """What ``/metrics`` exports now."""
        return NodeView(self.settings.node_name, self.snapshot, self.figures, self.busy)

    async def refresh_gone(self) -> tuple[frozenset[str], frozenset[str]]:
        """(pods with a directory here, those known to have ended).

        A pod has ended when the ledger released it, or, with the Kubernetes API
        at hand, when the ledger lacks it and the API has no such pod. The
        ledger's silence alone proves nothing: a Redis that lost its data must
        neither lift limits nor delete the directories of running containers.
        The ledger's answer comes through the inventory; without one nothing is gone.
        """
        placements = await self.gateway.placements()
        states = {p.uid: p.state for p in placements.pods}
        owners = {o.pod_uid: o for o, _ in await asyncio.to_thread(self.host.containers)}
        gone = set()
        for uid, owner in owners.items():
            state = states.get(uid)
            if state == PlacementState.RELEASED or (
                state is None and await self._absent_from_api(owner)
            ):
                gone.add(uid)
        self.gone = frozenset(gone)
        # MIG instances of ended pods go at once: the ledger has freed their slices
        made = {r.pod_uid for r in await asyncio.to_thread(self.mig.records)}
        ended = {u for u in made if u in gone or states.get(u) == PlacementState.RELEASED}
        if ended:
            await asyncio.to_thread(self.mig.release, ended)
        return frozenset(owners), self.gone

    async def _absent_from_api(self, owner: ContainerOwner) -> bool:
        if self.kube is None:
            return False
        try:
            pod = await self.kube.get_pod(owner.namespace, owner.pod_name)
        except PodNotFound:
            return True
        except KubeError as exc:
            log.warning("pod %s/%s not checked: %s", owner.namespace, owner.pod_name, exc)
            return False
        return bool((pod.get("metadata") or {}).get("uid", owner.pod_uid) != owner.pod_uid)

    async def clean_up(self) -> list[str]:
        """Remove directories of pods that have ended (after ``cleanup_grace``)."""
        present, gone = await self.refresh_gone()
        grace = self.settings.cleanup_grace.total_seconds()
        removed = await asyncio.to_thread(self.host.cleanup, present - gone, grace)
        for uid in removed:
            log.info("removed the container directories of pod %s", uid)
        return removed

    async def ready(self) -> bool:
        """Registered, kubelet watching the devices (a plugin that took our resource
        name over would end that stream), and the inventory answering for its ledger.
        In DRA mode: the node's ResourceSlices written, and the inventory answering."""
        if self.dra is not None:
            if not self.dra.slices.published.is_set():
                return False
        elif not (self.link.registered.is_set() and self.plugin.watching > 0):
            return False
        return await self.inventory_answers()

    async def _ping_inventory(self) -> bool:
        try:
            await self.gateway.ping()
        except NodeRequestError as exc:
            log.info("not ready: %s", exc)
            return False
        return True


@dataclass
class DraParts:
    """DRA mode's parts of a running agent."""

    claims: Claims
    slices: SlicePublisher
    server: DraPluginServer

    async def serve(self) -> None:
        """kubelet's DRA plugin service and registration until cancelled."""
        await self.server.start()
        try:
            await asyncio.Event().wait()
        finally:
            await self.server.stop()


def node_mode(settings: DevicePluginSettings, config: NodeConfig) -> DevicePluginSettings:
    """``settings`` with this node's mode: its node configuration's ``kubeletApi``
    where it sets one, else ``GPUSLICE_DRA``."""
    if config.kubelet_api is None:
        return settings
    return settings.model_copy(update={"dra": config.kubelet_api == "dra"})


def check_dra(kube: KubeApi | None) -> KubeApi:
    """The Kubernetes API DRA mode writes its slices to; ConfigError without one."""
    if kube is None:
        raise ConfigError(
            "invalid configuration: GPUSLICE_KUBE_API: DRA mode (GPUSLICE_DRA) publishes the "
            "node's ResourceSlices through the Kubernetes API; set it to cluster, not none"
        )
    return kube


def dra_parts(
    settings: DevicePluginSettings,
    kube: KubeApi | None,
    agent: NodeAgent,
    gateway: InventoryGateway,
    host: HostDir,
    server: Callable[[ClaimPreparer, Path, Path], DraPluginServer] = DraPluginServer,
) -> DraParts:
    """The parts DRA mode runs; ConfigError without a Kubernetes API to write slices
    to, or for a node name too long to name its slices."""
    kube = check_dra(kube)
    try:
        check_node_name(settings.node_name)
    except ValueError as exc:
        raise ConfigError(f"invalid configuration: GPUSLICE_NODE_NAME: {exc}") from None
    claims = Claims(
        settings,
        gateway,
        host,
        lambda: agent.config,
        driver_support=lambda: agent.driver_support,
    )
    slices = SlicePublisher(
        kube,
        settings.node_name,
        agent.inventory,
        consumable=settings.dra_consumable,
        interval=settings.health_interval.total_seconds(),
    )
    plugin = server(claims, Path(settings.dra_plugins_dir), Path(settings.dra_registry_dir))
    return DraParts(claims, slices, plugin)


def _hold_by_driver(agent: NodeAgent, card: str, cgroup: str, memory_bytes: int) -> None:
    """Layer 1 for one container, where the driver offers it on ``card``: the
    container's group held to its grant through NVML (the enforcer calls this
    from its sampling thread), and the outcome in the agent's per-card report."""
    support = agent.driver_support.get(card)
    if support is None or not support.supported:
        return
    result = driverlimits.ensure_limit(card, cgroup, memory_bytes, root=agent.cgroup_root())
    agent.note_driver_limit(card, cgroup, result)


def create_app(running: Running) -> FastAPI:
    app = FastAPI(title="gpuslice device plugin", docs_url=None, redoc_url=None)

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz(response: Response) -> dict[str, str]:
        if await running.ready():
            return {"status": "ready"}
        response.status_code = 503
        return {"status": "not ready"}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(running.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get(HAMI_PATH)
    async def hami_metrics() -> Response:
        """HAMi's names before 2.9 (``HostGPUMemoryUsage``, ...); 404 while off."""
        hami = running.hami_registry
        status, body, kind = hami_answer(None if hami is None else lambda: generate_latest(hami))
        return Response(body, status_code=status, media_type=kind.decode())

    return app


@contextlib.asynccontextmanager
async def running(
    settings: DevicePluginSettings,
    *,
    bus: Bus | None = None,
    kube: KubeApi | None = None,
    serve_http: bool = True,
    timing: LinkTiming | None = None,
    config: NodeConfig | None = None,
) -> AsyncIterator[Running]:
    """The agent running until the block ends. Raises on bad configuration."""
    if config is None:
        config = load_node_config(settings.node_config_file, settings.node_name)
    settings = node_mode(settings, config)
    if settings.dra:
        check_dra(kube)
    host = HostDir(Path(settings.host_dir))
    await asyncio.to_thread(
        host.install, Path(settings.interposer_library), settings.container_lib_dir
    )
    backend = await asyncio.to_thread(open_backend, settings.backend, settings.node_name, config)
    gateway = InventoryGateway(settings, bus)
    registry = CollectorRegistry()
    metrics = PluginMetrics(registry)
    mig = MigInstances(backend, host.root)
    await asyncio.to_thread(mig.reconcile)
    agent = NodeAgent(settings, backend, config, metrics, bus=bus, mig=mig)
    plugin = DevicePlugin(
        settings,
        agent.device_list,
        lambda: agent.config,
        gateway,
        host,
        metrics,
        kube=kube,
        mig=mig,
        driver_support=lambda: agent.driver_support,
    )
    link = KubeletLink(
        plugin,
        Path(settings.kubelet_dir),
        settings.socket_name,
        settings.requests.resources.gpu,
        metrics,
        timing,
    )
    static = StaticMig(Path(settings.kubelet_dir), settings.requests.resources.gpu, metrics, timing)
    state = Running(
        settings,
        agent,
        plugin,
        link,
        Coordinator(host),
        host,
        gateway,
        registry,
        mig,
        static,
        kube=kube,
        dra=dra_parts(settings, kube, agent, gateway, host) if settings.dra else None,
    )
    if settings.enforce:
        sampler = await asyncio.to_thread(open_sampler, backend.name)
        state.enforcer = Enforcer(
            settings,
            host,
            sampler,
            EnforcerMetrics(registry),
            driver_limit=functools.partial(_hold_by_driver, agent),
        )
        agent.card_layers = state.enforcer.card_layers
    names = Names.GPUSLICE_AND_HAMI if settings.hami_metrics else Names.GPUSLICE
    registry.register(NodeCollector(state.view, names=names))
    if settings.hami_metrics:
        state.hami_registry = registry_with(NodeCollector(state.view, names=Names.HAMI_LEGACY))
    http = contextlib.AsyncExitStack()
    try:
        await agent.refresh()
        log.info(
            "node %s: %d GPU(s) from the %s backend, %d replicas each",
            settings.node_name,
            len(agent.device_list.replicas.devices),
            backend.name,
            agent.config.split_count,
        )
        await state.read_figures()
        coordinate = settings.coordinate_interval.total_seconds()
        if state.dra is None:  # in DRA mode kubelet grants no card through the device plugin
            state.tasks.append(asyncio.create_task(link.run(), name="kubelet-link"))
        else:
            state.tasks += [
                asyncio.create_task(state.dra.slices.run(), name="resource-slices"),
                asyncio.create_task(state.dra.serve(), name="dra-plugin"),
            ]
        state.tasks += [
            asyncio.create_task(state.advertise_static_mig(), name="static-mig"),
            asyncio.create_task(agent.run(), name="node-agent"),
            asyncio.create_task(
                every(coordinate, state.coordinate, "coordination", expected=(NodeRequestError,))
            ),
            asyncio.create_task(
                every(settings.health_interval.total_seconds(), state.read_figures, "GPU figures")
            ),
            asyncio.create_task(
                every(CLEANUP_INTERVAL_S, state.clean_up, "clean-up", expected=(NodeRequestError,))
            ),
            asyncio.create_task(
                every(
                    GONE_PODS_INTERVAL_S,
                    state.refresh_gone,
                    "pod check",
                    expected=(NodeRequestError,),
                )
            ),
        ]
        if state.enforcer is not None:
            state.tasks.append(
                asyncio.create_task(state.enforcer.run(state.report_enforced), name="enforcer")
            )
        if serve_http:
            http_config = plain_http(
                create_app(state), settings.listen_host, settings.metrics_port, settings.log_level
            )
            # SIGTERM stops the agent as a whole, not uvicorn alone
            _, serving = await http.enter_async_context(
                http_server(
                    http_config,
                    "agent-http",
                    max_body=settings.max_request_body,
                    handle_signals=False,
                )
            )
            state.tasks.append(serving)
        yield state
    finally:
        await http.aclose()  # the HTTP server closes its sockets first
        for task in state.tasks:
            task.cancel()
        for task in state.tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await state.static.close()
        state.coordinator.close()
        if state.enforcer is not None:
            await asyncio.to_thread(state.enforcer.close)
        await asyncio.to_thread(backend.close)


SOURCE = "gpuslice/deviceplugin"
BUS_RETRY_S = 5.0


def connect_bus(settings: DevicePluginSettings) -> Awaitable[Bus]:
    """The node's connection: replies come below ``_INBOX.<node token>``, the
    only inbox the node's NATS identity may read."""
    return Bus.connect(settings, SOURCE, inbox_prefix=Subjects.node_inbox(settings.node_name))


async def _connect_later(state: Running, buses: list[Bus]) -> None:
    """Keep trying NATS; once connected, the agent publishes and asks through it."""
    while True:
        await asyncio.sleep(BUS_RETRY_S)
        try:
            bus = await connect_bus(state.settings)
        except BusError as exc:
            log.warning("NATS still unreachable: %s", exc)
            continue
        buses.append(bus)
        state.agent.bus = state.gateway.bus = bus
        log.info("connected to NATS; publishing the inventory, asking the inventory service")
        await state.agent.publish_inventory()
        return


async def main(settings: DevicePluginSettings) -> None:
    """Run until SIGTERM/SIGINT or until a part fails for good (then raise).

    NATS being down at start does not keep kubelet waiting: the agent lists its
    devices without the bus and connects when it can (Allocate waits for it,
    within its deadline)
    """
    config = load_node_config(settings.node_config_file, settings.node_name)
    settings = node_mode(settings, config)
    if settings.dra and settings.kube_api == "none":
        check_dra(None)  # refused before anything starts
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    buses: list[Bus] = []
    try:
        buses.append(await connect_bus(settings))
    except BusError as exc:
        log.warning("starting without NATS (%s); connecting in the background", exc)
    kube = kube_api(settings)
    try:
        bus = buses[0] if buses else None
        async with running(settings, bus=bus, kube=kube, config=config) as state:
            log.info("device plugin for node %s started", settings.node_name)
            if bus is None:
                state.tasks.append(
                    asyncio.create_task(_connect_later(state, buses), name="nats-connect")
                )
            stopping = asyncio.create_task(stop.wait(), name="signals")
            waiting = {*state.tasks, stopping}
            while True:
                done, waiting = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                ended = [t for t in done if t is not stopping and t.get_name() != "nats-connect"]
                for task in ended:
                    task.result()  # a part that failed for good ends the agent with its error
                if stopping in done or ended:
                    break
            stopping.cancel()
            log.info("stopping")
    finally:
        if kube is not None:
            await kube.close()
        for b in buses:
            await b.close()
