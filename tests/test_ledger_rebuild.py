"""A node's part of the ledger after Redis lost it: no reservation, bind or
allocation before a reconciliation pass stamps it rebuilt, and restores that
never count more than a card holds."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from redis.asyncio import Redis

from gpuslice_common.kube import LocalKubeApi
from gpuslice_common.ledger import Ledger, LedgerRebuilding, ReservationConflict
from gpuslice_common.models import FitReason, PlacementState
from gpuslice_inventory.reconcile import Reconciler
from gpuslice_inventory.upkeep import Upkeep
from tests.conftest import make_inventory
from tests.inventory.test_reconcile import pod_for
from tests.test_ledger import placement, usage

NODE = "gpu-1"


def reconciler(ledger: Ledger, kube: LocalKubeApi) -> Reconciler:
    upkeep = Upkeep(ledger, timedelta(seconds=10), timedelta(minutes=5))
    return Reconciler(ledger, kube, upkeep)


async def flush(redis_url: str) -> None:
    """Redis loses everything (a restart without persistence)."""
    client: Redis = Redis.from_url(redis_url)
    await client.flushall()
    await client.aclose()


async def test_a_node_takes_nothing_before_it_is_stamped_rebuilt(ledger: Ledger) -> None:
    await ledger.register_node(make_inventory(NODE, gpus=2))
    assert (await ledger.rebuild_status())[NODE].rebuilt_at is None
    with pytest.raises(LedgerRebuilding) as refused:
        await ledger.reserve(placement("p1", NODE, [[(0, 1000, 10)]]))
    assert refused.value.node == NODE
    assert f"node {NODE} is being rebuilt" in str(refused.value)
    assert await ledger.placement("p1") is None  # the pod index claim was given up
    with pytest.raises(LedgerRebuilding):
        await ledger.mark_bound("p1", NODE)
    with pytest.raises(LedgerRebuilding):
        await ledger.allocate(NODE, 1)
    with pytest.raises(LedgerRebuilding):
        await ledger.next_allocation(NODE, 1)
    assert await usage(ledger, NODE) == [(0, 0, 0, None), (0, 0, 0, None)]

    # the pod goes elsewhere at once: its refused claim blocks nothing
    await ledger.register_node(make_inventory("gpu-2", gpus=1), rebuilt=True)
    assert (await ledger.reserve(placement("p1", "gpu-2", [[(0, 1000, 10)]]))).node == "gpu-2"
    await ledger.release("p1", "test")

    # a restore is how the node is rebuilt: allowed before the stamp
    kept = placement("kept", NODE, [[(1, 2000, 20)]])
    restored, new = await ledger.restore(kept, running=False)
    assert new
    assert restored.state is PlacementState.BOUND
    with pytest.raises(LedgerRebuilding):  # still no choice among the bound pods
        await ledger.allocate(NODE, 1)

    revision = (await ledger.revisions([NODE]))[NODE]
    registered = (await ledger.rebuild_status())[NODE].registered
    assert await ledger.mark_rebuilt(NODE, registered)
    assert (await ledger.revisions([NODE]))[NODE] > revision  # the scheduler re-reads it
    assert (await ledger.rebuild_status())[NODE].rebuilt_at is not None
    assert (await ledger.allocate(NODE, 1)).placement.pod.uid == "kept"
    await ledger.reserve(placement("p2", NODE, [[(0, 1000, 10)]]))
    assert await usage(ledger, NODE) == [(1000, 10, 1, None), (2000, 20, 1, None)]
    assert await ledger.check_node(NODE) == []


async def test_a_node_registered_again_after_the_loss_needs_a_new_stamp(
    ledger: Ledger, redis_url: str
) -> None:
    await ledger.register_node(make_inventory(NODE, gpus=1))
    before = (await ledger.rebuild_status())[NODE].registered
    assert not await ledger.mark_rebuilt("never-registered")
    await flush(redis_url)
    assert await ledger.rebuild_status() == {}
    assert not await ledger.mark_rebuilt(NODE, before)  # nothing there to stamp
    await ledger.register_node(make_inventory(NODE, gpus=1))
    # a pass that read the registration before the loss rebuilt nothing now there
    assert not await ledger.mark_rebuilt(NODE, before)
    assert (await ledger.rebuild_status())[NODE].rebuilt_at is None
    await ledger.register_node(make_inventory(NODE, gpus=1))  # heartbeats keep it
    assert await ledger.mark_rebuilt(NODE, (await ledger.rebuild_status())[NODE].registered)
    await ledger.register_node(make_inventory(NODE, gpus=1))  # and keep the stamp
    assert (await ledger.rebuild_status())[NODE].rebuilt_at is not None


@pytest.mark.parametrize(
    ("first", "second", "reason"),
    [
        ((0, 1000, 70), (0, 1000, 60), FitReason.CARD_INSUFFICIENT_CORE),
        ((0, 30000, 10), (0, 11000, 10), FitReason.CARD_INSUFFICIENT_MEMORY),
        ((0, 1000, 100), (0, 1000, 10), FitReason.EXCLUSIVE_DEVICE_ALLOCATE_CONFLICT),
    ],
)
async def test_a_restore_never_counts_more_than_the_card_holds(
    ledger: Ledger,
    first: tuple[int, int, int],
    second: tuple[int, int, int],
    reason: FitReason,
) -> None:
    await ledger.register_node(make_inventory(NODE, gpus=1, memory_mib=40960))
    await ledger.restore(placement("first", NODE, [[first]]), running=True)
    before = await usage(ledger, NODE)
    with pytest.raises(ReservationConflict) as refused:
        await ledger.restore(placement("second", NODE, [[second]]), running=True)
    assert refused.value.reason == reason
    assert await usage(ledger, NODE) == before
    assert await ledger.placement("second") is None
    assert await ledger.check_node(NODE) == []


async def test_reconciliation_counts_records_that_claim_too_much_and_stamps_the_node(
    ledger: Ledger,
) -> None:
    """Two pods' annotations claim 130 of a card's 100 cores (one is outdated): one
    is restored, the other counted as a conflict; the node is rebuilt either way."""
    await ledger.register_node(make_inventory(NODE, gpus=1, memory_mib=40960))
    kube = LocalKubeApi()
    kube.add_pod(pod_for(placement("a", NODE, [[(0, 20000, 70)]]), "Running"))
    kube.add_pod(pod_for(placement("b", NODE, [[(0, 21000, 60)]]), "Running"))
    result = await reconciler(ledger, kube).run_once()
    assert (result.restored, result.conflicts, result.failed) == (1, 1, 0)
    assert (result.stamped, result.waiting) == (1, 0)
    [card] = await ledger.node_gpus(NODE)
    assert card.used.cores in (60, 70)
    assert card.used.cores <= card.capacity.cores
    assert card.used.memory_mib <= card.capacity.memory_mib
    assert await ledger.check_node(NODE) == []


class RegistersDuringTheList(LocalKubeApi):
    """A node registers (new, or again after a loss) while the pods are listed."""

    def __init__(self, ledger: Ledger, node: str) -> None:
        super().__init__()
        self.ledger = ledger
        self.node = node

    async def list_all_pods(self) -> list[dict[str, Any]]:
        listed = await super().list_all_pods()
        await self.ledger.register_node(make_inventory(self.node, gpus=1))
        return listed


async def test_a_node_is_stamped_only_by_a_pass_that_listed_after_it_registered(
    ledger: Ledger,
) -> None:
    await ledger.register_node(make_inventory(NODE, gpus=1))
    kube = RegistersDuringTheList(ledger, "late")
    first = await reconciler(ledger, kube).run_once()
    assert first.stamped == 1
    status = await ledger.rebuild_status()
    assert status[NODE].rebuilt_at is not None
    assert status["late"].rebuilt_at is None  # its pods may be missing from that list
    second = await reconciler(ledger, kube).run_once()
    assert second.stamped == 1
    assert (await ledger.rebuild_status())["late"].rebuilt_at is not None


async def test_a_record_on_a_node_not_registered_yet_is_tried_again(ledger: Ledger) -> None:
    """Not a conflict: the node has not registered since Redis lost its data."""
    kube = LocalKubeApi()
    kube.add_pod(pod_for(placement("p", NODE, [[(0, 1000, 10)]]), "Running"))
    first = await reconciler(ledger, kube).run_once()
    assert (first.restored, first.conflicts, first.failed, first.stamped) == (0, 0, 1, 0)
    await ledger.register_node(make_inventory(NODE, gpus=1))
    second = await reconciler(ledger, kube).run_once()
    assert (second.restored, second.conflicts, second.failed, second.stamped) == (1, 0, 0, 1)
    assert await usage(ledger, NODE) == [(1000, 10, 1, None)]


async def test_one_unreadable_node_holds_back_only_itself(ledger: Ledger) -> None:
    """A pod record no gpuslice wrote on one node, a name in the node set that is no
    node's, and a stamp that is not a time: reconciliation still runs, stamps every
    other node, and leaves the unreadable one alone until it can be read."""
    for node in (NODE, "gpu-2"):
        await ledger.register_node(make_inventory(node, gpus=1))
    await ledger.redis.hset(ledger.node_keys("gpu-2").pods, "broken", "{not json")
    await ledger.redis.sadd(ledger.nodes_key, "Not A Node!")
    kube = LocalKubeApi()
    kube.add_pod(pod_for(placement("a", NODE, [[(0, 1000, 10)]]), "Running"))
    kube.add_pod(pod_for(placement("b", "gpu-2", [[(0, 1000, 10)]]), "Running"))
    result = await reconciler(ledger, kube).run_once()
    assert (result.restored, result.stamped, result.waiting) == (1, 1, 1)
    status = await ledger.rebuild_status()
    assert set(status) == {NODE, "gpu-2"}
    assert status[NODE].rebuilt_at is not None
    assert status["gpu-2"].rebuilt_at is None
    # a stamp that is not a time is read without failing (and shown as none)
    await ledger.redis.hset(ledger.node_keys(NODE).meta, "rebuilt", "soon")
    assert (await ledger.rebuild_status())[NODE].rebuilt_at is None
