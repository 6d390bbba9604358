"""Prometheus metrics of the node agent.

:class:`PluginMetrics` counts what the agent itself does (kubelet registration,
allocations, inventory). :class:`RegionCollector` exports the GPU containers of
the node from the latest :class:`CoordinatorSnapshot`, built into metric
families at scrape time: nothing is kept between scrapes, so a container that is
gone disappears from the output. Per container and GPU the labels are
``namespace, pod, pod_uid, container, uuid``; per GPU only ``uuid``. Its counters
are the interposer's own cumulative counts in the region file, which outlives
restarts of the container's processes and of this agent.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Final

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from gpuslice_deviceplugin.coordinator import ContainerState, CoordinatorSnapshot, DeviceState

__all__ = ["CONTAINER_LABELS", "GPU_LABELS", "PluginMetrics", "RegionCollector", "registry_with"]

CONTAINER_LABELS: Final = ("namespace", "pod", "pod_uid", "container", "uuid")
GPU_LABELS: Final = ("uuid",)
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
        self.ambiguous = Counter(
            "gpuslice_deviceplugin_ambiguous_allocations",
            "Allocate calls answered while other pods waited for as many GPUs: kubelet "
            "names no pod, so the pod bound first was chosen.",
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


Family = CounterMetricFamily | GaugeMetricFamily


def _family(name: str, documentation: str, labels: tuple[str, ...], counter: bool) -> Family:
    if counter:
        return CounterMetricFamily(name, documentation, labels=labels)
    return GaugeMetricFamily(name, documentation, labels=labels)


def _families() -> tuple[list[Family], Family]:
    per_container = [
        _family(s.name, s.help, CONTAINER_LABELS, s.counter) for s in _CONTAINER_METRICS
    ]
    return per_container, _family(*_GPU_ACTIVE, GPU_LABELS, False)


def _labels(state: ContainerState, device: DeviceState) -> list[str]:
    o = state.owner
    return [o.namespace, o.pod_name, o.pod_uid, o.container, device.usage.uuid]


class RegionCollector(Collector):
    """Exports the snapshot ``latest()`` returns (nothing while it returns None)."""

    def __init__(self, latest: Callable[[], CoordinatorSnapshot | None]) -> None:
        self._latest = latest

    def describe(self) -> Iterator[Metric]:
        """The families, without samples: lets a registry detect clashing names."""
        per_container, per_gpu = _families()
        yield from per_container
        yield per_gpu

    def collect(self) -> Iterator[Metric]:
        snapshot = self._latest()
        per_container, per_gpu = _families()
        if snapshot is not None:
            for state in snapshot.containers:
                for device in state.devices:
                    labels = _labels(state, device)
                    for spec, family in zip(_CONTAINER_METRICS, per_container, strict=True):
                        family.add_metric(labels, spec.value(device))
            for gpu in snapshot.gpus:
                per_gpu.add_metric([gpu.uuid], gpu.active_containers)
        yield from per_container
        yield per_gpu


def registry_with(*collectors: Collector) -> CollectorRegistry:
    """A new registry (not the process-wide one) holding ``collectors``."""
    registry = CollectorRegistry()
    for collector in collectors:
        registry.register(collector)
    return registry
