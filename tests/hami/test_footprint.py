"""HAMi's cases about what a placed pod holds on each card, against
:meth:`Placement.footprint` (what the ledger reserves for the pod)."""

from __future__ import annotations

import pytest

from gpuslice_common.models import ContainerAssignment, DeviceGrant, Placement, PodRef
from tests.hami.cases import Case, params


@pytest.mark.parametrize("case", params("footprint"))
def test_hami_footprint_case(case: Case) -> None:
    containers = tuple(
        ContainerAssignment(
            name=c["name"],
            init=c.get("init", False),
            devices=tuple(
                DeviceGrant(uuid=d["uuid"], memory_mib=d["mib"], cores=d["cores"])
                for d in c["devices"]
            ),
        )
        for c in case.data["containers"]
    )
    placement = Placement(pod=PodRef(uid="uid-hami-case"), node="node1", containers=containers)
    footprint = placement.footprint()
    for uuid, wanted in case.outcome["cards"].items():
        got = footprint[uuid].model_dump()
        assert {k: got[k] for k in wanted} == wanted, f"{case.source}: {uuid} holds {got}"
