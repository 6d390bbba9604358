"""The agent rides out Redis and NATS restarts; its generated API stays in step with the .proto."""

from __future__ import annotations

import asyncio
import filecmp
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from gpuslice_cli.dev.kubelet import DevKubelet
from gpuslice_common.bus import Bus
from gpuslice_common.config import DevicePluginSettings
from gpuslice_common.ledger import Ledger
from gpuslice_common.models import NodeInventory
from gpuslice_common.servers import NatsServer, RedisServer
from gpuslice_deviceplugin.service import running
from tests.deviceplugin.conftest import FAST, NODE, bind, placement, uuids

ROOT = Path(__file__).resolve().parents[2]
API = ROOT / "services" / "deviceplugin" / "gpuslice_deviceplugin" / "api"


async def test_an_allocate_during_a_redis_restart_is_answered_when_redis_is_back(
    make_settings: Callable[..., DevicePluginSettings],
    own_redis: RedisServer,
    kubelet: DevKubelet,
    bus: Bus,
) -> None:
    settings = make_settings(redis_url=own_redis.url)
    async with running(settings, bus=bus, serve_http=False, timing=FAST) as state:
        await state.ledger.register_node(state.agent.inventory(), rebuilt=True)
        await bind(state.ledger, placement("through", [[(uuids(state)[0], 100, 5)]]))
        plugin = await kubelet.registration()
        await plugin.list_after(0)
        own_redis.kill()
        admitting = asyncio.create_task(plugin.admit_container(1))
        await asyncio.sleep(0.5)
        assert not admitting.done()
        await asyncio.to_thread(own_redis.start)
        response = await asyncio.wait_for(admitting, 15)
    assert response.envs["GPUSLICE_POD_UID"] == "through"


async def test_the_heartbeat_comes_back_after_a_nats_restart(
    make_settings: Callable[..., DevicePluginSettings],
    own_nats: NatsServer,
    kubelet: DevKubelet,
    prefix: str,
) -> None:
    settings = make_settings(nats_url=own_nats.url, inventory_interval="200ms")
    agent_bus = await Bus.connect(settings, "gpuslice/deviceplugin")
    try:
        async with running(settings, bus=agent_bus, serve_http=False, timing=FAST):
            await asyncio.sleep(0.3)
            own_nats.kill()
            await asyncio.sleep(0.5)  # heartbeats while NATS is down are buffered or dropped
            await asyncio.to_thread(own_nats.start)
            listener = await Bus.connect(settings, "test")
            got: asyncio.Queue[NodeInventory] = asyncio.Queue()

            async def on_inventory(_subject: str, inv: NodeInventory) -> None:
                await got.put(inv)

            try:
                await listener.subscribe(
                    listener.subjects.inventory(NODE), NodeInventory, on_inventory
                )
                await listener.nc.flush()
                inv = await asyncio.wait_for(got.get(), 10)
            finally:
                await listener.close()
    finally:
        await agent_bus.close()
    assert inv.node == NODE
    assert len(inv.devices) == 2


async def test_an_allocate_while_the_node_is_being_rebuilt_waits_for_it(
    make_settings: Callable[..., DevicePluginSettings],
    tmp_path: Path,
    kubelet: DevKubelet,
    bus: Bus,
) -> None:
    """Redis restarts empty; the pod's placement is restored, but until the node is
    stamped rebuilt no choice among its bound pods is safe: Allocate waits."""
    server = RedisServer(tmp_path / "redis", persist=False)
    with server:
        settings = make_settings(redis_url=server.url)
        async with running(settings, bus=bus, serve_http=False, timing=FAST) as state:
            plugin = await kubelet.registration()
            await plugin.list_after(0)
            await asyncio.to_thread(server.kill)
            await asyncio.to_thread(server.start)
            await state.ledger.register_node(state.agent.inventory())  # not stamped
            record = placement("survivor", [[(uuids(state)[0], 100, 5)]])
            await state.ledger.restore(record, running=False)
            admitting = asyncio.create_task(plugin.admit_container(1))
            await asyncio.sleep(1)  # kubelet's call arrives while the node is rebuilt
            assert not admitting.done()
            assert await state.ledger.mark_rebuilt(NODE)
            response = await asyncio.wait_for(admitting, 30)
            assert response.envs["GPUSLICE_POD_UID"] == "survivor"


async def test_a_redis_outage_at_start_does_not_stop_the_agent(
    make_settings: Callable[..., DevicePluginSettings],
    own_redis: RedisServer,
    kubelet: DevKubelet,
    bus: Bus,
) -> None:
    own_redis.kill()
    settings = make_settings(redis_url=own_redis.url)
    async with running(settings, bus=bus, serve_http=False, timing=FAST) as state:
        plugin = await kubelet.registration()
        assert len(await plugin.list_after(0)) == 8  # devices come from the node, not Redis
        await asyncio.to_thread(own_redis.start)
        ledger = Ledger.from_settings(settings)
        try:
            await ledger.register_node(state.agent.inventory(), rebuilt=True)
            await bind(ledger, placement("late", [[(uuids(state)[1], 100, 5)]]))
        finally:
            await ledger.close()
        response = await plugin.admit_container(1)
    assert response.envs["GPUSLICE_POD_UID"] == "late"


async def test_the_agent_serves_kubelet_while_nats_is_down_and_connects_later(
    agent_process: Callable[..., subprocess.Popen[str]],
    own_nats: NatsServer,
    kubelet: DevKubelet,
    prefix: str,
) -> None:
    own_nats.kill()
    proc = agent_process(
        GPUSLICE_NATS_URL=own_nats.url, GPUSLICE_CONNECT_WAIT="1s", GPUSLICE_NODE_NAME="late-bus"
    )
    plugin = await kubelet.registration(timeout=30)
    assert len(await plugin.list_after(0)) == 10  # kubelet is served without the bus
    await asyncio.to_thread(own_nats.start)
    listener = await Bus.connect(
        DevicePluginSettings(node_name="late-bus", nats_url=own_nats.url, subject_prefix=prefix),
        "test",
    )
    got: asyncio.Queue[NodeInventory] = asyncio.Queue()

    async def on_inventory(_subject: str, inv: NodeInventory) -> None:
        await got.put(inv)

    try:
        await listener.subscribe(
            listener.subjects.inventory("late-bus"), NodeInventory, on_inventory
        )
        await listener.nc.flush()
        inv = await asyncio.wait_for(got.get(), 20)  # the agent retries every 5 s
    finally:
        await listener.close()
    assert inv.node == "late-bus"
    assert proc.poll() is None


def test_generated_api_matches_the_proto(tmp_path: Path) -> None:
    work = tmp_path / "gen"
    shutil.copytree(API.parent.parent, work, ignore=shutil.ignore_patterns("__pycache__"))
    for generated in (work / "gpuslice_deviceplugin" / "api").glob("*_pb2*"):
        generated.unlink()
    bin_dir = Path(sys.executable).parent
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-I",
            ".",
            "--python_out=.",
            "--grpc_python_out=.",
            "--mypy_out=.",
            "--mypy_grpc_out=.",
            "gpuslice_deviceplugin/api/deviceplugin.proto",
        ],
        cwd=work,
        env={**os.environ, "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}"},
        check=True,
        capture_output=True,
    )
    names = sorted(p.name for p in API.glob("*_pb2*"))
    assert len(names) == 4
    match, mismatch, errors = filecmp.cmpfiles(
        API, work / "gpuslice_deviceplugin" / "api", names, shallow=False
    )
    assert (mismatch, errors) == ([], []), "run `make proto` and commit the result"
    assert match == names
