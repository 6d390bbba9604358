"""The bus against a real nats-server with JetStream."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import timedelta

import pytest
from nats.js.api import StorageType, StreamConfig
from nats.js.errors import APIError

from gpuslice_common.bus import Bus, BusError
from gpuslice_common.config import CommonSettings
from gpuslice_common.events import (
    AllocationEvent,
    CloudEvent,
    EnforcementEvent,
    EventType,
    PodAdmitted,
    PodDenied,
    make_event,
)
from gpuslice_common.models import (
    ContainerAssignment,
    ContainerGpuRequest,
    DeviceGrant,
    Frozen,
    MemoryRequest,
    NodeInventory,
    PodRef,
)
from gpuslice_common.servers import NatsServer, free_port
from tests.conftest import make_inventory

POD = PodRef(uid="0b6f1d2e-5c51-4f0b-9d43-2c1f8a7e9b10", namespace="team-a", name="train-0")


def sample_payload(t: EventType) -> Frozen:
    if t is EventType.POD_ADMITTED:
        req = ContainerGpuRequest(name="main", count=1, memory=MemoryRequest(mib=4096), cores=30)
        return PodAdmitted(pod=POD, containers=(req,))
    if t is EventType.POD_DENIED:
        return PodDenied(pod=POD, reason="container 'main': nvidia.com/gpucores above 100")
    if t.value.startswith("io.gpuslice.enforce."):
        return EnforcementEvent(
            pod=POD,
            pod_uid=POD.uid,
            node="gpu-node-1",
            container="main",
            card="GPU-1",
            pid=4242,
            used_bytes=3 << 30,
            allowed_bytes=1 << 30,
            reason="killed process 4242 on GPU-1",
        )
    grant = DeviceGrant(uuid="GPU-1", memory_mib=4096, cores=30)
    return AllocationEvent(
        pod=POD,
        node="gpu-node-1",
        containers=(ContainerAssignment(name="main", devices=(grant,)),),
        policy="binpack",
        reason="expired" if t is EventType.ALLOC_RELEASED else "",
    )


def settings_for(url: str, prefix: str) -> CommonSettings:
    return CommonSettings(nats_url=url, subject_prefix=prefix)


@pytest.fixture
async def bus(nats_server: NatsServer, prefix: str) -> AsyncIterator[Bus]:
    b = await Bus.connect(settings_for(nats_server.url, prefix), "test")
    yield b
    await b.close()


async def wait_for(cond: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def collector() -> tuple[list[CloudEvent], Callable[[CloudEvent], Awaitable[None]]]:
    got: list[CloudEvent] = []

    async def handler(event: CloudEvent) -> None:
        got.append(event)

    return got, handler


async def test_every_event_type_round_trips(bus: Bus) -> None:
    got, handler = collector()
    await bus.subscribe_events(bus.subjects.events_all, handler)
    sent = [make_event(t, sample_payload(t), source=bus.source, subject=POD.uid) for t in EventType]
    for event in sent:
        await bus.publish(event)
    await wait_for(lambda: len(got) == len(sent))
    assert got == sent
    assert [e.payload() for e in got] == [sample_payload(t) for t in EventType]
    assert bus.stats.malformed == 0


async def test_a_flush_reaches_the_server_after_what_was_sent_before_it(bus: Bus) -> None:
    # the bytes as they go onto the socket: the flush's PING must follow the
    # SUB and the PUB queued before it, or its PONG confirms nothing about them
    # (nats-py's own flush writes the PING first)
    transport = bus.nc._transport
    assert transport is not None
    wire: list[bytes] = []
    write, writelines = transport.write, transport.writelines

    def keep(data: bytes) -> None:
        wire.append(bytes(data))
        write(data)

    def keep_lines(lines: list[bytes]) -> None:
        wire.append(b"".join(bytes(line) for line in lines))
        writelines(lines)

    transport.write = keep  # type: ignore[method-assign]
    transport.writelines = keep_lines  # type: ignore[method-assign]
    _, handler = collector()
    await bus.subscribe_events(bus.subjects.event(EventType.POD_DENIED), handler)
    await bus.nc.publish("elsewhere", b"x")
    await bus.flush()
    sent = b"".join(wire)
    assert sent.index(b"SUB ") < sent.index(b"PUB elsewhere") < sent.index(b"PING")


async def test_event_subjects_follow_the_type(bus: Bus) -> None:
    got, handler = collector()
    await bus.subscribe_events(bus.subjects.event(EventType.ALLOC_BOUND), handler)
    for t in (EventType.ALLOC_RESERVED, EventType.ALLOC_BOUND, EventType.POD_ADMITTED):
        await bus.publish(make_event(t, sample_payload(t), source=bus.source))
    await wait_for(lambda: len(got) == 1)
    await bus.flush()
    assert [e.type for e in got] == [EventType.ALLOC_BOUND]
    assert bus.subjects.event(EventType.ALLOC_BOUND).endswith(".events.alloc.bound")


@pytest.mark.parametrize(
    ("payload", "complaint"),
    [
        (b"\xff\xfe not json", "not JSON"),
        (b"[1, 2]", "JSON object"),
        (b'{"specversion": "1.0", "id": "x"}', "source"),
        (
            b'{"specversion": "0.3", "id": "x", "source": "/s", "type": "io.gpuslice.pod.denied",'
            b' "time": "2026-01-01T00:00:00Z", "data": {}}',
            "specversion",
        ),
        (
            b'{"specversion": "1.0", "id": "x", "source": "/s", "type": "io.other.thing",'
            b' "time": "2026-01-01T00:00:00Z", "data": {}}',
            "type",
        ),
        (
            b'{"specversion": "1.0", "id": "x", "source": "/s", "type": "io.gpuslice.pod.denied",'
            b' "time": "2026-01-01T00:00:00Z", "data": {"pod": {"uid": "u"}}}',
            "reason",
        ),
    ],
)
async def test_malformed_events_are_counted_and_never_reach_handlers(
    bus: Bus, payload: bytes, complaint: str
) -> None:
    got, handler = collector()
    await bus.subscribe_events(bus.subjects.events_all, handler)
    await bus.nc.publish(bus.subjects.event(EventType.POD_DENIED), payload)
    good = make_event(EventType.POD_DENIED, sample_payload(EventType.POD_DENIED), source="/t")
    await bus.publish(good)
    await wait_for(lambda: len(got) == 1)
    assert got == [good]  # the subscription survived the bad message
    assert bus.stats.malformed == 1
    assert complaint in bus.stats.last_malformed


async def test_typed_subscription_and_failing_handler(bus: Bus) -> None:
    got: list[tuple[str, NodeInventory]] = []

    async def handler(subject: str, inv: NodeInventory) -> None:
        if inv.node == "boom":
            raise RuntimeError("handler bug")
        got.append((subject, inv))

    await bus.subscribe(bus.subjects.inventory_all, NodeInventory, handler)
    await bus.publish_model(bus.subjects.inventory("boom"), make_inventory("boom"))
    await bus.nc.publish(bus.subjects.inventory("bad"), json.dumps({"node": "bad"}).encode())
    inv = make_inventory("gpu-1.example.com")
    await bus.publish_model(bus.subjects.inventory("gpu-1.example.com"), inv)
    await wait_for(lambda: len(got) == 1)
    assert got == [(f"{bus.subjects.prefix}.inventory.gpu-1_example_com", inv)]
    assert bus.stats.handler_errors == 1
    assert bus.stats.malformed == 1
    assert "devices" in bus.stats.last_malformed


def test_event_of_the_wrong_payload_is_refused_before_publishing() -> None:
    with pytest.raises(ValueError, match="PodDenied"):
        make_event(EventType.POD_DENIED, sample_payload(EventType.ALLOC_BOUND), source="/t")


async def test_audit_stream_stores_events_once_and_refuses_deletion(bus: Bus) -> None:
    info = await bus.ensure_audit_stream(timedelta(days=30))
    assert info.config.storage == StorageType.FILE
    assert info.config.max_age == timedelta(days=30).total_seconds()
    events = [make_event(t, sample_payload(t), source=bus.source) for t in EventType]
    for e in events:
        await bus.publish_acked(e)
    seq = await bus.publish_acked(events[0])  # a retry of the same event id
    assert seq == 1
    stored = await bus.read_audit()
    assert [e.id for e in stored] == [e.id for e in events]
    only_bound = await bus.read_audit(subject=bus.subjects.event(EventType.ALLOC_BOUND))
    assert [e.type for e in only_bound] == [EventType.ALLOC_BOUND]
    with pytest.raises(APIError):
        await bus.js.delete_msg(bus.subjects.audit_stream, 1)
    with pytest.raises(APIError):
        await bus.js.purge_stream(bus.subjects.audit_stream)
    # ensuring again is a no-op that keeps the data; a new retention is applied
    again = await bus.ensure_audit_stream(timedelta(days=7))
    assert again.config.max_age == timedelta(days=7).total_seconds()
    assert len(await bus.read_audit()) == len(events)


async def test_audit_read_since_a_time(bus: Bus) -> None:
    await bus.ensure_audit_stream(timedelta(days=1))
    t = EventType.ALLOC_RESERVED
    old = make_event(t, sample_payload(t), source=bus.source)
    await bus.publish_acked(old)
    await asyncio.sleep(0.05)
    new = make_event(t, sample_payload(t), source=bus.source)
    await bus.publish_acked(new)
    assert [e.id for e in await bus.read_audit(since=new.time)] == [new.id]


async def test_audit_refuses_a_stream_that_allows_deletes(bus: Bus) -> None:
    await bus.js.add_stream(
        StreamConfig(
            name=bus.subjects.audit_stream,
            subjects=[bus.subjects.events_all],
            storage=StorageType.MEMORY,
        )
    )
    with pytest.raises(BusError, match=r"storage.*deleting"):
        await bus.ensure_audit_stream(timedelta(days=1))


async def test_audit_survives_a_nats_restart_and_buffered_events_arrive(
    own_nats: NatsServer, prefix: str
) -> None:
    bus = await Bus.connect(settings_for(own_nats.url, prefix), "test", reconnect_wait=0.1)
    try:
        await bus.ensure_audit_stream(timedelta(days=1))
        t = EventType.ALLOC_BOUND
        before = make_event(t, sample_payload(t), source=bus.source)
        await bus.publish_acked(before)

        own_nats.kill()
        await wait_for(lambda: not bus.connected)
        during = make_event(t, sample_payload(t), source=bus.source)
        await bus.publish(during)  # buffered by the client while disconnected
        own_nats.start()
        await wait_for(lambda: bus.connected, timeout=10)
        await bus.flush()

        async def both_stored() -> list[str]:
            for _ in range(100):
                ids = [e.id for e in await bus.read_audit()]
                if len(ids) == 2:
                    return ids
                await asyncio.sleep(0.05)
            return ids

        assert await both_stored() == [before.id, during.id]
        assert bus.stats.disconnects >= 1
        assert bus.stats.reconnects >= 1
    finally:
        await bus.close()


async def test_connecting_to_nothing_is_a_clear_error() -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    with pytest.raises(BusError, match=f"cannot connect to NATS at {url}"):
        await Bus.connect(
            settings_for(url, "x"), "test", connect_timeout=0.2, first_connect_wait=0.3
        )


async def test_an_event_changed_after_it_was_built_is_refused(bus: Bus) -> None:
    event = make_event(EventType.POD_DENIED, sample_payload(EventType.POD_DENIED), source="/t")
    del event.data["reason"]
    with pytest.raises(BusError, match=r"invalid io\.gpuslice\.pod\.denied"):
        await bus.publish(event)
    assert bus.stats.publish_failures == 1


async def test_audit_refuses_a_stream_that_would_drop_old_events(bus: Bus) -> None:
    await bus.js.add_stream(
        StreamConfig(
            name=bus.subjects.audit_stream,
            subjects=[bus.subjects.events_all],
            storage=StorageType.FILE,
            deny_delete=True,
            deny_purge=True,
            max_msgs=3,
        )
    )
    with pytest.raises(BusError, match="max_msgs is 3"):
        await bus.ensure_audit_stream(timedelta(days=1))


async def test_a_short_retention_gets_a_matching_duplicate_window(bus: Bus) -> None:
    info = await bus.ensure_audit_stream(timedelta(seconds=30))
    assert info.config.max_age == 30
    assert info.config.duplicate_window == 30


async def test_reading_a_subject_with_no_events_returns_at_once(bus: Bus) -> None:
    await bus.ensure_audit_stream(timedelta(days=1))
    t = EventType.ALLOC_BOUND
    await bus.publish_acked(make_event(t, sample_payload(t), source=bus.source))
    loop = asyncio.get_running_loop()
    started = loop.time()
    assert await bus.read_audit(subject=bus.subjects.event(EventType.ALLOC_FAILED)) == []
    assert loop.time() - started < 1.0
    assert len(await bus.read_audit(subject=bus.subjects.event(t))) == 1


async def test_the_connect_error_names_the_servers_without_the_password() -> None:
    port = free_port()
    url = f"nats://auditor:hunter2secret@127.0.0.1:{port},nats://u:pw2secret@127.0.0.1:{port}"
    with pytest.raises(BusError) as raised:
        await Bus.connect(
            settings_for(url, "x"), "test", connect_timeout=0.2, first_connect_wait=0.3
        )
    assert "hunter2secret" not in str(raised.value)
    assert "pw2secret" not in str(raised.value)
    assert f"nats://auditor@127.0.0.1:{port}" in str(raised.value)


ANY_BYTES = [
    b"\xff\xfe",
    b"",
    b"not json {",
    b"[1, 2]",
    b'"a string"',
    b"null",
    b"[" * 100_000,
    b'{"node": "\xc3\x28"}',
    b'{"node": ' + b"9" * 100_000 + b"}",
]


async def test_any_bytes_on_a_subscribed_subject_are_dropped_and_the_next_message_served(
    bus: Bus, caplog: pytest.LogCaptureFixture
) -> None:
    got: list[NodeInventory] = []
    events, on_event = collector()

    async def handler(subject: str, inv: NodeInventory) -> None:
        got.append(inv)

    await bus.subscribe(bus.subjects.inventory_all, NodeInventory, handler)
    await bus.subscribe_events(bus.subjects.events_all, on_event)
    huge = b"x" * (bus.nc.max_payload - 64)
    for payload in [*ANY_BYTES, huge]:
        await bus.nc.publish(bus.subjects.inventory("node-a"), payload)
        await bus.nc.publish(bus.subjects.event(EventType.POD_DENIED), payload)
    inv = make_inventory("node-a")
    await bus.publish_model(bus.subjects.inventory("node-a"), inv)
    good = make_event(EventType.POD_DENIED, sample_payload(EventType.POD_DENIED), source="/t")
    await bus.publish(good)
    await wait_for(lambda: len(got) == 1 and len(events) == 1)
    assert got == [inv]
    assert events == [good]
    assert bus.stats.malformed == 2 * (len(ANY_BYTES) + 1)
    assert bus.stats.handler_errors == 0
    assert not any(r.exc_info for r in caplog.records)
