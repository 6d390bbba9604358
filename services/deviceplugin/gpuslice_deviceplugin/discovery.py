"""Where this node's GPUs come from: NVML on a GPU node, or simulated ones from the config.

A backend's ``devices()`` is the current view, health included. It is polled
every few seconds from a worker thread and reports a sick card as
``healthy=False`` rather than failing; only a failure of the whole backend
raises :class:`DiscoveryError`. Its ``figures()`` gives the cards' physical
readings (:mod:`gpuslice_deviceplugin.physical`) and never raises.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, Protocol

import pynvml  # type: ignore[import-untyped]

from gpuslice_common.models import GpuDevice
from gpuslice_deviceplugin.nodeconfig import FilterDevices, NodeConfig, SimulatedGpus
from gpuslice_deviceplugin.physical import GpuFigures, Load, NvmlFigures, simulated_figures

log = logging.getLogger(__name__)

MiB = 1 << 20
PCI_DEVICES = Path("/sys/bus/pci/devices")

# Xids an application causes (and survives) rather than the card, as the NVIDIA
# device plugin treats them: 13 graphics engine exception, 31 GPU memory page
# fault, 43 GPU stopped processing, 45 preemptive cleanup, 68 video processor
# exception, 109 context switch timeout. Any other critical Xid marks the card
# unhealthy until the agent restarts.
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})

# A namespace for simulated GPU UUIDs: uuid5(namespace, "node/index").
_SIMULATED_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "https://gpuslice.io/simulated-gpu")


class DiscoveryError(Exception):
    """The backend as a whole cannot report devices."""


class Backend(Protocol):
    """A source of this node's GPUs."""

    name: str

    def devices(self) -> list[GpuDevice]:
        """Every GPU with its health now; raises DiscoveryError only if the backend fails."""
        ...

    def figures(self, devices: Sequence[GpuDevice], load: Load) -> list[GpuFigures]:
        """The physical readings of ``devices`` now; what a card cannot give is None."""
        ...

    def close(self) -> None: ...


def visible(devices: Sequence[GpuDevice], filter: FilterDevices) -> list[GpuDevice]:
    """The devices the node configuration's ``filterDevices`` leaves in."""
    return [d for d in devices if not filter.excludes(d)]


def simulated_uuid(node: str, index: int) -> str:
    """A UUID for a simulated GPU: the same for a node and index, different across nodes."""
    return f"GPU-{uuid.uuid5(_SIMULATED_NAMESPACE, f'{node}/{index}')}"


class SimulatedBackend:
    """GPUs described by the node configuration's ``simulate`` section."""

    name = "simulated"

    def __init__(self, node: str, gpus: SimulatedGpus) -> None:
        self._node = node
        self._gpus = gpus

    def update(self, gpus: SimulatedGpus) -> None:
        """Report ``gpus`` from now on (the node configuration was reloaded)."""
        self._gpus = gpus

    def devices(self) -> list[GpuDevice]:
        gpus = self._gpus
        return [
            GpuDevice(
                uuid=simulated_uuid(self._node, i),
                index=i,
                model=gpus.model,
                memory_mib=gpus.memory_mib,
                numa=gpus.numa_of(i),
                healthy=i not in gpus.unhealthy,
            )
            for i in range(gpus.count)
        ]

    def figures(self, devices: Sequence[GpuDevice], load: Load) -> list[GpuFigures]:
        return simulated_figures(devices, load)

    def close(self) -> None:
        pass


def pci_numa_node(bus_id: str, root: Path = PCI_DEVICES) -> int | None:
    """The NUMA node sysfs gives a PCI device (NVML's bus id, e.g. ``00000000:3B:00.0``)."""
    domain, sep, rest = bus_id.strip().partition(":")
    try:
        name = f"{int(domain, 16):04x}:{rest.lower()}" if sep else ""
        node = int((root / name / "numa_node").read_text()) if name else -1
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def _handle_address(handle: Any) -> int | None:
    value = ctypes.cast(handle, ctypes.c_void_p).value
    return int(value) if value else None


class NvmlBackend:
    """The node's real GPUs through NVML (pynvml)."""

    name = "nvml"

    def __init__(self) -> None:
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise DiscoveryError(f"NVML did not initialise: {exc}") from exc
        self._lock = threading.Lock()
        self._last: dict[int, GpuDevice] = {}  # by index: the last successful read
        self._failing: set[int] = set()  # indices whose last read failed
        self._xid: dict[int, int] = {}  # index -> the critical Xid that took it out
        self._mig_warned: set[str] = set()
        self._events: Any = None
        self._event_devices: dict[int, int] = {}  # handle address -> index
        self._closed = False
        self._figures = NvmlFigures()
        self._watch_xids()

    # ------------------------------------------------------------------ events

    def _watch_xids(self) -> None:
        """Registers every device for critical Xid events where NVML supports it."""
        try:
            events = pynvml.nvmlEventSetCreate()
        except pynvml.NVMLError as exc:
            log.debug("NVML events unavailable (%s): no Xid health checks", exc)
            return
        try:
            count = int(pynvml.nvmlDeviceGetCount())
        except pynvml.NVMLError as exc:
            log.debug("NVML device count failed (%s): no Xid health checks", exc)
            count = 0
        for index in range(count):
            try:
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                pynvml.nvmlDeviceRegisterEvents(
                    handle, pynvml.nvmlEventTypeXidCriticalError, events
                )
            except pynvml.NVMLError as exc:
                log.debug("GPU %d: no Xid events (%s)", index, exc)
                continue
            address = _handle_address(handle)
            if address is not None:
                self._event_devices[address] = index
        if self._event_devices:
            self._events = events
        else:
            _quietly(pynvml.nvmlEventSetFree, events)

    def _drain_xids(self) -> None:
        """Marks cards hit by a critical Xid since the last poll (never waits)."""
        while self._events is not None:
            try:
                data = pynvml.nvmlEventSetWait_v2(self._events, 0)
            except pynvml.NVMLError_Timeout:
                return
            except pynvml.NVMLError as exc:
                log.warning("reading NVML events failed (%s): Xid health checks stop", exc)
                _quietly(pynvml.nvmlEventSetFree, self._events)
                self._events = None
                return
            if not int(data.eventType) & pynvml.nvmlEventTypeXidCriticalError:
                continue
            xid = int(data.eventData)
            if xid in APPLICATION_XIDS:
                log.info("Xid %d (application error) seen; the GPU stays healthy", xid)
                continue
            address = _handle_address(data.device)
            if address is None:  # no device named: every card is suspect
                hit = list(self._event_devices.values())
            elif address in self._event_devices:
                hit = [self._event_devices[address]]
            else:
                log.warning("critical Xid %d on a GPU not watched; ignored", xid)
                continue
            for index in hit:
                if index not in self._xid:
                    log.warning("GPU %d had critical Xid %d: unhealthy until restart", index, xid)
                    self._xid[index] = xid

    # ----------------------------------------------------------------- devices

    def devices(self) -> list[GpuDevice]:
        with self._lock:
            if self._closed:
                raise DiscoveryError("the NVML backend is closed")
            self._drain_xids()
            try:
                count = int(pynvml.nvmlDeviceGetCount())
            except pynvml.NVMLError as exc:
                raise DiscoveryError(f"NVML cannot count devices: {exc}") from exc
            found = (self._device(index) for index in range(count))
            return [d for d in found if d is not None]

    def _device(self, index: int) -> GpuDevice | None:
        """Device ``index`` as read now, its last good read marked unhealthy, or None."""
        try:
            device = self._read(index)
        except (pynvml.NVMLError, ValueError) as exc:
            return self._failed(index, exc)
        if index in self._failing:
            self._failing.discard(index)
            log.info("GPU %d (%s) answers again", index, device.uuid)
        self._last[index] = device
        if device.mig:
            if device.uuid not in self._mig_warned:
                self._mig_warned.add(device.uuid)
                log.warning("GPU %d (%s) is in MIG mode and cannot be shared", index, device.uuid)
            return device.model_copy(update={"healthy": False})
        if index in self._xid:
            return device.model_copy(update={"healthy": False})
        return device

    def _failed(self, index: int, exc: Exception) -> GpuDevice | None:
        first = index not in self._failing
        self._failing.add(index)
        last = self._last.get(index)
        if last is None:
            if first:
                log.warning("GPU %d cannot be read (%s) and was never seen: left out", index, exc)
            return None
        if first:
            log.warning("GPU %d (%s) cannot be read (%s): unhealthy", index, last.uuid, exc)
        return last.model_copy(update={"healthy": False})

    def _read(self, index: int) -> GpuDevice:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        return GpuDevice(
            uuid=str(pynvml.nvmlDeviceGetUUID(handle)),
            index=index,
            model=str(pynvml.nvmlDeviceGetName(handle)),
            memory_mib=int(pynvml.nvmlDeviceGetMemoryInfo(handle).total) // MiB,
            numa=_numa(handle),
            mig=_mig(handle),
        )

    def figures(self, devices: Sequence[GpuDevice], load: Load) -> list[GpuFigures]:
        with self._lock:
            if self._closed:
                return [GpuFigures(device=d) for d in devices]
            return self._figures.read(devices)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._events is not None:
                _quietly(pynvml.nvmlEventSetFree, self._events)
                self._events = None
            _quietly(pynvml.nvmlShutdown)


def _numa(handle: Any) -> int | None:
    """NVML's NUMA node for the card, else sysfs's for its PCI bus id; None if unknown."""
    try:
        node = int(pynvml.nvmlDeviceGetNumaNodeId(handle))
        return node if node >= 0 else None
    except pynvml.NVMLError:
        pass
    try:
        bus_id = pynvml.nvmlDeviceGetPciInfo(handle).busId
    except pynvml.NVMLError:
        return None
    return pci_numa_node(bus_id.decode() if isinstance(bus_id, bytes) else str(bus_id))


def _mig(handle: Any) -> bool:
    """Whether MIG is on now; False where the card or driver has no MIG."""
    try:
        current, _pending = pynvml.nvmlDeviceGetMigMode(handle)
    except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound):
        return False
    return int(current) == 1  # NVML_DEVICE_MIG_ENABLE


def _quietly(call: Any, *args: Any) -> None:
    try:
        call(*args)
    except pynvml.NVMLError as exc:
        log.debug("%s failed: %s", getattr(call, "__name__", call), exc)


def open_backend(
    kind: Literal["auto", "nvml", "simulated"], node: str, config: NodeConfig
) -> Backend:
    """The backend ``kind`` names; "auto" takes NVML when it loads and sees a GPU."""
    if kind == "simulated":
        return SimulatedBackend(node, config.simulate)
    if kind == "nvml":
        return NvmlBackend()
    try:
        nvml = NvmlBackend()
    except DiscoveryError as exc:
        reason = str(exc)
    else:
        try:
            if nvml.devices():
                return nvml
            reason = "NVML reports no GPUs"
        except DiscoveryError as exc:
            reason = str(exc)
        nvml.close()
    # "auto" is for machines that may have no GPU (development); a GPU node runs "nvml"
    log.warning("%s: using %d simulated GPUs", reason, config.simulate.count)
    return SimulatedBackend(node, config.simulate)
