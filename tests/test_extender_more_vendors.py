"""Ascend, Cambricon, Moore Threads, Metax, Enflame and whole Kunlun XPUs through the
live extender: nodes registered the way each vendor's plugin registers them (HAMi's
register annotations, node capacity, the vendor's own annotation), held by a local
API server and read into a real Redis ledger; pods written as HAMi's docs write
them filtered and bound; the annotations each plugin reads at Allocate checked."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import pytest

from gpuslice_common.devicetypes import parse_device_config
from gpuslice_common.kube import LocalKubeApi
from gpuslice_common.ledger import Ledger
from gpuslice_common.models import PlacementState
from gpuslice_common.servers import NatsServer
from gpuslice_inventory.vendorsync import VendorSync
from tests.test_extender_vendors import CONFIG, Stack, serving, vendor_settings


def now() -> str:
    return "Reported_" + datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S")


def node(name: str, annotations: dict[str, str], capacity: dict[str, str]) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "annotations": annotations},
        "status": {"capacity": capacity, "allocatable": capacity},
    }


def ascend_node() -> dict[str, Any]:
    cards = [
        {
            "id": f"NPU-{i}",
            "index": i,
            "count": 4,
            "devmem": 65536,
            "devcore": 20,
            "type": "Ascend910B3",
            "health": True,
        }
        for i in range(2)
    ]
    return node(
        "ascend",
        {
            "hami.io/node-register-Ascend910B3": json.dumps(cards),
            "hami.io/node-handshake-Ascend910B3": now(),
        },
        {"huawei.com/Ascend910B3": "2"},
    )


ENFLAME_CAPACITY = {
    "devices": [
        {"index": "0", "minor": "0", "capacity": 6},
        {"index": "1", "minor": "1", "capacity": 6},
    ],
    "profiles": {"1g.6gb": "0", "3g.20gb": "1", "6g.40gb": "2"},
}


def nodes() -> list[dict[str, Any]]:
    """The nodes, made when a test runs: a handshake dated at import would be stale
    by the time a test of a long session runs."""
    return [
        ascend_node(),
        # Cambricon's dynamic-smlu plugin: 2 MLUs of 100 cores and 192 x 256 MiB each
        node(
            "mlu",
            {},
            {
                "cambricon.com/vmlu": "200",
                "cambricon.com/mlu.smlu.vcore": "200",
                "cambricon.com/mlu.smlu.vmemory": "384",
            },
        ),
        # Moore Threads: 2 cards of 16 cores and 96 x 512 MiB each
        node(
            "mt",
            {},
            {
                "mthreads.com/vgpu": "200",
                "mthreads.com/sgpu-core": "32",
                "mthreads.com/sgpu-memory": "192",
            },
        ),
        node(
            "metax",
            {
                "metax-tech.com/node-gpu-devices": json.dumps(
                    [
                        {
                            "uuid": f"MXC-{i}",
                            "model": "MXC500",
                            "totalDevCount": 16,
                            "totalCompute": 100,
                            "totalVRam": 65536,
                            "healthy": True,
                            "qosPolicy": "best-effort",
                        }
                        for i in range(2)
                    ]
                )
            },
            {"metax-tech.com/sgpu": "32"},
        ),
        node("metax-whole", {}, {"metax-tech.com/gpu": "2"}),
        node("gcu", {"enflame.com/gcu-drs-capacity": json.dumps(ENFLAME_CAPACITY)}, {}),
        node("xpu", {}, {"kunlunxin.com/xpu": "8"}),
    ]


NAMES = [n["metadata"]["name"] for n in nodes()]


def pod(
    name: str, limits: dict[str, Any], annotations: dict[str, str] | None = None
) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": "team",
            "uid": f"uid-{name}",
            "annotations": annotations or {},
        },
        "spec": {
            "containers": [{"name": "main", "resources": {"limits": limits}}, {"name": "log"}]
        },
    }


@pytest.fixture
async def stack(redis_url: str, nats_server: NatsServer, prefix: str) -> AsyncIterator[Stack]:
    settings = vendor_settings(redis_url, nats_server, prefix)
    ledger = Ledger.from_url(redis_url)
    try:
        kube = LocalKubeApi()
        for spec in nodes():
            kube.add_node(spec)
        types = parse_device_config(CONFIG.read_text()).announced()
        result = await VendorSync(ledger, kube, types).run_once()
        assert not result.refused, result
        assert set(result.registered) >= {
            "ascend910b3",
            "cambricon",
            "mthreads",
            "metax-sgpu",
            "metax",
            "enflame",
            "kunlun",
        }
        for name in NAMES:  # as the inventory's first reconciliation pass stamps them
            assert await ledger.mark_rebuilt(name)
        async with serving(settings, kube, ledger) as stack:
            yield stack
    finally:
        await ledger.close()


async def bound(stack: Stack, spec: dict[str, Any], node: str) -> dict[str, str]:
    """Filter (the pod fits ``node`` only), bind there, and the pod's annotations."""
    reply = await stack.filter(spec, *NAMES)
    assert reply["NodeNames"] == [node], reply
    assert await stack.bind(spec, node) == {"Error": ""}
    placed = await stack.ledger.placement(spec["metadata"]["uid"])
    assert placed is not None
    assert placed.state is PlacementState.BOUND
    stored = await stack.kube.get_pod("team", spec["metadata"]["name"])
    assert stored["spec"]["nodeName"] == node
    annotations: dict[str, str] = stored["metadata"]["annotations"]
    assert annotations["hami.io/vgpu-node"] == node
    return annotations


async def refused(stack: Stack, spec: dict[str, Any], resource: str) -> str:
    reply = await stack.filter(spec, *NAMES)
    assert reply["NodeNames"] == []
    lines = {**reply["FailedNodes"], **reply["FailedAndUnresolvableNodes"]}
    assert all(resource in line for line in lines.values()), lines
    return "\n".join(lines.values())


async def test_ascend_vnpus_take_their_template(stack: Stack) -> None:
    spec = pod("npu", {"huawei.com/Ascend910B3": "1", "huawei.com/Ascend910B3-memory": "16000"})
    annotations = await bound(stack, spec, "ascend")
    [entry] = json.loads(annotations["huawei.com/Ascend910B3"])
    assert entry["temp"] == "vir05_1c_16g"
    assert entry["memory"] == 16384
    uuid = entry["UUID"]
    assert annotations["hami.io/Ascend910B3-devices-to-allocate"] == (
        f"{uuid},Ascend910B3,16384,0:;;"
    )
    # three whole cards: the node has two
    await refused(stack, pod("npu3", {"huawei.com/Ascend910B3": "3"}), "huawei.com/Ascend910B3")


async def test_cambricon_mlus_are_shared_by_memory_and_cores(stack: Stack) -> None:
    limits = {
        "cambricon.com/vmlu": "1",
        "cambricon.com/mlu.smlu.vmemory": "20",
        "cambricon.com/mlu.smlu.vcore": "10",
    }
    annotations = await bound(stack, pod("mlu", limits), "mlu")
    expected_card = annotations["hami.io/cambricon-mlu-devices-to-allocate"].split(",")[0]
    assert expected_card.startswith("mlu-cambricon-mlu-")
    index = expected_card.rsplit("-", 1)[1]
    assert annotations["CAMBRICON_DSMLU_PROFILE"] == f"{index}_10_20"
    assert annotations["CAMBRICON_DSMLU_ASSIGNED"] == "false"
    # HAMi's 256 MiB units: 8000 of them is more than an MLU of 48 GiB holds
    too_big = {**limits, "cambricon.com/mlu.smlu.vmemory": "8000"}
    await refused(stack, pod("mlu-big", too_big), "cambricon.com/mlu.smlu.vmemory")


async def test_moore_threads_sgpus_take_sixteenths_of_a_card(stack: Stack) -> None:
    limits = {
        "mthreads.com/vgpu": "1",
        "mthreads.com/sgpu-memory": "32",
        "mthreads.com/sgpu-core": "8",
    }
    annotations = await bound(stack, pod("mt", limits), "mt")
    assert annotations["mthreads.com/gpu-index"] in {"0", "1"}
    assert annotations["mthreads.com/predicate-node"] == "mt"
    card = annotations["hami.io/mthreads-vgpu-devices-allocated"].split(",")[0]
    gpus = {g.device.uuid: g for g in await stack.ledger.node_gpus("mt", vendor="mthreads")}
    assert (gpus[card].used.memory_mib, gpus[card].used.cores) == (16384, 8)
    assert gpus[card].capacity.cores == 16
    # three whole cards: the node has two
    await refused(stack, pod("mt3", {"mthreads.com/vgpu": "3"}), "mthreads.com/vgpu")


async def test_metax_sgpus_and_whole_gpus(stack: Stack) -> None:
    limits = {
        "metax-tech.com/sgpu": "1",
        "metax-tech.com/vcore": "60",
        "metax-tech.com/vmemory": "4",
    }
    annotations = await bound(stack, pod("sgpu", limits), "metax")
    [[entry]] = json.loads(annotations["metax-tech.com/gpu-devices-allocated"])[:1]
    assert entry["uuid"] in {"MXC-0", "MXC-1"}
    assert (entry["compute"], entry["vRam"]) == (60, 4096)
    whole = await bound(stack, pod("gpu", {"metax-tech.com/gpu": "1"}), "metax-whole")
    assert whole["hami.io/metax-gpu-devices-to-allocate"].startswith("metax-whole-metax-")
    await refused(stack, pod("gpu3", {"metax-tech.com/gpu": "3"}), "metax-tech.com/gpu")


async def test_enflame_gets_the_drs_profile_of_its_node(stack: Stack) -> None:
    annotations = await bound(stack, pod("gcu", {"enflame.com/drs-gcu": "3"}), "gcu")
    assigned = json.loads(annotations["assigned-containers"])
    assert assigned == {
        "main": {"allocated": False, "request": 3, "profileID": "1", "profileName": "3g.20gb"}
    }
    assert annotations["enflame.com/gcu-request-size"] == "3"
    by_spec = {"enflame.com/gcu-memory": "20480", "enflame.com/gcu-core": "40"}
    annotations = await bound(stack, pod("gcu-spec", by_spec), "gcu")
    assert json.loads(annotations["assigned-containers"])["main"]["profileName"] == "3g.20gb"
    # no profile has 5 slices
    await refused(stack, pod("gcu5", {"enflame.com/drs-gcu": "5"}), "enflame.com/drs-gcu")


async def test_whole_kunlun_xpus_are_taken_joined(stack: Stack) -> None:
    annotations = await bound(stack, pod("xpu2", {"kunlunxin.com/xpu": "2"}), "xpu")
    picked = [int(i) for i in annotations["BAIDU_COM_DEVICE_IDX"].split(",")]
    assert len(picked) == 2
    assert len({i // 4 for i in picked}) == 1  # one group of four
    annotations = await bound(stack, pod("xpu4", {"kunlunxin.com/xpu": "4"}), "xpu")
    four = [int(i) for i in annotations["BAIDU_COM_DEVICE_IDX"].split(",")]
    assert len({i // 4 for i in four}) == 1
    assert not set(four) & set(picked)
    await refused(stack, pod("xpu8", {"kunlunxin.com/xpu": "8"}), "kunlunxin.com/xpu")
