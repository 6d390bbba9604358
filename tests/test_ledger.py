"""Ledger behaviour against a real redis-server."""

from __future__ import annotations

import asyncio
import json
import random
import re
from collections.abc import Awaitable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ResponseError

from gpuslice_common.ledger import (
    AlreadyReserved,
    AmbiguousAllocation,
    BadRecord,
    Ledger,
    LedgerError,
    LedgerRebuilding,
    LedgerUnavailable,
    NodeBusy,
    NotReserved,
    Release,
    ReservationConflict,
)
from gpuslice_common.models import (
    ContainerAssignment,
    DeviceGrant,
    FitReason,
    GpuDevice,
    NodeInventory,
    Placement,
    PlacementState,
    PodRef,
)
from gpuslice_common.servers import RedisServer, free_port
from tests.conftest import make_inventory


def placement(
    uid: str,
    node: str,
    grants: list[list[tuple[int, int, int]]],
    init: list[list[tuple[int, int, int]]] | None = None,
) -> Placement:
    """grants[c] = [(gpu index, memory MiB, cores), ...] for app container c."""

    def container(
        name: str, devs: list[tuple[int, int, int]], is_init: bool
    ) -> ContainerAssignment:
        return ContainerAssignment(
            name=name,
            init=is_init,
            devices=tuple(
                DeviceGrant(uuid=f"GPU-{node}-{i}", memory_mib=m, cores=c) for i, m, c in devs
            ),
        )

    containers = [container(f"init{i}", g, True) for i, g in enumerate(init or [])]
    containers += [container(f"c{i}", g, False) for i, g in enumerate(grants)]
    return Placement(
        pod=PodRef(uid=uid, namespace="ns", name=uid), node=node, containers=tuple(containers)
    )


async def usage(ledger: Ledger, node: str) -> list[tuple[int, int, int, str | None]]:
    return [
        (g.used.memory_mib, g.used.cores, g.used.slots, g.used.exclusive_owner)
        for g in await ledger.node_gpus(node)
    ]


async def test_register_reports_capacity_after_scaling(ledger: Ledger) -> None:
    inv = make_inventory("node-a", gpus=2, memory_mib=10000, memory_scaling=1.5, core_scaling=2.0)
    assert await ledger.register_node(inv, rebuilt=True) == 2
    gpus = await ledger.node_gpus("node-a")
    assert [g.device.uuid for g in gpus] == ["GPU-node-a-0", "GPU-node-a-1"]
    assert gpus[0].capacity.memory_mib == 15000
    assert gpus[0].capacity.cores == 200
    assert gpus[0].capacity.slots == 10
    assert gpus[1].device.numa == 1
    assert await ledger.nodes() == ["node-a"]


async def test_reserve_bind_allocate_release_moves_through_states(ledger: Ledger) -> None:
    await ledger.register_node(make_inventory("node-a"), rebuilt=True)
    p = await ledger.reserve(
        placement("pod-1", "node-a", [[(0, 4000, 30)], [(1, 2000, 0), (0, 1000, 10)]])
    )
    assert p.state is PlacementState.RESERVED
    assert p.reserved_at is not None
    assert await usage(ledger, "node-a") == [(5000, 40, 2, None), (2000, 0, 1, None)]

    bound = await ledger.mark_bound("pod-1")
    assert bound.state is PlacementState.BOUND
    first = await ledger.allocate("node-a", 1)
    assert first.container_index == 0
    assert [d.uuid for d in first.devices] == ["GPU-node-a-0"]
    with pytest.raises(NotReserved, match="1 GPU"):
        await ledger.allocate("node-a", 1)
    second = await ledger.allocate("node-a", 2)
    assert second.container_index == 1
    assert second.placement.state is PlacementState.ALLOCATED

    released = await ledger.release("pod-1", reason="pod deleted")
    assert released is not None
    assert released.first
    assert released.placement.state is PlacementState.RELEASED
    assert released.placement.release_reason == "pod deleted"
    assert await usage(ledger, "node-a") == [(0, 0, 0, None), (0, 0, 0, None)]
    again = await ledger.release("pod-1")
    assert again is not None
    assert not again.first
    assert await ledger.release("never-seen") is None
    assert await ledger.check_node("node-a") == []


async def test_reserve_is_idempotent_by_pod_uid(ledger: Ledger) -> None:
    await ledger.register_node(make_inventory("node-a"), rebuilt=True)
    p = placement("pod-1", "node-a", [[(0, 4000, 30)]])
    first = await ledger.reserve(p)
    second = await ledger.reserve(p)
    assert first.reserved_at == second.reserved_at
    assert await usage(ledger, "node-a") == [(4000, 30, 1, None), (0, 0, 0, None)]


async def test_pod_reserved_on_one_node_cannot_reserve_another(ledger: Ledger) -> None:
    await ledger.register_node(make_inventory("node-a"), rebuilt=True)
    await ledger.register_node(make_inventory("node-b"), rebuilt=True)
    await ledger.reserve(placement("pod-1", "node-a", [[(0, 4000, 30)]]))
    with pytest.raises(AlreadyReserved) as err:
        await ledger.reserve(placement("pod-1", "node-b", [[(0, 4000, 30)]]))
    assert err.value.node == "node-a"
    assert await usage(ledger, "node-b") == [(0, 0, 0, None), (0, 0, 0, None)]
    still = await ledger.placement("pod-1")  # the refused retry left the index alone
    assert still is not None
    assert still.node == "node-a"
    released = await ledger.release("pod-1")
    assert released is not None
    assert released.placement.node == "node-a"
    await ledger.reserve(placement("pod-1", "node-a", [[(0, 4000, 30)]]))
    # once released, the same pod (a retried schedule) may go elsewhere
    await ledger.release("pod-1")
    moved = await ledger.reserve(placement("pod-1", "node-b", [[(1, 100, 0)]]))
    assert moved.node == "node-b"
    assert (await ledger.placement("pod-1")) == moved


@pytest.mark.parametrize(
    ("existing", "request_", "reason"),
    [
        ([(0, 10000, 10)], [(0, 7000, 10)], FitReason.CARD_INSUFFICIENT_MEMORY),
        ([(0, 1000, 80)], [(0, 1000, 30)], FitReason.CARD_INSUFFICIENT_CORE),
        ([(0, 1000, 100)], [(0, 1000, 0)], FitReason.EXCLUSIVE_DEVICE_ALLOCATE_CONFLICT),
        ([(0, 1000, 0)], [(0, 1000, 100)], FitReason.EXCLUSIVE_DEVICE_ALLOCATE_CONFLICT),
        ([(0, 1000, 10)], [(0, 1000, 100)], FitReason.CARD_INSUFFICIENT_CORE),
        ([(0, 1000, 60), (0, 1000, 40)], [(0, 1000, 0)], FitReason.CARD_COMPUTE_UNITS_EXHAUSTED),
    ],
)
async def test_reserve_refuses_what_does_not_fit_and_changes_nothing(
    ledger: Ledger,
    existing: list[tuple[int, int, int]],
    request_: list[tuple[int, int, int]],
    reason: FitReason,
) -> None:
    await ledger.register_node(make_inventory("node-a"), rebuilt=True)
    await ledger.reserve(placement("holder", "node-a", [[g] for g in existing]))
    before = await usage(ledger, "node-a")
    new = placement("pod-2", "node-a", [[g] for g in request_])
    with pytest.raises(ReservationConflict) as err:
        await ledger.reserve(new)
    assert err.value.reason == reason
    assert await usage(ledger, "node-a") == before
    assert await ledger.placement("pod-2") is None
    assert await ledger.check_node("node-a") == []


async def test_split_slots_and_health_and_unknown_cards(ledger: Ledger) -> None:
    await ledger.register_node(make_inventory("node-a", split_count=2), rebuilt=True)
    await ledger.reserve(placement("p1", "node-a", [[(0, 10, 1)]]))
    await ledger.reserve(placement("p2", "node-a", [[(0, 10, 1)]]))
    with pytest.raises(ReservationConflict) as err:
        await ledger.reserve(placement("p3", "node-a", [[(0, 10, 1)]]))
    assert err.value.reason == FitReason.CARD_TIME_SLICING_EXHAUSTED

    unhealthy = make_inventory("node-a", split_count=2)
    devices = (unhealthy.devices[0], unhealthy.devices[1].model_copy(update={"healthy": False}))
    await ledger.register_node(unhealthy.model_copy(update={"devices": devices}), rebuilt=True)
    with pytest.raises(ReservationConflict) as err:
        await ledger.reserve(placement("p4", "node-a", [[(1, 10, 1)]]))
    assert err.value.reason == FitReason.CARD_NOT_HEALTH

    with pytest.raises(ReservationConflict) as err:
        await ledger.reserve(placement("p5", "node-a", [[(7, 10, 1)]]))
    assert err.value.reason == FitReason.CARD_NOT_FOUND


async def test_init_containers_count_at_the_pods_peak(ledger: Ledger) -> None:
    await ledger.register_node(make_inventory("node-a"), rebuilt=True)
    p = placement(
        "pod-1",
        "node-a",
        grants=[[(0, 3000, 20)], [(0, 2000, 10)]],
        init=[[(0, 8000, 5)], [(0, 1000, 50), (1, 500, 5)]],
    )
    await ledger.reserve(p)
    # card 0: max(apps 5000/30/2, inits 8000/50/1); card 1: init only
    assert await usage(ledger, "node-a") == [(8000, 50, 2, None), (500, 5, 1, None)]
    await ledger.mark_bound("pod-1")
    order = [(await ledger.allocate("node-a", n)).container_index for n in (1, 2, 1, 1)]
    assert order == [0, 1, 2, 3]


async def test_allocate_serves_the_bound_pod_and_is_idempotent_per_request(
    ledger: Ledger,
) -> None:
    await ledger.register_node(make_inventory("node-a"), rebuilt=True)
    for uid in ("first", "second"):
        await ledger.reserve(placement(uid, "node-a", [[(0, 100, 1)]]))
    await ledger.reserve(placement("unbound", "node-a", [[(1, 100, 1)]]))
    await ledger.mark_bound("first", exclusive=True)
    a = await ledger.allocate("node-a", 1, request_id="req-1")
    retry = await ledger.allocate("node-a", 1, request_id="req-1")
    assert a.placement.pod.uid == retry.placement.pod.uid == "first"
    await ledger.mark_bound("second", exclusive=True)
    b = await ledger.allocate("node-a", 1, request_id="req-2")
    assert b.placement.pod.uid == "second"
    with pytest.raises(NotReserved, match="0 pod"):
        await ledger.allocate("node-a", 1)  # 'unbound' is reserved but not bound


async def test_an_exclusive_bind_waits_while_another_pod_awaits_allocate(
    ledger: Ledger,
) -> None:
    await ledger.register_node(make_inventory("node-a"), rebuilt=True)
    await ledger.register_node(make_inventory("node-b"), rebuilt=True)
    await ledger.reserve(placement("a", "node-a", [[(0, 100, 1)], [(1, 100, 1)]]))
    await ledger.reserve(placement("b", "node-a", [[(0, 100, 1)]]))
    await ledger.reserve(placement("elsewhere", "node-b", [[(0, 100, 1)]]))
    await ledger.mark_bound("a", exclusive=True)
    with pytest.raises(NodeBusy, match="node node-a is taking pod a") as busy:
        await ledger.mark_bound("b", exclusive=True)
    assert busy.value.pending == "a"
    assert (await ledger.placement("b")).state == PlacementState.RESERVED  # type: ignore[union-attr]
    await ledger.mark_bound("elsewhere", exclusive=True)  # another node binds meanwhile
    await ledger.allocate("node-a", 1)  # a's first container: a still waits for its second
    with pytest.raises(NodeBusy):
        await ledger.mark_bound("b", exclusive=True)
    await ledger.allocate("node-a", 1)
    bound = await ledger.mark_bound("b", exclusive=True)
    assert bound.state == PlacementState.BOUND


async def test_the_turn_passes_at_once_when_the_waiting_pod_had_no_binding(
    ledger: Ledger,
) -> None:
    await ledger.register_node(make_inventory("node-a"), rebuilt=True)
    await ledger.reserve(placement("a", "node-a", [[(0, 100, 1)]]))
    await ledger.reserve(placement("b", "node-a", [[(1, 100, 1)]]))
    await ledger.mark_bound("a", exclusive=True)
    with pytest.raises(NodeBusy):
        await ledger.mark_bound("b", exclusive=True)
    await ledger.release("a", "bind failed", kubelet_may_admit=False)
    assert (await ledger.mark_bound("b", exclusive=True)).state == PlacementState.BOUND


async def age_release(ledger: Ledger, node: str, uid: str, ms: int) -> None:
    """Move a released record's release time ``ms`` into the past."""
    key = ledger.node_keys(node).pods
    record = json.loads(await ledger.redis.hget(key, uid))
    record["times"]["released"] -= ms
    await ledger.redis.hset(key, uid, json.dumps(record))


async def test_a_pod_deleted_before_kubelet_admitted_it_keeps_the_turn_a_while(
    ledger: Ledger,
) -> None:
    """Kubelet, lagging its watch, may still admit a pod just deleted: its ghost
    holds the node's turn for 30 s, and an Allocate it could be meant by is
    refused rather than given to the pod bound after it."""
    await ledger.register_node(make_inventory("node-a"), rebuilt=True)
    await ledger.reserve(placement("a", "node-a", [[(0, 100, 1)]]))
    await ledger.reserve(placement("b", "node-a", [[(1, 100, 1)]]))
    await ledger.mark_bound("a", exclusive=True)
    await ledger.release("a", "deleted")
    with pytest.raises(NodeBusy, match="taking pod a"):
        await ledger.mark_bound("b", exclusive=True)
    await ledger.mark_bound("b")  # as a bind that skipped the turn would
    assert await ledger.next_allocation("node-a", 1) is None
    with pytest.raises(AmbiguousAllocation, match="pods b, a"):
        await ledger.allocate("node-a", 1)
    await age_release(ledger, "node-a", "a", 31_000)
    assert (await ledger.allocate("node-a", 1)).placement.pod.uid == "b"


async def test_a_ghost_alone_is_never_handed_out_and_lapses(ledger: Ledger) -> None:
    await ledger.register_node(make_inventory("node-a"), rebuilt=True)
    await ledger.reserve(placement("a", "node-a", [[(0, 100, 1)]]))
    await ledger.mark_bound("a", exclusive=True)
    await ledger.release("a", "deleted")
    with pytest.raises(NotReserved):
        await ledger.allocate("node-a", 1)  # kubelet admitting the deleted pod: nothing
    await age_release(ledger, "node-a", "a", 31_000)
    await ledger.reserve(placement("b", "node-a", [[(1, 100, 1)]]))
    assert (await ledger.mark_bound("b", exclusive=True)).state == PlacementState.BOUND
    assert (await ledger.allocate("node-a", 1)).placement.pod.uid == "b"
    assert await ledger.redis.zcard(ledger.node_keys("node-a").pending) == 0  # both gone


async def test_an_exclusive_bind_ignores_pods_another_vendor_allocates(ledger: Ledger) -> None:
    """A pod whose only containers left are another vendor's is never allocated
    here: it cannot make an Allocate of ours ambiguous, so it holds no turn."""
    await ledger.register_node(make_inventory("node-a"), rebuilt=True)
    await ledger.reserve(placement("a", "node-a", [[(0, 100, 1)], [(1, 100, 1)]]))
    await ledger.mark_bound("a", exclusive=True)
    await ledger.allocate("node-a", 1)
    raw = await ledger.redis.hget(ledger.node_keys("node-a").pods, "a")
    record = json.loads(raw)
    record["containers"][1]["vendor"] = "ascend"  # the second is another vendor's
    await ledger.redis.hset(ledger.node_keys("node-a").pods, "a", json.dumps(record))
    await ledger.reserve(placement("b", "node-a", [[(0, 100, 1)]]))
    assert (await ledger.mark_bound("b", exclusive=True)).state == PlacementState.BOUND


async def test_next_allocation_looks_without_handing_out(ledger: Ledger) -> None:
    await ledger.register_node(make_inventory("node-a"), rebuilt=True)
    await ledger.reserve(placement("two", "node-a", [[(0, 100, 1), (1, 100, 1)]]))
    await ledger.reserve(placement("one", "node-a", [[(0, 100, 1)]]))
    assert await ledger.next_allocation("node-a", 1) is None  # nothing bound yet
    await ledger.mark_bound("two")
    await ledger.mark_bound("one")
    seen = await ledger.next_allocation("node-a", 1)
    assert seen is not None
    assert (seen.placement.pod.uid, seen.container_index) == ("one", 0)
    again = await ledger.next_allocation("node-a", 1)
    assert again is not None
    assert again.placement.pod.uid == "one"  # looking changed nothing
    pair = await ledger.next_allocation("node-a", 2)
    assert pair is not None
    assert [d.uuid for d in pair.devices] == ["GPU-node-a-0", "GPU-node-a-1"]
    taken = await ledger.allocate("node-a", 1)
    assert taken.placement.pod.uid == "one"
    assert await ledger.next_allocation("node-a", 1) is None
    assert (await ledger.placement("two")).state == PlacementState.BOUND  # type: ignore[union-attr]


async def test_allocate_refuses_when_it_could_mean_several_pods(ledger: Ledger) -> None:
    """Two pods bound together (a ledger restored after Redis lost data, a bind
    that skipped the turn): an Allocate of a count both wait for is refused,
    naming them, and hands out nothing; a count only one waits for is served."""
    await ledger.register_node(make_inventory("node-a"), rebuilt=True)
    await ledger.reserve(placement("a", "node-a", [[(0, 100, 1)]]))
    await ledger.reserve(placement("b", "node-a", [[(1, 100, 1)]]))
    await ledger.reserve(placement("pair", "node-a", [[(0, 100, 1), (1, 100, 1)]]))
    for uid in ("a", "b", "pair"):
        await ledger.mark_bound(uid)
    assert await ledger.next_allocation("node-a", 1) is None  # no preference either
    with pytest.raises(AmbiguousAllocation, match="any of pods a, b") as refused:
        await ledger.allocate("node-a", 1, request_id="r1")
    assert refused.value.pods == ("a", "b")
    assert {(await ledger.placement(u)).state for u in ("a", "b")} == {PlacementState.BOUND}  # type: ignore[union-attr]
    pair = await ledger.allocate("node-a", 2)
    assert pair.placement.pod.uid == "pair"
    await ledger.release("b", "deleted")
    await age_release(ledger, "node-a", "b", 31_000)  # its ghost lapsed (below)
    assert (await ledger.allocate("node-a", 1, request_id="r2")).placement.pod.uid == "a"


async def test_bind_requires_a_live_reservation(ledger: Ledger) -> None:
    with pytest.raises(NotReserved):
        await ledger.mark_bound("ghost")
    await ledger.register_node(make_inventory("node-a"), rebuilt=True)
    await ledger.reserve(placement("p", "node-a", [[(0, 1, 1)]]))
    await ledger.release("p")
    with pytest.raises(NotReserved):
        await ledger.mark_bound("p")


async def test_card_removed_while_in_use_stays_until_released(ledger: Ledger) -> None:
    await ledger.register_node(make_inventory("node-a"), rebuilt=True)
    await ledger.reserve(placement("p", "node-a", [[(1, 100, 10)]]))
    only_first = make_inventory("node-a")
    await ledger.register_node(
        only_first.model_copy(update={"devices": only_first.devices[:1]}), rebuilt=True
    )
    gpus = await ledger.node_gpus("node-a")
    assert [(g.device.index, g.present) for g in gpus] == [(0, True), (1, False)]
    await ledger.release("p")
    await ledger.register_node(
        only_first.model_copy(update={"devices": only_first.devices[:1]}), rebuilt=True
    )
    assert [g.device.index for g in await ledger.node_gpus("node-a")] == [0]


async def test_keys_of_a_node_share_one_hash_tag(ledger: Ledger) -> None:
    await ledger.register_node(make_inventory("gpu-1.example.com"), rebuilt=True)
    await ledger.reserve(placement("p", "gpu-1.example.com", [[(0, 1, 1)]]))
    keys = [str(k) for k in await ledger.redis.keys("*")]
    node_keys = [k for k in keys if "pod:" not in k and k != "gpuslice:nodes"]
    assert node_keys
    assert {k.split("{", 1)[1].split("}", 1)[0] for k in node_keys} == {"gpu-1_example_com"}


async def test_ledger_survives_a_redis_restart(own_redis: RedisServer) -> None:
    led = Ledger.from_url(own_redis.url)
    try:
        await led.register_node(make_inventory("node-a"), rebuilt=True)
        await led.reserve(placement("p1", "node-a", [[(0, 1000, 10)]]))
        own_redis.kill()
        own_redis.start()
        # the data came back from the AOF, but a restart is a new epoch (the
        # file may miss the last writes): no reservation before a new stamp
        with pytest.raises(LedgerRebuilding):
            await led.reserve(placement("p2", "node-a", [[(0, 1000, 10)]]))
        assert (await led.rebuild_status())["node-a"].rebuilt_at is None
        assert await led.mark_rebuilt("node-a")
        # script cache is empty after the restart: loaded again on first use
        await led.reserve(placement("p2", "node-a", [[(0, 1000, 10)]]))
        assert await usage(led, "node-a") == [(2000, 20, 2, None), (0, 0, 0, None)]
        assert await led.check_node("node-a") == []
    finally:
        await led.close()


def test_inventory_rejects_duplicate_devices() -> None:
    dev = GpuDevice(uuid="GPU-x", index=0, model="T4", memory_mib=15360)
    with pytest.raises(ValueError, match="unique"):
        NodeInventory(node="n", devices=(dev, dev))


async def test_one_pod_raced_onto_two_nodes_ends_on_exactly_one(ledger: Ledger) -> None:
    for node in ("node-a", "node-b"):
        await ledger.register_node(make_inventory(node, split_count=1000), rebuilt=True)
    uids = [f"pod-{i}" for i in range(150)]

    async def attempt(uid: str, node: str) -> str | None:
        try:
            return (await ledger.reserve(placement(uid, node, [[(0, 10, 0)]]))).node
        except AlreadyReserved:
            return None

    results = await asyncio.gather(
        *(attempt(uid, node) for uid in uids for node in ("node-a", "node-b"))
    )
    winners = dict(zip([(u, n) for u in uids for n in ("node-a", "node-b")], results, strict=True))
    for uid in uids:
        held = [n for n in ("node-a", "node-b") if winners[(uid, n)] is not None]
        live = [
            n
            for n in ("node-a", "node-b")
            if any(
                p.pod.uid == uid and p.state != "released" for p in await ledger.node_placements(n)
            )
        ]
        assert live == held
        assert len(live) == 1, f"{uid} is live on {live}"
        p = await ledger.placement(uid)
        assert p is not None
        assert p.node == live[0]
    assert await ledger.check_node("node-a") == []
    assert await ledger.check_node("node-b") == []


async def test_a_crashed_reserve_blocks_other_nodes_only_for_the_lease(redis_url: str) -> None:
    led = Ledger.from_url(redis_url, claim_lease=timedelta(milliseconds=300))
    try:
        await led.register_node(make_inventory("node-a"), rebuilt=True)
        await led.register_node(make_inventory("node-b"), rebuilt=True)
        # a reserve on node-a that died after claiming the index, before its script ran
        await led._index("claim", "pod-1", "node-a", "crashed")
        with pytest.raises(AlreadyReserved) as err:
            await led.reserve(placement("pod-1", "node-b", [[(0, 10, 1)]]))
        assert err.value.node == "node-a"
        await asyncio.sleep(0.35)
        p = await led.reserve(placement("pod-1", "node-b", [[(0, 10, 1)]]))
        assert p.node == "node-b"
        # the same on node-a itself is a retry, and needs no wait
        await led._index("claim", "pod-2", "node-a", "crashed")
        assert (await led.reserve(placement("pod-2", "node-a", [[(1, 10, 1)]]))).node == "node-a"
    finally:
        await led.close()


class PausingLedger(Ledger):
    """A ledger whose next reserve waits, after claiming the index, before its
    script (in three steps: in one script nothing can come between)."""

    def __init__(self, redis: Any, **kwargs: Any) -> None:
        super().__init__(redis, **kwargs)
        self.paused = asyncio.Event()
        self.go_on = asyncio.Event()

    async def _run(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> list[str]:
        if name == "reserve" and not self.go_on.is_set():
            self.paused.set()
            await self.go_on.wait()
        return await super()._run(name, keys, args)


async def test_a_reserve_that_loses_its_claim_gives_its_cards_back(
    ledger: Ledger, redis_url: str
) -> None:
    for node in ("node-a", "node-b"):
        await ledger.register_node(make_inventory(node), rebuilt=True)
    slow = PausingLedger(ledger.redis, claim_lease=timedelta(milliseconds=1), fast_reserve=False)
    fast = Ledger(ledger.redis, claim_lease=timedelta(milliseconds=1))
    stalled = asyncio.create_task(slow.reserve(placement("pod-1", "node-a", [[(0, 4000, 30)]])))
    await slow.paused.wait()  # node-a's reserve holds a claim, past its lease
    await asyncio.sleep(0.01)
    taken = await fast.reserve(placement("pod-1", "node-b", [[(1, 1000, 10)]]))
    assert taken.node == "node-b"
    slow.go_on.set()  # node-a's reserve now runs its script, then fails to confirm
    with pytest.raises(AlreadyReserved) as err:
        await stalled
    assert err.value.node == "node-b"
    assert await usage(ledger, "node-a") == [(0, 0, 0, None), (0, 0, 0, None)]
    assert await ledger.check_node("node-a") == []
    assert await ledger.check_node("node-b") == []
    p = await ledger.placement("pod-1")
    assert p is not None
    assert p.node == "node-b"


async def test_an_unreachable_redis_is_a_clear_ledger_error(redis_url: str) -> None:
    up = Ledger.from_url(redis_url)
    assert await up.ping()
    await up.close()
    down = Ledger.from_url(f"redis://127.0.0.1:{free_port()}/0", retries=1)
    try:
        with pytest.raises(LedgerUnavailable, match="Redis is unreachable"):
            await down.reserve(placement("pod-1", "node-a", [[(0, 10, 1)]]))
        with pytest.raises(LedgerUnavailable):
            await down.node_gpus("node-a")
    finally:
        await down.close()


async def test_a_reserve_slipping_into_a_release_leaves_nothing_unreachable(ledger: Ledger) -> None:
    for node in ("node-a", "node-b"):
        await ledger.register_node(make_inventory(node), rebuilt=True)
    p_a = placement("pod-1", "node-a", [[(0, 4000, 30)]])
    await ledger.reserve(p_a)
    # a release marks the index released, then a scheduler retry reserves on node-a
    # before the release frees the cards
    value = await ledger._get(ledger.pod_index_key("pod-1"))
    assert value is not None
    assert (await ledger._index("release", "pod-1", value, 60)) == ["ok"]
    await ledger.reserve(p_a)
    await ledger._free("node-a", "pod-1", "pod deleted")
    # the pod may now go to node-b, and nothing stays behind on node-a
    moved = await ledger.reserve(placement("pod-1", "node-b", [[(1, 1000, 10)]]))
    assert moved.node == "node-b"
    assert await usage(ledger, "node-a") == [(0, 0, 0, None), (0, 0, 0, None)]
    assert await ledger.check_node("node-a") == []
    assert await ledger.check_node("node-b") == []


async def test_a_release_killed_halfway_is_finished_by_the_next_reserve(ledger: Ledger) -> None:
    for node in ("node-a", "node-b"):
        await ledger.register_node(make_inventory(node), rebuilt=True)
    await ledger.reserve(placement("pod-1", "node-a", [[(0, 4000, 30)]]))
    value = await ledger._get(ledger.pod_index_key("pod-1"))
    assert value is not None
    await ledger._index("release", "pod-1", value, 60)  # then the releasing process died
    assert await ledger.check_node("node-a") != []  # detected: live here, index says released
    moved = await ledger.reserve(placement("pod-1", "node-b", [[(0, 1000, 10)]]))
    assert moved.node == "node-b"
    assert await usage(ledger, "node-a") == [(0, 0, 0, None), (0, 0, 0, None)]
    assert await ledger.check_node("node-a") == []


async def test_two_reserves_on_one_node_share_a_takeover(redis_url: str) -> None:
    led = Ledger.from_url(redis_url, claim_lease=timedelta(milliseconds=1))
    try:
        for node in ("node-a", "node-b"):
            await led.register_node(make_inventory(node), rebuilt=True)
        await led._index("claim", "pod-1", "node-a", "crashed")
        await asyncio.sleep(0.01)
        p = placement("pod-1", "node-b", [[(0, 1000, 10)]])
        results = await asyncio.gather(led.reserve(p), led.reserve(p))
        assert [r.node for r in results] == ["node-b", "node-b"]
        assert await usage(led, "node-b") == [(1000, 10, 1, None), (0, 0, 0, None)]
    finally:
        await led.close()


async def test_a_resent_claim_is_still_ours_and_is_abandoned_on_failure(ledger: Ledger) -> None:
    for node in ("node-a", "node-b"):
        await ledger.register_node(make_inventory(node), rebuilt=True)
    first = await ledger._index("claim", "pod-1", "node-a", "tok")
    again = await ledger._index("claim", "pod-1", "node-a", "tok")  # reply was lost; re-sent
    assert first[1] == again[1]
    assert again[2] == ""  # not "shared": this call owns the claim
    other = await ledger._index("claim", "pod-1", "node-a", "other-call")
    assert other[2] == other[1]  # a different call on the same node shares it
    await ledger._index("abandon", "pod-1", first[1])
    with pytest.raises(ReservationConflict):
        await ledger.reserve(placement("pod-1", "node-a", [[(0, 99999, 10)]]))
    # the failed reserve left no claim behind: node-b is free to take the pod at once
    assert (await ledger.reserve(placement("pod-1", "node-b", [[(0, 10, 1)]]))).node == "node-b"


def test_native_sidecars_count_beside_later_init_containers_and_the_apps() -> None:
    def c(name: str, mem: int, *, init: bool = False, sidecar: bool = False) -> ContainerAssignment:
        grant = DeviceGrant(uuid="GPU-0", memory_mib=mem, cores=0)
        return ContainerAssignment(name=name, init=init, sidecar=sidecar, devices=(grant,))

    def peak(*containers: ContainerAssignment) -> int:
        p = Placement(pod=PodRef(uid="u"), node="n", containers=containers)
        return p.footprint()["GPU-0"].memory_mib

    # sidecar 8 GiB beside an 8 GiB app: 16 GiB, not max(8, 8)
    assert peak(c("proxy", 8192, init=True, sidecar=True), c("app", 8192)) == 16384
    # a plain init container before the sidecar runs alone; after it, beside it
    assert peak(c("setup", 10000, init=True), c("proxy", 1000, init=True, sidecar=True)) == 10000
    assert (
        peak(c("proxy", 1000, init=True, sidecar=True), c("setup", 10000, init=True), c("app", 500))
        == 11000
    )
    # without sidecars: max(sum of apps, largest init container)
    assert (
        peak(c("i1", 3000, init=True), c("i2", 5000, init=True), c("a", 2000), c("b", 2000)) == 5000
    )


async def test_a_cordoned_card_takes_no_new_reservation_and_keeps_its_pods(
    ledger: Ledger,
) -> None:
    await ledger.register_node(make_inventory("n1", gpus=1), rebuilt=True)
    await ledger.reserve(placement("before", "n1", [[(0, 1000, 10)]]))
    revision = (await ledger.revisions(["n1"]))["n1"]
    await ledger.cordon("n1", "GPU-n1-0")
    assert (await ledger.revisions(["n1"]))["n1"] == revision + 1
    [card] = await ledger.node_gpus("n1")
    assert card.cordoned
    assert card.used.slots == 1  # the pod already there stays
    with pytest.raises(ReservationConflict) as refused:
        await ledger.reserve(placement("after", "n1", [[(0, 1000, 10)]]))
    assert refused.value.reason == FitReason.CARD_CORDONED
    await ledger.cordon("n1", "GPU-n1-0", cordoned=False)
    await ledger.reserve(placement("after", "n1", [[(0, 1000, 10)]]))
    assert await ledger.check_node("n1") == []
    with pytest.raises(LedgerError, match="has no card GPU-n1-9"):
        await ledger.cordon("n1", "GPU-n1-9")


# ---------------------------------------------------------------- node liveness


async def test_a_node_is_marked_unavailable_only_when_its_heartbeat_is_old(ledger: Ledger) -> None:
    await ledger.register_node(make_inventory("n1", gpus=2), rebuilt=True)
    await ledger.reserve(placement("p1", "n1", [[(0, 1000, 10)]]))
    revision = (await ledger.revisions(["n1"]))["n1"]
    beat = (await ledger.node_liveness(["n1"]))["n1"].heartbeat
    assert beat is not None
    assert not await ledger.mark_unavailable("n1", beat)  # not older than the cutoff
    assert await ledger.mark_unavailable("n1", beat + timedelta(milliseconds=1))
    assert not await ledger.mark_unavailable("n1", beat + timedelta(hours=1))  # once
    cards = await ledger.node_gpus("n1")
    assert [c.device.healthy for c in cards] == [False, False]
    assert cards[0].used.memory_mib == 1000
    assert (await ledger.revisions(["n1"]))["n1"] > revision  # the scheduler sees it
    liveness = (await ledger.node_liveness(["n1"]))["n1"]
    assert liveness.unavailable_since is not None
    # the next registration brings the node back with its own health
    inventory = make_inventory("n1", gpus=2)
    sick = inventory.devices[1].model_copy(update={"healthy": False})
    await ledger.register_node(
        inventory.model_copy(update={"devices": (inventory.devices[0], sick)}), rebuilt=True
    )
    assert [c.device.healthy for c in await ledger.node_gpus("n1")] == [True, False]
    assert (await ledger.node_liveness(["n1"]))["n1"].unavailable_since is None


async def test_unknown_nodes_have_no_liveness(ledger: Ledger) -> None:
    assert not await ledger.mark_unavailable("ghost", datetime.now(UTC))
    liveness = (await ledger.node_liveness(["ghost"]))["ghost"]
    assert liveness.heartbeat is None
    assert liveness.unavailable_since is None


@pytest.mark.parametrize(
    ("stored", "problem"),
    [
        ("1e+17", "not a whole number"),  # how Lua prints a double from 1e14 up
        ("1.5", "not a whole number"),
        ("-1", "not a whole number"),
        (" 7", "not a whole number"),
        ("\u0661", "not a whole number"),  # a digit, but not an ASCII one
        ("", "not a whole number"),
        ("99999999999999999999", "not a whole number"),
        ("16777217", "above its bound 16777216"),
    ],
)
async def test_numbers_are_read_strictly_and_a_bad_one_spoils_only_its_node(
    ledger: Ledger, stored: str, problem: str
) -> None:
    await ledger.register_node(make_inventory("n1", gpus=1))
    await ledger.register_node(make_inventory("n2", gpus=1))
    await ledger.redis.hset(ledger.node_keys("n1").gpus, "GPU-n1-0|memory", stored)
    read = await ledger.read_gpus(["n1", "n2"])
    bad, good = read["n1"], read["n2"]
    assert isinstance(bad, BadRecord)
    assert bad.node == "n1"
    assert problem in bad.problem
    assert "GPU-n1-0 memory" in bad.problem
    assert isinstance(good, list)
    assert [g.device.uuid for g in good] == ["GPU-n2-0"]
    with pytest.raises(BadRecord):
        await ledger.nodes_gpus(["n1", "n2"])


async def test_unreadable_revisions_and_times_name_their_node(ledger: Ledger) -> None:
    await ledger.register_node(make_inventory("n1", gpus=1))
    await ledger.register_node(make_inventory("n2", gpus=1))
    await ledger.redis.hset(ledger.node_keys("n1").meta, "rev", "1e+17")
    await ledger.redis.hset(ledger.node_keys("n2").meta, "heartbeat", "soon")
    revs = await ledger.revisions(["n1", "n2"])
    assert revs["n1"] is None
    assert isinstance(revs["n2"], int)
    read = await ledger.read_nodes(["n1", "n2"])
    assert isinstance(read["n1"], BadRecord)
    assert "revision is '1e+17'" in read["n1"].problem
    liveness = await ledger.read_liveness(["n1", "n2"])
    assert isinstance(liveness["n2"], BadRecord)
    assert "heartbeat is 'soon'" in str(liveness["n2"])
    assert not isinstance(liveness["n1"], BadRecord)


async def test_a_name_in_the_node_set_that_is_no_node_s_is_a_bad_record(ledger: Ledger) -> None:
    await ledger.register_node(make_inventory("n1", gpus=1))
    await ledger.redis.sadd(ledger.nodes_key, "Bad\nNode")
    names = await ledger.nodes()
    assert (await ledger.revisions(names))["Bad\nNode"] is None
    for read in (await ledger.read_nodes(names), await ledger.read_liveness(names)):
        assert not isinstance(read["n1"], BadRecord)
        bad = read["Bad\nNode"]
        assert isinstance(bad, BadRecord)
        assert str(bad) == "node 'Bad\\nNode': its name is not a Kubernetes node name"
    with pytest.raises(BadRecord):
        await ledger.node_placements("Bad\nNode")


# ---------------------------------------------------------------- a reserve in one script

_STAMPS = ("heartbeat", "registered", "rebuilt")  # times in a node's meta
_TIMES = ("reserved_at", "bound_at", "allocated_at", "released_at")


async def stored(led: Ledger) -> dict[str, Any]:
    """Every key of the ledger as two runs of the same calls must leave it: times
    and the tokens reserve calls draw (which differ from run to run) masked, the
    prefix cut."""
    r: Any = led.redis
    found: dict[str, Any] = {}
    async for key in r.scan_iter(match=f"{led.prefix}:*"):
        name = key.removeprefix(f"{led.prefix}:")
        kind = await r.type(key)
        if kind == "string":
            state, _, token, node = (await r.get(key)).split(":", 3)
            token = "<call>" if re.fullmatch("[0-9a-f]{16}", token) else token  # a call's own
            found[name] = (state, token, node, await r.ttl(key) > 0)
        elif kind == "hash":
            fields = await r.hgetall(key)
            if name.endswith(":meta"):
                fields = {f: "<time>" if f in _STAMPS else v for f, v in fields.items()}
            if name.endswith(":pods"):
                fields = {uid: _untimed(raw) for uid, raw in fields.items()}
            found[name] = fields
        elif kind == "zset":  # released: scored by time; pending: by bind order
            found[name] = await r.zrange(key, 0, -1, withscores=name.endswith(":pending"))
        else:
            found[name] = sorted(await r.smembers(key))
    return found


def _untimed(raw: str) -> Any:
    record = json.loads(raw)
    record["times"] = sorted(record["times"])  # the steps it went through, not when
    return record


def masked(result: Any) -> Any:
    """A ledger call's result without its times."""
    if isinstance(result, Placement):
        return result.model_dump(mode="json", exclude=set(_TIMES))
    if isinstance(result, Release):
        return (masked(result.placement), result.first, result.clamped)
    if isinstance(result, tuple):
        return tuple(masked(r) for r in result)
    return result


ODD_UID = "x:1:tok:node-b}{pod:\n\x00é😀"  # ':' as in an index value, braces, odd bytes


async def reserves_of_every_kind(led: Ledger) -> list[Any]:
    """Each call's result (or error) beside every key it left, call by call."""
    seen: list[Any] = []

    async def call(done: Awaitable[Any]) -> None:
        try:
            result = masked(await done)
        except LedgerError as exc:
            result = (type(exc).__name__, str(exc))
        seen.append((result, await stored(led)))

    for node in ("node-a", "node-b"):
        await led.register_node(make_inventory(node), rebuilt=True)
    await led.register_node(make_inventory("node-c"))  # not stamped rebuilt
    p1 = placement("pod-1", "node-a", [[(0, 4000, 30)]])
    await call(led.reserve_new(p1))
    await call(led.reserve_new(p1))  # exists: not made by this call
    await call(led.reserve_new(placement("pod-1", "node-b", [[(0, 10, 1)]])))  # live on node-a
    await call(led.reserve_new(placement("pod-2", "node-a", [[(0, 99999, 10)]])))  # no room
    await call(led.reserve_new(placement("pod-3", "node-c", [[(0, 10, 1)]])))  # being rebuilt
    await call(led.restore(placement("pod-4", "node-c", [[(1, 10, 1)]]), True))
    await call(led.reserve_new(placement("pod-5", "node-b", [[(1, 100, 100)]])))  # exclusive
    await call(led.reserve_new(placement("pod-6", "node-b", [[(1, 100, 10)]])))  # its owner
    await call(led.release("pod-1"))
    await call(led.reserve_new(p1))  # after a release, on the same node
    await call(led.release("pod-1"))
    await call(led.reserve_new(placement("pod-1", "node-a", [[(0, 99999, 1)]])))  # over a release
    await call(led.reserve_new(placement("pod-1", "node-b", [[(0, 10, 1)]])))
    await call(led.release("pod-1"))
    await call(led.reserve_new(p1))  # after a release on another node
    # a release that died after marking the index: the next reserve elsewhere finishes it
    value = await led._get(led.pod_index_key("pod-1"))
    await led._index("release", "pod-1", value, 60)
    await call(led.reserve_new(placement("pod-1", "node-b", [[(0, 10, 1)]])))
    # another call's claim: shared on its node, refused elsewhere while fresh
    for uid in ("pod-7", "pod-8", "pod-9"):
        await led._index("claim", uid, "node-a", "othercall")
    await call(led.reserve_new(placement("pod-7", "node-a", [[(1, 10, 1)]])))
    await call(led.reserve_new(placement("pod-8", "node-a", [[(1, 99999, 1)]])))  # claim stays
    await call(led.reserve_new(placement("pod-9", "node-b", [[(0, 10, 1)]])))
    await call(led.mark_bound("pod-7"))
    await call(led.reserve_new(placement("pod-7", "node-a", [[(1, 10, 1)]])))  # exists, bound
    await call(led.cordon("node-a", "GPU-node-a-1"))
    await call(led.reserve_new(placement("pod-10", "node-a", [[(1, 10, 1)]])))  # cordoned
    await call(led.reserve_new(placement("pod-11", "node-a", [[(0, 10**30, 1)]])))  # absurd
    await call(led.reserve_new(placement(ODD_UID, "node-a", [[(0, 10, 1)]])))
    await call(led.reserve_new(placement(ODD_UID, "node-b", [[(0, 10, 1)]])))
    await call(led.placement(ODD_UID))
    await call(led.release(ODD_UID))
    return seen


async def test_one_script_answers_and_stores_what_the_three_steps_do(redis_url: str) -> None:
    fast = Ledger.from_url(redis_url, prefix="fast")
    steps = Ledger.from_url(redis_url, prefix="steps", fast_reserve=False)
    notices = steps.redis.pubsub()
    try:
        assert fast.fast_reserve
        await notices.subscribe(fast.changes_channel, steps.changes_channel)
        in_one, in_three = await reserves_of_every_kind(fast), await reserves_of_every_kind(steps)
        for i, (one, three) in enumerate(zip(in_one, in_three, strict=True)):
            assert one == three, f"call {i}"
        outcomes = [outcome for outcome, _ in in_one]
        assert outcomes[1][1] is False  # exists
        assert outcomes[2] == ("AlreadyReserved", "pod pod-1 is already reserved on node node-a")
        assert outcomes[3][0] == "ReservationConflict"
        assert outcomes[4][0] == "LedgerRebuilding"
        assert outcomes[11][0] == "ReservationConflict"
        assert "pod:{pod-1}" not in in_one[11][1]  # the claim over the release is dropped
        assert in_one[15][1]["pod:{pod-1}"] == ("live", "<call>", "node-b", False)
        assert in_one[16][1]["pod:{pod-7}"] == ("live", "othercall", "node-a", False)  # shared
        assert in_one[17][1]["pod:{pod-8}"] == ("claimed", "othercall", "node-a", False)
        assert outcomes[18] == ("AlreadyReserved", "pod pod-9 is already reserved on node node-a")
        assert outcomes[22][0] == outcomes[23][0] == "ReservationConflict"
        assert outcomes[23][1].endswith("InvalidRequest")
        assert outcomes[25][0] == "AlreadyReserved"
        assert outcomes[26] is not None
        announced: dict[str, list[str]] = {fast.changes_channel: [], steps.changes_channel: []}
        while (message := await notices.get_message(timeout=0.2)) is not None:
            if message["type"] == "message":
                prefix = message["channel"].removesuffix(":changes")
                announced[message["channel"]].append(message["data"].removeprefix(prefix))
        assert announced[fast.changes_channel] == announced[steps.changes_channel]
        assert len(announced[fast.changes_channel]) > 10
    finally:
        await notices.aclose()  # type: ignore[no-untyped-call]
        await fast.close()
        await steps.close()


async def evalsha_calls(redis: Any) -> int:
    stats = await redis.info("commandstats")
    return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))


async def test_a_reserve_is_one_round_trip_where_every_key_is_on_one_server(
    ledger: Ledger, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    steps = Ledger(ledger.redis, fast_reserve=False)
    for node in ("node-a", "node-b"):
        await ledger.register_node(make_inventory(node), rebuilt=True)
    for led in (ledger, steps):  # scripts loaded
        await led.reserve(placement(f"warm-{led.fast_reserve}", "node-a", [[(0, 10, 1)]]))
    sent: list[str] = []
    send = ledger.redis.execute_command

    async def counted(*args: Any, **options: Any) -> Any:
        sent.append(str(args[0]))
        return await send(*args, **options)

    monkeypatch.setattr(ledger.redis, "execute_command", counted)
    server = Redis.from_url(redis_url)  # a client of its own, not counted
    try:
        before = await evalsha_calls(server)
        _, created, _ = await ledger.reserve_new(placement("pod-1", "node-a", [[(0, 10, 1)]]))
        assert created
        assert sent == ["EVALSHA"]
        assert await evalsha_calls(server) - before == 1
        sent.clear()
        await steps.reserve(placement("pod-2", "node-a", [[(0, 10, 1)]]))
        assert sent == ["EVALSHA"] * 3  # claim, reserve, confirm
        sent.clear()
        # an index naming another node: the one script changes nothing, the steps decide
        with pytest.raises(AlreadyReserved):
            await ledger.reserve(placement("pod-1", "node-b", [[(0, 10, 1)]]))
        assert sent == ["EVALSHA", "EVALSHA", "HGET"]  # one script, the claim, node-a's record
        # the script cache emptied (a restart, a failover): loaded again on first use
        await server.script_flush()
        sent.clear()
        await ledger.reserve(placement("pod-3", "node-a", [[(0, 10, 1)]]))
        assert sent == ["EVALSHA", "SCRIPT LOAD", "EVALSHA"]
    finally:
        await server.aclose()


async def test_a_redis_cluster_ledger_reserves_in_three_steps() -> None:
    led = Ledger(RedisCluster(host="127.0.0.1", port=free_port()))
    try:
        assert not led.fast_reserve  # the pod index and the node's keys are in two slots
    finally:
        await led.close()


async def test_many_reserves_of_one_pod_on_two_nodes_at_once_leave_one(redis_url: str) -> None:
    ledgers = [
        Ledger.from_url(redis_url),
        Ledger.from_url(redis_url),
        Ledger.from_url(redis_url, fast_reserve=False),  # both kinds at once, as in an upgrade
    ]
    nodes = ("node-a", "node-b")
    try:
        for node in nodes:
            await ledgers[0].register_node(make_inventory(node, split_count=1000), rebuilt=True)
        uids = [f"pod-{i}" for i in range(60)]
        tries = [(uid, nodes[k % 2], ledgers[k % 3]) for uid in uids for k in range(12)]
        random.Random(7).shuffle(tries)

        async def attempt(uid: str, node: str, led: Ledger) -> tuple[str, bool] | str:
            try:
                reserved, created, _ = await led.reserve_new(placement(uid, node, [[(0, 10, 0)]]))
            except AlreadyReserved as exc:
                return exc.node
            return reserved.node, created

        results = await asyncio.gather(*(attempt(*t) for t in tries))
        won = dict.fromkeys(nodes, 0)
        for uid in uids:
            mine = [r for t, r in zip(tries, results, strict=True) if t[0] == uid]
            winners = {r[0] for r in mine if isinstance(r, tuple)}
            assert len(winners) == 1, f"{uid} reserved on {winners}"
            [winner] = winners
            assert sum(1 for r in mine if isinstance(r, tuple) and r[1]) == 1  # made once
            assert all(r == winner for r in mine if isinstance(r, str))  # refusals name it
            index = await ledgers[0]._get(ledgers[0].pod_index_key(uid))
            assert index is not None
            assert index.startswith("live:")
            assert index.endswith(f":{winner}")
            won[winner] += 1
        for node in nodes:
            live = [p for p in await ledgers[0].node_placements(node) if p.state != "released"]
            assert len(live) == won[node]
            held = [(10 * won[node], 0, won[node], None), (0, 0, 0, None)]
            assert await usage(ledgers[0], node) == held
            assert await ledgers[0].check_node(node) == []
    finally:
        for led in ledgers:
            await led.close()


def _reserve_args(uid: str, footprint: str, record: str | None = None) -> list[str]:
    if record is None:
        record = json.dumps({"pod": {"uid": uid}, "node": "node-a", "containers": [], "policy": ""})
    return [uid, record, footprint, ""]


@pytest.mark.parametrize(
    ("footprint", "record"),
    [
        ('[["GPU-node-a-0", 1e30, 0, 1, 0]]', None),
        ('[["GPU-node-a-0", Infinity, 0, 1, 0]]', None),
        ('[["GPU-node-a-0", 10, 0, inf, 0]]', None),
        ('[["GPU-node-a-0", NaN, 0, 1, 0]]', None),
        ('[["GPU-node-a-0", -0, 0, 1, 0]]', None),  # Lua prints "-0": no integer to Redis
        ('[["GPU-node-a-0", -1, 0, 1, 0]]', None),
        ('[["GPU-node-a-0", 1.5, 0, 1, 0]]', None),
        ('[["GPU-node-a-0", 100000000000000, 0, 1, 0]]', None),  # printed as 1e+14
        ('[["GPU-node-a-0", "10", 0, 1, 0]]', None),
        ('[["GPU-node-a-0", 10, 0, 1, 2]]', None),  # exclusive is 0 or 1
        ('[["GPU-node-a-0", 10, 0, 1, true]]', None),
        ('[["GPU-node-a-0", 10, 0, 1]]', None),
        ('[["GPU-node-a-0", 9000, 0, 1, 0], ["GPU-node-a-0", 9000, 0, 1, 0]]', None),
        ("[]", None),
        ("{}", None),
        ('{"GPU-node-a-0": [10, 0, 1, 0]}', None),
        ("[null]", None),
        ("[5]", None),
        ('"GPU-node-a-0"', None),
        ('[["GPU-node-a-0", 10, 0, 1, 0]]', '"a string"'),
        ('[["GPU-node-a-0", 10, 0, 1, 0]]', '{"pod": {}}'),  # no containers
        ('[["GPU-node-a-0", 10, 0, 1, 0]]', "[]"),
    ],
)
@pytest.mark.parametrize("fast", [True, False])
async def test_a_footprint_or_record_that_cannot_be_read_is_refused_whole(
    ledger: Ledger, footprint: str, record: str | None, fast: bool
) -> None:
    """Never read as no limit, never half written; refused alike in one script or three."""
    await ledger.register_node(make_inventory("node-a"), rebuilt=True)
    before = await stored(ledger)
    keys = ledger.node_keys("node-a").all()
    args = _reserve_args("pod-1", footprint, record)
    if fast:
        reply = await ledger._run(
            "claim_reserve", [*keys, ledger.pod_index_key("pod-1")], [*args, "tok", "node-a"]
        )
    else:
        reply = await ledger._run("reserve", keys, args)
    assert reply[0] == "fail"
    assert reply[2] == "InvalidRequest"
    assert await stored(ledger) == before


async def test_a_record_that_is_no_json_changes_nothing(ledger: Ledger) -> None:
    await ledger.register_node(make_inventory("node-a"), rebuilt=True)
    before = await stored(ledger)
    keys = [*ledger.node_keys("node-a").all(), ledger.pod_index_key("pod-1")]
    args = _reserve_args("pod-1", '[["GPU-node-a-0", 10, 0, 1, 0]]', "{not json")
    with pytest.raises(ResponseError):
        await ledger._run("claim_reserve", keys, [*args, "tok", "node-a"])
    assert await stored(ledger) == before


@pytest.mark.parametrize(
    ("token", "node"),
    [
        ("a:b", "node-a"),  # would shift the index value's fields
        ("", "node-a"),
        ("tok\n", "node-a"),
        ("tok", ""),
        ("tok", "node-a:x"),
        ("tok", "node-a\n"),
        ("tok", ".node-a"),
        ("tok", "nöde-a"),
    ],
)
async def test_one_script_refuses_a_token_or_node_no_reserve_sends(
    ledger: Ledger, token: str, node: str
) -> None:
    await ledger.register_node(make_inventory("node-a"), rebuilt=True)
    before = await stored(ledger)
    keys = [*ledger.node_keys("node-a").all(), ledger.pod_index_key("pod-1")]
    args = _reserve_args("pod-1", '[["GPU-node-a-0", 10, 0, 1, 0]]')
    with pytest.raises(ResponseError, match="not a token and a node name"):
        await ledger._run("claim_reserve", keys, [*args, token, node])
    assert await stored(ledger) == before


@pytest.mark.parametrize("fast", [True, False])
async def test_a_node_name_that_is_no_node_s_writes_nothing(redis_url: str, fast: bool) -> None:
    led = Ledger.from_url(redis_url, fast_reserve=fast)
    try:
        for node in ("node-a:1", "node-a\n", "Node-A", "{node-a}"):
            with pytest.raises(ValueError, match="not a Kubernetes node name"):
                await led.reserve(placement("pod-1", node, [[(0, 10, 1)]]))
        assert await led.redis.keys("*") == []
    finally:
        await led.close()


async def test_a_bind_in_turn_waits_for_the_allocate_then_binds(ledger: Ledger) -> None:
    await ledger.register_node(make_inventory("node-a"), rebuilt=True)
    await ledger.reserve(placement("a", "node-a", [[(0, 100, 1)]]))
    await ledger.reserve(placement("b", "node-a", [[(1, 100, 1)]]))
    _, waited = await ledger.mark_bound_in_turn("a", "node-a", 5.0)
    assert not waited
    turn = asyncio.ensure_future(ledger.mark_bound_in_turn("b", "node-a", 30.0))
    await asyncio.sleep(0.1)
    assert not turn.done()  # a still waits for kubelet
    assert (await ledger.allocate("node-a", 1)).placement.pod.uid == "a"
    bound, waited = await turn
    assert (bound.pod.uid, bound.state, waited) == ("b", PlacementState.BOUND, True)


async def test_a_bind_in_turn_gives_up_after_its_wait(ledger: Ledger) -> None:
    await ledger.register_node(make_inventory("node-a"), rebuilt=True)
    await ledger.reserve(placement("a", "node-a", [[(0, 100, 1)]]))
    await ledger.reserve(placement("b", "node-a", [[(1, 100, 1)]]))
    await ledger.mark_bound_in_turn("a", "node-a", 5.0)
    with pytest.raises(NodeBusy, match="taking pod a"):
        await ledger.mark_bound_in_turn("b", "node-a", 0.1)
    assert (await ledger.placement("b")).state == PlacementState.RESERVED  # type: ignore[union-attr]


async def test_bytes_that_are_not_utf8_in_one_record_leave_the_other_nodes_readable(
    ledger: Ledger,
) -> None:
    """No gpuslice writes such bytes, but a record set by hand, or left by a fault,
    may hold them: the client decodes every reply, so one node's bytes used to fail
    the reading of every node (and the scheduler's whole copy)."""
    for node in ("n1", "n2", "n3"):
        await ledger.register_node(make_inventory(node, gpus=1))
    raw = ledger.redis.connection_pool.connection_kwargs
    assert raw.get("decode_responses")  # why one reply fails the round trip
    card = next(iter(await ledger.redis.hkeys(ledger.node_keys("n2").gpus)))
    await ledger.redis.hset(ledger.node_keys("n2").gpus, card, b"\xff\xfe")
    await ledger.redis.hset(ledger.node_keys("n3").meta, "heartbeat", b"\xc3")
    read = await ledger.read_nodes(["n1", "n2", "n3"])
    assert isinstance(read["n2"], BadRecord)
    assert "bytes that are not UTF-8" in read["n2"].problem
    assert not isinstance(read["n1"], BadRecord)
    assert not isinstance(read["n3"], BadRecord)
    assert len(read["n1"].cards) == 1
    revisions = await ledger.revisions(["n1", "n2", "n3"])
    assert isinstance(revisions["n1"], int)
    assert isinstance(revisions["n2"], int)  # its revision is text: only its cards are not
    liveness = await ledger.read_liveness(["n1", "n2", "n3"])
    assert isinstance(liveness["n3"], BadRecord)
    assert not isinstance(liveness["n1"], BadRecord)
    # the connections are clean after: every later read is the right node's
    again = await ledger.read_nodes(["n1"])
    assert again["n1"] == read["n1"]
    assert await ledger.nodes() == ["n1", "n2", "n3"]
