"""Fixtures of the webhook's tests: AdmissionReview builders, the patch applied with
an independent RFC 6902 implementation (jsonpatch), and the webhook serving HTTPS
with a test certificate authority (trustme)."""

from __future__ import annotations

import base64
import copy
import json
import ssl
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import jsonpatch
import pytest
import trustme

from gpuslice_common.config import WebhookSettings
from gpuslice_common.servers import free_port
from gpuslice_webhook.admission import Admission
from gpuslice_webhook.metrics import Metrics
from gpuslice_webhook.service import Running, running

V1 = "admission.k8s.io/v1"
V1BETA1 = "admission.k8s.io/v1beta1"
GPU = "nvidia.com/gpu"
MEM = "nvidia.com/gpumem"
MEM_PCT = "nvidia.com/gpumem-percentage"
CORES = "nvidia.com/gpucores"
PRIORITY = "nvidia.com/priority"


def settings(**overrides: Any) -> WebhookSettings:
    """Webhook settings for tests: no Kubernetes API, plain HTTP on loopback."""
    values: dict[str, Any] = {
        "kube_api": "none",
        "listen_host": "127.0.0.1",
        "metrics_host": "127.0.0.1",
        "metrics_port": free_port(),
    }
    values.update(overrides)
    return WebhookSettings(**values)


def container(name: str, limits: dict[str, Any] | None = None, **fields: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {"name": name, "image": "registry.example/app:1"}
    if limits is not None:
        spec["resources"] = {"limits": dict(limits)}
    spec.update(fields)
    return spec


def pod(
    *containers: dict[str, Any],
    init: list[dict[str, Any]] | None = None,
    name: str = "trainer",
    namespace: str | None = None,
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    **spec: Any,
) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name}
    if namespace is not None:
        metadata["namespace"] = namespace
    if labels is not None:
        metadata["labels"] = labels
    if annotations is not None:
        metadata["annotations"] = annotations
    body: dict[str, Any] = {"containers": list(containers), **spec}
    if init is not None:
        body["initContainers"] = init
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": body}


def review(
    obj: dict[str, Any] | None,
    *,
    version: str = V1,
    operation: str = "CREATE",
    namespace: str = "team-a",
    uid: str | None = None,
    dry_run: bool = False,
    kind: str = "Pod",
) -> dict[str, Any]:
    """An AdmissionReview request as the API server sends it for a pod."""
    resource = "pods" if kind == "Pod" else kind.lower() + "s"
    request: dict[str, Any] = {
        "uid": uid or str(uuid.uuid4()),
        "kind": {"group": "", "version": "v1", "kind": kind},
        "resource": {"group": "", "version": "v1", "resource": resource},
        "requestKind": {"group": "", "version": "v1", "kind": kind},
        "requestResource": {"group": "", "version": "v1", "resource": resource},
        "name": (obj or {}).get("metadata", {}).get("name", ""),
        "namespace": namespace,
        "operation": operation,
        "userInfo": {"username": "alice", "groups": ["system:authenticated"]},
        "object": obj,
        "oldObject": None,
        "dryRun": dry_run,
        "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"},
    }
    return {"apiVersion": version, "kind": "AdmissionReview", "request": request}


def check_response(sent: dict[str, Any], answer: dict[str, Any]) -> dict[str, Any]:
    """Check the envelope the contract requires and return ``response``."""
    assert answer["apiVersion"] == sent["apiVersion"]
    assert answer["kind"] == "AdmissionReview"
    response = answer["response"]
    assert response["uid"] == sent["request"]["uid"]
    assert isinstance(response["allowed"], bool)
    assert ("patch" in response) == ("patchType" in response)
    if "patch" in response:
        assert response["patchType"] == "JSONPatch"
        assert response["allowed"] is True
    if not response["allowed"]:
        status = response["status"]
        assert isinstance(status["code"], int)
        assert status["message"]
    return response


def decoded_patch(response: dict[str, Any]) -> list[dict[str, Any]]:
    if "patch" not in response:
        return []
    ops = json.loads(base64.b64decode(response["patch"], validate=True))
    assert isinstance(ops, list)
    return ops


def applied(obj: dict[str, Any], response: dict[str, Any]) -> dict[str, Any]:
    """The pod after the response's patch (jsonpatch, an independent implementation)."""
    return jsonpatch.apply_patch(copy.deepcopy(obj), decoded_patch(response))


def gpu_env(name: str, priority: int = 1, *, policy: str | None = None) -> list[dict[str, Any]]:
    """What the webhook appends to a GPU container's env, in its order."""
    env: list[dict[str, Any]] = [{"name": "CUDA_TASK_PRIORITY", "value": str(priority)}]
    if policy is not None:
        env.append({"name": "GPU_CORE_UTILIZATION_POLICY", "value": policy})
    for var, path in (
        ("GPUSLICE_POD_NAME", "metadata.name"),
        ("GPUSLICE_POD_NAMESPACE", "metadata.namespace"),
        ("GPUSLICE_POD_UID", "metadata.uid"),
        ("GPUSLICE_NODE_NAME", "spec.nodeName"),
    ):
        field = {"fieldRef": {"apiVersion": "v1", "fieldPath": path}}
        env.append({"name": var, "valueFrom": field})
    env.append({"name": "GPUSLICE_CONTAINER_NAME", "value": name})
    return env


HIDDEN = [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "none"}]


@pytest.fixture
def admit() -> Callable[..., Any]:
    """Run one review through :class:`Admission` in-process: (status, answer)."""

    async def run(body: dict[str, Any], **overrides: Any) -> tuple[int, dict[str, Any]]:
        admission = Admission(settings(**overrides), Metrics())
        status, raw = await admission.handle(json.dumps(body).encode())
        return status, json.loads(raw)

    return run


# ---------------------------------------------------------------- HTTPS


@pytest.fixture(scope="session")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
def tls_files(ca: trustme.CA, tmp_path: Path) -> tuple[Path, Path]:
    cert_file, key_file = tmp_path / "tls.crt", tmp_path / "tls.key"
    write_cert(ca.issue_cert(*CERT_NAMES), cert_file, key_file)
    return cert_file, key_file


CERT_NAMES = ("127.0.0.1", "localhost", "gpuslice-webhook.gpuslice.svc")


def write_cert(cert: trustme.LeafCert, cert_file: Path, key_file: Path) -> None:
    """Write a leaf certificate (with its chain) and its key as a Secret mount holds them."""
    cert_file.write_bytes(b"".join(pem.bytes() for pem in cert.cert_chain_pems))
    key_file.write_bytes(cert.private_key_pem.bytes())


def trusting(ca_file: Path) -> ssl.SSLContext:
    """A client context that trusts only the test CA."""
    return ssl.create_default_context(cafile=str(ca_file))


@pytest.fixture
def ca_file(ca: trustme.CA, tmp_path: Path) -> Path:
    path = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(path))
    return path


@pytest.fixture
async def https_webhook(tls_files: tuple[Path, Path]) -> AsyncIterator[Running]:
    """The webhook serving HTTPS on a free loopback port, no NATS, no Kubernetes API."""
    cert_file, key_file = tls_files
    config = settings(
        listen_port=free_port(),
        tls_cert_file=str(cert_file),
        tls_key_file=str(key_file),
        tls_reload_interval=0.05,
    )
    async with running(config, None, None) as state:
        yield state


@pytest.fixture
async def client(https_webhook: Running, ca_file: Path) -> AsyncIterator[httpx.AsyncClient]:
    base = f"https://127.0.0.1:{https_webhook.port}"
    async with httpx.AsyncClient(base_url=base, verify=trusting(ca_file), timeout=10) as c:
        yield c
