"""The placement engine: which nodes can take a pod, how good each is, which cards.

One pure function, :func:`evaluate`, serves the extender's filter, prioritize
and bind and the trace replay alike. It works on a subset of nodes at once,
container by container, with NumPy over every card of those nodes:

1. each card gets a fit code (HAMi's rules, :mod:`gpuslice_scheduler.fit`);
2. fitting cards are ranked by the GPU policy's card score;
3. per node (per NUMA node when the pod binds NUMA) the best ``count`` cards are
   taken and added to a scratch copy of the usage, so the pod's later containers
   see its earlier ones;
4. a node fits when every container found its cards; feasible nodes get a score
   from the node policy.

Kubernetes phases decide what a container shares a card with: a plain init
container runs beside the sidecars started before it only, so it is checked
but not added; sidecars and app containers are added.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gpuslice_common.models import (
    ContainerAssignment,
    DeviceGrant,
    FitReason,
    GpuPolicy,
    NodePolicy,
    Placement,
    PodGpuRequest,
)
from gpuslice_scheduler.cluster import Bools, Cluster, Floats, Ints
from gpuslice_scheduler.fit import (
    CODE_COUNT,
    REASONS,
    CardDemand,
    Code,
    Codes,
    Usage,
    static_codes,
    usage_codes,
)
from gpuslice_scheduler.fragmentation import (
    NodeFragments,
    WorkloadMix,
    cluster_fragments,
    fragmentation_after,
    has_cluster_fragments,
    node_fragments,
    segment_sums,
)

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
    ) -> Demand:
        gpu_policy = (request.gpu_policy if request else None) or default_policy
        node_policy = request.node_policy if request else None
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
            [self.detail[r] for r in rows.tolist()],
            [c[rows] for c in self.chosen],
        )

    def reason(self, row: int) -> FitReason | None:
        code = Code(int(self.code[row]))
        return None if code is Code.FITS else REASONS[code]


# ---------------------------------------------------------------- scores


def hami_card_score(
    cluster: Cluster, cards: Ints, usage: Usage, d: CardDemand, mem: Ints
) -> Floats:
    """HAMi's card score: 10 x (slots + cores + memory in use after this container)."""
    score = (
        (usage.slots + 1) / np.maximum(cluster.cap_slots[cards], 1)
        + (usage.cores + d.cores) / np.maximum(cluster.cap_cores[cards], 1)
        + (usage.mem + mem) / np.maximum(cluster.cap_mem[cards], 1)
    )
    return np.asarray(10.0 * score, dtype=float)


def hami_node_score(cluster: Cluster, cards: Ints, bounds: Ints, usage: Usage) -> Floats:
    """HAMi's node score before the pod: 10 x (share of slots + cores + memory in use),
    for the nodes whose cards are ``cards[bounds[i]:bounds[i + 1]]`` with ``usage``."""
    used = np.stack([usage.slots, usage.cores, usage.mem], axis=1).astype(float)
    cap = np.stack(
        [cluster.cap_slots[cards], cluster.cap_cores[cards], cluster.cap_mem[cards]], axis=1
    ).astype(float)
    used_n, cap_n = segment_sums(used, bounds), segment_sums(cap, bounds)
    return np.asarray(10.0 * (used_n / np.maximum(cap_n, 1)).sum(axis=1), dtype=float)


# ---------------------------------------------------------------- evaluation


@dataclass
class _Scope:
    """The cards of the evaluated nodes, and where each node's run of cards starts."""

    nodes: Ints
    cards: Ints
    pos: Ints  # row -> position of its node in ``nodes``
    bounds: Ints  # node position -> first row; length nodes + 1

    @classmethod
    def of(cls, cluster: Cluster, nodes: Ints) -> _Scope:
        counts = cluster.node_start[nodes + 1] - cluster.node_start[nodes]
        bounds = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        pos = np.repeat(np.arange(nodes.size, dtype=np.int64), counts)
        return cls(nodes, cluster.cards_of(nodes), pos, bounds)


def evaluate(
    cluster: Cluster, demand: Demand, nodes: Ints, mix: WorkloadMix | None = None
) -> Evaluation:
    """Fit, cards and score of ``demand`` on each of ``nodes`` (node indexes)."""
    scope = _Scope.of(cluster, nodes)
    cpu_free = cluster.node_cpu_free[nodes]
    mem_free = cluster.node_mem_free[nodes]
    feasible = (cpu_free >= demand.cpu) & (mem_free >= demand.memory)
    code = np.where(feasible, Code.FITS, Code.TOO_FEW_CARDS).astype(np.int8)
    detail = ["" if ok else "node CPU or memory is short" for ok in feasible.tolist()]
    base = Usage.of(cluster, scope.cards)
    usage = base.copy()
    chosen: list[Ints] = []

    fragments: tuple[NodeFragments, Bools, Floats] | None = None
    use_fragments = mix is not None and (
        demand.gpu_policy is GpuPolicy.FRAGMENTATION or demand.node_policy is None
    )
    if use_fragments:
        assert mix is not None
        fragments = _fragments(cluster, scope, mix, base, cpu_free, mem_free)
    # One card for one container: the node's new fragmentation is that card's price.
    prices: _Prices | None = None

    request = demand.request
    if request is not None:
        static = static_codes(cluster, scope.cards, request.selector)
        for container in request.containers:
            d = CardDemand.of(container)
            mem = d.memory_on(cluster.cap_mem[scope.cards])
            codes = np.where(static != 0, static, usage_codes(cluster, scope.cards, usage, d, mem))
            fit = codes == 0
            prices = _card_scores(cluster, scope, demand, mix, fragments, usage, d, mem, fit)
            card_score = prices.score
            picked, short = _pick(cluster, scope, d, fit, card_score, request.selector.numa_bind)
            newly = feasible & short
            if newly.any():
                _explain(scope, codes, d, container.name, newly, code, detail)
            feasible &= ~short
            picked[~feasible] = NO_CARD
            chosen.append(picked)
            if not container.init or container.sidecar:
                rows = picked[feasible].ravel()
                rows = rows[rows >= 0]
                usage.add(rows, d, mem[rows])
        for p in chosen:  # a node that failed on a later container keeps no earlier cards
            p[~feasible] = NO_CARD
        single = len(request.containers) == 1 and request.containers[0].count == 1
        if single and not request.containers[0].init and prices is not None:
            prices.rows = chosen[0][:, 0]
        else:
            prices = None
        # ``chosen`` holds rows into the scope; turn them into cluster card indexes.
        # Without any card in the scope every entry is NO_CARD already (and indexing fails).
        if scope.cards.size:
            chosen = [np.where(p >= 0, scope.cards[np.maximum(p, 0)], NO_CARD) for p in chosen]

    score = _node_scores(cluster, scope, demand, mix, fragments, base, usage, prices)
    score = np.where(feasible, score, -np.inf)
    return Evaluation(nodes, feasible, score, code, detail, chosen)


def _fragments(
    cluster: Cluster,
    scope: _Scope,
    mix: WorkloadMix,
    usage: Usage,
    cpu_free: Floats,
    mem_free: Floats,
) -> tuple[NodeFragments, Bools, Floats]:
    """Fragmentation before the pod: from the cluster-wide cache for a large scope."""
    if not has_cluster_fragments(mix, cluster) and scope.cards.size * 4 < cluster.card_count:
        return node_fragments(mix, cluster, scope.cards, scope.bounds, usage, cpu_free, mem_free)
    nodes, usable, share = cluster_fragments(mix, cluster)
    part = NodeFragments(
        nodes.count[scope.nodes],
        nodes.unusable[scope.nodes],
        nodes.total[scope.nodes],
        nodes.fragmentation[scope.nodes],
    )
    return part, usable[scope.cards], share[scope.cards]


@dataclass
class _Prices:
    """Per row of the scope: the card score, and for the fragmentation policy the
    node's fragmentation and free share if the container took that card."""

    score: Floats
    fragmentation: Floats | None = None
    total: Floats | None = None
    rows: Ints | None = None  # per node, the card a one-card pod took


def _card_scores(
    cluster: Cluster,
    scope: _Scope,
    demand: Demand,
    mix: WorkloadMix | None,
    fragments: tuple[NodeFragments, Bools, Floats] | None,
    usage: Usage,
    d: CardDemand,
    mem: Ints,
    fit: Bools,
) -> _Prices:
    """Score of giving this container each card (higher first); only fitting rows matter."""
    hami = hami_card_score(cluster, scope.cards, usage, d, mem)
    if demand.gpu_policy is GpuPolicy.BINPACK:
        return _Prices(hami)
    if demand.gpu_policy is GpuPolicy.SPREAD:
        return _Prices(-hami)
    if mix is None or fragments is None:
        raise ValueError("the fragmentation policy needs a workload mix")
    before, usable, share = fragments
    rows = np.flatnonzero(fit)
    size = scope.cards.size
    prices = _Prices(np.full(size, -np.inf), np.full(size, np.nan), np.full(size, np.nan))
    if rows.size == 0:
        return prices
    after = Usage(
        mem=usage.mem[rows] + mem[rows],
        cores=usage.cores[rows] + d.cores,
        slots=usage.slots[rows] + 1,
        owned=usage.owned[rows] | d.exclusive,
    )
    frag = fragmentation_after(
        mix,
        cluster,
        before,
        rows,
        scope.pos[rows],
        scope.cards[rows],
        usable,
        share,
        after,
        cluster.node_cpu_free[scope.nodes] - demand.cpu,
        cluster.node_mem_free[scope.nodes] - demand.memory,
    )
    # Less added fragmentation first; among equals, the fuller card (best fit).
    pos = scope.pos[rows]
    prices.score[rows] = -(frag - before.fragmentation[pos]) + 1e-6 * hami[rows]
    assert prices.fragmentation is not None
    assert prices.total is not None
    prices.fragmentation[rows] = frag
    new_share = mix.free_share(cluster, scope.cards[rows], after)
    prices.total[rows] = before.total[pos] - share[rows] + new_share
    return prices


def _pick(
    cluster: Cluster,
    scope: _Scope,
    d: CardDemand,
    fit: Bools,
    card_score: Floats,
    numa_bind: bool,
) -> tuple[Ints, Bools]:
    """The best ``d.count`` fitting rows per node: ((nodes, count) rows, node short of cards)."""
    n = scope.nodes.size
    picked = np.full((n, d.count), NO_CARD, dtype=np.int64)
    rows = np.flatnonzero(fit)
    if rows.size == 0:
        return picked, np.ones(n, dtype=np.bool_)
    bind = numa_bind and d.count > 1
    numa = cluster.numa[scope.cards[rows]] + 1 if bind else np.zeros(rows.size, np.int64)
    width = int(numa.max()) + 1
    group = scope.pos[rows] * width + numa
    order = np.lexsort((-card_score[rows], group))
    rows, group = rows[order], group[order]
    first = np.r_[True, group[1:] != group[:-1]]
    starts = np.flatnonzero(first)
    rank = np.arange(rows.size) - np.repeat(starts, np.diff(np.r_[starts, rows.size]))
    sizes = np.bincount(group, minlength=n * width).reshape(n, width)
    # Per node, the group with enough cards and the best summed score of its top cards.
    top = rank < d.count
    group_score = np.full(n * width, -np.inf)
    sums = np.bincount(group[top], weights=card_score[rows[top]], minlength=n * width)
    enough = sizes.ravel() >= d.count
    group_score[enough] = sums[enough]
    best = group_score.reshape(n, width).argmax(axis=1)
    short = ~enough.reshape(n, width)[np.arange(n), best]
    take = top & (group == (scope.pos[rows] * width + best[scope.pos[rows]]))
    picked[scope.pos[rows[take]], rank[take]] = rows[take]
    picked[short] = NO_CARD
    return picked, short


def _explain(
    scope: _Scope,
    codes: Codes,
    d: CardDemand,
    container: str,
    failed: Bools,
    code: Codes,
    detail: list[str],
) -> None:
    """Record, for nodes that just failed, the reason code and a line naming the counts."""
    n = scope.nodes.size
    counts = np.bincount(scope.pos * CODE_COUNT + codes, minlength=n * CODE_COUNT)
    counts = counts.reshape(n, CODE_COUNT)
    fitting = counts[:, 0]
    dominant = counts[:, 1:].argmax(axis=1) + 1
    cards = np.diff(scope.bounds)
    for i in np.flatnonzero(failed).tolist():
        if cards[i] == 0:
            code[i] = Code.NOT_FOUND
            detail[i] = f"container {container!r}: the node has no GPU"
            continue
        if fitting[i] >= d.count:
            code[i] = Code.NUMA_NOT_FIT
        elif fitting[i] > 0:
            code[i] = Code.TOO_FEW_CARDS
        else:
            code[i] = dominant[i]
        parts = ", ".join(
            f"{int(counts[i, c])} {REASONS[Code(c)].value}"
            for c in range(1, CODE_COUNT)
            if counts[i, c]
        )
        detail[i] = (
            f"{REASONS[Code(int(code[i]))].value}: container {container!r} needs {d.count} "
            f"card(s), {int(fitting[i])} of {int(cards[i])} fit" + (f" ({parts})" if parts else "")
        )


def _node_scores(
    cluster: Cluster,
    scope: _Scope,
    demand: Demand,
    mix: WorkloadMix | None,
    fragments: tuple[NodeFragments, Bools, Floats] | None,
    base: Usage,
    usage: Usage,
    prices: _Prices | None,
) -> Floats:
    if demand.node_policy is not None or fragments is None or mix is None:
        hami = hami_node_score(cluster, scope.cards, scope.bounds, base)
        return -hami if demand.node_policy is NodePolicy.SPREAD else hami
    before = fragments[0]
    if prices is not None and prices.rows is not None and prices.fragmentation is not None:
        assert prices.total is not None
        if prices.fragmentation.size == 0:  # no card at all: every node is infeasible
            return np.zeros(scope.nodes.size)
        rows = np.maximum(prices.rows, 0)  # infeasible nodes' scores are replaced by -inf
        frag, total = prices.fragmentation[rows], prices.total[rows]
        return np.asarray(-(frag - before.fragmentation) - 1e-9 * total)
    cpu_after = cluster.node_cpu_free[scope.nodes] - demand.cpu
    mem_after = cluster.node_mem_free[scope.nodes] - demand.memory
    after, _, _ = node_fragments(
        mix, cluster, scope.cards, scope.bounds, usage, cpu_after, mem_after
    )
    # Less added fragmentation first; among equals, the node left with the least free share.
    return np.asarray(-(after.fragmentation - before.fragmentation) - 1e-9 * after.total)


# ---------------------------------------------------------------- results


def placement(cluster: Cluster, demand: Demand, evaluation: Evaluation, row: int) -> Placement:
    """The placement ``evaluation`` chose on the node of ``row`` (which must be feasible)."""
    if not evaluation.feasible[row] or demand.request is None:
        raise ValueError("no placement: the node does not fit the pod")
    request = demand.request
    containers = []
    for container, picked in zip(request.containers, evaluation.chosen, strict=True):
        cards = picked[row]
        grants = tuple(
            DeviceGrant(
                uuid=cluster.uuids[c],
                memory_mib=container.memory.on_card(int(cluster.cap_mem[c])),
                cores=container.cores,
            )
            for c in cards.tolist()
        )
        containers.append(
            ContainerAssignment(
                name=container.name,
                init=container.init,
                sidecar=container.sidecar,
                devices=grants,
                priority=container.priority,
            )
        )
    return Placement(
        pod=request.pod,
        node=cluster.node_names[int(evaluation.nodes[row])],
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
        levels = np.sort(np.unique(values))[::-1]
        distinct = levels[np.r_[True, np.diff(levels) < -tolerance]]
        rank = np.searchsorted(-distinct, -values - tolerance)
        result[finite] = np.maximum(10 - rank, 0)
    ranks: list[int] = result.tolist()
    return ranks


# ---------------------------------------------------------------- incremental


def demand_key(demand: Demand) -> tuple[object, ...]:
    """What makes two pods the same kind for the engine (everything but their identity)."""
    request = demand.request
    shape = (request.containers, request.selector, request.vgpu_mode) if request else None
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
