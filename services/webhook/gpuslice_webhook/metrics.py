"""Prometheus metrics of the webhook (names documented in docs/architecture.md)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gpuslice_common.outbox import Outbox
from gpuslice_webhook.tls import ReloadingTls

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

DRA_RESULTS = ("created", "existing", "dry_run", "foreign", "failed")


class Metrics:
    """gpuslice's names on ``registry`` (``/metrics``); while ``hami`` is on, HAMi's
    ``QuotaUsed`` on ``hami_registry`` (``/metrics/hami``), else that is None."""

    def __init__(self, registry: CollectorRegistry | None = None, *, hami: bool = True) -> None:
        self.registry = registry or CollectorRegistry()
        self.hami_registry = CollectorRegistry() if hami else None
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
        # DRA mode: pods' GPU requests turned into ResourceClaimTemplates, by what
        # became of the template: created, existing (an equal one of ours was
        # there), dry_run (nothing created), foreign (another under our name:
        # refused), failed (the API could not be asked: refused)
        self.dra_templates = Counter(
            "gpuslice_webhook_dra_translations",
            "GPU pods translated into a ResourceClaimTemplate (DRA mode), by result.",
            ["result"],
            registry=self.registry,
        )
        for result in DRA_RESULTS:
            self.dra_templates.labels(result)
        self.readings = Readings()
        self.registry.register(self.readings)
        quota_labels = ["namespace", "quota", "resource"]
        self.quota_used = Gauge(
            "gpuslice_quota_used",
            "GPU use of a namespace against a ResourceQuota, in the key's unit (NVIDIA's "
            "memory MiB, cores percent of a card), as of the last pod checked there.",
            quota_labels,
            registry=self.registry,
        )
        self.quota_limit = Gauge(
            "gpuslice_quota_limit",
            "GPU limit of a namespace's ResourceQuota, in the key's unit (NVIDIA's memory "
            "MiB, cores percent of a card).",
            quota_labels,
            registry=self.registry,
        )
        self.hami_quota_used: Gauge | None = None
        self._hami_limits: dict[tuple[str, str], str] = {}  # (namespace, resource) -> limit
        if self.hami_registry is not None:
            # HAMi's scheduler name, labels and units: memory in MiB, the limit a label
            self.hami_quota_used = Gauge(
                "QuotaUsed",
                "resourcequota usage for a certain device",
                ["quotanamespace", "quotaName", "limit", "zone"],
                registry=self.hami_registry,
            )

    def quota(self, namespace: str, quota: str, key: str, used: int, limit: int) -> None:
        """Record a namespace's use of one ResourceQuota key (``limits.<resource>``)."""
        resource = key.removeprefix("limits.")
        self.quota_used.labels(namespace, quota, resource).set(used)
        self.quota_limit.labels(namespace, quota, resource).set(limit)
        if self.hami_quota_used is not None:
            # HAMi's limit is a label: a changed limit replaces the series, not adds one
            old = self._hami_limits.get((namespace, resource))
            if old is not None and old != str(limit):
                self.hami_quota_used.remove(namespace, resource, old, "vGPU")
            self._hami_limits[namespace, resource] = str(limit)
            self.hami_quota_used.labels(namespace, resource, str(limit), "vGPU").set(used)

    def render_hami(self) -> Callable[[], bytes] | None:
        """What renders ``/metrics/hami``: None while HAMi's names are off."""
        hami = self.hami_registry
        return None if hami is None else lambda: generate_latest(hami)


class Readings(Collector):
    """What the outbox and the certificate counted, read at scrape time."""

    def __init__(self) -> None:
        self.outbox: Outbox | None = None
        self.tls: ReloadingTls | None = None

    def collect(self) -> Iterator[Metric]:
        outbox, tls = self.outbox, self.tls
        yield GaugeMetricFamily(
            "gpuslice_webhook_events_pending",
            "Admission events waiting to be published to NATS.",
            value=outbox.pending if outbox else 0,
        )
        yield CounterMetricFamily(
            "gpuslice_webhook_events_dropped",
            "Admission events dropped since start because the queue for NATS was full.",
            value=outbox.stats.dropped if outbox else 0,
        )
        yield CounterMetricFamily(
            "gpuslice_webhook_tls_reloads",
            "Times the serving certificate was reloaded since start.",
            value=tls.stats.reloads if tls else 0,
        )
        yield CounterMetricFamily(
            "gpuslice_webhook_tls_reload_failures",
            "Changed certificate files that could not be used (the old pair stayed).",
            value=tls.stats.failures if tls else 0,
        )
