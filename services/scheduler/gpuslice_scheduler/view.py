"""The scheduler's copy of the ledger's cards, kept fresh by change notices and revisions.

Filter and prioritize read this copy and never wait on Redis. Every ledger
change to a node bumps its revision and announces the node on the ledger's
changes channel: an announced node is re-read at once. :meth:`ClusterView.sync`
reads all revisions in one round trip and re-reads the nodes whose revision
moved, or whose epoch did (a failover: every rebuilt stamp went stale); it
runs at start, after (re)subscribing, every ``resync`` seconds, and
every ``interval`` seconds while notices are unavailable.
The copy may lag by one sync interval: that only affects scores, because bind
reserves through the ledger, which checks capacity atomically, and a lost race
refreshes the node at once.

A node whose record cannot be read (a value no gpuslice writes: an older
version's, or one set by hand) is left out of the copy, as if unregistered, and
listed in :attr:`ClusterView.skipped` with the reason; every other node stays
in sync, and the node comes back once its record reads again.

With :class:`~gpuslice_scheduler.resources.NodeResources`, each node's free CPU
and memory in the copy are what kube-scheduler's cache would say: set for every
node when the copy is built, and for the nodes it reports changed each time
:meth:`ClusterView.follow_resources` runs (before every evaluation), whose
evaluations are then redone. Without it they are infinite.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable, Sequence

import numpy as np

from gpuslice_common.ledger import BadRecord, Ledger, LedgerError, NodeCards, StoredCard
from gpuslice_common.models import NVIDIA, Placement, VgpuMode
from gpuslice_scheduler.cluster import CardFacts, Cluster, Ints, Row
from gpuslice_scheduler.mig import HAMI_CORE, CardMode, MigCard
from gpuslice_scheduler.resources import NodeResources

log = logging.getLogger(__name__)


def stop_if_cancelled() -> None:
    """Raise CancelledError where this task was asked to stop and something on the
    way swallowed the cancel (the Redis client, amid a call; on Python 3.11, a
    timeout that ended as the cancel came): the task still counts the request."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


def _row(card: StoredCard) -> Row:
    return (
        card.uuid,
        card.model,
        -1 if card.numa is None else card.numa,
        card.cap_mem,
        card.cap_cores,
        card.cap_slots,
        card.used_mem,
        card.used_cores,
        card.used_slots,
        bool(card.owner),
        card.healthy,
        card.present,
        card.cordoned,
    )


def _mode(card: StoredCard) -> CardMode:
    if card.mode is VgpuMode.HAMI_CORE and card.vendor == NVIDIA:
        return HAMI_CORE
    state = card.mig_state
    if state is None:
        return CardMode(card.mode, vendor=card.vendor)
    mig = MigCard.make(state.profiles, state.slices, state.static)
    return CardMode(card.mode, mig, state.used, card.vendor)


class ClusterView:
    """Every registered node's cards as one :class:`Cluster`, refreshed by revision."""

    def __init__(
        self,
        ledger: Ledger,
        interval: float = 1.0,
        resync: float = 30.0,
        resources: NodeResources | None = None,
    ) -> None:
        self.ledger = ledger
        self.resources = resources
        self.interval = interval
        self.resync = resync
        self.listening = False
        self._dirty: set[str] = set()
        self._wake = asyncio.Event()
        self._heard: dict[str, asyncio.Event] = {}  # per node, set at its next notice
        self._resync_due = 0.0
        self.rows: dict[str, list[Row]] = {}
        self.modes: dict[str, list[CardMode]] = {}  # per node, each card's mode (rows' order)
        self.indexes: dict[str, list[int]] = {}  # per node, each card's index (rows' order)
        self.revs: dict[str, int | None] = {}
        self.epochs: dict[str, str] = {}  # the epoch each node was last read in
        self.skipped: dict[str, str] = {}  # node -> why its record cannot be read
        self.cluster = Cluster.from_rows([])
        self.synced = False
        # registered nodes not stamped rebuilt yet: the ledger refuses to reserve there
        self.rebuilding: set[str] = set()
        # nodes whose agent serves kubelet through DRA: no device-plugin pod goes there
        self.dra: set[str] = set()
        # per node, reservations made here and counted before a read showed them:
        # (the node's revision with the reservation, the placement)
        self._pending: dict[str, list[tuple[int, Placement]]] = {}

    async def sync(self) -> int:
        """Re-read nodes that changed (and new ones); returns how many were re-read.

        A node whose revision cannot be read is re-read every time (to say why).
        """
        names = await self.ledger.nodes()
        revs = await self.ledger.revisions(names)
        # a failover or restart leaves revisions as they were but every stamp
        # stale: a node read in another epoch is read again
        epochs = await self.ledger.epochs(names)
        changed = [
            n
            for n in names
            if revs[n] is None or revs[n] != self.revs.get(n) or epochs.get(n) != self.epochs.get(n)
        ]
        gone = (set(self.rows) | set(self.skipped)) - set(names)
        updated, removed = (await self._take(changed)) if changed else ([], False)
        self.epochs.update(epochs)
        for node in gone:
            removed |= self.rows.pop(node, None) is not None
            self.modes.pop(node, None)
            self.indexes.pop(node, None)
            self.revs.pop(node, None)
            self.epochs.pop(node, None)
            self.rebuilding.discard(node)
            self.dra.discard(node)
            self.skipped.pop(node, None)
            self._pending.pop(node, None)
        if updated or removed or not self.synced:
            self._rebuild(updated, removed)
        self.synced = True
        return len(changed)

    async def _take(self, nodes: Sequence[str]) -> tuple[list[str], bool]:
        """Read ``nodes`` into :attr:`rows`; returns the nodes read and whether a node
        left the copy (its record cannot be read any more)."""
        read = await self.ledger.read_nodes(nodes, vendor=None)  # every vendor's cards
        updated: list[str] = []
        removed = False
        for node, got in read.items():
            if isinstance(got, NodeCards):
                self.rows[node] = [_row(card) for card in got.cards]
                self.modes[node] = [_mode(card) for card in got.cards]
                self.indexes[node] = [card.index for card in got.cards]
                self.revs[node] = got.rev
                self._settle({node: got.rev})
                if got.rebuilt:
                    self.rebuilding.discard(node)
                else:
                    self.rebuilding.add(node)
                if got.dra:
                    self.dra.add(node)
                else:
                    self.dra.discard(node)
                if self.skipped.pop(node, None) is not None:
                    log.info("node %s can be read again; it is back in the scheduler's copy", node)
                updated.append(node)
            else:
                removed |= self._skip(node, got)
        return updated, removed

    def _skip(self, node: str, problem: BadRecord) -> bool:
        """Leave ``node`` out of the copy; True when it was in."""
        if self.skipped.get(node) != problem.problem:
            log.warning("left out of the scheduler's copy: %s", problem)
        self.skipped[node] = problem.problem
        self.revs[node] = None  # read again next sync
        self.dra.discard(node)
        self.modes.pop(node, None)
        self.indexes.pop(node, None)
        return self.rows.pop(node, None) is not None

    def _rebuild(self, changed: Sequence[str], removed: bool) -> None:
        cluster = self.cluster
        in_place = not removed and all(n in cluster.node_index for n in changed)
        if in_place:
            for node in changed:
                if not self._update_node(cluster, node):
                    in_place = False
                    break
        if not in_place:
            nodes = sorted(self.rows.items())
            cpu, memory = self._free([name for name, _ in nodes])
            modes = [self.modes[name] for name, _ in nodes]
            self.cluster = Cluster.from_rows(nodes, cpu, memory, modes)
            self._recount(list(self._pending))
        else:
            self._recount([n for n in changed if n in self._pending])

    def _update_node(self, cluster: Cluster, node: str) -> bool:
        """Overwrite one node's usage in place; False when its card list changed shape."""
        i = cluster.node_index[node]
        lo, hi = int(cluster.node_start[i]), int(cluster.node_start[i + 1])
        rows, modes = self.rows[node], self.modes[node]
        if [r[0] for r in rows] != cluster.uuids[lo:hi] or any(
            (r[1], m.mode, m.vendor) not in cluster.kind_index
            for r, m in zip(rows, modes, strict=True)
        ):
            return False
        # a re-read that finds what the copy holds (a bind, an allocation: the
        # cards' usage is unchanged) leaves the node's evaluations standing
        changed = [
            (card, row, mode)
            for card, (row, mode) in enumerate(zip(rows, modes, strict=True), start=lo)
            if cluster.row(card) != row or cluster.card_mode(card) != mode
        ]
        if changed:
            facts = False
            for card, row, mode in changed:
                facts |= cluster.set_row(card, row, mode)
            cluster.touch([i], facts=facts)
        return True

    def _free(self, names: Sequence[str]) -> tuple[list[float] | None, list[float] | None]:
        """Free CPU and memory of ``names`` (None: not followed, infinite)."""
        if self.resources is None:
            return None, None
        self.resources.take_changed()  # every node is read now, changed or not
        free = [self.resources.free(name) for name in names]
        return [cpu for cpu, _ in free], [memory for _, memory in free]

    def follow_resources(self) -> None:
        """Bring the copy's free CPU and memory up to the nodes that changed."""
        if self.resources is None:
            return
        cluster = self.cluster
        touched: list[int] = []
        for name in self.resources.take_changed():
            i = cluster.node_index.get(name)
            if i is None:
                continue
            cpu, memory = self.resources.free(name)
            if cluster.node_cpu_free[i] != cpu or cluster.node_mem_free[i] != memory:
                cluster.node_cpu_free[i], cluster.node_mem_free[i] = cpu, memory
                touched.append(i)
        if touched:
            cluster.touch(touched)

    def weighs_resources(self) -> bool:
        """Whether any node of the copy has a known free CPU and memory."""
        return bool(np.isfinite(self.cluster.node_cpu_free).any())

    def card_facts(self, node: str) -> dict[str, CardFacts]:
        """Each card of ``node`` in the copy, by UUID ({} for a node not in it)."""
        rows, indexes = self.rows.get(node, ()), self.indexes.get(node, ())
        return {r[0]: CardFacts(i, r[1]) for r, i in zip(rows, indexes, strict=True)}

    def node_indexes(self, names: Sequence[str]) -> tuple[Ints, list[str]]:
        """Indexes of the known nodes among ``names`` (in order), and the unknown names."""
        return self.cluster.lookup(names)

    def apply(self, placement: Placement, rev: int) -> None:
        """Count a reservation this process made, at once; ``rev`` is the node's
        revision the reservation produced.

        A re-read of the node at that revision or later has counted it already;
        one from before (in flight while the reservation was made) must not wipe
        it out: it stays counted over such reads until a read reaches ``rev``.
        """
        node = placement.node
        if (self.revs.get(node) or -1) >= rev or node not in self.cluster.node_index:
            return
        self._pending.setdefault(node, []).append((rev, placement))
        self._count(placement)

    def _count(self, placement: Placement) -> None:
        cluster = self.cluster
        node = cluster.node_index[placement.node]
        lo, hi = int(cluster.node_start[node]), int(cluster.node_start[node + 1])
        where = {u: lo + k for k, u in enumerate(cluster.uuids[lo:hi])}
        for uuid, fp in placement.footprint().items():
            c = where.get(uuid)
            if c is None:
                continue
            cluster.used_mem[c] += fp.memory_mib
            cluster.used_cores[c] += fp.cores
            cluster.used_slots[c] += fp.slots
            cluster.owned[c] |= fp.exclusive
            cluster.mig_used[c] |= fp.mig_mask
        cluster.touch([node])

    def _settle(self, read: dict[str, int]) -> None:
        """Forget the reservations that the reads ``read`` (node -> revision) counted."""
        for node, rev in read.items():
            pending = [p for p in self._pending.pop(node, ()) if p[0] > rev]
            if pending:
                self._pending[node] = pending

    def _recount(self, nodes: Iterable[str]) -> None:
        """Count again, over fresh reads of ``nodes``, the reservations they lack."""
        for node in nodes:
            for _, placement in self._pending.get(node, ()):
                if node in self.cluster.node_index:
                    self._count(placement)

    async def refresh(self, nodes: Sequence[str]) -> None:
        """Re-read ``nodes`` now (announced changes, a lost race)."""
        updated, removed = await self._take(nodes)
        if updated or removed:
            self._rebuild(updated, removed)

    async def refresh_node(self, node: str) -> None:
        await self.refresh([node])

    async def changed(self, node: str, timeout: float) -> None:
        """Return at the next notice of a change to ``node`` (a bind waiting for the
        node's turn hears it pass), or after ``timeout`` seconds without one."""
        heard = self._heard.setdefault(node, asyncio.Event())
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await heard.wait()

    async def _listen(self) -> None:
        """Follow the ledger's change notices: an announced node is re-read at once."""

        def subscribed() -> None:
            self.listening = True
            self._resync_due = 0.0  # changes before the subscription: read everything again
            self._wake.set()

        try:
            while True:
                try:
                    async for node in self.ledger.watch_changes(on_subscribed=subscribed):
                        self._dirty.add(node)
                        self._wake.set()
                        heard = self._heard.pop(node, None)
                        if heard is not None:
                            heard.set()
                except NotImplementedError:  # Redis Cluster: polling only
                    return
                except Exception as exc:  # lost, or a fault of ours: polled until back
                    stop_if_cancelled()
                    if self.listening:
                        if isinstance(exc, LedgerError):
                            log.warning("%s; polling the ledger until they resume", exc)
                        else:
                            log.exception("following the ledger's change notices failed")
                    self.listening = False
                    self._wake.set()  # polling starts now, not after a resync's wait
                    await asyncio.sleep(self.interval)
        finally:
            self.listening = False  # however it ends, nothing follows the notices

    async def run(self) -> None:
        """Keep the copy fresh forever; a Redis outage is logged and retried, never fatal.

        With change notices, announced nodes are re-read at once and everything
        every ``resync`` seconds; without them (Redis Cluster, or while the
        notices are down), every node's revision is read every ``interval``.
        """
        listener = asyncio.create_task(self._listen(), name="ledger-changes")
        failing = False
        try:
            while True:
                self._wake.clear()
                dirty: list[str] = []
                try:
                    now = time.monotonic()
                    if not self.listening or now >= self._resync_due:
                        # Set first: a subscription made during the sync asks for another.
                        self._resync_due = now + self.resync
                        self._dirty.clear()
                        await self.sync()
                    elif self._dirty:
                        dirty, self._dirty = sorted(self._dirty), set()
                        await self.refresh(dirty)
                    if failing:
                        log.info("ledger reachable again; the scheduler's copy is in sync")
                    failing = False
                except Exception as exc:  # the copy must outlive any one failure
                    self._dirty.update(dirty)
                    self._resync_due = 0.0
                    if not failing:
                        if isinstance(exc, LedgerError):
                            log.warning("cannot sync the scheduler's copy of the ledger: %s", exc)
                        else:
                            log.exception("syncing the scheduler's copy of the ledger failed")
                    failing = True
                wait = self.interval
                if self.listening and not failing:
                    wait = max(0.0, self._resync_due - time.monotonic())
                stop_if_cancelled()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wait):
                        await self._wake.wait()
                stop_if_cancelled()
        finally:
            listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await listener
