"""Trace replay through a live extender and Redis ledger (``gpuslice sim --via URL``).

The replay plays kube-scheduler: it registers the trace's nodes in the ledger,
then for each pod of a sample (the same seeded arrival order as the offline
replay) applies the node CPU/memory fit kube-scheduler's own filters would,
POSTs ``filter``, ``prioritize`` (when more than one node is left) and ``bind``
to the extender, and takes the best-scored node; a bound GPU pod is then
allocated in the ledger, as kubelet's Allocate does at once (the extender binds
one GPU pod per node at a time until then). The extender must run with
``GPUSLICE_KUBE_API=local`` so that it learns each pod from its filter call; the
first filter call carries the trace's nodes as full Node objects (allocatable
CPU and memory, kube-scheduler's nodeCacheCapable=false form), from which it
learns them too; every later call names them. CPU-only pods take the first node
that fits, or with ``cpu_pods`` go through filter, prioritize and bind as GPU
pods do (an extender with ``GPUSLICE_SCORE_CPU_PODS=true`` scores them as the
offline replay does).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
import urllib.parse
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
import orjson

from gpuslice_common.ledger import Ledger
from gpuslice_common.models import GpuDevice, NodeInventory
from gpuslice_scheduler.sim import (
    DEFAULT_MEMORY_MIB,
    MODEL_MEMORY_MIB,
    SPLIT_COUNT,
    PodClass,
    TraceError,
    TraceNode,
    arrivals,
)

VERBS = ("filter", "prioritize", "bind")
PER_POD = "filter+prioritize+bind"  # the three calls of one bound pod, end to end
BIND_ATTEMPTS = 3  # schedulings of one pod whose bind failed, before it counts as failed


@dataclass
class ViaResult:
    pods: int
    scheduled_pods: int
    failed_pods: int
    bind_errors: int  # binds that failed (a pod is scheduled again, up to BIND_ATTEMPTS times)
    milli_gpu_allocation_ratio: float  # of the cluster, read back from the ledger
    pods_per_second: float
    extender_pods_per_second: float  # pods that went through filter, prioritize and bind
    latency_ms: dict[str, dict[str, float]] = field(default_factory=dict)
    wall_seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def inventory(node: TraceNode, split_count: int = SPLIT_COUNT) -> NodeInventory:
    memory = MODEL_MEMORY_MIB.get(node.model, DEFAULT_MEMORY_MIB)
    devices = tuple(
        GpuDevice(uuid=f"{node.name}-gpu{i}", index=i, model=node.model, memory_mib=memory)
        for i in range(node.gpus)
    )
    return NodeInventory(node=node.name, devices=devices, split_count=split_count)


def node_json(node: TraceNode) -> dict[str, Any]:
    """The trace node as a Node object: its allocatable CPU and memory."""
    allocatable = {"cpu": f"{node.cpu_milli}m", "memory": f"{node.memory_mib}Mi"}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": node.name},
        "status": {"allocatable": allocatable, "capacity": dict(allocatable)},
    }


def pod_json(pod: PodClass, name: str) -> dict[str, Any]:
    """The trace pod as a HAMi pod spec (a CPU-only one asks for no GPU at all)."""
    limits: dict[str, str] = {"cpu": f"{pod.cpu_milli}m", "memory": f"{pod.memory_mib}Mi"}
    if pod.num_gpu:
        limits["nvidia.com/gpu"] = str(pod.num_gpu)
    if 0 < pod.gpu_milli < 1000:
        share = str(math.ceil(pod.gpu_milli / 10))
        limits["nvidia.com/gpucores"] = share
        limits["nvidia.com/gpumem-percentage"] = share
    annotations = {"nvidia.com/use-gputype": ",".join(pod.gpu_spec)} if pod.gpu_spec else {}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": "sim",
            "uid": str(uuid.uuid4()),
            "annotations": annotations,
        },
        "spec": {"containers": [{"name": "main", "resources": {"limits": limits}}]},
    }


async def register(ledger: Ledger, nodes: Sequence[TraceNode], split_count: int) -> None:
    gate = asyncio.Semaphore(32)

    async def one(node: TraceNode) -> None:
        async with gate:
            await ledger.register_node(inventory(node, split_count), rebuilt=True)

    await asyncio.gather(*(one(n) for n in nodes if n.gpus > 0))


async def wait_ready(http: httpx.AsyncClient, nodes: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            reply = await http.get("/readyz")
            body = reply.json()
            if reply.status_code == 200 and body.get("nodes", 0) >= nodes:
                return
            last = f"{reply.status_code} {body}"
        except (httpx.HTTPError, ValueError) as exc:
            last = str(exc) or type(exc).__name__
        await asyncio.sleep(0.2)
    raise TraceError(f"the extender did not become ready with {nodes} nodes: {last}")


def _percentiles(samples: list[float]) -> dict[str, float]:
    if not samples:
        return {"count": 0}
    ms = np.asarray(samples) * 1000
    return {
        "count": len(samples),
        "p50": round(float(np.percentile(ms, 50)), 3),
        "p99": round(float(np.percentile(ms, 99)), 3),
        "max": round(float(ms.max()), 3),
    }


class Connection:
    """One keep-alive HTTP/1.1 connection posting JSON, as kube-scheduler's client does.

    The replay shares the machine's CPUs with the extender it measures; a general
    HTTP client would cost the driver several times what it costs kube-scheduler.
    """

    def __init__(self, url: str) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise TraceError(f"--via needs an http://host:port URL, not {url!r}")
        self.host, self.port = parts.hostname, parts.port or 80
        self.base = parts.path.rstrip("/")
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        """POST ``body``; a connection the server closed meanwhile is opened again once."""
        try:
            return await self._post(path, body)
        except (OSError, EOFError, asyncio.IncompleteReadError, IndexError, ValueError):
            await self.close()
            return await self._post(path, body)

    async def _post(self, path: str, body: bytes) -> tuple[int, bytes]:
        if self.writer is None or self.reader is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        head = (
            f"POST {self.base}{path} HTTP/1.1\r\nHost: {self.host}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        self.writer.write(head.encode() + body)
        await self.writer.drain()
        status = int((await self.reader.readline()).split()[1])
        length = -1
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            if name.strip().lower() == "content-length":
                length = int(value)
        if length < 0:
            raise TraceError(f"POST {path}: the reply has no Content-Length")
        return status, await self.reader.readexactly(length)

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            with contextlib.suppress(OSError):
                await self.writer.wait_closed()
        self.reader = self.writer = None


async def replay_via(
    url: str,
    redis_url: str,
    nodes: Sequence[TraceNode],
    pods: Sequence[PodClass],
    *,
    seed: int = 42,
    sample: int = 1000,
    inflation: float = 1.3,
    split_count: int = SPLIT_COUNT,
    ledger_prefix: str = "gpuslice",
    cpu_pods: bool = False,
    progress: Callable[[float], None] | None = None,
) -> ViaResult:
    """Replay ``sample`` pods of the seeded arrival order through the extender at ``url``.

    ``cpu_pods``: pods without GPUs go through the extender too, not first-fit."""
    result = await replay_via_replicas(
        [url],
        redis_url,
        nodes,
        pods,
        seed=seed,
        sample=sample,
        inflation=inflation,
        split_count=split_count,
        ledger_prefix=ledger_prefix,
        cpu_pods=cpu_pods,
        progress=progress,
    )
    return result.replicas[0]


@dataclass
class ReplicasResult:
    """Several schedulers replaying at once, each through its own extender replica."""

    replicas: list[ViaResult]
    milli_gpu_allocation_ratio: float
    extender_pods_per_second: float  # all replicas together
    wall_seconds: float
    overcommitted: list[str]  # cards holding more than their capacity, and ledger mismatches


async def replay_via_replicas(
    urls: Sequence[str],
    redis_url: str,
    nodes: Sequence[TraceNode],
    pods: Sequence[PodClass],
    *,
    seed: int = 42,
    sample: int = 1000,
    inflation: float = 1.3,
    split_count: int = SPLIT_COUNT,
    ledger_prefix: str = "gpuslice",
    cpu_pods: bool = False,
    progress: Callable[[float], None] | None = None,
) -> ReplicasResult:
    """Replay the seeded arrival order through the extenders at ``urls`` at once,
    as that many kube-schedulers would: each takes every len(urls)-th pod, keeps
    its own view of node CPU and memory, and binds through its own replica, so
    the replicas race for the same cards in the one ledger. Afterwards every
    card is checked against its capacity and every node's usage against its
    reservations."""
    connections = [Connection(url) for url in urls]  # checks the URLs first
    ledger = Ledger.from_url(redis_url, prefix=ledger_prefix)
    try:
        await register(ledger, nodes, split_count)
        for url in urls:
            async with httpx.AsyncClient(base_url=url.rstrip("/"), timeout=30.0) as http:
                await wait_ready(http, sum(1 for n in nodes if n.gpus > 0))
        capacity = 1000 * sum(n.gpus for n in nodes)
        order = arrivals(pods, capacity, inflation, seed)[:sample]
        started = time.perf_counter()
        try:
            results = await asyncio.gather(
                *(
                    _drive(
                        c,
                        ledger,
                        nodes,
                        pods,
                        order[k :: len(urls)],
                        seed,
                        cpu_pods,
                        progress if k == 0 else None,
                    )
                    for k, c in enumerate(connections)
                )
            )
        finally:
            for connection in connections:
                await connection.close()
        wall = time.perf_counter() - started
        names = [n.name for n in nodes if n.gpus > 0]
        states = await ledger.nodes_gpus(names)
        overcommitted = [
            f"{g.device.uuid}: {g.used} over {g.capacity}"
            for s in states.values()
            for g in s
            if g.used.memory_mib > g.capacity.memory_mib
            or g.used.cores > g.capacity.cores
            or g.used.slots > g.capacity.slots
        ]
        for name in names:
            overcommitted += await ledger.check_node(name)
    finally:
        await ledger.close()
    cores = sum(g.used.cores * 1000 // max(g.capacity.cores, 1) for s in states.values() for g in s)
    ratio = round(100.0 * cores / max(1000 * sum(len(s) for s in states.values()), 1), 3)
    for result in results:
        result.milli_gpu_allocation_ratio = ratio
    through = sum(int(r.latency_ms[PER_POD]["count"]) for r in results)
    return ReplicasResult(
        replicas=list(results),
        milli_gpu_allocation_ratio=ratio,
        extender_pods_per_second=round(through / wall, 1) if wall > 0 else 0.0,
        wall_seconds=round(wall, 3),
        overcommitted=overcommitted,
    )


async def _drive(
    http: Connection,
    ledger: Ledger,
    nodes: Sequence[TraceNode],
    pods: Sequence[PodClass],
    order: Sequence[int],
    seed: int,
    cpu_pods: bool,
    progress: Callable[[float], None] | None,
) -> ViaResult:
    cpu = np.asarray([n.cpu_milli for n in nodes], dtype=float)
    mem = np.asarray([n.memory_mib for n in nodes], dtype=float)
    gpus = np.asarray([n.gpus for n in nodes])
    names = [n.name for n in nodes]
    index = {name: i for i, name in enumerate(names)}
    latency: dict[str, list[float]] = {v: [] for v in (*VERBS, PER_POD)}
    scheduled = failed = bind_errors = 0
    # the first filter call sends full Node objects, from which the extender learns them
    node_list: dict[str, Any] | None = {
        "apiVersion": "v1",
        "kind": "NodeList",
        "items": [node_json(n) for n in nodes],
    }

    async def call(verb: str, body: dict[str, Any]) -> Any:
        nonlocal node_list
        if verb == "filter" and node_list is not None:
            # every node, so that the extender knows them all from here on; of
            # those it passes, the candidates sent are the answer
            sent = set(body.pop("NodeNames"))
            body["Nodes"], node_list = node_list, None
            reply = await call(verb, body)
            kept = (reply.get("Nodes") or {}).get("items") or ()
            reply["NodeNames"] = [
                n["metadata"]["name"] for n in kept if n["metadata"]["name"] in sent
            ]
            return reply
        started = time.perf_counter()
        try:
            status, reply = await http.post(f"/{verb}", orjson.dumps(body))
        except (OSError, EOFError, asyncio.IncompleteReadError, IndexError, ValueError) as exc:
            raise TraceError(f"{verb}: no answer from the extender ({exc})") from None
        latency[verb].append(time.perf_counter() - started)
        if status != 200:
            raise TraceError(f"{verb} answered {status}: {reply[:200]!r}")
        try:
            return orjson.loads(reply)
        except orjson.JSONDecodeError:
            raise TraceError(
                f"{verb} answered something that is not JSON: {reply[:200]!r}"
            ) from None

    started = time.perf_counter()
    for i, k in enumerate(order):
        pod = pods[k]
        fits = np.flatnonzero((cpu >= pod.cpu_milli) & (mem >= pod.memory_mib))
        if pod.num_gpu == 0 and not cpu_pods:
            chosen = int(fits[0]) if fits.size else -1
        else:
            spec = pod_json(pod, f"sim-{seed}-{http.port}-{i}")
            # a failed bind sends the pod back to kube-scheduler's queue: it is
            # scheduled again from a fresh filter (another scheduler may have
            # taken the cards meanwhile)
            for _ in range(BIND_ATTEMPTS):
                began = time.perf_counter()
                chosen = await _place(call, spec, fits, gpus, names, index)
                if chosen >= 0:
                    latency[PER_POD].append(time.perf_counter() - began)
                if chosen != -2:
                    break
                bind_errors += 1
        if chosen >= 0 and pod.num_gpu:
            # kubelet's Allocate, as soon as the pod is bound: the node's turn
            # passes (the extender binds one GPU pod per node at a time)
            await ledger.allocate(names[chosen], pod.num_gpu)
        if chosen >= 0:
            cpu[chosen] -= pod.cpu_milli
            mem[chosen] -= pod.memory_mib
            scheduled += 1
        else:
            failed += 1
        if progress is not None and i % 64 == 0:
            progress(i / max(len(order), 1))
    wall = time.perf_counter() - started
    return ViaResult(
        pods=len(order),
        scheduled_pods=scheduled,
        failed_pods=failed,
        bind_errors=bind_errors,
        milli_gpu_allocation_ratio=0.0,
        pods_per_second=round(len(order) / wall, 1) if wall > 0 else 0.0,
        extender_pods_per_second=round(len(latency[PER_POD]) / wall, 1) if wall > 0 else 0.0,
        latency_ms={v: _percentiles(s) for v, s in latency.items()},
        wall_seconds=round(wall, 3),
    )


async def _place(
    call: Callable[[str, dict[str, Any]], Any],
    pod: dict[str, Any],
    fits: np.ndarray[Any, Any],
    gpus: np.ndarray[Any, Any],
    names: list[str],
    index: dict[str, int],
) -> int:
    """Filter, prioritize and bind one pod; the node index, -1 if none fits, -2 on a bind error.

    A GPU pod is offered the nodes with GPUs that fit its CPU and memory, a
    CPU-only pod every node that fits them."""
    gpu_pod = "nvidia.com/gpu" in pod["spec"]["containers"][0]["resources"]["limits"]
    candidates = [names[i] for i in fits.tolist() if gpus[i] > 0 or not gpu_pod]
    if not candidates:
        return -1
    reply = await call("filter", {"Pod": pod, "NodeNames": candidates})
    if reply.get("Error"):
        raise TraceError(f"filter: {reply['Error']}")
    feasible = reply.get("NodeNames") or []
    if not feasible:
        return -1
    best = feasible[0]
    if len(feasible) > 1:
        scores = await call("prioritize", {"Pod": pod, "NodeNames": feasible})
        best = max(scores, key=lambda h: h["Score"])["Host"]  # first of the best, as sent
    meta = pod["metadata"]
    bound = await call(
        "bind",
        {
            "PodName": meta["name"],
            "PodNamespace": meta["namespace"],
            "PodUID": meta["uid"],
            "Node": best,
        },
    )
    if bound.get("Error"):
        return -2
    return index[best]
