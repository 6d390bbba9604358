"""The outbox against real nats-server processes: order, never waiting, NATS down or restarting."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import timedelta
from pathlib import Path

import nats
import pytest
from nats.aio.msg import Msg
from nats.js.api import StorageType, StreamConfig

from gpuslice_common.bus import Bus, BusError, BusStats
from gpuslice_common.config import CommonSettings
from gpuslice_common.events import (
    CloudEvent,
    EventType,
    PodAdmitted,
    PodDenied,
    make_event,
)
from gpuslice_common.models import ContainerGpuRequest, MemoryRequest, PodRef
from gpuslice_common.outbox import STRIKES, Outbox
from gpuslice_common.servers import NatsServer, free_port
from gpuslice_common.subjects import Subjects

SOURCE = "/gpuslice/test-webhook"
RETRY = 0.2  # longer than the test stream's duplicate window (0.1 s)


def settings_for(url: str, prefix: str) -> CommonSettings:
    return CommonSettings(nats_url=url, subject_prefix=prefix)


def events(n: int, start: int = 0) -> list[CloudEvent]:
    """Admitted and denied pods, alternating, numbered in their names."""
    made = []
    for i in range(start, start + n):
        pod = PodRef(uid=f"uid-{i}", namespace="team-a", name=f"pod-{i}")
        if i % 2:
            made.append(
                make_event(EventType.POD_DENIED, PodDenied(pod=pod, reason="no"), source=SOURCE)
            )
        else:
            req = ContainerGpuRequest(
                name="main", count=1, memory=MemoryRequest(mib=1024), cores=10
            )
            payload = PodAdmitted(pod=pod, containers=(req,))
            made.append(make_event(EventType.POD_ADMITTED, payload, source=SOURCE))
    return made


async def wait_for(cond: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


class Received:
    """A subscriber on every event subject of a prefix, on its own connection."""

    def __init__(self) -> None:
        self.got: list[tuple[str, CloudEvent]] = []
        self.bus: Bus | None = None

    async def start(self, url: str, prefix: str) -> None:
        self.bus = await Bus.connect(settings_for(url, prefix), "test-subscriber")
        await self.bus.nc.subscribe(self.bus.subjects.events_all, cb=self._on_msg)
        await self.bus.flush()

    async def _on_msg(self, msg: Msg) -> None:
        self.got.append((msg.subject, CloudEvent.model_validate_json(msg.data)))

    @property
    def ids(self) -> list[str]:
        return [e.id for _, e in self.got]


@pytest.fixture
async def received() -> AsyncIterator[Received]:
    r = Received()
    yield r
    if r.bus is not None:
        await r.bus.close()


async def make_stream(url: str, prefix: str, duplicate_window: float = 0.1) -> None:
    """An events stream on file storage (kept across a restart of own_nats): the
    outbox waits for its acknowledgements.

    Its duplicate window is by default the least NATS allows, shorter than the
    outbox's retry interval, so an event published twice a retry apart is stored
    twice.
    """
    bus = await Bus.connect(settings_for(url, prefix), "test-stream")
    try:
        await bus.js.add_stream(
            StreamConfig(
                name=bus.subjects.audit_stream,
                subjects=[bus.subjects.events_all],
                storage=StorageType.FILE,
                duplicate_window=duplicate_window,
            )
        )
    finally:
        await bus.close()


async def stored(bus: Bus, expected: int, timeout: float = 10.0) -> list[CloudEvent]:
    """The events in the stream once it holds ``expected`` of them (or what it holds
    at the timeout). read_audit is retried: now and then it reads nothing from a
    stream that is not empty (about 1 read in 200)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            got = await bus.read_audit()
        except BusError:  # not reconnected yet, or JetStream not ready
            got = []
        if len(got) >= expected or time.monotonic() > deadline:
            return got
        await asyncio.sleep(0.05)


@pytest.fixture
def blackholed_port() -> Iterator[int]:
    """A port whose TCP connections hang, as to an unreachable host: its listen
    backlog is full, so the kernel drops further connection attempts.

    (Not a server that accepts and never speaks: nats-py leaks the socket of a
    connection attempt cancelled in the middle of its handshake, which the
    outbox, never seeing that client, cannot close.)
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen(0)
        with socket.create_connection(s.getsockname()):  # fills the backlog
            yield s.getsockname()[1]


# ------------------------------------------------------------------ tests


async def test_events_arrive_in_order_on_their_subjects(
    nats_server: NatsServer, prefix: str, received: Received
) -> None:
    await make_stream(nats_server.url, prefix)
    await received.start(nats_server.url, prefix)
    outbox = Outbox(settings_for(nats_server.url, prefix), "test-webhook", retry_interval=RETRY)
    await outbox.start()
    sent = events(200)
    assert all(outbox.submit(e) for e in sent)
    await outbox.close()  # publishes what is queued before closing the bus it opened
    await wait_for(lambda: len(received.got) >= len(sent))
    await asyncio.sleep(0.1)  # nothing more arrives
    subjects = Subjects(prefix)
    assert received.ids == [e.id for e in sent]
    assert [s for s, _ in received.got] == [subjects.event(e.type) for e in sent]
    assert {s for s, _ in received.got} == {
        f"{prefix}.events.pod.admitted",
        f"{prefix}.events.pod.denied",
    }
    assert [e for _, e in received.got] == sent
    assert outbox.stats.submitted == outbox.stats.published == 200
    assert outbox.stats.dropped == outbox.stats.publish_errors == 0
    assert outbox.stats.connect_attempts == 1
    assert outbox.bus is None  # the bus it opened is closed


async def test_submit_never_waits_even_when_nats_is_unreachable(
    prefix: str, blackholed_port: int
) -> None:
    # connection attempts hang: the worst case for a caller that waited on one
    outbox = Outbox(
        settings_for(f"nats://127.0.0.1:{blackholed_port}", prefix), "t", retry_interval=RETRY
    )
    await outbox.start()
    await asyncio.sleep(0.05)  # the task is now inside its connection attempt
    batch = events(1000)
    t0 = time.perf_counter()
    accepted = [outbox.submit(e) for e in batch]
    per_submit = (time.perf_counter() - t0) / len(batch)
    try:
        assert all(accepted)
        assert per_submit < 1e-3, f"submit took {per_submit * 1e6:.0f} µs"
        assert outbox.pending == 1000
        assert not outbox.connected
    finally:
        await asyncio.wait_for(outbox.close(timeout=0.1), 5)
    print(f"submit: {per_submit * 1e6:.2f} µs each")


async def test_events_submitted_while_nats_is_down_arrive_once_it_is_up(
    own_nats: NatsServer, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    await make_stream(own_nats.url, prefix)
    own_nats.stop()
    outbox = Outbox(settings_for(own_nats.url, prefix), "test-webhook", retry_interval=RETRY)
    await outbox.start()
    sent = events(50)
    with caplog.at_level(logging.WARNING, logger="gpuslice.outbox"):
        for e in sent:
            assert outbox.submit(e)
        await wait_for(lambda: outbox.stats.connect_attempts >= 2)
    assert not outbox.connected
    assert outbox.pending == 50
    # warned once, not at every attempt
    assert len([r for r in caplog.records if "cannot connect" in r.getMessage()]) == 1

    await asyncio.to_thread(own_nats.start)
    later = events(10, start=50)
    await wait_for(lambda: outbox.connected)
    for e in later:
        assert outbox.submit(e)
    await outbox.close()
    checker = await Bus.connect(settings_for(own_nats.url, prefix), "test-checker")
    try:
        got = await stored(checker, 60)
    finally:
        await checker.close()
    assert [e.id for e in got] == [e.id for e in sent + later]
    assert outbox.stats.published == 60
    assert outbox.stats.dropped == 0


async def test_restart_mid_stream_delivers_every_event_exactly_once(
    own_nats: NatsServer, prefix: str
) -> None:
    await make_stream(own_nats.url, prefix)
    # a client with a small reconnect buffer: should the outbox hand it events
    # while NATS is down, publishing would fail and the retry path would run
    nc = await nats.connect(
        own_nats.url,
        pending_size=16 * 1024,
        reconnect_time_wait=0.1,
        max_reconnect_attempts=-1,
    )
    bus = Bus(nc, Subjects(prefix), source=SOURCE, stats=BusStats())
    outbox = Outbox(settings_for(own_nats.url, prefix), "t", retry_interval=RETRY, bus=bus)
    checker = await Bus.connect(settings_for(own_nats.url, prefix), "test-checker")
    try:
        await outbox.start()
        before, during, after = events(100), events(300, start=100), events(100, start=400)
        for e in before:
            assert outbox.submit(e)
        assert len(await stored(checker, 100)) == 100  # all stored: none in flight at the stop

        await asyncio.to_thread(own_nats.stop)
        await wait_for(lambda: not outbox.connected)
        for e in during:
            assert outbox.submit(e)
        await asyncio.sleep(3 * RETRY)  # a few rounds while still down
        # the events wait in the outbox, not in the client's reconnect buffer
        assert outbox.pending == 300
        assert outbox.stats.published == 100

        await asyncio.to_thread(own_nats.start)
        await wait_for(lambda: outbox.connected)
        for e in after:
            assert outbox.submit(e)
        await wait_for(lambda: outbox.pending == 0)
        await outbox.close()
        assert bus.connected  # a given bus is left open
        await bus.flush()
        got = await stored(checker, 500)
    finally:
        await outbox.close()
        await bus.close()
        await checker.close()
    # stored once each, in order; and the client sent no copies that the stream's
    # deduplication could have hidden (copies flushed together at the reconnect)
    assert [e.id for e in got] == [e.id for e in before + during + after]
    assert nc.stats["out_msgs"] == 500
    assert outbox.stats.published == 500
    assert outbox.stats.dropped == 0


async def test_full_queue_drops_new_events_and_keeps_earlier_ones(
    nats_server: NatsServer, prefix: str, received: Received, caplog: pytest.LogCaptureFixture
) -> None:
    await make_stream(nats_server.url, prefix)
    await received.start(nats_server.url, prefix)
    outbox = Outbox(settings_for(nats_server.url, prefix), "t", capacity=5, retry_interval=RETRY)
    sent = events(8)
    with caplog.at_level(logging.WARNING, logger="gpuslice.outbox"):
        accepted = [outbox.submit(e) for e in sent]  # not started: nothing leaves the queue
    assert accepted == [True] * 5 + [False] * 3
    assert outbox.stats.dropped == 3
    assert outbox.stats.submitted == 8
    assert len([r for r in caplog.records if "full" in r.getMessage()]) == 1  # logged once
    await outbox.start()
    await wait_for(lambda: len(received.got) >= 5)
    await outbox.close()
    await asyncio.sleep(0.1)
    assert received.ids == [e.id for e in sent[:5]]
    assert outbox.stats.published == 5


async def test_an_event_nats_refuses_is_dropped_and_does_not_block_the_rest(
    nats_server: NatsServer, prefix: str, received: Received
) -> None:
    await make_stream(nats_server.url, prefix)
    await received.start(nats_server.url, prefix)
    outbox = Outbox(settings_for(nats_server.url, prefix), "t", retry_interval=RETRY)
    await outbox.start()
    await wait_for(lambda: outbox.connected)
    bad, *good = events(4)
    bad.data.clear()  # the envelope is frozen, its payload dict is not
    for e in (bad, *good):
        assert outbox.submit(e)
    await wait_for(lambda: len(received.got) >= 3)
    await outbox.close()
    assert received.ids == [e.id for e in good]
    assert outbox.stats.dropped == 1
    assert outbox.stats.published == 3


@pytest.mark.parametrize("down", ["refused", "blackholed"])
async def test_close_with_nats_down_is_bounded_and_counts_what_is_left(
    prefix: str, blackholed_port: int, down: str
) -> None:
    port = free_port() if down == "refused" else blackholed_port
    outbox = Outbox(settings_for(f"nats://127.0.0.1:{port}", prefix), "t", retry_interval=RETRY)
    await outbox.start()
    for e in events(10):
        outbox.submit(e)
    await asyncio.sleep(0.15)  # inside a connection attempt or between two
    t0 = time.monotonic()
    await asyncio.wait_for(outbox.close(timeout=0.3), 5)  # fails, not hangs
    elapsed = time.monotonic() - t0
    assert 0.3 <= elapsed < 0.6, f"close took {elapsed:.2f}s"
    assert outbox.stats.dropped == 10
    assert outbox.pending == 0
    assert outbox.stats.published == 0
    assert not outbox.submit(events(1)[0])  # closed: refused, counted
    assert outbox.stats.dropped == 11


class AckLost(Bus):
    """A real bus whose first acknowledgement for each event never arrives: the
    stream stores the event, the publisher hears nothing (a NATS member died
    between the two)."""

    lost: set[str]

    async def publish_acked(self, event: CloudEvent, timeout: float = 2.0) -> int:
        seq = await super().publish_acked(event, timeout)
        if event.id not in self.lost:
            self.lost.add(event.id)
            raise BusError("no acknowledgement (lost in a failover)")
        return seq


async def test_an_event_whose_acknowledgement_is_lost_is_sent_again_and_stored_once(
    nats_server: NatsServer, prefix: str
) -> None:
    await make_stream(nats_server.url, prefix, duplicate_window=120)
    nc = await nats.connect(nats_server.url)
    bus = AckLost(nc, Subjects(prefix), source=SOURCE, stats=BusStats())
    bus.lost = set()
    outbox = Outbox(settings_for(nats_server.url, prefix), "t", retry_interval=RETRY, bus=bus)
    checker = await Bus.connect(settings_for(nats_server.url, prefix), "test-checker")
    try:
        await outbox.start()
        sent = events(100)
        for e in sent:
            assert outbox.submit(e)
        await wait_for(lambda: outbox.pending == 0)
        got = await stored(checker, 100)
        await asyncio.sleep(0.1)
        got = await stored(checker, 100)
    finally:
        await outbox.close()
        await bus.close()
        await checker.close()
    assert bus.lost == {e.id for e in sent}  # every event was sent twice ...
    assert outbox.stats.retried == 100
    assert [e.id for e in got] == [e.id for e in sent]  # ... and stored once, in order
    assert outbox.stats.published == 100
    assert outbox.stats.dropped == 0


async def test_events_wait_until_the_stream_can_store_them(
    nats_server: NatsServer, prefix: str
) -> None:
    # no stream listens yet (JetStream without a leader answers no one either):
    # the events are not dropped, they wait and go in once it can store them
    outbox = Outbox(settings_for(nats_server.url, prefix), "t", retry_interval=RETRY)
    checker = await Bus.connect(settings_for(nats_server.url, prefix), "test-checker")
    try:
        await outbox.start()
        sent = events(20)
        for e in sent:
            assert outbox.submit(e)
        await wait_for(lambda: outbox.stats.publish_errors >= 20)
        assert outbox.pending == 20
        assert outbox.stats.published == outbox.stats.dropped == 0
        await make_stream(nats_server.url, prefix, duplicate_window=120)
        await wait_for(lambda: outbox.pending == 0)
        got = await stored(checker, 20)
    finally:
        await outbox.close()
        await checker.close()
    assert [e.id for e in got] == [e.id for e in sent]
    assert outbox.stats.published == 20


async def test_an_event_too_large_with_its_headers_is_refused_and_the_connection_kept(
    tmp_path: Path, prefix: str
) -> None:
    # the client checks the payload alone; the server counts the headers too,
    # and closes a connection that sends more, for good
    limit = 4096
    with NatsServer(tmp_path / "nats", config=f"max_payload: {limit}\n") as server:
        await make_stream(server.url, prefix, duplicate_window=120)
        outbox = Outbox(settings_for(server.url, prefix), "t", retry_interval=RETRY)
        checker = await Bus.connect(settings_for(server.url, prefix), "test-checker")
        try:
            await outbox.start()
            pod = PodRef(uid="big", namespace="team-a", name="big")
            empty = PodDenied(pod=pod, reason="")
            fits = len(make_event(EventType.POD_DENIED, empty, source=SOURCE).to_json())
            reason = "r" * (limit - fits - 4)
            big = make_event(EventType.POD_DENIED, PodDenied(pod=pod, reason=reason), source=SOURCE)
            assert len(big.to_json()) < limit  # the client alone would send it
            sent = events(10)
            assert outbox.submit(big)
            for e in sent:
                assert outbox.submit(e)
            got = await stored(checker, 10)
            await wait_for(lambda: outbox.pending == 0)
            assert outbox.connected
        finally:
            await outbox.close()
            await checker.close()
    assert [e.id for e in got] == [e.id for e in sent]
    assert outbox.stats.dropped == 1


async def test_events_nats_does_not_let_the_publisher_send_are_dropped_not_kept_for_ever(
    tmp_path: Path, prefix: str
) -> None:
    config = f"""
    jetstream {{}}
    authorization {{ users: [
      {{ user: admin, password: a }}
      {{ user: webhook, password: w, permissions: {{
          publish: ["{prefix}.events.pod.admitted"], subscribe: ["_INBOX.>"] }} }}
    ] }}
    """
    with NatsServer(tmp_path / "nats", config=config) as server:
        admin = CommonSettings(
            nats_url=server.url, subject_prefix=prefix, nats_user="admin", nats_password="a"
        )
        bus = await Bus.connect(admin, "audit-init")
        await bus.ensure_audit_stream(timedelta(hours=1))
        webhook = admin.model_copy(update={"nats_user": "webhook", "nats_password": "w"})
        outbox = Outbox(webhook, "t", retry_interval=RETRY)
        try:
            await outbox.start()
            sent = events(200)  # half of them pod.denied, which the user may not publish
            for e in sent:
                assert outbox.submit(e)
            await wait_for(lambda: outbox.pending == 0, timeout=20)
            got = await stored(bus, 100)
        finally:
            await outbox.close()
            await bus.close()
    admitted = [e.id for e in sent if e.type is EventType.POD_ADMITTED]
    assert [e.id for e in got] == admitted
    assert outbox.stats.dropped == 100
    assert outbox.stats.published == 100


class NeverAcked(Bus):
    """A real bus on which one event's acknowledgement never comes."""

    poison: str = ""

    async def publish_acked(self, event: CloudEvent, timeout: float = 2.0) -> int:
        if event.id == self.poison:
            raise BusError("no acknowledgement")
        return await super().publish_acked(event, timeout)


async def test_an_event_never_stored_while_the_rest_are_is_dropped_after_strikes(
    nats_server: NatsServer, prefix: str
) -> None:
    await make_stream(nats_server.url, prefix, duplicate_window=120)
    nc = await nats.connect(nats_server.url)
    bus = NeverAcked(nc, Subjects(prefix), source=SOURCE, stats=BusStats())
    outbox = Outbox(
        settings_for(nats_server.url, prefix), "t", retry_interval=RETRY, bus=bus, window=4
    )
    checker = await Bus.connect(settings_for(nats_server.url, prefix), "test-checker")
    sent = events(12)
    bus.poison = sent[0].id
    try:
        await outbox.start()
        for e in sent:
            assert outbox.submit(e)
        await wait_for(lambda: outbox.pending == 0)
        got = await stored(checker, 11)
    finally:
        await outbox.close()
        await bus.close()
        await checker.close()
    assert [e.id for e in got] == [e.id for e in sent[1:]]
    assert outbox.stats.dropped == 1
    assert outbox.stats.retried == STRIKES - 1


async def test_while_nothing_is_stored_nothing_is_dropped(
    nats_server: NatsServer, prefix: str
) -> None:
    # no stream yet: every event of every batch fails, many times over; none
    # is struck out, all wait
    outbox = Outbox(settings_for(nats_server.url, prefix), "t", retry_interval=0.05, window=4)
    try:
        await outbox.start()
        for e in events(8):
            assert outbox.submit(e)
        await wait_for(lambda: outbox.stats.publish_errors >= 8 * STRIKES * 2, timeout=30)
        assert outbox.pending == 8
        assert outbox.stats.dropped == 0
    finally:
        await outbox.close(timeout=0.1)
