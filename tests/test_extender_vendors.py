"""Other vendors' pods through the live extender: a real Redis ledger and NATS bus,
nodes registered from HAMi vendor plugins' annotations held by a local API server
(and, for vendors whose cards HAMi derives otherwise, registered as such in the
ledger), and the annotations each vendor's plugin reads at Allocate written at bind."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpuslice_common import drs
from gpuslice_common.bus import Bus
from gpuslice_common.config import SchedulerSettings, load
from gpuslice_common.devicetypes import parse_device_config, read_vendors
from gpuslice_common.kube import LocalKubeApi
from gpuslice_common.ledger import Ledger
from gpuslice_common.models import (
    PLACEMENT_ANNOTATION,
    GpuDevice,
    NodeInventory,
    Placement,
    PlacementState,
)
from gpuslice_common.servers import NatsServer, free_port
from gpuslice_inventory.vendorsync import VendorSync
from gpuslice_scheduler.service import running
from tests.conftest import make_inventory

CONFIG = Path(__file__).parent / "data" / "hami-device-config.yaml"
# an Enflame card's DRS profiles: 1, 2 and 4 slices of 4
DRS_TABLE = drs.table(
    [drs.profile("1g.8gb", "10"), drs.profile("2g.16gb", "11"), drs.profile("4g.32gb", "12")]
)


def accel_cards() -> list[NodeInventory]:
    """Node "accel": eight whole Kunlun XPUs and one Enflame DRS card (device index 3,
    minor 6), as the inventory registers cards HAMi derives from node capacity and
    from Enflame's own annotation."""
    kunlun = tuple(
        GpuDevice(
            uuid=f"accel-kunlun-{i}", index=i, model="kunlun", memory_mib=98304, vendor="kunlun"
        )
        for i in range(8)
    )
    enflame = GpuDevice(
        uuid="accel-enflame-drs-3",
        index=3,
        model=drs.model_of(DRS_TABLE, "6"),
        memory_mib=32768,
        vendor="enflame",
    )
    return [
        NodeInventory(node="accel", devices=kunlun, split_count=1, vendor="kunlun"),
        NodeInventory(node="accel", devices=(enflame,), split_count=4, vendor="enflame"),
    ]


def vendor_node(name: str) -> dict[str, Any]:
    """A node whose HAMi plugins announce two DCUs (Hygon's text form) and one XPU."""
    # reported now, when the node is made: a time taken at import would be stale by
    # the time a test runs in a long session
    reported = "Reported_" + datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S")
    return {
        "metadata": {
            "name": name,
            "annotations": {
                "hami.io/node-dcu-register": "DCU-a,4,65520,100,DCU-Z100L,0,true,0,hami-core:"
                "DCU-b,4,65520,100,DCU-Z100L,0,true,1,hami-core:",
                "hami.io/node-handshake-dcu": reported,
                "hami.io/node-register-xpu": json.dumps(
                    [
                        {
                            "id": "XPU-0",
                            "index": 2,
                            "count": 2,
                            "devmem": 98304,
                            "type": "P800",
                            "health": True,
                        }
                    ]
                ),
                "hami.io/node-handshake-xpu": reported,
            },
        },
        "status": {"allocatable": {}, "capacity": {}},
    }


def pod(name: str, limits: dict[str, Any], *, init: bool = True) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "containers": [
            {"name": "main", "resources": {"limits": limits}},
            {"name": "log"},
        ]
    }
    if init:
        spec["initContainers"] = [{"name": "setup"}]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "team", "uid": f"uid-{name}", "annotations": {}},
        "spec": spec,
    }


class Stack:
    def __init__(self, url: str, http: httpx.AsyncClient, kube: LocalKubeApi, ledger: Ledger):
        self.url, self.http, self.kube, self.ledger = url, http, kube, ledger

    async def post(self, verb: str, body: Any) -> Any:
        reply = await self.http.post(f"{self.url}/{verb}", content=json.dumps(body).encode())
        assert reply.status_code == 200
        return reply.json()

    async def filter(self, spec: dict[str, Any], *nodes: str) -> Any:
        return await self.post("filter", {"Pod": spec, "NodeNames": list(nodes)})

    async def bind(self, spec: dict[str, Any], node: str) -> Any:
        self.kube.add_pod(spec)
        meta = spec["metadata"]
        return await self.post(
            "bind",
            {
                "PodName": meta["name"],
                "PodNamespace": meta["namespace"],
                "PodUID": meta["uid"],
                "Node": node,
            },
        )


def vendor_settings(redis_url: str, nats_server: NatsServer, prefix: str) -> SchedulerSettings:
    """An extender's settings reading HAMi's default device configuration."""
    return read_vendors(
        load(
            SchedulerSettings,
            redis_url=redis_url,
            nats_url=nats_server.url,
            subject_prefix=prefix,
            listen_host="127.0.0.1",
            listen_port=free_port(),
            metrics_port=free_port(),
            sync_interval="50ms",
            device_config=str(CONFIG),
        )
    )


@contextlib.asynccontextmanager
async def serving(
    settings: SchedulerSettings, kube: LocalKubeApi, ledger: Ledger
) -> AsyncIterator[Stack]:
    """The live extender over ``ledger`` and ``kube``, with its bus."""
    bus = await Bus.connect(settings, "test")
    try:
        await bus.ensure_audit_stream(timedelta(hours=1))
        async with running(settings, kube, bus=bus), httpx.AsyncClient(timeout=5) as http:
            yield Stack(f"http://127.0.0.1:{settings.listen_port}", http, kube, ledger)
    finally:
        await bus.close()


@pytest.fixture
async def stack(redis_url: str, nats_server: NatsServer, prefix: str) -> AsyncIterator[Stack]:
    settings = vendor_settings(redis_url, nats_server, prefix)
    assert {v.vendor for v in settings.requests.vendors} >= {"hygon", "xpu"}
    ledger = Ledger.from_url(redis_url)
    try:
        kube = LocalKubeApi()
        # "mixed": the node agent's one NVIDIA card, and the vendor plugins' cards;
        # "gpu": NVIDIA only
        await ledger.register_node(make_inventory("mixed", gpus=1, memory_mib=16384), rebuilt=True)
        await ledger.register_node(make_inventory("gpu", gpus=2, memory_mib=16384), rebuilt=True)
        kube.add_node(vendor_node("mixed"))
        kube.add_node({"metadata": {"name": "gpu"}})
        types = parse_device_config(CONFIG.read_text()).announced()
        result = await VendorSync(ledger, kube, types).run_once()
        assert result.registered["hygon"] == 1
        await ledger.register_node(make_inventory("accel", gpus=0), rebuilt=True)
        for inventory in accel_cards():
            await ledger.register_node(inventory)
        kube.add_node({"metadata": {"name": "accel"}})
        async with serving(settings, kube, ledger) as stack:
            yield stack
    finally:
        await ledger.close()


DCU = {"hygon.com/dcunum": "1", "hygon.com/dcumem": "2000", "hygon.com/dcucores": "30"}


async def test_a_vendor_pod_fits_only_where_its_vendors_cards_are(stack: Stack) -> None:
    reply = await stack.filter(pod("dcu", DCU), "mixed", "gpu")
    assert reply["NodeNames"] == ["mixed"]
    assert reply["FailedAndUnresolvableNodes"]["gpu"].startswith("CardTypeMismatch")
    # two DCUs on the node, not three: the NVIDIA card and the XPU are not counted
    reply = await stack.filter(pod("dcu3", {"hygon.com/dcunum": "3"}), "mixed")
    assert reply["NodeNames"] == []
    assert reply["FailedAndUnresolvableNodes"]["mixed"] == (
        "AllocatedCardsInsufficientRequest: container 'main' needs 3 card(s), 2 of 4 fit "
        "(2 CardTypeMismatch) [hygon: hygon.com/dcunum, hygon.com/dcumem, hygon.com/dcucores]"
    )
    # an NVIDIA pod asking for two cards fits on "gpu" only: the DCUs are not NVIDIA's
    reply = await stack.filter(pod("cuda", {"nvidia.com/gpu": "2"}), "mixed", "gpu")
    assert reply["NodeNames"] == ["gpu"]
    # an XPU pod is placed on the XPU only
    reply = await stack.filter(pod("xpu", {"kunlunxin.com/vxpu": "1"}), "mixed", "gpu")
    assert reply["NodeNames"] == ["mixed"]


async def test_bind_writes_what_hamis_vendor_plugins_read(stack: Stack) -> None:
    spec = pod("dcu", DCU)
    before = int(datetime.now(UTC).timestamp())
    assert await stack.bind(spec, "mixed") == {"Error": ""}
    placed = await stack.ledger.placement("uid-dcu")
    assert placed is not None
    assert placed.state is PlacementState.BOUND
    [main] = placed.containers
    assert main.vendor == "hygon"
    [grant] = main.devices
    assert grant.uuid in {"DCU-a", "DCU-b"}
    assert (grant.memory_mib, grant.cores) == (2000, 30)
    stored = await stack.kube.get_pod("team", "dcu")
    assert stored["spec"]["nodeName"] == "mixed"
    annotations = stored["metadata"]["annotations"]
    # HAMi's encoding: per container (init "setup", then "main" and "log"), ";"-ended;
    # per card "uuid,type,memory MiB,cores" ":"-ended
    expected = f";{grant.uuid},DCU,2000,30:;;"
    assert annotations["hami.io/dcu-devices-to-allocate"] == expected
    assert annotations["hami.io/dcu-devices-allocated"] == expected
    assert annotations["hami.io/vgpu-node"] == "mixed"
    assert annotations["hami.io/bind-phase"] == "allocating"
    assert before <= int(annotations["hami.io/bind-time"]) <= before + 60
    record = Placement.from_annotation(annotations[PLACEMENT_ANNOTATION])
    assert record.containers == placed.containers
    # decoded as HAMi's scheduler does: split per container, then per card
    entries = expected.split(";")
    assert entries[:3] == ["", f"{grant.uuid},DCU,2000,30:", ""]
    fields = entries[1].split(":")[0].split(",")
    assert fields == [grant.uuid, "DCU", "2000", "30"]
    # the DCU's usage is counted; the node's NVIDIA card is untouched
    dcus = {c.device.uuid: c for c in await stack.ledger.node_gpus("mixed", vendor="hygon")}
    assert dcus[grant.uuid].used.memory_mib == 2000
    [gpu] = await stack.ledger.node_gpus("mixed")
    assert gpu.used.memory_mib == 0


async def test_bind_writes_the_card_indexes_kunlun_s_plugin_reads(stack: Stack) -> None:
    spec = pod("xpus", {"kunlunxin.com/xpu": "2"})
    assert await stack.bind(spec, "accel") == {"Error": ""}
    placed = await stack.ledger.placement("uid-xpus")
    assert placed is not None
    [main] = placed.containers
    indexes = {
        c.device.uuid: c.device.index
        for c in await stack.ledger.node_gpus("accel", vendor="kunlun")
    }
    annotations = (await stack.kube.get_pod("team", "xpus"))["metadata"]["annotations"]
    # two joined XPUs, named by their device indexes as the ledger holds them
    assert annotations["BAIDU_COM_DEVICE_IDX"] == ",".join(
        str(indexes[g.uuid]) for g in main.devices
    )
    assert annotations["BAIDU_COM_DEVICE_IDX"] == "0,1"
    cards = "".join(f"{g.uuid},kunlun,{g.memory_mib},{g.cores}:" for g in main.devices)
    assert annotations["hami.io/kunlun-allocated"] == f";{cards};;"
    assert "hami.io/kunlun-devices-to-allocate" not in annotations
    assert annotations["hami.io/vgpu-node"] == "accel"


async def test_bind_writes_the_drs_profile_enflame_s_plugin_reads(stack: Stack) -> None:
    spec = pod("gcu", {"enflame.com/drs-gcu": "2"})
    before = datetime.now(UTC).timestamp()
    assert await stack.bind(spec, "accel") == {"Error": ""}
    placed = await stack.ledger.placement("uid-gcu")
    assert placed is not None
    [main] = placed.containers
    [grant] = main.devices
    # the profile of two slices: 16 GB, half the card's compute
    assert (grant.uuid, grant.memory_mib, grant.cores) == ("accel-enflame-drs-3", 16384, 50)
    annotations = (await stack.kube.get_pod("team", "gcu"))["metadata"]["annotations"]
    assert annotations["hami.io/enflame-vgpu-devices-allocated"] == (
        ";accel-enflame-drs-3,Enflame,16384,50:;;"
    )
    assert annotations["assigned-containers"] == (
        '{"main":{"allocated":false,"request":2,"profileID":"11","profileName":"2g.16gb"}}'
    )
    # the card's device index and minor, from its record in the scheduler's copy
    assert annotations["enflame.com/gcu-assigned-index"] == "3"
    assert annotations["enflame.com/gcu-assigned-id"] == "3"
    assert annotations["enflame.com/gcu-assigned-minor"] == "6"
    assert annotations["enflame.com/gcu-request-size"] == "2"
    assert annotations["enflame.com/gcu-assigned"] == "false"
    assigned_ns = int(annotations["enflame.com/gcu-assigned-time"])
    assert before <= assigned_ns / 1e9 <= before + 60
    assert int(annotations["hami.io/bind-time"]) == assigned_ns // 1_000_000_000


async def test_an_nvidia_pod_gets_no_hami_vendor_annotations(stack: Stack) -> None:
    spec = pod("cuda", {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "1000"}, init=False)
    assert await stack.bind(spec, "mixed") == {"Error": ""}
    stored = await stack.kube.get_pod("team", "cuda")
    assert set(stored["metadata"]["annotations"]) == {PLACEMENT_ANNOTATION}
    placed = await stack.ledger.placement("uid-cuda")
    assert placed is not None
    assert placed.containers[0].devices[0].uuid.startswith("GPU-")


def test_a_card_name_that_would_break_hamis_encoding_is_refused() -> None:
    from gpuslice_common.config import VendorResources
    from gpuslice_common.models import ContainerAssignment, DeviceGrant, PodRef
    from gpuslice_scheduler.vendorannotations import (
        EncodingError,
        encode_devices,
        vendor_annotations,
    )

    hygon = VendorResources(
        vendor="hygon", count="hygon.com/dcunum", device_type="DCU", allocate_key="dcu"
    )

    def placed(uuid: str, name: str = "main") -> Placement:
        grant = DeviceGrant(uuid=uuid, memory_mib=1, cores=1)
        assignment = ContainerAssignment(name=name, devices=(grant,), vendor="hygon")
        return Placement(pod=PodRef(uid="u"), node="n", containers=(assignment,))

    spec = pod("p", DCU, init=False)
    assert encode_devices(spec, placed("DCU-a"), hygon) == "DCU-a,DCU,1,1:;;"
    for bad in ("DCU,a", "DCU:a", "DCU;a", ""):
        with pytest.raises(EncodingError, match="cannot be written for HAMi"):
            encode_devices(spec, placed(bad or "-"), hygon)
        with pytest.raises(EncodingError, match="cannot be written for HAMi"):
            vendor_annotations(spec, placed(bad or "-"), (hygon,), {}, 0)
    with pytest.raises(EncodingError, match="'gone' is not in the pod's spec"):
        encode_devices(spec, placed("DCU-a", "gone"), hygon)
    # a pod on the cards of a vendor the scheduler no longer reads is not bound
    # without what its plugin needs
    with pytest.raises(EncodingError, match="vendor hygon is not in the scheduler's device"):
        vendor_annotations(spec, placed("DCU-a"), (), {}, 0)


@pytest.mark.parametrize("service", ["gpuslice_webhook", "gpuslice_scheduler"])
async def test_a_bad_device_config_stops_the_service_at_start(service: str, tmp_path: Path) -> None:
    bad = tmp_path / "device-config.yaml"
    bad.write_text("hygon:\n  memoryFactor: 0\n")
    env = {
        **os.environ,
        "GPUSLICE_DEVICE_CONFIG": str(bad),
        "GPUSLICE_KUBE_API": "none" if service == "gpuslice_webhook" else "local",
        "GPUSLICE_NATS_URL": "nats://127.0.0.1:1",  # never reached
        # never bound either, but a start that got that far must not take fixed ones
        "GPUSLICE_LISTEN_PORT": str(free_port()),
        "GPUSLICE_METRICS_PORT": str(free_port()),
    }
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", service, env=env, stderr=asyncio.subprocess.PIPE
    )
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 2
    assert "hygon.memoryFactor is 0, outside 1..1048576" in err.decode()
