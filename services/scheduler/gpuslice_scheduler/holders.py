"""Reservations of ended pods, freed when they stand in a pending pod's way.

A pod's reservation is released by the inventory as its pod watch reports the
pod deleted or ended. kube-scheduler learns of the same deletion from its own
informer and retries the pods it parked at once: often before the inventory
has released, and then the retry fails on cards that nothing holds any more,
and the pod is parked again until some later cluster event or kube-scheduler's
five-minute timeout. So when filter or bind finds a node short of what
reservations hold, :class:`HolderCheck` asks the API server about the pods
holding them, one GET each (a read from etcd, never a watch's copy: once
kube-scheduler has seen the deletion, the object is gone from the API server),
and releases, through the ledger's own release, the reservations of pods it
says are gone (404, or the name now belongs to another UID) or terminal
(phase ``Succeeded`` or ``Failed``). The caller then reads the nodes again
and evaluates once more. In whichever order kube-scheduler and the inventory
learn of the deletion, the retry finds the cards free.

Only the API server's word frees anything: a pod that exists with the UID, in
any other phase (terminating included: its containers may still run), a
failed or slow read, a record without a pod name, all leave the reservation
as it is. The cost is bounded: the check runs only where a node failed, for at
most :data:`MAX_NODES` nodes and :data:`MAX_CHECKS` pods per call, all at once
under :data:`BUDGET_S`. A pod found gone or terminal is remembered (a UID never
comes back, a terminal phase never changes), so a release that failed is tried
again without asking. A pod found alive is not remembered: an answer from
before kube-scheduler saw a deletion would fail its retry, which is what this
check is for.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from gpuslice_common.kube import KubeApi, KubeError, PodNotFound, object_uid, pod_end_reason
from gpuslice_common.ledger import Ledger, LedgerError
from gpuslice_common.models import Placement, PlacementState
from gpuslice_scheduler.metrics import Metrics

log = logging.getLogger(__name__)

MAX_NODES = 16  # failed nodes whose reservations one call looks at
MAX_CHECKS = 16  # pods one call asks the API server about
BUDGET_S = 1.0  # all of one call's reads; a read not answered by then frees nothing
REMEMBERED = 1024  # pods known gone or terminal

# release reasons: the inventory's words for the same ends (a terminal pod's:
# :func:`~gpuslice_common.kube.pod_end_reason`)
DELETED = "pod deleted"

# a check's answers (the label of gpuslice_scheduler_holder_checks_total)
GONE, ENDED, ALIVE, ERROR = "gone", "terminal", "alive", "error"


@dataclass(frozen=True)
class Freed:
    """A reservation this check released."""

    placement: Placement  # as the ledger held it, released
    reason: str


class HolderCheck:
    """Frees the reservations of pods the API server says are gone or terminal."""

    def __init__(
        self,
        ledger: Ledger,
        kube: KubeApi,
        metrics: Metrics,
        on_freed: Callable[[Freed], Awaitable[None]] | None = None,
    ) -> None:
        """``on_freed`` is told of every reservation released here (the
        extender publishes ``alloc.released``)."""
        self.ledger = ledger
        self.kube = kube
        self.metrics = metrics
        self.on_freed = on_freed
        self._ended: collections.OrderedDict[str, str] = collections.OrderedDict()

    async def free(self, nodes: Sequence[str], pending: str, verb: str) -> list[Freed]:
        """Release the reservations on ``nodes`` (the first :data:`MAX_NODES`)
        of pods that are gone or terminal; ``pending`` is the UID of the pod
        waiting (its own reservation is not looked at), ``verb`` the caller."""
        holders = await self._holders(nodes[:MAX_NODES], pending)
        known = [(p, self._ended[p.pod.uid]) for p in holders if p.pod.uid in self._ended]
        unknown = [p for p in holders if p.pod.uid not in self._ended][:MAX_CHECKS]
        if unknown:
            asked = await self._ask_all(unknown)
            known += [(p, reason) for p, reason in zip(unknown, asked, strict=True) if reason]
        freed: list[Freed] = []
        for placement, reason in known:
            done = await self._release(placement, reason, pending, verb)
            if done is not None:
                freed.append(done)
        return freed

    async def _holders(self, nodes: Sequence[str], pending: str) -> list[Placement]:
        """The live reservations on ``nodes`` but ``pending``'s; a node whose
        reservations cannot be read has none here."""
        read = await asyncio.gather(
            *(self.ledger.node_placements(node) for node in nodes), return_exceptions=True
        )
        holders: list[Placement] = []
        for node, got in zip(nodes, read, strict=True):
            if isinstance(got, BaseException):
                if not isinstance(got, LedgerError):
                    raise got
                log.info("cannot read the reservations on %s: %s", node, got)
                continue
            holders += [
                p for p in got if p.state is not PlacementState.RELEASED and p.pod.uid != pending
            ]
        return holders

    async def _ask_all(self, holders: Sequence[Placement]) -> list[str]:
        """Per holder, the release reason the API server's answer gives, or ""."""
        tasks = [asyncio.ensure_future(self._ask(p)) for p in holders]
        done, late = await asyncio.wait(tasks, timeout=BUDGET_S)
        for task in late:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if late:
            self.metrics.holder_checks.labels(ERROR).inc(len(late))
            log.info(
                "%d pod read(s) not answered in %.1fs: their reservations stay", len(late), BUDGET_S
            )
        return [task.result() if task in done else "" for task in tasks]

    async def _ask(self, holder: Placement) -> str:
        """Why ``holder``'s reservation ends, in the API server's words, or ""
        (alive, or no answer: the reservation stays)."""
        pod = holder.pod
        if not pod.name:  # nothing to ask about
            self.metrics.holder_checks.labels(ERROR).inc()
            return ""
        try:
            found = await self.kube.get_pod(pod.namespace, pod.name)
        except PodNotFound:
            return self._ended_as(pod.uid, DELETED, GONE)
        except KubeError as exc:
            self.metrics.holder_checks.labels(ERROR).inc()
            log.info("cannot read pod %s/%s holding cards: %s", pod.namespace, pod.name, exc)
            return ""
        if object_uid(found) != pod.uid:  # the name was taken again: the holder is gone
            return self._ended_as(pod.uid, DELETED, GONE)
        reason = pod_end_reason(found)
        if reason is not None:
            return self._ended_as(pod.uid, reason, ENDED)
        self.metrics.holder_checks.labels(ALIVE).inc()
        return ""

    def _ended_as(self, uid: str, reason: str, answer: str) -> str:
        self.metrics.holder_checks.labels(answer).inc()
        self._ended[uid] = reason
        self._ended.move_to_end(uid)
        while len(self._ended) > REMEMBERED:
            self._ended.popitem(last=False)
        return reason

    async def _release(
        self, placement: Placement, reason: str, pending: str, verb: str
    ) -> Freed | None:
        pod = placement.pod
        try:
            released = await self.ledger.release(pod.uid, reason)
        except LedgerError as exc:  # asked again next time, without a read
            log.warning("cannot release pod %s/%s (%s): %s", pod.namespace, pod.name, reason, exc)
            return None
        self._ended.pop(pod.uid, None)  # released (by this call or the inventory): done
        if released is None or not released.first:
            return None  # the inventory released it meanwhile
        self.metrics.holders_freed.labels(verb).inc()
        log.info(
            "released pod %s/%s (%s) on %s: %s, says the API server; pod %s waits for its cards",
            pod.namespace,
            pod.name,
            pod.uid,
            placement.node,
            reason,
            pending,
        )
        freed = Freed(released.placement, reason)
        if self.on_freed is not None:
            await self.on_freed(freed)
        return freed
