"""Node CPU and memory as kube-scheduler counts them: a pod's request
(requested.py), what each node has free (NodeResources), and following nodes
and pods over real HTTP, through the dev API server and through the test API
server (expired and broken watches)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from gpuslice_cli.dev.apiserver import DevApiServer
from gpuslice_common.kube import KubeApi, KubernetesApi, LocalKubeApi
from gpuslice_scheduler.requested import (
    MAX_CPU_MILLI,
    MAX_MEMORY,
    MIB,
    Amount,
    ResourceError,
    node_allocatable,
    pod_request,
)
from gpuslice_scheduler.resources import NodeResources
from tests.kubeapi import FakeApiServer, Recorded, Stream, status_body

GI = 1024  # MiB
UNKNOWN = (math.inf, math.inf)


def box(
    name: str,
    cpu: str | None = None,
    memory: str | None = None,
    *,
    limits: dict[str, Any] | None = None,
    sidecar: bool = False,
) -> dict[str, Any]:
    """A container requesting ``cpu`` and ``memory`` (and limiting ``limits``)."""
    requests = {k: v for k, v in (("cpu", cpu), ("memory", memory)) if v is not None}
    resources: dict[str, Any] = {"requests": requests} if requests else {}
    if limits:
        resources["limits"] = limits
    container: dict[str, Any] = {"name": name, "image": "img", "resources": resources}
    if sidecar:
        container["restartPolicy"] = "Always"
    return container


def pod(
    name: str,
    node: str | None = None,
    *containers: dict[str, Any],
    phase: str = "Running",
    init: list[dict[str, Any]] | None = None,
    overhead: dict[str, Any] | None = None,
    uid: str | None = None,
) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": list(containers) or [box("main", "1", "1Gi")]}
    if node is not None:
        spec["nodeName"] = node
    if init is not None:
        spec["initContainers"] = init
    if overhead is not None:
        spec["overhead"] = overhead
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "team", "uid": uid or f"uid-{name}"},
        "spec": spec,
        "status": {"phase": phase},
    }


def node(name: str, cpu: str = "8", memory: str = "32Gi") -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name},
        "status": {"allocatable": {"cpu": cpu, "memory": memory}},
    }


# ---------------------------------------------------------------- a pod's request


def test_app_containers_add_up() -> None:
    got = pod_request(pod("p", None, box("a", "500m", "1Gi"), box("b", "1.5", "512Mi")))
    assert got == Amount(2000, 1536 * MIB)


def test_a_resource_only_limited_counts_its_limit_as_the_api_server_defaults_it() -> None:
    limited = box("a", limits={"cpu": "2", "memory": "4Gi"})
    mixed = box("b", "250m", limits={"cpu": "1", "memory": "1Gi"})  # request wins for cpu
    assert pod_request(pod("p", None, limited, mixed)) == Amount(2250, 5 * GI * MIB)


def test_a_container_without_resources_asks_nothing() -> None:
    assert pod_request(pod("p", None, {"name": "bare", "image": "img"})) == Amount(0, 0)


def test_the_largest_plain_init_container_wins_over_smaller_apps() -> None:
    init = [box("fetch", "4", "256Mi"), box("migrate", "1", "8Gi")]
    got = pod_request(pod("p", None, box("main", "2", "1Gi"), init=init))
    assert got == Amount(4000, 8 * GI * MIB)  # per resource: cpu of one, memory of the other


def test_sidecars_run_beside_the_apps_and_the_init_containers_after_them() -> None:
    init = [
        box("early", "3", "1Gi"),  # runs before the sidecar starts: alone
        box("proxy", "500m", "1Gi", sidecar=True),
        box("late", "3", "1Gi"),  # runs beside the proxy
    ]
    got = pod_request(pod("p", None, box("main", "1", "2Gi"), init=init))
    # apps + sidecar: 1.5 CPU, 3 GiB; "late" with the proxy: 3.5 CPU, 2 GiB
    assert got == Amount(3500, 3 * GI * MIB)


def test_overhead_comes_on_top() -> None:
    overhead = {"cpu": "250m", "memory": "160Mi"}
    got = pod_request(pod("p", None, box("main", "1", "1Gi"), overhead=overhead))
    assert got == Amount(1250, (GI + 160) * MIB)


def test_quantities_round_up_as_kubernetes_rounds_them() -> None:
    got = pod_request(pod("p", None, box("a", "0.0001", "1k"), box("b", "1e-3", "100m")))
    assert got == Amount(2, 1001)  # 0.1 milli-CPU is 1, 0.1 byte is 1


@pytest.mark.parametrize(
    ("target", "says"),
    [
        (pod("p", None, box("main", "lots")), "container 'main': cpu has an invalid value"),
        (pod("p", None, box("main", "1", "-1Gi")), "container 'main': memory must be between 0"),
        (pod("p", None, box("main", "2000000")), "cpu must be between 0 and 1000000 cores"),
        (pod("p", None, box("x", limits={"memory": []})), "memory has an invalid value"),
        (pod("p", None, init=[box("i", "1x")]), "init container 'i': cpu has an invalid value"),
        (pod("p", None, overhead={"cpu": "much"}), "spec.overhead: cpu has an invalid value"),
        ({"spec": {"containers": {"main": {}}}}, "spec.containers must be a list"),
        ({"spec": {"containers": ["main"]}}, "each container must be an object"),
        ({"spec": {"containers": [{"name": "m", "resources": []}]}}, "'m': resources must be"),
        ({"spec": "none"}, "spec must be an object"),
    ],
)
def test_a_request_that_cannot_be_read_is_an_error_naming_it(
    target: dict[str, Any], says: str
) -> None:
    with pytest.raises(ResourceError, match=says):
        pod_request(target)


@pytest.mark.parametrize(
    ("cpu", "memory", "expected", "unclamped"),
    [
        ("2000000", "1Gi", Amount(MAX_CPU_MILLI, GI * MIB), "cpu must be between 0 and"),
        ("1", "2Ei", Amount(1000, MAX_MEMORY), "memory must be between 0 and"),
        ("1e40", "1e40", Amount(MAX_CPU_MILLI, MAX_MEMORY), "cpu must be between"),  # past 1e30
        (  # the API server's canonical form of a huge request
            "1" + "0" * 200 + "E",
            "1" + "0" * 200 + "Ei",
            Amount(MAX_CPU_MILLI, MAX_MEMORY),
            "cpu must be between",
        ),
        ("1000000", "1Ei", Amount(MAX_CPU_MILLI, MAX_MEMORY), None),  # at the bound: as it is
    ],
)
def test_clamped_a_request_above_the_bound_counts_as_the_bound(
    cpu: str, memory: str, expected: Amount, unclamped: str | None
) -> None:
    target = pod("p", "a", box("main", cpu, memory))
    assert pod_request(target, clamp=True) == expected
    if unclamped is None:
        assert pod_request(target) == expected
    else:
        with pytest.raises(ResourceError, match=unclamped):
            pod_request(target)


@pytest.mark.parametrize(
    ("target", "says"),
    [
        (pod("p", None, box("main", "lots")), "cpu has an invalid value"),
        (pod("p", None, box("main", "1", "-1Gi")), "memory must be between 0"),
        (pod("p", None, box("main", "-1e40")), "cpu has an invalid value"),
        (pod("p", None, box("main", "1x" + "0" * 200)), "cpu has an invalid value"),
    ],
)
def test_clamped_a_request_that_cannot_be_read_is_still_an_error(
    target: dict[str, Any], says: str
) -> None:
    with pytest.raises(ResourceError, match=says):
        pod_request(target, clamp=True)


def test_a_node_has_its_allocatable() -> None:
    assert node_allocatable(node("a", "7910m", "30Gi")) == Amount(7910, 30 * GI * MIB)


@pytest.mark.parametrize(
    ("target", "says"),
    [
        ({"metadata": {"name": "a"}}, "status.allocatable has no cpu and no memory"),
        ({"status": {"allocatable": {"cpu": "8"}}}, "status.allocatable has no memory"),
        (node("a", cpu="eight"), "cpu has an invalid value"),
        (node("a", cpu="1e12"), "cpu must be between 0 and 1000000 cores"),
        (node("a", memory="2Ei"), "memory must be between 0"),
        (node("a", memory="-1"), "memory must be between 0"),
        ({"status": ["x"]}, "status must be an object"),
    ],
)
def test_an_allocatable_that_cannot_be_read_is_an_error_naming_it(
    target: dict[str, Any], says: str
) -> None:
    with pytest.raises(ResourceError, match=says):
        node_allocatable(target)


# ---------------------------------------------------------------- what a node has free


def resources_with(*nodes: dict[str, Any]) -> NodeResources:
    resources = NodeResources(LocalKubeApi())
    resources.replace_nodes(list(nodes))
    return resources


def test_a_node_nobody_reported_is_unknown() -> None:
    resources = resources_with(node("a"))
    assert resources.free("a") == (8000.0, 32 * GI)
    assert resources.free("elsewhere") == UNKNOWN


def test_bound_pods_that_have_not_ended_count_on_their_node() -> None:
    resources = resources_with(node("a"), node("b"))
    resources.replace_pods(
        [
            pod("running", "a", box("m", "1", "1Gi")),
            pod("starting", "a", box("m", "500m", "512Mi"), phase="Pending"),
            pod("waiting", None, box("m", "4", "4Gi"), phase="Pending"),  # not bound
            pod("done", "a", box("m", "2", "2Gi"), phase="Succeeded"),
            pod("crashed", "a", box("m", "2", "2Gi"), phase="Failed"),
        ]
    )
    assert resources.free("a") == (6500.0, 32 * GI - 1536)
    assert resources.free("b") == (8000.0, 32 * GI)


def test_each_event_of_a_pod_replaces_what_it_counted() -> None:
    resources = resources_with(node("a"), node("b"))
    resources.apply_pod("ADDED", pod("p", None, box("m", "2", "1Gi"), phase="Pending"))
    assert resources.free("a")[0] == 8000.0
    resources.apply_pod("MODIFIED", pod("p", "a", box("m", "2", "1Gi"), phase="Pending"))
    resources.apply_pod("MODIFIED", pod("p", "a", box("m", "2", "1Gi")))  # Running: same count
    assert resources.free("a")[0] == 6000.0
    resources.apply_pod("MODIFIED", pod("p", "b", box("m", "2", "1Gi")))  # on another node now
    assert (resources.free("a")[0], resources.free("b")[0]) == (8000.0, 6000.0)
    resources.apply_pod("MODIFIED", pod("p", "b", box("m", "2", "1Gi"), phase="Succeeded"))
    assert resources.free("b")[0] == 8000.0


def test_a_deleted_pod_no_longer_counts() -> None:
    resources = resources_with(node("a"))
    resources.apply_pod("ADDED", pod("p", "a", box("m", "3", "3Gi")))
    resources.apply_pod("DELETED", pod("p", "a", box("m", "3", "3Gi")))
    assert resources.free("a") == (8000.0, 32 * GI)


def test_more_asked_than_a_node_has_is_negative_free() -> None:
    resources = resources_with(node("a", cpu="1"))
    resources.apply_pod("ADDED", pod("p", "a", box("m", "1500m", "1Gi")))
    assert resources.free("a")[0] == -500.0


def test_changed_nodes_are_reported_once_and_a_status_update_reports_none() -> None:
    resources = resources_with(node("a"), node("b"))
    assert resources.take_changed() == {"a", "b"}
    assert resources.take_changed() == set()
    running = pod("p", "a", box("m", "1", "1Gi"))
    resources.apply_pod("ADDED", running)
    assert resources.take_changed() == {"a"}
    resources.apply_pod("MODIFIED", {**running, "status": {"phase": "Running", "podIP": "1.2.3.4"}})
    resources.apply_node("MODIFIED", node("b"))  # a heartbeat: allocatable as before
    assert resources.take_changed() == set()
    resources.apply_node("MODIFIED", node("b", cpu="4"))
    resources.apply_node("DELETED", node("a"))
    assert resources.take_changed() == {"a", "b"}
    assert resources.free("a") == UNKNOWN


def test_a_list_replaces_everything_known_before() -> None:
    resources = resources_with(node("a"), node("gone"))
    resources.replace_pods([pod("old", "a", box("m", "4", "1Gi"))])
    resources.take_changed()
    resources.replace_nodes([node("a", cpu="6")])
    resources.replace_pods([pod("new", "a", box("m", "1", "1Gi"))])
    assert resources.free("a") == (5000.0, 31 * GI)
    assert resources.free("gone") == UNKNOWN
    assert resources.take_changed() == {"a", "gone"}


def test_a_pod_whose_request_cannot_be_read_makes_its_node_full_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    resources = resources_with(node("a"), node("b"))
    bad = pod("bad", "a", box("m", "a lot"))
    with caplog.at_level(logging.WARNING, logger="gpuslice_scheduler.resources"):
        resources.apply_pod("ADDED", bad)
        resources.apply_pod("MODIFIED", bad)
        resources.apply_pod("ADDED", pod("fine", "b", box("m", "1", "1Gi")))
    cpu, memory = resources.free("a")
    assert cpu < 0  # full: a tenant cannot make its node look empty with a bad quantity
    assert memory < 0
    assert resources.free("b") == (7000.0, 31 * GI)
    (record,) = caplog.records
    assert "pod team/bad (on a): container 'm': cpu has an invalid value" in record.message
    assert "looks full" in record.message
    resources.apply_pod("DELETED", bad)
    assert resources.free("a") == (8000.0, 32 * GI)


@pytest.mark.parametrize("huge", ["2000000", "1e40"])
def test_a_pod_bound_there_asking_above_the_bound_makes_its_node_full_not_unknown(
    huge: str, caplog: pytest.LogCaptureFixture
) -> None:
    resources = resources_with(node("a"), node("b"))
    hostile = pod("hostile", "a", box("m", huge, "1e40"))  # bound straight, not through us
    with caplog.at_level(logging.WARNING, logger="gpuslice_scheduler.resources"):
        resources.replace_pods([hostile, pod("fine", "a", box("m", "1", "1Gi"))])
        resources.apply_pod("MODIFIED", hostile)
    cpu, memory = resources.free("a")
    assert cpu == 8000.0 - MAX_CPU_MILLI - 1000
    assert memory == 32 * GI - MAX_MEMORY / MIB - GI
    assert cpu < 0  # full: nothing fits there, not infinitely free
    assert memory < 0
    assert resources.free("b") == (8000.0, 32 * GI)
    (record,) = caplog.records
    assert "pod team/hostile (on a) requests more CPU or memory than any node" in record.message
    resources.apply_pod("DELETED", hostile)
    assert resources.free("a") == (7000.0, 31 * GI)


def test_a_node_whose_allocatable_cannot_be_read_is_unknown_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="gpuslice_scheduler.resources"):
        resources = resources_with(node("huge", cpu="1e12"), node("fine"))
        resources.apply_node("MODIFIED", node("huge", cpu="1e12"))
        resources.apply_node("ADDED", {"metadata": {"name": "bare"}})
    assert resources.free("huge") == resources.free("bare") == UNKNOWN
    assert resources.free("fine") == (8000.0, 32 * GI)
    assert [r.message.split(":")[0] for r in caplog.records] == ["node huge", "node bare"]
    resources.apply_node("MODIFIED", node("huge", cpu="64"))
    assert resources.free("huge") == (64000.0, 32 * GI)


def test_a_bind_counts_at_once_and_the_watch_takes_its_place() -> None:
    resources = resources_with(node("a"))
    pending = pod("p", None, box("m", "2", "2Gi"), phase="Pending")
    resources.apply_pod("ADDED", pending)
    resources.assume(pending, "a")
    assert resources.free("a")[0] == 6000.0
    # the watch's events from before the Binding leave the count alone
    resources.apply_pod("MODIFIED", {**pending, "metadata": {**pending["metadata"], "x": 1}})
    assert resources.free("a")[0] == 6000.0
    bound = pod("p", "a", box("m", "2", "2Gi"), phase="Pending")
    resources.apply_pod("MODIFIED", bound)
    assert resources.free("a")[0] == 6000.0  # replaced, not added
    resources.assume(pending, "a")  # a retried bind
    resources.forget(pending)  # the watch counts it: nothing to take back
    assert resources.free("a")[0] == 6000.0
    resources.apply_pod("DELETED", bound)
    assert resources.free("a")[0] == 8000.0


def test_a_failed_bind_takes_its_count_back() -> None:
    resources = resources_with(node("a"))
    pending = pod("p", None, box("m", "2", "2Gi"), phase="Pending")
    resources.assume(pending, "a")
    resources.forget(pending)
    assert resources.free("a") == (8000.0, 32 * GI)


def test_a_list_keeps_a_bind_in_flight_and_drops_one_for_a_pod_gone() -> None:
    resources = resources_with(node("a"))
    flying = pod("flying", None, box("m", "1", "1Gi"), phase="Pending")
    gone = pod("gone", None, box("m", "2", "1Gi"), phase="Pending")
    resources.assume(flying, "a")
    resources.assume(gone, "a")
    resources.replace_pods([flying])  # not bound yet in the list; "gone" deleted
    assert resources.free("a")[0] == 7000.0


# ---------------------------------------------------------------- following, over HTTP


async def until(check: Callable[[], bool], timeout: float = 10.0) -> None:
    """Wait until ``check()``; fail the test after ``timeout`` seconds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"not true within {timeout}s")
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def following(kube: KubeApi) -> AsyncIterator[NodeResources]:
    resources = NodeResources(kube)
    task = asyncio.create_task(resources.run())
    try:
        yield resources
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@pytest.fixture
async def served(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[LocalKubeApi, KubernetesApi]]:
    store = LocalKubeApi()
    server = DevApiServer(store)
    async with server.serving():
        monkeypatch.setenv("KUBECONFIG", str(server.kubeconfig(tmp_path / "kubeconfig")))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        client = KubernetesApi.from_environment(timeout=3)
        try:
            yield store, client
        finally:
            await client.close()


async def test_nodes_and_pods_are_followed_through_the_dev_api_server(
    served: tuple[LocalKubeApi, KubernetesApi],
) -> None:
    store, client = served
    store.add_node(node("a"))
    store.add_pod(pod("listed", "a", box("m", "1", "1Gi")))
    async with following(client) as resources:
        await until(lambda: resources.free("a") == (7000.0, 31 * GI))
        store.add_node(node("b", cpu="4"))
        store.add_pod(pod("new", None, box("m", "2", "2Gi"), phase="Pending"))
        await store.bind_pod("team", "new", "uid-new", "b")
        await until(lambda: resources.free("b") == (2000.0, 30 * GI))
        store.set_phase("team", "listed", "Succeeded")
        store.set_allocatable("a", cpu="6")
        await until(lambda: resources.free("a") == (6000.0, 32 * GI))
        store.delete_pod("team", "new")
        store.delete_node("a")
        await until(lambda: resources.free("b") == (4000.0, 32 * GI))
        assert resources.free("a") == UNKNOWN


async def test_an_unreadable_node_is_unknown_and_logged_the_others_followed(
    served: tuple[LocalKubeApi, KubernetesApi], caplog: pytest.LogCaptureFixture
) -> None:
    store, client = served
    store.add_node(node("absurd", cpu="1e12"))
    store.add_node(node("garbled", memory="32 gigs"))
    store.add_node(node("fine"))
    with caplog.at_level(logging.WARNING, logger="gpuslice_scheduler.resources"):
        async with following(client) as resources:
            await until(lambda: resources.free("fine") == (8000.0, 32 * GI))
            store.set_allocatable("absurd", memory="64Gi")  # still absurd: not logged again
            store.set_allocatable("fine", cpu="2")
            await until(lambda: resources.free("fine")[0] == 2000.0)
            assert resources.free("absurd") == resources.free("garbled") == UNKNOWN
    logged = sorted(r.message for r in caplog.records)
    assert len(logged) == 2
    assert logged[0].startswith("node absurd: status.allocatable: cpu must be between 0 and")
    assert logged[1].startswith("node garbled: status.allocatable: memory has an invalid value")


# the test API server: every list and watch answered as the test says


def node_list(version: str, *items: dict[str, Any]) -> dict[str, Any]:
    return {"kind": "NodeList", "metadata": {"resourceVersion": version}, "items": list(items)}


def answers(lists: list[Any], watches: list[Stream]) -> Callable[[dict[str, str]], Any]:
    """Each list request gets the next of ``lists``, each watch the next of
    ``watches``; the last of each is answered again and again."""
    lists, watches = list(lists), list(watches)

    def answer(query: dict[str, str]) -> Any:
        queue: list[Any] = watches if query.get("watch") == "true" else lists
        return queue.pop(0) if len(queue) > 1 else queue[0]

    return answer


def quiet_pods(server: FakeApiServer) -> None:
    empty = {"kind": "PodList", "metadata": {"resourceVersion": "1"}, "items": []}
    server.answer("GET", "/api/v1/pods", 200, answers([empty], [Stream([], hold=30)]))


def node_requests(server: FakeApiServer) -> list[tuple[str | None, str | None]]:
    """(watch, resourceVersion) of each request for nodes so far."""
    asked: list[Recorded] = [r for r in server.requests if r.path.startswith("/api/v1/nodes")]
    return [(r.query.get("watch"), r.query.get("resourceVersion")) for r in asked]


@pytest.fixture
async def client(kube_api_server: FakeApiServer) -> AsyncIterator[KubernetesApi]:
    api = KubernetesApi.connect(kube_api_server.host, timeout=3)
    try:
        yield api
    finally:
        await api.close()


async def test_a_watch_whose_version_is_gone_is_followed_by_a_fresh_list(
    kube_api_server: FakeApiServer, client: KubernetesApi
) -> None:
    server = kube_api_server
    quiet_pods(server)
    gone = status_body(410, "Expired", "too old resource version: 5 (9)")
    server.answer(
        "GET",
        "/api/v1/nodes",
        200,
        answers(
            [node_list("5", node("a")), node_list("9", node("a", cpu="4"), node("b"))],
            [Stream([{"type": "ERROR", "object": gone}]), Stream([], hold=30)],
        ),
    )
    async with following(client) as resources:
        await until(lambda: resources.free("b") == (8000.0, 32 * GI))
        assert resources.free("a") == (4000.0, 32 * GI)
        await until(lambda: len(node_requests(server)) == 4)
    assert node_requests(server) == [(None, None), ("true", "5"), (None, None), ("true", "9")]


async def test_a_watch_broken_mid_stream_is_followed_by_a_fresh_list(
    kube_api_server: FakeApiServer, client: KubernetesApi, caplog: pytest.LogCaptureFixture
) -> None:
    server = kube_api_server
    quiet_pods(server)
    shrunk = {"type": "MODIFIED", "object": node("a", cpu="6")}
    server.answer(
        "GET",
        "/api/v1/nodes",
        200,
        answers(
            [node_list("5", node("a")), node_list("7", node("a", cpu="2"))],
            [Stream([shrunk], cut=True), Stream([], hold=30)],
        ),
    )
    with caplog.at_level(logging.INFO, logger="gpuslice_scheduler.reflector"):
        async with following(client) as resources:
            await until(lambda: resources.free("a")[0] == 2000.0)
            await until(lambda: len(node_requests(server)) == 4)
    assert node_requests(server) == [(None, None), ("true", "5"), (None, None), ("true", "7")]
    warned = [r.message for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1
    assert warned[0].startswith("cannot follow the nodes (trying again): cannot reach")
    assert "following the nodes again" in [r.message for r in caplog.records]


async def test_a_failing_api_is_logged_once_and_retried(
    kube_api_server: FakeApiServer, client: KubernetesApi, caplog: pytest.LogCaptureFixture
) -> None:
    server = kube_api_server
    quiet_pods(server)
    denied = status_body(403, "Forbidden", 'nodes is forbidden: User "x" cannot list "nodes"')
    server.answer("GET", "/api/v1/nodes", 403, denied)
    with caplog.at_level(logging.WARNING, logger="gpuslice_scheduler.reflector"):
        async with following(client) as resources:
            await until(lambda: len(node_requests(server)) >= 3)  # it keeps trying
            server.answer(
                "GET", "/api/v1/nodes", 200, answers([node_list("3", node("a"))], [Stream([], 30)])
            )
            await until(lambda: resources.free("a") == (8000.0, 32 * GI), timeout=20)
    (warning,) = caplog.records
    assert "HTTP 403 Forbidden" in warning.message
