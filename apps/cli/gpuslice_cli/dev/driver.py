"""The cluster driver: what the API server, kube-scheduler and kubelet do to a pod,
done against the local stack over the real protocols.

For each pod spec, :meth:`ClusterDriver.run_pod`:

1. sends an AdmissionReview (``admission.k8s.io/v1``, CREATE) to the webhook and
   applies the JSON patch it answers, or stops with the webhook's refusal;
2. stores the pod in the API server (``Pending``);
3. does kube-scheduler's resource fit for the device-plugin resources the
   extender does not manage (``nvidia.com/mig-3g.20gb`` of static MIG): only
   nodes whose kubelet holds a plugin of each with enough free healthy devices
   are candidates, and with none the pod is ``Unschedulable`` with
   kube-scheduler's "Insufficient <resource>"; then calls the extender's
   ``filter`` (on the candidates), ``prioritize`` and ``bind`` as
   kube-scheduler does (``nodeCacheCapable``: node names only), and takes the
   best-scored node; the bind goes through the API server (a pod that names
   another scheduler, which this stack does not run, stays ``Pending`` and is
   reported so; one for kube-scheduler's default goes to the first candidate).
   Where the extender runs as several replicas, the calls are spread over them
   in turn, as a Service in front of them does, and a call that finds one down
   goes to the next. A pod the extender's filter passes on no node is, as
   kube-scheduler 1.34 does with a pod that only an extender rejected, parked
   and tried again only when a cluster event comes (an assigned pod deleted
   from the API server, a node added, changed or deleted; one that came during
   the failed attempt counts) or after ``park_s`` (kube-scheduler's
   ``podMaxInUnschedulablePodsDuration``, five minutes); with ``park_s`` 0
   (the default) it is reported unschedulable at once;
4. as the node's kubelet, asks each resource's device plugin over gRPC to
   Allocate what every container asks of it (``nvidia.com/gpu`` and any other
   device-plugin resource), merging one container's responses as kubelet does;
5. runs each container's ``command`` + ``args`` as a local process with the
   environment kubelet would give it: the container's own variables (downward
   API fields resolved), the Allocate response's, with every mount applied by
   path (a value under a mount's container path points at its host path), the
   interposer preloaded as ``/etc/ld.so.preload`` names it, and, on a simulated
   node, the fake CUDA driver and NVML showing its GPUs (a node on this
   machine's real GPUs uses the real driver); each container's output is kept
   in ``<log dir>/<namespace>/<pod>-<uid>/<container>.log``;
6. when every container has ended, sets the phase (``Succeeded`` or ``Failed``),
   gives the replicas back to the kubelet, deletes the pod and says so on the bus
   (:class:`~gpuslice_common.models.PodEnded`).

:meth:`ClusterDriver.delete_pod` is ``kubectl delete --force`` of a running pod:
it leaves the API server at once, then its containers are killed.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import hashlib
import json
import logging
import os
import re
import signal
import uuid
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx

from gpuslice_cli.dev import dra
from gpuslice_cli.dev.drakubelet import PreparedClaim
from gpuslice_cli.dev.kubelet import Plugin
from gpuslice_cli.dev.priority import admit_priority
from gpuslice_cli.dev.stack import NATIVE_BUILD, NodeSpec, Stack, StackError
from gpuslice_common.bus import Bus
from gpuslice_common.config import ResourceNames
from gpuslice_common.dra import DRIVER
from gpuslice_common.grant import GRANT_DIR
from gpuslice_common.kube import PodNotFound, WatchEvent, WatchExpired
from gpuslice_common.ledger import Ledger, LedgerError
from gpuslice_common.models import PLACEMENT_ANNOTATION, Placement, PodEnded, PodRef, utcnow
from gpuslice_deviceplugin.api import deviceplugin_pb2 as pb

log = logging.getLogger(__name__)

GPU_RESOURCE = "nvidia.com/gpu"
DEFAULT_SCHEDULER = "default-scheduler"
GPUSLICE_SCHEDULER = "gpuslice-scheduler"
PRELOAD = "/etc/ld.so.preload"
CONTAINER_TIMEOUT_S = 120.0
# the resources the extender manages and kube-scheduler leaves to it
# (managedResources, ignoredByScheduler: k8s/cpu-pods/scheduler-config.yaml)
MANAGED = frozenset(ResourceNames().all())
# devices of one extended resource a container may ask here
MAX_EXTENDED = 64
# how long a step is tried again while a component restarts
RETRY_FOR_S = 60.0
RETRY_FIRST_S = 0.2
RETRY_MAX_S = 2.0
# a replica that refused a connection gets no call for this long
REPLICA_DOWN_S = 1.0
# filter's reasons that kube-scheduler's next tries outlast: a node's ledger
# being rebuilt, pods evicted for this one ending (GPU preemption)
WAIT_REASONS = ("NodeLedgerRebuilding", "GpuPreemption")
FIELD_REFS = {
    "metadata.name": lambda pod: pod["metadata"]["name"],
    "metadata.namespace": lambda pod: pod["metadata"]["namespace"],
    "metadata.uid": lambda pod: pod["metadata"]["uid"],
    "spec.nodeName": lambda pod: pod["spec"].get("nodeName", ""),
}


class DriverError(Exception):
    """Something the driver cannot do with a pod spec; the message says what."""


@dataclass
class ContainerRun:
    name: str
    returncode: int | None = None
    output: str = ""
    env: dict[str, str] = field(default_factory=dict)  # what Allocate gave
    devices: tuple[str, ...] = ()  # kubelet's replica IDs
    # the device IDs of every other device-plugin resource, by resource
    extended: dict[str, tuple[str, ...]] = field(default_factory=dict)
    log_path: Path | None = None  # its output, kept once it has run
    pid: int | None = None  # its first process (its process group's), once started
    error: str = ""  # why it could not start (its command not installed), as a runtime says

    def tail(self, lines: int = 20) -> str:
        """The last ``lines`` lines of its output."""
        return "\n".join(self.output.splitlines()[-lines:])


def start_failure(argv: Sequence[str], exc: Exception) -> tuple[int, str]:
    """The exit code and reason of a container whose command cannot start, as
    a shell says them: 127 when it is not there, 126 when it cannot be run."""
    if not argv:  # no image here to take an entrypoint from
        return 127, "no command to run (this stack runs commands, not images)"
    if isinstance(exc, FileNotFoundError):
        return 127, f"command not found: {argv[0]}"
    reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    return 126, f"cannot run {argv[0]}: {reason}"


@dataclass
class PodOutcome:
    """What became of one pod."""

    name: str
    namespace: str
    uid: str
    # Denied, Pending (another scheduler's), Unschedulable, Succeeded, Failed, Deleted
    phase: str
    reason: str = ""
    node: str = ""
    warnings: tuple[str, ...] = ()
    containers: list[ContainerRun] = field(default_factory=list)
    placement: Placement | None = None  # the scheduler's record on the pod

    @property
    def ref(self) -> str:
        return f"{self.namespace}/{self.name}"


def apply_patch(document: Any, operations: Sequence[Mapping[str, Any]]) -> Any:
    """Apply the RFC 6902 ``add``, ``replace`` and ``remove`` operations the webhook writes."""
    for op in operations:
        kind, path, value = op.get("op"), op.get("path"), op.get("value")
        if kind not in ("add", "replace", "remove") or not isinstance(path, str):
            raise DriverError(f"the webhook sent a patch operation this driver cannot apply: {op}")
        tokens = [t.replace("~1", "/").replace("~0", "~") for t in path.split("/")[1:]]
        if not tokens:
            document = value
            continue
        parent = document
        for token in tokens[:-1]:
            parent = parent[int(token)] if isinstance(parent, list) else parent[token]
        last = tokens[-1]
        if kind == "remove":
            try:
                del parent[int(last) if isinstance(parent, list) else last]
            except (KeyError, IndexError, ValueError):
                raise DriverError(f"the webhook removes what is not there: {op}") from None
        elif isinstance(parent, list):
            if last == "-":
                parent.append(value)
            elif kind == "add":
                parent.insert(int(last), value)
            else:
                parent[int(last)] = value
        else:
            parent[last] = value
    return document


def _gpus(container: Mapping[str, Any]) -> int:
    return _extended(container).get(GPU_RESOURCE, 0)


def _extended(container: Mapping[str, Any]) -> dict[str, int]:
    """The extended resources (domain-qualified, outside kubernetes.io) a
    container asks, by name: its limits, else its requests (kubelet takes them
    alike for these); a count that is not a whole number from 1 to
    MAX_EXTENDED counts as 0, as the API server would have refused the pod."""
    resources = container.get("resources") or {}
    asked = {**(resources.get("requests") or {}), **(resources.get("limits") or {})}
    out = {}
    for name, value in asked.items():
        name = str(name)
        if "/" not in name or name.partition("/")[0].endswith("kubernetes.io"):
            continue
        try:
            count = int(str(value))
        except ValueError:
            continue
        if 0 < count <= MAX_EXTENDED:
            out[name] = count
    return out


def pod_needs(pod: Mapping[str, Any]) -> dict[str, int]:
    """The device-plugin resources a pod needs on its node, as kube-scheduler
    counts them: the app containers' sum, or an init container's need where
    larger (they run one by one). The resources the extender manages
    (``ignoredByScheduler``) are left to it."""
    spec = pod.get("spec") or {}
    need: dict[str, int] = {}
    for container in spec.get("containers") or []:
        for name, count in _extended(container).items():
            need[name] = need.get(name, 0) + count
    for container in spec.get("initContainers") or []:
        for name, count in _extended(container).items():
            need[name] = max(need.get(name, 0), count)
    return {name: count for name, count in need.items() if name not in MANAGED}


def _asks_extender(pod: Mapping[str, Any]) -> bool:
    """Does the pod ask for a resource the extender manages (kube-scheduler
    calls an extender only for such pods)?"""
    spec = pod.get("spec") or {}
    containers = [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]
    return any(MANAGED & set(_extended(c)) for c in containers)


def merge_responses(
    responses: Sequence[pb.ContainerAllocateResponse],
) -> pb.ContainerAllocateResponse:
    """One container's Allocate responses from several plugins, as kubelet
    merges them: variables (a later one wins), mounts, devices and annotations together."""
    merged = pb.ContainerAllocateResponse()
    for response in responses:
        merged.envs.update(response.envs)
        merged.mounts.extend(response.mounts)
        merged.devices.extend(response.devices)
        merged.annotations.update(response.annotations)
        merged.cdi_devices.extend(response.cdi_devices)
    return merged


def _rewrite(value: str, mounts: Sequence[pb.Mount]) -> str:
    """A container path in ``value`` made the host path its mount brings in."""
    for mount in sorted(mounts, key=lambda m: -len(m.container_path)):
        if value == mount.container_path or value.startswith(mount.container_path + "/"):
            return mount.host_path + value[len(mount.container_path) :]
    return value


def _file_name(text: str) -> str:
    """``text`` as one safe path component (names come from pod files): a
    name that had to be changed (cut, characters replaced, leading dots
    dropped) ends in a hash of the original, so two names never share one
    file (a container's log opened after another's would truncate it)."""
    text = str(text)
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", text)[:100].lstrip(".")
    if name == text:
        return name
    digest = hashlib.sha256(text.encode(errors="surrogatepass")).hexdigest()[:8]
    return f"{name or '_'}-{digest}"


class Retry(Exception):
    """A step that a real cluster would try again (a component restarting)."""


class Unschedulable(Exception):
    """The extender's filter passed no node: kube-scheduler parks the pod."""


def requeues(event: WatchEvent, node_event: bool) -> bool:
    """Whether kube-scheduler 1.34 moves a pod that only an extender rejected
    out of its unschedulable pods on this change: any node change, and the
    deletion of a pod bound to a node (a pending pod's deletion frees nothing)."""
    kind, obj = event
    if node_event:
        return kind in ("ADDED", "MODIFIED", "DELETED")
    return kind == "DELETED" and bool((obj.get("spec") or {}).get("nodeName"))


# (the admitted pod, "", warnings) or (None, the refusal, ())
Admission = tuple[dict[str, Any] | None, str, tuple[str, ...]]


class ClusterDriver:
    """Drives pods through the stack; ``bus`` (optional) carries the pod-ended
    reports; containers' output is kept under ``log_dir`` (default: the
    stack's ``pods`` directory)."""

    def __init__(
        self,
        stack: Stack,
        bus: Bus | None = None,
        log_dir: Path | None = None,
        park_s: float = 0.0,
    ) -> None:
        self.stack = stack
        # how long a pod the extender found unschedulable stays parked without
        # a cluster event (module docstring); 0: reported unschedulable at once
        self.park_s = park_s
        self.parked: dict[str, str] = {}  # pods parked now (namespace/name) -> why
        self._processes: dict[str, set[int]] = {}  # per pod UID, its containers' pids
        self.bus = bus
        self.log_dir = log_dir or stack.workdir / "pods"
        self.http = httpx.AsyncClient(timeout=15)
        self._node_locks: dict[str, asyncio.Lock] = {}
        self._next_replica = 0  # the replica the next call to replicas goes to
        # replicas that refused a connection lately, until when (loop time): as
        # a Service's endpoints drop a pod that is not ready
        self._down: dict[str, float] = {}
        # steps tried again, by whom: a component down, restarting, its store away
        self.retries: collections.Counter[str] = collections.Counter()
        # DRA: kube-scheduler allocates claims one pod at a time; each pod's claims
        self._dra_lock = asyncio.Lock()
        self._claims: dict[str, list[dict[str, Any]]] = {}
        self._ledger: Ledger | None = None  # made at the first DRA pod: its placement

    async def _dra_placement(self, pod_uid: str) -> Placement | None:
        """The ledger's record of a DRA pod, as the inventory made it at prepare
        (DRA pods carry no placement annotation)."""
        if self._ledger is None:
            self._ledger = self.stack.ledger(retries=2)
        try:
            return await self._ledger.placement(pod_uid)
        except LedgerError as exc:
            log.warning("placement of pod %s unreadable: %s", pod_uid, exc)
            return None

    async def close(self) -> None:
        await self.http.aclose()
        if self._ledger is not None:
            await self._ledger.close()

    async def _post(
        self, url: str | Sequence[str], body: Any, who: str, ok: tuple[int, ...] = (200,)
    ) -> httpx.Response:
        """POST, trying again while ``who`` cannot answer (restarting, its store
        away), as the API server and kube-scheduler keep trying. Given several
        URLs (replicas behind one Service), each try goes to the next, and only
        a whole round of failures waits before the next round."""
        urls = [url] if isinstance(url, str) else list(url)
        loop = asyncio.get_running_loop()
        delay, deadline = RETRY_FIRST_S, loop.time() + RETRY_FOR_S
        failed = 0  # in a row
        while True:
            target = self._pick(urls, loop.time())
            problem = ""
            try:
                reply = await self.http.post(target, json=body)
                if reply.status_code in ok:
                    return reply
                problem = f"HTTP {reply.status_code}: {reply.text[:200]}"
            except httpx.TransportError as exc:
                problem = f"{type(exc).__name__}: {exc}"
                if len(urls) > 1:
                    self._down[target] = loop.time() + REPLICA_DOWN_S
            self.retries[who] += 1
            if asyncio.get_running_loop().time() > deadline:
                raise DriverError(f"{who} did not answer at {target}: {problem}")
            failed += 1
            if failed % len(urls) == 0:
                await asyncio.sleep(delay)
                delay = min(delay * 2, RETRY_MAX_S)

    def _pick(self, urls: Sequence[str], now: float) -> str:
        """The next of ``urls`` in turn, passing over those down lately (all
        down: the next in turn all the same)."""
        count = len(urls)
        for step in range(count):
            url = urls[(self._next_replica + step) % count]
            if self._down.get(url, 0.0) <= now:
                self._next_replica += step + 1
                return url
        self._next_replica += 1
        return urls[(self._next_replica - 1) % count]

    async def _schedule_retrying(self, pod: dict[str, Any]) -> tuple[str, str]:
        delay, deadline = RETRY_FIRST_S, asyncio.get_running_loop().time() + RETRY_FOR_S
        timed_out = False
        while True:
            since = self.stack.kube.resource_version  # changes during the attempt count
            try:
                return await self.schedule(pod)
            except Retry as exc:
                self.retries["schedule"] += 1
                if asyncio.get_running_loop().time() > deadline:
                    return "", str(exc)
            except Unschedulable as exc:
                if self.park_s <= 0 or timed_out:
                    return "", str(exc)
                timed_out = not await self._parked(pod, str(exc), since)
                continue
            await asyncio.sleep(delay)
            delay = min(delay * 2, RETRY_MAX_S)

    async def _parked(self, pod: dict[str, Any], why: str, since: str) -> bool:
        """Park ``pod`` until a change after version ``since`` that kube-scheduler
        requeues it on (:func:`requeues`): True, or False after ``park_s``."""
        meta = pod["metadata"]
        ref = f"{meta['namespace']}/{meta['name']}"
        self.parked[ref] = why
        kube = self.stack.kube

        async def first(changes: Any, node_event: bool) -> None:
            async for event in changes:
                if requeues(event, node_event):
                    name = (event[1].get("metadata") or {}).get("name")
                    log.info("pod %s tried again: %s %s", ref, event[0], name)
                    return

        watches = [
            asyncio.ensure_future(first(kube.watch_pods(since), False)),
            asyncio.ensure_future(first(kube.watch_nodes(since), True)),
        ]
        try:
            done, _ = await asyncio.wait(
                watches, timeout=self.park_s, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            self.parked.pop(ref, None)
            for watch in watches:
                watch.cancel()
            await asyncio.gather(*watches, return_exceptions=True)
        for watch in done:  # a version too old to resume from: changes were missed
            if isinstance(watch.exception(), WatchExpired):
                return True
            watch.result()
        self.retries["parked"] += 1
        return bool(done)

    async def _allocate(
        self, node: str, count: int, resource: str = GPU_RESOURCE
    ) -> tuple[Plugin, pb.ContainerAllocateResponse]:
        """Allocate through the node's plugin of ``resource`` as its kubelet
        holds it now; a plugin that restarts re-registers, and the call is made again."""
        delay, deadline = RETRY_FIRST_S, asyncio.get_running_loop().time() + RETRY_FOR_S
        while True:
            try:
                plugin = self.stack.plugin(node, resource)
                return plugin, await plugin.admit_container(count)
            except StackError as exc:  # its plugin not registered (again) yet
                self.retries["Allocate"] += 1
                if asyncio.get_running_loop().time() > deadline:
                    raise DriverError(f"Allocate on {node} failed: {exc}") from None
            except grpc.aio.AioRpcError as exc:
                self.retries["Allocate"] += 1
                if asyncio.get_running_loop().time() > deadline:
                    raise DriverError(f"Allocate on {node} failed: {exc.details()}") from None
            except RuntimeError as exc:  # a plugin just registered lists no devices yet
                self.retries["Allocate"] += 1
                if asyncio.get_running_loop().time() > deadline:
                    raise DriverError(f"Allocate on {node} failed: {exc}") from None
            await asyncio.sleep(delay)
            delay = min(delay * 2, RETRY_MAX_S)

    # ------------------------------------------------------------ the API server's part

    async def admit(
        self, pod: dict[str, Any]
    ) -> tuple[dict[str, Any] | None, str, tuple[str, ...]]:
        """(the admitted pod, "", warnings) or (None, the refusal, ())."""
        refusal = admit_priority(pod, self.stack.kube.priority_classes)  # before any webhook
        if refusal:
            return None, refusal, ()
        review = {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": str(uuid.uuid4()),
                "kind": {"group": "", "version": "v1", "kind": "Pod"},
                "resource": {"group": "", "version": "v1", "resource": "pods"},
                "namespace": pod["metadata"]["namespace"],
                "name": pod["metadata"]["name"],
                "operation": "CREATE",
                "userInfo": {"username": "gpuslice-dev"},
                "object": pod,
                "dryRun": False,
            },
        }
        reply = await self._post(f"{self.stack.webhook_url}/mutate", review, "the webhook")
        response = reply.json()["response"]
        if not response.get("allowed"):
            return None, str((response.get("status") or {}).get("message", "denied")), ()
        patched = pod
        if response.get("patch"):
            operations = json.loads(base64.b64decode(response["patch"]))
            patched = apply_patch(json.loads(json.dumps(pod)), operations)
        return patched, "", tuple(response.get("warnings") or ())

    # ------------------------------------------------------------ kube-scheduler's part

    async def schedule(self, pod: dict[str, Any]) -> tuple[str, str]:
        """(node, "") once bound, or ("", why not); :class:`Unschedulable` when
        the extender's filter passed no node."""
        names = [node.name for node in self.stack.nodes]
        scheduler = pod["spec"].get("schedulerName") or DEFAULT_SCHEDULER
        if scheduler not in (DEFAULT_SCHEDULER, GPUSLICE_SCHEDULER):
            return "", f"names scheduler {scheduler}, which this stack does not run"
        if dra.uses_claims(pod):
            return await self._schedule_claims(pod)
        fit, why = self.resource_fit(pod, names)
        if not fit:
            return "", why
        if scheduler == DEFAULT_SCHEDULER:
            node = fit[0]
            meta = pod["metadata"]
            await self._node_locks.setdefault(node, asyncio.Lock()).acquire()
            if not self.resource_fit(pod, [node])[0]:
                # another pod took the devices between the fit and the lock
                # (devices are taken at Allocate, under the lock): fit again
                self._node_locks[node].release()
                raise Retry(f"{node} no longer fits")
            try:
                await self.stack.kube.bind_pod(meta["namespace"], meta["name"], meta["uid"], node)
            except BaseException:
                self._node_locks[node].release()
                raise
            return node, ""
        node = await self._extender_node(pod, fit, len(names))
        # The node's device plugin answers Allocate with the pods bound to it in
        # bind order: from this bind until the pod's Allocate calls are done,
        # no other pod binds to the node (the lock is released in run_pod).
        lock = self._node_locks.setdefault(node, asyncio.Lock())
        await lock.acquire()
        try:
            await self._extender_bind(pod, node)
        except BaseException:
            lock.release()
            raise
        return node, ""

    async def _extender_node(self, pod: dict[str, Any], nodes: list[str], total: int) -> str:
        """The extender's choice among ``nodes``: its filter, then the best of
        its prioritize (the first sent among equals), as kube-scheduler asks it."""
        replicas = self.stack.extender_urls
        filtered = await self._post(
            [f"{url}/filter" for url in replicas], {"Pod": pod, "NodeNames": nodes}, "the extender"
        )
        result = filtered.json()
        if result.get("Error"):
            raise Retry(f"filter: {result['Error']}")
        passed = result.get("NodeNames") or []
        if not passed:
            failed = {
                **(result.get("FailedNodes") or {}),
                **(result.get("FailedAndUnresolvableNodes") or {}),
            }
            why = "; ".join(f"{node}: {reason}" for node, reason in sorted(failed.items()))
            if any(reason.startswith(WAIT_REASONS) for reason in failed.values()):
                # kube-scheduler tries an unschedulable pod again as the nodes change
                raise Retry(f"0/{total} nodes are available: {why}")
            raise Unschedulable(f"0/{total} nodes are available: {why}")
        body = {"Pod": pod, "NodeNames": passed}
        scored = await self._post(
            [f"{url}/prioritize" for url in replicas], body, "the extender", ok=(200, 400)
        )
        if scored.status_code != 200:
            raise Retry(f"prioritize: {scored.text}")
        scores = {entry["Host"]: entry["Score"] for entry in scored.json()}
        return max(passed, key=lambda n: (scores.get(n, 0), -passed.index(n)))  # type: ignore[no-any-return]

    async def _extender_bind(self, pod: Mapping[str, Any], node: str) -> None:
        """The extender's bind of ``pod`` to ``node``; Retry when it failed and
        the pod is not bound there."""
        meta = pod["metadata"]
        binding = {
            "PodName": meta["name"],
            "PodNamespace": meta["namespace"],
            "PodUID": meta["uid"],
            "Node": node,
        }
        urls = [f"{url}/bind" for url in self.stack.extender_urls]
        bound = (await self._post(urls, binding, "the extender")).json()
        if bound.get("Error"):
            held = await self.stack.kube.get_pod(meta["namespace"], meta["name"])
            if held["spec"].get("nodeName") != node:  # not bound before the error
                raise Retry(f"bind: {bound['Error']}")

    async def _schedule_claims(self, pod: dict[str, Any]) -> tuple[str, str]:
        """kube-scheduler with DRA: the DRA nodes (in order) on which every claim
        of the pod can be allocated; for a pod of gpuslice's scheduler that asks
        for resources the extender manages (the webhook keeps them beside the
        claim), the extender's choice among them and its bind, else the first;
        the claims written back allocated and reserved for the pod there."""
        claims = self._claims[pod["metadata"]["uid"]]
        names = [node.name for node in self.stack.nodes if node.dra]
        meta = pod["metadata"]
        scheduler = pod["spec"].get("schedulerName") or DEFAULT_SCHEDULER
        extender = scheduler == GPUSLICE_SCHEDULER and _asks_extender(pod)
        async with self._dra_lock:
            fit = []
            for name in names:
                try:
                    if await dra.fits_on(self.stack.kube, claims, name):
                        fit.append(name)
                except dra.DraError as exc:
                    raise Unschedulable(str(exc)) from None
            if not fit:
                raise Unschedulable(
                    f"0/{len(self.stack.nodes)} nodes are available: "
                    f"{len(names)} cannot allocate all of the pod's claims"
                    + (
                        f", {len(self.stack.nodes) - len(names)} serve no DRA driver"
                        if names
                        else ""
                    )
                )
            node = await self._extender_node(pod, fit, len(names)) if extender else fit[0]
            try:
                allocated = await dra.allocate_on(self.stack.kube, pod, claims, node)
            except dra.DraError as exc:
                raise Unschedulable(str(exc)) from None
            if allocated is None:  # cannot happen under the lock
                raise Retry(f"the claims no longer fit on {node}")
            self._claims[meta["uid"]] = allocated
            lock = self._node_locks.setdefault(node, asyncio.Lock())
            await lock.acquire()
            try:
                if extender:
                    await self._extender_bind(pod, node)
                else:
                    await self.stack.kube.bind_pod(
                        meta["namespace"], meta["name"], meta["uid"], node
                    )
            except BaseException:
                lock.release()
                raise
            return node, ""

    async def _prepare_claims(self, pod: Mapping[str, Any], node: str) -> dict[str, Any]:
        """kubelet's NodePrepareResources for the pod's claims: by claim UID, the
        (request, CDI IDs) of each device. Raises DriverError with the plugin's
        error, as kubelet reports it on the pod."""
        claims = self._claims.get(pod["metadata"]["uid"]) or []
        if not claims:
            return {}
        kubelet = self.stack.dra_kubelets.get(node)
        if kubelet is None:
            raise DriverError(f"node {node} runs no DRA plugin for the pod's claims")
        try:
            answers = await kubelet.prepare(DRIVER, dra.claim_refs(claims))
        except grpc.aio.AioRpcError as exc:
            raise DriverError(f"NodePrepareResources on {node} failed: {exc.details()}") from None
        prepared: dict[str, Any] = {}
        for uid, answer in answers.items():
            if not isinstance(answer, PreparedClaim):
                raise DriverError(f"NodePrepareResources on {node}: {answer}")
            prepared[uid] = [(d.request_names[0], d.cdi_ids) for d in answer.devices]
        return prepared

    async def _unprepare_claims(self, pod: Mapping[str, Any], node: str) -> None:
        claims = self._claims.pop(pod["metadata"]["uid"], None) or []
        kubelet = self.stack.dra_kubelets.get(node)
        if claims and kubelet is not None:
            try:
                answers = await kubelet.unprepare(DRIVER, dra.claim_refs(claims))
            except grpc.aio.AioRpcError as exc:
                log.warning("NodeUnprepareResources on %s failed: %s", node, exc.details())
            else:
                for uid, error in answers.items():
                    if error:
                        log.warning("claim %s not unprepared on %s: %s", uid, node, error)
        await dra.release_claims(self.stack.kube, pod)

    def resource_fit(self, pod: Mapping[str, Any], names: Sequence[str]) -> tuple[list[str], str]:
        """kube-scheduler's resource fit for the device-plugin resources the
        extender does not manage: the nodes whose kubelet has a plugin of each
        such resource with enough free healthy devices, and when none, why in
        kube-scheduler's words."""
        need = pod_needs(pod)
        fit: list[str] = []
        short: collections.Counter[str] = collections.Counter()
        for name in names:
            kubelet = self.stack.kubelets.get(name)
            missing = []
            for resource, count in sorted(need.items()):
                plugin = kubelet.plugin_for(resource) if kubelet is not None else None
                if plugin is None or len(plugin.free()) < count:
                    missing.append(resource)
            if missing:
                short.update(f"Insufficient {resource}" for resource in missing)
            else:
                fit.append(name)
        if fit:
            return fit, ""
        reasons = ", ".join(f"{count} {why}" for why, count in sorted(short.items()))
        return [], f"0/{len(names)} nodes are available: {reasons}."

    # ------------------------------------------------------------ kubelet's part

    def container_env(
        self,
        pod: Mapping[str, Any],
        container: Mapping[str, Any],
        node: NodeSpec,
        allocated: pb.ContainerAllocateResponse | None,
    ) -> dict[str, str]:
        env = {
            "PATH": f"{NATIVE_BUILD}:{os.environ.get('PATH', '/usr/bin:/bin')}",
            "HOME": os.environ.get("HOME", "/"),
            "LANG": "C.UTF-8",
        }
        for item in container.get("env") or []:
            name = item.get("name")
            if not isinstance(name, str):
                continue
            if "value" in item:
                env[name] = str(item["value"])
                continue
            ref = ((item.get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath")
            if ref in FIELD_REFS:
                env[name] = str(FIELD_REFS[ref](pod))
        if allocated is None:
            return env
        mounts = list(allocated.mounts)
        env.update({k: _rewrite(v, mounts) for k, v in allocated.envs.items()})
        # processes here see the host's paths: the grant is where the mount comes from
        grant_dir = [m for m in mounts if m.container_path == GRANT_DIR]
        if grant_dir:
            env["GPUSLICE_GRANT_DIR"] = grant_dir[0].host_path
        preload = [m for m in mounts if m.container_path == PRELOAD]
        if preload:
            with open(preload[0].host_path) as listed:
                libraries = [_rewrite(line.strip(), mounts) for line in listed if line.strip()]
            env["LD_PRELOAD"] = ":".join(libraries)
        if node.real:
            # what the NVIDIA runtime would do: only the container's GPUs exist
            env["CUDA_VISIBLE_DEVICES"] = env.get("NVIDIA_VISIBLE_DEVICES", "")
        else:  # the fake driver and NVML, showing the node's GPUs
            uuids = ",".join(node.uuids)
            env.update(
                {
                    "LD_LIBRARY_PATH": str(NATIVE_BUILD / "fake"),
                    "FAKECUDA_DEVICES": str(node.gpus),
                    "FAKECUDA_MEMORY": f"{node.memory_mib}m",
                    "FAKECUDA_UUIDS": uuids,
                    "FAKENVML_UUIDS": uuids,
                    "FAKENVML_NAME": node.model,
                }
            )
        env.setdefault("GPUSLICE_TELEMETRY_INTERVAL", "200ms")
        return env

    def log_path(self, pod: Mapping[str, Any], container: str) -> Path:
        """Where a container's output is kept: one directory per pod (its uid
        keeps a pod run twice apart), one file per container."""
        meta = pod["metadata"]
        where = self.log_dir / _file_name(meta["namespace"])
        where /= f"{_file_name(meta['name'])}-{meta['uid'][:8]}"
        return where / f"{_file_name(container)}.log"

    async def run_container(
        self,
        container: Mapping[str, Any],
        env: dict[str, str],
        run: ContainerRun,
        log_path: Path,
        pod_uid: str = "",
    ) -> None:
        argv = [str(a) for a in (container.get("command") or []) + (container.get("args") or [])]
        log_path.parent.mkdir(parents=True, exist_ok=True)
        run.log_path = log_path
        # Output goes to a file, not a pipe: a background process of the
        # container holding a pipe open would keep its end waiting.
        with log_path.open("w+b") as output:
            try:
                if not argv:
                    raise ValueError("no command")
                proc = await asyncio.create_subprocess_exec(
                    *argv,
                    env=env,
                    stdout=output,
                    stderr=asyncio.subprocess.STDOUT,
                    stdin=asyncio.subprocess.DEVNULL,
                    start_new_session=True,  # its own process group: the container's processes
                )
            except (OSError, ValueError) as exc:  # this container fails, with why; the run goes on
                run.returncode, run.error = start_failure(argv, exc)
                run.output = run.error + "\n"
                output.write(run.output.encode())
                return
            run.pid = proc.pid
            note = ""
            running = self._processes.setdefault(pod_uid, set())
            running.add(proc.pid)
            try:
                await asyncio.wait_for(proc.wait(), CONTAINER_TIMEOUT_S)
            except TimeoutError:
                note = f"killed after {CONTAINER_TIMEOUT_S:.0f}s\n"
            finally:
                running.discard(proc.pid)
                if not running:
                    self._processes.pop(pod_uid, None)
                # the container ends with its first process: the rest of its group too
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
                run.returncode = proc.returncode
                if note:
                    output.write(note.encode())
                output.seek(0)
                run.output = output.read().decode(errors="replace")

    # ------------------------------------------------------------ a whole pod

    async def run_pod(self, spec: Mapping[str, Any], namespace: str = "default") -> PodOutcome:
        pod = json.loads(json.dumps(spec))
        meta = pod.setdefault("metadata", {})
        meta.setdefault("namespace", namespace)
        meta.setdefault("name", f"pod-{uuid.uuid4().hex[:8]}")
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = utcnow().strftime("%Y-%m-%dT%H:%M:%SZ")
        pod.setdefault("spec", {})
        outcome = PodOutcome(meta["name"], meta["namespace"], meta["uid"], "Pending")
        admitted, refusal, warnings = await self.admit(pod)
        outcome.warnings = warnings
        if admitted is None:
            outcome.phase, outcome.reason = "Denied", refusal
            return outcome
        admitted["status"] = {"phase": "Pending"}
        self.stack.kube.add_pod(admitted)
        unlock: list[Callable[[], None]] = []
        try:
            if dra.uses_claims(admitted):
                try:
                    self._claims[meta["uid"]] = await dra.make_claims(self.stack.kube, admitted)
                except dra.DraError as exc:
                    outcome.phase, outcome.reason = "Pending", str(exc)
                    return outcome
            node, why = await self._schedule_retrying(admitted)
            if not node:
                scheduler = admitted["spec"].get("schedulerName") or DEFAULT_SCHEDULER
                ours = scheduler in (DEFAULT_SCHEDULER, GPUSLICE_SCHEDULER)
                outcome.phase, outcome.reason = "Unschedulable" if ours else "Pending", why
                return outcome
            outcome.node = node
            unlock.append(self._node_locks[node].release)  # taken by schedule
            held = await self.stack.kube.get_pod(meta["namespace"], meta["name"])
            record = (held["metadata"].get("annotations") or {}).get(PLACEMENT_ANNOTATION)
            if record is not None:
                outcome.placement = Placement.from_annotation(record)
            await self._run_on_node(admitted, node, outcome, unlock)
            return outcome
        finally:
            while unlock:  # when Allocate failed before it was released
                unlock.pop()()
            if dra.uses_claims(admitted):
                await self._unprepare_claims(admitted, outcome.node)
            await self._delete(admitted)

    async def _run_on_node(
        self,
        pod: dict[str, Any],
        node: str,
        outcome: PodOutcome,
        unlock: list[Callable[[], None]],
    ) -> None:
        """Allocate every container, let other pods bind to the node (``unlock``,
        once), run the containers."""
        spec = self.stack.node(node)
        containers = [("init", c) for c in pod["spec"].get("initContainers") or []]
        containers += [("app", c) for c in pod["spec"].get("containers") or []]
        envs: list[dict[str, str]] = []
        held: list[tuple[Plugin, str]] = []
        prepared = await self._prepare_claims(pod, node)
        claims = self._claims.get(pod["metadata"]["uid"]) or []
        if claims:
            outcome.placement = await self._dra_placement(pod["metadata"]["uid"])
        try:
            for _, container in containers:
                run = ContainerRun(str(container.get("name")))
                responses = []
                ids = dra.container_cdi_ids(pod, container, claims, prepared) if claims else []
                try:
                    edits = dra.container_response(self.stack.cdi_dir(node), ids)
                except dra.DraError as exc:
                    raise DriverError(f"container {run.name}: {exc}") from None
                if edits is not None:
                    responses.append(edits)
                    visible = edits.envs.get("NVIDIA_VISIBLE_DEVICES", "")
                    run.devices = tuple(u for u in visible.split(",") if u)
                for resource, count in sorted(_extended(container).items()):
                    if resource in MANAGED and (resource != GPU_RESOURCE or spec.dra):
                        # the extender's to count: no plugin serves it (on a DRA
                        # node not even the GPUs: kubelet's device manager skips
                        # a resource no device plugin registered)
                        continue
                    plugin, response = await self._allocate(node, count, resource)
                    held.extend((plugin, device) for device in plugin.last_allocated)
                    responses.append(response)
                    if resource == GPU_RESOURCE:
                        run.devices = plugin.last_allocated
                    else:
                        run.extended[resource] = plugin.last_allocated
                allocated = merge_responses(responses) if responses else None
                if allocated is not None:
                    run.env = dict(allocated.envs)
                envs.append(self.container_env(pod, container, spec, allocated))
                outcome.containers.append(run)
            while unlock:
                unlock.pop()()
            meta = pod["metadata"]
            with contextlib.suppress(PodNotFound):  # deleted meanwhile (delete_pod)
                self.stack.kube.set_phase(meta["namespace"], meta["name"], "Running")
            pairs = list(zip(containers, envs, outcome.containers, strict=True))

            async def run_all() -> None:
                for (kind, container), env, run in pairs:
                    if kind == "init":
                        await self.run_container(
                            container, env, run, self.log_path(pod, run.name), meta["uid"]
                        )
                        if run.returncode != 0:
                            return
                await asyncio.gather(
                    *(
                        self.run_container(
                            container, env, run, self.log_path(pod, run.name), meta["uid"]
                        )
                        for (kind, container), env, run in pairs
                        if kind == "app"
                    )
                )

            deleted = await self._stopped_if_deleted(pod, run_all(), outcome.containers)
            ok = all(run.returncode == 0 for run in outcome.containers) and not deleted
            outcome.phase = "Succeeded" if ok else "Failed"
            if deleted:
                outcome.reason = deleted
            elif not ok:
                failed = [
                    f"{r.name} (exit {r.returncode}{': ' + r.error if r.error else ''})"
                    for r in outcome.containers
                    if r.returncode not in (0, None)  # None: not run after a failed init
                ]
                outcome.reason = f"containers failed: {', '.join(failed)}"
            # each container's end, as kubelet reports it (a signal's as 128 + its number)
            exits = {
                r.name: r.returncode if r.returncode >= 0 else 128 - r.returncode
                for r in outcome.containers
                if r.returncode is not None
            }
            try:
                self.stack.kube.set_phase(meta["namespace"], meta["name"], outcome.phase, exits)
            except PodNotFound:
                outcome.phase, outcome.reason = "Deleted", "deleted while it ran"
        finally:
            for plugin, device in held:
                plugin.allocated.discard(device)

    async def delete_pod(self, namespace: str, name: str) -> None:
        """``kubectl delete --force``: the pod leaves the API server now (its
        DELETED event goes to every watch: the inventory's, the parked pods'),
        then its containers are killed, as kubelet does; its run ends
        ``Deleted``. PodNotFound when there is no such pod."""
        pod = await self.stack.kube.get_pod(namespace, name)
        self.stack.kube.delete_pod(namespace, name)
        for pid in list(self._processes.get(pod["metadata"].get("uid", ""), ())):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)

    async def _stopped_if_deleted(
        self, pod: dict[str, Any], work: Coroutine[Any, Any, None], runs: Sequence[ContainerRun]
    ) -> str:
        """Run ``work`` (the pod's containers); if the pod is deleted meanwhile (an
        eviction), stop them as kubelet does: SIGTERM, then SIGKILL after the
        grace period. Returns why they were stopped, "" when they ran to the end."""
        running = asyncio.ensure_future(work)
        deletion = asyncio.ensure_future(self._deletion(pod))
        try:
            await asyncio.wait({running, deletion}, return_when=asyncio.FIRST_COMPLETED)
            if running.done() or deletion.cancelled() or deletion.exception() is not None:
                await running
                return ""
            grace = deletion.result()
            for sig in (signal.SIGTERM, signal.SIGKILL):
                for run in runs:
                    if run.pid is not None and run.returncode is None:
                        with contextlib.suppress(ProcessLookupError, PermissionError):
                            os.killpg(run.pid, sig)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(running), grace)
                if running.done():
                    break
            await running
            return f"Evicted: the pod was deleted while it ran (grace period {grace:g}s)"
        finally:
            deletion.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await deletion

    async def _deletion(self, pod: dict[str, Any]) -> float:
        """Wait until the pod is being deleted; its grace period in seconds."""
        kube, meta = self.stack.kube, pod["metadata"]
        while True:
            try:
                held = await kube.get_pod(meta["namespace"], meta["name"])
            except PodNotFound:
                return 0.0
            if held["metadata"].get("uid") != meta["uid"]:
                return 0.0
            if held["metadata"].get("deletionTimestamp"):
                return float(held["metadata"].get("deletionGracePeriodSeconds") or 0)
            with contextlib.suppress(WatchExpired):
                async for kind, obj in kube.watch_pods(held["metadata"]["resourceVersion"]):
                    if obj.get("metadata", {}).get("uid") != meta["uid"]:
                        continue
                    if kind == "DELETED":
                        return 0.0
                    if obj["metadata"].get("deletionTimestamp"):
                        return float(obj["metadata"].get("deletionGracePeriodSeconds") or 0)

    async def _delete(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        with contextlib.suppress(PodNotFound):
            self.stack.kube.delete_pod(meta["namespace"], meta["name"])
        if self.bus is not None:
            ended = PodEnded(
                pod=PodRef(uid=meta["uid"], namespace=meta["namespace"], name=meta["name"]),
                phase="Deleted",
            )
            try:
                await self.bus.publish_model(self.bus.subjects.pod_ended, ended)
            except Exception as exc:  # the watch releases the pod anyway
                log.warning("cannot report pod %s ended on the bus: %s", meta["uid"], exc)
