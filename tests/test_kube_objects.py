"""The generic object calls of :class:`KubeApi` (``get_object`` ...): the real
client over HTTP to the dev API server, and the in-memory API behind it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from gpuslice_cli.dev.apiserver import DevApiServer
from gpuslice_common.kube import Conflict, KubernetesApi, LocalKubeApi, NotFound, ObjectRef

CLAIMS = ObjectRef("resource.k8s.io/v1", "resourceclaims", "team-a")
SLICES = ObjectRef("resource.k8s.io/v1", "resourceslices")


@pytest.fixture
async def apis() -> AsyncIterator[tuple[LocalKubeApi, KubernetesApi]]:
    local = LocalKubeApi()
    async with DevApiServer(local).serving() as server:
        real = KubernetesApi.connect(server.url, token=server.token, timeout=5.0)
        try:
            yield local, real
        finally:
            await real.close()


def claim(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": {"devices": {"requests": []}},
    }


def test_paths() -> None:
    assert CLAIMS.named("c").path == "/apis/resource.k8s.io/v1/namespaces/team-a/resourceclaims/c"
    assert SLICES.path == "/apis/resource.k8s.io/v1/resourceslices"
    assert ObjectRef("v1", "pods", "ns", "p").path == "/api/v1/namespaces/ns/pods/p"


async def test_create_get_replace_status_delete(apis: tuple[LocalKubeApi, KubernetesApi]) -> None:
    local, real = apis
    made = await real.create_object(CLAIMS, claim("one"))
    assert made["metadata"]["namespace"] == "team-a"
    assert made["metadata"]["uid"]
    with pytest.raises(Conflict):
        await real.create_object(CLAIMS, claim("one"))
    got = await real.get_object(CLAIMS.named("one"))
    got["status"] = {"allocation": {"devices": {"results": []}}}
    updated = await real.replace_object(CLAIMS.named("one"), got, subresource="status")
    assert updated["status"] == got["status"]
    assert (await local.get_object(CLAIMS.named("one")))["status"] == got["status"]
    # a stale resource version is refused, the stored object kept
    with pytest.raises(Conflict):
        await real.replace_object(CLAIMS.named("one"), got)
    # the spec put back keeps the status
    fresh = await real.get_object(CLAIMS.named("one"))
    fresh["spec"] = {"devices": {"requests": [{"name": "gpu"}]}}
    replaced = await real.replace_object(CLAIMS.named("one"), fresh)
    assert replaced["status"] == got["status"]
    assert replaced["spec"] == fresh["spec"]
    with pytest.raises(Conflict):
        await real.delete_object(CLAIMS.named("one"), uid="someone-else")
    await real.delete_object(CLAIMS.named("one"), uid=made["metadata"]["uid"])
    with pytest.raises(NotFound):
        await real.get_object(CLAIMS.named("one"))
    with pytest.raises(NotFound):
        await real.delete_object(CLAIMS.named("one"))


async def test_lists_by_namespace_and_label(apis: tuple[LocalKubeApi, KubernetesApi]) -> None:
    _, real = apis
    await real.create_object(CLAIMS, claim("a"))
    await real.create_object(CLAIMS.in_namespace("team-b"), claim("b"))
    await real.create_object(SLICES, {"metadata": {"name": "node-1-gpu"}, "spec": {}})
    assert [c["metadata"]["name"] for c in await real.list_objects(CLAIMS)] == ["a"]
    every = await real.list_objects(CLAIMS.in_namespace(None))
    assert sorted(c["metadata"]["name"] for c in every) == ["a", "b"]
    assert every.resource_version
    labelled = await real.list_objects(CLAIMS.in_namespace(None), label_selector="app=b")
    assert [c["metadata"]["name"] for c in labelled] == ["b"]
    assert [s["metadata"]["name"] for s in await real.list_objects(SLICES)] == ["node-1-gpu"]


async def test_unknown_kinds_and_scopes_are_not_found(
    apis: tuple[LocalKubeApi, KubernetesApi],
) -> None:
    _, real = apis
    with pytest.raises(NotFound):
        await real.get_object(ObjectRef("resource.k8s.io/v1", "widgets", "ns", "w"))
    with pytest.raises(NotFound):  # slices are cluster-scoped
        await real.get_object(ObjectRef("resource.k8s.io/v1", "resourceslices", "ns", "s"))
