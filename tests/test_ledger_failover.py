"""The ledger through Redis Sentinel: a failover is ridden without losing an
operation or applying one twice; a primary cut off from its replicas takes no
write (``min-replicas-to-write``); and a failover that lost acknowledged writes
(replication is asynchronous: within the replicas' lag it still can) is caught
by the epoch: no node takes a reservation or an allocation until a
reconciliation pass has restored its placements and stamped it again.

The groups that lose writes run without ``min-replicas-to-write`` (``lossy``):
that is the only way to lose a write on demand, rather than within a lag."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from gpuslice_common.config import CommonSettings
from gpuslice_common.kube import LocalKubeApi
from gpuslice_common.ledger import Ledger, LedgerError, LedgerRebuilding, ReservationConflict
from gpuslice_common.models import (
    ContainerAssignment,
    DeviceGrant,
    Placement,
    PlacementState,
    PodRef,
)
from gpuslice_common.servers import RedisMember, RedisSentinelGroup
from gpuslice_inventory.reconcile import Reconciler
from gpuslice_inventory.upkeep import Upkeep
from tests.conftest import make_inventory

NODE = "node-a"


@pytest.fixture(params=[pytest.param(1, id="safe")])
def group(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[RedisSentinelGroup]:
    with RedisSentinelGroup(tmp_path / "redis", min_replicas=request.param) as servers:
        yield servers


lossy = pytest.mark.parametrize("group", [pytest.param(0, id="lossy")], indirect=True)


@pytest.fixture
async def ledger(group: RedisSentinelGroup) -> AsyncIterator[Ledger]:
    settings = CommonSettings(redis_url=group.url, redis_sentinels=group.sentinels)
    led = Ledger.from_settings(settings)
    await led.register_node(make_inventory(NODE, gpus=1, memory_mib=16384), rebuilt=True)
    yield led
    await led.close()


def placement(uid: str, mib: int) -> Placement:
    grant = DeviceGrant(uuid=f"GPU-{NODE}-0", memory_mib=mib, cores=10)
    return Placement(
        pod=PodRef(uid=uid, namespace="team", name=uid),
        node=NODE,
        containers=(ContainerAssignment(name="main", devices=(grant,)),),
    )


async def used_mib(ledger: Ledger) -> int:
    [card] = await ledger.node_gpus(NODE)
    return card.used.memory_mib


def cut_replicas(group: RedisSentinelGroup) -> list[RedisMember]:
    """The replicas hang and lose their links: the primary's writes from now on
    reach none of them."""
    primary = group.primary()
    assert primary is not None
    replicas = [s for s in group.servers if s is not primary]
    for replica in replicas:
        replica.freeze()
    with primary.client() as client:
        client.execute_command("CLIENT", "KILL", "TYPE", "replica")
    return replicas


def fail_over(group: RedisSentinelGroup, replicas: list[RedisMember]) -> None:
    """Kill the primary, let the cut-off replicas go on, wait for a promotion."""
    old = group.kill_primary()
    for replica in replicas:
        replica.freeze(False)
    group.wait_promoted(old)


def pod_of(record: Placement, phase: str) -> dict[str, Any]:
    """The pod as the API server has it: bound, annotated with its placement."""
    return {
        "metadata": {
            "uid": record.pod.uid,
            "namespace": record.pod.namespace,
            "name": record.pod.name,
            "annotations": {"gpuslice.io/placement": record.to_annotation()},
        },
        "spec": {"nodeName": record.node},
        "status": {"phase": phase},
    }


def reconciler(ledger: Ledger, kube: LocalKubeApi) -> Reconciler:
    return Reconciler(ledger, kube, Upkeep(ledger, timedelta(seconds=5), timedelta(minutes=5)))


async def replicated(group: RedisSentinelGroup) -> None:
    """Every replica has what the primary acknowledged so far."""
    primary = group.primary()
    assert primary is not None
    with primary.client() as client:
        assert client.execute_command("WAIT", len(group.servers) - 1, 5000) == 2


async def test_operations_retried_across_a_failover_are_applied_once(
    group: RedisSentinelGroup, ledger: Ledger
) -> None:
    await ledger.reserve(placement("p1", 2000))
    await ledger.mark_bound("p1")
    first = await ledger.allocate(NODE, 1, request_id="kubelet-1")
    await replicated(group)
    old = group.kill_primary()
    new = group.wait_promoted(old)
    assert new is not old

    # the same calls again, as a client whose replies were cut off sends them:
    # nothing counted twice, the same container handed out
    again = await ledger.reserve(placement("p1", 2000))
    assert again.state is PlacementState.ALLOCATED
    assert (await ledger.allocate(NODE, 1, request_id="kubelet-1")) == first
    assert await used_mib(ledger) == 2000

    # a failover is a new epoch: no new reservation before a new stamp
    with pytest.raises(LedgerRebuilding):
        await ledger.reserve(placement("p2", 3000))
    assert (await ledger.rebuild_status())[NODE].rebuilt_at is None
    assert await ledger.mark_rebuilt(NODE)
    await ledger.reserve(placement("p2", 3000))
    assert await used_mib(ledger) == 5000
    assert await ledger.check_node(NODE) == []

    # the old primary comes back as a replica; the ledger stays on the new one
    group.rejoin(old)
    await ledger.release("p1")
    assert await used_mib(ledger) == 3000


async def test_a_primary_cut_off_from_its_replicas_acknowledges_no_write(
    group: RedisSentinelGroup, ledger: Ledger
) -> None:
    await ledger.reserve(placement("kept", 1000))
    await replicated(group)
    replicas = cut_replicas(group)
    # refused (NOREPLICAS) and tried again, on whichever primary the sentinels name
    cut_off = asyncio.create_task(ledger.reserve(placement("cut-off", 8000)))
    await asyncio.sleep(0.5)
    assert not cut_off.done()
    await asyncio.to_thread(fail_over, group, replicas)
    # it lands on the promoted replica, in a new epoch: refused there too
    with pytest.raises(LedgerRebuilding):
        await cut_off
    assert await ledger.placement("cut-off") is None
    assert await used_mib(ledger) == 1000


@lossy
async def test_writes_lost_in_a_failover_wait_for_reconciliation(
    group: RedisSentinelGroup, ledger: Ledger
) -> None:
    await ledger.reserve(placement("kept", 1000))
    await replicated(group)
    replicas = cut_replicas(group)
    lost = await ledger.reserve(placement("lost", 8000))  # acknowledged
    assert await used_mib(ledger) == 9000
    fail_over(group, replicas)

    # the promoted replica never saw "lost": its 8000 MiB look free, but the
    # node is in a new epoch and takes nothing until reconciliation ran
    assert await ledger.placement("lost") is None
    assert await used_mib(ledger) == 1000
    with pytest.raises(LedgerRebuilding):
        await ledger.reserve(placement("late", 10000))
    with pytest.raises(LedgerRebuilding):
        await ledger.allocate(NODE, 1, request_id="kubelet-2")
    status = (await ledger.rebuild_status())[NODE]
    assert status.rebuilt_at is None

    # reconciliation restores what the pod's annotation records, then stamps
    restored, _ = await ledger.restore(lost, running=False)
    assert restored.state is PlacementState.BOUND
    assert await ledger.mark_rebuilt(NODE, status.registered)
    assert await used_mib(ledger) == 9000
    # now the card's real free memory decides: 10000 MiB no longer fits
    with pytest.raises(ReservationConflict, match="InsufficientMemory"):
        await ledger.reserve(placement("late", 10000))
    await ledger.reserve(placement("late", 7000))
    assert await used_mib(ledger) == 16000
    assert await ledger.check_node(NODE) == []


@lossy
async def test_a_pass_cut_by_a_failover_does_not_stamp(
    group: RedisSentinelGroup, ledger: Ledger
) -> None:
    # the node waits for a pass; the pass restores a running pod's placement on
    # one primary, which dies before a replica has it: the pass must not stamp
    # the node on the promoted replica, where the restore is missing
    registered = (await ledger.rebuild_status())[NODE].registered
    await ledger.register_node(make_inventory(NODE, gpus=1, memory_mib=16384))
    primary = group.primary()
    assert primary is not None
    with primary.client() as raw:
        raw.hdel(ledger.node_keys(NODE).meta, "rebuilt")  # not stamped: a new node
    await replicated(group)
    running = placement("running", 12000)
    kube = LocalKubeApi()
    kube.add_pod(pod_of(running, "Running"))
    restore = ledger.restore

    async def restore_then_fail_over(record: Placement, running: bool) -> tuple[Placement, bool]:
        replicas = cut_replicas(group)
        done = await restore(record, running)
        await asyncio.to_thread(fail_over, group, replicas)
        return done

    ledger.restore = restore_then_fail_over  # type: ignore[method-assign]
    result = await reconciler(ledger, kube).run_once()
    ledger.restore = restore  # type: ignore[method-assign]
    assert (result.restored, result.stamped, result.waiting) == (1, 0, 1)
    now = (await ledger.rebuild_status())[NODE]
    assert (now.registered, now.rebuilt_at) == (registered, None)
    with pytest.raises(LedgerRebuilding):
        await ledger.reserve(placement("intruder", 10000))
    # the next pass restores again and stamps: the card counts the running pod
    again = await reconciler(ledger, kube).run_once()
    assert (again.restored, again.stamped) == (1, 1)
    assert await used_mib(ledger) == 12000
    with pytest.raises(ReservationConflict):
        await ledger.reserve(placement("intruder", 10000))


@lossy
async def test_a_lost_release_and_the_reservation_that_reused_its_room(
    group: RedisSentinelGroup, ledger: Ledger
) -> None:
    # x ends and is released; y takes its room and runs; the failover loses
    # both writes, so the promoted replica holds x and not y. The pass must free
    # x before it restores y, or y does not fit and goes uncounted
    x, y = placement("x", 12000), placement("y", 12000)
    await ledger.reserve(x)
    await ledger.mark_bound("x")
    await ledger.allocate(NODE, 1, request_id="kubelet-x")
    await replicated(group)
    replicas = cut_replicas(group)
    await ledger.release("x", "pod succeeded")
    await ledger.reserve(y)
    await ledger.mark_bound("y")
    await ledger.allocate(NODE, 1, request_id="kubelet-y")
    fail_over(group, replicas)
    assert await ledger.placement("y") is None
    kube = LocalKubeApi()
    kube.add_pod(pod_of(x, "Succeeded"))
    kube.add_pod(pod_of(y, "Running"))
    result = await reconciler(ledger, kube).run_once()
    assert (result.released, result.restored, result.conflicts, result.stamped) == (1, 1, 0, 1)
    assert await used_mib(ledger) == 12000
    with pytest.raises(ReservationConflict):
        await ledger.reserve(placement("z", 12000))
    assert await ledger.check_node(NODE) == []


async def test_a_primary_that_hung_and_was_replaced_never_promises_a_card_twice(
    group: RedisSentinelGroup, ledger: Ledger
) -> None:
    # split brain: the primary hangs (a paused VM), a replica is promoted and
    # stamped in the new epoch; the old one comes back still calling itself
    # primary, and this client's pooled connections still reach it. Whatever
    # it answers there, what this client is told was reserved is what the new
    # primary holds, and a card is never promised twice
    await ledger.ping()
    old = group.primary()
    assert old is not None
    await replicated(group)
    old.freeze()
    new = await asyncio.to_thread(group.wait_promoted, old)
    other = Ledger.from_settings(
        CommonSettings(redis_url=group.url, redis_sentinels=group.sentinels)
    )
    try:
        assert await other.mark_rebuilt(NODE)  # the inventory's pass, on the new primary
        old.freeze(False)
        try:
            first = await ledger.reserve(placement("first", 12000))
        except LedgerError:
            first = None  # refused: as good, nothing was promised

        def demoted() -> None:
            deadline = time.monotonic() + 60
            while old.replication().get("role") != "slave":
                assert time.monotonic() < deadline, "the sentinels never demoted the old primary"
                time.sleep(0.2)

        await asyncio.to_thread(demoted)
        held = await other.placement("first")
        assert (held is None) == (first is None)
        if first is not None:
            with pytest.raises(ReservationConflict):
                await other.reserve(placement("second", 12000))
        assert new.replication().get("role") == "master"
    finally:
        await other.close()
