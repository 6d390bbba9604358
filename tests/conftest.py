"""Test harness: real nats-server and redis-server processes on free loopback ports.

Session-wide servers serve most tests (each test gets a clean Redis database and
its own subject prefix); fault tests take the per-test ``own_*`` servers, which
they may stop, kill and restart at will.

The interposer under the fake driver (tests/native/probe.py):

* ``native``: builds everything (`make -C native check`) once and gives the paths;
* ``native_tools``: only the fake driver, NVML and test programs (`fakes progs`),
  for tests of the fake itself;
* ``run_probe(*commands, env=None, build="release", options=(), timeout=30,
  check=True, preload_after=())``: runs build/probe to completion, a ProbeResult;
* ``spawn_probe(...)``: the same in the background, a ProbeProcess (a
  subprocess.Popen) for tests that kill or race processes; killed at the test's end.

No test serves HTTP in-process on a service's fixed default port (9092, 9400, ...):
the autouse ``no_fixed_service_ports`` fails the start, naming the port (processes
a test starts are checked by tests/test_fixed_ports.py).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import uvicorn
from redis.asyncio import Redis

from gpuslice_common import service
from gpuslice_common.config import (
    DevicePluginSettings,
    InventorySettings,
    SchedulerSettings,
    WebhookSettings,
)
from gpuslice_common.ledger import Ledger
from gpuslice_common.models import GpuDevice, NodeInventory
from gpuslice_common.servers import NatsServer, RedisServer
from gpuslice_inventory.vendornodes import core_scaling
from tests.kubeapi import FakeApiServer, fake_api_server
from tests.native.probe import (
    Native,
    ProbeRunner,
    ProbeSpawner,
    asan_runtime,
    ensure_built,
)

# every port a service binds when its settings leave it at the default
FIXED_SERVICE_PORTS = frozenset(
    field.default
    for settings in (WebhookSettings, SchedulerSettings, InventorySettings, DevicePluginSettings)
    for name, field in settings.model_fields.items()
    if name.endswith("_port") and isinstance(field.default, int) and field.default > 0
)


@pytest.fixture(autouse=True)
def no_fixed_service_ports(monkeypatch: pytest.MonkeyPatch) -> None:
    """Refuse to serve on a fixed default port: anything else holding it (another
    run, a Prometheus on :9090) would make the test fail by chance."""
    serve = service._serve

    async def guarded(server: uvicorn.Server) -> None:
        port = server.config.port
        if port in FIXED_SERVICE_PORTS:
            raise AssertionError(
                f"a test serves HTTP on the fixed port {port}: give it free_port()"
            )
        await serve(server)

    monkeypatch.setattr(service, "_serve", guarded)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"), persist=False)
    with server:
        yield server


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    server = NatsServer(tmp_path_factory.mktemp("nats"))
    with server:
        yield server


@pytest.fixture
def kube_api_server() -> Iterator[FakeApiServer]:
    """A local Kubernetes API server answering canned JSON (tests/kubeapi.py)."""
    with fake_api_server() as server:
        yield server


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A Redis only this test uses, with append-only persistence, to stop or kill."""
    server = RedisServer(tmp_path / "redis", persist=True)
    with server:
        yield server


@pytest.fixture
def own_nats(tmp_path: Path) -> Iterator[NatsServer]:
    """A nats-server only this test uses, to stop, kill and restart."""
    server = NatsServer(tmp_path / "nats")
    with server:
        yield server


@pytest.fixture
async def redis_url(redis_server: RedisServer) -> str:
    """The session Redis, emptied for this test."""
    client: Redis = Redis.from_url(redis_server.url)
    await client.flushall()
    await client.script_flush()
    await client.aclose()
    return redis_server.url


@pytest.fixture
async def ledger(redis_url: str) -> AsyncIterator[Ledger]:
    led = Ledger.from_url(redis_url)
    yield led
    await led.close()


@pytest.fixture
def prefix() -> str:
    """A subject prefix unique to this test, so tests on one nats-server never mix."""
    return "t" + uuid.uuid4().hex[:10]


def make_inventory(
    node: str,
    gpus: int = 2,
    memory_mib: int = 16384,
    model: str = "NVIDIA A100-SXM4-80GB",
    split_count: int = 10,
    **kwargs: object,
) -> NodeInventory:
    devices = tuple(
        GpuDevice(
            uuid=f"GPU-{node}-{i}",
            index=i,
            model=model,
            memory_mib=memory_mib,
            numa=i % 2,
        )
        for i in range(gpus)
    )
    return NodeInventory(node=node, devices=devices, split_count=split_count, **kwargs)  # type: ignore[arg-type]


def make_vendor_inventory(
    node: str,
    vendor: str,
    model: str,
    cards: int = 2,
    memory_mib: int = 49152,
    cores: int = 100,
    split_count: int = 10,
) -> NodeInventory:
    """``cards`` of another vendor than NVIDIA, as the inventory registers those it
    reads from node objects: ``cores`` a card (Moore Threads' 16, say) held as the
    inventory holds them, through the node's core scaling."""
    devices = tuple(
        GpuDevice(
            uuid=f"{vendor.upper()}-{node}-{i}",
            index=i,
            model=model,
            memory_mib=memory_mib,
            numa=0,
            vendor=vendor,
        )
        for i in range(cards)
    )
    return NodeInventory(
        node=node,
        devices=devices,
        split_count=split_count,
        core_scaling=core_scaling(cores),
        vendor=vendor,
    )


@pytest.fixture(scope="session")
def native() -> Native:
    """Everything `make -C native check` builds; the session fails if make fails."""
    paths = Native.at()
    ensure_built(paths, "check")
    for path in (paths.lib, paths.asan_lib, paths.probe, paths.other_interposer):
        assert path.exists(), f"make check did not build {path}"
    asan_runtime(paths.asan_lib)  # fail early when the sanitizer runtime is missing
    return paths


@pytest.fixture(scope="session")
def native_tools() -> Native:
    """The fake driver and NVML, the probe and other_interposer.so; not the interposer."""
    paths = Native.at()
    ensure_built(paths, "fakes", "progs")
    return paths


@pytest.fixture
def run_probe(native_tools: Native) -> ProbeRunner:
    """Runs the probe; a build other than "none" builds the interposer first."""
    return ProbeRunner(native_tools)


@pytest.fixture
def spawn_probe(native_tools: Native, tmp_path: Path) -> Iterator[ProbeSpawner]:
    spawner = ProbeSpawner(native_tools, tmp_path)
    yield spawner
    spawner.close()
