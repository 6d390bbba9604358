"""The compiled placement engine against the NumPy one it replaced (tests/engine_reference.py).

On random clusters (0 to 8 cards a node, mixed models, NUMA unknown/0/1, usage
with owned, unhealthy, absent and cordoned cards, node CPU and memory finite or
not) and random pods (every GPU policy with every node policy, with and without
a workload mix, several containers with init and sidecar ones, card type and
UUID lists, NUMA binding, CPU-only pods), on subsets of the nodes,
:func:`gpuslice_scheduler.engine.evaluate` must answer as the reference does:
the same nodes, feasibility, reason codes and lines, scores within 1e-9
(relative, or absolute below 1) and the same cards.

Cards may differ only where the reference scores them the same: two cards
equal to the last bits can come out in either order from another order of
floating-point sums. Where a node's cards differ, the reference replays the
evaluation with the compiled engine's cards (:func:`engine_reference.replay`)
and the test requires, container by container, that those cards fit, belong to
the node, differ from each other, share a NUMA node where the pod binds NUMA,
and score within 1e-9 of the best pick the reference could make in that state;
the rest of that node's answer (later containers, score) is then compared with
the replay's. A node the compiled engine calls infeasible is not replayed: it
must be infeasible for the reference too.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from gpuslice_common.models import (
    ContainerGpuRequest,
    DeviceSelector,
    GpuPolicy,
    MemoryRequest,
    NodePolicy,
    PodGpuRequest,
    PodRef,
    ScoringWeights,
)
from gpuslice_scheduler.cluster import Cluster, Ints, Row
from gpuslice_scheduler.engine import NO_CARD, Demand, Evaluation, evaluate
from gpuslice_scheduler.fit import CardDemand
from gpuslice_scheduler.fragmentation import WorkloadClass, WorkloadMix, default_mix
from tests import engine_reference as reference
from tests.test_engine_properties import containers

TOLERANCE = 1e-9
MODELS = ("NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3", "Tesla T4")
TYPE_WORDS = ("a100", "H100", "t4", "nvidia", "tesla")
NODE_POLICIES: list[NodePolicy | None] = [None, NodePolicy.BINPACK, NodePolicy.SPREAD]


def examples(count: int) -> settings:
    """``count`` examples, no deadline, and no shrinking: a failing example is printed as
    drawn, at once, where shrinking one of these clusters can take the five minutes
    Hypothesis allows it per test."""
    return settings(
        max_examples=count,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
        phases=[Phase.explicit, Phase.reuse, Phase.generate],
        report_multiple_bugs=False,
    )


# ---------------------------------------------------------------- strategies


def rarely(odd: bool, usual: bool) -> st.SearchStrategy[bool]:
    """``odd`` one time in eight."""
    return st.sampled_from([odd, *[usual] * 7])


def mostly_empty(lists: st.SearchStrategy[tuple[str, ...]]) -> st.SearchStrategy[tuple[str, ...]]:
    """No constraint three times in four, else one drawn from ``lists``."""
    return st.one_of(st.just(()), st.just(()), st.just(()), lists)


@st.composite
def card_rows(draw: st.DrawFn, node: str, index: int) -> Row:
    cap_mem = draw(st.sampled_from([1000, 8000, 16000, 24000]))
    cap_cores = draw(st.sampled_from([100, 100, 150, 200]))
    cap_slots = draw(st.integers(1, 10))
    idle = draw(st.booleans())
    light = draw(st.sampled_from([True, True, True, False]))  # else up to full, or full
    used_mem = 0 if idle else draw(st.integers(0, cap_mem // 2 if light else cap_mem))
    used_cores = 0 if idle else draw(st.integers(0, cap_cores // 2 if light else cap_cores))
    used_slots = 0 if idle else draw(st.integers(0, cap_slots - 1 if light else cap_slots))
    if not idle and not light and draw(st.booleans()):
        used_mem, used_cores = cap_mem, cap_cores
    owned = not idle and draw(rarely(True, False))
    return (
        f"GPU-{node}-{index}",
        draw(st.sampled_from(MODELS)),
        draw(st.sampled_from([-1, 0, 1])),
        cap_mem,
        cap_cores,
        cap_slots,
        used_mem,
        used_cores,
        used_slots,
        owned,
        draw(rarely(False, True)),  # healthy
        draw(rarely(False, True)),  # present
        draw(rarely(True, False)),  # cordoned
    )


FREE = st.sampled_from([math.inf] * 4 + [0.0, 500.0, 2000.0, 8000.0, 32000.0, 64000.0, -100.0])


# What pods and classes ask of the node's CPU (milli) and memory (MiB), and what nodes
# have free, close enough that a pod often leaves a node short for some class.
ASKED = st.sampled_from([0.0, 1000.0, 2000.0, 3000.0, 4000.0, 8000.0])
TIGHT = st.sampled_from([2000.0, 4000.0, 5000.0, 6000.0, 8000.0, 12000.0, 16000.0, math.inf])


@st.composite
def clusters(draw: st.DrawFn, max_nodes: int = 6, tight: bool = False) -> Cluster:
    nodes = []
    for n in range(draw(st.integers(1, max_nodes))):
        name = f"node{n}"
        count = draw(st.sampled_from([0, 1, 2, 3, 4, 5, 6, 7, 8, 2, 4, 8]))
        nodes.append((name, [draw(card_rows(name, i)) for i in range(count)]))
    size = len(nodes)
    if tight:
        cpu = draw(st.lists(TIGHT, min_size=size, max_size=size))
        mem = draw(st.lists(TIGHT, min_size=size, max_size=size))
    else:
        cpu = draw(st.one_of(st.none(), st.lists(FREE, min_size=size, max_size=size)))
        mem = draw(st.one_of(st.none(), st.lists(FREE, min_size=size, max_size=size)))
    return Cluster.from_rows(nodes, cpu, mem)


def type_lists() -> st.SearchStrategy[tuple[str, ...]]:
    return st.lists(st.sampled_from(TYPE_WORDS), max_size=2, unique=True).map(tuple)


@st.composite
def requests(draw: st.DrawFn, cluster: Cluster, max_containers: int = 3) -> PodGpuRequest:
    several = st.lists(
        st.sampled_from(["app", "app", "init", "sidecar"]), min_size=1, max_size=max_containers
    )
    # One app container half the time: the common pod, and the one whose node score
    # under the fragmentation policy follows the card it took.
    kinds = draw(st.one_of(st.just(["app"]), several))
    # Init containers first, in order, then the apps: parse_pod's order.
    kinds = [k for k in kinds if k != "app"] + [k for k in kinds if k == "app"]
    built = tuple(draw(containers(f"c{i}", kind)) for i, kind in enumerate(kinds))
    uuids = [*cluster.uuids, "GPU-elsewhere"]
    some_uuids = st.lists(st.sampled_from(uuids), max_size=3, unique=True).map(tuple)
    selector = DeviceSelector(
        include_types=draw(mostly_empty(type_lists())),
        exclude_types=draw(mostly_empty(type_lists())),
        include_uuids=draw(mostly_empty(some_uuids)),
        exclude_uuids=draw(mostly_empty(some_uuids)),
        numa_bind=draw(st.booleans()),
    )
    return PodGpuRequest(
        pod=PodRef(uid="pod"),
        containers=built,
        selector=selector,
        scoring_weights=draw(st.one_of(st.just(ScoringWeights()), WEIGHTS)),
    )


# Small weights, so that cards often tie; now and then a large one.
WEIGHTS = st.builds(
    ScoringWeights,
    slot=st.sampled_from([0, 1, 2, 5, 10**9]),
    core=st.sampled_from([0, 1, 3]),
    memory=st.sampled_from([1, 2, 7]),
)


NODE_CPU = st.sampled_from([0.0] * 5 + [250.0, 1000.0, 4000.0, 16000.0])
NODE_MEM = st.sampled_from([0.0] * 5 + [512.0, 4096.0, 32768.0])


@st.composite
def card_demands(draw: st.DrawFn) -> CardDemand:
    percent = draw(st.booleans())
    cores = draw(st.sampled_from([0, 10, 25, 50, 75, 100, 100, 30]))
    return CardDemand(
        count=draw(st.sampled_from([1, 1, 1, 2, 4, 8])),
        mem_mib=-1 if percent else draw(st.sampled_from([0, 1000, 4000, 16000])),
        mem_percent=draw(st.sampled_from([0, 10, 50, 100, cores])) if percent else -1,
        cores=cores,
        exclusive=draw(st.sampled_from([cores == 100, cores == 100, True, False])),
    )


@st.composite
def workload_classes(draw: st.DrawFn, tight: bool = False) -> WorkloadClass:
    card = draw(st.one_of(st.none(), card_demands(), card_demands()))
    selector = DeviceSelector(
        include_types=draw(mostly_empty(type_lists())),
        exclude_types=draw(mostly_empty(type_lists())),
    )
    return WorkloadClass(
        frequency=draw(st.sampled_from([0.5, 1.0, 2.0, 3.0, 10.0, 0.01])),
        card=card,
        selector=selector,
        cpu=draw(ASKED if tight else NODE_CPU),
        memory=draw(ASKED if tight else NODE_MEM),
    )


def random_mixes(tight: bool = False) -> st.SearchStrategy[WorkloadMix]:
    return st.builds(
        WorkloadMix.of,
        st.lists(workload_classes(tight), min_size=1, max_size=6),
        st.sampled_from([0.0, 0.5, 1.0]),
    )


MIXES = st.one_of(st.just(default_mix()), random_mixes())


@st.composite
def subsets(draw: st.DrawFn, cluster: Cluster) -> Ints:
    """Some of the nodes, in any order, each at most once (possibly none)."""
    picked = draw(st.lists(st.integers(0, cluster.node_count - 1), unique=True))
    return np.asarray(picked, dtype=np.int64)


# ---------------------------------------------------------------- comparing


def close(got: float, want: float) -> bool:
    if math.isinf(want) or math.isinf(got):
        return got == want
    return abs(got - want) <= TOLERANCE * max(1.0, abs(got), abs(want))


def assert_scores(got: np.ndarray[Any, Any], want: np.ndarray[Any, Any]) -> None:
    assert got.shape == want.shape
    bad = [
        (i, g, w)
        for i, (g, w) in enumerate(zip(got.tolist(), want.tolist(), strict=True))
        if not close(g, w)
    ]
    assert not bad, f"scores differ (row, compiled, reference): {bad}"


def usage_of(cluster: Cluster) -> list[list[Any]]:
    """What an evaluation must leave as it was: the cards' usage, the nodes' CPU and memory."""
    arrays = (cluster.used_mem, cluster.used_cores, cluster.used_slots, cluster.owned)
    return [a.tolist() for a in (*arrays, cluster.node_cpu_free, cluster.node_mem_free)]


def outcome(run: Callable[[], Evaluation]) -> Evaluation | type[Exception]:
    try:
        return run()
    except ValueError:
        return ValueError


def compare(
    cluster: Cluster, demand: Demand, nodes: Ints, mix: WorkloadMix | None
) -> Evaluation | None:
    """Both engines on ``nodes``; fails where they disagree (see the module's docstring).
    Returns the reference's evaluation, None where both refused the pod."""
    want = outcome(lambda: reference.evaluate(cluster, demand, nodes, mix))
    before = usage_of(cluster)
    got = outcome(lambda: evaluate(cluster, demand, nodes.copy(), mix))
    assert usage_of(cluster) == before, "evaluate changed the cluster"
    if not isinstance(want, Evaluation) or not isinstance(got, Evaluation):
        assert got is want, f"compiled {got!r}, reference {want!r}"
        return None
    assert got.nodes.tolist() == nodes.tolist()
    assert len(got.detail) == nodes.size
    assert len(got.chosen) == len(want.chosen)
    for g, w in zip(got.chosen, want.chosen, strict=True):
        assert g.shape == w.shape
    differs = np.zeros(nodes.size, dtype=np.bool_)
    for g, w in zip(got.chosen, want.chosen, strict=True):
        differs |= (g != w).any(axis=1)
    compared = want
    if differs.any():
        assert demand.request is not None
        # Cards differ: they must be a pick the reference scores as well as its own.
        rep = reference.replay(
            cluster, demand, nodes, mix, [c.copy() for c in got.chosen], got.feasible.copy()
        )
        for row in np.flatnonzero(differs & got.feasible).tolist():
            assert rep.valid[row], f"node row {row}: the compiled engine's cards do not fit"
            for k, (taken, best) in enumerate(zip(rep.taken, rep.best, strict=True)):
                assert close(float(taken[row]), float(best[row])), (
                    f"node row {row}, container {k}: cards scoring {taken[row]!r} where the "
                    f"best scores {best[row]!r} (compiled {got.chosen[k][row].tolist()}, "
                    f"reference {want.chosen[k][row].tolist()})"
                )
        compared = rep.evaluation
    assert got.feasible.tolist() == compared.feasible.tolist()
    assert got.code.tolist() == compared.code.tolist()
    assert got.detail == compared.detail
    assert_scores(got.score, compared.score)
    for g, w in zip(got.chosen, compared.chosen, strict=True):
        assert g.tolist() == w.tolist()
    return want


def demands(
    request: PodGpuRequest | None, gpu: GpuPolicy, node: NodePolicy | None
) -> st.SearchStrategy[Demand]:
    return st.builds(Demand, st.just(request), st.just(gpu), st.just(node), NODE_CPU, NODE_MEM)


def both_scopes(
    data: st.DataObject, cluster: Cluster, demand: Demand, mix: WorkloadMix | None
) -> None:
    """Every node, then a subset, then every node in reverse."""
    everything = np.arange(cluster.node_count, dtype=np.int64)
    compare(cluster, demand, everything, mix)
    compare(cluster, demand, data.draw(subsets(cluster)), mix)
    compare(cluster, demand, everything[::-1].copy(), mix)


# ---------------------------------------------------------------- properties


@pytest.mark.parametrize("node_policy", NODE_POLICIES)
@pytest.mark.parametrize("gpu_policy", list(GpuPolicy))
@examples(40)
@given(data=st.data(), cluster=clusters(), mix=st.one_of(st.none(), MIXES, MIXES))
def test_gpu_pods_are_placed_as_the_reference_places_them(
    data: st.DataObject,
    cluster: Cluster,
    mix: WorkloadMix | None,
    gpu_policy: GpuPolicy,
    node_policy: NodePolicy | None,
) -> None:
    request = data.draw(requests(cluster))
    demand = data.draw(demands(request, gpu_policy, node_policy))
    both_scopes(data, cluster, demand, mix)


@pytest.mark.parametrize("node_policy", NODE_POLICIES)
@pytest.mark.parametrize("gpu_policy", list(GpuPolicy))
@examples(15)
@given(data=st.data(), cluster=clusters(), mix=st.one_of(st.none(), MIXES, MIXES))
def test_cpu_only_pods_are_scored_as_the_reference_scores_them(
    data: st.DataObject,
    cluster: Cluster,
    mix: WorkloadMix | None,
    gpu_policy: GpuPolicy,
    node_policy: NodePolicy | None,
) -> None:
    demand = data.draw(demands(None, gpu_policy, node_policy))
    both_scopes(data, cluster, demand, mix)


@pytest.mark.parametrize("node_policy", NODE_POLICIES)
@examples(80)
@given(data=st.data(), cluster=clusters(tight=True), mix=random_mixes(tight=True))
def test_pods_on_nodes_short_of_cpu_or_memory_are_placed_as_the_reference_places_them(
    data: st.DataObject, cluster: Cluster, mix: WorkloadMix, node_policy: NodePolicy | None
) -> None:
    """The fragmentation policy where the pod's and the classes' CPU and memory decide
    which nodes could still host a class once the pod is there."""
    request = data.draw(
        st.one_of(requests(cluster, max_containers=1), requests(cluster), st.none())
    )
    cpu, memory = data.draw(ASKED), data.draw(ASKED)
    demand = Demand(request, GpuPolicy.FRAGMENTATION, node_policy, cpu, memory)
    both_scopes(data, cluster, demand, mix)


@examples(40)
@given(data=st.data(), cluster=clusters(), mix=MIXES)
def test_pods_placed_one_after_another_are_placed_as_the_reference_places_them(
    data: st.DataObject, cluster: Cluster, mix: WorkloadMix
) -> None:
    """As the extender and the replay go: evaluate, take the best node's cards, again.

    Each placement changes the cluster in place, so nothing either engine keeps
    from one call to the next may outlive the change."""
    everything = np.arange(cluster.node_count, dtype=np.int64)
    for _ in range(4):
        request = data.draw(st.one_of(requests(cluster), st.none()))
        policies = st.sampled_from(list(GpuPolicy))
        demand = Demand.of(request, data.draw(policies), data.draw(NODE_CPU), data.draw(NODE_MEM))
        want = compare(cluster, demand, everything, mix)
        compare(cluster, demand, data.draw(subsets(cluster)), mix)
        if want is None or not want.feasible.any():
            continue
        best = int(np.argmax(want.score))
        take(cluster, demand, want, best)


def take(cluster: Cluster, demand: Demand, ev: Evaluation, row: int) -> None:
    """Add what ``demand`` takes on the node of ``row`` (as ``ev`` chose) to the cluster."""
    node = int(ev.nodes[row])
    footprint: dict[int, list[int]] = {}  # card -> [mem, cores, slots, exclusive]
    if demand.request is not None:
        for container, picked in zip(demand.request.containers, ev.chosen, strict=True):
            if container.init and not container.sidecar:
                continue
            for card in picked[row].tolist():
                assert card != NO_CARD
                f = footprint.setdefault(card, [0, 0, 0, 0])
                f[0] += container.memory.on_card(int(cluster.cap_mem[card]))
                f[1] += container.cores
                f[2] += 1
                f[3] |= container.exclusive
    cards = np.asarray(list(footprint), dtype=np.int64)
    values = np.asarray(list(footprint.values()), dtype=np.int64).reshape(-1, 4)
    cluster.take(
        cards,
        values[:, 0],
        values[:, 1],
        values[:, 2],
        values[:, 3].astype(np.bool_),
        node,
        demand.cpu,
        demand.memory,
    )


# ---------------------------------------------------------------- the test itself


def test_a_worse_pick_is_caught_and_an_equal_one_accepted() -> None:
    """The tie rule accepts only cards the reference scores as well as its own."""
    idle = ("", "Tesla T4", 0, 16000, 100, 10, 0, 0, 0, False, True, True, False)
    half = ("", "Tesla T4", 0, 16000, 100, 10, 8000, 50, 1, False, True, True, False)
    cluster = Cluster.from_rows([("n0", [idle, half, idle])])
    cluster.uuids[:] = ["GPU-0", "GPU-1", "GPU-2"]
    request = PodGpuRequest(
        pod=PodRef(uid="p"),
        containers=(ContainerGpuRequest(name="c", count=1, memory=MemoryRequest(percent=10)),),
    )
    demand = Demand.of(request, GpuPolicy.BINPACK)
    nodes = np.asarray([0], dtype=np.int64)
    want = reference.evaluate(cluster, demand, nodes, None)
    assert want.chosen[0].tolist() == [[1]]  # binpack: the half-used card
    feasible = np.asarray([True])
    worse = reference.replay(cluster, demand, nodes, None, [np.asarray([[0]])], feasible)
    assert worse.valid[0]
    assert not close(float(worse.taken[0][0]), float(worse.best[0][0]))
    # The two idle cards tie: HAMi's pick is the last, but either scores as well,
    # and the replay says so.
    spread = Demand.of(request, GpuPolicy.SPREAD)
    assert reference.evaluate(cluster, spread, nodes, None).chosen[0].tolist() == [[2]]
    other = reference.replay(cluster, spread, nodes, None, [np.asarray([[0]])], feasible)
    assert other.valid[0]
    assert close(float(other.taken[0][0]), float(other.best[0][0]))
    assert other.evaluation.chosen[0].tolist() == [[0]]
    # A card of no node in the scope, or one that does not fit, is no pick at all.
    for bad in (7, NO_CARD):
        wrong = reference.replay(cluster, spread, nodes, None, [np.asarray([[bad]])], feasible)
        assert not wrong.valid[0]
        assert not wrong.evaluation.feasible[0]


@examples(60)
@given(
    data=st.data(),
    cluster=clusters(),
    mix=MIXES,
    gpu_policy=st.sampled_from(list(GpuPolicy)),
    node_policy=st.sampled_from(NODE_POLICIES),
)
def test_a_replay_of_the_references_own_cards_is_its_evaluation(
    data: st.DataObject,
    cluster: Cluster,
    mix: WorkloadMix,
    gpu_policy: GpuPolicy,
    node_policy: NodePolicy | None,
) -> None:
    """The replay that judges differing cards changes nothing else: given the reference's
    own cards it answers exactly as the reference, and they score the best."""
    demand = data.draw(demands(data.draw(requests(cluster)), gpu_policy, node_policy))
    nodes = data.draw(subsets(cluster))
    want = reference.evaluate(cluster, demand, nodes, mix)
    rep = reference.replay(cluster, demand, nodes, mix, want.chosen, want.feasible.copy())
    got = rep.evaluation
    assert got.feasible.tolist() == want.feasible.tolist()
    assert got.code.tolist() == want.code.tolist()
    assert got.detail == want.detail
    assert got.score.tolist() == want.score.tolist()
    assert [c.tolist() for c in got.chosen] == [c.tolist() for c in want.chosen]
    assert rep.valid[want.feasible].all()
    for taken, best in zip(rep.taken, rep.best, strict=True):
        assert taken[want.feasible].tolist() == best[want.feasible].tolist()
        assert np.isfinite(taken[want.feasible]).all()


def test_the_reference_node_fragmentation_is_the_engines() -> None:
    """Reference fragmentation on a hand-made node: a half card is a fragment for whole-card
    pods, and the free share counts both cards."""
    idle = ("GPU-0", "Tesla T4", 0, 16000, 100, 10, 0, 0, 0, False, True, True, False)
    half = ("GPU-1", "Tesla T4", 0, 16000, 100, 10, 8000, 50, 1, False, True, True, False)
    cluster = Cluster.from_rows([("n0", [idle, half]), ("n1", [])])
    whole = WorkloadMix.of([WorkloadClass(1, CardDemand(1, -1, 100, 100, True))])
    frag, total = reference.node_fragmentation(whole, cluster, np.asarray([1, 0]))
    assert frag.tolist() == [0.0, 500.0]
    assert total.tolist() == [0.0, 1500.0]


# ---------------------------------------------------------------- node fragmentation


def test_node_fragmentation_is_the_references() -> None:
    """The product's per-node fragmentation and free share, which replaced node_fragments."""
    # Imported first, so that a product without it fails at once rather than in each example.
    from gpuslice_scheduler.fragmentation import node_fragmentation

    @examples(60)
    @given(data=st.data(), cluster=clusters(), mix=MIXES)
    def matches(data: st.DataObject, cluster: Cluster, mix: WorkloadMix) -> None:
        for nodes in (np.arange(cluster.node_count, dtype=np.int64), data.draw(subsets(cluster))):
            frag, total = node_fragmentation(mix, cluster, nodes.copy())
            want_frag, want_total = reference.node_fragmentation(mix, cluster, nodes)
            assert_scores(np.asarray(frag, dtype=float), want_frag)
            assert_scores(np.asarray(total, dtype=float), want_total)

    matches()


def test_odd_node_cpu_and_memory_starve_alike_in_both() -> None:
    """A node's free CPU or memory that is NaN counts as none (as the fit reads it),
    and inf, negative or huge ones are priced alike: the core and the reference
    agree, and neither gives a NaN score."""
    from gpuslice_scheduler.fragmentation import node_fragmentation

    idle = ("GPU-0", "Tesla T4", 0, 16000, 100, 10, 0, 0, 0, False, True, True, False)
    half = ("GPU-1", "Tesla T4", 0, 16000, 100, 10, 8000, 50, 1, False, True, True, False)
    rows = [("n0", [idle, half]), ("n1", [idle]), ("n2", [idle, idle])]
    nodes = np.arange(3, dtype=np.int64)
    clusters = [
        ([math.nan, 1000.0, 2000.0], [1e4] * 3),
        ([1000.0] * 3, [math.nan, 1.0, 2.0]),
        ([math.inf, -5000.0, -math.inf], [math.inf, 1e4, 1e308]),
    ]
    shares = CardDemand(1, -1, 50, 50, False)
    for cpu, mem in clusters:
        cluster = Cluster.from_rows(rows, cpu, mem)
        for classes in (
            [WorkloadClass(1, shares, cpu=500.0, memory=1000.0)],
            [WorkloadClass(1, shares, cpu=1e308, memory=1e308)],
            [WorkloadClass(1, shares, cpu=1e308), WorkloadClass(1, None, cpu=1e308)],
        ):
            frag, total = node_fragmentation(WorkloadMix.of(classes), cluster, nodes.copy())
            want, want_total = reference.node_fragmentation(WorkloadMix.of(classes), cluster, nodes)
            assert not np.isnan(frag).any()
            assert_scores(np.asarray(frag, dtype=float), want)
            assert_scores(np.asarray(total, dtype=float), want_total)
