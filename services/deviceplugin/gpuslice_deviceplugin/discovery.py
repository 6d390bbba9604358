"""Where this node's GPUs come from: NVML on a GPU node, or simulated ones from the config.

A backend's ``devices()`` is the current view, health included. It is polled
every few seconds from a worker thread and reports a sick card as
``healthy=False`` rather than failing; only a failure of the whole backend
raises :class:`DiscoveryError`. Its ``figures()`` gives the cards' physical
readings (:mod:`gpuslice_deviceplugin.physical`) and never raises. It is also
the node's :class:`~gpuslice_deviceplugin.mig.MigDriver`.

A card in MIG mode is shared as the node configuration says. On a ``mig``
node it is a ``mig`` card: its profiles are those NVML offers that the
``migProfileAllowlist`` entry for its model names, and the instances already on
it are listed (the agent takes its own out); a card no profile is allowed on is
left out. On a ``hami-core`` node with ``migStrategy: mixed`` its instances are
static: listed, and the card itself is not shared (reported unhealthy for
hami-core). With ``migStrategy: none`` it is left out. A card without MIG, or
with MIG off, on a ``mig`` node is shared by hami-core. Each of these is
logged once per card.
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

from gpuslice_common.models import GpuDevice, MigPlacement, MigProfile, VgpuMode
from gpuslice_deviceplugin import mig_nvml
from gpuslice_deviceplugin.mig import (
    A100_40GB,
    LiveInstance,
    MigError,
    SimulatedMig,
    first_fit,
    static_instances,
)
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

    def configure(self, config: NodeConfig) -> None:
        """Share the cards as ``config`` says from now on (it was reloaded)."""
        ...

    def mig_profiles(self, gpu: str) -> tuple[MigProfile, ...]: ...

    def mig_instances(self, gpu: str) -> list[LiveInstance]: ...

    def mig_create(self, gpu: str, profile: str, placement: MigPlacement) -> LiveInstance: ...

    def mig_destroy(self, gpu: str, placement: MigPlacement) -> bool: ...

    def close(self) -> None: ...


def visible(devices: Sequence[GpuDevice], filter: FilterDevices) -> list[GpuDevice]:
    """The devices the node configuration's ``filterDevices`` leaves in."""
    return [d for d in devices if not filter.excludes(d)]


def mps_cards(devices: Sequence[GpuDevice], *, daemon_ready: bool) -> list[GpuDevice]:
    """``devices`` as cards of an MPS node: mode ``mps``, unhealthy while the daemon is not."""
    return [
        d.model_copy(update={"mode": VgpuMode.MPS, "healthy": d.healthy and daemon_ready})
        for d in devices
    ]


def simulated_uuid(node: str, index: int) -> str:
    """A UUID for a simulated GPU: the same for a node and index, different across nodes."""
    return f"GPU-{uuid.uuid5(_SIMULATED_NAMESPACE, f'{node}/{index}')}"


class SimulatedBackend(SimulatedMig):
    """GPUs described by the node configuration's ``simulate`` section; with
    ``mig: true`` MIG cards of the A100-40GB geometry whose instances live in
    memory. ``instances`` are made on each MIG card the first time its devices
    are read, as someone else made them: static. On a ``mig`` node the cards are
    ``mig`` cards; on a ``hami-core`` node (``migStrategy: mixed``) they are not
    shared, and their instances are advertised as ``nvidia.com/mig-<profile>``."""

    name = "simulated"

    def __init__(self, node: str, gpus: SimulatedGpus, config: NodeConfig | None = None) -> None:
        super().__init__()
        self._node = node
        self._gpus = gpus
        self._config = config or NodeConfig()
        self._premade: set[str] = set()  # cards whose static instances were made

    def update(self, gpus: SimulatedGpus) -> None:
        """Report ``gpus`` from now on (the node configuration was reloaded)."""
        self._gpus = gpus

    def configure(self, config: NodeConfig) -> None:
        self._config = config
        self._gpus = config.simulate

    def mig_profiles(self, gpu: str) -> tuple[MigProfile, ...]:
        """The A100-40GB profiles on this node's simulated MIG cards; () elsewhere."""
        gpus = self._gpus
        mine = {simulated_uuid(self._node, i) for i in range(gpus.count)}
        return super().mig_profiles(gpu) if gpus.mig and gpu in mine else ()

    def devices(self) -> list[GpuDevice]:
        gpus = self._gpus
        out = []
        for i in range(gpus.count):
            uuid = simulated_uuid(self._node, i)
            fields: dict[str, Any] = {
                "uuid": uuid,
                "index": i,
                "model": gpus.model,
                "memory_mib": gpus.memory_mib,
                "numa": gpus.numa_of(i),
                "healthy": i not in gpus.unhealthy,
            }
            if gpus.mig and uuid not in self._premade:
                self._premade.add(uuid)
                for profile, place in zip(
                    gpus.instances, first_fit(A100_40GB, gpus.instances), strict=True
                ):
                    self.mig_create(uuid, profile, place)
            if gpus.mig and self._config.operating_mode != "mig":
                fields.update(  # migStrategy mixed: its instances are static, the card not shared
                    mig=True,
                    mig_instances=static_instances(uuid, self.mig_instances(uuid)),
                    healthy=False,
                )
            elif gpus.mig:
                allowed = self._config.mig_allowed(gpus.model)
                profiles = tuple(
                    p for p in self.mig_profiles(uuid) if allowed is None or p.name in allowed
                )
                fields.update(
                    mig=True,
                    mode=VgpuMode.MIG if profiles else VgpuMode.HAMI_CORE,
                    mig_profiles=profiles,
                    mig_instances=static_instances(uuid, self.mig_instances(uuid)),
                    healthy=fields["healthy"] and bool(profiles),  # none allowed: not shared
                )
            out.append(GpuDevice(**fields))
        return out

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

    def __init__(self, config: NodeConfig | None = None) -> None:
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise DiscoveryError(f"NVML did not initialise: {exc}") from exc
        self._lock = threading.Lock()
        self._last: dict[int, GpuDevice] = {}  # by index: the last successful read
        self._failing: set[int] = set()  # indices whose last read failed
        self._xid: dict[int, int] = {}  # index -> the critical Xid that took it out
        self._config = config or NodeConfig()
        self._said: set[tuple[str, str]] = set()  # (card UUID, what) logged once
        self._mig_known: dict[str, list[mig_nvml.NvmlProfile]] = {}  # card UUID -> profiles
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
            log.info("GPU %d (%s) answers again", index, device.uuid if device else "left out")
        if device is None:  # left out
            self._last.pop(index, None)
            return None
        self._last[index] = device
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

    def _read(self, index: int) -> GpuDevice | None:
        """Card ``index`` shared as the configuration says; None when it is left out."""
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        device = GpuDevice(
            uuid=str(pynvml.nvmlDeviceGetUUID(handle)),
            index=index,
            model=str(pynvml.nvmlDeviceGetName(handle)),
            memory_mib=int(pynvml.nvmlDeviceGetMemoryInfo(handle).total) // MiB,
            numa=_numa(handle),
            mig=_mig(handle),
        )
        config = self._config
        if not device.mig:
            if config.operating_mode == "mig":
                self._once(device, "no-mig", "has no MIG or MIG is off: shared by hami-core")
            return device
        if config.operating_mode != "mig" and config.mig_strategy == "none":
            self._once(device, "none", "is in MIG mode and migStrategy is none: left out")
            return None
        live = mig_nvml.instances(handle, self._known(handle, device))
        fields = device.model_dump()
        fields["mig_instances"] = static_instances(device.uuid, live)
        if config.operating_mode == "mig":
            allowed = config.mig_allowed(device.model)
            profiles = tuple(
                p.profile
                for p in self._known(handle, device)
                if allowed is None or p.profile.name in allowed
            )
            if not profiles:
                self._once(
                    device,
                    "no-profile",
                    "is in MIG mode but no MIG profile is allowed "
                    f"for {device.model!r} (migProfileAllowlist): left out",
                )
                return None
            return GpuDevice(**{**fields, "mode": VgpuMode.MIG, "mig_profiles": profiles})
        self._once(
            device,
            "static",
            "is in MIG mode: its instances are static, the card is not shared by hami-core",
        )
        return GpuDevice(**{**fields, "healthy": False})

    def _once(self, device: GpuDevice, what: str, message: str) -> None:
        if (device.uuid, what) not in self._said:
            self._said.add((device.uuid, what))
            log.warning("GPU %d (%s) %s", device.index, device.uuid, message)

    def _known(self, handle: Any, device: GpuDevice) -> list[mig_nvml.NvmlProfile]:
        """The card's MIG profiles (read once: they do not change while MIG is on)."""
        known = self._mig_known.get(device.uuid)
        if known is None:
            known = self._mig_known[device.uuid] = mig_nvml.profiles(handle, device.memory_mib)
        return known

    def configure(self, config: NodeConfig) -> None:
        with self._lock:
            self._config = config

    # --------------------------------------------------------------------- MIG

    def _card(self, gpu: str) -> tuple[Any, list[mig_nvml.NvmlProfile]]:
        if self._closed:
            raise MigError("the NVML backend is closed")
        handle = pynvml.nvmlDeviceGetHandleByUUID(gpu)
        known = self._mig_known.get(gpu)
        if known is None:
            memory_mib = int(pynvml.nvmlDeviceGetMemoryInfo(handle).total) // MiB
            known = self._mig_known[gpu] = mig_nvml.profiles(handle, memory_mib)
        return handle, known

    def mig_profiles(self, gpu: str) -> tuple[MigProfile, ...]:
        with self._lock:
            try:
                if not _mig(pynvml.nvmlDeviceGetHandleByUUID(gpu)):
                    return ()
                return tuple(p.profile for p in self._card(gpu)[1])
            except pynvml.NVMLError as exc:
                raise MigError(f"GPU {gpu}: MIG profiles unreadable: {exc}") from None

    def mig_instances(self, gpu: str) -> list[LiveInstance]:
        with self._lock:
            try:
                return mig_nvml.instances(*self._card(gpu))
            except pynvml.NVMLError as exc:
                raise MigError(f"GPU {gpu}: MIG instances unreadable: {exc}") from None

    def mig_create(self, gpu: str, profile: str, placement: MigPlacement) -> LiveInstance:
        with self._lock:
            try:
                handle, known = self._card(gpu)
                return mig_nvml.create(handle, known, profile, placement)
            except pynvml.NVMLError as exc:
                raise MigError(
                    f"GPU {gpu}: NVML did not make MIG {profile} at "
                    f"{placement.start}+{placement.size}: {exc}"
                ) from None

    def mig_destroy(self, gpu: str, placement: MigPlacement) -> bool:
        with self._lock:
            try:
                return mig_nvml.destroy(*self._card(gpu), placement)
            except pynvml.NVMLError as exc:
                raise MigError(
                    f"GPU {gpu}: NVML did not destroy the MIG instance at "
                    f"{placement.start}+{placement.size}: {exc}"
                ) from None

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
        return SimulatedBackend(node, config.simulate, config)
    if kind == "nvml":
        return NvmlBackend(config)
    try:
        nvml = NvmlBackend(config)
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
    return SimulatedBackend(node, config.simulate, config)
