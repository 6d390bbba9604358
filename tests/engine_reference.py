"""The NumPy engine the compiled one replaced, kept as the reference it is tested against.

A frozen copy of ``gpuslice_scheduler.engine.evaluate`` as it was in NumPy,
with every helper that left the product (card usage, HAMi's fit rules as masks,
node fragmentation and its one-card update, HAMi's card and node scores, the
per-node pick of cards). It imports only what stays in the product: the
engine's result types, the fit codes and card demand, the workload mix's
arrays, the cluster.

Since then it follows the product where HAMi's semantics were taken up: a
percentage of memory is never 0 MiB, HAMi's card score is weighted by the pod's
scoring weights, equal cards under binpack and spread go where HAMi's card list
puts them, and a node with fewer cards than a container asks is
NodeInsufficientDevice.

One difference on purpose: the product kept node fragmentation cached for the
whole cluster and read a large scope's from that cache; this copy always
computes it for the scope. The two differ at most in the last bits of sums.

:func:`replay` is the same evaluation with given cards in place of the ones it
would pick (the compiled engine's, where its choice among equally scored cards
differs): it says what each pick scores and what the best pick would have.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from gpuslice_common.models import DeviceSelector, GpuPolicy, NodePolicy, ScoringWeights
from gpuslice_scheduler.cluster import Bools, Cluster, Floats, Ints
from gpuslice_scheduler.engine import NO_CARD, Demand, Evaluation
from gpuslice_scheduler.fit import CODE_COUNT, REASONS, CardDemand, Code, model_mask
from gpuslice_scheduler.fragmentation import WorkloadMix

Codes = npt.NDArray[np.int8]
EVEN = ScoringWeights()

# ---------------------------------------------------------------- HAMi's fit rules


def memory_on(d: CardDemand, cap_mem: Ints) -> Ints:
    """MiB taken on cards of the given schedulable memory (percent rounds down, to
    no less than 1 MiB)."""
    if d.mem_mib >= 0:
        return np.full_like(cap_mem, d.mem_mib)
    return percent_of(cap_mem, d.mem_percent)


def percent_of(cap_mem: Any, percent: Any) -> Any:
    return np.maximum(cap_mem * percent // 100, 1)


def static_codes(cluster: Cluster, cards: Ints, selector: DeviceSelector) -> Codes:
    """Rules 1-3 (without NUMA): presence, health, cordon, type, UUID lists."""
    conditions = [
        ~cluster.present[cards],
        ~cluster.healthy[cards],
        cluster.cordoned[cards],
    ]
    codes = [Code.NOT_FOUND, Code.NOT_HEALTHY, Code.CORDONED]
    if selector.include_types or selector.exclude_types:
        conditions.append(~model_mask(selector, cluster.models)[cluster.model_id[cards]])
        codes.append(Code.TYPE_MISMATCH)
    if selector.include_uuids or selector.exclude_uuids:
        include, exclude = set(selector.include_uuids), set(selector.exclude_uuids)
        uuid_ok = np.asarray(
            [
                (not include or cluster.uuids[c] in include) and cluster.uuids[c] not in exclude
                for c in cards.tolist()
            ],
            dtype=np.bool_,
        )
        conditions.append(~uuid_ok)
        codes.append(Code.UUID_MISMATCH)
    return np.select(conditions, [np.int8(c) for c in codes], default=np.int8(0)).astype(np.int8)


@dataclass
class Usage:
    """Usage of a set of cards: the ledger's numbers, or a scratch copy being filled."""

    mem: Ints
    cores: Ints
    slots: Ints
    owned: Bools

    @classmethod
    def of(cls, cluster: Cluster, cards: Ints) -> Usage:
        return cls(
            mem=cluster.used_mem[cards].copy(),
            cores=cluster.used_cores[cards].copy(),
            slots=cluster.used_slots[cards].copy(),
            owned=cluster.owned[cards].copy(),
        )

    def copy(self) -> Usage:
        return Usage(self.mem.copy(), self.cores.copy(), self.slots.copy(), self.owned.copy())

    def add(self, rows: Ints, demand: CardDemand, mem: Ints) -> None:
        self.mem[rows] += mem
        self.cores[rows] += demand.cores
        self.slots[rows] += 1
        if demand.exclusive:
            self.owned[rows] = True


def usage_rules(
    cluster: Cluster,
    cards: Ints,
    usage: Usage,
    mem: Any,
    cores: Any,
    exclusive: Any,
    kinds: bool = False,
) -> list[Bools]:
    """HAMi's rules 4-8 as "broken" masks, in order: slots, memory, cores, exclusivity,
    compute exhausted. For one container, ``mem`` is per card and ``cores`` and
    ``exclusive`` are scalars; with ``kinds`` they carry a trailing axis of kinds of
    container, and the masks are (cards, kinds)."""

    def card(values: Any) -> Any:
        return values[:, None] if kinds else values

    cap_cores = card(cluster.cap_cores[cards])
    used_cores, used_slots = card(usage.cores), card(usage.slots)
    return [
        used_slots + 1 > card(cluster.cap_slots[cards]),
        card(usage.mem) + mem > card(cluster.cap_mem[cards]),
        used_cores + cores > cap_cores,
        card(usage.owned) | (exclusive & (used_slots > 0)),
        (cores == 0) & (used_cores >= cap_cores),
    ]


def usage_codes(
    cluster: Cluster, cards: Ints, usage: Usage, demand: CardDemand, mem: Ints
) -> Codes:
    """Rules 4-8 for cards with ``usage`` (rows aligned with ``cards``)."""
    conditions = usage_rules(cluster, cards, usage, mem, demand.cores, demand.exclusive)
    codes = [
        Code.SLOTS_EXHAUSTED,
        Code.INSUFFICIENT_MEMORY,
        Code.INSUFFICIENT_CORE,
        Code.EXCLUSIVE_CONFLICT,
        Code.COMPUTE_EXHAUSTED,
    ]
    return np.select(conditions, [np.int8(c) for c in codes], default=np.int8(0)).astype(np.int8)


# ---------------------------------------------------------------- fragmentation


def schedulable(cluster: Cluster, cards: Ints) -> Bools:
    """Which of ``cards`` may take new work at all (present, healthy, not cordoned)."""
    return np.asarray(cluster.present[cards] & cluster.healthy[cards] & ~cluster.cordoned[cards])


def usable(mix: WorkloadMix, cluster: Cluster, cards: Ints, usage: Usage) -> Bools:
    """(cards, parts): could one more container of each part of ``mix`` go on each card."""
    cap_mem = cluster.cap_mem[cards][:, None]
    need_mem = np.where(
        mix.part_mem_mib >= 0, mix.part_mem_mib, percent_of(cap_mem, mix.part_mem_percent)
    )
    broken = usage_rules(
        cluster, cards, usage, need_mem, mix.part_cores, mix.part_exclusive, kinds=True
    )
    ok = (
        schedulable(cluster, cards)[:, None] & mix.model_ok(cluster.models)[cluster.model_id[cards]]
    )
    for rule in broken:  # the masks broadcast: (cards, 1) or (cards, parts)
        ok = ok & ~rule
    return np.asarray(ok, dtype=np.bool_)


def free_share(cluster: Cluster, cards: Ints, usage: Usage) -> Floats:
    """Free compute of each card in milli-GPU; 0 where the card takes no new work."""
    cap = cluster.cap_cores[cards]
    free = np.maximum(cap - usage.cores, 0) * 1000.0 / np.maximum(cap, 1)
    return np.where(schedulable(cluster, cards) & ~usage.owned, free, 0.0)


def hosts(
    mix: WorkloadMix, cpu_free: Floats, mem_free: Floats, count: npt.NDArray[np.int64]
) -> Bools:
    """(nodes, classes): can the node host one pod of the class (count: usable per part)."""
    return (
        (cpu_free[:, None] >= mix.cpu)
        & (mem_free[:, None] >= mix.memory)
        & (count[:, mix.part] >= mix.need)
    )


def starved(feed: tuple[float, float], total: Floats, cpu_free: Floats, mem_free: Floats) -> Floats:
    """Free share that the free CPU and memory cannot feed at the mix's ratios."""
    out = np.zeros_like(total)
    for ratio, have in zip(feed, (cpu_free, mem_free), strict=True):
        if ratio > 0:
            # as the core: NaN free CPU or memory is none; a NaN shortfall (inf / inf) none
            with np.errstate(over="ignore", invalid="ignore"):
                unfed = total - np.where(have > 0, have, 0.0) / ratio
            out = np.fmax(out, unfed)
    return np.asarray(np.minimum(out, total))


def mix_score(
    mix: WorkloadMix,
    host: Bools,
    unusable: Floats,
    total: Floats,
    feed: tuple[float, float],
    cpu_free: Floats,
    mem_free: Floats,
) -> Floats:
    """Weighted fragmentation from per-part aggregates (rows are nodes or candidates),
    and the share the nodes' CPU and memory cannot feed."""
    frag = np.where(host, unusable[:, mix.part], total[:, None])
    hungry = mix.starved_weight * starved(feed, total, cpu_free, mem_free)
    return np.asarray(frag @ mix.weight + hungry, dtype=float)


@dataclass
class NodeFragments:
    """Per-node aggregates of a set of nodes, enough to price a change to one card."""

    count: Ints  # (nodes, parts) cards usable by each part
    unusable: Floats  # (nodes, parts) free share on cards the part cannot use
    total: Floats  # (nodes,) free share
    fragmentation: Floats  # (nodes,)


def segment_sums(values: npt.NDArray[np.float64], bounds: Ints) -> npt.NDArray[np.float64]:
    """Sums of rows between consecutive ``bounds`` (which start at 0), empty segments 0."""
    shape = (1, *values.shape[1:])
    acc = np.concatenate([np.zeros(shape), np.cumsum(values, axis=0)])
    return np.asarray(acc[bounds[1:]] - acc[bounds[:-1]])


def node_fragments(
    mix: WorkloadMix,
    cluster: Cluster,
    cards: Ints,
    bounds: Ints,
    usage: Usage,
    cpu_free: Floats,
    mem_free: Floats,
) -> tuple[NodeFragments, Bools, Floats]:
    """Fragmentation of nodes whose cards are ``cards[bounds[i]:bounds[i+1]]``.

    Also returns the per-card usability and free share it was computed from.
    """
    use = usable(mix, cluster, cards, usage)
    share = free_share(cluster, cards, usage)
    count = segment_sums(use.astype(float), bounds).round().astype(np.int64)
    unusable = segment_sums(np.where(use, 0.0, share[:, None]), bounds)
    total = segment_sums(share, bounds)
    host = hosts(mix, cpu_free, mem_free, count)
    score = mix_score(mix, host, unusable, total, mix.feed_ratios(cluster), cpu_free, mem_free)
    frag = NodeFragments(count, unusable, total, score)
    return frag, use, share


def fragmentation_after(
    mix: WorkloadMix,
    cluster: Cluster,
    before: NodeFragments,
    rows: Ints,
    node_pos: Ints,
    cards: Ints,
    use: Bools,
    share: Floats,
    after: Usage,
    cpu_after: Floats,
    mem_after: Floats,
) -> Floats:
    """Node fragmentation if one card changed to ``after`` (one candidate per row).

    ``rows`` index the per-card arrays (``use``, ``share``) of the evaluation;
    ``cards`` are the cluster's card indexes; ``node_pos`` the node of each row.
    """
    new_usable = usable(mix, cluster, cards, after)
    new_share = free_share(cluster, cards, after)
    old_usable, old_share = use[rows], share[rows]
    count = before.count[node_pos] - old_usable + new_usable
    unusable = (
        before.unusable[node_pos]
        - np.where(old_usable, 0.0, old_share[:, None])
        + np.where(new_usable, 0.0, new_share[:, None])
    )
    total = before.total[node_pos] - old_share + new_share
    cpu, mem = cpu_after[node_pos], mem_after[node_pos]
    host = hosts(mix, cpu, mem, count)
    return mix_score(mix, host, unusable, total, mix.feed_ratios(cluster), cpu, mem)


def node_fragmentation(mix: WorkloadMix, cluster: Cluster, nodes: Ints) -> tuple[Floats, Floats]:
    """Per node of ``nodes``: its fragmentation and its total free share, as the cards'
    usage and the nodes' free CPU and memory stand."""
    counts = cluster.node_start[nodes + 1] - cluster.node_start[nodes]
    bounds = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    cards = cluster.cards_of(nodes)
    frag, _, _ = node_fragments(
        mix,
        cluster,
        cards,
        bounds,
        Usage.of(cluster, cards),
        cluster.node_cpu_free[nodes],
        cluster.node_mem_free[nodes],
    )
    return frag.fragmentation, frag.total


# ---------------------------------------------------------------- scores


def hami_card_score(
    cluster: Cluster,
    cards: Ints,
    usage: Usage,
    d: CardDemand,
    mem: Ints,
    weights: ScoringWeights = EVEN,
) -> Floats:
    """HAMi's card score: 10 x (slots + cores + memory in use after this container,
    weighted); 0 on a card without slots, cores or memory."""
    slots, cores, memory = (
        cluster.cap_slots[cards],
        cluster.cap_cores[cards],
        cluster.cap_mem[cards],
    )
    score = (  # in floats, as the core: cards the demand does not fit are scored too
        weights.slot * ((usage.slots.astype(float) + 1.0) / np.maximum(slots, 1))
        + weights.core * ((usage.cores.astype(float) + float(d.cores)) / np.maximum(cores, 1))
        + weights.memory * ((usage.mem.astype(float) + mem.astype(float)) / np.maximum(memory, 1))
    )
    empty = (slots <= 0) | (cores <= 0) | (memory <= 0)
    return np.asarray(np.where(empty, 0.0, 10.0 * score), dtype=float)


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


@dataclass
class Replay:
    """:func:`replay`'s answer: the evaluation with the given cards, and per container
    (nodes,) what the given cards' scores sum to and what the best pick's would."""

    evaluation: Evaluation
    taken: list[Floats]  # -inf where the given cards do not fit (or none were given)
    best: list[Floats]  # -inf where no pick fits
    valid: Bools  # per node: every given pick was fitting, distinct cards of that node


def evaluate(
    cluster: Cluster, demand: Demand, nodes: Ints, mix: WorkloadMix | None = None
) -> Evaluation:
    """Fit, cards and score of ``demand`` on each of ``nodes`` (node indexes)."""
    return _evaluate(cluster, demand, nodes, mix, None).evaluation


def replay(
    cluster: Cluster,
    demand: Demand,
    nodes: Ints,
    mix: WorkloadMix | None,
    given: list[Ints],
    where: Bools,
) -> Replay:
    """:func:`evaluate`, but on the nodes ``where`` is True every container takes the
    cards ``given`` (per container, (nodes, count) cluster card indexes) instead of
    its own pick, so that later containers and the node score see those cards."""
    return _evaluate(cluster, demand, nodes, mix, (given, where))


def _evaluate(
    cluster: Cluster,
    demand: Demand,
    nodes: Ints,
    mix: WorkloadMix | None,
    forced: tuple[list[Ints], Bools] | None,
) -> Replay:
    scope = _Scope.of(cluster, nodes)
    cpu_free = cluster.node_cpu_free[nodes]
    mem_free = cluster.node_mem_free[nodes]
    feasible = (cpu_free >= demand.cpu) & (mem_free >= demand.memory)
    code = np.where(feasible, Code.FITS, Code.TOO_FEW_CARDS).astype(np.int8)
    detail = ["" if ok else "node CPU or memory is short" for ok in feasible.tolist()]
    base = Usage.of(cluster, scope.cards)
    usage = base.copy()
    chosen: list[Ints] = []
    taken: list[Floats] = []
    best: list[Floats] = []
    valid = np.ones(nodes.size, dtype=np.bool_)

    fragments: tuple[NodeFragments, Bools, Floats] | None = None
    use_fragments = mix is not None and (
        demand.gpu_policy is GpuPolicy.FRAGMENTATION or demand.node_policy is None
    )
    if use_fragments:
        assert mix is not None
        # Not from a cluster-wide cache, as the product once did: always for the scope.
        fragments = node_fragments(
            mix, cluster, scope.cards, scope.bounds, base, cpu_free, mem_free
        )
    # One card for one container: the node's new fragmentation is that card's price.
    prices: _Prices | None = None

    request = demand.request
    hami_policy = demand.gpu_policy is not GpuPolicy.FRAGMENTATION
    # HAMi's card list: each row's place in its node's list (binpack, spread)
    place = np.arange(scope.cards.size, dtype=np.int64) - scope.bounds[scope.pos]
    if request is not None:
        static = static_codes(cluster, scope.cards, request.selector)
        for k, container in enumerate(request.containers):
            d = CardDemand.of(container)
            mem = memory_on(d, cluster.cap_mem[scope.cards])
            codes = np.where(static != 0, static, usage_codes(cluster, scope.cards, usage, d, mem))
            fit = codes == 0
            prices = _card_scores(cluster, scope, demand, mix, fragments, usage, d, mem, fit)
            card_score = prices.score
            tie = None
            if hami_policy:
                fresh = k == 0 or container.init or request.containers[k - 1].init
                place = _list_places(cluster, scope, card_score, place, fresh)
                tie = place
            picked, short = _pick(
                cluster, scope, d, fit, card_score, request.selector.numa_bind, tie
            )
            if forced is not None:
                given, where = forced
                best.append(_sums(picked, short, card_score))
                ok = _force(cluster, scope, d, fit, request.selector.numa_bind, given[k], where)
                picked[where], short[where] = ok.rows[where], ~ok.valid[where]
                valid &= ~where | ok.valid
                taken.append(_sums(picked, short, card_score))
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
    return Replay(Evaluation(nodes, feasible, score, code, detail, chosen), taken, best, valid)


def _sums(picked: Ints, short: Bools, card_score: Floats) -> Floats:
    """Per node, the summed card score of its picked rows (-inf where short)."""
    if card_score.size == 0:
        return np.full(picked.shape[0], -np.inf)
    sums = card_score[np.maximum(picked, 0)].sum(axis=1)
    return np.where(short | (picked < 0).any(axis=1), -np.inf, sums)


@dataclass
class _Forced:
    rows: Ints  # (nodes, count) scope rows of the given cards, NO_CARD where not in scope
    valid: Bools  # per node: the given cards are distinct fitting cards of the node


def _force(
    cluster: Cluster,
    scope: _Scope,
    d: CardDemand,
    fit: Bools,
    numa_bind: bool,
    given: Ints,
    where: Bools,
) -> _Forced:
    """The given cards (cluster indexes) as scope rows, and whether they are a valid pick."""
    n = scope.nodes.size
    row_of = {int(c): r for r, c in enumerate(scope.cards.tolist())}
    rows = np.full((n, d.count), NO_CARD, dtype=np.int64)
    valid = np.zeros(n, dtype=np.bool_)
    if given.shape != (n, d.count):
        return _Forced(rows, valid)
    for i in np.flatnonzero(where).tolist():
        picks = [row_of.get(int(c), NO_CARD) for c in given[i].tolist()]
        rows[i] = picks
        ok = all(r >= 0 and scope.pos[r] == i and fit[r] for r in picks)
        ok = ok and len(set(picks)) == len(picks)
        if ok and numa_bind and d.count > 1:
            ok = len({int(cluster.numa[scope.cards[r]]) for r in picks}) == 1
        valid[i] = ok
    return _Forced(rows, valid)


@dataclass
class _Prices:
    """Per row of the scope: the card score, and for the fragmentation policy the
    node's fragmentation and free share if the container took that card."""

    score: Floats
    fragmentation: Floats | None = None
    total: Floats | None = None
    rows: Ints | None = None  # per node, the card a one-card pod took


def _list_places(
    cluster: Cluster, scope: _Scope, card_score: Floats, place: Ints, fresh: bool
) -> Ints:
    """HAMi's card list re-sorted for one container: by score (low first), NUMA node,
    then the list's order before (the node's card order when ``fresh``); returns each
    row's new place in its node's list. HAMi takes cards from the end."""
    if fresh:
        place = np.arange(scope.cards.size, dtype=np.int64) - scope.bounds[scope.pos]
    order = np.lexsort((place, cluster.numa[scope.cards], card_score, scope.pos))
    new = np.empty_like(place)
    new[order] = np.arange(order.size, dtype=np.int64) - scope.bounds[scope.pos[order]]
    return new


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
    if demand.gpu_policy is not GpuPolicy.FRAGMENTATION:
        weights = demand.request.scoring_weights if demand.request else EVEN
        hami = hami_card_score(cluster, scope.cards, usage, d, mem, weights)
        return _Prices(hami if demand.gpu_policy is GpuPolicy.BINPACK else -hami)
    hami = hami_card_score(cluster, scope.cards, usage, d, mem)
    if mix is None or fragments is None:
        raise ValueError("the fragmentation policy needs a workload mix")
    before, use, share = fragments
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
        use,
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
    new_share = free_share(cluster, scope.cards[rows], after)
    prices.total[rows] = before.total[pos] - share[rows] + new_share
    return prices


def _pick(
    cluster: Cluster,
    scope: _Scope,
    d: CardDemand,
    fit: Bools,
    card_score: Floats,
    numa_bind: bool,
    tie: Ints | None = None,
) -> tuple[Ints, Bools]:
    """The best ``d.count`` fitting rows per node: ((nodes, count) rows, node short of
    cards); among equal scores the higher ``tie`` first, else (None) the first row."""
    n = scope.nodes.size
    picked = np.full((n, d.count), NO_CARD, dtype=np.int64)
    rows = np.flatnonzero(fit)
    if rows.size == 0:
        return picked, np.ones(n, dtype=np.bool_)
    bind = numa_bind and d.count > 1
    numa = cluster.numa[scope.cards[rows]] + 1 if bind else np.zeros(rows.size, np.int64)
    width = int(numa.max()) + 1
    group = scope.pos[rows] * width + numa
    keys = (-card_score[rows], group) if tie is None else (-tie[rows], -card_score[rows], group)
    order = np.lexsort(keys)
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
            code[i] = Code.NODE_INSUFFICIENT_DEVICE
            detail[i] = f"NodeInsufficientDevice: container {container!r}: the node has no GPU"
            continue
        present = int(cards[i] - counts[i, Code.NOT_FOUND])
        if present < d.count:
            code[i] = Code.NODE_INSUFFICIENT_DEVICE
            detail[i] = (
                f"NodeInsufficientDevice: container {container!r} needs {d.count} "
                f"card(s), the node has {present}"
            )
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
