"""The local stack's API server, driven by the services' own KubernetesApi over
real HTTP through the kubeconfig it writes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpuslice_cli.dev.apiserver import DevApiServer
from gpuslice_common.kube import (
    Conflict,
    EvictionRefused,
    KubeError,
    KubernetesApi,
    LocalKubeApi,
    PodNotFound,
    WatchExpired,
)


def pod(name: str, uid: str, phase: str = "Pending") -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "team", "uid": uid},
        "spec": {"containers": [{"name": "main", "image": "cuda"}]},
        "status": {"phase": phase},
    }


@pytest.fixture
async def served(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[LocalKubeApi, DevApiServer, KubernetesApi]]:
    store = LocalKubeApi()
    server = DevApiServer(store)
    async with server.serving():
        monkeypatch.setenv("KUBECONFIG", str(server.kubeconfig(tmp_path / "kubeconfig")))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        client = KubernetesApi.from_environment(timeout=3)
        try:
            yield store, server, client
        finally:
            await client.close()


async def test_pods_are_read_annotated_and_bound_through_the_real_client(
    served: tuple[LocalKubeApi, DevApiServer, KubernetesApi],
) -> None:
    store, _, client = served
    store.add_pod(pod("a", "uid-a"))
    got = await client.get_pod("team", "a")
    assert got["metadata"]["uid"] == "uid-a"
    await client.patch_pod_annotations("team", "a", {"gpuslice.io/placement": "{}", "x": None})
    await client.bind_pod("team", "a", "uid-a", "gpu-1")
    held = await store.get_pod("team", "a")
    assert held["metadata"]["annotations"] == {"gpuslice.io/placement": "{}"}
    assert held["spec"]["nodeName"] == "gpu-1"
    with pytest.raises(Conflict, match="already bound to node gpu-1"):
        await client.bind_pod("team", "a", "uid-a", "gpu-2")
    with pytest.raises(Conflict, match="uid"):
        await client.bind_pod("team", "a", "uid-other", "gpu-1")
    with pytest.raises(PodNotFound, match="team/nope"):
        await client.get_pod("team", "nope")


async def test_lists_namespaces_and_quotas(
    served: tuple[LocalKubeApi, DevApiServer, KubernetesApi],
) -> None:
    store, _, client = served
    store.add_pod(pod("run", "u1", "Running"))
    store.add_pod(pod("done", "u2", "Succeeded"))
    store.add_namespace("team", {"hami.io/webhook": "ignore"})
    quota = {"metadata": {"name": "gpu"}, "spec": {"hard": {"limits.nvidia.com/gpumem": "8000"}}}
    store.add_resource_quota("team", quota)
    assert [p["metadata"]["name"] for p in await client.list_pods("team")] == ["run"]
    assert sorted(p["metadata"]["name"] for p in await client.list_all_pods()) == ["done", "run"]
    namespace = await client.get_namespace("team")
    assert namespace["metadata"]["labels"] == {"hami.io/webhook": "ignore"}
    (got,) = await client.list_resource_quotas("team")
    assert got["spec"]["hard"] == {"limits.nvidia.com/gpumem": "8000"}


async def test_the_watch_streams_changes_and_refuses_a_forgotten_version(
    served: tuple[LocalKubeApi, DevApiServer, KubernetesApi],
) -> None:
    store, _, client = served
    store.add_pod(pod("a", "uid-a"))
    events = client.watch_pods()
    assert (await anext(events))[0] == "ADDED"
    store.set_phase("team", "a", "Running")
    store.delete_pod("team", "a")
    kinds = [(await asyncio.wait_for(anext(events), 5))[0] for _ in range(2)]
    await events.aclose()
    assert kinds == ["MODIFIED", "DELETED"]
    with pytest.raises(WatchExpired):
        await anext(client.watch_pods("999999"))


async def test_a_quiet_watch_still_delivers_later_changes(
    served: tuple[LocalKubeApi, DevApiServer, KubernetesApi],
) -> None:
    store, _, client = served
    store.add_pod(pod("a", "uid-a"))
    events = client.watch_pods(store.resource_version)  # nothing new yet
    waiting = asyncio.ensure_future(anext(events))
    await asyncio.sleep(0.5)
    store.delete_pod("team", "a")
    assert (await asyncio.wait_for(waiting, 5))[0] == "DELETED"
    await events.aclose()


def node(name: str, cpu: str = "16") -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name},
        "status": {"allocatable": {"cpu": cpu, "memory": "64Gi"}},
    }


async def test_nodes_are_listed_and_watched_through_the_real_client(
    served: tuple[LocalKubeApi, DevApiServer, KubernetesApi],
) -> None:
    store, _, client = served
    store.add_node(node("gpu-1"))
    listed = await client.list_nodes()
    assert [n["metadata"]["name"] for n in listed] == ["gpu-1"]
    assert listed.resource_version == store.resource_version
    events = client.watch_nodes(listed.resource_version)
    waiting = asyncio.ensure_future(anext(events))
    store.set_allocatable("gpu-1", cpu="8")
    store.delete_node("gpu-1")
    kind, changed = await asyncio.wait_for(waiting, 5)
    assert (kind, changed["status"]["allocatable"]["cpu"]) == ("MODIFIED", "8")
    assert (await asyncio.wait_for(anext(events), 5))[0] == "DELETED"
    await events.aclose()
    with pytest.raises(WatchExpired, match="nodes"):
        await anext(client.watch_nodes("999999"))


async def test_requests_without_the_token_or_with_bad_bodies_get_a_status(
    served: tuple[LocalKubeApi, DevApiServer, KubernetesApi],
) -> None:
    store, server, _ = served
    store.add_pod(pod("a", "uid-a"))
    async with httpx.AsyncClient(base_url=server.url) as http:
        denied = await http.get("/api/v1/pods")
        assert denied.status_code == 401
        assert denied.json()["kind"] == "Status"
        auth = {"Authorization": f"Bearer {server.token}"}
        spec = await http.patch(
            "/api/v1/namespaces/team/pods/a",
            json={"spec": {"nodeName": "x"}},
            headers={**auth, "Content-Type": "application/merge-patch+json"},
        )
        assert spec.status_code == 422
        assert "metadata.annotations only" in spec.json()["message"]
        garbage = await http.post(
            "/api/v1/namespaces/team/pods/a/binding", content=b"{", headers=auth
        )
        assert garbage.status_code == 422
        assert garbage.json()["message"] == "the request body is not JSON"
        review = "/apis/authentication.k8s.io/v1/tokenreviews"
        tokenless = await http.post(review, json={"kind": "TokenReview", "spec": {}}, headers=auth)
        assert tokenless.status_code == 422
        assert "spec.token" in tokenless.json()["message"]
        assert (await http.post(review, json={"spec": {"token": "t"}})).status_code == 401
    assert (await store.get_pod("team", "a"))["spec"].get("nodeName") is None


class Collected(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


async def test_a_watch_open_when_the_server_stops_ends_as_a_response() -> None:
    """A service still watching when an attached driver stops: its watch ends as a
    watch does (the client watches again), not cancelled as an application error."""
    store = LocalKubeApi()
    store.add_pod(pod("a", "uid-a"))
    server = DevApiServer(store)
    errors = Collected()
    uvicorn_log = logging.getLogger("uvicorn.error")
    uvicorn_log.addHandler(errors)
    try:
        async with contextlib.AsyncExitStack() as serving:
            await serving.enter_async_context(server.serving())
            auth = {"Authorization": f"Bearer {server.token}"}
            async with (
                httpx.AsyncClient(base_url=server.url, timeout=30) as http,
                http.stream("GET", "/api/v1/pods?watch=true", headers=auth) as response,
            ):
                assert response.status_code == 200
                lines = response.aiter_lines()
                assert json.loads(await anext(lines))["type"] == "ADDED"

                async def rest() -> list[str]:
                    return [line async for line in lines]

                reading = asyncio.ensure_future(rest())
                await serving.aclose()  # the server stops, the watch still open
                assert await asyncio.wait_for(reading, 10) == []  # ended, no more events
    finally:
        uvicorn_log.removeHandler(errors)
    assert [r.getMessage() for r in errors.records] == []


async def test_minted_service_account_tokens_are_reviewed_through_the_real_client(
    served: tuple[LocalKubeApi, DevApiServer, KubernetesApi],
) -> None:
    store, _, client = served
    token = store.tokens.mint(
        "gpuslice",
        "gpuslice-deviceplugin",
        pod_name="agent-1",
        pod_uid="uid-agent-1",
        node="gpu-1",
        audiences=["gpuslice-nats"],
    )
    review = await client.review_token(token, ["gpuslice-nats"])
    assert review["authenticated"] is True
    assert review["user"]["username"] == "system:serviceaccount:gpuslice:gpuslice-deviceplugin"
    assert review["user"]["extra"]["authentication.kubernetes.io/node-name"] == ["gpu-1"]
    assert review["audiences"] == ["gpuslice-nats"]
    # another audience, or a token nobody minted, is not authenticated
    assert (await client.review_token(token, ["https://kubernetes"]))["authenticated"] is False
    assert (await client.review_token(token + "x", ["gpuslice-nats"]))["authenticated"] is False


async def test_user_tokens_and_access_reviews_through_the_real_client(
    served: tuple[LocalKubeApi, DevApiServer, KubernetesApi],
) -> None:
    """The console's questions: who holds this token, and may they list pods
    there. The local API grants nothing until its driver says so."""
    store, _, client = served
    token = store.tokens.mint_user("dev", ["devs"])
    review = await client.review_token(token)  # the API server's own audience
    assert review["authenticated"] is True
    assert review["user"]["username"] == "dev"
    assert review["user"]["groups"] == ["devs", "system:authenticated"]
    assert not await client.access_review("dev", ["devs"], "list", "pods", "team")
    assert not await client.access_review("dev", ["devs"], "list", "pods")
    store.access.grant(group="devs", namespace="team")
    assert await client.access_review("dev", ["devs"], "list", "pods", "team")
    assert not await client.access_review("dev", [], "list", "pods", "team")  # not in the group
    assert not await client.access_review("dev", ["devs"], "list", "pods", "other")
    assert not await client.access_review("dev", ["devs"], "list", "pods")  # not cluster-wide
    assert not await client.access_review("dev", ["devs"], "delete", "pods", "team")
    store.access.grant(user="dev")
    assert await client.access_review("dev", [], "list", "pods")


def running_pod(name: str, labels: dict[str, str]) -> dict[str, Any]:
    held = pod(name, f"uid-{name}", "Running")
    held["metadata"]["labels"] = labels
    held["spec"]["nodeName"] = "node-1"
    held["spec"]["terminationGracePeriodSeconds"] = 7
    return held


async def test_evictions_honour_a_disruption_budget_as_the_api_server_does(
    served: tuple[LocalKubeApi, DevApiServer, KubernetesApi],
) -> None:
    store, _, client = served
    for name in ("a", "b"):
        store.add_pod(running_pod(name, {"app": "batch"}))
    store.add_pod(running_pod("free", {"app": "other"}))
    budget = store.add_pdb(
        "team",
        {
            "metadata": {"name": "batch"},
            "spec": {"selector": {"matchLabels": {"app": "batch"}}, "minAvailable": 1},
        },
    )
    assert budget["status"]["disruptionsAllowed"] == 1
    # a dry run changes nothing
    await client.evict_pod("team", "a", "uid-a", dry_run=True)
    assert store.evictions == []
    assert "deletionTimestamp" not in (await client.get_pod("team", "a"))["metadata"]
    # the UID is a precondition
    with pytest.raises(Conflict):
        await client.evict_pod("team", "a", "uid-other")
    await client.evict_pod("team", "a", "uid-a")
    evicted = await client.get_pod("team", "a")
    assert evicted["metadata"]["deletionTimestamp"]
    assert evicted["metadata"]["deletionGracePeriodSeconds"] == 7
    assert {c["type"]: c["reason"] for c in evicted["status"]["conditions"]} == {
        "DisruptionTarget": "EvictionByEvictionAPI"
    }
    # one healthy pod is left of the two: the budget allows no more (429), dry run or not
    for dry in (True, False):
        with pytest.raises(EvictionRefused, match="disruption budget"):
            await client.evict_pod("team", "b", "uid-b", dry_run=dry)
    await client.evict_pod("team", "free", "uid-free")  # another budget's pods: none
    assert store.evictions == [("team", "a"), ("team", "free")]
    with pytest.raises(PodNotFound):
        await client.evict_pod("team", "gone", "uid-gone")


async def test_nominated_node_and_events_are_written_as_asked_and_only_so(
    served: tuple[LocalKubeApi, DevApiServer, KubernetesApi],
) -> None:
    store, server, client = served
    store.add_pod(pod("a", "uid-a"))
    await client.patch_pod_status("team", "a", {"nominatedNodeName": "node-1"})
    assert (await client.get_pod("team", "a"))["status"]["nominatedNodeName"] == "node-1"
    with pytest.raises(KubeError, match="nominatedNodeName only"):
        await client.patch_pod_status("team", "a", {"phase": "Running"})
    event = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": "a.1", "namespace": "team"},
        "involvedObject": {"kind": "Pod", "namespace": "team", "name": "a", "uid": "uid-a"},
        "reason": "Preempted",
        "message": "by team/b",
        "type": "Normal",
    }
    await client.create_event("team", event)
    with pytest.raises(KubeError, match=r"involvedObject\.namespace"):
        await client.create_event("team", {**event, "involvedObject": {"namespace": "other"}})
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {server.token}"}) as http:
        listed = (await http.get(f"{server.url}/api/v1/namespaces/team/events")).json()
        # an eviction whose name differs from the URL's is refused, as the API server does
        wrong = await http.post(
            f"{server.url}/api/v1/namespaces/team/pods/a/eviction",
            json={"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": "b"}},
        )
    assert [(e["reason"], e["involvedObject"]["name"]) for e in listed["items"]] == [
        ("Preempted", "a")
    ]
    assert wrong.status_code == 400
    assert store.evictions == []
