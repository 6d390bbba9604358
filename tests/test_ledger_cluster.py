"""The same ledger scripts on a real three-shard Redis Cluster."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator, Iterator

import pytest
from redis.asyncio import Redis

from gpuslice_common.config import CommonSettings
from gpuslice_common.ledger import AlreadyReserved, Ledger, LedgerRebuilding, ReservationConflict
from gpuslice_common.models import Placement
from gpuslice_common.servers import RedisClusterServers
from tests.conftest import make_inventory
from tests.test_ledger import placement

NODES = [f"gpu-{i}.rack-{i % 3}.example" for i in range(9)]


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisClusterServers]:
    with RedisClusterServers(shards=3) as servers:
        yield servers


@pytest.fixture
async def ledger(cluster: RedisClusterServers) -> AsyncIterator[Ledger]:
    led = Ledger.from_settings(CommonSettings(redis_url=cluster.url, redis_cluster=True))
    await led.redis.flushall()
    for node in NODES:
        await led.register_node(make_inventory(node, gpus=4, memory_mib=10000), rebuilt=True)
    yield led
    await led.close()


async def test_nodes_spread_over_every_shard(ledger: Ledger) -> None:
    slots = {ledger.redis.keyslot(ledger.node_keys(n).gpus) for n in NODES}  # type: ignore[union-attr]
    shards = {ledger.redis.get_node_from_key(ledger.node_keys(n).gpus).port for n in NODES}  # type: ignore[union-attr]
    assert len(slots) == len(NODES)
    assert len(shards) == 3


async def test_full_lifecycle_on_every_node(ledger: Ledger) -> None:
    for i, node in enumerate(NODES):
        uid = f"pod-{i}"
        await ledger.reserve(placement(uid, node, [[(0, 1000, 10)], [(1, 500, 0), (2, 500, 0)]]))
        await ledger.mark_bound(uid)
        assert (await ledger.allocate(node, 1)).container_index == 0
        assert (await ledger.allocate(node, 2)).placement.state == "allocated"
    views = await ledger.nodes_gpus(NODES)
    assert all(gpus[0].used.memory_mib == 1000 for gpus in views.values())
    for i, node in enumerate(NODES):
        assert await ledger.check_node(node) == []
        released = await ledger.release(f"pod-{i}")
        assert released is not None
        assert released.first
    views = await ledger.nodes_gpus(NODES)
    assert all(g.used.slots == 0 for gpus in views.values() for g in gpus)


async def test_racing_reservations_across_shards(ledger: Ledger) -> None:
    rng = random.Random(11)
    attempts = []
    for i in range(400):
        node = rng.choice(NODES)
        cards = rng.sample(range(4), rng.randint(1, 2))
        grants = [(c, rng.randrange(500, 6000, 500), rng.choice([0, 10, 30, 100])) for c in cards]
        attempts.append(placement(f"r-{i % 150}", node, [grants]))  # UIDs repeat on other nodes

    async def one(p: Placement) -> None:
        with contextlib.suppress(ReservationConflict, AlreadyReserved):
            await ledger.reserve(p)

    await asyncio.gather(*(one(p) for p in attempts))
    live: dict[str, list[str]] = {}
    for node in NODES:
        assert await ledger.check_node(node) == []
        for p in await ledger.node_placements(node):
            if p.state != "released":
                live.setdefault(p.pod.uid, []).append(node)
    assert live
    assert all(len(nodes) == 1 for nodes in live.values()), live


async def test_a_shard_that_lost_its_data_blocks_only_its_own_nodes(ledger: Ledger) -> None:
    def shard_of(node: str) -> int:
        return int(ledger.redis.get_node_from_key(ledger.node_keys(node).gpus).port)  # type: ignore[union-attr]

    lost = shard_of(NODES[0])
    on_lost = [n for n in NODES if shard_of(n) == lost]
    elsewhere = [n for n in NODES if n not in on_lost]
    assert elsewhere
    shard: Redis = Redis(host="127.0.0.1", port=lost)
    await shard.flushall()  # that shard restarted empty
    await shard.aclose()
    for node in on_lost:
        await ledger.register_node(make_inventory(node, gpus=4, memory_mib=10000))
    status = await ledger.rebuild_status()
    assert {n for n, s in status.items() if s.rebuilt_at is None} == set(on_lost)
    for i, node in enumerate(on_lost):
        with pytest.raises(LedgerRebuilding):
            await ledger.reserve(placement(f"waits-{i}", node, [[(0, 1000, 10)]]))
    for i, node in enumerate(elsewhere):
        await ledger.reserve(placement(f"goes-{i}", node, [[(0, 1000, 10)]]))
    for node in on_lost:
        assert await ledger.mark_rebuilt(node, status[node].registered)
        await ledger.reserve(placement(f"after-{node}", node, [[(0, 1000, 10)]]))
        assert await ledger.check_node(node) == []
