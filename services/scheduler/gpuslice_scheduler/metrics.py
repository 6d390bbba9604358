"""Prometheus metrics of the extender (names documented in docs/architecture.md)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.requests = Counter(
            "gpuslice_scheduler_requests",
            "Extender requests by verb and outcome (ok, error).",
            ["verb", "outcome"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "gpuslice_scheduler_request_seconds",
            "Time to answer an extender request, by verb.",
            ["verb"],
            buckets=BUCKETS,
            registry=self.registry,
        )
        self.placements = Counter(
            "gpuslice_scheduler_placements",
            "Pods bound with devices reserved, by policy.",
            ["policy"],
            registry=self.registry,
        )
        self.failures = Counter(
            "gpuslice_scheduler_failures",
            "Nodes rejected by filter and binds that failed, by reason.",
            ["verb", "reason"],
            registry=self.registry,
        )
        self.bind_turns = Counter(
            "gpuslice_scheduler_bind_turns",
            "GPU binds by how they got their node's turn (one pod per node waits for "
            "kubelet's Allocate at a time): at-once, waited, gave-up.",
            ["outcome"],
            registry=self.registry,
        )
        self.holder_checks = Counter(
            "gpuslice_scheduler_holder_checks",
            "Pods holding cards a pending pod needs, asked about at the API server, "
            "by answer (gone, terminal, alive, error).",
            ["answer"],
            registry=self.registry,
        )
        self.holders_freed = Counter(
            "gpuslice_scheduler_holders_freed",
            "Reservations of gone or terminal pods released by the extender, by verb.",
            ["verb"],
            registry=self.registry,
        )
        self.nodes = Gauge(
            "gpuslice_scheduler_known_nodes",
            "Nodes in the scheduler's copy of the ledger.",
            registry=self.registry,
        )
        self.skipped_nodes = Gauge(
            "gpuslice_scheduler_skipped_nodes",
            "Registered nodes left out of the scheduler's copy: their record cannot be read.",
            registry=self.registry,
        )
        self.refused_notices = Gauge(
            "gpuslice_scheduler_refused_change_notices",
            "Messages on the ledger's changes channel skipped since start: they named no "
            "node (bytes no gpuslice publishes).",
            registry=self.registry,
        )
        self.preemptions = Counter(
            "gpuslice_scheduler_preemptions",
            "GPU preemptions tried at filter time, by outcome (nominated, no_victims, "
            "refused: a disruption budget stopped it midway, error).",
            ["outcome"],
            registry=self.registry,
        )
        self.victims = Counter(
            "gpuslice_scheduler_preemption_victims",
            "GPU pods evicted to make room for pods of higher priority.",
            registry=self.registry,
        )
