"""The device plugin against the test kubelet, with real Redis, NATS and gRPC."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from nats.aio.msg import Msg

from gpuslice_cli.dev.kubelet import DevKubelet, Plugin
from gpuslice_common.bus import Bus
from gpuslice_common.config import DevicePluginSettings
from gpuslice_common.events import AllocationEvent, CloudEvent, EventType, parse_event
from gpuslice_common.grant import Grant, GrantDevice
from gpuslice_common.grant import parse as parse_grant
from gpuslice_common.kube import LocalKubeApi
from gpuslice_common.ledger import Ledger
from gpuslice_common.models import NodeInventory, PlacementState
from gpuslice_common.nodeapi import MAX_DEVICES
from gpuslice_common.region import Region
from gpuslice_common.servers import NatsServer
from gpuslice_deviceplugin.allocation import without_credentials
from gpuslice_deviceplugin.api import deviceplugin_pb2 as pb
from gpuslice_deviceplugin.containers import ContainerOwner
from gpuslice_deviceplugin.driverlimits import CardSupport
from gpuslice_deviceplugin.kubelet import KubeletLinkError
from gpuslice_deviceplugin.service import Running, running
from gpuslice_inventory.service import Running as InventoryRunning
from tests.deviceplugin.conftest import (
    FAST,
    MIB,
    NODE,
    SIMULATED,
    an_inventory,
    bind,
    placement,
    uuids,
)


def write(path: Path, text: str) -> None:
    path.write_text(text)


def read(path: Path) -> bytes:
    return path.read_bytes()


def is_socket(path: Path) -> bool:
    return path.is_socket()


def granted(directory: Path) -> Grant:
    """The grant the agent wrote into a container's directory."""
    return parse_grant((directory / "grant").read_text())


def region_devices(directory: Path) -> list[tuple[str, int, int]]:
    """(UUID, memory limit, SM limit) of each device of the region the agent made."""
    with Region.open(directory / "region") as r:
        return [(d.uuid, d.limit_bytes, d.sm_limit_percent) for d in r.devices()]


async def registered(kubelet: DevKubelet, number: int = 1) -> Plugin:
    plugin = await kubelet.registration(number)
    await plugin.list_after(0)
    return plugin


class Events:
    """alloc.* events as they arrive on the bus."""

    def __init__(self) -> None:
        self.seen: asyncio.Queue[CloudEvent] = asyncio.Queue()

    async def start(self, bus: Bus) -> None:
        async def on_msg(msg: object) -> None:
            await self.seen.put(parse_event(msg.data))  # type: ignore[attr-defined]

        await bus.nc.subscribe(f"{bus.subjects.prefix}.events.alloc.*", cb=on_msg)
        await bus.flush()

    async def next(self, timeout: float = 5.0) -> CloudEvent:
        return await asyncio.wait_for(self.seen.get(), timeout)


@pytest.fixture
async def events(bus: Bus) -> Events:
    e = Events()
    await e.start(bus)
    return e


# ----------------------------------------------------------------- handshake


async def test_handshake_registers_and_lists_every_replica(
    agent: Running, kubelet: DevKubelet
) -> None:
    plugin = await registered(kubelet)
    req = plugin.request
    assert (req.version, req.endpoint, req.resource_name) == (
        "v1beta1",
        "gpuslice.sock",
        "nvidia.com/gpu",
    )
    assert req.options.get_preferred_allocation_available
    assert plugin.options is not None
    assert plugin.options.get_preferred_allocation_available
    devices = plugin.devices
    gpus = uuids(agent)
    assert len(gpus) == 2
    assert len(devices) == 2 * 4  # deviceSplitCount 4
    assert {d.ID for d in devices} == {f"{u}::{n}" for u in gpus for n in range(4)}
    assert all(len(d.ID) <= 63 and d.health == "Healthy" for d in devices)
    numa = {d.ID.split("::")[0]: [n.ID for n in d.topology.nodes] for d in devices}
    assert numa == {gpus[0]: [0], gpus[1]: [1]}
    assert kubelet.refusals == []


async def test_health_change_resends_the_full_list_and_inventory(
    agent: Running, kubelet: DevKubelet, node_config: Path, bus: Bus
) -> None:
    plugin = await registered(kubelet)
    inventories: asyncio.Queue[NodeInventory] = asyncio.Queue()

    async def on_inventory(_subject: str, inv: NodeInventory) -> None:
        await inventories.put(inv)

    await bus.subscribe(bus.subjects.inventory(NODE), NodeInventory, on_inventory)
    await bus.flush()
    seen = len(plugin.lists)
    write(node_config, SIMULATED.replace("numaNodes: 2}", "numaNodes: 2, unhealthy: [1]}"))
    devices = await plugin.list_after(seen, timeout=5)
    sick = uuids(agent)[1]
    assert len(devices) == 8  # the full list, not a delta
    assert {d.ID for d in devices if d.health == "Unhealthy"} == {f"{sick}::{n}" for n in range(4)}
    inv = await asyncio.wait_for(inventories.get(), 5)
    assert [(d.uuid, d.healthy) for d in inv.devices] == [(uuids(agent)[0], True), (sick, False)]
    assert inv.split_count == 4


async def test_a_bad_config_edit_keeps_the_last_good_one(
    agent: Running, kubelet: DevKubelet, node_config: Path
) -> None:
    plugin = await registered(kubelet)
    write(node_config, "defaults: {deviceSplitCount: zero}\n")
    await asyncio.sleep(0.5)
    assert agent.agent.config.split_count == 4
    assert len(plugin.lists) == 1
    assert len(plugin.devices) == 8
    write(node_config, "defaults: {deviceSplitCount: 2, simulate: {count: 2}}\n")
    devices = await plugin.list_after(1, timeout=5)
    assert len(devices) == 4


async def test_kubelet_restart_means_registering_again(
    agent: Running, kubelet: DevKubelet, plugin_ledger: Ledger
) -> None:
    await registered(kubelet)
    await kubelet.restart()  # deletes every socket, ours included
    again = await registered(kubelet, 2)
    assert len(again.devices) == 8
    assert is_socket(Path(agent.settings.kubelet_dir) / "gpuslice.sock")
    await bind(plugin_ledger, placement("after-restart", [[(uuids(agent)[0], 1000, 10)]]))
    response = await again.admit_container(1)
    assert response.envs["GPUSLICE_POD_UID"] == "after-restart"


async def test_our_socket_deleted_alone_means_registering_again(
    agent: Running, kubelet: DevKubelet
) -> None:
    await registered(kubelet)
    os.unlink(Path(agent.settings.kubelet_dir) / "gpuslice.sock")
    again = await registered(kubelet, 2)
    assert len(again.devices) == 8


async def test_agent_waits_for_kubelet_then_registers(
    settings: DevicePluginSettings, short_dir: Path, bus: Bus
) -> None:
    async with running(settings, bus=bus, serve_http=False, timing=FAST) as state:
        await asyncio.sleep(0.3)  # no kubelet.sock yet
        assert not state.link.registered.is_set()
        kubelet = DevKubelet(short_dir / "kubelet")
        await kubelet.start()
        try:
            await registered(kubelet)
            await asyncio.wait_for(state.link.registered.wait(), 5)
        finally:
            await kubelet.stop()


async def test_registration_refused_gives_up_after_bounded_retries(
    make_settings: Callable[..., DevicePluginSettings], kubelet: DevKubelet, bus: Bus
) -> None:
    settings = make_settings(requests={"resources": {"gpu": "gpu"}})  # not domain-qualified
    async with running(settings, bus=bus, serve_http=False, timing=FAST) as state:
        link = state.tasks[0]
        with pytest.raises(KubeletLinkError, match=r"4 times in a row.*not domain-qualified"):
            await asyncio.wait_for(link, 10)
    assert len(kubelet.refusals) == 4


# ------------------------------------------------------------------ Allocate


async def test_allocate_gives_the_toolkit_hook_the_grant_where_the_driver_limits_memory(
    agent: Running, kubelet: DevKubelet, plugin_ledger: Ledger
) -> None:
    plugin = await registered(kubelet)
    first, second = uuids(agent)[:2]
    # simulated cards: no driver limits, so no hook variable
    assert not agent.agent.driver_support[first].supported
    await bind(plugin_ledger, placement("p0", [[(first, 1024, 10)]]))
    assert "NVIDIA_GPU_MEMORY_LIMIT" not in dict((await plugin.admit_container(1)).envs)
    agent.agent.driver_support = {
        first: CardSupport(True, "driver"),
        second: CardSupport(False, "MIG mode"),
    }
    await bind(plugin_ledger, placement("p1", [[(first, 4096, 30)]]))
    env = dict((await plugin.admit_container(1)).envs)
    assert env["NVIDIA_GPU_MEMORY_LIMIT"] == str(4096 * MIB)  # decimal bytes
    assert "NVIDIA_GPU_MEMORY_REQUEST" not in env
    # one card of the container without driver limits: the agent sets them, not the hook
    await bind(plugin_ledger, placement("p2", [[(first, 1024, 10), (second, 1024, 10)]]))
    assert "NVIDIA_GPU_MEMORY_LIMIT" not in dict((await plugin.admit_container(2)).envs)


async def test_allocate_one_gpu_answers_env_and_mounts(
    agent: Running, kubelet: DevKubelet, events: Events, plugin_ledger: Ledger
) -> None:
    plugin = await registered(kubelet)
    gpu = uuids(agent)[1]
    await bind(plugin_ledger, placement("p1", [[(gpu, 4096, 30)]]))
    response = await plugin.admit_container(1)
    env = dict(response.envs)
    host = agent.host
    assert env["NVIDIA_VISIBLE_DEVICES"] == gpu
    assert env["CUDA_DEVICE_MEMORY_LIMIT_0"] == "4096m"
    assert env["CUDA_DEVICE_SM_LIMIT"] == "30"
    assert env["CUDA_DEVICE_MEMORY_SHARED_CACHE"] == "/run/gpuslice/region"
    assert env["CUDA_TASK_PRIORITY"] == "1"
    assert env["GPU_CORE_UTILIZATION_POLICY"] == "default"
    assert (env["GPUSLICE_NODE_NAME"], env["GPUSLICE_POD_UID"]) == (NODE, "p1")
    assert (env["GPUSLICE_POD_NAMESPACE"], env["GPUSLICE_POD_NAME"]) == ("team", "pod-p1")
    assert env["GPUSLICE_CONTAINER_NAME"] == "c0"
    assert env["GPUSLICE_NATS_URL"] == agent.settings.nats_url
    assert env["GPUSLICE_SUBJECT_PREFIX"] == agent.settings.subject_prefix
    assert not any(k.startswith("GPUSLICE_NATS_") and k != "GPUSLICE_NATS_URL" for k in env)
    mounts = {m.container_path: (m.host_path, m.read_only) for m in response.mounts}
    region_dir = host.container_dir("p1", "c0")
    # the container sees its directory read-only, and only the region writable
    assert mounts == {
        "/usr/local/gpuslice/libgpuslice.so": (str(host.lib_path), True),
        "/etc/ld.so.preload": (str(host.preload_path), True),
        "/run/gpuslice": (str(region_dir), True),
        "/run/gpuslice/region": (str(region_dir / "region"), False),
    }
    order = [m.container_path for m in response.mounts]
    assert order.index("/run/gpuslice") < order.index("/run/gpuslice/region")
    # the limits are the grant's, written before the answer: the ledger's, and the
    # node configuration's policy and (default) context overhead
    assert granted(region_dir) == Grant(
        node=NODE,
        pod_uid="p1",
        container="c0",
        policy="default",
        priority=1,
        control_optional=False,
        context_overhead_bytes=384 * MIB,
        devices=(GrantDevice(uuid=gpu, memory_bytes=4096 * MIB, sm_percent=30),),
    )
    assert region_devices(region_dir) == [(gpu, 4096 * MIB, 30)]
    assert read(host.lib_path) == read(Path(agent.settings.interposer_library))
    assert read(host.preload_path) == b"/usr/local/gpuslice/libgpuslice.so\n"
    owner = ContainerOwner.from_json(read(region_dir / "owner.json"))
    assert (owner.pod_uid, owner.container, owner.devices) == ("p1", "c0", (gpu,))
    event = await events.next()
    assert event.type == EventType.ALLOC_ALLOCATED
    payload = event.payload()
    assert isinstance(payload, AllocationEvent)
    assert payload.pod is not None
    assert payload.pod.uid == "p1"
    assert (payload.node, payload.container, payload.policy) == (NODE, "c0", "binpack")
    assert [d.uuid for d in payload.containers[0].devices] == [gpu]
    record = await plugin_ledger.placement("p1")
    assert record is not None
    assert record.state == PlacementState.ALLOCATED


async def test_allocate_two_gpus_prefers_the_scheduler_s_cards(
    agent: Running, kubelet: DevKubelet, plugin_ledger: Ledger
) -> None:
    plugin = await registered(kubelet)
    a, b = uuids(agent)
    await bind(plugin_ledger, placement("p2", [[(b, 1000, 20), (a, 2000, 50)]]))
    response = await plugin.admit_container(2)
    env = dict(response.envs)
    assert env["NVIDIA_VISIBLE_DEVICES"] == f"{b},{a}"
    assert (env["CUDA_DEVICE_MEMORY_LIMIT_0"], env["CUDA_DEVICE_MEMORY_LIMIT_1"]) == (
        "1000m",
        "2000m",
    )
    assert (env["CUDA_DEVICE_SM_LIMIT_0"], env["CUDA_DEVICE_SM_LIMIT_1"]) == ("20", "50")
    assert "CUDA_DEVICE_SM_LIMIT" not in env
    directory = agent.host.container_dir("p2", "c0")
    assert granted(directory).devices == (  # in the container's order, as the environment
        GrantDevice(uuid=b, memory_bytes=1000 * MIB, sm_percent=20),
        GrantDevice(uuid=a, memory_bytes=2000 * MIB, sm_percent=50),
    )
    assert region_devices(directory) == [(b, 1000 * MIB, 20), (a, 2000 * MIB, 50)]
    chosen = {i.split("::")[0] for i in plugin.allocated}
    assert chosen == {a, b}  # kubelet's replicas stand for the scheduler's two cards


async def test_multi_container_pods_are_served_in_bind_order(
    agent: Running, kubelet: DevKubelet, plugin_ledger: Ledger
) -> None:
    plugin = await registered(kubelet)
    a, b = uuids(agent)
    await bind(
        plugin_ledger,
        placement("first", [[(a, 100, 10)], [(a, 200, 10), (b, 300, 10)]], init=[[(b, 50, 5)]]),
    )
    answers = [await plugin.admit_container(n) for n in (1, 1, 2)]
    await bind(plugin_ledger, placement("second", [[(b, 400, 10)]]))  # the node's next turn
    answers.append(await plugin.admit_container(1))
    got = [
        (
            r.envs["GPUSLICE_POD_UID"],
            r.envs["GPUSLICE_CONTAINER_NAME"],
            r.envs["NVIDIA_VISIBLE_DEVICES"],
        )
        for r in answers
    ]
    assert got == [
        ("first", "init0", b),
        ("first", "c0", a),
        ("first", "c1", f"{a},{b}"),
        ("second", "c0", b),
    ]
    assert (await plugin_ledger.placement("first")).state == PlacementState.ALLOCATED  # type: ignore[union-attr]


async def test_allocate_without_a_pending_pod_is_a_clear_error(
    agent: Running, kubelet: DevKubelet, events: Events
) -> None:
    plugin = await registered(kubelet)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await plugin.admit_container(1)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"no bound pod on node {NODE} waits for a container with 1 GPU(s)" in str(
        err.value.details()
    )
    event = await events.next()
    assert event.type == EventType.ALLOC_FAILED
    payload = event.payload()
    assert isinstance(payload, AllocationEvent)
    assert payload.pod is None
    assert payload.node == NODE
    assert "no pending pod" in payload.reason


async def test_a_count_mismatch_is_refused_and_the_pod_keeps_waiting(
    agent: Running, kubelet: DevKubelet, plugin_ledger: Ledger
) -> None:
    plugin = await registered(kubelet)
    a, b = uuids(agent)
    await bind(plugin_ledger, placement("two", [[(a, 100, 10), (b, 100, 10)]]))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await plugin.admit_container(1)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    plugin.allocated.clear()
    response = await plugin.admit_container(2)
    assert response.envs["GPUSLICE_POD_UID"] == "two"


async def test_concurrent_allocates_hand_out_each_container_once(
    agent: Running, kubelet: DevKubelet, plugin_ledger: Ledger
) -> None:
    plugin = await registered(kubelet)
    a, b = uuids(agent)
    pod = placement("pod", [[(a if i % 2 else b, 100, 5)] for i in range(8)])
    await bind(plugin_ledger, pod)
    ids = plugin.free()
    calls = [
        plugin.stub.Allocate(
            pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=[i])])
        )
        for i in ids[:8]
    ]
    responses = await asyncio.gather(*calls)
    served = sorted(r.container_responses[0].envs["GPUSLICE_CONTAINER_NAME"] for r in responses)
    assert served == sorted(c.name for c in pod.containers)


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (pb.AllocateRequest(), "one container per call, got 0"),
        (
            pb.AllocateRequest(
                container_requests=[pb.ContainerAllocateRequest(), pb.ContainerAllocateRequest()]
            ),
            "one container per call, got 2",
        ),
        (
            pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest()]),
            "names no device IDs",
        ),
        (
            pb.AllocateRequest(
                container_requests=[pb.ContainerAllocateRequest(devices_ids=["GPU-nope::0"])]
            ),
            "unknown device IDs: GPU-nope::0",
        ),
    ],
)
async def test_malformed_allocates_are_refused_and_nothing_is_handed_out(
    agent: Running,
    kubelet: DevKubelet,
    request_: pb.AllocateRequest,
    message: str,
    plugin_ledger: Ledger,
) -> None:
    plugin = await registered(kubelet)
    await bind(plugin_ledger, placement("waiting", [[(uuids(agent)[0], 100, 5)]]))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await plugin.stub.Allocate(request_)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in str(err.value.details())
    record = await plugin_ledger.placement("waiting")
    assert record is not None
    assert record.state == PlacementState.BOUND
    assert (await plugin.admit_container(1)).envs["GPUSLICE_POD_UID"] == "waiting"


async def call_raw(plugin: Plugin, method: str, data: bytes) -> None:
    """Call ``method`` with ``data`` as the request's bytes, whatever they are."""
    path = f"/v1beta1.DevicePlugin/{method}"
    if method == "ListAndWatch":
        stream = plugin.channel.unary_stream(
            path, request_serializer=lambda b: b, response_deserializer=lambda b: b
        )
        await stream(data).read()
        return
    unary = plugin.channel.unary_unary(
        path, request_serializer=lambda b: b, response_deserializer=lambda b: b
    )
    await unary(data)


async def test_repeated_ids_and_garbage_bytes_leave_the_plugin_serving(
    agent: Running, kubelet: DevKubelet, caplog: pytest.LogCaptureFixture
) -> None:
    plugin = await registered(kubelet)
    one = plugin.free()[0]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await plugin.stub.Allocate(
            pb.AllocateRequest(
                container_requests=[pb.ContainerAllocateRequest(devices_ids=[one, one])]
            )
        )
    assert "device IDs repeat" in str(err.value.details())
    raw = plugin.channel.unary_unary(
        "/v1beta1.DevicePlugin/Allocate",
        request_serializer=lambda b: b,
        response_deserializer=lambda b: b,
    )
    caplog.set_level(logging.DEBUG)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await raw(b"\xff\xff\xff\xff not protobuf")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid v1beta1.AllocateRequest" in str(err.value.details())
    # every method is guarded, streams too
    for method in ("GetPreferredAllocation", "ListAndWatch"):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call_raw(plugin, method, b"\x0a\xff")  # a length past the end
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not a valid v1beta1." in str(err.value.details())
    options = await plugin.stub.GetDevicePluginOptions(pb.Empty())
    assert options.get_preferred_allocation_available
    refusals = [r for r in caplog.records if "not a valid" in r.getMessage()]
    assert len(refusals) == 3
    assert all("\n" not in r.getMessage() for r in refusals)
    assert not any(r.exc_info for r in caplog.records)
    assert "Traceback" not in caplog.text


async def test_preferred_allocation_honours_must_include(
    agent: Running, kubelet: DevKubelet, plugin_ledger: Ledger
) -> None:
    plugin = await registered(kubelet)
    a, b = uuids(agent)
    await bind(plugin_ledger, placement("pref", [[(a, 100, 5), (b, 100, 5)]]))
    free = plugin.free()
    forced = f"{b}::3"
    reply = await plugin.stub.GetPreferredAllocation(
        pb.PreferredAllocationRequest(
            container_requests=[
                pb.ContainerPreferredAllocationRequest(
                    available_deviceIDs=free, must_include_deviceIDs=[forced], allocation_size=2
                )
            ]
        )
    )
    ids = list(reply.container_responses[0].deviceIDs)
    assert ids[0] == forced
    assert {i.split("::")[0] for i in ids} == {a, b}


def test_the_agent_s_own_nats_credentials_never_reach_a_container() -> None:
    urls = "nats://agent:pw@10.0.0.1:4222, tls://a:b@nats.example:4443,nats://plain:4222"
    assert without_credentials(urls) == (
        "nats://10.0.0.1:4222,tls://nats.example:4443,nats://plain:4222"
    )


async def test_disable_control_leaves_the_preload_out(
    settings: DevicePluginSettings,
    kubelet: DevKubelet,
    bus: Bus,
    plugin_ledger: Ledger,
    inventory: InventoryRunning,
) -> None:
    kube = LocalKubeApi()
    pod = {
        "metadata": {"name": "pod-dbg", "namespace": "team", "uid": "dbg"},
        "spec": {
            "containers": [
                {"name": "c0", "env": [{"name": "CUDA_DISABLE_CONTROL", "value": "true"}]},
            ]
        },
    }
    kube.add_pod(pod)
    async with running(settings, bus=bus, kube=kube, serve_http=False, timing=FAST) as state:
        await plugin_ledger.register_node(state.agent.inventory(), rebuilt=True)
        plugin = await registered(kubelet)
        await bind(plugin_ledger, placement("dbg", [[(uuids(state)[0], 100, 5)]]))
        debug = await plugin.admit_container(1)
        await bind(plugin_ledger, placement("ctl", [[(uuids(state)[0], 100, 5)]]))
        normal = await plugin.admit_container(1)  # pod 'ctl' is not known to the API: enforced
        host = state.host
    assert "/etc/ld.so.preload" not in {m.container_path for m in debug.mounts}
    assert "/etc/ld.so.preload" in {m.container_path for m in normal.mounts}
    # only the pod that asked may turn the interposer off: its grant says so
    assert granted(host.container_dir("dbg", "c0")).control_optional is True
    assert granted(host.container_dir("ctl", "c0")).control_optional is False


async def test_telemetry_credential_and_context_overhead_reach_the_container(
    make_settings: Callable[..., DevicePluginSettings],
    kubelet: DevKubelet,
    bus: Bus,
    node_config: Path,
    plugin_ledger: Ledger,
    inventory: InventoryRunning,
) -> None:
    write(node_config, SIMULATED_WITH_OVERHEAD)
    settings = make_settings(telemetry_nats_url="nats://nats.gpuslice:4222")
    async with running(settings, bus=bus, serve_http=False, timing=FAST) as state:
        await plugin_ledger.register_node(state.agent.inventory(), rebuilt=True)
        plugin = await registered(kubelet)
        await bind(plugin_ledger, placement("cred", [[(uuids(state)[0], 100, 5)]], priority=0))
        env = dict((await plugin.admit_container(1)).envs)
        grant = granted(state.host.container_dir("cred", "c0"))
    assert (grant.policy, grant.priority, grant.context_overhead_bytes) == ("force", 0, 300 * MIB)
    assert env["GPUSLICE_NATS_URL"] == "nats://nats.gpuslice:4222"
    # no token issued (no auth callout): the container gets no credential at all
    assert not {"GPUSLICE_NATS_USER", "GPUSLICE_NATS_PASSWORD", "GPUSLICE_NATS_TOKEN"} & set(env)
    assert env["GPUSLICE_CONTEXT_OVERHEAD"] == "300m"
    assert env["GPU_CORE_UTILIZATION_POLICY"] == "force"
    assert env["LIBCUDA_LOG_LEVEL"] == "3"
    assert env["CUDA_TASK_PRIORITY"] == "0"


SIMULATED_WITH_OVERHEAD = """
defaults:
  deviceSplitCount: 4
  contextOverhead: 300
  gpuCorePolicy: force
  libCudaLogLevel: 3
  simulate: {count: 1}
"""


async def test_a_token_the_inventory_issues_is_the_container_s_only_credential(
    make_settings: Callable[..., DevicePluginSettings],
    kubelet: DevKubelet,
    bus: Bus,
    nats_server: NatsServer,
    redis_url: str,
    prefix: str,
    plugin_ledger: Ledger,
) -> None:
    settings = make_settings()

    def issue(node: str, pod_uid: str) -> str:
        return f"tok.{node}.{pod_uid}"

    async with (
        an_inventory(nats_server.url, redis_url, prefix, issue_telemetry_token=issue),
        running(settings, bus=bus, serve_http=False, timing=FAST) as state,
    ):
        await plugin_ledger.register_node(state.agent.inventory(), rebuilt=True)
        plugin = await registered(kubelet)
        await bind(plugin_ledger, placement("tok", [[(uuids(state)[0], 100, 5)]]))
        env = dict((await plugin.admit_container(1)).envs)
    assert env["GPUSLICE_NATS_TOKEN"] == f"tok.{NODE}.tok"
    assert "GPUSLICE_NATS_USER" not in env
    assert "GPUSLICE_NATS_PASSWORD" not in env


async def test_the_agent_publishes_nothing_but_its_inventory_and_asks_only_its_own_subjects(
    agent: Running, kubelet: DevKubelet, bus: Bus, plugin_ledger: Ledger
) -> None:
    """What the node's NATS credential must allow: inventory.<node> and node.<node>.>."""
    seen: list[str] = []

    async def on_msg(msg: Msg) -> None:
        seen.append(msg.subject)

    await bus.nc.subscribe(">", cb=on_msg)
    await bus.flush()
    plugin = await registered(kubelet)
    await bind(plugin_ledger, placement("watched", [[(uuids(agent)[0], 100, 5)]]))
    await plugin.admit_container(1)
    with pytest.raises(grpc.aio.AioRpcError):
        await plugin.admit_container(1)  # nothing waits: refused
    await agent.agent.publish_inventory()
    await agent.clean_up()
    await bus.flush()
    prefix = bus.subjects.prefix
    own = (f"{prefix}.inventory.{NODE}", f"{prefix}.node.{NODE}.")
    requests = [s for s in seen if not s.startswith(("_INBOX.", f"{prefix}.events."))]
    assert any(s.startswith(own[1]) for s in requests)
    assert own[0] in requests
    assert all(s == own[0] or s.startswith(own[1]) for s in requests), requests


def preferred_request(size: int, available: list[str]) -> pb.PreferredAllocationRequest:
    return pb.PreferredAllocationRequest(
        container_requests=[
            pb.ContainerPreferredAllocationRequest(
                available_deviceIDs=available, allocation_size=size
            )
        ]
    )


@pytest.mark.parametrize("size", [0, -1, MAX_DEVICES + 1, 2**31 - 1])
async def test_an_absurd_allocation_size_is_invalid_argument_in_one_line(
    agent: Running, kubelet: DevKubelet, caplog: pytest.LogCaptureFixture, size: int
) -> None:
    plugin = await registered(kubelet)
    caplog.set_level(logging.DEBUG)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await plugin.stub.GetPreferredAllocation(preferred_request(size, plugin.free()))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == f"allocation_size {size} is not between 1 and {MAX_DEVICES}"
    refusals = [r for r in caplog.records if "allocation_size" in r.getMessage()]
    assert len(refusals) == 1
    assert not any(r.exc_info for r in caplog.records)
    assert "Traceback" not in caplog.text
    # the plugin still answers a sound call
    reply = await plugin.stub.GetPreferredAllocation(preferred_request(1, plugin.free()))
    assert len(reply.container_responses[0].deviceIDs) == 1


async def test_more_devices_than_a_container_takes_is_invalid_argument_in_one_line(
    agent: Running,
    kubelet: DevKubelet,
    node_config: Path,
    caplog: pytest.LogCaptureFixture,
    plugin_ledger: Ledger,
) -> None:
    """65 replicas the node advertises, all known: refused before the inventory is
    asked (which takes at most 64), not an UNKNOWN with a traceback."""
    plugin = await registered(kubelet)
    write(node_config, SIMULATED.replace("deviceSplitCount: 4", "deviceSplitCount: 40"))
    devices = await plugin.list_after(1, timeout=5)
    assert len(devices) == 80
    await bind(plugin_ledger, placement("waiting", [[(uuids(agent)[0], 100, 5)]]))
    ids = [d.ID for d in devices][: MAX_DEVICES + 1]
    caplog.set_level(logging.DEBUG)
    allocate = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=ids)])
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await plugin.stub.Allocate(allocate)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == f"65 device IDs; a container takes at most {MAX_DEVICES}"
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await plugin.stub.GetPreferredAllocation(preferred_request(MAX_DEVICES + 1, ids))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert not any(r.exc_info for r in caplog.records)
    assert "Traceback" not in caplog.text
    record = await plugin_ledger.placement("waiting")
    assert record is not None
    assert record.state == PlacementState.BOUND  # nothing was handed out
