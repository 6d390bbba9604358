"""Vendor rules the compiled core does not know: Enflame DRS profiles, Kunlun XPU links.

**Enflame.** A container asks for a DRS profile (:class:`~gpuslice_common.models.DrsDemand`);
which profile, and so the memory and compute share it holds, depends on the
profiles of the node's cards (their model lists them: :mod:`gpuslice_common.drs`).
:func:`drs_groups` splits the nodes by profile table; each group is evaluated
with the pod's containers resolved against that table (:func:`resolve`), on
cards of that table only. A container whose demand no profile of a node holds
fails there with ``CardTypeMismatch`` (HAMi: ``ModeNotFit``), naming it.

**Kunlun.** Whole XPUs are joined in groups of four (cards 0-3 and 4-7 of each
eight), and across groups in pairs (``i``, ``i + 4``) and HAMi's fixed sets of
four; a container takes 1, 2, 4 or 8 cards that are so joined
(:func:`kunlun_cards`). After the core's answer (which counts free cards),
:func:`kunlun_topology` picks joined cards on each fitting node, fullest group
first, or fails the node with ``NumaNotFit``, as HAMi does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Final

import numpy as np

from gpuslice_common import drs
from gpuslice_common.models import ContainerGpuRequest, MemoryRequest, PodGpuRequest
from gpuslice_scheduler.cluster import Bools, Cluster, Ints
from gpuslice_scheduler.fit import Code

if TYPE_CHECKING:
    from gpuslice_scheduler.engine import Demand, Evaluation

KUNLUN: Final = "kunlun"  # the whole-XPU vendor (devicetypes: kunlun's resourceCountName)
# HAMi's sets of four XPUs joined across the two groups of an eight
KUNLUN_FOURS: Final = (
    (0, 1, 4, 5),
    (2, 3, 6, 7),
    (0, 2, 4, 6),
    (1, 3, 5, 7),
    (0, 3, 4, 7),
    (1, 2, 5, 6),
)

Table = tuple[drs.Profile, ...]


def wants_drs(request: PodGpuRequest | None) -> bool:
    return request is not None and any(c.drs is not None for c in request.containers)


def model_tables(cluster: Cluster) -> list[Table | None]:
    """Per kind of card, the DRS profiles its model lists (None: not a DRS card)."""
    found = cluster.lookups.get("drs_tables")
    if found is None:
        found = cluster.lookups["drs_tables"] = [drs.profiles_of(m) for m in cluster.models]
    tables: list[Table | None] = found
    return tables


def node_table(cluster: Cluster, node: int, vendor: str) -> Table | None:
    """The DRS profiles of ``vendor``'s cards on ``node``: the first present card's
    (a withdrawn card still in use may list an older table), else the first card's."""
    tables = model_tables(cluster)
    found: Table | None = None
    for card in range(int(cluster.node_start[node]), int(cluster.node_start[node + 1])):
        kind = int(cluster.model_id[card])
        table = tables[kind]
        if cluster.model_vendor[kind] != vendor or table is None:
            continue
        if cluster.present[card]:
            return table
        found = found or table
    return found


def resolve(request: PodGpuRequest, table: Table) -> tuple[PodGpuRequest, str]:
    """``request`` with each DRS demand replaced by its profile's memory and share;
    and "" or, when no profile of ``table`` holds a container's demand, why."""
    containers: list[ContainerGpuRequest] = []
    for container in request.containers:
        if container.drs is None:
            containers.append(container)
            continue
        chosen = drs.choose(table, container.drs)
        if chosen is None:
            return request, _no_profile(container, table)
        containers.append(
            container.model_copy(
                update={
                    "memory": MemoryRequest(mib=chosen.memory_mib),
                    "cores": drs.cores(chosen, table),
                }
            )
        )
    return request.model_copy(update={"containers": tuple(containers)}), ""


def _no_profile(container: ContainerGpuRequest, table: Table) -> str:
    demand = container.drs
    assert demand is not None
    asked = (
        f"{demand.size} slices"
        if demand.size is not None
        else f"memory {demand.memory}, cores {demand.cores}%"
    )
    names = ", ".join(p.name for p in table)
    return (
        f"CardTypeMismatch: container {container.name!r} asks for a DRS profile of {asked}; "
        f"the node's cards have {names}"
    )


Run = Callable[["Demand", Ints, "Bools | None"], "Evaluation"]


def drs_groups(cluster: Cluster, nodes: Ints, vendor: str) -> dict[Table | None, list[int]]:
    """The rows of ``nodes`` per profile table of their ``vendor`` cards."""
    groups: dict[Table | None, list[int]] = {}
    for row, node in enumerate(nodes.tolist()):
        groups.setdefault(node_table(cluster, node, vendor), []).append(row)
    return groups


def drs_parts(
    cluster: Cluster, demand: Demand, nodes: Ints, run: Run
) -> Iterator[tuple[Ints, Evaluation | str]]:
    """A pod asking for DRS profiles, evaluated group by group of ``nodes``: per
    group, its rows and either the evaluation (``run`` evaluates a demand on some
    nodes, on the kinds of card a mask allows) or why no node of it fits."""
    request = demand.request
    assert request is not None
    tables = model_tables(cluster)
    for table, rows in drs_groups(cluster, nodes, request.vendor).items():
        at = np.asarray(rows, dtype=np.int64)
        if table is None:
            yield at, run(demand, nodes[at], None)  # no DRS card there: the core says why
            continue
        resolved, why = resolve(request, table)
        if why:
            yield at, why
            continue
        kinds = np.asarray([t == table for t in tables], dtype=np.bool_)
        yield at, run(replace(demand, request=resolved), nodes[at], kinds)


# ---------------------------------------------------------------- Kunlun


def kunlun_cards(free: Iterable[int], count: int) -> list[int] | None:
    """Device indexes of ``count`` joined free XPUs, or None: the group of four (within
    an eight) with the fewest free cards that holds them; else, for two, a pair
    across groups; for four, one of HAMi's joined sets; eight, a whole free eight."""
    free_set = set(free)
    eights = sorted({i // 8 for i in free_set})
    if count == 8:
        return next(
            (
                list(range(e * 8, e * 8 + 8))
                for e in eights
                if set(range(e * 8, e * 8 + 8)) <= free_set
            ),
            None,
        )
    if count not in (1, 2, 4):
        return None
    groups: dict[int, list[int]] = {}
    for i in sorted(free_set):
        groups.setdefault(i // 4, []).append(i)
    fitting = [(len(cards), g) for g, cards in groups.items() if len(cards) >= count]
    if fitting:
        _, best = min(fitting)
        return groups[best][:count]
    for e in eights:
        base = e * 8
        sets = [(i, i + 4) for i in range(4)] if count == 2 else KUNLUN_FOURS
        for joined in sets:
            cards = [base + i for i in joined]
            if set(cards) <= free_set:
                return cards
    return None


def _index_of(uuid: str) -> int | None:
    """A capacity-derived card's device index (its UUID is ``<node>-kunlun-<index>``)."""
    tail = uuid.rpartition("-")[2]
    return int(tail) if tail.isdigit() and len(tail) <= 6 else None


def kunlun_topology(cluster: Cluster, request: PodGpuRequest, evaluation: Evaluation) -> None:
    """Replace the core's cards by joined ones on each fitting node, in place (a pod
    of whole XPUs has one container asking for them: vendorrequests.check_pod)."""
    asking = [i for i, c in enumerate(request.containers) if c.vendor == KUNLUN]
    if len(asking) != 1:
        return
    slot = asking[0]
    container = request.containers[slot]
    chosen = evaluation.chosen[slot]
    for row in np.flatnonzero(evaluation.feasible).tolist():
        node = int(evaluation.nodes[row])
        # the core took cards it may use: any free card of the same kind may stand in
        taken = [int(c) for c in chosen[row].tolist()]
        kinds = {int(cluster.model_id[c]) for c in taken}
        free: dict[int, int] = {}
        for card in range(int(cluster.node_start[node]), int(cluster.node_start[node + 1])):
            index = _index_of(cluster.uuids[card])
            usable = (
                int(cluster.model_id[card]) in kinds
                and bool(cluster.present[card] and cluster.healthy[card])
                and not cluster.cordoned[card]
                and int(cluster.used_slots[card]) == 0
            )
            if usable and index is not None:
                free[index] = card
        # the core's own picks passed the pod's selectors; the others must too
        allowed = _allowed(cluster, request, free, set(taken))
        picked = kunlun_cards(allowed, container.count)
        if picked is None:
            evaluation.feasible[row] = False
            evaluation.score[row] = -np.inf
            evaluation.code[row] = Code.NUMA_NOT_FIT
            evaluation.detail[row] = (
                f"NumaNotFit: container {container.name!r} needs {container.count} joined "
                f"XPU(s); the free ones ({', '.join(str(i) for i in sorted(allowed)) or 'none'}) "
                "are not joined so"
            )
            continue
        chosen[row] = [free[i] for i in picked]


def _allowed(
    cluster: Cluster, request: PodGpuRequest, free: dict[int, int], taken: set[int]
) -> list[int]:
    selector = request.selector
    found = []
    for index, card in free.items():
        uuid = cluster.uuids[card]
        if card not in taken:
            if selector.include_uuids and uuid not in selector.include_uuids:
                continue
            if uuid in selector.exclude_uuids:
                continue
        found.append(index)
    return found


__all__ = [
    "KUNLUN",
    "drs_parts",
    "kunlun_cards",
    "kunlun_topology",
    "node_table",
    "resolve",
    "wants_drs",
]
