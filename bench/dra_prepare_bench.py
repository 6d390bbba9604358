"""DRA benchmark: what kubelet waits for when it prepares a pod's ResourceClaim,
beside the device plugin's Allocate measured the same way.

One run, real redis-server and nats-server on loopback, the inventory as its own
process reading claims from the dev API server over HTTP, the node agent in this
process on simulated GPUs:

* **DRA**: the agent in DRA mode, registered with a stand-in kubelet over the real
  plugin registration; ``--held`` claims already prepared on the node; then, one
  at a time, a new claim (allocated and reserved for its bound pod in the API
  server beforehand, as kube-scheduler leaves it) is prepared with
  NodePrepareResources over the plugin's unix socket (timed), then unprepared
  (not timed), so the node keeps holding ``--held``;
* **device plugin** (the baseline): a second node's agent in device-plugin mode,
  ``--held`` pods allocated; then, one at a time, a bound pod's container is
  allocated with Allocate over the plugin's socket (timed) and released.

    python bench/dra_prepare_bench.py [--held 64] [--claims 300] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import deviceplugin_bench  # bench/ is the script's own directory
import grpc

from gpuslice_cli.dev.apiserver import DevApiServer
from gpuslice_cli.dev.drakubelet import DevDraKubelet, PreparedClaim
from gpuslice_common.config import DevicePluginSettings
from gpuslice_common.dra import API_VERSION, DRIVER, device_name
from gpuslice_common.kube import LocalKubeApi, ObjectRef
from gpuslice_common.ledger import Ledger
from gpuslice_common.models import ClaimRef, ContainerAssignment, DeviceGrant, Placement, PodRef
from gpuslice_common.servers import NatsServer, RedisServer
from gpuslice_deviceplugin.api import deviceplugin_pb2 as pb
from gpuslice_deviceplugin.api import deviceplugin_pb2_grpc as pb_grpc
from gpuslice_deviceplugin.kubelet import LinkTiming
from gpuslice_deviceplugin.service import connect_bus, running

GPUS = 8
SPLIT = 100
NAMESPACE = "bench"
CLAIMS = ObjectRef(API_VERSION, "resourceclaims", NAMESPACE)


def start_inventory(work: Path, redis_url: str, nats_url: str, kubeconfig: Path) -> Any:
    """The inventory reading the API server through ``kubeconfig``."""
    os.environ.pop("KUBERNETES_SERVICE_HOST", None)
    return deviceplugin_bench.start_inventory(
        work,
        redis_url,
        nats_url,
        GPUSLICE_KUBE_API="cluster",
        KUBECONFIG=str(kubeconfig),
        GPUSLICE_RECONCILE_GRACE="600s",
    )


def summary(samples_s: list[float]) -> dict[str, float]:
    ms = [s * 1000 for s in samples_s]
    return {**deviceplugin_bench.summary(samples_s), "max_ms": round(max(ms), 3)}


def agent_settings(work: Path, node: str, nats_url: str, *, dra: bool) -> DevicePluginSettings:
    home = work / node
    home.mkdir()
    config = home / "nodes.yaml"
    config.write_text(f"defaults: {{deviceSplitCount: {SPLIT}, simulate: {{count: {GPUS}}}}}\n")
    library = home / "libgpuslice.so"
    library.write_bytes(b"\x7fELF stand-in: the benchmark never loads it")
    return DevicePluginSettings(
        node_name=node,
        kubelet_dir=str(home / "k"),
        host_dir=str(home / "host"),
        interposer_library=str(library),
        node_config_file=str(config),
        backend="simulated",
        nats_url=nats_url,
        kube_api="cluster" if dra else "none",
        dra=dra,
        dra_plugins_dir=str(home / "k" / "plugins"),
        dra_registry_dir=str(home / "k" / "reg"),
        cdi_dir=str(home / "cdi"),
    )


def claim_objects(node: str, card: str, i: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """A bound pod and its claim, allocated on ``card`` (100 MiB, 1 % of it)."""
    pod_uid, claim_name = str(uuid.uuid4()), f"claim-{i}"
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"pod-{i}", "namespace": NAMESPACE, "uid": pod_uid},
        "spec": {
            "nodeName": node,
            "resourceClaims": [{"name": "gpu", "resourceClaimName": claim_name}],
            "containers": [
                {"name": "main", "image": "cuda", "resources": {"claims": [{"name": "gpu"}]}}
            ],
        },
        "status": {"phase": "Pending"},
    }
    claim = {
        "apiVersion": API_VERSION,
        "kind": "ResourceClaim",
        "metadata": {"name": claim_name, "namespace": NAMESPACE},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "x"}}]}},
    }
    status = {
        "allocation": {
            "devices": {
                "results": [
                    {
                        "request": "gpu",
                        "driver": DRIVER,
                        "pool": node,
                        "device": device_name(card),
                        "consumedCapacity": {"memory": "100Mi", "cores": "1"},
                        "shareID": str(uuid.uuid4()),
                    }
                ]
            },
            "nodeSelector": {
                "nodeSelectorTerms": [
                    {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
                ]
            },
        },
        "reservedFor": [{"resource": "pods", "name": f"pod-{i}", "uid": pod_uid}],
    }
    return pod, {**claim, "status": status}


async def add_claim(kube: LocalKubeApi, node: str, card: str, i: int) -> ClaimRef:
    pod, claim = claim_objects(node, card, i)
    kube.add_pod(pod)
    made = await kube.create_object(CLAIMS, claim)
    await kube.replace_object(
        CLAIMS.named(made["metadata"]["name"]),
        {**made, "status": claim["status"]},
        subresource="status",
    )
    return ClaimRef(namespace=NAMESPACE, name=made["metadata"]["name"], uid=made["metadata"]["uid"])


async def prepare(kubelet: DevDraKubelet, claim: ClaimRef) -> None:
    answer = (await kubelet.prepare(DRIVER, [claim]))[claim.uid]
    if not isinstance(answer, PreparedClaim):
        raise SystemExit(f"NodePrepareResources refused {claim}: {answer}")


async def unprepare(kubelet: DevDraKubelet, claim: ClaimRef) -> None:
    error = (await kubelet.unprepare(DRIVER, [claim]))[claim.uid]
    if error:
        raise SystemExit(f"NodeUnprepareResources refused {claim}: {error}")


async def bench_dra(
    args: argparse.Namespace,
    work: Path,
    kube: LocalKubeApi,
    redis_url: str,
    nats_url: str,
) -> list[float]:
    settings = agent_settings(work, "dra-node", nats_url, dra=True)
    Path(settings.dra_registry_dir).mkdir(parents=True)  # noqa: ASYNC240 (set-up)
    bus = await connect_bus(settings)  # a node's bus: replies come to its own inbox
    kubelet = DevDraKubelet(Path(settings.dra_registry_dir))
    await kubelet.start()
    ledger = Ledger.from_url(redis_url)
    try:
        async with running(settings, bus=bus, kube=kube, serve_http=False) as state:
            await kubelet.registration(DRIVER, timeout=30)
            cards = [d.uuid for d in state.agent.device_list.replicas.devices]
            await wait_ready(state.ready)
            # what the inventory's first reconciliation pass would stamp
            await ledger.register_node(state.agent.inventory(), rebuilt=True)
            for i in range(args.held):
                await prepare(kubelet, await add_claim(kube, "dra-node", cards[i % GPUS], i))
            samples = []
            for i in range(args.held, args.held + args.claims + 10):
                claim = await add_claim(kube, "dra-node", cards[i % GPUS], i)
                start = time.perf_counter()
                await prepare(kubelet, claim)
                took = time.perf_counter() - start
                await unprepare(kubelet, claim)
                if i >= args.held + 10:  # the first ten warm up
                    samples.append(took)
            return samples
    finally:
        await kubelet.stop()
        await ledger.close()
        await bus.close()


async def wait_ready(ready: Callable[[], Awaitable[bool]]) -> None:
    deadline = time.monotonic() + 30
    while not await ready():
        if time.monotonic() > deadline:
            raise SystemExit("the DRA agent was not ready within 30 s")
        await asyncio.sleep(0.1)


@asynccontextmanager
async def registration_socket(path: Path) -> AsyncIterator[asyncio.Event]:
    registered = asyncio.Event()

    class Registration(pb_grpc.RegistrationServicer):
        async def Register(self, request: pb.RegisterRequest, context: Any) -> pb.Empty:
            registered.set()
            return pb.Empty()

    server = grpc.aio.server()
    pb_grpc.add_RegistrationServicer_to_server(Registration(), server)
    server.add_insecure_port(f"unix://{path}")
    await server.start()
    try:
        yield registered
    finally:
        await server.stop(0)


async def bench_device_plugin(
    args: argparse.Namespace, work: Path, redis_url: str, nats_url: str
) -> list[float]:
    settings = agent_settings(work, "dp-node", nats_url, dra=False)
    Path(settings.kubelet_dir).mkdir(parents=True)  # noqa: ASYNC240 (set-up)
    bus = await connect_bus(settings)
    ledger = Ledger.from_url(redis_url)
    try:
        async with (
            registration_socket(Path(settings.kubelet_dir) / "kubelet.sock") as registered,
            running(settings, bus=bus, serve_http=False, timing=LinkTiming(poll_s=0.05)) as state,
        ):
            await asyncio.wait_for(registered.wait(), 30)
            cards = [d.uuid for d in state.agent.device_list.replicas.devices]
            await ledger.register_node(state.agent.inventory(), rebuilt=True)
            socket = f"unix://{Path(settings.kubelet_dir) / 'gpuslice.sock'}"
            async with grpc.aio.insecure_channel(socket) as channel:
                stub = pb_grpc.DevicePluginStub(channel)
                stream = stub.ListAndWatch(pb.Empty())
                first = await stream.read()
                ids = [d.ID for d in first.devices]  # type: ignore[union-attr]

                async def allocate(i: int) -> float:
                    uid = f"pod-{i}"
                    await ledger.reserve(
                        Placement(
                            pod=PodRef(uid=uid, namespace=NAMESPACE, name=uid),
                            node="dp-node",
                            containers=(
                                ContainerAssignment(
                                    name="main",
                                    devices=(
                                        DeviceGrant(uuid=cards[i % GPUS], memory_mib=100, cores=1),
                                    ),
                                ),
                            ),
                        )
                    )
                    await ledger.mark_bound(uid)
                    request = pb.AllocateRequest(
                        container_requests=[pb.ContainerAllocateRequest(devices_ids=[ids[i]])]
                    )
                    start = time.perf_counter()
                    await stub.Allocate(request)
                    return time.perf_counter() - start

                for i in range(args.held):
                    await allocate(i)
                samples = []
                for i in range(args.held, args.held + args.claims + 10):
                    took = await allocate(i)
                    await ledger.release(f"pod-{i}", "benchmark")
                    if i >= args.held + 10:
                        samples.append(took)
                stream.cancel()
                return samples
    finally:
        await ledger.close()
        await bus.close()


async def main(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="drab", dir="/tmp"))
    kube = LocalKubeApi()
    try:
        with RedisServer(work / "redis", persist=False) as redis, NatsServer(work / "nats") as nats:
            async with DevApiServer(kube).serving() as api:
                kubeconfig = api.kubeconfig(work / "kubeconfig")
                bus = await connect_bus(agent_settings(work, "setup", nats.url, dra=False))
                await bus.ensure_audit_stream(
                    DevicePluginSettings(node_name="x", nats_url=nats.url).audit_max_age
                )
                inventory = await asyncio.to_thread(
                    start_inventory, work, redis.url, nats.url, kubeconfig
                )
                try:
                    dra = await bench_dra(args, work, kube, redis.url, nats.url)
                    plugin = await bench_device_plugin(args, work, redis.url, nats.url)
                finally:
                    inventory.terminate()
                    await asyncio.to_thread(inventory.wait, 10)
                    await bus.close()
    finally:
        if not os.environ.get("KEEP"):
            shutil.rmtree(work, ignore_errors=True)
    return {
        "held": args.held,
        "claims": args.claims,
        "node_prepare_resources": summary(dra),
        "device_plugin_allocate": summary(plugin),
    }


def run() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--held", type=int, default=64, help="claims the node already holds")
    parser.add_argument("--claims", type=int, default=300, help="claims timed")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = asyncio.run(main(args))
    result["machine"] = f"{platform.machine()} {os.cpu_count()} CPUs ({platform.node()})"
    result["date"] = datetime.now(UTC).strftime("%Y-%m-%d")
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"one claim at a time on a node holding {result['held']}, {result['claims']} timed")
    for key in ("node_prepare_resources", "device_plugin_allocate"):
        s = result[key]
        print(
            f"  {key:24s} p50 {s['p50_ms']:8.3f} ms  p99 {s['p99_ms']:8.3f} ms"
            f"  max {s['max_ms']:8.3f} ms"
        )


if __name__ == "__main__":
    run()
