"""Admission with the rest of the cluster: events on a real nats-server, namespace
labels and GPU quotas through the Kubernetes API interface (in memory, and over
HTTP against a local API server that checks the requests)."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import pytest

from gpuslice_common.bus import Bus
from gpuslice_common.events import CloudEvent, EventType, PodAdmitted, PodDenied
from gpuslice_common.kube import KubeApi, KubeError, KubernetesApi, LocalKubeApi
from gpuslice_common.models import (
    PLACEMENT_ANNOTATION,
    ContainerAssignment,
    DeviceGrant,
    Placement,
    PodRef,
)
from gpuslice_common.outbox import Outbox
from gpuslice_common.servers import NatsServer, free_port
from gpuslice_webhook.admission import SOURCE, Admission
from gpuslice_webhook.metrics import Metrics
from gpuslice_webhook.namespaces import NamespaceCache
from tests.kubeapi import FakeApiServer
from tests.webhook.conftest import (
    CORES,
    GPU,
    MEM,
    MEM_PCT,
    check_response,
    container,
    pod,
    review,
    settings,
)
from tests.webhook.test_vendors import VENDORS

NS = "team-a"


async def admit_with(
    body: dict[str, Any], kube: KubeApi | None = None, outbox: Outbox | None = None, **kw: Any
) -> dict[str, Any]:
    namespaces = NamespaceCache(kube, ttl=30) if kube is not None else None
    admission = Admission(settings(**kw), Metrics(), namespaces=namespaces, outbox=outbox)
    status, raw = await admission.handle(json.dumps(body).encode())
    assert status == 200
    return check_response(body, json.loads(raw))


def quota(name: str, **hard: str) -> dict[str, Any]:
    return {"metadata": {"name": name}, "spec": {"hard": dict(hard)}}


def running_pod(name: str, limits: dict[str, Any], phase: str = "Running") -> dict[str, Any]:
    found = pod(container("main", limits), name=name, namespace=NS)
    found["status"] = {"phase": phase}
    return found


# ---------------------------------------------------------------- events


@pytest.fixture
async def events(nats_server: NatsServer, prefix: str) -> AsyncIterator[list[CloudEvent]]:
    """Every event published under this test's prefix, as received."""
    received: list[CloudEvent] = []
    listener = await Bus.connect(settings(nats_url=nats_server.url, subject_prefix=prefix), "t")

    async def keep(event: CloudEvent) -> None:
        received.append(event)

    await listener.subscribe_events(listener.subjects.events_all, keep)
    await listener.flush()
    yield received
    await listener.close()


async def until(condition: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def test_admitted_and_denied_pods_are_published(
    nats_server: NatsServer, prefix: str, events: list[CloudEvent]
) -> None:
    config = settings(nats_url=nats_server.url, subject_prefix=prefix)
    outbox = Outbox(config, SOURCE)
    await outbox.start()
    try:
        await admit_with(review(pod(container("main", {MEM: "2000"}))), outbox=outbox)
        await admit_with(review(pod(container("main", {CORES: "101"}), name="bad")), outbox=outbox)
        await admit_with(review(pod(container("main", {GPU: 1})), dry_run=True), outbox=outbox)
        await admit_with(review(pod(container("main"))), outbox=outbox)  # no GPU: no event
        await until(lambda: len(events) >= 2)
        await asyncio.sleep(0.2)  # nothing else arrives
    finally:
        await outbox.close()
    assert [e.type for e in events] == [EventType.POD_ADMITTED, EventType.POD_DENIED]
    admitted, denied = (e.payload() for e in events)
    assert isinstance(admitted, PodAdmitted)
    assert admitted.pod == PodRef(uid=f"{NS}/trainer", namespace=NS, name="trainer")
    assert admitted.containers[0].memory.mib == 2000
    assert isinstance(denied, PodDenied)
    assert "container 'main'" in denied.reason
    assert CORES in denied.reason
    assert all(e.source == SOURCE for e in events)


async def test_admission_does_not_wait_for_a_bus_that_is_down(
    own_nats: NatsServer, prefix: str
) -> None:
    own_nats.stop()
    config = settings(nats_url=own_nats.url, subject_prefix=prefix)
    outbox = Outbox(config, SOURCE, retry_interval=0.2)
    await outbox.start()
    try:
        started = time.perf_counter()
        for i in range(20):
            body = review(pod(container("main", {MEM: "1000"}), name=f"p{i}"))
            assert (await admit_with(body, outbox=outbox))["allowed"] is True
        elapsed = time.perf_counter() - started
        assert elapsed < 1.0, f"20 admissions took {elapsed:.2f}s with NATS down"
        assert outbox.pending == 20
        own_nats.start()
        # the install step: the audit stream the outbox waits to store them in
        admin = await Bus.connect(config, "audit-init")
        try:
            await admin.ensure_audit_stream(timedelta(hours=1))
        finally:
            await admin.close()
        await until(lambda: outbox.stats.published == 20, timeout=15)
    finally:
        await outbox.close()


# ---------------------------------------------------------------- namespaces and quotas


async def test_namespace_labelled_ignore_is_left_alone() -> None:
    kube = LocalKubeApi()
    kube.add_namespace(NS, {"gpuslice.io/webhook": "ignore"})
    response = await admit_with(review(pod(container("main", {CORES: "500"}))), kube)
    assert response["allowed"] is True
    assert "patch" not in response
    kube.add_namespace("team-b", {"hami.io/webhook": "ignore"})
    response = await admit_with(review(pod(container("m", {GPU: 1})), namespace="team-b"), kube)
    assert "patch" not in response
    response = await admit_with(review(pod(container("m", {GPU: 1})), namespace="team-c"), kube)
    assert "patch" in response


async def test_memory_quota_counts_running_pods_and_placements() -> None:
    kube = LocalKubeApi()
    kube.add_resource_quota(NS, quota("gpu", **{"limits.nvidia.com/gpumem": "10000"}))
    kube.add_pod(running_pod("a", {GPU: 2, MEM: "2000"}))  # 4000
    kube.add_pod(running_pod("done", {MEM: "9000"}, phase="Succeeded"))  # ended: not counted
    kube.add_pod(
        running_pod("other-ns", {MEM: "9000"}) | {"metadata": {"name": "x", "namespace": "b"}}
    )
    placed = running_pod("placed", {GPU: 1, MEM_PCT: "50"})
    placed["metadata"]["uid"] = "u-placed"
    record = Placement(
        pod=PodRef(uid="u-placed", namespace=NS, name="placed"),
        node="n1",
        containers=(
            ContainerAssignment(
                name="main", devices=(DeviceGrant(uuid="GPU-1", memory_mib=3000, cores=0),)
            ),
        ),
    )
    placed["metadata"]["annotations"] = {PLACEMENT_ANNOTATION: record.to_annotation()}
    kube.add_pod(placed)  # a share of a card, priced by the card it got: 3000
    fits = await admit_with(review(pod(container("main", {MEM: "3000"}))), kube)
    assert fits["allowed"] is True
    over = await admit_with(review(pod(container("main", {MEM: "3001"}))), kube)
    assert over["allowed"] is False
    assert over["status"]["code"] == 403
    assert over["status"]["message"] == (
        "exceeded quota: gpu, requested: limits.nvidia.com/gpumem=3001, "
        "used: limits.nvidia.com/gpumem=7000, limited: limits.nvidia.com/gpumem=10000"
    )


async def test_memory_quota_needs_memory_in_mib() -> None:
    kube = LocalKubeApi()
    kube.add_resource_quota(NS, quota("gpu", **{"limits.nvidia.com/gpumem": "100000"}))
    for limits in ({GPU: 1}, {MEM_PCT: "50"}):
        response = await admit_with(review(pod(container("main", limits))), kube)
        assert response["allowed"] is False
        message = response["status"]["message"]
        assert "must be given in MiB with nvidia.com/gpumem" in message
        assert "container 'main'" in message


async def test_cores_quota_counts_the_pods_peak() -> None:
    kube = LocalKubeApi()
    kube.add_resource_quota(NS, quota("cores", **{"limits.nvidia.com/gpucores": "150"}))
    # the peak of init (one at a time) and apps (together): max(80, 30 + 40) = 80
    kube.add_pod(
        pod(
            container("a", {CORES: "30"}),
            container("b", {CORES: "40"}),
            init=[container("warm", {CORES: "80"})],
            name="running",
            namespace=NS,
        )
    )
    assert (await admit_with(review(pod(container("m", {CORES: "70"}))), kube))["allowed"]
    refused = await admit_with(review(pod(container("m", {GPU: 1}))), kube)  # a whole card: 100
    assert refused["allowed"] is False
    assert "requested: limits.nvidia.com/gpucores=100" in refused["status"]["message"]


async def test_a_namespace_without_gpu_quotas_lists_no_pods() -> None:
    class Counting(LocalKubeApi):
        listed = 0

        async def list_pods(self, namespace: str) -> list[dict[str, Any]]:
            Counting.listed += 1
            return await super().list_pods(namespace)

    kube = Counting()
    kube.add_resource_quota(NS, quota("cpu", **{"limits.cpu": "10"}))
    assert (await admit_with(review(pod(container("m", {GPU: 1}))), kube))["allowed"]
    assert Counting.listed == 0


# ---------------------------------------------------------------- over HTTP


NAMESPACE_PATH = f"/api/v1/namespaces/{NS}"


async def test_quota_and_labels_read_from_an_api_server(
    kube_api_server: FakeApiServer,
) -> None:
    server = kube_api_server
    server.answer("GET", NAMESPACE_PATH, 200, {"metadata": {"name": NS, "labels": {"x": "y"}}})
    server.answer(
        "GET",
        f"{NAMESPACE_PATH}/resourcequotas",
        200,
        {"items": [quota("gpu", **{"limits.nvidia.com/gpumem": "8192"})], "metadata": {}},
    )
    server.answer(
        "GET",
        f"{NAMESPACE_PATH}/pods",
        200,
        {"items": [running_pod("a", {MEM: "8000"})], "metadata": {}},
    )
    api = KubernetesApi.connect(server.host, timeout=2.0)
    admission = Admission(settings(), Metrics(), namespaces=NamespaceCache(api, ttl=30))
    answers = []
    try:
        for mib in ("192", "193"):
            body = review(pod(container("m", {MEM: mib})))
            status, raw = await admission.handle(json.dumps(body).encode())
            assert status == 200
            answers.append(check_response(body, json.loads(raw)))
    finally:
        await api.close()
    ok, refused = answers
    assert ok["allowed"] is True  # 8000 + 192 fits in 8192 MiB
    assert refused["allowed"] is False
    paths = [r.path for r in server.requests]
    assert paths.count(NAMESPACE_PATH) == 1  # the namespace and its quotas are cached
    assert sum(p.startswith(f"{NAMESPACE_PATH}/resourcequotas") for p in paths) == 1
    pod_lists = [p for p in paths if p.startswith(f"{NAMESPACE_PATH}/pods")]
    assert len(pod_lists) == 2  # usage is read fresh for every pod
    assert "fieldSelector=status.phase" in pod_lists[0]


async def test_a_hung_api_server_is_a_503_within_the_deadline(
    nats_server: NatsServer, prefix: str, events: list[CloudEvent]
) -> None:
    silent = socket.socket()  # accepts connections, never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    api = KubernetesApi.connect(f"http://127.0.0.1:{silent.getsockname()[1]}", timeout=5.0)
    config = settings(nats_url=nats_server.url, subject_prefix=prefix)
    outbox = Outbox(config, SOURCE)
    await outbox.start()
    metrics = Metrics()
    admission = Admission(
        settings(kube_timeout=0.5), metrics, namespaces=NamespaceCache(api, 30), outbox=outbox
    )
    body = review(pod(container("m", {MEM: "100"})))
    try:
        started = time.monotonic()
        status, raw = await admission.handle(json.dumps(body).encode())
        elapsed = time.monotonic() - started
        await asyncio.sleep(0.3)  # no event would have arrived by now either
    finally:
        await outbox.close()
        silent.close()
        await api.close()
    response = check_response(body, json.loads(raw))
    assert status == 200
    assert elapsed < 1.5
    assert response["status"]["code"] == 503
    assert "did not answer within 0.5s" in response["status"]["message"]
    assert metrics.admissions.labels("unavailable")._value.get() == 1
    assert metrics.admissions.labels("denied")._value.get() == 0
    assert events == []  # an outage says nothing about the pod


async def test_an_unreachable_api_server_denies_gpu_pods_with_503() -> None:
    api = KubernetesApi.connect(f"http://127.0.0.1:{free_port()}", timeout=1.0)
    try:
        refused = await admit_with(review(pod(container("m", {MEM: "100"}))), api)
        plain = await admit_with(review(pod(container("m"))), api)
    finally:
        await api.close()
    assert refused["allowed"] is False
    assert refused["status"]["code"] == 503
    assert refused["status"]["reason"] == "ServiceUnavailable"
    assert f"cannot read namespace '{NS}'" in refused["status"]["message"]
    assert plain["allowed"] is True  # pods without GPUs never need the API


async def test_a_pod_asking_for_zero_gpus_is_a_pod_without_gpus_even_with_the_api_down() -> None:
    api = KubernetesApi.connect(f"http://127.0.0.1:{free_port()}", timeout=1.0)
    zero = pod(
        container("m", {GPU: "0", "cpu": "1"}), container("n", resources={"requests": {GPU: 0}})
    )
    try:
        alone = await admit_with(review(zero), api)
        routed = await admit_with(review(zero), api, route_cpu_pods=True)
        refused = await admit_with(review(pod(container("m", {GPU: "0", MEM: "100"}))), api)
    finally:
        await api.close()
    assert alone["allowed"] is True
    assert "patch" not in alone
    assert routed["allowed"] is True  # as any pod without GPUs: unrouted, never refused
    assert "patch" not in routed
    # a count of 0 beside another GPU resource is still a GPU request (a bad one)
    assert refused["allowed"] is False
    assert refused["status"]["code"] == 503


# ---------------------------------------------------------------- the cache


async def test_namespace_cache_shares_reads_and_expires() -> None:
    now = [0.0]
    reads: list[str] = []

    class Slow(LocalKubeApi):
        async def get_namespace(self, name: str) -> dict[str, Any]:
            reads.append(name)
            await asyncio.sleep(0.05)
            return await super().get_namespace(name)

    kube = Slow()
    kube.add_namespace(NS, {"a": "1"})
    cache = NamespaceCache(kube, ttl=10, clock=lambda: now[0])
    results = await asyncio.gather(*(cache.labels(NS) for _ in range(5)))
    assert results == [{"a": "1"}] * 5
    assert reads == [NS]
    kube.add_namespace(NS, {"a": "2"})
    now[0] = 9.9
    assert await cache.labels(NS) == {"a": "1"}
    now[0] = 10.1
    assert await cache.labels(NS) == {"a": "2"}
    assert reads == [NS, NS]


async def test_a_caller_giving_up_cancels_nobody_else() -> None:
    class Slow(LocalKubeApi):
        async def get_namespace(self, name: str) -> dict[str, Any]:
            await asyncio.sleep(0.2)
            return await super().get_namespace(name)

    kube = Slow()
    kube.add_namespace(NS, {"a": "1"})
    cache = NamespaceCache(kube, ttl=10)
    impatient = asyncio.create_task(cache.labels(NS))
    await asyncio.sleep(0.05)
    patient = asyncio.create_task(cache.labels(NS))
    await asyncio.sleep(0.05)
    impatient.cancel()
    assert await patient == {"a": "1"}
    assert impatient.cancelled()


async def test_namespace_cache_does_not_keep_failures() -> None:
    calls = 0

    class Flaky(LocalKubeApi):
        async def list_resource_quotas(self, namespace: str) -> list[dict[str, Any]]:
            nonlocal calls
            calls += 1
            if calls == 1:
                raise KubeError("cannot reach the Kubernetes API")
            return await super().list_resource_quotas(namespace)

    cache = NamespaceCache(Flaky(), ttl=60)
    with pytest.raises(KubeError):
        await cache.quotas(NS)
    assert await cache.quotas(NS) == []
    assert calls == 2


async def test_a_placement_claiming_another_vendor_still_counts_an_nvidia_pod() -> None:
    # a pod's annotations are its owner's to edit: a record naming another vendor
    # must not take a pod asking for NVIDIA's cards out of NVIDIA's quotas
    kube = LocalKubeApi()
    kube.add_resource_quota(NS, quota("gpu", **{"limits.nvidia.com/gpumem": "10000"}))
    placed = running_pod("placed", {GPU: 1, MEM: "9000"})
    placed["metadata"]["uid"] = "u-placed"
    record = Placement(
        pod=PodRef(uid="u-placed", namespace=NS, name="placed"),
        node="n1",
        containers=(
            ContainerAssignment(
                name="main",
                vendor="hygon",
                devices=(DeviceGrant(uuid="GPU-1", memory_mib=9000, cores=0),),
            ),
        ),
    )
    placed["metadata"]["annotations"] = {PLACEMENT_ANNOTATION: record.to_annotation()}
    kube.add_pod(placed)
    over = await admit_with(review(pod(container("main", {MEM: "3000"}))), kube)
    assert over["allowed"] is False
    assert "used: limits.nvidia.com/gpumem=9000" in over["status"]["message"]


async def test_a_pod_asking_for_another_vendors_cards_is_not_counted() -> None:

    kube = LocalKubeApi()
    kube.add_resource_quota(NS, quota("gpu", **{"limits.nvidia.com/gpumem": "10000"}))
    kube.add_pod(running_pod("dcu", {"hygon.com/dcunum": 1, "hygon.com/dcumem": 9000}))
    fits = await admit_with(review(pod(container("main", {MEM: "3000"}))), kube, requests=VENDORS)
    assert fits["allowed"] is True
    # without the device configuration its resources are no GPU request either
    fits = await admit_with(review(pod(container("main", {MEM: "3000"}))), kube)
    assert fits["allowed"] is True
    kube.add_pod(running_pod("gpu", {GPU: 1, MEM: "8000"}))
    over = await admit_with(review(pod(container("main", {MEM: "3000"}))), kube, requests=VENDORS)
    assert over["allowed"] is False
    assert "used: limits.nvidia.com/gpumem=8000" in over["status"]["message"]


async def test_a_placement_made_for_another_pod_is_not_counted() -> None:
    # only the scheduler may change the annotation, but a pod may be created with
    # one: its UID, given by the API server, cannot be one the scheduler placed
    kube = LocalKubeApi()
    kube.add_resource_quota(NS, quota("gpu", **{"limits.nvidia.com/gpumem": "10000"}))
    pending = running_pod("pending", {GPU: 1, MEM: "9000"}, phase="Pending")
    pending["metadata"]["uid"] = "u-pending"
    record = Placement(
        pod=PodRef(uid="u-other", namespace=NS, name="pending"),
        node="n1",
        containers=(
            ContainerAssignment(
                name="main", devices=(DeviceGrant(uuid="GPU-1", memory_mib=1, cores=0),)
            ),
        ),
    )
    pending["metadata"]["annotations"] = {PLACEMENT_ANNOTATION: record.to_annotation()}
    kube.add_pod(pending)
    over = await admit_with(review(pod(container("main", {MEM: "3000"}))), kube)
    assert over["allowed"] is False
    assert "used: limits.nvidia.com/gpumem=9000" in over["status"]["message"]
