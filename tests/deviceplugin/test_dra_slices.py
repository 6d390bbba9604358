"""The node's cards as ResourceSlices: their content, checked against Kubernetes 1.34's
schema, and the publisher keeping the API server's slices of the node in step."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Mapping
from typing import Any

import kubernetes_validate
import pytest

from gpuslice_common.dra import DRIVER, device_name
from gpuslice_common.kube import KubeError, LocalKubeApi, ObjectRef
from gpuslice_common.models import (
    GpuDevice,
    MigInstance,
    MigPlacement,
    MigProfile,
    NodeInventory,
    VgpuMode,
)
from gpuslice_deviceplugin.dra.slices import (
    MAX_DEVICES_PER_SLICE,
    MAX_NODE_NAME,
    MAX_SLICE_INDEX,
    NODE_LABEL,
    RESOURCE,
    SlicePublisher,
    binary_quantity,
    check_node_name,
    decimal_quantity,
    offer,
    resource_slices,
    slice_name,
)

KUBERNETES = "1.34.0"
NODE = "node-a"
GIB = 1 << 30
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def card(index: int, **fields: Any) -> GpuDevice:
    values: dict[str, Any] = {
        "uuid": f"GPU-{index:08x}-1111-2222-3333-444455556666",
        "index": index,
        "model": "NVIDIA A100-SXM4-40GB",
        "memory_mib": 40960,
        "numa": index % 2,
    }
    values.update(fields)
    return GpuDevice(**values)


def inventory(*cards: GpuDevice, node: str = NODE, **fields: Any) -> NodeInventory:
    return NodeInventory(node=node, devices=cards, **fields)


def valid(obj: Mapping[str, Any]) -> None:
    try:
        kubernetes_validate.validate(dict(obj), KUBERNETES, strict=True)
    except kubernetes_validate.ValidationError as exc:
        raise AssertionError(f"ResourceSlice {obj['metadata']['name']}: {exc}") from None


def test_quantities_are_written_in_their_canonical_form() -> None:
    assert binary_quantity(40960 << 20) == "40Gi"
    assert binary_quantity(1536 << 20) == "1536Mi"
    assert binary_quantity(2048 * GIB) == "2Ti"
    assert binary_quantity(1000) == "1000"
    assert decimal_quantity(100) == "100"
    assert decimal_quantity(1000) == "1k"
    assert decimal_quantity(0) == "0"


def test_consumable_cards_share_memory_and_cores_with_request_policies() -> None:
    inv = inventory(card(0), card(1, numa=None, model="Tesla T4", memory_mib=15360))
    (obj,) = resource_slices(inv, consumable=True, generation=7)
    valid(obj)
    assert obj["metadata"]["name"] == f"{NODE}-gpu.gpuslice.io"
    assert obj["metadata"]["labels"] == {NODE_LABEL: NODE}
    spec = obj["spec"]
    assert spec["driver"] == DRIVER == "gpu.gpuslice.io"
    assert spec["nodeName"] == NODE
    assert spec["pool"] == {"name": NODE, "generation": 7, "resourceSliceCount": 1}
    first, second = spec["devices"]
    assert first["name"] == device_name(inv.devices[0].uuid)
    assert first["attributes"] == {
        "uuid": {"string": inv.devices[0].uuid},
        "model": {"string": "NVIDIA A100-SXM4-40GB"},
        "index": {"int": 0},
        "numa": {"int": 0},
        "vendor": {"string": "nvidia"},
        "mode": {"string": "hami-core"},
    }
    assert first["allowMultipleAllocations"] is True
    assert first["capacity"] == {
        "memory": {
            "value": "40Gi",
            "requestPolicy": {
                "default": "40Gi",  # a claim that names no memory takes the card's
                "validRange": {"min": "1Mi", "max": "40Gi", "step": "1Mi"},
            },
        },
        "cores": {
            "value": "100",
            "requestPolicy": {
                "default": "0",  # HAMi's "no core limit"
                "validRange": {"min": "0", "max": "100", "step": "1"},
            },
        },
    }
    assert "numa" not in second["attributes"]
    assert second["attributes"]["model"] == {"string": "Tesla T4"}
    assert second["capacity"]["memory"]["value"] == "15Gi"


def test_whole_cards_without_consumable_capacity() -> None:
    (obj,) = resource_slices(inventory(card(0), card(1)), consumable=False, generation=1)
    valid(obj)
    for device in obj["spec"]["devices"]:
        assert "allowMultipleAllocations" not in device
        assert device["capacity"] == {"memory": {"value": "40Gi"}, "cores": {"value": "100"}}


def test_capacity_is_the_scaled_one_the_ledger_counts() -> None:
    inv = inventory(card(0, memory_mib=1000), memory_scaling=1.5, core_scaling=2.0)
    (obj,) = resource_slices(inv, consumable=True, generation=1)
    valid(obj)
    (device,) = obj["spec"]["devices"]
    assert inv.capacity(inv.devices[0]).memory_mib == 1500
    assert device["capacity"]["memory"]["value"] == "1500Mi"
    assert device["capacity"]["cores"]["value"] == "200"
    # one container's grant is at most a whole card's cores
    assert device["capacity"]["cores"]["requestPolicy"]["validRange"]["max"] == "100"
    low = inventory(card(0), core_scaling=0.5)
    (obj,) = resource_slices(low, consumable=True, generation=1)
    valid(obj)
    cores = obj["spec"]["devices"][0]["capacity"]["cores"]
    assert cores["value"] == "50"
    assert cores["requestPolicy"]["validRange"]["max"] == "50"


def test_unhealthy_and_mig_cards_are_left_out_with_their_reason() -> None:
    profile = MigProfile(
        name="1g.5gb",
        memory_mib=4864,
        cores=14,
        slices=1,
        placements=(MigPlacement(start=0, size=1),),
    )
    dynamic = card(1, mig=True, mode=VgpuMode.MIG, mig_profiles=(profile,))
    static = card(
        2,
        mig=True,
        mig_instances=(
            MigInstance(
                uuid="MIG-aaaa-bbbb", profile="1g.5gb", placement=MigPlacement(start=0, size=1)
            ),
        ),
    )
    sick = card(3, healthy=False)
    mps = card(4, mode=VgpuMode.MPS)
    inv = inventory(card(0), dynamic, static, sick, mps)
    found = offer(inv, consumable=True)
    assert [d["name"] for d in found.devices] == [
        device_name(inv.devices[0].uuid),
        device_name(mps.uuid),
    ]
    reasons = dict(found.left_out)
    assert reasons[sick.uuid] == "unhealthy"
    assert "MIG mode" in reasons[dynamic.uuid]
    assert "statically MIG-partitioned" in reasons[static.uuid]
    (obj,) = resource_slices(inv, consumable=True, generation=2)
    valid(obj)
    assert obj["spec"]["devices"][1]["attributes"]["mode"] == {"string": "mps"}


def test_a_node_without_cards_publishes_an_empty_pool() -> None:
    (obj,) = resource_slices(inventory(card(0, healthy=False)), consumable=True, generation=3)
    valid(obj)
    assert obj["spec"]["devices"] == []
    assert obj["spec"]["pool"]["resourceSliceCount"] == 1


def test_more_than_128_devices_go_into_several_slices_of_one_pool() -> None:
    cards = [card(i, numa=None) for i in range(MAX_DEVICES_PER_SLICE * 2 + 3)]
    slices = resource_slices(inventory(*cards), consumable=True, generation=4)
    assert [len(s["spec"]["devices"]) for s in slices] == [128, 128, 3]
    names = [s["metadata"]["name"] for s in slices]
    assert names == [slice_name(NODE), slice_name(NODE, 1), slice_name(NODE, 2)]
    assert len(set(names)) == 3
    for s in slices:
        valid(s)
        assert s["spec"]["pool"] == {"name": NODE, "generation": 4, "resourceSliceCount": 3}
    every = [d["name"] for s in slices for d in s["spec"]["devices"]]
    assert every == [device_name(c.uuid) for c in cards]


def test_slice_names_are_the_node_s_name_and_a_suffix_the_policy_checks() -> None:
    """<node>-gpu.gpuslice.io, then -1 ... -999: what the admission policy
    gpuslice-agent-writes-its-own-slice computes from the agent's node."""
    assert slice_name(NODE) == f"{NODE}-{DRIVER}"
    assert [slice_name(NODE, i) for i in (1, 2, 999)] == [
        f"{NODE}-{DRIVER}-1",
        f"{NODE}-{DRIVER}-2",
        f"{NODE}-{DRIVER}-999",
    ]
    for index in (-1, MAX_SLICE_INDEX + 1):
        with pytest.raises(ValueError, match=r"not in 0\.\.999"):
            slice_name(NODE, index)
    # a node name that ends like another's slice never takes that slice's name
    assert slice_name("a", 1) not in {slice_name("a-1"), slice_name("a-gpu.gpuslice.io")}


def test_the_longest_node_name_still_names_every_slice() -> None:
    longest = ".".join(["a" * 58] * 4)[:MAX_NODE_NAME].rstrip(".")
    longest += "b" * (MAX_NODE_NAME - len(longest))
    assert len(longest) == MAX_NODE_NAME == 233
    check_node_name(longest)
    name = slice_name(longest, MAX_SLICE_INDEX)
    assert len(name) == 253
    assert DNS_SUBDOMAIN.fullmatch(name), name
    (obj,) = resource_slices(inventory(card(0), node=longest), consumable=False, generation=1)
    valid(obj)
    assert obj["spec"]["nodeName"] == obj["spec"]["pool"]["name"] == longest
    label = obj["metadata"]["labels"][NODE_LABEL]
    assert len(label) <= 63
    assert label != longest


def test_a_node_name_too_long_for_its_slice_names_is_refused_with_its_length() -> None:
    too_long = ".".join(["a" * 60] * 4)  # 243 characters, a valid node name
    with pytest.raises(ValueError, match=r"node name 'a{60}.*' is 243 characters.* 233 "):
        check_node_name(too_long)
    with pytest.raises(ValueError, match="is 243 characters"):
        slice_name(too_long)
    check_node_name("a" * 233)
    with pytest.raises(ValueError, match="is 234 characters"):
        check_node_name("a" * 234)


# ------------------------------------------------------------------ the publisher


class Cards:
    """The agent's inventory as the publisher reads it."""

    def __init__(self, *cards: GpuDevice) -> None:
        self.now = inventory(*cards)

    def __call__(self) -> NodeInventory:
        return self.now

    def set(self, *cards: GpuDevice) -> None:
        self.now = inventory(*cards)


async def slices_of(kube: LocalKubeApi, node: str = NODE) -> dict[str, dict[str, Any]]:
    return {
        s["metadata"]["name"]: s
        for s in await kube.list_objects(RESOURCE)
        if s["spec"].get("nodeName") == node
    }


def generation(obj: Mapping[str, Any]) -> int:
    value = obj["spec"]["pool"]["generation"]
    assert isinstance(value, int)
    return value


def foreign(name: str, node: str, driver: str) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name, "labels": {NODE_LABEL: NODE}},
        "spec": {
            "driver": driver,
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": [],
        },
    }


async def test_publisher_creates_updates_and_keeps_the_slice_in_step() -> None:
    kube = LocalKubeApi()
    cards = Cards(card(0), card(1))
    publisher = SlicePublisher(kube, NODE, cards, consumable=True)
    assert await publisher.sync() is True
    (obj,) = (await slices_of(kube)).values()
    valid({k: v for k, v in obj.items() if k != "status"})
    assert generation(obj) == 1
    assert len(obj["spec"]["devices"]) == 2
    assert publisher.published.is_set()
    version = obj["metadata"]["resourceVersion"]
    assert await publisher.sync() is False  # nothing changed: nothing asked
    assert (await slices_of(kube))[obj["metadata"]["name"]]["metadata"]["resourceVersion"] == (
        version
    )
    cards.set(card(0), card(1, healthy=False))  # a card turned unhealthy
    assert await publisher.sync() is True
    (obj,) = (await slices_of(kube)).values()
    assert generation(obj) == 2
    assert [d["name"] for d in obj["spec"]["devices"]] == [device_name(card(0).uuid)]
    cards.set(card(0), card(1), card(2))  # healthy again, and a new card
    assert await publisher.sync() is True
    (obj,) = (await slices_of(kube)).values()
    assert generation(obj) == 3
    assert len(obj["spec"]["devices"]) == 3


async def test_publisher_deletes_stale_slices_of_its_node_only() -> None:
    kube = LocalKubeApi()
    many = [card(i, numa=None) for i in range(MAX_DEVICES_PER_SLICE + 1)]
    cards = Cards(*many)
    await SlicePublisher(kube, NODE, cards, consumable=False).sync()
    assert sorted(await slices_of(kube)) == [slice_name(NODE), slice_name(NODE, 1)]
    other = await kube.create_object(RESOURCE, foreign("node-b-gpu.gpuslice.io", "node-b", DRIVER))
    # labelled as ours, but another node's, and another driver's slice of our node
    lookalike = await kube.create_object(RESOURCE, foreign("lookalike", "node-b", DRIVER))
    theirs = await kube.create_object(RESOURCE, foreign("nvidia", NODE, "gpu.nvidia.com"))
    # the agent restarts with fewer cards: its second slice goes
    cards.set(card(0))
    publisher = SlicePublisher(kube, NODE, cards, consumable=False)
    assert await publisher.sync() is True
    ours = await slices_of(kube)
    assert sorted(ours) == sorted([slice_name(NODE), "nvidia"])
    assert generation(ours[slice_name(NODE)]) == 2  # past what the last agent wrote
    assert ours[slice_name(NODE)]["spec"]["pool"]["resourceSliceCount"] == 1
    for kept in (other, lookalike, theirs):
        ref = RESOURCE.named(kept["metadata"]["name"])
        assert (await kube.get_object(ref))["metadata"]["uid"] == kept["metadata"]["uid"]


async def test_a_restarted_publisher_adopts_slices_equal_to_its_own() -> None:
    kube = LocalKubeApi()
    cards = Cards(card(0))
    await SlicePublisher(kube, NODE, cards, consumable=True).sync()
    await SlicePublisher(kube, NODE, cards, consumable=True).sync()  # changed nothing
    (obj,) = (await slices_of(kube)).values()
    assert generation(obj) == 1
    again = SlicePublisher(kube, NODE, cards, consumable=True)
    assert await again.sync() is False
    assert again.generation == 1
    assert again.published.is_set()
    # someone edited the slice: a resync puts it back, at a higher generation
    obj["spec"]["devices"] = []
    await kube.replace_object(RESOURCE.named(obj["metadata"]["name"]), obj)
    repair = SlicePublisher(kube, NODE, cards, consumable=True)
    assert await repair.sync() is True
    (obj,) = (await slices_of(kube)).values()
    assert generation(obj) == 2
    assert len(obj["spec"]["devices"]) == 1


class FailingKube(LocalKubeApi):
    """The in-memory API server refusing writes while ``failing`` is above zero."""

    def __init__(self, failing: int) -> None:
        super().__init__()
        self.failing = failing
        self.refused = 0

    async def create_object(self, ref: ObjectRef, body: Mapping[str, Any]) -> dict[str, Any]:
        if self.failing > 0:
            self.failing -= 1
            self.refused += 1
            raise KubeError("etcdserver: request timed out", 500)
        return await super().create_object(ref, body)


async def test_publisher_retries_after_api_failures() -> None:
    kube = FailingKube(failing=3)
    cards = Cards(card(0))
    publisher = SlicePublisher(
        kube, NODE, cards, consumable=True, interval=0.05, first_retry=0.01, last_retry=0.05
    )
    with pytest.raises(KubeError):
        await publisher.sync()  # one pass raises, assuming nothing written
    task = asyncio.create_task(publisher.run())
    try:
        await asyncio.wait_for(publisher.published.wait(), 10)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert kube.refused == 3
    assert publisher.failures == 2
    (obj,) = (await slices_of(kube)).values()
    assert generation(obj) == 1
    assert len(obj["spec"]["devices"]) == 1


async def test_a_slice_squatting_the_node_s_name_is_logged_as_an_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A slice of another node (or driver) under this node's name: the agent may
    not delete it; it logs an error naming it, once, and fails each pass."""
    kube = LocalKubeApi()
    squat = foreign(slice_name(NODE), "node-b", DRIVER)
    del squat["metadata"]["labels"]
    await kube.create_object(RESOURCE, squat)
    publisher = SlicePublisher(kube, NODE, Cards(card(0)), consumable=True)
    caplog.set_level(logging.ERROR, logger="gpuslice_deviceplugin.dra.slices")
    for _ in range(2):
        with pytest.raises(KubeError, match="already exists"):
            await publisher.sync()
    (record,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    message = record.getMessage()
    assert f"ResourceSlice {slice_name(NODE)}" in message
    assert "driver 'gpu.gpuslice.io', node 'node-b', pool 'node-b'" in message
    assert "until an administrator deletes it" in message
    assert not publisher.published.is_set()
    # once it is gone, the node publishes
    await kube.delete_object(RESOURCE.named(slice_name(NODE)))
    assert await publisher.sync() is True
    (obj,) = (await slices_of(kube)).values()
    assert obj["metadata"]["name"] == slice_name(NODE)
