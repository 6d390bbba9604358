"""The placement engine: which nodes can take a pod, how good each is, which cards.

One function, :func:`evaluate`, serves the extender's filter, prioritize and
bind and the trace replay alike. A node's answer depends on that node alone,
so the work is one pass per node, in a compiled core (``native/engine/engine.c``
through :mod:`gpuslice_scheduler.core`), container by container:

1. each card gets a fit code: HAMi's rules in HAMi's order (:class:`~gpuslice_scheduler.fit.Code`);
2. fitting cards are ranked by the GPU policy's card score: binpack takes the
   card fullest after the container (HAMi's score, 10 x the shares of slots,
   cores and memory in use, weighted by the pod's ``device-scoring-weights``),
   spread the emptiest; among equal cards both take HAMi's: the last in HAMi's
   card list, which is sorted by score, then NUMA node, before each container
   (afresh for each init container and the first app container, the previous
   container's order for later ones). Fragmentation takes the card whose taking
   adds the least fragmentation to the node
   (:mod:`gpuslice_scheduler.fragmentation`), the fuller one among equals, the
   first card among those; it has no use for scoring weights;
3. the best ``count`` cards are taken (all from one NUMA node when the pod binds
   NUMA: the group whose top cards score best) and added to a scratch copy of
   the node's usage, so the pod's later containers see its earlier ones;
4. a node fits when its CPU and memory suffice and every container found its
   cards; feasible nodes get a score from the node policy: HAMi's node score
   (usage before the pod; spread negates it), or without one under the
   fragmentation policy, less fragmentation added first and, among equals, the
   node left with less free share.

Cards in mode mig are placed by :mod:`gpuslice_scheduler.mig` (in Python: they
are rare, and a cluster without them never enters it): the core never takes
one, and for a pod that may use them (its vgpu-mode unset or mig), each node
with MIG cards is evaluated there too. A pod whose vgpu-mode is unset keeps
the core's answer where it fits (the node's other cards), else the MIG path's.

Kubernetes phases decide what a container shares a card with: a plain init
container runs beside the sidecars started before it only, so it is checked
but not added; sidecars and app containers are added.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import numpy as np

from gpuslice_common.models import (
    ContainerAssignment,
    ContainerGpuRequest,
    DeviceGrant,
    DeviceSelector,
    FitReason,
    GpuPolicy,
    NodePolicy,
    Placement,
    PodGpuRequest,
    ScoringWeights,
)
from gpuslice_scheduler import core, mig, vendorfit
from gpuslice_scheduler.cluster import Bools, Cluster, Floats, Ints
from gpuslice_scheduler.fit import REASONS, Code, Codes, model_mask
from gpuslice_scheduler.fragmentation import WorkloadMix

NO_CARD = -1


@dataclass(frozen=True)
class Demand:
    """A pod as the engine sees it: its GPU request, node CPU/memory, resolved policies."""

    request: PodGpuRequest | None  # None: the pod asks for no GPU (trace replay only)
    gpu_policy: GpuPolicy = GpuPolicy.FRAGMENTATION
    node_policy: NodePolicy | None = None  # None: follow the GPU policy
    cpu: float = 0.0
    memory: float = 0.0

    @classmethod
    def of(
        cls,
        request: PodGpuRequest | None,
        default_policy: GpuPolicy = GpuPolicy.FRAGMENTATION,
        cpu: float = 0.0,
        memory: float = 0.0,
        default_node_policy: NodePolicy | None = None,
    ) -> Demand:
        gpu_policy = (request.gpu_policy if request else None) or default_policy
        node_policy = (request.node_policy if request else None) or default_node_policy
        if node_policy is None and gpu_policy is not GpuPolicy.FRAGMENTATION:
            node_policy = NodePolicy.BINPACK  # HAMi's default node policy
        return cls(request, gpu_policy, node_policy, cpu, memory)

    @property
    def policy_name(self) -> str:
        node = self.node_policy.value if self.node_policy else "fragmentation"
        return f"gpu={self.gpu_policy.value},node={node}"


@dataclass
class Evaluation:
    """The engine's answer for a set of nodes (rows follow ``nodes``)."""

    nodes: Ints
    feasible: Bools
    score: Floats  # higher is better; -inf where infeasible
    code: Codes  # why a node failed (Code.FITS where feasible)
    detail: list[str]  # one line per failed node, "" where feasible
    chosen: list[Ints]  # per container: (nodes, count) card indexes, NO_CARD where none

    def row(self, node: int) -> int:
        hits = np.flatnonzero(self.nodes == node)
        if hits.size == 0:
            raise KeyError(node)
        return int(hits[0])

    def subset(self, rows: Ints) -> Evaluation:
        """The rows ``rows`` of this evaluation, in that order."""
        return Evaluation(
            self.nodes[rows],
            self.feasible[rows],
            self.score[rows],
            self.code[rows],
            _pick_items(self.detail, rows),
            [c[rows] for c in self.chosen],
        )

    def reason(self, row: int) -> FitReason | None:
        code = Code(int(self.code[row]))
        return None if code is Code.FITS else REASONS[code]


def _pick_items(items: list[str], rows: Ints) -> list[str]:
    if rows.size == 0:
        return []
    if rows.size == 1:
        return [items[int(rows[0])]]
    return list(operator.itemgetter(*rows.tolist())(items))


# ---------------------------------------------------------------- evaluation


def evaluate(
    cluster: Cluster, demand: Demand, nodes: Ints, mix: WorkloadMix | None = None
) -> Evaluation:
    """Fit, cards and score of ``demand`` on each of ``nodes`` (node indexes).

    The work is done by the compiled core (:mod:`gpuslice_scheduler.core`); here
    only the lines that explain failed nodes are written, once per distinct reason.
    Vendors' rules the core does not know are applied around it
    (:mod:`gpuslice_scheduler.vendorfit`).
    """
    request = demand.request
    if vendorfit.wants_drs(request):
        assert request is not None
        evaluation = _unfit(nodes, request)
        for rows, part in vendorfit.drs_parts(
            cluster, demand, nodes, lambda d, n, k: _evaluate(cluster, d, n, mix, k)
        ):
            if isinstance(part, str):
                evaluation.code[rows] = Code.TYPE_MISMATCH
                for row in rows.tolist():
                    evaluation.detail[row] = part
            else:
                _write(evaluation, rows, part)
        return evaluation
    evaluation = _evaluate(cluster, demand, nodes, mix, None)
    if request is not None and request.vendor == vendorfit.KUNLUN:
        vendorfit.kunlun_topology(cluster, request, evaluation)
    return evaluation


def _unfit(nodes: Ints, request: PodGpuRequest) -> Evaluation:
    """An evaluation where no node fits yet (rows follow ``nodes``)."""
    n = int(nodes.size)
    return Evaluation(
        nodes,
        np.zeros(n, dtype=np.bool_),
        np.full(n, -np.inf),
        np.full(n, int(Code.NOT_FOUND), dtype=np.int8),
        [""] * n,
        [np.full((n, c.count), NO_CARD, dtype=np.int64) for c in request.containers],
    )


def _evaluate(
    cluster: Cluster,
    demand: Demand,
    nodes: Ints,
    mix: WorkloadMix | None,
    kinds: Bools | None,
) -> Evaluation:
    request = demand.request
    if request is not None and demand.gpu_policy is GpuPolicy.FRAGMENTATION and mix is None:
        raise ValueError("the fragmentation policy needs a workload mix")
    answer = core.evaluate(
        cluster,
        request.containers if request is not None else None,
        request.selector if request is not None else _NO_SELECTOR,
        demand.gpu_policy,
        demand.node_policy,
        demand.cpu,
        demand.memory,
        nodes,
        mix,
        request.vgpu_mode if request is not None else None,
        request.scoring_weights if request is not None else _EVEN,
        kinds,
    )
    containers = request.containers if request is not None else ()
    detail = _details(answer, containers)
    evaluation = Evaluation(
        nodes, answer.feasible, answer.score, answer.code, detail, answer.chosen
    )
    if cluster.mig and request is not None and mig.wants_mig(request):
        _mig_rows(cluster, demand, request, evaluation)
    return evaluation


def _mig_rows(
    cluster: Cluster, demand: Demand, request: PodGpuRequest, evaluation: Evaluation
) -> None:
    """Evaluate the nodes with MIG cards through the MIG path, in place: its answer
    replaces the core's where the core's does not fit (the node's other cards)."""
    rows = np.flatnonzero(cluster.node_mig[evaluation.nodes] & ~evaluation.feasible)
    if rows.size == 0:
        return
    only_mig = request.vgpu_mode is not None  # the core's answer there is a type mismatch
    type_ok = _type_ok(cluster, request)
    for row in rows.tolist():
        node = int(evaluation.nodes[row])
        fit = _mig_fit(cluster, demand, request, node, type_ok)
        if fit.feasible or only_mig or evaluation.code[row] == Code.TYPE_MISMATCH:
            evaluation.feasible[row] = fit.feasible
            evaluation.score[row] = fit.score
            evaluation.code[row] = fit.code
            evaluation.detail[row] = fit.detail
            for picks, chosen in zip(fit.chosen, evaluation.chosen, strict=False):
                chosen[row] = [card for card, _, _ in picks]


def _type_ok(cluster: Cluster, request: PodGpuRequest) -> list[bool] | None:
    """Per kind of card, may the pod's type lists use it (None: no list)."""
    selector = request.selector
    if not (selector.include_types or selector.exclude_types):
        return None
    allowed: list[bool] = model_mask(selector, cluster.models).tolist()
    return allowed


def _mig_fit(
    cluster: Cluster,
    demand: Demand,
    request: PodGpuRequest,
    node: int,
    type_ok: list[bool] | None,
) -> mig.NodeFit:
    return mig.fit_node(
        cluster,
        node,
        request,
        demand.gpu_policy,
        demand.node_policy,
        demand.cpu,
        demand.memory,
        type_ok,
    )


_NO_SELECTOR = DeviceSelector()
_EVEN = ScoringWeights()
_NODE_SHORT = "node CPU or memory is short"


def _details(answer: core.Answer, containers: tuple[ContainerGpuRequest, ...]) -> list[str]:
    """One line per node: "" where it fits, else the reason and the cards' codes counted."""
    detail = [""] * answer.feasible.size
    rows = np.flatnonzero(answer.failed != core.FAIL_NONE)
    if rows.size == 0:
        return detail
    lines: dict[tuple[int, ...], str] = {}
    failed, code, counts = answer.failed[rows], answer.code[rows], answer.counts[rows]
    for row, key in zip(
        rows.tolist(), np.column_stack([failed, code, counts]).tolist(), strict=True
    ):
        memo = tuple(key)
        line = lines.get(memo)
        if line is None:
            line = lines[memo] = _detail(key[0], Code(key[1]), key[2:], containers)
        detail[row] = line
    return detail


def _detail(
    failed: int, code: Code, counts: list[int], containers: tuple[ContainerGpuRequest, ...]
) -> str:
    if failed == core.FAIL_NODE_SHORT:
        return _NODE_SHORT
    container = containers[failed - core.FAIL_CONTAINER]
    cards = sum(counts)
    if cards == 0:
        return f"{REASONS[code].value}: container {container.name!r}: the node has no GPU"
    if code is Code.NODE_INSUFFICIENT_DEVICE:
        present = cards - counts[Code.NOT_FOUND]
        return (
            f"{REASONS[code].value}: container {container.name!r} needs {container.count} "
            f"card(s), the node has {present}"
        )
    parts = ", ".join(
        f"{counts[c]} {REASONS[Code(c)].value}" for c in range(1, len(counts)) if counts[c]
    )
    return (
        f"{REASONS[code].value}: container {container.name!r} needs {container.count} "
        f"card(s), {counts[0]} of {cards} fit" + (f" ({parts})" if parts else "")
    )


# ---------------------------------------------------------------- results


def placement(cluster: Cluster, demand: Demand, evaluation: Evaluation, row: int) -> Placement:
    """The placement ``evaluation`` chose on the node of ``row`` (which must be feasible)."""
    if not evaluation.feasible[row] or demand.request is None:
        raise ValueError("no placement: the node does not fit the pod")
    request = demand.request
    node = int(evaluation.nodes[row])
    if vendorfit.wants_drs(request):
        table = vendorfit.node_table(cluster, node, request.vendor)
        if table is None:
            raise ValueError("no placement: the node's DRS cards changed since the evaluation")
        request, why = vendorfit.resolve(request, table)
        if why:
            raise ValueError(f"no placement: {why}")
    mig_grants = None
    if cluster.node_mig[node] and any(int(c[row][0]) in cluster.mig for c in evaluation.chosen):
        # the answer the evaluation had: the same cluster, the same rules
        fit = _mig_fit(cluster, demand, request, node, _type_ok(cluster, request))
        if not fit.feasible:
            raise ValueError("no placement: the node's MIG cards changed since the evaluation")
        mig_grants = fit.grants(cluster.uuids)
    containers = []
    for i, (container, picked) in enumerate(
        zip(request.containers, evaluation.chosen, strict=True)
    ):
        cards = picked[row]
        grants = (
            mig_grants[i]
            if mig_grants is not None
            else tuple(
                DeviceGrant(
                    uuid=cluster.uuids[c],
                    memory_mib=container.memory.on_card(int(cluster.cap_mem[c])),
                    cores=container.cores,
                )
                for c in cards.tolist()
            )
        )
        containers.append(
            ContainerAssignment(
                name=container.name,
                init=container.init,
                sidecar=container.sidecar,
                devices=grants,
                priority=container.priority,
                vendor=container.vendor,
            )
        )
    return Placement(
        pod=request.pod,
        node=cluster.node_names[node],
        containers=tuple(containers),
        policy=demand.policy_name,
    )


def normalise(scores: Floats, tolerance: float = 1e-9) -> list[int]:
    """Scores as kube-scheduler's 0-10, by rank: the best score 10, each distinctly
    worse one a step less (0 from the eleventh on, and for infeasible nodes).

    Ranks keep the best node alone at 10 however far apart the others are,
    where scaling between the worst and the best would crowd it among near
    equals; within ``tolerance`` scores count as equal.
    """
    finite = np.isfinite(scores)
    result = np.zeros(scores.size, dtype=np.int64)
    if finite.any():
        values = scores[finite]
        levels = np.unique(values)[::-1]  # sorted, highest first
        distinct = levels[np.r_[True, np.diff(levels) < -tolerance]]
        rank = np.searchsorted(-distinct, -values - tolerance)
        result[finite] = np.maximum(10 - rank, 0)
    ranks: list[int] = result.tolist()
    return ranks


# ---------------------------------------------------------------- incremental


def demand_key(demand: Demand) -> tuple[object, ...]:
    """What makes two pods the same kind for the engine (everything but their identity)."""
    request = demand.request
    shape = (
        (request.containers, request.selector, request.vgpu_mode, request.scoring_weights)
        if request
        else None
    )
    return (shape, demand.gpu_policy, demand.node_policy, demand.cpu, demand.memory)


@dataclass
class _Entry:
    demand: Demand
    evaluation: Evaluation
    seen: int  # cluster version the rows were last brought up to


class Evaluator:
    """Evaluations of every node for each kind of pod, re-computed only where nodes changed.

    A node's fit, cards and score depend on that node alone (and the mix), so a
    pod of a kind seen before costs one :func:`evaluate` over the nodes changed
    since. Bound to one cluster and mix; make a new one when either is replaced.
    An evaluator may be filled in another thread while its cluster changes: rows
    of nodes changed meanwhile are simply evaluated again on the next call.
    """

    def __init__(self, cluster: Cluster, mix: WorkloadMix | None, kinds: int = 256) -> None:
        self.cluster = cluster
        self.mix = mix
        self.kinds = kinds
        self.entries: dict[tuple[object, ...], _Entry] = {}
        self.all_nodes = np.arange(cluster.node_count, dtype=np.int64)

    def evaluate(self, demand: Demand) -> Evaluation:
        """The pod's evaluation on every node of the cluster (row = node index)."""
        key = demand_key(demand)
        entry = self.entries.pop(key, None)  # re-inserted below: most recent last
        cluster = self.cluster
        version = cluster.version  # before reading: a change from now on is seen as stale
        if entry is None:
            entry = _Entry(demand, evaluate(cluster, demand, self.all_nodes, self.mix), version)
        else:
            stale = np.flatnonzero(cluster.changed > entry.seen)
            if stale.size:
                _write(entry.evaluation, stale, evaluate(cluster, demand, stale, self.mix))
                entry.seen = version
        self.entries[key] = entry
        while len(self.entries) > self.kinds:
            del self.entries[next(iter(self.entries))]
        return entry.evaluation

    def recent(self, count: int) -> list[Demand]:
        """The kinds of pod evaluated last, most recent first."""
        return [e.demand for e in reversed(self.entries.values())][:count]


class Ceiling:
    """Per kind of pod, the nodes it could never fit even with every card empty.

    What preemption cannot fix: type, UUID or NUMA lists, too few or too small
    cards, unhealthy or cordoned ones. Computed only for the nodes asked about,
    and again only where a node's facts changed.
    """

    def __init__(self, cluster: Cluster, kinds: int = 256) -> None:
        self.cluster = cluster
        self.kinds = kinds
        # per kind: (known per node, never per node, version the facts were read at)
        self.entries: dict[tuple[object, ...], tuple[Bools, Bools, Ints]] = {}

    def never_fit(self, demand: Demand, nodes: Ints) -> Bools:
        """For each of ``nodes``: True where the pod could never fit."""
        key = demand_key(demand)
        cluster = self.cluster
        entry = self.entries.pop(key, None)
        if entry is None:
            n = cluster.node_count
            entry = (np.zeros(n, np.bool_), np.zeros(n, np.bool_), np.zeros(n, np.int64))
        known, never, seen = entry
        todo = nodes[~known[nodes] | (cluster.reshaped[nodes] > seen[nodes])]
        if todo.size:
            version = cluster.version
            plain = Demand(
                demand.request, GpuPolicy.BINPACK, NodePolicy.BINPACK, demand.cpu, demand.memory
            )
            empty = evaluate(cluster.emptied(), plain, todo, None)
            never[todo] = ~empty.feasible
            known[todo] = True
            seen[todo] = version
        self.entries[key] = entry
        while len(self.entries) > self.kinds:
            del self.entries[next(iter(self.entries))]
        return never[nodes]


def _write(into: Evaluation, rows: Ints, part: Evaluation) -> None:
    """Overwrite ``rows`` of ``into`` with ``part`` (whose rows are those nodes, in order)."""
    into.feasible[rows] = part.feasible
    into.score[rows] = part.score
    into.code[rows] = part.code
    for row, line in zip(rows.tolist(), part.detail, strict=True):
        into.detail[row] = line
    for whole, piece in zip(into.chosen, part.chosen, strict=True):
        whole[rows] = piece
