"""Pods as the console shows them: live placements and pods known from the audit feed.

A pod's incarnation is its uid: the newest one of a namespace/name is the one
shown. Admission events name a pod before the API server gives it a uid (the
webhook records ``namespace/name`` then); they belong to the incarnation that
follows them. A pod denied at admission has no uid at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from gpuslice_common.events import EventError, EventType, PodAdmitted, parse_event
from gpuslice_common.models import Placement, PlacementState
from gpuslice_inventory.console.auditfeed import AuditFeed, FeedEvent, real_uid
from gpuslice_inventory.console.snapshot import SnapshotBuilder, iso

MAX_PODS = 500
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)  # when a placement carries no time
STORY_STATES = {
    EventType.POD_ADMITTED: "admitted",
    EventType.POD_DENIED: "denied",
    EventType.ALLOC_RESERVED: "reserved",
    EventType.ALLOC_BOUND: "bound",
    EventType.ALLOC_ALLOCATED: "allocated",
    EventType.ALLOC_RELEASED: "released",
    EventType.ALLOC_FAILED: "failed",
}


def story_type(event_type: EventType) -> str:
    """A story line's type: the state an event moves the pod to, or, for what the
    node agent did to it (enforce.*), the action (memory-kill, throttle, ...)."""
    return STORY_STATES.get(event_type) or event_type.suffix.rsplit(".", 1)[-1]


@dataclass
class PodSummary:
    uid: str | None
    namespace: str
    name: str
    node: str | None
    state: str
    since: datetime
    reason: str | None = None
    placement: Placement | None = None
    events: list[FeedEvent] = field(default_factory=list)

    def document(self) -> dict[str, Any]:
        return {
            "uid": self.uid,
            "namespace": self.namespace,
            "name": self.name,
            "node": self.node,
            "state": self.state,
            "since": iso(self.since),
            "reason": self.reason,
        }


def _placement_since(p: Placement) -> datetime | None:
    return p.released_at or p.allocated_at or p.bound_at or p.reserved_at


def _event_reason(fed: FeedEvent) -> str | None:
    return fed.reason


def _from_events(namespace: str, name: str, events: list[FeedEvent]) -> list[PodSummary]:
    """The incarnations of ``namespace/name`` the events tell of, oldest first."""
    pods: list[PodSummary] = []
    waiting: list[FeedEvent] = []  # admission events before a uid is known
    by_uid: dict[str, PodSummary] = {}
    for fed in events:
        pod = fed.pod
        if pod is None:
            continue
        uid = real_uid(pod.uid)
        state = STORY_STATES.get(fed.type)
        if state is None:  # the node agent acted on a placed pod: a line, not a state
            if uid is not None and uid in by_uid:
                by_uid[uid].events.append(fed)
            continue
        if uid is None or fed.type is EventType.POD_DENIED:
            if fed.type is EventType.POD_DENIED:
                denied = PodSummary(
                    uid, namespace, name, None, "denied", fed.time, _event_reason(fed)
                )
                denied.events = [*waiting, fed]
                waiting = []
                pods.append(denied)
            else:
                waiting.append(fed)
            continue
        summary = by_uid.get(uid)
        if summary is None:
            summary = PodSummary(uid, namespace, name, None, state, fed.time)
            summary.events = waiting
            waiting = []
            by_uid[uid] = summary
            pods.append(summary)
        summary.events.append(fed)
        if state != "admitted":
            summary.state = state
            summary.since = fed.time
            summary.reason = _event_reason(fed)
            summary.node = fed.node or summary.node
    if waiting:  # admitted, not placed yet
        first = waiting[-1]
        pending = PodSummary(None, namespace, name, None, "admitted", first.time)
        pending.events = waiting
        pods.append(pending)
    return pods


def _merge_placement(summary: PodSummary | None, p: Placement) -> PodSummary:
    """The ledger's word on a placement wins over the events' for its state."""
    since = _placement_since(p)
    if summary is None:
        summary = PodSummary(
            p.pod.uid, p.pod.namespace, p.pod.name, p.node, p.state.value, since or EPOCH
        )
    summary.placement = p
    summary.node = p.node
    summary.state = p.state.value
    if since is not None:
        summary.since = since
    if p.state is PlacementState.RELEASED:
        summary.reason = p.release_reason or summary.reason
    elif summary.reason and summary.state != "failed":
        summary.reason = None
    return summary


def pod_list(builder: SnapshotBuilder, feed: AuditFeed) -> list[PodSummary]:
    """Every pod the ledger or the feed knows, newest first (all of them; callers cut)."""
    by_key: dict[tuple[str, str, str | None], PodSummary] = {}
    for namespace, name in list(feed.by_pod):
        for s in _from_events(namespace, name, feed.pod_events(namespace, name)):
            key = (namespace, name, s.uid if s.uid else f"@{iso(s.since)}")
            by_key[key] = s
    for p in builder.placements():
        key = (p.pod.namespace, p.pod.name, p.pod.uid)
        by_key[key] = _merge_placement(by_key.get(key), p)
    pods = [s for s in by_key.values() if s.state != "admitted"]
    pods.sort(key=lambda s: s.since, reverse=True)
    return pods


def find_pod(
    builder: SnapshotBuilder, feed: AuditFeed, namespace: str, name: str
) -> PodSummary | None:
    """The newest incarnation of ``namespace/name``; None when nothing knows it."""
    known = _from_events(namespace, name, feed.pod_events(namespace, name))
    by_uid = {s.uid: s for s in known if s.uid}
    placed = [p for p in builder.placements() if (p.pod.namespace, p.pod.name) == (namespace, name)]
    for p in placed:
        by_uid[p.pod.uid] = _merge_placement(by_uid.get(p.pod.uid), p)
    candidates = [*by_uid.values(), *(s for s in known if not s.uid)]
    if not candidates:
        return None
    # a live placement is the current incarnation; otherwise the latest news
    live = [s for s in candidates if s.placement and s.state != "released"]
    pool = live or candidates
    return max(pool, key=lambda s: s.since)


def asked(events: list[FeedEvent]) -> dict[str, dict[str, Any]]:
    """What each container asked for per card, by the newest admission of the
    pod the feed holds: memory in the units asked (``memory_mib``, or
    ``memory_percent`` of the card) and cores, so that the page shows a
    request as it was made, not only the MiB it came to; {} without one."""
    admission = next((f for f in reversed(events) if f.type is EventType.POD_ADMITTED), None)
    if admission is None:
        return {}
    try:
        payload = parse_event(admission.line).payload()
    except (EventError, ValidationError):  # the feed holds what parsed; kept to be safe
        return {}
    if not isinstance(payload, PodAdmitted):
        return {}
    return {
        c.name: {
            "memory_mib": c.memory.mib,
            "memory_percent": c.memory.percent,
            "cores": c.cores,
        }
        for c in payload.containers
    }


def pod_document(builder: SnapshotBuilder, summary: PodSummary) -> dict[str, Any]:
    """The pod document of the API (``GET /api/v1/pods/{namespace}/{name}``)."""
    p = summary.placement
    containers: list[dict[str, Any]] = []
    policy = p.policy if p is not None else None
    requests = asked(summary.events)
    if p is not None:
        usage = (
            builder.pod_usage(p.node, p.pod.uid) if p.state is not PlacementState.RELEASED else []
        )
        for c in p.containers:
            cards = []
            for d in c.devices:
                card = builder.card(p.node, d.uuid)
                cards.append(
                    {
                        "uuid": d.uuid,
                        "index": card.index if card else None,
                        "model": card.model if card else None,
                        "vendor": card.vendor if card else None,
                        "memory_mib": d.memory_mib,
                        # granted, and the card's own, in its vendor's units
                        "cores": d.cores,
                        "card_cores": card.cap_cores if card else None,
                        "mig": d.mig.model_dump(mode="json") if d.mig else None,
                    }
                )
            containers.append(
                {
                    "name": c.name,
                    "asked": requests.get(c.name),  # None: the feed holds no admission
                    "cards": cards,
                    "usage": [
                        {
                            "uuid": u.uuid,
                            "used_bytes": u.used_bytes,
                            "peak_bytes": u.peak_bytes,
                            "limit_bytes": u.limit_bytes,
                            "sm_percent": u.sm_percent,
                            "throttled_ns": u.throttled_ns,
                            "denied_allocations": u.denied_allocations,
                            "at": iso(datetime.fromtimestamp(u.at_ms / 1000, UTC)),
                        }
                        for u in usage
                        if u.container == c.name
                    ],
                }
            )
    elif summary.events:
        policy = next((f.policy for f in reversed(summary.events) if f.policy), None)
    story = [
        {
            "type": story_type(f.type),
            "time": iso(f.time),
            "source": f.source,
            "reason": _event_reason(f),
            "id": f.id,
        }
        for f in summary.events
    ]
    return {
        **summary.document(),
        "policy": policy or None,
        "containers": containers,
        "story": story,
    }
