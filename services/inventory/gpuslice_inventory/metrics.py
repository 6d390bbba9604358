"""Prometheus metrics of the inventory (names and labels listed in docs/architecture.md).

Cluster state (per card of every vendor, per container, pods by state) is read
from the ledger and the telemetry store every ``metrics_interval`` by :meth:`ClusterMetrics.refresh`
and served from that snapshot, so a scrape never waits on Redis. Counters of the
inventory's own work are read from its parts' stats at scrape time. A node whose
record in the ledger cannot be read is left out of the snapshot, logged once
and counted in ``gpuslice_ledger_unreadable_nodes``; the other nodes are not.
With ``hami_metrics`` on, the same read makes HAMi's scheduler names too
(:class:`HamiFamilies`), kept in a snapshot of their own that :class:`HamiMetrics`
exports on ``/metrics/hami``: they are camelCase, which Prometheus's naming rules
flag, so ``/metrics`` holds only gpuslice's names. HAMi's per-card names are
NVIDIA's cards' (their ``devicetype`` is ``NVIDIA-<model>``); gpuslice's carry a
``vendor`` label, and their cores are in the vendor's units (percent of a card
for NVIDIA and most vendors, 16 a card for Moore Threads, AI cores for Ascend).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gpuslice_common.ledger import BadRecord, Ledger
from gpuslice_common.models import NVIDIA, GpuState, Placement, PlacementState
from gpuslice_inventory.telemetry import TelemetryStore

log = logging.getLogger(__name__)
MIB = 1024 * 1024
# a card's: its index is per vendor (a node's NVIDIA card 0 and Hygon card 0)
GPU_LABELS = ("node", "uuid", "index", "model", "vendor")
# the device plugin's per-container label set: pod namespace and name beside the UID
CONTAINER_LABELS = ("node", "namespace", "pod", "pod_uid", "container", "uuid")
# HAMi's scheduler metrics (its label names; memory in bytes, cores in percent of a card)
HAMI_ZONE = "vGPU"
HAMI_GPU_LABELS = ("nodeid", "deviceuuid", "deviceidx", "zone")
HAMI_CONTAINER_LABELS = (
    "podnamespace",
    "nodename",
    "podname",
    "containeridx",
    "deviceuuid",
    "zone",
)


@dataclass
class WorkStats:
    """What the inventory itself did since start."""

    registrations: int = 0
    registration_errors: int = 0
    nodes_rebuilt: int = 0  # nodes stamped rebuilt by a reconciliation pass
    restore_conflicts: int = 0  # restores refused: the cards held too much already
    # inventories refused, by reason
    refused: Counter[str] = field(
        default_factory=lambda: Counter(dict.fromkeys(("malformed", "invalid", "subject"), 0))
    )


def _gauge(name: str, doc: str, labels: Iterable[str] = ()) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=list(labels))


class ClusterMetrics(Collector):
    """The cluster's GPUs as the ledger and telemetry see them, refreshed on a timer."""

    def __init__(
        self,
        ledger: Ledger,
        telemetry: TelemetryStore | None,
        active: Callable[[], bool] = lambda: True,
        *,
        hami: bool = True,
    ) -> None:
        """Only while ``active()`` (the replica holding the lease) is anything
        exported, so replicas scraped together never count a GPU twice."""
        self.ledger = ledger
        self.telemetry = telemetry
        self.active = active
        self.hami = hami  # HAMi's scheduler names too
        self._snapshot: list[Metric] = []
        self.hami_snapshot: list[Metric] = []  # HAMi's names, exported by HamiMetrics
        self.skipped: dict[str, str] = {}  # node -> why its record cannot be read

    def collect(self) -> Iterator[Metric]:
        return iter(self._snapshot if self.active() else [])

    async def refresh(self) -> None:
        """Read the ledger and telemetry and replace the snapshot."""
        gpu = {
            "memory_capacity": _gauge(
                "gpuslice_gpu_memory_capacity_mib",
                "Schedulable device memory of a GPU (after memory scaling), MiB.",
                GPU_LABELS,
            ),
            "memory_allocated": _gauge(
                "gpuslice_gpu_memory_allocated_mib",
                "Device memory of a GPU reserved for pods, MiB.",
                GPU_LABELS,
            ),
            "memory_used": _gauge(
                "gpuslice_gpu_memory_used_bytes",
                "Device memory of a GPU in use by gpuslice containers (telemetry), bytes.",
                GPU_LABELS,
            ),
            "cores_capacity": _gauge(
                "gpuslice_gpu_cores_capacity_percent",
                "Schedulable compute of a GPU (after core scaling), percent of the card"
                " (other vendors: in their units, 16 a card for Moore Threads).",
                GPU_LABELS,
            ),
            "cores_allocated": _gauge(
                "gpuslice_gpu_cores_allocated_percent",
                "Compute of a GPU reserved for pods, percent of the card"
                " (other vendors: in their units, 16 a card for Moore Threads).",
                GPU_LABELS,
            ),
            "sm_used": _gauge(
                "gpuslice_gpu_sm_used_percent",
                "Compute of a GPU in use by gpuslice containers (telemetry), percent.",
                GPU_LABELS,
            ),
            "slots_capacity": _gauge(
                "gpuslice_gpu_slots", "Containers a GPU can hold (deviceSplitCount).", GPU_LABELS
            ),
            "slots_used": _gauge(
                "gpuslice_gpu_slots_used", "Containers holding a share of a GPU.", GPU_LABELS
            ),
            "healthy": _gauge(
                "gpuslice_gpu_healthy",
                "1 when a GPU is healthy and its node available, else 0.",
                GPU_LABELS,
            ),
            "cordoned": _gauge(
                "gpuslice_gpu_cordoned",
                "1 when an operator took a GPU out of scheduling.",
                GPU_LABELS,
            ),
        }
        node_up = _gauge(
            "gpuslice_node_available",
            "1 while a node's agent sends heartbeats, 0 once it is marked unavailable.",
            ["node"],
        )
        heartbeat_age = _gauge(
            "gpuslice_node_heartbeat_age_seconds",
            "Seconds since a node's agent last registered it.",
            ["node"],
        )
        pods = _gauge("gpuslice_pods", "Pods in the ledger by placement state.", ["state"])
        sm = _gauge(
            "gpuslice_container_sm_percent",
            "Compute a container uses on a GPU (telemetry), percent.",
            CONTAINER_LABELS,
        )
        live = [state for state in PlacementState if state is not PlacementState.RELEASED]
        states: Counter[str] = Counter({state.value: 0 for state in live})
        unreadable = _gauge(
            "gpuslice_ledger_unreadable_nodes",
            "Registered nodes whose record in the ledger cannot be read, left out here.",
        )
        hami = HamiFamilies() if self.hami else None
        nodes = await self.ledger.nodes()
        all_cards = await self.ledger.read_gpus(nodes, vendor=None)  # every vendor's
        all_liveness = await self.ledger.read_liveness(nodes)
        now = await self.ledger.now()  # heartbeats carry Redis's time
        skipped: dict[str, str] = {}
        for node in nodes:
            cards, alive = all_cards[node], all_liveness[node]
            try:
                if isinstance(cards, BadRecord):
                    raise cards
                if isinstance(alive, BadRecord):
                    raise alive
                placements = await self.ledger.node_placements(node)
            except BadRecord as exc:
                skipped[node] = exc.problem
                if self.skipped.get(node) != exc.problem:
                    log.warning("left out of the metrics: %s", exc)
                continue
            usage = await self.telemetry.gpu_usage(node) if self.telemetry else {}
            for card in cards:
                device = card.device
                labels = [node, device.uuid, str(device.index), device.model, device.vendor]
                if hami is not None and device.vendor == NVIDIA:
                    hami.card(node, card)
                real = usage.get(card.device.uuid)
                values = {
                    "memory_capacity": card.capacity.memory_mib,
                    "memory_allocated": card.used.memory_mib,
                    "memory_used": real.used_bytes if real else 0,
                    "cores_capacity": card.capacity.cores,
                    "cores_allocated": card.used.cores,
                    "sm_used": real.sm_percent if real else 0.0,
                    "slots_capacity": card.capacity.slots,
                    "slots_used": card.used.slots,
                    "healthy": int(card.device.healthy),
                    "cordoned": int(card.cordoned),
                }
                for key, value in values.items():
                    gpu[key].add_metric(labels, value)
            node_up.add_metric([node], 0 if alive.unavailable_since else 1)
            if alive.heartbeat is not None:
                heartbeat_age.add_metric([node], (now - alive.heartbeat).total_seconds())
            pods_here: dict[str, Placement] = {}
            for placement in placements:
                if placement.state is not PlacementState.RELEASED:
                    states[placement.state.value] += 1
                    pods_here[placement.pod.uid] = placement
                    if hami is not None:
                        hami.placement(placement)
            if self.telemetry is not None:
                for c in await self.telemetry.container_usage(node):
                    placed = pods_here.get(c.pod_uid)
                    if placed is None:  # released since the sample: no name to give it
                        continue
                    ref = placed.pod
                    labels = [node, ref.namespace, ref.name, c.pod_uid, c.container, c.uuid]
                    sm.add_metric(labels, c.sm_percent)
        for state, count in sorted(states.items()):
            pods.add_metric([state], count)
        self.skipped = skipped
        unreadable.add_metric([], len(skipped))
        self._snapshot = [
            *gpu.values(),
            node_up,
            heartbeat_age,
            pods,
            sm,
            unreadable,
        ]
        self.hami_snapshot = hami.families() if hami is not None else []


class HamiMetrics(Collector):
    """HAMi's scheduler names from the last :meth:`ClusterMetrics.refresh`, while
    that replica holds the lease, as the rest of the cluster's figures."""

    def __init__(self, cluster: ClusterMetrics) -> None:
        self.cluster = cluster

    def collect(self) -> Iterator[Metric]:
        return iter(self.cluster.hami_snapshot if self.cluster.active() else [])


class HamiFamilies:
    """HAMi's scheduler metrics (``GPUDevice*``, ``nodeGPU*``, ``vGPU*``) with
    HAMi's names, labels and units, from the same ledger read, so that HAMi's
    dashboards and alerts keep working."""

    def __init__(self) -> None:
        gpu = HAMI_GPU_LABELS
        self.core_limit = _gauge("GPUDeviceCoreLimit", "Device core limit for a certain GPU", gpu)
        self.memory_limit = _gauge(
            "GPUDeviceMemoryLimit", "Device memory limit for a certain GPU", gpu
        )
        self.core_allocated = _gauge(
            "GPUDeviceCoreAllocated", "Device core allocated for a certain GPU", gpu
        )
        self.memory_allocated = _gauge(
            "GPUDeviceMemoryAllocated",
            "Device memory allocated for a certain GPU",
            (*gpu[:3], "devicecores", "zone"),
        )
        self.shared = _gauge("GPUDeviceSharedNum", "Number of containers sharing this GPU", gpu)
        self.overview = _gauge(
            "nodeGPUOverview",
            "GPU overview on a certain node",
            (
                *gpu[:3],
                "devicecores",
                "sharedcontainers",
                "devicememorylimit",
                "devicetype",
                "zone",
            ),
        )
        self.memory_percentage = _gauge(
            "nodeGPUMemoryPercentage", "GPU Memory Allocated Percentage on a certain GPU", gpu
        )
        ctr = HAMI_CONTAINER_LABELS
        self.pods_allocated = _gauge(
            "vGPUPodsDeviceAllocated",
            "vGPU Allocated from pods",
            (*ctr[:5], "deviceusedcore", "zone"),
        )
        self.container_memory = _gauge(
            "vGPUMemoryAllocated", "vGPU memory allocated from a container", ctr
        )
        self.container_cores = _gauge(
            "vGPUCoreAllocated", "vGPU core allocated from a container", ctr
        )

    def card(self, node: str, card: GpuState) -> None:
        uuid, index = card.device.uuid, str(card.device.index)
        cap, used = card.capacity, card.used
        labels = [node, uuid, index, HAMI_ZONE]
        self.core_limit.add_metric(labels, cap.cores)
        self.memory_limit.add_metric(labels, cap.memory_mib * MIB)
        self.core_allocated.add_metric(labels, used.cores)
        self.shared.add_metric(labels, used.slots)
        self.memory_allocated.add_metric(
            [node, uuid, index, str(cap.cores), HAMI_ZONE], used.memory_mib * MIB
        )
        self.overview.add_metric(
            [
                node,
                uuid,
                index,
                str(cap.cores),
                str(used.slots),
                str(cap.memory_mib),
                f"NVIDIA-{card.device.model}",
                HAMI_ZONE,
            ],
            used.memory_mib * MIB,
        )
        if cap.memory_mib > 0:
            self.memory_percentage.add_metric(labels, used.memory_mib / cap.memory_mib)

    def placement(self, placement: Placement) -> None:
        pod = placement.pod
        for index, container in enumerate(placement.containers):
            for grant in container.devices:
                base = [pod.namespace, placement.node, pod.name, str(index), grant.uuid]
                memory = grant.memory_mib * MIB
                self.pods_allocated.add_metric([*base, str(grant.cores), HAMI_ZONE], memory)
                self.container_memory.add_metric([*base, HAMI_ZONE], memory)
                self.container_cores.add_metric([*base, HAMI_ZONE], grant.cores)

    def families(self) -> list[Metric]:
        return [
            self.core_limit,
            self.memory_limit,
            self.core_allocated,
            self.memory_allocated,
            self.shared,
            self.overview,
            self.memory_percentage,
            self.pods_allocated,
            self.container_memory,
            self.container_cores,
        ]


class WorkMetrics(Collector):
    """Counters of the inventory's own work, read from its parts at scrape time."""

    def __init__(self, read: Callable[[], dict[str, float | Counter[str]]]) -> None:
        self.read = read

    def collect(self) -> Iterator[Metric]:
        values = self.read()
        for name, value in values.items():
            doc = WORK_METRICS[name]
            if isinstance(value, Counter):
                family = CounterMetricFamily(f"gpuslice_inventory_{name}", doc, labels=["reason"])
                for reason, count in sorted(value.items()):
                    family.add_metric([reason], count)
            else:
                family = CounterMetricFamily(f"gpuslice_inventory_{name}", doc, value=value)
            yield family


WORK_METRICS = {
    "registrations": "Node inventories written to the ledger.",
    "registration_errors": "Node inventories that could not be written (ledger unreachable).",
    "inventories_refused": "Node inventories refused before the ledger, by reason: not JSON "
    "(malformed), outside the bounds (invalid), another node than the subject's (subject).",
    "releases": "Pods released by the inventory, by reason.",
    "pod_watch_events": "Pod changes received from the Kubernetes watch.",
    "pod_watch_restarts": "Pod watches begun again after a failure or an expired version.",
    "pod_watch_listed_first": "Pod watches from now begun with a paged list, because the API "
    "server refused to stream the current state (watch-list; etcd without progress notifications).",
    "nodes_marked_unavailable": "Nodes marked unavailable after missed heartbeats.",
    "sweeps": "Liveness and expiry passes run by this replica.",
    "nodes_rebuilt": "Nodes stamped rebuilt by a reconciliation pass (they take pods again).",
    "restore_conflicts": "Placements not restored because their cards held too much already.",
    "telemetry_samples": "Telemetry samples received.",
    "telemetry_stored": "Telemetry samples written to Redis.",
    "telemetry_malformed": "Telemetry samples dropped as malformed.",
    "node_request_errors": "Node agents' requests answered with an error, by kind.",
    "node_requests_dropped": "Node agents' requests dropped unanswered and unserved, by reason: "
    "no reply subject, or a reply subject outside the node's own inbox.",
    "node_failures_repeated": "Allocation failures naming no pod not recorded again: the same "
    "node, kind and count were recorded within the last minute.",
    "node_enforce_reports_dropped": "Node agents' enforcement reports not recorded: past "
    "their node's rate (a burst of 100, then 5 a second) or their pod's (20, then 1).",
    "telemetry_dropped": "Well-formed telemetry samples not stored, by reason: too many "
    "waiting (full, containers, flush-failed), or not the placement's (not-placed, "
    "foreign-container, foreign-device).",
    "change_notices_refused": "Messages on the ledger's changes channel skipped: they named "
    "no node (bytes no gpuslice publishes).",
    "bus_messages_malformed": "Messages on subscribed NATS subjects dropped before any handler: "
    "not the message the subject carries.",
    "callout_nodes_accepted": "NATS connections of node agents let in by the auth callout.",
    "callout_containers_accepted": "NATS connections of GPU containers let in by the auth callout.",
    "callout_refusals": "NATS connections refused by the auth callout, by reason.",
}


def registry_for(cluster: ClusterMetrics, work: WorkMetrics) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(cluster)
    registry.register(work)
    return registry
