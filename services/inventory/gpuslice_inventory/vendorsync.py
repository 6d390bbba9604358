"""Registering other vendors' cards from node objects (:mod:`.vendornodes`).

In the replica holding the lease, every ``vendor_interval``: list the nodes,
read each readable vendor's cards (from HAMi's register annotations, the node's
capacity, or Metax's and Enflame's own annotations), and register them in the
ledger as that vendor's cards of the node (the node agent's NVIDIA cards and
the node's other vendors are left as they are). A vendor whose plugin stopped,
withdrew its cards, or whose annotation or capacity is refused has its cards
withdrawn: cards still in use stay (not present) until their pods end, as for
any card that disappears. A node deleted, or with no sign of the vendor left,
loses its vendor cards the same way. A registration the ledger refuses (a card
under the UUID of another vendor's card on the node) leaves that vendor's cards
out and the others in.

NVIDIA's register annotation is not read: gpuslice's own node agent reports
NVIDIA cards. A problem is logged once when it appears or changes.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from gpuslice_common.devicetypes import (
    DeviceType,
    load_device_config,
)
from gpuslice_common.kube import KubeApi
from gpuslice_common.ledger import BadRecord, Ledger, LedgerError
from gpuslice_common.models import NVIDIA, NodeInventory, utcnow
from gpuslice_inventory.vendornodes import REPORT_TIMEOUT, VendorReading, read_node

log = logging.getLogger(__name__)


@dataclass
class SyncResult:
    nodes: int = 0
    registered: Counter[str] = field(default_factory=Counter)  # vendor -> nodes
    withdrawn: Counter[str] = field(default_factory=Counter)  # vendor -> nodes
    refused: Counter[str] = field(default_factory=Counter)  # vendor -> nodes
    failed: int = 0  # registrations the ledger refused
    unchanged: int = 0  # live vendors whose cards the ledger already holds as they are


# What registering a card writes, as the ledger reads it back.
Facts = tuple[str, int, str, int, int | None, bool, int, int, int]


class VendorSync:
    """Keeps the ledger's non-NVIDIA cards as the nodes' annotations say."""

    def __init__(
        self,
        ledger: Ledger,
        kube: KubeApi,
        types: Sequence[DeviceType],
        *,
        report_timeout: timedelta = REPORT_TIMEOUT,
        clock: Callable[[], datetime] = utcnow,
    ) -> None:
        self.ledger = ledger
        self.kube = kube
        self.types = tuple(t for t in types if t.vendor != NVIDIA and t.readable)
        self.report_timeout = report_timeout
        self.clock = clock
        self.problems: dict[tuple[str, str], str] = {}  # (node, vendor) -> last logged

    async def run_once(self) -> SyncResult:
        result = SyncResult()
        listing = await self.kube.list_nodes()
        now = self.clock()
        readings: list[VendorReading] = []
        for obj in listing:
            readings += read_node(obj, self.types, now, self.report_timeout)
        result.nodes = len(listing)
        held = await self._held()
        seen: set[tuple[str, str]] = set()
        for reading in readings:
            key = (reading.node, reading.vendor)
            seen.add(key)
            problem = ""
            if reading.state != "live":
                problem = f"{reading.message}; its cards are not scheduled"
            if reading.state == "refused":
                result.refused[reading.vendor] += 1
            if reading.state == "live":
                inventory = reading.inventory()
                if held.get(key) == _facts_of(inventory):
                    result.unchanged += 1  # no write: the scheduler has nothing to re-read
                elif failure := await self._register(inventory, result):
                    problem = failure
                else:
                    result.registered[reading.vendor] += 1
            elif key in held:
                if failure := await self._register(reading.inventory(), result):
                    problem = failure
                else:
                    result.withdrawn[reading.vendor] += 1
            self._note(key, problem)
        for node, vendor in sorted(set(held) - seen):
            empty = NodeInventory(node=node, devices=(), vendor=vendor)
            if failure := await self._register(empty, result):
                self._note((node, vendor), failure)
                continue
            log.info("node %s no longer announces %s cards: withdrawn", node, vendor)
            result.withdrawn[vendor] += 1
        for key in set(self.problems) - seen - set(held):
            del self.problems[key]  # a node or vendor gone: nothing left to say of it
        return result

    async def _held(self) -> dict[tuple[str, str], frozenset[Facts]]:
        """Per (node, vendor), the present non-NVIDIA cards the ledger lists."""
        held: dict[tuple[str, str], set[Facts]] = {}
        nodes = await self.ledger.nodes()
        for node, read in (await self.ledger.read_nodes(nodes, vendor=None)).items():
            if isinstance(read, BadRecord):
                log.warning("vendor cards of node %s not checked: %s", node, read)
                continue
            for c in read.cards:
                if c.vendor != NVIDIA and c.present:
                    card = (c.uuid, c.index, c.model, c.memory_mib, c.numa, c.healthy)
                    facts = (*card, c.cap_mem, c.cap_cores, c.cap_slots)
                    held.setdefault((node, c.vendor), set()).add(facts)
        return {key: frozenset(cards) for key, cards in held.items()}

    async def _register(self, inventory: NodeInventory, result: SyncResult) -> str:
        """Why the ledger refused the registration ("": it did not)."""
        try:
            await self.ledger.register_node(inventory)
        except LedgerError as exc:
            result.failed += 1
            return (
                f"node {inventory.node}: {inventory.vendor}: the ledger refused the cards: "
                f"{exc}; those it held stay as they were"
            )
        return ""

    def _note(self, key: tuple[str, str], message: str) -> None:
        if not message:
            if self.problems.pop(key, None) is not None:
                log.info("node %s: %s cards read again", *key)
            return
        if self.problems.get(key) != message:
            log.warning("%s", message)
        self.problems[key] = message


def _facts_of(inventory: NodeInventory) -> frozenset[Facts]:
    facts = set()
    for d in inventory.devices:
        cap = inventory.capacity(d)
        card = (d.uuid, d.index, d.model, d.memory_mib, d.numa, d.healthy)
        facts.add((*card, cap.memory_mib, cap.cores, cap.slots))
    return frozenset(facts)


__all__ = ["SyncResult", "VendorSync", "load_device_config"]
