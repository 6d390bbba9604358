"""Other vendors' cards read from node objects as HAMi's device plugins annotate them:
the register annotation's two formats, the handshake, and hostile annotations."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from gpuslice_common.devicetypes import DeviceType, parse_device_config
from gpuslice_inventory.vendornodes import (
    MAX_ANNOTATION_BYTES,
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
    annotations: dict[str, str],
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
    unsupported: DeviceType = TYPES["cambricon"]
    assert read_vendor(node({"hami.io/node-mlu-register": "x"}), unsupported, NOW) is None
