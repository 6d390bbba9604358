"""Vendor cards registered from node objects held by a local API server, into a real
redis-server: they appear, a stale handshake or a bad annotation withdraws them, a
deleted node loses them, and the node agent's NVIDIA cards are never touched."""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from gpuslice_common.bus import Bus
from gpuslice_common.devicetypes import DeviceConfigError, parse_device_config
from gpuslice_common.kube import LocalKubeApi
from gpuslice_common.ledger import Ledger
from gpuslice_common.models import GpuDevice, NodeInventory
from gpuslice_common.servers import NatsServer
from gpuslice_inventory.service import running
from gpuslice_inventory.vendorsync import VendorSync, load_device_config
from tests.conftest import make_inventory
from tests.inventory.conftest import announce, settings_for, until

CONFIG = Path(__file__).parent.parent / "data" / "hami-device-config.yaml"
START = datetime(2026, 11, 24, 12, 0, 0, tzinfo=UTC)


class Clock:
    def __init__(self) -> None:
        self.now = START

    def __call__(self) -> datetime:
        return self.now


def stamp(at: datetime) -> str:
    return at.strftime("%Y-%m-%d %H:%M:%S")


def dcu_node(name: str, at: datetime, register: str | None = None) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "annotations": {
                "hami.io/node-dcu-register": register
                or "DCU-a,4,65520,100,DCU-Z100L,0,true,0,hami-core:"
                "DCU-b,4,65520,100,DCU-Z100L,1,true,1,hami-core:",
                "hami.io/node-handshake-dcu": "Reported_" + stamp(at),
                "hami.io/node-register-xpu": json.dumps(
                    [{"id": "XPU-0", "count": 2, "devmem": 98304, "type": "P800", "health": True}]
                ),
                "hami.io/node-handshake-xpu": "Reported_" + stamp(at),
            },
        },
        "status": {"allocatable": {}, "capacity": {}},
    }


@pytest.fixture
def sync_parts(ledger: Ledger) -> tuple[VendorSync, LocalKubeApi, Clock]:
    kube = LocalKubeApi()
    clock = Clock()
    types = parse_device_config(CONFIG.read_text()).announced()
    return VendorSync(ledger, kube, types, clock=clock), kube, clock


async def uuids(ledger: Ledger, node: str, vendor: str | None) -> list[str]:
    return [c.device.uuid for c in await ledger.node_gpus(node, vendor=vendor)]


async def test_nodes_appear_with_their_vendor_cards(
    ledger: Ledger, sync_parts: tuple[VendorSync, LocalKubeApi, Clock]
) -> None:
    sync, kube, clock = sync_parts
    await ledger.register_node(make_inventory("dcu-1", gpus=1), rebuilt=True)
    kube.add_node(dcu_node("dcu-1", clock.now))
    kube.add_node({"metadata": {"name": "cpu-only"}})
    result = await sync.run_once()
    assert result.nodes == 2
    assert dict(result.registered) == {"hygon": 1, "xpu": 1}
    assert await uuids(ledger, "dcu-1", "hygon") == ["DCU-a", "DCU-b"]
    assert await uuids(ledger, "dcu-1", "xpu") == ["XPU-0"]
    assert sorted(await uuids(ledger, "dcu-1", None)) == ["DCU-a", "DCU-b", "GPU-dcu-1-0", "XPU-0"]
    [dcu, _] = await ledger.node_gpus("dcu-1", vendor="hygon")
    assert (dcu.capacity.slots, dcu.capacity.memory_mib, dcu.device.numa) == (4, 65520, 0)
    assert await uuids(ledger, "dcu-1", "nvidia") == ["GPU-dcu-1-0"]  # the agent's, untouched
    assert "cpu-only" not in await ledger.nodes()


async def test_a_stale_handshake_removes_the_vendors_cards(
    ledger: Ledger, sync_parts: tuple[VendorSync, LocalKubeApi, Clock]
) -> None:
    sync, kube, clock = sync_parts
    kube.add_node(dcu_node("dcu-1", clock.now))
    await sync.run_once()
    revision = (await ledger.revisions(["dcu-1"]))["dcu-1"]
    clock.now += timedelta(minutes=4)  # within HAMi's five minutes
    again = await sync.run_once()
    assert await uuids(ledger, "dcu-1", "hygon") == ["DCU-a", "DCU-b"]
    # nothing changed: nothing written, so the scheduler has nothing to re-read
    assert (again.unchanged, dict(again.registered)) == (2, {})
    assert (await ledger.revisions(["dcu-1"]))["dcu-1"] == revision
    clock.now += timedelta(minutes=2)  # the plugin stopped reporting six minutes ago
    result = await sync.run_once()
    assert dict(result.withdrawn) == {"hygon": 1, "xpu": 1}
    assert await uuids(ledger, "dcu-1", None) == []
    # the plugin reports again: the cards come back
    kube.add_node(dcu_node("dcu-1", clock.now))
    await sync.run_once()
    assert await uuids(ledger, "dcu-1", "hygon") == ["DCU-a", "DCU-b"]


async def test_a_changed_card_is_registered_again(
    ledger: Ledger, sync_parts: tuple[VendorSync, LocalKubeApi, Clock]
) -> None:
    sync, kube, clock = sync_parts
    kube.add_node(dcu_node("dcu-1", clock.now))
    await sync.run_once()
    sick = "DCU-a,4,65520,100,DCU-Z100L,0,false,0,hami-core:DCU-b,4,65520,100,DCU-Z100L,1,true,1,:"
    kube.add_node(dcu_node("dcu-1", clock.now, register=sick))
    result = await sync.run_once()
    assert dict(result.registered) == {"hygon": 1}
    assert result.unchanged == 1  # the XPU
    cards = await ledger.node_gpus("dcu-1", vendor="hygon")
    assert [c.device.healthy for c in cards] == [False, True]


async def test_a_bad_annotation_is_logged_and_nothing_registered_for_that_vendor(
    ledger: Ledger,
    sync_parts: tuple[VendorSync, LocalKubeApi, Clock],
    caplog: pytest.LogCaptureFixture,
) -> None:
    sync, kube, clock = sync_parts
    kube.add_node(dcu_node("dcu-1", clock.now))
    await sync.run_once()
    kube.add_node(dcu_node("dcu-1", clock.now, register="DCU-a,4,65520,100,Z,0,true:" * 2))
    with caplog.at_level(logging.WARNING, logger="gpuslice_inventory.vendorsync"):
        result = await sync.run_once()
        await sync.run_once()  # the same problem is not logged again
    assert dict(result.refused) == {"hygon": 1}
    refusals = [r.getMessage() for r in caplog.records if "listed twice" in r.getMessage()]
    assert refusals == [
        "node dcu-1: hygon hami.io/node-dcu-register: card 'DCU-a' is listed twice; "
        "its cards are not scheduled"
    ]
    assert await uuids(ledger, "dcu-1", "hygon") == []
    assert await uuids(ledger, "dcu-1", "xpu") == ["XPU-0"]  # the other vendor stays


async def test_a_deleted_node_loses_its_vendor_cards_but_in_use_ones_wait(
    ledger: Ledger, sync_parts: tuple[VendorSync, LocalKubeApi, Clock]
) -> None:
    sync, kube, clock = sync_parts
    kube.add_node(dcu_node("dcu-1", clock.now))
    kube.add_node(dcu_node("dcu-2", clock.now))
    await sync.run_once()
    kube.delete_node("dcu-2")
    result = await sync.run_once()
    assert dict(result.withdrawn) == {"hygon": 1, "xpu": 1}
    assert await uuids(ledger, "dcu-2", None) == []
    assert await uuids(ledger, "dcu-1", "hygon") == ["DCU-a", "DCU-b"]
    # nothing left to withdraw: the next pass writes nothing for dcu-2
    assert dict((await sync.run_once()).withdrawn) == {}


async def test_an_annotation_naming_an_nvidia_cards_uuid_is_refused(
    ledger: Ledger, sync_parts: tuple[VendorSync, LocalKubeApi, Clock]
) -> None:
    sync, kube, clock = sync_parts
    await ledger.register_node(make_inventory("dcu-1", gpus=1), rebuilt=True)
    kube.add_node(dcu_node("dcu-1", clock.now, register="GPU-dcu-1-0,4,1024,100,Z,0,true:"))
    result = await sync.run_once()
    assert result.failed == 1
    [card] = await ledger.node_gpus("dcu-1")
    assert (card.device.vendor, card.device.memory_mib) == ("nvidia", 16384)


async def test_nvidia_annotations_are_the_agents_business(
    ledger: Ledger, sync_parts: tuple[VendorSync, LocalKubeApi, Clock]
) -> None:
    sync, kube, clock = sync_parts
    cards = [{"id": "GPU-x", "count": 10, "devmem": 81920, "type": "H100", "health": True}]
    kube.add_node(
        {
            "metadata": {
                "name": "gpu-1",
                "annotations": {
                    "hami.io/node-nvidia-register": json.dumps(cards),
                    "hami.io/node-handshake": "Reported_" + stamp(clock.now),
                },
            }
        }
    )
    await sync.run_once()
    assert "gpu-1" not in await ledger.nodes()


def test_device_config_file_warnings_are_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "device-config.yaml"
    path.write_text("hygon:\n  resourceCountName: hygon.com/dcunum\nnewvendor: {}\n")
    with caplog.at_level(logging.WARNING):
        config = load_device_config(str(path))
    assert "newvendor" in config.by_vendor()
    assert any("section newvendor" in r.getMessage() for r in caplog.records)


def test_vendor_inventory_rejects_a_foreign_card() -> None:
    card = GpuDevice(uuid="DCU-a", index=0, model="Z", memory_mib=1, vendor="hygon")
    with pytest.raises(ValueError, match="another vendor's card"):
        NodeInventory(node="n", devices=(card,), vendor="xpu")


async def test_the_inventory_registers_vendor_nodes_from_the_api_server(
    nats_server: NatsServer,
    redis_url: str,
    prefix: str,
    bus: Bus,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    path = tmp_path / "device-config.yaml"
    path.write_text(CONFIG.read_text())
    kube = LocalKubeApi()
    kube.add_node(dcu_node("dcu-1", datetime.now(UTC)))
    config = settings_for(
        nats_server, redis_url, prefix, device_config=str(path), vendor_interval=0.1
    )
    async with running(config, bus, kube=kube, serve_http=False) as state:
        led = state.ledger

        async def registered() -> bool:
            return await uuids(led, "dcu-1", "hygon") == ["DCU-a", "DCU-b"]

        await until(registered)
        # a node agent cannot pass its cards off as another vendor's
        card = GpuDevice(uuid="DCU-z", index=0, model="Z", memory_mib=1, vendor="hygon")
        with caplog.at_level(logging.WARNING):
            await announce(bus, NodeInventory(node="dcu-1", devices=(card,), vendor="hygon"))
            await until(lambda: state.work.refused["invalid"] == 1)
        assert await uuids(led, "dcu-1", "hygon") == ["DCU-a", "DCU-b"]
        assert any("it lists hygon cards" in r.getMessage() for r in caplog.records)
        # the plugin withdraws its cards
        node = dcu_node("dcu-1", datetime.now(UTC))
        node["metadata"]["annotations"]["hami.io/node-handshake-dcu"] = "Deleted_2026.11.24 1:0:0"
        kube.add_node(node)

        async def withdrawn() -> bool:
            return await uuids(led, "dcu-1", "hygon") == []

        await until(withdrawn)


async def test_a_bad_device_config_stops_the_start_naming_the_file(
    nats_server: NatsServer, redis_url: str, prefix: str, bus: Bus, tmp_path: Path
) -> None:
    path = tmp_path / "device-config.yaml"
    path.write_text("hygon:\n  resourceCountName: hygon.com/dcunum\n  memoryFactor: -1\n")
    config = settings_for(nats_server, redis_url, prefix, device_config=str(path))
    with pytest.raises(DeviceConfigError, match=r"device-config.yaml: .*hygon.memoryFactor is -1"):
        async with running(config, bus, kube=LocalKubeApi(), serve_http=False):
            pass
    missing = str(tmp_path / "absent.yaml")
    with pytest.raises(DeviceConfigError, match=r"absent\.yaml: No such file"):
        load_device_config(missing)


# ---------------------------------------------------- cards from capacity, Metax, Enflame

MX_KEY = "metax-tech.com/node-gpu-devices"
EF_KEY = "enflame.com/gcu-drs-capacity"
PROFILES = {"1g.6gb": "0", "3g.20gb": "1", "6g.40gb": "2"}


def mx_cards(*uuids: str, compute: int = 50) -> str:
    return json.dumps(
        [
            {
                "uuid": u,
                "model": "C500",
                "totalDevCount": 16,
                "totalCompute": compute,
                "totalVRam": 65536,
                "healthy": True,
            }
            for u in uuids
        ]
    )


def accel_node(
    name: str,
    capacity: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A node with cards of every source that is not a register annotation."""
    default_capacity = {
        "cambricon.com/mlu.smlu.vcore": "200",
        "cambricon.com/mlu.smlu.vmemory": "256",
        "mthreads.com/sgpu-core": "16",
        "mthreads.com/sgpu-memory": "64",
        "metax-tech.com/gpu": "1",
        "kunlunxin.com/xpu": "2",
    }
    default_annotations = {
        MX_KEY: mx_cards("MX-a", "MX-b"),
        EF_KEY: json.dumps(
            {"devices": [{"index": "0", "minor": "3", "capacity": 6}], "profiles": PROFILES}
        ),
    }
    return {
        "metadata": {
            "name": name,
            "annotations": default_annotations if annotations is None else annotations,
        },
        "status": {"capacity": default_capacity if capacity is None else capacity},
    }


async def cards_of(ledger: Ledger, node: str, vendor: str) -> list[tuple[Any, ...]]:
    """What the ledger holds of a vendor's cards: uuid, model, memory, cores, slots, numa."""
    return [
        (
            c.device.uuid,
            c.device.model,
            c.capacity.memory_mib,
            c.capacity.cores,
            c.capacity.slots,
            c.device.numa,
        )
        for c in await ledger.node_gpus(node, vendor=vendor)
    ]


async def test_cards_from_capacity_and_vendor_annotations_are_registered(
    ledger: Ledger, sync_parts: tuple[VendorSync, LocalKubeApi, Clock]
) -> None:
    sync, kube, _ = sync_parts
    await ledger.register_node(make_inventory("acc-1", gpus=1), rebuilt=True)
    kube.add_node(accel_node("acc-1"))
    result = await sync.run_once()
    assert dict(result.registered) == {
        "cambricon": 1,
        "mthreads": 1,
        "metax": 1,
        "metax-sgpu": 1,
        "enflame": 1,
        "kunlun": 1,
    }
    assert result.failed == 0
    assert await cards_of(ledger, "acc-1", "cambricon") == [
        ("acc-1-cambricon-mlu-0", "MLU", 32768, 100, 100, 0),
        ("acc-1-cambricon-mlu-1", "MLU", 32768, 100, 100, 0),
    ]
    # a Moore Threads card is 16 cores, all of them schedulable
    assert await cards_of(ledger, "acc-1", "mthreads") == [
        ("acc-1-mthreads-0", "Mthreads", 32768, 16, 100, 0)
    ]
    assert await cards_of(ledger, "acc-1", "metax") == [
        ("acc-1-metax-0", "Metax-GPU", 65536, 100, 1, 0)
    ]
    assert await cards_of(ledger, "acc-1", "kunlun") == [
        ("acc-1-kunlun-0", "kunlun", 98304, 100, 1, 0),
        ("acc-1-kunlun-1", "kunlun", 98304, 100, 1, 1),  # the upper half, NUMA node 1
    ]
    # a shared Metax card's cores are its totalCompute
    assert await cards_of(ledger, "acc-1", "metax-sgpu") == [
        ("MX-a", "C500", 65536, 50, 16, 0),
        ("MX-b", "C500", 65536, 50, 16, 0),
    ]
    assert await cards_of(ledger, "acc-1", "enflame") == [
        ("acc-1-enflame-drs-0", "DRS minor=3 1g.6gb=0 3g.20gb=1 6g.40gb=2", 40960, 100, 6, 0)
    ]
    assert await uuids(ledger, "acc-1", "nvidia") == ["GPU-acc-1-0"]
    # read again as they are: nothing written
    again = await sync.run_once()
    assert (dict(again.registered), again.unchanged) == ({}, 6)


async def test_capacity_dropping_to_zero_or_going_withdraws_the_cards(
    ledger: Ledger, sync_parts: tuple[VendorSync, LocalKubeApi, Clock]
) -> None:
    sync, kube, _ = sync_parts
    kube.add_node(accel_node("acc-1"))
    await sync.run_once()
    node = accel_node("acc-1")
    node["status"]["capacity"]["mthreads.com/sgpu-core"] = "0"  # the plugin has no cards
    del node["status"]["capacity"]["kunlunxin.com/xpu"]  # no sign of Kunlun left
    kube.add_node(node)
    result = await sync.run_once()
    assert dict(result.withdrawn) == {"mthreads": 1, "kunlun": 1}
    assert await uuids(ledger, "acc-1", "mthreads") == []
    assert await uuids(ledger, "acc-1", "kunlun") == []
    assert await uuids(ledger, "acc-1", "cambricon") == [
        "acc-1-cambricon-mlu-0",
        "acc-1-cambricon-mlu-1",
    ]
    # fewer cores: fewer cards, each with its share of the memory
    node["status"]["capacity"]["cambricon.com/mlu.smlu.vcore"] = "100"
    kube.add_node(node)
    await sync.run_once()
    assert await cards_of(ledger, "acc-1", "cambricon") == [
        ("acc-1-cambricon-mlu-0", "MLU", 65536, 100, 100, 0)
    ]


async def test_a_removed_vendor_annotation_withdraws_the_cards(
    ledger: Ledger, sync_parts: tuple[VendorSync, LocalKubeApi, Clock]
) -> None:
    sync, kube, _ = sync_parts
    kube.add_node(accel_node("acc-1"))
    await sync.run_once()
    kube.add_node(accel_node("acc-1", annotations={}))
    result = await sync.run_once()
    assert dict(result.withdrawn) == {"metax-sgpu": 1, "enflame": 1}
    assert await uuids(ledger, "acc-1", "metax-sgpu") == []
    assert await uuids(ledger, "acc-1", "enflame") == []
    assert await uuids(ledger, "acc-1", "metax") == ["acc-1-metax-0"]
    # Metax's plugin lists no cards: gone too
    kube.add_node(accel_node("acc-1", annotations={MX_KEY: "[]"}))
    assert dict((await sync.run_once()).withdrawn) == {}
    kube.add_node(accel_node("acc-1"))
    await sync.run_once()
    kube.add_node(accel_node("acc-1", annotations={MX_KEY: "[]", EF_KEY: "{}"}))
    assert dict((await sync.run_once()).withdrawn) == {"metax-sgpu": 1, "enflame": 1}


@pytest.mark.parametrize(
    "forged",
    [
        "GPU-acc-1-0",  # the node agent's NVIDIA card
        "acc-1-metax-0",  # the node's whole Metax GPU
        "acc-1-enflame-drs-0",  # its Enflame card
        "DCU-a",  # a Hygon card its register annotation lists
    ],
)
async def test_a_metax_card_under_another_cards_uuid_leaves_the_others(
    ledger: Ledger,
    sync_parts: tuple[VendorSync, LocalKubeApi, Clock],
    caplog: pytest.LogCaptureFixture,
    forged: str,
) -> None:
    sync, kube, clock = sync_parts
    await ledger.register_node(make_inventory("acc-1", gpus=1), rebuilt=True)
    node = accel_node("acc-1")
    node["metadata"]["annotations"].update(dcu_node("acc-1", clock.now)["metadata"]["annotations"])
    kube.add_node(node)
    await sync.run_once()
    before = {
        v: await cards_of(ledger, "acc-1", v)
        for v in ("nvidia", "metax", "enflame", "hygon", "cambricon")
    }
    assert all(before.values())
    node["metadata"]["annotations"][MX_KEY] = mx_cards("MX-a", forged)
    kube.add_node(node)
    with caplog.at_level(logging.WARNING, logger="gpuslice_inventory.vendorsync"):
        result = await sync.run_once()
        again = await sync.run_once()
    assert (result.failed, again.failed) == (1, 1)
    # the ledger refused Metax's cards only: they stay as they were
    assert await uuids(ledger, "acc-1", "metax-sgpu") == ["MX-a", "MX-b"]
    after = {v: await cards_of(ledger, "acc-1", v) for v in before}
    assert after == before
    # logged once, naming the node, the vendor and the card
    refusals = [r.getMessage() for r in caplog.records if "ledger refused" in r.getMessage()]
    assert len(refusals) == 1
    assert refusals[0].startswith("node acc-1: metax-sgpu: the ledger refused the cards: ")
    assert forged in refusals[0]


async def test_a_bad_vendor_stops_neither_the_pass_nor_other_nodes(
    ledger: Ledger,
    sync_parts: tuple[VendorSync, LocalKubeApi, Clock],
    caplog: pytest.LogCaptureFixture,
) -> None:
    sync, kube, _ = sync_parts
    long_name = ".".join(["a" * 63, "b" * 63, "c" * 63, "d" * 61])
    kube.add_node(accel_node(long_name))  # every card uuid too long
    hostile = accel_node(
        "acc-0",
        capacity={"cambricon.com/mlu.smlu.vcore": "1e9", "kunlunxin.com/xpu": "-1"},
        annotations={MX_KEY: "[" * 50000, EF_KEY: json.dumps({"devices": "all"})},
    )
    kube.add_node(hostile)
    kube.add_node(accel_node("acc-2"))
    with caplog.at_level(logging.WARNING, logger="gpuslice_inventory.vendorsync"):
        result = await sync.run_once()
        await sync.run_once()
    assert result.refused["cambricon"] == 2
    assert result.refused["metax-sgpu"] == 1  # the long name's Metax cards name their own
    assert dict(result.registered)["metax-sgpu"] == 2
    assert await uuids(ledger, "acc-2", "kunlun") == ["acc-2-kunlun-0", "acc-2-kunlun-1"]
    assert await uuids(ledger, long_name, "metax-sgpu") == ["MX-a", "MX-b"]
    assert await uuids(ledger, long_name, "kunlun") == []
    assert await uuids(ledger, "acc-0", None) == []
    messages = [r.getMessage() for r in caplog.records]
    assert (
        "node acc-0: cambricon cambricon.com/mlu.smlu.vcore: the capacity is '1e9', "
        "not a whole number; its cards are not scheduled"
    ) in messages
    assert len([m for m in messages if m.startswith("node acc-0: kunlun ")]) == 1
    assert any(m.startswith(f"node acc-0: metax-sgpu {MX_KEY}: it is not JSON") for m in messages)
    assert any(m.startswith(f"node {long_name}: enflame {EF_KEY}: card 0 uuid") for m in messages)
