"""The console's documents say what a user asked, in the user's terms: a failed
pod's cause, memory in the units it was asked in, and no fragmentation figure
where nothing is allocated to fragment (the page's wording: tests/console)."""

from __future__ import annotations

from typing import Any

import httpx

from gpuslice_common.bus import Bus
from gpuslice_common.events import EventType, PodAdmitted, make_event
from gpuslice_common.kube import LocalKubeApi
from gpuslice_common.models import ContainerGpuRequest, MemoryRequest, PodRef
from gpuslice_common.reports import write_report
from gpuslice_common.servers import NatsServer, free_port
from gpuslice_inventory.service import running
from tests.conftest import make_inventory
from tests.inventory.conftest import announce, rebuilt, settings_for, until
from tests.inventory.test_console import (
    TRAIN,
    WAIT_S,
    Console,
    alloc_event,
    console,  # noqa: F401 (the fixture)
    feed_holds,
    placed,
    register,
)
from tests.test_report import sample


async def test_an_idle_cluster_and_an_idle_node_have_no_fragmentation_figure(
    console: Console,  # noqa: F811
    bus: Bus,
    prefix: str,
) -> None:
    """The scheduler's report gives 12 % for the cluster and 5 % for gpu-1 (the
    share of the free cards some learned kind cannot use): with nothing
    allocated nothing is fragmented, so the snapshot gives none until a pod holds a share."""
    await register(console, bus, ("gpu-1", 2), ("gpu-2", 1))
    ledger = console.state.ledger
    await write_report(ledger.redis, prefix, sample())

    async def reported() -> bool:
        return (await console.json("/api/v1/cluster"))["report_at"] is not None

    await until(reported, timeout=WAIT_S)
    snap = await console.json("/api/v1/cluster")
    assert snap["cluster"]["fragmentation"] is None
    nodes = {n["name"]: n for n in snap["nodes"]}
    assert (nodes["gpu-1"]["fragmentation"], nodes["gpu-1"]["free_share"]) == (None, 1250.0)

    await ledger.reserve(placed(TRAIN, "gpu-1", [(0, 4096, 25)]))

    async def figured() -> bool:
        return (await console.json("/api/v1/cluster"))["cluster"]["fragmentation"] is not None

    await until(figured, timeout=WAIT_S)
    snap = await console.json("/api/v1/cluster")
    assert snap["cluster"]["fragmentation"] == 0.12
    nodes = {n["name"]: n for n in snap["nodes"]}
    assert nodes["gpu-1"]["fragmentation"] == 0.05
    assert nodes["gpu-2"]["fragmentation"] is None  # nothing on it


def admitted_asking(pod: PodRef, memory: MemoryRequest, cores: int) -> Any:
    asked = ContainerGpuRequest(name="main", count=1, memory=memory, cores=cores)
    ref = PodRef(uid=f"{pod.namespace}/{pod.name}", namespace=pod.namespace, name=pod.name)
    return make_event(
        EventType.POD_ADMITTED, PodAdmitted(pod=ref, containers=(asked,)), source="/w"
    )


async def test_a_pods_document_gives_each_containers_request_as_it_was_asked(
    console: Console,  # noqa: F811
    bus: Bus,
) -> None:
    """A quarter of a 16 GiB card is 4096 MiB granted; the page shows "25 %"."""
    await register(console, bus, ("gpu-1", 1))
    ledger = console.state.ledger
    await bus.publish_acked(admitted_asking(TRAIN, MemoryRequest(percent=25), 0))
    await ledger.reserve(placed(TRAIN, "gpu-1", [(0, 4096, 0)]))
    await bus.publish_acked(alloc_event(EventType.ALLOC_RESERVED, TRAIN, "gpu-1"))
    await feed_holds(console, 2)

    async def placed_with_story() -> bool:
        doc = await console.json("/api/v1/pods/team-a/train-1")
        return bool(doc["containers"]) and len(doc["story"]) == 2

    await until(placed_with_story, timeout=WAIT_S)
    [container] = (await console.json("/api/v1/pods/team-a/train-1"))["containers"]
    assert container["asked"] == {"memory_mib": None, "memory_percent": 25, "cores": 0}
    assert (container["cards"][0]["memory_mib"], container["cards"][0]["cores"]) == (4096, 0)


async def test_a_failed_pod_is_shown_with_its_containers_exit_codes(
    nats_server: NatsServer, redis_url: str, prefix: str, bus: Bus
) -> None:
    """The API server (its stand-in) reports the pod Failed with its container's
    exit code: the pod's list entry and document say so, not a bare "pod failed"."""
    kube = LocalKubeApi()
    port = free_port()
    config = settings_for(
        nats_server, redis_url, prefix, console_port=port, console_tick=0.2, reconcile_interval=3600
    )
    async with running(config, bus, kube=kube) as state:
        await announce(bus, make_inventory("gpu-1", gpus=1))
        await until(lambda: rebuilt(state.ledger, "gpu-1"))
        await state.ledger.reserve(placed(TRAIN, "gpu-1", [(0, 4096, 25)]))
        kube.add_pod(
            {
                "metadata": {"name": TRAIN.name, "namespace": TRAIN.namespace, "uid": TRAIN.uid},
                "spec": {"nodeName": "gpu-1"},
                "status": {"phase": "Running"},
            }
        )
        await until(lambda: state.watcher is not None and state.watcher.stats.events >= 1)
        kube.set_phase(TRAIN.namespace, TRAIN.name, "Failed", {"main": 3})
        why = "pod failed: container main exited 3 (Error)"
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=WAIT_S) as web:

            async def released() -> bool:
                doc = (await web.get("/api/v1/pods/team-a/train-1")).json()
                return bool(doc.get("state") == "released")

            await until(released, timeout=WAIT_S)
            doc = (await web.get("/api/v1/pods/team-a/train-1")).json()
            assert doc["reason"] == why
            listed = (await web.get("/api/v1/pods")).json()["pods"]
            assert [(p["name"], p["state"], p["reason"]) for p in listed] == [
                ("train-1", "released", why)
            ]
