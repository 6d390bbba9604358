"""HAMi's placement cases against gpuslice's engine: cards, node, failure reason.

Each case's cards become a :class:`Cluster` as the ledger would hold them, its
pod is read by ``parse_pod`` and evaluated on every node with the engine's
public entry points, as the extender does. HAMi cases without a GPU policy run
with HAMi's default (spread), and HAMi's default node policy (binpack).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest

from gpuslice_common.models import GpuPolicy, NodePolicy, Placement
from gpuslice_common.requests import parse_pod
from gpuslice_scheduler.cluster import Cluster
from gpuslice_scheduler.engine import Demand, Evaluation, evaluate, placement
from gpuslice_scheduler.fragmentation import default_mix
from tests.hami.cases import Case, nodes, params, pod_manifest, request_settings


def _evaluate(case: Case) -> tuple[Cluster, Demand, Evaluation]:
    data = case.data
    cluster = Cluster.build(nodes(data["nodes"]))
    request = parse_pod(pod_manifest(data["pod"]), request_settings(data.get("settings")))
    assert request is not None, f"{case.source}: the pod asks for no GPU"
    policy = data.get("policy") or {}
    demand = Demand.of(
        request,
        GpuPolicy(policy.get("gpu", "spread")),
        default_node_policy=NodePolicy(policy.get("node", "binpack")),
    )
    mix = default_mix() if demand.gpu_policy is GpuPolicy.FRAGMENTATION else None
    return cluster, demand, evaluate(cluster, demand, np.arange(cluster.node_count), mix)


def _cards(p: Placement) -> dict[str, list[Any]]:
    """Per container, its cards: a UUID, or UUID with the MIG instance where there is one."""
    found: dict[str, list[Any]] = {}
    for container in p.containers:
        cards: list[Any] = []
        for grant in container.devices:
            if grant.mig is None:
                cards.append(grant.uuid)
            else:
                place = grant.mig.placement
                cards.append(
                    {
                        "uuid": grant.uuid,
                        "profile": grant.mig.profile,
                        "placement": [place.start, place.size],
                    }
                )
        found[container.name] = sorted(cards, key=str)
    return found


def _expected_cards(wanted: Mapping[str, list[Any]]) -> dict[str, list[Any]]:
    return {name: sorted(cards, key=str) for name, cards in wanted.items()}


def _counts(detail: str) -> dict[str, int]:
    """The failing cards counted by reason, from the engine's line for a node."""
    counted = re.search(r"\(([^()]*)\)$", detail)
    assert counted is not None, detail
    return {
        reason: int(number)
        for number, reason in (part.split(" ") for part in counted.group(1).split(", "))
    }


@pytest.mark.parametrize("case", params("place"))
def test_hami_placement_case(case: Case) -> None:
    cluster, demand, ev = _evaluate(case)
    outcome = case.outcome
    got: dict[str, Any] = {}
    for row, name in enumerate(cluster.node_names):
        if ev.feasible[row]:
            got[name] = _cards(placement(cluster, demand, ev, row))
        else:
            reason = ev.reason(row)
            got[name] = reason.value if reason is not None else "infeasible without a reason"
    wanted: dict[str, Any] = {}
    for name, value in outcome["nodes"].items():
        if isinstance(value, str):
            wanted[name] = value
        elif "counts" in value:  # a failure with the cards' reasons counted
            row = cluster.node_names.index(name)
            assert not ev.feasible[row], f"{case.source}: {name} fits"
            assert _counts(ev.detail[row]) == value["counts"], f"{case.source}: {ev.detail[row]}"
            wanted[name] = value.get("reason", got[name])
        else:
            wanted[name] = _expected_cards(value)
    # nodes the case leaves out are not compared (HAMi's filter names only the chosen one)
    assert {name: got[name] for name in wanted} == wanted, f"{case.source}: {ev.detail}"
    grants = [
        grant
        for row in range(cluster.node_count)
        if ev.feasible[row]
        for container in placement(cluster, demand, ev, row).containers
        for grant in container.devices
    ]
    for uuid, mib in (outcome.get("booked_mib") or {}).items():
        booked = [grant.memory_mib for grant in grants if grant.uuid == uuid]
        assert booked == [mib], f"{case.source}: {uuid} booked {booked} MiB"
    for uuid, cores in (outcome.get("booked_cores") or {}).items():
        booked = [grant.cores for grant in grants if grant.uuid == uuid]
        assert booked == [cores], f"{case.source}: {uuid} booked {booked} cores"
    if "best" in outcome:
        scores = np.where(ev.feasible, ev.score, -np.inf)
        top = np.flatnonzero(scores == scores.max())
        chosen = [cluster.node_names[int(r)] for r in top]
        assert chosen == [outcome["best"]], f"{case.source}: scores {ev.score.tolist()}"
