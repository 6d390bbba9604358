"""Fixtures of the device plugin's tests: a test kubelet and the agent beside it.

Unix socket paths are limited to 107 bytes, so sockets live in a short
directory under /tmp rather than in pytest's tmp_path.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Literal

import pytest

from gpuslice_cli.dev.kubelet import DevKubelet
from gpuslice_common.bus import Bus
from gpuslice_common.config import DevicePluginSettings, InventorySettings
from gpuslice_common.grant import Grant as ContainerGrant
from gpuslice_common.grant import GrantDevice
from gpuslice_common.ledger import Ledger
from gpuslice_common.models import ContainerAssignment, DeviceGrant, Placement, PodRef
from gpuslice_common.servers import NatsServer, free_port
from gpuslice_deviceplugin.kubelet import LinkTiming
from gpuslice_deviceplugin.service import Running, connect_bus, running
from gpuslice_inventory.gateway import TokenIssuer
from gpuslice_inventory.service import Running as InventoryRunning
from gpuslice_inventory.service import running as inventory_running
from tests.native.probe import Native

NODE = "node-a"
MIB = 1 << 20
FAKE_MEMORY = 80 << 30  # the fake driver's card, all of it
FAST = LinkTiming(poll_s=0.05, backoff_s=0.05, backoff_max_s=0.2, max_failures=4)

SIMULATED = """
defaults:
  deviceSplitCount: 4
  simulate: {count: 2, model: NVIDIA A100-SXM4-40GB, memoryMiB: 40960, numaNodes: 2}
"""


@pytest.fixture
def short_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="gs", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
async def kubelet(short_dir: Path) -> AsyncIterator[DevKubelet]:
    k = DevKubelet(short_dir / "kubelet")
    await k.start()
    yield k
    await k.stop()


@pytest.fixture
def node_config(tmp_path: Path) -> Path:
    path = tmp_path / "nodes.yaml"
    path.write_text(SIMULATED)
    return path


@pytest.fixture
def make_settings(
    short_dir: Path,
    tmp_path: Path,
    node_config: Path,
    nats_server: NatsServer,
    prefix: str,
    native: Native,
) -> Callable[..., DevicePluginSettings]:
    def make(**overrides: Any) -> DevicePluginSettings:
        values: dict[str, Any] = {
            "node_name": NODE,
            "kubelet_dir": str(short_dir / "kubelet"),
            "host_dir": str(tmp_path / "host"),
            "interposer_library": str(native.lib),
            "node_config_file": str(node_config),
            "backend": "simulated",
            "nats_url": nats_server.url,
            "subject_prefix": prefix,
            "kube_api": "none",
            "inventory_timeout": "1s",
            "health_interval": "100ms",
            "inventory_interval": "10s",
            "coordinate_interval": "100ms",
            # served unless a test says serve_http=False: never on the fixed 9400
            "listen_host": "127.0.0.1",
            "metrics_port": free_port(),
        }
        values.update(overrides)
        return DevicePluginSettings(**values)

    return make


@pytest.fixture
def settings(make_settings: Callable[..., DevicePluginSettings]) -> DevicePluginSettings:
    return make_settings()


@pytest.fixture
async def bus(nats_server: NatsServer, prefix: str) -> AsyncIterator[Bus]:
    b = await connect_bus(
        DevicePluginSettings(node_name=NODE, nats_url=nats_server.url, subject_prefix=prefix)
    )
    yield b
    await b.close()


@asynccontextmanager
async def an_inventory(
    nats_url: str,
    redis_url: str,
    prefix: str,
    *,
    issue_telemetry_token: TokenIssuer | None = None,
    **overrides: Any,
) -> AsyncIterator[InventoryRunning]:
    """The inventory service, which answers the agent's requests to the ledger."""
    values: dict[str, Any] = {
        "nats_url": nats_url,
        "redis_url": redis_url,
        "subject_prefix": prefix,
        "ledger_prefix": prefix,
        "kube_api": "none",
        "listen_host": "127.0.0.1",
        "listen_port": free_port(),
        **overrides,
    }
    settings = InventorySettings(**values)
    bus = await Bus.connect(settings, "test/inventory")
    try:
        async with inventory_running(
            settings, bus, serve_http=False, issue_telemetry_token=issue_telemetry_token
        ) as state:
            await bus.flush()
            yield state
    finally:
        await bus.close()


@pytest.fixture
async def inventory(
    nats_server: NatsServer, redis_url: str, prefix: str
) -> AsyncIterator[InventoryRunning]:
    async with an_inventory(nats_server.url, redis_url, prefix) as state:
        yield state


@pytest.fixture
async def plugin_ledger(redis_url: str, prefix: str) -> AsyncIterator[Ledger]:
    """The ledger the inventory serves the agent from, for the test's own reads and writes."""
    led = Ledger.from_url(redis_url, prefix)
    yield led
    await led.close()


@pytest.fixture
async def agent(
    settings: DevicePluginSettings,
    kubelet: DevKubelet,
    bus: Bus,
    inventory: InventoryRunning,
    plugin_ledger: Ledger,
) -> AsyncIterator[Running]:
    """The agent registered with the test kubelet, its node registered in the ledger."""
    async with running(settings, bus=bus, serve_http=False, timing=FAST) as state:
        await plugin_ledger.register_node(state.agent.inventory(), rebuilt=True)
        yield state


Grant = tuple[str, int, int]  # (uuid, memory MiB, cores)


def make_grant(
    pod_uid: str,
    container: str,
    devices: Sequence[str],
    *,
    memory: int = FAKE_MEMORY,
    sm: int = 0,
    policy: str = "default",
    priority: int = 1,
) -> ContainerGrant:
    """A container's grant as the agent writes it: ``memory`` bytes and ``sm`` percent
    on each of ``devices``, control required, no context overhead counted."""
    return ContainerGrant.model_validate(
        {
            "node": NODE,
            "pod_uid": pod_uid,
            "container": container,
            "policy": policy,
            "priority": priority,
            "control_optional": False,
            "context_overhead_bytes": 0,
            "devices": tuple(
                GrantDevice(uuid=u, memory_bytes=memory, sm_percent=sm) for u in devices
            ),
        }
    )


def placement(
    uid: str,
    containers: list[list[Grant]],
    *,
    init: list[list[Grant]] | None = None,
    node: str = NODE,
    priority: Literal[0, 1] = 1,
) -> Placement:
    """A pod's placement: each container's (uuid, memory MiB, cores) per GPU."""

    def assignment(name: str, grants: list[Grant], is_init: bool) -> ContainerAssignment:
        return ContainerAssignment(
            name=name,
            init=is_init,
            priority=priority,
            devices=tuple(DeviceGrant(uuid=u, memory_mib=m, cores=c) for u, m, c in grants),
        )

    out = [assignment(f"init{i}", g, True) for i, g in enumerate(init or [])]
    out += [assignment(f"c{i}", g, False) for i, g in enumerate(containers)]
    return Placement(
        pod=PodRef(uid=uid, namespace="team", name=f"pod-{uid}"),
        node=node,
        containers=tuple(out),
        policy="binpack",
    )


async def bind(ledger: Ledger, *placements: Placement) -> None:
    """Reserve and bind, as the scheduler does before kubelet sees the pod."""
    for p in placements:
        await ledger.reserve(p)
        await ledger.mark_bound(p.pod.uid)


def uuids(state: Running) -> list[str]:
    return [d.uuid for d in state.agent.device_list.replicas.devices]


@pytest.fixture
def agent_process(
    short_dir: Path,
    tmp_path: Path,
    native: Native,
    nats_server: NatsServer,
    prefix: str,
) -> Iterator[Callable[..., subprocess.Popen[str]]]:
    """``python -m gpuslice_deviceplugin`` on NVML (the fake), as a DaemonSet runs it."""
    procs: list[subprocess.Popen[str]] = []
    config = tmp_path / "e2e-nodes.yaml"
    config.write_text("defaults: {deviceSplitCount: 5, contextOverhead: 64}\n")

    def start(**overrides: str) -> subprocess.Popen[str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUSLICE_", "FAKE"))}
        env.update(
            {
                "LD_LIBRARY_PATH": str(native.fake_dir),
                "FAKECUDA_DEVICES": "2",
                "FAKECUDA_MEMORY": "16g",
                "GPUSLICE_NODE_NAME": "node-e2e",
                "GPUSLICE_BACKEND": "nvml",
                "GPUSLICE_KUBELET_DIR": str(short_dir / "kubelet"),
                "GPUSLICE_HOST_DIR": str(tmp_path / "host"),
                "GPUSLICE_INTERPOSER_LIBRARY": str(native.lib),
                "GPUSLICE_NODE_CONFIG_FILE": str(config),
                "GPUSLICE_NATS_URL": nats_server.url,
                "GPUSLICE_SUBJECT_PREFIX": prefix,
                "GPUSLICE_KUBE_API": "none",
                "GPUSLICE_LISTEN_HOST": "127.0.0.1",
                "GPUSLICE_METRICS_PORT": str(free_port()),
                "GPUSLICE_COORDINATE_INTERVAL": "100ms",
                **overrides,
            }
        )
        proc = subprocess.Popen(
            [sys.executable, "-m", "gpuslice_deviceplugin"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        proc.port = int(env["GPUSLICE_METRICS_PORT"])  # type: ignore[attr-defined]
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=10)  # reaps it and closes its pipe
