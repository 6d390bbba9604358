"""What a node agent may ask the inventory, and the answers: NATS request-reply.

A node agent holds no ledger credential. It asks the inventory on
``<prefix>.node.<node token>.<verb>`` (:meth:`Subjects.node_request`); the
inventory takes the node from the subject, never from the payload, so a node
whose credential may publish only to its own subjects acts only on its own
slice of the ledger. Every request gets an answer: the verb's reply or an
:class:`ErrorReply` saying what kind of failure it was.

Verbs: ``ping`` (the inventory and its ledger answer), ``allocate`` (the next
container for kubelet's Allocate, idempotent per request id), ``preferred``
(the container ``allocate`` would hand out now, for GetPreferredAllocation),
``placements`` (the state of each pod the ledger places on the node, to find
pods that ended) and ``failed`` (the agent could not prepare a container the
ledger handed out: the inventory records ``alloc.failed``).

In DRA mode (:mod:`gpuslice_common.dra`) kubelet names the claim it wants
prepared: ``prepare`` has the inventory read that ResourceClaim and its pod from
the API server itself, check that kube-scheduler allocated it on this node's
cards, record it in the ledger and answer the grants (idempotent per claim);
``unprepare`` releases what ``prepare`` recorded for the claim.
"""

from __future__ import annotations

import enum
from typing import Annotated, Literal

from pydantic import Field, TypeAdapter, ValidationError

from gpuslice_common.models import (
    K8S_LABEL_PATTERN,
    ClaimRef,
    Frozen,
    Placement,
    PlacementState,
)

# what kubelet's one Allocate may ask for, and a retry's key for its answer
MAX_DEVICES = 64
RequestId = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
PodUid = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_-]+$")]
DeviceCount = Annotated[int, Field(ge=1, le=MAX_DEVICES)]
Reason = Annotated[str, Field(max_length=1024)]


class Verb(enum.StrEnum):
    PING = "ping"
    ALLOCATE = "allocate"
    PREFERRED = "preferred"
    PLACEMENTS = "placements"
    FAILED = "failed"
    ENFORCED = "enforced"
    PREPARE = "prepare"
    UNPREPARE = "unprepare"


class ErrorKind(enum.StrEnum):
    BAD_REQUEST = "bad-request"  # not a valid request (subject, verb or payload)
    NOT_RESERVED = "not-reserved"  # no pod waits for it on this node
    BAD_CLAIM = "bad-claim"  # DRA: the claim cannot be prepared here; the message says why
    AMBIGUOUS = "ambiguous"  # several pods could be the one kubelet admits: refused
    LEDGER_UNAVAILABLE = "ledger-unavailable"  # Redis unreachable: try again
    KUBE_UNAVAILABLE = "kube-unavailable"  # DRA: the API server did not answer: try again
    REBUILDING = "rebuilding"  # the node's ledger is being rebuilt: try again soon
    BUSY = "busy"  # the node asks faster than its budget allows: try again later
    LEDGER_ERROR = "ledger-error"  # Redis refused the operation
    INTERNAL = "internal"  # the inventory failed otherwise; its log says why

    @property
    def transient(self) -> bool:
        """Whether asking again (the same request) may succeed."""
        return self in (
            ErrorKind.LEDGER_UNAVAILABLE,
            ErrorKind.KUBE_UNAVAILABLE,
            ErrorKind.REBUILDING,
            ErrorKind.BUSY,
        )


# ------------------------------------------------------------------ requests


class PingRequest(Frozen):
    pass


class AllocateRequest(Frozen):
    """Hand out the next container asking for ``count`` GPUs; a retry passes the
    same ``request_id`` and gets the same container."""

    request_id: RequestId
    count: DeviceCount


class PreferredRequest(Frozen):
    count: DeviceCount


class PlacementsRequest(Frozen):
    pass


class FailedRequest(Frozen):
    """The agent could not prepare a container the ledger handed out."""

    pod_uid: PodUid
    container: Annotated[str, Field(min_length=1, max_length=253)]
    reason: Reason


EnforceKind = Literal["memory-kill", "throttle", "compute-kill", "ungranted-kill"]


class EnforcedRequest(Frozen):
    """The agent acted on a container's process (gpuslice_deviceplugin.enforcer):
    the inventory records it as an ``enforce.<kind>`` event of the node the subject
    names, with the pod as its ledger places it there. A retry passes the same
    ``request_id`` and is recorded once."""

    request_id: RequestId
    kind: EnforceKind
    pod_uid: PodUid
    container: Annotated[str, Field(min_length=1, max_length=253)] | None = None
    card: Annotated[str, Field(min_length=1, max_length=96)]
    pid: Annotated[int, Field(ge=0, le=2**31)] = 0
    used_bytes: Annotated[int, Field(ge=0, le=2**64)] = 0
    allowed_bytes: Annotated[int, Field(ge=0, le=2**64)] = 0
    busy_percent: Annotated[float, Field(ge=0, le=100)] = 0.0
    share_percent: Annotated[int, Field(ge=0, le=100)] = 0
    frozen_percent: Annotated[float, Field(ge=0, le=100)] = 0.0
    reason: Reason = ""


class PrepareRequest(Frozen):
    """DRA: prepare this claim kube-scheduler allocated on the node (idempotent)."""

    claim: ClaimRef


class UnprepareRequest(Frozen):
    """DRA: release what :class:`PrepareRequest` recorded for the claim (idempotent);
    ``pod_uid`` is the pod it was prepared for, as the agent kept it."""

    claim: ClaimRef
    pod_uid: PodUid | None = None


REQUESTS: dict[Verb, type[Frozen]] = {
    Verb.PING: PingRequest,
    Verb.ALLOCATE: AllocateRequest,
    Verb.PREFERRED: PreferredRequest,
    Verb.PLACEMENTS: PlacementsRequest,
    Verb.FAILED: FailedRequest,
    Verb.ENFORCED: EnforcedRequest,
    Verb.PREPARE: PrepareRequest,
    Verb.UNPREPARE: UnprepareRequest,
}


# ------------------------------------------------------------------ replies


class Pong(Frozen):
    kind: Literal["pong"] = "pong"


class AllocationReply(Frozen):
    """One container's devices, with everything the agent puts into its answer."""

    kind: Literal["allocation"] = "allocation"
    placement: Placement
    container_index: Annotated[int, Field(ge=0)]
    # 0: an Allocate that more than one pod could be meant by is refused
    # (ErrorKind.AMBIGUOUS); kept so that replies stay readable across versions
    rivals: Annotated[int, Field(ge=0)] = 0
    # the container's own telemetry credential; empty where no auth callout runs
    telemetry_token: Annotated[str, Field(max_length=4096)] = ""

    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(g.uuid for g in self.placement.containers[self.container_index].devices)


# a claim's request name, or "<request>/<subrequest>" where it was a firstAvailable list
RequestName = Annotated[
    str,
    Field(
        min_length=1,
        max_length=127,
        pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(/[a-z0-9]([-a-z0-9]*[a-z0-9])?)?$",
    ),
]


class ClaimDevice(Frozen):
    """One device of the claim's allocation and the container whose grant holds it."""

    request: RequestName
    pool: Annotated[str, Field(min_length=1, max_length=253)]
    device: Annotated[str, Field(min_length=1, max_length=63, pattern=K8S_LABEL_PATTERN)]
    uuid: Annotated[str, Field(min_length=1, max_length=128)]
    container: Annotated[str, Field(min_length=1, max_length=63, pattern=K8S_LABEL_PATTERN)]


class ClaimReply(Frozen):
    """A prepared claim: the pod's placement as the ledger records it (its containers
    that use the claim, each with its grants) and which device is whose."""

    kind: Literal["claim"] = "claim"
    claim: ClaimRef
    placement: Placement
    devices: Annotated[tuple[ClaimDevice, ...], Field(min_length=1, max_length=MAX_DEVICES)]
    # the pod's own telemetry credential; empty where no auth callout runs
    telemetry_token: Annotated[str, Field(max_length=4096)] = ""


class PreferredReply(Frozen):
    kind: Literal["preferred"] = "preferred"
    devices: tuple[str, ...] = ()  # the next container's GPUs; none waits: empty


class PodState(Frozen):
    uid: str
    state: PlacementState


class PlacementsReply(Frozen):
    kind: Literal["placements"] = "placements"
    pods: tuple[PodState, ...] = ()


class Done(Frozen):
    kind: Literal["done"] = "done"


class ErrorReply(Frozen):
    kind: Literal["error"] = "error"
    error: ErrorKind
    message: Reason


Reply = Annotated[
    Pong | AllocationReply | ClaimReply | PreferredReply | PlacementsReply | Done | ErrorReply,
    Field(discriminator="kind"),
]
REPLY: TypeAdapter[Reply] = TypeAdapter(Reply)


class NodeRequestError(Exception):
    """A request failed: the inventory's error reply, or no answer at all."""

    def __init__(self, kind: ErrorKind | Literal["no-answer"], message: str) -> None:
        super().__init__(message)
        self.kind = kind

    @property
    def transient(self) -> bool:
        return self.kind == "no-answer" or self.kind.transient


def parse_reply(data: bytes) -> Reply:
    """The reply in ``data``; a reply that is none of ours is an INTERNAL error reply."""
    try:
        return REPLY.validate_json(data)
    except ValidationError as exc:
        return ErrorReply(
            error=ErrorKind.INTERNAL, message=f"unreadable reply: {exc.errors()[0]['msg']}"
        )


__all__ = [
    "MAX_DEVICES",
    "REQUESTS",
    "AllocateRequest",
    "AllocationReply",
    "ClaimDevice",
    "ClaimReply",
    "Done",
    "ErrorKind",
    "ErrorReply",
    "FailedRequest",
    "NodeRequestError",
    "PingRequest",
    "PlacementsReply",
    "PlacementsRequest",
    "PodState",
    "Pong",
    "PreferredReply",
    "PreferredRequest",
    "PrepareRequest",
    "Reply",
    "RequestName",
    "UnprepareRequest",
    "Verb",
    "parse_reply",
]
