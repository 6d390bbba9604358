"""MIG cards in the ledger, against a real redis-server: the slices a reservation
takes are checked and booked atomically with the rest, freed on release, put back
from a pod's own record; hostile reports and forged grants are refused."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError
from redis.asyncio import Redis

from gpuslice_common.ledger import BadRecord, Ledger, ReservationConflict
from gpuslice_common.models import (
    ContainerAssignment,
    DeviceGrant,
    MigGrant,
    MigPlacement,
    NodeInventory,
    Placement,
    PodRef,
)
from tests.mig_cards import a100, grant, mig_node, mig_placement, static

GPU = "GPU-n1-0"


async def used_mask(ledger: Ledger, node: str = "n1", card: int = 0) -> int:
    return (await ledger.node_gpus(node))[card].used.mig_mask


async def test_register_stores_mode_profiles_and_static_instances(ledger: Ledger) -> None:
    inv = mig_node("n1", plain=1, instances=(static("1g.5gb", 6),))
    await ledger.register_node(inv, rebuilt=True)
    mig, plain = await ledger.node_gpus("n1")
    assert mig.device == inv.devices[0]  # profiles and static instances round-trip
    assert mig.device.mig_static_mask == 0b0100_0000
    assert mig.used.mig_mask == 0
    assert plain.device.mode == "hami-core"
    assert plain.device.mig_profiles == ()


async def test_reserve_books_slices_and_release_frees_them(ledger: Ledger) -> None:
    await ledger.register_node(mig_node("n1"), rebuilt=True)
    await ledger.reserve(mig_placement("a", "n1", [grant(GPU, "3g.20gb", 4)]))
    await ledger.reserve(
        mig_placement("b", "n1", [grant(GPU, "1g.5gb", 0), grant(GPU, "1g.5gb", 1)])
    )
    assert await used_mask(ledger) == 0b1111_0011
    [card] = await ledger.node_gpus("n1")
    assert (card.used.memory_mib, card.used.cores, card.used.slots) == (19968 + 2 * 4864, 70, 3)
    await ledger.release("a")
    assert await used_mask(ledger) == 0b0000_0011
    await ledger.release("a")  # idempotent: nothing freed twice
    await ledger.release("b")
    assert await used_mask(ledger) == 0
    assert await ledger.check_node("n1") == []


async def test_overlapping_slices_are_refused_and_change_nothing(ledger: Ledger) -> None:
    await ledger.register_node(mig_node("n1", instances=(static("1g.5gb", 6),)), rebuilt=True)
    await ledger.reserve(mig_placement("a", "n1", [grant(GPU, "2g.10gb", 2)]))
    for uid, g in (("b", grant(GPU, "1g.5gb", 3)), ("c", grant(GPU, "1g.10gb", 6))):
        with pytest.raises(ReservationConflict) as info:
            await ledger.reserve(mig_placement(uid, "n1", [g]))
        assert info.value.reason == "CardMigTopologyInfeasible"
        assert await ledger.placement(uid) is None
    assert await used_mask(ledger) == 0b0000_1100
    assert await ledger.check_node("n1") == []


async def test_init_and_app_instances_never_share_slices(ledger: Ledger) -> None:
    await ledger.register_node(mig_node("n1"), rebuilt=True)
    p = mig_placement("a", "n1", [grant(GPU, "1g.5gb", 0)], init=[grant(GPU, "1g.5gb", 1)])
    assert p.footprint()[GPU].mig_mask == 0b11
    await ledger.reserve(p)
    assert await used_mask(ledger) == 0b11
    with pytest.raises(ValidationError, match="overlaps another of the pod's"):
        mig_placement("b", "n1", [grant(GPU, "1g.5gb", 2)], init=[grant(GPU, "1g.5gb", 2)])


async def test_restore_puts_slices_back_and_refuses_a_conflicting_record(
    ledger: Ledger, redis_url: str
) -> None:
    await ledger.register_node(mig_node("n1"), rebuilt=True)
    a = await ledger.reserve(mig_placement("a", "n1", [grant(GPU, "4g.20gb", 0)]))
    client: Redis = Redis.from_url(redis_url)
    await client.flushdb()  # Redis lost everything
    await client.aclose()
    await ledger.register_node(mig_node("n1"))
    record = Placement.from_annotation(a.to_annotation())
    restored, new = await ledger.restore(record, running=True)
    assert new
    assert restored.containers == a.containers
    assert await used_mask(ledger) == 0b1111
    stale = mig_placement("old", "n1", [grant(GPU, "3g.20gb", 0)])  # an outdated record
    with pytest.raises(ReservationConflict, match="CardMigTopologyInfeasible"):
        await ledger.restore(stale, running=True)
    assert await ledger.check_node("n1") == []


async def test_pods_share_a_card_by_instances_and_a_container_never_holds_a_card_twice(
    ledger: Ledger,
) -> None:
    await ledger.register_node(mig_node("n1"), rebuilt=True)
    for uid, start in (("a", 6), ("b", 5)):
        await ledger.reserve(
            Placement(
                pod=PodRef(uid=uid),
                node="n1",
                containers=(ContainerAssignment(name="c", devices=(grant(GPU, "1g.5gb", start),)),),
            )
        )
    [card] = await ledger.node_gpus("n1")
    assert (card.used.mig_mask, card.used.slots, card.used.memory_mib) == (0b0110_0000, 2, 9728)
    # two containers of one pod: their instances must not meet
    overlapping = (
        ContainerAssignment(name="c", devices=(grant(GPU, "1g.10gb", 4),)),
        ContainerAssignment(name="d", devices=(grant(GPU, "1g.5gb", 5),)),
    )
    with pytest.raises(ValidationError, match="overlaps another of the pod's"):
        Placement(pod=PodRef(uid="x"), node="n1", containers=overlapping)
    # a container's cards are distinct, MIG or not (a CUDA process enumerates one
    # MIG device, so a second instance of the card would sit idle)
    with pytest.raises(ValidationError, match="same card twice"):
        ContainerAssignment(name="c", devices=(grant(GPU, "1g.5gb", 3), grant(GPU, "1g.5gb", 4)))
    with pytest.raises(ValidationError, match="same card twice"):
        ContainerAssignment(
            name="c",
            devices=(grant(GPU, "1g.5gb", 3), DeviceGrant(uuid=GPU, memory_mib=1, cores=1)),
        )


def forged(grant_: DeviceGrant, uid: str = "x") -> Placement:
    return Placement(
        pod=PodRef(uid=uid),
        node="n1",
        containers=(ContainerAssignment(name="c", devices=(grant_,)),),
    )


@pytest.mark.parametrize(
    "bad",
    [
        # a placement the profile does not have
        grant(GPU, "3g.20gb", 0).model_copy(
            update={"mig": MigGrant(profile="3g.20gb", placement=MigPlacement(start=2, size=4))}
        ),
        # a profile the card does not have
        grant(GPU, "1g.5gb", 0).model_copy(
            update={"mig": MigGrant(profile="1g.6gb", placement=MigPlacement(start=0, size=1))}
        ),
        # slices past the card's eight
        grant(GPU, "1g.5gb", 0).model_copy(
            update={"mig": MigGrant(profile="1g.5gb", placement=MigPlacement(start=9, size=1))}
        ),
        # less memory booked than the profile takes
        grant(GPU, "7g.40gb", 0).model_copy(update={"memory_mib": 1}),
        # no instance at all on a card in mode mig
        DeviceGrant(uuid=GPU, memory_mib=1024, cores=10),
    ],
    ids=["placement", "profile", "outside", "memory", "no-instance"],
)
async def test_a_forged_grant_is_an_invalid_request(ledger: Ledger, bad: DeviceGrant) -> None:
    await ledger.register_node(mig_node("n1"), rebuilt=True)
    with pytest.raises(ReservationConflict) as info:
        await ledger.reserve(forged(bad))
    assert info.value.reason == "InvalidRequest"
    assert await used_mask(ledger) == 0
    assert (await ledger.node_gpus("n1"))[0].used.slots == 0


async def test_a_mig_grant_on_a_card_not_in_mig_mode_is_an_invalid_request(
    ledger: Ledger,
) -> None:
    await ledger.register_node(mig_node("n1", cards=0, plain=1), rebuilt=True)
    with pytest.raises(ReservationConflict) as info:
        await ledger.reserve(forged(grant("GPU-n1-0", "1g.5gb", 0)))
    assert info.value.reason == "InvalidRequest"


async def test_a_footprint_that_hides_slices_is_refused(ledger: Ledger) -> None:
    """The script checks the footprint's mask against the grants themselves."""
    await ledger.register_node(mig_node("n1"), rebuilt=True)
    p = mig_placement("a", "n1", [grant(GPU, "1g.5gb", 0)])
    record = p.model_dump(mode="json", include={"pod", "node", "containers", "policy"})
    for mask in (0, 0b10, 2**16, -1):
        fp = [[GPU, 4864, 14, 1, 0, mask]]
        reply = await ledger._run(
            "reserve", ledger.node_keys("n1").all(), ["a", json.dumps(record), json.dumps(fp), ""]
        )
        assert reply[::2] == ["fail", "InvalidRequest"], mask
    assert await used_mask(ledger) == 0


def test_a_hostile_report_of_overlapping_or_outside_instances_is_refused() -> None:
    with pytest.raises(ValidationError, match="overlaps another"):
        a100("GPU-0", instances=(static("3g.20gb", 4), static("1g.5gb", 5, uuid="MIG-1")))
    bare = a100("GPU-0").model_copy(update={"mig_profiles": a100("GPU-0").mig_profiles[:1]})
    with pytest.raises(ValidationError, match="outside the card"):
        type(bare).model_validate(
            {**bare.model_dump(), "mig_instances": [static("3g.20gb", 4).model_dump()]}
        )
    with pytest.raises(ValidationError):
        NodeInventory.model_validate(
            {"node": "n1", "devices": [{**a100("GPU-0").model_dump(), "mode": "hami-core"}]}
        )


@pytest.mark.parametrize(
    ("field", "value", "problem"),
    [
        ("mig_profiles", "[[1,2]]", "MIG facts"),
        ("mig_profiles", "{}", "not a JSON list"),
        ("mig_profiles", "[" + "[]," * 9000 + "[]]", "characters long"),
        ("mig_instances", '[["MIG-x","1g.5gb",0,1],["MIG-y","1g.5gb",0,1]]', "MIG facts"),
        ("mig_used", "65536", "above its bound"),
        ("mig_used", "256", "outside the card"),
        ("mig_static", "1", "not its profiles'"),
        ("mode", "vgpu", "no sharing mode"),
    ],
)
async def test_a_stored_mig_record_no_gpuslice_writes_is_a_bad_record(
    ledger: Ledger, field: str, value: str, problem: str
) -> None:
    await ledger.register_node(mig_node("n1"), rebuilt=True)
    await ledger.register_node(mig_node("n2"), rebuilt=True)
    await ledger.redis.hset(ledger.node_keys("n1").gpus, f"{GPU}|{field}", value)
    read = await ledger.read_gpus(["n1", "n2"])
    assert isinstance(read["n1"], BadRecord)
    assert problem in read["n1"].problem
    assert not isinstance(read["n2"], BadRecord)  # the other node reads as before


async def test_a_mode_flip_while_a_pod_holds_slices_frees_none_of_them(ledger: Ledger) -> None:
    """A node agent reporting the card hami-core and then mig again (a reconfigured
    or hostile node) cannot make the ledger forget slices a pod still holds."""
    await ledger.register_node(mig_node("n1"), rebuilt=True)
    await ledger.reserve(mig_placement("a", "n1", [grant(GPU, "3g.20gb", 4)]))
    await ledger.register_node(mig_node("n1", cards=0, plain=1))  # the same card, hami-core
    with pytest.raises(ReservationConflict) as info:  # a MIG grant on it now is forged
        await ledger.reserve(mig_placement("b", "n1", [grant(GPU, "1g.5gb", 5)]))
    assert info.value.reason == "InvalidRequest"
    await ledger.register_node(mig_node("n1"))  # back in mig mode
    assert await used_mask(ledger) == 0b1111_0000
    with pytest.raises(ReservationConflict) as info:
        await ledger.reserve(mig_placement("c", "n1", [grant(GPU, "1g.5gb", 5)]))
    assert info.value.reason == "CardMigTopologyInfeasible"
    await ledger.release("a")
    assert await used_mask(ledger) == 0
    assert await ledger.check_node("n1") == []


async def test_a_mig_pod_cannot_take_a_card_a_hami_core_pod_holds_whole(ledger: Ledger) -> None:
    """A card with an exclusive hami-core pod that its agent then reports in mig mode
    gives no instance until that pod is released."""
    await ledger.register_node(mig_node("n1", cards=0, plain=1), rebuilt=True)
    whole = DeviceGrant(uuid=GPU, memory_mib=40960, cores=100)
    await ledger.reserve(
        Placement(
            pod=PodRef(uid="w", namespace="ns", name="w"),
            node="n1",
            containers=(ContainerAssignment(name="c", devices=(whole,)),),
        )
    )
    await ledger.register_node(mig_node("n1"))
    with pytest.raises(ReservationConflict) as info:
        await ledger.reserve(mig_placement("m", "n1", [grant(GPU, "1g.5gb", 6)]))
    assert info.value.reason == "ExclusiveDeviceAllocateConflict"
    assert await used_mask(ledger) == 0
