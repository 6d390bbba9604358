"""Physical figures of the node's GPUs: what the whole card shows, whoever uses it.

A backend's ``figures(devices, load)`` gives one :class:`GpuFigures` per device.
On NVML they are the card's own readings: memory used by anything on it and its
total (``nvmlDeviceGetMemoryInfo``), GPU and memory-controller utilisation
(``nvmlDeviceGetUtilizationRates``), the GPU sensor's temperature, the power
draw (milliwatts, given in watts) and the volatile ECC error counts, corrected
and uncorrected (since the driver last loaded). A reading NVML refuses for a
card (not supported, lost GPU, ...) is left out for that card, ``None`` here,
and logged once per card and figure.

The simulated backend derives them from what the gpuslice containers on the
card do (:class:`Load`): memory used is what their regions hold, utilisation is
their busy time, temperature and power follow utilisation within the model's
range, ECC counts stay 0. It has no memory-controller figure.

The agent reads them every ``health_interval`` in a worker thread, never in a
scrape: an NVML call on a sick card may take seconds.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import pynvml  # type: ignore[import-untyped]

from gpuslice_common.models import GpuDevice
from gpuslice_deviceplugin.coordinator import CoordinatorSnapshot

__all__ = ["BusyMeter", "ContainerKey", "GpuFigures", "Load", "NvmlFigures", "simulated_figures"]

log = logging.getLogger(__name__)

MiB: Final = 1 << 20
ContainerKey = tuple[str, str, str]  # (pod UID, container, GPU UUID)


@dataclass(frozen=True)
class GpuFigures:
    """One GPU's physical readings; None where the card gives none."""

    device: GpuDevice
    memory_used_bytes: float | None = None
    memory_total_bytes: float | None = None
    utilization_percent: float | None = None
    memory_utilization_percent: float | None = None
    temperature_celsius: float | None = None
    power_watts: float | None = None
    ecc_corrected: float | None = None
    ecc_uncorrected: float | None = None


@dataclass(frozen=True)
class Load:
    """What the gpuslice containers do on each GPU, by UUID."""

    held_bytes: Mapping[str, int] = field(default_factory=dict)
    busy_percent: Mapping[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, snapshot: CoordinatorSnapshot | None, busy: Mapping[ContainerKey, float]) -> Load:
        held: dict[str, int] = {}
        if snapshot is not None:
            for state in snapshot.containers:
                for device in state.devices:
                    uuid = device.usage.uuid
                    if uuid:
                        held[uuid] = held.get(uuid, 0) + device.usage.used_bytes
        percent: dict[str, float] = {}
        for (_, _, uuid), value in busy.items():
            percent[uuid] = min(100.0, percent.get(uuid, 0.0) + value)
        return cls(held, percent)


class BusyMeter:
    """Per container and GPU, the percentage of time its kernels kept the GPU busy
    between two snapshots (``busy_ns`` grows only while a compute limit applies)."""

    def __init__(self) -> None:
        self._last: dict[ContainerKey, tuple[int, float]] = {}

    def update(self, snapshot: CoordinatorSnapshot | None) -> dict[ContainerKey, float]:
        """The percentages since the previous snapshot; a container seen for the
        first time has none yet."""
        if snapshot is None:
            return {}
        now: dict[ContainerKey, tuple[int, float]] = {}
        out: dict[ContainerKey, float] = {}
        for state in snapshot.containers:
            for device in state.devices:
                if not device.usage.uuid:
                    continue
                key = (state.owner.pod_uid, state.owner.container, device.usage.uuid)
                busy = device.usage.busy_ns
                now[key] = (busy, snapshot.taken_at)
                last = self._last.get(key)
                if last is None or snapshot.taken_at <= last[1] or busy < last[0]:
                    continue  # new, no time passed, or a new region (counts restarted)
                elapsed_ns = (snapshot.taken_at - last[1]) * 1e9
                out[key] = min(100.0, 100.0 * (busy - last[0]) / elapsed_ns)
        self._last = now
        return out


# ----------------------------------------------------------------- simulated

# (idle watts, full-load watts, idle degrees C, full-load degrees C) by a part
# of the model's name; the first match wins.
_MODEL_RANGES: Final = (
    ("H200", (90.0, 700.0, 32.0, 75.0)),
    ("H100", (70.0, 700.0, 32.0, 75.0)),
    ("A100-SXM", (55.0, 400.0, 30.0, 70.0)),
    ("A100", (40.0, 300.0, 30.0, 70.0)),
    ("L40", (35.0, 300.0, 30.0, 75.0)),
    ("L4", (16.0, 72.0, 30.0, 70.0)),
    ("T4", (10.0, 70.0, 30.0, 70.0)),
    ("", (50.0, 300.0, 30.0, 70.0)),
)


def simulated_figures(devices: Sequence[GpuDevice], load: Load) -> list[GpuFigures]:
    """Figures shaped like a real card's, driven by what the containers do."""
    out = []
    for d in devices:
        idle_w, full_w, idle_c, full_c = next(r for k, r in _MODEL_RANGES if k in d.model)
        busy = load.busy_percent.get(d.uuid, 0.0)
        total = d.memory_mib * MiB
        out.append(
            GpuFigures(
                device=d,
                memory_used_bytes=float(min(total, load.held_bytes.get(d.uuid, 0))),
                memory_total_bytes=float(total),
                utilization_percent=busy,
                temperature_celsius=round(idle_c + (full_c - idle_c) * busy / 100, 1),
                power_watts=round(idle_w + (full_w - idle_w) * busy / 100, 1),
                ecc_corrected=0.0,
                ecc_uncorrected=0.0,
            )
        )
    return out


# ---------------------------------------------------------------------- NVML


class NvmlFigures:
    """Reads the figures through NVML (already initialised by the caller)."""

    def __init__(self) -> None:
        self._refused: set[tuple[str, str]] = set()  # (uuid, figure) logged already

    def read(self, devices: Sequence[GpuDevice]) -> list[GpuFigures]:
        return [self._one(d) for d in devices]

    def _one(self, device: GpuDevice) -> GpuFigures:
        try:
            handle = pynvml.nvmlDeviceGetHandleByUUID(device.uuid)
        except pynvml.NVMLError as exc:
            self._refusal(device, "all figures", exc)
            return GpuFigures(device=device)
        memory = self._get(device, "memory", pynvml.nvmlDeviceGetMemoryInfo, handle)
        rates = self._get(device, "utilisation", pynvml.nvmlDeviceGetUtilizationRates, handle)
        temperature = self._get(
            device, "temperature", pynvml.nvmlDeviceGetTemperature, handle, 0
        )  # NVML_TEMPERATURE_GPU
        power_mw = self._get(device, "power", pynvml.nvmlDeviceGetPowerUsage, handle)
        ecc = [
            self._get(
                device,
                f"{kind} ECC errors",
                pynvml.nvmlDeviceGetTotalEccErrors,
                handle,
                error_type,
                pynvml.NVML_VOLATILE_ECC,
            )
            for kind, error_type in (
                ("corrected", pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED),
                ("uncorrected", pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED),
            )
        ]
        return GpuFigures(
            device=device,
            memory_used_bytes=_number(memory, "used"),
            memory_total_bytes=_number(memory, "total"),
            utilization_percent=_number(rates, "gpu"),
            memory_utilization_percent=_number(rates, "memory"),
            temperature_celsius=_number(temperature),
            power_watts=None if power_mw is None else float(power_mw) / 1000,
            ecc_corrected=_number(ecc[0]),
            ecc_uncorrected=_number(ecc[1]),
        )

    def _get(self, device: GpuDevice, figure: str, call: Callable[..., Any], *args: Any) -> Any:
        try:
            return call(*args)
        except pynvml.NVMLError as exc:
            self._refusal(device, figure, exc)
            return None

    def _refusal(self, device: GpuDevice, figure: str, exc: Exception) -> None:
        key = (device.uuid, figure)
        if key in self._refused:
            return
        self._refused.add(key)
        log.info(
            "GPU %d (%s): NVML gives no %s (%s): left out", device.index, device.uuid, figure, exc
        )


def _number(value: Any, attribute: str | None = None) -> float | None:
    if value is None:
        return None
    return float(getattr(value, attribute) if attribute else value)
