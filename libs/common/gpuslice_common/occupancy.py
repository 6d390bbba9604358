"""Who occupies a card: the live placements' grants on it, per pod and container.

Read by ``gpuslice status`` (per pod) and by the inventory's console (per
container), so both count a card's pods the same way.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from gpuslice_common.models import Placement, PlacementState


@dataclass(frozen=True)
class CardGrant:
    """What one container of a live pod was granted on one card."""

    uid: str
    namespace: str
    name: str
    state: str  # the placement's state: reserved, bound or allocated
    container: str
    memory_mib: int
    cores: int


def card_grants(uuid: str, placements: Iterable[Placement]) -> list[CardGrant]:
    """The grants on card ``uuid`` of the live (not released) ``placements``,
    by pod uid then container name."""
    grants = []
    for placement in placements:
        if placement.state is PlacementState.RELEASED:
            continue
        pod = placement.pod
        for container in placement.containers:
            mine = [d for d in container.devices if d.uuid == uuid]
            if mine:
                grants.append(
                    CardGrant(
                        pod.uid,
                        pod.namespace,
                        pod.name,
                        placement.state.value,
                        container.name,
                        sum(d.memory_mib for d in mine),
                        sum(d.cores for d in mine),
                    )
                )
    grants.sort(key=lambda g: (g.uid, g.container))
    return grants
