"""The whole system on one machine: servers, the four services, simulated nodes.

:class:`Stack` starts, each as a child process with its own log file under the
stack's directory:

* nats-server (JetStream) and redis-server, unless URLs of running ones are given;
* the webhook (plain HTTP), the scheduler extender and the inventory;
* one device plugin per simulated node, on the simulated GPU backend, whose
  kubelet is a :class:`~gpuslice_cli.dev.kubelet.DevKubelet` in this process.

The nats-server it starts runs the cluster's accounts and users
(:mod:`gpuslice_cli.dev.natsauth`) with fresh passwords and a fresh callout key:
each service logs in as its own user, the inventory runs the auth callout, each
node agent proves its node with a projected ServiceAccount token that the API
server below minted for it (renewed as kubelet renews it), and GPU containers
get their telemetry token at Allocate. ``gpuslice.env`` in the stack's
directory holds the servers' URLs and the auditor's credential, for
``gpuslice status`` and ``gpuslice audit tail``.

With ``ha=True`` the stack runs the shapes of the highly-available install:
three nats-servers routed as one JetStream cluster (the same accounts and
callout; the audit stream in three copies), a Redis primary with two replicas
and three sentinels (the services find the primary through the sentinels), and
two replicas each of the scheduler extender and the inventory
(``scheduler-0``, ``scheduler-1``, ``inventory-0``, ``inventory-1``); the
webhook stays one.

Every service reaches the Kubernetes API through a kubeconfig naming the
:class:`~gpuslice_cli.dev.apiserver.DevApiServer` this process serves, so each
runs the code it runs on a cluster. Children are started in their own session
(Ctrl-C reaches only this process) and stopped together with SIGTERM, then
SIGKILL after a grace period, whenever this process stops (Ctrl-C, SIGTERM,
SIGHUP). A SIGKILL of this process leaves them running.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pynvml  # type: ignore[import-untyped]

from gpuslice_cli.dev.apiserver import DevApiServer
from gpuslice_cli.dev.drakubelet import DevDraKubelet
from gpuslice_cli.dev.kubelet import DevKubelet, Plugin
from gpuslice_cli.dev.natsauth import (
    AUTHORIZATION,
    NODE_AGENT_AUDIENCE,
    NODE_AGENT_NAMESPACE,
    NODE_AGENT_SERVICE_ACCOUNT,
    NatsAuth,
)
from gpuslice_common.bus import Bus, BusError
from gpuslice_common.config import CommonSettings
from gpuslice_common.dra import API_VERSION, DEVICE_CLASS, DRIVER
from gpuslice_common.kube import LocalKubeApi, ObjectRef
from gpuslice_common.ledger import Ledger
from gpuslice_common.servers import (
    NatsCluster,
    NatsServer,
    RedisSentinelGroup,
    RedisServer,
    free_port,
)
from gpuslice_deviceplugin.discovery import simulated_uuid

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[4]
# the interposer, the fake driver and NVML, the probe (the image sets the variable)
NATIVE_BUILD = Path(os.environ.get("GPUSLICE_NATIVE_DIR") or ROOT / "native" / "build")
STOP_GRACE_S = 10.0
READY_TIMEOUT_S = 60.0
# the subject prefix the manifests' NATS permissions are written for
NATS_AUTH_PREFIX = "gpuslice"
# replicas of the extender and of the inventory in the highly-available stack
HA_REPLICAS = 2
GPU_RESOURCE = "nvidia.com/gpu"


def nvidia_gpus() -> tuple[int, str]:
    """How many NVIDIA GPUs this machine's NVML sees, and why none when 0."""
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return 0, f"NVML cannot start ({exc})"
    try:
        count = int(pynvml.nvmlDeviceGetCount())
    finally:
        pynvml.nvmlShutdown()
    return count, "" if count else "NVML sees no GPU"


class StackError(Exception):
    """The stack could not start; the message says which part and why."""


@dataclass(frozen=True)
class NodeSpec:
    """A simulated GPU node."""

    name: str
    gpus: int = 2
    model: str = "NVIDIA A100-SXM4-80GB"
    memory_mib: int = 81920
    split_count: int = 4
    known_uuids: tuple[str, ...] = ()  # as the node registered them, when learnt
    real: bool = False  # this machine's own GPUs (NVML), not simulated ones
    mig: bool = False  # MIG cards (A100-40GB geometry) on an operatingMode mig node
    # static MIG: these instances already on each MIG card (A100-40GB geometry) of a
    # hami-core node with migStrategy mixed, advertised as nvidia.com/mig-<profile>
    static_mig: tuple[str, ...] = ()
    # DRA mode: the agent publishes a ResourceSlice and serves kubelet's DRA plugin
    # API (a DevDraKubelet here) instead of the device plugin's
    dra: bool = False

    @property
    def resources(self) -> tuple[str, ...]:
        """The extended resources its device plugin registers (a node on real
        GPUs: those NVML shows, learnt only as they register)."""
        static = () if self.real else self.static_mig
        return (GPU_RESOURCE, *sorted({f"nvidia.com/mig-{p}" for p in static}))

    @property
    def uuids(self) -> tuple[str, ...]:
        if self.known_uuids:
            return self.known_uuids
        return tuple(simulated_uuid(self.name, i) for i in range(self.gpus))


DEFAULT_NODES = (
    NodeSpec("gpu-node-1", gpus=2, model="NVIDIA A100-SXM4-80GB", memory_mib=81920),
    NodeSpec("gpu-node-2", gpus=2, model="Tesla T4", memory_mib=15360),
)


@dataclass(frozen=True)
class Attached:
    """Services that run elsewhere (containers, compose.yaml): the stack then
    serves only the API server and one kubelet per node, in directories the
    device plugins share, and drives pods through the services' URLs."""

    webhook_url: str
    extender_url: str
    inventory_url: str
    kubelet_root: Path  # <kubelet_root>/<node>/kubelet.sock
    kubeconfig: Path  # written for the services, naming api_advertise
    api_advertise: str  # how the services reach the API server, e.g. http://driver:6443
    api_host: str = "0.0.0.0"
    api_port: int = 6443
    api_token: str = ""  # fixed bearer token; empty: a fresh one


@dataclass
class Child:
    """One child process of the stack."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    ready_url: str = ""
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log_path.open("ab") as out:
            self.proc = subprocess.Popen(
                self.argv,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, grace: float = STOP_GRACE_S, kill: bool = False) -> int | None:
        """SIGTERM (SIGKILL with ``kill``), then SIGKILL after ``grace``; the exit code."""
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in %.0fs: killed", self.name, grace)
                proc.kill()
                proc.wait()
        self.proc = None
        return proc.returncode


DEVICE_CLASSES = ObjectRef(API_VERSION, "deviceclasses")


def device_class() -> dict[str, object]:
    """The DeviceClass k8s/dra installs: every device of gpuslice's driver."""
    return {
        "apiVersion": API_VERSION,
        "kind": "DeviceClass",
        "metadata": {"name": DEVICE_CLASS},
        "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{DRIVER}"'}}]},
    }


def write_private(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` whole, in a file only its owner may read
    from the moment it exists (made 0600, not narrowed after: a --workdir that
    others may list would let them open it meanwhile)."""
    partial = path.with_name(f".{path.name}.partial")
    partial.unlink(missing_ok=True)
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)
    partial.replace(path)


@dataclass
class AgentTokens:
    """The node agents' projected ServiceAccount tokens, as kubelet keeps them:
    minted by the API server for the agent's pod on its node and NATS's
    audience, written whole to a file, and renewed at 80 % of their life."""

    kube: LocalKubeApi
    ttl_s: float = 3600.0
    files: dict[str, Path] = field(default_factory=dict)  # by node

    def write(self, node: str, path: Path) -> Path:
        token = self.kube.tokens.mint(
            NODE_AGENT_NAMESPACE,
            NODE_AGENT_SERVICE_ACCOUNT,
            pod_name=f"{NODE_AGENT_SERVICE_ACCOUNT}-{node}",
            pod_uid=f"uid-{NODE_AGENT_SERVICE_ACCOUNT}-{node}",
            node=node,
            audiences=(NODE_AGENT_AUDIENCE,),
            ttl_s=self.ttl_s,
        )
        write_private(path, token)
        self.files[node] = path
        return path

    async def renew(self) -> None:
        """Every file gets a fresh token at 80 % of the last one's life, until cancelled."""
        while True:
            await asyncio.sleep(self.ttl_s * 0.8)
            for node, path in self.files.items():
                self.write(node, path)


@dataclass
class Stack:
    """Everything gpuslice needs on this machine, for the block of :meth:`running`."""

    workdir: Path
    nodes: tuple[NodeSpec, ...] = DEFAULT_NODES
    nats_url: str | None = None
    redis_url: str | None = None
    prefix: str = "gpuslice"
    log_level: str = "INFO"
    heartbeat_s: float = 2.0
    kube: LocalKubeApi = field(default_factory=LocalKubeApi)
    children: dict[str, Child] = field(default_factory=dict)
    kubelets: dict[str, DevKubelet] = field(default_factory=dict)
    dra_kubelets: dict[str, DevDraKubelet] = field(default_factory=dict)  # DRA nodes'
    plugins: dict[str, Plugin] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)
    apiserver: DevApiServer | None = None
    exit_codes: dict[str, int | None] = field(default_factory=dict)  # at stop
    attached: Attached | None = None
    nats_auth: NatsAuth | None = None  # the credentials of the NATS the stack started
    agent_token_ttl_s: float = 3600.0
    ha: bool = False  # the highly-available shapes (module docstring)
    nats_cluster: NatsCluster | None = None  # ha: the servers, to kill in fault tests
    redis_group: RedisSentinelGroup | None = None
    redis_sentinels: str | None = None  # ha: "host:port,..."
    redis_sentinel_service: str = "gpuslice"
    _servers: list[NatsServer | RedisServer | NatsCluster | RedisSentinelGroup] = field(
        default_factory=list
    )
    _sockets: Path | None = None
    _agent_tokens: AgentTokens | None = None
    _renewing: asyncio.Task[None] | None = None

    @property
    def webhook_url(self) -> str:
        if self.attached is not None:
            return self.attached.webhook_url
        return f"http://127.0.0.1:{self.ports['webhook']}"

    @property
    def extender_url(self) -> str:
        """The extender (ha: its first replica; :attr:`extender_urls` names all)."""
        return self.extender_urls[0]

    @property
    def inventory_url(self) -> str:
        """The inventory (ha: its first replica; :attr:`inventory_urls` names all)."""
        return self.inventory_urls[0]

    @property
    def extender_urls(self) -> list[str]:
        """Every replica of the extender, as a Service in front of them would reach them."""
        if self.attached is not None:
            return [self.attached.extender_url]
        return [f"http://127.0.0.1:{self.ports[name]}" for name in self.replicas("scheduler")]

    @property
    def inventory_urls(self) -> list[str]:
        if self.attached is not None:
            return [self.attached.inventory_url]
        return [f"http://127.0.0.1:{self.ports[name]}" for name in self.replicas("inventory")]

    @property
    def console_url(self) -> str | None:
        """The web console of the (first) inventory; None when attached to a stack
        this one did not start."""
        if self.attached is not None:
            return None
        port = self.ports.get(self.replicas("inventory")[0] + "-console")
        return None if port is None else f"http://127.0.0.1:{port}/"

    @property
    def metrics_urls(self) -> dict[str, str]:
        """Each process's plain-HTTP metrics endpoint, by name (none when attached):
        the webhook's and the extenders' own metrics ports, the inventories'
        HTTP port, the node agents' metrics ports."""
        if self.attached is not None:
            return {}
        names = ["webhook", *self.replicas("scheduler")]
        urls = {name: f"http://127.0.0.1:{self.ports[name + '-metrics']}/metrics" for name in names}
        for name, url in zip(self.replicas("inventory"), self.inventory_urls, strict=True):
            urls[name] = f"{url}/metrics"
        for node in self.nodes:
            if node.name in self.ports:
                urls[node.name] = f"http://127.0.0.1:{self.ports[node.name]}/metrics"
        return urls

    @property
    def service_urls(self) -> list[str]:
        """Every service replica's URL: the webhook, the extenders, the inventories."""
        return [self.webhook_url, *self.extender_urls, *self.inventory_urls]

    def replicas(self, service: str) -> list[str]:
        """The children that run ``service`` (scheduler, inventory): itself, or
        ``<service>-0``, ``<service>-1`` in the highly-available stack."""
        if not self.ha or service == "webhook":
            return [service]
        return [f"{service}-{i}" for i in range(HA_REPLICAS)]

    @property
    def env_file(self) -> Path:
        """The servers' URLs and the auditor's NATS credential, as variables."""
        return self.workdir / "gpuslice.env"

    def bus_settings(self, user: str) -> CommonSettings:
        """Settings to reach the stack's NATS as ``user`` (when it has users), and
        its Redis (ha: through the sentinels)."""
        auth = self.nats_auth
        return CommonSettings(
            nats_url=self.nats_url or "",
            nats_user=user if auth is not None else None,
            nats_password=auth.passwords[user] if auth is not None else None,
            redis_url=self.redis_url or "",
            redis_sentinels=self.redis_sentinels,
            redis_sentinel_service=self.redis_sentinel_service,
            subject_prefix=self.prefix,
            ledger_prefix=self.prefix,
            audit_replicas=3 if self.nats_cluster is not None else 1,
        )

    def ledger(self, **kwargs: Any) -> Ledger:
        """A client of the stack's ledger (ha: it finds the primary through the
        sentinels, again after a failover)."""
        return Ledger.from_settings(self.bus_settings("admin"), **kwargs)

    def node(self, name: str) -> NodeSpec:
        for node in self.nodes:
            if node.name == name:
                return node
        raise KeyError(name)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Stack]:
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.attached is not None:
            async with self._attach():
                yield self
            return
        try:
            self._start_servers()
            self.apiserver = DevApiServer(self.kube)
            async with self.apiserver.serving():
                kubeconfig = self.apiserver.kubeconfig(self.workdir / "kubeconfig")
                try:
                    await self._start_services(kubeconfig)
                    yield self
                finally:
                    await self._stop_services()
        finally:
            for server in reversed(self._servers):
                server.stop()
            self._servers.clear()

    @contextlib.asynccontextmanager
    async def _attach(self) -> AsyncIterator[None]:
        attached = self.attached
        assert attached is not None
        if self.nats_url is None or self.redis_url is None:
            raise StackError("attached to running services, the stack needs NATS and Redis URLs")
        self.apiserver = DevApiServer(
            self.kube, attached.api_host, attached.api_port, attached.api_token
        )
        async with self.apiserver.serving():
            self.apiserver.kubeconfig(attached.kubeconfig, server=attached.api_advertise)
            try:
                for node in self.nodes:
                    kubelet = DevKubelet(attached.kubelet_root / node.name)
                    await kubelet.start()
                    self.kubelets[node.name] = kubelet
                await self._wait_ready(list(self.kubelets))
                await self.learn_nodes()
                await self._wait_services()
                yield
            finally:
                for kubelet in self.kubelets.values():
                    await kubelet.stop()

    async def _wait_services(self) -> None:
        """Attached: every service answers /readyz with 200."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        async with httpx.AsyncClient(timeout=2) as client:
            for url in (self.webhook_url, self.extender_url, self.inventory_url):
                while True:
                    with contextlib.suppress(httpx.HTTPError):
                        if (await client.get(f"{url}/readyz")).status_code == 200:
                            break
                    if time.monotonic() > deadline:
                        raise StackError(f"{url} was not ready within {READY_TIMEOUT_S:.0f}s")
                    await asyncio.sleep(0.2)

    async def learn_nodes(self) -> None:
        """The nodes' GPUs as their agents registered them (attached, the stack
        did not configure them): what the fake driver must show. Returns once
        every node is stamped rebuilt (it takes pods)."""
        ledger = self.ledger(retries=2)
        try:
            learnt = []
            deadline = time.monotonic() + READY_TIMEOUT_S
            for node in self.nodes:
                cards = await ledger.node_gpus(node.name)
                while not cards:
                    if time.monotonic() > deadline:
                        raise StackError(f"{node.name} never registered its GPUs in the ledger")
                    await asyncio.sleep(0.2)
                    cards = await ledger.node_gpus(node.name)
                # the inventory's first reconciliation pass after the node
                # registered stamps it rebuilt: only then does it take pods
                while (await ledger.rebuild_status([node.name]))[node.name].rebuilt_at is None:
                    if time.monotonic() > deadline:
                        raise StackError(f"{node.name} was never stamped rebuilt by the inventory")
                    await asyncio.sleep(0.2)
                cards.sort(key=lambda c: c.device.index)
                first = cards[0].device
                learnt.append(
                    dataclasses.replace(
                        node,
                        gpus=len(cards),
                        model=first.model,
                        memory_mib=first.memory_mib,
                        known_uuids=tuple(c.device.uuid for c in cards),
                    )
                )
            self.nodes = tuple(learnt)
        finally:
            await ledger.close()

    def _start_servers(self) -> None:
        if self.ha:
            if self.nats_url is not None or self.redis_url is not None:
                raise StackError("the highly-available stack starts its own NATS and Redis")
            if self.prefix != NATS_AUTH_PREFIX:
                raise StackError(
                    f"the stack's NATS permits the subjects of prefix {NATS_AUTH_PREFIX!r} only"
                )
            self.nats_auth = NatsAuth.generate()
            cluster = NatsCluster(
                self.workdir / "nats", 3, config=AUTHORIZATION, env=self.nats_auth.server_env()
            )
            self._servers.append(cluster)
            cluster.start()
            self.nats_cluster, self.nats_url = cluster, cluster.url
            group = RedisSentinelGroup(self.workdir / "redis", service=self.redis_sentinel_service)
            self._servers.append(group)
            group.start()
            self.redis_group, self.redis_url = group, group.url
            self.redis_sentinels = group.sentinels
            self._write_env_file()
            return
        if self.nats_url is None:
            if self.prefix != NATS_AUTH_PREFIX:
                raise StackError(
                    f"the stack's NATS permits the subjects of prefix {NATS_AUTH_PREFIX!r} only"
                )
            self.nats_auth = NatsAuth.generate()
            nats = NatsServer(
                self.workdir / "nats", config=AUTHORIZATION, env=self.nats_auth.server_env()
            )
            nats.start()
            self._servers.append(nats)
            self.nats_url = nats.url
        if self.redis_url is None:
            redis = RedisServer(self.workdir / "redis", persist=True)
            redis.start()
            self._servers.append(redis)
            self.redis_url = redis.url
        self._write_env_file()

    def _write_env_file(self) -> None:
        auditor = self.bus_settings("auditor")
        lines = [
            "# the local stack's servers and the auditor's NATS credential, for",
            "# gpuslice status and gpuslice audit tail:  set -a; . THIS_FILE; set +a",
            f"GPUSLICE_NATS_URL={auditor.nats_url}",
            f"GPUSLICE_REDIS_URL={auditor.redis_url}",
            f"GPUSLICE_SUBJECT_PREFIX={self.prefix}",
            f"GPUSLICE_LEDGER_PREFIX={self.prefix}",
        ]
        if self.redis_sentinels:
            lines += [
                f"GPUSLICE_REDIS_SENTINELS={self.redis_sentinels}",
                f"GPUSLICE_REDIS_SENTINEL_SERVICE={self.redis_sentinel_service}",
            ]
        if auditor.nats_user:
            lines += [
                f"GPUSLICE_NATS_USER={auditor.nats_user}",
                f"GPUSLICE_NATS_PASSWORD={auditor.nats_password}",
            ]
        write_private(self.env_file, "\n".join(lines) + "\n")

    def base_env(self, kubeconfig: Path) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUSLICE_", "FAKE"))}
        env.pop("KUBERNETES_SERVICE_HOST", None)
        env.update(
            {
                "GPUSLICE_NATS_URL": self.nats_url or "",
                "GPUSLICE_REDIS_URL": self.redis_url or "",
                "GPUSLICE_SUBJECT_PREFIX": self.prefix,
                "GPUSLICE_LEDGER_PREFIX": self.prefix,
                "GPUSLICE_LOG_LEVEL": self.log_level,
                "GPUSLICE_LISTEN_HOST": "127.0.0.1",
                "GPUSLICE_KUBE_API": "cluster",
                "KUBECONFIG": str(kubeconfig),
            }
        )
        if self.redis_sentinels:
            env["GPUSLICE_REDIS_SENTINELS"] = self.redis_sentinels
            env["GPUSLICE_REDIS_SENTINEL_SERVICE"] = self.redis_sentinel_service
        if self.nats_cluster is not None:
            env["GPUSLICE_AUDIT_REPLICAS"] = "3"
        return env

    def _login(self, user: str) -> dict[str, str]:
        """A service's NATS credential, as variables (none when NATS has no users)."""
        return self.nats_auth.client_env(user) if self.nats_auth is not None else {}

    def _service(self, name: str, module: str, env: dict[str, str], ready: str = "") -> Child:
        child = Child(
            name,
            [sys.executable, "-m", module],
            env,
            self.workdir / f"{name}.log",
            ready_url=ready,
        )
        self.children[name] = child
        return child

    async def init_audit_stream(self) -> None:
        """The install step: the audit stream made with the admin credential,
        before any service runs (services only check it)."""
        settings = self.bus_settings("admin")
        bus = await Bus.connect(settings, "audit-init")
        deadline = time.monotonic() + READY_TIMEOUT_S
        try:
            while True:  # as the install Job is retried
                try:
                    await bus.ensure_audit_stream(settings.audit_max_age, settings.audit_replicas)
                    return
                except BusError as exc:
                    if time.monotonic() > deadline:
                        raise StackError(f"the audit stream could not be made: {exc}") from None
                    log.info("the audit stream is not made yet (%s); trying again", exc)
                await asyncio.sleep(0.5)
        finally:
            await bus.close()

    async def _start_services(self, kubeconfig: Path) -> None:
        env = self.base_env(kubeconfig)
        await self.init_audit_stream()
        names = ["webhook", *self.replicas("scheduler"), *self.replicas("inventory")]
        for name in names:
            self.ports[name] = free_port()
        for name in ("webhook", *self.replicas("scheduler")):  # their plain metrics ports
            self.ports[name + "-metrics"] = free_port()
        for name in self.replicas("inventory"):  # each inventory's web console
            self.ports[name + "-console"] = free_port()
        heartbeat = f"{self.heartbeat_s}s"

        def listen(name: str) -> dict[str, str]:
            return {
                "GPUSLICE_LISTEN_PORT": str(self.ports[name]),
                "GPUSLICE_METRICS_HOST": "127.0.0.1",
                "GPUSLICE_METRICS_PORT": str(self.ports[name + "-metrics"]),
            }

        dra = {"GPUSLICE_DRA": "true"} if self.nodes and all(n.dra for n in self.nodes) else {}
        self._service(
            "webhook",
            "gpuslice_webhook",
            {**env, **self._login("webhook"), **listen("webhook"), **dra},
            f"{self.webhook_url}/readyz",
        )
        for name, url in zip(self.replicas("scheduler"), self.extender_urls, strict=True):
            self._service(
                name,
                "gpuslice_scheduler",
                {**env, **self._login("scheduler"), **listen(name)},
                f"{url}/readyz",
            )
        for name, url in zip(self.replicas("inventory"), self.inventory_urls, strict=True):
            self._service(
                name,
                "gpuslice_inventory",
                {
                    **env,
                    **self._login("inventory"),
                    **self._callout_env(),
                    "GPUSLICE_LISTEN_PORT": str(self.ports[name]),
                    "GPUSLICE_CONSOLE_HOST": "127.0.0.1",
                    "GPUSLICE_CONSOLE_PORT": str(self.ports[name + "-console"]),
                    "GPUSLICE_HEARTBEAT_INTERVAL": heartbeat,
                    "GPUSLICE_SWEEP_INTERVAL": "1s",
                    "GPUSLICE_METRICS_INTERVAL": "1s",
                    # pods that end while the inventory is down are found by the
                    # next pass: keep it short here
                    "GPUSLICE_RECONCILE_INTERVAL": "5s",
                    "GPUSLICE_RECONCILE_GRACE": "2s",
                },
                f"{url}/readyz",
            )
        for child in self.children.values():
            child.start()
        # the node agents after the inventory: its callout lets them into NATS
        await self._wait_ready()
        # Unix socket paths are short: the kubelet directories live under /tmp.
        sockets = Path(tempfile.mkdtemp(prefix="gpuslice-kubelet-"))
        self._sockets = sockets
        if self.nats_auth is not None:
            self._agent_tokens = AgentTokens(self.kube, self.agent_token_ttl_s)
            self._renewing = asyncio.create_task(self._agent_tokens.renew())
        if any(node.dra for node in self.nodes):
            await self.kube.create_object(DEVICE_CLASSES, device_class())
        for node in self.nodes:
            kubelet = DevKubelet(sockets / node.name)
            await kubelet.start()
            self.kubelets[node.name] = kubelet
            if node.dra:
                dra_kubelet = DevDraKubelet(sockets / node.name / "plugins_registry")
                await dra_kubelet.start()
                self.dra_kubelets[node.name] = dra_kubelet
            self._service(node.name, "gpuslice_deviceplugin", self._plugin_env(env, node, sockets))
            self.children[node.name].start()
        await self._wait_ready()
        await self.learn_nodes()  # a node on real GPUs has what NVML found

    def _callout_env(self) -> dict[str, str]:
        """The inventory's auth callout: its account key, its NATS user, and
        whose tokens prove a node agent."""
        if self.nats_auth is None:
            return {}
        return {
            "GPUSLICE_CALLOUT_ISSUER_SEED": self.nats_auth.issuer.seed,
            "GPUSLICE_CALLOUT_NATS_USER": "callout",
            "GPUSLICE_CALLOUT_NATS_PASSWORD": self.nats_auth.passwords["callout"],
            "GPUSLICE_NODE_AGENT_AUDIENCE": NODE_AGENT_AUDIENCE,
            "GPUSLICE_NODE_AGENT_SERVICE_ACCOUNT": (
                f"system:serviceaccount:{NODE_AGENT_NAMESPACE}:{NODE_AGENT_SERVICE_ACCOUNT}"
            ),
        }

    def _plugin_env(self, env: dict[str, str], node: NodeSpec, sockets: Path) -> dict[str, str]:
        home = self.workdir / node.name
        home.mkdir(parents=True, exist_ok=True)
        config = home / "node-config.json"
        defaults: dict[str, object] = {"deviceSplitCount": node.split_count}
        if not node.real:
            defaults["simulate"] = {
                "count": node.gpus,
                "model": node.model,
                "memoryMiB": node.memory_mib,
                "mig": node.mig or bool(node.static_mig),
                "instances": list(node.static_mig),
            }
            if node.mig:
                defaults["operatingMode"] = "mig"
            elif node.static_mig:
                defaults["migStrategy"] = "mixed"
        config.write_text(json.dumps({"defaults": defaults}))
        self.ports[node.name] = free_port()
        # the node agent holds no ledger credential: it asks the inventory over NATS
        agent_env = {
            k: v
            for k, v in env.items()
            if k not in ("GPUSLICE_REDIS_URL", "GPUSLICE_LEDGER_PREFIX")
        }
        # nor a NATS password: its pod's projected token, which the callout
        # reviews (the agent replies below _INBOX.<node>, as on a cluster)
        if self._agent_tokens is not None:
            token = self._agent_tokens.write(node.name, home / "nats-token")
            agent_env["GPUSLICE_NATS_TOKEN_FILE"] = str(token)
        return {
            **agent_env,
            "GPUSLICE_NODE_NAME": node.name,
            "GPUSLICE_BACKEND": "nvml" if node.real else "simulated",
            "GPUSLICE_NODE_CONFIG_FILE": str(config),
            "GPUSLICE_KUBELET_DIR": str(sockets / node.name),
            "GPUSLICE_HOST_DIR": str(home / "host"),
            "GPUSLICE_INTERPOSER_LIBRARY": str(NATIVE_BUILD / "libgpuslice.so"),
            "GPUSLICE_METRICS_PORT": str(self.ports[node.name]),
            "GPUSLICE_INVENTORY_INTERVAL": f"{self.heartbeat_s}s",
            "GPUSLICE_COORDINATE_INTERVAL": "100ms",
            **(self._dra_env(node, sockets / node.name) if node.dra else {}),
        }

    def cdi_dir(self, node: str) -> Path:
        """Where the node's agent writes its CDI specs (DRA mode)."""
        return self.workdir / node / "cdi"

    def _dra_env(self, node: NodeSpec, kubelet_dir: Path) -> dict[str, str]:
        return {
            "GPUSLICE_DRA": "true",
            "GPUSLICE_DRA_PLUGINS_DIR": str(kubelet_dir / "plugins"),
            "GPUSLICE_DRA_REGISTRY_DIR": str(kubelet_dir / "plugins_registry"),
            "GPUSLICE_CDI_DIR": str(self.cdi_dir(node.name)),
        }

    async def _wait_ready(self, nodes: list[str] | None = None) -> None:
        """Every child ready (services: /readyz; nodes: registered with devices);
        attached, the named nodes' plugins registered with their kubelets."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        waiting: list[tuple[str, Child | None]] = [(c.name, c) for c in self.children.values()]
        waiting += [(node, None) for node in nodes or []]
        async with httpx.AsyncClient(timeout=2) as client:
            for name, child in waiting:
                while True:
                    self.check_alive()
                    if child is not None and child.ready_url:
                        with contextlib.suppress(httpx.HTTPError):
                            if (await client.get(child.ready_url)).status_code == 200:
                                break
                    elif name in self.dra_kubelets:
                        if self.dra_kubelets[name].plugin_for(DRIVER) is not None:
                            break
                    else:
                        kubelet = self.kubelets[name]
                        wanted = self.node(name).resources if child is not None else ()
                        plugin = kubelet.plugin_for(GPU_RESOURCE)
                        others = all(kubelet.plugin_for(r) for r in wanted)
                        if plugin is not None and plugin.devices and others:
                            self.plugins[name] = plugin
                            break
                    if time.monotonic() > deadline:
                        where = (
                            f"; its log ({child.log_path}) ends:\n{child.tail()}"
                            if child is not None
                            else ": no plugin registered with its kubelet"
                        )
                        raise StackError(
                            f"{name} was not ready within {READY_TIMEOUT_S:.0f}s{where}"
                        )
                    await asyncio.sleep(0.1)

    def check_alive(self) -> None:
        for child in self.children.values():
            if child.proc is not None and not child.running:
                raise StackError(
                    f"{child.name} exited with {child.proc.returncode}; "
                    f"its log ({child.log_path}) ends:\n{child.tail()}"
                )

    def plugin(self, node: str, resource: str = GPU_RESOURCE) -> Plugin:
        """The node's device plugin of ``resource`` as its kubelet holds it now
        (it re-registers after a restart)."""
        plugin = self.kubelets[node].plugin_for(resource)
        if plugin is None:
            raise StackError(f"no device plugin of {resource} registered on {node}")
        return plugin

    async def restart(self, name: str, kill: bool = False) -> None:
        """Stop a service (SIGKILL with ``kill``) and start it again."""
        child = self.children[name]
        registered = len(self.kubelets[name].plugins) if name in self.kubelets else 0
        await asyncio.to_thread(child.stop, STOP_GRACE_S, kill)
        child.start()
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            if child.ready_url:
                with contextlib.suppress(httpx.HTTPError):
                    async with httpx.AsyncClient(timeout=2) as client:
                        if (await client.get(child.ready_url)).status_code == 200:
                            return
            elif self._registered_again(name, registered):
                return
            if not child.running or time.monotonic() > deadline:
                raise StackError(f"{name} did not come back; its log ends:\n{child.tail()}")
            await asyncio.sleep(0.1)

    def _registered_again(self, name: str, before: int) -> bool:
        """Every resource of node ``name`` registered after the first ``before``
        registrations, its GPUs listed."""
        kubelet = self.kubelets[name]
        fresh = kubelet.plugins[before:]
        for resource in self.node(name).resources:
            plugin = kubelet.plugin_for(resource)
            if plugin is None or plugin not in fresh:
                return False
        return bool(self.plugin(name).devices)

    def server(self, kind: str) -> NatsServer | RedisServer:
        """The embedded nats-server or redis-server, to stop or kill in fault tests."""
        wanted = NatsServer if kind == "nats" else RedisServer
        for server in self._servers:
            if isinstance(server, wanted):
                return server
        raise StackError(f"no embedded {kind} server")

    async def _stop_services(self) -> None:
        if self._renewing is not None:
            self._renewing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewing
            self._renewing = None
        codes = await asyncio.gather(
            *(asyncio.to_thread(c.stop) for c in reversed(self.children.values()))
        )
        for child, code in zip(reversed(self.children.values()), codes, strict=True):
            self.exit_codes[child.name] = code
            if code not in (0, None):
                log.warning("%s exited with %s (log: %s)", child.name, code, child.log_path)
        for kubelet in self.kubelets.values():
            await kubelet.stop()
        for dra_kubelet in self.dra_kubelets.values():
            await dra_kubelet.stop()
        if self._sockets is not None:
            shutil.rmtree(self._sockets, ignore_errors=True)
