"""Whole Kunlun XPUs are taken in joined groups, as HAMi takes them."""

from __future__ import annotations

import pytest

from gpuslice_scheduler.vendorfit import kunlun_cards


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
