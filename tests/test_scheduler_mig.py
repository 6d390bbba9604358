"""MIG cards through the scheduler's copy of a real ledger: HAMi's profile and
placement choice, static instances, slices freed by a release and put back by a
rebuild from the pods' own records, and which pods may use which cards."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import numpy as np
import pytest
from redis.asyncio import Redis

from gpuslice_common.ledger import Ledger
from gpuslice_common.models import (
    PLACEMENT_ANNOTATION,
    ContainerGpuRequest,
    DeviceSelector,
    FitReason,
    GpuPolicy,
    MemoryRequest,
    NodeInventory,
    Placement,
    PodGpuRequest,
    PodRef,
    VgpuMode,
)
from gpuslice_scheduler.engine import Demand, Evaluation, Evaluator, evaluate, placement
from gpuslice_scheduler.fragmentation import default_mix
from gpuslice_scheduler.mig import MigCard, select
from gpuslice_scheduler.view import ClusterView
from tests.mig_cards import a100, a100_profiles, mig_node, static
from tests.test_extender import Stack, args, eventually, gpu_pod, kubelet_admitting
from tests.test_extender import stack as stack  # the fixture


def pod(
    uid: str,
    mems: Sequence[int | str],
    mode: VgpuMode | None = None,
    *,
    count: int = 1,
    cores: int = 0,
    init: Sequence[int] = (),
) -> PodGpuRequest:
    """One container per entry of ``mems``: MiB, or "<n>%" of the card."""

    def memory(m: int | str) -> MemoryRequest:
        if isinstance(m, str):
            return MemoryRequest(percent=int(m.rstrip("%")))
        return MemoryRequest(mib=m)

    containers = [
        ContainerGpuRequest(name=f"init{i}", init=True, count=count, memory=memory(m), cores=cores)
        for i, m in enumerate(init)
    ]
    containers += [
        ContainerGpuRequest(name=f"c{i}", count=count, memory=memory(m), cores=cores)
        for i, m in enumerate(mems)
    ]
    return PodGpuRequest(
        pod=PodRef(uid=uid, name=uid), containers=tuple(containers), vgpu_mode=mode
    )


def demand_of(request: PodGpuRequest, policy: GpuPolicy = GpuPolicy.BINPACK) -> Demand:
    return Demand.of(request, policy)


def run(
    view: ClusterView, request: PodGpuRequest, policy: GpuPolicy = GpuPolicy.BINPACK
) -> Evaluation:
    demand = demand_of(request, policy)
    mix = default_mix() if policy is GpuPolicy.FRAGMENTATION else None
    nodes = np.arange(view.cluster.node_count, dtype=np.int64)
    return evaluate(view.cluster, demand, nodes, mix)


async def bind(
    view: ClusterView, ledger: Ledger, request: PodGpuRequest, node: str = "n1"
) -> Placement:
    """What the extender's bind does: evaluate the node, reserve, count at once."""
    demand = demand_of(request)
    row = view.cluster.node_index[node]
    ev = evaluate(view.cluster, demand, np.asarray([row], dtype=np.int64), None)
    assert ev.feasible[0], ev.detail[0]
    chosen = placement(view.cluster, demand, ev, 0)
    made = await ledger.reserve_new(chosen)
    assert made.created
    view.apply(made.placement, made.rev)
    return made.placement


def instances(p: Placement) -> list[tuple[str, str, int]]:
    return [
        (g.uuid, g.mig.profile, g.mig.placement.start)
        for c in p.containers
        for g in c.devices
        if g.mig is not None
    ]


async def synced(ledger: Ledger, *inventories: NodeInventory) -> ClusterView:
    for inv in inventories:
        await ledger.register_node(inv, rebuilt=True)
    view = ClusterView(ledger)
    await view.sync()
    return view


async def ledger_mask(ledger: Ledger, node: str = "n1", card: int = 0) -> int:
    return (await ledger.node_gpus(node))[card].used.mig_mask


GPU = "GPU-n1-0"


# ---------------------------------------------------------------- HAMi's choice


@pytest.mark.parametrize(
    ("memory", "profile", "start"),
    [
        (1, "1g.5gb", 6),  # 1g.*: the highest start first
        (4864, "1g.5gb", 6),
        (4865, "1g.10gb", 6),  # as much memory as 2g.10gb, fewer slices
        (9857, "3g.20gb", 4),  # 3g.*: the highest start first; fewer slices than 4g
        (19969, "7g.40gb", 0),
        (40193, None, None),  # above every profile
    ],
)
def test_the_smallest_profile_that_holds_the_request_at_hami_s_placement(
    memory: int, profile: str | None, start: int | None
) -> None:
    card = MigCard.of(a100("GPU-0"))
    choice = select(card, 0, memory)
    if profile is None:
        assert choice is None
    else:
        assert choice is not None
        assert (choice[0].name, choice[1].start) == (profile, start)


def test_profiles_other_than_1g_and_3g_take_the_lowest_free_start() -> None:
    card = MigCard.make([p for p in a100_profiles() if p.name == "2g.10gb"], slices=0xFF, static=0)
    picked = []
    occupied = 0
    while (choice := select(card, occupied, 9000)) is not None:
        picked.append(choice[1].start)
        occupied |= choice[1].mask
    assert picked == [0, 2, 4]


# ---------------------------------------------------------------- through the ledger


async def test_two_pods_fill_an_a100_with_seven_1g_instances(ledger: Ledger) -> None:
    view = await synced(ledger, mig_node("n1"))
    a = await bind(view, ledger, pod("a", [4000] * 4, VgpuMode.MIG))
    b = await bind(view, ledger, pod("b", [4000] * 3))  # vgpu-mode unset: any card
    assert [s for _, _, s in instances(a)] == [6, 5, 4, 3]
    assert [s for _, _, s in instances(b)] == [2, 1, 0]
    # the grant books the profile's memory and cores, not the request's
    assert {(g.memory_mib, g.cores) for c in a.containers for g in c.devices} == {(4864, 14)}
    assert await ledger_mask(ledger) == 0b0111_1111
    ev = run(view, pod("c", [1000]))
    assert not ev.feasible[0]
    assert ev.reason(0) is FitReason.CARD_MIG_TOPOLOGY_INFEASIBLE
    assert "CardMigTopologyInfeasible" in ev.detail[0]
    await view.refresh(["n1"])  # the ledger's own count agrees with the copy's
    assert not run(view, pod("c", [1000])).feasible[0]
    assert await ledger.check_node("n1") == []


async def test_a_static_instance_takes_its_slices(ledger: Ledger) -> None:
    view = await synced(ledger, mig_node("n1", instances=(static("3g.20gb", 4),)))
    first = await bind(view, ledger, pod("a", [15000]))
    assert instances(first) == [(GPU, "3g.20gb", 0)]
    ev = run(view, pod("b", [15000]))
    assert ev.reason(0) is FitReason.CARD_MIG_TOPOLOGY_INFEASIBLE
    assert await ledger_mask(ledger) == 0b0000_1111  # the static slices are not the pod's


async def test_a_pod_s_own_containers_and_init_containers_take_distinct_slices(
    ledger: Ledger,
) -> None:
    view = await synced(ledger, mig_node("n1"))
    p = await bind(view, ledger, pod("a", [15000], init=[15000]))
    assert instances(p) == [(GPU, "3g.20gb", 4), (GPU, "3g.20gb", 0)]
    assert await ledger_mask(ledger) == 0xFF
    assert not run(view, pod("b", [1])).feasible[0]


async def test_a_release_frees_the_slices_for_the_next_pod(ledger: Ledger) -> None:
    view = await synced(ledger, mig_node("n1"))
    await bind(view, ledger, pod("a", [30000]))
    assert not run(view, pod("b", [4000])).feasible[0]
    await ledger.release("a")
    await view.refresh(["n1"])
    assert await ledger_mask(ledger) == 0
    b = await bind(view, ledger, pod("b", [4000]))
    assert instances(b) == [(GPU, "1g.5gb", 6)]


async def test_a_rebuild_from_the_pods_records_puts_the_slices_back(
    ledger: Ledger, redis_url: str
) -> None:
    view = await synced(ledger, mig_node("n1"))
    records = [
        (await bind(view, ledger, pod(uid, mems))).to_annotation()
        for uid, mems in (("a", [15000]), ("b", [4000, 4000]))
    ]
    client: Redis = Redis.from_url(redis_url)
    await client.flushdb()  # Redis lost everything
    await client.aclose()
    await ledger.register_node(mig_node("n1"))
    for record in records:
        await ledger.restore(Placement.from_annotation(record), running=True)
    await ledger.mark_rebuilt("n1")
    fresh = ClusterView(ledger)
    await fresh.sync()
    assert await ledger_mask(ledger) == 0b1111_1100  # 3g.20gb at 4, 1g.5gb at 3 and 2
    c = await bind(fresh, ledger, pod("c", [9000]))
    assert instances(c) == [(GPU, "1g.10gb", 0)]


async def test_a_container_asking_for_two_gets_one_instance_on_each_of_two_cards(
    ledger: Ledger,
) -> None:
    """A container's cards are distinct, MIG or not: one instance per card."""
    view = await synced(ledger, mig_node("n1", cards=3))
    a = await bind(view, ledger, pod("a", [4000]))
    assert instances(a) == [("GPU-n1-2", "1g.5gb", 6)]  # equal cards: the last, as HAMi
    b = await bind(view, ledger, pod("b", [4000], count=2))  # binpack: the card in use first
    assert instances(b) == [("GPU-n1-2", "1g.5gb", 5), ("GPU-n1-1", "1g.5gb", 6)]
    c = await bind(view, ledger, pod("c", [15000], count=2))
    assert instances(c) == [("GPU-n1-2", "3g.20gb", 0), ("GPU-n1-1", "3g.20gb", 0)]
    [card] = [g for g in await ledger.node_gpus("n1") if g.device.uuid == "GPU-n1-2"]
    assert (card.used.mig_mask, card.used.slots) == (0x6F, 3)
    assert await ledger.check_node("n1") == []
    spread = pod("d", [4000])
    ev = run(view, spread, GpuPolicy.SPREAD)
    got = placement(view.cluster, demand_of(spread, GpuPolicy.SPREAD), ev, 0)
    assert got.containers[0].devices[0].uuid == "GPU-n1-0"  # the emptiest


async def test_too_few_free_slices_is_a_topology_failure(ledger: Ledger) -> None:
    view = await synced(ledger, mig_node("n1", cards=2, instances=(static("3g.20gb", 4),)))
    ev = run(view, pod("p", [25000], count=2))  # a 7g.40gb would meet the static instance
    assert ev.reason(0) is FitReason.CARD_MIG_TOPOLOGY_INFEASIBLE
    assert run(view, pod("p", [15000], count=2)).feasible[0]  # a 3g.20gb at 0 on each


# ---------------------------------------------------------------- modes


async def test_modes_decide_which_cards_a_pod_may_use(ledger: Ledger) -> None:
    view = await synced(ledger, mig_node("n1"), mig_node("n2", cards=0, plain=1))
    names = view.cluster.node_names
    assert names == ["n1", "n2"]
    for mode, fits in (
        (VgpuMode.MIG, [True, False]),
        (VgpuMode.HAMI_CORE, [False, True]),
        (VgpuMode.MPS, [False, False]),
        (None, [True, True]),
    ):
        ev = run(view, pod("p", [4000], mode))
        assert ev.feasible.tolist() == fits, mode
        for row, ok in enumerate(fits):
            if not ok:
                assert ev.reason(row) is FitReason.CARD_TYPE_MISMATCH, (mode, row)


async def test_a_pod_of_any_mode_takes_a_node_s_other_cards_before_its_mig_cards(
    ledger: Ledger,
) -> None:
    view = await synced(ledger, mig_node("n1", cards=1, plain=1))
    first = await bind(view, ledger, pod("a", ["100%"], cores=100))
    assert first.containers[0].devices[0].uuid == "GPU-n1-1"  # the hami-core card, whole
    assert first.containers[0].devices[0].mig is None
    second = await bind(view, ledger, pod("b", [4000]))
    assert instances(second) == [(GPU, "1g.5gb", 6)]


async def test_under_fragmentation_a_mig_node_ranks_after_the_others(ledger: Ledger) -> None:
    view = await synced(ledger, mig_node("n1"), mig_node("n2", cards=0, plain=1))
    ev = run(view, pod("p", [4000]), GpuPolicy.FRAGMENTATION)
    assert ev.feasible.tolist() == [True, True]
    assert ev.score[1] > ev.score[0]
    only = run(view, pod("p", [4000], VgpuMode.MIG), GpuPolicy.FRAGMENTATION)
    assert only.feasible.tolist() == [True, False]


async def test_the_usual_rules_come_before_the_mig_rule(ledger: Ledger) -> None:
    view = await synced(ledger, mig_node("n1"))
    await ledger.cordon("n1", GPU)
    await view.refresh(["n1"])
    assert run(view, pod("p", [4000])).reason(0) is FitReason.CARD_CORDONED
    await ledger.cordon("n1", GPU, cordoned=False)
    await view.refresh(["n1"])
    assert run(view, pod("p", [50000])).reason(0) is FitReason.CARD_INSUFFICIENT_MEMORY
    await bind(view, ledger, pod("a", [4000], cores=50))  # books 1g.5gb's 14 %, not 50 %
    assert run(view, pod("p", [4000], cores=86)).feasible[0]
    assert run(view, pod("p", [4000], cores=87)).reason(0) is FitReason.CARD_INSUFFICIENT_CORE


async def test_type_and_uuid_lists_hold_for_mig_cards(ledger: Ledger) -> None:
    view = await synced(ledger, mig_node("n1", cards=2))

    def with_selector(**lists: tuple[str, ...]) -> PodGpuRequest:
        return pod("p", [4000]).model_copy(update={"selector": DeviceSelector(**lists)})

    ev = run(view, with_selector(exclude_types=("a100",)))
    assert ev.reason(0) is FitReason.CARD_TYPE_MISMATCH
    ev = run(view, with_selector(include_uuids=("GPU-n1-0",)))
    assert instances(
        placement(view.cluster, demand_of(with_selector(include_uuids=("GPU-n1-0",))), ev, 0)
    ) == [("GPU-n1-0", "1g.5gb", 6)]
    ev = run(view, with_selector(exclude_uuids=("GPU-n1-0", "GPU-n1-1")))
    assert ev.reason(0) is FitReason.CARD_UUID_MISMATCH


async def test_evaluations_of_a_mig_node_follow_its_slices(ledger: Ledger) -> None:
    """The incremental evaluator re-evaluates a MIG node whose slices changed."""
    view = await synced(ledger, mig_node("n1"))
    evaluator = Evaluator(view.cluster, None)
    kind = demand_of(pod("p", [30000]))
    assert evaluator.evaluate(kind).feasible[0]
    await bind(view, ledger, pod("a", [4000]))
    assert view.cluster is evaluator.cluster  # counted in place, not rebuilt
    assert not evaluator.evaluate(kind).feasible[0]
    await ledger.release("a")
    await view.refresh(["n1"])
    assert view.cluster is evaluator.cluster
    assert evaluator.evaluate(kind).feasible[0]


# ---------------------------------------------------------------- through the extender


async def test_the_extender_filters_and_binds_mig_pods_and_never_shares_a_slice(
    stack: Stack,
) -> None:
    await stack.ledger.register_node(mig_node("node-m"), rebuilt=True)
    view = stack.extender.view
    await eventually(
        lambda: "node-m" in view.cluster.node_index and "node-m" not in view.rebuilding
    )
    mig = {"nvidia.com/vgpu-mode": "mig"}
    probe = gpu_pod("probe", mem=4000, annotations=mig)
    reply = (await stack.post("filter", args(probe, "node-a", "node-m"))).json()
    assert reply["NodeNames"] == ["node-m"], reply
    # no preemption could give a hami-core card another mode
    assert reply["FailedAndUnresolvableNodes"]["node-a"].startswith("CardTypeMismatch")
    # eight pods of one 1g.5gb instance race for the card's seven
    pods = [await stack.add(gpu_pod(f"m{i}", mem=4000, annotations=mig)) for i in range(8)]
    async with kubelet_admitting(stack, "node-m"):
        replies = await asyncio.gather(*(stack.bind(p, "node-m") for p in pods))
    assert sum(r.json()["Error"] == "" for r in replies) == 7
    assert await ledger_mask(stack.ledger, "node-m") == 0b0111_1111
    assert await stack.ledger.check_node("node-m") == []
    placed = [await stack.ledger.placement(f"uid-m{i}") for i in range(8)]
    starts = sorted(instances(p)[0][2] for p in placed if p is not None and p.state != "released")
    assert starts == list(range(7))
    stored = await stack.kube.get_pod("team", "m0")
    record = Placement.from_annotation(stored["metadata"]["annotations"][PLACEMENT_ANNOTATION])
    assert record.containers[0].devices[0].mig is not None
