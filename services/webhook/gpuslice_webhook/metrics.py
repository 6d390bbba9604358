"""Prometheus metrics of the webhook (names documented in docs/architecture.md)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

# admitted: a GPU pod, changed; routed: a pod without GPUs given gpuslice's
# scheduler (route_cpu_pods); denied; skipped: no GPU, or not a pod creation;
# ignored: labelled to be left alone; unavailable: the Kubernetes API could not be
# read (answered 503; a pod without GPUs is admitted unchanged); invalid: not an
# AdmissionReview (HTTP 400); too_large: a body over the limit (HTTP 413); error:
# an unexpected failure (answered 500)
OUTCOMES = (
    "admitted",
    "routed",
    "denied",
    "skipped",
    "ignored",
    "unavailable",
    "invalid",
    "too_large",
    "error",
)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.admissions = Counter(
            "gpuslice_webhook_admissions",
            "Admission reviews answered, by outcome.",
            ["outcome"],
            registry=self.registry,
        )
        for outcome in OUTCOMES:
            self.admissions.labels(outcome)
        self.latency = Histogram(
            "gpuslice_webhook_admission_seconds",
            "Time to answer an admission review, from its body to the answer.",
            buckets=BUCKETS,
            registry=self.registry,
        )
        self.events_pending = Gauge(
            "gpuslice_webhook_events_pending",
            "Admission events waiting to be published to NATS.",
            registry=self.registry,
        )
        self.events_dropped = Gauge(
            "gpuslice_webhook_events_dropped",
            "Admission events dropped since start because the queue for NATS was full.",
            registry=self.registry,
        )
        self.tls_reloads = Gauge(
            "gpuslice_webhook_tls_reloads",
            "Times the serving certificate was reloaded since start.",
            registry=self.registry,
        )
        self.tls_failures = Gauge(
            "gpuslice_webhook_tls_reload_failures",
            "Changed certificate files that could not be used (the old pair stayed).",
            registry=self.registry,
        )
