"""Cards in mode ``mig``: each container gets a MIG instance the device plugin makes
at Allocate, at the profile and placement chosen here.

MIG cards are rare and their rule does not fit the compiled core's arrays (a
card's free slices are a set, not a number), so they are placed here, in
Python; the compiled core never takes one (its type mask says so, see
:func:`mode_ok`), and a cluster without MIG cards never enters this module's
evaluation.

HAMi's rules, as it applies them to a card in mode mig:

* a pod's ``nvidia.com/vgpu-mode``, when set, must be the card's mode, else
  ``CardTypeMismatch``; unset, any mode will do;
* the usual per-card rules first, in HAMi's order (health, cordon, type, UUID,
  slots, memory, cores, exclusivity, compute left);
* then the container's memory request (MiB, or a percentage of the card) picks
  the profile with the least memory at or above it (fewer compute slices among
  equals) that has a placement free of the slices already taken: by gpuslice's
  instances in use, by the static instances (not gpuslice's), and by this pod's
  earlier containers. Placements are tried highest start first for ``1g.*`` and
  ``3g.*`` profiles, lowest first otherwise. None: ``CardMigTopologyInfeasible``;
* the grant books the profile's memory and cores, not the request's.

Cards are ranked by HAMi's card score (binpack and the fragmentation policy
take the fullest, spread the emptiest; among equals the last card, as HAMi).
A node is scored by HAMi's node score before the pod; under the fragmentation
policy, which has no node policy of its own, a MIG node ranks after every
other feasible node (a pod that may use any card leaves MIG slices to pods that
need them), fuller MIG nodes first.

Every container's instance, init containers' too, exists from the pod's
admission on (kubelet allocates all containers then): a pod's instances never
share slices (:class:`~gpuslice_common.models.DeviceFootprint`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

from gpuslice_common.models import (
    NVIDIA,
    ContainerGpuRequest,
    DeviceGrant,
    DeviceSelector,
    GpuDevice,
    GpuPolicy,
    MigGrant,
    MigPlacement,
    MigProfile,
    NodePolicy,
    PodGpuRequest,
    VgpuMode,
)
from gpuslice_scheduler.fit import REASONS, Code

if TYPE_CHECKING:  # the cluster holds MIG cards: it imports this module
    from gpuslice_scheduler.cluster import Cluster

# Under the fragmentation policy a MIG node's score is HAMi's node score less this:
# below any other feasible node's (fragmentation scores are far smaller in size).
MIG_NODE_RANK = -1e12


@dataclass(frozen=True, slots=True)
class MigCard:
    """A MIG card's facts: its profiles (in the order they are tried) and slices."""

    profiles: tuple[MigProfile, ...]  # least memory first, fewer slices among equals
    slices: int  # every slice of the card
    static: int  # taken by static instances

    @classmethod
    def of(cls, device: GpuDevice) -> MigCard:
        return cls.make(device.mig_profiles, device.mig_slice_mask, device.mig_static_mask)

    @classmethod
    def make(cls, profiles: Sequence[MigProfile], slices: int, static: int) -> MigCard:
        ordered = sorted(profiles, key=lambda p: (p.memory_mib, p.slices))  # stable
        return cls(tuple(ordered), slices, static)


@dataclass(frozen=True, slots=True)
class CardMode:
    """How one card is shared, as the scheduler's copy holds it beside its row."""

    mode: VgpuMode = VgpuMode.HAMI_CORE
    mig: MigCard | None = None  # mode mig: its facts
    used: int = 0  # mode mig: the slices gpuslice's instances take
    vendor: str = NVIDIA  # whose card: a container is placed on its own vendor's cards only


HAMI_CORE = CardMode()


def mode_ok(card_mode: VgpuMode, wanted: VgpuMode | None) -> bool:
    """May the compiled core place a pod asking for ``wanted`` on a card of ``card_mode``:
    never on a MIG card (this module places those), else when the modes agree."""
    return card_mode is not VgpuMode.MIG and (wanted is None or wanted is card_mode)


def wants_mig(request: PodGpuRequest) -> bool:
    """May the pod use MIG cards (NVIDIA's, its vgpu-mode unset or mig)."""
    if request.vendor != NVIDIA:
        return False
    return request.vgpu_mode is None or request.vgpu_mode is VgpuMode.MIG


def _placements(profile: MigProfile) -> list[MigPlacement]:
    high = profile.name.startswith(("1g.", "3g."))
    return sorted(profile.placements, key=lambda p: -p.start if high else p.start)


def select(card: MigCard, occupied: int, memory_mib: int) -> tuple[MigProfile, MigPlacement] | None:
    """The profile and placement HAMi picks for ``memory_mib`` on ``card`` with the
    slices ``occupied`` taken, or None when no profile has a free placement."""
    for profile in card.profiles:
        if profile.memory_mib < memory_mib:
            continue
        for placement in _placements(profile):
            if not placement.mask & occupied:
                return profile, placement
    return None


@dataclass
class _Card:
    """One card of the node being evaluated, with the pod's earlier containers added."""

    index: int  # the cluster's card index
    static: Code  # the first usage-free rule it breaks (Code.FITS: none)
    numa: int
    cap_mem: int
    cap_cores: int
    cap_slots: int
    mem: int
    cores: int
    slots: int
    owned: bool
    mig: MigCard | None
    occupied: int


@dataclass
class NodeFit:
    """The MIG path's answer for one node."""

    feasible: bool
    score: float
    code: Code
    detail: str
    # per container, the cards (cluster indexes) and the instance made on each
    chosen: list[list[tuple[int, MigProfile, MigPlacement]]] = field(default_factory=list)

    def grants(self, uuids: Sequence[str]) -> list[tuple[DeviceGrant, ...]]:
        """Per container, its grants: the profile's memory and cores, and the instance."""
        return [
            tuple(
                DeviceGrant(
                    uuid=uuids[card],
                    memory_mib=profile.memory_mib,
                    cores=profile.cores,
                    mig=MigGrant(profile=profile.name, placement=placement),
                )
                for card, profile, placement in picks
            )
            for picks in self.chosen
        ]


def fit_node(
    c: Cluster,
    node: int,
    request: PodGpuRequest,
    gpu_policy: GpuPolicy,
    node_policy: NodePolicy | None,
    cpu: float,
    memory: float,
    type_ok: Sequence[bool] | None,
) -> NodeFit:
    """Fit ``request`` on the MIG cards of ``node`` (its other cards are a type
    mismatch); ``type_ok``: per kind of card (``Cluster.models``), may the pod's
    type lists use it (None: no list)."""
    if not (c.node_cpu_free[node] >= cpu and c.node_mem_free[node] >= memory):
        return NodeFit(False, -np.inf, Code.TOO_FEW_CARDS, "node CPU or memory is short")
    lo, hi = int(c.node_start[node]), int(c.node_start[node + 1])
    cards = [_card(c, k, type_ok, request.selector) for k in range(lo, hi)]
    chosen: list[list[tuple[int, MigProfile, MigPlacement]]] = []
    for container in request.containers:
        codes = [_code(card, container) for card in cards]
        fitting = [card for card, code in zip(cards, codes, strict=True) if code is Code.FITS]
        ranked = _ranked(fitting, container, gpu_policy)
        bind = request.selector.numa_bind and container.count > 1
        picks = None
        for group in _groups(ranked) if bind else [ranked]:
            if _take([replace(card) for card in group], container) is not None:
                # taken for good: the pod's later containers see these instances
                picks = _take(group, container)
                break
        if picks is None:
            code, after = _failure(cards, codes, ranked, container, bind)
            return NodeFit(False, -np.inf, code, _detail(code, after, len(fitting), container))
        chosen.append(picks)
    score = _node_score(c, lo, hi)
    if node_policy is NodePolicy.SPREAD:
        score = -score
    elif node_policy is None and gpu_policy is GpuPolicy.FRAGMENTATION:
        score += MIG_NODE_RANK
    return NodeFit(True, score, Code.FITS, "", chosen)


def _card(c: Cluster, k: int, type_ok: Sequence[bool] | None, selector: DeviceSelector) -> _Card:
    mig = c.mig.get(k)
    static = Code.FITS
    if not c.present[k]:
        static = Code.NOT_FOUND
    elif not c.healthy[k]:
        static = Code.NOT_HEALTHY
    elif c.cordoned[k]:
        static = Code.CORDONED
    elif mig is None or (type_ok is not None and not type_ok[int(c.model_id[k])]):
        static = Code.TYPE_MISMATCH
    elif not _uuid_ok(selector, c.uuids[k]):
        static = Code.UUID_MISMATCH
    return _Card(
        index=k,
        static=static,
        numa=int(c.numa[k]),
        cap_mem=int(c.cap_mem[k]),
        cap_cores=int(c.cap_cores[k]),
        cap_slots=int(c.cap_slots[k]),
        mem=int(c.used_mem[k]),
        cores=int(c.used_cores[k]),
        slots=int(c.used_slots[k]),
        owned=bool(c.owned[k]),
        mig=mig,
        occupied=(int(c.mig_used[k]) | mig.static | ~mig.slices) if mig else -1,
    )


def _uuid_ok(selector: DeviceSelector, uuid: str) -> bool:
    include, exclude = selector.include_uuids, selector.exclude_uuids
    return (not include or uuid in include) and uuid not in exclude


def _memory(card: _Card, container: ContainerGpuRequest) -> int:
    return container.memory.on_card(card.cap_mem)


def _code(card: _Card, container: ContainerGpuRequest) -> Code:
    if card.static is not Code.FITS:
        return card.static
    mem = _memory(card, container)
    if card.slots >= card.cap_slots:
        return Code.SLOTS_EXHAUSTED
    if mem > card.cap_mem - card.mem:
        return Code.INSUFFICIENT_MEMORY
    if container.cores > card.cap_cores - card.cores:
        return Code.INSUFFICIENT_CORE
    if card.owned or (container.exclusive and card.slots > 0):
        return Code.EXCLUSIVE_CONFLICT
    if container.cores == 0 and card.cores >= card.cap_cores:
        return Code.COMPUTE_EXHAUSTED
    assert card.mig is not None
    if select(card.mig, card.occupied, mem) is None:
        return Code.MIG_TOPOLOGY_INFEASIBLE
    return Code.FITS


def _card_score(card: _Card, container: ContainerGpuRequest) -> float:
    """HAMi's card score with the container added."""
    return 10.0 * (
        (card.slots + 1) / max(card.cap_slots, 1)
        + (card.cores + container.cores) / max(card.cap_cores, 1)
        + (card.mem + _memory(card, container)) / max(card.cap_mem, 1)
    )


def _ranked(fitting: list[_Card], container: ContainerGpuRequest, policy: GpuPolicy) -> list[_Card]:
    """The fitting cards in the order they are tried: by HAMi's card score, the fullest
    first (spread: the emptiest), the last card first among equals, as HAMi."""
    sign = -1.0 if policy is GpuPolicy.SPREAD else 1.0
    ranked = sorted(fitting, key=lambda card: (sign * _card_score(card, container), card.index))
    ranked.reverse()
    return ranked


def _groups(ranked: list[_Card]) -> list[list[_Card]]:
    """The ranked cards per NUMA node, in the order of each node's best card."""
    groups: dict[int, list[_Card]] = {}
    for card in ranked:
        groups.setdefault(card.numa, []).append(card)
    return list(groups.values())


def _take(
    cards: list[_Card], container: ContainerGpuRequest
) -> list[tuple[int, MigProfile, MigPlacement]] | None:
    """The container's ``count`` instances from ``cards`` in order, one per card.

    HAMi lets one card give a container several instances; here a container's
    cards are distinct, MIG or not: a CUDA process enumerates one MIG device
    only, so a second instance on the same card would be idle for most
    programs, and its slices lost to other pods. Adds them to ``cards``; None
    when they do not add up to ``count``."""
    picks: list[tuple[int, MigProfile, MigPlacement]] = []
    for card in cards:
        if len(picks) < container.count and _code(card, container) is Code.FITS:
            assert card.mig is not None
            choice = select(card.mig, card.occupied, _memory(card, container))
            assert choice is not None  # _code checked it
            profile, placement = choice
            card.mem += profile.memory_mib
            card.cores += profile.cores
            card.slots += 1
            card.owned = card.owned or container.exclusive
            card.occupied |= placement.mask
            picks.append((card.index, profile, placement))
    return picks if len(picks) == container.count else None


def _failure(
    cards: list[_Card],
    codes: list[Code],
    ranked: list[_Card],
    container: ContainerGpuRequest,
    bind: bool,
) -> tuple[Code, list[Code]]:
    """Why the container found too few instances, and each card's code once the
    instances it could give were taken (what stopped it)."""
    trial = [replace(card) for card in ranked]
    enough = _take(trial, container) is not None
    after = {card.index: _code(card, container) for card in trial}
    final = [after.get(card.index, code) for card, code in zip(cards, codes, strict=True)]
    if len(cards) - codes.count(Code.NOT_FOUND) < container.count:
        # as the compiled core, and HAMi: more cards asked than the node has at all
        return Code.NODE_INSUFFICIENT_DEVICE, final
    if bind and enough:  # enough instances, not on one NUMA node
        return Code.NUMA_NOT_FIT, final
    return _explain(final), final


def _explain(codes: list[Code]) -> Code:
    """The code most cards give (the lowest among equals), as the compiled core's
    ``explain`` in engine.c names a node's reason."""
    counts = {code: codes.count(code) for code in codes if code is not Code.FITS}
    if not counts:
        return Code.TOO_FEW_CARDS
    return max(sorted(counts), key=lambda code: counts[code])


def _detail(code: Code, codes: list[Code], fits: int, container: ContainerGpuRequest) -> str:
    """The node's line: its reason, and what stopped each card counted."""
    if not codes:
        return f"container {container.name!r}: the node has no GPU"
    parts = ", ".join(
        f"{codes.count(c)} {REASONS[c].value}" for c in sorted(set(codes)) if c is not Code.FITS
    )
    return (
        f"{REASONS[code].value}: container {container.name!r} needs {container.count} "
        f"instance(s), {fits} of {len(codes)} card(s) fit" + (f" ({parts})" if parts else "")
    )


def _node_score(c: Cluster, lo: int, hi: int) -> float:
    """HAMi's node score before the pod: 10 x the shares of slots, cores and memory in use."""
    score = 0.0
    for used, cap in (
        (c.used_slots, c.cap_slots),
        (c.used_cores, c.cap_cores),
        (c.used_mem, c.cap_mem),
    ):
        score += float(used[lo:hi].sum()) / max(float(cap[lo:hi].sum()), 1.0)
    return 10.0 * score
