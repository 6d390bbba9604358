"""HAMi's per-card fit rules: their codes, and a container's demand on each card.

A card gets the code of the first rule it breaks, in HAMi's order; 0 means it
fits. Two codes are the node's, not a card's: too few fitting cards, and (first,
as HAMi checks it before any card) fewer cards on the node than a container asks.
MIG placement that no free slice admits has its code in HAMi's place, after the
compute rule. Rules that do not depend on usage (presence, health, cordon, type, UUID)
come first; a card failing one of them can never take the request. Then, with
the card's usage: a free slot, memory, cores, no exclusive holder (and none
other at all for a container that wants the card alone), and for a container
asking no cores, some compute left. The rules are applied by the engine's
compiled core (``native/engine/engine.c``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from gpuslice_common.models import ContainerGpuRequest, DeviceSelector, FitReason

Codes = npt.NDArray[np.int8]
Bools = npt.NDArray[np.bool_]  # as gpuslice_scheduler.cluster's (which imports this module's users)


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
    MIG_TOPOLOGY_INFEASIBLE = 12
    TOO_FEW_CARDS = 13
    NODE_INSUFFICIENT_DEVICE = 14


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
    Code.MIG_TOPOLOGY_INFEASIBLE: FitReason.CARD_MIG_TOPOLOGY_INFEASIBLE,
    Code.TOO_FEW_CARDS: FitReason.ALLOCATED_CARDS_INSUFFICIENT_REQUEST,
    Code.NODE_INSUFFICIENT_DEVICE: FitReason.NODE_INSUFFICIENT_DEVICE,
}
CODE_COUNT = len(Code)  # the compiled core counts every code (the MIG one stays 0 there)


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
