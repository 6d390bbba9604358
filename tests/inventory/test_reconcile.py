"""Reconciliation against a real Redis: the ledger rebuilt from pod annotations after
Redis lost everything, and reservations of pods that are gone released."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

from redis.asyncio import Redis

from gpuslice_common.kube import LocalKubeApi
from gpuslice_common.ledger import Ledger, LedgerError
from gpuslice_common.models import (
    PLACEMENT_ANNOTATION,
    ContainerAssignment,
    DeviceGrant,
    Placement,
    PlacementState,
    PodRef,
)
from gpuslice_inventory.reconcile import Reconciler
from gpuslice_inventory.upkeep import Upkeep
from tests.conftest import make_inventory
from tests.test_ledger import placement
from tests.test_ledger_vendors import dcus

NODE = "gpu-1"


def pod_for(record: Placement, phase: str, node: str | None = NODE) -> dict[str, Any]:
    pod: dict[str, Any] = {
        "metadata": {
            "name": record.pod.name,
            "namespace": record.pod.namespace,
            "uid": record.pod.uid,
            "annotations": {PLACEMENT_ANNOTATION: record.to_annotation()},
        },
        "spec": {"containers": [{"name": c.name} for c in record.containers]},
        "status": {"phase": phase},
    }
    if node is not None:
        pod["spec"]["nodeName"] = node
    return pod


def reconciler(ledger: Ledger, kube: LocalKubeApi, grace: float = 30) -> Reconciler:
    upkeep = Upkeep(ledger, timedelta(seconds=10), timedelta(minutes=5))
    return Reconciler(ledger, kube, upkeep, grace=timedelta(seconds=grace))


async def usage(ledger: Ledger) -> list[tuple[int, int, int]]:
    return [(g.used.memory_mib, g.used.cores, g.used.slots) for g in await ledger.node_gpus(NODE)]


async def test_the_ledger_is_whole_again_after_redis_lost_everything(
    ledger: Ledger, redis_url: str
) -> None:
    await ledger.register_node(make_inventory(NODE, gpus=2), rebuilt=True)
    running = placement("running", NODE, [[(0, 4000, 30)], [(1, 2000, 10)]])
    starting = placement("starting", NODE, [[(1, 1000, 5)]])
    unbound = placement("unbound", NODE, [[(0, 500, 5)]])
    for record in (running, starting, unbound):
        await ledger.reserve(record)
    before = await usage(ledger)
    kube = LocalKubeApi()
    kube.add_pod(pod_for(running, "Running"))
    kube.add_pod(pod_for(starting, "Pending"))
    kube.add_pod(pod_for(unbound, "Pending", node=None))  # bind not done: the scheduler's
    kube.add_pod(pod_for(placement("ended", NODE, [[(0, 9000, 90)]]), "Succeeded"))
    client: Redis = Redis.from_url(redis_url)
    await client.flushall()  # Redis lost its data
    await client.aclose()
    await ledger.register_node(make_inventory(NODE, gpus=2))  # the next heartbeat
    assert (await ledger.rebuild_status())[NODE].rebuilt_at is None
    result = await reconciler(ledger, kube).run_once()
    assert (result.pods, result.held, result.restored, result.released) == (4, 0, 2, 0)
    assert (result.stamped, result.waiting, result.conflicts) == (1, 0, 0)
    assert (await ledger.rebuild_status())[NODE].rebuilt_at is not None
    after = await usage(ledger)
    assert after == [(4000, 30, 1), (3000, 15, 2)]  # running and starting, not the others
    assert before == [(4500, 35, 2), (3000, 15, 2)]
    restored = await ledger.placement("running")
    assert restored is not None
    assert restored.state is PlacementState.ALLOCATED
    bound = await ledger.placement("starting")
    assert bound is not None
    assert bound.state is PlacementState.BOUND  # kubelet may still ask to allocate it
    assert await ledger.check_node(NODE) == []
    # a second pass changes nothing
    again = await reconciler(ledger, kube).run_once()
    assert (again.held, again.restored, again.released) == (2, 0, 0)


async def test_restore_counts_devices_on_a_card_that_is_now_unhealthy(ledger: Ledger) -> None:
    inventory = make_inventory(NODE, gpus=1)
    sick = inventory.devices[0].model_copy(update={"healthy": False})
    await ledger.register_node(inventory.model_copy(update={"devices": (sick,)}))
    record = placement("p", NODE, [[(0, 1000, 10)]])
    kube = LocalKubeApi()
    kube.add_pod(pod_for(record, "Running"))
    result = await reconciler(ledger, kube).run_once()
    assert result.restored == 1
    assert await usage(ledger) == [(1000, 10, 1)]


async def test_pods_that_ended_or_went_are_released(ledger: Ledger) -> None:
    await ledger.register_node(make_inventory(NODE, gpus=1), rebuilt=True)
    records = {
        uid: placement(uid, NODE, [[(0, 100, 1)]]) for uid in ("done", "failed", "gone", "alive")
    }
    for record in records.values():
        await ledger.reserve(record)
    kube = LocalKubeApi()
    kube.add_pod(pod_for(records["done"], "Succeeded"))
    kube.add_pod(pod_for(records["failed"], "Failed"))
    kube.add_pod(pod_for(records["alive"], "Running"))
    # "gone" has no pod, but its reservation is younger than the grace: the
    # scheduler may have made it after the list was read
    first = await reconciler(ledger, kube, grace=3600).run_once()
    assert first.released == 2
    second = await reconciler(ledger, kube, grace=0).run_once()
    assert second.released == 1
    found = {uid: await ledger.placement(uid) for uid in records}
    reasons = {uid: (p.state, p.release_reason) for uid, p in found.items() if p is not None}
    assert reasons == {
        "done": (PlacementState.RELEASED, "pod succeeded"),
        "failed": (PlacementState.RELEASED, "pod failed"),
        "gone": (PlacementState.RELEASED, "pod deleted"),
        "alive": (PlacementState.RESERVED, ""),
    }
    assert await usage(ledger) == [(100, 1, 1)]


class EndsWhileListed(LocalKubeApi):
    """The pod ends (and the watch releases it) while the list is being read: the
    list still shows it running."""

    def __init__(self, ledger: Ledger, uid: str) -> None:
        super().__init__()
        self.ledger = ledger
        self.uid = uid

    async def list_all_pods(self) -> list[dict[str, Any]]:
        listed = await super().list_all_pods()
        await self.ledger.release(self.uid, "pod deleted")
        return listed


async def test_a_pod_that_ends_during_the_list_is_not_brought_back(ledger: Ledger) -> None:
    await ledger.register_node(make_inventory(NODE, gpus=1), rebuilt=True)
    record = placement("p1", NODE, [[(0, 100, 1)]])
    await ledger.reserve(record)
    kube = EndsWhileListed(ledger, "p1")
    kube.add_pod(pod_for(record, "Running"))
    result = await reconciler(ledger, kube, grace=0).run_once()
    assert (result.restored, result.released) == (0, 0)
    found = await ledger.placement("p1")
    assert found is not None
    assert found.state is PlacementState.RELEASED
    assert await usage(ledger) == [(0, 0, 0)]


async def test_nodes_are_judged_only_after_sweeping_for_a_whole_silence(ledger: Ledger) -> None:
    """Heartbeats sent while Redis (or every inventory) was away are lost: a node
    is not marked before it had three intervals to send a new one."""
    await ledger.register_node(make_inventory(NODE, gpus=1))
    upkeep = Upkeep(ledger, timedelta(milliseconds=100), timedelta(minutes=5))
    await asyncio.sleep(0.5)  # the heartbeat is older than the silence (0.3 s) ...
    await upkeep.sweep()  # ... but this is the first sweep
    assert upkeep.stats.nodes_marked == 0
    await asyncio.sleep(0.35)
    await upkeep.sweep()
    assert upkeep.stats.nodes_marked == 1


async def test_a_vendor_pod_bound_in_the_ledger_but_never_to_its_node_is_released(
    ledger: Ledger,
) -> None:
    # another vendor's bound pod never expires in the sweep (its plugin allocates
    # it unseen); one whose Binding never came (the scheduler died between the two)
    # would hold its cards, and keep the pod from any other node, for ever
    await ledger.register_node(make_inventory(NODE, gpus=1), rebuilt=True)
    await ledger.register_node(dcus(NODE, count=1))

    def on_dcu(uid: str) -> Placement:
        grant = DeviceGrant(uuid=f"DCU-{NODE}-0", memory_mib=1000, cores=10)
        main = ContainerAssignment(name="main", devices=(grant,), vendor="hygon")
        return Placement(
            pod=PodRef(uid=uid, namespace="ns", name=uid), node=NODE, containers=(main,)
        )

    kube = LocalKubeApi()
    for uid, node in (("running", NODE), ("pending", None), ("elsewhere", "gpu-2")):
        await ledger.reserve(on_dcu(uid))
        await ledger.mark_bound(uid)
        kube.add_pod(pod_for(on_dcu(uid), "Pending" if node is None else "Running", node))
    upkeep = Upkeep(ledger, timedelta(seconds=10), timedelta(minutes=5))
    young = await Reconciler(ledger, kube, upkeep, grace=timedelta(0)).run_once()
    assert young.released == 0  # within the reservation TTL: the Binding may be coming
    upkeep = Upkeep(ledger, timedelta(seconds=10), timedelta(0))
    old = await Reconciler(ledger, kube, upkeep, grace=timedelta(0)).run_once()
    assert old.released_by == {"expired": 2}
    found = {uid: await ledger.placement(uid) for uid in ("running", "pending", "elsewhere")}
    assert {uid: p.state for uid, p in found.items() if p is not None} == {
        "running": PlacementState.BOUND,
        "pending": PlacementState.RELEASED,
        "elsewhere": PlacementState.RELEASED,
    }
    [dcu] = await ledger.node_gpus(NODE, vendor="hygon")
    assert dcu.used.memory_mib == 1000


class _StampLost(Ledger):
    """The ledger, with the next stamp's answer lost (a Redis restarting)."""

    lose = 1

    async def mark_rebuilt(self, node: str, registered: str = "", epoch: str = "") -> bool:
        if self.lose:
            self.lose -= 1
            raise LedgerError("connection lost")
        return await super().mark_rebuilt(node, registered, epoch)


async def test_a_stamp_the_ledger_did_not_answer_counts_as_failed(
    redis_url: str, prefix: str
) -> None:
    """The inventory runs a failed pass again soon: a node whose stamp was lost must
    not wait for the next periodic pass (hours) to take pods."""
    ledger = _StampLost.from_url(redis_url, prefix)
    try:
        await ledger.register_node(make_inventory(NODE, gpus=1))
        first = await reconciler(ledger, LocalKubeApi()).run_once()
        assert (first.stamped, first.waiting, first.failed) == (0, 1, 1)
        assert (await ledger.rebuild_status())[NODE].rebuilt_at is None
        again = await reconciler(ledger, LocalKubeApi()).run_once()
        assert (again.stamped, again.waiting, again.failed) == (1, 0, 0)
    finally:
        await ledger.close()


async def test_a_pending_pod_kubelet_admitted_is_restored_allocated(
    ledger: Ledger, redis_url: str
) -> None:
    """A pod still pulling its image or running init containers is Pending, yet
    kubelet allocated its containers: restored as bound it would hold its
    node's turn (no other GPU pod binds there) until it expired."""
    await ledger.register_node(make_inventory(NODE, gpus=2), rebuilt=True)
    pulling = placement("pulling", NODE, [[(0, 1000, 5)]])
    initialising = placement("initialising", NODE, [[(1, 1000, 5)]])
    for record in (pulling, initialising):
        await ledger.reserve(record)
    kube = LocalKubeApi()
    started = pod_for(pulling, "Pending")
    started["status"]["startTime"] = "2026-11-28T10:00:00Z"
    kube.add_pod(started)
    init = pod_for(initialising, "Pending")
    init["status"]["initContainerStatuses"] = [{"name": "fetch", "state": {"running": {}}}]
    kube.add_pod(init)
    client: Redis = Redis.from_url(redis_url)
    await client.flushall()
    await client.aclose()
    await ledger.register_node(make_inventory(NODE, gpus=2))
    result = await reconciler(ledger, kube).run_once()
    assert result.restored == 2
    for uid in ("pulling", "initialising"):
        restored = await ledger.placement(uid)
        assert restored is not None
        assert restored.state is PlacementState.ALLOCATED, uid
    await ledger.reserve(placement("next", NODE, [[(0, 500, 5)]]))
    assert (await ledger.mark_bound("next", exclusive=True)).state is PlacementState.BOUND
