"""Cards of several vendors on one node: each registration replaces its own vendor's
cards only, and the scheduler's readers see NVIDIA's. Against a real redis-server."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from pydantic import ValidationError

from gpuslice_common.ledger import Ledger, LedgerError, NotReserved, ReservationConflict
from gpuslice_common.models import (
    ContainerAssignment,
    DeviceGrant,
    GpuDevice,
    NodeInventory,
    Placement,
    PodRef,
    VgpuMode,
)
from tests.conftest import make_inventory


def dcus(node: str, count: int = 2, split_count: int = 4) -> NodeInventory:
    devices = tuple(
        GpuDevice(
            uuid=f"DCU-{node}-{i}",
            index=i,
            model="DCU-Z100",
            memory_mib=32768,
            numa=0,
            vendor="hygon",
        )
        for i in range(count)
    )
    return NodeInventory(node=node, devices=devices, split_count=split_count, vendor="hygon")


async def test_vendor_registrations_leave_each_other_be(ledger: Ledger) -> None:
    await ledger.register_node(make_inventory("n1", gpus=2), rebuilt=True)
    assert await ledger.register_node(dcus("n1")) == 4
    # the scheduler's view: NVIDIA's cards only
    assert [c.device.uuid for c in await ledger.node_gpus("n1")] == ["GPU-n1-0", "GPU-n1-1"]
    hygon = await ledger.node_gpus("n1", vendor="hygon")
    assert [(c.device.uuid, c.device.vendor, c.capacity.slots) for c in hygon] == [
        ("DCU-n1-0", "hygon", 4),
        ("DCU-n1-1", "hygon", 4),
    ]
    every = (await ledger.read_nodes(["n1"], vendor=None))["n1"]
    assert not isinstance(every, Exception)
    assert sorted(c.vendor for c in every.cards) == ["hygon", "hygon", "nvidia", "nvidia"]
    # the node agent's next heartbeat keeps the DCUs; one DCU fewer keeps the GPUs
    await ledger.register_node(make_inventory("n1", gpus=1), rebuilt=True)
    await ledger.register_node(dcus("n1", count=1))
    every = (await ledger.read_nodes(["n1"], vendor=None))["n1"]
    assert not isinstance(every, Exception)
    assert sorted(c.uuid for c in every.cards) == ["DCU-n1-0", "GPU-n1-0"]


async def test_vendor_registration_is_not_a_heartbeat(ledger: Ledger) -> None:
    await ledger.register_node(make_inventory("n1", gpus=1), rebuilt=True)
    beat = (await ledger.node_liveness(["n1"]))["n1"].heartbeat
    assert beat is not None
    await ledger.register_node(dcus("n1"))
    assert (await ledger.node_liveness(["n1"]))["n1"].heartbeat == beat
    # the agent went silent: its cards turn unhealthy, the DCUs keep their plugin's word
    assert await ledger.mark_unavailable("n1", beat + timedelta(milliseconds=1))
    assert [c.device.healthy for c in await ledger.node_gpus("n1")] == [False]
    assert [c.device.healthy for c in await ledger.node_gpus("n1", vendor="hygon")] == [
        True,
        True,
    ]


async def test_a_vendor_only_node_has_no_heartbeat_to_miss(ledger: Ledger) -> None:
    await ledger.register_node(dcus("n2"))
    assert "n2" in await ledger.nodes()
    assert await ledger.node_gpus("n2") == []
    assert not await ledger.mark_unavailable("n2", (await ledger.now()) + timedelta(hours=1))


async def test_a_uuid_of_another_vendors_card_is_refused(ledger: Ledger) -> None:
    await ledger.register_node(make_inventory("n1", gpus=1), rebuilt=True)
    clash = GpuDevice(uuid="GPU-n1-0", index=0, model="DCU", memory_mib=1024, vendor="hygon")
    with pytest.raises(LedgerError, match="card GPU-n1-0 is a nvidia card there"):
        await ledger.register_node(NodeInventory(node="n1", devices=(clash,), vendor="hygon"))
    # nothing written: the GPU is still NVIDIA's, with its memory
    [card] = await ledger.node_gpus("n1")
    assert (card.device.vendor, card.device.memory_mib) == ("nvidia", 16384)
    assert await ledger.node_gpus("n1", vendor="hygon") == []


async def test_a_vendor_annotation_naming_an_nvidia_card_first_cannot_block_the_node_agent(
    ledger: Ledger, caplog: pytest.LogCaptureFixture
) -> None:
    """A vendor plugin (or anyone who can annotate the node) naming the UUID of an
    NVIDIA card before the node agent registers it: the agent, which found the card
    through NVML, takes it; a pod on the squatted card keeps it, and the agent's
    other cards and its heartbeat are registered all the same."""
    squat = GpuDevice(uuid="GPU-n1-0", index=0, model="DCU", memory_mib=1024, vendor="hygon")
    other = GpuDevice(uuid="GPU-n1-1", index=1, model="DCU", memory_mib=1024, vendor="hygon")
    await ledger.register_node(NodeInventory(node="n1", devices=(squat,), vendor="hygon"))
    await ledger.register_node(make_inventory("n1", gpus=1), rebuilt=True)
    [card] = await ledger.node_gpus("n1")
    assert (card.device.uuid, card.device.vendor, card.device.memory_mib) == (
        "GPU-n1-0",
        "nvidia",
        16384,
    )
    assert await ledger.node_gpus("n1", vendor="hygon") == []
    assert (await ledger.node_liveness(["n1"]))["n1"].heartbeat is not None
    # the vendor's next registration is the one refused
    with pytest.raises(LedgerError, match="card GPU-n1-0 is a nvidia card there"):
        await ledger.register_node(NodeInventory(node="n1", devices=(squat,), vendor="hygon"))

    # held by a pod: the squatted card stays the vendor's until released
    await ledger.register_node(NodeInventory(node="n1", devices=(other,), vendor="hygon"))
    await ledger.reserve(
        Placement(
            pod=PodRef(uid="p", namespace="ns", name="p"),
            node="n1",
            containers=(
                ContainerAssignment(
                    name="c",
                    vendor="hygon",
                    devices=(DeviceGrant(uuid="GPU-n1-1", memory_mib=512, cores=0),),
                ),
            ),
        )
    )
    assert await ledger.register_node(make_inventory("n1", gpus=2), rebuilt=True) == 2
    assert [c.device.uuid for c in await ledger.node_gpus("n1")] == ["GPU-n1-0"]
    assert any("GPU-n1-1" in r.getMessage() for r in caplog.records)
    await ledger.release("p")
    await ledger.register_node(make_inventory("n1", gpus=2), rebuilt=True)
    assert [c.device.uuid for c in await ledger.node_gpus("n1")] == ["GPU-n1-0", "GPU-n1-1"]


async def test_withdrawn_vendor_cards_in_use_stay_until_released(ledger: Ledger) -> None:
    await ledger.register_node(dcus("n1", count=1))
    await ledger.register_node(make_inventory("n1", gpus=1), rebuilt=True)
    grant = DeviceGrant(uuid="DCU-n1-0", memory_mib=1000, cores=10)
    held = Placement(
        pod=PodRef(uid="p1", namespace="ns", name="p1"),
        node="n1",
        containers=(ContainerAssignment(name="c0", devices=(grant,), vendor="hygon"),),
    )
    await ledger.reserve(held)
    await ledger.register_node(NodeInventory(node="n1", devices=(), vendor="hygon"))
    [card] = await ledger.node_gpus("n1", vendor="hygon")
    assert not card.present
    assert card.used.memory_mib == 1000
    await ledger.release("p1")
    await ledger.register_node(NodeInventory(node="n1", devices=(), vendor="hygon"))
    assert await ledger.node_gpus("n1", vendor="hygon") == []
    assert [c.device.uuid for c in await ledger.node_gpus("n1")] == ["GPU-n1-0"]


def _held(uid: str, *containers: tuple[str, str, str | None]) -> Placement:
    """A placement of one grant per container: (container, card, vendor or None for
    a record that names none)."""
    made = []
    for name, uuid, vendor in containers:
        grant = DeviceGrant(uuid=uuid, memory_mib=1000, cores=10)
        made.append(ContainerAssignment(name=name, devices=(grant,), vendor=vendor or "nvidia"))
    return Placement(pod=PodRef(uid=uid, namespace="ns", name=uid), node="n1", containers=(*made,))


async def test_a_grant_on_another_vendors_card_is_refused(ledger: Ledger) -> None:
    await ledger.register_node(make_inventory("n1", gpus=1), rebuilt=True)
    await ledger.register_node(dcus("n1", count=1))
    refused = [
        _held("p1", ("c0", "DCU-n1-0", None)),  # an NVIDIA container on a DCU
        _held("p2", ("c0", "GPU-n1-0", "hygon")),  # a DCU container on an NVIDIA card
        _held("p3", ("c0", "DCU-n1-0", "iluvatar")),  # a third vendor's container
        # one container right, the other not: nothing is reserved
        _held("p4", ("c0", "DCU-n1-0", "hygon"), ("c1", "GPU-n1-0", "hygon")),
    ]
    for placement in refused:
        with pytest.raises(ReservationConflict) as err:
            await ledger.reserve(placement)
        assert err.value.reason == "InvalidRequest"
    for card in [*await ledger.node_gpus("n1"), *await ledger.node_gpus("n1", vendor="hygon")]:
        assert card.used.memory_mib == 0
        assert card.used.slots == 0
    # each container on its own vendor's card is reserved, and the record keeps the vendor
    placed = await ledger.reserve(
        _held("p5", ("c0", "DCU-n1-0", "hygon"), ("c1", "GPU-n1-0", None))
    )
    assert [c.vendor for c in placed.containers] == ["hygon", "nvidia"]
    [dcu] = await ledger.node_gpus("n1", vendor="hygon")
    assert dcu.used.memory_mib == 1000


async def test_a_record_with_a_vendor_that_is_not_text_is_refused(ledger: Ledger) -> None:
    await ledger.register_node(dcus("n1", count=1), rebuilt=True)
    placement = _held("p1", ("c0", "DCU-n1-0", "hygon"))
    record = placement.model_dump(mode="json", include={"pod", "node", "containers", "policy"})
    record["containers"][0]["vendor"] = None
    footprint = [["DCU-n1-0", 1000, 10, 1, 0, 0]]
    keys = ledger.node_keys("n1").all()
    reply = await ledger._run(
        "reserve", keys, ["p1", json.dumps(record), json.dumps(footprint), ""]
    )
    assert [str(x) for x in reply] == ["fail", "DCU-n1-0", "InvalidRequest"]


async def test_the_node_agent_is_never_handed_a_vendor_container(ledger: Ledger) -> None:
    await ledger.register_node(make_inventory("n1", gpus=1), rebuilt=True)
    await ledger.register_node(dcus("n1", count=1))
    await ledger.reserve(_held("dcu", ("c0", "DCU-n1-0", "hygon")))
    await ledger.mark_bound("dcu")  # bound first: the oldest pending pod
    await ledger.reserve(_held("cuda", ("c0", "GPU-n1-0", None)))
    await ledger.mark_bound("cuda")
    given = await ledger.allocate("n1", 1)
    assert given.placement.pod.uid == "cuda"
    with pytest.raises(NotReserved):
        await ledger.allocate("n1", 1)  # the DCU pod waits for its own vendor's plugin
    dcu = await ledger.placement("dcu")
    assert dcu is not None
    assert dcu.state.value == "bound"


def test_models_keep_vendors_apart() -> None:
    with pytest.raises(ValidationError, match="another vendor's card"):
        NodeInventory(node="n1", devices=dcus("n1").devices)  # an NVIDIA inventory
    with pytest.raises(ValidationError, match="neither MIG nor MPS"):
        GpuDevice(uuid="X-0", index=0, model="X", memory_mib=1, vendor="hygon", mode=VgpuMode.MPS)
    with pytest.raises(ValidationError, match="vendor"):
        GpuDevice(uuid="X-0", index=0, model="X", memory_mib=1, vendor="Hygon DCU")


async def test_a_node_naming_another_node_s_cards_gets_its_own_copies_only(
    ledger: Ledger,
) -> None:
    """Cards are the node's: the same UUIDs announced on a second node are booked
    apart, so a pod there takes nothing from the first node's cards."""
    await ledger.register_node(dcus("n1", count=1))
    clone = dcus("n1", count=1).model_copy(update={"node": "n2"})
    await ledger.register_node(clone)
    await ledger.register_node(make_inventory("n2", gpus=0), rebuilt=True)
    grant = DeviceGrant(uuid="DCU-n1-0", memory_mib=32768, cores=100)
    await ledger.reserve(
        Placement(
            pod=PodRef(uid="p", namespace="ns", name="p"),
            node="n2",
            containers=(ContainerAssignment(name="c", vendor="hygon", devices=(grant,)),),
        )
    )
    [mine] = await ledger.node_gpus("n1", vendor="hygon")
    assert (mine.used.memory_mib, mine.used.slots, mine.used.exclusive_owner) == (0, 0, None)
    [theirs] = await ledger.node_gpus("n2", vendor="hygon")
    assert theirs.used.exclusive_owner == "p"
