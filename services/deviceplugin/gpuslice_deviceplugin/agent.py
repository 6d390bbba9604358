"""The node's GPUs as the rest of the system sees them.

Every ``health_interval`` the agent re-reads the node configuration file (when
it changed) and asks the backend for the devices and their health. A change
re-sends kubelet's device list on every ListAndWatch stream and publishes the
node inventory on ``<prefix>.inventory.<node>`` at once; the inventory is also
published every ``inventory_interval`` as the node's heartbeat. A configuration
file that turns bad is reported and the last good one kept.
"""

from __future__ import annotations

import asyncio
import logging
import os

from gpuslice_common.bus import Bus, BusError
from gpuslice_common.config import DevicePluginSettings
from gpuslice_common.models import GpuDevice, NodeInventory, VgpuMode
from gpuslice_deviceplugin.discovery import Backend, DiscoveryError, mps_cards, visible
from gpuslice_deviceplugin.metrics import PluginMetrics
from gpuslice_deviceplugin.mig import MigInstances
from gpuslice_deviceplugin.mps import DaemonCheck
from gpuslice_deviceplugin.nodeconfig import NodeConfig, NodeConfigError, load_node_config
from gpuslice_deviceplugin.plugin import DeviceList
from gpuslice_deviceplugin.replicas import Replicas

log = logging.getLogger(__name__)


def _file_stamp(path: str | None) -> tuple[int, int, int] | None:
    if path is None:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


class NodeAgent:
    def __init__(
        self,
        settings: DevicePluginSettings,
        backend: Backend,
        config: NodeConfig,
        metrics: PluginMetrics,
        *,
        bus: Bus | None = None,
        mig: MigInstances | None = None,
    ) -> None:
        self.settings = settings
        self.mig = mig  # its own MIG instances are not reported as static ones
        self.backend = backend
        self._config = config
        self.metrics = metrics
        self.bus = bus
        self._config_stamp = _file_stamp(settings.node_config_file)
        self._devices: list[GpuDevice] = []
        self.device_list = DeviceList(Replicas((), config.split_count))
        self._published: NodeInventory | None = None
        self._mps_daemon = DaemonCheck()

    @property
    def config(self) -> NodeConfig:
        return self._config

    @property
    def devices(self) -> list[GpuDevice]:
        """The GPUs the node offers, as last discovered (``filterDevices`` applied)."""
        return self._devices

    def inventory(self) -> NodeInventory:
        return self._config.inventory(self.settings.node_name, self._devices)

    async def refresh(self) -> bool:
        """Re-read configuration and devices; True when what is advertised changed."""
        self._reload_config()
        try:
            found = await asyncio.to_thread(self.backend.devices)
        except DiscoveryError as exc:
            log.error("device discovery failed; keeping the last list: %s", exc)
            return False
        devices = visible(found, self._config.filter_devices)
        if self._config.mode is VgpuMode.MPS:
            problem = await asyncio.to_thread(self._mps_daemon.problem, self._config.mps)
            devices = mps_cards(devices, daemon_ready=not problem)
        if self.mig is not None:
            devices = await asyncio.to_thread(self.mig.foreign, devices)
        self._devices = devices
        for health in ("healthy", "unhealthy"):
            self.metrics.devices.labels(health).set(
                sum(d.healthy == (health == "healthy") for d in devices)
            )
        changed = await self.device_list.update(Replicas(tuple(devices), self._config.split_count))
        if self._published is None or _facts(self._published) != _facts(self.inventory()):
            await self.publish_inventory()
        return changed

    def _reload_config(self) -> None:
        path = self.settings.node_config_file
        stamp = _file_stamp(path)
        if stamp == self._config_stamp:
            return
        self._config_stamp = stamp
        try:
            config = load_node_config(path, self.settings.node_name)
        except NodeConfigError as exc:
            log.error("node configuration not reloaded; keeping the last good one: %s", exc)
            return
        if config != self._config:
            log.info("node configuration reloaded from %s", path)
            self._config = config
            self.backend.configure(config)

    async def publish_inventory(self) -> None:
        inventory = self.inventory()
        if self.bus is None:
            return
        try:
            await self.bus.publish_model(self.bus.subjects.inventory(inventory.node), inventory)
        except BusError as exc:
            log.warning("inventory not published: %s", exc)
            return
        self._published = inventory
        self.metrics.inventories.inc()

    async def run(self) -> None:
        """Refresh every health interval and publish the heartbeat; runs until cancelled."""
        health = self.settings.health_interval.total_seconds()
        heartbeat = self.settings.inventory_interval.total_seconds()
        loop = asyncio.get_running_loop()
        next_beat = loop.time() + heartbeat
        while True:
            await asyncio.sleep(min(health, max(0.0, next_beat - loop.time())))
            await self.refresh()
            if loop.time() >= next_beat:
                await self.publish_inventory()
                next_beat = loop.time() + heartbeat


def _facts(inventory: NodeInventory) -> NodeInventory:
    """The inventory without its send time, for comparing two."""
    return inventory.model_copy(update={"sent_at": None})
