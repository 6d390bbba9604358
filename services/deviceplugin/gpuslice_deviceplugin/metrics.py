"""Prometheus metrics of the node agent.

:class:`PluginMetrics` counts what the agent itself does (kubelet registration,
allocations, inventory). :class:`NodeCollector` exports, at scrape time, the GPU
containers of the node from the latest :class:`CoordinatorSnapshot` and the
GPUs' physical figures from the latest reading (:mod:`gpuslice_deviceplugin.physical`):
nothing is kept between scrapes, so a container that is gone disappears from
the output. Per container and GPU the labels are ``node, namespace, pod,
pod_uid, container, uuid``; per GPU ``node, uuid, index, model``. Its container
counters are the interposer's own cumulative counts in the region file, which
outlives restarts of the container's processes and of this agent. A physical
figure a card cannot give is left out for that card.

With ``hami_metrics`` on it also exports HAMi's vGPUmonitor series with HAMi's
labels (plus ``zone="vGPU"``, as HAMi's monitor adds), so HAMi dashboards keep
working: under HAMi's current names (``hami_*``) beside gpuslice's on
``/metrics``, and under its names before 2.9 (``HostGPUMemoryUsage``,
``vGPU_device_memory_usage_in_bytes``, ...) on ``/metrics/hami``, since
Prometheus's naming rules (``promtool check metrics``) flag those. Which of the
sets a :class:`NodeCollector` exports is its :class:`Names`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Final, TypeVar

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from gpuslice_deviceplugin.coordinator import ContainerState, CoordinatorSnapshot, DeviceState
from gpuslice_deviceplugin.physical import ContainerKey, GpuFigures

__all__ = [
    "CONTAINER_LABELS",
    "GPU_LABELS",
    "DraMetrics",
    "EnforcerMetrics",
    "Names",
    "NodeCollector",
    "NodeView",
    "PluginMetrics",
    "registry_with",
]

CONTAINER_LABELS: Final = ("node", "namespace", "pod", "pod_uid", "container", "uuid")
GPU_LABELS: Final = ("node", "uuid", "index", "model")
ALLOCATE_BUCKETS: Final = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class PluginMetrics:
    """The agent's own counters and gauges, registered on ``registry``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.devices = Gauge(
            "gpuslice_deviceplugin_devices",
            "GPUs the node offers, by health (healthy, unhealthy).",
            ["health"],
            registry=registry,
        )
        self.inventories = Counter(
            "gpuslice_deviceplugin_inventories_published",
            "Node inventories published: on every change and as the node's heartbeat.",
            registry=registry,
        )
        self.registrations = Counter(
            "gpuslice_deviceplugin_registrations",
            "Registrations with kubelet, by outcome (ok, error).",
            ["outcome"],
            registry=registry,
        )
        self.watchers = Gauge(
            "gpuslice_deviceplugin_list_watchers",
            "Open ListAndWatch streams from kubelet.",
            registry=registry,
        )
        self.allocate_seconds = Histogram(
            "gpuslice_deviceplugin_allocate_seconds",
            "Time to answer kubelet's Allocate call.",
            buckets=ALLOCATE_BUCKETS,
            registry=registry,
        )
        self.allocations = Counter(
            "gpuslice_deviceplugin_allocations",
            "Containers allocated, by outcome (ok, error).",
            ["outcome"],
            registry=registry,
        )
        self.layers = Gauge(
            "gpuslice_enforcement_layer",
            "Whether a layer holds the containers on a GPU to their grants (1) or is "
            "missing there (0); layer: driver, agent-memory, agent-compute, interposer.",
            ["node", "uuid", "layer"],
            registry=registry,
        )
        self.driver_limits = Counter(
            "gpuslice_driver_limits",
            "Driver memory limits ensured on a container's cgroup, by outcome (set, kept, "
            "unsupported, failed).",
            ["outcome"],
            registry=registry,
        )
        self.ambiguous = Counter(
            "gpuslice_deviceplugin_ambiguous_allocations",
            "Allocate calls refused because more than one bound pod waited for as many "
            "GPUs: kubelet names no pod, and a guess could give one pod another's grant.",
            registry=registry,
        )


class DraMetrics:
    """kubelet's DRA plugin calls (:mod:`gpuslice_deviceplugin.dra.kubelet`): claims
    prepared and unprepared by outcome, how long each took, and kubelet's word on
    the plugin's registration."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.claims = Counter(
            "gpuslice_dra_claims",
            "Claims kubelet asked to prepare or unprepare, by operation (prepare, "
            "unprepare) and outcome (ok, refused, invalid, error).",
            ["operation", "outcome"],
            registry=registry,
        )
        self.claim_seconds = Histogram(
            "gpuslice_dra_claim_seconds",
            "Time to prepare or unprepare one claim, by operation (prepare, unprepare).",
            ["operation"],
            buckets=ALLOCATE_BUCKETS,
            registry=registry,
        )
        self.refused_calls = Counter(
            "gpuslice_dra_refused_calls",
            "kubelet DRA plugin calls refused whole for carrying too many claims.",
            registry=registry,
        )
        self.registrations = Counter(
            "gpuslice_dra_registrations",
            "kubelet's notifications of the DRA plugin's registration, by outcome (ok, error).",
            ["outcome"],
            registry=registry,
        )


class EnforcerMetrics:
    """What the enforcer (:mod:`gpuslice_deviceplugin.enforcer`) did and could see."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.kills = Counter(
            "gpuslice_enforce_kills",
            "Processes the node agent killed, by kind (memory, compute, ungranted).",
            ["kind"],
            registry=registry,
        )
        self.throttles = Counter(
            "gpuslice_enforce_throttles",
            "Times a container began to be throttled (its cgroup frozen in a duty cycle) "
            "for running above its compute share.",
            registry=registry,
        )
        self.throttled = Gauge(
            "gpuslice_enforce_throttled_containers",
            "Containers being throttled now.",
            registry=registry,
        )
        self.layer = Gauge(
            "gpuslice_enforce_layer",
            "Whether the node agent enforces a layer on a card (1) or cannot (0): memory "
            "needs NVML's processes and their cgroups, compute also their utilisation "
            "and a freezer.",
            ["uuid", "layer"],
            registry=registry,
        )
        self.unreadable = Counter(
            "gpuslice_enforce_unreadable",
            "Samples in which something could not be read, by what (processes, memory, "
            "utilization, cgroup, grant, freeze).",
            ["what"],
            registry=registry,
        )
        self.foreign = Gauge(
            "gpuslice_enforce_host_processes",
            "Processes on a card not in a pod's cgroup (left alone), at the last sample.",
            ["uuid"],
            registry=registry,
        )
        self.sample_seconds = Histogram(
            "gpuslice_enforce_sample_seconds",
            "Time one enforcement sample took (NVML, /proc, decisions).",
            buckets=ALLOCATE_BUCKETS,
            registry=registry,
        )
        self.regions_truncated = Counter(
            "gpuslice_enforce_regions_truncated",
            "Containers' shared regions found written past their size (the tenant's one "
            "writable file, on the node's disk) and cut back.",
            registry=registry,
        )


@dataclass(frozen=True)
class _Spec:
    name: str
    help: str
    counter: bool
    value: Callable[[DeviceState], float]


_CONTAINER_METRICS: Final = (
    _Spec(
        "gpuslice_container_memory_used_bytes",
        "Device memory the container's processes hold on the GPU, context overhead included.",
        False,
        lambda d: d.usage.used_bytes,
    ),
    _Spec(
        "gpuslice_container_memory_limit_bytes",
        "Device memory the container may hold on the GPU (0: no limit).",
        False,
        lambda d: d.usage.limit_bytes,
    ),
    _Spec(
        "gpuslice_container_memory_peak_bytes",
        "Highest device memory the container has held on the GPU since its region was created.",
        False,
        lambda d: d.usage.peak_bytes,
    ),
    _Spec(
        "gpuslice_container_denied_allocations_total",
        "Allocations on the GPU refused because they would pass the container's memory limit.",
        True,
        lambda d: d.usage.denied_allocations,
    ),
    _Spec(
        "gpuslice_container_throttled_seconds_total",
        "Time the container's kernel launches on the GPU waited: for its compute share, "
        "or yielding to a high-priority container.",
        True,
        lambda d: d.usage.throttled_ns / 1e9,
    ),
    _Spec(
        "gpuslice_container_gpu_busy_seconds_total",
        "GPU time the container's kernels took, as measured while a compute limit applied "
        "(it does not grow while the container runs unlimited).",
        True,
        lambda d: d.usage.busy_ns / 1e9,
    ),
    _Spec(
        "gpuslice_container_sm_limit_percent",
        "The container's compute share of the GPU in percent (0: no limit).",
        False,
        lambda d: d.usage.sm_limit_percent,
    ),
    _Spec(
        "gpuslice_container_processes",
        "Live processes of the container holding memory on the GPU.",
        False,
        lambda d: d.processes,
    ),
    _Spec(
        "gpuslice_container_gpu_shared",
        "1 while another container is active on the GPU, so a compute limit applies under "
        "the default policy; 0 while the container has the GPU to itself.",
        False,
        lambda d: int(d.shared),
    ),
    _Spec(
        "gpuslice_container_gpu_yield",
        "1 while a high-priority container is active on the GPU and the container's "
        "low-priority processes wait before launching.",
        False,
        lambda d: int(d.yield_),
    ),
)

_GPU_ACTIVE: Final = (
    "gpuslice_gpu_active_containers",
    "Containers active on the GPU: holding memory on it, or running kernels under a limit.",
)


@dataclass(frozen=True)
class _GpuSpec:
    name: str
    help: str
    value: Callable[[GpuFigures], float | None]


_NVML_METRICS: Final = (
    _GpuSpec(
        "gpuslice_gpu_nvml_memory_used_bytes",
        "Device memory in use on the GPU by anything, as NVML reports it.",
        lambda f: f.memory_used_bytes,
    ),
    _GpuSpec(
        "gpuslice_gpu_nvml_memory_total_bytes",
        "Device memory of the GPU, as NVML reports it.",
        lambda f: f.memory_total_bytes,
    ),
    _GpuSpec(
        "gpuslice_gpu_nvml_utilization_percent",
        "Percent of the last sample period in which a kernel ran on the GPU (NVML).",
        lambda f: f.utilization_percent,
    ),
    _GpuSpec(
        "gpuslice_gpu_nvml_memory_utilization_percent",
        "Percent of the last sample period in which device memory was read or written (NVML).",
        lambda f: f.memory_utilization_percent,
    ),
    _GpuSpec(
        "gpuslice_gpu_nvml_temperature_celsius",
        "Temperature of the GPU die in degrees Celsius (NVML, GPU sensor).",
        lambda f: f.temperature_celsius,
    ),
    _GpuSpec(
        "gpuslice_gpu_nvml_power_watts",
        "Power the GPU draws in watts (NVML).",
        lambda f: f.power_watts,
    ),
)

_NVML_ECC: Final = (
    "gpuslice_gpu_nvml_ecc_errors_total",
    "ECC memory errors of the GPU by type (corrected, uncorrected): NVML's volatile "
    "counts, since the driver last loaded.",
)

# HAMi's vGPUmonitor: its zone label, and its label sets per GPU and per container.
HAMI_ZONE: Final = "vGPU"
_HAMI_GPU: Final = ("node", "device_index", "device_uuid", "device_type", "zone")
_HAMI_GPU_NO_NODE: Final = ("device_index", "device_uuid", "device_type", "zone")
_HAMI_GPU_LEGACY: Final = ("nodeid", "deviceidx", "deviceuuid", "devicetype", "zone")
_HAMI_CONTAINER: Final = ("namespace", "pod", "container", "vdevice_index", "device_uuid", "zone")
_HAMI_CONTAINER_LEGACY: Final = (
    "podnamespace",
    "podname",
    "ctrname",
    "vdeviceid",
    "deviceuuid",
    "zone",
)


@dataclass(frozen=True)
class _HamiGpu:
    name: str
    help: str
    labels: tuple[str, ...]
    value: Callable[[GpuFigures], float | None]


_HAMI_GPU_METRICS: Final = (
    _HamiGpu(
        "hami_host_gpu_memory_used_bytes",
        "GPU device memory usage in bytes (HAMi's name).",
        _HAMI_GPU,
        lambda f: f.memory_used_bytes,
    ),
    _HamiGpu(
        "hami_host_gpu_utilization_ratio",
        "GPU core utilization ratio (0-100) (HAMi's name).",
        _HAMI_GPU,
        lambda f: f.utilization_percent,
    ),
    _HamiGpu(
        "hami_host_gpu_memory_controller_utilization_ratio",
        "GPU memory controller utilization ratio (0-100) (HAMi's name).",
        _HAMI_GPU_NO_NODE,
        lambda f: f.memory_utilization_percent,
    ),
    _HamiGpu(
        "HostGPUMemoryUsage",
        "GPU device memory usage in bytes (HAMi's legacy name).",
        _HAMI_GPU_LEGACY,
        lambda f: f.memory_used_bytes,
    ),
    _HamiGpu(
        "HostCoreUtilization",
        "GPU core utilization in percent (HAMi's legacy name).",
        _HAMI_GPU_LEGACY,
        lambda f: f.utilization_percent,
    ),
)


@dataclass(frozen=True)
class _HamiContainer:
    name: str
    help: str
    labels: tuple[str, ...]
    value: Callable[[DeviceState, float | None], float | None]  # (record, busy percent)


_HAMI_CONTAINER_METRICS: Final = (
    _HamiContainer(
        "hami_vgpu_memory_used_bytes",
        "vGPU device memory usage in bytes (HAMi's name).",
        _HAMI_CONTAINER,
        lambda d, _: d.usage.used_bytes,
    ),
    _HamiContainer(
        "hami_vgpu_memory_limit_bytes",
        "vGPU device memory limit in bytes, 0 for none (HAMi's name).",
        _HAMI_CONTAINER,
        lambda d, _: d.usage.limit_bytes,
    ),
    _HamiContainer(
        "hami_container_device_memory_bytes",
        "Container device memory usage in bytes (HAMi's name).",
        _HAMI_CONTAINER,
        lambda d, _: d.usage.used_bytes,
    ),
    _HamiContainer(
        "hami_container_device_utilization_ratio",
        "Container device SM utilization in percent (0-100): its kernels' busy time "
        "under a compute limit (HAMi's name).",
        _HAMI_CONTAINER,
        lambda _, busy: busy,
    ),
    _HamiContainer(
        "vGPU_device_memory_usage_in_bytes",
        "vGPU device memory usage in bytes (HAMi's legacy name).",
        _HAMI_CONTAINER_LEGACY,
        lambda d, _: d.usage.used_bytes,
    ),
    _HamiContainer(
        "vGPU_device_memory_limit_in_bytes",
        "vGPU device memory limit in bytes, 0 for none (HAMi's legacy name).",
        _HAMI_CONTAINER_LEGACY,
        lambda d, _: d.usage.limit_bytes,
    ),
    _HamiContainer(
        "Device_utilization_desc_of_container",
        "Container device SM utilization in percent: its kernels' busy time under a "
        "compute limit (HAMi's legacy name).",
        _HAMI_CONTAINER_LEGACY,
        lambda _, busy: busy,
    ),
)


@dataclass(frozen=True)
class NodeView:
    """What a scrape exports: the latest snapshot, physical figures and busy shares."""

    node: str
    snapshot: CoordinatorSnapshot | None = None
    figures: Sequence[GpuFigures] = ()
    busy: Mapping[ContainerKey, float] = field(default_factory=dict)


Family = CounterMetricFamily | GaugeMetricFamily


def _family(name: str, documentation: str, labels: Sequence[str], counter: bool) -> Family:
    if counter:
        return CounterMetricFamily(name, documentation, labels=labels)
    return GaugeMetricFamily(name, documentation, labels=labels)


class Names(Enum):
    """The names a :class:`NodeCollector` exports."""

    GPUSLICE = "gpuslice's names"  # /metrics with hami_metrics off
    GPUSLICE_AND_HAMI = "gpuslice's names and HAMi's hami_* names"  # /metrics
    HAMI_LEGACY = "HAMi's names before 2.9"  # /metrics/hami


_Hami = TypeVar("_Hami", _HamiGpu, _HamiContainer)


def _hami_specs(specs: Sequence[_Hami], names: Names) -> list[_Hami]:
    """HAMi's series in ``names``: its current ``hami_*`` ones beside
    gpuslice's, its legacy ones alone."""
    if names is Names.GPUSLICE:
        return []
    legacy = names is Names.HAMI_LEGACY
    return [s for s in specs if s.name.startswith("hami_") is not legacy]


@dataclass
class _Families:
    gpuslice: bool  # gpuslice's own series
    container: list[Family]
    active: Family
    nvml: list[Family]
    ecc: Family
    hami_gpu_specs: list[_HamiGpu]
    hami_gpu: list[Family]
    hami_container_specs: list[_HamiContainer]
    hami_container: list[Family]

    @classmethod
    def new(cls, names: Names) -> _Families:
        gpu_specs = _hami_specs(_HAMI_GPU_METRICS, names)
        container_specs = _hami_specs(_HAMI_CONTAINER_METRICS, names)
        return cls(
            names is not Names.HAMI_LEGACY,
            [_family(s.name, s.help, CONTAINER_LABELS, s.counter) for s in _CONTAINER_METRICS],
            _family(*_GPU_ACTIVE, GPU_LABELS, False),
            [_family(s.name, s.help, GPU_LABELS, False) for s in _NVML_METRICS],
            _family(*_NVML_ECC, (*GPU_LABELS, "type"), True),
            gpu_specs,
            [_family(s.name, s.help, s.labels, False) for s in gpu_specs],
            container_specs,
            [_family(s.name, s.help, s.labels, False) for s in container_specs],
        )

    def all(self) -> Iterator[Family]:
        if self.gpuslice:
            yield from self.container
            yield self.active
            yield from self.nvml
            yield self.ecc
        yield from self.hami_gpu
        yield from self.hami_container


def _labels(node: str, state: ContainerState, device: DeviceState) -> list[str]:
    o = state.owner
    return [node, o.namespace, o.pod_name, o.pod_uid, o.container, device.usage.uuid]


def _hami_gpu_labels(names: tuple[str, ...], node: str, f: GpuFigures) -> list[str]:
    """HAMi's values for ``names``: the node first where HAMi names it (not on every series)."""
    d = f.device
    values = [str(d.index), d.uuid, f"NVIDIA-{d.model}", HAMI_ZONE]
    return [node, *values] if names[0] in ("node", "nodeid") else values


class NodeCollector(Collector):
    """Exports what ``view()`` returns under ``names``."""

    def __init__(self, view: Callable[[], NodeView], *, names: Names) -> None:
        self._view = view
        self._names = names

    def describe(self) -> Iterator[Metric]:
        """The families, without samples: lets a registry detect clashing names."""
        yield from _Families.new(self._names).all()

    def collect(self) -> Iterator[Metric]:
        view = self._view()
        families = _Families.new(self._names)
        self._containers(view, families)
        self._gpus(view, families)
        yield from families.all()

    def _containers(self, view: NodeView, families: _Families) -> None:
        if view.snapshot is None:
            return
        for state in view.snapshot.containers:
            o = state.owner
            for vindex, device in enumerate(state.devices):
                if families.gpuslice:
                    labels = _labels(view.node, state, device)
                    for spec, family in zip(_CONTAINER_METRICS, families.container, strict=True):
                        family.add_metric(labels, spec.value(device))
                uuid = device.usage.uuid
                if not uuid:
                    continue  # HAMi leaves out devices not named yet
                busy = view.busy.get((o.pod_uid, o.container, uuid))
                hami = [o.namespace, o.pod_name, o.container, str(vindex), uuid, HAMI_ZONE]
                for hspec, family in zip(
                    families.hami_container_specs, families.hami_container, strict=True
                ):
                    value = hspec.value(device, busy)
                    if value is not None:
                        family.add_metric(hami, value)

    def _gpus(self, view: NodeView, families: _Families) -> None:
        active = {g.uuid: g.active_containers for g in view.snapshot.gpus} if view.snapshot else {}
        for f in view.figures:
            if families.gpuslice:
                self._gpu(view.node, f, active.get(f.device.uuid, 0), families)
            for hspec, family in zip(families.hami_gpu_specs, families.hami_gpu, strict=True):
                value = hspec.value(f)
                if value is not None:
                    family.add_metric(_hami_gpu_labels(hspec.labels, view.node, f), value)

    @staticmethod
    def _gpu(node: str, f: GpuFigures, active: int, families: _Families) -> None:
        d = f.device
        labels = [node, d.uuid, str(d.index), d.model]
        families.active.add_metric(labels, active)
        for spec, family in zip(_NVML_METRICS, families.nvml, strict=True):
            value = spec.value(f)
            if value is not None:
                family.add_metric(labels, value)
        for kind, count in (("corrected", f.ecc_corrected), ("uncorrected", f.ecc_uncorrected)):
            if count is not None:
                families.ecc.add_metric([*labels, kind], count)


def registry_with(*collectors: Collector) -> CollectorRegistry:
    """A new registry (not the process-wide one) holding ``collectors``."""
    registry = CollectorRegistry()
    for collector in collectors:
        registry.register(collector)
    return registry
