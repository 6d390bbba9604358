"""The node agents' way to the ledger: NATS request-reply on ``<prefix>.node.<node>.<verb>``.

Node agents hold no ledger credential; they ask here (:mod:`gpuslice_common.nodeapi`).
The node a request acts on is the one its subject names, never one its payload
names: once each node's NATS credential may publish only to its own subjects,
a node can touch only its own slice of the ledger. What a DRA ``prepare`` grants
is read from the API server, never taken from the node
(:mod:`gpuslice_inventory.claims`). Every replica serves in the
inventory's queue group, so each request is answered once.

Every request gets a reply: the verb's, or an error reply with its kind (a
request that cannot be read is a ``bad-request``, logged in one line). The
``alloc.allocated`` and ``alloc.failed`` events of kubelet's Allocate are
published from here, through the inventory's outbox.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Generic, TypeVar

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import Error as NatsError
from pydantic import ValidationError

from gpuslice_common import dra
from gpuslice_common.events import (
    AllocationEvent,
    CloudEvent,
    EnforcementEvent,
    EventType,
    make_event,
)
from gpuslice_common.kube import KubeApi, KubeError, NotFound, ObjectRef
from gpuslice_common.ledger import (
    Allocation,
    AlreadyReserved,
    AmbiguousAllocation,
    ClaimConflict,
    Ledger,
    LedgerError,
    LedgerRebuilding,
    LedgerUnavailable,
    NotReserved,
    ReservationConflict,
)
from gpuslice_common.models import Frozen, Placement, PlacementState, PodRef
from gpuslice_common.nodeapi import (
    REQUESTS,
    AllocateRequest,
    AllocationReply,
    ClaimReply,
    Done,
    EnforcedRequest,
    ErrorKind,
    ErrorReply,
    FailedRequest,
    PlacementsReply,
    PodState,
    Pong,
    PreferredReply,
    PreferredRequest,
    PrepareRequest,
    UnprepareRequest,
    Verb,
)
from gpuslice_common.outbox import Outbox
from gpuslice_common.subjects import Subjects
from gpuslice_inventory.claims import (
    ClaimRefused,
    NotOnNode,
    claim_names,
    claim_placement,
    pod_on_node,
    reserved_pod,
)

log = logging.getLogger(__name__)

SOURCE = "gpuslice/inventory"
# events of one allocation share an id, so the audit stream keeps a retried one once
EVENT_NAMESPACE = uuid.UUID("5b0c6e1e-6c59-4c1b-9d1e-6a4f0c2f7a31")
# A failure that names no pod is recorded once per node, kind, count and this
# many seconds: a node asking again and again (or on purpose, to flood the
# audit stream) adds no events within one window (the stream's duplicate window
# drops the repeats, whose id is the same).
PODLESS_FAILURE_WINDOW_S = 60
# Enforcement reports a node may have recorded: a burst, then so many a second. The
# enforcer acts rarely (a kill, a throttle's start); a node's credential sending
# more is flooding the audit stream, whose retention would push real events out.
# Each pod has a budget of its own within its node's, so that a tenant making its
# processes be killed over and over cannot use up its neighbours' records.
ENFORCE_BURST = 100
ENFORCE_PER_S = 5.0
ENFORCE_POD_BURST = 20
ENFORCE_POD_PER_S = 1.0
MAX_BUDGETS = 100_000
# Claims a node may have prepared or unprepared: a burst (a node's pods starting at
# once), then so many a second, and so many at a time. Each reads the API server;
# a node's credential asking more is using the inventory to read it, or to slow it.
CLAIM_BURST = 200
CLAIM_PER_S = 50.0
CLAIMS_IN_FLIGHT = 16
RECENT_PODLESS = 4096  # ids remembered to keep repeats out of the outbox's queue


def podless_failure_id(node: str, kind: str, count: int, now: float | None = None) -> str:
    """The event id of an allocation failure without a pod, the same within a window."""
    window = int((time.time() if now is None else now) // PODLESS_FAILURE_WINDOW_S)
    return str(uuid.uuid5(EVENT_NAMESPACE, f"{node}/{kind}/{count}/{window}"))


ENFORCE_TYPES = {
    "memory-kill": EventType.ENFORCE_MEMORY_KILL,
    "throttle": EventType.ENFORCE_THROTTLE,
    "compute-kill": EventType.ENFORCE_COMPUTE_KILL,
    "ungranted-kill": EventType.ENFORCE_UNGRANTED_KILL,
}

MAX_IN_FLIGHT = 512
PING_TIMEOUT_S = 1.0
# DRA: how long reading a claim, its pod and the pod's other claims may take, and
# how many other claims of a pod are read (to refuse a second gpuslice claim)
KUBE_TIMEOUT_S = 5.0
MAX_POD_CLAIMS = 16
CLAIMS = ObjectRef(dra.API_VERSION, "resourceclaims")
NO_KUBE = "the inventory cannot read claims (no Kubernetes API)"
UNPREPARED = "claim unprepared"

TokenIssuer = Callable[[str, str], str]
Releaser = Callable[[str, str], Awaitable[bool]]  # (pod uid, reason): Upkeep.release
After = list[Callable[[], None]]  # what follows a reply: its events
Answer = Pong | AllocationReply | ClaimReply | PreferredReply | PlacementsReply | Done | ErrorReply


class KubeUnavailable(Exception):
    """The API server did not answer a read the request needs: ask again."""


K = TypeVar("K", str, tuple[str, str])


class Throttled(Exception):
    """The node asks faster than its budget allows: ask again later."""


class Budgets(Generic[K]):
    """Token buckets by key (a node, a node's pod): each holds up to ``burst``
    tokens, full when new, refilled at ``per_s`` a second. At most MAX_BUDGETS
    keys are kept (keys are nodes and their pods: only a defect gets past it)."""

    def __init__(self, burst: int, per_s: float) -> None:
        self.burst = burst
        self.per_s = per_s
        self._buckets: dict[K, tuple[float, float]] = {}

    def __contains__(self, key: K) -> bool:
        return key in self._buckets

    def tokens(self, key: K, now: float) -> float:
        """The key's tokens at ``now``."""
        budget = self._buckets.get(key)
        if budget is None:
            return float(self.burst)
        tokens, then = budget
        return min(float(self.burst), tokens + (now - then) * self.per_s)

    def keep(self, key: K, tokens: float, now: float) -> None:
        """Store the key's tokens as counted at ``now``."""
        if len(self._buckets) >= MAX_BUDGETS and key not in self._buckets:
            self._buckets.clear()
        self._buckets[key] = (tokens, now)

    def take(self, key: K, now: float) -> bool:
        """Take one token; False, taking nothing, when there is none."""
        tokens = self.tokens(key, now)
        allowed = tokens >= 1.0
        self.keep(key, tokens - (1.0 if allowed else 0.0), now)
        return allowed


def error_kind(exc: Exception) -> ErrorKind:
    """The error kind of a ledger exception: the one place that maps them."""
    if isinstance(exc, LedgerRebuilding):
        return ErrorKind.REBUILDING
    if isinstance(exc, AmbiguousAllocation):
        return ErrorKind.AMBIGUOUS
    if isinstance(exc, NotReserved):
        return ErrorKind.NOT_RESERVED
    if isinstance(exc, LedgerUnavailable):
        return ErrorKind.LEDGER_UNAVAILABLE
    if isinstance(exc, LedgerError):
        return ErrorKind.LEDGER_ERROR
    return ErrorKind.INTERNAL


class BadRequest(Exception):
    """A request that cannot be read; the message says why."""


@dataclass
class GatewayStats:
    requests: Counter[str] = field(default_factory=Counter)  # by verb
    errors: Counter[str] = field(default_factory=Counter)  # by error kind
    unanswerable: int = 0  # requests without a reply subject
    foreign_replies: int = 0  # requests whose reply subject is not the node's own inbox
    repeated_failures: int = 0  # pod-less failures not recorded again within their window
    enforce_dropped: int = 0  # enforcement reports past their node's rate, not recorded
    claims_throttled: int = 0  # prepare/unprepare requests past their node's budget


class NodeGateway:
    """Serves the node agents' requests with the ledger."""

    def __init__(
        self,
        ledger: Ledger,
        subjects: Subjects,
        outbox: Outbox | None = None,
        *,
        issue_telemetry_token: TokenIssuer | None = None,
        max_in_flight: int = MAX_IN_FLIGHT,
        kube: KubeApi | None = None,
        release: Releaser | None = None,
    ) -> None:
        """``kube`` reads the claims DRA nodes prepare (without it each is refused);
        ``release`` gives back an unprepared claim's pod and announces it
        (:meth:`Upkeep.release <gpuslice_inventory.upkeep.Upkeep.release>`)."""
        self.ledger = ledger
        self.kube = kube
        self.release = release
        self.subjects = subjects
        self.outbox = outbox
        self.issue_telemetry_token = issue_telemetry_token
        self.max_in_flight = max_in_flight
        self.stats = GatewayStats()
        self._tasks: set[asyncio.Task[None]] = set()
        self._subscription: Subscription | None = None
        # ids of pod-less failures recorded lately: a repeat is not queued again
        self._recent_podless: collections.OrderedDict[str, None] = collections.OrderedDict()
        # enforcement reports a node, and a pod on it, may still have recorded
        self._enforce_budget: Budgets[str] = Budgets(ENFORCE_BURST, ENFORCE_PER_S)
        self._enforce_pod_budget: Budgets[tuple[str, str]] = Budgets(
            ENFORCE_POD_BURST, ENFORCE_POD_PER_S
        )
        # claims a node may still prepare or unprepare, and how many it has in flight
        self.claim_budget: Budgets[str] = Budgets(CLAIM_BURST, CLAIM_PER_S)
        self.claims_in_flight = CLAIMS_IN_FLIGHT
        self._claims_busy: Counter[str] = Counter()
        self._handlers: dict[Verb, Callable[[str, Frozen, After], Awaitable[Answer]]] = {
            Verb.PING: self._ping,
            Verb.ALLOCATE: self._allocate,
            Verb.PREFERRED: self._preferred,
            Verb.PLACEMENTS: self._placements,
            Verb.FAILED: self._failed,
            Verb.ENFORCED: self._enforced,
            Verb.PREPARE: self._prepare,
            Verb.UNPREPARE: self._unprepare,
        }

    async def start(self, nc: NATS, queue: str) -> Subscription:
        self._subscription = await nc.subscribe(
            self.subjects.node_requests_all, queue=queue, cb=self._on_msg
        )
        return self._subscription

    async def close(self, timeout: float = 2.0) -> None:
        """Stop taking requests; those in flight get up to ``timeout`` to answer."""
        if self._subscription is not None:
            with contextlib.suppress(Exception):
                await self._subscription.unsubscribe()
            self._subscription = None
        if self._tasks:
            _, stuck = await asyncio.wait(set(self._tasks), timeout=timeout)
            for task in stuck:
                task.cancel()
            if stuck:
                await asyncio.wait(stuck)

    async def _on_msg(self, msg: Msg) -> None:
        if not self._answerable(msg):
            return
        # one task each: a request waiting for Redis must not hold up the others
        if len(self._tasks) >= self.max_in_flight:
            busy = ErrorReply(error=ErrorKind.LEDGER_UNAVAILABLE, message="inventory busy")
            await self._respond(msg, busy)
            return
        task = asyncio.create_task(self._serve(msg))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, msg: Msg) -> None:
        after: After = []
        answer = await self.answer(msg.subject, msg.data, after)
        await self._respond(msg, answer)
        if after:
            await asyncio.sleep(0)  # the reply goes out before the events are built
            for step in after:
                step()

    async def answer(self, subject: str, data: bytes, after: After | None = None) -> Answer:
        """The reply to one request; never raises. What is to follow the reply (its
        events) is appended to ``after``; without it, it is done at once."""
        steps: After = [] if after is None else after
        try:
            return await self._answer(subject, data, steps)
        finally:
            if after is None:
                for step in steps:
                    step()

    async def _answer(self, subject: str, data: bytes, after: After) -> Answer:
        try:
            node, verb, request = self._parse(subject, data)
        except BadRequest as exc:
            self.stats.errors[ErrorKind.BAD_REQUEST] += 1
            log.warning("bad request on %s: %s", subject[:300], exc)
            return ErrorReply(error=ErrorKind.BAD_REQUEST, message=str(exc)[:1024])
        self.stats.requests[verb] += 1
        try:
            return await self._handlers[verb](node, request, after)
        except BadRequest as exc:
            log.warning("bad %s request from node %s: %s", verb, node, exc)
            answer = ErrorReply(error=ErrorKind.BAD_REQUEST, message=str(exc)[:1024])
        except ClaimRefused as exc:
            log.warning("%s for node %s refused: %s", verb, node, exc.detail[:2048])
            answer = ErrorReply(error=ErrorKind.BAD_CLAIM, message=exc.reason[:1024])
        except Throttled as exc:
            self.stats.claims_throttled += 1
            if self.stats.claims_throttled % 1000 == 1:
                log.warning("%s (%d so far)", exc, self.stats.claims_throttled)
            answer = ErrorReply(error=ErrorKind.BUSY, message=str(exc)[:1024])
        except KubeUnavailable as exc:
            log.warning("%s for node %s: %s", verb, node, exc)
            answer = ErrorReply(error=ErrorKind.KUBE_UNAVAILABLE, message=str(exc)[:1024])
        except LedgerError as exc:
            kind = error_kind(exc)
            if kind != ErrorKind.NOT_RESERVED:
                log.warning("%s for node %s: %s", verb, node, exc)
            answer = ErrorReply(error=kind, message=str(exc)[:1024])
        except Exception as exc:  # a defect here: the node gets an answer, the log the trace
            log.exception("%s for node %s failed", verb, node)
            answer = ErrorReply(
                error=ErrorKind.INTERNAL, message=f"{type(exc).__name__}: {exc}"[:1024]
            )
        self.stats.errors[answer.error] += 1
        return answer

    def _parse(self, subject: str, data: bytes) -> tuple[str, Verb, Frozen]:
        parsed = self.subjects.parse_node_request(subject)
        if parsed is None:
            raise BadRequest(f"not a node request subject: {subject[:300]!r}")
        node, name = parsed
        try:
            verb = Verb(name)
        except ValueError:
            raise BadRequest(f"unknown verb {name!r}") from None
        model = REQUESTS[verb]
        try:
            request = model.model_validate_json(data or b"{}")
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or 'request'}: {e['msg']}"
                for e in exc.errors()[:5]
            )
            raise BadRequest(f"not a valid {verb} request: {problems}") from None
        return node, verb, request

    def _answerable(self, msg: Msg) -> bool:
        """Serve only requests whose answer goes to the requesting node's own inbox.

        The reply subject is the requester's to choose: one naming an audit
        subject would have the inventory's answer stored as an event. Such a
        request, one without a reply subject, and one whose subject names no node
        are dropped before they change anything, and counted.
        """
        if not msg.reply:
            self.stats.unanswerable += 1
            return False
        parsed = self.subjects.parse_node_request(msg.subject)
        if parsed is None:  # no node: no inbox to answer in
            self.stats.errors[ErrorKind.BAD_REQUEST] += 1
            log.warning("bad request on %s: not a node request subject", msg.subject[:300])
            return False
        if msg.reply.startswith(Subjects.node_inbox(parsed[0]) + "."):
            return True
        self.stats.foreign_replies += 1
        count = self.stats.foreign_replies
        if count in (1, 10, 100) or count % 1000 == 0:
            log.warning(
                "dropped a request on %s to be answered on %s, not the node's own inbox"
                " (%d so far)",
                msg.subject[:300],
                msg.reply[:300],
                count,
            )
        return False

    async def _respond(self, msg: Msg, answer: Answer) -> None:
        try:
            await msg.respond(answer.model_dump_json().encode())
        except (NatsError, OSError) as exc:  # the node asks again
            log.warning("reply on %s not sent: %s", msg.subject, exc)

    # ------------------------------------------------------------ verbs

    async def _ping(self, node: str, request: Frozen, after: After) -> Answer:
        try:
            alive = await asyncio.wait_for(self.ledger.ping(), PING_TIMEOUT_S)
        except TimeoutError:
            alive = False
        if not alive:
            raise LedgerUnavailable("Redis did not answer a ping")
        return Pong()

    async def _allocate(self, node: str, request: Frozen, after: After) -> Answer:
        assert isinstance(request, AllocateRequest)
        try:
            allocation = await self.ledger.allocate(node, request.count, request.request_id)
        except NotReserved as exc:
            why = "ambiguous" if isinstance(exc, AmbiguousAllocation) else "no-pending-pod"
            self._podless_failure(after, node, why, request.count, str(exc))
            raise
        except LedgerError as exc:
            if not isinstance(exc, LedgerRebuilding):  # asked again soon, not a failure yet
                self._podless_failure(after, node, "ledger-unavailable", request.count, str(exc))
            raise
        token = ""
        if self.issue_telemetry_token is not None:
            token = self.issue_telemetry_token(node, allocation.placement.pod.uid)
        # retried requests share the event id: the audit stream keeps it once
        event_id = str(uuid.uuid5(EVENT_NAMESPACE, f"{node}/{request.request_id}"))
        after.append(
            partial(
                self._publish, EventType.ALLOC_ALLOCATED, node, allocation, "", event_id=event_id
            )
        )
        return AllocationReply(
            placement=allocation.placement,
            container_index=allocation.container_index,
            telemetry_token=token,
        )

    async def _prepare(self, node: str, request: Frozen, after: After) -> Answer:
        """DRA: read the claim kubelet named and its pod from the API server, check
        them (:func:`~gpuslice_inventory.claims.claim_placement`), record the pod's
        placement allocated (idempotent) and answer whose each device is."""
        assert isinstance(request, PrepareRequest)
        with self._claim_turn(node):
            return await self._prepare_claim(node, request, after)

    async def _prepare_claim(self, node: str, request: PrepareRequest, after: After) -> Answer:
        ref = request.claim
        if self.kube is None:
            raise ClaimRefused(NO_KUBE)
        claim = await self._read(
            self.kube.get_object(CLAIMS.in_namespace(ref.namespace).named(ref.name)),
            NotOnNode(ref, node, f"claim {ref.namespace}/{ref.name} does not exist"),
        )
        pod_name = reserved_pod(claim, ref, node)
        pod = await self._read(
            self.kube.get_pod(ref.namespace, pod_name),
            NotOnNode(ref, node, f"pod {ref.namespace}/{pod_name} does not exist"),
        )
        pod_on_node(claim, pod, node, ref)  # the claim is the node's: the rest is its business
        others: list[dict[str, Any]] = []
        for name in dict.fromkeys(n for n in claim_names(pod) if n != ref.name):
            if len(others) >= MAX_POD_CLAIMS:
                raise ClaimRefused(
                    f"pod {ref.namespace}/{pod_name} has more than {MAX_POD_CLAIMS} claims"
                )
            with contextlib.suppress(NotFound):  # kubelet cannot prepare it either
                others.append(
                    await self._read(
                        self.kube.get_object(CLAIMS.in_namespace(ref.namespace).named(name)),
                        None,
                    )
                )
        cards = await self.ledger.node_gpus(node)
        prepared = claim_placement(claim, pod, node, cards, ref, other_claims=others)
        try:
            made = await self.ledger.record_claim(prepared.placement)
        except ClaimConflict as exc:
            raise ClaimRefused(f"{exc}: gpuslice prepares one ResourceClaim per pod") from None
        except AlreadyReserved as exc:
            raise ClaimRefused(f"claim {ref}: {exc}") from None
        except ReservationConflict as exc:
            if exc.reason == "NodeNotDra":
                raise ClaimRefused(
                    f"node {node} is not in DRA mode: its cards are granted by the device "
                    "plugin, never by a claim"
                ) from None
            raise ClaimRefused(f"claim {ref}: {exc}") from None
        placement = made.placement
        token = ""
        if self.issue_telemetry_token is not None:
            token = self.issue_telemetry_token(node, placement.pod.uid)
        if made.created:
            log.info("prepared claim %s for pod %s on %s", ref, placement.pod.uid, node)
        # a retried prepare shares the event id: the audit stream keeps it once
        event_id = str(uuid.uuid5(EVENT_NAMESPACE, f"{node}/claim/{ref.uid}"))
        after.append(partial(self._publish_claim, placement, event_id))
        return ClaimReply(
            claim=ref, placement=placement, devices=prepared.devices, telemetry_token=token
        )

    async def _unprepare(self, node: str, request: Frozen, after: After) -> Answer:
        """DRA: release the pod's placement of this claim on this node; nothing held
        (released already, another claim's, another node's): done all the same."""
        assert isinstance(request, UnprepareRequest)
        with self._claim_turn(node, spend=False):
            return await self._unprepare_claim(node, request)

    async def _unprepare_claim(self, node: str, request: UnprepareRequest) -> Answer:
        ref = request.claim
        held: Placement | None = None
        if request.pod_uid is not None:
            held = await self.ledger.placement(request.pod_uid)
        else:  # the agent lost which pod it was: the node's placement of this claim
            for placement in await self.ledger.node_placements(node):
                if placement.claim is not None and placement.claim.uid == ref.uid:
                    held = placement
        if (
            held is None
            or held.node != node
            or held.state is PlacementState.RELEASED
            or held.claim is None
            or held.claim.uid != ref.uid
        ):
            return Done()
        if self.release is not None:
            await self.release(held.pod.uid, UNPREPARED)
        else:
            await self.ledger.release(held.pod.uid, UNPREPARED, kubelet_may_admit=False)
        log.info("unprepared claim %s of pod %s on %s", ref, held.pod.uid, node)
        return Done()

    @contextlib.contextmanager
    def _claim_turn(self, node: str, *, spend: bool = True) -> Iterator[None]:
        """A prepare or unprepare of ``node``, within its budget: one of
        :attr:`claims_in_flight` places and, for a prepare (``spend``: it reads
        the API server), a token of :attr:`claim_budget`; past either,
        :class:`Throttled` (the node asks again later). An unprepare reads no
        object and only frees room."""
        if self._claims_busy[node] >= self.claims_in_flight:
            raise Throttled(
                f"node {node} has {self.claims_in_flight} claims being prepared or "
                "unprepared: ask again later"
            )
        if spend and not self.claim_budget.take(node, time.monotonic()):
            raise Throttled(
                f"node {node} asks to prepare claims more than "
                f"{self.claim_budget.per_s:g} a second: ask again later"
            )
        self._claims_busy[node] += 1
        try:
            yield
        finally:
            self._claims_busy[node] -= 1
            if not self._claims_busy[node]:
                del self._claims_busy[node]

    async def _read(
        self, call: Awaitable[dict[str, Any]], missing: ClaimRefused | None
    ) -> dict[str, Any]:
        """An object from the API server, within KUBE_TIMEOUT_S: ``missing`` refuses
        the claim when it does not exist (None passes NotFound on); no answer raises
        :class:`KubeUnavailable`."""
        try:
            return await asyncio.wait_for(call, KUBE_TIMEOUT_S)
        except NotFound:
            if missing is None:
                raise
            raise missing from None
        except TimeoutError:
            raise KubeUnavailable(
                f"the Kubernetes API did not answer within {KUBE_TIMEOUT_S:g} s"
            ) from None
        except KubeError as exc:
            # what failed may name an object the node is not shown: the log says it
            log.warning("a read for a claim failed: %s", exc)
            status = f" (HTTP {exc.status})" if exc.status is not None else ""
            raise KubeUnavailable(f"the Kubernetes API failed{status}") from None

    def _publish_claim(self, placement: Placement, event_id: str) -> None:
        """``alloc.allocated`` of a prepared claim: every container it grants, the claim."""
        if self.outbox is None:
            return
        payload = AllocationEvent(
            pod=placement.pod,
            node=placement.node,
            containers=placement.containers,
            policy=placement.policy,
            claim=placement.claim,
        )
        event = make_event(
            EventType.ALLOC_ALLOCATED,
            payload,
            source=SOURCE,
            subject=placement.pod.uid,
            event_id=event_id,
        )
        self.outbox.submit(event)

    async def _preferred(self, node: str, request: Frozen, after: After) -> Answer:
        assert isinstance(request, PreferredRequest)
        upcoming = await self.ledger.next_allocation(node, request.count)
        return PreferredReply(devices=tuple(g.uuid for g in upcoming.devices) if upcoming else ())

    async def _placements(self, node: str, request: Frozen, after: After) -> Answer:
        placements = await self.ledger.node_placements(node)
        return PlacementsReply(
            pods=tuple(PodState(uid=p.pod.uid, state=p.state) for p in placements)
        )

    async def _failed(self, node: str, request: Frozen, after: After) -> Answer:
        assert isinstance(request, FailedRequest)
        placement = await self.ledger.placement(request.pod_uid)
        if placement is None or placement.node != node:
            raise NotReserved(f"pod {request.pod_uid} has no placement on node {node}")
        names = [c.name for c in placement.containers]
        if request.container not in names:
            raise BadRequest(f"pod {request.pod_uid} has no container {request.container!r}")
        allocation = Allocation(placement, names.index(request.container))
        after.append(
            partial(self._publish, EventType.ALLOC_FAILED, node, allocation, request.reason)
        )
        return Done()

    async def _enforced(self, node: str, request: Frozen, after: After) -> Answer:
        """Record what the node's agent did to a process: the node is the subject's,
        the pod the ledger's placement on that node (None when it has none there)."""
        assert isinstance(request, EnforcedRequest)
        if not self._enforce_allowed(node, request.pod_uid):
            self.stats.enforce_dropped += 1
            if self.stats.enforce_dropped % 1000 == 1:
                log.warning(
                    "node %s: enforcement reports past %g a second not recorded (%d so far)",
                    node,
                    ENFORCE_PER_S,
                    self.stats.enforce_dropped,
                )
            return Done()  # answered: a retry would only send it again
        placement = await self.ledger.placement(request.pod_uid)
        pod = placement.pod if placement is not None and placement.node == node else None
        payload = EnforcementEvent(
            pod=pod,
            pod_uid=request.pod_uid,
            node=node,
            container=request.container,
            card=request.card,
            pid=request.pid,
            used_bytes=request.used_bytes,
            allowed_bytes=request.allowed_bytes,
            busy_percent=request.busy_percent,
            share_percent=request.share_percent,
            frozen_percent=request.frozen_percent,
            reason=request.reason,
        )
        event = make_event(
            ENFORCE_TYPES[request.kind],
            payload,
            source=SOURCE,
            subject=request.pod_uid,
            event_id=str(uuid.uuid5(EVENT_NAMESPACE, f"{node}/enforce/{request.request_id}")),
        )
        after.append(partial(self._submit, event))
        return Done()

    def _enforce_allowed(self, node: str, pod_uid: str) -> bool:
        """Take one enforcement report from the pod's budget and its node's (token
        buckets); False, taking nothing, when either is spent."""
        now = time.monotonic()
        pod_key = (node, pod_uid)
        node_tokens = self._enforce_budget.tokens(node, now)
        pod_tokens = self._enforce_pod_budget.tokens(pod_key, now)
        allowed = node_tokens >= 1.0 and pod_tokens >= 1.0
        taken = 1.0 if allowed else 0.0
        self._enforce_budget.keep(node, node_tokens - taken, now)
        if allowed or pod_key in self._enforce_pod_budget:
            # a pod's budget is kept once a report of it was recorded: a node naming
            # ever new pods fills the table only as fast as its own budget allows
            self._enforce_pod_budget.keep(pod_key, pod_tokens - taken, now)
        return allowed

    def _submit(self, event: CloudEvent) -> None:
        if self.outbox is not None:
            self.outbox.submit(event)

    def _podless_failure(self, after: After, node: str, kind: str, count: int, why: str) -> None:
        """Record, after the reply, an allocation failure that names no pod."""
        event_id = podless_failure_id(node, kind, count)
        reason = f"{kind.replace('-', ' ')}: {why}"
        after.append(
            partial(self._publish, EventType.ALLOC_FAILED, node, None, reason, event_id=event_id)
        )

    def _publish(
        self,
        event_type: EventType,
        node: str,
        allocation: Allocation | None,
        reason: str,
        *,
        event_id: str | None = None,
    ) -> None:
        if self.outbox is None:
            return
        if allocation is None and event_id is not None:
            if event_id in self._recent_podless:
                self.stats.repeated_failures += 1
                return
            self._recent_podless[event_id] = None
            if len(self._recent_podless) > RECENT_PODLESS:
                self._recent_podless.popitem(last=False)
        if allocation is None:
            payload = AllocationEvent(pod=None, node=node, reason=reason[:1024])
            pod: PodRef | None = None
        else:
            placement = allocation.placement
            container = placement.containers[allocation.container_index]
            pod = placement.pod
            payload = AllocationEvent(
                pod=pod,
                node=node,
                containers=(container,),
                container=container.name,
                policy=placement.policy,
                reason=reason[:1024],
            )
        event = make_event(
            event_type,
            payload,
            source=SOURCE,
            subject=pod.uid if pod else None,
            event_id=event_id,
        )
        self.outbox.submit(event)
