"""The scheduler's report for the web console: fragmentation by its own measure, and
how many more pods of the most common kinds would still fit.

:func:`build_report` reads the scheduler's copy of the ledger (a
:class:`~gpuslice_scheduler.cluster.Cluster`) and the workload mix it has
learned; :class:`ReportPublisher` writes the report to Redis
(:mod:`gpuslice_common.reports`) every :data:`REPORT_INTERVAL_S` seconds when
its content changed, and at least every :data:`REPORT_REFRESH_S` seconds so that
its expiry never lapses while the scheduler runs.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Collection
from datetime import UTC, datetime
from typing import Final

import numpy as np
from redis.exceptions import RedisError

from gpuslice_common.ledger import Ledger
from gpuslice_common.models import MAX_CAPACITY_MIB, MAX_DEVICES, NVIDIA, GpuPolicy
from gpuslice_common.reports import (
    MAX_FITS,
    MAX_KINDS,
    MAX_LABEL,
    REPORT_TTL_S,
    WARN_EVERY_S,
    Fragmentation,
    ReportKind,
    SchedulerReport,
    write_report,
)
from gpuslice_scheduler.cluster import Bools, Cluster, Ints
from gpuslice_scheduler.fit import CardDemand, model_mask
from gpuslice_scheduler.fragmentation import WorkloadClass, WorkloadMix, node_fragmentation
from gpuslice_scheduler.mig import mode_ok
from gpuslice_scheduler.view import ClusterView

log = logging.getLogger(__name__)

REPORT_INTERVAL_S: Final = 2.0
REPORT_REFRESH_S: Final = 30.0


# ---------------------------------------------------------------- fragmentation


def fragmentation(
    mix: WorkloadMix, cluster: Cluster
) -> tuple[Fragmentation, dict[str, Fragmentation]]:
    """The cluster's and each node's fragmentation by the scheduler's own measure.

    :func:`~gpuslice_scheduler.fragmentation.node_fragmentation` gives per node its
    free share (milli-GPU of free compute on cards that take new work; 1000 is a
    whole free card) and its fragmentation score in the same unit: the free share
    each class of the mix could not use there, weighted by the class's weight
    (weights sum to 1), plus the share the node's free CPU or memory cannot feed,
    which counts ``STARVED_WEIGHT`` times. A node's *fragment* is that score capped
    at its free share (so a starved node reads as all fragment, not more), and its
    fragmentation the fragment over the free share: 0 when every kind of pod
    could use every free share, 1 when none of it is of use. The cluster's is the
    sum of the fragments over the sum of the free shares; None where there is no
    free share.
    """
    if cluster.node_count == 0:
        return Fragmentation(fragmentation=None, free_share=0.0), {}
    score, share = node_fragmentation(mix, cluster, np.arange(cluster.node_count, dtype=np.int64))
    share = np.where(np.isfinite(share), np.maximum(share, 0.0), 0.0)
    fragment = np.where(np.isfinite(score), np.clip(score, 0.0, share), share)
    nodes = {
        name: _fragmentation(float(f), float(s))
        for name, f, s in zip(cluster.node_names, fragment.tolist(), share.tolist(), strict=True)
    }
    return _fragmentation(float(fragment.sum()), float(share.sum())), nodes


def _fragmentation(fragment: float, share: float) -> Fragmentation:
    fraction = min(1.0, fragment / share) if share > 0 else None
    return Fragmentation(
        fragmentation=None if fraction is None else round(fraction, 6),
        free_share=round(share, 3),
    )


# ---------------------------------------------------------------- kinds


def card_fits(cluster: Cluster, card: CardDemand, usable: Bools | None = None) -> Ints:
    """Per card, how many more containers asking ``card`` (per card) it takes now, by
    HAMi's rules as the compiled core applies them (``usage_code``): a free slot,
    memory, cores, no exclusive holder, and for an exclusive container an idle
    card; for one asking no cores, compute left. ``usable`` (per card): the
    cards its type, mode and vendor admit at all (else every schedulable card)."""
    cap_mem, used_mem = cluster.cap_mem, cluster.used_mem
    if card.mem_mib >= 0:
        need = np.full(cluster.card_count, card.mem_mib, dtype=np.int64)
    else:  # a percentage of each card, as percent_of: rounded down, at least 1 MiB
        need = np.maximum(np.floor_divide(cap_mem * card.mem_percent, 100), 1)
    slots = np.maximum(cluster.cap_slots - cluster.used_slots, 0)
    mem_left = cap_mem - used_mem
    by_mem = np.where(
        mem_left < need, 0, np.floor_divide(np.maximum(mem_left, 0), np.maximum(need, 1))
    )
    by_mem = np.where((need == 0) & (mem_left >= 0), slots, by_mem)
    cores_left = cluster.cap_cores - cluster.used_cores
    if card.cores > 0:
        by_cores = np.floor_divide(np.maximum(cores_left, 0), card.cores)
    else:  # takes no cores, but only where some compute is left
        by_cores = np.where(cores_left > 0, slots, 0)
    fits = np.minimum(np.minimum(slots, by_mem), by_cores)
    if card.exclusive:
        fits = np.where(cluster.used_slots > 0, 0, np.minimum(fits, 1))
    ok = cluster.schedulable(np.arange(cluster.card_count)) & ~cluster.owned
    if usable is not None:
        ok &= usable
    return np.where(ok, fits, 0).astype(np.int64)


def node_pods(cluster: Cluster, per_card: Ints, count: int) -> Ints:
    """Per node, the most pods whose ``count`` cards each must be distinct, when card
    ``k`` takes ``per_card[k]`` more containers: the largest ``p`` with
    ``sum_k min(per_card[k], p) >= count * p`` (a card serves each pod at most once).
    Found by bisection for all nodes at once; the left side, less ``count * p``, is
    concave in ``p`` and 0 at 0, so the ``p`` that satisfy it run from 0 up."""
    starts, ends = cluster.node_start[:-1], cluster.node_start[1:]
    node_of = np.repeat(np.arange(cluster.node_count), ends - starts)

    def per_node(values: Ints) -> Ints:
        acc = np.concatenate([[0], np.cumsum(values, dtype=np.int64)])
        out: Ints = acc[ends] - acc[starts]
        return out

    total = per_node(per_card)
    if count == 1:
        return total
    lo = np.zeros(cluster.node_count, dtype=np.int64)
    hi = total // count
    while bool((lo < hi).any()):
        mid = (lo + hi + 1) // 2
        ok = per_node(np.minimum(per_card, mid[node_of])) >= count * mid
        lo = np.where(ok, mid, lo)
        hi = np.where(ok, hi, mid - 1)
    return lo


def kind_fits(cluster: Cluster, kind: WorkloadClass, closed: Collection[str] = ()) -> int:
    """How many more pods of ``kind`` alone would fit on the cluster now: on each node
    as many as its cards take (:func:`node_pods`), and no more than its free CPU and
    memory feed where the cluster follows them; none on the nodes ``closed`` (being
    rebuilt: the ledger takes no reservation there). Cards are those a pod with no
    vgpu-mode or vendor of its own may use: NVIDIA's, not in mode mig (its MIG
    slices go by profile, which a per-card count does not describe)."""
    card = kind.card
    if card is None or cluster.node_count == 0:
        return 0
    allowed = model_mask(kind.selector, cluster.models)
    allowed &= np.asarray([mode_ok(m, None) for m in cluster.model_mode], dtype=np.bool_)
    allowed &= np.asarray([v == NVIDIA for v in cluster.model_vendor], dtype=np.bool_)
    pods = node_pods(cluster, card_fits(cluster, card, allowed[cluster.model_id]), card.count)
    bound = pods.astype(np.float64)
    for need, free in ((kind.cpu, cluster.node_cpu_free), (kind.memory, cluster.node_mem_free)):
        if need > 0:
            bound = np.minimum(bound, np.floor(np.maximum(free, 0.0) / need))
    for name in closed:
        i = cluster.node_index.get(name)
        if i is not None:
            bound[i] = 0.0
    return int(min(float(bound.sum()), MAX_FITS))


def label(kind: WorkloadClass) -> str:
    """A kind of pod in plain words, e.g. "1 card, 25% of cores, 4096 MiB" or
    "2 whole cards"; at most :data:`MAX_LABEL` characters."""
    card = kind.card
    assert card is not None
    cards = "card" if card.count == 1 else "cards"
    whole = card.exclusive and card.cores == 100 and card.mem_mib < 0
    whole &= card.mem_percent in (-1, 100)
    if whole:
        parts = [f"{card.count} whole {cards}"]
    else:
        parts = [f"{card.count} {cards}"]
        parts.append(f"{card.cores}% of cores" if card.cores > 0 else "shared cores")
        if card.mem_mib >= 0:
            parts.append(f"{card.mem_mib} MiB")
        elif card.mem_percent > 0:
            parts.append(f"{card.mem_percent}% of memory")
        else:
            parts.append("any memory")
        if card.exclusive:
            parts.append("alone on its cards")
    if kind.selector.include_types:
        parts.append("only " + "/".join(kind.selector.include_types))
    if kind.selector.exclude_types:
        parts.append("not " + "/".join(kind.selector.exclude_types))
    if kind.cpu > 0:
        parts.append(f"{kind.cpu / 1000:g} CPU")
    if kind.memory > 0:
        parts.append(f"{kind.memory:g} MiB of node memory")
    text = ", ".join(parts)
    return text if len(text) <= MAX_LABEL else text[: MAX_LABEL - 1] + "…"


def _reportable(card: CardDemand) -> bool:
    """Within the report's bounds (a learned kind outside them fits nowhere anyway)."""
    return (
        1 <= card.count <= MAX_DEVICES
        and card.mem_mib <= MAX_CAPACITY_MIB
        and card.mem_percent <= 100
        and 0 <= card.cores <= 100
    )


def common_kinds(mix: WorkloadMix) -> list[tuple[WorkloadClass, float]]:
    """The mix's GPU kinds (classes alike in card demand, types, CPU and memory taken
    together), each with its share of the pods the mix expects, most common first,
    at most :data:`MAX_KINDS`. Pods without GPUs strand no card: they are not listed."""
    total = sum(c.frequency for c in mix.classes)
    shares: dict[tuple[object, ...], tuple[WorkloadClass, float]] = {}
    for c in mix.classes:
        if c.card is None or not _reportable(c.card) or not total > 0:
            continue
        key = (c.card, c.selector, c.cpu, c.memory)
        _, share = shares.get(key, (c, 0.0))
        shares[key] = (c, share + c.frequency / total)
    ranked = sorted(shares.values(), key=lambda cs: (-cs[1], label(cs[0])))
    return [(c, min(1.0, share)) for c, share in ranked[:MAX_KINDS] if math.isfinite(share)]


def build_report(
    cluster: Cluster,
    mix: WorkloadMix,
    policy: GpuPolicy,
    closed: Collection[str] = (),
    at: datetime | None = None,
) -> SchedulerReport:
    """The report of ``cluster`` as it is now, against ``mix``; ``closed``: nodes that
    take no pod now (being rebuilt)."""
    whole, nodes = fragmentation(mix, cluster)
    kinds = []
    for kind, share in common_kinds(mix):
        card = kind.card
        assert card is not None
        kinds.append(
            ReportKind(
                label=label(kind),
                weight=round(share, 6),
                count=card.count,
                memory_mib=card.mem_mib if card.mem_mib >= 0 else None,
                memory_percent=card.mem_percent if card.mem_percent > 0 else None,
                cores=card.cores,
                exclusive=card.exclusive,
                fits=kind_fits(cluster, kind, closed),
            )
        )
    return SchedulerReport(
        at=at or datetime.now(UTC),
        policy=policy,
        cluster=whole,
        nodes=nodes,
        kinds=tuple(kinds),
    )


# ---------------------------------------------------------------- publishing


class ReportPublisher:
    """Writes the scheduler's report while the scheduler runs.

    Every ``interval`` seconds: builds the report when the copy of the ledger, the
    nodes being rebuilt or the mix changed, and writes it when its content
    changed or ``refresh`` seconds have passed since the last write (each write
    lives ``ttl`` seconds). A failure is logged (at most once a minute while it
    lasts) and tried again next round: it never ends the task.
    """

    def __init__(
        self,
        ledger: Ledger,
        view: ClusterView,
        mix: Callable[[], WorkloadMix],
        policy: GpuPolicy,
        interval: float = REPORT_INTERVAL_S,
        refresh: float = REPORT_REFRESH_S,
        ttl: float = REPORT_TTL_S,
    ) -> None:
        self.ledger = ledger
        self.view = view
        self.mix = mix
        self.policy = policy
        self.interval = interval
        self.refresh = refresh
        self.ttl = ttl
        self.report: SchedulerReport | None = None  # the last one built
        self.written: SchedulerReport | None = None  # the last one written
        self.writes = 0
        self._built_for: tuple[object, ...] | None = None
        self._written_at = -math.inf
        self._failing_since: float | None = None
        self._warned_at = -math.inf

    def build(self) -> SchedulerReport:
        """The report now: built again only when what it is made of changed."""
        cluster, mix = self.view.cluster, self.mix()
        closed = frozenset(self.view.rebuilding)
        inputs = (id(cluster), cluster.version, id(mix), closed)
        if self.report is None or inputs != self._built_for:
            self.report = build_report(cluster, mix, self.policy, closed)
            self._built_for = inputs
        return self.report

    async def publish(self) -> bool:
        """One round: write the report when due; True when it was written."""
        report = self.build()
        now = time.monotonic()
        changed = self.written is None or not report.same_content(self.written)
        if not changed and now - self._written_at < self.refresh:
            return False
        if not changed:
            report = report.made_at(datetime.now(UTC))
        await write_report(self.ledger.redis, self.ledger.prefix, report, self.ttl)
        self.written, self._written_at = report, now
        self.writes += 1
        return True

    async def run(self) -> None:
        """Publish every ``interval`` seconds until cancelled."""
        while True:
            try:
                await self.publish()
            except Exception as exc:  # the report must never end the scheduler
                self._failed(exc)
            else:
                if self._failing_since is not None:
                    log.info("the scheduler report is written again")
                self._failing_since = None
            await asyncio.sleep(self.interval)

    def _failed(self, exc: Exception) -> None:
        now = time.monotonic()
        if self._failing_since is None:
            self._failing_since = now
        if now - self._warned_at < WARN_EVERY_S:
            return
        self._warned_at = now
        if isinstance(exc, (RedisError, OSError)):
            log.warning(
                "cannot write the scheduler report (retried every %gs): %s", self.interval, exc
            )
        else:
            log.exception("building the scheduler report failed (retried every %gs)", self.interval)
