"""Static MIG (``migStrategy: mixed``): instances already on a card advertised as
``nvidia.com/mig-<profile>``, one registration each, by the agent on the fake NVML."""

from __future__ import annotations

import asyncio
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from gpuslice_cli.dev.kubelet import DevKubelet, Plugin
from gpuslice_deviceplugin.api import deviceplugin_pb2 as pb
from gpuslice_inventory.service import Running as InventoryRunning

SMALL = ("MIG-00000001-0000-4001-8000-000000000001", "MIG-00000002-0000-4002-8000-000000000002")
BIG = "MIG-00000003-0000-4003-8000-000000000003"
CARD = "GPU-facefeed-0000-4000-8000-000000000000"


async def test_static_instances_are_advertised_per_profile_and_allocated_by_uuid(
    agent_process: Callable[..., subprocess.Popen[str]],
    kubelet: DevKubelet,
    inventory: InventoryRunning,
    tmp_path: Path,
) -> None:
    config = tmp_path / "static.yaml"
    config.write_text("defaults: {deviceSplitCount: 2, migStrategy: mixed}\n")
    state = tmp_path / "mig-state"
    state.write_text(
        f"serial 3\ngi 0 1 0 0 0 {SMALL[0]}\ngi 0 2 0 1 0 {SMALL[1]}\ngi 0 3 2 4 0 {BIG}\n"
        "gi 0 4 0 2 -1 -\n"  # a GPU instance without a MIG device: nothing to give
    )
    proc = agent_process(
        GPUSLICE_NODE_CONFIG_FILE=str(config),
        FAKECUDA_MEMORY="40g",
        FAKENVML_NAME="NVIDIA A100-SXM4-40GB",
        FAKENVML_MIG="1,0",
        FAKENVML_MIG_FILE=str(state),
    )
    plugins: dict[str, Plugin] = {}
    for n in (1, 2, 3):
        plugin = await kubelet.registration(n, timeout=30)
        plugins[plugin.request.resource_name] = plugin
    assert set(plugins) == {"nvidia.com/gpu", "nvidia.com/mig-1g.5gb", "nvidia.com/mig-3g.20gb"}
    assert plugins["nvidia.com/mig-3g.20gb"].request.endpoint == "gpuslice-mig-3g.20gb.sock"
    # the MIG card is not shared by hami-core: its replicas are unhealthy
    gpus = await plugins["nvidia.com/gpu"].list_after(0)
    assert {d.ID.split("::")[0] for d in gpus if d.health == "Unhealthy"} == {CARD}
    small = await plugins["nvidia.com/mig-1g.5gb"].list_after(0)
    assert [(d.ID, d.health) for d in small] == [(u, "Healthy") for u in SMALL]
    big = plugins["nvidia.com/mig-3g.20gb"]
    assert [d.ID for d in await big.list_after(0)] == [BIG]
    response = await big.admit_container(1)
    assert dict(response.envs) == {"NVIDIA_VISIBLE_DEVICES": BIG}
    assert list(response.mounts) == []  # no interposer: MIG isolates in hardware
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await big.stub.Allocate(
            pb.AllocateRequest(
                container_requests=[pb.ContainerAllocateRequest(devices_ids=[SMALL[0]])]
            )
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == f"nvidia.com/mig-3g.20gb: unknown device IDs: {SMALL[0]}"
    # an instance destroyed by its owner leaves the list
    state.write_text(f"serial 3\ngi 0 1 0 0 0 {SMALL[0]}\ngi 0 3 2 4 0 {BIG}\n")
    seen = len(plugins["nvidia.com/mig-1g.5gb"].lists)
    after = await plugins["nvidia.com/mig-1g.5gb"].list_after(seen, timeout=15)
    assert [d.ID for d in after] == [SMALL[0]]
    assert "gi 0 3 2 4 0" in state.read_text()  # the agent never touched them
    proc.send_signal(signal.SIGTERM)
    out, _ = await asyncio.to_thread(proc.communicate, timeout=20)
    assert proc.returncode == 0, out
    assert "Traceback" not in out
