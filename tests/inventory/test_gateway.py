"""The node agents' requests to the ledger, served by the inventory over real NATS and Redis.

Requests are sent here as a node agent sends them: on ``<prefix>.node.<node>.<verb>``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError

from gpuslice_common.bus import Bus
from gpuslice_common.events import AllocationEvent, CloudEvent, EnforcementEvent, EventType
from gpuslice_common.ledger import (
    Ledger,
    LedgerError,
    LedgerRebuilding,
    LedgerUnavailable,
    NotReserved,
)
from gpuslice_common.models import (
    ContainerAssignment,
    DeviceGrant,
    Placement,
    PlacementState,
    PodRef,
)
from gpuslice_common.nodeapi import (
    AllocationReply,
    Done,
    ErrorKind,
    ErrorReply,
    PlacementsReply,
    Pong,
    PreferredReply,
    Reply,
    parse_reply,
)
from gpuslice_common.servers import NatsServer
from gpuslice_inventory.gateway import (
    ENFORCE_BURST,
    ENFORCE_PER_S,
    ENFORCE_POD_BURST,
    ENFORCE_POD_PER_S,
    PODLESS_FAILURE_WINDOW_S,
    error_kind,
    podless_failure_id,
)
from gpuslice_inventory.service import Running, running
from tests.conftest import make_inventory
from tests.inventory.conftest import settings_for, until

A, B = "node-a", "node-b"


def bound(uid: str, node: str, gpus: int = 1) -> Placement:
    return Placement(
        pod=PodRef(uid=uid, namespace="team", name=f"pod-{uid}"),
        node=node,
        containers=(
            ContainerAssignment(
                name="main",
                devices=tuple(
                    DeviceGrant(uuid=f"GPU-{node}-{i}", memory_mib=1000, cores=10)
                    for i in range(gpus)
                ),
            ),
        ),
        policy="binpack",
    )


@pytest.fixture
async def inventory(
    nats_server: NatsServer, redis_url: str, prefix: str, bus: Bus
) -> AsyncIterator[Running]:
    settings = settings_for(nats_server, redis_url, prefix, kube_api="none")
    issued: list[tuple[str, str]] = []

    def issue(node: str, pod_uid: str) -> str:
        issued.append((node, pod_uid))
        return f"token-{node}-{pod_uid}"

    async with running(settings, bus, serve_http=False, issue_telemetry_token=issue) as state:
        state.issued = issued  # type: ignore[attr-defined]
        await bus.flush()
        yield state


@pytest.fixture
async def nodes(ledger_of_prefix: Ledger) -> Ledger:
    for node in (A, B):
        await ledger_of_prefix.register_node(make_inventory(node), rebuilt=True)
    for p in (bound("on-a", A), bound("on-b", B)):
        await ledger_of_prefix.reserve(p)
        await ledger_of_prefix.mark_bound(p.pod.uid)
    return ledger_of_prefix


@pytest.fixture
async def ledger_of_prefix(redis_url: str, prefix: str) -> AsyncIterator[Ledger]:
    led = Ledger.from_url(redis_url, prefix)
    yield led
    await led.close()


async def ask(
    bus: Bus,
    node: str,
    verb: str,
    payload: bytes | dict[str, Any] = b"{}",
    *,
    inbox: str | None = None,
    timeout: float = 5,
) -> Reply:
    """A request as the node's agent sends it: answered in the node's own inbox
    (``inbox`` names another one)."""
    subject = f"{bus.subjects.prefix}.node.{node}.{verb}"
    data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    reply_to = f"{inbox or '_INBOX.' + node}.{uuid.uuid4().hex}"
    sub = await bus.nc.subscribe(reply_to, max_msgs=1)
    try:
        await bus.nc.publish(subject, data, reply=reply_to)
        msg = await sub.next_msg(timeout=timeout)
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
    return parse_reply(msg.data)


async def test_ping_answers_for_the_ledger(inventory: Running, bus: Bus) -> None:
    assert isinstance(await ask(bus, A, "ping"), Pong)


async def test_allocate_hands_out_the_node_s_own_pod_with_its_token_and_event(
    inventory: Running, nodes: Ledger, bus: Bus, events: list[CloudEvent]
) -> None:
    reply = await ask(bus, A, "allocate", {"request_id": "r1", "count": 1})
    assert isinstance(reply, AllocationReply)
    assert (reply.placement.pod.uid, reply.container_index) == ("on-a", 0)
    assert reply.devices == ("GPU-node-a-0",)
    assert reply.telemetry_token == "token-node-a-on-a"
    assert inventory.issued == [(A, "on-a")]  # type: ignore[attr-defined]
    await until(lambda: any(e.type == EventType.ALLOC_ALLOCATED for e in events))
    [event] = [e for e in events if e.type == EventType.ALLOC_ALLOCATED]
    payload = event.payload()
    assert isinstance(payload, AllocationEvent)
    assert payload.pod is not None
    assert (payload.pod.uid, payload.node, payload.container) == ("on-a", A, "main")
    assert event.source == "gpuslice/inventory"
    record = await nodes.placement("on-a")
    assert record is not None
    assert record.state == PlacementState.ALLOCATED


async def test_a_node_acts_only_on_its_own_slice_whatever_the_payload_says(
    inventory: Running, nodes: Ledger, bus: Bus, events: list[CloudEvent]
) -> None:
    # node-a's only pod is taken; node-b's pod waits, but a node-a request cannot reach it
    assert isinstance(
        await ask(bus, A, "allocate", {"request_id": "r1", "count": 1}), AllocationReply
    )
    again = await ask(bus, A, "allocate", {"request_id": "r2", "count": 1})
    assert isinstance(again, ErrorReply)
    assert again.error == ErrorKind.NOT_RESERVED
    assert "node node-a" in again.message
    # naming the other node in the payload is not a request at all
    named = await ask(bus, A, "allocate", {"request_id": "r3", "count": 1, "node": B})
    assert isinstance(named, ErrorReply)
    assert named.error == ErrorKind.BAD_REQUEST
    # node-a cannot report node-b's pod as failed either
    failed = await ask(bus, A, "failed", {"pod_uid": "on-b", "container": "main", "reason": "x"})
    assert isinstance(failed, ErrorReply)
    assert failed.error == ErrorKind.NOT_RESERVED
    assert "on-b" not in await pod_list(bus, A)
    preferred = await ask(bus, A, "preferred", {"count": 1})
    assert isinstance(preferred, PreferredReply)
    assert preferred.devices == ()
    record = await nodes.placement("on-b")
    assert record is not None
    assert record.state == PlacementState.BOUND
    await bus.flush()
    await asyncio.sleep(0.2)  # the outbox publishes in the background
    failures = [e.payload() for e in events if e.type == EventType.ALLOC_FAILED]
    assert all(isinstance(p, AllocationEvent) and p.pod is None for p in failures)
    # and node-b's own request gets it
    mine = await ask(bus, B, "allocate", {"request_id": "r1", "count": 1})
    assert isinstance(mine, AllocationReply)
    assert mine.placement.pod.uid == "on-b"


async def pod_list(bus: Bus, node: str) -> dict[str, PlacementState]:
    reply = await ask(bus, node, "placements")
    assert isinstance(reply, PlacementsReply)
    return {p.uid: p.state for p in reply.pods}


async def test_placements_and_preferred_show_the_node_s_pods(
    inventory: Running, nodes: Ledger, bus: Bus
) -> None:
    assert await pod_list(bus, A) == {"on-a": PlacementState.BOUND}
    preferred = await ask(bus, A, "preferred", {"count": 1})
    assert isinstance(preferred, PreferredReply)
    assert preferred.devices == ("GPU-node-a-0",)
    nothing = await ask(bus, A, "preferred", {"count": 2})
    assert isinstance(nothing, PreferredReply)
    assert nothing.devices == ()


async def test_a_repeated_request_gets_the_same_container_and_one_audit_event(
    inventory: Running, nodes: Ledger, bus: Bus
) -> None:
    first = await ask(bus, A, "allocate", {"request_id": "same", "count": 1})
    again = await ask(bus, A, "allocate", {"request_id": "same", "count": 1})
    assert isinstance(first, AllocationReply)
    assert isinstance(again, AllocationReply)
    # the pod has no container left: only the remembered answer gives it again
    assert first.placement.pod.uid == again.placement.pod.uid == "on-a"
    fresh = await ask(bus, A, "allocate", {"request_id": "another", "count": 1})
    assert isinstance(fresh, ErrorReply)
    stored: list[CloudEvent] = []

    async def allocated() -> bool:
        stored[:] = await bus.read_audit(subject=bus.subjects.event(EventType.ALLOC_ALLOCATED))
        return bool(stored)

    await until(allocated)
    await asyncio.sleep(0.3)  # a second event, if there were one, would be stored by now
    stored = await bus.read_audit(subject=bus.subjects.event(EventType.ALLOC_ALLOCATED))
    assert len(stored) == 1


async def test_a_failure_report_for_the_node_s_own_pod_is_recorded(
    inventory: Running, nodes: Ledger, bus: Bus, events: list[CloudEvent]
) -> None:
    assert isinstance(
        await ask(bus, A, "allocate", {"request_id": "r", "count": 1}), AllocationReply
    )
    reason = {"pod_uid": "on-a", "container": "main", "reason": "cannot prepare the container"}
    assert isinstance(await ask(bus, A, "failed", reason), Done)
    unknown = await ask(bus, A, "failed", {**reason, "container": "other"})
    assert isinstance(unknown, ErrorReply)
    assert unknown.error == ErrorKind.BAD_REQUEST
    await until(lambda: any(e.type == EventType.ALLOC_FAILED for e in events))
    [event] = [e for e in events if e.type == EventType.ALLOC_FAILED]
    payload = event.payload()
    assert isinstance(payload, AllocationEvent)
    assert payload.pod is not None
    assert (payload.pod.uid, payload.container, payload.reason) == (
        "on-a",
        "main",
        "cannot prepare the container",
    )


@pytest.mark.parametrize(
    ("node", "verb", "payload", "expected"),
    [
        (A, "allocate", b"not json", "not a valid allocate request"),
        (A, "allocate", b"", "request_id: Field required"),
        (A, "allocate", b'{"request_id": "r", "count": 0}', "count: Input should be greater"),
        (A, "allocate", b'{"request_id": "r", "count": 1000}', "count: Input should be less"),
        (A, "allocate", b'{"request_id": "../x", "count": 1}', "request_id: String should match"),
        (A, "allocate", b'{"request_id": "' + b"r" * 65 + b'", "count": 1}', "request_id"),
        (A, "allocate", b"[1, 2]", "not a valid allocate request"),
        (
            A,
            "failed",
            b'{"pod_uid": "p", "container": "c", "reason": "' + b"x" * 2000 + b'"}',
            "reason",
        ),
        (A, "ping", b'{"extra": 1}', "extra: Extra inputs are not permitted"),
        (A, "release", b"{}", "unknown verb 'release'"),
    ],
)
async def test_malformed_requests_get_a_bad_request_reply_and_no_traceback(
    inventory: Running,
    bus: Bus,
    caplog: pytest.LogCaptureFixture,
    node: str,
    verb: str,
    payload: bytes,
    expected: str,
) -> None:
    caplog.set_level(logging.INFO)
    reply = await ask(bus, node, verb, payload)
    assert isinstance(reply, ErrorReply)
    assert reply.error == ErrorKind.BAD_REQUEST
    assert expected in reply.message
    assert "Traceback" not in caplog.text
    assert not any(r.exc_info for r in caplog.records)
    assert any("bad request" in r.getMessage() for r in caplog.records)
    assert isinstance(await ask(bus, A, "ping"), Pong)  # still serving


async def test_requests_answerable_elsewhere_than_the_node_s_inbox_are_dropped(
    inventory: Running, nodes: Ledger, bus: Bus, caplog: pytest.LogCaptureFixture
) -> None:
    """The reply subject is the requester's to choose: naming an audit subject
    (or another node's inbox) would have the inventory publish there. Such a
    request changes nothing and gets no answer; nor does one whose subject names
    no node."""
    events: list[bytes] = []

    async def keep(msg: Msg) -> None:
        events.append(msg.data)

    await bus.nc.subscribe(f"{bus.subjects.prefix}.events.>", cb=keep)
    allocate = {"request_id": "r", "count": 1}
    for inbox in (f"{bus.subjects.prefix}.events.pod.admitted", f"_INBOX.{B}", "_INBOX"):
        with pytest.raises(NatsTimeoutError):
            await ask(bus, A, "allocate", allocate, inbox=inbox, timeout=0.5)
    with pytest.raises(NatsTimeoutError):
        await ask(bus, "NODE-A", "ping", timeout=0.5)
    assert inventory.gateway.stats.foreign_replies == 3
    assert inventory.gateway.stats.errors[ErrorKind.BAD_REQUEST] == 1
    record = await nodes.placement("on-a")
    assert record is not None
    assert record.state == PlacementState.BOUND  # nothing was allocated
    assert events == []
    assert "not the node's own inbox" in caplog.text
    assert "not a node request subject" in caplog.text
    assert "Traceback" not in caplog.text
    # the node's own inbox is answered
    assert isinstance(await ask(bus, A, "allocate", allocate), AllocationReply)


async def test_requests_without_a_reply_subject_change_nothing(
    inventory: Running, nodes: Ledger, bus: Bus
) -> None:
    await bus.nc.publish(
        f"{bus.subjects.prefix}.node.{A}.allocate", b'{"request_id":"r","count":1}'
    )
    await bus.flush()
    await until(lambda: inventory.gateway.stats.unanswerable == 1)
    # answered or not, the allocation is remembered: asking with the id gives it back
    reply = await ask(bus, A, "allocate", {"request_id": "r", "count": 1})
    assert isinstance(reply, AllocationReply)
    assert reply.placement.pod.uid == "on-a"


@pytest.mark.parametrize(
    ("exc", "kind"),
    [
        (LedgerRebuilding("node-a"), ErrorKind.REBUILDING),
        (NotReserved("nothing waits"), ErrorKind.NOT_RESERVED),
        (LedgerUnavailable("Redis is unreachable"), ErrorKind.LEDGER_UNAVAILABLE),
        (LedgerError("Redis refused allocate"), ErrorKind.LEDGER_ERROR),
        (RuntimeError("a defect"), ErrorKind.INTERNAL),
    ],
)
def test_ledger_errors_map_to_error_kinds(exc: Exception, kind: ErrorKind) -> None:
    assert error_kind(exc) == kind
    assert kind.transient == (kind in (ErrorKind.REBUILDING, ErrorKind.LEDGER_UNAVAILABLE))


async def test_two_replicas_answer_each_request_once(
    nats_server: NatsServer, redis_url: str, prefix: str, bus: Bus, nodes: Ledger
) -> None:
    settings = settings_for(nats_server, redis_url, prefix, kube_api="none")
    second_bus = await Bus.connect(settings, "t2")
    try:
        async with (
            running(settings, bus, serve_http=False, name="one") as one,
            running(settings, second_bus, serve_http=False, name="two") as two,
        ):
            await bus.flush()
            await second_bus.flush()
            replies = [await ask(bus, A, "ping") for _ in range(20)]
            assert all(isinstance(r, Pong) for r in replies)
            served = one.gateway.stats.requests["ping"] + two.gateway.stats.requests["ping"]
            assert served == 20
    finally:
        await second_bus.close()


async def test_a_node_asking_again_and_again_for_nothing_adds_one_failure_a_window(
    inventory: Running, nodes: Ledger, bus: Bus, events: list[CloudEvent]
) -> None:
    """A node's requests that find no pod (kubelet retrying, or a node flooding the
    audit stream on purpose) record one failure per kind and count a window: the
    rest neither reaches the outbox's queue nor the stream."""
    for _ in range(200):
        reply = await ask(bus, A, "allocate", {"request_id": uuid.uuid4().hex, "count": 3})
        assert isinstance(reply, ErrorReply)
        assert reply.error == ErrorKind.NOT_RESERVED
    reply = await ask(bus, B, "allocate", {"request_id": "other-node", "count": 3})
    assert isinstance(reply, ErrorReply)
    await until(lambda: len([e for e in events if e.type == EventType.ALLOC_FAILED]) >= 2)
    await ask(bus, A, "ping")  # events of the requests above are out by now
    await bus.flush()
    failures = [e.payload() for e in events if e.type == EventType.ALLOC_FAILED]
    on_a = [f for f in failures if isinstance(f, AllocationEvent) and f.node == A]
    on_b = [f for f in failures if isinstance(f, AllocationEvent) and f.node == B]
    assert len(on_b) == 1
    # one a window: two if the requests happened to straddle a window's end
    assert len(on_a) in (1, 2)
    assert inventory.gateway.stats.repeated_failures == 200 - len(on_a)


def test_pod_less_failure_ids_are_one_per_node_kind_count_and_window() -> None:
    base = 1_800_000_000.0 - 1_800_000_000.0 % PODLESS_FAILURE_WINDOW_S
    same = podless_failure_id(A, "no-pending-pod", 1, base)
    assert podless_failure_id(A, "no-pending-pod", 1, base + PODLESS_FAILURE_WINDOW_S - 1) == same
    assert podless_failure_id(A, "no-pending-pod", 1, base + PODLESS_FAILURE_WINDOW_S) != same
    assert podless_failure_id(B, "no-pending-pod", 1, base) != same
    assert podless_failure_id(A, "ledger-unavailable", 1, base) != same
    assert podless_failure_id(A, "no-pending-pod", 2, base) != same


async def test_an_enforcement_report_is_recorded_for_the_node_the_subject_names(
    inventory: Running, nodes: Ledger, bus: Bus, events: list[CloudEvent]
) -> None:
    """The node is the subject's; the pod is the ledger's placement on that node, or
    none: node A cannot put its report on node B's pod."""
    report = {
        "request_id": "k1",
        "kind": "memory-kill",
        "pod_uid": "on-a",
        "container": "main",
        "card": "GPU-node-a-0",
        "pid": 4242,
        "used_bytes": 3 << 30,
        "allowed_bytes": 1 << 30,
        "reason": "killed process 4242",
    }
    assert isinstance(await ask(bus, A, "enforced", report), Done)
    assert isinstance(await ask(bus, A, "enforced", {**report, "pod_uid": "on-b"}), Done)
    bad = await ask(bus, A, "enforced", {**report, "kind": "reboot"})
    assert isinstance(bad, ErrorReply)
    assert bad.error == ErrorKind.BAD_REQUEST

    def kills() -> list[EnforcementEvent]:
        found = []
        for e in events:
            if e.type == EventType.ENFORCE_MEMORY_KILL:
                payload = e.payload()
                assert isinstance(payload, EnforcementEvent)
                found.append(payload)
        return found

    await until(lambda: len(kills()) >= 2)
    await asyncio.sleep(0.3)
    own, other = sorted(kills(), key=lambda p: p.pod_uid)
    assert own.node == A
    assert own.pod == PodRef(uid="on-a", namespace="team", name="pod-on-a")
    assert (own.container, own.pid, own.used_bytes) == ("main", 4242, 3 << 30)
    assert other.node == A
    assert other.pod is None  # on-b is not node A's
    assert other.pod_uid == "on-b"


async def test_a_node_flooding_enforcement_reports_has_a_burst_recorded_not_the_flood(
    inventory: Running, nodes: Ledger, bus: Bus, events: list[CloudEvent]
) -> None:
    """A node's credential can say anything in its reports; what it cannot do is fill
    the audit stream (and push other nodes' events out of its retention): past a
    burst, its reports are answered and counted, not recorded. One pod's reports
    (a tenant having its processes killed over and over) use up that pod's budget,
    not its neighbours'. Another node's reports are recorded."""
    report = {"kind": "ungranted-kill", "card": "GPU-node-a-0", "reason": "flood"}
    sent = 0
    started = time.monotonic()

    async def send(node: str, pod: str) -> None:
        nonlocal sent
        request = {**report, "pod_uid": pod, "request_id": f"r{sent}"}
        sent += node == A
        assert isinstance(await ask(bus, node, "enforced", request), Done)

    for _ in range(3 * ENFORCE_POD_BURST):
        await send(A, "noisy")
    noisy_s = time.monotonic() - started
    await send(A, "quiet")
    for i in range(3 * ENFORCE_BURST):
        await send(A, f"pod-{i}")
    elapsed = time.monotonic() - started
    await send(B, "other-node")

    def recorded(node: str, pod: str | None = None) -> int:
        return sum(
            1
            for e in events
            if e.type == EventType.ENFORCE_UNGRANTED_KILL
            and isinstance(p := e.payload(), EnforcementEvent)
            and p.node == node
            and (pod is None or p.pod_uid == pod)
        )

    await until(lambda: recorded(B) == 1)
    await ask(bus, A, "ping")
    await bus.flush()
    await asyncio.sleep(0.3)
    noisy = recorded(A, "noisy")
    assert ENFORCE_POD_BURST <= noisy <= ENFORCE_POD_BURST + ENFORCE_POD_PER_S * noisy_s + 1
    assert recorded(A, "quiet") == 1
    on_a = recorded(A)
    assert ENFORCE_BURST <= on_a <= ENFORCE_BURST + ENFORCE_PER_S * elapsed + 1
    assert inventory.gateway.stats.enforce_dropped == sent - on_a
