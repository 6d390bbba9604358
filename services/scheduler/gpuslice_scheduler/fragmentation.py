"""Fragmentation of nodes measured against the expected workload.

After the FGD paper (ATC'23, "Beware of Fragmentation"): free GPU capacity is a
*fragment* for a kind of pod when that pod could not use it. For one node and
one workload class ``m``:

* if the node cannot host ``m`` at all (CPU or memory short, too few cards
  that fit it, wrong model), every free share of every card is a fragment;
* otherwise the free shares of the cards that cannot take ``m`` are fragments.

The node's fragmentation is the mean over classes weighted by how common each
class is times the square root of the share of a card it needs (0.1 to 1):
FGD weighs by frequency alone; weighing bigger shares a little more keeps room
for the pods that are harder to place (docs/benchmarks.md compares the two).

To that is added the node's *starved* share: the free share its free CPU or
memory cannot feed at the ratio the mix asks them in (:meth:`WorkloadMix.feed_ratios`).
FGD asks only whether one more pod of a class fits, so a node whose CPU is
nearly gone looks sound until the last pod that fits has come, and its other
cards are lost then; the starved share sees them coming, and sends pods that
ask much CPU for little GPU where CPU is plentiful. A starved share is lost to
every pod to come, a fragment only to the classes that cannot use it, so the
starved share weighs :data:`STARVED_WEIGHT` times as much (docs/benchmarks.md
measures it: ahead of FGD's measure on every openb trace and derived mix).

Free share is measured in milli-GPU of compute (1000 = a whole free card); a
card held exclusively, unhealthy, cordoned or absent has none. A class is one
kind of pod: CPU and memory on the node, and a per-card demand for its largest
GPU container (count, memory, cores, type lists).

This module defines the workload (:class:`WorkloadMix`, learned by
:class:`MixLearner`); the measure itself is computed by the engine's compiled
core (``native/engine/engine.c``), for the engine and :func:`node_fragmentation`.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gpuslice_common.models import DeviceSelector
from gpuslice_scheduler import core
from gpuslice_scheduler.cluster import Bools, Cluster, Floats, Ints
from gpuslice_scheduler.fit import CardDemand, model_mask

_FEED_LOCK = threading.Lock()
SIZE_EXPONENT = 0.5  # 0 weighs classes by frequency alone, as FGD does
# A starved share is lost to every pod to come, a fragment only to the classes that
# cannot use it: starved milli-GPU weigh this many fragment milli-GPU (docs/benchmarks.md)
STARVED_WEIGHT = 10.0


@dataclass(frozen=True)
class WorkloadClass:
    """One kind of pod in the expected workload and how common it is."""

    frequency: float
    card: CardDemand | None  # None: the pod asks for no GPU
    selector: DeviceSelector = field(default_factory=DeviceSelector)
    cpu: float = 0.0
    memory: float = 0.0

    @property
    def gpu_milli(self) -> int:
        """Milli-GPU one pod of the class takes (compute share, else memory share)."""
        if self.card is None:
            return 0
        share = self.card.cores or max(self.card.mem_percent, 0) or 100
        return self.card.count * share * 10

    def weight(self, size_exponent: float) -> float:
        """Frequency x (share of one card) ** exponent, the share between 0.1 and 1 card.

        A pod left without room costs more the more of a card it needs; a pod
        of several whole cards counts as much as one whole card.
        """
        share = min(max(self.gpu_milli, 100), 1000)
        return float(self.frequency * share**size_exponent)


@dataclass
class WorkloadMix:
    """Classes as arrays: the GPU parts deduplicated, then each class pointing at one."""

    classes: tuple[WorkloadClass, ...]
    size_exponent: float = SIZE_EXPONENT
    starvation: bool = True  # price the share a node's CPU or memory cannot feed
    starved_weight: float = field(default=STARVED_WEIGHT, init=False)
    weight: Floats = field(init=False)
    cpu: Floats = field(init=False)
    memory: Floats = field(init=False)
    need: Ints = field(init=False)  # cards each class needs (0 for CPU-only)
    part: Ints = field(init=False)  # index of the class's GPU part
    parts: list[tuple[CardDemand, DeviceSelector]] = field(init=False)
    part_mem_mib: Ints = field(init=False)
    part_mem_percent: Ints = field(init=False)
    part_cores: Ints = field(init=False)
    part_exclusive: Bools = field(init=False)
    # per milli-GPU the mix asks: CPU and memory its GPU pods ask, and its pods without
    demand_ratios: tuple[float, float, float, float] = field(init=False)
    _feed: tuple[float, float] | None = field(init=False, default=None, repr=False)
    _model_ok: dict[tuple[str, ...], Bools] = field(init=False, default_factory=dict)
    # per list of models: the mix as the compiled core reads it (gpuslice_scheduler.core)
    core_structs: dict[tuple[str, ...], Any] = field(
        init=False, default_factory=dict, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        if not self.classes:
            raise ValueError("a workload mix needs at least one class")
        weights = [c.weight(self.size_exponent) for c in self.classes]
        if not all(math.isfinite(w) and w >= 0 for w in weights):
            raise ValueError("a workload mix needs finite, non-negative class weights")
        total = sum(weights)
        if not (math.isfinite(total) and total > 0):
            raise ValueError("a workload mix needs a positive total weight")
        index: dict[tuple[CardDemand, DeviceSelector], int] = {}
        cpu_only = CardDemand(count=1, mem_mib=0, mem_percent=-1, cores=0, exclusive=False)
        parts: list[int] = []
        for c in self.classes:
            key = (c.card or cpu_only, c.selector)
            parts.append(index.setdefault(key, len(index)))
        self.parts = list(index)
        self.weight = np.asarray(weights) / total
        self.cpu = np.asarray([c.cpu for c in self.classes], dtype=float)
        self.memory = np.asarray([c.memory for c in self.classes], dtype=float)
        self.need = np.asarray([c.card.count if c.card else 0 for c in self.classes], np.int64)
        self.part = np.asarray(parts, dtype=np.int64)
        self.part_mem_mib = np.asarray([d.mem_mib for d, _ in self.parts], dtype=np.int64)
        self.part_mem_percent = np.asarray([d.mem_percent for d, _ in self.parts], np.int64)
        self.part_cores = np.asarray([d.cores for d, _ in self.parts], dtype=np.int64)
        self.part_exclusive = np.asarray([d.exclusive for d, _ in self.parts], dtype=np.bool_)
        self.demand_ratios = self._demand_ratios()

    def _demand_ratios(self, hostable: Bools | None = None) -> tuple[float, float, float, float]:
        """Per milli-GPU the mix asks (by frequency): the CPU and memory its GPU pods
        ask, and those its pods without GPUs ask; zeros where it asks no GPU.
        Only the ``hostable`` classes count, when given."""
        freq = np.asarray([c.frequency for c in self.classes], dtype=float)
        if hostable is not None:
            freq = np.where(hostable, freq, 0.0)
        gpu = float(freq @ np.asarray([c.gpu_milli for c in self.classes], dtype=float))
        if not (math.isfinite(gpu) and gpu > 0):
            return 0.0, 0.0, 0.0, 0.0
        with_gpu = self.need > 0
        ratios = tuple(
            float(freq[rows] @ values[rows]) / gpu
            for values in (self.cpu, self.memory)
            for rows in (with_gpu, ~with_gpu)
        )
        if not all(math.isfinite(r) and r >= 0 for r in ratios):
            raise ValueError("a workload mix needs finite, non-negative CPU and memory")
        cpu_gpu, cpu_none, mem_gpu, mem_none = ratios
        return cpu_gpu, cpu_none, mem_gpu, mem_none

    def feed_ratios(self, cluster: Cluster) -> tuple[float, float]:
        """CPU (milli) and memory (MiB) a node must have per milli-GPU of free share to
        feed it with the pods the mix brings; (0, 0) where not priced.

        The GPU pods' own ratio, raised where the pods without GPUs ask more than the
        cluster's spare: those pods take the spare first (CPU and memory beyond
        what the GPU pods need, over the cluster's free share), and only what they
        need past it comes out of the GPU pods' share. Classes no node could take now
        (asking more CPU or memory than any node has free) count for nothing, so
        that pods asking absurd amounts cannot move the ratio. Fixed when the mix is first
        priced against a cluster, so that every node of an evaluation, and of the
        evaluations kept for later, is priced alike; but not by a cluster whose
        followed nodes have no free share (cards all full, or none yet), whose spare
        cannot be measured: no node of it can starve, so the ratio it gets is used
        for nothing, and the mix is priced again on the next cluster.
        """
        with _FEED_LOCK:  # the service evaluates a new mix in a second thread
            if self._feed is not None:
                return self._feed
            feed = (0.0, 0.0)
            final = True
            if self.starvation:
                # pods no node could take bring no demand: a tenant asking absurd CPU
                # or memory cannot move the ratio past what the largest node offers
                cpu_max, mem_max = largest_free(cluster)
                hostable = (self.cpu <= cpu_max) & (self.memory <= mem_max)
                cpu_gpu, cpu_none, mem_gpu, mem_none = self._demand_ratios(hostable)
                cpu_spare, mem_spare = spare_ratios(cluster)
                final = not (
                    (cpu_none > 0 and math.isinf(cpu_spare))
                    or (mem_none > 0 and math.isinf(mem_spare))
                    # no GPU class fits any node now (all full): nothing to measure
                    or (bool(np.any(self.need > 0)) and not np.any(hostable & (self.need > 0)))
                )
                feed = (
                    cpu_gpu + max(0.0, cpu_none - max(0.0, cpu_spare - cpu_gpu)),
                    mem_gpu + max(0.0, mem_none - max(0.0, mem_spare - mem_gpu)),
                )
            if final:
                self._feed = feed
            return feed

    @property
    def fixed_feed(self) -> tuple[float, float] | None:
        """The feed ratios once fixed (:meth:`feed_ratios`); None before."""
        return self._feed

    @classmethod
    def of(
        cls,
        classes: Sequence[WorkloadClass],
        size_exponent: float = SIZE_EXPONENT,
        starvation: bool = True,
    ) -> WorkloadMix:
        return cls(tuple(classes), size_exponent, starvation)

    def model_ok(self, models: list[str]) -> Bools:
        """(models, parts): may a part's type lists use a model."""
        key = tuple(models)
        cached = self._model_ok.get(key)
        if cached is None:
            cached = np.stack([model_mask(s, models) for _, s in self.parts], axis=1)
            self._model_ok[key] = cached
        return cached


def largest_free(cluster: Cluster) -> tuple[float, float]:
    """The most free CPU (milli) and memory (MiB) on one node; inf where some node's
    are not followed (or there is no node), which bounds nothing."""
    out = []
    for resource in (cluster.node_cpu_free, cluster.node_mem_free):
        out.append(float(np.max(resource)) if resource.size else math.inf)
    return out[0], out[1]


def spare_ratios(cluster: Cluster) -> tuple[float, float]:
    """The cluster's free CPU (milli) and memory (MiB) per milli-GPU of free share, over
    the nodes whose CPU and memory are followed; inf where none are, or none has a
    free share."""
    cap = np.maximum(cluster.cap_cores, 1)
    free = np.maximum(cluster.cap_cores - cluster.used_cores, 0) * 1000.0 / cap
    usable = cluster.schedulable(np.arange(cluster.card_count)) & ~cluster.owned
    acc = np.concatenate([[0.0], np.cumsum(np.where(usable, free, 0.0))])
    share = acc[cluster.node_start[1:]] - acc[cluster.node_start[:-1]]
    out = []
    for resource in (cluster.node_cpu_free, cluster.node_mem_free):
        known = np.isfinite(resource)
        total = float(share[known].sum())
        out.append(float(np.maximum(resource[known], 0).sum()) / total if total > 0 else math.inf)
    return out[0], out[1]


def node_fragmentation(mix: WorkloadMix, cluster: Cluster, nodes: Ints) -> tuple[Floats, Floats]:
    """Per node of ``nodes``: its fragmentation against ``mix`` as it is now, and its
    free share (milli-GPU). Computed by the engine's compiled core."""
    return core.fragmentation(cluster, mix, nodes)


def default_mix() -> WorkloadMix:
    """The mix assumed before any pod has been seen: common shapes of GPU pods."""

    def share(percent: int, weight: float) -> WorkloadClass:
        return WorkloadClass(weight, CardDemand(1, -1, percent, percent, percent == 100))

    def whole(count: int, weight: float) -> WorkloadClass:
        return WorkloadClass(weight, CardDemand(count, -1, 100, 100, True))

    return WorkloadMix.of(
        [
            whole(1, 0.30),
            whole(2, 0.06),
            whole(4, 0.04),
            whole(8, 0.04),
            share(50, 0.20),
            share(25, 0.18),
            share(10, 0.10),
            share(75, 0.08),
        ]
    )


# what one learned class is: card demand (None: no GPU), type lists, CPU, memory
ClassKey = tuple[CardDemand | None, DeviceSelector, float, float]


class MixLearner:
    """The workload mix the service expects, learned from the pods it is asked to place.

    Starts from a prior (:func:`default_mix`) worth ``prior_weight`` pods; each
    of the last ``remember`` distinct pods counts once toward its class: its
    largest GPU container's card demand (None for a pod without GPUs), type
    lists, and the CPU (milli) and memory (MiB) it asks of the node, as the
    trace replay's exact mix has them.
    The mix is rebuilt after every ``rebuild_every`` new pods and keeps the
    ``max_classes`` most common classes (openb's default trace has 151 of these
    kinds: the 96 most common hold 99 % of its pods, the 48 most common 94 %).
    """

    def __init__(
        self,
        prior: WorkloadMix | None = None,
        prior_weight: float = 50.0,
        rebuild_every: int = 256,
        max_classes: int = 96,
        remember: int = 20_000,
        shift: float = 0.02,
    ) -> None:
        self.prior = prior or default_mix()
        self.prior_weight = prior_weight
        self.rebuild_every = rebuild_every
        self.max_classes = max_classes
        self.remember = remember
        self.shift = shift
        self.counts: dict[ClassKey, int] = {}
        # the last ``remember`` pods counted, and their class: a pod forgotten
        # leaves the counts, so that pods of ever-new requests cannot grow them
        self.seen: dict[str, ClassKey] = {}
        self.pending = 0
        self._mix: WorkloadMix = self.prior

    @property
    def mix(self) -> WorkloadMix:
        """The current mix; replaced only when the learned one differs by more than ``shift``.

        Every new mix makes the scheduler evaluate each kind of pod afresh, so a
        mix that has settled is kept.
        """
        if self.pending >= self.rebuild_every:
            fresh = self._build()
            if _distance(fresh, self._mix) > self.shift:
                self._mix = fresh
            self.pending = 0
        return self._mix

    def observe(
        self,
        pod_uid: str,
        card: CardDemand | None,
        selector: DeviceSelector,
        cpu: float = 0.0,
        memory: float = 0.0,
    ) -> None:
        """Count a pod once: ``card`` None for a pod that asks for no GPU; ``cpu``
        and ``memory`` its node request (0 where nodes' are not followed)."""
        if pod_uid in self.seen:
            return
        if not (math.isfinite(cpu) and math.isfinite(memory) and cpu >= 0 and memory >= 0):
            return  # not a request a node can be measured against
        if card is None and cpu == 0 and memory == 0:
            return  # asks for nothing: it strands no GPU anywhere
        kept = (
            DeviceSelector(
                include_types=selector.include_types, exclude_types=selector.exclude_types
            )
            if card is not None
            else DeviceSelector()
        )
        key = (card, kept, float(cpu), float(memory))
        self.seen[pod_uid] = key
        self.counts[key] = self.counts.get(key, 0) + 1
        if len(self.seen) > self.remember:
            oldest = next(iter(self.seen))
            gone = self.seen.pop(oldest)
            if self.counts[gone] > 1:
                self.counts[gone] -= 1
            else:
                del self.counts[gone]
        self.pending += 1

    def _build(self) -> WorkloadMix:
        total = sum(c.frequency for c in self.prior.classes)
        classes = [
            WorkloadClass(
                c.frequency / total * self.prior_weight, c.card, c.selector, c.cpu, c.memory
            )
            for c in self.prior.classes
        ]
        common = sorted(self.counts.items(), key=lambda kv: -kv[1])[: self.max_classes]
        classes += [
            WorkloadClass(float(n), card, sel, cpu, memory)
            for (card, sel, cpu, memory), n in common
        ]
        return WorkloadMix.of(classes, self.prior.size_exponent, self.prior.starvation)


def _distance(a: WorkloadMix, b: WorkloadMix) -> float:
    """Largest difference in any class's normalised weight between two mixes."""

    def weights(mix: WorkloadMix) -> dict[tuple[object, ...], float]:
        out: dict[tuple[object, ...], float] = {}
        for cls, w in zip(mix.classes, mix.weight.tolist(), strict=True):
            key = (cls.card, cls.selector, cls.cpu, cls.memory)
            out[key] = out.get(key, 0.0) + w
        return out

    wa, wb = weights(a), weights(b)
    return max((abs(wa.get(k, 0.0) - wb.get(k, 0.0)) for k in wa.keys() | wb.keys()), default=0.0)
