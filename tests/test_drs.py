"""Enflame DRS profiles: read from the node's table, carried as a card's model,
chosen as HAMi chooses them."""

from __future__ import annotations

import pytest

from gpuslice_common import drs
from gpuslice_common.models import DrsDemand

# the table of HAMi's Enflame tests: a card of 6 slices
TABLE = drs.table(
    [drs.profile("6g.40gb", "2"), drs.profile("1g.6gb", "0"), drs.profile("3G.20GB", "1")]
)


def test_a_table_is_sorted_as_hami_tries_it_and_survives_the_model() -> None:
    assert [p.name for p in TABLE] == ["1g.6gb", "3g.20gb", "6g.40gb"]
    model = drs.model_of(TABLE, "3")
    assert model == "DRS minor=3 1g.6gb=0 3g.20gb=1 6g.40gb=2"
    assert drs.profiles_of(model) == TABLE
    assert drs.minor_of(model) == "3"
    # another vendor's model is no table
    for other in ("MLU", "DRS", "DRS 1g.6gb=0", "DRS minor=x 1g.6gb=0", "DRS minor=1 1g.6gb"):
        assert drs.profiles_of(other) is None


def test_a_profile_is_chosen_by_slices_or_by_memory_and_cores() -> None:
    assert drs.choose(TABLE, DrsDemand(size=3)) == TABLE[1]
    assert drs.choose(TABLE, DrsDemand(size=2)) is None
    # HAMi's example: 20480 (above twice the largest 40 GB: MiB) and 40 % -> 3g.20gb
    assert drs.choose(TABLE, DrsDemand(memory=20480, cores=40)) == TABLE[1]
    # 20 (GB) alone, then cores that only the whole card holds
    assert drs.choose(TABLE, DrsDemand(memory=20)) == TABLE[1]
    assert drs.choose(TABLE, DrsDemand(cores=51)) == TABLE[2]
    assert drs.choose(TABLE, DrsDemand(memory=41)) is None
    # shares round up: a slice of six is 17 %
    assert [drs.cores(p, TABLE) for p in TABLE] == [17, 50, 100]
    assert drs.granted(TABLE, 20 * 1024, 50) == TABLE[1]
    assert drs.granted(TABLE, 20 * 1024, 17) is None


@pytest.mark.parametrize(
    ("name", "profile_id", "message"),
    [
        ("1g", "0", "is not <slices>g.<memory>gb"),
        ("0g.6gb", "0", "outside 1..1024 slices"),
        ("4294967299g.6gb", "0", "is not <slices>g.<memory>gb"),
        ("2048g.6gb", "0", "outside 1..1024 slices"),
        ("1g.6gb", "a,b", "is not a short word"),
        ("1g.6gb", "x" * 17, "is not a short word"),
    ],
)
def test_hostile_profiles_are_refused_naming_them(name: str, profile_id: str, message: str) -> None:
    with pytest.raises(drs.ProfileError, match=message):
        drs.profile(name, profile_id)


def test_a_table_is_bounded() -> None:
    with pytest.raises(drs.ProfileError, match="lists no profiles"):
        drs.table([])
    with pytest.raises(drs.ProfileError, match="listed twice"):
        drs.table([drs.profile("1g.6gb", "0"), drs.profile("1G.6GB", "1")])
    many = [drs.profile(f"{i}g.{i}gb", str(i)) for i in range(1, 18)]
    with pytest.raises(drs.ProfileError, match="17 profiles, above 16"):
        drs.table(many)
    with pytest.raises(drs.ProfileError, match="do not fit in 128 characters"):
        drs.model_of(drs.table(many[:16]), "0")
    with pytest.raises(drs.ProfileError, match="is not a device number"):
        drs.model_of(TABLE, "0; rm")


def test_a_table_whose_grants_cannot_be_told_apart_is_refused() -> None:
    # of 200 slices, one slice and two are both 1 % of the card: a grant of 6 GB
    # and 1 % would read back at bind as the first, whichever the pod was given
    one, two, whole = (
        drs.profile("1g.6gb", "a"),
        drs.profile("2g.6gb", "b"),
        drs.profile("200g.48gb", "c"),
    )
    with pytest.raises(drs.ProfileError, match=r"1g\.6gb and 2g\.6gb are both 6 GB and 1 %"):
        drs.table([whole, two, one])
    # the same sizes with distinct memory are granted apart
    table = drs.table([whole, drs.profile("2g.12gb", "b"), one])
    assert drs.granted(table, 12 * 1024, 1) == table[1]
