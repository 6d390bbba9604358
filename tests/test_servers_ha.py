"""The highly-available server shapes the harness runs: a three-member NATS
cluster keeps a replicated stream through the loss of any one member, and
Redis sentinels promote a replica when the primary dies, the old primary
coming back as a replica."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest
from nats.js.api import StreamConfig
from redis.asyncio import Redis

from gpuslice_common.servers import NatsCluster, RedisSentinelGroup


@pytest.fixture
def nats_cluster(tmp_path: Path) -> Iterator[NatsCluster]:
    with NatsCluster(tmp_path / "nats") as cluster:
        yield cluster


@pytest.fixture
def sentinel_group(tmp_path: Path) -> Iterator[RedisSentinelGroup]:
    with RedisSentinelGroup(tmp_path / "redis") as group:
        yield group


async def _publish(js: nats.js.JetStreamContext, subject: str, payload: bytes) -> None:
    """Publish with the ack of the stream's quorum, trying again while the
    cluster elects a new stream leader (a client's retry; the stream drops a
    duplicate by its message id)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    while True:
        try:
            await js.publish(subject, payload, timeout=1, headers={"Nats-Msg-Id": payload.decode()})
            return
        except (TimeoutError, nats.errors.Error):
            assert loop.time() < deadline, f"{subject} never acknowledged"
            await asyncio.sleep(0.2)


async def test_a_replicated_stream_survives_losing_any_one_member(
    nats_cluster: NatsCluster,
) -> None:
    assert len(nats_cluster.members) == 3
    assert nats_cluster.url.count("nats://") == 3
    assert nats_cluster.meta_leader() is not None
    nc = await nats.connect(
        nats_cluster.url.split(","), max_reconnect_attempts=-1, reconnect_time_wait=0.2
    )
    try:
        js = nc.jetstream()
        await js.add_stream(StreamConfig(name="ha", subjects=["ha.>"], num_replicas=3))
        sent = 0
        for member in nats_cluster.members:
            for _ in range(5):
                await _publish(js, "ha.before", f"m{sent}".encode())
                sent += 1
            member.kill()  # SIGKILL: no goodbye to the others
            # the two left keep a quorum: writes and reads go on
            for _ in range(5):
                await _publish(js, "ha.during", f"m{sent}".encode())
                sent += 1
            info = await js.stream_info("ha")
            assert info.state.messages == sent
            member.start()
            await asyncio.to_thread(nats_cluster.wait_healthy, 30.0)
        # every message, once, on every member: each in turn is the one asked
        for member in nats_cluster.members:
            alone = await nats.connect(member.url)
            try:
                info = await alone.jetstream().stream_info("ha")
            finally:
                await alone.close()
            assert info.state.messages == sent
            assert info.config.num_replicas == 3
    finally:
        await nc.close()


async def test_a_replica_takes_over_when_the_primary_dies(
    sentinel_group: RedisSentinelGroup,
) -> None:
    group = sentinel_group
    assert group.sentinels.count("127.0.0.1:") == 3
    assert len(group.servers) == 3
    first = group.primary()
    assert first is group.servers[0]
    writer = Redis(port=first.port)
    await writer.set("kept", "yes")
    assert await writer.wait(2, 5000) == 2  # both replicas hold it before the crash
    await writer.aclose()

    killed = await asyncio.to_thread(group.kill_primary)
    assert killed is first
    assert not killed.running
    promoted = await asyncio.to_thread(group.wait_promoted, killed, 30.0)
    assert promoted is not killed
    client = Redis(port=promoted.port)
    try:
        assert await client.get("kept") == b"yes"
        await client.set("after", "1")  # it takes writes
    finally:
        await client.aclose()

    await asyncio.to_thread(group.rejoin, killed)
    assert group.primary() is promoted
    role = killed.replication()
    assert role["role"] == "slave"
    assert role["master_port"] == promoted.port
    client = Redis(port=killed.port)
    try:
        assert await client.get("after") == b"1"  # it follows the new primary
    finally:
        await client.aclose()
