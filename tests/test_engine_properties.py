"""Property tests: whatever the cluster and the pod, the engine's placements are safe.

For every node the engine calls feasible, the placement's footprint fits on top
of the cards' usage, each container's cards differ, only schedulable cards that
the pod's selector admits are used, and exclusive grants land on idle cards.
Every infeasible node gets a reason. Single-container pods are also checked
against a plain-Python rendering of HAMi's fit rules.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
from hypothesis import given, note, settings
from hypothesis import strategies as st

from gpuslice_common.models import (
    ContainerGpuRequest,
    DeviceSelector,
    FitReason,
    GpuCapacity,
    GpuDevice,
    GpuPolicy,
    GpuState,
    GpuUsage,
    MemoryRequest,
    PodGpuRequest,
    PodRef,
)
from gpuslice_scheduler.cluster import Cluster
from gpuslice_scheduler.engine import NO_CARD, Demand, evaluate, normalise, placement
from gpuslice_scheduler.fragmentation import default_mix

EXAMPLES = settings(max_examples=150, deadline=None)
MIX = default_mix()
MODELS = ("NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3", "Tesla T4")
TYPE_WORDS = ("a100", "H100", "t4", "nvidia", "tesla")
R = FitReason

# ---------------------------------------------------------------- strategies


def mostly_empty(
    lists: st.SearchStrategy[tuple[str, ...]],
) -> st.SearchStrategy[tuple[str, ...]]:
    """No constraint three times in four, else one drawn from ``lists``."""
    return st.one_of(st.just(()), st.just(()), st.just(()), lists)


def rarely(odd: bool, usual: bool) -> st.SearchStrategy[bool]:
    """``odd`` one time in eight."""
    return st.sampled_from([odd, *[usual] * 7])


@st.composite
def cards(draw: st.DrawFn, node: str, index: int) -> GpuState:
    cap_mem = draw(st.sampled_from([1000, 8000, 16000, 24000]))
    cap_cores = draw(st.sampled_from([100, 100, 150, 200]))
    cap_slots = draw(st.integers(1, 10))
    idle = draw(st.booleans())
    used = (
        GpuUsage()
        if idle
        else GpuUsage(
            memory_mib=draw(st.one_of(st.integers(0, cap_mem // 2), st.integers(0, cap_mem))),
            cores=draw(st.one_of(st.integers(0, cap_cores // 2), st.integers(0, cap_cores))),
            slots=draw(st.integers(0, cap_slots)),
            exclusive_owner=draw(st.sampled_from([None, None, None, "owner"])),
        )
    )
    return GpuState(
        node=node,
        device=GpuDevice(
            uuid=f"GPU-{node}-{index}",
            index=index,
            model=draw(st.sampled_from(MODELS)),
            memory_mib=cap_mem,
            numa=draw(st.sampled_from([None, 0, 1])),
            healthy=draw(rarely(False, True)),
        ),
        capacity=GpuCapacity(memory_mib=cap_mem, cores=cap_cores, slots=cap_slots),
        used=used,
        present=draw(rarely(False, True)),
        cordoned=draw(rarely(True, False)),
    )


@st.composite
def clusters(draw: st.DrawFn) -> list[tuple[str, list[GpuState]]]:
    nodes = []
    for n in range(draw(st.integers(1, 4))):
        name = f"node{n}"
        nodes.append((name, [draw(cards(name, i)) for i in range(draw(st.integers(1, 8)))]))
    return nodes


@st.composite
def containers(draw: st.DrawFn, name: str, kind: str) -> ContainerGpuRequest:
    if draw(st.booleans()):
        memory = MemoryRequest(mib=draw(st.one_of(st.integers(1, 4000), st.integers(1, 24000))))
    else:
        memory = MemoryRequest(percent=draw(st.integers(1, 100)))
    return ContainerGpuRequest(
        name=name,
        init=kind != "app",
        sidecar=kind == "sidecar",
        count=draw(st.sampled_from([1, 1, 1, 2, 2, 3, 4])),
        memory=memory,
        cores=draw(st.one_of(st.sampled_from([0, 10, 25, 50, 75, 99, 100]), st.integers(0, 100))),
    )


@st.composite
def requests(
    draw: st.DrawFn, nodes: list[tuple[str, list[GpuState]]], max_containers: int = 3
) -> PodGpuRequest:
    kinds = draw(
        st.lists(
            st.sampled_from(["app", "app", "init", "sidecar"]), min_size=1, max_size=max_containers
        )
    )
    # Init containers first, in order, then the apps: parse_pod's order.
    kinds = [k for k in kinds if k != "app"] + [k for k in kinds if k == "app"]
    built = tuple(draw(containers(f"c{i}", kind)) for i, kind in enumerate(kinds))
    all_uuids = [s.device.uuid for _, states in nodes for s in states]
    some_uuids = st.lists(st.sampled_from(all_uuids), max_size=3, unique=True).map(tuple)
    some_types = st.lists(st.sampled_from(TYPE_WORDS), max_size=2, unique=True).map(tuple)
    selector = DeviceSelector(
        include_types=draw(mostly_empty(some_types)),
        exclude_types=draw(mostly_empty(some_types)),
        include_uuids=draw(mostly_empty(some_uuids)),
        exclude_uuids=draw(mostly_empty(some_uuids)),
        numa_bind=draw(st.booleans()),
    )
    return PodGpuRequest(pod=PodRef(uid="pod"), containers=built, selector=selector)


policies = st.sampled_from(list(GpuPolicy))

# ---------------------------------------------------------------- a plain HAMi oracle


def card_reason(
    state: GpuState, container: ContainerGpuRequest, selector: DeviceSelector
) -> FitReason | None:
    """HAMi's per-card rules in order, for one container on a card as the ledger has it."""
    cap, used = state.capacity, state.used
    model = state.device.model.lower()
    if not state.present:
        return R.CARD_NOT_FOUND
    if not state.device.healthy:
        return R.CARD_NOT_HEALTH
    if state.cordoned:
        return R.CARD_CORDONED
    if selector.include_types and not any(t.lower() in model for t in selector.include_types):
        return R.CARD_TYPE_MISMATCH
    if any(t.lower() in model for t in selector.exclude_types):
        return R.CARD_TYPE_MISMATCH
    uuid = state.device.uuid
    if (selector.include_uuids and uuid not in selector.include_uuids) or (
        uuid in selector.exclude_uuids
    ):
        return R.CARD_UUID_MISMATCH
    if used.slots + 1 > cap.slots:
        return R.CARD_TIME_SLICING_EXHAUSTED
    if used.memory_mib + container.memory.on_card(cap.memory_mib) > cap.memory_mib:
        return R.CARD_INSUFFICIENT_MEMORY
    if used.cores + container.cores > cap.cores:
        return R.CARD_INSUFFICIENT_CORE
    if used.exclusive_owner is not None or (container.exclusive and used.slots > 0):
        return R.EXCLUSIVE_DEVICE_ALLOCATE_CONFLICT
    if container.cores == 0 and used.cores >= cap.cores:
        return R.CARD_COMPUTE_UNITS_EXHAUSTED
    return None


ORDER = list(R)


@dataclass
class Expected:
    feasible: bool
    reason: FitReason | None


def expected(
    states: list[GpuState], container: ContainerGpuRequest, selector: DeviceSelector
) -> Expected:
    """What the engine must say about one single-container pod on one node."""
    if sum(s.present for s in states) < container.count:  # HAMi's check before any card
        return Expected(False, R.NODE_INSUFFICIENT_DEVICE)
    reasons = [card_reason(s, container, selector) for s in states]
    fitting = [s for s, r in zip(states, reasons, strict=True) if r is None]
    if selector.numa_bind and container.count > 1:
        groups = Counter(s.device.numa for s in fitting)
        if any(n >= container.count for n in groups.values()):
            return Expected(True, None)
        if len(fitting) >= container.count:
            return Expected(False, R.NUMA_NOT_FIT)
    elif len(fitting) >= container.count:
        return Expected(True, None)
    if fitting:
        return Expected(False, R.ALLOCATED_CARDS_INSUFFICIENT_REQUEST)
    counts = Counter(r for r in reasons if r is not None)
    top = max(counts.values())
    return Expected(False, min((r for r in counts if counts[r] == top), key=ORDER.index))


# ---------------------------------------------------------------- properties


def check_evaluation(
    nodes: list[tuple[str, list[GpuState]]], request: PodGpuRequest, policy: GpuPolicy
) -> None:
    cluster = Cluster.build(nodes)
    demand = Demand.of(request, policy)
    ev = evaluate(cluster, demand, np.arange(cluster.node_count), MIX)
    states = {s.device.uuid: s for _, node_states in nodes for s in node_states}
    assert ev.nodes.tolist() == list(range(cluster.node_count))
    assert len(ev.chosen) == len(request.containers)
    scaled = normalise(ev.score)
    assert all(0 <= s <= 10 for s in scaled)
    if ev.feasible.any():
        assert max(scaled) == 10
    for row, (name, _node_states) in enumerate(nodes):
        if not ev.feasible[row]:
            assert ev.reason(row) is not None
            assert ev.detail[row]
            assert np.isneginf(ev.score[row])
            assert all((picked[row] == NO_CARD).all() for picked in ev.chosen)
            continue
        assert ev.reason(row) is None
        assert ev.detail[row] == ""
        assert np.isfinite(ev.score[row])
        p = placement(cluster, demand, ev, row)
        assert p.node == name
        for container, assignment in zip(request.containers, p.containers, strict=True):
            used = [g.uuid for g in assignment.devices]
            assert len(used) == container.count
            assert len(set(used)) == len(used), "two grants of one container on one card"
            for grant in assignment.devices:
                state = states[grant.uuid]
                assert state.node == name
                assert state.present
                assert state.device.healthy
                assert not state.cordoned
                assert request.selector.admits(state.device)
                assert state.used.exclusive_owner is None
                assert grant.memory_mib == container.memory.on_card(state.capacity.memory_mib)
                assert grant.cores == container.cores
            if request.selector.numa_bind and container.count > 1:
                assert len({states[u].device.numa for u in used}) == 1
        for uuid, fp in p.footprint().items():
            state = states[uuid]
            cap, base = state.capacity, state.used
            assert base.memory_mib + fp.memory_mib <= cap.memory_mib
            assert base.cores + fp.cores <= cap.cores
            assert base.slots + fp.slots <= cap.slots
            if fp.exclusive:
                assert base.slots == 0
            if fp.cores == 0:
                assert base.cores < cap.cores


@EXAMPLES
@given(data=st.data(), nodes=clusters(), policy=policies)
def test_feasible_placements_fit_and_infeasible_nodes_say_why(
    data: st.DataObject, nodes: list[tuple[str, list[GpuState]]], policy: GpuPolicy
) -> None:
    check_evaluation(nodes, data.draw(requests(nodes)), policy)


@EXAMPLES
@given(data=st.data(), nodes=clusters(), policy=policies)
def test_single_container_pods_follow_hamis_rules(
    data: st.DataObject, nodes: list[tuple[str, list[GpuState]]], policy: GpuPolicy
) -> None:
    request = data.draw(requests(nodes, max_containers=1))
    (container,) = request.containers
    cluster = Cluster.build(nodes)
    ev = evaluate(cluster, Demand.of(request, policy), np.arange(cluster.node_count), MIX)
    for row, (_, states) in enumerate(nodes):
        want = expected(states, container, request.selector)
        assert (bool(ev.feasible[row]), ev.reason(row)) == (want.feasible, want.reason), ev.detail[
            row
        ]


@settings(max_examples=60, deadline=None)
@given(data=st.data(), nodes=clusters())
def test_placing_the_chosen_pod_keeps_the_cluster_within_capacity(
    data: st.DataObject, nodes: list[tuple[str, list[GpuState]]]
) -> None:
    """Place pods one after another, as the extender would; usage never passes capacity."""
    cluster = Cluster.build(nodes)
    index = {u: i for i, u in enumerate(cluster.uuids)}
    placed = 0
    for _ in range(4):
        request = data.draw(requests(nodes))
        demand = Demand.of(request, data.draw(policies))
        ev = evaluate(cluster, demand, np.arange(cluster.node_count), MIX)
        if not ev.feasible.any():
            continue
        best = int(np.argmax(ev.score))
        assert ev.feasible[best]
        placed_pod = placement(cluster, demand, ev, best)
        # A limit of 0 MiB would be none at all in the container: every grant has some.
        assert all(g.memory_mib >= 1 for c in placed_pod.containers for g in c.devices)
        fp = placed_pod.footprint()
        rows = np.asarray([index[u] for u in fp], dtype=np.int64)
        assert not cluster.owned[rows[[f.exclusive for f in fp.values()]]].any()
        cluster.take(
            rows,
            np.asarray([f.memory_mib for f in fp.values()], dtype=np.int64),
            np.asarray([f.cores for f in fp.values()], dtype=np.int64),
            np.asarray([f.slots for f in fp.values()], dtype=np.int64),
            np.asarray([f.exclusive for f in fp.values()], dtype=np.bool_),
            best,
        )
        assert cluster.schedulable(rows).all()
        assert (cluster.used_mem <= cluster.cap_mem).all()
        assert (cluster.used_cores <= cluster.cap_cores).all()
        assert (cluster.used_slots <= cluster.cap_slots).all()
        placed += 1
    note(f"placed {placed} pods")
