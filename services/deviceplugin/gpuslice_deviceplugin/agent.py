"""The node's GPUs as the rest of the system sees them.

Every ``health_interval`` the agent re-reads the node configuration file (when
it changed) and asks the backend for the devices and their health. A change
re-sends kubelet's device list on every ListAndWatch stream and publishes the
node inventory on ``<prefix>.inventory.<node>`` at once; the inventory is also
published every ``inventory_interval`` as the node's heartbeat. A configuration
file that turns bad is reported and the last good one kept.

The inventory also says, per card, which enforcement layers hold its containers
to their grants (:class:`~gpuslice_common.models.CardLayers`): the driver's
per-cgroup limits where the node supports them (:mod:`gpuslice_deviceplugin.driverlimits`,
checked again whenever the cards change), the agent's own memory and compute
checks as its sampler reports them (``card_layers``: card UUID -> (memory, compute);
"missing" for a card it has no data for, or where no sampler runs) and the
interposer. The same shows as the ``gpuslice_enforcement_layer`` gauge.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path

from gpuslice_common.bus import Bus, BusError
from gpuslice_common.config import DevicePluginSettings
from gpuslice_common.models import (
    MAX_LAYER_NOTE,
    CardLayers,
    GpuDevice,
    LayerState,
    NodeInventory,
    VgpuMode,
)
from gpuslice_deviceplugin import driverlimits
from gpuslice_deviceplugin.discovery import Backend, DiscoveryError, mps_cards, visible
from gpuslice_deviceplugin.metrics import PluginMetrics
from gpuslice_deviceplugin.mig import MigInstances
from gpuslice_deviceplugin.mps import DaemonCheck
from gpuslice_deviceplugin.nodeconfig import NodeConfig, NodeConfigError, load_node_config
from gpuslice_deviceplugin.plugin import DeviceList
from gpuslice_deviceplugin.replicas import Replicas

log = logging.getLogger(__name__)

MAX_DRIVER_FAILURES = 4096  # containers whose driver limit could not be ensured, kept
# What the agent's sampler could read per card: UUID -> (memory checked, compute checked)
CardLayerSource = Callable[[], Mapping[str, tuple[bool, bool]]]


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
        card_layers: CardLayerSource | None = None,
    ) -> None:
        self.settings = settings
        self.card_layers = card_layers  # the sampler's report; None: no sampler runs
        self.driver_support: dict[str, driverlimits.CardSupport] = {}
        self._support_for: tuple[tuple[str, bool], ...] | None = None
        self._sampler_broken = False
        # (card UUID, container cgroup) -> why the driver's limit could not be ensured
        self._driver_failed: dict[tuple[str, str], str] = {}
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
        inventory = self._config.inventory(self.settings.node_name, self._devices)
        dra = bool(getattr(self.settings, "dra", False))
        return inventory.model_copy(update={"layers": self.layers(), "dra": dra})

    def layers(self) -> dict[str, CardLayers]:
        """Which layers enforce on each card now."""
        sampled: Mapping[str, tuple[bool, bool]] = {}
        if self.card_layers is not None:
            try:
                sampled = self.card_layers()
            except Exception:  # a broken sampler report leaves its layers missing
                if not self._sampler_broken:  # once, not at every refresh
                    log.exception("the sampler's per-card report could not be read")
                self._sampler_broken = True
            else:
                if self._sampler_broken:
                    log.info("the sampler's per-card report is readable again")
                self._sampler_broken = False
        out = {}
        for device in self._devices:
            support = self.driver_support.get(device.uuid)
            memory, compute = sampled.get(device.uuid, (False, False))
            driver = support is not None and support.supported
            note = support.note if support else "not checked"
            failure = self._driver_failure(device.uuid) if driver and self._driver_failed else None
            if failure is not None:
                driver, note = False, f"limit not applied: {failure}"
            out[device.uuid] = CardLayers(
                driver=_state(driver),
                driver_note=_note(note),
                agent_memory=_state(memory is True),
                agent_compute=_state(compute is True),
            )
        return out

    def cgroup_root(self) -> Path | None:
        """The host's cgroup v2 hierarchy as the agent sees it: the ``cgroup_root``
        setting where the deployment mounts the host's tree (the agent's own
        /sys/fs/cgroup shows only its own group, without ``dmem.capacity``), else
        the first cgroup2 mount. The driver's limits name groups by this path."""
        configured = getattr(self.settings, "cgroup_root", None)
        return Path(configured) if configured else driverlimits.cgroup2_root()

    def note_driver_limit(self, uuid: str, cgroup: str, result: driverlimits.LimitResult) -> None:
        """What :func:`driverlimits.ensure_limit` did for a container's ``cgroup`` on
        card ``uuid``: until it succeeds there, the card's driver layer is reported
        missing, with why (a container the driver does not hold is not enforced)."""
        self.metrics.driver_limits.labels(result.outcome).inc()
        key = (uuid, cgroup)
        if result.ok:
            self._driver_failed.pop(key, None)
        elif key in self._driver_failed or len(self._driver_failed) < MAX_DRIVER_FAILURES:
            self._driver_failed[key] = result.detail or result.outcome

    def _driver_failure(self, uuid: str) -> str | None:
        """Why a container on the card is not held by the driver, or None. A
        container whose cgroup is gone is forgotten."""
        root = self.cgroup_root()
        for (card, cgroup), why in list(self._driver_failed.items()):
            if root is not None:
                try:
                    gone = not driverlimits.group_path(root, cgroup).is_dir()
                except ValueError:
                    gone = False
                if gone:
                    del self._driver_failed[(card, cgroup)]
                    continue
            if card == uuid:
                return why
        return None

    async def check_driver_limits(self) -> None:
        """Whether the driver limits memory per cgroup on each card (again when the
        cards or their MIG modes changed)."""
        key = tuple((d.uuid, d.mig) for d in self._devices)
        if key == self._support_for:
            return
        if self.backend.name != "nvml":
            note = f"no NVML ({self.backend.name} backend)"
            support = {d.uuid: driverlimits.CardSupport(False, note) for d in self._devices}
        else:
            try:
                support = await asyncio.to_thread(
                    driverlimits.card_support, self._devices, self.cgroup_root()
                )
            except Exception as exc:  # NVML or the file system: say so, count as missing
                log.warning("driver memory limits could not be checked: %s", exc)
                note = f"check failed: {type(exc).__name__}"
                support = {d.uuid: driverlimits.CardSupport(False, note) for d in self._devices}
        for uuid, found in support.items():
            if self.driver_support.get(uuid) != found:
                log.info(
                    "GPU %s: driver memory limits %s (%s)",
                    uuid,
                    "supported" if found.supported else "missing",
                    found.note,
                )
        self.driver_support = support
        self._support_for = key

    def _export_layers(self, layers: Mapping[str, CardLayers]) -> None:
        self.metrics.layers.clear()
        node = self.settings.node_name
        for uuid, card in layers.items():
            for name, state in (
                ("driver", card.driver),
                ("agent-memory", card.agent_memory),
                ("agent-compute", card.agent_compute),
                ("interposer", card.interposer),
            ):
                self.metrics.layers.labels(node, uuid, name).set(
                    1 if state is LayerState.ENFORCING else 0
                )

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
        await self.check_driver_limits()
        for health in ("healthy", "unhealthy"):
            self.metrics.devices.labels(health).set(
                sum(d.healthy == (health == "healthy") for d in devices)
            )
        changed = await self.device_list.update(Replicas(tuple(devices), self._config.split_count))
        inventory = self.inventory()
        self._export_layers(inventory.layers)
        if self._published is None or _facts(self._published) != _facts(inventory):
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


def _state(on: bool) -> LayerState:
    return LayerState.ENFORCING if on else LayerState.MISSING


_UNPRINTABLE = re.compile(r"[^ -~]+")


def _note(text: str) -> str | None:
    """``text`` as a CardLayers note: printable ASCII, bounded; None when empty."""
    clean = _UNPRINTABLE.sub(" ", text).strip()[:MAX_LAYER_NOTE].strip()
    return clean or None
