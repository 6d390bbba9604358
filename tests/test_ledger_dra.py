"""One ledger for both modes: a node in DRA mode takes prepared claims only, a node in
device-plugin mode never takes one (real Redis)."""

from __future__ import annotations

import pytest

from gpuslice_cli.status import gather_status, status_document
from gpuslice_common.ledger import (
    ClaimConflict,
    Ledger,
    LedgerRebuilding,
    NodeCards,
    ReservationConflict,
    ServesDra,
)
from gpuslice_common.models import ClaimRef, Placement, PlacementState
from gpuslice_scheduler.view import ClusterView
from tests.conftest import make_inventory
from tests.test_ledger import placement

DRA, PLUGIN = "dra-node", "plugin-node"
CLAIM = ClaimRef(namespace="ns", name="pod-gpu", uid="claim-1")


def ref(name: str) -> ClaimRef:
    return ClaimRef(namespace="ns", name=f"{name}-gpu", uid=f"claim-{name}")


def claimed(
    uid: str, node: str, grants: list[list[tuple[int, int, int]]], **kw: object
) -> Placement:
    claim = kw.pop("claim", CLAIM)
    return placement(uid, node, grants).model_copy(update={"claim": claim, "policy": "dra"})


@pytest.fixture
async def nodes(ledger: Ledger) -> Ledger:
    await ledger.register_node(make_inventory(DRA, dra=True), rebuilt=True)
    await ledger.register_node(make_inventory(PLUGIN), rebuilt=True)
    return ledger


async def usage(ledger: Ledger, node: str) -> list[tuple[int, int, int]]:
    return [(g.used.memory_mib, g.used.cores, g.used.slots) for g in await ledger.node_gpus(node)]


async def test_the_mode_is_stored_at_registration_and_read_back(nodes: Ledger) -> None:
    read = await nodes.read_nodes([DRA, PLUGIN])
    dra, plugin = read[DRA], read[PLUGIN]
    assert isinstance(dra, NodeCards)
    assert isinstance(plugin, NodeCards)
    assert (dra.dra, plugin.dra) == (True, False)
    # the agent's next heartbeat says otherwise: so is the node
    await nodes.register_node(make_inventory(DRA))
    again = (await nodes.read_nodes([DRA]))[DRA]
    assert isinstance(again, NodeCards)
    assert again.dra is False


async def test_a_prepared_claim_is_recorded_allocated_with_its_claim(nodes: Ledger) -> None:
    made = await nodes.record_claim(claimed("p1", DRA, [[(0, 4096, 30)], [(1, 1000, 100)]]))
    assert made.created
    stored = await nodes.placement("p1")
    assert stored is not None
    assert stored.claim == CLAIM
    assert stored.state is PlacementState.ALLOCATED
    assert stored.allocated_containers == 2
    assert await usage(nodes, DRA) == [(4096, 30, 1), (1000, 100, 1)]
    assert [p.claim for p in await nodes.node_placements(DRA)] == [CLAIM]
    # the same claim again: the stored placement, counted once
    again = await nodes.record_claim(claimed("p1", DRA, [[(0, 4096, 30)], [(1, 1000, 100)]]))
    assert not again.created
    assert again.placement == stored
    assert await usage(nodes, DRA) == [(4096, 30, 1), (1000, 100, 1)]
    assert await nodes.check_node(DRA) == []
    # nothing on the node waits for kubelet's Allocate: the claim was the grant
    with pytest.raises(ServesDra, match="serves GPUs through DRA"):
        await nodes.allocate(DRA, 1)


async def test_another_claim_for_a_pod_that_holds_one_is_refused(nodes: Ledger) -> None:
    await nodes.record_claim(claimed("p1", DRA, [[(0, 1000, 10)]]))
    other = ClaimRef(namespace="ns", name="second", uid="claim-2")
    with pytest.raises(ClaimConflict, match="already holds claim ns/pod-gpu"):
        await nodes.record_claim(claimed("p1", DRA, [[(1, 1000, 10)]], claim=other))
    assert await usage(nodes, DRA) == [(1000, 10, 1), (0, 0, 0)]


async def test_a_claim_is_refused_on_a_device_plugin_node(nodes: Ledger) -> None:
    with pytest.raises(ReservationConflict) as refused:
        await nodes.record_claim(claimed("p1", PLUGIN, [[(0, 1000, 10)]]))
    assert refused.value.reason == "NodeNotDra"
    assert await nodes.placement("p1") is None
    assert await usage(nodes, PLUGIN) == [(0, 0, 0), (0, 0, 0)]


async def test_a_dra_node_takes_no_device_plugin_reservation(nodes: Ledger) -> None:
    with pytest.raises(ReservationConflict) as refused:
        await nodes.reserve(placement("p1", DRA, [[(0, 1000, 10)]]))
    assert refused.value.reason == "NodeServesDra"
    assert await nodes.placement("p1") is None
    assert await usage(nodes, DRA) == [(0, 0, 0), (0, 0, 0)]


async def test_a_claim_is_checked_like_a_new_reservation(nodes: Ledger) -> None:
    # a device-plugin pod made before the node turned to DRA holds card 0 whole
    await nodes.register_node(make_inventory(DRA))
    await nodes.reserve(placement("old", DRA, [[(0, 1000, 100)]]))
    await nodes.register_node(make_inventory(DRA, dra=True))
    with pytest.raises(ReservationConflict) as refused:
        await nodes.record_claim(claimed("p1", DRA, [[(0, 1000, 10)]]))
    assert refused.value.reason == "ExclusiveDeviceAllocateConflict"
    with pytest.raises(ReservationConflict) as refused:
        await nodes.record_claim(claimed("p1", DRA, [[(1, 16385, 10)]]))
    assert refused.value.reason == "CardInsufficientMemory"
    assert await nodes.placement("p1") is None
    assert await nodes.check_node(DRA) == []


async def test_a_claim_counts_as_kube_scheduler_counts_it(nodes: Ledger) -> None:
    """kube-scheduler sums what claims consume: all cores make no card exclusive, a
    share without cores needs none spare, the split count does not apply; only the
    sums of memory and cores must fit the card."""
    await nodes.record_claim(claimed("all", DRA, [[(0, 1, 100)]], claim=ref("all")))
    await nodes.record_claim(claimed("none", DRA, [[(0, 1, 0)]], claim=ref("none")))
    await nodes.record_claim(claimed("half1", DRA, [[(1, 1, 50)]], claim=ref("half1")))
    await nodes.record_claim(claimed("half2", DRA, [[(1, 1, 50)]], claim=ref("half2")))
    await nodes.record_claim(claimed("zero", DRA, [[(1, 1, 0)]], claim=ref("zero")))
    # more shares than the split count (10), as many as kube-scheduler allocates
    for i in range(10):
        await nodes.record_claim(claimed(f"s{i}", DRA, [[(0, 1, 0)]], claim=ref(f"s{i}")))
    assert await usage(nodes, DRA) == [(12, 100, 12), (3, 100, 3)]
    # the sums still bound it: memory or cores past the card's are refused
    with pytest.raises(ReservationConflict) as refused:
        await nodes.record_claim(claimed("big", DRA, [[(0, 16384 - 11, 0)]], claim=ref("big")))
    assert refused.value.reason == "CardInsufficientMemory"
    with pytest.raises(ReservationConflict) as refused:
        await nodes.record_claim(claimed("more", DRA, [[(1, 1, 1)]], claim=ref("more")))
    assert refused.value.reason == "CardInsufficientCore"
    assert await nodes.placement("big") is None
    assert await nodes.placement("more") is None
    await nodes.record_claim(claimed("fits", DRA, [[(0, 16384 - 12, 0)]], claim=ref("fits")))
    # its readers take a card with all cores granted and more pods on it
    assert await nodes.check_node(DRA) == []
    [first, _] = await nodes.node_gpus(DRA)
    assert (first.used.exclusive_owner, first.free_cores, first.free_memory_mib) == (None, 0, 0)
    read = (await nodes.read_nodes([DRA]))[DRA]
    assert isinstance(read, NodeCards)
    assert [(c.used_cores, c.owner) for c in read.cards] == [(100, ""), (100, "")]
    [status] = await gather_status(nodes, DRA)
    document = status_document([status])
    [gpu0, gpu1] = document["nodes"][0]["gpus"]
    assert (gpu0["cores_allocated"], gpu0["pod_count"], gpu0["exclusive_owner"]) == (100, 13, None)
    assert (gpu1["cores_allocated"], gpu1["pod_count"]) == (100, 3)
    view = ClusterView(nodes)
    await view.sync()
    lo = int(view.cluster.node_start[view.cluster.node_index[DRA]])
    assert [bool(view.cluster.owned[lo + k]) for k in range(2)] == [False, False]
    assert [int(view.cluster.used_cores[lo + k]) for k in range(2)] == [100, 100]
    # and the ledger rebuilt from the pods' records takes them all back
    placements = await nodes.node_placements(DRA)
    await nodes.redis.flushall()
    await nodes.register_node(make_inventory(DRA, dra=True))
    for held in placements:
        _, restored = await nodes.restore(held, running=True)
        assert restored
    assert await usage(nodes, DRA) == [(16384, 100, 13), (3, 100, 3)]
    assert await nodes.check_node(DRA) == []


async def test_a_claim_placed_on_a_cordoned_or_unhealthy_card_is_recorded(nodes: Ledger) -> None:
    """The pod is bound to the card kube-scheduler chose: refusing it would leave it
    bound and never started."""
    await nodes.cordon(DRA, f"GPU-{DRA}-1")
    made = await nodes.record_claim(claimed("p1", DRA, [[(1, 1000, 10)]]))
    assert made.created
    inventory = make_inventory(DRA, dra=True)
    sick = inventory.devices[0].model_copy(update={"healthy": False})
    await nodes.register_node(
        inventory.model_copy(update={"devices": (sick, inventory.devices[1])})
    )
    made = await nodes.record_claim(claimed("p2", DRA, [[(0, 1000, 10)]], claim=ref("p2")))
    assert made.created
    assert await usage(nodes, DRA) == [(1000, 10, 1), (1000, 10, 1)]


async def test_a_claim_waits_for_the_node_s_rebuild(ledger: Ledger) -> None:
    await ledger.register_node(make_inventory(DRA, dra=True))  # not stamped rebuilt
    with pytest.raises(LedgerRebuilding):
        await ledger.record_claim(claimed("p1", DRA, [[(0, 1000, 10)]]))


async def test_a_released_claim_frees_its_cards(nodes: Ledger) -> None:
    await nodes.record_claim(claimed("p1", DRA, [[(0, 1000, 10)]]))
    released = await nodes.release("p1", "claim unprepared")
    assert released is not None
    assert released.placement.claim == CLAIM
    assert await usage(nodes, DRA) == [(0, 0, 0), (0, 0, 0)]


async def test_a_placement_without_a_claim_is_no_claim_s(nodes: Ledger) -> None:
    with pytest.raises(ValueError, match="needs a placement with its claim"):
        await nodes.record_claim(placement("p1", DRA, [[(0, 1000, 10)]]))


def test_the_annotation_keeps_the_claim_and_is_unchanged_without_one() -> None:
    plain = placement("p1", DRA, [[(0, 1000, 10)]])
    assert "claim" not in plain.to_annotation()
    record = claimed("p1", DRA, [[(0, 1000, 10)]])
    assert Placement.from_annotation(record.to_annotation()).claim == CLAIM
