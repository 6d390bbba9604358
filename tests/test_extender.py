"""The extender over real HTTP, with a real Redis ledger, a real NATS bus and a local API."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpuslice_common.bus import Bus
from gpuslice_common.config import SchedulerSettings, load
from gpuslice_common.events import CloudEvent, EventType
from gpuslice_common.kube import KubeError, LocalKubeApi, WatchEvent
from gpuslice_common.ledger import Ledger, NotReserved
from gpuslice_common.models import PLACEMENT_ANNOTATION, DeviceSelector, Placement, PlacementState
from gpuslice_common.servers import NatsServer, RedisServer, free_port
from gpuslice_scheduler.extender import UNKNOWN_NODE, Extender
from gpuslice_scheduler.fit import CardDemand
from gpuslice_scheduler.fragmentation import MixLearner, WorkloadClass, WorkloadMix
from gpuslice_scheduler.service import running
from gpuslice_scheduler.sim import workload_mix
from gpuslice_scheduler.via import ViaResult
from gpuslice_scheduler.view import ClusterView
from tests.conftest import make_inventory
from tests.rawhttp import post_huge


@contextlib.asynccontextmanager
async def kubelet_admitting(stack: Stack, node: str) -> AsyncIterator[None]:
    """A kubelet on ``node`` admitting each one-GPU pod bound there as it comes
    (its container allocated), so the node's bind turn passes. Stopped by an
    event, not a cancel: the Redis client may swallow a cancel amid a call."""
    stop = asyncio.Event()

    async def admit() -> None:
        while not stop.is_set():
            with contextlib.suppress(NotReserved):
                await stack.ledger.allocate(node, 1)
            await asyncio.sleep(0.01)

    admitting = asyncio.ensure_future(admit())
    try:
        yield
    finally:
        stop.set()
        await admitting


def gpu_pod(
    name: str,
    *,
    gpus: int = 1,
    mem: int | None = None,
    cores: int | None = None,
    annotations: dict[str, str] | None = None,
    uid: str | None = None,
) -> dict[str, Any]:
    limits: dict[str, Any] = {"nvidia.com/gpu": str(gpus)}
    if mem is not None:
        limits["nvidia.com/gpumem"] = str(mem)
    if cores is not None:
        limits["nvidia.com/gpucores"] = str(cores)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": "team",
            "uid": uid or f"uid-{name}",
            "annotations": annotations or {},
        },
        "spec": {"containers": [{"name": "main", "resources": {"limits": limits}}]},
    }


class FlakyKube(LocalKubeApi):
    """The local API, but Binding creation fails while ``fail_binding`` is set, or
    succeeds and loses its reply while ``lose_reply`` is set; and pod watches
    show nothing more while ``pod_events`` is clear."""

    fail_binding = False
    lose_reply = False

    def __init__(self) -> None:
        super().__init__()
        self.pod_events = asyncio.Event()
        self.pod_events.set()

    async def watch_pods(self, resource_version: str = "") -> AsyncIterator[WatchEvent]:
        async with contextlib.aclosing(super().watch_pods(resource_version)) as events:
            async for event in events:
                await self.pod_events.wait()
                yield event

    async def bind_pod(self, namespace: str, name: str, uid: str, node: str) -> None:
        if self.fail_binding:
            raise KubeError("binding refused by the test API server", status=500)
        await super().bind_pod(namespace, name, uid, node)
        if self.lose_reply:
            raise KubeError("cannot reach the Kubernetes API: read timed out")


@dataclass
class Stack:
    url: str
    http: httpx.AsyncClient
    kube: FlakyKube
    ledger: Ledger
    extender: Extender
    events: list[CloudEvent]

    async def post(self, verb: str, body: Any) -> httpx.Response:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        return await self.http.post(f"{self.url}/{verb}", content=content)

    async def add(self, pod: dict[str, Any]) -> dict[str, Any]:
        self.kube.add_pod(pod)
        return pod

    async def bind(self, pod: dict[str, Any], node: str) -> httpx.Response:
        meta = pod["metadata"]
        return await self.post(
            "bind",
            {
                "PodName": meta["name"],
                "PodNamespace": meta["namespace"],
                "PodUID": meta["uid"],
                "Node": node,
            },
        )

    async def wait_events(self, count: int) -> list[EventType]:
        for _ in range(200):
            if len(self.events) >= count:
                break
            await asyncio.sleep(0.01)
        return [e.type for e in self.events]


@pytest.fixture
async def stack(redis_url: str, nats_server: NatsServer, prefix: str) -> AsyncIterator[Stack]:
    settings = load(
        SchedulerSettings,
        redis_url=redis_url,
        nats_url=nats_server.url,
        subject_prefix=prefix,
        listen_host="127.0.0.1",
        listen_port=free_port(),
        metrics_port=free_port(),
        sync_interval="50ms",
    )
    ledger = Ledger.from_url(redis_url)
    await ledger.register_node(make_inventory("node-a", gpus=2, memory_mib=16384), rebuilt=True)
    await ledger.register_node(make_inventory("node-b", gpus=4, memory_mib=16384), rebuilt=True)
    await ledger.register_node(
        make_inventory("node-c", gpus=1, memory_mib=8192, model="Tesla T4"), rebuilt=True
    )
    bus = await Bus.connect(settings, "test")
    await bus.ensure_audit_stream(timedelta(hours=1))  # the extender's outbox waits for it
    events: list[CloudEvent] = []

    async def collect(event: CloudEvent) -> None:
        events.append(event)

    await bus.subscribe_events(bus.subjects.events_all, collect)
    kube = FlakyKube()
    async with (
        running(settings, kube, bus=bus) as (extender, _),
        httpx.AsyncClient(timeout=5) as http,
    ):
        yield Stack(
            f"http://127.0.0.1:{settings.listen_port}", http, kube, ledger, extender, events
        )
    await bus.close()
    await ledger.close()


def local_settings(redis_url: str) -> SchedulerSettings:
    """An extender on a free loopback port with the in-memory Kubernetes API."""
    return load(
        SchedulerSettings,
        redis_url=redis_url,
        listen_host="127.0.0.1",
        listen_port=free_port(),
        metrics_port=free_port(),
        sync_interval="50ms",
        kube_api="local",
    )


async def gpuslice(*argv: str) -> tuple[int, str, str]:
    """Run the gpuslice command; its exit code, stdout and stderr."""
    cli = str(Path(sys.executable).parent / "gpuslice")
    proc = await asyncio.create_subprocess_exec(
        cli, *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def args(pod: dict[str, Any], *nodes: str) -> dict[str, Any]:
    return {"Pod": pod, "NodeNames": list(nodes)}


# ---------------------------------------------------------------- filter


async def test_filter_passes_nodes_that_fit_and_gives_hami_reasons(stack: Stack) -> None:
    pod = gpu_pod("big", gpus=2, mem=12000, cores=30)
    reply = (await stack.post("filter", args(pod, "node-a", "node-b", "node-c"))).json()
    assert reply["NodeNames"] == ["node-a", "node-b"]
    assert reply["Error"] == ""
    # node-c has one 8 GiB card: no amount of preemption makes it fit, and, as HAMi
    # says it, the node has fewer cards than the container asks for.
    assert "node-c" in reply["FailedAndUnresolvableNodes"]
    assert reply["FailedAndUnresolvableNodes"]["node-c"] == (
        "NodeInsufficientDevice: container 'main' needs 2 card(s), the node has 1"
    )


async def test_filter_failure_that_preemption_could_fix_is_resolvable(stack: Stack) -> None:
    hog = await stack.add(gpu_pod("hog", gpus=1))  # a whole card
    assert (await stack.bind(hog, "node-c")).json() == {"Error": ""}
    pod = gpu_pod("small", mem=1000, cores=10)
    reply = (await stack.post("filter", args(pod, "node-c"))).json()
    assert reply["NodeNames"] == []
    # HAMi's order: the whole card's memory is taken before exclusivity is checked.
    assert "CardInsufficientMemory" in reply["FailedNodes"]["node-c"]
    assert reply["FailedAndUnresolvableNodes"] == {}


async def test_filter_reads_go_keys_in_any_case_and_node_lists(stack: Stack) -> None:
    pod = gpu_pod("t4", gpus=1, mem=1000, annotations={"nvidia.com/use-gputype": "t4"})
    nodes = {"Items": None, "items": [{"metadata": {"name": n}} for n in ("node-a", "node-c")]}
    reply = (await stack.post("filter", {"pod": pod, "nodes": nodes})).json()
    assert [i["metadata"]["name"] for i in reply["Nodes"]["items"]] == ["node-c"]
    assert reply["NodeNames"] is None
    assert "CardTypeMismatch" in reply["FailedAndUnresolvableNodes"]["node-a"]


async def test_filter_of_a_pod_without_gpus_passes_every_node(stack: Stack) -> None:
    pod = {"metadata": {"name": "cpu", "uid": "u"}, "spec": {"containers": [{"name": "c"}]}}
    reply = (await stack.post("filter", args(pod, "node-a", "elsewhere"))).json()
    assert reply["NodeNames"] == ["node-a", "elsewhere"]


async def test_filter_calls_unregistered_nodes_unresolvable(stack: Stack) -> None:
    reply = (await stack.post("filter", args(gpu_pod("p"), "node-a", "ghost"))).json()
    assert reply["NodeNames"] == ["node-a"]
    assert "no GPU of this node is registered" in reply["FailedAndUnresolvableNodes"]["ghost"]


async def test_both_node_fields_null_means_no_node_fits(stack: Stack) -> None:
    reply = (await stack.post("filter", {"Pod": gpu_pod("p")})).json()
    assert reply["NodeNames"] == []


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (b"{not json", "not valid JSON"),
        (b"[]", "must be a JSON object"),
        (b'{"NodeNames": ["a"]}', "missing Pod"),
        (b'{"Pod": 3, "NodeNames": []}', "Pod must be an object"),
        (b'{"Pod": {}, "NodeNames": "node-a"}', "list of node names"),
    ],
)
async def test_malformed_filter_requests_get_an_error_not_a_500(
    stack: Stack, body: bytes, needle: str
) -> None:
    response = await stack.post("filter", body)
    assert response.status_code == 200
    assert needle in response.json()["Error"]
    assert response.json()["NodeNames"] is None


async def test_absurd_quantities_are_an_error_naming_the_resource(stack: Stack) -> None:
    pod = gpu_pod("absurd", gpus=1, mem=10**15)
    reply = (await stack.post("filter", args(pod, "node-a"))).json()
    assert "nvidia.com/gpumem" in reply["Error"]
    assert reply["NodeNames"] is None


# ---------------------------------------------------------------- prioritize


async def test_prioritize_scores_between_0_and_10_with_the_best_at_10(stack: Stack) -> None:
    # Half of node-a's first card is in use: the fragmentation policy fills it.
    first = await stack.add(gpu_pod("first", mem=8000, cores=50))
    assert (await stack.bind(first, "node-a")).json() == {"Error": ""}
    pod = gpu_pod("second", mem=8000, cores=50)
    response = await stack.post("prioritize", args(pod, "node-a", "node-b"))
    scores = {h["Host"]: h["Score"] for h in response.json()}
    assert set(scores) == {"node-a", "node-b"}
    assert all(0 <= s <= 10 for s in scores.values())
    assert scores["node-a"] == 10
    assert scores["node-b"] < 10


async def test_the_verbs_answer_posts_and_everything_else_reaches_the_probes(
    stack: Stack,
) -> None:
    # the verbs are served in front of FastAPI: a POST is a verb's, any other
    # method on the path is FastAPI's 405, and the probes and metrics are its own
    for verb in ("filter", "prioritize", "bind", "preempt"):
        response = await stack.http.get(f"{stack.url}/{verb}")
        assert response.status_code == 405, verb
    assert (await stack.http.get(f"{stack.url}/healthz")).json() == {"status": "ok"}
    assert (await stack.http.post(f"{stack.url}/filter/x", content=b"{}")).status_code == 404
    reply = await stack.post("bind", b'{"PodName": "x"}')
    assert reply.headers["content-type"] == "application/json"
    assert reply.json()["Error"] == "bind: PodNamespace must be a non-empty string"
    metrics = (await stack.http.get(f"{stack.url}/metrics")).text
    assert 'gpuslice_scheduler_requests_total{outcome="error",verb="bind"} 1.0' in metrics


async def test_prioritize_with_a_bad_body_answers_400_with_an_error(stack: Stack) -> None:
    response = await stack.post("prioritize", b"\xff\xfe")
    assert response.status_code == 400
    assert "not valid JSON" in response.json()["Error"]


async def test_cards_of_a_deleted_pod_the_inventory_has_not_released_pass_filter_and_bind(
    stack: Stack,
) -> None:
    """kube-scheduler may retry a pod as soon as it sees another deleted, before
    the inventory has released that pod's cards: the API server's word frees them."""
    hog = await stack.add(gpu_pod("hog", gpus=1))
    assert (await stack.bind(hog, "node-c")).json() == {"Error": ""}
    await stack.ledger.allocate("node-c", 1)  # kubelet admitted it: it runs
    other = await stack.add(gpu_pod("other", gpus=1))
    assert (await stack.bind(other, "node-a")).json() == {"Error": ""}
    waiting = await stack.add(gpu_pod("waiting", mem=1000, cores=10))
    reply = (await stack.post("filter", args(waiting, "node-c"))).json()
    assert reply["NodeNames"] == []  # the hog is alive: its card stays its own
    assert (await stack.ledger.placement("uid-hog")).state is PlacementState.ALLOCATED  # type: ignore[union-attr]

    stack.kube.delete_pod("team", "hog")
    reply = (await stack.post("filter", args(waiting, "node-c"))).json()
    assert reply["NodeNames"] == ["node-c"], reply
    released = await stack.ledger.placement("uid-hog")
    assert released is not None
    assert (released.state, released.release_reason) == (PlacementState.RELEASED, "pod deleted")
    assert (await stack.ledger.placement("uid-other")).state is PlacementState.BOUND  # type: ignore[union-attr]
    types = await stack.wait_events(5)
    assert types.count(EventType.ALLOC_RELEASED) == 1
    [event] = [e for e in stack.events if e.type == EventType.ALLOC_RELEASED]
    assert event.source == "gpuslice-scheduler"

    # bind finds the same where its filter did not run: the pod's card ended
    assert (await stack.bind(waiting, "node-c")).json() == {"Error": ""}
    await stack.ledger.allocate("node-c", 1)
    stack.kube.set_phase("team", "waiting", "Succeeded")
    late = await stack.add(gpu_pod("late", gpus=1))
    assert (await stack.bind(late, "node-c")).json() == {"Error": ""}
    ended = await stack.ledger.placement("uid-waiting")
    assert ended is not None
    assert (ended.state, ended.release_reason) == (PlacementState.RELEASED, "pod succeeded")
    assert await stack.ledger.check_node("node-c") == []


async def test_with_the_in_memory_api_no_holder_is_asked_about(redis_url: str) -> None:
    """The in-memory API knows only the pods it was shown: its "not found" frees nothing."""
    ledger = Ledger.from_url(redis_url)
    try:
        view = ClusterView(ledger)
        extender = Extender(local_settings(redis_url), ledger, view, LocalKubeApi())
        assert extender.holders is None
        on = Extender(load(SchedulerSettings, redis_url=redis_url), ledger, view, LocalKubeApi())
        assert on.holders is not None
        await extender.close()
        await on.close()
    finally:
        await ledger.close()


# ---------------------------------------------------------------- bind


async def test_bind_reserves_annotates_binds_and_publishes(stack: Stack) -> None:
    pod = await stack.add(gpu_pod("web", mem=4000, cores=25))
    assert (await stack.bind(pod, "node-b")).json() == {"Error": ""}
    placed = await stack.ledger.placement("uid-web")
    assert placed is not None
    assert placed.state is PlacementState.BOUND
    assert placed.node == "node-b"
    assert placed.containers[0].devices[0].memory_mib == 4000
    stored = await stack.kube.get_pod("team", "web")
    assert stored["spec"]["nodeName"] == "node-b"
    record = Placement.from_annotation(stored["metadata"]["annotations"][PLACEMENT_ANNOTATION])
    assert record.containers == placed.containers
    assert await stack.wait_events(2) == [EventType.ALLOC_RESERVED, EventType.ALLOC_BOUND]
    assert await stack.ledger.check_node("node-b") == []


async def test_bind_is_idempotent_for_a_pod_already_bound_there(stack: Stack) -> None:
    pod = await stack.add(gpu_pod("twice", mem=4000, cores=25))
    assert (await stack.bind(pod, "node-a")).json() == {"Error": ""}
    assert (await stack.bind(pod, "node-a")).json() == {"Error": ""}
    gpus = await stack.ledger.node_gpus("node-a")
    assert sum(g.used.slots for g in gpus) == 1
    other = (await stack.bind(pod, "node-b")).json()
    assert "bound to node-a" in other["Error"]


async def test_failed_binding_releases_the_reservation(stack: Stack) -> None:
    pod = await stack.add(gpu_pod("unlucky", mem=4000, cores=25))
    stack.kube.fail_binding = True
    reply = (await stack.bind(pod, "node-a")).json()
    assert "binding refused" in reply["Error"]
    placed = await stack.ledger.placement("uid-unlucky")
    assert placed is not None
    assert placed.state is PlacementState.RELEASED
    assert all(g.used.slots == 0 for g in await stack.ledger.node_gpus("node-a"))
    assert EventType.ALLOC_FAILED in await stack.wait_events(2)
    stack.kube.fail_binding = False
    assert (await stack.bind(pod, "node-a")).json() == {"Error": ""}


async def test_bind_that_cannot_fit_is_an_error_and_an_event(stack: Stack) -> None:
    pod = await stack.add(gpu_pod("huge", gpus=3))
    reply = (await stack.bind(pod, "node-a")).json()
    assert "NodeInsufficientDevice" in reply["Error"]
    assert await stack.wait_events(1) == [EventType.ALLOC_FAILED]
    assert await stack.ledger.placement("uid-huge") is None


async def test_bind_checks_the_pod_uid_and_existence(stack: Stack) -> None:
    pod = gpu_pod("ghost")
    assert "cannot read pod team/ghost" in (await stack.bind(pod, "node-a")).json()["Error"]
    await stack.add(gpu_pod("renamed", uid="new-uid"))
    stale = gpu_pod("renamed", uid="old-uid")
    assert "has UID new-uid" in (await stack.bind(stale, "node-a")).json()["Error"]


async def test_bind_with_missing_fields_is_a_clear_error(stack: Stack) -> None:
    reply = (await stack.post("bind", {"PodName": "x", "PodNamespace": "y"})).json()
    assert reply["Error"] == "bind: PodUID must be a non-empty string"


async def test_a_node_being_rebuilt_is_filtered_out_and_a_bind_there_is_retryable(
    stack: Stack,
) -> None:
    await stack.ledger.register_node(make_inventory("node-d", gpus=1))  # not stamped yet
    pod = await stack.add(gpu_pod("early", mem=1000, cores=10))
    reply: dict[str, Any] = {}
    for _ in range(250):
        reply = (await stack.post("filter", args(pod, "node-a", "node-d"))).json()
        if "node-d" in reply["FailedNodes"]:
            break
        await asyncio.sleep(0.02)
    assert reply["NodeNames"] == ["node-a"]
    assert reply["FailedNodes"]["node-d"].startswith("NodeLedgerRebuilding")
    # kube-scheduler's copy may be older than ours: the ledger refuses anyway
    error = (await stack.bind(pod, "node-d")).json()["Error"]
    assert "the ledger of node node-d is being rebuilt" in error
    assert await stack.ledger.placement("uid-early") is None
    assert "nodeName" not in (await stack.kube.get_pod("team", "early"))["spec"]
    assert await stack.ledger.mark_rebuilt("node-d")
    for _ in range(250):
        reply = (await stack.post("filter", args(pod, "node-a", "node-d"))).json()
        if reply["NodeNames"] == ["node-a", "node-d"]:
            break
        await asyncio.sleep(0.02)
    assert reply["NodeNames"] == ["node-a", "node-d"]
    assert (await stack.bind(pod, "node-d")).json() == {"Error": ""}
    text = (await stack.http.get(f"{stack.url}/metrics")).text
    assert 'reason="NodeLedgerRebuilding",verb="bind"} 1.0' in text


async def test_concurrent_binds_never_double_allocate(stack: Stack) -> None:
    # node-c has one 8 GiB card; ten pods of 3 GiB race for it: at most two fit.
    pods = [await stack.add(gpu_pod(f"race{i}", mem=3000, cores=10)) for i in range(10)]
    async with kubelet_admitting(stack, "node-c"):
        replies = await asyncio.gather(*(stack.bind(p, "node-c") for p in pods))
    ok = [r.json()["Error"] == "" for r in replies]
    assert sum(ok) == 2
    [card] = await stack.ledger.node_gpus("node-c")
    assert card.used.memory_mib == 6000
    assert await stack.ledger.check_node("node-c") == []


# ---------------------------------------------------------------- preempt, health


async def test_preempt_answers_meta_victims(stack: Stack) -> None:
    body = {
        "Pod": gpu_pod("p"),
        "NodeNameToVictims": {
            "node-a": {"Pods": [{"metadata": {"uid": "v1"}}], "NumPDBViolations": 1}
        },
    }
    reply = (await stack.post("preempt", body)).json()
    assert reply["NodeNameToMetaVictims"] == {
        "node-a": {"Pods": [{"UID": "v1"}], "NumPDBViolations": 1}
    }
    bad = await stack.post("preempt", {"Pod": {}, "NodeNameToMetaVictims": {"n": {"Pods": [{}]}}})
    assert "has no UID" in bad.json()["Error"]


async def test_health_readiness_and_metrics(stack: Stack) -> None:
    assert (await stack.http.get(f"{stack.url}/healthz")).status_code == 200
    ready = await stack.http.get(f"{stack.url}/readyz")
    assert ready.status_code == 200
    assert ready.json()["nodes"] == 3
    await stack.post("filter", args(gpu_pod("m", gpus=3), "node-a"))
    text = (await stack.http.get(f"{stack.url}/metrics")).text
    assert 'gpuslice_scheduler_requests_total{outcome="ok",verb="filter"} 1.0' in text
    assert 'gpuslice_scheduler_failures_total{reason="NodeInsufficientDevice"' in text
    assert "gpuslice_scheduler_request_seconds_bucket" in text


@pytest.mark.parametrize("hami", [True, False])
async def test_metrics_hami_is_empty_on_both_ports_while_on_and_404_while_off(
    redis_url: str, hami: bool
) -> None:
    """HAMi's scheduler names come from the inventory: the extender has none."""
    settings = local_settings(redis_url).model_copy(update={"hami_metrics": hami})
    async with running(settings, LocalKubeApi()), httpx.AsyncClient(timeout=5) as http:
        for port in (settings.listen_port, settings.metrics_port):
            answer = await http.get(f"http://127.0.0.1:{port}/metrics/hami")
            if hami:
                assert answer.status_code == 200
                assert answer.headers["content-type"].startswith("text/plain; version=0.0.4")
                assert answer.text == ""
            else:
                assert answer.status_code == 404
                assert "GPUSLICE_HAMI_METRICS is false" in answer.json()["error"]
            plain = await http.get(f"http://127.0.0.1:{port}/metrics")
            assert "gpuslice_scheduler_known_nodes" in plain.text


async def test_new_nodes_and_usage_reach_the_copy_by_revision(stack: Stack) -> None:
    await stack.ledger.register_node(make_inventory("node-d", gpus=1), rebuilt=True)
    for _ in range(100):
        if "node-d" in stack.extender.view.cluster.node_index:
            break
        await asyncio.sleep(0.02)
    reply = (await stack.post("filter", args(gpu_pod("p"), "node-d"))).json()
    assert reply["NodeNames"] == ["node-d"]
    await stack.ledger.cordon("node-d", "GPU-node-d-0")
    for _ in range(100):
        reply = (await stack.post("filter", args(gpu_pod("p"), "node-d"))).json()
        if reply["NodeNames"] == []:
            break
        await asyncio.sleep(0.02)
    assert "CardCordoned" in reply["FailedAndUnresolvableNodes"]["node-d"]


async def corrupt(ledger: Ledger, node: str, field: str, value: str) -> None:
    """Write one card field of ``node`` by hand, as an older version or an operator
    could, and announce the change as the ledger's scripts do."""
    keys = ledger.node_keys(node)
    await ledger.redis.hset(keys.gpus, f"GPU-{node}-0|{field}", value)
    await ledger.redis.hincrby(keys.meta, "rev", 1)
    await ledger.redis.publish(ledger.changes_channel, keys.meta)


async def eventually(condition: Any, timeout: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def test_bytes_that_name_no_node_on_the_changes_channel_are_counted_in_metrics(
    stack: Stack,
) -> None:
    view = stack.extender.view
    await eventually(lambda: view.listening)
    for data in (b"\xff\xfe", b"", b"gpuslice:{Not_A_Node}:meta"):
        await stack.ledger.redis.publish(stack.ledger.changes_channel, data)
    await eventually(lambda: view.ledger.refused_notices == 3)
    text = (await stack.http.get(f"{stack.url}/metrics")).text
    assert "gpuslice_scheduler_refused_change_notices 3.0" in text
    assert view.listening


async def test_an_unreadable_node_is_skipped_named_and_the_rest_stays_in_sync(
    stack: Stack, caplog: pytest.LogCaptureFixture
) -> None:
    view = stack.extender.view
    await corrupt(stack.ledger, "node-b", "cap_mem", "1e+17")  # as registering 1e17 MiB did
    # every other node keeps syncing: one registered later is schedulable
    await stack.ledger.register_node(make_inventory("node-d", gpus=1), rebuilt=True)
    await eventually(lambda: "node-d" in view.cluster.node_index)
    reply = (await stack.post("filter", args(gpu_pod("p"), "node-d"))).json()
    assert reply["NodeNames"] == ["node-d"]
    ready = await stack.http.get(f"{stack.url}/readyz")
    assert ready.status_code == 200  # one bad node must not take the extender out
    assert ready.json()["nodes"] == 3
    assert ready.json()["skipped_count"] == 1
    assert "'1e+17', not a whole number" in ready.json()["skipped"]["node-b"]
    text = (await stack.http.get(f"{stack.url}/metrics")).text
    assert "gpuslice_scheduler_skipped_nodes 1.0" in text
    # fail closed: nothing is placed on the unreadable node
    reply = (await stack.post("filter", args(gpu_pod("p"), "node-b"))).json()
    assert reply["FailedAndUnresolvableNodes"] == {"node-b": UNKNOWN_NODE}
    # a value out of bounds, though digits, is as unreadable
    await corrupt(stack.ledger, "node-c", "cap_slots", "99999999")
    await eventually(lambda: "node-c" in view.skipped)
    assert "above its bound" in view.skipped["node-c"]
    # the node's next registration writes it afresh: back in the copy
    await stack.ledger.register_node(
        make_inventory("node-b", gpus=4, memory_mib=16384), rebuilt=True
    )
    await eventually(lambda: "node-b" in view.cluster.node_index)
    assert "node-b" not in view.skipped
    assert "Traceback" not in caplog.text
    assert not any(r.exc_info for r in caplog.records)


async def test_readyz_fails_while_redis_is_down_and_recovers(
    own_redis: RedisServer, nats_server: NatsServer
) -> None:
    settings = load(
        SchedulerSettings,
        redis_url=own_redis.url,
        nats_url=nats_server.url,
        listen_host="127.0.0.1",
        listen_port=free_port(),
        metrics_port=free_port(),
        sync_interval="50ms",
    )
    async with running(settings, LocalKubeApi()), httpx.AsyncClient(timeout=30) as http:
        url = f"http://127.0.0.1:{settings.listen_port}"
        assert (await http.get(f"{url}/readyz")).status_code == 200
        own_redis.stop()
        down = await http.get(f"{url}/readyz")
        assert down.status_code == 503
        assert down.json()["reason"] == "ledger unreachable"
        # Filter keeps answering from the copy while Redis is away.
        reply = (await http.post(f"{url}/filter", json=args(gpu_pod("p"), "x"))).json()
        assert reply["Error"] == ""
        own_redis.start()
        for _ in range(100):
            if (await http.get(f"{url}/readyz")).status_code == 200:
                break
            await asyncio.sleep(0.1)
        assert (await http.get(f"{url}/readyz")).status_code == 200


# ---------------------------------------------------------------- replay through the service


async def test_trace_replay_through_the_live_extender(redis_url: str) -> None:
    from gpuslice_scheduler.sim import PodClass, TraceNode, arrivals
    from gpuslice_scheduler.via import replay_via

    nodes = [
        TraceNode("t4-0", 16000, 65536, 2, "T4"),
        TraceNode("t4-1", 16000, 65536, 2, "T4"),
        TraceNode("g2-0", 64000, 262144, 8, "G2"),
        TraceNode("cpu-0", 8000, 32768, 0, "none"),
    ]
    pods = [
        PodClass(2000, 4096, 1, 500, ()),
        PodClass(2000, 4096, 1, 250, ()),
        PodClass(4000, 8192, 1, 1000, ()),
        PodClass(8000, 16384, 2, 1000, ("G2",)),
        PodClass(1000, 1024, 0, 0, ()),
    ]
    settings = local_settings(redis_url)
    kube = LocalKubeApi()
    async with running(settings, kube):
        result = await replay_via(
            f"http://127.0.0.1:{settings.listen_port}", redis_url, nodes, pods, sample=40
        )
    expected = len(arrivals(pods, 12_000, 1.3, 42)[:40])  # the list ends at 130 % demand
    assert result.pods == expected
    assert result.scheduled_pods + result.failed_pods == expected
    assert result.bind_errors == 0
    assert result.scheduled_pods > 10
    assert result.latency_ms["filter"]["count"] > 0
    assert result.latency_ms["bind"]["p99"] > 0
    # What the replay reports is what the ledger holds, and the ledger is consistent.
    ledger = Ledger.from_url(redis_url)
    try:
        states = await ledger.nodes_gpus(["t4-0", "t4-1", "g2-0"])
        used = sum(g.used.cores * 10 for s in states.values() for g in s)
        assert result.milli_gpu_allocation_ratio == pytest.approx(100 * used / 12000, abs=0.01)
        for node in states:
            assert await ledger.check_node(node) == []
        # Two-GPU pods asked for G2: nothing exclusive-by-two landed on a T4 node.
        bound = [p for p in kube.pods() if p["spec"].get("nodeName")]
        assert bound
        for pod in bound:
            placed = Placement.from_annotation(pod["metadata"]["annotations"][PLACEMENT_ANNOTATION])
            if len(placed.containers[0].devices) == 2:
                assert placed.node == "g2-0"
    finally:
        await ledger.close()


async def test_cpu_pods_through_the_live_extender_pack_as_the_offline_replay(
    redis_url: str,
) -> None:
    from gpuslice_scheduler.sim import PodClass, TraceNode, arrivals, replay
    from gpuslice_scheduler.via import replay_via

    # Nodes dense with GPUs have just the CPU their GPU pods need; two nodes
    # have CPU to spare. A pod without GPUs placed first-fit takes a dense
    # node's CPU and strands its cards; FGD sends it where it strands none.
    nodes = [
        TraceNode("dense-0", 32000, 262144, 8, "T4"),
        TraceNode("dense-1", 32000, 262144, 8, "T4"),
        TraceNode("cpu-0", 64000, 262144, 1, "T4"),
        TraceNode("cpu-1", 64000, 262144, 1, "T4"),
    ]
    whole = PodClass(4000, 8192, 1, 1000, ())
    pods = [PodClass(8000, 8192, 0, 0, ()), whole, whole, PodClass(4000, 8192, 1, 500, ())]
    offline = replay(nodes, pods, "fragmentation", 42)

    async def live(score: bool, cpu_pods: bool) -> ViaResult:
        ledger = f"cpu-{score}-{cpu_pods}".lower()  # each run its own empty ledger
        update = {"score_cpu_pods": score, "ledger_prefix": ledger}
        settings = local_settings(redis_url).model_copy(update=update)
        kube = LocalKubeApi()
        async with running(settings, kube) as (extender, _):
            # the replay's exact mix (the trace is shorter than a learner's batch)
            extender.learner = MixLearner(prior=workload_mix(pods))
            url = f"http://127.0.0.1:{settings.listen_port}"
            result = await replay_via(
                url, redis_url, nodes, pods, sample=1000, ledger_prefix=ledger, cpu_pods=cpu_pods
            )
        listed = {n["metadata"]["name"] for n in await kube.list_nodes()}
        assert listed == {n.name for n in nodes}  # learned from the first filter call
        return result

    scored = await live(score=True, cpu_pods=True)
    assert scored.pods == len(arrivals(pods, 18_000, 1.3, 42))
    assert scored.bind_errors == 0
    # every pod went through the extender, CPU-only ones too
    assert scored.latency_ms["bind"]["count"] == scored.scheduled_pods
    # the same cards taken as offline (which stops at 130 % arrived GPU demand,
    # before pods without GPUs that arrive after it; the live replay places them)
    assert offline.milli_gpu_allocation_ratio == pytest.approx(94.444)
    assert scored.milli_gpu_allocation_ratio == offline.milli_gpu_allocation_ratio
    # first-fit, or sent through an extender that does not score them: worse
    first_fit = await live(score=True, cpu_pods=False)
    assert first_fit.milli_gpu_allocation_ratio < offline.milli_gpu_allocation_ratio - 20
    unscored = await live(score=False, cpu_pods=True)
    assert unscored.milli_gpu_allocation_ratio < offline.milli_gpu_allocation_ratio - 20


async def test_two_replicas_placing_at_once_never_over_commit_a_card(redis_url: str) -> None:
    from gpuslice_scheduler.sim import PodClass, TraceNode, arrivals
    from gpuslice_scheduler.via import replay_via_replicas

    # few cards and many pods: the two schedulers race for the same cards
    nodes = [TraceNode(f"n{i}", 64000, 262144, 2, "T4") for i in range(3)]
    pods = [PodClass(1000, 1024, 1, 300, ()), PodClass(1000, 1024, 1, 700, ())]
    first, second = local_settings(redis_url), local_settings(redis_url)
    async with running(first, LocalKubeApi()), running(second, LocalKubeApi()):
        urls = [f"http://127.0.0.1:{s.listen_port}" for s in (first, second)]
        result = await replay_via_replicas(urls, redis_url, nodes, pods, sample=60)
    expected = len(arrivals(pods, 6000, 1.3, 42)[:60])
    assert [r.pods for r in result.replicas] == [(expected + 1) // 2, expected // 2]
    assert all(r.scheduled_pods > 0 for r in result.replicas)
    assert result.overcommitted == []
    assert 0 < result.milli_gpu_allocation_ratio <= 100
    assert result.extender_pods_per_second > 0


async def test_an_unexpected_failure_is_an_error_reply_not_a_500(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(args: object) -> object:
        raise RuntimeError("engine bug")

    monkeypatch.setattr(stack.extender, "filter", broken)
    response = await stack.post("filter", args(gpu_pod("p"), "node-a"))
    assert response.status_code == 200
    assert response.json()["Error"] == "internal error: RuntimeError"
    assert "Traceback" not in response.text
    text = (await stack.http.get(f"{stack.url}/metrics")).text
    assert 'gpuslice_scheduler_requests_total{outcome="error",verb="filter"} 1.0' in text


# ---------------------------------------------------------------- the ledger copy


async def test_ledger_announces_each_changed_node(ledger: Ledger) -> None:
    seen: list[str] = []
    ready = asyncio.Event()

    async def follow() -> None:
        async for node in ledger.watch_changes(poll=0.05, on_subscribed=ready.set):
            seen.append(node)

    task = asyncio.create_task(follow())
    try:
        await asyncio.wait_for(ready.wait(), 5)
        await ledger.register_node(make_inventory("gpu-1.example.com", gpus=1), rebuilt=True)
        await ledger.cordon("gpu-1.example.com", "GPU-gpu-1.example.com-0")
        for _ in range(100):
            if len(seen) >= 2:
                break
            await asyncio.sleep(0.02)
        assert seen == ["gpu-1.example.com", "gpu-1.example.com"]
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert ledger.node_of_meta_key(ledger.node_keys("a.b").meta) == "a.b"
    assert ledger.node_of_meta_key("other:{a}:meta") is None
    assert ledger.node_of_meta_key(f"{ledger.prefix}:{{}}:meta") is None


async def test_the_copy_follows_notices_without_waiting_for_a_poll(own_redis: RedisServer) -> None:
    ledger = Ledger.from_url(own_redis.url)
    await ledger.register_node(make_inventory("n1", gpus=1), rebuilt=True)
    view = ClusterView(ledger, interval=30.0, resync=30.0)  # polling alone would take 30 s
    await view.sync()
    task = asyncio.create_task(view.run())

    async def copy_sees(slots: int) -> bool:
        for _ in range(150):
            if int(view.cluster.used_slots.sum()) == slots:
                return True
            await asyncio.sleep(0.02)
        return False

    try:
        for _ in range(100):
            if view.listening:
                break
            await asyncio.sleep(0.02)
        assert view.listening
        card = (await ledger.node_gpus("n1"))[0].device.uuid
        await ledger.reserve(_placement("p1", "n1", card))
        assert await copy_sees(1)
        # Redis restarts: the notices come back.
        own_redis.stop()
        own_redis.start()
        await ledger.mark_rebuilt("n1")  # a restart is a new epoch: stamped again first
        await ledger.reserve(_placement("p2", "n1", card))
        assert await copy_sees(2)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await ledger.close()


async def test_the_copy_sees_every_stamp_go_stale_in_a_new_epoch(own_redis: RedisServer) -> None:
    # a restart (or a failover) keeps the revisions but not the stamps' worth:
    # the filter must fail the nodes as the scripts will, not pass them
    ledger = Ledger.from_url(own_redis.url)
    try:
        await ledger.register_node(make_inventory("n1", gpus=1), rebuilt=True)
        view = ClusterView(ledger, interval=30.0, resync=30.0)
        await view.sync()
        assert view.rebuilding == set()
        own_redis.kill()
        own_redis.start()
        await view.sync()
        assert view.rebuilding == {"n1"}
        assert await ledger.mark_rebuilt("n1")
        await view.sync()
        assert view.rebuilding == set()
    finally:
        await ledger.close()


def _placement(uid: str, node: str, card: str) -> Placement:
    from gpuslice_common.models import ContainerAssignment, DeviceGrant, PodRef

    grant = DeviceGrant(uuid=card, memory_mib=1000, cores=10)
    return Placement(
        pod=PodRef(uid=uid),
        node=node,
        containers=(ContainerAssignment(name="main", devices=(grant,)),),
    )


async def test_a_new_mix_is_warmed_before_it_serves(stack: Stack) -> None:
    pod = gpu_pod("w", mem=4000, cores=25)
    assert (await stack.post("filter", args(pod, "node-a", "node-b"))).json()["Error"] == ""
    serving = stack.extender._current
    assert serving is not None
    learner = stack.extender.learner
    learner.rebuild_every, learner.shift = 1, 0.0
    learner.observe("another-pod", CardDemand(2, -1, 100, 100, True), DeviceSelector())
    reply = (await stack.post("filter", args(pod, "node-a", "node-b"))).json()
    assert reply["NodeNames"] == ["node-a", "node-b"]
    # That call was answered by the old evaluations; the new mix replaces them once warm.
    for _ in range(200):
        if stack.extender._current is not serving:
            break
        await asyncio.sleep(0.01)
    current = stack.extender._current
    assert current is not serving
    assert current is not None
    assert current.mix is learner.mix
    assert current.entries  # the kinds seen last were evaluated with the new mix


async def test_the_warm_up_thread_yields_the_cores_to_the_verbs(stack: Stack) -> None:
    """The compiled core releases the GIL: the thread that evaluates a new mix runs
    at the lowest priority, so it takes only what the verbs leave."""

    def niceness() -> tuple[int, int]:
        return threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    loop = asyncio.get_running_loop()
    tid, nice = await loop.run_in_executor(stack.extender._warmer, niceness)
    assert tid != threading.get_native_id()
    assert nice == 19
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) < 19  # not the loop's


async def test_a_binding_whose_reply_was_lost_keeps_its_reservation(stack: Stack) -> None:
    pod = await stack.add(gpu_pod("lost", mem=4000, cores=25))
    stack.kube.lose_reply = True
    assert (await stack.bind(pod, "node-a")).json() == {"Error": ""}
    placed = await stack.ledger.placement("uid-lost")
    assert placed is not None
    assert placed.state is PlacementState.BOUND
    assert (await stack.kube.get_pod("team", "lost"))["spec"]["nodeName"] == "node-a"
    assert await stack.wait_events(2) == [EventType.ALLOC_RESERVED, EventType.ALLOC_BOUND]


async def test_a_failed_bind_does_not_release_a_reservation_it_did_not_make(
    stack: Stack,
) -> None:
    # An earlier bind of the pod reserved it; this one finds that reservation and fails.
    pod = await stack.add(gpu_pod("shared", mem=4000, cores=25))
    from gpuslice_scheduler.engine import placement

    demand = stack.extender._demand(pod)
    assert demand is not None
    ev, _ = stack.extender._evaluate(demand, ["node-a"])
    await stack.ledger.reserve(placement(stack.extender.view.cluster, demand, ev, 0))
    stack.kube.fail_binding = True
    reply = (await stack.bind(pod, "node-a")).json()
    assert "binding refused" in reply["Error"]
    placed = await stack.ledger.placement("uid-shared")
    assert placed is not None
    assert placed.state is not PlacementState.RELEASED


async def test_gpuslice_sim_via_prints_json_from_the_live_extender(
    redis_url: str, tmp_path: Path
) -> None:
    nodes = tmp_path / "nodes.csv"
    nodes.write_text("sn,cpu_milli,memory_mib,gpu,model\nv-0,32000,131072,4,T4\n")
    pods = tmp_path / "pods.csv"
    pods.write_text(
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli\n"
        "p0,1000,1024,1,500\np1,1000,1024,1,1000\np2,2000,2048,0,0\n"
    )
    settings = local_settings(redis_url)
    url = f"http://127.0.0.1:{settings.listen_port}"
    trace = ("sim", "--nodes", str(nodes), "--pods", str(pods), "--redis-url", redis_url)
    async with running(settings, LocalKubeApi()):
        code, out, err = await gpuslice(*trace, "--via", url, "--sample", "5")
    assert code == 0, err
    report = json.loads(out)
    assert report["via"] == url
    assert report["scheduled_pods"] + report["failed_pods"] == report["pods"] > 0
    assert report["latency_ms"]["bind"]["count"] >= 1
    assert 0 < report["milli_gpu_allocation_ratio"] <= 100
    # --cpu-pods: the pods without GPUs are bound through the extender too
    async with running(settings.model_copy(update={"score_cpu_pods": True}), LocalKubeApi()):
        code, out, err = await gpuslice(*trace, "--via", url, "--sample", "8", "--cpu-pods")
    assert code == 0, err
    report = json.loads(out)
    assert report["latency_ms"]["bind"]["count"] == report["scheduled_pods"] > 0
    code, _, err = await gpuslice(*trace, "--cpu-pods")
    assert code == 2
    assert "--cpu-pods needs --via" in err
    # A URL it cannot use is a one-line error, not a traceback.
    code, _, err = await gpuslice(*trace, "--via", "https://x:1")
    assert code == 2
    assert "Traceback" not in err


def memory_kib(pid: int) -> dict[str, int]:
    """VmRSS (now) and VmHWM (the peak) of a process, in KiB, from /proc."""
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {
        key: int(value.split()[0])
        for key, _, value in (line.partition(":") for line in lines)
        if key in ("VmRSS", "VmHWM")
    }


async def test_a_huge_body_gets_413_without_the_extender_holding_it(
    redis_url: str, nats_server: NatsServer, prefix: str, tmp_path: Path
) -> None:
    """A 256 MiB body, declared or chunked, is refused at the 64 MiB cap: the
    process's memory, peak included, grows by far less than the body."""
    ledger = Ledger.from_url(redis_url)
    await ledger.register_node(make_inventory("node-a", gpus=2), rebuilt=True)
    await ledger.close()
    port = free_port()
    env = {
        **os.environ,
        "GPUSLICE_REDIS_URL": redis_url,
        "GPUSLICE_NATS_URL": nats_server.url,
        "GPUSLICE_SUBJECT_PREFIX": prefix,
        "GPUSLICE_KUBE_API": "local",
        "GPUSLICE_LISTEN_HOST": "127.0.0.1",
        "GPUSLICE_LISTEN_PORT": str(port),
        "GPUSLICE_METRICS_HOST": "127.0.0.1",
        "GPUSLICE_METRICS_PORT": str(free_port()),
    }
    log = tmp_path / "extender.log"
    body = 256 * 1024 * 1024
    with log.open("wb") as out:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gpuslice_scheduler", env=env, stdout=out, stderr=out
        )
    try:
        url = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient(timeout=5) as http:
            for _ in range(300):
                with contextlib.suppress(httpx.TransportError):
                    if (await http.get(f"{url}/readyz")).status_code == 200:
                        break
                assert proc.returncode is None, log.read_text()
                await asyncio.sleep(0.05)
            for _ in range(3):  # warm up the filter path
                reply = await http.post(f"{url}/filter", json=args(gpu_pod("p"), "node-a"))
                assert reply.json()["NodeNames"] == ["node-a"]
            before = memory_kib(proc.pid)
            declared = await asyncio.to_thread(post_huge, port, "/filter", body, chunked=False)
            chunked = await asyncio.to_thread(post_huge, port, "/filter", body, chunked=True)
            assert declared[0] == 413
            assert chunked[0] == 413
            assert b"larger than 67108864 bytes" in chunked[1]
            reply = await http.post(f"{url}/filter", json=args(gpu_pod("p"), "node-a"))
            assert reply.json()["NodeNames"] == ["node-a"]  # still serving
            after = memory_kib(proc.pid)
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), 15)
    grown_peak = (after["VmHWM"] - before["VmRSS"]) * 1024
    grown = (after["VmRSS"] - before["VmRSS"]) * 1024
    print(f"RSS before {before}, after {after} (KiB): peak +{grown_peak >> 20} MiB")
    assert grown_peak < body // 2
    assert grown < body // 2
    assert "Traceback" not in log.read_text()


# ---------------------------------------------------------------- node CPU and memory


def k8s_node(name: str, cpu: str, memory: str = "64Gi") -> dict[str, Any]:
    return {
        "metadata": {"name": name},
        "status": {"allocatable": {"cpu": cpu, "memory": memory}},
    }


def asking_cpu(pod: dict[str, Any], cpu: str) -> dict[str, Any]:
    """``pod`` with its container requesting ``cpu``."""
    pod["spec"]["containers"][0]["resources"]["requests"] = {"cpu": cpu}
    return pod


def plain_pod(name: str, node: str, cpu: str) -> dict[str, Any]:
    """A pod without GPUs, bound to ``node`` by someone else (kube-scheduler)."""
    return {
        "metadata": {"name": name, "namespace": "other", "uid": f"uid-{name}"},
        "spec": {
            "nodeName": node,
            "containers": [{"name": "c", "resources": {"requests": {"cpu": cpu}}}],
        },
        "status": {"phase": "Running"},
    }


async def free_cpu(stack: Stack, node: str, milli: float) -> None:
    """Wait until the extender's follow of nodes and pods says ``node`` has ``milli`` free."""
    resources = stack.extender.view.resources
    assert resources is not None
    for _ in range(500):
        if resources.free(node)[0] == milli:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{node}: {resources.free(node)[0]} milli-CPU free, not {milli}")


async def test_a_node_short_of_cpu_fails_the_filter_and_scores_nothing(stack: Stack) -> None:
    stack.kube.add_node(k8s_node("node-a", cpu="2"))
    stack.kube.add_node(k8s_node("node-b", cpu="16"))
    stack.kube.add_pod(plain_pod("busy", "node-a", "1500m"))
    await free_cpu(stack, "node-a", 500.0)
    pod = asking_cpu(gpu_pod("wants-cpu", mem=1000, cores=10), "1")
    reply = (await stack.post("filter", args(pod, "node-a", "node-b", "node-c"))).json()
    # node-c: no Node object known, so kube-scheduler's own check decides
    assert reply["NodeNames"] == ["node-b", "node-c"]
    assert reply["FailedNodes"] == {"node-a": "node CPU or memory is short"}
    scores = (await stack.post("prioritize", args(pod, "node-a", "node-b"))).json()
    assert {s["Host"]: s["Score"] for s in scores} == {"node-a": 0, "node-b": 10}
    # the busy pod ends: the node takes the pod again
    stack.kube.set_phase("other", "busy", "Succeeded")
    await free_cpu(stack, "node-a", 2000.0)
    reply = (await stack.post("filter", args(pod, "node-a"))).json()
    assert reply["NodeNames"] == ["node-a"]


async def test_a_pod_bound_straight_there_asking_absurd_cpu_makes_the_node_full(
    stack: Stack,
) -> None:
    stack.kube.add_node(k8s_node("node-a", cpu="64"))
    stack.kube.add_node(k8s_node("node-b", cpu="64"))
    await free_cpu(stack, "node-b", 64000.0)
    # not through the extender: spec.nodeName set by its owner, a request no node has
    stack.kube.add_pod(plain_pod("hostile", "node-a", "1e40"))
    await free_cpu(stack, "node-a", 64000.0 - 10**9)  # the bound, not unknown (infinite)
    pod = asking_cpu(gpu_pod("wants-cpu", mem=1000, cores=10), "1")
    reply = (await stack.post("filter", args(pod, "node-a", "node-b"))).json()
    assert reply["NodeNames"] == ["node-b"]
    assert reply["FailedNodes"] == {"node-a": "node CPU or memory is short"}
    scores = (await stack.post("prioritize", args(pod, "node-a", "node-b"))).json()
    assert {s["Host"]: s["Score"] for s in scores} == {"node-a": 0, "node-b": 10}


async def test_a_pod_whose_cpu_cannot_be_read_fails_the_filter_naming_it(stack: Stack) -> None:
    pod = asking_cpu(gpu_pod("garbled", mem=1000, cores=10), "one")
    reply = (await stack.post("filter", args(pod, "node-a"))).json()
    assert reply["Error"].startswith("gpuslice: container 'main': cpu has an invalid value")


async def test_a_bind_counts_the_pods_cpu_at_once_and_its_watch_event_not_again(
    stack: Stack,
) -> None:
    stack.kube.add_node(k8s_node("node-a", cpu="4"))
    stack.kube.add_node(k8s_node("node-b", cpu="8"))
    await free_cpu(stack, "node-a", 4000.0)
    pod = await stack.add(asking_cpu(gpu_pod("p", mem=1000, cores=10), "1"))
    stack.kube.pod_events.clear()  # the watch shows no pod change for now
    assert (await stack.bind(pod, "node-a")).json() == {"Error": ""}
    await free_cpu(stack, "node-a", 3000.0)  # counted by the bind itself
    big = asking_cpu(gpu_pod("big", mem=1000, cores=10), "3500m")
    assert (await stack.post("filter", args(big, "node-a"))).json()["NodeNames"] == []
    stack.kube.pod_events.set()
    # a pod bound after it: once the watch shows that one, it has shown the bind too
    stack.kube.add_pod(plain_pod("later", "node-b", "1"))
    await free_cpu(stack, "node-b", 7000.0)
    await free_cpu(stack, "node-a", 3000.0)


async def test_a_failed_bind_takes_its_cpu_back(stack: Stack) -> None:
    stack.kube.add_node(k8s_node("node-a", cpu="4"))
    await free_cpu(stack, "node-a", 4000.0)
    pod = await stack.add(asking_cpu(gpu_pod("p", mem=1000, cores=10), "1"))
    stack.kube.fail_binding = True
    assert "binding refused" in (await stack.bind(pod, "node-a")).json()["Error"]
    await free_cpu(stack, "node-a", 4000.0)
    plain = await stack.add(asking_cpu(gpu_pod("plain", gpus=0), "2"))
    assert "binding refused" in (await stack.bind(plain, "node-a")).json()["Error"]
    await free_cpu(stack, "node-a", 4000.0)


async def test_without_node_resources_cpu_is_not_weighed(redis_url: str) -> None:
    settings = local_settings(redis_url).model_copy(update={"node_resources": False})
    kube = LocalKubeApi()
    kube.add_node(k8s_node("node-a", cpu="1"))
    async with running(settings, kube) as (extender, _):
        assert extender.view.resources is None
        demand = extender._demand(asking_cpu(gpu_pod("p", mem=1000, cores=10), "64"))
        assert demand is not None
        assert (demand.cpu, demand.memory) == (0.0, 0.0)


async def test_a_pods_cpu_is_weighed_once_some_node_is_known(stack: Stack) -> None:
    pod = asking_cpu(gpu_pod("p", mem=1000, cores=10), "2")
    demand = stack.extender._demand(pod)
    assert demand is not None
    assert demand.cpu == 0.0  # no node's CPU is known: pods stay one kind
    stack.kube.add_node(k8s_node("node-a", cpu="4"))
    await free_cpu(stack, "node-a", 4000.0)
    demand = stack.extender._demand(pod)
    assert demand is not None
    assert (demand.cpu, demand.memory) == (2000.0, 0.0)


# ---------------------------------------------------------------- pods without GPUs


def cpu_pod(name: str, cpu: str) -> dict[str, Any]:
    """A pod without GPUs, not bound yet, asking for ``cpu``."""
    return {
        "metadata": {"name": name, "namespace": "team", "uid": f"uid-{name}"},
        "spec": {"containers": [{"name": "c", "resources": {"requests": {"cpu": cpu}}}]},
    }


def expect_whole_cards_with_4_cpus(stack: Stack) -> None:
    """The workload the extender expects from now on: one-card pods asking 4 CPUs."""
    whole = WorkloadClass(1.0, CardDemand(1, -1, 100, 100, True), cpu=4000.0)
    stack.extender.learner = MixLearner(prior=WorkloadMix.of([whole]))
    stack.extender._current = None  # evaluated afresh with it


def score_cpu_pods(stack: Stack, on: bool = True) -> None:
    stack.extender.settings = stack.extender.settings.model_copy(update={"score_cpu_pods": on})


async def test_cpu_pods_score_where_they_strand_the_fewest_gpus(stack: Stack) -> None:
    score_cpu_pods(stack)
    expect_whole_cards_with_4_cpus(stack)
    for name, cpu in (("node-a", "8"), ("node-b", "64"), ("node-c", "8")):
        stack.kube.add_node(k8s_node(name, cpu=cpu))
        await free_cpu(stack, name, float(cpu) * 1000)
    pod = cpu_pod("web", "6")
    names = ("node-a", "node-b", "node-c", "no-gpus")
    # filter: every node passes (kube-scheduler checked CPU and memory)
    reply = (await stack.post("filter", args(pod, *names))).json()
    assert reply["NodeNames"] == list(names)
    assert reply["FailedNodes"] == {}
    assert reply["FailedAndUnresolvableNodes"] == {}
    scores = (await stack.post("prioritize", args(pod, *names))).json()
    # 6 of 8 CPUs leave node-a's 2 cards and node-c's 1 card without a pod that
    # could use them; node-b keeps 58 CPUs; a node without GPUs strands none
    assert [s["Host"] for s in scores] == list(names)
    by_node = {s["Host"]: s["Score"] for s in scores}
    assert by_node["no-gpus"] == 10
    assert by_node["no-gpus"] > by_node["node-b"] > by_node["node-c"] > by_node["node-a"]
    # off: every node alike, as before
    score_cpu_pods(stack, on=False)
    scores = (await stack.post("prioritize", args(pod, *names))).json()
    assert {s["Score"] for s in scores} == {0}


async def test_a_small_cpu_pod_strands_nothing_and_is_scored_by_the_tie_break(
    stack: Stack,
) -> None:
    score_cpu_pods(stack)
    expect_whole_cards_with_4_cpus(stack)
    for name in ("node-a", "node-b"):
        stack.kube.add_node(k8s_node(name, cpu="64"))
        await free_cpu(stack, name, 64000.0)
    scores = (await stack.post("prioritize", args(cpu_pod("tiny", "1"), "node-a", "node-b"))).json()
    # no fragmentation added anywhere: the node with the least free GPU share first
    assert {s["Host"]: s["Score"] for s in scores} == {"node-a": 10, "node-b": 9}


async def test_a_cpu_pod_is_not_scored_while_no_node_cpu_is_known(stack: Stack) -> None:
    score_cpu_pods(stack)
    assert stack.extender._demand(cpu_pod("early", "2")) is None
    scores = (await stack.post("prioritize", args(cpu_pod("early", "2"), "node-a"))).json()
    assert scores == [{"Host": "node-a", "Score": 0}]


async def test_a_cpu_pod_whose_cpu_cannot_be_read_fails_the_filter(stack: Stack) -> None:
    score_cpu_pods(stack)
    stack.kube.add_node(k8s_node("node-a", cpu="8"))
    await free_cpu(stack, "node-a", 8000.0)
    reply = (await stack.post("filter", args(cpu_pod("garbled", "lots"), "node-a"))).json()
    assert "cpu has an invalid value" in reply["Error"]


async def test_binding_a_scored_cpu_pod_counts_its_cpu_at_once(stack: Stack) -> None:
    score_cpu_pods(stack)
    stack.kube.add_node(k8s_node("node-b", cpu="16"))
    await free_cpu(stack, "node-b", 16000.0)
    pod = await stack.add(cpu_pod("web", "6"))
    stack.kube.pod_events.clear()  # the watch shows no pod change for now
    assert (await stack.bind(pod, "node-b")).json() == {"Error": ""}
    await free_cpu(stack, "node-b", 10000.0)  # counted by the bind itself
    assert ("team", "web", "node-b") in stack.kube.bindings
    assert await stack.ledger.placement("uid-web") is None  # no GPU: nothing reserved
    stack.kube.pod_events.set()


async def test_a_pod_asking_for_zero_gpus_is_a_pod_without_gpus(stack: Stack) -> None:
    policy = {"hami.io/gpu-scheduler-policy": "bogus"}  # what a GPU pod is refused for
    refused = (
        await stack.post("filter", args(gpu_pod("gpu", annotations=policy), "node-a"))
    ).json()
    assert "unknown GPU policy 'bogus'" in refused["Error"]
    score_cpu_pods(stack)
    expect_whole_cards_with_4_cpus(stack)
    for name, cpu in (("node-a", "8"), ("node-b", "64")):
        stack.kube.add_node(k8s_node(name, cpu=cpu))
        await free_cpu(stack, name, float(cpu) * 1000)
    zero = cpu_pod("zero", "6")
    zero["metadata"]["annotations"] = policy
    zero["spec"]["containers"][0]["resources"]["limits"] = {"nvidia.com/gpu": "0"}
    names = ("node-a", "node-b", "no-gpus")
    reply = (await stack.post("filter", args(zero, *names))).json()
    assert reply["Error"] == ""
    assert reply["NodeNames"] == list(names)
    # scored as the same pod without the GPU resource
    scores = (await stack.post("prioritize", args(zero, *names))).json()
    plain = (await stack.post("prioritize", args(cpu_pod("web", "6"), *names))).json()
    assert scores == plain
    assert len({s["Score"] for s in scores}) > 1
    await stack.add(zero)
    assert (await stack.bind(zero, "node-b")).json() == {"Error": ""}
    assert ("team", "zero", "node-b") in stack.kube.bindings
    assert await stack.ledger.placement("uid-zero") is None  # no GPU: nothing reserved


async def test_the_learner_counts_cpu_pods_and_cpu_requests(stack: Stack) -> None:
    score_cpu_pods(stack)
    learner = stack.extender.learner
    learner.rebuild_every, learner.shift = 1, 0.0
    stack.kube.add_node(k8s_node("node-a", cpu="64"))
    await free_cpu(stack, "node-a", 64000.0)
    await stack.post("filter", args(cpu_pod("web", "6"), "node-a"))
    gpu = asking_cpu(gpu_pod("train", mem=1000, cores=10), "2")
    await stack.post("filter", args(gpu, "node-a"))
    learned = {(c.card is None, c.cpu) for c in learner.mix.classes if c.cpu}
    assert learned == {(True, 6000.0), (False, 2000.0)}


async def test_a_filter_with_node_objects_teaches_a_local_api_its_nodes(stack: Stack) -> None:
    nodes = {"items": [k8s_node("node-a", cpu="4"), k8s_node("node-b", cpu="16")]}
    pod = asking_cpu(gpu_pod("p", mem=1000, cores=10), "8")
    reply = (await stack.post("filter", {"Pod": pod, "Nodes": nodes})).json()
    # learned before this very call was answered: the pod's CPU is weighed at once
    assert [n["metadata"]["name"] for n in reply["Nodes"]["items"]] == ["node-b"]
    assert reply["FailedNodes"] == {"node-a": "node CPU or memory is short"}
    resources = stack.extender.view.resources
    assert resources is not None
    assert resources.free("node-a") == (4000.0, 65536.0)
    listed = {n["metadata"]["name"]: n for n in await stack.kube.list_nodes()}
    assert set(listed) == {"node-a", "node-b"}
    # the same nodes again (kube-scheduler sends them with every call): nothing changes
    version = stack.kube.resource_version
    await stack.post("filter", {"Pod": pod, "Nodes": nodes})
    assert stack.kube.resource_version == version
    # a node whose allocatable changed is learned again
    grown = {"items": [k8s_node("node-a", cpu="32")]}
    reply = (await stack.post("filter", {"Pod": pod, "Nodes": grown})).json()
    assert [n["metadata"]["name"] for n in reply["Nodes"]["items"]] == ["node-a"]
    assert resources.free("node-a")[0] == 32000.0


async def test_a_cluster_api_extender_learns_no_nodes_from_requests(redis_url: str) -> None:
    settings = local_settings(redis_url)
    kube = LocalKubeApi()
    async with running(settings, kube) as (extender, _):
        extender.kube = object()  # type: ignore[assignment]  # not a LocalKubeApi
        nodes = {"items": [k8s_node("intruder", cpu="1000")]}
        body = {"Pod": gpu_pod("p"), "Nodes": nodes}
        async with httpx.AsyncClient(timeout=5) as http:
            reply = await http.post(f"http://127.0.0.1:{settings.listen_port}/filter", json=body)
        assert reply.status_code == 200
        assert await kube.list_nodes() == []
        assert extender.view.resources is not None
        assert extender.view.resources.free("intruder")[0] == float("inf")


async def test_a_device_plugin_pod_never_goes_to_a_dra_node(stack: Stack) -> None:
    # node-b's agent now serves kubelet through DRA: its cards are claims' only
    await stack.ledger.register_node(
        make_inventory("node-b", gpus=4, memory_mib=16384, dra=True), rebuilt=True
    )
    for _ in range(500):
        if "node-b" in stack.extender.view.dra:
            break
        await asyncio.sleep(0.01)
    assert stack.extender.view.dra == {"node-b"}
    pod = gpu_pod("small", mem=1000, cores=10)
    reply = (await stack.post("filter", args(pod, "node-a", "node-b", "node-c"))).json()
    assert reply["NodeNames"] == ["node-a", "node-c"]
    assert reply["FailedAndUnresolvableNodes"] == {
        "node-b": "NodeServesDra: node node-b serves GPUs through DRA (ResourceClaims)"
    }
    assert reply["FailedNodes"] == {}
    # a bind there is refused, and nothing is reserved
    pod = await stack.add(gpu_pod("direct", mem=1000, cores=10))
    bound = (await stack.bind(pod, "node-b")).json()
    assert "serves GPUs through DRA" in bound["Error"]
    assert await stack.ledger.placement("uid-direct") is None
    # back in device-plugin mode, it takes pods again
    await stack.ledger.register_node(make_inventory("node-b", gpus=4, memory_mib=16384))
    for _ in range(500):
        if not stack.extender.view.dra:
            break
        await asyncio.sleep(0.01)
    reply = (await stack.post("filter", args(gpu_pod("later"), "node-b"))).json()
    assert reply["NodeNames"] == ["node-b"]


# ---------------------------------------------------------------- DRA pods


def claiming(pod: dict[str, Any]) -> dict[str, Any]:
    """``pod`` as the webhook translates it in DRA mode: its HAMi resources kept,
    its claim ``gpuslice`` made from a template."""
    pod["spec"]["resourceClaims"] = [
        {"name": "gpuslice", "resourceClaimTemplateName": "gpuslice-0123"}
    ]
    pod["spec"]["containers"][0]["resources"]["claims"] = [{"name": "gpuslice", "request": "main"}]
    return pod


async def dra_nodes(stack: Stack, *nodes: str) -> None:
    """``nodes`` (of the fixture's) serve their GPUs through DRA from now on."""
    sizes = {"node-a": 2, "node-b": 4}
    for node in nodes:
        await stack.ledger.register_node(
            make_inventory(node, gpus=sizes[node], memory_mib=16384, dra=True), rebuilt=True
        )
    for _ in range(500):
        if stack.extender.view.dra == set(nodes):
            break
        await asyncio.sleep(0.01)
    assert stack.extender.view.dra == set(nodes)


async def test_a_dra_pod_passes_dra_nodes_whatever_the_ledger_holds(stack: Stack) -> None:
    await dra_nodes(stack, "node-a", "node-b")
    # four cards: more than node-a has, by the ledger; kube-scheduler's DRA
    # plugin is the judge of device fit, so node-a passes all the same
    pod = claiming(gpu_pod("wide", gpus=4, mem=1000))
    reply = (await stack.post("filter", args(pod, "node-a", "node-b", "node-c", "node-x"))).json()
    assert reply["Error"] == ""
    assert reply["NodeNames"] == ["node-a", "node-b"]
    assert reply["FailedNodes"] == {}
    assert reply["FailedAndUnresolvableNodes"] == {
        "node-c": "NodeServesDevicePlugin: node node-c serves GPUs through the device plugin",
        "node-x": UNKNOWN_NODE,
    }
    # a device-plugin pod as before: DRA nodes refuse it, the others take it
    plain = gpu_pod("plain", mem=1000)
    reply = (await stack.post("filter", args(plain, "node-a", "node-b", "node-c"))).json()
    assert reply["NodeNames"] == ["node-c"]
    assert set(reply["FailedAndUnresolvableNodes"]) == {"node-a", "node-b"}
    assert all(v.startswith("NodeServesDra") for v in reply["FailedAndUnresolvableNodes"].values())


async def test_a_dra_pod_is_scored_as_the_same_request_by_the_engine(stack: Stack) -> None:
    await dra_nodes(stack, "node-a", "node-b")
    small = gpu_pod("small", mem=3000, cores=20)
    plugin = (await stack.post("prioritize", args(small, "node-a", "node-b"))).json()
    dra = claiming(gpu_pod("small", mem=3000, cores=20))
    scored = (await stack.post("prioritize", args(dra, "node-a", "node-b", "node-c"))).json()
    assert scored[:2] == plugin
    assert max(s["Score"] for s in scored) == 10
    assert scored[2] == {"Host": "node-c", "Score": 0}  # not a DRA node
    # where the ledger says it does not fit (node-a has two cards), 0
    wide = claiming(gpu_pod("wide", gpus=4, mem=1000))
    scored = (await stack.post("prioritize", args(wide, "node-a", "node-b"))).json()
    assert scored == [{"Host": "node-a", "Score": 0}, {"Host": "node-b", "Score": 10}]


async def test_a_dra_pod_s_bind_is_a_binding_alone(stack: Stack) -> None:
    await dra_nodes(stack, "node-a", "node-b")
    before = await stack.ledger.revisions(["node-a", "node-b", "node-c"])
    pod = await stack.add(claiming(gpu_pod("claims", mem=4000, cores=25)))
    assert (await stack.bind(pod, "node-b")).json() == {"Error": ""}
    stored = await stack.kube.get_pod("team", "claims")
    assert stored["spec"]["nodeName"] == "node-b"
    assert PLACEMENT_ANNOTATION not in stored["metadata"]["annotations"]
    assert await stack.ledger.placement("uid-claims") is None
    assert await stack.ledger.revisions(["node-a", "node-b", "node-c"]) == before
    assert (await stack.bind(pod, "node-b")).json() == {"Error": ""}  # again: done
    assert "bound to node-b" in (await stack.bind(pod, "node-a")).json()["Error"]
    # never on a device-plugin node: refused, nothing reserved
    other = await stack.add(claiming(gpu_pod("elsewhere", mem=4000)))
    refused = (await stack.bind(other, "node-c")).json()
    assert "serves GPUs through the device plugin" in refused["Error"]
    assert "nodeName" not in (await stack.kube.get_pod("team", "elsewhere"))["spec"]
    assert await stack.ledger.placement("uid-elsewhere") is None
    assert await stack.ledger.revisions(["node-a", "node-b", "node-c"]) == before
    failed = [e for e in await stack.wait_events(1) if e == EventType.ALLOC_FAILED]
    assert failed == [EventType.ALLOC_FAILED]
    # a device-plugin pod keeps its reservation path on the device-plugin node
    plain = await stack.add(gpu_pod("plain", mem=4000))
    assert (await stack.bind(plain, "node-c")).json() == {"Error": ""}
    placed = await stack.ledger.placement("uid-plain")
    assert placed is not None
    assert placed.node == "node-c"
