"""Ledger benchmark: reserve + release against a real redis-server on loopback.

Prints, for one client at a time (latency) and for many concurrent clients
(throughput), the ledger's numbers beside a baseline measured in the same run:
the same number (4) of plain Redis round trips (PING), which is the floor any
network ledger pays.

    python bench/ledger_bench.py [--pairs 5000] [--concurrency 64] [--redis-url URL] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

from gpuslice_common.ledger import Ledger
from gpuslice_common.models import (
    ContainerAssignment,
    DeviceGrant,
    GpuDevice,
    NodeInventory,
    Placement,
    PodRef,
)
from gpuslice_common.servers import RedisServer

NODES = 64
GPUS = 8


def inventory(n: int) -> NodeInventory:
    devices = tuple(
        GpuDevice(uuid=f"GPU-{n}-{i}", index=i, model="NVIDIA A100", memory_mib=81920)
        for i in range(GPUS)
    )
    return NodeInventory(node=f"node-{n}", devices=devices)


def placement(i: int) -> Placement:
    node = i % NODES
    grant = DeviceGrant(uuid=f"GPU-{node}-{(i // NODES) % GPUS}", memory_mib=1024, cores=10)
    return Placement(
        pod=PodRef(uid=f"bench-{i}", namespace="bench", name=f"p{i}"),
        node=f"node-{node}",
        containers=(ContainerAssignment(name="main", devices=(grant,)),),
    )


def percentile(samples: list[float], p: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


async def timed(op: Callable[[int], Awaitable[Any]], count: int) -> list[float]:
    out = []
    for i in range(count):
        t0 = time.perf_counter()
        await op(i)
        out.append(time.perf_counter() - t0)
    return out


async def throughput(op: Callable[[int], Awaitable[Any]], count: int, workers: int) -> float:
    counter = iter(range(count))

    async def worker() -> None:
        for i in counter:
            await op(i)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(workers)))
    return count / (time.perf_counter() - t0)


async def run(url: str, pairs: int, concurrency: int) -> dict[str, Any]:
    ledger = Ledger.from_url(url, prefix="bench", max_connections=concurrency)
    await ledger.redis.flushall()
    for n in range(NODES):
        await ledger.register_node(inventory(n), rebuilt=True)
    placements = [placement(i) for i in range(pairs)]

    async def reserve_release(i: int) -> None:
        await ledger.reserve(placements[i])
        await ledger.release(placements[i].pod.uid)

    async def reserve_only(i: int) -> None:
        await ledger.reserve(placements[i].model_copy(update={"pod": PodRef(uid=f"r-{i}")}))

    round_trips = 4  # reserve: one script; release: index GET, mark released, script

    async def baseline(_: int) -> None:
        for _ in range(round_trips):
            await ledger.redis.ping()

    await timed(reserve_release, min(500, pairs))  # warm up scripts and connections
    lat = await timed(reserve_release, pairs)
    base = await timed(baseline, pairs)
    rate = await throughput(reserve_release, pairs, concurrency)
    base_rate = await throughput(baseline, pairs, concurrency)
    reserve_rate = await throughput(reserve_only, min(pairs, NODES * GPUS * 10), concurrency)
    problems = [p for n in range(NODES) for p in await ledger.check_node(f"node-{n}")]
    await ledger.close()
    ms = 1000.0
    return {
        "machine": f"{platform.node()} {platform.machine()} {platform.python_version()}",
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "nodes": NODES,
        "gpus": NODES * GPUS,
        "pairs": pairs,
        "concurrency": concurrency,
        "reserve_release_p50_ms": statistics.median(lat) * ms,
        "reserve_release_p99_ms": percentile(lat, 99) * ms,
        "baseline_p50_ms": statistics.median(base) * ms,
        "baseline_p99_ms": percentile(base, 99) * ms,
        "reserve_release_per_s": rate,
        "baseline_per_s": base_rate,
        "reservations_per_s": reserve_rate,
        "consistent": not problems,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=5000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--redis-url", default=None, help="use this Redis instead of starting one")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.redis_url:
        result = asyncio.run(run(args.redis_url, args.pairs, args.concurrency))
    else:
        with RedisServer(persist=False) as server:
            result = asyncio.run(run(server.url, args.pairs, args.concurrency))
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"ledger benchmark  {result['date']}  {result['machine']}")
    print(f"{result['nodes']} nodes, {result['gpus']} GPUs, {result['pairs']} pods")
    conc = result["concurrency"]
    rows = [
        ("reserve+release (1 client)", "reserve_release", None),
        ("baseline: 6 PINGs (1 client)", "baseline", None),
        (f"reserve+release ({conc} clients)", None, "reserve_release_per_s"),
        (f"baseline: 6 PINGs ({conc} clients)", None, "baseline_per_s"),
        (f"reserve only ({conc} clients)", None, "reservations_per_s"),
    ]
    print(f"{'':34}{'p50 ms':>10}{'p99 ms':>10}{'per s':>12}")
    for label, latency, rate in rows:
        cells = (
            f"{'':20}"
            if latency is None
            else (f"{result[latency + '_p50_ms']:>10.3f}{result[latency + '_p99_ms']:>10.3f}")
        )
        print(f"{label:34}{cells}{'' if rate is None else format(result[rate], '>12.0f')}")
    print(f"ledger consistent afterwards: {result['consistent']}")
    if not result["consistent"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
