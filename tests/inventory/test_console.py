"""The inventory's web console over real HTTP: snapshot, live updates, pods, audit.

A real inventory (``running``) on the session nats-server and redis-server
serves the console on a free port; the tests read it with httpx (and a raw
socket where httpx would tidy the path up).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import orjson
import pytest
from pydantic import ValidationError

from gpuslice_common.bus import Bus
from gpuslice_common.config import ConfigError, InventorySettings, load
from gpuslice_common.events import (
    AllocationEvent,
    CloudEvent,
    EnforcementEvent,
    EventType,
    PodAdmitted,
    PodDenied,
    make_event,
    parse_event,
)
from gpuslice_common.kube import KubernetesApi
from gpuslice_common.models import (
    CardLayers,
    ContainerAssignment,
    ContainerGpuRequest,
    DeviceGrant,
    LayerState,
    MemoryRequest,
    NodeInventory,
    Placement,
    PodRef,
)
from gpuslice_common.reports import write_report
from gpuslice_common.servers import NatsServer, RedisServer, free_port
from gpuslice_inventory.console.auth import Viewer
from gpuslice_inventory.console.hub import MIN_REFRESH_S
from gpuslice_inventory.service import Running, running
from tests.conftest import make_inventory, make_vendor_inventory
from tests.inventory.conftest import announce, rebuilt, settings_for, until
from tests.kubeapi import FakeApiServer, Stream
from tests.test_report import sample

MIB = 1024 * 1024
TRAIN = PodRef(uid="uid-train-1", namespace="team-a", name="train-1")
OTHER = PodRef(uid="uid-other-1", namespace="team-b", name="other-1")
WAIT_S = 15.0


def placed(pod: PodRef, node: str, grants: list[tuple[int, int, int]]) -> Placement:
    """``pod`` on ``node`` with one container ``main``: (card index, MiB, cores) each."""
    devices = tuple(
        DeviceGrant(uuid=f"GPU-{node}-{i}", memory_mib=m, cores=c) for i, m, c in grants
    )
    return Placement(
        pod=pod,
        node=node,
        containers=(ContainerAssignment(name="main", devices=devices),),
        policy="binpack",
    )


def alloc_event(kind: EventType, pod: PodRef | None, node: str, reason: str = "") -> CloudEvent:
    grant = DeviceGrant(uuid=f"GPU-{node}-0", memory_mib=4096, cores=25)
    containers = () if pod is None else (ContainerAssignment(name="main", devices=(grant,)),)
    payload = AllocationEvent(
        pod=pod, node=node, containers=containers, policy="binpack", reason=reason
    )
    return make_event(kind, payload, source="/test")


def admitted(pod: PodRef) -> CloudEvent:
    asked = ContainerGpuRequest(name="main", count=1, memory=MemoryRequest(mib=4096), cores=25)
    # before the API server gives it a uid, the webhook names the pod by namespace/name
    ref = PodRef(uid=f"{pod.namespace}/{pod.name}", namespace=pod.namespace, name=pod.name)
    return make_event(
        EventType.POD_ADMITTED, PodAdmitted(pod=ref, containers=(asked,)), source="/w"
    )


def denied(namespace: str, name: str, reason: str) -> CloudEvent:
    ref = PodRef(uid=f"{namespace}/{name}", namespace=namespace, name=name)
    return make_event(EventType.POD_DENIED, PodDenied(pod=ref, reason=reason), source="/w")


def telemetry_sample(node: str, pod: str, used: int, sm: float, limit: int = 8192 * MIB) -> bytes:
    return orjson.dumps(
        {
            "node": node,
            "pod_uid": pod,
            "container": "main",
            "pid": 42,
            "time": "2026-11-25T01:00:00Z",
            "devices": [
                {
                    "uuid": f"GPU-{node}-0",
                    "used_bytes": used,
                    "peak_bytes": 3 * used,
                    "limit_bytes": limit,
                    "sm_percent": sm,
                    "throttled_ns": 5,
                    "denied_allocations": 0,
                }
            ],
            "dropped_samples": 0,
        }
    )


class Console:
    """The running inventory with an HTTP client on its console."""

    def __init__(self, state: Running, client: httpx.AsyncClient, port: int) -> None:
        self.state = state
        self.client = client
        self.port = port

    @property
    def hub(self) -> Any:
        assert self.state.console is not None
        return self.state.console

    async def get(self, path: str, **params: str) -> httpx.Response:
        return await self.client.get(path, params=params)

    async def json(self, path: str, **params: str) -> Any:
        answer = await self.get(path, **params)
        assert answer.status_code == 200, answer.text
        return answer.json()


@contextlib.asynccontextmanager
async def start_console(
    nats: NatsServer, redis_url: str, prefix: str, bus: Bus, **kw: Any
) -> AsyncIterator[Console]:
    port = free_port()
    settings = settings_for(nats, redis_url, prefix, kube_api="none", console_port=port, **kw)
    async with running(settings, bus) as state:
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}", timeout=WAIT_S, limits=limits
        ) as client:
            yield Console(state, client, port)


@pytest.fixture
async def console(
    nats_server: NatsServer, redis_url: str, prefix: str, bus: Bus
) -> AsyncIterator[Console]:
    async with start_console(nats_server, redis_url, prefix, bus, console_tick=0.2) as c:
        yield c


async def register(console: Console, bus: Bus, *nodes: tuple[str, int]) -> None:
    for node, gpus in nodes:
        await announce(bus, make_inventory(node, gpus=gpus, memory_mib=16384))
    await until(lambda: rebuilt(console.state.ledger, *(n for n, _ in nodes)))


async def sse_events(response: httpx.Response) -> AsyncIterator[tuple[str, Any]]:
    """(event name, parsed data) of a server-sent event stream; comments skipped."""
    name, data = "", ""
    async for line in response.aiter_lines():
        if line.startswith(":"):
            continue
        if line.startswith("event: "):
            name = line.removeprefix("event: ")
        elif line.startswith("data: "):
            data = line.removeprefix("data: ")
        elif line == "" and name:
            yield name, json.loads(data)
            name, data = "", ""


async def first_event(
    events: AsyncIterator[tuple[str, Any]], want: Any, timeout: float = WAIT_S
) -> tuple[str, Any]:
    """The first event for which ``want(name, data)`` holds, within ``timeout``."""

    async def find() -> tuple[str, Any]:
        async for name, data in events:
            if want(name, data):
                return name, data
        raise AssertionError("the stream ended")

    return await asyncio.wait_for(find(), timeout)


# ---------------------------------------------------------------- the snapshot


async def test_snapshot_counts_cards_placements_telemetry_and_the_report(
    console: Console, bus: Bus, prefix: str
) -> None:
    await register(console, bus, ("gpu-1", 2), ("gpu-2", 1))
    ledger = console.state.ledger
    await ledger.reserve(placed(TRAIN, "gpu-1", [(0, 4096, 25)]))
    await ledger.reserve(placed(OTHER, "gpu-2", [(0, 2048, 10)]))
    telemetry = console.state.telemetry
    assert telemetry.ingest(
        bus.subjects.telemetry("gpu-1", TRAIN.uid),
        telemetry_sample("gpu-1", TRAIN.uid, 1024 * MIB, 12.5),
    )
    assert await telemetry.flush() == 1
    report = sample()  # the report tests' own
    await write_report(ledger.redis, prefix, report)

    async def measured() -> bool:
        snap = await console.json("/api/v1/cluster")
        return bool(snap["cluster"]["measured_memory_mib"]) and snap["report_at"] is not None

    await until(measured, timeout=WAIT_S)
    snap = await console.json("/api/v1/cluster")
    cluster = snap["cluster"]
    assert (cluster["nodes"], cluster["cards"], cluster["pods"]) == (2, 3, 2)
    assert cluster["memory_mib"] == 3 * 16384
    assert (cluster["used_memory_mib"], cluster["used_cores"]) == (4096 + 2048, 35)
    assert cluster["cores"] == 300
    assert cluster["measured_memory_mib"] == 1024.0
    assert cluster["fragmentation"] == 0.12
    assert [k["fits"] for k in cluster["fits"]] == [37]
    assert snap["report_at"] == "2026-11-25T01:00:00Z"
    nodes = {n["name"]: n for n in snap["nodes"]}
    assert set(nodes) == {"gpu-1", "gpu-2"}
    gpu1 = nodes["gpu-1"]
    assert gpu1["live"] is True
    assert gpu1["rebuilt"] is True
    assert (gpu1["fragmentation"], gpu1["free_share"]) == (0.05, 1250.0)
    assert nodes["gpu-2"]["fragmentation"] is None
    card = gpu1["cards"][0]
    assert (card["uuid"], card["index"], card["memory_mib"], card["cores"]) == (
        "GPU-gpu-1-0",
        0,
        16384,
        100,
    )
    assert card["used"] == {"memory_mib": 4096, "cores": 25, "slots": 1}
    assert card["measured"] == {"memory_mib": 1024.0, "sm_percent": 12.5}
    assert card["pods"] == [
        {
            "uid": TRAIN.uid,
            "namespace": "team-a",
            "name": "train-1",
            "container": "main",
            "memory_mib": 4096,
            "cores": 25,
        }
    ]
    assert card["others"] is None
    idle = gpu1["cards"][1]
    assert idle["pods"] == []
    assert idle["measured"] == {"memory_mib": None, "sm_percent": None}


async def test_each_vendor_s_cards_show_their_vendor_model_memory_and_cores(
    console: Console, bus: Bus
) -> None:
    """NVIDIA's cards and Moore Threads' (16 cores a card) on one node, Hygon's
    alone on another, as the inventory registers them from the vendors' node
    objects: each card with its vendor, model, memory and cores, NVIDIA's
    first; the cluster's figures per vendor, whose cores add up in its units."""
    await register(console, bus, ("gpu-1", 1))
    ledger = console.state.ledger
    await ledger.register_node(
        make_vendor_inventory("gpu-1", "mthreads", "MTT S4000", memory_mib=49152, cores=16)
    )
    await ledger.register_node(
        make_vendor_inventory("dcu-1", "hygon", "DCU-Z100", cards=1, memory_mib=32768)
    )
    grant = DeviceGrant(uuid="MTHREADS-gpu-1-1", memory_mib=8192, cores=4)
    mt = Placement(
        pod=TRAIN,
        node="gpu-1",
        containers=(ContainerAssignment(name="main", vendor="mthreads", devices=(grant,)),),
    )
    await ledger.reserve(mt)

    async def shown() -> bool:
        snap = await console.json("/api/v1/cluster")
        return snap["cluster"]["cards"] == 4 and snap["cluster"]["pods"] == 1

    await until(shown, timeout=WAIT_S)
    snap = await console.json("/api/v1/cluster")
    nodes = {n["name"]: n for n in snap["nodes"]}
    cards = [
        (c["vendor"], c["index"], c["model"], c["memory_mib"], c["cores"], c["used"]["cores"])
        for c in nodes["gpu-1"]["cards"]
    ]
    assert cards == [
        ("nvidia", 0, "NVIDIA A100-SXM4-80GB", 16384, 100, 0),
        ("mthreads", 0, "MTT S4000", 49152, 16, 0),
        ("mthreads", 1, "MTT S4000", 49152, 16, 4),
    ]
    held = nodes["gpu-1"]["cards"][2]
    assert [(p["name"], p["memory_mib"], p["cores"]) for p in held["pods"]] == [
        ("train-1", 8192, 4)
    ]
    # the pod's own page: its card's vendor, and the cores granted of the card's
    doc = await console.json(f"/api/v1/pods/{TRAIN.namespace}/{TRAIN.name}")
    [container] = doc["containers"]
    [card] = container["cards"]
    assert (card["vendor"], card["model"], card["cores"], card["card_cores"]) == (
        "mthreads",
        "MTT S4000",
        4,
        16,
    )
    (dcu,) = nodes["dcu-1"]["cards"]
    assert (dcu["vendor"], dcu["model"], dcu["memory_mib"], dcu["cores"]) == (
        "hygon",
        "DCU-Z100",
        32768,
        100,
    )
    assert snap["cluster"]["vendors"] == [
        {
            "vendor": "nvidia",
            "cards": 1,
            "memory_mib": 16384,
            "used_memory_mib": 0,
            "cores": 100,
            "used_cores": 0,
        },
        {
            "vendor": "hygon",
            "cards": 1,
            "memory_mib": 32768,
            "used_memory_mib": 0,
            "cores": 100,
            "used_cores": 0,
        },
        {
            "vendor": "mthreads",
            "cards": 2,
            "memory_mib": 2 * 49152,
            "used_memory_mib": 8192,
            "cores": 32,
            "used_cores": 4,
        },
    ]


async def test_a_namespaced_viewer_sees_other_tenants_only_as_sums(
    console: Console, bus: Bus
) -> None:
    await register(console, bus, ("gpu-1", 1))
    await console.state.ledger.reserve(placed(TRAIN, "gpu-1", [(0, 4096, 25)]))
    await console.state.ledger.reserve(placed(OTHER, "gpu-1", [(0, 2048, 10)]))
    hub = console.hub

    def both() -> bool:
        return (
            len(hub.builder.document["nodes"][0]["cards"][0]["pods"]) == 2
            if hub.builder.document["nodes"]
            else False
        )

    await until(both, timeout=WAIT_S)
    team_a = {"team-a"}
    before = hub.serialisations
    bodies = {hub.cluster_bytes(Viewer(f"u{i}", frozenset()), team_a) for i in range(100)}
    assert len(bodies) == 1
    assert hub.serialisations == before + 1  # one per namespace set and version
    scoped = json.loads(hub.cluster_bytes(Viewer("alice", frozenset()), team_a))
    card = scoped["nodes"][0]["cards"][0]
    assert [p["name"] for p in card["pods"]] == ["train-1"]
    assert card["others"] == {"pods": 1, "memory_mib": 2048, "cores": 10}
    assert scoped["cluster"]["pods"] == 1
    everything = json.loads(hub.cluster_bytes(Viewer("root", None), None))
    assert len(everything["nodes"][0]["cards"][0]["pods"]) == 2  # the scoping copied


# ---------------------------------------------------------------- live updates


async def test_a_reservation_reaches_an_open_stream_without_waiting_for_the_tick(
    nats_server: NatsServer, redis_url: str, prefix: str, bus: Bus
) -> None:
    # a tick of an hour: only the ledger's change notice can bring the update
    async with start_console(nats_server, redis_url, prefix, bus, console_tick=3600) as console:
        await register(console, bus, ("gpu-1", 1))
        await until(lambda: console.hub.builder.document["cluster"]["cards"] == 1)
        async with console.client.stream("GET", "/api/v1/stream", params={"view": "cluster"}) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            events = sse_events(r)
            _, snap = await first_event(events, lambda n, d: n == "cluster")
            assert snap["cluster"]["used_memory_mib"] == 0
            await console.state.ledger.reserve(placed(TRAIN, "gpu-1", [(0, 4096, 25)]))
            _, snap = await first_event(
                events, lambda n, d: n == "cluster" and d["cluster"]["used_memory_mib"] == 4096
            )
            assert snap["nodes"][0]["cards"][0]["pods"][0]["name"] == "train-1"
        await until(lambda: len(console.hub.slots) == 0)


async def test_changes_in_quick_succession_are_read_in_few_refreshes(
    nats_server: NatsServer, redis_url: str, prefix: str, bus: Bus
) -> None:
    """A busy cluster is refreshed at most every MIN_REFRESH_S, not once per change:
    each refresh is pushed to every open page."""
    slow = {"console_tick": 3600, "heartbeat_interval": 60}
    async with start_console(nats_server, redis_url, prefix, bus, **slow) as console:
        await register(console, bus, ("gpu-1", 4))
        await until(lambda: console.hub.builder.document["cluster"]["cards"] == 4)
        hub = console.hub
        reads = hub.builder.refreshes
        started = time.monotonic()
        pods = [
            PodRef(uid=f"uid-burst-{i}", namespace="team-a", name=f"burst-{i}") for i in range(40)
        ]
        for i, pod in enumerate(pods):
            await console.state.ledger.reserve(placed(pod, "gpu-1", [(i % 4, 64, 1)]))
            await asyncio.sleep(0.005)
        await until(lambda: hub.builder.document["cluster"]["pods"] == len(pods))
        elapsed = time.monotonic() - started
        # a refresh per change would be 40; a slower machine only spaces them out more
        assert hub.builder.refreshes - reads <= elapsed / MIN_REFRESH_S + 2


async def test_a_hundred_viewers_cost_no_more_ledger_reads_than_one(
    nats_server: NatsServer, redis_url: str, prefix: str, bus: Bus
) -> None:
    # nothing changes meanwhile: no node goes silent (heartbeats of a minute)
    slow = {"console_tick": 3600, "heartbeat_interval": 60}
    async with start_console(nats_server, redis_url, prefix, bus, **slow) as console:
        await register(console, bus, ("gpu-1", 1))
        await until(lambda: console.hub.builder.document["cluster"]["cards"] == 1)
        hub = console.hub
        reads = hub.builder.refreshes
        gone = asyncio.Event()
        connected = 0

        async def view() -> int:
            nonlocal connected
            async with console.client.stream("GET", "/api/v1/stream") as r:
                _, snap = await first_event(sse_events(r), lambda n, d: n == "cluster")
                connected += 1
                await gone.wait()
                return int(snap["version"])

        viewers = [asyncio.create_task(view()) for _ in range(100)]
        await until(lambda: connected == 100, timeout=60)
        assert len(hub.slots) == 100
        assert hub.builder.refreshes == reads  # the viewers read no ledger
        gone.set()
        versions = await asyncio.gather(*viewers)
        assert len(set(versions)) == 1
        await until(lambda: len(hub.slots) == 0)  # every closed stream was let go


async def test_a_pod_stream_follows_its_story(console: Console, bus: Bus) -> None:
    await register(console, bus, ("gpu-1", 1))
    await bus.publish_acked(admitted(TRAIN))
    params = {"view": "pod", "namespace": "team-a", "name": "train-1"}
    async with console.client.stream("GET", "/api/v1/stream", params=params) as r:
        events = sse_events(r)
        _, doc = await first_event(events, lambda n, d: n == "pod")
        assert [s["type"] for s in doc["story"]] == ["admitted"]
        await console.state.ledger.reserve(placed(TRAIN, "gpu-1", [(0, 4096, 25)]))
        await bus.publish_acked(alloc_event(EventType.ALLOC_RESERVED, TRAIN, "gpu-1"))
        _, doc = await first_event(
            events, lambda n, d: n == "pod" and [s["type"] for s in d["story"]][-1] == "reserved"
        )
        assert doc["state"] == "reserved"
        assert doc["node"] == "gpu-1"
        # what the node agent did: a line of the story, not a state
        kill = EnforcementEvent(
            pod=TRAIN,
            pod_uid=TRAIN.uid,
            node="gpu-1",
            container="main",
            card="GPU-x",
            pid=42,
            reason="killed process 42 on GPU-x: the container held 3 GiB, 1 GiB allowed",
        )
        await bus.publish_acked(
            make_event(EventType.ENFORCE_MEMORY_KILL, kill, source="gpuslice/inventory")
        )
        _, doc = await first_event(
            events, lambda n, d: n == "pod" and d["story"][-1]["type"] == "memory-kill"
        )
        assert doc["story"][-1]["reason"] == kill.reason
        assert doc["state"] == "reserved"


async def test_an_audit_stream_sends_only_matching_new_events(console: Console, bus: Bus) -> None:
    params = {"view": "audit", "type": "pod.denied"}
    async with console.client.stream("GET", "/api/v1/stream", params=params) as r:
        events = sse_events(r)
        await until(lambda: len(console.hub.slots) == 1)
        await bus.publish_acked(alloc_event(EventType.ALLOC_RESERVED, TRAIN, "gpu-1"))
        await bus.publish_acked(denied("team-b", "big", "asks for 200% of cores"))
        name, event = await first_event(events, lambda n, d: True)
        assert name == "audit"
        assert event["type"] == EventType.POD_DENIED.value
        assert event["data"]["reason"] == "asks for 200% of cores"


# ---------------------------------------------------------------- audit


async def feed_holds(console: Console, count: int) -> None:
    await until(lambda: len(console.hub.feed.events) >= count, timeout=WAIT_S)


async def test_audit_filters_and_their_refusals(console: Console, bus: Bus) -> None:
    history = [
        admitted(TRAIN),
        alloc_event(EventType.ALLOC_RESERVED, TRAIN, "gpu-1"),
        alloc_event(EventType.ALLOC_BOUND, TRAIN, "gpu-1"),
        denied("team-b", "infer-1", "nvidia.com/gpucores above 100"),
        alloc_event(EventType.ALLOC_RESERVED, OTHER, "gpu-2"),
        alloc_event(EventType.ALLOC_FAILED, None, "gpu-2", reason="no pending pod"),
    ]
    for event in history:
        await bus.publish_acked(event)
    await feed_holds(console, len(history))

    async def ids(**params: str) -> list[str]:
        doc = await console.json("/api/v1/audit", **params)
        return [e["id"] for e in doc["events"]]

    every = [e.id for e in history]
    assert await ids() == every  # newest last
    assert await ids(type="pod.denied") == [history[3].id]
    assert await ids(type="alloc.reserved,alloc.bound") == [e.id for e in history[1:3]] + [
        history[4].id
    ]
    assert await ids(node="gpu-2") == [history[4].id, history[5].id]
    assert await ids(namespace="team-a") == [e.id for e in history[:3]]
    assert await ids(pod="train-1") == [e.id for e in history[:3]]
    assert await ids(pod=OTHER.uid) == [history[4].id]
    assert await ids(since="15m") == every
    future = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
    assert await ids(since=future) == []
    assert await ids(until="2000-01-01T00:00:00Z") == []
    limited = await console.json("/api/v1/audit", limit="2")
    assert [e["id"] for e in limited["events"]] == every[-2:]
    assert limited["truncated"] is True
    assert (await console.json("/api/v1/audit"))["truncated"] is False

    bad = {
        "since": ["yesterday", "2026-11-25T01:00:00", "9" * 80],
        "until": ["soon"],
        "limit": ["0", "5001", "abc", "-1", "1.5", "²"],
        "type": ["pod.bogus", "alloc.reserved,nope"],
        "node": ["gpu\n1", "x" * 300],
        "namespace": ["team\x00a"],
        "pod": ["p" * 400],
    }
    for name, values in bad.items():
        for value in values:
            answer = await console.get("/api/v1/audit", **{name: value})
            assert answer.status_code == 400, (name, value, answer.text)
            assert answer.json()["error"].startswith(f"{name}:"), answer.text
    twice = await console.client.get("/api/v1/audit?limit=1&limit=2")
    assert twice.status_code == 400
    assert twice.json()["error"].startswith("limit:")


async def test_export_streams_json_lines_from_the_stream(console: Console, bus: Bus) -> None:
    history = [
        alloc_event(EventType.ALLOC_RESERVED, TRAIN, "gpu-1"),
        alloc_event(EventType.ALLOC_BOUND, TRAIN, "gpu-1"),
        denied("team-b", "infer-1", "too much"),
    ]
    for event in history:
        await bus.publish_acked(event)
    answer = await console.get(
        "/api/v1/audit/export", since="1h", type="alloc.reserved,alloc.bound"
    )
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"] == "application/x-ndjson"
    assert answer.headers["content-disposition"] == 'attachment; filename="gpuslice-audit.jsonl"'
    lines = answer.content.splitlines()
    assert [parse_event(line).id for line in lines] == [e.id for e in history[:2]]
    assert answer.content.endswith(b"\n")
    everything = await console.get("/api/v1/audit/export", since="1h")
    assert [parse_event(line).id for line in everything.content.splitlines()] == [
        e.id for e in history
    ]
    refused = await console.get("/api/v1/audit/export", since="not a time")
    assert refused.status_code == 400
    assert refused.json()["error"].startswith("since:")


# ---------------------------------------------------------------- pods


async def test_a_pods_document_is_worked_out_again_only_when_its_story_changes(
    console: Console, bus: Bus
) -> None:
    """Pod pages on a busy cluster: other pods' events leave a pod's document as
    it was, so a hundred pages of it cost one document per change to it."""
    hub = console.hub
    await bus.publish_acked(admitted(TRAIN))
    await feed_holds(console, 1)
    first = hub.pod_bytes(TRAIN.namespace, TRAIN.name)
    assert first is not None
    built = hub.pod_builds
    neighbours = [
        PodRef(uid=f"uid-n{i}", namespace=TRAIN.namespace, name=f"n{i}") for i in range(5)
    ]
    for pod in neighbours:
        await bus.publish_acked(admitted(pod))
    await feed_holds(console, 1 + len(neighbours))
    assert hub.pod_bytes(TRAIN.namespace, TRAIN.name) == first
    assert hub.pod_builds == built
    await bus.publish_acked(alloc_event(EventType.ALLOC_FAILED, TRAIN, "gpu-1", reason="no fit"))
    await feed_holds(console, 2 + len(neighbours))
    assert hub.pod_bytes(TRAIN.namespace, TRAIN.name) != first  # its own event: a new story
    assert hub.pod_builds == built + 1


async def test_a_pods_streams_get_its_document_at_most_every_min_refresh(
    console: Console, bus: Bus
) -> None:
    """A pod re-created many times a second: its pages get a newer document once the
    last is ``min_refresh`` old, and are told when to look again."""
    hub = console.hub
    await bus.publish_acked(admitted(TRAIN))
    await feed_holds(console, 1)
    first, later = hub.pod_answer(TRAIN.namespace, TRAIN.name)
    assert first is not None
    assert later == 0
    hub.min_refresh = 3600.0
    await bus.publish_acked(alloc_event(EventType.ALLOC_FAILED, TRAIN, "gpu-1", reason="no fit"))
    await feed_holds(console, 2)
    built = hub.pod_builds
    kept, later = hub.pod_answer(TRAIN.namespace, TRAIN.name)
    assert (kept, hub.pod_builds) == (first, built)
    assert 0 < later <= 3600
    assert hub.pod_bytes(TRAIN.namespace, TRAIN.name) != first  # a GET is answered as it is now
    hub.min_refresh = 0.0
    newer, later = hub.pod_answer(TRAIN.namespace, TRAIN.name)
    assert newer != first
    assert later == 0


async def test_pod_document_with_cards_usage_and_story(console: Console, bus: Bus) -> None:
    await register(console, bus, ("gpu-1", 1))
    ledger = console.state.ledger
    await bus.publish_acked(admitted(TRAIN))
    await ledger.reserve(placed(TRAIN, "gpu-1", [(0, 4096, 25)]))
    await bus.publish_acked(alloc_event(EventType.ALLOC_RESERVED, TRAIN, "gpu-1"))
    await ledger.mark_bound(TRAIN.uid, "gpu-1")
    await bus.publish_acked(alloc_event(EventType.ALLOC_BOUND, TRAIN, "gpu-1"))
    telemetry = console.state.telemetry
    telemetry.ingest(
        bus.subjects.telemetry("gpu-1", TRAIN.uid),
        telemetry_sample("gpu-1", TRAIN.uid, 512 * MIB, 40.0, limit=4096 * MIB),
    )
    assert await telemetry.flush() == 1
    await feed_holds(console, 3)

    async def complete() -> bool:
        doc = await console.json("/api/v1/pods/team-a/train-1")
        # the feed may tell "bound" before the snapshot holds the placement
        containers = doc["containers"]
        return doc["state"] == "bound" and bool(containers) and bool(containers[0]["usage"])

    await until(complete, timeout=WAIT_S)
    doc = await console.json("/api/v1/pods/team-a/train-1")
    assert (doc["uid"], doc["node"], doc["policy"], doc["reason"]) == (
        TRAIN.uid,
        "gpu-1",
        "binpack",
        None,
    )
    [container] = doc["containers"]
    assert container["name"] == "main"
    assert container["cards"] == [
        {
            "uuid": "GPU-gpu-1-0",
            "index": 0,
            "model": "NVIDIA A100-SXM4-80GB",
            "vendor": "nvidia",
            "memory_mib": 4096,
            "cores": 25,
            "card_cores": 100,
            "mig": None,
        }
    ]
    [usage] = container["usage"]
    assert (usage["used_bytes"], usage["limit_bytes"], usage["sm_percent"]) == (
        512 * MIB,
        4096 * MIB,
        40.0,
    )
    assert usage["peak_bytes"] == 3 * 512 * MIB  # the interposer's peak, not the use now
    assert [s["type"] for s in doc["story"]] == ["admitted", "reserved", "bound"]
    assert all(s["time"].endswith("Z") for s in doc["story"])

    listed = await console.json("/api/v1/pods")
    [pod] = [p for p in listed["pods"] if p["name"] == "train-1"]
    assert (pod["state"], pod["node"], pod["uid"]) == ("bound", "gpu-1", TRAIN.uid)

    missing = await console.get("/api/v1/pods/team-a/nobody")
    assert missing.status_code == 404
    assert missing.json() == {"error": "no pod team-a/nobody is known"}


async def test_a_denied_pod_is_listed_with_its_reason(console: Console, bus: Bus) -> None:
    reason = "nvidia.com/gpumem-percentage and nvidia.com/gpumem together"
    await bus.publish_acked(admitted(PodRef(uid="x", namespace="team-b", name="infer-1")))
    await bus.publish_acked(denied("team-b", "infer-1", reason))
    await feed_holds(console, 2)
    listed = await console.json("/api/v1/pods")
    [pod] = [p for p in listed["pods"] if p["name"] == "infer-1"]
    assert pod == {
        "uid": None,
        "namespace": "team-b",
        "name": "infer-1",
        "node": None,
        "state": "denied",
        "since": pod["since"],
        "reason": reason,
    }
    doc = await console.json("/api/v1/pods/team-b/infer-1")
    assert (doc["state"], doc["reason"], doc["uid"], doc["containers"]) == (
        "denied",
        reason,
        None,
        [],
    )
    assert [s["type"] for s in doc["story"]] == ["admitted", "denied"]
    assert doc["story"][-1]["reason"] == reason


# ---------------------------------------------------------------- the page and HTTP


def raw_get(
    port: int, path: str, method: str = "GET", host: str = "127.0.0.1"
) -> tuple[int, bytes]:
    """A request with ``path`` and ``host`` exactly as given (clients would tidy them up)."""
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as sock:
        request = f"{method} {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
        sock.sendall(request.encode())
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


async def test_the_page_and_its_assets_only(console: Console) -> None:
    page = await console.get("/")
    assert page.status_code == 200
    assert b"gpuslice console" in page.content
    assert page.headers["content-type"].startswith("text/html")
    assert page.headers["cache-control"] == "no-cache"
    assert "frame-ancestors 'none'" in page.headers["content-security-policy"]
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert page.headers["x-content-type-options"] == "nosniff"
    assert page.headers["referrer-policy"] == "no-referrer"
    asset = await console.get("/static/index.html")
    assert asset.status_code == 200
    assert asset.content == page.content
    for path in (
        "/static/../service.py",
        "/static/..%2Fservice.py",
        "/static/%2e%2e%2fservice.py",
        "/static/%2e%2e/service.py",
        "/static/..%5cservice.py",
        "/static/....//service.py",
        "/static/%2Fetc%2Fpasswd",
        "/static//etc/passwd",
        "/static/__init__.py",
        "/static/",
        "/static/.",
        "/static/%00index.html",
    ):
        status, body = await asyncio.to_thread(raw_get, console.port, path)
        assert status in (400, 404), (path, status)
        assert b"import" not in body, path
        assert b"root:" not in body, path


async def test_without_authentication_only_loopback_host_names_are_answered(
    console: Console,
) -> None:
    """A page the operator opens at http://evil.example:8090/, whose name the
    attacker's DNS then rebinds to 127.0.0.1, is same-origin with what it reads:
    the console must not answer a Host that is not a loopback name."""
    port = console.port
    for host in (
        f"evil.example:{port}",
        "evil.example",
        f"127.0.0.1.nip.io:{port}",
        f"localhost.evil.example:{port}",
        f"10.0.0.5:{port}",
        "",
        f"[::2]:{port}",
        f"127.0.0.1:{port}@evil.example",
        f"localhost:{port}x",
    ):
        for path in ("/api/v1/cluster", "/api/v1/session", "/api/v1/audit", "/"):
            status, body = await asyncio.to_thread(raw_get, port, path, host=host)
            assert status == 403, (host, path, status)
            assert b"loopback" in json.loads(body)["error"].encode(), host
    refused = await console.client.get("/api/v1/session", headers={"Host": "evil.example"})
    assert refused.status_code == 403
    assert "frame-ancestors 'none'" in refused.headers["content-security-policy"]
    for host in (
        f"127.0.0.1:{port}",
        f"localhost:{port}",
        "LOCALHOST",
        f"127.0.0.2:{port}",
        f"[::1]:{port}",
        "localhost.",
    ):
        status, body = await asyncio.to_thread(raw_get, port, "/api/v1/session", host=host)
        assert status == 200, (host, status)
        assert json.loads(body)["user"] == "port-forward"


async def test_only_get_and_head_are_served(console: Console) -> None:
    for method in ("POST", "PUT", "DELETE", "PATCH", "OPTIONS"):
        for path in ("/", "/api/v1/cluster", "/api/v1/audit", "/nowhere"):
            answer = await console.client.request(method, path)
            assert answer.status_code == 405, (method, path)
            assert answer.headers["allow"] == "GET, HEAD"
            assert "read-only" in answer.json()["error"]
    head = await console.client.head("/api/v1/session")
    assert head.status_code == 200
    session = await console.json("/api/v1/session")
    assert session == {"user": "port-forward", "namespaces": None, "auth": "none"}
    nowhere = await console.get("/api/v2/anything")
    assert nowhere.status_code == 404
    assert "error" in nowhere.json()


async def test_head_on_a_stream_or_an_export_ends_at_once(console: Console, bus: Bus) -> None:
    """HEAD answers what GET would, headers only: it neither holds one of the
    few streams open nor reads the audit stream for an export nobody gets."""
    await bus.publish_acked(alloc_event(EventType.ALLOC_RESERVED, TRAIN, "gpu-1"))
    await feed_holds(console, 1)
    for path, kind in (
        ("/api/v1/stream", b"text/event-stream"),
        ("/api/v1/stream?view=audit", b"text/event-stream"),
        ("/api/v1/audit/export?since=30d", b"application/x-ndjson"),
    ):
        # the answer ends (Connection: close): a held stream would time the read out
        head, body = await asyncio.to_thread(raw_answer, console.port, path, "HEAD")
        assert head.startswith(b"HTTP/1.1 200"), (path, head)
        assert b"content-type: " + kind in head.lower(), path
        assert body == b"", path
    assert len(console.hub.slots) == 0
    bad = await console.client.head("/api/v1/stream", params={"view": "nothing"})
    assert bad.status_code == 400


def raw_answer(port: int, path: str, method: str) -> tuple[bytes, bytes]:
    """The head and body of one request on its own connection, read to its end."""
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as sock:
        request = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
        sock.sendall(request.encode())
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    return head, body


async def test_stream_parameters_are_checked(console: Console) -> None:
    for params, named in (
        ({"view": "everything"}, "view:"),
        ({"view": "pod", "name": "x"}, "namespace:"),
        ({"view": "pod", "namespace": "x"}, "name:"),
        ({"view": "audit", "limit": "0"}, "limit:"),
    ):
        answer = await console.client.get("/api/v1/stream", params=params)
        assert answer.status_code == 400, params
        assert answer.json()["error"].startswith(named)
    assert len(console.hub.slots) == 0


async def test_behind_token_review_a_tenant_sees_its_namespaces_only(
    nats_server: NatsServer, redis_url: str, prefix: str, bus: Bus, kube_api_server: FakeApiServer
) -> None:
    api = kube_api_server
    empty = {"kind": "PodList", "metadata": {"resourceVersion": "1"}, "items": []}
    api.answer(  # the pod watch and the reconciliation see no pods
        "GET", "/api/v1/pods", 200, lambda q: Stream([], hold=1) if q.get("watch") else empty
    )
    api.access.grant(user="alice")  # list pods everywhere
    api.access.grant(user="bob", namespace="team-a")
    alice = {"Authorization": f"Bearer {api.tokens.mint_user('alice')}"}
    bob = {"Authorization": f"Bearer {api.tokens.mint_user('bob')}"}
    kube = KubernetesApi.connect(api.host, token="inventory-token", timeout=5)
    port = free_port()
    settings = settings_for(
        nats_server, redis_url, prefix, console_port=port, console_auth="tokenreview"
    )
    try:
        async with (
            running(settings, bus, kube=kube) as state,
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=WAIT_S) as client,
        ):
            console = Console(state, client, port)
            await register(console, bus, ("gpu-1", 1))
            await state.ledger.reserve(placed(TRAIN, "gpu-1", [(0, 4096, 25)]))
            await state.ledger.reserve(placed(OTHER, "gpu-1", [(0, 2048, 10)]))
            for event in (
                alloc_event(EventType.ALLOC_RESERVED, TRAIN, "gpu-1"),
                alloc_event(EventType.ALLOC_RESERVED, OTHER, "gpu-1"),
                alloc_event(EventType.ALLOC_FAILED, None, "gpu-1", reason="no pending pod"),
            ):
                await bus.publish_acked(event)
            await feed_holds(console, 3)

            async def both(headers: dict[str, str]) -> Any:
                answer = await client.get("/api/v1/cluster", headers=headers)
                assert answer.status_code == 200, answer.text
                return answer.json()

            await until(lambda: _pods_on_card(both(alice), 2), timeout=WAIT_S)
            mine = (await both(bob))["nodes"][0]["cards"][0]
            assert [p["name"] for p in mine["pods"]] == ["train-1"]
            assert mine["others"] == {"pods": 1, "memory_mib": 2048, "cores": 10}
            session = (await client.get("/api/v1/session", headers=bob)).json()
            assert session == {"user": "bob", "namespaces": [], "auth": "tokenreview"}

            events = (await client.get("/api/v1/audit", headers=bob)).json()["events"]
            assert [e["data"]["pod"]["name"] for e in events] == ["train-1"]
            assert len((await client.get("/api/v1/audit", headers=alice)).json()["events"]) == 3
            pods = (await client.get("/api/v1/pods", headers=bob)).json()["pods"]
            assert {p["name"] for p in pods} == {"train-1"}
            hidden = await client.get("/api/v1/pods/team-b/other-1", headers=bob)
            assert hidden.status_code == 404
            assert hidden.json() == {"error": "no pod team-b/other-1 is known"}
            seen = await client.get("/api/v1/pods/team-b/other-1", headers=alice)
            assert seen.status_code == 200
            params = {"view": "pod", "namespace": "team-b", "name": "other-1"}
            assert (
                await client.get("/api/v1/stream", params=params, headers=bob)
            ).status_code == 404

            for path in ("/api/v1/session", "/api/v1/cluster", "/api/v1/stream", "/api/v1/audit"):
                answer = await client.get(path)
                assert answer.status_code == 401, path
                assert answer.headers["www-authenticate"] == "Bearer"
                assert "error" in answer.json()
            forged = await client.get("/api/v1/cluster", headers={"Authorization": "Bearer nope"})
            assert forged.status_code == 401
            assert (await client.get("/")).status_code == 200  # the page asks for a token
    finally:
        await kube.close()


async def _pods_on_card(snapshot: Any, count: int) -> bool:
    nodes = (await snapshot)["nodes"]
    return bool(nodes) and len(nodes[0]["cards"][0]["pods"]) == count


def test_no_authentication_only_on_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    """The refusal names the variables a user sets, not the settings' fields."""
    with pytest.raises(ValidationError, match="GPUSLICE_CONSOLE_HOST"):
        InventorySettings(console_host="0.0.0.0", console_auth="none")
    monkeypatch.setenv("GPUSLICE_CONSOLE_HOST", "10.0.0.5")
    with pytest.raises(ConfigError) as refused:
        load(InventorySettings)
    said = str(refused.value)
    assert "GPUSLICE_CONSOLE_HOST must be a loopback address, not '10.0.0.5'" in said
    assert "GPUSLICE_CONSOLE_AUTH=tokenreview" in said
    assert "console_host" not in said
    assert "console_auth" not in said
    monkeypatch.delenv("GPUSLICE_CONSOLE_HOST")
    for fine in (
        {"console_host": "0.0.0.0", "console_auth": "tokenreview"},
        {"console_host": "0.0.0.0", "console_port": 0},
        {"console_host": "127.0.0.1"},
        {"console_host": "::1"},
    ):
        InventorySettings(**fine)


async def test_an_idle_stream_gets_keepalives(console: Console) -> None:
    console.hub.keepalive = 0.05
    async with console.client.stream("GET", "/api/v1/stream") as r:

        async def keepalive() -> None:
            async for line in r.aiter_lines():
                if line == ": keepalive":
                    return

        await asyncio.wait_for(keepalive(), WAIT_S)


async def test_a_report_that_does_not_parse_is_not_shown(
    console: Console, bus: Bus, prefix: str
) -> None:
    await register(console, bus, ("gpu-1", 1))
    redis = console.state.ledger.redis
    await redis.set(f"{prefix}:report:scheduler", b'{"version": 1, "at": "never"}')
    first = console.hub.builder.full_refreshes
    # the refresh under way may have read before the set: the one after it read the value
    await until(lambda: console.hub.builder.full_refreshes > first + 1)
    snap = await console.json("/api/v1/cluster")
    assert snap["report_at"] is None
    assert snap["cluster"]["fragmentation"] is None
    assert snap["cluster"]["fits"] == []
    assert snap["nodes"][0]["fragmentation"] is None


@contextlib.asynccontextmanager
async def reviewed_console(
    nats: NatsServer, redis_url: str, prefix: str, bus: Bus, api: FakeApiServer
) -> AsyncIterator[Console]:
    """The console behind TokenReview on ``api``, whose pod watch sees no pods."""
    empty = {"kind": "PodList", "metadata": {"resourceVersion": "1"}, "items": []}
    api.answer(
        "GET", "/api/v1/pods", 200, lambda q: Stream([], hold=1) if q.get("watch") else empty
    )
    kube = KubernetesApi.connect(api.host, token="inventory-token", timeout=5)
    port = free_port()
    settings = settings_for(
        nats, redis_url, prefix, console_port=port, console_auth="tokenreview", console_tick=0.2
    )
    try:
        async with (
            running(settings, bus, kube=kube) as state,
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=WAIT_S) as client,
        ):
            yield Console(state, client, port)
    finally:
        await kube.close()


async def stream_ends(console: Console, token: str, params: dict[str, str], revoke: Any) -> str:
    """Open a stream with ``token``, call ``revoke`` once it is open, and return
    the comment the stream ended with (it must end, without the client closing it)."""
    headers = {"Authorization": f"Bearer {token}"}
    async with console.client.stream("GET", "/api/v1/stream", params=params, headers=headers) as r:
        assert r.status_code == 200
        lines = r.aiter_lines()

        async def read() -> str:
            last = ""
            async for line in lines:
                if line == ": connected":
                    revoke()
                elif line.startswith(": ") and line != ": keepalive":
                    last = line
            return last

        return await asyncio.wait_for(read(), WAIT_S)


async def test_an_open_stream_ends_once_its_token_or_grant_is_taken_back(
    nats_server: NatsServer, redis_url: str, prefix: str, bus: Bus, kube_api_server: FakeApiServer
) -> None:
    """A stream lives for hours; what the viewer may see is asked again once the
    answers kept for its token expire: a revoked token, a cluster-wide grant
    taken back, a namespace grant taken back each end the stream."""
    api = kube_api_server
    async with reviewed_console(nats_server, redis_url, prefix, bus, api) as console:
        console.hub.authenticator.cache_ttl_s = 0.2  # answers are kept this long
        await register(console, bus, ("gpu-1", 1))
        await console.state.ledger.reserve(placed(TRAIN, "gpu-1", [(0, 4096, 25)]))

        api.access.grant(user="alice")  # cluster-wide
        token = api.tokens.mint_user("alice")
        said = await stream_ends(console, token, {}, lambda: api.tokens.revoke(token))
        assert "not accepted" in said

        token = api.tokens.mint_user("alice")
        said = await stream_ends(console, token, {}, lambda: api.access.revoke(user="alice"))
        assert "access changed" in said

        api.access.grant(user="bob", namespace="team-a")
        token = api.tokens.mint_user("bob")
        pod = {"view": "pod", "namespace": "team-a", "name": "train-1"}
        said = await stream_ends(console, token, pod, lambda: api.access.revoke(user="bob"))
        assert "access changed" in said
        assert len(console.hub.slots) == 0
        # the stream was answered while the grant held
        answer = await console.client.get(
            "/api/v1/stream", params=pod, headers={"Authorization": f"Bearer {token}"}
        )
        assert answer.status_code == 404


async def test_a_ledger_that_stops_answering_is_said_not_passed_off_as_live(
    nats_server: NatsServer, own_redis: RedisServer, prefix: str, bus: Bus
) -> None:
    """Redis away: the snapshot the console still holds is shown with a problem
    saying when it was read, pushed to open streams; gone once Redis answers."""
    async with start_console(nats_server, own_redis.url, prefix, bus, console_tick=0.2) as console:
        await register(console, bus, ("gpu-1", 1))
        await until(lambda: _has_node(console.json("/api/v1/cluster")))
        assert (await console.json("/api/v1/cluster"))["problem"] is None
        async with console.client.stream("GET", "/api/v1/stream") as r:
            events = sse_events(r)
            await first_event(events, lambda name, data: name == "cluster")
            own_redis.stop()
            _, stale = await first_event(events, lambda name, data: data["problem"] is not None)
        assert "ledger cannot be read" in stale["problem"]
        assert stale["nodes"][0]["name"] == "gpu-1"  # what it had, said to be old
        snap = await console.json("/api/v1/cluster")
        assert snap["problem"] == stale["problem"]
        own_redis.start()
        await until(lambda: _problem_gone(console.json("/api/v1/cluster")), timeout=WAIT_S)


async def _has_node(snapshot: Any) -> bool:
    return bool((await snapshot)["nodes"])


async def _problem_gone(snapshot: Any) -> bool:
    return (await snapshot)["problem"] is None


async def test_one_user_cannot_take_every_stream_of_the_console(
    nats_server: NatsServer, redis_url: str, prefix: str, bus: Bus, kube_api_server: FakeApiServer
) -> None:
    """Streams are few (MAX_STREAMS a process): one tenant holding all of them
    would shut every other viewer out; each user has a share of its own."""
    api = kube_api_server
    api.access.grant(user="alice")
    api.access.grant(user="bob", namespace="team-a")
    bob = {"Authorization": f"Bearer {api.tokens.mint_user('bob')}"}
    another_bob = {"Authorization": f"Bearer {api.tokens.mint_user('bob')}"}
    alice = {"Authorization": f"Bearer {api.tokens.mint_user('alice')}"}
    async with reviewed_console(nats_server, redis_url, prefix, bus, api) as console:
        console.hub.streams_per_user = 2
        readers = []  # kept: a reader that is collected closes its stream
        async with contextlib.AsyncExitStack() as open_streams:
            for headers in (bob, another_bob):
                r = await open_streams.enter_async_context(
                    console.client.stream("GET", "/api/v1/stream", headers=headers)
                )
                assert r.status_code == 200
                readers.append(sse_events(r))
                await first_event(readers[-1], lambda name, data: name == "cluster")
            assert len(console.hub.slots) == 2
            third = await console.client.get(
                "/api/v1/stream", params={"view": "audit"}, headers=bob
            )
            assert third.status_code == 503
            assert "2 event streams of bob" in third.json()["error"]
            async with console.client.stream("GET", "/api/v1/stream", headers=alice) as r:
                assert r.status_code == 200
        await until(lambda: not console.hub.slots)
        async with console.client.stream("GET", "/api/v1/stream", headers=bob) as r:
            assert r.status_code == 200


async def test_an_audit_query_of_one_namespace_asks_only_about_it(
    nats_server: NatsServer, redis_url: str, prefix: str, bus: Bus, kube_api_server: FakeApiServer
) -> None:
    """The feed holds events of many namespaces; a namespaced viewer's query is
    one access review per namespace it asks about. A query of one namespace asks
    about that one only; any other asks about every namespace of the feed, never
    about those of the events its filters match (a slower answer would tell that
    a pod it may not see had events)."""
    api = kube_api_server
    api.access.grant(user="bob", namespace="team-a")
    bob = {"Authorization": f"Bearer {api.tokens.mint_user('bob')}"}
    async with reviewed_console(nats_server, redis_url, prefix, bus, api) as console:
        for i in range(30):
            pod = PodRef(uid=f"uid-{i}", namespace=f"team-{i}", name=f"p-{i}")
            await bus.publish_acked(alloc_event(EventType.ALLOC_RESERVED, pod, "gpu-1"))
        await bus.publish_acked(alloc_event(EventType.ALLOC_BOUND, TRAIN, "gpu-1"))
        await feed_holds(console, 31)

        def asked() -> list[str | None]:
            return [
                r.body["spec"]["resourceAttributes"].get("namespace") for r in api.access_reviews
            ]

        answer = await console.client.get(
            "/api/v1/audit", params={"namespace": "team-a"}, headers=bob
        )
        assert [e["data"]["pod"]["name"] for e in answer.json()["events"]] == ["train-1"]
        assert asked() == [None, "team-a"]
        answer = await console.client.get(
            "/api/v1/audit", params={"namespace": "team-7"}, headers=bob
        )
        assert answer.json()["events"] == []
        assert asked() == [None, "team-a", "team-7"]
        for params in ({"pod": "p-9"}, {"pod": "no-such-pod"}):
            before = len(asked())
            answer = await console.client.get("/api/v1/audit", params=params, headers=bob)
            assert answer.json()["events"] == []
            # the first asks about the feed's namespaces, the second about none: both alike
            assert set(asked()[before:]) <= {f"team-{i}" for i in range(30)}
        assert set(asked()) == {None, "team-a", *(f"team-{i}" for i in range(30))}


async def test_an_audit_feed_that_cannot_follow_the_stream_says_so(
    own_nats: NatsServer, redis_url: str, prefix: str
) -> None:
    """NATS away: the events the feed holds are still shown, with a problem
    saying that newer ones may be missing; gone once it reads the stream again."""
    bus = await Bus.connect(InventorySettings(nats_url=own_nats.url, subject_prefix=prefix), "t")
    try:
        await bus.ensure_audit_stream(timedelta(hours=1))
        async with start_console(own_nats, redis_url, prefix, bus, console_tick=0.2) as console:
            await bus.publish_acked(alloc_event(EventType.ALLOC_RESERVED, TRAIN, "gpu-1"))
            await feed_holds(console, 1)
            await until(lambda: _audit_fine(console), timeout=WAIT_S)
            own_nats.stop()
            await until(lambda: _audit_troubled(console), timeout=WAIT_S)
            answer = await console.json("/api/v1/audit")
            assert "newer events may be missing" in answer["problem"]
            assert [e["data"]["pod"]["name"] for e in answer["events"]] == ["train-1"]
            own_nats.start()
            await until(lambda: _audit_fine(console), timeout=30)
    finally:
        await bus.close()


async def _audit_fine(console: Console) -> bool:
    return (await console.json("/api/v1/audit"))["problem"] is None


async def _audit_troubled(console: Console) -> bool:
    return (await console.json("/api/v1/audit"))["problem"] is not None


async def test_a_pods_story_holds_no_event_of_another_namespace_with_its_uid(
    console: Console, bus: Bus
) -> None:
    """Events are indexed by pod uid too (to join events that carry a uid and no
    name): an event of another namespace that carries the same uid is not shown
    in this pod's story, to a viewer who may see this pod's namespace only."""
    twin = PodRef(uid=TRAIN.uid, namespace="team-b", name="other-1")
    nameless = PodRef(uid=TRAIN.uid, namespace="team-a", name="")
    for event in (
        alloc_event(EventType.ALLOC_RESERVED, TRAIN, "gpu-1"),
        alloc_event(EventType.ALLOC_FAILED, twin, "gpu-1", reason="team-b's secret"),
        alloc_event(EventType.ALLOC_BOUND, nameless, "gpu-1"),
    ):
        await bus.publish_acked(event)
    await feed_holds(console, 3)
    pod = await console.json("/api/v1/pods/team-a/train-1")
    assert [s["type"] for s in pod["story"]] == ["reserved", "bound"]
    assert all(s["reason"] is None for s in pod["story"])
    assert pod["state"] == "bound"


async def test_telemetry_no_writer_writes_neither_stops_nor_breaks_the_snapshot(
    console: Console, bus: Bus, prefix: str
) -> None:
    """Usage entries are read from Redis as untrusted: numbers beyond a counter's
    range (a 400-digit one overflowed a float and stopped the console's
    refresher for good, the snapshot frozen as if live) are left out; the
    snapshot keeps following the ledger."""
    await register(console, bus, ("gpu-1", 1))
    redis = console.state.ledger.redis
    now = int(datetime.now(UTC).timestamp() * 1000)
    usage = f"{prefix}:usage:gpu-1"
    await redis.hset(usage, "GPU-gpu-1-0|uid-x|main", f"{'9' * 400},1,1.0,1,1,{now}")
    await redis.hset(usage, "GPU-gpu-1-0|uid-y|main", f"1,1,nan,1,1,{now}")
    await redis.hset(usage, "GPU-gpu-1-0|uid-z|main", f"1,{2**64},1.0,1,1,{now}")
    await redis.hset(usage, "GPU-gpu-1-0|uid-w|main", f"{4 * MIB},{8 * MIB},12.5,0,0,{now}")
    first = console.hub.builder.full_refreshes
    await until(lambda: console.hub.builder.full_refreshes > first + 1)
    snap = await console.json("/api/v1/cluster")
    assert snap["problem"] is None
    assert snap["nodes"][0]["cards"][0]["measured"] == {"memory_mib": 4.0, "sm_percent": 12.5}
    # the refresher still runs: a new placement shows
    await console.state.ledger.reserve(placed(TRAIN, "gpu-1", [(0, 4096, 25)]))
    await until(lambda: _pods_on_card(console.json("/api/v1/cluster"), 1), timeout=WAIT_S)


async def test_a_snapshot_that_cannot_be_built_is_said_to_be_stale(
    console: Console, bus: Bus, prefix: str
) -> None:
    """Whatever the ledger holds that the snapshot cannot be built from, the
    refresher goes on and viewers are told that what they see is old."""
    await register(console, bus, ("gpu-1", 1))
    await until(lambda: _has_node(console.json("/api/v1/cluster")))
    builder = console.hub.builder
    compose = builder._content_doc

    def broken() -> Any:
        raise OverflowError("integer division result too large for a float")

    builder._content_doc = broken  # what no reader expects, wherever it comes from
    try:
        await until(lambda: _problem_seen(console.json("/api/v1/cluster")), timeout=WAIT_S)
        snap = await console.json("/api/v1/cluster")
        assert "cannot be built" in snap["problem"]
        assert snap["nodes"][0]["name"] == "gpu-1"
    finally:
        builder._content_doc = compose
    await until(lambda: _problem_gone(console.json("/api/v1/cluster")), timeout=WAIT_S)


async def _problem_seen(snapshot: Any) -> bool:
    return (await snapshot)["problem"] is not None


async def test_an_event_that_states_no_namespace_is_shown_to_cluster_wide_viewers_only(
    nats_server: NatsServer, redis_url: str, prefix: str, bus: Bus, kube_api_server: FakeApiServer
) -> None:
    """A pod reference without a namespace reads as ``default``: such an event
    (whoever wrote it) is not shown as a pod of ``default`` to who may see that
    namespace, neither in the audit view, the pods, a pod's page nor an export."""
    api = kube_api_server
    api.access.grant(user="alice")
    api.access.grant(user="bob", namespace="default")
    bob = {"Authorization": f"Bearer {api.tokens.mint_user('bob')}"}
    alice = {"Authorization": f"Bearer {api.tokens.mint_user('alice')}"}
    unstated = CloudEvent(
        specversion="1.0",
        id="no-namespace-1",
        source="/somewhere",
        type=EventType.ALLOC_FAILED,
        time=datetime.now(UTC),
        data={"pod": {"uid": "uid-sneaky", "name": "sneaky"}, "node": "gpu-1", "reason": "x"},
    )
    async with reviewed_console(nats_server, redis_url, prefix, bus, api) as console:
        await bus.publish_acked(unstated)
        await feed_holds(console, 1)
        seen = await console.client.get("/api/v1/audit", headers=alice)
        assert [e["id"] for e in seen.json()["events"]] == ["no-namespace-1"]
        assert (await console.client.get("/api/v1/audit", headers=bob)).json()["events"] == []
        pods = (await console.client.get("/api/v1/pods", headers=bob)).json()["pods"]
        assert pods == []
        page = await console.client.get("/api/v1/pods/default/sneaky", headers=bob)
        assert page.status_code == 404
        export = await console.client.get(
            "/api/v1/audit/export", params={"since": "1h"}, headers=bob
        )
        assert export.status_code == 200
        assert export.content == b""
        export = await console.client.get(
            "/api/v1/audit/export", params={"since": "1h"}, headers=alice
        )
        assert b"no-namespace-1" in export.content


async def test_stopping_ends_open_streams_as_streams_end(
    nats_server: NatsServer,
    redis_url: str,
    prefix: str,
    bus: Bus,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A viewer never hangs up: stopping the service ends its stream the way a
    stream ends (the server does not give up waiting and cut it, which the
    client reads as a broken response and the server logs as an error)."""
    starting = start_console(nats_server, redis_url, prefix, bus)
    console = await starting.__aenter__()
    stopped = False
    try:
        async with (
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{console.port}", timeout=WAIT_S) as c,
            c.stream("GET", "/api/v1/stream") as r,
        ):
            lines = r.aiter_lines()
            async for line in lines:
                if line == ": connected":
                    break
            assert console.hub.slots
            stopping = asyncio.create_task(starting.__aexit__(None, None, None))
            rest = [line async for line in lines]  # the server ends it
            await stopping
            stopped = True
    finally:
        if not stopped:
            await starting.__aexit__(None, None, None)
    assert ": connected" not in rest
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == []


async def test_each_cards_enforcement_layers_reach_the_snapshot_from_the_agents_inventory(
    console: Console, bus: Bus
) -> None:
    """The node agent's report travels over the bus into the ledger and the page;
    a node whose agent reports none shows null, and a newer report replaces it."""
    inventory = make_inventory("gpu-1", gpus=2, memory_mib=16384)
    on = LayerState.ENFORCING
    layers = {
        "GPU-gpu-1-0": CardLayers(driver=on, driver_note="dmem", agent_memory=on),
        "GPU-gpu-1-1": CardLayers(driver_note="MIG mode: the driver limits whole cards only"),
    }
    await announce(bus, inventory)
    await until(lambda: rebuilt(console.state.ledger, "gpu-1"))

    async def cards() -> list[Any]:
        snap = await console.json("/api/v1/cluster")
        return [c for n in snap["nodes"] for c in n["cards"]]

    async def listed() -> bool:
        return len(await cards()) == 2

    await until(listed, timeout=WAIT_S)
    assert [c["layers"] for c in await cards()] == [None, None]
    await announce(bus, NodeInventory.model_validate({**inventory.model_dump(), "layers": layers}))

    async def reported() -> bool:
        return all(c["layers"] is not None for c in await cards())

    await until(reported, timeout=WAIT_S)
    first, second = await cards()
    assert first["layers"] == {
        "driver": "enforcing",
        "driver_note": "dmem",
        "agent_memory": "enforcing",
        "agent_compute": "missing",
        "interposer": "enforcing",
    }
    assert second["layers"]["driver"] == "missing"
    assert second["layers"]["driver_note"] == "MIG mode: the driver limits whole cards only"
