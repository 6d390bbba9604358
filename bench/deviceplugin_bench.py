"""Device plugin benchmark: what kubelet waits for when it admits a GPU container.

Runs the agent (simulated GPUs, real redis-server and nats-server on loopback)
and plays kubelet over the plugin's unix socket: for each pod, bound in the
ledger beforehand, GetPreferredAllocation then Allocate, as kubelet calls them.
The baseline, measured in the same run over the same socket, is an empty gRPC
round trip (GetDevicePluginOptions). Also: how long a health change takes to
reach an open ListAndWatch stream.

    python bench/deviceplugin_bench.py [--pods 500] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc

from gpuslice_common.config import DevicePluginSettings
from gpuslice_common.models import ContainerAssignment, DeviceGrant, Placement, PodRef
from gpuslice_common.servers import NatsServer, RedisServer
from gpuslice_deviceplugin.api import deviceplugin_pb2 as pb
from gpuslice_deviceplugin.api import deviceplugin_pb2_grpc as pb_grpc
from gpuslice_deviceplugin.kubelet import LinkTiming
from gpuslice_deviceplugin.service import running

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
        redis_url=redis_url,
        nats_url=nats_url,
        kube_api="none",
        health_interval="50ms",
    )
    registration = Registration()
    server = grpc.aio.server()
    pb_grpc.add_RegistrationServicer_to_server(registration, server)
    server.add_insecure_port(f"unix://{kubelet_dir / 'kubelet.sock'}")
    await server.start()
    async with running(settings, serve_http=False, timing=LinkTiming(poll_s=0.05)) as state:
        await asyncio.wait_for(registration.done.wait(), 10)
        gpus = [d.uuid for d in state.agent.device_list.replicas.devices]
        await state.ledger.register_node(state.agent.inventory(), rebuilt=True)
        for i in range(args.pods):
            grant = DeviceGrant(uuid=gpus[i % GPUS], memory_mib=100, cores=1)
            await state.ledger.reserve(
                Placement(
                    pod=PodRef(uid=f"bench-{i}", namespace="bench", name=f"p{i}"),
                    node=NODE,
                    containers=(ContainerAssignment(name="main", devices=(grant,)),),
                )
            )
            await state.ledger.mark_bound(f"bench-{i}")
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
    await server.stop(0)
    return {
        "pods": args.pods,
        "replicas": len(ids),
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
    for key in ("baseline_empty_rpc", "preferred_plus_allocate", "health_change_to_stream"):
        s = result[key]
        print(f"  {key:26s} p50 {s['p50_ms']:8.3f} ms  p99 {s['p99_ms']:8.3f} ms")


if __name__ == "__main__":
    run()
