"""The Kubernetes API door: KubernetesApi against a real local HTTP server that
records every request and answers with canned JSON (tests/kubeapi.py), and
LocalKubeApi's rules."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from gpuslice_common import kube as kube_module
from gpuslice_common.kube import (
    Conflict,
    KubeApi,
    KubeError,
    KubernetesApi,
    LocalKubeApi,
    NotFound,
    PodNotFound,
    WatchEvent,
    WatchExpired,
    object_uid,
    pod_node,
    pod_phase,
    pod_terminated,
    resource_version,
)
from tests.kubeapi import FakeApiServer, Stream, WithoutWatchList, fake_api_server, status_body

POD_PATH = "/api/v1/namespaces/ns/pods/name"
NAMESPACE_PATH = "/api/v1/namespaces/team-a"
QUOTAS_PATH = "/api/v1/namespaces/team-a/resourcequotas"
PODS_PATH = "/api/v1/namespaces/team-a/pods"

POD = {
    "apiVersion": "v1",
    "kind": "Pod",
    "metadata": {
        "name": "name",
        "namespace": "ns",
        "uid": "uid-1",
        "creationTimestamp": "2024-05-01T10:00:00Z",
        "annotations": {"gpuslice.io/request": "0.5"},
        "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "rs"}],
    },
    "spec": {
        "schedulerName": "gpuslice",
        "containers": [{"name": "c", "image": "img", "imagePullPolicy": "IfNotPresent"}],
        "someFutureField": {"keptAs": "is"},
    },
    "status": {"phase": "Pending"},
}


@pytest.fixture
def server() -> Iterator[FakeApiServer]:
    with fake_api_server() as state:
        yield state


@pytest.fixture
async def api(server: FakeApiServer) -> Any:
    client = KubernetesApi.connect(server.host, timeout=2.0)
    try:
        yield client
    finally:
        await client.close()


def closed_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


# --- reading objects' fields ------------------------------------------------------


def test_the_readers_give_each_field_of_a_pod_as_the_server_sends_it() -> None:
    pod = {
        "metadata": {"uid": "u-1", "resourceVersion": "42"},
        "spec": {"nodeName": "node-a"},
        "status": {"phase": "Running"},
    }
    assert object_uid(pod) == "u-1"
    assert resource_version(pod) == "42"
    assert pod_node(pod) == "node-a"
    assert pod_phase(pod) == "Running"
    assert pod_terminated(pod) is False


@pytest.mark.parametrize(
    ("phase", "ended"),
    [
        ("Succeeded", True),
        ("Failed", True),
        ("Pending", False),
        ("Unknown", False),
        ("succeeded", False),
    ],
)
def test_a_pod_has_terminated_only_in_phase_succeeded_or_failed(phase: str, ended: bool) -> None:
    assert pod_terminated({"status": {"phase": phase}}) is ended


@pytest.mark.parametrize(
    "pod",
    [
        {},
        {"metadata": None, "spec": None, "status": None},
        {"metadata": [], "spec": "x", "status": 1},
        {
            "metadata": {"uid": 7, "resourceVersion": None},
            "spec": {"nodeName": ["a"]},
            "status": {"phase": {"p": 1}},
        },
    ],
    ids=["missing", "null", "not-objects", "not-strings"],
)
def test_a_field_missing_or_of_another_type_reads_as_empty(pod: dict[str, Any]) -> None:
    assert object_uid(pod) == resource_version(pod) == pod_node(pod) == pod_phase(pod) == ""
    assert pod_terminated(pod) is False


# --- KubernetesApi: reading pods ---------------------------------------------------


async def test_get_pod_returns_server_json_with_camel_case_keys(
    server: FakeApiServer, api: KubernetesApi
) -> None:
    server.answer("GET", POD_PATH, 200, POD)
    pod = await api.get_pod("ns", "name")
    assert pod == POD
    assert pod["metadata"]["creationTimestamp"] == "2024-05-01T10:00:00Z"
    assert pod["spec"]["schedulerName"] == "gpuslice"
    assert [(r.method, r.path.split("?")[0]) for r in server.requests] == [("GET", POD_PATH)]
    assert "authorization" not in server.requests[0].headers


async def test_get_missing_pod_raises_pod_not_found_with_server_message(
    server: FakeApiServer, api: KubernetesApi
) -> None:
    server.answer("GET", POD_PATH, 404, status_body(404, "NotFound", 'pods "name" not found'))
    with pytest.raises(PodNotFound) as caught:
        await api.get_pod("ns", "name")
    assert caught.value.status == 404
    assert 'pods "name" not found' in str(caught.value)
    assert "ns/name" in str(caught.value)


async def test_server_error_is_kube_error_with_status_and_message(
    server: FakeApiServer, api: KubernetesApi
) -> None:
    server.answer(
        "GET", POD_PATH, 500, status_body(500, "InternalError", "etcdserver: request timed out")
    )
    with pytest.raises(KubeError) as caught:
        await api.get_pod("ns", "name")
    assert type(caught.value) is KubeError
    assert caught.value.status == 500
    message = str(caught.value)
    assert "500" in message
    assert "etcdserver: request timed out" in message
    assert "Traceback" not in message
    assert "\n" not in message


async def test_non_json_error_body_is_quoted_on_one_line(
    server: FakeApiServer, api: KubernetesApi
) -> None:
    server.answer("GET", POD_PATH, 503, "proxy says\nno")
    with pytest.raises(KubeError) as caught:
        await api.get_pod("ns", "name")
    assert caught.value.status == 503
    assert "\n" not in str(caught.value)


# --- KubernetesApi: annotations and binding -----------------------------------------


async def test_patch_annotations_sends_merge_patch_of_exactly_the_annotations(
    server: FakeApiServer, api: KubernetesApi
) -> None:
    server.answer("PATCH", POD_PATH, 200, POD)
    await api.patch_pod_annotations(
        "ns", "name", {"gpuslice.io/gpu": "GPU-1", "gpuslice.io/stale": None}
    )
    [request] = server.requests
    assert request.method == "PATCH"
    assert request.path.split("?")[0] == POD_PATH
    assert request.headers["content-type"] == "application/merge-patch+json"
    assert request.body == {
        "metadata": {"annotations": {"gpuslice.io/gpu": "GPU-1", "gpuslice.io/stale": None}}
    }


async def test_patch_missing_pod_raises_pod_not_found(
    server: FakeApiServer, api: KubernetesApi
) -> None:
    with pytest.raises(PodNotFound):
        await api.patch_pod_annotations("ns", "name", {"a": "b"})
    assert server.requests[0].method == "PATCH"


async def test_bind_posts_a_binding_naming_pod_uid_and_node(
    server: FakeApiServer, api: KubernetesApi
) -> None:
    # A real API server answers 201 with a Status (no ``target``), which some
    # client versions cannot deserialise as a Binding.
    server.answer("POST", POD_PATH + "/binding", 201, {"kind": "Status", "status": "Success"})
    await api.bind_pod("ns", "name", "uid-1", "node-a")
    [request] = server.requests
    assert request.method == "POST"
    assert request.path.split("?")[0] == POD_PATH + "/binding"
    assert request.headers["content-type"] == "application/json"
    body = request.body
    assert body["apiVersion"] == "v1"
    assert body["kind"] == "Binding"
    assert body["metadata"]["name"] == "name"
    assert body["metadata"]["uid"] == "uid-1"
    assert body["target"] == {"apiVersion": "v1", "kind": "Node", "name": "node-a"}


async def test_bind_conflict_raises_conflict(server: FakeApiServer, api: KubernetesApi) -> None:
    server.answer(
        "POST",
        POD_PATH + "/binding",
        409,
        status_body(409, "Conflict", 'Operation cannot be fulfilled on pods/binding "name"'),
    )
    with pytest.raises(Conflict) as caught:
        await api.bind_pod("ns", "name", "uid-1", "node-a")
    assert caught.value.status == 409
    assert "Operation cannot be fulfilled" in str(caught.value)
    assert "node-a" in str(caught.value)


# --- KubernetesApi: namespaces, quotas, pod lists -----------------------------------

NAMESPACE = {
    "apiVersion": "v1",
    "kind": "Namespace",
    "metadata": {
        "name": "team-a",
        "labels": {"gpuslice.io/enabled": "true"},
        "creationTimestamp": "2024-05-01T10:00:00Z",
    },
    "spec": {"finalizers": ["kubernetes"]},
    "status": {"phase": "Active"},
}


def quota(name: str, hard: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "metadata": {"name": name, "namespace": "team-a"},
        "spec": {"hard": hard},
        "status": {"hard": hard, "used": {}},
    }


def a_list(kind: str, items: list[Any], token: str = "") -> dict[str, Any]:
    metadata = {"resourceVersion": "42"} | ({"continue": token} if token else {})
    return {"apiVersion": "v1", "kind": kind, "metadata": metadata, "items": items}


def pod_named(name: str, phase: str = "Running", namespace: str = "team-a") -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": namespace}, "status": {"phase": phase}}


def node_named(name: str, cpu: str = "8", memory: str = "32Gi") -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name},
        "status": {"allocatable": {"cpu": cpu, "memory": memory}},
    }


NODE = node_named("gpu-1")


async def test_get_namespace_returns_server_json(server: FakeApiServer, api: KubernetesApi) -> None:
    server.answer("GET", NAMESPACE_PATH, 200, NAMESPACE)
    assert await api.get_namespace("team-a") == NAMESPACE
    assert [(r.method, r.path.split("?")[0]) for r in server.requests] == [("GET", NAMESPACE_PATH)]


async def test_get_missing_namespace_raises_not_found_naming_it(
    server: FakeApiServer, api: KubernetesApi
) -> None:
    server.answer(
        "GET", NAMESPACE_PATH, 404, status_body(404, "NotFound", 'namespaces "team-a" not found')
    )
    with pytest.raises(NotFound) as caught:
        await api.get_namespace("team-a")
    assert isinstance(caught.value, KubeError)
    assert not isinstance(caught.value, PodNotFound)
    assert caught.value.status == 404
    assert str(caught.value) == 'namespace team-a not found: namespaces "team-a" not found'


async def test_namespace_forbidden_is_kube_error_with_server_message(
    server: FakeApiServer, api: KubernetesApi
) -> None:
    denied = 'namespaces "team-a" is forbidden: User "system:serviceaccount:x:y" cannot get'
    server.answer("GET", NAMESPACE_PATH, 403, status_body(403, "Forbidden", denied))
    with pytest.raises(KubeError) as caught:
        await api.get_namespace("team-a")
    assert type(caught.value) is KubeError
    assert caught.value.status == 403
    assert str(caught.value) == f"reading namespace team-a failed: HTTP 403 Forbidden: {denied}"


async def test_list_resource_quotas_returns_the_items(
    server: FakeApiServer, api: KubernetesApi
) -> None:
    quotas = [quota("gpu", {"requests.nvidia.com/gpu": "4"}), quota("cpu", {"cpu": "8"})]
    # an item that is not an object is skipped
    server.answer("GET", QUOTAS_PATH, 200, a_list("ResourceQuotaList", [quotas[0], 7, quotas[1]]))
    assert await api.list_resource_quotas("team-a") == quotas
    [request] = server.requests
    assert request.method == "GET"
    assert request.path.split("?")[0] == QUOTAS_PATH
    assert request.query.get("limit") == "500"
    assert "continue" not in request.query


async def test_list_pods_asks_for_running_pods_and_follows_continue(
    server: FakeApiServer, api: KubernetesApi
) -> None:
    def pages(query: dict[str, str]) -> dict[str, Any]:
        if query.get("continue") == "page-2":
            return a_list("PodList", [pod_named("c")])
        return a_list("PodList", [pod_named("a"), pod_named("b")], token="page-2")

    server.answer("GET", PODS_PATH, 200, pages)
    pods = await api.list_pods("team-a")
    assert [pod["metadata"]["name"] for pod in pods] == ["a", "b", "c"]
    assert [r.query.get("continue") for r in server.requests] == [None, "page-2"]
    for request in server.requests:
        assert request.path.split("?")[0] == PODS_PATH
        assert request.query["fieldSelector"] == "status.phase!=Succeeded,status.phase!=Failed"
        assert request.query["limit"] == "500"


async def test_list_all_pods_reads_every_namespace_in_pages(
    server: FakeApiServer, api: KubernetesApi
) -> None:
    def pages(query: dict[str, str]) -> dict[str, Any]:
        if query.get("continue") == "next":
            return a_list("PodList", [pod_named("done")])
        return a_list("PodList", [pod_named("a")], token="next")

    server.answer("GET", "/api/v1/pods", 200, pages)
    pods = await api.list_all_pods()
    assert [pod["metadata"]["name"] for pod in pods] == ["a", "done"]
    assert all("fieldSelector" not in r.query for r in server.requests)  # every phase


async def test_list_all_pods_names_the_version_of_its_first_page(
    server: FakeApiServer, api: KubernetesApi
) -> None:
    def pages(query: dict[str, str]) -> dict[str, Any]:
        if query.get("continue") == "next":
            return {**a_list("PodList", [pod_named("b")]), "metadata": {"resourceVersion": "99"}}
        return a_list("PodList", [pod_named("a")], token="next")

    server.answer("GET", "/api/v1/pods", 200, pages)
    pods = await api.list_all_pods()
    assert pods.resource_version == "42"  # a watch from it misses nothing


async def test_list_without_a_version_names_none(server: FakeApiServer, api: KubernetesApi) -> None:
    server.answer("GET", "/api/v1/nodes", 200, {"kind": "NodeList", "items": [NODE]})
    nodes = await api.list_nodes()
    assert (list(nodes), nodes.resource_version) == ([NODE], "")


async def test_list_nodes_reads_every_node_in_pages(
    server: FakeApiServer, api: KubernetesApi
) -> None:
    def pages(query: dict[str, str]) -> dict[str, Any]:
        if query.get("continue") == "next":
            return a_list("NodeList", [node_named("b")])
        return a_list("NodeList", [node_named("a")], token="next")

    server.answer("GET", "/api/v1/nodes", 200, pages)
    nodes = await api.list_nodes()
    assert [node["metadata"]["name"] for node in nodes] == ["a", "b"]
    assert nodes.resource_version == "42"
    assert [r.query.get("limit") for r in server.requests] == ["500", "500"]


async def test_list_nodes_forbidden_is_a_kube_error(
    server: FakeApiServer, api: KubernetesApi
) -> None:
    denied = 'nodes is forbidden: User "x" cannot list resource "nodes"'
    server.answer("GET", "/api/v1/nodes", 403, status_body(403, "Forbidden", denied))
    with pytest.raises(KubeError, match="listing the nodes failed: HTTP 403 Forbidden: " + denied):
        await api.list_nodes()


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ([pod_named("a")], "sent no object"),
        ({"kind": "PodList", "metadata": {}}, "sent a list without items"),
        ({"kind": "PodList", "items": {"a": 1}}, "sent a list without items"),
    ],
)
async def test_list_body_that_is_no_list_object_is_a_kube_error(
    server: FakeApiServer, api: KubernetesApi, body: Any, says: str
) -> None:
    server.answer("GET", PODS_PATH, 200, body)
    with pytest.raises(KubeError) as caught:
        await api.list_pods("team-a")
    assert str(caught.value) == (
        f"listing pods of namespace team-a: the API server at {server.host} {says}"
    )


async def test_list_forbidden_is_kube_error_with_server_message(
    server: FakeApiServer, api: KubernetesApi
) -> None:
    denied = 'resourcequotas is forbidden: User "x" cannot list resource "resourcequotas"'
    server.answer("GET", QUOTAS_PATH, 403, status_body(403, "Forbidden", denied))
    with pytest.raises(KubeError) as caught:
        await api.list_resource_quotas("team-a")
    assert type(caught.value) is KubeError
    assert caught.value.status == 403
    assert str(caught.value) == (
        f"listing ResourceQuotas of namespace team-a failed: HTTP 403 Forbidden: {denied}"
    )


# --- KubernetesApi: watching pods ------------------------------------------------


async def first_events(api: KubeApi, count: int, resource_version: str = "") -> list[WatchEvent]:
    got: list[WatchEvent] = []
    async for event in api.watch_pods(resource_version):
        got.append(event)
        if len(got) == count:
            break
    return got


async def test_watch_streams_events_and_asks_for_bookmarks(
    server: FakeApiServer, api: KubernetesApi
) -> None:
    running = {**pod_named("a"), "status": {"phase": "Running"}}
    events = [
        {"type": "ADDED", "object": pod_named("a")},
        {"type": "MODIFIED", "object": running},
        {"type": "BOOKMARK", "object": {"kind": "Pod", "metadata": {"resourceVersion": "77"}}},
        {"type": "DELETED", "object": running},
    ]
    server.answer("GET", "/api/v1/pods", 200, Stream(events))
    got = [event async for event in api.watch_pods("41")]
    assert got == [(e["type"], e["object"]) for e in events]
    (request,) = server.requests
    assert request.query["watch"] == "true"
    assert request.query["allowWatchBookmarks"] == "true"
    assert request.query["resourceVersion"] == "41"
    assert request.query["timeoutSeconds"] == "300"


async def test_watch_from_now_sends_no_resource_version(
    server: FakeApiServer, api: KubernetesApi
) -> None:
    server.answer("GET", "/api/v1/pods", 200, Stream([{"type": "ADDED", "object": POD}]))
    assert await first_events(api, 1) == [("ADDED", POD)]
    assert "resourceVersion" not in server.requests[0].query


async def test_watch_event_split_across_chunks_is_joined(
    server: FakeApiServer, api: KubernetesApi
) -> None:
    line = json.dumps({"type": "ADDED", "object": POD}).encode() + b"\n"
    server.answer("GET", "/api/v1/pods", 200, Stream([line[:10], line[10:25], line[25:]]))
    assert [event async for event in api.watch_pods()] == [("ADDED", POD)]


async def test_watch_of_a_gone_version_raises_watch_expired(
    server: FakeApiServer, api: KubernetesApi
) -> None:
    gone = status_body(410, "Expired", "too old resource version: 41 (900)")
    server.answer("GET", "/api/v1/pods", 200, Stream([{"type": "ERROR", "object": gone}]))
    with pytest.raises(WatchExpired, match="too old resource version: 41"):
        await first_events(api, 1, "41")
    server.answer("GET", "/api/v1/pods", 410, gone)
    with pytest.raises(WatchExpired, match="too old resource version: 41"):
        await first_events(api, 1, "41")


async def test_node_watch_streams_events_from_a_version(
    server: FakeApiServer, api: KubernetesApi
) -> None:
    events = [
        {"type": "ADDED", "object": node_named("a")},
        {"type": "BOOKMARK", "object": {"kind": "Node", "metadata": {"resourceVersion": "77"}}},
        {"type": "DELETED", "object": node_named("a")},
    ]
    server.answer("GET", "/api/v1/nodes", 200, Stream(events))
    got = [event async for event in api.watch_nodes("41")]
    assert got == [(e["type"], e["object"]) for e in events]
    (request,) = server.requests
    assert request.path.split("?")[0] == "/api/v1/nodes"
    assert (request.query["watch"], request.query["resourceVersion"]) == ("true", "41")
    assert request.query["allowWatchBookmarks"] == "true"


async def test_node_watch_of_a_gone_version_raises_watch_expired(
    server: FakeApiServer, api: KubernetesApi
) -> None:
    gone = status_body(410, "Expired", "too old resource version: 41 (900)")
    server.answer("GET", "/api/v1/nodes", 200, Stream([{"type": "ERROR", "object": gone}]))
    with pytest.raises(WatchExpired, match="watching the nodes: too old resource version: 41"):
        await anext(api.watch_nodes("41"))
    server.answer("GET", "/api/v1/nodes", 410, gone)
    with pytest.raises(WatchExpired, match="too old resource version: 41"):
        await anext(api.watch_nodes("41"))


@pytest.mark.parametrize(
    ("line", "says"),
    [
        (b"not json\n", "sent no JSON"),
        (b'{"object": {}}\n', "sent an event without a type"),
        (json.dumps({"type": "ERROR", "object": status_body(500, "x", "boom")}) + "\n", "boom"),
    ],
)
async def test_watch_garbage_is_a_kube_error(
    server: FakeApiServer, api: KubernetesApi, line: bytes | str, says: str
) -> None:
    raw = line.encode() if isinstance(line, str) else line
    server.answer("GET", "/api/v1/pods", 200, Stream([raw]))
    # from a version: a watch from now that fails at once lists first instead
    with pytest.raises(KubeError, match=says) as caught:
        await first_events(api, 1, "41")
    assert "watching the pods of every namespace" in str(caught.value)


def pod_at(name: str, version: int, phase: str = "Running") -> dict[str, Any]:
    pod = pod_named(name)
    pod["metadata"]["resourceVersion"] = str(version)
    pod["status"] = {"phase": phase}
    return pod


def watches(server: FakeApiServer) -> list[str]:
    """The resource version of each watch asked for ("" when from now)."""
    return [r.query.get("resourceVersion", "") for r in server.requests if "watch" in r.query]


async def test_a_watch_from_now_the_server_cannot_stream_lists_first_and_remembers(
    server: FakeApiServer,
    api: KubernetesApi,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(kube_module, "PAGE_SIZE", 2)
    pods = [pod_at("a", 11), pod_at("b", 12, "Succeeded"), pod_at("c", 13)]
    gone = pod_at("a", 51)
    stand_in = WithoutWatchList(pods, 50, [("DELETED", gone)], hold=0)
    server.answer("GET", "/api/v1/pods", 200, stand_in)
    caplog.set_level(logging.DEBUG, "gpuslice_common.kube")

    got = [event async for event in api.watch_pods()]

    end = {"resourceVersion": "50", "annotations": {"k8s.io/initial-events-end": "true"}}
    assert got == [
        *[("ADDED", pod) for pod in pods],
        ("BOOKMARK", {"metadata": end}),
        ("DELETED", gone),
    ]
    refused, first_page, second_page, watch = server.requests
    assert refused.query["watch"] == "true"
    assert "resourceVersion" not in refused.query
    assert "watch" not in first_page.query
    assert first_page.query["limit"] == "2"
    assert second_page.query["continue"] == "2"
    assert (watch.query["watch"], watch.query["resourceVersion"]) == ("true", "50")
    assert stand_in.refused == 1
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1
    assert "RequestWatchProgress is disabled" in warnings[0].getMessage()

    # remembered: the next watch from now lists at once, and says nothing again
    assert [event async for event in api.watch_pods()] == got
    assert watches(server) == ["", "50", "50"]
    assert api.watches_listed_first == 2

    # once the refusal is old, the streaming form is asked for again, quietly
    api.watch_list_refused_at = time.monotonic() - api.watch_list_retry_s - 1
    assert [event async for event in api.watch_pods()] == got
    assert watches(server) == ["", "50", "50", "", "50"]
    assert stand_in.refused == 2
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1


async def test_leaving_a_watch_that_listed_first_leaves_no_thread_reading(
    server: FakeApiServer, api: KubernetesApi
) -> None:
    stand_in = WithoutWatchList([pod_at("a", 11)], 50, [("DELETED", pod_at("a", 51))], hold=60)
    server.answer("GET", "/api/v1/pods", 200, stand_in)
    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(1))
    events = api.watch_pods()
    kinds = [(await anext(events))[0] for _ in range(3)]
    assert kinds == ["ADDED", "BOOKMARK", "DELETED"]
    reading = asyncio.ensure_future(anext(events))
    await asyncio.sleep(0.2)  # the one worker thread is now blocked on the quiet stream
    reading.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reading
    await events.aclose()
    await asyncio.wait_for(asyncio.to_thread(lambda: None), 5)


async def test_a_watch_that_fails_after_its_first_event_or_from_a_version_does_not_list(
    server: FakeApiServer, api: KubernetesApi
) -> None:
    error = {"type": "ERROR", "object": status_body(500, "InternalError", "boom")}
    server.answer("GET", "/api/v1/pods", 200, Stream([{"type": "ADDED", "object": POD}, error]))
    with pytest.raises(KubeError, match="boom"):
        await first_events(api, 2)
    server.answer("GET", "/api/v1/pods", 200, Stream([error]))
    with pytest.raises(KubeError, match="boom"):
        await first_events(api, 1, "41")
    assert len(server.requests) == 2
    assert watches(server) == ["", "41"]
    assert api.watch_list_refused_at is None


async def test_watch_forbidden_is_a_kube_error_with_server_message(
    server: FakeApiServer, api: KubernetesApi
) -> None:
    denied = 'pods is forbidden: User "x" cannot watch resource "pods"'
    server.answer("GET", "/api/v1/pods", 403, status_body(403, "Forbidden", denied))
    with pytest.raises(KubeError, match="HTTP 403 Forbidden: " + denied):
        await first_events(api, 1)


async def test_leaving_a_quiet_watch_is_quick_and_leaves_no_thread_reading(
    server: FakeApiServer, api: KubernetesApi
) -> None:
    server.answer("GET", "/api/v1/pods", 200, Stream([{"type": "ADDED", "object": POD}], hold=60))
    # One worker thread: while it is still blocked reading, nothing else runs.
    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(1))
    events = api.watch_pods()
    assert await anext(events) == ("ADDED", POD)
    reading = asyncio.ensure_future(anext(events))
    await asyncio.sleep(0.2)  # the worker thread is now blocked on the quiet stream
    started = time.monotonic()
    reading.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reading
    await events.aclose()
    await asyncio.wait_for(asyncio.to_thread(lambda: None), 5)
    assert time.monotonic() - started < 3


def test_pod_not_found_is_a_not_found() -> None:
    assert issubclass(PodNotFound, NotFound)
    assert issubclass(NotFound, KubeError)


# --- KubernetesApi: connection, credentials ----------------------------------------


async def test_token_is_sent_as_bearer(server: FakeApiServer) -> None:
    server.answer("GET", POD_PATH, 200, POD)
    api = KubernetesApi.connect(server.host, token="s3cret", timeout=2.0)
    try:
        await api.get_pod("ns", "name")
    finally:
        await api.close()
    assert server.requests[0].headers["authorization"] == "Bearer s3cret"


async def test_unreachable_server_is_a_quick_kube_error_naming_the_host() -> None:
    host = f"http://127.0.0.1:{closed_port()}"
    api = KubernetesApi.connect(host, timeout=0.5)
    started = time.monotonic()
    try:
        with pytest.raises(KubeError) as caught:
            await api.bind_pod("ns", "name", "uid-1", "node-a")
    finally:
        await api.close()
    assert time.monotonic() - started < 3.0
    assert caught.value.status is None
    message = str(caught.value)
    assert message.startswith(f"cannot reach the Kubernetes API at {host}")
    assert "object at 0x" not in message


async def test_slow_server_times_out(server: FakeApiServer) -> None:
    server.answer("GET", POD_PATH, 200, POD, delay=1.0)
    api = KubernetesApi.connect(server.host, timeout=0.2)
    started = time.monotonic()
    try:
        with pytest.raises(KubeError) as caught:
            await api.get_pod("ns", "name")
    finally:
        await api.close()
    assert time.monotonic() - started < 0.9
    assert server.host in str(caught.value)


def write_kubeconfig(path: Path, server: str, token: str) -> Path:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": {"server": server}}],
        "users": [{"name": "u", "user": {"token": token}}],
        "contexts": [{"name": "ctx", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "ctx",
    }
    path.write_text(json.dumps(config))  # JSON is YAML
    return path


async def test_from_environment_reads_kubeconfig(
    server: FakeApiServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    kubeconfig = write_kubeconfig(tmp_path / "config", server.host, "from-kubeconfig")
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    server.answer("GET", POD_PATH, 200, POD)
    api = KubernetesApi.from_environment(timeout=2.0)
    try:
        assert await api.get_pod("ns", "name") == POD
    finally:
        await api.close()
    assert server.requests[0].headers["authorization"] == "Bearer from-kubeconfig"


def test_from_environment_without_kubeconfig_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    with pytest.raises(KubeError) as caught:
        KubernetesApi.from_environment()
    assert str(caught.value).startswith("cannot load Kubernetes credentials from kubeconfig")
    assert str(tmp_path / "missing") in str(caught.value)


def test_from_environment_in_cluster_without_service_account_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    with pytest.raises(KubeError) as caught:
        KubernetesApi.from_environment()
    assert str(caught.value).startswith(
        "cannot load Kubernetes credentials from the in-cluster service account"
    )


# --- LocalKubeApi -----------------------------------------------------------------


def local_with_pod(**spec: Any) -> LocalKubeApi:
    api = LocalKubeApi()
    api.add_pod(
        {"metadata": {"name": "name", "namespace": "ns", "uid": "uid-1"}, "spec": dict(spec)}
    )
    return api


async def test_local_stores_and_returns_copies() -> None:
    pod = {"metadata": {"name": "name", "namespace": "ns", "uid": "uid-1"}, "spec": {}}
    api = LocalKubeApi()
    api.add_pod(pod)
    pod["metadata"]["uid"] = "changed-by-caller"
    got = await api.get_pod("ns", "name")
    assert got["metadata"]["uid"] == "uid-1"
    got["spec"]["nodeName"] = "changed-by-caller"
    assert "nodeName" not in (await api.get_pod("ns", "name"))["spec"]


async def test_local_get_missing_pod_raises_pod_not_found() -> None:
    api = local_with_pod()
    with pytest.raises(PodNotFound):
        await api.get_pod("ns", "other")
    with pytest.raises(PodNotFound):
        await api.get_pod("other-ns", "name")


def test_local_add_pod_needs_a_name() -> None:
    with pytest.raises(ValueError, match=r"metadata\.name"):
        LocalKubeApi().add_pod({"metadata": {"namespace": "ns"}})


async def test_local_patch_merges_and_none_deletes() -> None:
    api = local_with_pod()
    await api.patch_pod_annotations("ns", "name", {"a": "1", "b": "2"})
    await api.patch_pod_annotations("ns", "name", {"a": None, "c": "3", "missing": None})
    pod = await api.get_pod("ns", "name")
    assert pod["metadata"]["annotations"] == {"b": "2", "c": "3"}
    assert api.patches == [
        ("ns", "name", {"a": "1", "b": "2"}),
        ("ns", "name", {"a": None, "c": "3", "missing": None}),
    ]
    with pytest.raises(PodNotFound):
        await api.patch_pod_annotations("ns", "gone", {"a": "1"})


async def test_local_bind_sets_node_name_and_records_it() -> None:
    api = local_with_pod()
    await api.bind_pod("ns", "name", "uid-1", "node-a")
    assert (await api.get_pod("ns", "name"))["spec"]["nodeName"] == "node-a"
    assert api.bindings == [("ns", "name", "node-a")]


async def test_local_bind_to_another_node_is_a_conflict() -> None:
    api = local_with_pod(nodeName="node-a")
    with pytest.raises(Conflict) as caught:
        await api.bind_pod("ns", "name", "uid-1", "node-b")
    assert caught.value.status == 409
    assert "node-a" in str(caught.value)
    assert (await api.get_pod("ns", "name"))["spec"]["nodeName"] == "node-a"
    assert api.bindings == []


async def test_local_bind_of_a_replaced_pod_is_a_conflict() -> None:
    api = local_with_pod()
    with pytest.raises(Conflict, match="uid"):
        await api.bind_pod("ns", "name", "uid-old", "node-a")
    assert "nodeName" not in (await api.get_pod("ns", "name"))["spec"]
    assert api.bindings == []


async def test_local_bind_missing_pod_raises_pod_not_found() -> None:
    with pytest.raises(PodNotFound):
        await LocalKubeApi().bind_pod("ns", "name", "uid-1", "node-a")


async def test_local_delete_removes_the_pod() -> None:
    api = local_with_pod()
    api.delete_pod("ns", "name")
    with pytest.raises(PodNotFound):
        await api.get_pod("ns", "name")
    with pytest.raises(PodNotFound):
        api.delete_pod("ns", "name")


async def test_local_namespace_exists_by_default_and_has_the_labels_given() -> None:
    api = LocalKubeApi()
    assert await api.get_namespace("anything") == {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": "anything"},
    }
    labels = {"gpuslice.io/enabled": "true"}
    api.add_namespace("team-a", labels)
    labels["gpuslice.io/enabled"] = "changed-by-caller"
    got = await api.get_namespace("team-a")
    assert got["metadata"] == {"name": "team-a", "labels": {"gpuslice.io/enabled": "true"}}
    got["metadata"]["labels"]["extra"] = "changed-by-caller"
    again = await api.get_namespace("team-a")
    assert again["metadata"]["labels"] == {"gpuslice.io/enabled": "true"}
    api.add_namespace("team-a")  # no labels now
    assert "labels" not in (await api.get_namespace("team-a"))["metadata"]


async def test_local_resource_quotas_add_replace_and_list_per_namespace() -> None:
    api = LocalKubeApi()
    assert await api.list_resource_quotas("team-a") == []
    api.add_resource_quota("team-a", quota("gpu", {"requests.nvidia.com/gpu": "4"}))
    api.add_resource_quota("team-a", quota("cpu", {"cpu": "8"}))
    api.add_resource_quota("team-b", quota("gpu", {"requests.nvidia.com/gpu": "1"}))
    api.add_resource_quota("team-a", quota("gpu", {"requests.nvidia.com/gpu": "2"}))
    got = await api.list_resource_quotas("team-a")
    assert sorted((q["metadata"]["name"], q["spec"]["hard"]) for q in got) == [
        ("cpu", {"cpu": "8"}),
        ("gpu", {"requests.nvidia.com/gpu": "2"}),
    ]
    [other] = await api.list_resource_quotas("team-b")
    assert other["metadata"]["namespace"] == "team-b"
    assert other["spec"]["hard"] == {"requests.nvidia.com/gpu": "1"}


async def test_local_resource_quotas_are_copies() -> None:
    api = LocalKubeApi()
    given = quota("gpu", {"requests.nvidia.com/gpu": "4"})
    api.add_resource_quota("team-a", given)
    given["spec"]["hard"]["requests.nvidia.com/gpu"] = "changed-by-caller"
    [got] = await api.list_resource_quotas("team-a")
    assert got["spec"]["hard"] == {"requests.nvidia.com/gpu": "4"}
    got["spec"]["hard"]["requests.nvidia.com/gpu"] = "changed-by-caller"
    [again] = await api.list_resource_quotas("team-a")
    assert again["spec"]["hard"] == {"requests.nvidia.com/gpu": "4"}


def test_local_add_resource_quota_needs_a_name() -> None:
    with pytest.raises(ValueError, match=r"metadata\.name"):
        LocalKubeApi().add_resource_quota("team-a", {"spec": {"hard": {"cpu": "1"}}})


async def test_local_list_pods_leaves_out_terminated_pods_and_other_namespaces() -> None:
    api = LocalKubeApi()
    for pod in [
        pod_named("running"),
        pod_named("pending", "Pending"),
        pod_named("done", "Succeeded"),
        pod_named("crashed", "Failed"),
        pod_named("elsewhere", namespace="team-b"),
        {"metadata": {"name": "no-status", "namespace": "team-a"}},
    ]:
        api.add_pod(pod)
    got = await api.list_pods("team-a")
    assert sorted(pod["metadata"]["name"] for pod in got) == ["no-status", "pending", "running"]
    got[0]["metadata"]["name"] = "changed-by-caller"
    again = await api.list_pods("team-a")
    assert sorted(pod["metadata"]["name"] for pod in again) == ["no-status", "pending", "running"]
    assert await api.list_pods("nowhere") == []


async def test_local_watch_from_now_lists_then_follows_every_change() -> None:
    api = local_with_pod()
    events = api.watch_pods()
    assert (await anext(events))[0] == "ADDED"
    api.add_pod(pod_named("b"))
    await api.bind_pod("ns", "name", "uid-1", "node-a")
    api.set_phase("ns", "name", "Succeeded")
    api.delete_pod("ns", "name")
    got = [await anext(events) for _ in range(4)]
    await events.aclose()
    assert [(kind, pod["metadata"]["name"]) for kind, pod in got] == [
        ("ADDED", "b"),
        ("MODIFIED", "name"),
        ("MODIFIED", "name"),
        ("DELETED", "name"),
    ]
    assert got[1][1]["spec"]["nodeName"] == "node-a"
    assert got[2][1]["status"]["phase"] == "Succeeded"
    versions = [int(pod["metadata"]["resourceVersion"]) for _, pod in got]
    assert versions == sorted(set(versions))


async def test_local_watch_resumes_from_a_version_and_refuses_a_gone_one() -> None:
    api = LocalKubeApi()
    api.add_pod(pod_named("a"))
    since = (await api.list_all_pods())[0]["metadata"]["resourceVersion"]
    api.delete_pod("team-a", "a")
    assert [kind for kind, _ in await first_events(api, 1, since)] == ["DELETED"]
    for i in range(1100):  # more than the history holds
        api.add_pod(pod_named(f"p{i}"))
    with pytest.raises(WatchExpired):
        await first_events(api, 1, since)
    with pytest.raises(WatchExpired):
        await first_events(api, 1, "not-a-version")


async def test_local_nodes_are_listed_as_copies_with_their_version() -> None:
    api = LocalKubeApi()
    api.add_node(node_named("a"))
    api.set_allocatable("a", cpu="4")
    nodes = await api.list_nodes()
    assert nodes[0]["status"]["allocatable"] == {"cpu": "4", "memory": "32Gi"}
    assert nodes.resource_version == api.resource_version == "2"
    nodes[0]["metadata"]["name"] = "changed-by-caller"
    assert [n["metadata"]["name"] for n in await api.list_nodes()] == ["a"]
    with pytest.raises(ValueError, match=r"metadata\.name"):
        api.add_node({"metadata": {}})
    with pytest.raises(NotFound, match="node nope"):
        api.set_allocatable("nope", cpu="1")


async def test_local_node_watch_from_now_lists_then_follows_every_change() -> None:
    api = LocalKubeApi()
    api.add_node(node_named("a"))
    events = api.watch_nodes()
    assert (await anext(events))[0] == "ADDED"
    api.add_node(node_named("b"))
    api.set_allocatable("a", memory="16Gi")
    api.delete_node("b")
    got = [await anext(events) for _ in range(3)]
    await events.aclose()
    assert [(kind, node["metadata"]["name"]) for kind, node in got] == [
        ("ADDED", "b"),
        ("MODIFIED", "a"),
        ("DELETED", "b"),
    ]
    assert got[1][1]["status"]["allocatable"]["memory"] == "16Gi"


async def test_local_node_watch_resumes_past_pod_changes_and_refuses_a_gone_version() -> None:
    api = LocalKubeApi()
    api.add_node(node_named("a"))
    since = (await api.list_nodes()).resource_version
    for i in range(1100):  # pod changes fill the pods' history, not the nodes'
        api.add_pod(pod_named(f"p{i}"))
    api.set_allocatable("a", cpu="2")
    events = api.watch_nodes(since)
    kind, node = await anext(events)
    await events.aclose()
    assert (kind, node["status"]["allocatable"]["cpu"]) == ("MODIFIED", "2")
    for i in range(1100):  # more node changes than the history holds
        api.set_allocatable("a", cpu=str(i))
    with pytest.raises(WatchExpired, match="watching nodes: too old resource version"):
        await anext(api.watch_nodes(since))


async def test_local_satisfies_the_interface() -> None:
    api: KubeApi = local_with_pod()
    await api.bind_pod("ns", "name", "uid-1", "node-a")
    assert (await api.get_namespace("ns"))["metadata"]["name"] == "ns"
    assert await api.list_resource_quotas("ns") == []
    assert [pod["metadata"]["name"] for pod in await api.list_pods("ns")] == ["name"]
    assert [pod["metadata"]["name"] for pod in await api.list_all_pods()] == ["name"]
    assert await api.list_nodes() == []
    await api.close()
    assert isinstance(api, LocalKubeApi)
    assert api.closed
