"""MPS nodes: their cards as the rest of the system sees them, and what Allocate answers
for them, through the test kubelet with real Redis, NATS and gRPC."""

from __future__ import annotations

import asyncio
import logging
import shutil
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from gpuslice_cli.dev.kubelet import DevKubelet, Plugin
from gpuslice_common.bus import Bus
from gpuslice_common.grant import GrantDevice
from gpuslice_common.grant import parse as parse_grant
from gpuslice_common.ledger import Ledger
from gpuslice_common.models import NodeInventory, VgpuMode
from gpuslice_deviceplugin.api import deviceplugin_pb2 as pb
from gpuslice_deviceplugin.service import Running
from gpuslice_inventory.service import Running as InventoryRunning
from tests.deviceplugin.conftest import MIB, NODE, bind, placement, uuids
from tests.native.probe import ProbeSpawner

# HAMi's variables for the interposer's limits: an MPS container's limits are not these
HAMI_LIMITS = ("CUDA_DEVICE_MEMORY_LIMIT", "CUDA_DEVICE_SM_LIMIT")


@pytest.fixture
def daemon_dirs(tmp_path: Path) -> tuple[Path, Path]:
    """Stand-ins for the MPS control daemon's pipe and shared memory directories."""
    pipe, shm = tmp_path / "mps" / "pipe", tmp_path / "mps" / "shm"
    pipe.mkdir(parents=True)
    shm.mkdir()
    return pipe, shm


def mps_config(pipe: Path, shm: Path, **extra: str) -> str:
    more = "".join(f"  {k}: {v}\n" for k, v in extra.items())
    return (
        "defaults:\n"
        "  operatingMode: mps\n"
        f"  mps: {{pipeDirectory: {pipe}, shmDirectory: {shm}}}\n"
        f"{more}"
    )


@pytest.fixture
def node_config(tmp_path: Path, daemon_dirs: tuple[Path, Path]) -> Path:
    """The conftest's simulated node, shared through MPS."""
    path = tmp_path / "nodes.yaml"
    path.write_text(
        mps_config(
            *daemon_dirs,
            deviceSplitCount="4",
            simulate="{count: 2, model: NVIDIA A100-SXM4-40GB, memoryMiB: 40960}",
        )
    )
    return path


async def registered(kubelet: DevKubelet) -> Plugin:
    plugin = await kubelet.registration(1)
    await plugin.list_after(0)
    return plugin


def mounts_of(response: pb.ContainerAllocateResponse) -> dict[str, tuple[str, bool]]:
    return {m.container_path: (m.host_path, m.read_only) for m in response.mounts}


async def test_cards_of_an_mps_node_are_reported_in_mps_mode(
    agent: Running, kubelet: DevKubelet, bus: Bus
) -> None:
    inventories: asyncio.Queue[NodeInventory] = asyncio.Queue()

    async def on_inventory(_subject: str, inv: NodeInventory) -> None:
        await inventories.put(inv)

    await bus.subscribe(bus.subjects.inventory(NODE), NodeInventory, on_inventory)
    await bus.flush()
    await registered(kubelet)
    await agent.agent.publish_inventory()  # the heartbeat, sent now
    inventory = await asyncio.wait_for(inventories.get(), 5)
    assert [(d.mode, d.healthy) for d in inventory.devices] == [(VgpuMode.MPS, True)] * 2


async def test_allocate_on_an_mps_card_gives_mps_limits_and_the_daemon_s_directories(
    agent: Running,
    kubelet: DevKubelet,
    plugin_ledger: Ledger,
    daemon_dirs: tuple[Path, Path],
) -> None:
    pipe, shm = daemon_dirs
    plugin = await registered(kubelet)
    gpu = uuids(agent)[1]
    await bind(plugin_ledger, placement("m1", [[(gpu, 4096, 30)]]))
    response = await plugin.admit_container(1)
    env = dict(response.envs)
    assert env["NVIDIA_VISIBLE_DEVICES"] == gpu
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == "/tmp/nvidia-mps"
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=4096M"
    assert not [k for k in env if k.startswith(HAMI_LIMITS)]
    host = agent.host
    region_dir = host.container_dir("m1", "c0")
    assert mounts_of(response) == {
        "/usr/local/gpuslice/libgpuslice.so": (str(host.lib_path), True),
        "/etc/ld.so.preload": (str(host.preload_path), True),
        "/run/gpuslice": (str(region_dir), True),
        "/run/gpuslice/region": (str(region_dir / "region"), False),
        # clients only connect there: no container may replace the daemon's sockets
        "/tmp/nvidia-mps": (str(pipe), True),
        "/dev/shm": (str(shm), False),
    }
    # the interposer keeps the memory limit, which the container cannot change;
    # the cores are MPS's to share, so the interposer does not throttle them too
    grant = parse_grant((region_dir / "grant").read_text())
    assert grant.devices == (GrantDevice(uuid=gpu, memory_bytes=4096 * MIB, sm_percent=0),)
    assert grant.control_optional is False


async def test_two_mps_cards_get_a_memory_limit_each_in_the_container_s_order(
    agent: Running, kubelet: DevKubelet, plugin_ledger: Ledger
) -> None:
    plugin = await registered(kubelet)
    a, b = uuids(agent)
    await bind(plugin_ledger, placement("m2", [[(b, 1000, 20), (a, 2000, 50)]]))
    response = await plugin.admit_container(2)
    env = dict(response.envs)
    assert env["NVIDIA_VISIBLE_DEVICES"] == f"{b},{a}"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=1000M,1=2000M"
    # one figure for all of a client's cards: the smaller share holds on both
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "20"
    assert not [k for k in env if k.startswith(HAMI_LIMITS)]
    grant = parse_grant((agent.host.container_dir("m2", "c0") / "grant").read_text())
    assert [(d.uuid, d.memory_bytes, d.sm_percent) for d in grant.devices] == [
        (b, 1000 * MIB, 0),
        (a, 2000 * MIB, 0),
    ]


async def test_no_core_share_sets_no_thread_percentage(
    agent: Running, kubelet: DevKubelet, plugin_ledger: Ledger
) -> None:
    plugin = await registered(kubelet)
    await bind(plugin_ledger, placement("m0", [[(uuids(agent)[0], 512, 0)]]))
    env = dict((await plugin.admit_container(1)).envs)
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in env  # up to the daemon's default
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=512M"


async def test_cards_are_unhealthy_while_the_daemon_s_pipe_directory_is_missing(
    agent: Running,
    kubelet: DevKubelet,
    daemon_dirs: tuple[Path, Path],
    caplog: pytest.LogCaptureFixture,
) -> None:
    pipe, _ = daemon_dirs
    plugin = await registered(kubelet)
    assert {d.health for d in plugin.devices} == {"Healthy"}
    seen = len(plugin.lists)
    with caplog.at_level(logging.INFO, logger="gpuslice_deviceplugin.mps"):
        shutil.rmtree(pipe)
        devices = await plugin.list_after(seen, timeout=5)
        assert len(devices) == 8
        assert {d.health for d in devices} == {"Unhealthy"}
        assert not any(d.healthy for d in agent.agent.inventory().devices)
        mine = [r for r in caplog.records if r.name == "gpuslice_deviceplugin.mps"]
        warnings = [r.getMessage() for r in mine if r.levelno == logging.WARNING]
        assert warnings == [
            f"GPUs unhealthy: MPS pipe directory {pipe} cannot be read "
            "(No such file or directory) (is the MPS control daemon running?)"
        ]
        pipe.mkdir()
        devices = await plugin.list_after(seen + 1, timeout=5)
        assert {d.health for d in devices} == {"Healthy"}
        back = [r.getMessage() for r in caplog.records if r.name == "gpuslice_deviceplugin.mps"]
        assert back[-1] == f"MPS daemon directory {pipe} is back: GPUs healthy"


async def test_a_plain_file_in_the_pipe_directory_s_place_is_refused(
    agent: Running, kubelet: DevKubelet, daemon_dirs: tuple[Path, Path]
) -> None:
    pipe, _ = daemon_dirs
    plugin = await registered(kubelet)
    seen = len(plugin.lists)
    pipe.rmdir()
    pipe.write_text("not a daemon\n")
    devices = await plugin.list_after(seen, timeout=5)
    assert {d.health for d in devices} == {"Unhealthy"}


async def test_the_tenant_s_own_mps_variables_do_not_lift_the_interposer_s_memory_limit(
    agent_process: Callable[..., subprocess.Popen[str]],
    kubelet: DevKubelet,
    plugin_ledger: Ledger,
    bus: Bus,
    spawn_probe: ProbeSpawner,
    inventory: InventoryRunning,
    tmp_path: Path,
    daemon_dirs: tuple[Path, Path],
) -> None:
    """The agent on the fake NVML, as a DaemonSet runs it, on an MPS node; the
    container's process is the probe on the fake CUDA driver, under the interposer."""
    config = tmp_path / "mps-nodes.yaml"
    config.write_text(mps_config(*daemon_dirs, deviceSplitCount="5", contextOverhead="64"))
    inventories: asyncio.Queue[NodeInventory] = asyncio.Queue()

    async def on_inventory(_subject: str, inv: NodeInventory) -> None:
        await inventories.put(inv)

    await bus.subscribe(bus.subjects.inventory("node-e2e"), NodeInventory, on_inventory)
    await bus.flush()
    proc = agent_process(GPUSLICE_NODE_CONFIG_FILE=str(config))
    plugin = await kubelet.registration(timeout=90)
    await plugin.list_after(0)
    published = await asyncio.wait_for(inventories.get(), 10)
    assert {d.mode for d in published.devices} == {VgpuMode.MPS}
    await plugin_ledger.register_node(published, rebuilt=True)
    fake = [d.uuid for d in published.devices]
    await bind(plugin_ledger, placement("fence", [[(fake[0], 512, 40)]], node="node-e2e"))
    response = await plugin.admit_container(1)
    mounts = {m.container_path: m.host_path for m in response.mounts}
    env = dict(response.envs)
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=512M"
    # the tenant raises every limit its environment holds
    env.update(
        {
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=16384M",
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100",
            "CUDA_DEVICE_MEMORY_LIMIT_0": "16g",
            "CUDA_DEVICE_MEMORY_LIMIT": "16g",
            "GPUSLICE_GRANT_DIR": mounts["/run/gpuslice"],
            "LD_PRELOAD": mounts["/usr/local/gpuslice/libgpuslice.so"],
            "FAKECUDA_DEVICES": "2",
            "FAKECUDA_MEMORY": "16g",
        }
    )
    probe = spawn_probe(
        "init", "ctx", "0", "alloc", "400m", "alloc", "100m", "info", build="none", env=env
    )
    result = probe.result(timeout=20)
    allocs = [line["rc"] for line in result.by_cmd("alloc")]
    assert allocs == [0, 2], result.describe()  # 64 + 400 fit in 512 MiB; 100 more do not
    assert result.one("info")["total"] == 512 << 20
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 0, out
    assert "Traceback" not in out
