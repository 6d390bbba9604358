"""Reconciliation: the ledger made to agree with the pods that exist.

Every pod the scheduler placed carries its placement as an annotation
(``gpuslice.io/placement``), written before its Binding: the durable record.
One pass reads the ledger, then lists every pod of the cluster, and:

* **restores** the reservation of a pod that is bound to a node, has not
  terminated and whose placement the ledger does not hold (Redis lost its data,
  or a release raced ahead): as allocated when the pod runs, else as bound.
  A restore checks fit: records that claim more than a card holds (an outdated
  annotation) are refused and counted as conflicts, never over-committed;
* **releases** what the ledger holds for a pod that has terminated (reason
  ``pod succeeded`` / ``pod failed``) or no longer exists (``pod deleted``);
  and a placement a DRA node prepared whose ResourceClaim is gone, was made
  again under its name (another uid), is no longer allocated or no longer
  reserved for the pod (``claim deleted`` / ``claim replaced`` / ``claim
  deallocated`` / ``claim not reserved for the pod``: the claims are listed once
  a pass, where the ledger holds such a placement or a pod to restore has
  claims). Such a pod carries no placement annotation: its claim is its durable
  record, and a pod bound to a node whose gpuslice claim the ledger lost is
  restored from the claim (checked as a prepare checks it) as allocated.
  A reservation younger than ``grace`` is left alone: the scheduler may have
  made it after the list was read. A bound pod on another vendor's cards (which
  never expires in the sweep) whose pod is still not on its node after the
  reservation TTL is released as ``expired``: its Binding never came;
* **stamps rebuilt** every node whose registration it read before the list and
  whose restores all got an answer: only then does the node take reservations,
  binds and allocations (``Ledger.mark_rebuilt``). A node that registered after
  the pass read the registrations (new, or Redis lost it), or whose ledger
  entered a new epoch during the pass (a failover), waits for the next.

Releases come before restores: a failover can lose a release together with a
reservation that reused its room, and the restore must find that room free.

So after Redis loses everything, the ledger is whole again within one pass
after the nodes registered again, and nothing is placed on a node before.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeVar

from pydantic import ValidationError

from gpuslice_common import dra
from gpuslice_common.kube import (
    KubeApi,
    KubeError,
    ObjectRef,
    object_uid,
    pod_end_reason,
    pod_node,
    pod_phase,
    pod_terminated,
)
from gpuslice_common.ledger import (
    BadRecord,
    Ledger,
    LedgerError,
    NodeRebuild,
    ReservationConflict,
)
from gpuslice_common.models import PLACEMENT_ANNOTATION, ClaimRef, Placement, PlacementState
from gpuslice_inventory.claims import ClaimRefused, claim_names, claim_placement
from gpuslice_inventory.lifecycle import DELETED
from gpuslice_inventory.upkeep import EXPIRED, Upkeep

log = logging.getLogger(__name__)

# ledger operations one pass keeps in flight (the ledger's own gate allows 64)
CONCURRENCY = 32
CLAIMS = ObjectRef(dra.API_VERSION, "resourceclaims")
CLAIM_DELETED = "claim deleted"
CLAIM_REPLACED = "claim replaced"
CLAIM_DEALLOCATED = "claim deallocated"
CLAIM_NOT_RESERVED = "claim not reserved for the pod"
Item = TypeVar("Item")
R = TypeVar("R")


@dataclass(frozen=True)
class ReconcileResult:
    pods: int  # pods listed
    held: int  # live reservations in the ledger before the pass
    restored: int
    released: int
    failed: int  # restores and stamps not done (node not registered yet, Redis failed)
    seconds: float
    released_by: Counter[str] = field(default_factory=Counter)  # by reason
    conflicts: int = 0  # restores refused: the cards hold too much already
    stamped: int = 0  # nodes this pass stamped rebuilt
    waiting: int = 0  # registered nodes left unstamped (restores failed, or too new)


def _admitted(pod: Mapping[str, Any]) -> bool:
    """Whether kubelet has admitted the pod (so allocated its containers): it runs,
    or kubelet has set its start time or a container's status (a pod still
    pulling images or running init containers is Pending, yet allocated). Such
    a pod restored as merely bound would hold its node's turn until it expired."""
    status = pod.get("status") or {}
    if pod_phase(pod) == "Running" or not isinstance(status, Mapping):
        return pod_phase(pod) == "Running"
    return bool(
        status.get("startTime")
        or status.get("containerStatuses")
        or status.get("initContainerStatuses")
    )


def claim_ended(ref: ClaimRef, pod_uid: str, claims: Mapping[tuple[str, str], Any]) -> str:
    """Why a prepared claim no longer holds its pod's placement ("" while it does):
    ``claims`` maps (namespace, name) to the claims listed."""
    claim = claims.get((ref.namespace, ref.name))
    if not isinstance(claim, Mapping):
        return CLAIM_DELETED
    metadata = claim.get("metadata")
    if not isinstance(metadata, Mapping) or metadata.get("uid") != ref.uid:
        return CLAIM_REPLACED
    status = claim.get("status")
    if not isinstance(status, Mapping) or not isinstance(status.get("allocation"), Mapping):
        return CLAIM_DEALLOCATED
    consumers = status.get("reservedFor")
    if not isinstance(consumers, list) or not any(
        isinstance(c, Mapping) and c.get("resource") == "pods" and c.get("uid") == pod_uid
        for c in consumers
    ):
        return CLAIM_NOT_RESERVED
    return ""


def _ours(claim: Mapping[str, Any]) -> bool:
    """Whether the claim's allocation holds a device of gpuslice's driver."""
    status = claim.get("status")
    allocation = status.get("allocation") if isinstance(status, Mapping) else None
    devices = allocation.get("devices") if isinstance(allocation, Mapping) else None
    results = devices.get("results") if isinstance(devices, Mapping) else None
    return isinstance(results, list) and any(
        isinstance(r, Mapping) and r.get("driver") == dra.DRIVER for r in results
    )


def _record(pod: Mapping[str, Any]) -> Placement | None:
    """The pod's placement annotation, when it has a readable one for itself."""
    metadata = pod.get("metadata")
    annotations = metadata.get("annotations") if isinstance(metadata, Mapping) else None
    raw = annotations.get(PLACEMENT_ANNOTATION) if isinstance(annotations, Mapping) else None
    if not isinstance(raw, str):
        return None
    try:
        placement = Placement.from_annotation(raw)
    except ValueError:
        log.warning("pod %s: unreadable %s annotation", object_uid(pod), PLACEMENT_ANNOTATION)
        return None
    return placement if placement.pod.uid == object_uid(pod) else None


class Reconciler:
    def __init__(
        self,
        ledger: Ledger,
        kube: KubeApi,
        upkeep: Upkeep,
        grace: timedelta = timedelta(seconds=30),
    ) -> None:
        self.ledger = ledger
        self.kube = kube
        self.upkeep = upkeep
        self.grace = grace
        self.last: ReconcileResult | None = None
        self._listed: dict[tuple[str, str], dict[str, Any]] = {}  # this pass's claims

    async def run_once(self) -> ReconcileResult:
        started = time.perf_counter()
        # The ledger is read before the pods are listed: a pod that ends while the
        # list is read is then held and found ended, or already released and
        # found ended; never released and found running (which would revive it).
        listed_at = await self.ledger.now()
        # Registrations are read before the list: a node stamped below registered
        # before the pods were listed, so the list has every pod bound to it.
        nodes = await self.ledger.rebuild_status()
        held, unreadable = await self._held()
        pods = {uid: pod for pod in await self.kube.list_all_pods() if (uid := object_uid(pod))}
        to_restore = [
            (uid, pod)
            for uid, pod in pods.items()
            if uid not in held
            and not pod_terminated(pod)
            and pod_node(pod)
            and pod_node(pod) not in unreadable
        ]
        to_release: list[tuple[str, str]] = []
        claims = await self._claims(held, [pod for _, pod in to_restore])
        self._listed = claims or {}
        for uid, placement in held.items():
            found = pods.get(uid)
            if found is None:
                since = placement.reserved_at or listed_at
                if listed_at - since < self.grace:
                    continue
                to_release.append((uid, DELETED))
            elif (ended := pod_end_reason(found)) is not None:
                to_release.append((uid, ended))
            elif self.upkeep.never_bound_here(placement, pod_node(found), listed_at):
                to_release.append((uid, EXPIRED))
            elif (
                placement.claim is not None
                and claims is not None
                and (why := claim_ended(placement.claim, uid, claims))
            ):
                to_release.append((uid, why))
        # releases before restores: a release the ledger lost (a failover) may
        # hold the room that a restore is to take back
        released: Counter[str] = Counter(
            reason for reason in await _each(to_release, self._release) if reason
        )
        # a card unknown on a node not registered when the pass began: not yet
        restores = [
            (node, "failed" if outcome == "conflict" and node not in nodes else outcome)
            for node, outcome in await _each(to_restore, self._restore)
        ]
        outcomes = Counter(outcome for _, outcome in restores)
        unfinished = {node for node, outcome in restores if outcome == "failed"} | unreadable
        stamped = waiting = unstamped = 0
        for node, status in nodes.items():
            if status.rebuilt_at is not None:
                continue
            outcome = "" if node in unfinished else await self._stamp(node, status)
            if outcome == "stamped":
                stamped += 1
            else:
                waiting += 1
                unstamped += outcome == "error"
        # a stamp the ledger did not answer is tried again as soon as a failed restore
        restored, failed = outcomes["restored"], outcomes["failed"] + unstamped
        result = ReconcileResult(
            pods=len(pods),
            held=len(held),
            restored=restored,
            released=sum(released.values()),
            failed=failed,
            seconds=time.perf_counter() - started,
            released_by=released,
            conflicts=outcomes["conflict"],
            stamped=stamped,
            waiting=waiting,
        )
        self.last = result
        return result

    async def _held(self) -> tuple[dict[str, Placement], set[str]]:
        """The live placements of every node, by pod uid, and the nodes whose
        records cannot be read: those are left alone (not restored, released or
        stamped) and named in the log; every other node is reconciled."""
        unreadable: set[str] = set()

        async def placements_of(node: str) -> list[Placement]:
            try:
                return await self.ledger.node_placements(node)
            except BadRecord as exc:
                log.warning("reconciliation leaves node %s alone: %s", node, exc)
                unreadable.add(node)
                return []

        held: dict[str, Placement] = {}
        for placements in await _each(await self.ledger.nodes(), placements_of):
            for placement in placements:
                if placement.state is not PlacementState.RELEASED:
                    held[placement.pod.uid] = placement
        return held, unreadable

    async def _claims(
        self, held: Mapping[str, Placement], unheld: Sequence[Mapping[str, Any]]
    ) -> dict[tuple[str, str], dict[str, Any]] | None:
        """Every ResourceClaim by (namespace, name), listed after the ledger was read
        (a claim prepared by then is in the list unless it went); only where the
        ledger holds a prepared claim or a pod it does not hold has claims. None
        when they cannot be listed: no claim is judged this pass."""
        if not any(p.claim is not None for p in held.values()) and not any(
            claim_names(pod) for pod in unheld
        ):
            return {}
        try:
            listed = await self.kube.list_objects(CLAIMS)
        except KubeError as exc:
            log.warning("cannot list ResourceClaims; prepared claims are judged next pass: %s", exc)
            return None
        claims: dict[tuple[str, str], dict[str, Any]] = {}
        for claim in listed:
            metadata = claim.get("metadata")
            if isinstance(metadata, Mapping):
                key = (metadata.get("namespace"), metadata.get("name"))
                if isinstance(key[0], str) and isinstance(key[1], str):
                    claims[(key[0], key[1])] = claim
        return claims

    async def _restore(self, item: tuple[str, Mapping[str, Any]]) -> tuple[str, str]:
        """Put back one pod's reservation from its annotation: its node, and
        restored, conflict, failed or ''."""
        uid, pod = item
        record = _record(pod)
        running = _admitted(pod)
        if record is None:
            # a prepared claim is allocated at once: kubelet never calls Allocate for it
            record, running = await self._from_claim(pod), True
        if record is None or record.node != pod_node(pod):
            return pod_node(pod), ""
        try:
            _, new = await self.ledger.restore(record, running=running)
        except ReservationConflict as exc:
            log.warning("cannot restore the reservation of pod %s: %s", uid, exc)
            return record.node, "conflict"
        except LedgerError as exc:
            log.warning("cannot restore the reservation of pod %s: %s", uid, exc)
            return record.node, "failed"
        if not new:
            return record.node, ""
        log.debug("restored the reservation of pod %s on %s", uid, record.node)
        return record.node, "restored"

    async def _from_claim(self, pod: Mapping[str, Any]) -> Placement | None:
        """The placement the pod's gpuslice claim (listed this pass) makes, checked
        as a prepare checks it; None when it has none or the claim does not hold."""
        metadata = pod.get("metadata")
        namespace = metadata.get("namespace") if isinstance(metadata, Mapping) else None
        if not isinstance(namespace, str):
            return None
        for name in claim_names(pod):
            claim = self._listed.get((namespace, name))
            if claim is None or not _ours(claim):
                continue
            try:
                ref = ClaimRef(namespace=namespace, name=name, uid=object_uid(claim))
            except ValidationError:
                return None
            node = pod_node(pod)
            try:
                cards = await self.ledger.node_gpus(node)
                return claim_placement(claim, pod, node, cards, ref).placement
            except ClaimRefused as exc:
                log.warning(
                    "pod %s is not restored from claim %s: %s", object_uid(pod), ref, exc.detail
                )
                return None
            except LedgerError as exc:
                log.warning("cannot read the cards of node %s: %s", node, exc)
                return None
        return None

    async def _stamp(self, node: str, status: NodeRebuild) -> str:
        """Stamp ``node`` if it is as the pass found it: same registration, and
        the same epoch (a failover during the pass may have lost its restores).
        ``stamped``; ``changed`` when it is not as found (its new registration
        gets a pass of its own); ``error`` when the ledger did not answer."""
        try:
            stamped = await self.ledger.mark_rebuilt(node, status.registered, status.epoch)
        except LedgerError as exc:
            log.warning("cannot stamp node %s rebuilt: %s", node, exc)
            return "error"
        if not stamped:
            return "changed"
        log.info("node %s is rebuilt: it takes reservations", node)
        return "stamped"

    async def _release(self, item: tuple[str, str]) -> str:
        uid, reason = item
        return reason if await self.upkeep.release(uid, reason) else ""


async def _each(items: Sequence[Item], work: Callable[[Item], Awaitable[R]]) -> list[R]:
    """``work`` on every item, at most CONCURRENCY at a time; results in order."""
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(item: Item) -> R:
        async with gate:
            return await work(item)

    return await asyncio.gather(*(one(item) for item in items))
