"""The agent rides out Redis, NATS and inventory restarts and lost replies; its
generated API stays in step with the .proto."""

from __future__ import annotations

import asyncio
import filecmp
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from nats.aio.msg import Msg

from gpuslice_cli.dev.kubelet import DevKubelet
from gpuslice_common.bus import Bus
from gpuslice_common.config import DevicePluginSettings
from gpuslice_common.ledger import Ledger
from gpuslice_common.models import NodeInventory, PlacementState
from gpuslice_common.nodeapi import AllocationReply, ErrorKind, ErrorReply
from gpuslice_common.servers import NatsServer, RedisServer
from gpuslice_common.subjects import Subjects
from gpuslice_deviceplugin.service import connect_bus, running
from gpuslice_inventory.gateway import NodeGateway
from tests.deviceplugin.conftest import FAST, NODE, an_inventory, bind, placement, uuids

ROOT = Path(__file__).resolve().parents[2]
API = ROOT / "services" / "deviceplugin" / "gpuslice_deviceplugin" / "api"


async def test_an_allocate_during_a_redis_restart_is_answered_when_redis_is_back(
    make_settings: Callable[..., DevicePluginSettings],
    own_redis: RedisServer,
    nats_server: NatsServer,
    prefix: str,
    kubelet: DevKubelet,
    bus: Bus,
) -> None:
    settings = make_settings()
    ledger = Ledger.from_url(own_redis.url, prefix)
    try:
        async with (
            an_inventory(nats_server.url, own_redis.url, prefix),
            running(settings, bus=bus, serve_http=False, timing=FAST) as state,
        ):
            await ledger.register_node(state.agent.inventory(), rebuilt=True)
            await bind(ledger, placement("through", [[(uuids(state)[0], 100, 5)]]))
            plugin = await kubelet.registration()
            await plugin.list_after(0)
            own_redis.kill()
            admitting = asyncio.create_task(plugin.admit_container(1))
            await asyncio.sleep(0.5)
            assert not admitting.done()
            await asyncio.to_thread(own_redis.start)
            response = await asyncio.wait_for(admitting, 30)
    finally:
        await ledger.close()
    assert response.envs["GPUSLICE_POD_UID"] == "through"


async def test_the_heartbeat_comes_back_after_a_nats_restart(
    make_settings: Callable[..., DevicePluginSettings],
    own_nats: NatsServer,
    kubelet: DevKubelet,
    prefix: str,
) -> None:
    settings = make_settings(nats_url=own_nats.url, inventory_interval="200ms")
    agent_bus = await connect_bus(settings)
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
                await listener.flush()
                inv = await asyncio.wait_for(got.get(), 10)
            finally:
                await listener.close()
    finally:
        await agent_bus.close()
    assert inv.node == NODE
    assert len(inv.devices) == 2


async def test_an_allocate_before_any_inventory_answers_waits_for_one(
    settings: DevicePluginSettings,
    nats_server: NatsServer,
    redis_url: str,
    prefix: str,
    plugin_ledger: Ledger,
    kubelet: DevKubelet,
    bus: Bus,
) -> None:
    async with running(settings, bus=bus, serve_http=False, timing=FAST) as state:
        plugin = await kubelet.registration()
        assert len(await plugin.list_after(0)) == 8  # devices come from the node, not the ledger
        await plugin_ledger.register_node(state.agent.inventory(), rebuilt=True)
        await bind(plugin_ledger, placement("late", [[(uuids(state)[1], 100, 5)]]))
        admitting = asyncio.create_task(plugin.admit_container(1))
        await asyncio.sleep(0.5)  # no inventory listens: asked again and again
        assert not admitting.done()
        async with an_inventory(nats_server.url, redis_url, prefix):
            response = await asyncio.wait_for(admitting, 15)
    assert response.envs["GPUSLICE_POD_UID"] == "late"


async def test_a_reply_lost_after_the_ledger_took_the_container_is_asked_again_to_the_same_answer(
    settings: DevicePluginSettings,
    nats_server: NatsServer,
    redis_url: str,
    prefix: str,
    plugin_ledger: Ledger,
    kubelet: DevKubelet,
    bus: Bus,
) -> None:
    """An inventory replica that dies between the ledger's allocation and its reply:
    the agent asks again with the same request id and gets the same container, not
    the pod's next one."""
    subjects = Subjects(prefix)
    dying = NodeGateway(plugin_ledger, subjects)
    took: asyncio.Queue[AllocationReply] = asyncio.Queue()

    async def answer_then_die(msg: Msg) -> None:
        await sub.unsubscribe()  # the replica is gone: no reply is ever sent
        reply = await dying.answer(msg.subject, msg.data)
        assert isinstance(reply, AllocationReply)
        await took.put(reply)

    async with running(settings, bus=bus, serve_http=False, timing=FAST) as state:
        plugin = await kubelet.registration()
        await plugin.list_after(0)
        await plugin_ledger.register_node(state.agent.inventory(), rebuilt=True)
        gpu = uuids(state)[0]
        await bind(plugin_ledger, placement("pod", [[(gpu, 100, 5)], [(gpu, 100, 5)]]))
        sub = await bus.nc.subscribe(
            subjects.node_request(NODE, "allocate"), queue=f"{prefix}-inventory", cb=answer_then_die
        )
        await bus.flush()
        admitting = asyncio.create_task(plugin.admit_container(1))
        lost = await asyncio.wait_for(took.get(), 10)
        assert lost.container_index == 0
        async with an_inventory(nats_server.url, redis_url, prefix):
            response = await asyncio.wait_for(admitting, 15)
    assert response.envs["GPUSLICE_CONTAINER_NAME"] == "c0"
    pod = await plugin_ledger.placement("pod")
    assert pod is not None
    assert pod.state == PlacementState.BOUND  # its second container not handed out by the retry


async def test_rebuilding_answers_are_waited_out(
    settings: DevicePluginSettings,
    prefix: str,
    plugin_ledger: Ledger,
    kubelet: DevKubelet,
    bus: Bus,
) -> None:
    """An inventory whose ledger for the node is being rebuilt says so; the agent
    asks again until the answer is an allocation."""
    subjects = Subjects(prefix)
    gateway = NodeGateway(plugin_ledger, subjects)
    asked: list[str] = []

    async def rebuilding_twice(msg: Msg) -> None:
        asked.append(msg.subject)
        if len(asked) <= 2:
            busy = ErrorReply(error=ErrorKind.REBUILDING, message="node-a is being rebuilt")
            await msg.respond(busy.model_dump_json().encode())
            return
        reply = await gateway.answer(msg.subject, msg.data)
        await msg.respond(reply.model_dump_json().encode())

    async with running(settings, bus=bus, serve_http=False, timing=FAST) as state:
        plugin = await kubelet.registration()
        await plugin.list_after(0)
        await plugin_ledger.register_node(state.agent.inventory(), rebuilt=True)
        await bind(plugin_ledger, placement("rebuilt", [[(uuids(state)[0], 100, 5)]]))
        await bus.nc.subscribe(subjects.node_request(NODE, "allocate"), cb=rebuilding_twice)
        await bus.flush()
        response = await asyncio.wait_for(plugin.admit_container(1), 15)
    assert response.envs["GPUSLICE_POD_UID"] == "rebuilt"
    assert len(asked) == 3


async def test_an_allocate_while_the_node_is_being_rebuilt_waits_for_it(
    make_settings: Callable[..., DevicePluginSettings],
    nats_server: NatsServer,
    prefix: str,
    tmp_path: Path,
    kubelet: DevKubelet,
    bus: Bus,
) -> None:
    """Redis restarts empty; the pod's placement is restored, but until the node is
    stamped rebuilt no choice among its bound pods is safe: the real inventory
    answers "rebuilding" and Allocate waits. (An inventory without the Kubernetes
    API stamps a node when it registers it: the agent's next heartbeat is kept
    beyond the test.)"""
    settings = make_settings(inventory_interval="1h")
    server = RedisServer(tmp_path / "redis", persist=False)
    with server:
        ledger = Ledger.from_url(server.url, prefix)
        try:
            async with (
                an_inventory(nats_server.url, server.url, prefix),
                running(settings, bus=bus, serve_http=False, timing=FAST) as state,
            ):
                plugin = await kubelet.registration()
                await plugin.list_after(0)
                # the agent's first inventory is in the ledger (stamped) before Redis
                # restarts: arriving after, it would stamp the new, empty ledger
                for _ in range(300):
                    if NODE in await ledger.nodes():
                        break
                    await asyncio.sleep(0.1)
                assert NODE in await ledger.nodes()
                await asyncio.to_thread(server.kill)
                await asyncio.to_thread(server.start)
                await ledger.register_node(state.agent.inventory())  # not stamped
                record = placement("survivor", [[(uuids(state)[0], 100, 5)]])
                await ledger.restore(record, running=False)
                admitting = asyncio.create_task(plugin.admit_container(1))
                await asyncio.sleep(1)  # kubelet's call arrives while the node is rebuilt
                assert not admitting.done()
                assert await ledger.mark_rebuilt(NODE)
                response = await asyncio.wait_for(admitting, 30)
                assert response.envs["GPUSLICE_POD_UID"] == "survivor"
        finally:
            await ledger.close()


async def test_an_allocate_the_inventory_never_answers_is_refused_at_its_deadline(
    make_settings: Callable[..., DevicePluginSettings],
    kubelet: DevKubelet,
    bus: Bus,
) -> None:
    settings = make_settings(allocate_timeout="1s", inventory_timeout="200ms")
    async with running(settings, bus=bus, serve_http=False, timing=FAST):
        plugin = await kubelet.registration()
        await plugin.list_after(0)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await asyncio.wait_for(plugin.admit_container(1), 15)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "inventory unavailable: no inventory is listening" in str(err.value.details())


async def test_an_inventory_restart_between_allocates_loses_nothing(
    settings: DevicePluginSettings,
    nats_server: NatsServer,
    redis_url: str,
    prefix: str,
    plugin_ledger: Ledger,
    kubelet: DevKubelet,
    bus: Bus,
) -> None:
    async with running(settings, bus=bus, serve_http=False, timing=FAST) as state:
        plugin = await kubelet.registration()
        await plugin.list_after(0)
        await plugin_ledger.register_node(state.agent.inventory(), rebuilt=True)
        gpu = uuids(state)[0]
        await bind(plugin_ledger, placement("p", [[(gpu, 100, 5)]] * 4))  # four containers
        served = []
        async with an_inventory(nats_server.url, redis_url, prefix):
            for _ in range(2):
                served.append((await plugin.admit_container(1)).envs["GPUSLICE_CONTAINER_NAME"])
        admitting = asyncio.create_task(plugin.admit_container(1))
        await asyncio.sleep(0.3)
        async with an_inventory(nats_server.url, redis_url, prefix):
            response = await asyncio.wait_for(admitting, 15)
            served.append(response.envs["GPUSLICE_CONTAINER_NAME"])
            served.append((await plugin.admit_container(1)).envs["GPUSLICE_CONTAINER_NAME"])
    assert served == ["c0", "c1", "c2", "c3"]
    record = await plugin_ledger.placement("p")
    assert record is not None
    assert record.state == PlacementState.ALLOCATED


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
    plugin = await kubelet.registration(timeout=90)
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
        await listener.flush()
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
