"""What keeps the ledger true over time, run by whichever replica holds the lease.

* **Node liveness.** The node agent re-registers its node on every heartbeat
  (``inventory_interval``). A node silent for three ``heartbeat_interval``s is
  marked unavailable: its cards turn unhealthy, so the scheduler places nothing
  there, and its reservations stay until their pods go. Its next registration
  brings it back.
* **Expiry.** A reservation never allocated within ``reservation_ttl`` (kubelet
  never called Allocate: the bind failed, the pod was deleted before it
  started, the node died) is released with reason ``expired`` and an
  ``alloc.released`` event: no phantom reservations. A bound pod on another
  vendor's cards does not expire (that vendor's plugin allocates it, unseen
  here): it is released when the pod ends, or by reconciliation, as expired,
  when the pod is still not on its node after ``reservation_ttl``
  (:meth:`Upkeep.never_bound_here`).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from gpuslice_common.events import AllocationEvent, EventType, make_event
from gpuslice_common.ledger import Ledger
from gpuslice_common.models import NVIDIA, Placement, PlacementState
from gpuslice_common.outbox import Outbox

log = logging.getLogger(__name__)

SOURCE = "gpuslice/inventory"
MISSED_HEARTBEATS = 3
EXPIRED = "expired"


def _vendor_only(placement: Placement) -> bool:
    """Whether no container of the placement is on NVIDIA's cards (gpuslice's node
    agent never allocates it)."""
    return all(c.vendor != NVIDIA for c in placement.containers)


@dataclass
class UpkeepStats:
    sweeps: int = 0
    nodes_marked: int = 0
    released: Counter[str] = field(default_factory=Counter)  # by reason


class Upkeep:
    """One pass over the cluster: :meth:`sweep`."""

    def __init__(
        self,
        ledger: Ledger,
        heartbeat_interval: timedelta,
        reservation_ttl: timedelta,
        outbox: Outbox | None = None,
        on_release: Callable[[Placement], Awaitable[object]] | None = None,
    ) -> None:
        """``on_release`` is told of every pod this replica released (the
        telemetry store forgets the pod's usage)."""
        self.on_release = on_release
        self.ledger = ledger
        self.silence = heartbeat_interval * MISSED_HEARTBEATS
        self.reservation_ttl = reservation_ttl
        self.outbox = outbox
        self.stats = UpkeepStats()
        # Redis time of the first sweep of the current unbroken run of sweeps
        self.sweeping_since: datetime | None = None

    async def sweep(self) -> None:
        """Mark silent nodes, release expired reservations.

        Times are Redis's (the ledger's timestamps are), never this machine's.
        Nodes are marked only once sweeps have gone on without a failure for the
        whole silence: heartbeats that came while Redis (or every inventory) was
        away were lost, and the nodes must have had the time to send new ones.
        """
        try:
            await self._sweep()
        except Exception:
            self.sweeping_since = None
            raise

    async def _sweep(self) -> None:
        now = await self.ledger.now()
        if self.sweeping_since is None:
            self.sweeping_since = now
        judge = now - self.sweeping_since >= self.silence
        nodes = await self.ledger.nodes()
        for node in nodes:
            if judge and await self.ledger.mark_unavailable(node, now - self.silence):
                self.stats.nodes_marked += 1
                log.warning(
                    "node %s sent no heartbeat for %s: marked unavailable",
                    node,
                    self.silence,
                )
            for placement in await self.ledger.node_placements(node):
                if not self._expired(placement, now):
                    continue
                # Read again just before: kubelet may have allocated it meanwhile.
                current = await self.ledger.placement(placement.pod.uid)
                if current is not None and self._expired(current, now):
                    await self.release(placement.pod.uid, EXPIRED)
        self.stats.sweeps += 1

    def _expired(self, placement: Placement, now: datetime) -> bool:
        if placement.state not in (PlacementState.RESERVED, PlacementState.BOUND):
            return False
        if placement.state is PlacementState.BOUND and _vendor_only(placement):
            return False  # another vendor's plugin allocates it: released when the pod ends
        since = placement.reserved_at or placement.bound_at
        return since is not None and now - since > self.reservation_ttl

    def never_bound_here(self, placement: Placement, pod_node: str | None, now: datetime) -> bool:
        """Whether a bound pod on another vendor's cards, which the sweep keeps, is
        ``reservation_ttl`` past its reservation while the pod is not on the
        placement's node (``pod_node``, the pod's ``spec.nodeName``): its Binding
        never came, and its cards would be held as long as the pod exists."""
        if placement.state is not PlacementState.BOUND or not _vendor_only(placement):
            return False
        if pod_node == placement.node:
            return False
        since = placement.reserved_at or placement.bound_at
        return since is not None and now - since > self.reservation_ttl

    async def release(self, pod_uid: str, reason: str) -> bool:
        """Release a pod's devices and say so on the bus; False if the ledger
        held none for it or someone else released them first."""
        released = await self.ledger.release(pod_uid, reason)
        if released is None or not released.first:
            return False
        record = released.placement
        self.stats.released[reason] += 1
        log.info("released pod %s on %s: %s", pod_uid, record.node, reason)
        if self.on_release is not None:
            try:
                await self.on_release(record)
            except Exception as exc:  # the release stands; the usage expires anyway
                log.warning("after releasing pod %s: %s", pod_uid, exc)
        if self.outbox is not None:
            payload = AllocationEvent(
                pod=record.pod,
                node=record.node,
                containers=record.containers,
                policy=record.policy,
                reason=reason,
                claim=record.claim,
            )
            event = make_event(
                EventType.ALLOC_RELEASED,
                payload,
                source=SOURCE,
                subject=f"{record.pod.namespace}/{record.pod.name}",
            )
            self.outbox.submit(event)
        return True
