"""The placement engine: HAMi's fit rules and reasons, card and node scores, phases, NUMA.

Pure unit tests over small hand-built clusters: no servers. Requests are built
directly as :class:`PodGpuRequest` or read from HAMi pod JSON with ``parse_pod``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from gpuslice_common.models import (
    ContainerGpuRequest,
    DeviceFootprint,
    DeviceSelector,
    FitReason,
    GpuCapacity,
    GpuDevice,
    GpuPolicy,
    GpuState,
    GpuUsage,
    MemoryRequest,
    NodeInventory,
    NodePolicy,
    Placement,
    PodGpuRequest,
    PodRef,
)
from gpuslice_common.requests import parse_pod
from gpuslice_scheduler.cluster import Cluster
from gpuslice_scheduler.engine import (
    NO_CARD,
    Demand,
    Evaluation,
    Evaluator,
    evaluate,
    normalise,
    placement,
)
from gpuslice_scheduler.fragmentation import default_mix
from tests import engine_reference as reference

MODEL = "NVIDIA A100-SXM4-80GB"
MEM = 10_000  # MiB per card in most tests, so percentages are easy to read

# ---------------------------------------------------------------- helpers


def gpu(
    node: str,
    index: int,
    *,
    mem: int = MEM,
    cores: int = 100,
    slots: int = 10,
    used_mem: int = 0,
    used_cores: int = 0,
    used_slots: int = 0,
    owner: str | None = None,
    model: str = MODEL,
    numa: int | None = None,
    healthy: bool = True,
    present: bool = True,
    cordoned: bool = False,
) -> GpuState:
    """One card as the ledger sees it; the UUID is ``GPU-<node>-<index>``."""
    return GpuState(
        node=node,
        device=GpuDevice(
            uuid=f"GPU-{node}-{index}",
            index=index,
            model=model,
            memory_mib=mem,
            numa=numa,
            healthy=healthy,
        ),
        capacity=GpuCapacity(memory_mib=mem, cores=cores, slots=slots),
        used=GpuUsage(
            memory_mib=used_mem, cores=used_cores, slots=used_slots, exclusive_owner=owner
        ),
        present=present,
        cordoned=cordoned,
    )


def busy(node: str, index: int, share: int, **kwargs: Any) -> GpuState:
    """A card on which one pod holds ``share`` % of compute and memory."""
    return gpu(node, index, used_mem=MEM * share // 100, used_cores=share, used_slots=1, **kwargs)


def cluster(*nodes: tuple[str, list[GpuState]]) -> Cluster:
    return Cluster.build(list(nodes))


def one_card(**kwargs: Any) -> Cluster:
    return cluster(("n0", [gpu("n0", 0, **kwargs)]))


def ctr(
    name: str = "main",
    *,
    count: int = 1,
    mib: int | None = None,
    percent: int | None = None,
    cores: int = 0,
    init: bool = False,
    sidecar: bool = False,
) -> ContainerGpuRequest:
    if mib is None and percent is None:
        mib = 1000
    return ContainerGpuRequest(
        name=name,
        init=init or sidecar,
        sidecar=sidecar,
        count=count,
        memory=MemoryRequest(mib=mib, percent=percent),
        cores=cores,
    )


def pod(
    *containers: ContainerGpuRequest,
    selector: DeviceSelector | None = None,
    gpu_policy: GpuPolicy | None = None,
    node_policy: NodePolicy | None = None,
) -> PodGpuRequest:
    return PodGpuRequest(
        pod=PodRef(uid="pod-1", name="pod-1"),
        containers=containers,
        selector=selector or DeviceSelector(),
        gpu_policy=gpu_policy,
        node_policy=node_policy,
    )


def hami_pod(
    containers: list[dict[str, Any]],
    *,
    init: list[dict[str, Any]] | None = None,
    annotations: dict[str, str] | None = None,
) -> PodGpuRequest:
    """A PodGpuRequest read from a HAMi pod manifest."""
    spec: dict[str, Any] = {"containers": containers}
    if init:
        spec["initContainers"] = init
    manifest = {
        "metadata": {"name": "p", "uid": "uid-p", "annotations": annotations or {}},
        "spec": spec,
    }
    request = parse_pod(manifest)
    assert request is not None
    return request


def limits(name: str, **resources: int | str) -> dict[str, Any]:
    """A container spec with ``nvidia.com/<key>`` limits (``gpumem_percentage`` -> dash)."""
    amounts = {f"nvidia.com/{k.replace('_', '-')}": v for k, v in resources.items()}
    return {"name": name, "resources": {"limits": amounts}}


def run(
    c: Cluster,
    request: PodGpuRequest,
    policy: GpuPolicy = GpuPolicy.BINPACK,
    nodes: list[int] | None = None,
) -> tuple[Demand, Evaluation]:
    demand = Demand.of(request, policy)
    mix = default_mix() if demand.gpu_policy is GpuPolicy.FRAGMENTATION else None
    rows = np.arange(c.node_count) if nodes is None else np.asarray(nodes, dtype=np.int64)
    return demand, evaluate(c, demand, rows, mix)


def place(c: Cluster, request: PodGpuRequest, policy: GpuPolicy = GpuPolicy.BINPACK) -> Placement:
    """The placement on the only node (or the first node) of ``c``; fails the test if none."""
    demand, ev = run(c, request, policy)
    assert ev.feasible[0], ev.detail[0]
    return placement(c, demand, ev, 0)


def uuids(p: Placement, container: str) -> list[str]:
    return [d.uuid for c in p.containers if c.name == container for d in c.devices]


def reject(c: Cluster, request: PodGpuRequest, row: int = 0) -> tuple[FitReason | None, str]:
    _, ev = run(c, request)
    assert not ev.feasible[row]
    assert np.isneginf(ev.score[row])
    assert all((picked[row] == NO_CARD).all() for picked in ev.chosen)
    return ev.reason(row), ev.detail[row]


def commit(c: Cluster, p: Placement) -> None:
    """Add a placement's footprint to the cluster, as the ledger would."""
    index = {u: i for i, u in enumerate(c.uuids)}
    fp = p.footprint()
    cards = np.asarray([index[u] for u in fp], dtype=np.int64)
    c.take(
        cards,
        np.asarray([f.memory_mib for f in fp.values()], dtype=np.int64),
        np.asarray([f.cores for f in fp.values()], dtype=np.int64),
        np.asarray([f.slots for f in fp.values()], dtype=np.int64),
        np.asarray([f.exclusive for f in fp.values()], dtype=np.bool_),
        c.node_index[p.node],
    )


# ---------------------------------------------------------------- each fit rule


R = FitReason
SMALL = ctr(mib=1000, cores=10)


@pytest.mark.parametrize(
    ("card", "container", "selector", "reason"),
    [
        pytest.param({"healthy": False}, SMALL, None, R.CARD_NOT_HEALTH, id="unhealthy"),
        pytest.param({"cordoned": True}, SMALL, None, R.CARD_CORDONED, id="cordoned"),
        pytest.param(
            {},
            SMALL,
            DeviceSelector(include_types=("H100",)),
            R.CARD_TYPE_MISMATCH,
            id="type-not-included",
        ),
        pytest.param(
            {},
            SMALL,
            DeviceSelector(exclude_types=("a100",)),
            R.CARD_TYPE_MISMATCH,
            id="type-excluded-any-case",
        ),
        pytest.param(
            {},
            SMALL,
            DeviceSelector(include_uuids=("GPU-other-0",)),
            R.CARD_UUID_MISMATCH,
            id="uuid-not-included",
        ),
        pytest.param(
            {},
            SMALL,
            DeviceSelector(exclude_uuids=("GPU-n0-0",)),
            R.CARD_UUID_MISMATCH,
            id="uuid-excluded",
        ),
        pytest.param(
            {"slots": 3, "used_slots": 3, "used_mem": 300, "used_cores": 30},
            SMALL,
            None,
            R.CARD_TIME_SLICING_EXHAUSTED,
            id="slots-used-up",
        ),
        pytest.param(
            {"used_mem": 9_500, "used_slots": 1},
            ctr(mib=501),
            None,
            R.CARD_INSUFFICIENT_MEMORY,
            id="memory-mib",
        ),
        pytest.param(
            {"used_mem": 5_001, "used_slots": 1},
            ctr(percent=50),
            None,
            R.CARD_INSUFFICIENT_MEMORY,
            id="memory-percent",
        ),
        pytest.param(
            {"used_cores": 50, "used_slots": 1},
            ctr(cores=51),
            None,
            R.CARD_INSUFFICIENT_CORE,
            id="cores",
        ),
        pytest.param(
            {"used_slots": 1, "used_mem": 100},
            ctr(percent=50, cores=100),
            None,
            R.EXCLUSIVE_DEVICE_ALLOCATE_CONFLICT,
            id="whole-card-on-shared-card",
        ),
        pytest.param(
            # Core scaling 2: the owner's 100 cores leave room, yet the card is held.
            {"cores": 200, "used_cores": 100, "used_mem": 1000, "used_slots": 1, "owner": "other"},
            ctr(mib=100, cores=10),
            None,
            R.EXCLUSIVE_DEVICE_ALLOCATE_CONFLICT,
            id="any-request-on-held-card",
        ),
        pytest.param(
            {"used_cores": 100, "used_mem": 1000, "used_slots": 2},
            ctr(mib=100, cores=0),
            None,
            R.CARD_COMPUTE_UNITS_EXHAUSTED,
            id="no-compute-left",
        ),
    ],
)
def test_each_fit_rule_gives_its_reason(
    card: dict[str, Any],
    container: ContainerGpuRequest,
    selector: DeviceSelector | None,
    reason: FitReason,
) -> None:
    got, detail = reject(one_card(**card), pod(container, selector=selector))
    assert got is reason
    assert detail.startswith(f"{reason.value}: container 'main' needs 1 card(s), 0 of 1 fit")
    assert f"(1 {reason.value})" in detail


@pytest.mark.parametrize(
    ("card", "container"),
    [
        pytest.param({"used_mem": 9_500, "used_slots": 1}, ctr(mib=500), id="memory-exactly-free"),
        pytest.param({"used_mem": 5_000, "used_slots": 1}, ctr(percent=50), id="percent-exact"),
        pytest.param({"used_cores": 50, "used_slots": 1}, ctr(cores=50), id="cores-exactly-free"),
        pytest.param({"slots": 3, "used_slots": 2}, SMALL, id="last-slot"),
        pytest.param({"used_cores": 99, "used_slots": 1}, ctr(cores=0), id="cores-0-one-left"),
        pytest.param({}, ctr(percent=100, cores=100), id="whole-card-on-empty-card"),
        # 33 % of 999 MiB is 329 (rounded down), exactly what is left.
        pytest.param({"mem": 999, "used_mem": 670, "used_slots": 1}, ctr(percent=33), id="floor"),
        # 1 % of 50 MiB rounds down to 0, but takes 1 MiB: 0 would be no limit at all.
        pytest.param({"mem": 50, "used_mem": 49, "used_slots": 1}, ctr(percent=1), id="tiny"),
    ],
)
def test_boundaries_that_still_fit(card: dict[str, Any], container: ContainerGpuRequest) -> None:
    _, ev = run(one_card(**card), pod(container))
    assert ev.feasible.tolist() == [True]
    assert ev.reason(0) is None
    assert ev.detail == [""]
    assert ev.chosen[0].tolist() == [[0]]


def test_an_absent_card_is_not_the_nodes() -> None:
    """HAMi lists only the cards a node reports: fewer than a container asks for is
    NodeInsufficientDevice, before any card's reason."""
    reason, detail = reject(one_card(present=False), pod(SMALL))
    assert reason is R.NODE_INSUFFICIENT_DEVICE
    assert detail == "NodeInsufficientDevice: container 'main' needs 1 card(s), the node has 0"
    two = cluster(("n0", [gpu("n0", 0, present=False, healthy=False), gpu("n0", 1)]))
    reason, detail = reject(two, pod(ctr(mib=100, count=2)))
    assert reason is R.NODE_INSUFFICIENT_DEVICE
    assert detail.endswith("needs 2 card(s), the node has 1")
    # With enough cards present, an absent one is CardNotFound, ahead of health.
    three = cluster(
        (
            "n0",
            [
                gpu("n0", 0, present=False, healthy=False),
                gpu("n0", 1, healthy=False),
                gpu("n0", 2, present=False),
                gpu("n0", 3, healthy=False),
            ],
        )
    )
    reason, detail = reject(three, pod(ctr(mib=100, count=2)))
    assert reason is R.CARD_NOT_FOUND
    assert detail.endswith("0 of 4 fit (2 CardNotFound, 2 CardNotHealth)")


@pytest.mark.parametrize(
    ("resources", "mem", "grant"),
    [
        pytest.param({"gpumem_percentage": 0}, MEM, MEM, id="percentage-0-is-the-whole-card"),
        pytest.param({"gpumem_percentage": 0, "gpumem": 0}, MEM, MEM, id="both-0"),
        pytest.param({"gpumem_percentage": 1}, 50, 1, id="1-percent-of-50-mib"),
        pytest.param({"gpumem_percentage": 100}, 50, 50, id="whole-tiny-card"),
    ],
)
def test_no_grant_is_zero_mib(resources: dict[str, int], mem: int, grant: int) -> None:
    """0 MiB reads as no limit in a container: no request, default or rounding gives it."""
    request = hami_pod([limits("app", gpu=1, **resources)])
    (container,) = place(one_card(mem=mem), request).containers
    assert [d.memory_mib for d in container.devices] == [grant]


def test_a_node_without_cards_is_node_insufficient_device() -> None:
    c = cluster(("cpu-only", []), ("gpu", [gpu("gpu", 0)]))
    _, ev = run(c, pod(SMALL))
    assert ev.feasible.tolist() == [False, True]
    assert ev.reason(0) is R.NODE_INSUFFICIENT_DEVICE
    assert ev.detail[0] == "NodeInsufficientDevice: container 'main': the node has no GPU"
    # Evaluating only card-less nodes must not fail either.
    _, alone = run(c, pod(SMALL), nodes=[0])
    assert alone.feasible.tolist() == [False]
    assert alone.reason(0) is R.NODE_INSUFFICIENT_DEVICE
    assert alone.chosen[0].tolist() == [[NO_CARD]]


@pytest.mark.parametrize(
    ("card", "container", "selector", "reason"),
    [
        pytest.param(
            {"healthy": False, "cordoned": True}, SMALL, None, R.CARD_NOT_HEALTH, id="health>cordon"
        ),
        pytest.param(
            {"cordoned": True},
            SMALL,
            DeviceSelector(include_types=("H100",)),
            R.CARD_CORDONED,
            id="cordon>type",
        ),
        pytest.param(
            {},
            SMALL,
            DeviceSelector(exclude_types=("A100",), exclude_uuids=("GPU-n0-0",)),
            R.CARD_TYPE_MISMATCH,
            id="type>uuid",
        ),
        pytest.param(
            {"slots": 1, "used_slots": 1, "used_mem": 10_000, "used_cores": 100},
            SMALL,
            DeviceSelector(include_uuids=("GPU-n0-9",)),
            R.CARD_UUID_MISMATCH,
            id="uuid>slots",
        ),
        pytest.param(
            {"slots": 2, "used_slots": 2, "used_mem": 10_000, "used_cores": 100},
            SMALL,
            None,
            R.CARD_TIME_SLICING_EXHAUSTED,
            id="slots>memory",
        ),
        pytest.param(
            {"used_mem": 9_000, "used_cores": 95, "used_slots": 1},
            ctr(mib=2000, cores=10),
            None,
            R.CARD_INSUFFICIENT_MEMORY,
            id="memory>cores",
        ),
        pytest.param(
            {"used_mem": 100, "used_cores": 10, "used_slots": 1},
            ctr(percent=10, cores=100),
            None,
            R.CARD_INSUFFICIENT_CORE,
            id="cores>exclusive",
        ),
        pytest.param(
            {"used_mem": 1000, "used_cores": 100, "used_slots": 1, "owner": "other"},
            ctr(mib=100, cores=0),
            None,
            R.EXCLUSIVE_DEVICE_ALLOCATE_CONFLICT,
            id="exclusive>compute",
        ),
    ],
)
def test_a_card_failing_two_rules_reports_the_earlier(
    card: dict[str, Any],
    container: ContainerGpuRequest,
    selector: DeviceSelector | None,
    reason: FitReason,
) -> None:
    got, detail = reject(one_card(**card), pod(container, selector=selector))
    assert got is reason
    assert f"(1 {reason.value})" in detail


def test_too_few_fitting_cards_names_the_container_and_counts() -> None:
    c = cluster(
        (
            "n0",
            [
                gpu("n0", 0),
                gpu("n0", 1),
                gpu("n0", 2, used_mem=9_000, used_slots=1),
                gpu("n0", 3, healthy=False),
            ],
        )
    )
    reason, detail = reject(c, pod(ctr("trainer", count=3, percent=20)))
    assert reason is R.ALLOCATED_CARDS_INSUFFICIENT_REQUEST
    assert detail == (
        "AllocatedCardsInsufficientRequest: container 'trainer' needs 3 card(s), 2 of 4 fit "
        "(1 CardNotHealth, 1 CardInsufficientMemory)"
    )
    # Two cards are enough for two.
    _, ev = run(c, pod(ctr("trainer", count=2, percent=20)))
    assert ev.feasible[0]
    assert sorted(ev.chosen[0][0].tolist()) == [0, 1]


def test_without_a_fitting_card_the_commonest_reason_wins() -> None:
    c = cluster(
        (
            "n0",
            [
                gpu("n0", 0, healthy=False),
                gpu("n0", 1, used_cores=90, used_slots=1),
                gpu("n0", 2, used_cores=95, used_slots=1),
            ],
        )
    )
    reason, detail = reject(c, pod(ctr(cores=20)))
    assert reason is R.CARD_INSUFFICIENT_CORE
    assert "0 of 3 fit (1 CardNotHealth, 2 CardInsufficientCore)" in detail


def test_node_cpu_or_memory_short() -> None:
    c = Cluster.build([("n0", [gpu("n0", 0)]), ("n1", [gpu("n1", 0)])], node_cpu=[500, 4000])
    demand = Demand.of(pod(SMALL), GpuPolicy.BINPACK, cpu=1000)
    ev = evaluate(c, demand, np.arange(2))
    assert ev.feasible.tolist() == [False, True]
    assert ev.detail[0] == "node CPU or memory is short"


# ---------------------------------------------------------------- memory, cores, slots


def scaled_cluster(memory_scaling: float, core_scaling: float, split: int) -> Cluster:
    inventory = NodeInventory(
        node="n0",
        devices=(GpuDevice(uuid="GPU-n0-0", index=0, model=MODEL, memory_mib=16_000),),
        memory_scaling=memory_scaling,
        core_scaling=core_scaling,
        split_count=split,
    )
    device = inventory.devices[0]
    state = GpuState(node="n0", device=device, capacity=inventory.capacity(device), used=GpuUsage())
    return cluster(("n0", [state]))


def test_percentage_memory_is_a_share_of_scaled_capacity() -> None:
    c = scaled_cluster(memory_scaling=1.5, core_scaling=1, split=10)
    assert c.cap_mem.tolist() == [24_000]
    p = place(c, pod(ctr(percent=50)))
    assert p.containers[0].devices[0].memory_mib == 12_000  # not 8000 of the raw 16000
    commit(c, p)
    # 12000 MiB left: 50 % fits once more, 51 % (12240) does not.
    reason, _ = reject(c, pod(ctr(percent=51)))
    assert reason is R.CARD_INSUFFICIENT_MEMORY
    assert place(c, pod(ctr(percent=50))).containers[0].devices[0].memory_mib == 12_000


def test_percentage_rounds_down() -> None:
    c = one_card(mem=999)
    assert place(c, pod(ctr(percent=33))).containers[0].devices[0].memory_mib == 329


def test_core_scaling_lets_cores_oversubscribe() -> None:
    c = scaled_cluster(memory_scaling=1, core_scaling=2, split=10)
    for _ in range(3):
        commit(c, place(c, pod(ctr(mib=100, cores=60))))
    assert c.used_cores.tolist() == [180]
    reason, _ = reject(c, pod(ctr(mib=100, cores=30)))
    assert reason is R.CARD_INSUFFICIENT_CORE


def test_split_count_limits_sharers() -> None:
    c = scaled_cluster(memory_scaling=1, core_scaling=1, split=3)
    for _ in range(3):
        commit(c, place(c, pod(ctr(mib=100, cores=10))))
    assert c.used_slots.tolist() == [3]
    reason, detail = reject(c, pod(ctr(mib=100, cores=10)))
    assert reason is R.CARD_TIME_SLICING_EXHAUSTED
    assert "0 of 1 fit (1 CardTimeSlicingExhausted)" in detail


def test_whole_card_request_from_a_bare_count() -> None:
    request = hami_pod([limits("app", gpu=1)])
    (container,) = request.containers
    assert container.exclusive
    c = cluster(("n0", [busy("n0", 0, 10), gpu("n0", 1), busy("n0", 2, 5)]))
    p = place(c, request)
    (grant,) = p.containers[0].devices
    assert (grant.uuid, grant.memory_mib, grant.cores) == ("GPU-n0-1", MEM, 100)
    assert p.footprint() == {
        "GPU-n0-1": DeviceFootprint(memory_mib=MEM, cores=100, slots=1, exclusive=True)
    }
    commit(c, p)
    assert c.owned.tolist() == [False, True, False]
    # Now no card is free; the held card refuses even a tiny share.
    reason, _ = reject(c, request)
    assert reason is R.CARD_INSUFFICIENT_MEMORY
    only_held = pod(ctr(mib=1, cores=0), selector=DeviceSelector(include_uuids=("GPU-n0-1",)))
    # No request is 0 MiB: even 1 MiB finds the held card's memory all taken.
    _, detail = reject(c, only_held)
    assert detail.endswith("0 of 3 fit (2 CardUuidMismatch, 1 CardInsufficientMemory)")


def test_whole_card_request_avoids_a_card_with_a_zero_core_sharer() -> None:
    c = cluster(("n0", [gpu("n0", 0, used_mem=100, used_slots=1), gpu("n0", 1)]))
    p = place(c, pod(ctr(percent=50, cores=100)))
    assert uuids(p, "main") == ["GPU-n0-1"]


# ---------------------------------------------------------------- multi-GPU and containers


def test_a_multi_gpu_container_gets_distinct_cards() -> None:
    c = cluster(("n0", [gpu("n0", i) for i in range(4)]))
    p = place(c, pod(ctr(count=3, percent=10, cores=10)))
    got = uuids(p, "main")
    assert len(got) == 3
    assert len(set(got)) == 3
    assert all(f.slots == 1 for f in p.footprint().values())


def test_a_multi_gpu_container_never_doubles_up_on_one_big_card() -> None:
    # One card has room for both shares, but a container's cards must differ.
    c = cluster(("n0", [gpu("n0", 0), gpu("n0", 1, healthy=False)]))
    reason, detail = reject(c, pod(ctr(count=2, percent=10)))
    assert reason is R.ALLOCATED_CARDS_INSUFFICIENT_REQUEST
    assert "needs 2 card(s), 1 of 2 fit (1 CardNotHealth)" in detail


def test_two_containers_share_a_card_when_it_fits() -> None:
    c = one_card()
    p = place(c, pod(ctr("a", percent=40, cores=40), ctr("b", percent=40, cores=40)))
    assert uuids(p, "a") == uuids(p, "b") == ["GPU-n0-0"]
    assert p.footprint()["GPU-n0-0"] == DeviceFootprint(memory_mib=8000, cores=80, slots=2)


def test_the_second_container_sees_the_first() -> None:
    c = one_card()
    reason, detail = reject(c, pod(ctr("a", percent=40, cores=60), ctr("b", percent=40, cores=60)))
    assert reason is R.CARD_INSUFFICIENT_CORE
    assert detail.startswith("CardInsufficientCore: container 'b' needs 1 card(s), 0 of 1 fit")
    # With a second card the second container moves there.
    c = cluster(("n0", [gpu("n0", 0), gpu("n0", 1)]))
    p = place(c, pod(ctr("a", percent=40, cores=60), ctr("b", percent=40, cores=60)))
    assert set(uuids(p, "a") + uuids(p, "b")) == {"GPU-n0-0", "GPU-n0-1"}


def test_a_node_failing_a_later_container_keeps_no_cards_for_earlier_ones() -> None:
    c = cluster(("small", [gpu("small", 0)]), ("big", [gpu("big", 0), gpu("big", 1)]))
    request = pod(ctr("a", percent=60, cores=10), ctr("b", percent=60, cores=10))
    demand, ev = run(c, request)
    assert ev.feasible.tolist() == [False, True]
    assert "container 'b'" in ev.detail[0]
    assert [picked[0].tolist() for picked in ev.chosen] == [[NO_CARD], [NO_CARD]]
    assert sorted(int(picked[1][0]) for picked in ev.chosen) == [1, 2]
    assert placement(c, demand, ev, 1).node == "big"


def test_an_exclusive_container_keeps_its_card_from_the_next_container() -> None:
    c = cluster(("n0", [gpu("n0", 0), gpu("n0", 1)]))
    p = place(c, pod(ctr("whole", percent=50, cores=100), ctr("small", mib=10, cores=0)))
    assert uuids(p, "whole") != uuids(p, "small")
    # On a single card the second container has nowhere to go.
    reason, _ = reject(
        one_card(), pod(ctr("whole", percent=50, cores=100), ctr("small", mib=10, cores=0))
    )
    assert reason is R.EXCLUSIVE_DEVICE_ALLOCATE_CONFLICT


# ---------------------------------------------------------------- init containers and sidecars


def test_a_big_init_container_that_fits_alone_is_fine() -> None:
    c = one_card()
    request = pod(ctr("init", init=True, percent=90, cores=90), ctr("app", percent=50, cores=50))
    p = place(c, request)
    assert uuids(p, "init") == uuids(p, "app") == ["GPU-n0-0"]
    # The footprint is the peak of the two phases, not their sum.
    assert p.footprint()["GPU-n0-0"] == DeviceFootprint(memory_mib=9000, cores=90, slots=1)


def test_init_and_app_peak_is_per_card_and_per_resource() -> None:
    c = one_card()
    request = pod(
        ctr("init", init=True, percent=70, cores=20),
        ctr("app1", percent=20, cores=30),
        ctr("app2", percent=20, cores=30),
    )
    p = place(c, request)
    assert p.footprint()["GPU-n0-0"] == DeviceFootprint(memory_mib=7000, cores=60, slots=2)


def test_an_init_container_too_big_for_the_card_fails() -> None:
    c = one_card(used_mem=5000, used_cores=10, used_slots=1)
    reason, detail = reject(c, pod(ctr("init", init=True, percent=60), ctr("app", percent=10)))
    assert reason is R.CARD_INSUFFICIENT_MEMORY
    assert "container 'init'" in detail


def test_a_plain_init_container_runs_beside_earlier_sidecars() -> None:
    c = one_card()
    reason, detail = reject(
        c,
        pod(
            ctr("proxy", sidecar=True, percent=20),
            ctr("init", init=True, percent=90),
            ctr("app", percent=10),
        ),
    )
    assert reason is R.CARD_INSUFFICIENT_MEMORY
    assert "container 'init'" in detail
    p = place(
        c,
        pod(
            ctr("proxy", sidecar=True, percent=20),
            ctr("init", init=True, percent=80),
            ctr("app", percent=10),
        ),
    )
    assert p.footprint()["GPU-n0-0"] == DeviceFootprint(memory_mib=10_000, cores=0, slots=2)


def test_sidecars_are_counted_with_the_apps() -> None:
    c = one_card()
    request = pod(ctr("proxy", sidecar=True, mib=100, cores=40), ctr("app", mib=100, cores=70))
    reason, detail = reject(c, request)
    assert reason is R.CARD_INSUFFICIENT_CORE
    assert "container 'app'" in detail
    fits = pod(ctr("proxy", sidecar=True, mib=100, cores=40), ctr("app", mib=100, cores=60))
    p = place(c, fits)
    assert p.footprint()["GPU-n0-0"] == DeviceFootprint(memory_mib=200, cores=100, slots=2)


def test_init_containers_from_a_hami_manifest() -> None:
    sidecar = limits("proxy", gpu=1, gpumem=2000, gpucores=30) | {"restartPolicy": "Always"}
    request = hami_pod(
        [limits("app", gpu=1, gpumem=6000, gpucores=60)],
        init=[limits("setup", gpu=1, gpumem=7000, gpucores=50), sidecar],
    )
    assert [(c.name, c.init, c.sidecar) for c in request.containers] == [
        ("setup", True, False),
        ("proxy", True, True),
        ("app", False, False),
    ]
    p = place(one_card(), request)
    assert p.footprint()["GPU-n0-0"] == DeviceFootprint(memory_mib=8000, cores=90, slots=2)
    # A bigger app no longer fits beside the sidecar, though it would alone.
    too_big = hami_pod(
        [limits("app", gpu=1, gpumem=8001, gpucores=60)],
        init=[sidecar],
    )
    reason, detail = reject(one_card(), too_big)
    assert reason is R.CARD_INSUFFICIENT_MEMORY
    assert "container 'app'" in detail


# ---------------------------------------------------------------- annotations end to end


def two_models() -> Cluster:
    return cluster(
        ("a100", [gpu("a100", 0, model="NVIDIA A100-SXM4-80GB")]),
        ("h100", [gpu("h100", 0, model="NVIDIA H100 80GB HBM3")]),
        ("t4", [gpu("t4", 0, model="Tesla T4")]),
    )


@pytest.mark.parametrize(
    ("annotations", "feasible"),
    [
        ({"nvidia.com/use-gputype": "h100"}, [False, True, False]),
        ({"nvidia.com/use-gputype": "A100,t4"}, [True, False, True]),
        ({"nvidia.com/nouse-gputype": "NVIDIA"}, [False, False, True]),
        ({"nvidia.com/use-gputype": "nvidia", "nvidia.com/nouse-gputype": "H100"}, [1, 0, 0]),
        ({"nvidia.com/use-gpuuuid": "GPU-t4-0,GPU-h100-0"}, [False, True, True]),
        ({"nvidia.com/nouse-gpuuuid": "GPU-t4-0"}, [True, True, False]),
    ],
)
def test_type_and_uuid_annotations(annotations: dict[str, str], feasible: list[bool]) -> None:
    request = hami_pod([limits("app", gpu=1, gpumem=1000)], annotations=annotations)
    _, ev = run(two_models(), request)
    assert ev.feasible.tolist() == [bool(f) for f in feasible]
    uuid_rule = any("uuid" in key for key in annotations)
    expected = R.CARD_UUID_MISMATCH if uuid_rule else R.CARD_TYPE_MISMATCH
    for row, ok in enumerate(feasible):
        assert ev.reason(row) is (None if ok else expected)


def test_policy_annotations_reach_the_demand() -> None:
    request = hami_pod(
        [limits("app", gpu=1, gpumem=1000)],
        annotations={
            "hami.io/gpu-scheduler-policy": "spread",
            "hami.io/node-scheduler-policy": "spread",
        },
    )
    demand = Demand.of(request)
    assert (demand.gpu_policy, demand.node_policy) == (GpuPolicy.SPREAD, NodePolicy.SPREAD)
    assert demand.policy_name == "gpu=spread,node=spread"
    # Binpack for cards defaults to binpack for nodes, as in HAMi.
    binpack = hami_pod(
        [limits("app", gpu=1, gpumem=1000)],
        annotations={"hami.io/gpu-scheduler-policy": "binpack"},
    )
    assert Demand.of(binpack).node_policy is NodePolicy.BINPACK
    # Without annotations: the fragmentation policy ranks cards and nodes.
    plain = Demand.of(hami_pod([limits("app", gpu=1, gpumem=1000)]))
    assert (plain.gpu_policy, plain.node_policy) == (GpuPolicy.FRAGMENTATION, None)
    assert plain.policy_name == "gpu=fragmentation,node=fragmentation"


def test_the_default_node_policy_applies_to_pods_without_the_annotation() -> None:
    """nodeSchedulerPolicy as a setting (requests.default_node_policy): the pod's
    annotation wins; without either, the GPU policy decides as before."""
    plain = hami_pod([limits("app", gpu=1, gpumem=1000)])
    spread = Demand.of(plain, GpuPolicy.SPREAD, default_node_policy=NodePolicy.SPREAD)
    assert (spread.gpu_policy, spread.node_policy) == (GpuPolicy.SPREAD, NodePolicy.SPREAD)
    assert Demand.of(plain, GpuPolicy.SPREAD).node_policy is NodePolicy.BINPACK
    annotated = hami_pod(
        [limits("app", gpu=1, gpumem=1000)],
        annotations={"hami.io/node-scheduler-policy": "binpack"},
    )
    assert (
        Demand.of(annotated, default_node_policy=NodePolicy.SPREAD).node_policy
        is NodePolicy.BINPACK
    )


# ---------------------------------------------------------------- NUMA


def numa_node(name: str, numas: list[int], **kwargs: Any) -> tuple[str, list[GpuState]]:
    return name, [gpu(name, i, numa=n, **kwargs) for i, n in enumerate(numas)]


def test_numa_bind_needs_the_cards_on_one_numa_node() -> None:
    c = cluster(numa_node("split", [0, 1]), numa_node("paired", [0, 1, 1]))
    request = hami_pod(
        [limits("app", gpu=2, gpumem=1000)], annotations={"nvidia.com/numa-bind": "true"}
    )
    assert request.selector.numa_bind
    demand, ev = run(c, request)
    assert ev.feasible.tolist() == [False, True]
    assert ev.reason(0) is R.NUMA_NOT_FIT
    assert "needs 2 card(s), 2 of 2 fit" in ev.detail[0]
    p = placement(c, demand, ev, 1)
    assert sorted(uuids(p, "app")) == ["GPU-paired-1", "GPU-paired-2"]
    # Without the annotation the split node is fine.
    _, free = run(c, hami_pod([limits("app", gpu=2, gpumem=1000)]))
    assert free.feasible.tolist() == [True, True]


def test_numa_scheduler_policy_binds_too() -> None:
    c = cluster(numa_node("split", [0, 1]))
    request = hami_pod(
        [limits("app", gpu=2, gpumem=1000)],
        annotations={"hami.io/gpu-scheduler-policy": "numa"},
    )
    assert request.selector.numa_bind
    reason, _ = reject(c, request)
    assert reason is R.NUMA_NOT_FIT


def test_numa_bind_skips_unfit_cards_and_picks_the_group_that_fits() -> None:
    # NUMA 0 has two cards, one of them full; NUMA 1 has two free ones.
    node = (
        "n0",
        [
            gpu("n0", 0, numa=0),
            gpu("n0", 1, numa=0, used_mem=MEM, used_slots=1),
            gpu("n0", 2, numa=1),
            gpu("n0", 3, numa=1),
        ],
    )
    request = pod(ctr(count=2, percent=10), selector=DeviceSelector(numa_bind=True))
    p = place(cluster(node), request)
    assert sorted(uuids(p, "main")) == ["GPU-n0-2", "GPU-n0-3"]


@pytest.mark.parametrize(
    ("policy", "expected"),
    [(GpuPolicy.BINPACK, ["GPU-n0-2", "GPU-n0-3"]), (GpuPolicy.SPREAD, ["GPU-n0-0", "GPU-n0-1"])],
)
def test_numa_bind_chooses_the_group_by_policy(policy: GpuPolicy, expected: list[str]) -> None:
    node = (
        "n0",
        [
            gpu("n0", 0, numa=0),
            gpu("n0", 1, numa=0),
            busy("n0", 2, 30, numa=1),
            busy("n0", 3, 30, numa=1),
        ],
    )
    request = pod(ctr(count=2, percent=10), selector=DeviceSelector(numa_bind=True))
    p = place(cluster(node), request, policy)
    assert sorted(uuids(p, "main")) == expected


def test_numa_bind_with_one_card_is_no_constraint() -> None:
    c = cluster(numa_node("n0", [0, 1], used_mem=9_000, used_slots=1))
    request = pod(ctr(count=1, mib=500), selector=DeviceSelector(numa_bind=True))
    _, ev = run(c, request)
    assert ev.feasible.tolist() == [True]


# ---------------------------------------------------------------- binpack and spread


def test_hami_card_order_binpack_and_spread() -> None:
    c = cluster(("n0", [busy("n0", 0, 30), gpu("n0", 1), busy("n0", 2, 60)]))
    request = pod(ctr(count=2, percent=10, cores=10))
    _, ev = run(c, request, GpuPolicy.BINPACK)
    assert ev.chosen[0][0].tolist() == [2, 0]  # fullest first
    _, ev = run(c, request, GpuPolicy.SPREAD)
    assert ev.chosen[0][0].tolist() == [1, 0]  # emptiest first


@pytest.mark.parametrize(
    ("first", "second", "fuller"),
    [
        # HAMi's score: 10 x ((slots+1)/S + (cores+c)/C + (mem+m)/M); each term can decide.
        # slots: 2/2 + 0.2 + 0.2 = 1.4 against 2/10 + 0.2 + 0.5 = 0.9
        ({"slots": 2, "used_cores": 10, "used_mem": 1000}, {"used_cores": 10, "used_mem": 4000}, 0),
        # cores: 0.2 + 0.7 + 0.2 = 1.1 against 0.2 + 0.2 + 0.4 = 0.8
        ({"used_cores": 60, "used_mem": 1000}, {"used_cores": 10, "used_mem": 3000}, 0),
        # memory: 0.2 + 0.5 + 0.2 = 0.9 against 0.2 + 0.2 + 0.7 = 1.1
        ({"used_cores": 40, "used_mem": 1000}, {"used_cores": 10, "used_mem": 6000}, 1),
    ],
)
def test_card_score_counts_slots_cores_and_memory(
    first: dict[str, int], second: dict[str, int], fuller: int
) -> None:
    c = cluster(("n0", [gpu("n0", 0, used_slots=1, **first), gpu("n0", 1, used_slots=1, **second)]))
    request = pod(ctr(mib=1000, cores=10))
    _, ev = run(c, request, GpuPolicy.BINPACK)
    assert ev.chosen[0][0].tolist() == [fuller]
    _, ev = run(c, request, GpuPolicy.SPREAD)
    assert ev.chosen[0][0].tolist() == [1 - fuller]


def weighted_pod(weights: str | None) -> PodGpuRequest:
    annotations = {} if weights is None else {"hami.io/device-scoring-weights": weights}
    return hami_pod([limits("app", gpu=1, gpumem=1000, gpucores=10)], annotations=annotations)


# Evenly weighted, the first card is fuller (0.2 + 0.7 + 0.2 = 1.1 against 0.2 + 0.2 +
# 0.4 = 0.8); with memory weighing 3 the second is (0.2 + 0.7 + 0.6 = 1.5 against
# 0.2 + 0.2 + 1.2 = 1.6).
WEIGHED = (
    {"used_slots": 1, "used_cores": 60, "used_mem": 1000},
    {"used_slots": 1, "used_cores": 10, "used_mem": 3000},
)


@pytest.mark.parametrize(
    ("weights", "fuller"),
    [
        pytest.param(None, 0, id="even"),
        pytest.param("slot=1,core=1,memory=3", 1, id="memory-3"),
        pytest.param("memory=1, core=0, slot=0", 1, id="memory-only"),
        pytest.param("slot=0,core=1,memory=0", 0, id="cores-only"),
    ],
)
def test_scoring_weights_weigh_the_card_score(weights: str | None, fuller: int) -> None:
    c = cluster(("n0", [gpu("n0", i, **WEIGHED[i]) for i in range(2)]))
    request = weighted_pod(weights)
    _, ev = run(c, request, GpuPolicy.BINPACK)
    assert ev.chosen[0][0].tolist() == [fuller]
    _, ev = run(c, request, GpuPolicy.SPREAD)
    assert ev.chosen[0][0].tolist() == [1 - fuller]


def test_fragmentation_ignores_scoring_weights() -> None:
    c = cluster(("n0", [gpu("n0", i, **WEIGHED[i]) for i in range(2)]))
    _, even = run(c, weighted_pod(None), GpuPolicy.FRAGMENTATION)
    _, weighed = run(c, weighted_pod("slot=1,core=1,memory=3"), GpuPolicy.FRAGMENTATION)
    assert even.chosen[0].tolist() == weighed.chosen[0].tolist()
    assert even.score.tolist() == weighed.score.tolist()


def test_pods_differing_only_in_weights_are_different_kinds() -> None:
    c = cluster(("n0", [gpu("n0", i, **WEIGHED[i]) for i in range(2)]))
    evaluator = Evaluator(c, None)
    even = evaluator.evaluate(Demand.of(weighted_pod(None), GpuPolicy.BINPACK))
    weighed = evaluator.evaluate(
        Demand.of(weighted_pod("memory=3,slot=1,core=1"), GpuPolicy.BINPACK)
    )
    assert (even.chosen[0][0].tolist(), weighed.chosen[0][0].tolist()) == ([0], [1])


@pytest.mark.parametrize("policy", [GpuPolicy.BINPACK, GpuPolicy.SPREAD])
def test_equal_cards_go_to_the_last_as_in_hami(policy: GpuPolicy) -> None:
    """HAMi sorts its card list by score and takes cards from its end."""
    c = cluster(("n0", [gpu("n0", i) for i in range(4)]))
    _, ev = run(c, pod(ctr(mib=1000)), policy)
    assert ev.chosen[0][0].tolist() == [3]
    _, ev = run(c, pod(ctr(count=2, mib=1000)), policy)
    assert ev.chosen[0][0].tolist() == [3, 2]


@pytest.mark.parametrize("policy", [GpuPolicy.BINPACK, GpuPolicy.SPREAD])
def test_equal_cards_go_to_the_higher_numa_node_first(policy: GpuPolicy) -> None:
    """HAMi's list breaks equal scores by NUMA node, low first, so the higher is taken."""
    c = cluster(numa_node("n0", [1, 0, 1, 0]))
    _, ev = run(c, pod(ctr(count=3, mib=1000)), policy)
    assert ev.chosen[0][0].tolist() == [2, 0, 3]


@pytest.mark.parametrize("policy", [GpuPolicy.BINPACK, GpuPolicy.SPREAD])
def test_equal_cards_on_a_large_node_go_where_hamis_go(policy: GpuPolicy) -> None:
    """Past 16 cards the core sorts HAMi's list another way, to the same order."""
    c = cluster(numa_node("n0", [0, 1] * 10))
    _, ev = run(c, pod(ctr(count=3, mib=1000)), policy)
    assert ev.chosen[0][0].tolist() == [19, 17, 15]
    c = cluster(
        ("n0", [gpu("n0", i, used_slots=i % 3, used_mem=1000 * (i % 3)) for i in range(40)])
    )
    request = pod(ctr("a", count=5, mib=1000), ctr("b", count=4, percent=10))
    demand, ev = run(c, request, policy)
    want = reference.evaluate(c, demand, np.arange(1))
    assert [p.tolist() for p in ev.chosen] == [p.tolist() for p in want.chosen]


def test_equal_cards_keep_the_order_the_previous_container_left() -> None:
    """HAMi sorts one list in place for each app container: cards equal for the second
    container stay in the order the first one's scores put them."""
    c = cluster(
        (
            "n0",
            [
                gpu("n0", 0, mem=8000),
                gpu("n0", 1, mem=16000),
                gpu("n0", 2, mem=8000, used_mem=2000, used_slots=1),
            ],
        )
    )
    # The first container's scores: 6 for card 0, 3.5 for card 1, 9.5 for card 2, which
    # it takes; its list is [1, 0, 2]. For the second, cards 0 and 1 both score 6 and
    # card 2 has no room: the last of the two in that list is card 0.
    request = pod(ctr("a", mib=4000), ctr("b", percent=50))
    _, ev = run(c, request, GpuPolicy.BINPACK)
    assert [p[0].tolist() for p in ev.chosen] == [[2], [0]]
    # Alone, the second container takes card 2 (it has room then); without card 2, the
    # list is in the node's order and card 1 is the last of the two.
    _, ev = run(c, pod(ctr("b", percent=50)), GpuPolicy.BINPACK)
    assert ev.chosen[0][0].tolist() == [2]
    c2 = cluster(("n0", [gpu("n0", 0, mem=8000), gpu("n0", 1, mem=16000)]))
    _, ev = run(c2, pod(ctr("b", percent=50)), GpuPolicy.BINPACK)
    assert ev.chosen[0][0].tolist() == [1]


def test_hami_node_score_and_ordering() -> None:
    c = cluster(
        ("empty", [gpu("empty", 0), gpu("empty", 1)]),
        ("half", [busy("half", 0, 50), gpu("half", 1)]),
        ("full", [busy("full", 0, 90), busy("full", 1, 90)]),
    )
    request = pod(ctr(percent=5, cores=5), node_policy=NodePolicy.BINPACK)
    _, ev = run(c, request, GpuPolicy.BINPACK)
    # 10 x (slots 1/20 + cores 50/200 + memory 5000/20000) = 5.5; full: 10 x (0.1+0.9+0.9)
    assert ev.score == pytest.approx([0.0, 5.5, 19.0])
    assert int(np.argmax(ev.score)) == 2
    spread = pod(ctr(percent=5, cores=5), node_policy=NodePolicy.SPREAD)
    _, ev = run(c, spread, GpuPolicy.BINPACK)
    assert ev.score == pytest.approx([0.0, -5.5, -19.0])
    assert normalise(ev.score) == [10, 9, 8]


@pytest.mark.parametrize("default", [GpuPolicy.BINPACK, GpuPolicy.FRAGMENTATION])
def test_node_policy_from_annotation_orders_nodes(default: GpuPolicy) -> None:
    # The node policy annotation wins over the default GPU policy's node ranking.
    c = cluster(("light", [busy("light", 0, 20)]), ("heavy", [busy("heavy", 0, 60)]))
    for policy, best in (("binpack", "heavy"), ("spread", "light")):
        request = hami_pod(
            [limits("app", gpu=1, gpumem=500, gpucores=10)],
            annotations={"hami.io/node-scheduler-policy": policy},
        )
        demand, ev = run(c, request, default)
        assert demand.gpu_policy is default
        assert ev.feasible.all()
        assert c.node_names[int(ev.nodes[np.argmax(ev.score)])] == best
        assert normalise(ev.score) == ([9, 10] if best == "heavy" else [10, 9])


def test_gpu_policy_from_annotation_orders_cards() -> None:
    c = cluster(("n0", [busy("n0", 0, 20), busy("n0", 1, 60), gpu("n0", 2)]))
    for policy, card in (("binpack", "GPU-n0-1"), ("spread", "GPU-n0-2")):
        request = hami_pod(
            [limits("app", gpu=1, gpumem=500, gpucores=10)],
            annotations={"hami.io/gpu-scheduler-policy": policy},
        )
        demand = Demand.of(request)
        ev = evaluate(c, demand, np.arange(1))
        assert uuids(placement(c, demand, ev, 0), "app") == [card]


def test_a_subset_of_nodes_in_any_order() -> None:
    c = cluster(
        ("a", [gpu("a", 0)]),
        ("b", [gpu("b", 0), gpu("b", 1, healthy=False)]),
        ("c", [busy("c", 0, 50), gpu("c", 1)]),
    )
    demand, ev = run(c, pod(ctr(count=2, percent=10)), nodes=[2, 0, 1])
    assert ev.nodes.tolist() == [2, 0, 1]
    assert ev.feasible.tolist() == [True, False, False]
    assert ev.row(2) == 0
    assert ev.row(1) == 2
    with pytest.raises(KeyError):
        ev.row(7)
    p = placement(c, demand, ev, ev.row(2))
    assert p.node == "c"
    assert sorted(uuids(p, "main")) == ["GPU-c-0", "GPU-c-1"]
    with pytest.raises(ValueError, match="does not fit"):
        placement(c, demand, ev, ev.row(0))


# ---------------------------------------------------------------- fragmentation policy


def test_fragmentation_puts_a_half_on_the_half_used_card() -> None:
    c = cluster(("n0", [gpu("n0", 0), busy("n0", 1, 50)]))
    request = pod(ctr(percent=50, cores=50))
    assert uuids(place(c, request, GpuPolicy.FRAGMENTATION), "main") == ["GPU-n0-1"]
    assert uuids(place(c, request, GpuPolicy.SPREAD), "main") == ["GPU-n0-0"]


def test_fragmentation_fills_the_gap_that_fits_best() -> None:
    # A quarter fits on either part-used card; filling the 75 % card leaves one whole
    # half free, where the other choice would leave two unusable scraps.
    c = cluster(("n0", [busy("n0", 0, 50), busy("n0", 1, 75), gpu("n0", 2)]))
    request = pod(ctr(percent=25, cores=25))
    assert uuids(place(c, request, GpuPolicy.FRAGMENTATION), "main") == ["GPU-n0-1"]


def test_fragmentation_keeps_an_exact_quarter_gap_where_binpack_would_not() -> None:
    # Free 40 % and 25 %: a 10 % pod on the 40 % card leaves 30 % and 25 %, both fit for
    # a quarter pod; binpack takes the fuller card and leaves a 15 % scrap.
    c = cluster(("n0", [busy("n0", 0, 60), busy("n0", 1, 75)]))
    request = pod(ctr(percent=10, cores=10))
    assert uuids(place(c, request, GpuPolicy.FRAGMENTATION), "main") == ["GPU-n0-0"]
    assert uuids(place(c, request, GpuPolicy.BINPACK), "main") == ["GPU-n0-1"]


def test_fragmentation_sends_a_whole_card_where_it_breaks_nothing() -> None:
    c = cluster(
        ("four", [gpu("four", i) for i in range(4)]),
        ("last", [gpu("last", 0), busy("last", 1, 100)]),
    )
    request = pod(ctr(percent=100, cores=100))
    demand, ev = run(c, request, GpuPolicy.FRAGMENTATION)
    assert demand.node_policy is None
    assert ev.feasible.tolist() == [True, True]
    assert int(np.argmax(ev.score)) == 1
    assert normalise(ev.score) == [9, 10]
    assert placement(c, demand, ev, 1).node == "last"


@pytest.mark.parametrize(
    ("x", "y", "share", "best", "binpack_best"),
    [
        # Filling y's half card keeps two whole cards, though x has less free room.
        ([0], [0, 50], 50, "y", "y"),
        # A quarter on x's 75 % card leaves an exact half; y keeps its whole card.
        ([25], [0, 90], 25, "x", "y"),
    ],
)
def test_fragmentation_node_choice(
    x: list[int], y: list[int], share: int, best: str, binpack_best: str
) -> None:
    def node(name: str, shares: list[int]) -> tuple[str, list[GpuState]]:
        return name, [busy(name, i, s) if s else gpu(name, i) for i, s in enumerate(shares)]

    c = cluster(node("x", x), node("y", y))
    request = pod(ctr(percent=share, cores=share))
    _, ev = run(c, request, GpuPolicy.FRAGMENTATION)
    assert ev.feasible.all()
    assert c.node_names[int(np.argmax(ev.score))] == best
    _, ev = run(c, request, GpuPolicy.BINPACK)
    assert c.node_names[int(np.argmax(ev.score))] == binpack_best


def test_fragmentation_keeps_whole_nodes_whole_for_small_pods() -> None:
    # A quarter pod should go to the node that is already broken up, not the idle one.
    c = cluster(
        ("idle", [gpu("idle", 0), gpu("idle", 1)]),
        ("broken", [busy("broken", 0, 50), gpu("broken", 1)]),
    )
    _, ev = run(c, pod(ctr(percent=25, cores=25)), GpuPolicy.FRAGMENTATION)
    assert ev.feasible.tolist() == [True, True]
    assert ev.score[1] > ev.score[0]
    assert ev.chosen[0][1].tolist() == [c.node_start[1]]  # the half-used card


def test_fragmentation_without_a_mix_is_refused() -> None:
    demand = Demand.of(pod(SMALL))
    with pytest.raises(ValueError, match="needs a workload mix"):
        evaluate(one_card(), demand, np.arange(1), None)


# ---------------------------------------------------------------- normalise


@pytest.mark.parametrize(
    ("scores", "expected"),
    [
        ([1.0, 3.0, -np.inf, 2.0], [8, 10, 0, 9]),
        ([-5.0, -1.0], [9, 10]),
        ([2.0, 2.0, -np.inf], [10, 10, 0]),
        ([-np.inf, -np.inf], [0, 0]),
        ([0.0, 0.25, 1.0], [8, 9, 10]),
        ([1000.0, 1.0, 1.0 + 1e-12, 0.999], [10, 9, 9, 8]),  # far outliers do not crowd
        (list(range(13)), [0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]),
    ],
)
def test_normalise(scores: list[float], expected: list[int]) -> None:
    assert normalise(np.asarray(scores)) == expected


def test_normalise_real_scores_gives_the_best_node_ten() -> None:
    c = cluster(
        ("a", [busy("a", 0, 10)]),
        ("b", [busy("b", 0, 40)]),
        ("c", [gpu("c", 0, healthy=False)]),
        ("d", [busy("d", 0, 70)]),
    )
    _, ev = run(c, pod(ctr(percent=10, cores=10)), GpuPolicy.BINPACK)
    scaled = normalise(ev.score)
    assert all(0 <= s <= 10 for s in scaled)
    assert scaled[int(np.argmax(ev.score))] == 10
    assert scaled == [8, 9, 0, 10]
