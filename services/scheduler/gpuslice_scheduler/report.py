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
from gpuslice_scheduler.cluster import Bools, Cluster, Floats, Ints
from gpuslice_scheduler.fit import CardDemand, model_mask
from gpuslice_scheduler.fragmentation import WorkloadClass, WorkloadMix, node_fragmentation
from gpuslice_scheduler.mig import mode_ok
from gpuslice_scheduler.view import ClusterView, stop_if_cancelled

log = logging.getLogger(__name__)

REPORT_INTERVAL_S: Final = 2.0
REPORT_REFRESH_S: Final = 30.0


# ---------------------------------------------------------------- measures


class Measures:
    """What a report is made of, kept from one report to the next and measured again
    only for the nodes that changed since (all of them for another copy of the
    cluster, or another mix): each node's fragmentation (:meth:`update`) and how
    many more pods of a kind it takes (:meth:`fits`).

    Fragmentation is the scheduler's own measure:
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

    def __init__(self) -> None:
        self.nodes: dict[str, Fragmentation] = {}
        self.cluster = Fragmentation(fragmentation=None, free_share=0.0)
        self._basis: tuple[Cluster, WorkloadMix] | None = None
        self._seen = 0  # the cluster's version last measured
        self._fragment: Floats = np.zeros(0)
        self._share: Floats = np.zeros(0)
        self.changes = 0  # how many updates changed an entry
        # per kind: the cluster version measured, and each node's pods of it
        self._fits: dict[tuple[object, ...], tuple[int, Ints]] = {}
        self._fits_basis: Cluster | None = None

    def update(self, mix: WorkloadMix, cluster: Cluster) -> bool:
        """Measure what changed; True when a node's entry changed (or the nodes did)."""
        version = cluster.version  # first: a change made while measuring is measured next time
        basis = self._basis
        if basis is None or basis[0] is not cluster or basis[1] is not mix:
            todo = np.arange(cluster.node_count, dtype=np.int64)
            self._fragment = np.zeros(cluster.node_count)
            self._share = np.zeros(cluster.node_count)
            old, self.nodes = self.nodes, {}
        else:
            todo = np.flatnonzero(cluster.changed > self._seen).astype(np.int64)
            old = self.nodes
        if todo.size:
            score, share = node_fragmentation(mix, cluster, todo)
            share = np.where(np.isfinite(share), np.maximum(share, 0.0), 0.0)
            self._share[todo] = share
            self._fragment[todo] = np.where(np.isfinite(score), np.clip(score, 0.0, share), share)
        self._basis, self._seen = (cluster, mix), version  # measured: a failure measures again
        changed = old is not self.nodes and old.keys() != set(cluster.node_names)
        names = cluster.node_names
        for i, fragment, share in zip(
            todo.tolist(), self._fragment[todo].tolist(), self._share[todo].tolist(), strict=True
        ):
            name = names[i]
            kept = old.get(name)
            values = _values(fragment, share)
            if kept is None or (kept.fragmentation, kept.free_share) != values:
                kept = Fragmentation(fragmentation=values[0], free_share=values[1])
                changed = True
            self.nodes[name] = kept  # an entry that holds is kept: 100k of them take a while
        fraction, total = _values(float(self._fragment.sum()), float(self._share.sum()))
        self.cluster = Fragmentation(fragmentation=fraction, free_share=total)
        self.changes += changed
        return changed

    def fits(
        self, cluster: Cluster, kinds: list[WorkloadClass], closed: Collection[str]
    ) -> list[int]:
        """How many more pods of each of ``kinds`` alone would fit on the cluster now
        (:func:`kind_fits`); the kinds not asked for are forgotten."""
        if self._fits_basis is not cluster:
            self._fits, self._fits_basis = {}, cluster
        version = cluster.version  # first, as in update
        kept, self._fits = self._fits, {}
        out = []
        for kind in kinds:
            key = (kind.card, kind.selector, kind.cpu, kind.memory)
            got = kept.get(key)
            if got is None:
                pods = node_fits(cluster, kind, np.arange(cluster.node_count, dtype=np.int64))
            else:
                seen, pods = got
                todo = np.flatnonzero(cluster.changed > seen).astype(np.int64)
                if todo.size:
                    pods[todo] = node_fits(cluster, kind, todo)
            self._fits[key] = (version, pods)
            out.append(_total(cluster, pods, closed))
        return out


def _values(fragment: float, share: float) -> tuple[float | None, float]:
    """A fragment of a free share as the report holds them: the fraction (None without a
    free share), rounded to 6 places; the share to 3."""
    fraction = round(min(1.0, fragment / share), 6) if share > 0 else None
    return fraction, round(share, 3)


# ---------------------------------------------------------------- kinds


def card_fits(
    cluster: Cluster, card: CardDemand, cards: Ints | None = None, usable: Bools | None = None
) -> Ints:
    """Per card of ``cards`` (default: all), how many more containers asking ``card``
    (per card) it takes now, by HAMi's rules as the compiled core applies them
    (``usage_code``): a free slot, memory, cores, no exclusive holder, and for an
    exclusive container an idle card; for one asking no cores, compute left.
    ``usable`` (per card of the cluster): the cards its type, mode and vendor admit
    at all (else every schedulable card)."""
    if cards is None:
        cards = np.arange(cluster.card_count, dtype=np.int64)
    cap_mem, used_slots = cluster.cap_mem[cards], cluster.used_slots[cards]
    if card.mem_mib >= 0:
        need = np.full(cards.size, card.mem_mib, dtype=np.int64)
    else:  # a percentage of each card, as percent_of: rounded down, at least 1 MiB
        need = np.maximum(np.floor_divide(cap_mem * card.mem_percent, 100), 1)
    slots = np.maximum(cluster.cap_slots[cards] - used_slots, 0)
    mem_left = cap_mem - cluster.used_mem[cards]
    by_mem = np.where(
        mem_left < need, 0, np.floor_divide(np.maximum(mem_left, 0), np.maximum(need, 1))
    )
    by_mem = np.where((need == 0) & (mem_left >= 0), slots, by_mem)
    cores_left = cluster.cap_cores[cards] - cluster.used_cores[cards]
    if card.cores > 0:
        by_cores = np.floor_divide(np.maximum(cores_left, 0), card.cores)
    else:  # takes no cores, but only where some compute is left
        by_cores = np.where(cores_left > 0, slots, 0)
    fits = np.minimum(np.minimum(slots, by_mem), by_cores)
    if card.exclusive:
        fits = np.where(used_slots > 0, 0, np.minimum(fits, 1))
    ok = cluster.schedulable(cards) & ~cluster.owned[cards]
    if usable is not None:
        ok &= usable[cards]
    return np.where(ok, fits, 0).astype(np.int64)


def node_pods(per_card: Ints, cards: Ints, count: int) -> Ints:
    """Per node, the most pods whose ``count`` cards each must be distinct, when node
    ``i`` has ``cards[i]`` cards (``per_card`` holds them, node after node) and card
    ``k`` takes ``per_card[k]`` more containers: the largest ``p`` with
    ``sum_k min(per_card[k], p) >= count * p`` (a card serves each pod at most once).
    Found by bisection for all nodes at once; the left side, less ``count * p``, is
    concave in ``p`` and 0 at 0, so the ``p`` that satisfy it run from 0 up."""
    ends = np.cumsum(cards, dtype=np.int64)
    starts = ends - cards
    node_of = np.repeat(np.arange(cards.size), cards)

    def per_node(values: Ints) -> Ints:
        acc = np.concatenate([[0], np.cumsum(values, dtype=np.int64)])
        out: Ints = acc[ends] - acc[starts]
        return out

    total = per_node(per_card)
    if count == 1:
        return total
    lo = np.zeros(cards.size, dtype=np.int64)
    hi = total // count
    while bool((lo < hi).any()):
        mid = (lo + hi + 1) // 2
        ok = per_node(np.minimum(per_card, mid[node_of])) >= count * mid
        lo = np.where(ok, mid, lo)
        hi = np.where(ok, hi, mid - 1)
    return lo


def node_fits(cluster: Cluster, kind: WorkloadClass, nodes: Ints) -> Ints:
    """Per node of ``nodes``, how many more pods of ``kind`` alone it takes now: as many
    as its cards take (:func:`node_pods`), and no more than its free CPU and memory
    feed where the cluster follows them. Cards are those a pod with no vgpu-mode or
    vendor of its own may use: NVIDIA's, not in mode mig (its MIG slices go by
    profile, which a per-card count does not describe)."""
    card = kind.card
    if card is None:
        return np.zeros(nodes.size, dtype=np.int64)
    allowed = model_mask(kind.selector, cluster.models)
    allowed &= np.asarray([mode_ok(m, None) for m in cluster.model_mode], dtype=np.bool_)
    allowed &= np.asarray([v == NVIDIA for v in cluster.model_vendor], dtype=np.bool_)
    cards = cluster.cards_of(nodes)
    counts = cluster.node_start[nodes + 1] - cluster.node_start[nodes]
    per_card = card_fits(cluster, card, cards, allowed[cluster.model_id])
    bound = node_pods(per_card, counts, card.count).astype(np.float64)
    for need, free in ((kind.cpu, cluster.node_cpu_free), (kind.memory, cluster.node_mem_free)):
        if need > 0:
            bound = np.minimum(bound, np.floor(np.maximum(free[nodes], 0.0) / need))
    return np.minimum(bound, MAX_FITS).astype(np.int64)


def kind_fits(cluster: Cluster, kind: WorkloadClass, closed: Collection[str] = ()) -> int:
    """How many more pods of ``kind`` alone would fit on the cluster now
    (:func:`node_fits`), none of them on the nodes ``closed`` (being rebuilt: the
    ledger takes no reservation there)."""
    return _total(cluster, node_fits(cluster, kind, np.arange(cluster.node_count)), closed)


def _total(cluster: Cluster, pods: Ints, closed: Collection[str]) -> int:
    shut = [i for i in map(cluster.node_index.get, closed) if i is not None]
    return int(min(int(pods.sum()) - int(pods[shut].sum()), MAX_FITS))


def label(kind: WorkloadClass) -> str:
    """A kind of pod in plain words, e.g. "1 card, 25% of cores, 4096 MiB" or
    "2 whole cards"; printable, at most :data:`MAX_LABEL` characters."""
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
    # type lists are the pods' own text: nothing unprintable goes on a page or in a log
    text = "".join(ch if ch.isprintable() else "?" for ch in ", ".join(parts))
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
    measures: Measures | None = None,
) -> SchedulerReport:
    """The report of ``cluster`` as it is now, against ``mix``; ``closed``: nodes that
    take no pod now (being rebuilt); ``measures``: those kept from the last report,
    brought up to date here."""
    measures = measures or Measures()
    measures.update(mix, cluster)
    common = common_kinds(mix)
    fits = measures.fits(cluster, [kind for kind, _ in common], closed)
    kinds = []
    for (kind, share), n in zip(common, fits, strict=True):
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
                fits=n,
            )
        )
    return SchedulerReport(
        at=at or datetime.now(UTC),
        policy=policy,
        cluster=measures.cluster,
        nodes=measures.nodes,
        kinds=tuple(kinds),
    )


# ---------------------------------------------------------------- publishing


class ReportPublisher:
    """Writes the scheduler's report while the scheduler runs.

    Every ``interval`` seconds: builds the report when the copy of the ledger, the
    nodes being rebuilt or the mix changed (in a worker thread, measuring again
    only the nodes that changed: the event loop keeps answering kube-scheduler),
    and writes it when its content changed or ``refresh`` seconds have passed
    since the last write (each write lives ``ttl`` seconds). A failure is logged
    (at most once a minute while it lasts) and tried again next round: it never
    ends the task.
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
        self._measures = Measures()
        self._built_for: tuple[Cluster, int, WorkloadMix, frozenset[str]] | None = None
        self._written_changes = -1  # the node entries' changes the last write held
        self._written_at = -math.inf
        self._failing = False
        self._warned_at = -math.inf

    async def build(self) -> SchedulerReport:
        """The report now: built again only when what it is made of changed."""
        # read here, in the event loop that changes them; the mix may be rebuilt on reading
        self.view.follow_resources()  # nodes' free CPU and memory, as evaluations do
        cluster, mix = self.view.cluster, self.mix()
        closed = frozenset(self.view.rebuilding)
        built = self._built_for
        if (
            self.report is None
            or built is None
            or built[0] is not cluster
            or built[1] != cluster.version
            or built[2] is not mix
            or built[3] != closed
        ):
            built = (cluster, cluster.version, mix, closed)
            self.report = await asyncio.to_thread(
                build_report, cluster, mix, self.policy, closed, None, self._measures
            )
            self._built_for = built
        return self.report

    async def publish(self) -> bool:
        """One round: write the report when due; True when it was written."""
        report = await self.build()
        now = time.monotonic()
        written = self.written
        changed = (
            written is None
            or self._measures.changes != self._written_changes
            or (report.policy, report.cluster, report.kinds)
            != (written.policy, written.cluster, written.kinds)
        )
        if not changed and now - self._written_at < self.refresh:
            return False
        if not changed:
            report = report.made_at(datetime.now(UTC))
        changes = self._measures.changes
        await write_report(self.ledger.redis, self.ledger.prefix, report, self.ttl)
        self.written, self._written_at, self._written_changes = report, now, changes
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
                if self._failing:
                    log.info("the scheduler report is written again")
                self._failing = False
            stop_if_cancelled()  # a cancel the Redis client swallowed amid a write
            await asyncio.sleep(self.interval)

    def _failed(self, exc: Exception) -> None:
        self._failing = True
        now = time.monotonic()
        if now - self._warned_at < WARN_EVERY_S:
            return
        self._warned_at = now
        if isinstance(exc, (RedisError, OSError)):
            log.warning(
                "cannot write the scheduler report (retried every %gs): %s", self.interval, exc
            )
        else:
            log.exception("building the scheduler report failed (retried every %gs)", self.interval)
