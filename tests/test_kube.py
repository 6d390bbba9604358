"""The Kubernetes API door: KubernetesApi against a real local HTTP server that
records every request and answers with canned JSON, and LocalKubeApi's rules."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from gpuslice_common.kube import (
    Conflict,
    KubeApi,
    KubeError,
    KubernetesApi,
    LocalKubeApi,
    PodNotFound,
)

POD_PATH = "/api/v1/namespaces/ns/pods/name"

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


def status_body(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure" if code >= 400 else "Success",
        "message": message,
        "reason": reason,
        "code": code,
    }


@dataclass
class Recorded:
    method: str
    path: str
    headers: dict[str, str]
    body: Any


@dataclass
class FakeApiServer:
    """Answers (method, path) from ``routes`` with (status, JSON body[, delay]);
    anything else gets a 404 Status."""

    host: str = ""
    requests: list[Recorded] = field(default_factory=list)
    routes: dict[tuple[str, str], tuple[int, Any, float]] = field(default_factory=dict)

    def answer(self, method: str, path: str, status: int, body: Any, delay: float = 0.0) -> None:
        self.routes[(method, path)] = (status, body, delay)


def make_handler(state: FakeApiServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _serve(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            body = json.loads(raw) if raw else None
            headers = {key.lower(): value for key, value in self.headers.items()}
            state.requests.append(Recorded(self.command, self.path, headers, body))
            status, answer, delay = state.routes.get(
                (self.command, self.path.split("?")[0]),
                (404, status_body(404, "NotFound", "the server could not find it"), 0.0),
            )
            if delay:
                time.sleep(delay)
            data = json.dumps(answer).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except OSError:
                pass  # the client gave up (timeout test)

        do_GET = do_POST = do_PATCH = _serve

    return Handler


@pytest.fixture
def server() -> Iterator[FakeApiServer]:
    state = FakeApiServer()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(state))
    httpd.daemon_threads = False  # server_close() waits for every handler
    state.host = f"http://127.0.0.1:{httpd.server_address[1]}"
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield state
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)


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


async def test_local_satisfies_the_interface() -> None:
    api: KubeApi = local_with_pod()
    await api.bind_pod("ns", "name", "uid-1", "node-a")
    await api.close()
    assert isinstance(api, LocalKubeApi)
    assert api.closed
