"""GPU-aware preemption, done by the extender at filter time.

kube-scheduler's preemption cannot see the GPU resources gpuslice manages
(``ignoredByScheduler``): its dry run finds no victim for a pod short of GPU
room and never calls the extender's preempt verb. So when filter finds that a
GPU pod fits none of its candidate nodes, :meth:`Preemptor.preempt`:

1. checks the pod may preempt: it asks for GPUs, its ``preemptionPolicy`` is not
   ``Never``, and, as the API server holds it (read again: the request body is
   not trusted for an act), it is the same UID, not bound, not being deleted;
   its ``spec.priority`` is the one the API server's priority admission set;
2. keeps a live nomination of the pod as it is (a retried filter, on any
   replica, never evicts a second set of victims): the pod waits for them;
3. otherwise, on each candidate node that failed for a reason preemption can
   cure (at most :data:`MAX_NODES`), reads the node's GPU pods (the ledger's
   holders) and each one's priority, start and state from the API server, and
   chooses victims (:mod:`gpuslice_scheduler.victims`): only pods of strictly
   lower priority, never a pod already going (being deleted, not bound there),
   never a pod whose eviction a PodDisruptionBudget refuses;
4. checks each victim's eviction with a dry run of the Eviction API (a budget
   that forbids it: that victim stays, choose again), claims the nomination in
   Redis (:mod:`gpuslice_common.nominations`; refused when another nomination
   appeared on the node meanwhile: choose again), then evicts each victim
   through the Eviction API, never deleting a pod directly;
5. records a Kubernetes Event ``Preempted`` on each victim naming the
   preemptor and ``Preempting`` on the preemptor, an ``alloc.preempted`` audit
   event per victim, the metrics, and sets the preemptor's
   ``status.nominatedNodeName``.

Until it binds or the nomination expires, the room stays held:
:meth:`Preemptor.holds` makes filter fail the node for pods of lower or equal
priority whose placement would take it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from gpuslice_common.events import AllocationEvent, EventType
from gpuslice_common.kube import (
    EvictionRefused,
    KubeApi,
    KubeError,
    PodNotFound,
    object_uid,
    pod_node,
    pod_terminated,
)
from gpuslice_common.ledger import Ledger, LedgerError
from gpuslice_common.models import Placement, PlacementState, PodRef
from gpuslice_common.nominations import Nomination, Nominations
from gpuslice_scheduler.engine import Demand
from gpuslice_scheduler.metrics import Metrics
from gpuslice_scheduler.victims import Choice, Holder, NodeRoom, best, choose_on_node
from gpuslice_scheduler.view import ClusterView, stop_if_cancelled

log = logging.getLogger(__name__)

COMPONENT = "gpuslice-scheduler"
PREEMPTING = "GpuPreemption"  # a failed node's reason while a pod waits for its victims
HELD = "GpuRoomNominated"  # a failed node's reason: its room is held for another pod
MAX_NODES = 64  # candidate nodes examined in one filter call
MAX_POD_READS = 512  # API reads of GPU pods in one filter call
MAX_ROUNDS = 3  # choices in one filter call (a victim a budget protects, a new nomination)
READS_AT_ONCE = 16
FACTS_TTL_S = 5.0  # a GPU pod's state, as read, is used this long
FACTS_KEPT = 8192
# kube-scheduler's range of priorities: int32 (system classes reach 2000001000)
MIN_PRIORITY, MAX_PRIORITY = -(2**31), 2**31 - 1


def pod_priority(pod: Mapping[str, Any]) -> int | None:
    """``spec.priority`` as kube-scheduler reads it (absent: 0); None when it is
    not an int32 (no admission writes that)."""
    spec = pod.get("spec")
    value = spec.get("priority", 0) if isinstance(spec, Mapping) else 0
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value if MIN_PRIORITY <= value <= MAX_PRIORITY else None


def may_preempt(pod: Mapping[str, Any]) -> bool:
    """Whether the pod's ``preemptionPolicy`` lets it preempt (absent: yes)."""
    spec = pod.get("spec")
    policy = spec.get("preemptionPolicy") if isinstance(spec, Mapping) else None
    return policy != "Never"


def _ref(pod: PodRef) -> str:
    return f"{pod.namespace}/{pod.name}"


@dataclass(frozen=True)
class Facts:
    """A GPU pod as the API server describes it, for a victim choice."""

    present: bool  # there (bound, or its bind under way), not being deleted, not ended
    priority: int
    started: str
    node: str
    cpu: float = 0.0
    memory: float = 0.0


GONE = Facts(False, MAX_PRIORITY, "", "")


class Preemptor:
    """Chooses and evicts GPU victims; holds nominated rooms (see the module)."""

    def __init__(
        self,
        ledger: Ledger,
        view: ClusterView,
        kube: KubeApi,
        nominations: Nominations,
        metrics: Metrics,
        send: Callable[[EventType, AllocationEvent], Awaitable[None]],
        request_of: Callable[[Mapping[str, Any]], tuple[float, float]],
        ttl_s: float = 300.0,
    ) -> None:
        self.ledger = ledger
        self.view = view
        self.kube = kube
        self.nominations = nominations
        self.metrics = metrics
        self.send = send
        self.request_of = request_of  # a pod's CPU and memory, as its demand counts them
        self.ttl_s = ttl_s
        self.live: list[Nomination] = []  # as last read; the filter's holds use it
        self._facts: collections.OrderedDict[str, tuple[float, Facts]] = collections.OrderedDict()
        # per node: (the ledger revision, the lowest priority of its GPU pods), where
        # every one of them was there: a pod not above it has nothing to look at
        self._floors: dict[str, tuple[int, int]] = {}
        self._problems: set[str] = set()
        self._instance = socket.gethostname()

    # ------------------------------------------------------------ holding rooms

    def holds(
        self, pod: Mapping[str, Any], demand: Demand, passed: Sequence[str]
    ) -> dict[str, str]:
        """Of ``passed``, the nodes where rooms held for other pods' nominations of
        equal or higher priority leave no room for this pod, each with why."""
        if not self.live or demand.request is None:
            return {}
        uid = object_uid(pod)
        priority = pod_priority(pod)
        priority = MIN_PRIORITY if priority is None else priority
        now = datetime.now(UTC)
        keep = set(passed)
        by_node: dict[str, list[Nomination]] = {}
        for n in self.live:
            if n.uid != uid and n.priority >= priority and n.node in keep and n.expires > now:
                by_node.setdefault(n.node, []).append(n)
        failed = {}
        for node, held in by_node.items():
            if node not in self.view.cluster.node_index:
                continue
            room = NodeRoom(self.view.cluster, node)
            if room.fits(demand, adding=[n.placement for n in held]):
                continue
            who = ", ".join(f"{_ref(n.placement.pod)} (priority {n.priority})" for n in held)
            failed[node] = (
                f"{HELD}: the GPU room here is held for {who}, which preempted pods of "
                "lower priority on this node"
            )
        if failed:
            self.metrics.failures.labels("filter", HELD).inc(len(failed))
        return failed

    async def run(self, interval: float) -> None:
        """Read the nominations every ``interval`` seconds, forever; drop those whose
        pod holds a reservation now (it bound, perhaps through another replica)
        or is gone, replaced (another UID) or ended: its room is no one's, and
        a replacement must not meet it as held and evict a second set."""
        failing = False
        while True:
            try:
                live, problems = await self.nominations.live()
                for problem in set(problems) - self._problems:
                    log.warning("left out: %s", problem)
                self._problems = set(problems)
                bound = [n.uid for n in live if not await self._still_waiting(n)]
                if bound:
                    await self.nominations.drop(bound)
                self.live = [n for n in live if n.uid not in bound]
                if failing:
                    log.info("nominations readable again")
                failing = False
            except LedgerError as exc:
                if not failing:
                    log.warning("cannot read the nominations: %s", exc)
                failing = True
            stop_if_cancelled()  # a cancel the Redis client swallowed amid a call
            await asyncio.sleep(interval)

    async def _still_waiting(self, nomination: Nomination) -> bool:
        """Whether the nominated pod still waits: it holds no reservation yet, and
        the API server has it (same UID, not being deleted, not ended)."""
        held = await self.ledger.placement(nomination.uid)
        if held is not None and held.state is not PlacementState.RELEASED:
            return False
        return (await self._fetch(nomination.placement.pod)).present

    async def bound(self, uid: str) -> None:
        """The pod bound: its nomination, if this replica knows one, ends."""
        if not any(n.uid == uid for n in self.live):
            return
        self.live = [n for n in self.live if n.uid != uid]
        try:
            await self.nominations.drop([uid])
        except LedgerError as exc:  # it expires, or the next read drops it
            log.warning("cannot drop the nomination of pod %s: %s", uid, exc)

    # ------------------------------------------------------------ preempting

    async def preempt(
        self, pod: Mapping[str, Any], demand: Demand, nodes: Sequence[str]
    ) -> tuple[str, str] | None:
        """Make room for ``pod`` (which fits none of ``nodes`` now) by evicting
        pods of lower priority on one of them; (the node, the line filter shows
        there) once the pod is nominated, else None."""
        if demand.request is None or not may_preempt(pod) or pod_priority(pod) is None:
            return None
        metadata = pod.get("metadata") or {}
        uid, namespace, name = object_uid(pod), metadata.get("namespace"), metadata.get("name")
        if not (uid and isinstance(namespace, str) and isinstance(name, str)):
            return None
        try:
            fresh = await self.kube.get_pod(namespace, name)
        except KubeError as exc:
            log.info("preemption for %s/%s: cannot read the pod: %s", namespace, name, exc)
            return None
        priority = pod_priority(fresh)
        if (
            object_uid(fresh) != uid
            or pod_node(fresh)
            or (fresh.get("metadata") or {}).get("deletionTimestamp")
            or priority is None
            or not may_preempt(fresh)
        ):
            return None
        try:
            return await self._preempt(fresh, uid, priority, demand, nodes)
        except LedgerError as exc:
            log.warning("preemption for %s/%s: %s", namespace, name, exc)
            self.metrics.preemptions.labels("error").inc()
            return None

    async def _preempt(
        self,
        pod: Mapping[str, Any],
        uid: str,
        priority: int,
        demand: Demand,
        nodes: Sequence[str],
    ) -> tuple[str, str] | None:
        existing = await self.nominations.get(uid)
        if existing is not None:
            offered = existing.node in nodes  # kube-scheduler's own filters still pass it
            if offered and (
                await self._victims_remain(existing) or await self._fits_now(existing, demand)
            ):
                return existing.node, _waiting(existing)
            # its victims are gone and still it fits nowhere (the room went to a
            # pod of higher priority, or the node changed), or kube-scheduler no
            # longer offers its node (CPU taken, a taint): choose afresh
            await self.nominations.drop([uid])
        known = self.view.cluster.node_index
        candidates = [n for n in nodes if n in known][:MAX_NODES]
        refused: set[str] = set()  # victims a budget protects
        token = self.nominations.new_token()
        for _ in range(MAX_ROUNDS):
            live, _problems = await self.nominations.live()
            choice = await self._choose(demand, uid, priority, candidates, live, refused)
            if choice is None:
                self.metrics.preemptions.labels("no_victims").inc()
                return None
            blocked = [v for v in choice.victims if not await self._evict(v, dry_run=True)]
            if blocked:
                refused.update(v.uid for v in blocked)
                continue
            counted = [n.uid for n in live if n.node == choice.node and n.uid != uid]
            claim = await self.nominations.claim(
                choice.placement,
                priority,
                [v.uid for v in choice.victims],
                self.ttl_s,
                counted,
                token,
            )
            if claim.outcome == "held" and claim.nomination is not None:
                return claim.nomination.node, _waiting(claim.nomination)
            if claim.outcome != "ok":
                continue  # another nomination on the node appeared: choose again
            return await self._carry_out(pod, priority, choice, refused)
        self.metrics.preemptions.labels("no_victims").inc()
        return None

    async def _carry_out(
        self, pod: Mapping[str, Any], priority: int, choice: Choice, refused: set[str]
    ) -> tuple[str, str] | None:
        nomination = Nomination(
            choice.placement,
            priority,
            tuple(v.uid for v in choice.victims),
            datetime.fromtimestamp(time.time() + self.ttl_s, UTC),
        )
        self.live = [n for n in self.live if n.uid != nomination.uid] + [nomination]
        preemptor = choice.placement.pod
        evicted: list[Holder] = []
        for victim in choice.victims:
            if not await self._evict(victim):
                refused.add(victim.uid)
                break
            evicted.append(victim)
        await self._record(preemptor, priority, choice.node, evicted)
        if len(evicted) < len(choice.victims):
            # a budget changed between the dry run and the eviction: the next
            # filter call chooses again (those evicted count as going then)
            await self.nominations.drop([nomination.uid])
            self.live = [n for n in self.live if n.uid != nomination.uid]
            self.metrics.preemptions.labels("refused").inc()
            return None
        self.metrics.preemptions.labels("nominated").inc()
        with contextlib.suppress(KubeError):  # informative: the hold is the nomination
            await self.kube.patch_pod_status(
                preemptor.namespace, preemptor.name, {"nominatedNodeName": choice.node}
            )
        return choice.node, _waiting(nomination)

    async def _victims_remain(self, nomination: Nomination) -> bool:
        """Whether a pod evicted for ``nomination`` still holds GPUs on its node."""
        victims = set(nomination.victims)
        placements = await self.ledger.node_placements(nomination.node)
        return any(
            p.pod.uid in victims and p.state is not PlacementState.RELEASED for p in placements
        )

    async def _fits_now(self, nomination: Nomination, demand: Demand) -> bool:
        """Whether the pod fits its nominated node as the ledger has it now: this
        copy of the ledger may not show the victims' release yet (the next
        filter call passes the node then)."""
        node = nomination.node
        with contextlib.suppress(LedgerError):
            await self.view.refresh_node(node)
        if node not in self.view.cluster.node_index:
            return False
        held = [
            n.placement
            for n in self.live
            if n.node == node and n.uid != nomination.uid and n.priority >= nomination.priority
        ]
        return NodeRoom(self.view.cluster, node).fits(demand, adding=held)

    async def _choose(
        self,
        demand: Demand,
        uid: str,
        priority: int,
        nodes: Sequence[str],
        live: Sequence[Nomination],
        refused: set[str],
    ) -> Choice | None:
        choices: list[Choice | None] = []
        reads = 0
        for order, node in enumerate(nodes):
            if node not in self.view.cluster.node_index:
                continue
            rev = self.view.revs.get(node)
            floor = self._floors.get(node)
            if rev is not None and floor is not None and floor[0] == rev and floor[1] >= priority:
                continue  # no pod of lower priority there, and the node has not changed
            try:
                placements = await self.ledger.node_placements(node)
            except LedgerError as exc:  # BadRecord included: that node cannot be judged
                log.info("preemption: node %s left out: %s", node, exc)
                continue
            placed = [
                p for p in placements if p.state is not PlacementState.RELEASED and p.pod.uid != uid
            ]
            reads += len(placed)
            if reads > MAX_POD_READS:
                break
            facts = await self._read(placed)
            holders: list[Holder] = []
            going: list[Holder] = []
            for placement, fact in zip(placed, facts, strict=True):
                stays = fact.present and fact.node == node
                level = MAX_PRIORITY if placement.pod.uid in refused else fact.priority
                holder = Holder(placement, level, fact.started, fact.cpu, fact.memory)
                (holders if stays else going).append(holder)
            if rev is not None and not going:
                lowest = min((f.priority for f in facts), default=MAX_PRIORITY)
                self._floors[node] = (rev, lowest)
            held = [
                n.placement
                for n in live
                if n.node == node and n.uid != uid and n.priority >= priority
            ]
            room = NodeRoom(self.view.cluster, node)
            choices.append(choose_on_node(room, demand, priority, holders, going, held, order))
        return best(choices)

    async def _read(self, placements: Sequence[Placement]) -> list[Facts]:
        """Each pod's facts, read from the API server unless read lately."""
        gate = asyncio.Semaphore(READS_AT_ONCE)

        async def one(placement: Placement) -> Facts:
            uid = placement.pod.uid
            now = time.monotonic()
            cached = self._facts.get(uid)
            if cached is not None and (not cached[1].present or now - cached[0] < FACTS_TTL_S):
                return cached[1]  # a pod that went does not come back
            async with gate:
                facts = await self._fetch(placement.pod)
            self._facts[uid] = (now, facts)
            self._facts.move_to_end(uid)
            while len(self._facts) > FACTS_KEPT:
                self._facts.popitem(last=False)
            return facts

        return list(await asyncio.gather(*(one(p) for p in placements)))

    async def _fetch(self, ref: PodRef) -> Facts:
        try:
            pod = await self.kube.get_pod(ref.namespace, ref.name)
        except PodNotFound:
            return GONE
        except KubeError as exc:  # cannot tell: it stays, and is no victim
            log.info("preemption: cannot read pod %s: %s", _ref(ref), exc)
            return Facts(True, MAX_PRIORITY, "", "")
        priority = pod_priority(pod)
        metadata = pod.get("metadata") or {}
        node = pod_node(pod)
        present = (
            object_uid(pod) == ref.uid
            and not metadata.get("deletionTimestamp")
            and not pod_terminated(pod)
        )
        if not present:
            return GONE
        if not node:  # its bind is under way (the ledger holds its cards): it stays, no victim
            return Facts(True, MAX_PRIORITY, "", "")
        started = metadata.get("creationTimestamp")
        cpu, memory = self.request_of(pod)
        return Facts(
            True,
            MAX_PRIORITY if priority is None else priority,  # unreadable: never a victim
            started if isinstance(started, str) else "",
            node,
            cpu,
            memory,
        )

    async def _evict(self, victim: Holder, *, dry_run: bool = False) -> bool:
        """True when the pod is evicted (or already gone); False when a
        PodDisruptionBudget, or an error, keeps it."""
        pod = victim.placement.pod
        try:
            await self.kube.evict_pod(pod.namespace, pod.name, pod.uid, dry_run=dry_run)
        except EvictionRefused as exc:
            log.info("preemption: %s stays: %s", _ref(pod), exc)
            self.metrics.failures.labels("preempt", "DisruptionBudget").inc()
            return False
        except PodNotFound:
            return True
        except KubeError as exc:
            log.warning("preemption: cannot evict %s: %s", _ref(pod), exc)
            return False
        if not dry_run:
            self._facts.pop(pod.uid, None)
        return True

    async def _record(
        self, preemptor: PodRef, priority: int, node: str, evicted: Sequence[Holder]
    ) -> None:
        """Events on the pods, the audit trail, the metrics."""
        names = ", ".join(v.ref for v in evicted) or "none: pods already ending make room"
        for victim in evicted:
            line = (
                f"Preempted by {_ref(preemptor)} (priority {priority}) on node {node}: "
                f"gpuslice evicted this pod (priority {victim.priority}) to free GPU room"
            )
            log.info("preemption: %s", line.replace("this pod", victim.ref))
            await self._event(victim.placement.pod, "Preempted", line)
            await self.send(
                EventType.ALLOC_PREEMPTED,
                AllocationEvent(
                    pod=victim.placement.pod,
                    node=node,
                    containers=victim.placement.containers,
                    policy=victim.placement.policy,
                    reason=(
                        f"preempted by {_ref(preemptor)} (uid {preemptor.uid}, priority "
                        f"{priority}); victim priority {victim.priority}"
                    )[:1024],
                ),
            )
        self.metrics.victims.inc(len(evicted))
        await self._event(
            preemptor,
            "Preempting",
            f"gpuslice nominated node {node} for this pod (priority {priority}); evicted: {names}",
        )

    async def _event(self, pod: PodRef, reason: str, message: str) -> None:
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {
                "name": f"{pod.name}.{time.time_ns():x}"[:253],
                "namespace": pod.namespace,
            },
            "involvedObject": {
                "apiVersion": "v1",
                "kind": "Pod",
                "namespace": pod.namespace,
                "name": pod.name,
                "uid": pod.uid,
            },
            "reason": reason,
            "message": message[:1024],
            "type": "Normal",
            "source": {"component": COMPONENT},
            "reportingComponent": COMPONENT,
            "reportingInstance": self._instance[:128],
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            await self.kube.create_event(pod.namespace, event)
        except KubeError as exc:  # the audit trail has it
            log.warning("cannot record event %s on %s: %s", reason, _ref(pod), exc)

    # ------------------------------------------------------------ kube-scheduler's own

    async def narrow(
        self, demand: Demand | None, victims: Mapping[str, Mapping[str, Any]]
    ) -> dict[str, Any]:
        """kube-scheduler's own proposal (victims it found for CPU, memory or
        other reasons), kept only on the nodes where the pod's GPUs fit once those
        victims are gone: elsewhere evicting them would not let it run."""
        if demand is None or demand.request is None:
            return dict(victims)
        kept: dict[str, Any] = {}
        for node, meta in victims.items():
            if node not in self.view.cluster.node_index:
                continue  # no GPU of it registered: the pod's GPUs cannot fit there
            uids = {p["UID"] for p in meta.get("Pods") or []}
            try:
                placements = await self.ledger.node_placements(node)
            except LedgerError as exc:
                log.info("preempt: node %s left out: %s", node, exc)
                continue
            gone = [
                Holder(p, 0, "")
                for p in placements
                if p.pod.uid in uids and p.state is not PlacementState.RELEASED
            ]
            if NodeRoom(self.view.cluster, node).fits(demand, gone):
                kept[node] = meta
        return kept


def _waiting(nomination: Nomination) -> str:
    count = len(nomination.victims)
    return (
        f"{PREEMPTING}: this pod is nominated to this node; {count} pod(s) of lower "
        "priority evicted for it are ending, and their GPU room is held for it"
    )
