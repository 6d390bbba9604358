"""HAMi's per-card fit rules, evaluated for many cards at once.

A card gets the code of the first rule it breaks, in HAMi's order; 0 means it
fits. Rules that do not depend on usage (presence, health, cordon, type, UUID)
are the *static* part; a card failing one of them can never take the request.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from gpuslice_common.models import ContainerGpuRequest, DeviceSelector, FitReason
from gpuslice_scheduler.cluster import Bools, Cluster, Ints

Codes = npt.NDArray[np.int8]


class Code(enum.IntEnum):
    """Fit codes in HAMi's rule order; the names map to :class:`FitReason`."""

    FITS = 0
    NOT_FOUND = 1
    NOT_HEALTHY = 2
    CORDONED = 3
    TYPE_MISMATCH = 4
    NUMA_NOT_FIT = 5
    UUID_MISMATCH = 6
    SLOTS_EXHAUSTED = 7
    INSUFFICIENT_MEMORY = 8
    INSUFFICIENT_CORE = 9
    EXCLUSIVE_CONFLICT = 10
    COMPUTE_EXHAUSTED = 11
    TOO_FEW_CARDS = 12


REASONS: dict[Code, FitReason] = {
    Code.NOT_FOUND: FitReason.CARD_NOT_FOUND,
    Code.NOT_HEALTHY: FitReason.CARD_NOT_HEALTH,
    Code.CORDONED: FitReason.CARD_CORDONED,
    Code.TYPE_MISMATCH: FitReason.CARD_TYPE_MISMATCH,
    Code.NUMA_NOT_FIT: FitReason.NUMA_NOT_FIT,
    Code.UUID_MISMATCH: FitReason.CARD_UUID_MISMATCH,
    Code.SLOTS_EXHAUSTED: FitReason.CARD_TIME_SLICING_EXHAUSTED,
    Code.INSUFFICIENT_MEMORY: FitReason.CARD_INSUFFICIENT_MEMORY,
    Code.INSUFFICIENT_CORE: FitReason.CARD_INSUFFICIENT_CORE,
    Code.EXCLUSIVE_CONFLICT: FitReason.EXCLUSIVE_DEVICE_ALLOCATE_CONFLICT,
    Code.COMPUTE_EXHAUSTED: FitReason.CARD_COMPUTE_UNITS_EXHAUSTED,
    Code.TOO_FEW_CARDS: FitReason.ALLOCATED_CARDS_INSUFFICIENT_REQUEST,
}
CODE_COUNT = len(Code)


@dataclass(frozen=True)
class CardDemand:
    """One container's demand on each of its cards, in array-friendly form."""

    count: int
    mem_mib: int  # -1 when the memory is a percentage
    mem_percent: int  # -1 when the memory is in MiB
    cores: int
    exclusive: bool

    @classmethod
    def of(cls, container: ContainerGpuRequest) -> CardDemand:
        memory = container.memory
        return cls(
            count=container.count,
            mem_mib=-1 if memory.mib is None else memory.mib,
            mem_percent=-1 if memory.percent is None else memory.percent,
            cores=container.cores,
            exclusive=container.exclusive,
        )

    def memory_on(self, cap_mem: Ints) -> Ints:
        """MiB taken on cards of the given schedulable memory (percent rounds down)."""
        if self.mem_mib >= 0:
            return np.full_like(cap_mem, self.mem_mib)
        return cap_mem * self.mem_percent // 100


def model_mask(selector: DeviceSelector, models: list[str]) -> Bools:
    """Per model name: does the type include/exclude list admit it (substring, any case)."""
    lowered = [m.lower() for m in models]
    include = [t.lower() for t in selector.include_types]
    exclude = [t.lower() for t in selector.exclude_types]
    return np.asarray(
        [
            (not include or any(t in m for t in include)) and not any(t in m for t in exclude)
            for m in lowered
        ],
        dtype=np.bool_,
    )


def static_codes(cluster: Cluster, cards: Ints, selector: DeviceSelector) -> Codes:
    """Rules 1-3 (without NUMA): presence, health, cordon, type, UUID lists."""
    conditions = [
        ~cluster.present[cards],
        ~cluster.healthy[cards],
        cluster.cordoned[cards],
    ]
    codes = [Code.NOT_FOUND, Code.NOT_HEALTHY, Code.CORDONED]
    if selector.include_types or selector.exclude_types:
        conditions.append(~model_mask(selector, cluster.models)[cluster.model_id[cards]])
        codes.append(Code.TYPE_MISMATCH)
    if selector.include_uuids or selector.exclude_uuids:
        include, exclude = set(selector.include_uuids), set(selector.exclude_uuids)
        uuid_ok = np.asarray(
            [
                (not include or cluster.uuids[c] in include) and cluster.uuids[c] not in exclude
                for c in cards.tolist()
            ],
            dtype=np.bool_,
        )
        conditions.append(~uuid_ok)
        codes.append(Code.UUID_MISMATCH)
    return np.select(conditions, [np.int8(c) for c in codes], default=np.int8(0)).astype(np.int8)


@dataclass
class Usage:
    """Usage of a set of cards: the ledger's numbers, or a scratch copy being filled."""

    mem: Ints
    cores: Ints
    slots: Ints
    owned: Bools

    @classmethod
    def of(cls, cluster: Cluster, cards: Ints) -> Usage:
        return cls(
            mem=cluster.used_mem[cards].copy(),
            cores=cluster.used_cores[cards].copy(),
            slots=cluster.used_slots[cards].copy(),
            owned=cluster.owned[cards].copy(),
        )

    def copy(self) -> Usage:
        return Usage(self.mem.copy(), self.cores.copy(), self.slots.copy(), self.owned.copy())

    def add(self, rows: Ints, demand: CardDemand, mem: Ints) -> None:
        self.mem[rows] += mem
        self.cores[rows] += demand.cores
        self.slots[rows] += 1
        if demand.exclusive:
            self.owned[rows] = True


def usage_rules(
    cluster: Cluster,
    cards: Ints,
    usage: Usage,
    mem: Any,
    cores: Any,
    exclusive: Any,
    kinds: bool = False,
) -> list[Bools]:
    """HAMi's rules 4-8 as "broken" masks, in order: slots, memory, cores, exclusivity,
    compute exhausted. For one container, ``mem`` is per card and ``cores`` and
    ``exclusive`` are scalars; with ``kinds`` they carry a trailing axis of kinds of
    container, and the masks are (cards, kinds)."""

    def card(values: Any) -> Any:
        return values[:, None] if kinds else values

    cap_cores = card(cluster.cap_cores[cards])
    used_cores, used_slots = card(usage.cores), card(usage.slots)
    return [
        used_slots + 1 > card(cluster.cap_slots[cards]),
        card(usage.mem) + mem > card(cluster.cap_mem[cards]),
        used_cores + cores > cap_cores,
        card(usage.owned) | (exclusive & (used_slots > 0)),
        (cores == 0) & (used_cores >= cap_cores),
    ]


def usage_codes(
    cluster: Cluster, cards: Ints, usage: Usage, demand: CardDemand, mem: Ints
) -> Codes:
    """Rules 4-8 for cards with ``usage`` (rows aligned with ``cards``)."""
    conditions = usage_rules(cluster, cards, usage, mem, demand.cores, demand.exclusive)
    codes = [
        Code.SLOTS_EXHAUSTED,
        Code.INSUFFICIENT_MEMORY,
        Code.INSUFFICIENT_CORE,
        Code.EXCLUSIVE_CONFLICT,
        Code.COMPUTE_EXHAUSTED,
    ]
    return np.select(conditions, [np.int8(c) for c in codes], default=np.int8(0)).astype(np.int8)
