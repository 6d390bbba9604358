"""Which pods to evict so that a pod of higher priority fits a node: pure code.

kube-scheduler's own preemption cannot see the GPU resources the extender
manages (they are ``ignoredByScheduler``), so the extender chooses GPU victims
itself, the way kube-scheduler chooses its own:

1. on each node, every GPU pod of strictly lower priority is taken away; if
   the pod still does not fit, the node cannot help;
2. the pods taken away are given back one at a time, the most important first
   (higher priority, then the one that started earlier): a pod the preemptor
   still fits beside stays; the rest are the victims. So no victim could be
   spared on its own (each was needed once the more important ones were back),
   and victims are the lowest in priority and, among equals, the youngest;
3. of the nodes that can help, the one with the fewest victims, then the lowest
   highest-victim priority, then the lowest sum of victims' priorities, then
   the first in the order the nodes came.

Fit is the engine's: the node's cards as a one-node cluster (:class:`NodeRoom`)
whose usage is the ledger's minus the footprints of the pods taken away, plus
those of rooms held for other nominations, evaluated by
:func:`~gpuslice_scheduler.engine.evaluate`. Pods that are already going (being
deleted, or no longer bound) count as gone, and are never victims.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from gpuslice_common.models import GpuPolicy, NodePolicy, Placement
from gpuslice_scheduler.cluster import Cluster
from gpuslice_scheduler.engine import Demand, Evaluation, evaluate, placement

ONE_NODE = np.zeros(1, dtype=np.int64)
ONE_NODE.setflags(write=False)


@dataclass(frozen=True)
class Holder:
    """A GPU pod on the node, as the ledger holds it and the API server describes it."""

    placement: Placement
    priority: int
    started: str  # metadata.creationTimestamp (RFC 3339: sorts as time does)
    cpu: float = 0.0  # milli-CPU it requests (0 where node CPU is not followed)
    memory: float = 0.0  # MiB

    @property
    def uid(self) -> str:
        return self.placement.pod.uid

    @property
    def ref(self) -> str:
        return f"{self.placement.pod.namespace}/{self.placement.pod.name}"


@dataclass(frozen=True)
class Choice:
    """One node's victims (possibly none: the pods already going make room)."""

    node: str
    victims: tuple[Holder, ...]
    placement: Placement  # where the pod would go with them gone
    order: int  # the node's place in the list the nodes came in

    def rank(self) -> tuple[int, int, int, int]:
        priorities = [v.priority for v in self.victims]
        highest = max(priorities) if priorities else -(2**63)
        return (len(priorities), highest, sum(priorities), self.order)


def plain(demand: Demand) -> Demand:
    """The pod's demand for a fit question: binpack, no workload mix. Feasibility
    does not depend on the policy; the cards chosen are only held, and the bind
    chooses again with the pod's own policy."""
    return Demand(demand.request, GpuPolicy.BINPACK, NodePolicy.BINPACK, demand.cpu, demand.memory)


class NodeRoom:
    """One node's cards as a one-node :class:`Cluster`, its usage set afresh for
    each question: the node's as the copy of the ledger has it, less what given
    pods hold, plus what given placements would take."""

    def __init__(self, cluster: Cluster, node: str) -> None:
        i = cluster.node_index[node]
        lo, hi = int(cluster.node_start[i]), int(cluster.node_start[i + 1])
        cards = range(lo, hi)
        self.name = node
        self.cluster = Cluster.from_rows(
            [(node, [cluster.row(c) for c in cards])],
            [float(cluster.node_cpu_free[i])],
            [float(cluster.node_mem_free[i])],
            [[cluster.card_mode(c) for c in cards]],
        )
        one = self.cluster
        self._base = (
            one.used_mem.copy(),
            one.used_cores.copy(),
            one.used_slots.copy(),
            one.owned.copy(),
            one.mig_used.copy(),
            one.node_cpu_free.copy(),
            one.node_mem_free.copy(),
        )
        self._where = {uuid: k for k, uuid in enumerate(one.uuids)}

    def evaluate(
        self,
        demand: Demand,
        without: Iterable[Holder] = (),
        adding: Iterable[Placement] = (),
    ) -> Evaluation:
        """The pod's evaluation on this node with ``without`` gone and ``adding`` placed."""
        one = self.cluster
        arrays = (
            one.used_mem,
            one.used_cores,
            one.used_slots,
            one.owned,
            one.mig_used,
            one.node_cpu_free,
            one.node_mem_free,
        )
        for array, base in zip(arrays, self._base, strict=True):
            array[:] = base  # in place: the core reads these arrays
        for holder in without:
            self._apply(holder.placement, -1)
            one.node_cpu_free[0] += holder.cpu
            one.node_mem_free[0] += holder.memory
        for taken in adding:
            self._apply(taken, 1)
        return evaluate(one, plain(demand), ONE_NODE, None)

    def fits(
        self, demand: Demand, without: Iterable[Holder] = (), adding: Iterable[Placement] = ()
    ) -> bool:
        return bool(self.evaluate(demand, without, adding).feasible[0])

    def _apply(self, placement: Placement, sign: int) -> None:
        one = self.cluster
        for uuid, fp in placement.footprint().items():
            c = self._where.get(uuid)
            if c is None:
                continue
            one.used_mem[c] = max(0, int(one.used_mem[c]) + sign * fp.memory_mib)
            one.used_cores[c] = max(0, int(one.used_cores[c]) + sign * fp.cores)
            one.used_slots[c] = max(0, int(one.used_slots[c]) + sign * fp.slots)
            if fp.exclusive:  # a card held exclusively has one holder
                one.owned[c] = sign > 0
            if sign > 0:
                one.mig_used[c] |= fp.mig_mask
            else:
                one.mig_used[c] &= ~fp.mig_mask


def choose_on_node(
    room: NodeRoom,
    demand: Demand,
    priority: int,
    holders: Sequence[Holder],
    going: Sequence[Holder] = (),
    held: Sequence[Placement] = (),
    order: int = 0,
) -> Choice | None:
    """The victims on ``room``'s node for a pod of ``priority``: None where even
    every pod of lower priority gone would not make it fit.

    ``holders``: the node's GPU pods that stay unless chosen; ``going``: those
    already leaving (counted as gone, never chosen); ``held``: rooms held for
    nominations of other pods that this pod may not take.
    """
    lower = [h for h in holders if h.priority < priority]
    gone = list(going)
    if not room.fits(demand, gone + lower, held):
        return None
    # the most important first: they are given back before the others
    candidates = sorted(lower, key=lambda h: (-h.priority, h.started, h.uid))
    victims = list(candidates)
    for holder in candidates:
        trial = [v for v in victims if v is not holder]
        if room.fits(demand, gone + trial, held):
            victims = trial
    ev = room.evaluate(demand, gone + victims, held)
    victims.reverse()  # the least important first: the order they are evicted in
    return Choice(room.name, tuple(victims), _placement(room, demand, ev), order)


def best(choices: Iterable[Choice | None]) -> Choice | None:
    """The node to preempt on: fewest victims, then lowest highest priority among
    them, then lowest sum, then the first sent."""
    found = [c for c in choices if c is not None]
    return min(found, key=Choice.rank) if found else None


def _placement(room: NodeRoom, demand: Demand, ev: Evaluation) -> Placement:
    return placement(room.cluster, plain(demand), ev, 0)
