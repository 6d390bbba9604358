"""The one small door through which gpuslice services talk to the Kubernetes API server.

:class:`KubeApi` is the interface: read a Pod, merge-patch its annotations, bind it
to a node; read a Namespace, list a namespace's ResourceQuotas and its pods that
have not terminated (what admission checks); list every pod or every node, or
watch them change; review a bearer token (TokenReview) and ask whether a user
may do something (SubjectAccessReview). Two implementations stand behind it:

* :class:`KubernetesApi` speaks to a real API server through the official
  ``kubernetes`` client. The client is blocking, so every call runs in a worker
  thread, under a request timeout. Objects come back as the server's own JSON
  (camelCase keys), never as client model objects; lists are read page by page;
  a watch is one streamed request, read chunk by chunk in a worker thread.
  A watch from now is, on kube-apiserver 1.32 and later, served as a
  *watch-list* (the server turns it into ``sendInitialEvents=true``); a server
  whose etcd lacks progress notifications (etcd before 3.5.13) refuses that
  with an ERROR event of code 500. The watch then falls back to what client-go
  does: a paged list, an ADDED for each item and a BOOKMARK at the list's
  resource version, then a watch from that version. The refusal is remembered
  for :data:`WATCH_LIST_RETRY_S` (watches from now list first meanwhile) and
  logged once.
* :class:`LocalKubeApi` keeps Pods, Nodes, namespace labels and ResourceQuotas in
  memory, for the dev stack and for tests of the services that use this interface.
  Its tokens are those its :class:`ServiceAccountTokens` minted, and its
  :class:`AccessRules` grant nothing until told to: with no users, every access
  review is refused.

Every failure surfaces as a :class:`KubeError` whose message reads well for an
operator; :class:`NotFound` (404; :class:`PodNotFound` for a pod) and
:class:`Conflict` (409) are the ones callers usually handle on their own.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import copy
import dataclasses
import functools
import json
import logging
import os
import secrets
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

import urllib3
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException

__all__ = [
    "DEFAULT_AUDIENCE",
    "AccessRules",
    "Conflict",
    "EvictionRefused",
    "KubeApi",
    "KubeError",
    "KubernetesApi",
    "Listing",
    "LocalKubeApi",
    "NotFound",
    "PodNotFound",
    "ServiceAccountTokens",
    "WatchEvent",
    "WatchExpired",
    "object_uid",
    "pod_node",
    "pod_phase",
    "pod_terminated",
    "resource_version",
]

DEFAULT_TIMEOUT = 5.0
PAGE_SIZE = 500
# pods that still hold what they asked for
RUNNING_PODS = "status.phase!=Succeeded,status.phase!=Failed"
TERMINATED_PHASES = ("Succeeded", "Failed")
MERGE_PATCH = "application/merge-patch+json"
USER_AGENT = "gpuslice"
# TokenReviews and SubjectAccessReviews at once (the NATS auth callout asks
# one per connecting node agent, the console one per viewer): their own threads
# and pooled connections, so that a burst of them neither waits behind the
# other calls' threads nor holds those calls up
REVIEW_THREADS = 64
# How long one watch request lasts before the server ends it and it is renewed.
WATCH_SECONDS = 300
WATCH_HISTORY = 1000  # LocalKubeApi: changes a resumed watch can catch up on
# How long a refused watch-list is remembered: meanwhile a watch from now lists
# first instead of asking the server for the streaming form again.
WATCH_LIST_RETRY_S = 600.0
# The annotation of the BOOKMARK that ends a watch's initial state, as the API
# server marks it at the end of a watch-list's initial events.
INITIAL_EVENTS_END = "k8s.io/initial-events-end"
T = TypeVar("T")

log = logging.getLogger(__name__)

# One change of a watched object: the type (ADDED, MODIFIED, DELETED, BOOKMARK)
# and the object as the server sent it.
WatchEvent = tuple[str, dict[str, Any]]


# ---------------------------------------------------------------- reading objects
# One reader per field of an object as the server sends it (JSON): a field that
# is missing or of another type reads as empty, never raises.


def _part(obj: Mapping[str, Any], part: str) -> Mapping[str, Any]:
    value = obj.get(part)
    return value if isinstance(value, Mapping) else {}


def _text(part: Mapping[str, Any], key: str) -> str:
    value = part.get(key)
    return value if isinstance(value, str) else ""


def object_uid(obj: Mapping[str, Any]) -> str:
    """``metadata.uid``; "" when there is none."""
    return _text(_part(obj, "metadata"), "uid")


def resource_version(obj: Mapping[str, Any]) -> str:
    """``metadata.resourceVersion`` of an object, or of a list; "" when there is none."""
    return _text(_part(obj, "metadata"), "resourceVersion")


def pod_phase(pod: Mapping[str, Any]) -> str:
    """``status.phase`` (Pending, Running, Succeeded, Failed, Unknown); "" when there is none."""
    return _text(_part(pod, "status"), "phase")


def pod_terminated(pod: Mapping[str, Any]) -> bool:
    """Whether the pod has ended for good (phase Succeeded or Failed): it holds
    nothing on its node any more."""
    return pod_phase(pod) in TERMINATED_PHASES


MAX_END_TEXT = 120  # of one reason or message a pod's status gives
MAX_END_CONTAINERS = 4  # failed containers named in one end reason


def _shown(text: str) -> str:
    """A status text as one printable line, cut at :data:`MAX_END_TEXT`: what the
    kubelet writes is the node's word, read as untrusted."""
    line = "".join(c if c.isprintable() else " " for c in text).strip()
    return line if len(line) <= MAX_END_TEXT else f"{line[: MAX_END_TEXT - 1]}\u2026"


def _exit_code(terminated: Mapping[str, Any]) -> int | None:
    code = terminated.get("exitCode")
    return code if isinstance(code, int) and not isinstance(code, bool) else None


def pod_failure(pod: Mapping[str, Any]) -> str:
    """Why a pod failed, as its status tells (what ``kubectl describe`` shows):
    the pod's reason and message (``Evicted: The node was low on memory``),
    then each container that ended with a non-zero exit code, with its own
    reason (``container main exited 137 (OOMKilled)``); "" when the status says
    nothing. Every text is one printable line of bounded length."""
    status = _part(pod, "status")
    parts = []
    said = ": ".join(_shown(t) for t in (_text(status, "reason"), _text(status, "message")) if t)
    if said:
        parts.append(said)
    failed = []
    for key in ("initContainerStatuses", "containerStatuses"):
        listed = status.get(key)
        for container in listed if isinstance(listed, list) else []:
            if not isinstance(container, Mapping):
                continue
            ended = _part(_part(container, "state"), "terminated")
            code = _exit_code(ended)
            if code is None or code == 0:
                continue
            why = _text(ended, "reason")
            name = _shown(_text(container, "name")) or "?"
            failed.append(f"container {name} exited {code}" + (f" ({_shown(why)})" if why else ""))
    if len(failed) > MAX_END_CONTAINERS:
        more = len(failed) - MAX_END_CONTAINERS
        failed = [*failed[:MAX_END_CONTAINERS], f"{more} more"]
    if failed:
        parts.append(", ".join(failed))
    return "; ".join(parts)


def pod_end_reason(pod: Mapping[str, Any]) -> str | None:
    """The release reason of a pod that has ended (``pod succeeded``, ``pod
    failed: <why>`` with :func:`pod_failure`'s words when its status gives
    them), or None while it runs."""
    phase = pod_phase(pod)
    if phase == "Succeeded":
        return "pod succeeded"
    if phase != "Failed":
        return None
    why = pod_failure(pod)
    return f"pod failed: {why}" if why else "pod failed"


def pod_node(pod: Mapping[str, Any]) -> str:
    """The node the pod is bound to (``spec.nodeName``); "" while it is not bound."""
    return _text(_part(pod, "spec"), "nodeName")


class Listing(list[dict[str, Any]]):
    """The items of a list (JSON), and the resource version the list was read at:
    a watch from that version shows every change the list does not ("" when the
    server named none: a watch from now, which lists again)."""

    def __init__(self, items: Iterable[dict[str, Any]] = (), resource_version: str = "") -> None:
        super().__init__(items)
        self.resource_version = resource_version


class KubeError(Exception):
    """The Kubernetes API did not do what was asked; the message says why.

    ``status`` is the HTTP status of the server's answer, when there was one.
    """

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class NotFound(KubeError):
    """The object (or its namespace) does not exist (HTTP 404)."""


class PodNotFound(NotFound):
    """The pod (or its namespace) does not exist."""


class WatchExpired(KubeError):
    """The resource version a watch started from is gone (HTTP 410): start again from now."""


class Conflict(KubeError):
    """The server refused the change as conflicting (HTTP 409), e.g. the pod is
    already bound to another node."""


class EvictionRefused(KubeError):
    """An eviction the API server refused for now (429): a PodDisruptionBudget
    allows no more disruption of the pod's set."""


@dataclasses.dataclass(frozen=True)
class ObjectRef:
    """Where an object of any API group lives, for the generic calls of
    :class:`KubeApi` (``get_object`` ...): ``api`` as in ``apiVersion``
    (``"resource.k8s.io/v1"``; ``"v1"`` for the core group), the resource's plural,
    the namespace (None: cluster-scoped) and the name (None: the collection)."""

    api: str
    plural: str
    namespace: str | None = None
    name: str | None = None

    def named(self, name: str) -> ObjectRef:
        return dataclasses.replace(self, name=name)

    def in_namespace(self, namespace: str | None) -> ObjectRef:
        return dataclasses.replace(self, namespace=namespace)

    @property
    def path(self) -> str:
        """The URL path of the object (or of its collection)."""
        base = "/api/v1" if self.api == "v1" else f"/apis/{self.api}"
        if self.namespace is not None:
            base += f"/namespaces/{self.namespace}"
        base += f"/{self.plural}"
        return base if self.name is None else f"{base}/{self.name}"

    def __str__(self) -> str:
        where = f"{self.namespace}/" if self.namespace is not None else ""
        return f"{self.plural} {where}{self.name or '*'}"


class KubeApi(Protocol):
    """What gpuslice services need from the Kubernetes API server."""

    async def get_object(self, ref: ObjectRef) -> dict[str, Any]:
        """The object at ``ref`` as the server sends it. Raises :class:`NotFound`."""
        ...

    async def list_objects(self, ref: ObjectRef, *, label_selector: str = "") -> Listing:
        """Every object of the collection at ``ref`` (a namespace, or all)."""
        ...

    async def create_object(self, ref: ObjectRef, body: Mapping[str, Any]) -> dict[str, Any]:
        """Create ``body`` in the collection at ``ref``; the stored object.
        Raises :class:`Conflict` when one of that name exists."""
        ...

    async def replace_object(
        self, ref: ObjectRef, body: Mapping[str, Any], *, subresource: str = ""
    ) -> dict[str, Any]:
        """Replace the object at ``ref`` (PUT; a ``subresource`` such as ``status``
        replaces that part only); the stored object. Raises :class:`Conflict` when
        ``body``'s ``metadata.resourceVersion`` is not the stored one, :class:`NotFound`."""
        ...

    async def delete_object(self, ref: ObjectRef, *, uid: str = "") -> None:
        """Delete the object at ``ref`` (only the one of ``uid`` when given: a
        precondition). Raises :class:`NotFound`, :class:`Conflict` (the UID differs)."""
        ...

    async def get_pod(self, namespace: str, name: str) -> dict[str, Any]:
        """The Pod as the server sends it (camelCase keys). Raises :class:`PodNotFound`."""
        ...

    async def patch_pod_annotations(
        self, namespace: str, name: str, annotations: Mapping[str, str | None]
    ) -> None:
        """Merge ``annotations`` into the pod's ``metadata.annotations``; a None
        value deletes that key."""
        ...

    async def bind_pod(self, namespace: str, name: str, uid: str, node: str) -> None:
        """Bind the pod to ``node``. ``uid`` guards against binding a newer pod
        that took the same name. Raises :class:`Conflict` if it is already bound."""
        ...

    async def evict_pod(
        self, namespace: str, name: str, uid: str, *, dry_run: bool = False
    ) -> None:
        """Evict the pod through the Eviction API (``policy/v1``), which honours
        PodDisruptionBudgets; only the pod of this ``uid`` (a precondition). With
        ``dry_run`` the server checks and changes nothing. Raises
        :class:`EvictionRefused` (429: a budget forbids it now), :class:`PodNotFound`,
        :class:`Conflict` (the UID differs)."""
        ...

    async def patch_pod_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> None:
        """Merge ``status`` into the pod's status (the ``pods/status`` subresource)."""
        ...

    async def create_event(self, namespace: str, event: Mapping[str, Any]) -> None:
        """Create a core/v1 Event in ``namespace``."""
        ...

    async def get_namespace(self, name: str) -> dict[str, Any]:
        """The Namespace as the server sends it (camelCase JSON). Raises :class:`NotFound`."""
        ...

    async def list_resource_quotas(self, namespace: str) -> list[dict[str, Any]]:
        """Every ResourceQuota of the namespace (the ``items`` of the list, JSON)."""
        ...

    async def list_pods(self, namespace: str) -> list[dict[str, Any]]:
        """The namespace's pods that have not terminated: phase neither Succeeded nor Failed."""
        ...

    async def list_all_pods(self) -> Listing:
        """Every pod of every namespace, whatever its phase (reconciliation)."""
        ...

    async def list_nodes(self) -> Listing:
        """Every Node, as the server sends it (camelCase JSON)."""
        ...

    async def review_token(self, token: str, audiences: Sequence[str] = ()) -> dict[str, Any]:
        """The API server's TokenReview of ``token`` for ``audiences`` (none: the
        API server's own): its ``status`` (``authenticated``, ``user`` with
        ``username``, ``uid``, ``groups`` and ``extra``, ``audiences``, ``error``)."""
        ...

    async def access_review(
        self,
        user: str,
        groups: Sequence[str],
        verb: str,
        resource: str,
        namespace: str | None = None,
        extra: Mapping[str, Sequence[str]] | None = None,
        *,
        uid: str = "",
    ) -> bool:
        """Whether the API server's authorizer lets ``user`` (in ``groups``, with
        ``extra``) ``verb`` the core-group ``resource`` in ``namespace``
        (None: in every namespace, cluster-wide): a SubjectAccessReview's
        ``status.allowed``. Raises :class:`KubeError` when there is no answer."""
        ...

    def watch_pods(self, resource_version: str = "") -> AsyncIterator[WatchEvent]:
        """The changes of every pod after ``resource_version`` (when empty: an
        ADDED for each pod that exists, then the changes), until the server ends
        the watch. BOOKMARK events only carry the resource version reached.
        Raises :class:`WatchExpired` when ``resource_version`` is too old."""
        ...

    def watch_nodes(self, resource_version: str = "") -> AsyncIterator[WatchEvent]:
        """The changes of every node, as :meth:`watch_pods` gives those of pods."""
        ...

    async def close(self) -> None:
        """Release connections; the object is not used afterwards."""
        ...


def _pod_ref(namespace: str, name: str) -> str:
    return f"{namespace}/{name}"


def _server_message(body: Any) -> str:
    """The ``message`` of a Kubernetes Status body, or the body's text itself."""
    if isinstance(body, bytes):
        body = body.decode("utf-8", errors="replace")
    if not isinstance(body, str) or not body.strip():
        return ""
    try:
        parsed = json.loads(body)
    except ValueError:
        text = " ".join(body.split())
        return text if len(text) <= 300 else text[:297] + "..."
    if isinstance(parsed, dict) and isinstance(parsed.get("message"), str):
        return str(parsed["message"])
    return ""


@dataclasses.dataclass(frozen=True)
class _Raw:
    """A body already read, where :func:`_read_body` expects a response."""

    data: bytes


def _read_body(response: Any) -> bytes:
    """Read an unparsed response (``_preload_content=False``) and free its connection."""
    try:
        data = response.data
    finally:
        release = getattr(response, "release_conn", None)
        if callable(release):
            release()
    return data if isinstance(data, bytes) else bytes(data or b"")


def _load_incluster(configuration: k8s.Configuration) -> None:
    k8s_config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]


def _load_kubeconfig(path: str, configuration: k8s.Configuration) -> None:
    k8s_config.load_kube_config(config_file=path, client_configuration=configuration)  # type: ignore[no-untyped-call]


class KubernetesApi:
    """:class:`KubeApi` on a real API server, through the official ``kubernetes`` client."""

    def __init__(
        self, api_client: k8s.ApiClient, *, host: str, timeout: float = DEFAULT_TIMEOUT
    ) -> None:
        if timeout <= 0:
            raise ValueError("timeout must be positive")
        self._api_client = api_client
        self._core = k8s.CoreV1Api(api_client)
        self._authn = k8s.AuthenticationV1Api(api_client)
        self._authz = k8s.AuthorizationV1Api(api_client)
        self._timeout = timeout
        self.host = host
        # threads start as reviews need them
        self._reviews = ThreadPoolExecutor(REVIEW_THREADS, thread_name_prefix="tokenreview")
        self.watch_list_retry_s = WATCH_LIST_RETRY_S
        self.watch_list_refused_at: float | None = None  # time.monotonic() of the last refusal
        self.watches_listed_first = 0  # watches from now begun with a list instead

    @classmethod
    def connect(
        cls,
        host: str,
        token: str | None = None,
        verify_ssl: bool = True,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> KubernetesApi:
        """Talk to the API server at ``host`` (``https://...``), with a bearer token if given."""
        configuration = k8s.Configuration()
        configuration.host = host.rstrip("/")
        configuration.verify_ssl = verify_ssl
        if token is not None:
            configuration.api_key = {"authorization": token}
            configuration.api_key_prefix = {"authorization": "Bearer"}
        return cls._from_configuration(configuration, timeout)

    @classmethod
    def from_environment(cls, timeout: float = DEFAULT_TIMEOUT) -> KubernetesApi:
        """Credentials as a pod or an operator's shell has them: the service
        account when running in a cluster (``KUBERNETES_SERVICE_HOST`` is set),
        else the current kubeconfig context (``KUBECONFIG`` or ``~/.kube/config``)."""
        configuration = k8s.Configuration()
        try:
            if os.environ.get("KUBERNETES_SERVICE_HOST"):
                source = "the in-cluster service account"
                _load_incluster(configuration)
            else:
                # KUBECONFIG is read now: the client's own default was fixed at import.
                kubeconfig = os.environ.get("KUBECONFIG") or "~/.kube/config"
                source = f"kubeconfig {kubeconfig}"
                _load_kubeconfig(kubeconfig, configuration)
        except (ConfigException, OSError, ValueError, TypeError, KeyError) as error:
            detail = " ".join(str(error).split()) or type(error).__name__
            raise KubeError(f"cannot load Kubernetes credentials from {source}: {detail}") from None
        return cls._from_configuration(configuration, timeout)

    @classmethod
    def _from_configuration(cls, configuration: k8s.Configuration, timeout: float) -> KubernetesApi:
        # One retry covers a pooled keep-alive connection the server has dropped,
        # without stretching an outage into several timeouts.
        configuration.retries = 1
        configuration.connection_pool_maxsize = max(
            configuration.connection_pool_maxsize, REVIEW_THREADS + 8
        )
        api_client = k8s.ApiClient(configuration)
        api_client.user_agent = USER_AGENT
        return cls(api_client, host=str(configuration.host), timeout=timeout)

    async def get_object(self, ref: ObjectRef) -> dict[str, Any]:
        what = f"reading {ref}"
        return self._object(await self._generic("GET", ref.path, what, f"{ref} not found"), what)

    async def list_objects(self, ref: ObjectRef, *, label_selector: str = "") -> Listing:
        what = f"listing {ref.plural}"

        def page(token: str | None) -> Any:
            query: list[tuple[str, str]] = [("limit", str(PAGE_SIZE))]
            if token:
                query.append(("continue", token))
            if label_selector:
                query.append(("labelSelector", label_selector))
            return _Raw(self._request("GET", ref.path, query=query))

        return await self._list(what, page)

    async def create_object(self, ref: ObjectRef, body: Mapping[str, Any]) -> dict[str, Any]:
        what = f"creating {ref}"
        raw = await self._generic("POST", ref.path, what, f"{what} failed", body=body)
        return self._object(raw, what)

    async def replace_object(
        self, ref: ObjectRef, body: Mapping[str, Any], *, subresource: str = ""
    ) -> dict[str, Any]:
        path = ref.path + (f"/{subresource}" if subresource else "")
        what = f"replacing {ref}" + (f" {subresource}" if subresource else "")
        raw = await self._generic("PUT", path, what, f"{ref} not found", body=body)
        return self._object(raw, what)

    async def delete_object(self, ref: ObjectRef, *, uid: str = "") -> None:
        options: dict[str, Any] = {"apiVersion": "v1", "kind": "DeleteOptions"}
        if uid:
            options["preconditions"] = {"uid": uid}
        await self._generic("DELETE", ref.path, f"deleting {ref}", f"{ref} not found", body=options)

    def _request(
        self,
        method: str,
        path: str,
        *,
        query: Sequence[tuple[str, str]] = (),
        body: Mapping[str, Any] | None = None,
    ) -> Any:
        """One blocking request to ``path`` with the client's credentials; the raw response."""
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = "application/json"
        params = self._api_client.param_serialize(
            method,
            path,
            query_params=list(query),
            header_params=headers,
            body=dict(body) if body is not None else None,
            auth_settings=["BearerToken"],
        )
        response = self._api_client.call_api(*params, _request_timeout=self._timeout)
        try:
            data = response.read()  # type: ignore[no-untyped-call]
        finally:
            release = getattr(response.response, "release_conn", None)
            if callable(release):
                release()
        if not 200 <= response.status < 300:
            raise ApiException(http_resp=response)
        return data if isinstance(data, bytes) else bytes(data or b"")

    async def _generic(
        self, method: str, path: str, what: str, not_found: str, *, body: Any = None
    ) -> bytes:
        return await self._guarded(
            what, lambda: self._request(method, path, body=body), not_found=not_found
        )

    async def get_pod(self, namespace: str, name: str) -> dict[str, Any]:
        what = f"reading pod {_pod_ref(namespace, name)}"
        body = await self._call(
            what,
            lambda: self._core.read_namespaced_pod(
                name=name,
                namespace=namespace,
                _preload_content=False,
                _request_timeout=self._timeout,
            ),
            not_found=f"pod {_pod_ref(namespace, name)} not found",
            missing=PodNotFound,
        )
        return self._object(body, what)

    async def patch_pod_annotations(
        self, namespace: str, name: str, annotations: Mapping[str, str | None]
    ) -> None:
        patch = {"metadata": {"annotations": dict(annotations)}}
        await self._call(
            f"annotating pod {_pod_ref(namespace, name)}",
            lambda: self._core.patch_namespaced_pod(
                name=name,
                namespace=namespace,
                body=patch,
                _content_type=MERGE_PATCH,
                _preload_content=False,
                _request_timeout=self._timeout,
            ),
            not_found=f"pod {_pod_ref(namespace, name)} not found",
            missing=PodNotFound,
        )

    async def bind_pod(self, namespace: str, name: str, uid: str, node: str) -> None:
        binding = k8s.V1Binding(
            api_version="v1",
            kind="Binding",
            metadata=k8s.V1ObjectMeta(name=name, namespace=namespace, uid=uid),
            target=k8s.V1ObjectReference(api_version="v1", kind="Node", name=node),
        )
        # The response is not deserialised: some client versions fail on a
        # Binding without ``target``, which is what servers send back. The
        # content type is named because the client sends none for this call.
        await self._call(
            f"binding pod {_pod_ref(namespace, name)} to node {node}",
            lambda: self._core.create_namespaced_pod_binding(
                name=name,
                namespace=namespace,
                body=binding,
                _headers={"Content-Type": "application/json"},
                _preload_content=False,
                _request_timeout=self._timeout,
            ),
            not_found=f"pod {_pod_ref(namespace, name)} not found",
            missing=PodNotFound,
        )

    async def evict_pod(
        self, namespace: str, name: str, uid: str, *, dry_run: bool = False
    ) -> None:
        eviction = k8s.V1Eviction(
            api_version="policy/v1",
            kind="Eviction",
            metadata=k8s.V1ObjectMeta(name=name, namespace=namespace),
            delete_options=k8s.V1DeleteOptions(
                preconditions=k8s.V1Preconditions(uid=uid), dry_run=["All"] if dry_run else None
            ),
        )
        try:
            await self._call(
                f"evicting pod {_pod_ref(namespace, name)}",
                lambda: self._core.create_namespaced_pod_eviction(
                    name=name,
                    namespace=namespace,
                    body=eviction,
                    _preload_content=False,
                    _request_timeout=self._timeout,
                ),
                not_found=f"pod {_pod_ref(namespace, name)} not found",
                missing=PodNotFound,
            )
        except KubeError as exc:
            if exc.status == 429:
                raise EvictionRefused(str(exc), 429) from None
            raise

    async def patch_pod_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> None:
        await self._call(
            f"patching the status of pod {_pod_ref(namespace, name)}",
            lambda: self._core.patch_namespaced_pod_status(
                name=name,
                namespace=namespace,
                body={"status": dict(status)},
                _content_type=MERGE_PATCH,
                _preload_content=False,
                _request_timeout=self._timeout,
            ),
            not_found=f"pod {_pod_ref(namespace, name)} not found",
            missing=PodNotFound,
        )

    async def create_event(self, namespace: str, event: Mapping[str, Any]) -> None:
        await self._call(
            f"recording an event in namespace {namespace}",
            lambda: self._core.create_namespaced_event(
                namespace=namespace,
                body=dict(event),  # type: ignore[arg-type]  # the client serialises a dict as is
                _preload_content=False,
                _request_timeout=self._timeout,
            ),
            not_found=f"namespace {namespace} not found",
        )

    async def get_namespace(self, name: str) -> dict[str, Any]:
        what = f"reading namespace {name}"
        body = await self._call(
            what,
            lambda: self._core.read_namespace(
                name=name, _preload_content=False, _request_timeout=self._timeout
            ),
            not_found=f"namespace {name} not found",
        )
        return self._object(body, what)

    async def list_resource_quotas(self, namespace: str) -> list[dict[str, Any]]:
        def page(token: str | None) -> Any:
            return self._core.list_namespaced_resource_quota(
                namespace=namespace,
                limit=PAGE_SIZE,
                _continue=token,
                _preload_content=False,
                _request_timeout=self._timeout,
            )

        return await self._list(f"listing ResourceQuotas of namespace {namespace}", page)

    async def list_pods(self, namespace: str) -> list[dict[str, Any]]:
        def page(token: str | None) -> Any:
            return self._core.list_namespaced_pod(
                namespace=namespace,
                field_selector=RUNNING_PODS,
                limit=PAGE_SIZE,
                _continue=token,
                _preload_content=False,
                _request_timeout=self._timeout,
            )

        return await self._list(f"listing pods of namespace {namespace}", page)

    async def list_all_pods(self) -> Listing:
        def page(token: str | None) -> Any:
            return self._core.list_pod_for_all_namespaces(
                limit=PAGE_SIZE,
                _continue=token,
                _preload_content=False,
                _request_timeout=self._timeout,
            )

        return await self._list("listing the pods of every namespace", page)

    async def list_nodes(self) -> Listing:
        def page(token: str | None) -> Any:
            return self._core.list_node(
                limit=PAGE_SIZE,
                _continue=token,
                _preload_content=False,
                _request_timeout=self._timeout,
            )

        return await self._list("listing the nodes", page)

    async def review_token(self, token: str, audiences: Sequence[str] = ()) -> dict[str, Any]:
        what = "reviewing a token"
        body = k8s.V1TokenReview(
            api_version="authentication.k8s.io/v1",
            kind="TokenReview",
            spec=k8s.V1TokenReviewSpec(token=token, audiences=list(audiences)),
        )
        raw = await self._guarded(
            what,
            lambda: _read_body(
                self._authn.create_token_review(
                    body=body, _preload_content=False, _request_timeout=self._timeout
                )
            ),
            not_found=f"{what} failed",
            executor=self._reviews,
        )
        status = self._object(raw, what).get("status")
        return status if isinstance(status, dict) else {}

    async def access_review(
        self,
        user: str,
        groups: Sequence[str],
        verb: str,
        resource: str,
        namespace: str | None = None,
        extra: Mapping[str, Sequence[str]] | None = None,
        *,
        uid: str = "",
    ) -> bool:
        where = f"in namespace {namespace}" if namespace else "cluster-wide"
        what = f"asking whether {user} may {verb} {resource} {where}"
        body = k8s.V1SubjectAccessReview(
            api_version="authorization.k8s.io/v1",
            kind="SubjectAccessReview",
            spec=k8s.V1SubjectAccessReviewSpec(
                user=user,
                groups=list(groups),
                uid=uid or None,
                extra={key: list(values) for key, values in (extra or {}).items()} or None,
                resource_attributes=k8s.V1ResourceAttributes(
                    group="", verb=verb, resource=resource, namespace=namespace or None
                ),
            ),
        )
        raw = await self._guarded(
            what,
            lambda: _read_body(
                self._authz.create_subject_access_review(
                    body=body, _preload_content=False, _request_timeout=self._timeout
                )
            ),
            not_found=f"{what} failed",
            executor=self._reviews,
        )
        status = self._object(raw, what).get("status")
        # only a literal true allows; anything else (missing, malformed) refuses
        return isinstance(status, dict) and status.get("allowed") is True

    def watch_pods(self, resource_version: str = "") -> AsyncIterator[WatchEvent]:
        return self._watch(
            "watching the pods of every namespace",
            self._core.list_pod_for_all_namespaces,
            resource_version,
        )

    def watch_nodes(self, resource_version: str = "") -> AsyncIterator[WatchEvent]:
        return self._watch("watching the nodes", self._core.list_node, resource_version)

    async def _watch(
        self, what: str, lister: Callable[..., Any], resource_version: str
    ) -> AsyncIterator[WatchEvent]:
        """The changes through ``lister`` (the client's list call) from
        ``resource_version``; from now (""), the current state first: as the
        server streams it, or, where it refuses to, listed first."""
        if resource_version or not self._watch_list_refused():
            refusal: KubeError | None = None
            events = self._stream(what, lister, resource_version)
            started = False
            try:
                async for event in events:
                    started = True
                    yield event
            except KubeError as error:
                if started or resource_version or not _refuses_watch_list(error):
                    raise
                refusal = error
            finally:
                await events.aclose()
            if refusal is None:
                return
            self._note_watch_list_refused(refusal)
        self.watches_listed_first += 1
        listing = await self._list(
            f"{what} (listing first)", functools.partial(_page, lister, self._timeout)
        )
        for item in listing:
            yield "ADDED", item
        metadata = {
            "resourceVersion": listing.resource_version,
            "annotations": {INITIAL_EVENTS_END: "true"},
        }
        yield "BOOKMARK", {"metadata": metadata}
        # closed with this watch, so no worker thread is left reading its stream
        async with contextlib.aclosing(
            self._stream(what, lister, listing.resource_version)
        ) as rest:
            async for event in rest:
                yield event

    def _watch_list_refused(self) -> bool:
        """Whether the server refused the streaming form of a watch from now lately."""
        refused = self.watch_list_refused_at
        return refused is not None and time.monotonic() - refused < self.watch_list_retry_s

    def _note_watch_list_refused(self, error: KubeError) -> None:
        first = self.watch_list_refused_at is None
        self.watch_list_refused_at = time.monotonic()
        # once per client: the same refusal every WATCH_LIST_RETRY_S says nothing new
        log.log(
            logging.WARNING if first else logging.DEBUG,
            "the Kubernetes API at %s refused to stream the current state in a watch "
            "(watch-list; an etcd without progress notifications, before 3.5.13, causes "
            "this): %s. Watches from now list first, then watch from the list's version; "
            "the streaming form is asked for again after %.0f s",
            self.host,
            error,
            self.watch_list_retry_s,
        )

    async def _stream(
        self, what: str, lister: Callable[..., Any], resource_version: str
    ) -> AsyncGenerator[WatchEvent, None]:
        """One watch request through ``lister`` (the client's list call), its
        events as they come."""

        def start() -> Any:
            return lister(
                watch=True,
                allow_watch_bookmarks=True,
                resource_version=resource_version or None,
                timeout_seconds=WATCH_SECONDS,
                _preload_content=False,
                # (connect, read): a read waits out a quiet watch, not a dead server
                _request_timeout=(self._timeout, WATCH_SECONDS + 30),
            )

        not_found = f"{what} failed"
        response = await self._guarded(what, start, not_found=not_found)
        chunks = response.stream(64 * 1024)
        pending = b""
        try:
            while True:
                chunk: bytes = await self._guarded(
                    what, functools.partial(next, chunks, b""), not_found=not_found
                )
                if not chunk:
                    return
                lines = (pending + chunk).split(b"\n")
                pending = lines.pop()
                for line in lines:
                    if line.strip():
                        yield self._watch_event(line, what)
        finally:
            # Wakes the worker thread still blocked reading, so nothing lingers.
            with contextlib.suppress(Exception):
                response.shutdown()
            with contextlib.suppress(Exception):
                response.close()

    def _watch_event(self, line: bytes, what: str) -> WatchEvent:
        event = self._object(line, what)
        kind, obj = event.get("type"), event.get("object")
        if not isinstance(kind, str) or not isinstance(obj, dict):
            raise KubeError(f"{what}: the API server at {self.host} sent an event without a type")
        if kind == "ERROR":
            code = obj.get("code")
            message = str(obj.get("message") or "no message")
            if code == 410:
                raise WatchExpired(f"{what}: {message}", 410)
            raise KubeError(f"{what} failed: HTTP {code}: {message}", code)
        return kind, obj

    async def _list(self, what: str, page: Callable[[str | None], Any]) -> Listing:
        """Every item of a paged list, following ``metadata.continue``; every page
        is of one snapshot, whose resource version the first names."""
        items = Listing()
        token: str | None = None
        while True:
            # A 404 here is no missing namespace (that lists as empty) but a
            # missing API: NotFound, worded like any failed call.
            raw = await self._call(what, functools.partial(page, token), not_found=f"{what} failed")
            body = self._object(raw, what)
            found = body.get("items")
            if not isinstance(found, list):
                raise KubeError(f"{what}: the API server at {self.host} sent a list without items")
            items.extend(item for item in found if isinstance(item, dict))
            metadata = body.get("metadata")
            version = metadata.get("resourceVersion") if isinstance(metadata, dict) else None
            if not items.resource_version and isinstance(version, str):
                items.resource_version = version
            token = metadata.get("continue") if isinstance(metadata, dict) else None
            if not isinstance(token, str) or not token:
                return items

    def _object(self, body: bytes, what: str) -> dict[str, Any]:
        try:
            parsed = json.loads(body)
        except ValueError:
            raise KubeError(f"{what}: the API server at {self.host} sent no JSON") from None
        if not isinstance(parsed, dict):
            raise KubeError(f"{what}: the API server at {self.host} sent no object")
        return parsed

    async def close(self) -> None:
        self._reviews.shutdown(wait=False, cancel_futures=True)
        await asyncio.to_thread(self._api_client.close)

    async def _call(
        self,
        what: str,
        request: Callable[[], Any],
        *,
        not_found: str,
        missing: type[NotFound] = NotFound,
    ) -> bytes:
        """Run one blocking request in a thread; return the raw body, or raise a KubeError
        (a 404 as ``missing``, its message starting with ``not_found``)."""
        return await self._guarded(
            what, lambda: _read_body(request()), not_found=not_found, missing=missing
        )

    async def _guarded(
        self,
        what: str,
        work: Callable[[], T],
        *,
        not_found: str,
        missing: type[NotFound] = NotFound,
        executor: ThreadPoolExecutor | None = None,
    ) -> T:
        """Run blocking client work in a thread (of ``executor``, else the loop's
        default), its failures as :class:`KubeError`s."""
        try:
            if executor is not None:
                return await asyncio.get_running_loop().run_in_executor(executor, work)
            return await asyncio.to_thread(work)
        except ApiException as error:
            if error.status == 410:
                message = _server_message(error.body) or "expired"
                raise WatchExpired(f"{what}: {message}", 410) from None
            raise self._api_error(what, error, not_found, missing) from None
        except (urllib3.exceptions.HTTPError, OSError) as error:
            raise KubeError(
                f"cannot reach the Kubernetes API at {self.host} ({what}): {_describe(error)}"
            ) from None

    def _api_error(
        self, what: str, error: ApiException, not_found: str, missing: type[NotFound]
    ) -> KubeError:
        status = error.status if isinstance(error.status, int) else None
        if not status:
            # Status 0: the client failed before any answer (TLS, unusable request).
            reason = " ".join(str(error.reason or "no answer").split())
            return KubeError(f"cannot reach the Kubernetes API at {self.host} ({what}): {reason}")
        message = _server_message(error.body)
        reason = str(error.reason or "").strip()
        head = f"HTTP {status} {reason}".rstrip()
        if status == 404:
            return missing(f"{not_found}: {message or head}", status)
        text = f"{what} failed: {head}" + (f": {message}" if message else "")
        if status == 409:
            return Conflict(text, status)
        return KubeError(text, status)


def _refuses_watch_list(error: KubeError) -> bool:
    """Whether a watch from now failed, before any event, as a server does that
    cannot stream the current state: it answered, with a server error (500:
    kube-apiserver's InternalError "a watch stream was requested by the client
    but the required storage feature RequestWatchProgress is disabled").
    Refusals of the client (401, 403) and outages (no answer) are not that."""
    return error.status is not None and error.status >= 500


def _page(lister: Callable[..., Any], timeout: float, token: str | None) -> Any:
    """One page of the list ``lister`` (the client's list call) makes."""
    return lister(
        limit=PAGE_SIZE, _continue=token, _preload_content=False, _request_timeout=timeout
    )


def _describe(error: BaseException) -> str:
    """A one-line reason for a connection failure, without urllib3's object reprs."""
    reason = getattr(error, "reason", None)
    if isinstance(reason, BaseException):
        error = reason
    text = str(error)
    # urllib3 prefixes "<urllib3.connection.HTTPConnection object at 0x...>: ".
    if text.startswith("<") and ">: " in text:
        text = text.split(">: ", 1)[1]
    return " ".join(text.split()) or type(error).__name__


NODE_NAME_EXTRA = "authentication.kubernetes.io/node-name"
POD_NAME_EXTRA = "authentication.kubernetes.io/pod-name"
POD_UID_EXTRA = "authentication.kubernetes.io/pod-uid"


# the audience a TokenReview that names none is checked against (the API
# server's own, as kube-apiserver's --api-audiences defaults it)
DEFAULT_AUDIENCE = "https://kubernetes.default.svc"
SERVICE_ACCOUNT_GROUPS = ("system:serviceaccounts", "system:authenticated")


@dataclasses.dataclass(frozen=True)
class _Minted:
    username: str
    audiences: tuple[str, ...]
    expires: float
    extra: dict[str, list[str]]
    groups: tuple[str, ...] = SERVICE_ACCOUNT_GROUPS


class ServiceAccountTokens:
    """Projected ServiceAccount tokens as a local API server mints and reviews
    them: each bound to a pod on a node, for some audiences, until it expires;
    and tokens of people (:meth:`mint_user`), as an OIDC or static-token
    authenticator would vouch for them.

    A token is JWT-shaped (its claims carry ``aud``, ``exp`` and ``sub`` as
    Kubernetes writes them) with a random signature part; only this object
    knows it, so anything else reviews as unauthenticated.
    """

    def __init__(self) -> None:
        self._tokens: dict[str, _Minted] = {}

    def mint(
        self,
        namespace: str,
        service_account: str,
        *,
        pod_name: str,
        pod_uid: str,
        node: str,
        audiences: Sequence[str],
        ttl_s: float = 3600.0,
    ) -> str:
        username = f"system:serviceaccount:{namespace}:{service_account}"
        expires = time.time() + ttl_s
        claims = {"aud": list(audiences), "exp": int(expires), "sub": username}

        def b64(value: Any) -> str:
            return base64.urlsafe_b64encode(json.dumps(value).encode()).decode().rstrip("=")

        token = f"{b64({'alg': 'RS256'})}.{b64(claims)}.{secrets.token_urlsafe(32)}"
        extra = {
            POD_NAME_EXTRA: [pod_name],
            POD_UID_EXTRA: [pod_uid],
            NODE_NAME_EXTRA: [node],
        }
        self._tokens[token] = _Minted(username, tuple(audiences), expires, extra)
        return token

    def mint_user(
        self,
        username: str,
        groups: Sequence[str] = (),
        *,
        audiences: Sequence[str] = (DEFAULT_AUDIENCE,),
        ttl_s: float = 3600.0,
    ) -> str:
        """A token the review answers with ``username`` in ``groups`` (and
        ``system:authenticated``), for ``audiences``, until ``ttl_s`` from now."""
        expires = time.time() + ttl_s
        token = f"gsu.{secrets.token_urlsafe(32)}"
        every = (*groups, *(() if "system:authenticated" in groups else ("system:authenticated",)))
        self._tokens[token] = _Minted(username, tuple(audiences), expires, {}, tuple(every))
        return token

    def revoke(self, token: str) -> None:
        self._tokens.pop(token, None)

    def review(self, token: str, audiences: Sequence[str]) -> dict[str, Any]:
        """A TokenReview's ``status``, as the API server fills it."""
        minted = self._tokens.get(token)
        if minted is None or time.time() >= minted.expires:
            return {"authenticated": False, "error": "invalid bearer token"}
        wanted = list(audiences) or [DEFAULT_AUDIENCE]
        matched = [a for a in wanted if a in minted.audiences]
        if not matched:
            return {"authenticated": False, "error": "token audiences are invalid"}
        return {
            "authenticated": True,
            "audiences": matched,
            "user": {
                "username": minted.username,
                "groups": list(minted.groups),
                "extra": copy.deepcopy(minted.extra),
            },
        }


class AccessRules:
    """Who may do what, as a local API server's authorizer answers a
    SubjectAccessReview: grants to a user or a group of a verb on a core-group
    resource, in one namespace or (namespace None) in every one. Nothing is
    granted until :meth:`grant` says so."""

    def __init__(self) -> None:
        # (kind "user"/"group", name, verb, resource) -> namespaces; None: every one
        self._grants: dict[tuple[str, str, str, str], set[str] | None] = {}

    def grant(
        self,
        *,
        user: str | None = None,
        group: str | None = None,
        verb: str = "list",
        resource: str = "pods",
        namespace: str | None = None,
    ) -> None:
        """Let ``user`` (or every member of ``group``) ``verb`` ``resource`` in
        ``namespace``; None: in every namespace and cluster-wide."""
        if (user is None) == (group is None):
            raise ValueError("grant to a user or to a group")
        key = ("user", user) if user is not None else ("group", str(group))
        rule = (*key, verb, resource)
        held = self._grants.get(rule, set())
        if held is None:
            return
        self._grants[rule] = None if namespace is None else held | {namespace}

    def revoke(self, *, user: str | None = None, group: str | None = None) -> None:
        """Take back every grant of ``user`` or ``group``."""
        for rule in list(self._grants):
            if rule[:2] in (("user", user), ("group", group)):
                del self._grants[rule]

    def allowed(
        self, user: str, groups: Sequence[str], verb: str, resource: str, namespace: str | None
    ) -> bool:
        subjects = [("user", user), *(("group", g) for g in groups)]
        for kind, name in subjects:
            if (kind, name, verb, resource) not in self._grants:
                continue
            namespaces = self._grants[(kind, name, verb, resource)]
            if namespaces is None or (namespace is not None and namespace in namespaces):
                return True
        return False

    def review(self, spec: Any) -> dict[str, Any]:
        """A SubjectAccessReview's ``status`` for its ``spec`` (JSON), as the
        API server fills it; a spec it cannot read is refused."""
        if not isinstance(spec, Mapping):
            return {"allowed": False, "reason": "no spec"}
        attributes = spec.get("resourceAttributes")
        user, groups = spec.get("user"), spec.get("groups") or []
        if (
            not isinstance(attributes, Mapping)
            or not isinstance(user, str)
            or not isinstance(groups, list)
            or attributes.get("group", "") not in ("", None)
        ):
            return {"allowed": False, "reason": "no rule matches"}
        verb, resource = attributes.get("verb"), attributes.get("resource")
        namespace = attributes.get("namespace") or None
        if not isinstance(verb, str) or not isinstance(resource, str):
            return {"allowed": False, "reason": "no rule matches"}
        names = [g for g in groups if isinstance(g, str)]
        ns = namespace if isinstance(namespace, str) else None
        if self.allowed(user, names, verb, resource, ns):
            return {"allowed": True, "reason": "granted by the local rules"}
        return {"allowed": False, "reason": "no rule matches"}


def _rfc3339(seconds: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


def _budget_count(value: Any, total: int, what: str) -> int:
    """A PodDisruptionBudget's count: a whole number, or a percentage of
    ``total`` rounded up, as the disruption controller rounds it."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str) and value.endswith("%") and value[:-1].isdigit():
        percent = int(value[:-1])
        if percent <= 100:
            return -(-total * percent // 100)
    raise KubeError(f"spec.{what} must be a count or a percentage, got {value!r}", 422)


class _Changes:
    """One kind's changes as :class:`LocalKubeApi` numbers them: the last
    WATCH_HISTORY kept for watches that resume from a version, and the watches
    open now."""

    def __init__(self, what: str, latest: Callable[[], int]) -> None:
        self.what = what
        self.latest = latest  # the version of the latest change, of any kind
        self.history: collections.deque[tuple[int, WatchEvent]] = collections.deque(
            maxlen=WATCH_HISTORY
        )
        self.forgotten = 0  # the version of the newest change no longer kept
        self.watchers: set[asyncio.Queue[tuple[int, WatchEvent]]] = set()

    def record(self, version: int, kind: str, obj: dict[str, Any]) -> None:
        """Keep (a copy of) the change and hand it to every open watch."""
        if len(self.history) == self.history.maxlen:
            self.forgotten = self.history[0][0]
        change = (version, (kind, copy.deepcopy(obj)))
        self.history.append(change)
        for queue in self.watchers:
            queue.put_nowait(change)

    async def watch(
        self, resource_version: str, objects: Iterable[dict[str, Any]]
    ) -> AsyncIterator[WatchEvent]:
        """The changes after ``resource_version`` (when empty: an ADDED for each
        of ``objects`` as they are then, followed by the changes)."""
        queue: asyncio.Queue[tuple[int, WatchEvent]] = asyncio.Queue()
        current = self.latest()
        if not resource_version:
            for obj in objects:
                queue.put_nowait((current, ("ADDED", copy.deepcopy(obj))))
        else:
            since = int(resource_version) if resource_version.isdigit() else -1
            if since < 0 or since > current or since < self.forgotten:
                raise WatchExpired(
                    f"watching {self.what}: too old resource version: {resource_version}"
                )
            for change in self.history:
                if change[0] > since:
                    queue.put_nowait(change)
        self.watchers.add(queue)
        try:
            while True:
                _, event = await queue.get()
                yield event
        finally:
            self.watchers.discard(queue)


class LocalKubeApi:
    """:class:`KubeApi` in memory: Pods, Nodes and ResourceQuotas held as
    JSON-shaped dicts, for the dev stack and tests. Every namespace exists, with
    the labels :meth:`add_namespace` gave it. Callers get copies, never what is
    held. ``bindings`` and ``patches`` record what was asked, in order."""

    def __init__(self) -> None:
        self._pods: dict[tuple[str, str], dict[str, Any]] = {}
        self._nodes: dict[str, dict[str, Any]] = {}
        self._namespaces: dict[str, dict[str, str]] = {}
        self._quotas: dict[tuple[str, str], dict[str, Any]] = {}
        self._budgets: dict[tuple[str, str], dict[str, Any]] = {}  # PodDisruptionBudgets
        # objects of the generic calls (get_object ...): (api, plural, namespace, name)
        self._objects: dict[tuple[str, str, str | None, str], dict[str, Any]] = {}
        self.priority_classes: dict[str, dict[str, Any]] = {}  # name -> PriorityClass
        self.events: list[dict[str, Any]] = []  # core/v1 Events, in the order made
        self.evictions: list[tuple[str, str]] = []  # pods evicted (not dry runs), in order
        self.bindings: list[tuple[str, str, str]] = []
        self.patches: list[tuple[str, str, dict[str, str | None]]] = []
        self.closed = False
        # one numbering for every kind, as etcd's revision
        self._version = 0
        self._pod_changes = _Changes("pods", lambda: self._version)
        self._node_changes = _Changes("nodes", lambda: self._version)
        self.tokens = ServiceAccountTokens()
        self.access = AccessRules()

    @property
    def resource_version(self) -> str:
        """The version of the latest change, as a list reports it."""
        return str(self._version)

    def _changed(self, kind: str, pod: dict[str, Any]) -> None:
        """Give the pod a new resource version and tell the watchers."""
        self._stamp(pod)
        self._pod_changes.record(self._version, kind, pod)

    def _stamp(self, obj: dict[str, Any]) -> None:
        self._version += 1
        obj["metadata"]["resourceVersion"] = str(self._version)

    def add_node(self, node: Mapping[str, Any]) -> None:
        """Store (a copy of) ``node``, replacing any node of the same name."""
        stored = copy.deepcopy(dict(node))
        name = stored.setdefault("metadata", {}).get("name")
        if not isinstance(name, str) or not name:
            raise ValueError("a node needs metadata.name")
        replaced = name in self._nodes
        self._nodes[name] = stored
        self._stamp(stored)
        self._node_changes.record(self._version, "MODIFIED" if replaced else "ADDED", stored)

    def set_allocatable(self, name: str, **resources: str) -> None:
        """Set some of the node's ``status.allocatable`` (``cpu="8"``, ``memory="32Gi"``),
        as its kubelet would report them."""
        node = self._nodes.get(name)
        if node is None:
            raise NotFound(f"node {name} not found", 404)
        status = node.setdefault("status", {})
        status["allocatable"] = {**(status.get("allocatable") or {}), **resources}
        self._stamp(node)
        self._node_changes.record(self._version, "MODIFIED", node)

    def delete_node(self, name: str) -> None:
        node = self._nodes.pop(name, None)
        if node is None:
            raise NotFound(f"node {name} not found", 404)
        self._stamp(node)
        self._node_changes.record(self._version, "DELETED", node)

    def add_pod(self, pod: Mapping[str, Any]) -> None:
        """Store (a copy of) ``pod``, replacing any pod of the same namespace and name."""
        stored = copy.deepcopy(dict(pod))
        metadata = stored.setdefault("metadata", {})
        name = metadata.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError("a pod needs metadata.name")
        namespace = metadata.setdefault("namespace", "default")
        replaced = self._pods.get((namespace, name))
        self._pods[(namespace, name)] = stored
        self._changed("ADDED" if replaced is None else "MODIFIED", stored)

    def learn(self, pod: Mapping[str, Any]) -> bool:
        """Store ``pod`` unless a pod of that name and UID is already held; True if stored.

        The dev stack has no API server: the extender learns pods from the
        filter calls that precede their bind.
        """
        metadata = pod.get("metadata")
        if not isinstance(metadata, Mapping):
            return False
        key = (metadata.get("namespace") or "default", metadata.get("name"))
        held = self._pods.get(key)  # type: ignore[arg-type]
        if held is not None and held.get("metadata", {}).get("uid") == metadata.get("uid"):
            return False
        try:
            self.add_pod(pod)
        except ValueError:
            return False
        return True

    def learn_node(self, node: Mapping[str, Any]) -> bool:
        """Store ``node`` unless a node of that name is held with the same labels,
        spec and status; True if stored.

        The dev stack has no API server: the extender learns nodes from the
        filter calls that carry full Node objects (kube-scheduler's
        nodeCacheCapable=false form), which come again with every call.
        """
        metadata = node.get("metadata")
        if not isinstance(metadata, Mapping):
            return False
        name = metadata.get("name")
        if not isinstance(name, str) or not name:
            return False
        held = self._nodes.get(name)
        if (
            held is not None
            and all(held.get(part) == node.get(part) for part in ("spec", "status"))
            and held["metadata"].get("labels") == metadata.get("labels")
        ):
            return False
        try:
            self.add_node(node)
        except (ValueError, TypeError):
            return False
        return True

    def add_namespace(self, name: str, labels: Mapping[str, str] | None = None) -> None:
        """Give a namespace labels (every namespace exists here, unlabelled by default)."""
        self._namespaces[name] = dict(labels or {})

    def add_resource_quota(self, namespace: str, quota: Mapping[str, Any]) -> None:
        """Store (a copy of) a ResourceQuota, replacing one of the same name."""
        stored = copy.deepcopy(dict(quota))
        metadata = stored.setdefault("metadata", {})
        name = metadata.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError("a ResourceQuota needs metadata.name")
        metadata["namespace"] = namespace
        self._quotas[(namespace, name)] = stored

    def add_priority_class(
        self, name: str, value: int, preemption_policy: str = "PreemptLowerPriority"
    ) -> None:
        """Store a PriorityClass (what the API server's priority admission reads)."""
        self.priority_classes[name] = {
            "apiVersion": "scheduling.k8s.io/v1",
            "kind": "PriorityClass",
            "metadata": {"name": name},
            "value": value,
            "preemptionPolicy": preemption_policy,
        }

    def add_pdb(self, namespace: str, budget: Mapping[str, Any]) -> dict[str, Any]:
        """Store (a copy of) a PodDisruptionBudget (``policy/v1``): ``spec.selector``
        with ``matchLabels`` only, and ``minAvailable`` or ``maxUnavailable`` (a
        count or a percentage). Returns it with its status as now computed."""
        stored = copy.deepcopy(dict(budget))
        metadata = stored.setdefault("metadata", {})
        name = metadata.get("name")
        if not isinstance(name, str) or not name:
            raise KubeError("a PodDisruptionBudget needs metadata.name", 422)
        spec = stored.get("spec")
        if not isinstance(spec, dict):
            raise KubeError("a PodDisruptionBudget needs a spec", 422)
        selector = spec.get("selector")
        labels = selector.get("matchLabels") if isinstance(selector, dict) else None
        if not isinstance(selector, dict) or not isinstance(labels, dict) or len(selector) != 1:
            raise KubeError(
                "spec.selector must hold matchLabels only (all this server serves)", 422
            )
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items()):
            raise KubeError("spec.selector.matchLabels must map names to strings", 422)
        if ("minAvailable" in spec) == ("maxUnavailable" in spec):
            raise KubeError("a PodDisruptionBudget needs one of minAvailable, maxUnavailable", 422)
        for key in ("minAvailable", "maxUnavailable"):
            if key in spec:
                _budget_count(spec[key], 1, key)  # refused now, not at the first eviction
        metadata["namespace"] = namespace
        stored.pop("status", None)
        self._budgets[(namespace, name)] = stored
        return self._with_status(stored)

    def list_pdbs(self, namespace: str) -> list[dict[str, Any]]:
        """The namespace's PodDisruptionBudgets, each with its status as now computed."""
        return [self._with_status(b) for (ns, _), b in self._budgets.items() if ns == namespace]

    def _with_status(self, budget: dict[str, Any]) -> dict[str, Any]:
        shown = copy.deepcopy(budget)
        expected, healthy, desired = self._budget_counts(budget)
        shown["status"] = {
            "expectedPods": expected,
            "currentHealthy": healthy,
            "desiredHealthy": desired,
            "disruptionsAllowed": max(0, healthy - desired),
        }
        return shown

    def _budget_counts(self, budget: Mapping[str, Any]) -> tuple[int, int, int]:
        """(pods it covers, healthy ones, how many must stay healthy), as the
        disruption controller computes them: a covered pod is one of the
        namespace that matches the selector and has not ended; a healthy one
        runs and is not being deleted."""
        spec = budget["spec"]
        namespace = budget["metadata"]["namespace"]
        labels = spec["selector"]["matchLabels"]
        covered = [
            pod
            for (ns, _), pod in self._pods.items()
            if ns == namespace
            and not pod_terminated(pod)
            and all((pod["metadata"].get("labels") or {}).get(k) == v for k, v in labels.items())
        ]
        healthy = sum(
            1
            for pod in covered
            if pod_phase(pod) == "Running" and not pod["metadata"].get("deletionTimestamp")
        )
        expected = len(covered)
        if "minAvailable" in spec:
            desired = _budget_count(spec["minAvailable"], expected, "minAvailable")
        else:
            desired = expected - _budget_count(spec["maxUnavailable"], expected, "maxUnavailable")
        return expected, healthy, max(0, desired)

    async def evict_pod(
        self, namespace: str, name: str, uid: str, *, dry_run: bool = False
    ) -> None:
        """As the API server's eviction subresource: a pod that has ended goes at
        once; one under a PodDisruptionBudget goes only if the budget allows a
        disruption (else :class:`EvictionRefused`); more than one budget is an
        error. The pod is then deleted gracefully: marked with a
        ``deletionTimestamp`` and the DisruptionTarget condition, for its kubelet
        to stop; a pod bound to no node is deleted at once."""
        pod = self._pod(namespace, name)
        ref = _pod_ref(namespace, name)
        if uid and pod["metadata"].get("uid") != uid:
            raise Conflict(
                f"evicting pod {ref} failed: Precondition failed: UID in precondition: {uid}, "
                f"UID in object meta: {pod['metadata'].get('uid')}",
                409,
            )
        if not pod_terminated(pod) and not pod["metadata"].get("deletionTimestamp"):
            labels = pod["metadata"].get("labels") or {}
            budgets = [
                b
                for (ns, _), b in self._budgets.items()
                if ns == namespace
                and all(labels.get(k) == v for k, v in b["spec"]["selector"]["matchLabels"].items())
            ]
            if len(budgets) > 1:
                raise KubeError(
                    "This pod has more than one PodDisruptionBudget, which the eviction "
                    "subresource does not support.",
                    500,
                )
            if budgets:
                _, healthy, desired = self._budget_counts(budgets[0])
                if healthy - desired <= 0:
                    raise EvictionRefused(
                        f"evicting pod {ref} failed: Cannot evict pod as it would violate the "
                        f"pod's disruption budget. The disruption budget "
                        f"{budgets[0]['metadata']['name']} needs {desired} healthy pods and has "
                        f"{healthy} currently",
                        429,
                    )
        if dry_run:
            return
        self.evictions.append((namespace, name))
        if pod_terminated(pod) or not pod_node(pod):
            self.delete_pod(namespace, name)
            return
        if pod["metadata"].get("deletionTimestamp"):
            return
        grace = (pod.get("spec") or {}).get("terminationGracePeriodSeconds", 30)
        grace = grace if isinstance(grace, int) and grace >= 0 else 30
        pod["metadata"]["deletionTimestamp"] = _rfc3339(time.time() + grace)
        pod["metadata"]["deletionGracePeriodSeconds"] = grace
        status = pod.setdefault("status", {})
        conditions = [
            c for c in status.get("conditions") or [] if c.get("type") != "DisruptionTarget"
        ]
        conditions.append(
            {
                "type": "DisruptionTarget",
                "status": "True",
                "reason": "EvictionByEvictionAPI",
                "message": "Eviction API: evicting",
                "lastTransitionTime": _rfc3339(time.time()),
            }
        )
        status["conditions"] = conditions
        self._changed("MODIFIED", pod)

    async def patch_pod_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> None:
        pod = self._pod(namespace, name)
        held = pod.setdefault("status", {})
        for key, value in status.items():
            if value is None:
                held.pop(key, None)
            else:
                held[key] = copy.deepcopy(value)
        self._changed("MODIFIED", pod)

    async def create_event(self, namespace: str, event: Mapping[str, Any]) -> None:
        stored = copy.deepcopy(dict(event))
        metadata = stored.setdefault("metadata", {})
        metadata["namespace"] = namespace
        metadata.setdefault("name", f"event.{secrets.token_hex(8)}")
        metadata["uid"] = str(uuid.uuid4())
        self._stamp(stored)
        self.events.append(stored)

    def delete_pod(self, namespace: str, name: str) -> None:
        pod = self._pods.pop((namespace, name), None)
        if pod is None:
            raise PodNotFound(f"pod {_pod_ref(namespace, name)} not found", 404)
        self._changed("DELETED", pod)

    def set_phase(
        self,
        namespace: str,
        name: str,
        phase: str,
        exits: Mapping[str, int] | None = None,
    ) -> None:
        """Set the pod's ``status.phase``, as its kubelet would report it; with
        ``exits`` (container name -> exit code) each container's terminated
        state too (reason ``Completed`` for 0, ``Error`` otherwise, as kubelet's)."""
        pod = self._pod(namespace, name)
        status = pod.setdefault("status", {})
        status["phase"] = phase
        if exits:
            status["containerStatuses"] = [
                {
                    "name": container,
                    "state": {
                        "terminated": {
                            "exitCode": code,
                            "reason": "Completed" if code == 0 else "Error",
                        }
                    },
                }
                for container, code in exits.items()
            ]
        self._changed("MODIFIED", pod)

    def pods(self) -> list[dict[str, Any]]:
        """Copies of every stored pod."""
        return [copy.deepcopy(pod) for pod in self._pods.values()]

    def _pod(self, namespace: str, name: str) -> dict[str, Any]:
        pod = self._pods.get((namespace, name))
        if pod is None:
            raise PodNotFound(f"pod {_pod_ref(namespace, name)} not found", 404)
        return pod

    async def get_pod(self, namespace: str, name: str) -> dict[str, Any]:
        return copy.deepcopy(self._pod(namespace, name))

    async def patch_pod_annotations(
        self, namespace: str, name: str, annotations: Mapping[str, str | None]
    ) -> None:
        pod = self._pod(namespace, name)
        self.patches.append((namespace, name, dict(annotations)))
        metadata = pod.setdefault("metadata", {})
        current = metadata.get("annotations") or {}
        for key, value in annotations.items():
            if value is None:
                current.pop(key, None)
            else:
                current[key] = value
        if current:
            metadata["annotations"] = current
        else:
            metadata.pop("annotations", None)
        self._changed("MODIFIED", pod)

    async def bind_pod(self, namespace: str, name: str, uid: str, node: str) -> None:
        pod = self._pod(namespace, name)
        ref = _pod_ref(namespace, name)
        actual_uid = pod["metadata"].get("uid")
        if actual_uid is not None and actual_uid != uid:
            raise Conflict(
                f"binding pod {ref} to node {node} failed: the pod's uid is {actual_uid}, "
                f"not {uid} (it was replaced)",
                409,
            )
        spec = pod.setdefault("spec", {})
        bound = spec.get("nodeName")
        if bound and bound != node:
            raise Conflict(
                f"binding pod {ref} to node {node} failed: already bound to node {bound}", 409
            )
        spec["nodeName"] = node
        self.bindings.append((namespace, name, node))
        self._changed("MODIFIED", pod)

    # ------------------------------------------------ objects of any API (generic)

    def _key(self, ref: ObjectRef) -> tuple[str, str, str | None, str]:
        if not ref.name:
            raise KubeError(f"{ref}: no object name", 400)
        return (ref.api, ref.plural, ref.namespace, ref.name)

    async def get_object(self, ref: ObjectRef) -> dict[str, Any]:
        found = self._objects.get(self._key(ref))
        if found is None:
            raise NotFound(f"{ref} not found", 404)
        return copy.deepcopy(found)

    async def list_objects(self, ref: ObjectRef, *, label_selector: str = "") -> Listing:
        wanted = dict(part.split("=", 1) for part in label_selector.split(",") if "=" in part)
        items = Listing()
        items.resource_version = self.resource_version
        for (api, plural, namespace, _), obj in sorted(
            self._objects.items(), key=lambda kv: int(kv[1]["metadata"]["resourceVersion"])
        ):
            if (api, plural) != (ref.api, ref.plural):
                continue
            if ref.namespace is not None and namespace != ref.namespace:
                continue
            labels = obj["metadata"].get("labels") or {}
            if all(labels.get(k) == v for k, v in wanted.items()):
                items.append(copy.deepcopy(obj))
        return items

    async def create_object(self, ref: ObjectRef, body: Mapping[str, Any]) -> dict[str, Any]:
        stored = copy.deepcopy(dict(body))
        metadata = stored.setdefault("metadata", {})
        if not metadata.get("name") and metadata.get("generateName"):
            metadata["name"] = str(metadata["generateName"]) + secrets.token_hex(3)[:5]
        name = metadata.get("name")
        if not isinstance(name, str) or not name:
            raise KubeError(f"creating {ref}: metadata.name is required", 422)
        if ref.namespace is not None:
            metadata["namespace"] = ref.namespace
        key = self._key(ref.named(name))
        if key in self._objects:
            raise Conflict(f"{ref.named(name)} already exists", 409)
        metadata["uid"] = str(uuid.uuid4())
        metadata["creationTimestamp"] = _rfc3339(time.time())
        self._stamp(stored)
        self._objects[key] = stored
        return copy.deepcopy(stored)

    async def replace_object(
        self, ref: ObjectRef, body: Mapping[str, Any], *, subresource: str = ""
    ) -> dict[str, Any]:
        key = self._key(ref)
        held = self._objects.get(key)
        if held is None:
            raise NotFound(f"{ref} not found", 404)
        given = (body.get("metadata") or {}).get("resourceVersion")
        if given and given != held["metadata"]["resourceVersion"]:
            raise Conflict(f"{ref}: the object has been modified", 409)
        new = copy.deepcopy(dict(body))
        if subresource == "status":
            stored = copy.deepcopy(held)
            stored["status"] = new.get("status") or {}
        elif subresource:
            raise NotFound(f"{ref}: no subresource {subresource}", 404)
        else:
            stored = new
            stored["status"] = copy.deepcopy(held.get("status") or {})
            metadata = stored.setdefault("metadata", {})
            for kept in ("uid", "creationTimestamp", "namespace", "name"):
                if kept in held["metadata"]:
                    metadata[kept] = held["metadata"][kept]
            if not stored["status"]:
                del stored["status"]
        self._stamp(stored)
        self._objects[key] = stored
        return copy.deepcopy(stored)

    async def delete_object(self, ref: ObjectRef, *, uid: str = "") -> None:
        key = self._key(ref)
        held = self._objects.get(key)
        if held is None:
            raise NotFound(f"{ref} not found", 404)
        if uid and held["metadata"].get("uid") != uid:
            raise Conflict(f"{ref}: the UID in the precondition is not the object's", 409)
        del self._objects[key]
        self._version += 1

    async def get_namespace(self, name: str) -> dict[str, Any]:
        metadata: dict[str, Any] = {"name": name}
        labels = self._namespaces.get(name)
        if labels:
            metadata["labels"] = dict(labels)
        return {"apiVersion": "v1", "kind": "Namespace", "metadata": metadata}

    async def list_resource_quotas(self, namespace: str) -> list[dict[str, Any]]:
        return [copy.deepcopy(q) for (ns, _), q in self._quotas.items() if ns == namespace]

    async def list_pods(self, namespace: str) -> list[dict[str, Any]]:
        return [
            copy.deepcopy(pod)
            for (ns, _), pod in self._pods.items()
            if ns == namespace and not pod_terminated(pod)
        ]

    async def list_all_pods(self) -> Listing:
        pods = (copy.deepcopy(pod) for pod in self._pods.values())
        return Listing(pods, self.resource_version)

    async def review_token(self, token: str, audiences: Sequence[str] = ()) -> dict[str, Any]:
        return self.tokens.review(token, audiences)

    async def access_review(
        self,
        user: str,
        groups: Sequence[str],
        verb: str,
        resource: str,
        namespace: str | None = None,
        extra: Mapping[str, Sequence[str]] | None = None,
        *,
        uid: str = "",
    ) -> bool:
        return self.access.allowed(user, groups, verb, resource, namespace)

    def watch_pods(self, resource_version: str = "") -> AsyncIterator[WatchEvent]:
        return self._pod_changes.watch(resource_version, self._pods.values())

    async def list_nodes(self) -> Listing:
        nodes = (copy.deepcopy(node) for node in self._nodes.values())
        return Listing(nodes, self.resource_version)

    def watch_nodes(self, resource_version: str = "") -> AsyncIterator[WatchEvent]:
        return self._node_changes.watch(resource_version, self._nodes.values())

    async def close(self) -> None:
        self.closed = True
