"""A small Kubernetes API server for the local stack.

It serves, over HTTP, the part of the core/v1 API that gpuslice's services use,
from a :class:`~gpuslice_common.kube.LocalKubeApi` held by the cluster driver:

* ``GET /api/v1/namespaces/{ns}/pods/{name}``, ``PATCH`` of the same path
  (a JSON merge patch of ``metadata.annotations`` only),
  ``POST .../pods/{name}/binding``;
* ``POST .../pods/{name}/eviction`` (``policy/v1`` Eviction: PodDisruptionBudgets
  honoured, 429 where one allows no disruption; ``dryRun``; a UID precondition),
  ``PATCH .../pods/{name}/status`` (a merge patch of ``status.nominatedNodeName``
  only);
* ``POST`` and ``GET /api/v1/namespaces/{ns}/events`` (core/v1 Events);
* ``POST`` and ``GET /apis/policy/v1/namespaces/{ns}/poddisruptionbudgets``
  (``matchLabels`` selectors; the status computed at each read);
* ``GET /api/v1/namespaces/{name}``, ``GET /api/v1/namespaces/{ns}/resourcequotas``;
* ``GET /api/v1/namespaces/{ns}/pods`` (``fieldSelector`` for pods that have not
  terminated), ``GET /api/v1/pods`` and its ``watch=true`` stream;
* ``GET /api/v1/nodes`` and its ``watch=true`` stream (the nodes the driver added);
* ``resource.k8s.io/v1`` (DRA): ``GET`` and ``POST`` of the collections of
  ResourceSlices and DeviceClasses (cluster-scoped) and of ResourceClaims and
  ResourceClaimTemplates (per namespace, and ``GET /apis/resource.k8s.io/v1/<plural>``
  across namespaces), ``GET``, ``PUT`` and ``DELETE`` of one (a UID
  precondition honoured), ``PUT .../resourceclaims/{name}/status``;
* ``POST /apis/authentication.k8s.io/v1/tokenreviews``: the projected
  ServiceAccount tokens the driver minted (``LocalKubeApi.tokens``) are reviewed
  as the API server reviews them (the inventory's auth callout asks);
* ``POST /apis/authorization.k8s.io/v1/subjectaccessreviews``: answered from
  ``LocalKubeApi.access`` (the web console asks), which grants nothing unless
  the driver says so.

So every service runs exactly the code it runs on a cluster (``KubernetesApi``
through a kubeconfig), and the driver sees what they do. Every request must
carry the bearer token of the kubeconfig :meth:`DevApiServer.kubeconfig`
writes; anything else is answered with a Kubernetes ``Status`` naming the
problem.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from gpuslice_common.kube import (
    RUNNING_PODS,
    Conflict,
    EvictionRefused,
    KubeError,
    LocalKubeApi,
    NotFound,
    ObjectRef,
    WatchEvent,
    WatchExpired,
)
from gpuslice_common.service import http_server, plain_http

MERGE_PATCH = "application/merge-patch+json"
MAX_BODY = 16 * 1024 * 1024  # objects the API server stores are at most about 1.5 MiB


class Unauthorized(Exception):
    """A request without the kubeconfig's bearer token."""


Watched = WatchEvent | WatchExpired | None  # None: the server is stopping


class Watches:
    """The watch streams being served. They are ended when the server stops: a
    client still watching (a service that outlives an attached driver) would
    otherwise have its response cancelled when the event loop closes, which
    uvicorn logs as an exception in the application."""

    def __init__(self) -> None:
        self.open: set[asyncio.Queue[Watched]] = set()
        self.closing = False

    def end_all(self) -> None:
        """End every stream now, and any that starts from now on at once."""
        self.closing = True
        for queue in self.open:
            queue.put_nowait(None)


def status_body(code: int, reason: str, message: str) -> dict[str, Any]:
    """A Kubernetes ``Status``, as the API server answers failures."""
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure" if code >= 400 else "Success",
        "message": message,
        "reason": reason,
        "code": code,
    }


def status(code: int, reason: str, message: str) -> JSONResponse:
    return JSONResponse(status_body(code, reason, message), status_code=code)


def a_list(kind: str, items: list[dict[str, Any]], version: str) -> dict[str, Any]:
    return {
        "kind": kind,
        "apiVersion": "v1",
        "metadata": {"resourceVersion": version},
        "items": items,
    }


DRA_API = "resource.k8s.io/v1"
DRA_CLUSTER_KINDS = {"resourceslices": "ResourceSlice", "deviceclasses": "DeviceClass"}
DRA_NAMESPACED_KINDS = {
    "resourceclaims": "ResourceClaim",
    "resourceclaimtemplates": "ResourceClaimTemplate",
}


def create_app(kube: LocalKubeApi, token: str) -> FastAPI:
    async def authenticate(request: Request) -> None:
        if request.headers.get("authorization") != f"Bearer {token}":
            raise Unauthorized

    # A dependency and exception handlers, not an HTTP middleware: that one
    # wraps streamed responses (watches) and logs their cancellation at shutdown.
    app = FastAPI(
        title="gpuslice dev API server",
        docs_url=None,
        redoc_url=None,
        dependencies=[Depends(authenticate)],
    )
    watches = app.state.watches = Watches()
    answers: list[tuple[type[Exception], int, str]] = [
        (Unauthorized, 401, "Unauthorized"),
        (EvictionRefused, 429, "TooManyRequests"),
        (Conflict, 409, "Conflict"),
        (NotFound, 404, "NotFound"),
        (KubeError, 422, "Invalid"),
    ]
    for error, code, reason in answers:

        def handler(_: Request, exc: Exception, code: int = code, reason: str = reason) -> Response:
            message = str(exc) or "Unauthorized: no or a wrong bearer token"
            return status(code, reason, message)

        app.add_exception_handler(error, handler)

    async def body_of(request: Request) -> dict[str, Any]:
        try:
            body = json.loads(await request.body())
        except ValueError:
            raise KubeError("the request body is not JSON") from None
        if not isinstance(body, dict):
            raise KubeError("the request body is not a JSON object")
        return body

    @app.get("/api/v1/namespaces/{namespace}/pods/{name}")
    async def get_pod(namespace: str, name: str) -> dict[str, Any]:
        return await kube.get_pod(namespace, name)

    @app.patch("/api/v1/namespaces/{namespace}/pods/{name}")
    async def patch_pod(namespace: str, name: str, request: Request) -> Response:
        if request.headers.get("content-type") != MERGE_PATCH:
            return status(415, "UnsupportedMediaType", f"only {MERGE_PATCH} is served here")
        patch = await body_of(request)
        metadata = patch.get("metadata")
        annotations = metadata.get("annotations") if isinstance(metadata, dict) else None
        if set(patch) != {"metadata"} or set(metadata or {}) != {"annotations"}:
            raise KubeError("this API server patches metadata.annotations only")
        if not isinstance(annotations, dict) or not all(
            isinstance(v, str | None) for v in annotations.values()
        ):
            raise KubeError("metadata.annotations must map names to strings or null")
        await kube.patch_pod_annotations(namespace, name, annotations)
        return JSONResponse(await kube.get_pod(namespace, name))

    @app.post("/api/v1/namespaces/{namespace}/pods/{name}/binding", status_code=201)
    async def bind(namespace: str, name: str, request: Request) -> Response:
        binding = await body_of(request)
        target = binding.get("target")
        node = target.get("name") if isinstance(target, dict) else None
        metadata = binding.get("metadata")
        uid = metadata.get("uid") if isinstance(metadata, dict) else None
        if binding.get("kind") != "Binding" or not isinstance(node, str) or not node:
            raise KubeError("a Binding with target.name is expected")
        await kube.bind_pod(namespace, name, uid if isinstance(uid, str) else "", node)
        return status(201, "", "")

    @app.post("/api/v1/namespaces/{namespace}/pods/{name}/eviction", status_code=201)
    async def evict(namespace: str, name: str, request: Request) -> Response:
        eviction = await body_of(request)
        metadata = eviction.get("metadata")
        options = eviction.get("deleteOptions") or {}
        if eviction.get("kind") != "Eviction" or eviction.get("apiVersion") != "policy/v1":
            raise KubeError("a policy/v1 Eviction is expected")
        if not isinstance(metadata, dict) or metadata.get("name") != name:
            return status(400, "BadRequest", "name in URL does not match name in Eviction object")
        if metadata.get("namespace") not in (None, namespace):
            return status(400, "BadRequest", "namespace in URL does not match the Eviction's")
        if not isinstance(options, dict):
            raise KubeError("deleteOptions must be an object")
        preconditions = options.get("preconditions") or {}
        uid = preconditions.get("uid") if isinstance(preconditions, dict) else None
        dry = options.get("dryRun") or []
        if not isinstance(dry, list) or not set(dry) <= {"All"}:
            raise KubeError("deleteOptions.dryRun may only be [] or [All]")
        await kube.evict_pod(
            namespace, name, uid if isinstance(uid, str) else "", dry_run=bool(dry)
        )
        return status(201, "", "")

    @app.patch("/api/v1/namespaces/{namespace}/pods/{name}/status")
    async def patch_status(namespace: str, name: str, request: Request) -> Response:
        if request.headers.get("content-type") != MERGE_PATCH:
            return status(415, "UnsupportedMediaType", f"only {MERGE_PATCH} is served here")
        patch = await body_of(request)
        fields = patch.get("status")
        if (
            set(patch) != {"status"}
            or not isinstance(fields, dict)
            or set(fields) != {"nominatedNodeName"}
        ):
            raise KubeError("this API server patches status.nominatedNodeName only")
        if not isinstance(fields["nominatedNodeName"], str | None):
            raise KubeError("status.nominatedNodeName must be a string or null")
        await kube.patch_pod_status(namespace, name, fields)
        return JSONResponse(await kube.get_pod(namespace, name))

    @app.post("/api/v1/namespaces/{namespace}/events", status_code=201)
    async def create_event(namespace: str, request: Request) -> Response:
        event = await body_of(request)
        involved = event.get("involvedObject")
        metadata = event.get("metadata")
        if event.get("kind") != "Event" or not isinstance(involved, dict):
            raise KubeError("an Event with involvedObject is expected")
        if isinstance(metadata, dict) and metadata.get("namespace") not in (None, namespace):
            raise KubeError("the Event's namespace does not match the URL's")
        if involved.get("namespace") not in (None, namespace):
            raise KubeError("involvedObject.namespace does not match the Event's namespace")
        for key in ("reason", "message"):
            if not isinstance(event.get(key), str) or len(event[key]) > 4096:
                raise KubeError(f"{key} must be a string of at most 4096 characters")
        if event.get("type") not in ("Normal", "Warning"):
            raise KubeError("type must be Normal or Warning")
        await kube.create_event(namespace, event)
        return JSONResponse(kube.events[-1], status_code=201)

    @app.get("/api/v1/namespaces/{namespace}/events")
    async def list_events(namespace: str) -> dict[str, Any]:
        items = [e for e in kube.events if e["metadata"]["namespace"] == namespace]
        return a_list("EventList", items, kube.resource_version)

    @app.post("/apis/policy/v1/namespaces/{namespace}/poddisruptionbudgets", status_code=201)
    async def create_pdb(namespace: str, request: Request) -> dict[str, Any]:
        budget = await body_of(request)
        if budget.get("kind") != "PodDisruptionBudget":
            raise KubeError("a PodDisruptionBudget is expected")
        return kube.add_pdb(namespace, budget)

    @app.get("/apis/policy/v1/namespaces/{namespace}/poddisruptionbudgets")
    async def list_pdbs(namespace: str) -> dict[str, Any]:
        listed = a_list("PodDisruptionBudgetList", kube.list_pdbs(namespace), kube.resource_version)
        listed["apiVersion"] = "policy/v1"
        return listed

    def resource_ref(plural: str, namespace: str | None, name: str | None = None) -> ObjectRef:
        cluster_scoped = plural in DRA_CLUSTER_KINDS
        if plural not in DRA_CLUSTER_KINDS and plural not in DRA_NAMESPACED_KINDS:
            raise NotFound(f"the server could not find the requested resource ({plural})")
        if cluster_scoped == (namespace is not None):
            raise NotFound(f"{plural} is {'not ' if cluster_scoped else ''}namespaced")
        return ObjectRef(DRA_API, plural, namespace, name)

    def resource_list(plural: str, items: list[dict[str, Any]], version: str) -> dict[str, Any]:
        kind = DRA_CLUSTER_KINDS.get(plural) or DRA_NAMESPACED_KINDS[plural]
        listed = a_list(f"{kind}List", items, version)
        listed["apiVersion"] = DRA_API
        return listed

    async def list_resources(
        plural: str, namespace: str | None, labelSelector: str
    ) -> dict[str, Any]:
        ref = resource_ref(plural, namespace) if namespace else None
        if ref is None:  # every namespace's, or a cluster-scoped kind's
            resource_ref(plural, None if plural in DRA_CLUSTER_KINDS else "x")
            ref = ObjectRef(DRA_API, plural)
        listed = await kube.list_objects(ref, label_selector=labelSelector)
        return resource_list(plural, listed, listed.resource_version)

    @app.get("/apis/resource.k8s.io/v1/{plural}")
    async def list_all_resources(plural: str, labelSelector: str = "") -> dict[str, Any]:
        return await list_resources(plural, None, labelSelector)

    @app.get("/apis/resource.k8s.io/v1/namespaces/{namespace}/{plural}")
    async def list_namespaced(
        plural: str, namespace: str, labelSelector: str = ""
    ) -> dict[str, Any]:
        return await list_resources(plural, namespace, labelSelector)

    @app.post("/apis/resource.k8s.io/v1/{plural}")
    async def create_cluster_resource(plural: str, request: Request) -> Response:
        made = await kube.create_object(resource_ref(plural, None), await body_of(request))
        return JSONResponse(made, status_code=201)

    @app.post("/apis/resource.k8s.io/v1/namespaces/{namespace}/{plural}")
    async def create_resource(plural: str, namespace: str, request: Request) -> Response:
        made = await kube.create_object(resource_ref(plural, namespace), await body_of(request))
        return JSONResponse(made, status_code=201)

    @app.get("/apis/resource.k8s.io/v1/{plural}/{name}")
    async def get_cluster_resource(plural: str, name: str) -> dict[str, Any]:
        return await kube.get_object(resource_ref(plural, None, name))

    @app.get("/apis/resource.k8s.io/v1/namespaces/{namespace}/{plural}/{name}")
    async def get_resource(plural: str, namespace: str, name: str) -> dict[str, Any]:
        return await kube.get_object(resource_ref(plural, namespace, name))

    @app.put("/apis/resource.k8s.io/v1/{plural}/{name}")
    async def replace_cluster_resource(plural: str, name: str, request: Request) -> dict[str, Any]:
        return await kube.replace_object(resource_ref(plural, None, name), await body_of(request))

    @app.put("/apis/resource.k8s.io/v1/namespaces/{namespace}/{plural}/{name}")
    async def replace_resource(
        plural: str, namespace: str, name: str, request: Request
    ) -> dict[str, Any]:
        ref = resource_ref(plural, namespace, name)
        return await kube.replace_object(ref, await body_of(request))

    @app.put("/apis/resource.k8s.io/v1/namespaces/{namespace}/{plural}/{name}/status")
    async def replace_status(
        plural: str, namespace: str, name: str, request: Request
    ) -> dict[str, Any]:
        ref = resource_ref(plural, namespace, name)
        return await kube.replace_object(ref, await body_of(request), subresource="status")

    async def delete_resource_at(ref: ObjectRef, request: Request) -> dict[str, Any]:
        raw = await request.body()
        options = await body_of(request) if raw.strip() else {}
        uid = (options.get("preconditions") or {}).get("uid") or ""
        await kube.delete_object(ref, uid=str(uid))
        return status_body(200, "", "deleted")

    @app.delete("/apis/resource.k8s.io/v1/{plural}/{name}")
    async def delete_cluster_resource(plural: str, name: str, request: Request) -> dict[str, Any]:
        return await delete_resource_at(resource_ref(plural, None, name), request)

    @app.delete("/apis/resource.k8s.io/v1/namespaces/{namespace}/{plural}/{name}")
    async def delete_resource(
        plural: str, namespace: str, name: str, request: Request
    ) -> dict[str, Any]:
        return await delete_resource_at(resource_ref(plural, namespace, name), request)

    @app.get("/api/v1/namespaces/{name}")
    async def get_namespace(name: str) -> dict[str, Any]:
        return await kube.get_namespace(name)

    @app.get("/api/v1/namespaces/{namespace}/resourcequotas")
    async def list_quotas(namespace: str) -> dict[str, Any]:
        items = await kube.list_resource_quotas(namespace)
        return a_list("ResourceQuotaList", items, kube.resource_version)

    @app.get("/api/v1/namespaces/{namespace}/pods")
    async def list_pods(namespace: str, fieldSelector: str = "") -> Response:
        if fieldSelector not in ("", RUNNING_PODS):
            return status(400, "BadRequest", f"field selector not served: {fieldSelector}")
        if fieldSelector:
            items = await kube.list_pods(namespace)
        else:
            items = [
                p for p in await kube.list_all_pods() if p["metadata"]["namespace"] == namespace
            ]
        return JSONResponse(a_list("PodList", items, kube.resource_version))

    @app.get("/api/v1/pods")
    async def all_pods(
        watch: bool = False,
        resourceVersion: str = "",
        timeoutSeconds: int = 300,
    ) -> Response:
        if not watch:
            listed = await kube.list_all_pods()
            return JSONResponse(a_list("PodList", listed, listed.resource_version))
        return await _watch(kube.watch_pods(resourceVersion), timeoutSeconds, watches)

    @app.get("/api/v1/nodes")
    async def all_nodes(
        watch: bool = False,
        resourceVersion: str = "",
        timeoutSeconds: int = 300,
    ) -> Response:
        if not watch:
            listed = await kube.list_nodes()
            return JSONResponse(a_list("NodeList", listed, listed.resource_version))
        return await _watch(kube.watch_nodes(resourceVersion), timeoutSeconds, watches)

    @app.post("/apis/authentication.k8s.io/v1/tokenreviews", status_code=201)
    async def review_token(request: Request) -> dict[str, Any]:
        review = await body_of(request)
        spec = review.get("spec")
        token = spec.get("token") if isinstance(spec, dict) else None
        audiences = spec.get("audiences") if isinstance(spec, dict) else None
        if review.get("kind") != "TokenReview" or not isinstance(token, str):
            raise KubeError("a TokenReview with spec.token is expected")
        if not isinstance(audiences, list) or not all(isinstance(a, str) for a in audiences):
            audiences = []
        return {
            "kind": "TokenReview",
            "apiVersion": "authentication.k8s.io/v1",
            "metadata": {},
            "spec": {"audiences": audiences},
            "status": await kube.review_token(token, audiences),
        }

    @app.post("/apis/authorization.k8s.io/v1/subjectaccessreviews", status_code=201)
    async def review_access(request: Request) -> dict[str, Any]:
        review = await body_of(request)
        if review.get("kind") != "SubjectAccessReview":
            raise KubeError("a SubjectAccessReview is expected")
        spec = review.get("spec")
        return {
            "kind": "SubjectAccessReview",
            "apiVersion": "authorization.k8s.io/v1",
            "metadata": {},
            "spec": spec if isinstance(spec, dict) else {},
            "status": kube.access.review(spec),
        }

    return app


async def _watch(events: AsyncIterator[WatchEvent], seconds: int, watches: Watches) -> Response:
    """A watch's answer: a 410 Status for a forgotten version, else the stream."""
    # The watch is read by a task of its own into a queue: waiting on the
    # queue with a timeout never cancels (and so ends) the watch itself.
    queue: asyncio.Queue[Watched] = asyncio.Queue()
    pump = asyncio.create_task(_pump(events, queue))
    try:
        first = await asyncio.wait_for(queue.get(), 0.05)
    except TimeoutError:
        first = None
    if isinstance(first, WatchExpired):
        pump.cancel()
        return status(410, "Expired", str(first))
    return StreamingResponse(
        _stream(queue, pump, first, seconds, watches), media_type="application/json"
    )


async def _pump(events: AsyncIterator[WatchEvent], queue: asyncio.Queue[Watched]) -> None:
    try:
        async for event in events:
            queue.put_nowait(event)
    except WatchExpired as exc:
        queue.put_nowait(exc)


async def _stream(
    queue: asyncio.Queue[Watched],
    pump: asyncio.Task[None],
    first: Watched,
    seconds: int,
    watches: Watches,
) -> AsyncIterator[bytes]:
    """A watch's lines until ``seconds`` pass (then the client watches again) or
    the server stops."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + max(1, seconds)
    watches.open.add(queue)
    try:
        if isinstance(first, WatchExpired):
            yield _line(("ERROR", status_body(410, "Expired", str(first))))
            return
        if first is not None:
            yield _line(first)
        while not watches.closing and (left := deadline - loop.time()) > 0:
            try:
                event = await asyncio.wait_for(queue.get(), left)
            except TimeoutError:
                return
            if event is None:
                return
            if isinstance(event, WatchExpired):
                yield _line(("ERROR", status_body(410, "Expired", str(event))))
                return
            yield _line(event)
    finally:
        watches.open.discard(queue)
        pump.cancel()


def _line(event: tuple[str, dict[str, Any]]) -> bytes:
    kind, obj = event
    return json.dumps({"type": kind, "object": obj}).encode() + b"\n"


class DevApiServer:
    """The API server over ``kube``, on a loopback port, for the block of a ``with``."""

    def __init__(
        self, kube: LocalKubeApi, host: str = "127.0.0.1", port: int = 0, token: str = ""
    ) -> None:
        """Without ``token``, a fresh random one (a fixed one lets services that
        outlive a restart of the driver keep the kubeconfig they read)."""
        self.kube = kube
        self.host = host
        self.port = port
        self.token = token or secrets.token_urlsafe(24)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def kubeconfig(self, path: Path, server: str | None = None) -> Path:
        """Write a kubeconfig (JSON is YAML) that reaches this server (at ``server``
        when the services reach it by another name); return its path."""
        name = "gpuslice-dev"
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": name, "cluster": {"server": server or self.url}}],
            "users": [{"name": name, "user": {"token": self.token}}],
            "contexts": [{"name": name, "context": {"cluster": name, "user": name}}],
            "current-context": name,
        }
        # written whole, then moved: a service never reads half a file
        partial = path.with_name(f".{path.name}.partial")
        partial.write_text(json.dumps(config, indent=2))
        partial.chmod(0o600)
        partial.replace(path)
        return path

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[DevApiServer]:
        app = create_app(self.kube, self.token)
        config = plain_http(app, self.host, self.port, "warning")
        async with http_server(
            config, "dev-apiserver", max_body=MAX_BODY, handle_signals=False
        ) as (server, _):
            if not self.port:
                self.port = server.servers[0].sockets[0].getsockname()[1]
            try:
                yield self
            finally:
                # before uvicorn stops: open watches end as responses do
                app.state.watches.end_all()
