"""The cluster as NumPy arrays: one row per card, cards grouped by node.

The placement engine's compiled core reads these arrays in place. Cards of one
node are contiguous, in the node's index order; ``node_start[n]:node_start[n + 1]``
are node ``n``'s cards.

A card's sharing mode and vendor are part of its kind: ``models`` lists each
distinct (model, mode, vendor) once, with the mode in ``model_mode`` and the
vendor in ``model_vendor``, so the compiled core's per-model type mask also
says which modes and which vendor's cards a pod may use. Cards in mode mig
carry their MIG facts in ``mig`` and the slices in use in ``mig_used``; the
compiled core reads neither (:mod:`gpuslice_scheduler.mig` places on them).

Node CPU and memory are tracked where they are known (the trace replay; the
service, from a watch of Nodes and Pods); elsewhere they are infinite, because
kube-scheduler checks them itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import orjson

from gpuslice_common.models import NVIDIA, GpuState, VgpuMode
from gpuslice_scheduler.mig import HAMI_CORE, CardMode, MigCard

# One card: uuid, model, numa (-1 unknown), cap_mem, cap_cores, cap_slots, used mem,
# cores, slots, owned, healthy, present, cordoned
Row = tuple[str, str, int, int, int, int, int, int, int, bool, bool, bool, bool]


@dataclass(frozen=True, slots=True)
class CardFacts:
    """What a bind reads of a card beside its grant: its index on the node and its
    model (another vendor's plugin is told which card by index, Enflame's also by
    the DRS profile its model lists)."""

    index: int
    model: str


Ints = npt.NDArray[np.int64]
Bools = npt.NDArray[np.bool_]
Floats = npt.NDArray[np.float64]


@dataclass
class Cluster:
    """Capacity and usage of every card, plus each node's free CPU and memory."""

    node_names: list[str]
    node_start: Ints  # length nodes + 1
    uuids: list[str]
    models: list[str]  # model of each distinct (model, mode, vendor); model_id indexes it
    model_id: Ints
    numa: Ints  # -1 when unknown
    cap_mem: Ints
    cap_cores: Ints
    cap_slots: Ints
    used_mem: Ints
    used_cores: Ints
    used_slots: Ints
    owned: Bools  # held exclusively by one pod
    healthy: Bools
    present: Bools
    cordoned: Bools
    node_cpu_free: Floats  # milli-CPU; inf when not tracked
    node_mem_free: Floats  # MiB; inf when not tracked
    model_mode: list[VgpuMode] = field(default_factory=list)  # per models entry; [] all hami-core
    model_vendor: list[str] = field(default_factory=list)  # per models entry; [] all NVIDIA
    mig: dict[int, MigCard] = field(default_factory=dict)  # card index -> facts, mode mig only
    mig_used: Ints = field(default_factory=lambda: np.zeros(0, np.int64))  # slices in use
    node_index: dict[str, int] = field(init=False)
    kind_index: dict[tuple[str, VgpuMode, str], int] = field(init=False)
    node_mig: Bools = field(init=False)  # per node: has a card in mode mig
    modes_differ: bool = field(init=False)  # some card is not in mode hami-core
    vendors_differ: bool = field(init=False)  # some card is not NVIDIA's
    names: npt.NDArray[np.object_] = field(init=False)  # node_names as an array, for indexing
    # Grows with every change to usage or cards.
    version: int = field(init=False, default=0)
    lookups: dict[str, Any] = field(init=False, default_factory=dict)  # kept: same cards
    # Per node, the version that last changed it (usage or anything), and the one
    # that last changed its facts or capacity (what could ever fit there).
    changed: Ints = field(init=False)
    reshaped: Ints = field(init=False)

    def __post_init__(self) -> None:
        if len(self.model_mode) != len(self.models):
            self.model_mode = [VgpuMode.HAMI_CORE] * len(self.models)
        if len(self.model_vendor) != len(self.models):
            self.model_vendor = [NVIDIA] * len(self.models)
        if self.mig_used.shape != (len(self.uuids),):
            self.mig_used = np.zeros(len(self.uuids), dtype=np.int64)
        self.kind_index = {
            k: i
            for i, k in enumerate(zip(self.models, self.model_mode, self.model_vendor, strict=True))
        }
        self.modes_differ = any(m is not VgpuMode.HAMI_CORE for m in self.model_mode)
        self.vendors_differ = any(v != NVIDIA for v in self.model_vendor)
        self.node_mig = np.zeros(len(self.node_names), dtype=np.bool_)
        if self.mig:
            cards = np.fromiter(self.mig, dtype=np.int64, count=len(self.mig))
            self.node_mig[np.searchsorted(self.node_start, cards, side="right") - 1] = True
        self.node_index = {name: i for i, name in enumerate(self.node_names)}
        self.names = np.asarray(self.node_names, dtype=object)
        self.changed = np.zeros(len(self.node_names), dtype=np.int64)
        self.reshaped = np.zeros(len(self.node_names), dtype=np.int64)

    # ------------------------------------------------------------ building

    @classmethod
    def from_rows(
        cls,
        nodes: Sequence[tuple[str, Sequence[Row]]],
        node_cpu: Sequence[float] | None = None,
        node_mem: Sequence[float] | None = None,
        modes: Sequence[Sequence[CardMode]] | None = None,
    ) -> Cluster:
        """A cluster from each node's cards as :data:`Row` tuples, in the given node order;
        ``modes``, per node, each card's mode (default: all hami-core)."""
        counts = [len(rows) for _, rows in nodes]
        cards = [r for _, rows in nodes for r in rows]
        card_modes = (
            [m for per_node in modes for m in per_node]
            if modes is not None
            else [HAMI_CORE] * len(cards)
        )
        if len(card_modes) != len(cards):
            raise ValueError("one mode per card")
        models: dict[tuple[str, VgpuMode, str], int] = {}
        model_id = [
            models.setdefault((r[1], m.mode, m.vendor), len(models))
            for r, m in zip(cards, card_modes, strict=True)
        ]

        def col(i: int, dtype: type) -> np.ndarray[Any, Any]:
            return np.asarray([r[i] for r in cards], dtype=dtype)

        n = len(nodes)
        return cls(
            node_names=[name for name, _ in nodes],
            node_start=np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).astype(np.int64),
            uuids=[r[0] for r in cards],
            models=[model for model, _, _ in models],
            model_id=np.asarray(model_id, dtype=np.int64),
            numa=col(2, np.int64),
            cap_mem=col(3, np.int64),
            cap_cores=col(4, np.int64),
            cap_slots=col(5, np.int64),
            used_mem=col(6, np.int64),
            used_cores=col(7, np.int64),
            used_slots=col(8, np.int64),
            owned=col(9, np.bool_),
            healthy=col(10, np.bool_),
            present=col(11, np.bool_),
            cordoned=col(12, np.bool_),
            node_cpu_free=np.asarray(node_cpu if node_cpu is not None else [np.inf] * n, float),
            node_mem_free=np.asarray(node_mem if node_mem is not None else [np.inf] * n, float),
            model_mode=[mode for _, mode, _ in models],
            model_vendor=[vendor for _, _, vendor in models],
            mig={k: m.mig for k, m in enumerate(card_modes) if m.mig is not None},
            mig_used=np.asarray([m.used for m in card_modes], dtype=np.int64),
        )

    @classmethod
    def build(
        cls,
        nodes: Sequence[tuple[str, Sequence[GpuState]]],
        node_cpu: Sequence[float] | None = None,
        node_mem: Sequence[float] | None = None,
    ) -> Cluster:
        """A cluster from the ledger's view of each node's cards, in the given node order."""
        ordered = [sorted(states, key=lambda s: s.device.index) for _, states in nodes]
        rows = [
            (name, [_row(s) for s in states])
            for (name, _), states in zip(nodes, ordered, strict=True)
        ]
        modes = [[card_mode(s) for s in states] for states in ordered]
        return cls.from_rows(rows, node_cpu, node_mem, modes)

    # ------------------------------------------------------------ reading

    @property
    def node_count(self) -> int:
        return len(self.node_names)

    @property
    def card_count(self) -> int:
        return len(self.uuids)

    def lookup(self, names: Sequence[str]) -> tuple[Ints, list[str]]:
        """Indexes of the known nodes among ``names`` (in order), and the unknown names.

        kube-scheduler sends the same list for many pods in a row (every node
        that passed its own filters), so the last answer is kept; it is read-only.
        """
        last = self.lookups.get("last_lookup")
        if last is not None and last[0] == names:
            return last[1], list(last[2])
        found = list(map(self.node_index.get, names))
        unknown: list[str] = []
        if None in found:
            unknown = [n for n, i in zip(names, found, strict=True) if i is None]
            found = [i for i in found if i is not None]
        indexes = np.array(found, dtype=np.int64)
        indexes.setflags(write=False)
        self.lookups["last_lookup"] = (list(names), indexes, tuple(unknown))
        return indexes, unknown

    def host_openings(self) -> list[bytes]:
        """Per node, ``{"Host":<its name as JSON>,"Score":``: the extender writes a
        prioritize reply from these without building an object per node."""
        openings = self.lookups.get("host_openings")
        if openings is None:
            openings = self.lookups["host_openings"] = [
                b'{"Host":' + orjson.dumps(name) + b',"Score":' for name in self.node_names
            ]
        assert isinstance(openings, list)
        return openings

    def cards_of(self, nodes: Ints) -> Ints:
        """Card indexes of ``nodes`` (node indexes), concatenated in the nodes' order."""
        starts = self.node_start[nodes]
        counts = self.node_start[nodes + 1] - starts
        total = int(counts.sum())
        if total == 0:
            return np.zeros(0, dtype=np.int64)
        offsets = np.repeat(starts - np.cumsum(counts) + counts, counts)
        return offsets + np.arange(total, dtype=np.int64)

    def schedulable(self, cards: Ints) -> Bools:
        """Which of ``cards`` may take new work at all (present, healthy, not cordoned)."""
        return np.asarray(self.present[cards] & self.healthy[cards] & ~self.cordoned[cards])

    def emptied(self) -> Cluster:
        """The same cards with nothing reserved: what could ever fit here.

        Made once per cluster: it shares this cluster's card facts and capacity
        (changed in place), with usage of its own that stays zero."""
        empty = self.lookups.get("emptied")
        if empty is None:
            empty = self.lookups["emptied"] = self._emptied()
        assert isinstance(empty, Cluster)
        return empty

    def _emptied(self) -> Cluster:
        zeros = np.zeros_like(self.used_mem)
        empty = dataclasses.replace(
            self,
            used_mem=zeros,
            used_cores=zeros.copy(),
            used_slots=zeros.copy(),
            owned=np.zeros_like(self.owned),
            node_cpu_free=np.full(self.node_count, np.inf),
            node_mem_free=np.full(self.node_count, np.inf),
            mig_used=zeros.copy(),
        )
        empty.node_mig = self.node_mig  # a fact, changed in place as the MIG facts are
        return empty

    # ------------------------------------------------------------ changing

    def row(self, card: int) -> Row:
        """One card as a :data:`Row`, as :meth:`set_row` takes it."""
        return (
            self.uuids[card],
            self.models[int(self.model_id[card])],
            int(self.numa[card]),
            int(self.cap_mem[card]),
            int(self.cap_cores[card]),
            int(self.cap_slots[card]),
            int(self.used_mem[card]),
            int(self.used_cores[card]),
            int(self.used_slots[card]),
            bool(self.owned[card]),
            bool(self.healthy[card]),
            bool(self.present[card]),
            bool(self.cordoned[card]),
        )

    def card_mode(self, card: int) -> CardMode:
        """One card's mode, MIG facts and slices in use, as :meth:`set_row` takes them."""
        kind = int(self.model_id[card])
        mode, vendor = self.model_mode[kind], self.model_vendor[kind]
        if mode is VgpuMode.HAMI_CORE and vendor == NVIDIA:
            return HAMI_CORE
        return CardMode(mode, self.mig.get(card), int(self.mig_used[card]), vendor)

    def set_row(self, card: int, row: Row, mode: CardMode = HAMI_CORE) -> bool:
        """Overwrite one card from ``row`` and ``mode`` (its model, mode and vendor must be a
        known kind); True when more than its usage changed. Call :meth:`touch` for its node
        afterwards."""
        model = self.kind_index[(row[1], mode.mode, mode.vendor)]
        mig_facts = self.mig.get(card) != mode.mig
        if mig_facts:
            if mode.mig is None:
                del self.mig[card]
            else:
                self.mig[card] = mode.mig
            node = int(np.searchsorted(self.node_start, card, side="right")) - 1
            lo, hi = int(self.node_start[node]), int(self.node_start[node + 1])
            self.node_mig[node] = any(k in self.mig for k in range(lo, hi))
        self.mig_used[card] = mode.used
        facts = (
            mig_facts
            or model != self.model_id[card]
            or row[2] != self.numa[card]
            or row[3:6] != (self.cap_mem[card], self.cap_cores[card], self.cap_slots[card])
            or row[10:13] != (self.healthy[card], self.present[card], self.cordoned[card])
        )
        self.model_id[card], self.numa[card] = model, row[2]
        self.cap_mem[card], self.cap_cores[card], self.cap_slots[card] = row[3:6]
        self.used_mem[card], self.used_cores[card], self.used_slots[card] = row[6:9]
        self.owned[card], self.healthy[card] = row[9], row[10]
        self.present[card], self.cordoned[card] = row[11], row[12]
        return bool(facts)

    def take(
        self,
        cards: Ints,
        mem: Ints,
        cores: Ints,
        slots: Ints,
        exclusive: Bools,
        node: int,
        cpu: float = 0.0,
        memory: float = 0.0,
    ) -> None:
        """Add a placed pod's footprint (one row per distinct card) to the usage."""
        self.used_mem[cards] += mem
        self.used_cores[cards] += cores
        self.used_slots[cards] += slots
        self.owned[cards] |= exclusive
        self.node_cpu_free[node] -= cpu
        self.node_mem_free[node] -= memory
        self.touch([node])

    def touch(self, nodes: Sequence[int] | None = None, *, facts: bool = False) -> None:
        """Say ``nodes`` (default: all) changed; ``facts`` when more than usage did."""
        self.version += 1
        where = slice(None) if nodes is None else np.asarray(nodes, dtype=np.int64)
        self.changed[where] = self.version
        if facts:
            self.reshaped[where] = self.version


def card_mode(s: GpuState) -> CardMode:
    """A card's mode as the ledger's view of it gives it."""
    d = s.device
    if d.mode is VgpuMode.HAMI_CORE and d.vendor == NVIDIA:
        return HAMI_CORE
    mig = MigCard.of(d) if d.mode is VgpuMode.MIG else None
    return CardMode(d.mode, mig, s.used.mig_mask, d.vendor)


def _row(s: GpuState) -> Row:
    d = s.device
    return (
        d.uuid,
        d.model,
        -1 if d.numa is None else d.numa,
        s.capacity.memory_mib,
        s.capacity.cores,
        s.capacity.slots,
        s.used.memory_mib,
        s.used.cores,
        s.used.slots,
        s.used.exclusive_owner is not None,
        d.healthy,
        s.present,
        s.cordoned,
    )
