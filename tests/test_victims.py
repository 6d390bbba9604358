"""The choice of GPU victims (gpuslice_scheduler.victims): pure code over the engine."""

from __future__ import annotations

from collections.abc import Sequence

from gpuslice_common.models import (
    ContainerAssignment,
    ContainerGpuRequest,
    DeviceGrant,
    DeviceSelector,
    GpuCapacity,
    GpuDevice,
    GpuState,
    GpuUsage,
    MemoryRequest,
    Placement,
    PodGpuRequest,
    PodRef,
)
from gpuslice_scheduler.cluster import Cluster
from gpuslice_scheduler.engine import Demand
from gpuslice_scheduler.victims import Choice, Holder, NodeRoom, best, choose_on_node

MEM = 10_000
MODEL = "NVIDIA A100-SXM4-80GB"


def holder(
    uid: str, node: str, card: int, share: int, priority: int, started: str = "2025-01-01T00:00:00Z"
) -> Holder:
    """A pod holding ``share`` % of memory and cores of card ``card`` of ``node``."""
    grant = DeviceGrant(uuid=f"GPU-{node}-{card}", memory_mib=MEM * share // 100, cores=share)
    placement = Placement(
        pod=PodRef(uid=uid, namespace="ns", name=uid),
        node=node,
        containers=(ContainerAssignment(name="main", devices=(grant,)),),
    )
    return Holder(placement, priority, started)


def node_cards(node: str, cards: int, holders: Sequence[Holder]) -> list[GpuState]:
    """The node's cards with the usage ``holders`` add up to, as the ledger has it."""
    states = []
    for index in range(cards):
        uuid = f"GPU-{node}-{index}"
        grants = [
            d
            for h in holders
            for c in h.placement.containers
            for d in c.devices
            if d.uuid == uuid and h.placement.node == node
        ]
        states.append(
            GpuState(
                node=node,
                device=GpuDevice(uuid=uuid, index=index, model=MODEL, memory_mib=MEM),
                capacity=GpuCapacity(memory_mib=MEM, cores=100, slots=10),
                used=GpuUsage(
                    memory_mib=sum(d.memory_mib for d in grants),
                    cores=sum(d.cores for d in grants),
                    slots=len(grants),
                ),
            )
        )
    return states


def whole_card(percent: int = 100) -> Demand:
    """A pod asking one card: ``percent`` % of its memory and cores."""
    request = PodGpuRequest(
        pod=PodRef(uid="preemptor", namespace="ns", name="preemptor"),
        containers=(
            ContainerGpuRequest(
                name="main", count=1, memory=MemoryRequest(percent=percent), cores=percent
            ),
        ),
        selector=DeviceSelector(),
    )
    return Demand.of(request)


def uids(holders: Sequence[Holder]) -> list[str]:
    return [h.uid for h in holders]


def test_the_lowest_victims_on_one_node_go_and_the_pod_takes_their_card() -> None:
    pods = [
        holder("a1", "a", 0, 60, priority=1),
        holder("a2", "a", 1, 60, priority=1),
        holder("b1", "b", 0, 60, priority=0),
        holder("b2", "b", 0, 30, priority=0),
        holder("b3", "b", 1, 60, priority=0),
    ]
    chosen = best_of_two_nodes(pods, cards=2)
    # one victim on each node; b's is of lower priority
    assert chosen is not None
    assert chosen.node == "b"
    assert uids(chosen.victims) == ["b3"]
    assert [d.uuid for c in chosen.placement.containers for d in c.devices] == ["GPU-b-1"]


def best_of_two_nodes(pods: list[Holder], cards: int) -> Choice | None:
    """The choice for one whole card between nodes a and b (``cards`` each),
    whose holders are ``pods``; a pod of priority 10 preempts."""
    on = {n: [p for p in pods if p.placement.node == n] for n in ("a", "b")}
    cluster = Cluster.build([(n, node_cards(n, cards, on[n])) for n in on])
    return best(
        [
            choose_on_node(NodeRoom(cluster, n), whole_card(), 10, on[n], order=i)
            for i, n in enumerate(on)
        ]
    )


def test_fewest_victims_win_over_lower_priority() -> None:
    pods = [
        holder("a1", "a", 0, 100, priority=5),
        holder("b1", "b", 0, 50, priority=1),
        holder("b2", "b", 0, 50, priority=1),
    ]
    chosen = best_of_two_nodes(pods, cards=1)
    assert chosen is not None
    assert chosen.node == "a"
    assert uids(chosen.victims) == ["a1"]


def test_pods_of_equal_or_higher_priority_are_never_victims() -> None:
    pods = [holder("same", "a", 0, 60, priority=10), holder("higher", "a", 1, 60, priority=11)]
    cluster = Cluster.build([("a", node_cards("a", 2, pods))])
    assert choose_on_node(NodeRoom(cluster, "a"), whole_card(), 10, pods) is None


def test_the_more_important_are_spared_first_and_the_youngest_go() -> None:
    pods = [
        holder("old", "a", 0, 50, priority=1, started="2024-01-01T00:00:00Z"),
        holder("young", "a", 0, 50, priority=1, started="2025-06-01T00:00:00Z"),
        holder("important", "a", 1, 100, priority=5),
    ]
    cluster = Cluster.build([("a", node_cards("a", 2, pods))])
    # half a card: one of the two low ones is enough, and it is the youngest
    half = choose_on_node(NodeRoom(cluster, "a"), whole_card(50), 10, pods)
    assert half is not None
    assert uids(half.victims) == ["young"]
    # a whole card: both low ones go (spared first: the more important pod)
    whole = choose_on_node(NodeRoom(cluster, "a"), whole_card(), 10, pods)
    assert whole is not None
    assert sorted(uids(whole.victims)) == ["old", "young"]


def test_no_victim_can_be_spared_alone() -> None:
    pods = [holder(f"p{i}", "a", i % 2, 30, priority=i % 3) for i in range(6)]
    cluster = Cluster.build([("a", node_cards("a", 2, pods))])
    room, demand = NodeRoom(cluster, "a"), whole_card(70)
    choice = choose_on_node(room, demand, 10, pods)
    assert choice is not None
    assert choice.victims
    for spared in choice.victims:
        rest = [v for v in choice.victims if v is not spared]
        assert not room.fits(demand, rest), f"{spared.uid} need not have gone"


def test_pods_already_going_make_room_without_a_victim() -> None:
    going = holder("ending", "a", 0, 100, priority=0)
    staying = holder("low", "a", 1, 100, priority=0)
    cluster = Cluster.build([("a", node_cards("a", 2, [going, staying]))])
    choice = choose_on_node(NodeRoom(cluster, "a"), whole_card(), 10, [staying], going=[going])
    assert choice is not None
    assert choice.victims == ()


def test_a_room_held_for_another_nomination_is_not_taken() -> None:
    pods = [holder("low", "a", 0, 100, priority=0)]
    cluster = Cluster.build([("a", node_cards("a", 2, pods))])
    other = holder("nominee", "a", 1, 100, priority=20).placement
    room = NodeRoom(cluster, "a")
    # without the hold the free card 1 fits: no victim; with it, "low" must go
    free = choose_on_node(room, whole_card(), 10, pods)
    assert free is not None
    assert free.victims == ()
    held = choose_on_node(room, whole_card(), 10, pods, held=[other])
    assert held is not None
    assert uids(held.victims) == ["low"]
    # and a node whose only room is held cannot help at all
    full = choose_on_node(room, whole_card(), 10, [], held=[other, pods[0].placement])
    assert full is None


def test_a_node_too_small_even_empty_cannot_help() -> None:
    pods = [holder("low", "a", 0, 10, priority=0)]
    cluster = Cluster.build([("a", node_cards("a", 1, pods))])
    two_cards = Demand.of(
        PodGpuRequest(
            pod=PodRef(uid="p", name="p"),
            containers=(
                ContainerGpuRequest(name="main", count=2, memory=MemoryRequest(mib=100), cores=0),
            ),
            selector=DeviceSelector(),
        )
    )
    assert choose_on_node(NodeRoom(cluster, "a"), two_cards, 10, pods) is None
