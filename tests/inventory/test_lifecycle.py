"""Releases as pods end: the Kubernetes pod watch (over real HTTP against the local
API server, and through LocalKubeApi inside the running service) and the dev
stack's pod-ended reports on a real NATS, each released once."""

from __future__ import annotations

import asyncio
import contextlib
import json
from datetime import timedelta
from typing import Any

from gpuslice_common.bus import Bus
from gpuslice_common.events import AllocationEvent, CloudEvent, EventType
from gpuslice_common.kube import KubernetesApi, LocalKubeApi
from gpuslice_common.ledger import Ledger
from gpuslice_common.models import (
    ContainerAssignment,
    DeviceGrant,
    Placement,
    PlacementState,
    PodEnded,
    PodRef,
)
from gpuslice_common.servers import NatsServer
from gpuslice_inventory.lifecycle import PodWatcher, end_reason
from gpuslice_inventory.service import running
from gpuslice_inventory.upkeep import Upkeep
from tests.conftest import make_inventory
from tests.inventory.conftest import announce, rebuilt, settings_for, until
from tests.inventory.test_reconcile import pod_for
from tests.kubeapi import FakeApiServer, Stream, WithoutWatchList, status_body
from tests.test_ledger import placement
from tests.test_ledger_vendors import dcus

NODE = "gpu-1"


def test_end_reasons() -> None:
    running = {"status": {"phase": "Running"}}
    done = {"status": {"phase": "Succeeded"}}
    failed = {"status": {"phase": "Failed"}}
    assert end_reason("DELETED", running) == "pod deleted"
    assert end_reason("MODIFIED", done) == "pod succeeded"
    assert end_reason("ADDED", failed) == "pod failed"  # a watch from now lists it
    assert end_reason("MODIFIED", running) is None
    assert end_reason("BOOKMARK", done) is None
    assert end_reason("MODIFIED", {"status": "odd"}) is None


async def released_reason(ledger: Ledger, uid: str) -> str | None:
    found = await ledger.placement(uid)
    if found is None or found.state is not PlacementState.RELEASED:
        return None
    return found.release_reason


async def test_the_watch_resumes_from_its_version_and_starts_over_when_it_is_gone(
    kube_api_server: FakeApiServer, ledger: Ledger
) -> None:
    await ledger.register_node(make_inventory(NODE, gpus=1), rebuilt=True)
    done = placement("done", NODE, [[(0, 100, 1)]])
    gone = placement("gone", NODE, [[(0, 100, 1)]])
    await ledger.reserve(done)
    await ledger.reserve(gone)
    finished = pod_for(done, "Succeeded")
    finished["metadata"]["resourceVersion"] = "7"
    deleted = pod_for(gone, "Running")
    deleted["metadata"]["resourceVersion"] = "9"
    answers = iter(
        [
            Stream([{"type": "MODIFIED", "object": finished}]),  # then the server ends it
            Stream([{"type": "ERROR", "object": status_body(410, "Expired", "too old")}]),
            Stream([{"type": "DELETED", "object": deleted}], hold=30),
        ]
    )
    kube_api_server.answer("GET", "/api/v1/pods", 200, lambda query: next(answers))
    kube = KubernetesApi.connect(kube_api_server.host, timeout=2)
    watcher = PodWatcher(kube, upkeep(ledger), lambda: True)
    task = asyncio.create_task(watcher.run(idle_s=0.05))
    try:
        await until(lambda: watcher.stats.events == 2)
        await until(lambda: released_reason(ledger, "gone"))
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await kube.close()
    versions = [r.query.get("resourceVersion", "") for r in kube_api_server.requests]
    assert versions == ["", "7", ""]
    assert watcher.stats.restarts == 1
    assert await released_reason(ledger, "done") == "pod succeeded"
    assert await released_reason(ledger, "gone") == "pod deleted"
    assert watcher.upkeep.stats.released == {"pod succeeded": 1, "pod deleted": 1}


async def test_a_failing_api_server_is_retried_and_an_inactive_replica_does_not_watch(
    kube_api_server: FakeApiServer, ledger: Ledger
) -> None:
    kube_api_server.answer("GET", "/api/v1/pods", 500, status_body(500, "x", "etcd down"))
    kube = KubernetesApi.connect(kube_api_server.host, timeout=2)
    leader = False
    watcher = PodWatcher(kube, upkeep(ledger), lambda: leader)
    task = asyncio.create_task(watcher.run(idle_s=0.05))
    try:
        await asyncio.sleep(0.3)
        assert kube_api_server.requests == []  # not the leader: no watch
        leader = True
        await until(lambda: len(kube_api_server.requests) >= 2, timeout=30)  # backs off, retries
        assert not task.done()
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await kube.close()


async def test_releases_flow_where_the_api_server_cannot_stream_the_current_state(
    kube_api_server: FakeApiServer, ledger: Ledger
) -> None:
    # kube-apiserver 1.34 over an etcd without progress notifications refuses
    # every watch from now; no reconciliation pass runs here, so only the watch
    # (listing first) can release these pods
    await ledger.register_node(make_inventory(NODE, gpus=1), rebuilt=True)
    records = {uid: placement(uid, NODE, [[(0, 100, 1)]]) for uid in ("done", "held", "running")}
    for record in records.values():
        await ledger.reserve(record)
    pods = {
        "done": pod_for(records["done"], "Succeeded"),
        "held": pod_for(records["held"], "Running"),
        "running": pod_for(records["running"], "Running"),
    }
    for version, pod in enumerate(pods.values(), start=3):
        pod["metadata"]["resourceVersion"] = str(version)
    deleted = json.loads(json.dumps(pods["held"]))
    deleted["metadata"]["resourceVersion"] = "21"
    stand_in = WithoutWatchList(list(pods.values()), 20, [("DELETED", deleted)])
    kube_api_server.answer("GET", "/api/v1/pods", 200, stand_in)
    kube = KubernetesApi.connect(kube_api_server.host, timeout=2)
    watcher = PodWatcher(kube, upkeep(ledger), lambda: True)
    task = asyncio.create_task(watcher.run(idle_s=0.05))
    try:
        await until(lambda: released_reason(ledger, "held"))
        await until(lambda: released_reason(ledger, "done"))
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await kube.close()
    assert await released_reason(ledger, "done") == "pod succeeded"
    assert await released_reason(ledger, "held") == "pod deleted"
    assert await released_reason(ledger, "running") is None
    assert stand_in.refused == 1  # asked once, not again and again
    watched = [
        r.query.get("resourceVersion", "") for r in kube_api_server.requests if "watch" in r.query
    ]
    assert watched == ["", "20"]
    assert watcher.stats.restarts == 0
    assert watcher.version == "21"


def upkeep(ledger: Ledger) -> Upkeep:
    return Upkeep(ledger, timedelta(seconds=10), timedelta(minutes=5))


def bound_pod(uid: str) -> dict[str, Any]:
    return pod_for(placement(uid, NODE, [[(0, 1000, 10)]]), "Running")


async def test_the_leader_releases_pods_as_the_watch_reports_them_ending(
    nats_server: NatsServer, redis_url: str, prefix: str, bus: Bus, events: list[CloudEvent]
) -> None:
    kube = LocalKubeApi()
    # reconciliation far off: only the watch can release here
    config = settings_for(nats_server, redis_url, prefix, reconcile_interval=3600)
    async with running(config, bus, kube=kube, serve_http=False) as state:
        led = state.ledger
        await announce(bus, make_inventory(NODE, gpus=1))
        await until(lambda: rebuilt(led, NODE))  # the first pass stamps it, at once
        for uid in ("deleted", "failed", "running"):
            await led.reserve(placement(uid, NODE, [[(0, 1000, 10)]]))
            kube.add_pod(bound_pod(uid))
        await until(lambda: state.watcher is not None and state.watcher.stats.events >= 3)
        kube.delete_pod("ns", "deleted")
        kube.set_phase("ns", "failed", "Failed", {"main": 137})  # why it failed, kept
        await until(lambda: released_reason(led, "failed"))
        await until(lambda: released_reason(led, "deleted"))
        assert await released_reason(led, "running") is None
        assert (await led.node_gpus(NODE))[0].used.memory_mib == 1000
        await until(lambda: sum(e.type is EventType.ALLOC_RELEASED for e in events) == 2)
    reasons = sorted(
        (p.pod.uid, p.reason)
        for e in events
        if e.type is EventType.ALLOC_RELEASED
        and isinstance(p := e.payload(), AllocationEvent)
        and p.pod is not None
    )
    assert reasons == [
        ("deleted", "pod deleted"),
        ("failed", "pod failed: container main exited 137 (Error)"),
    ]


async def test_the_running_inventory_releases_a_deleted_pod_where_watch_lists_are_refused(
    nats_server: NatsServer,
    redis_url: str,
    prefix: str,
    bus: Bus,
    kube_api_server: FakeApiServer,
) -> None:
    # the server ends each watch at once (hold), so a change made later reaches
    # the renewed watch; reconciliation far off: only the watch can release here
    stand_in = WithoutWatchList([], 1, hold=0.2)
    kube_api_server.answer("GET", "/api/v1/pods", 200, stand_in)
    kube = KubernetesApi.connect(kube_api_server.host, timeout=2)
    config = settings_for(nats_server, redis_url, prefix, reconcile_interval=3600)
    try:
        async with running(config, bus, kube=kube, serve_http=False) as state:
            led = state.ledger
            await announce(bus, make_inventory(NODE, gpus=1))
            await until(lambda: rebuilt(led, NODE))
            await until(lambda: stand_in.refused == 1)
            await led.reserve(placement("held", NODE, [[(0, 1000, 10)]]))
            pod = bound_pod("held")
            pod["metadata"]["resourceVersion"] = "5"
            stand_in.items.append(pod)
            stand_in.changes.append(("DELETED", pod))
            stand_in.version = 5
            await until(lambda: released_reason(led, "held"))
            assert await released_reason(led, "held") == "pod deleted"
            assert state.work_values()["pod_watch_listed_first"] == 1
            assert stand_in.refused == 1
    finally:
        await kube.close()


async def test_pods_reported_ended_on_the_bus_are_released_once(
    nats_server: NatsServer, redis_url: str, prefix: str, bus: Bus, events: list[CloudEvent]
) -> None:
    config = settings_for(nats_server, redis_url, prefix)
    async with running(config, bus, serve_http=False) as state:
        led = state.ledger
        await announce(bus, make_inventory(NODE, gpus=1))
        await until(lambda: state.work.registrations == 1)
        for uid in ("a", "b"):
            await led.reserve(placement(uid, NODE, [[(0, 1000, 10)]]))
        usage = {
            "node": NODE,
            "pod_uid": "a",
            "container": "c0",
            "pid": 1,
            "time": "2026-11-21T10:00:00Z",
            "devices": [{"uuid": "GPU-gpu-1-0", "used_bytes": 5, "limit_bytes": 9}],
        }
        assert state.telemetry.ingest(bus.subjects.telemetry(NODE, "a"), json.dumps(usage).encode())
        await state.telemetry.flush()
        assert len(await state.telemetry.container_usage(NODE)) == 1
        malformed_before = bus.stats.malformed
        await bus.nc.publish(bus.subjects.pod_ended, b'{"pod": {"uid": "a"}, "phase": "Gone"}')
        for _ in range(3):  # said three times, released once
            ended = PodEnded(pod=PodRef(uid="a", name="a"), phase="Deleted")
            await bus.publish_model(bus.subjects.pod_ended, ended)
        ended = PodEnded(pod=PodRef(uid="b", name="b"), phase="Succeeded")
        await bus.publish_model(bus.subjects.pod_ended, ended)
        await bus.flush()
        await until(lambda: released_reason(led, "a"))
        await until(lambda: released_reason(led, "b"))
        assert await released_reason(led, "a") == "pod deleted"
        assert await released_reason(led, "b") == "pod succeeded"
        # the released pod's usage is forgotten at once, not after the TTL
        assert await state.telemetry.container_usage(NODE) == []
        await until(lambda: bus.stats.malformed == malformed_before + 1)
        await until(lambda: sum(e.type is EventType.ALLOC_RELEASED for e in events) == 2)
        await asyncio.sleep(0.2)
    assert sum(e.type is EventType.ALLOC_RELEASED for e in events) == 2
    assert state.upkeep.stats.released == {"pod deleted": 1, "pod succeeded": 1}


async def test_a_bound_vendor_pod_is_released_when_it_is_deleted(
    nats_server: NatsServer, redis_url: str, prefix: str, bus: Bus
) -> None:
    # the sweep never expires it (its vendor's plugin allocates it, unseen): the
    # pod's end is what frees its cards
    kube = LocalKubeApi()
    config = settings_for(nats_server, redis_url, prefix, reconcile_interval=3600)
    async with running(config, bus, kube=kube, serve_http=False) as state:
        led = state.ledger
        await announce(bus, make_inventory(NODE, gpus=1))
        await until(lambda: rebuilt(led, NODE))
        await led.register_node(dcus(NODE, count=1))
        grant = DeviceGrant(uuid=f"DCU-{NODE}-0", memory_mib=1000, cores=10)
        main = ContainerAssignment(name="main", devices=(grant,), vendor="hygon")
        record = Placement(
            pod=PodRef(uid="dcu", namespace="ns", name="dcu"), node=NODE, containers=(main,)
        )
        await led.reserve(record)
        await led.mark_bound("dcu")
        kube.add_pod(pod_for(record, "Running"))
        await until(lambda: state.watcher is not None and state.watcher.stats.events >= 1)
        [dcu] = await led.node_gpus(NODE, vendor="hygon")
        assert dcu.used.memory_mib == 1000
        kube.delete_pod("ns", "dcu")
        await until(lambda: released_reason(led, "dcu"))
        assert await released_reason(led, "dcu") == "pod deleted"
        [dcu] = await led.node_gpus(NODE, vendor="hygon")
        assert dcu.used.memory_mib == 0
