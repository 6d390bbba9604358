"""Whole Kunlun XPUs are taken in joined groups, as HAMi takes them; a node's DRS
profiles are its present cards'."""

from __future__ import annotations

import pytest

from gpuslice_common import drs
from gpuslice_common.models import GpuCapacity, GpuDevice, GpuState, GpuUsage
from gpuslice_scheduler.cluster import Cluster
from gpuslice_scheduler.vendorfit import kunlun_cards, node_table


@pytest.mark.parametrize(
    ("free", "count", "expected"),
    [
        (range(8), 8, [0, 1, 2, 3, 4, 5, 6, 7]),
        ([0, 1, 2, 3, 4, 5, 6], 8, None),
        # the fullest group that holds them: the right one has 2 free, the left 4
        ([0, 1, 2, 3, 5, 6], 2, [5, 6]),
        ([0, 1, 2, 3, 5, 6], 1, [5]),
        ([0, 1, 2, 3, 5, 6], 4, [0, 1, 2, 3]),
        ([0, 5, 6], 2, [5, 6]),
        # no group holds two: a pair across the groups
        ([1, 5], 2, [1, 5]),
        ([0, 6], 2, None),
        # four across the groups: one of HAMi's joined sets
        ([0, 1, 4, 5], 4, [0, 1, 4, 5]),
        ([0, 3, 4, 7], 4, [0, 3, 4, 7]),
        ([0, 1, 4, 6], 4, None),
        ([], 1, None),
        (range(8), 3, None),
        # a second eight
        ([8, 9, 10, 11, 12], 4, [8, 9, 10, 11]),
    ],
)
def test_joined_xpus(free: list[int], count: int, expected: list[int] | None) -> None:
    assert kunlun_cards(free, count) == expected


def drs_card(index: int, model: str, present: bool = True) -> GpuState:
    return GpuState(
        node="n0",
        device=GpuDevice(
            uuid=f"n0-enflame-drs-{index}",
            index=index,
            model=model,
            memory_mib=40960,
            vendor="enflame",
        ),
        capacity=GpuCapacity(memory_mib=40960, cores=100, slots=6),
        used=GpuUsage(memory_mib=6144 if not present else 0, cores=17 if not present else 0),
        present=present,
    )


def test_a_nodes_drs_table_is_its_present_cards() -> None:
    """A withdrawn card still in use may list the table the node had before: the
    node's table is its present cards'."""
    old = drs.table([drs.profile("1g.6gb", "0"), drs.profile("6g.40gb", "2")])
    new = drs.table([drs.profile("2g.12gb", "7"), drs.profile("6g.40gb", "8")])
    cluster = Cluster.build(
        [
            (
                "n0",
                [
                    drs_card(0, drs.model_of(old, "0"), present=False),
                    drs_card(1, drs.model_of(new, "1")),
                ],
            )
        ]
    )
    assert node_table(cluster, 0, "enflame") == new
    assert node_table(cluster, 0, "nvidia") is None
    gone = Cluster.build([("n0", [drs_card(0, drs.model_of(old, "0"), present=False)])])
    assert node_table(gone, 0, "enflame") == old
