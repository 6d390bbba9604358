"""The report's "fits" against the placement engine itself: on random small clusters,
the pods of one kind that the engine places one after another until none fits are
as many as the report says would fit (for pods of several cards, no more: the
engine's own card choice may strand a card the count could use), and the count per
node of pods of several distinct cards matches an exhaustive search."""

from __future__ import annotations

import functools
import math

import numpy as np
from hypothesis import given, note, settings
from hypothesis import strategies as st

from gpuslice_common.models import (
    ContainerGpuRequest,
    GpuPolicy,
    MemoryRequest,
    PodGpuRequest,
    PodRef,
)
from gpuslice_scheduler.cluster import Cluster, Row
from gpuslice_scheduler.engine import Demand, evaluate, placement
from gpuslice_scheduler.fit import CardDemand
from gpuslice_scheduler.fragmentation import WorkloadClass
from gpuslice_scheduler.report import kind_fits, node_pods


@st.composite
def cards(draw: st.DrawFn, uuid: str) -> Row:
    cap_mem = draw(st.sampled_from([8000, 16000]))
    slots = draw(st.integers(1, 6))
    used_slots = draw(st.integers(0, slots))
    used_cores = 0 if used_slots == 0 else draw(st.sampled_from([0, 10, 25, 50, 90, 100]))
    used_mem = 0 if used_slots == 0 else draw(st.integers(0, cap_mem))
    owned = used_slots > 0 and draw(st.integers(0, 9)) == 0
    healthy = draw(st.integers(0, 9)) > 0
    cordoned = draw(st.integers(0, 9)) == 0
    model = draw(st.sampled_from(["A100", "T4"]))
    return (uuid, model, 0, cap_mem, 100, slots, used_mem, used_cores, used_slots, owned,
            healthy, True, cordoned)  # fmt: skip


@st.composite
def clusters(draw: st.DrawFn) -> Cluster:
    nodes = []
    cpu = []
    for n in range(draw(st.integers(1, 3))):
        rows = [draw(cards(f"GPU-{n}-{k}")) for k in range(draw(st.integers(1, 4)))]
        nodes.append((f"node-{n}", rows))
        cpu.append(draw(st.sampled_from([math.inf, 1000.0, 4000.0])))
    return Cluster.from_rows(nodes, node_cpu=cpu, node_mem=[math.inf] * len(nodes))


@st.composite
def kinds(draw: st.DrawFn, count: int | None = None) -> WorkloadClass:
    cores = draw(st.sampled_from([0, 10, 25, 50, 100]))
    percent = draw(st.one_of(st.none(), st.sampled_from([5, 25, 50, 100])))
    mib = -1 if percent is not None else draw(st.integers(500, 9000))
    demand = CardDemand(
        count if count is not None else draw(st.integers(1, 3)),
        mib,
        -1 if percent is None else percent,
        cores,
        cores == 100,  # as ContainerGpuRequest.exclusive
    )
    return WorkloadClass(1.0, demand, cpu=draw(st.sampled_from([0.0, 1000.0])))


def engine_places(cluster: Cluster, kind: WorkloadClass) -> int:
    """Pods of ``kind`` the engine places one after another (HAMi's binpack) until none fits."""
    card = kind.card
    assert card is not None
    memory = MemoryRequest(mib=card.mem_mib) if card.mem_mib >= 0 else None
    memory = memory or MemoryRequest(percent=card.mem_percent)
    container = ContainerGpuRequest(name="c", count=card.count, memory=memory, cores=card.cores)
    index = {u: i for i, u in enumerate(cluster.uuids)}
    for placed in range(200):
        request = PodGpuRequest(
            pod=PodRef(uid=f"u{placed}", namespace="ns", name=f"p{placed}"),
            containers=(container,),
        )
        demand = Demand.of(request, GpuPolicy.BINPACK, cpu=kind.cpu)
        ev = evaluate(cluster, demand, np.arange(cluster.node_count))
        if not ev.feasible.any():
            return placed
        best = int(np.argmax(np.where(ev.feasible, ev.score, -np.inf)))
        fp = placement(cluster, demand, ev, best).footprint()
        cluster.take(
            np.asarray([index[u] for u in fp], dtype=np.int64),
            np.asarray([f.memory_mib for f in fp.values()], dtype=np.int64),
            np.asarray([f.cores for f in fp.values()], dtype=np.int64),
            np.asarray([f.slots for f in fp.values()], dtype=np.int64),
            np.asarray([f.exclusive for f in fp.values()], dtype=np.bool_),
            int(ev.nodes[best]),
            cpu=kind.cpu,
        )
    raise AssertionError("the engine kept placing pods")


@settings(max_examples=60, deadline=None)
@given(cluster=clusters(), kind=kinds(count=1))
def test_one_card_kinds_fit_as_many_as_the_engine_places(
    cluster: Cluster, kind: WorkloadClass
) -> None:
    fits = kind_fits(cluster, kind)
    placed = engine_places(cluster, kind)
    note(f"fits {fits}, placed {placed}")
    assert fits == placed


@settings(max_examples=40, deadline=None)
@given(cluster=clusters(), kind=kinds())
def test_the_engine_never_places_more_than_fit(cluster: Cluster, kind: WorkloadClass) -> None:
    fits = kind_fits(cluster, kind)
    placed = engine_places(cluster, kind)
    note(f"fits {fits}, placed {placed}")
    assert placed <= fits
    assert (placed == 0) == (fits == 0)  # one pod fits wherever the count sees one


def most_pods(free: tuple[int, ...], count: int) -> int:
    """Exhaustively: the most pods of ``count`` distinct cards, card k taking free[k]."""

    @functools.cache
    def best(state: tuple[int, ...]) -> int:
        open_cards = [k for k, f in enumerate(state) if f > 0]
        top = 0
        for chosen in _subsets(open_cards, count):
            after = tuple(f - (k in chosen) for k, f in enumerate(state))
            top = max(top, 1 + best(tuple(sorted(after))))
        return top

    return best(tuple(sorted(free)))


def _subsets(items: list[int], size: int) -> list[tuple[int, ...]]:
    if size == 0:
        return [()]
    return [
        (items[i], *rest) for i in range(len(items)) for rest in _subsets(items[i + 1 :], size - 1)
    ]


@settings(max_examples=200, deadline=None)
@given(
    nodes=st.lists(st.lists(st.integers(0, 4), min_size=0, max_size=5), min_size=1, max_size=4),
    count=st.integers(1, 4),
)
def test_pods_of_distinct_cards_per_node_match_an_exhaustive_search(
    nodes: list[list[int]], count: int
) -> None:
    per_card = np.asarray([f for node in nodes for f in node], dtype=np.int64)
    sizes = np.asarray([len(node) for node in nodes], dtype=np.int64)
    got = node_pods(per_card, sizes, count).tolist()
    assert got == [most_pods(tuple(node), count) for node in nodes]
