"""The console's cluster snapshot, built from the ledger, the telemetry store and
the scheduler's report.

Incremental as the scheduler's copy is (``gpuslice_scheduler.view``): each
refresh reads the registered nodes and their revisions, and re-reads cards and
placements only of nodes whose revision moved (or that a change notice named);
everything is re-read every ``resync`` seconds, since a failover may keep
revisions and change the data. Telemetry, liveness and the report are read
once per tick (``full``). The document's ``version`` grows only when its
content changes.

Every vendor's cards are in it, each with its vendor; a node lists NVIDIA's
first, then the others by vendor. Vendors count cores in their own units
(percent of a card for most, 16 a card for Moore Threads, AI cores for
Ascend), so the cluster's figures are given per vendor too (``vendors``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import orjson

from gpuslice_common.ledger import BadRecord, Ledger, NodeCards, NodeLiveness, StoredCard
from gpuslice_common.models import Placement, PlacementState, utcnow, vendor_order
from gpuslice_common.occupancy import card_grants
from gpuslice_common.reports import SchedulerReport, read_report
from gpuslice_inventory.console.history import HistoryStore
from gpuslice_inventory.telemetry import ContainerUsage, TelemetryStore

log = logging.getLogger(__name__)
MIB = 1024 * 1024
RESYNC_S = 30.0


def iso(when: datetime | None) -> str | None:
    """RFC 3339 in UTC with a ``Z``, as the page shows it."""
    if when is None:
        return None
    return when.isoformat().replace("+00:00", "Z")


COUNTER_MAX = 2**64 - 1  # what telemetry's counters hold; JSON numbers of the API stay in range


def sane_usage(usage: ContainerUsage) -> bool:
    """Whether a stored usage entry holds numbers telemetry can have written:
    counters from 0 to 2**64-1 and a finite SM share from 0 to 100 %. The store
    is read as untrusted: one entry beyond these (set by hand, an older writer)
    is left out rather than break the snapshot for every viewer."""
    counters = (
        usage.used_bytes,
        usage.limit_bytes,
        usage.throttled_ns,
        usage.denied_allocations,
        usage.peak_bytes,
    )
    if not all(isinstance(c, int) and 0 <= c <= COUNTER_MAX for c in counters):
        return False
    sm = usage.sm_percent
    return isinstance(sm, int | float) and 0.0 <= sm <= 100.0 and 0 <= usage.at_ms <= 2**53


def allocated(cards: Iterable[dict[str, Any]]) -> bool:
    """Whether anything is allocated on ``cards`` (card documents): where
    nothing is, there is nothing to fragment, and the scheduler's measure (the
    free share its learned pod kinds cannot use, whole free cards included) is
    not shown as fragmentation."""
    return any(any(card["used"].values()) for card in cards)


@dataclass
class NodeEntry:
    """One registered node as last read."""

    rev: int | None
    rebuilt: bool = False
    cards: list[StoredCard] = field(default_factory=list)
    placements: list[Placement] = field(default_factory=list)
    problem: str = ""  # why its record cannot be read; "" when it can


class SnapshotBuilder:
    """Holds what was read and composes the snapshot document from it."""

    def __init__(
        self,
        ledger: Ledger,
        telemetry: TelemetryStore,
        prefix: str,
        *,
        resync: float = RESYNC_S,
        clock: Callable[[], datetime] = utcnow,
        history: HistoryStore | None = None,
    ) -> None:
        self.ledger = ledger
        # the last hour of every card, pod and the cluster, sampled at each full refresh
        self.history = history if history is not None else HistoryStore()
        self.telemetry = telemetry
        self.prefix = prefix
        self.resync = resync
        self.clock = clock
        self.nodes: dict[str, NodeEntry] = {}
        self.liveness: dict[str, NodeLiveness | BadRecord] = {}
        self.usage: dict[str, list[ContainerUsage]] = {}  # per node, fresh entries
        self.report: SchedulerReport | None = None
        self.version = 0
        self.at = clock()
        self.refreshes = 0  # refreshes that read Redis (tests count them)
        self.full_refreshes = 0  # of which with telemetry, liveness and the report
        # why what is shown may be stale (the ledger cannot be read now); None when fresh
        self.problem: str | None = None
        self.read_at: datetime | None = None  # the last refresh that read Redis through
        self.document: dict[str, Any] = {}
        self.body = b""
        self._content = b""
        self._resync_due = 0.0
        self._compose()

    def resync_soon(self) -> None:
        """Re-read every node at the next refresh (notices of changes may have been lost)."""
        self._resync_due = 0.0

    async def refresh(self, *, full: bool, dirty: Iterable[str] = ()) -> bool:
        """Read what changed (``full``: telemetry, liveness and the report too);
        True when the document changed. Raises LedgerError when Redis fails."""
        self.refreshes += 1
        names = await self.ledger.nodes()
        now = time.monotonic()
        reread_all = now >= self._resync_due
        if reread_all:
            self._resync_due = now + self.resync
        revs = await self.ledger.revisions(names)
        wanted = set(dirty)
        changed = [
            n
            for n in names
            if reread_all
            or n in wanted
            or n not in self.nodes
            or revs[n] is None
            or revs[n] != self.nodes[n].rev
        ]
        for gone in set(self.nodes) - set(names):
            del self.nodes[gone]
            self.usage.pop(gone, None)
            self.liveness.pop(gone, None)
        if changed:
            await self._read(changed)
        if full:
            self.full_refreshes += 1
            self.liveness = await self.ledger.read_liveness(names)
            usages = await asyncio.gather(
                *(self.telemetry.container_usage(n, prune=False) for n in names)
            )
            self.usage = {
                name: [u for u in found if sane_usage(u)]
                for name, found in zip(names, usages, strict=True)
            }
            self.report = await read_report(self.ledger.redis, self.prefix)
        self.problem = None
        self.read_at = self.clock()
        composed = self._compose()
        if full:
            self.history.record_snapshot(self.document, self.usage)
        return composed

    def failed(self, why: str = "the ledger cannot be read") -> bool:
        """A refresh failed (Redis does not answer, or holds what cannot be
        shown): the document says so, with when it last read the ledger, instead
        of passing old data off as live; True when the document changed (only
        the first failure of an outage)."""
        if self.problem is not None:
            return False
        when = iso(self.read_at) if self.read_at else "no time yet"
        self.problem = f"{why}: what is shown was read at {when}"
        # the last document with the problem (composing again may be what fails);
        # the next refresh that reads through composes a new one
        self.version += 1
        self.document = {**self.document, "version": self.version, "problem": self.problem}
        self.body = orjson.dumps(self.document)
        self._content = b""
        return True

    async def _read(self, names: list[str]) -> None:
        read = await self.ledger.read_nodes(names, vendor=None)  # every vendor's cards
        placements = await asyncio.gather(
            *(self.ledger.node_placements(n) for n in names), return_exceptions=True
        )
        for name, pods in zip(names, placements, strict=True):
            cards = read.get(name)
            if isinstance(pods, BaseException) and not isinstance(pods, BadRecord):
                raise pods
            if isinstance(cards, NodeCards) and isinstance(pods, list):
                self.nodes[name] = NodeEntry(cards.rev, cards.rebuilt, cards.cards, pods)
                continue
            problem = cards if isinstance(cards, BadRecord) else pods
            why = problem.problem if isinstance(problem, BadRecord) else "not readable"
            if self.nodes.get(name, NodeEntry(None)).problem != why:
                log.warning("the console leaves out node %s: %s", name, why)
            self.nodes[name] = NodeEntry(None, problem=why)

    # ------------------------------------------------------------ the document

    def _compose(self) -> bool:
        content = self._content_doc()
        encoded = orjson.dumps(content)
        if encoded == self._content and self.document:
            return False
        self._content = encoded
        self.version += 1
        self.at = self.clock()
        self.document = {"version": self.version, "at": iso(self.at), **content}
        self.body = orjson.dumps(self.document)
        return True

    def _content_doc(self) -> dict[str, Any]:
        report = self.report
        nodes = [self._node_doc(name, entry) for name, entry in sorted(self.nodes.items())]
        cards = [c for n in nodes for c in n["cards"]]
        measured = [c["measured"]["memory_mib"] for c in cards if c["measured"]["memory_mib"]]
        any_usage = any(c["measured"]["memory_mib"] is not None for c in cards)
        pods = {p["uid"] for c in cards for p in c["pods"]}
        by_vendor: dict[str, list[dict[str, Any]]] = {}
        for card in cards:
            by_vendor.setdefault(card["vendor"], []).append(card)
        vendors = [
            {
                "vendor": vendor,
                "cards": len(group),
                "memory_mib": sum(c["memory_mib"] for c in group),
                "used_memory_mib": sum(c["used"]["memory_mib"] for c in group),
                "cores": sum(c["cores"] for c in group),
                "used_cores": sum(c["used"]["cores"] for c in group),
            }
            for vendor, group in sorted(by_vendor.items(), key=lambda v: vendor_order(v[0]))
        ]
        cluster = {
            "nodes": sum(1 for n in nodes if not n.get("problem")),
            "cards": len(cards),
            "memory_mib": sum(c["memory_mib"] for c in cards),
            "used_memory_mib": sum(c["used"]["memory_mib"] for c in cards),
            "measured_memory_mib": round(sum(measured), 1) if any_usage else None,
            "cores": sum(c["cores"] for c in cards),
            "used_cores": sum(c["used"]["cores"] for c in cards),
            "pods": len(pods),
            "fragmentation": (
                report.cluster.fragmentation if report and allocated(cards) else None
            ),
            "fits": [k.model_dump(mode="json") for k in report.kinds] if report else [],
            # the same per vendor, whose cores add up in its own units only
            "vendors": vendors,
        }
        return {
            "problem": self.problem,
            "report_at": iso(report.at) if report else None,
            "cluster": cluster,
            "nodes": nodes,
        }

    def _node_doc(self, name: str, entry: NodeEntry) -> dict[str, Any]:
        liveness = self.liveness.get(name)
        live = isinstance(liveness, NodeLiveness) and liveness.unavailable_since is None
        share = self.report.nodes.get(name) if self.report else None
        # released placements stay in the ledger for an hour: set aside once per
        # node, not once per card, so a node's history does not slow every refresh
        held = [p for p in entry.placements if p.state is not PlacementState.RELEASED]
        usage: dict[str, list[ContainerUsage]] = {}
        for u in self.usage.get(name, []):
            usage.setdefault(u.uuid, []).append(u)
        cards = [
            self._card_doc(card, held, usage.get(card.uuid))
            for card in sorted(entry.cards, key=lambda c: (*vendor_order(c.vendor), c.index))
        ]
        doc: dict[str, Any] = {
            "name": name,
            "live": live,
            "rebuilt": entry.rebuilt,
            "fragmentation": share.fragmentation if share and allocated(cards) else None,
            "free_share": share.free_share if share else None,
            "cards": cards,
        }
        if entry.problem:
            doc["problem"] = entry.problem
        return doc

    @staticmethod
    def _card_doc(
        card: StoredCard, held: list[Placement], usage: list[ContainerUsage] | None
    ) -> dict[str, Any]:
        measured: dict[str, float | None] = {"memory_mib": None, "sm_percent": None}
        if usage:
            measured = {
                "memory_mib": round(sum(u.used_bytes for u in usage) / MIB, 1),
                "sm_percent": round(min(100.0, sum(u.sm_percent for u in usage)), 1),
            }
        return {
            "uuid": card.uuid,
            "index": card.index,
            "model": card.model,
            "mode": card.mode.value,
            "vendor": card.vendor,
            "healthy": card.healthy,
            "cordoned": card.cordoned,
            "present": card.present,
            "memory_mib": card.cap_mem,
            "cores": card.cap_cores,
            "slots": card.cap_slots,
            "used": {
                "memory_mib": card.used_mem,
                "cores": card.used_cores,
                "slots": card.used_slots,
            },
            "measured": measured,
            # which enforcement layers hold its containers; None: its agent says not
            "layers": None if card.layers is None else card.layers.model_dump(mode="json"),
            "pods": [
                {
                    "uid": g.uid,
                    "namespace": g.namespace,
                    "name": g.name,
                    "container": g.container,
                    "memory_mib": g.memory_mib,
                    "cores": g.cores,
                }
                for g in card_grants(card.uuid, held)
            ],
            "others": None,
        }

    # ------------------------------------------------------------ lookups for pods

    def placements(self) -> list[Placement]:
        """Every placement recorded on a readable node (released ones included)."""
        return [p for entry in self.nodes.values() for p in entry.placements]

    def card(self, node: str, uuid: str) -> StoredCard | None:
        entry = self.nodes.get(node)
        if entry is None:
            return None
        return next((c for c in entry.cards if c.uuid == uuid), None)

    def pod_usage(self, node: str, uid: str) -> list[ContainerUsage]:
        return [u for u in self.usage.get(node, []) if u.pod_uid == uid]
