"""Reading the audit stream: one ordered consumer from a time or a stream
sequence, events parsed and de-duplicated, and the filters readers apply.

Shared by ``gpuslice audit`` (tail, export) and the inventory's web console
(its in-memory feed and its export). The backlog and the live events come from
one ordered consumer, in stream order, so nothing between them is lost or
yielded twice (events are also de-duplicated by source and id).

A start time selects by when the stream stored an event, which is what
JetStream can seek to; the ``time`` an event carries is when its publisher says
it happened.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

from nats.errors import Error as NatsError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from gpuslice_common.bus import Bus, BusError, nats_reason
from gpuslice_common.config import parse_duration
from gpuslice_common.events import (
    AllocationEvent,
    CloudEvent,
    EnforcementEvent,
    EventError,
    EventType,
    parse_event,
)
from gpuslice_common.models import PodRef, utcnow

SEEN_IDS = 100_000  # event ids remembered to skip duplicates (bounded for --follow)


class AuditStreamMissing(BusError):
    """The audit stream does not exist (yet) on this NATS."""

    def __init__(self, stream: str, prefix: str, where: str = "this NATS") -> None:
        super().__init__(
            f"audit stream {stream} does not exist on {where} "
            f"(subject prefix {prefix!r}; gpuslice's services create it)"
        )
        self.stream = stream
        self.prefix = prefix


# ---------------------------------------------------------------- filters


def parse_since(value: str, now: datetime | None = None) -> datetime:
    """A duration back from ``now``, or an absolute time with an offset; ValueError if neither."""
    try:
        return (now or utcnow()) - parse_duration(value)
    except ValueError as duration_error:
        try:
            when = datetime.fromisoformat(value.strip())
        except ValueError:
            raise duration_error from None
        if when.tzinfo is None:
            raise ValueError(f"time {value!r} has no UTC offset (add Z or +00:00)") from None
        return when.astimezone(UTC)


def parse_types(values: Sequence[str]) -> frozenset[EventType]:
    """Event types named by suffix (``alloc.bound``) or in full, comma-separated or repeated."""
    by_name = {t.suffix: t for t in EventType} | {t.value: t for t in EventType}
    wanted: set[EventType] = set()
    for value in values:
        for name in filter(None, (part.strip() for part in value.split(","))):
            if name not in by_name:
                known = ", ".join(t.suffix for t in EventType)
                raise ValueError(f"unknown event type {name!r} (one of: {known})")
            wanted.add(by_name[name])
    return frozenset(wanted)


def event_pod(event: CloudEvent) -> PodRef | None:
    """The pod an event is about, if it names one."""
    payload = event.payload()
    pod = getattr(payload, "pod", None)
    return pod if isinstance(pod, PodRef) else None


def event_node(event: CloudEvent) -> str | None:
    """The node of an alloc.* or enforce.* event; None for admission events."""
    payload = event.payload()
    return payload.node if isinstance(payload, AllocationEvent | EnforcementEvent) else None


@dataclass(frozen=True)
class EventFilter:
    """Which events to show; an empty filter shows all."""

    pod: str | None = None  # pod name, namespace/name, or uid
    node: str | None = None
    types: frozenset[EventType] = field(default_factory=frozenset)
    namespace: str | None = None

    def matches(self, event: CloudEvent) -> bool:
        return self.matches_parts(event.type, event_pod(event), event_node(event))

    def matches_parts(self, kind: EventType, pod: PodRef | None, node: str | None) -> bool:
        """:meth:`matches` for an event already taken apart (readers that keep
        many events parse each payload once)."""
        if self.types and kind not in self.types:
            return False
        if self.node is not None and node != self.node:
            return False
        if self.namespace is not None and (pod is None or pod.namespace != self.namespace):
            return False
        if self.pod is None:
            return True
        return pod is not None and self.pod in {pod.name, pod.uid, f"{pod.namespace}/{pod.name}"}

    def subject(self, bus: Bus) -> str:
        """The narrowest subject that holds every matching event."""
        if len(self.types) == 1:
            [only] = self.types
            return bus.subjects.event(only)
        return bus.subjects.events_all


async def audit_events(
    bus: Bus,
    since: datetime | int,
    *,
    subject: str | None = None,
    follow: bool = False,
    timeout: float = 5.0,
    on_malformed: Callable[[str], None] | None = None,
    on_ready: Callable[[], None] | None = None,
) -> AsyncGenerator[CloudEvent, None]:
    """Events the audit stream stored from ``since`` on (a time, or a stream
    sequence number), in stream order, each once.

    The stream drops a re-published event within its duplicate window; one
    re-published later (same source and id) is skipped here, among the last
    SEEN_IDS events.

    Without ``follow`` it ends after the last event stored when it started, and
    raises BusError if the stream stops delivering before that. With ``follow``
    it goes on with new events until the caller stops iterating. Raises
    AuditStreamMissing when there is no audit stream. ``on_ready`` is called
    once the stream is found and being read.
    """
    name = bus.subjects.audit_stream
    try:
        info = await bus.js.stream_info(name)
    except NotFoundError:
        raise AuditStreamMissing(name, bus.subjects.prefix) from None
    except (NatsError, TimeoutError) as exc:
        raise BusError(f"cannot read audit stream {name}: {nats_reason(exc)}") from None
    if not follow and info.state.messages == 0:
        return
    if isinstance(since, datetime):
        config = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_TIME, opt_start_time=since)
    else:
        config = ConsumerConfig(
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=max(1, since)
        )
    try:
        sub = await bus.js.subscribe(
            subject or bus.subjects.events_all, stream=name, ordered_consumer=True, config=config
        )
    except NotFoundError:
        raise AuditStreamMissing(name, bus.subjects.prefix) from None
    except (NatsError, TimeoutError) as exc:
        raise BusError(f"cannot read audit stream {name}: {nats_reason(exc)}") from None
    seen: OrderedDict[tuple[str, str], None] = OrderedDict()  # the latest ids shown
    try:
        if on_ready is not None:
            on_ready()
        remaining: int | None = None
        if not follow:
            # what was pushed to this client already plus what the server still holds
            consumer = await sub.consumer_info()
            delivered = consumer.delivered.consumer_seq if consumer.delivered else 0
            remaining = (consumer.num_pending or 0) + (delivered or 0)
        while remaining is None or remaining > 0:
            try:
                msg = await sub.next_msg(timeout)
            except NatsTimeoutError:
                if follow:
                    continue
                raise BusError(
                    f"audit stream {name} stopped delivering with {remaining} events to go"
                ) from None
            if remaining is not None:
                remaining -= 1
            try:
                event = parse_event(msg.data)
            except EventError as exc:
                if on_malformed is not None:
                    on_malformed(f"stream sequence {msg.metadata.sequence.stream}: {exc}")
                continue
            key = (event.source, event.id)  # what identifies a CloudEvent
            if key in seen:
                continue
            seen[key] = None
            if len(seen) > SEEN_IDS:
                seen.popitem(last=False)
            yield event
    except (NatsError, TimeoutError) as exc:
        raise BusError(f"cannot read audit stream {name}: {nats_reason(exc)}") from None
    finally:
        with contextlib.suppress(NatsError, TimeoutError):
            await sub.unsubscribe()
