"""Device plugin benchmark: what kubelet waits for when it admits a GPU container.

Runs the agent (simulated GPUs, real redis-server and nats-server on loopback,
the inventory as its own process) and plays kubelet over the plugin's unix
socket: for each pod, bound in the ledger beforehand, GetPreferredAllocation
then Allocate, as kubelet calls them. The baseline, measured in the same run
over the same socket, is an empty gRPC round trip (GetDevicePluginOptions).

The ledger's part of Allocate is also timed alone, both ways, interleaved in
the same run: through the bus as the agent asks now (agent -> NATS ->
inventory -> Redis -> reply) and directly (agent -> Redis), as it did when it
held a ledger credential. Also: how long a health change takes to reach an open
ListAndWatch stream.

    python bench/deviceplugin_bench.py [--pods 500] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
import httpx

from gpuslice_common.bus import Bus
from gpuslice_common.config import DevicePluginSettings
from gpuslice_common.ledger import Ledger
from gpuslice_common.models import ContainerAssignment, DeviceGrant, Placement, PodRef
from gpuslice_common.servers import NatsServer, RedisServer, free_port
from gpuslice_deviceplugin.api import deviceplugin_pb2 as pb
from gpuslice_deviceplugin.api import deviceplugin_pb2_grpc as pb_grpc
from gpuslice_deviceplugin.gateway import InventoryGateway
from gpuslice_deviceplugin.kubelet import LinkTiming
from gpuslice_deviceplugin.service import connect_bus, running

ROOT = Path(__file__).resolve().parents[1]
NODE = "bench-node"
GPUS = 8
SPLIT = 100


def percentile(samples: list[float], p: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def summary(samples_s: list[float]) -> dict[str, float]:
    ms = [s * 1000 for s in samples_s]
    return {
        "p50_ms": round(statistics.median(ms), 3),
        "p99_ms": round(percentile(ms, 99), 3),
        "mean_ms": round(statistics.fmean(ms), 3),
    }


async def timed(n: int, call: Callable[[int], Awaitable[Any]]) -> list[float]:
    out = []
    for i in range(n):
        start = time.perf_counter()
        await call(i)
        out.append(time.perf_counter() - start)
    return out


class Registration(pb_grpc.RegistrationServicer):
    def __init__(self) -> None:
        self.done = asyncio.Event()

    async def Register(self, request: pb.RegisterRequest, context: Any) -> pb.Empty:
        self.done.set()
        return pb.Empty()


def start_inventory(
    work: Path, redis_url: str, nats_url: str, **settings: str
) -> subprocess.Popen[bytes]:
    """``python -m gpuslice_inventory``, as a cluster runs it (one replica);
    ``settings``: more of its environment (no Kubernetes API unless they say)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUSLICE_")}
    env.update(
        GPUSLICE_NATS_URL=nats_url,
        GPUSLICE_REDIS_URL=redis_url,
        GPUSLICE_KUBE_API="none",
        GPUSLICE_LISTEN_HOST="127.0.0.1",
        GPUSLICE_LISTEN_PORT=str(port),
        GPUSLICE_CONSOLE_PORT="0",  # no console: the bench measures the node path
        GPUSLICE_LOG_LEVEL="WARNING",
    )
    env.update(settings)
    with (work / "inventory.log").open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gpuslice_inventory"], env=env, stdout=log, stderr=log
        )
    deadline = time.monotonic() + 30
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"the inventory exited: {(work / 'inventory.log').read_text()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise SystemExit("the inventory did not get ready")
        time.sleep(0.1)


async def bind_pod(ledger: Ledger, gpus: list[str], uid: str, containers: int) -> None:
    """One pod of ``containers`` one-GPU containers, bound: a node waits for one
    pod's Allocates at a time (the extender's binds take turns)."""
    await ledger.reserve(
        Placement(
            pod=PodRef(uid=uid, namespace="bench", name=uid),
            node=NODE,
            containers=tuple(
                ContainerAssignment(
                    name=f"c{i}",
                    devices=(DeviceGrant(uuid=gpus[i % GPUS], memory_mib=100, cores=1),),
                )
                for i in range(containers)
            ),
        )
    )
    await ledger.mark_bound(uid)


async def ledger_part(
    args: argparse.Namespace, ledger: Ledger, gateway: InventoryGateway, gpus: list[str]
) -> tuple[list[float], list[float]]:
    """The ledger's part of Allocate, through the bus and directly, interleaved,
    for the containers of one bound pod at a time, released afterwards."""
    loop = asyncio.get_running_loop()
    bus: list[float] = []
    direct: list[float] = []
    batch = 5
    for first in range(0, args.pods + 4 * batch, batch):  # the first batches warm up
        uid = f"ledger-{first}"
        await bind_pod(ledger, gpus, uid, 2 * batch)
        for _ in range(batch):
            start = time.perf_counter()
            await gateway.allocate(1, uuid.uuid4().hex, loop.time() + 5)
            took_bus = time.perf_counter() - start
            start = time.perf_counter()
            await ledger.allocate(NODE, 1, uuid.uuid4().hex)
            took_direct = time.perf_counter() - start
            if first >= 4 * batch:
                bus.append(took_bus)
                direct.append(took_direct)
        await ledger.release(uid, "benchmark")
    return bus, direct


async def bench(
    args: argparse.Namespace, work: Path, redis_url: str, nats_url: str
) -> dict[str, Any]:
    kubelet_dir = work / "k"
    kubelet_dir.mkdir()
    config = work / "nodes.yaml"
    config.write_text(f"defaults: {{deviceSplitCount: {SPLIT}, simulate: {{count: {GPUS}}}}}\n")
    library = work / "libgpuslice.so"
    library.write_bytes(b"\x7fELF stand-in: the benchmark never loads it")
    settings = DevicePluginSettings(
        node_name=NODE,
        kubelet_dir=str(kubelet_dir),
        host_dir=str(work / "host"),
        interposer_library=str(library),
        node_config_file=str(config),
        backend="simulated",
        nats_url=nats_url,
        kube_api="none",
        health_interval="50ms",
    )
    registration = Registration()
    server = grpc.aio.server()
    pb_grpc.add_RegistrationServicer_to_server(registration, server)
    server.add_insecure_port(f"unix://{kubelet_dir / 'kubelet.sock'}")
    await server.start()
    # the install step: the audit stream the inventory waits for
    admin = await Bus.connect(settings, "bench/audit-init")
    await admin.ensure_audit_stream(settings.audit_max_age)
    await admin.close()
    inventory = await asyncio.to_thread(start_inventory, work, redis_url, nats_url)
    ledger = Ledger.from_url(redis_url)
    bus = await connect_bus(settings)
    try:
        async with running(
            settings, bus=bus, serve_http=False, timing=LinkTiming(poll_s=0.05)
        ) as state:
            await asyncio.wait_for(registration.done.wait(), 10)
            gpus = [d.uuid for d in state.agent.device_list.replicas.devices]
            await ledger.register_node(state.agent.inventory(), rebuilt=True)
            through_bus, direct = await ledger_part(args, ledger, state.gateway, gpus)
            await bind_pod(ledger, gpus, "bench", args.pods)
            async with grpc.aio.insecure_channel(f"unix://{kubelet_dir / 'gpuslice.sock'}") as ch:
                stub = pb_grpc.DevicePluginStub(ch)
                stream = stub.ListAndWatch(pb.Empty())
                first = await stream.read()
                ids = [d.ID for d in first.devices]  # type: ignore[union-attr]
                baseline = await timed(args.pods, lambda i: stub.GetDevicePluginOptions(pb.Empty()))

                async def admit(i: int) -> None:
                    free = ids[i:]
                    pref = await stub.GetPreferredAllocation(
                        pb.PreferredAllocationRequest(
                            container_requests=[
                                pb.ContainerPreferredAllocationRequest(
                                    available_deviceIDs=free, allocation_size=1
                                )
                            ]
                        )
                    )
                    chosen = list(pref.container_responses[0].deviceIDs)
                    await stub.Allocate(
                        pb.AllocateRequest(
                            container_requests=[pb.ContainerAllocateRequest(devices_ids=chosen)]
                        )
                    )

                admitted = await timed(args.pods, admit)
                changes = []
                for n in range(10):
                    unhealthy = "[0]" if n % 2 == 0 else "[]"
                    start = time.perf_counter()
                    config.write_text(
                        f"defaults: {{deviceSplitCount: {SPLIT}, "
                        f"simulate: {{count: {GPUS}, unhealthy: {unhealthy}}}}}\n"
                    )
                    await stream.read()
                    changes.append(time.perf_counter() - start)
                stream.cancel()
    finally:
        await bus.close()
        await ledger.close()
        inventory.terminate()
        await asyncio.to_thread(inventory.wait, 10)
        await server.stop(0)
    return {
        "pods": args.pods,
        "replicas": len(ids),
        "ledger_allocate_through_bus": summary(through_bus),
        "ledger_allocate_direct": summary(direct),
        "baseline_empty_rpc": summary(baseline),
        "preferred_plus_allocate": summary(admitted),
        "health_change_to_stream": summary(changes),
        "health_interval_ms": 50,
    }


async def main(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="dpb", dir="/tmp"))
    try:
        with RedisServer(work / "redis", persist=False) as redis, NatsServer(work / "nats") as nats:
            return await bench(args, work, redis.url, nats.url)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pods", type=int, default=500)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = asyncio.run(main(args))
    result["machine"] = f"{platform.machine()} {platform.node()} ({platform.processor() or 'cpu'})"
    result["date"] = datetime.now(UTC).strftime("%Y-%m-%d")
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"device plugin, {result['pods']} pods, {result['replicas']} replicas advertised")
    for key in (
        "ledger_allocate_through_bus",
        "ledger_allocate_direct",
        "baseline_empty_rpc",
        "preferred_plus_allocate",
        "health_change_to_stream",
    ):
        s = result[key]
        print(f"  {key:28s} p50 {s['p50_ms']:8.3f} ms  p99 {s['p99_ms']:8.3f} ms")


if __name__ == "__main__":
    run()
