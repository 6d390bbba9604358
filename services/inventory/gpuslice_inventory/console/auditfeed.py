"""The console's audit feed: the newest events of the audit stream, in memory.

One ordered consumer (:func:`gpuslice_common.auditstream.audit_events`) starts
at the newest ``capacity`` events the stream holds and follows it. The feed
keeps them in a deque, indexed by pod uid and by namespace/name, and tells its
followers of each new event. Queries (:meth:`AuditFeed.query`) filter the
window; exports read the stream itself (see the routes).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from nats.errors import Error as NatsError
from nats.js.errors import NotFoundError

from gpuslice_common.auditstream import (
    AuditStreamMissing,
    EventFilter,
    audit_events,
    event_node,
    event_pod,
)
from gpuslice_common.bus import Bus, BusError
from gpuslice_common.events import (
    AllocationEvent,
    CloudEvent,
    EnforcementEvent,
    EventType,
    PodDenied,
)
from gpuslice_common.models import PodRef
from gpuslice_inventory.console.scope import namespace_visible

log = logging.getLogger(__name__)
RETRY_S = 2.0


def real_uid(uid: str) -> str | None:
    """A pod's uid, or None for the webhook's stand-in (``namespace/name``) of a
    pod the API server has not given a uid yet."""
    return None if "/" in uid else uid


def stated_pod(event: CloudEvent) -> PodRef | None:
    """The pod an event is about, only when its data states the pod's namespace:
    a PodRef reads a missing one as ``default``, which would show an event of
    no stated namespace to whoever may see ``default``. Without it the event
    counts as naming no pod (shown to cluster-wide viewers only)."""
    pod = event_pod(event)
    stated = event.data.get("pod")
    if pod is None or not isinstance(stated, dict) or stated.get("namespace") != pod.namespace:
        return None
    return pod


@dataclass(frozen=True, slots=True)
class FeedEvent:
    """One event with what the console reads of it, worked out once: its id,
    source, type, time, pod, node, reason, policy and JSON line. The parsed event,
    payload and document are not kept (about 7 KiB an event, of the feed's
    20,000)."""

    id: str
    source: str
    type: EventType
    time: datetime
    pod: PodRef | None
    node: str | None
    reason: str | None  # a denial's, or an alloc.* event's when it gives one
    policy: str | None  # the policy an alloc.* event names
    line: bytes  # the event's JSON, as sent to viewers

    @classmethod
    def of(cls, event: CloudEvent) -> FeedEvent:
        payload = event.payload()
        reason = policy = None
        if isinstance(payload, PodDenied):
            reason = payload.reason
        elif isinstance(payload, AllocationEvent):
            reason, policy = payload.reason or None, payload.policy or None
        elif isinstance(payload, EnforcementEvent):
            reason = payload.reason or None
        return cls(
            event.id,
            event.source,
            event.type,
            event.time,
            stated_pod(event),
            event_node(event),
            reason,
            policy,
            event.to_json(),
        )

    def visible_to(self, visible: Collection[str] | None) -> bool:
        """Whether a viewer who sees ``visible`` namespaces (None: all) may see it:
        one that names no pod's namespace only when the viewer sees all."""
        if visible is None:
            return True
        return self.pod is not None and namespace_visible(self.pod.namespace, visible)

    def matches(self, wanted: EventFilter) -> bool:
        return wanted.matches_parts(self.type, self.pod, self.node)


class AuditFeed:
    """The newest ``capacity`` events, with indexes; ``followers`` hear of each new one."""

    def __init__(self, bus: Bus, capacity: int) -> None:
        self.bus = bus
        self.capacity = capacity
        self.events: deque[FeedEvent] = deque()
        self.by_uid: dict[str, deque[FeedEvent]] = {}
        self.by_pod: dict[tuple[str, str], deque[FeedEvent]] = {}
        # the last change to each pod name's story, by (namespace, name), as a
        # number of _seq; a name without events has none (see pod_stamp)
        self._stories: dict[tuple[str, str], int] = {}
        self._seq = 0
        self._floor = 0
        self.followers: list[Callable[[FeedEvent], None]] = []
        self.received = 0
        # why the feed may be missing events now (see problem()); None while it reads
        self._problem: str | None = "the audit stream has not been read yet"

    def problem(self) -> str | None:
        """Why newer events may be missing from the feed now (the stream cannot
        be read, NATS cannot be reached); None while the feed follows the stream.
        Said to viewers with what the feed holds, never passed off as complete."""
        if self._problem is not None:
            return self._problem
        if not self.bus.nc.is_connected:
            return "NATS cannot be reached now: newer events may be missing"
        return None

    def _reading(self) -> None:
        self._problem = None

    def add(self, event: CloudEvent) -> FeedEvent:
        """Keep ``event`` (dropping the oldest beyond capacity) and tell the followers."""
        fed = FeedEvent.of(event)
        self.events.append(fed)
        self.received += 1
        self._story_moved(fed)
        for key, index in self._keys(fed):
            index.setdefault(key, deque()).append(fed)
        while len(self.events) > self.capacity:
            self._forget(self.events.popleft())
        for follower in list(self.followers):
            follower(fed)
        return fed

    def _keys(self, fed: FeedEvent) -> Iterator[tuple[Any, dict[Any, deque[FeedEvent]]]]:
        pod = fed.pod
        if pod is None:
            return
        uid = real_uid(pod.uid)
        if uid is not None:
            yield uid, self.by_uid
        if pod.name:
            yield (pod.namespace, pod.name), self.by_pod

    def _story_moved(self, fed: FeedEvent) -> None:
        """Mark a change to the stories ``fed`` belongs to (:meth:`pod_stamp`) with
        a number never used before."""
        if (pod := fed.pod) is not None:
            self._seq += 1
            self._stories[(pod.namespace, pod.name)] = self._seq  # nameless: (ns, "")

    def _forget(self, fed: FeedEvent) -> None:
        self._story_moved(fed)
        for key, index in self._keys(fed):
            kept = index.get(key)
            if kept and kept[0] is fed:
                kept.popleft()
            if not kept:
                index.pop(key, None)
                if index is self.by_pod:  # a name with no event left: its mark goes
                    self._stories.pop(key, None)
                    self._floor = self._seq  # ... and the unmarked stamp moves on

    def query(
        self,
        wanted: EventFilter,
        since: datetime | None,
        until: datetime | None,
        limit: int,
        visible: Collection[str] | None,
    ) -> tuple[list[FeedEvent], bool]:
        """The newest ``limit`` matching events, oldest first, and whether more matched."""
        found: list[FeedEvent] = []
        for fed in reversed(self.events):
            when = fed.time
            if until is not None and when > until:
                continue
            if since is not None and when < since:
                continue
            if fed.matches(wanted) and fed.visible_to(visible):
                if len(found) == limit:
                    return found[::-1], True
                found.append(fed)
        return found[::-1], False

    def namespaces(self) -> set[str]:
        """The namespaces of the pods the feed holds events of."""
        named = {namespace for namespace, _ in self.by_pod}
        return named | {f[0].pod.namespace for f in self.by_uid.values() if f and f[0].pod}

    def namespaces_to_ask(self, wanted: EventFilter) -> set[str]:
        """What a namespaced viewer's query asks access reviews about: the one
        namespace it names, else every namespace the feed holds events of. Not
        the namespaces of the events that match its other filters: whether a
        review was asked (a slower answer) would tell the viewer that a pod it
        may not see had events."""
        if wanted.namespace is not None:
            return {wanted.namespace}
        return self.namespaces()

    def pod_stamp(self, namespace: str, name: str) -> tuple[int, int, int]:
        """What changes when an event joins (or leaves) the story of pods named
        ``namespace/name`` (:meth:`pod_events`), and nothing else: their
        documents are worked out again only then. Counted as events come and go,
        so asking costs nothing however long the story."""
        stories, floor = self._stories, self._floor
        return (
            stories.get((namespace, name), floor),
            stories.get((namespace, ""), floor),  # events of the namespace that name no pod
            floor,
        )

    def pod_events(self, namespace: str, name: str) -> list[FeedEvent]:
        """Every kept event of pods named ``namespace/name``, with the events of
        their uids that carry no name, in feed order."""
        named = list(self.by_pod.get((namespace, name), ()))
        uids = {u for f in named if (p := f.pod) and (u := real_uid(p.uid))}
        # only events that name no pod or this one: an event of another namespace
        # carrying the same uid (a forged or mistaken one) is not this pod's story
        extra = {
            id(f): f
            for u in uids
            for f in self.by_uid.get(u, ())
            if f.pod is not None and f.pod.namespace == namespace and f.pod.name in ("", name)
        }
        for f in named:
            extra.pop(id(f), None)
        if not extra:
            return named
        order = {id(f): i for i, f in enumerate(self.events)}
        return sorted([*named, *extra.values()], key=lambda f: order.get(id(f), -1))

    async def _start(self) -> int:
        """The stream sequence of the oldest event to keep."""
        name = self.bus.subjects.audit_stream
        try:
            info = await self.bus.js.stream_info(name)
        except NotFoundError:
            raise AuditStreamMissing(name, self.bus.subjects.prefix) from None
        except (NatsError, TimeoutError) as exc:
            raise BusError(f"cannot read audit stream {name}: {exc!r}") from None
        last = info.state.last_seq or 0
        first = info.state.first_seq or 1
        return max(first, last - self.capacity + 1, 1)

    async def run(self) -> None:
        """Follow the stream forever; an outage is logged once and retried."""
        said = ""
        while True:
            try:
                start = await self._start()
                self.events.clear()
                self.by_uid.clear()
                self.by_pod.clear()
                self._stories.clear()
                self._seq += 1
                self._floor = self._seq
                async for event in audit_events(
                    self.bus,
                    start,
                    follow=True,
                    on_malformed=self._malformed,
                    on_ready=self._reading,
                ):
                    if said:
                        log.info("the console's audit feed reads the stream again")
                        said = ""
                    self.add(event)
            except BusError as exc:
                self._problem = "the audit stream cannot be read now: newer events may be missing"
                if str(exc) != said:
                    log.warning("the console's audit feed waits: %s", exc)
                    said = str(exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.sleep(RETRY_S)

    @staticmethod
    def _malformed(why: str) -> None:
        log.warning("the console's audit feed skipped a malformed event: %s", why[:300])
