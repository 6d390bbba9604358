"""Other vendors' cards read from node objects as HAMi's scheduler reads them: the
register annotation's two formats and the handshake, cards derived from node
capacity, Metax's and Enflame's own annotations, and hostile values of each."""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from gpuslice_common import drs
from gpuslice_common.devicetypes import DeviceType, parse_device_config
from gpuslice_inventory.vendornodes import (
    MAX_ANNOTATION_BYTES,
    VendorReading,
    core_scaling,
    liveness,
    read_node,
    read_vendor,
)

NOW = datetime(2026, 11, 24, 12, 0, 0, tzinfo=UTC)
TYPES = parse_device_config(
    (Path(__file__).parent.parent / "data" / "hami-device-config.yaml").read_text()
).by_vendor()
HYGON, ASCEND, XPU, AMD, VASTAI = (
    TYPES[v] for v in ("hygon", "ascend910b3", "xpu", "amd", "vastai")
)


def stamp(at: datetime) -> str:
    return at.strftime("%Y-%m-%d %H:%M:%S")


def node(
    annotations: dict[str, Any],
    allocatable: dict[str, str] | None = None,
    capacity: dict[str, str] | None = None,
    name: str = "dcu-1",
) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "annotations": annotations},
        "status": {"allocatable": allocatable or {}, "capacity": capacity or {}},
    }


DCU_REGISTER = (
    "DCU-0001,4,65520,100,DCU-Z100L,0,true,0,hami-core:"
    "DCU-0002,4,65520,100,DCU-Z100L,1,false,1,hami-core:"
)


def dcu_node(register: str = DCU_REGISTER, handshake: str | None = None) -> dict[str, Any]:
    annos = {"hami.io/node-dcu-register": register}
    annos["hami.io/node-handshake-dcu"] = handshake or "Reported_" + stamp(NOW)
    return node(annos)


def test_colon_register_gives_the_cards() -> None:
    reading = read_vendor(dcu_node(), HYGON, NOW)
    assert reading is not None
    assert reading.state == "live"
    assert [
        (d.uuid, d.index, d.model, d.memory_mib, d.numa, d.healthy) for d in reading.devices
    ] == [
        ("DCU-0001", 0, "DCU-Z100L", 65520, 0, True),
        ("DCU-0002", 1, "DCU-Z100L", 65520, 1, False),
    ]
    assert {d.vendor for d in reading.devices} == {"hygon"}
    assert reading.split_count == 4
    assert reading.cores == (100, 100)
    inventory = reading.inventory()
    assert (inventory.node, inventory.vendor, inventory.split_count) == ("dcu-1", "hygon", 4)


def test_seven_field_entries_are_the_older_form() -> None:
    reading = read_vendor(dcu_node("DCU-9,10,16384,100,DCU-Z100,0,true:"), HYGON, NOW)
    assert reading is not None
    assert [(d.uuid, d.index) for d in reading.devices] == [("DCU-9", 0)]


def test_json_register_for_ascend() -> None:
    cards = [
        {
            "id": "NPU-a",
            "index": 0,
            "count": 7,
            "devmem": 65536,
            "devcore": 20,
            "type": "Ascend910B3",
            "health": True,
            "custominfo": {"ip": "1.2.3.4"},
        },
        {"id": "NPU-b", "index": 1, "count": 7, "devmem": 65536, "devcore": 20, "type": "A"},
    ]
    reading = read_vendor(
        node(
            {
                "hami.io/node-register-Ascend910B3": json.dumps(cards),
                "hami.io/node-handshake-Ascend910B3": "Requesting_" + stamp(NOW),
            }
        ),
        ASCEND,
        NOW,
    )
    assert reading is not None
    assert reading.state == "live"
    # HAMi leaves out false and zero: health absent is unhealthy, numa absent is 0
    assert [(d.uuid, d.healthy, d.numa) for d in reading.devices] == [
        ("NPU-a", True, 0),
        ("NPU-b", False, 0),
    ]
    assert reading.cores == (20, 20)  # Ascend's AI cores, as reported
    assert reading.split_count == 7


def test_vastai_cores_are_set_to_a_whole_card() -> None:
    cards = [
        {"id": "VA-0", "count": 1, "devmem": 1024, "devcore": 0, "type": "VA1", "health": True}
    ]
    annos = {
        "hami.io/node-va-register": json.dumps(cards),
        "hami.io/node-handshake-va": "Reported_" + stamp(NOW),
    }
    reading = read_vendor(node(annos), VASTAI, NOW)
    assert reading is not None
    assert reading.cores == (100,)


def test_amd_lives_by_the_node_capacity() -> None:
    cards = json.dumps([{"id": "AMD-0", "count": 10, "devmem": 196608, "type": "MI300X"}])
    annos = {"hami.io/node-amd-register": cards}
    live = read_vendor(node(annos, capacity={"amd.com/gpu": "8"}), AMD, NOW)
    assert live is not None
    assert live.state == "live"
    gone = read_vendor(node(annos, capacity={"amd.com/gpu": "0"}), AMD, NOW)
    assert gone is not None
    assert gone.state == "gone"
    assert "no amd.com/gpu capacity" in gone.message
    assert gone.inventory().devices == ()


def test_a_node_without_the_vendor_has_no_reading() -> None:
    assert read_vendor(node({"unrelated": "x"}), HYGON, NOW) is None
    assert read_node(node({}), list(TYPES.values()), NOW) == []


@pytest.mark.parametrize(
    ("handshake", "allocatable", "state", "why"),
    [
        ("Reported_" + stamp(NOW - timedelta(seconds=30)), 0, "live", ""),
        ("Reported_" + stamp(NOW - timedelta(minutes=6)), 0, "gone", "last reported 360s ago"),
        ("Reported_" + stamp(NOW - timedelta(minutes=6)), 4, "gone", "last reported"),
        ("Reported_" + stamp(NOW + timedelta(hours=2)), 0, "refused", "in the future"),
        ("Reported 2026-11-24 11:59:30.123456789 +0000 UTC m=+1104.7", 0, "live", ""),
        ("Reported 2026-11-24 13:59:30.1 +0200 CEST m=+1.0", 0, "live", ""),
        ("Reported 2026-11-24 11:59:30.1 -0200 X", 0, "refused", "in the future"),
        ("Requesting_" + stamp(NOW - timedelta(seconds=59)), 0, "live", ""),
        # a request dated ahead would otherwise never time out
        ("Requesting_" + stamp(NOW + timedelta(days=3650)), 0, "refused", "in the future"),
        ("Deleted_" + stamp(NOW + timedelta(days=3650)), 0, "gone", "withdrew"),
        ("Requesting_2026.11.24 11:58:00", 0, "gone", "has not answered a request for 120s"),
        ("Requesting_2026.11.24 11:58:00", 2, "live", ""),  # still allocatable: HAMi keeps it
        ("Deleted_2026.11.24 11:59:59", 8, "gone", "withdrew"),
        (None, 8, "gone", "no handshake annotation"),
        ("Requesting_yesterday", 0, "refused", "cannot be read"),
        ("Requesting_2026-13-40 99:00:00", 0, "refused", "cannot be read"),
        ("Hello_2026-11-24 11:59:59", 0, "refused", "none of Reported"),
        ("x" * 500, 0, "refused", "not a short text"),
    ],
)
def test_handshake(handshake: str | None, allocatable: int, state: str, why: str) -> None:
    got, message = liveness(handshake, NOW, allocatable)
    assert got == state
    assert why in message


def test_a_stale_handshake_withdraws_the_vendors_cards() -> None:
    old = "Reported_" + stamp(NOW - timedelta(minutes=10))
    reading = read_vendor(dcu_node(handshake=old), HYGON, NOW)
    assert reading is not None
    assert reading.state == "gone"
    assert reading.devices == ()
    assert reading.message.startswith("node dcu-1: hygon: its device plugin last reported")
    assert reading.inventory().devices == ()


@pytest.mark.parametrize(
    ("register", "why"),
    [
        ("no separator here", "no ':' between cards"),
        ("a,b,c:", "3 fields"),
        ("DCU-1,4,65520,100,Z,0,maybe:", "health 'maybe'"),
        ("DCU-1,4,lots,100,Z,0,true:", "memory 'lots'"),
        ("DCU-1,4,99999999999,100,Z,0,true:", "memory '99999999999'"),
        ("DCU-1,4,999999999,100,Z,0,true:", "card 0 memory is 999999999, outside"),
        ("DCU-1,4,-5,100,Z,0,true:", "card 0 memory is -5"),
        ("DCU-1,0,1024,100,Z,0,true:", "split count is 0"),
        ("DCU-1,4,1024,100,Z,-1,true:", "numa is -1"),
        ("DCU-1,4,1024,100,Z,0,true,2000,hami-core:", "index is 2000"),
        ("DCU-1,4,1024,100,Z,0,true,0,mig:", "mode 'mig'"),
        ("DCU-1,4,1024,100,Z,0,true:DCU-1,4,1024,100,Z,0,true,1,:", "listed twice"),
        ("DCU-1,4,1024,100,Z,0,true:DCU-2,4,1024,100,Z,0,true:", "index 0 is listed twice"),
        ("DCU 1;rm,4,1024,100,Z,0,true:", "uuid"),
        ("DCU-1,4,1024,100,Z\x1b[31m,0,true:", "model"),
        (":", "lists no cards"),
        ("x" * (MAX_ANNOTATION_BYTES + 1), "bytes, above"),
    ],
)
def test_bad_colon_register_is_refused_naming_node_vendor_and_key(register: str, why: str) -> None:
    reading = read_vendor(dcu_node(register), HYGON, NOW)
    assert reading is not None
    assert reading.state == "refused"
    assert reading.devices == ()
    assert reading.message.startswith("node dcu-1: hygon hami.io/node-dcu-register: ")
    assert why in reading.message


@pytest.mark.parametrize(
    ("register", "why"),
    [
        ("{not json", "not JSON"),
        ('{"id": "a"}', "not a JSON list of cards"),
        ("[1, 2]", "not a JSON list of cards"),
        (
            '[{"id": "a", "count": 1, "devmem": 1, "type": "X", "x": ' + "[" * 50 + "]" * 50 + "}]",
            "nests deeper",
        ),
        ('[{"count": 1, "devmem": 1, "type": "X"}]', "card 0 has no id"),
        # a ':' ends a card in the annotation HAMi's plugins read at Allocate: such a
        # card could never be bound, and would fail every bind the scheduler tried on it
        ('[{"id": "XPU:0", "count": 1, "devmem": 1, "type": "X"}]', "card 0 uuid 'XPU:0'"),
        ('[{"id": "-XPU", "count": 1, "devmem": 1, "type": "X"}]', "card 0 uuid '-XPU'"),
        ('[{"id": "a", "count": true, "devmem": 1, "type": "X"}]', "split count is 'True'"),
        ('[{"id": "a", "count": 1, "devmem": 1.5, "type": "X"}]', "memory is '1.5'"),
        ('[{"id": "a", "count": 1, "devmem": 1e30, "type": "X"}]', "memory is '1e+30'"),
        ('[{"id": "a", "count": 1, "devmem": 1, "type": "X", "health": "yes"}]', "health"),
        ('[{"id": "a", "count": 1, "devmem": 1, "type": "X", "mode": "mps"}]', "mode 'mps'"),
        ('[{"id": "a", "count": 1, "devmem": 1}]', "card 0 model"),
        ("[" + ",".join(['{"id": "a"}'] * 1025) + "]", "1025 cards, above 1024"),
        ("[" + "[" * 100000 + "]" * 100000 + "]", "not"),
    ],
)
def test_bad_json_register_is_refused(register: str, why: str) -> None:
    annos = {
        "hami.io/node-register-xpu": register,
        "hami.io/node-handshake-xpu": "Reported_" + stamp(NOW),
    }
    reading = read_vendor(node(annos, name="xpu-1"), XPU, NOW)
    assert reading is not None
    assert reading.state == "refused"
    assert reading.message.startswith("node xpu-1: xpu hami.io/node-register-xpu: ")
    assert why in reading.message


def test_a_handshake_without_a_register_annotation_is_refused() -> None:
    annos = {"hami.io/node-handshake-dcu": "Reported_" + stamp(NOW)}
    reading = read_vendor(node(annos), HYGON, NOW)
    assert reading is not None
    assert reading.state == "refused"
    assert "hami.io/node-dcu-register: the annotation is missing" in reading.message


def test_one_bad_vendor_leaves_the_others_on_the_node() -> None:
    cards = json.dumps(
        [{"id": "XPU-0", "count": 1, "devmem": 1024, "type": "P800", "health": True}]
    )
    annos = {
        "hami.io/node-dcu-register": "garbage",
        "hami.io/node-handshake-dcu": "Reported_" + stamp(NOW),
        "hami.io/node-register-xpu": cards,
        "hami.io/node-handshake-xpu": "Reported_" + stamp(NOW),
    }
    readings = {r.vendor: r for r in read_node(node(annos), [HYGON, XPU], NOW)}
    assert readings["hygon"].state == "refused"
    assert readings["xpu"].state == "live"
    assert [d.uuid for d in readings["xpu"].devices] == ["XPU-0"]


def test_unsupported_types_are_never_read() -> None:
    unsupported: DeviceType = TYPES["awsneuron"]
    assert not unsupported.supported
    neuron = node({}, capacity={"aws.amazon.com/neuron": "4", "aws.amazon.com/neuroncore": "8"})
    assert read_vendor(neuron, unsupported, NOW) is None


# ---------------------------------------------------------------- cards from node capacity

CAMBRICON, MTHREADS, METAX, KUNLUN = (
    TYPES[v] for v in ("cambricon", "mthreads", "metax", "kunlun")
)
MLU_CORES, MLU_MEMORY = "cambricon.com/mlu.smlu.vcore", "cambricon.com/mlu.smlu.vmemory"
MT_CORES, MT_MEMORY = "mthreads.com/sgpu-core", "mthreads.com/sgpu-memory"
# a node name as long as Kubernetes allows: a card's uuid made from it is too long
LONG_NAME = ".".join(["a" * 63, "b" * 63, "c" * 63, "d" * 61])


def facts(reading: VendorReading | None) -> list[tuple[Any, ...]]:
    assert reading is not None
    assert reading.state == "live", reading.message
    assert {d.vendor for d in reading.devices} == {reading.vendor}
    return [(d.uuid, d.index, d.model, d.memory_mib, d.numa, d.healthy) for d in reading.devices]


def test_cambricon_cards_are_the_cores_capacity_in_hundreds() -> None:
    # 250 cores: three cards (HAMi counts a part card as one), each a third of the
    # memory capacity, which Cambricon counts in units of 256 MiB
    capacity = {MLU_CORES: "250", MLU_MEMORY: "600", "cambricon.com/vmlu": "40"}
    reading = read_vendor(node({}, capacity=capacity, name="mlu-1"), CAMBRICON, NOW)
    assert facts(reading) == [
        (f"mlu-1-cambricon-mlu-{i}", i, "MLU", 600 * 256 * 100 // 250, 0, True) for i in range(3)
    ]
    assert reading is not None
    assert (reading.split_count, reading.cores, reading.core_scaling) == (100, (100,) * 3, 1.0)
    inventory = reading.inventory()
    assert [inventory.capacity(d).cores for d in inventory.devices] == [100] * 3


def test_moore_threads_cards_have_sixteen_cores() -> None:
    capacity = {MT_CORES: "32", MT_MEMORY: "96"}
    reading = read_vendor(node({}, capacity=capacity, name="mt-1"), MTHREADS, NOW)
    assert facts(reading) == [
        ("mt-1-mthreads-0", 0, "Mthreads", 24576, 0, True),
        ("mt-1-mthreads-1", 1, "Mthreads", 24576, 0, True),
    ]
    assert reading is not None
    assert reading.cores == (16, 16)
    inventory = reading.inventory()
    assert inventory.core_scaling == reading.core_scaling
    # the ledger's capacity of each card is its 16 cores, not 100
    assert [inventory.capacity(d).cores for d in inventory.devices] == [16, 16]
    assert [inventory.capacity(d).slots for d in inventory.devices] == [100, 100]


def test_core_scaling_gives_exactly_the_cards_cores() -> None:
    # 100 * 0.29 is 28.999999999999996: the scaling is nudged until its floor is 29
    for cores in range(1, 101):
        assert math.floor(100 * core_scaling(cores)) == cores
    assert math.floor(100 * core_scaling(29)) == 29


def test_whole_metax_gpus_are_the_count_capacity() -> None:
    reading = read_vendor(node({}, capacity={"metax-tech.com/gpu": "2"}, name="mx-1"), METAX, NOW)
    assert facts(reading) == [
        ("mx-1-metax-0", 0, "Metax-GPU", 65536, 0, True),
        ("mx-1-metax-1", 1, "Metax-GPU", 65536, 0, True),
    ]
    assert reading is not None
    assert reading.split_count == 1  # a whole card is one pod's


@pytest.mark.parametrize(
    ("count", "numas"),
    [
        (4, [0, 0, 1, 1]),
        (5, [0, 0, 1, 1, 1]),
        (1, [1]),  # HAMi's halves: card 0 >= 1 // 2 is on NUMA node 1
    ],
)
def test_kunlun_xpus_split_into_numa_halves(count: int, numas: list[int]) -> None:
    capacity = {"kunlunxin.com/xpu": str(count)}
    reading = read_vendor(node({}, capacity=capacity, name="xpu-2"), KUNLUN, NOW)
    got = facts(reading)
    assert [f[4] for f in got] == numas
    assert [f[:4] for f in got] == [(f"xpu-2-kunlun-{i}", i, "kunlun", 98304) for i in range(count)]


def test_capacity_zero_is_gone_and_no_capacity_no_sign() -> None:
    assert read_vendor(node({}, capacity={"amd.com/gpu": "1"}), CAMBRICON, NOW) is None
    # a count capacity without the cores HAMi reads: no sign either
    assert read_vendor(node({}, capacity={"mthreads.com/vgpu": "8"}), MTHREADS, NOW) is None
    gone = read_vendor(node({}, capacity={MLU_CORES: "0", MLU_MEMORY: "0"}), CAMBRICON, NOW)
    assert gone is not None
    assert gone.state == "gone"
    assert gone.message == f"node dcu-1: cambricon: the node has no {MLU_CORES} capacity"
    assert gone.inventory().devices == ()
    kunlun = read_vendor(node({}, capacity={"kunlunxin.com/xpu": 0}), KUNLUN, NOW)
    assert kunlun is not None
    assert kunlun.state == "gone"


@pytest.mark.parametrize(
    ("capacity", "key", "why"),
    [
        ({MLU_CORES: "-100", MLU_MEMORY: "64"}, MLU_CORES, "'-100', not a whole number"),
        ({MLU_CORES: -100, MLU_MEMORY: "64"}, MLU_CORES, "-100, outside 0.."),
        ({MLU_CORES: "1e9", MLU_MEMORY: "64"}, MLU_CORES, "'1e9', not a whole number"),
        ({MLU_CORES: "1k", MLU_MEMORY: "64"}, MLU_CORES, "'1k', not a whole number"),
        ({MLU_CORES: "8.5", MLU_MEMORY: "64"}, MLU_CORES, "'8.5', not a whole number"),
        ({MLU_CORES: " 100", MLU_MEMORY: "64"}, MLU_CORES, "not a whole number"),
        ({MLU_CORES: "\uff11\uff10\uff10", MLU_MEMORY: "64"}, MLU_CORES, "not a whole number"),
        ({MLU_CORES: 100.0, MLU_MEMORY: "64"}, MLU_CORES, "'100.0', not a whole number"),
        ({MLU_CORES: True, MLU_MEMORY: "64"}, MLU_CORES, "'True', not a whole number"),
        ({MLU_CORES: None, MLU_MEMORY: "64"}, MLU_CORES, "'None', not a whole number"),
        ({MLU_CORES: {"a": 1}, MLU_MEMORY: "64"}, MLU_CORES, "not a whole number"),
        ({MLU_CORES: "9" * 5000, MLU_MEMORY: "64"}, MLU_CORES, "5000 digits long"),
        ({MLU_CORES: 10**5000, MLU_MEMORY: "64"}, MLU_CORES, "a number above 10**30, outside"),
        ({MLU_CORES: "102500", MLU_MEMORY: "64"}, MLU_CORES, "makes 1025 cards, above 1024"),
        ({MLU_CORES: "100"}, MLU_MEMORY, "the node has no capacity of it"),
        ({MLU_CORES: "100", MLU_MEMORY: "0"}, MLU_MEMORY, "gives 0 MiB per card"),
        # a card's share rounds down to nothing
        ({MLU_CORES: "100000", MLU_MEMORY: "1"}, MLU_MEMORY, "gives 0 MiB per card"),
        ({MLU_CORES: "100", MLU_MEMORY: "x"}, MLU_MEMORY, "'x', not a whole number"),
        ({MLU_CORES: "100", MLU_MEMORY: str(10**15)}, MLU_MEMORY, "MiB per card, outside 1.."),
    ],
)
def test_bad_capacity_is_refused_naming_node_vendor_and_resource(
    capacity: dict[str, Any], key: str, why: str
) -> None:
    reading = read_vendor(node({}, capacity=capacity, name="mlu-1"), CAMBRICON, NOW)
    assert reading is not None
    assert reading.state == "refused"
    assert reading.devices == ()
    assert reading.message.startswith(f"node mlu-1: cambricon {key}: ")
    assert why in reading.message


def test_a_node_name_too_long_for_a_card_uuid_is_refused() -> None:
    capacity = {MT_CORES: "16", MT_MEMORY: "32"}
    reading = read_vendor(node({}, capacity=capacity, name=LONG_NAME), MTHREADS, NOW)
    assert reading is not None
    assert reading.state == "refused"
    assert reading.message.startswith(f"node {LONG_NAME}: mthreads {MT_CORES}: card 0 uuid ")
    assert "longer than 128 characters" in reading.message
    whole = read_vendor(node({}, capacity={"kunlunxin.com/xpu": "1"}, name=LONG_NAME), KUNLUN, NOW)
    assert whole is not None
    assert whole.state == "refused"
    assert "kunlunxin.com/xpu: card 0 uuid" in whole.message


def test_a_live_reading_always_makes_an_inventory() -> None:
    # a node object with no usable name (never from a real API server)
    bad = node({}, capacity={"metax-tech.com/gpu": "1"}, name="Not_A_Node")
    reading = read_vendor(bad, METAX, NOW)
    assert reading is not None
    assert reading.state == "refused"
    assert reading.message.startswith("node 'Not_A_Node': metax: its cards make no inventory")


# ---------------------------------------------------------------- Metax's own annotation

METAX_SGPU = TYPES["metax-sgpu"]
MX_KEY = "metax-tech.com/node-gpu-devices"


def mx_card(uuid: str = "MX-0", **fields: Any) -> dict[str, Any]:
    card: dict[str, Any] = {
        "uuid": uuid,
        "bdf": "0000:3b:00.0",
        "model": "C500",
        "totalDevCount": 16,
        "totalCompute": 100,
        "totalVRam": 65536,
        "availableDevCount": 16,
        "availableCompute": 100,
        "availableVRam": 65536,
        "numa": 0,
        "healthy": True,
        "qosPolicy": "best-effort",
        "linkZone": 1,
    }
    card.update(fields)
    return {k: v for k, v in card.items() if v is not None}


def mx_node(cards: Any, name: str = "mx-1") -> dict[str, Any]:
    text = cards if isinstance(cards, str) else json.dumps(cards)
    return node({MX_KEY: text}, name=name)


def test_metax_shared_cards_are_read_from_metaxs_list() -> None:
    cards = [
        mx_card("MX-0", numa=1),
        # Go leaves out zero and false: no numa is 0, no healthy is unhealthy
        mx_card("MX-1", model=None, numa=None, healthy=None),
    ]
    reading = read_vendor(mx_node(cards), METAX_SGPU, NOW)
    assert facts(reading) == [
        ("MX-0", 0, "C500", 65536, 1, True),
        ("MX-1", 1, "Metax-SGPU", 65536, 0, False),
    ]
    assert reading is not None
    assert (reading.split_count, reading.cores, reading.core_scaling) == (16, (100, 100), 1.0)


@pytest.mark.parametrize("compute", [29, 50, 57, 58, 100])
def test_metax_cores_are_its_total_compute(compute: int) -> None:
    cards = [mx_card("MX-0", totalCompute=compute), mx_card("MX-1", totalCompute=compute)]
    reading = read_vendor(mx_node(cards), METAX_SGPU, NOW)
    assert reading is not None
    assert reading.cores == (compute, compute)
    inventory = reading.inventory()
    assert [inventory.capacity(d).cores for d in inventory.devices] == [compute, compute]


def test_metax_without_the_annotation_is_no_sign_and_an_empty_list_is_gone() -> None:
    assert read_vendor(node({}, capacity={"metax-tech.com/sgpu": "32"}), METAX_SGPU, NOW) is None
    gone = read_vendor(mx_node([]), METAX_SGPU, NOW)
    assert gone is not None
    assert gone.state == "gone"
    assert gone.message == "node mx-1: metax-sgpu: its device plugin lists no cards"


@pytest.mark.parametrize(
    ("cards", "why"),
    [
        ("{not json", "not JSON"),
        ({"uuid": "MX-0"}, "not a JSON list of cards"),
        (["MX-0"], "not a JSON list of cards"),
        ([mx_card(extra=[[[[[[[[[["deep"]]]]]]]]]])], "nests deeper than 8"),
        ("[" * 100000 + "]" * 100000, "not"),
        ("[" + " " * MAX_ANNOTATION_BYTES + "]", "bytes, above"),
        ([mx_card("MX-0"), mx_card("MX-0")], "card 'MX-0' is listed twice"),
        ([mx_card(None)], "card 0 has no id"),
        ([mx_card(7)], "card 0 has no id"),
        ([mx_card("a,b")], "card 0 uuid 'a,b'"),
        ([mx_card("a:b")], "card 0 uuid 'a:b'"),
        ([mx_card("a;b")], "card 0 uuid 'a;b'"),
        ([mx_card("MX 0")], "card 0 uuid 'MX 0'"),
        ([mx_card("M" * 129)], "longer than 128 characters"),
        ([mx_card(totalCompute=None)], "card 0 totalCompute is 0, outside 1..100"),
        ([mx_card(totalCompute=101)], "card 0 totalCompute is 101, outside 1..100"),
        ([mx_card(totalCompute="100")], "card 0 totalCompute is '100', not a whole number"),
        (
            [mx_card("MX-0"), mx_card("MX-1", totalCompute=50)],
            "card 1 totalCompute is 50, not card 0's 100",
        ),
        ([mx_card(totalDevCount=None)], "card 0 split count is 0, outside 1..1024"),
        ([mx_card(totalDevCount=5000)], "card 0 split count is 5000"),
        ([mx_card(totalVRam=None)], "card 0 memory is 0, outside"),
        ([mx_card(totalVRam=10**12)], "card 0 memory is 1000000000000, outside"),
        ([mx_card(totalVRam=1.5)], "card 0 memory is '1.5'"),
        ([mx_card(numa=-1)], "card 0 numa is -1"),
        ([mx_card(healthy="yes")], "card 0 health is not true or false"),
        ([mx_card(model="C500\x1b[31m")], "card 0 model"),
        ([mx_card(model="M" * 129)], "card 0 model"),
        ([mx_card(model=5)], "card 0 model"),
        ([{"uuid": f"M{i}"} for i in range(1025)], "1025 cards, above 1024"),
    ],
)
def test_bad_metax_annotation_is_refused(cards: Any, why: str) -> None:
    reading = read_vendor(mx_node(cards), METAX_SGPU, NOW)
    assert reading is not None
    assert reading.state == "refused"
    assert reading.devices == ()
    assert reading.message.startswith(f"node mx-1: metax-sgpu {MX_KEY}: ")
    assert why in reading.message


def test_metax_annotation_not_text_is_refused() -> None:
    reading = read_vendor(node({MX_KEY: ["MX-0"]}), METAX_SGPU, NOW)
    assert reading is not None
    assert reading.state == "refused"
    assert "the annotation is not text" in reading.message


# ---------------------------------------------------------------- Enflame's own annotation

ENFLAME = TYPES["enflame"]
EF_KEY = "enflame.com/gcu-drs-capacity"
PROFILES = {"1g.6gb": "0", "3g.20gb": "1", "6g.40gb": "2"}


def ef_node(
    devices: Any, profiles: Any = None, name: str = "gcu-1", raw: str | None = None
) -> dict[str, Any]:
    spec = {"devices": devices, "profiles": PROFILES if profiles is None else profiles}
    return node({EF_KEY: raw if raw is not None else json.dumps(spec)}, name=name)


def test_enflame_drs_cards_carry_their_profiles_and_minor() -> None:
    devices = [
        {"index": "0", "minor": "0", "capacity": 6},
        {"index": "1", "minor": "4", "capacity": "6"},
        {"index": 2, "capacity": 6},  # no minor: HAMi takes the index
    ]
    reading = read_vendor(ef_node(devices), ENFLAME, NOW)
    profiles = "1g.6gb=0 3g.20gb=1 6g.40gb=2"
    assert facts(reading) == [
        ("gcu-1-enflame-drs-0", 0, f"DRS minor=0 {profiles}", 40960, 0, True),
        ("gcu-1-enflame-drs-1", 1, f"DRS minor=4 {profiles}", 40960, 0, True),
        ("gcu-1-enflame-drs-2", 2, f"DRS minor=2 {profiles}", 40960, 0, True),
    ]
    assert reading is not None
    assert (reading.split_count, reading.cores, reading.core_scaling) == (6, (100,) * 3, 1.0)
    assert [drs.minor_of(d.model) for d in reading.devices] == ["0", "4", "2"]


def test_enflame_memory_is_the_most_any_profile_has() -> None:
    # HAMi: the largest memory over the profiles, in GB, times 1024
    reading = read_vendor(
        ef_node([{"index": "0", "capacity": 4}], {"1g.30gb": "0", "4g.24gb": "1"}), ENFLAME, NOW
    )
    assert [d.memory_mib for d in facts_devices(reading)] == [30 * 1024]


def facts_devices(reading: VendorReading | None) -> tuple[Any, ...]:
    facts(reading)
    assert reading is not None
    return reading.devices


def test_enflame_without_the_annotation_is_no_sign_and_no_cards_is_gone() -> None:
    assert read_vendor(node({}, capacity={"enflame.com/drs-gcu": "8"}), ENFLAME, NOW) is None
    gone = read_vendor(ef_node([]), ENFLAME, NOW)
    assert gone is not None
    assert gone.state == "gone"
    assert gone.message == "node gcu-1: enflame: its device plugin lists no cards"


@pytest.mark.parametrize(
    ("devices", "profiles", "why"),
    [
        ([{"index": "0", "capacity": 3}], None, "card 0 capacity is 3 slices, not the 6"),
        ([{"index": "0", "capacity": "6.0"}], None, "card 0 capacity is '6.0', not a whole"),
        ([{"index": "0", "capacity": "-6"}], None, "card 0 capacity is '-6'"),
        ([{"index": "0", "capacity": True}], None, "card 0 capacity is 'True'"),
        ([{"index": "0"}], None, "card 0 capacity is 'None'"),
        ([{"index": "0", "capacity": 10**40}], None, "card 0 capacity is a number above"),
        ([{"index": "x", "capacity": 6}], None, "card 0 index is 'x', not a whole number"),
        ([{"index": "-1", "capacity": 6}], None, "card 0 index is '-1'"),
        ([{"index": "5000", "capacity": 6}], None, "card 0 index is 5000, outside 0..1023"),
        (
            [{"index": "0", "capacity": 6}, {"index": 0, "capacity": 6}],
            None,
            "index 0 is listed twice",
        ),
        ([{"index": "0", "minor": "a:b", "capacity": 6}], None, "minor 'a:b' is not"),
        ([{"index": "0", "minor": "1,2", "capacity": 6}], None, "minor '1,2' is not"),
        ([{"index": "0", "minor": "1;2", "capacity": 6}], None, "minor '1;2' is not"),
        ([{"index": "0", "minor": "9999999", "capacity": 6}], None, "minor '9999999'"),
        ([{"index": "0", "minor": -3, "capacity": 6}], None, "card 0 minor is -3, outside"),
        ([{"index": "0", "minor": [1], "capacity": 6}], None, "card 0 minor is '[1]'"),
        ([{"index": "0", "capacity": 6}], {}, "profiles: it lists no profiles"),
        ([{"index": "0", "capacity": 6}], ["1g.6gb"], "profiles is not a mapping"),
        ([{"index": "0", "capacity": 6}], {"big": "0"}, "profile 'big' is not"),
        ([{"index": "0", "capacity": 6}], {"1g.6gb": 0}, "a profile's name and ID are text"),
        ([{"index": "0", "capacity": 6}], {"1g.6gb": "a:b"}, "ID 'a:b' is not a short word"),
        (
            [{"index": "0", "capacity": 200}],
            {"1g.6gb": "0", "2g.6gb": "1", "200g.48gb": "2"},
            "1g.6gb and 2g.6gb are both 6 GB and 1 %",
        ),
        (
            [{"index": "0", "capacity": 1}],
            {f"1g.{n}gb": str(n) for n in range(1, 18)},
            "17 profiles, above 16",
        ),
        (
            [{"index": "0", "capacity": 1}],
            {f"1g.{n}gb": f"profile-{n:08d}" for n in range(1, 15)},
            "do not fit in 128 characters",
        ),
        ([{"index": str(i), "capacity": 6} for i in range(1025)], None, "1025 cards, above 1024"),
        ({"index": "0"}, None, "devices is not a list of cards"),
        (["0"], None, "devices is not a list of cards"),
    ],
)
def test_bad_enflame_annotation_is_refused(devices: Any, profiles: Any, why: str) -> None:
    reading = read_vendor(ef_node(devices, profiles), ENFLAME, NOW)
    assert reading is not None
    assert reading.state == "refused"
    assert reading.devices == ()
    assert reading.message.startswith(f"node gcu-1: enflame {EF_KEY}: ")
    assert why in reading.message


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        ("{not json", "not JSON"),
        ("[]", "not a JSON object"),
        ('{"devices": ' + "[" * 20 + "]" * 20 + "}", "nests deeper than 8"),
        ("{" * 100000, "not JSON"),
        (" " * (MAX_ANNOTATION_BYTES + 1), "bytes, above"),
    ],
)
def test_forged_enflame_annotation_is_refused(raw: str, why: str) -> None:
    reading = read_vendor(ef_node([], raw=raw), ENFLAME, NOW)
    assert reading is not None
    assert reading.state == "refused"
    assert reading.message.startswith(f"node gcu-1: enflame {EF_KEY}: ")
    assert why in reading.message


def test_an_enflame_card_uuid_too_long_is_refused() -> None:
    reading = read_vendor(ef_node([{"index": "0", "capacity": 6}], name=LONG_NAME), ENFLAME, NOW)
    assert reading is not None
    assert reading.state == "refused"
    assert f"{EF_KEY}: card 0 uuid " in reading.message
    assert "longer than 128 characters" in reading.message


def test_every_source_on_one_node_is_read_apart() -> None:
    """A node with every kind of card: each vendor is read on its own, and a bad one
    leaves the others."""
    capacity = {
        MLU_CORES: "100",
        MLU_MEMORY: "64",
        MT_CORES: "lots",  # refused: Moore Threads only
        MT_MEMORY: "64",
        "metax-tech.com/gpu": "1",
        "kunlunxin.com/xpu": "0",  # gone
    }
    annos = {
        MX_KEY: json.dumps([mx_card("MX-0")]),
        EF_KEY: json.dumps({"devices": [{"index": "0", "capacity": 6}], "profiles": PROFILES}),
    }
    types = [CAMBRICON, MTHREADS, METAX, KUNLUN, METAX_SGPU, ENFLAME, HYGON]
    readings = {r.vendor: r for r in read_node(node(annos, capacity=capacity), types, NOW)}
    assert {v: r.state for v, r in readings.items()} == {
        "cambricon": "live",
        "mthreads": "refused",
        "metax": "live",
        "kunlun": "gone",
        "metax-sgpu": "live",
        "enflame": "live",
    }
    assert [d.uuid for d in readings["metax"].devices] == ["dcu-1-metax-0"]
