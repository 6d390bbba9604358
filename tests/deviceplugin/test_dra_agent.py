"""The agent in DRA mode as a whole: its slices published, the GPU device plugin not
registered with kubelet, the inventory saying DRA, and no start without a Kubernetes API."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from gpuslice_common.bus import Bus
from gpuslice_common.config import ConfigError, DevicePluginSettings
from gpuslice_common.dra import DRIVER
from gpuslice_common.kube import LocalKubeApi
from gpuslice_common.models import NodeInventory
from gpuslice_deviceplugin.dra.claims import Claims
from gpuslice_deviceplugin.dra.slices import RESOURCE
from gpuslice_deviceplugin.service import running
from tests.deviceplugin.conftest import FAST, NODE


def exists(path: Path) -> bool:
    return path.exists()


@pytest.fixture
def dra_settings(
    make_settings: Callable[..., DevicePluginSettings], short_dir: Path, tmp_path: Path
) -> DevicePluginSettings:
    return make_settings(
        dra=True,
        kube_api="local",
        dra_plugins_dir=str(short_dir / "plugins"),
        dra_registry_dir=str(short_dir / "registry"),
        cdi_dir=str(tmp_path / "cdi"),
    )


async def test_dra_mode_publishes_slices_instead_of_registering_the_device_plugin(
    dra_settings: DevicePluginSettings, bus: Bus
) -> None:
    got: list[NodeInventory] = []

    async def on_inventory(_subject: str, inv: NodeInventory) -> None:
        got.append(inv)

    await bus.subscribe(bus.subjects.inventory(NODE), NodeInventory, on_inventory)
    await bus.flush()
    kube = LocalKubeApi()
    async with running(dra_settings, bus=bus, kube=kube, serve_http=False, timing=FAST) as state:
        assert state.dra is not None
        assert isinstance(state.dra.claims, Claims)
        await asyncio.wait_for(state.dra.slices.published.wait(), 10)
        names = {t.get_name() for t in state.tasks}
        assert "kubelet-link" not in names
        assert {"resource-slices", "dra-plugin"} <= names
        socket = Path(dra_settings.kubelet_dir) / dra_settings.socket_name
        assert not await asyncio.to_thread(exists, socket)
        await bus.flush()
        assert state.agent.inventory().dra is True
    (obj,) = await kube.list_objects(RESOURCE)
    assert obj["spec"]["driver"] == DRIVER
    assert obj["spec"]["nodeName"] == NODE
    assert len(obj["spec"]["devices"]) == 2  # the simulated node's two cards
    assert got
    assert all(inv.dra for inv in got)


async def test_dra_mode_without_a_kubernetes_api_is_refused(
    make_settings: Callable[..., DevicePluginSettings], bus: Bus
) -> None:
    settings = make_settings(dra=True, kube_api="none")
    with pytest.raises(ConfigError, match="GPUSLICE_KUBE_API"):
        async with running(settings, bus=bus, kube=None, serve_http=False, timing=FAST):
            pass


async def test_dra_mode_on_a_node_whose_slices_cannot_be_named_is_refused(
    dra_settings: DevicePluginSettings, bus: Bus
) -> None:
    """A node name so long that <node>-gpu.gpuslice.io-999 passes 253 characters:
    the admission policy would refuse every other name, so the agent does not start."""
    long = ".".join(["a" * 60] * 4)  # 243 characters, a valid node name
    settings = dra_settings.model_copy(update={"node_name": long})
    with pytest.raises(ConfigError, match=r"GPUSLICE_NODE_NAME: node name 'a{60}.*233"):
        async with running(settings, bus=bus, kube=LocalKubeApi(), serve_http=False, timing=FAST):
            pass


async def test_a_nodes_configuration_chooses_its_mode(
    dra_settings: DevicePluginSettings,
    make_settings: Callable[..., DevicePluginSettings],
    bus: Bus,
    tmp_path: Path,
) -> None:
    """kubeletApi of the node's entry wins over GPUSLICE_DRA, both ways; other
    nodes keep the agent's setting."""
    config = tmp_path / "nodes.yaml"
    config.write_text(
        "defaults: {simulate: {count: 2}}\n"
        f"nodeconfig: [{{name: {NODE}, kubeletApi: device-plugin}}, "
        "{name: other-node, kubeletApi: dra}]\n"
    )
    plugin_mode = dra_settings.model_copy(update={"node_config_file": str(config)})
    async with running(
        plugin_mode, bus=bus, kube=LocalKubeApi(), serve_http=False, timing=FAST
    ) as state:
        assert state.dra is None
        assert "kubelet-link" in {t.get_name() for t in state.tasks}
        assert state.agent.inventory().dra is False
    config.write_text(f"nodeconfig: [{{name: {NODE}, kubeletApi: dra}}]\n")
    dra_mode = make_settings(
        dra=False,
        kube_api="local",
        node_config_file=str(config),
        dra_plugins_dir=dra_settings.dra_plugins_dir,
        dra_registry_dir=dra_settings.dra_registry_dir,
        cdi_dir=dra_settings.cdi_dir,
    )
    async with running(
        dra_mode, bus=bus, kube=LocalKubeApi(), serve_http=False, timing=FAST
    ) as state:
        assert state.dra is not None
        assert state.agent.inventory().dra is True
