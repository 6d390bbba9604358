"""Audited events: CloudEvents 1.0 in structured JSON mode.

Every event carries a typed payload; the envelope and the payload are validated
when an event is built (before publishing) and again when one is parsed (on
receipt), so a subscriber never sees an event it cannot trust.
"""

from __future__ import annotations

import enum
import json
import uuid
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, ValidationError

from gpuslice_common.models import (
    ClaimRef,
    ContainerAssignment,
    ContainerGpuRequest,
    Frozen,
    PodRef,
    utcnow,
)

TYPE_PREFIX = "io.gpuslice."


class EventError(ValueError):
    """A payload is not a valid gpuslice event; the message says what is wrong."""


class EventType(enum.StrEnum):
    POD_ADMITTED = "io.gpuslice.pod.admitted"
    POD_DENIED = "io.gpuslice.pod.denied"
    ALLOC_RESERVED = "io.gpuslice.alloc.reserved"
    ALLOC_BOUND = "io.gpuslice.alloc.bound"
    ALLOC_ALLOCATED = "io.gpuslice.alloc.allocated"
    ALLOC_RELEASED = "io.gpuslice.alloc.released"
    ALLOC_FAILED = "io.gpuslice.alloc.failed"
    ALLOC_PREEMPTED = "io.gpuslice.alloc.preempted"  # evicted for a pod of higher priority
    # the node agent's enforcement (gpuslice_deviceplugin.enforcer), one type per action
    ENFORCE_MEMORY_KILL = "io.gpuslice.enforce.memory-kill"
    ENFORCE_THROTTLE = "io.gpuslice.enforce.throttle"
    ENFORCE_COMPUTE_KILL = "io.gpuslice.enforce.compute-kill"
    ENFORCE_UNGRANTED_KILL = "io.gpuslice.enforce.ungranted-kill"

    @property
    def suffix(self) -> str:
        """The subject part after '<prefix>.events.', e.g. 'alloc.bound'."""
        return self.value.removeprefix(TYPE_PREFIX)


class PodAdmitted(Frozen):
    pod: PodRef
    containers: tuple[ContainerGpuRequest, ...]
    warnings: tuple[str, ...] = ()


class PodDenied(Frozen):
    pod: PodRef
    reason: str


class AllocationEvent(Frozen):
    """Payload of every alloc.* event; which fields are set depends on the step.

    ``pod`` is absent only from an ``alloc.failed`` of a kubelet Allocate that
    found no pending pod: Allocate carries no pod identity. ``claim`` is the
    ResourceClaim of a placement made in DRA mode, left out of the JSON for the
    device plugin's (whose events stay as they were).
    """

    pod: PodRef | None
    node: str
    containers: tuple[ContainerAssignment, ...] = ()
    container: str | None = None
    policy: str = ""
    reason: str = ""
    claim: Annotated[ClaimRef | None, Field(exclude_if=lambda c: c is None)] = None


class EnforcementEvent(Frozen):
    """Payload of every enforce.* event: what the node agent did to a container's
    process on one card, and the figures that made it act.

    ``pod`` is the pod as the ledger places it on ``node``; None when the ledger
    has no such pod there (a pod gpuslice did not place: an ungranted process).
    ``pod_uid`` is always the one the process's cgroup names. Byte and percent
    figures that do not apply to the action are 0.
    """

    pod: PodRef | None
    pod_uid: Annotated[str, Field(min_length=1, max_length=128)]
    node: str
    container: str | None = None  # None: no grant directory of the pod matched
    card: Annotated[str, Field(min_length=1, max_length=96)]
    pid: Annotated[int, Field(ge=0)] = 0  # host PID acted on; 0 for a throttle
    used_bytes: Annotated[int, Field(ge=0)] = 0  # the container's memory on the card
    allowed_bytes: Annotated[int, Field(ge=0)] = 0  # grant + context allowance + margin
    busy_percent: Annotated[float, Field(ge=0, le=100)] = 0.0  # card time over the window
    share_percent: Annotated[int, Field(ge=0, le=100)] = 0  # the grant's compute share
    frozen_percent: Annotated[float, Field(ge=0, le=100)] = 0.0  # duty cycle frozen
    reason: Annotated[str, Field(max_length=1024)] = ""  # one readable line


PAYLOADS: dict[EventType, type[Frozen]] = {
    EventType.POD_ADMITTED: PodAdmitted,
    EventType.POD_DENIED: PodDenied,
    EventType.ALLOC_RESERVED: AllocationEvent,
    EventType.ALLOC_BOUND: AllocationEvent,
    EventType.ALLOC_ALLOCATED: AllocationEvent,
    EventType.ALLOC_RELEASED: AllocationEvent,
    EventType.ALLOC_FAILED: AllocationEvent,
    EventType.ALLOC_PREEMPTED: AllocationEvent,
    EventType.ENFORCE_MEMORY_KILL: EnforcementEvent,
    EventType.ENFORCE_THROTTLE: EnforcementEvent,
    EventType.ENFORCE_COMPUTE_KILL: EnforcementEvent,
    EventType.ENFORCE_UNGRANTED_KILL: EnforcementEvent,
}


class CloudEvent(BaseModel):
    """The structured-mode envelope. ``data`` is checked against the type's payload model."""

    model_config = ConfigDict(frozen=True, extra="allow")

    specversion: Literal["1.0"]  # required on the wire, as CloudEvents says
    id: Annotated[str, Field(min_length=1, max_length=200)]
    source: Annotated[str, Field(min_length=1)]
    type: EventType
    time: AwareDatetime  # RFC 3339: an offset is required
    subject: str | None = None
    datacontenttype: Literal["application/json"] = "application/json"
    data: dict[str, Any]

    def payload(self) -> Frozen:
        """The typed payload (already validated when this envelope was made)."""
        return PAYLOADS[self.type].model_validate(self.data)

    def to_json(self) -> bytes:
        return self.model_dump_json(exclude_none=True).encode()


def make_event(
    event_type: EventType,
    payload: Frozen,
    *,
    source: str,
    subject: str | None = None,
    event_id: str | None = None,
    time: datetime | None = None,
) -> CloudEvent:
    """Build an event; the payload must be the model registered for the type."""
    expected = PAYLOADS[event_type]
    if not isinstance(payload, expected):
        raise EventError(
            f"{event_type.value} carries {expected.__name__}, not {type(payload).__name__}"
        )
    try:
        return CloudEvent(
            specversion="1.0",
            id=event_id or str(uuid.uuid4()),
            source=source,
            type=event_type,
            time=time or utcnow(),
            subject=subject,
            data=payload.model_dump(mode="json"),
        )
    except ValidationError as exc:
        raise EventError(f"cannot build {event_type.value}: {_describe(exc)}") from None


def _describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "event"
        parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts)


def parse_event(raw: bytes | str) -> CloudEvent:
    """Parse and validate an event received from the wire, envelope and payload."""
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # also too deep, or an int too long
        raise EventError(f"not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise EventError("an event must be a JSON object")
    try:
        event = CloudEvent.model_validate(doc)
    except ValidationError as exc:
        raise EventError(f"bad CloudEvent envelope: {_describe(exc)}") from None
    try:
        PAYLOADS[event.type].model_validate(event.data)
    except ValidationError as exc:
        raise EventError(f"bad {event.type.value} data: {_describe(exc)}") from None
    return event
