"""Extender latency and throughput at openb scale, through HTTP and a real Redis ledger.

Starts nats-server, redis-server and the extender (``python -m gpuslice_scheduler``,
local Kubernetes API) as child processes, loads the openb cluster (1,213 nodes,
6,212 GPUs) into the ledger, then replays pods of the default trace the way
kube-scheduler would: filter over every node whose CPU and memory fit,
prioritize over the feasible ones, bind to the best. Prints p50/p99 per verb,
filter+prioritize+bind per pod, and sustained pods/s. The baseline, in the same
run, is a filter call for a pod without GPUs over every node: the HTTP and JSON
floor under every verb, with no placement work.

Usage: python bench/extender_bench.py [--traces DIR] [--pods 2000] [--seed 42]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import subprocess
import sys
import time
from datetime import date, timedelta
from pathlib import Path

import numpy as np
import orjson

from gpuslice_common.bus import Bus
from gpuslice_common.config import CommonSettings
from gpuslice_common.servers import NatsServer, RedisServer, free_port
from gpuslice_scheduler.sim import load_nodes, load_pods
from gpuslice_scheduler.via import Connection, replay_via

HERE = Path(__file__).resolve().parent


async def empty_call_baseline(url: str, names: list[str], count: int = 500) -> dict[str, float]:
    """POST /filter for a pod without GPUs and every node: the same request and reply
    sizes, through the same client, with no placement work."""
    pod = {"metadata": {"name": "cpu", "uid": "cpu"}, "spec": {"containers": [{"name": "c"}]}}
    body = orjson.dumps({"Pod": pod, "NodeNames": names})
    connection = Connection(url)
    samples = []
    try:
        for _ in range(count):
            started = time.perf_counter()
            status, _ = await connection.post("/filter", body)
            samples.append(time.perf_counter() - started)
            assert status == 200
    finally:
        await connection.close()
    ms = np.asarray(samples) * 1000
    return {"p50": float(np.percentile(ms, 50)), "p99": float(np.percentile(ms, 99))}


async def audit_stream(url: str) -> None:
    """The audit stream, as ``gpuslice audit init`` makes it at install: without it
    the extender's outbox would keep sending events nothing stores."""
    bus = await Bus.connect(CommonSettings(nats_url=url), "bench")
    try:
        await bus.ensure_audit_stream(timedelta(days=1))
    finally:
        await bus.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--traces", type=Path, default=HERE.parent.parent / "shared/traces/openb")
    parser.add_argument("--pods", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args()
    nodes = load_nodes(args.traces / "openb_node_list_gpu_node.csv")
    pods = load_pods(args.traces / "openb_pod_list_default.csv")
    port = free_port()
    with NatsServer() as nats, RedisServer(persist=False) as redis:
        asyncio.run(audit_stream(nats.url))
        env = {
            **os.environ,
            "GPUSLICE_NATS_URL": nats.url,
            "GPUSLICE_REDIS_URL": redis.url,
            "GPUSLICE_KUBE_API": "local",
            "GPUSLICE_LISTEN_HOST": "127.0.0.1",
            "GPUSLICE_LISTEN_PORT": str(port),
            "GPUSLICE_LOG_LEVEL": "WARNING",
        }
        server = subprocess.Popen([sys.executable, "-m", "gpuslice_scheduler"], env=env)
        url = f"http://127.0.0.1:{port}"
        try:
            result = asyncio.run(
                replay_via(url, redis.url, nodes, pods, seed=args.seed, sample=args.pods)
            )
            names = [n.name for n in nodes if n.gpus > 0]
            floor = asyncio.run(empty_call_baseline(url, names))
        finally:
            server.terminate()
            server.wait(timeout=10)
    gpus = sum(n.gpus for n in nodes)
    print(f"# extender benchmark, {date.today()}, {platform.node()}, {os.cpu_count()} CPUs")
    print(f"# openb: {len(nodes)} nodes, {gpus} GPUs; {result.pods} pods of the default trace")
    print("| verb | calls | p50 ms | p99 ms | max ms |")
    print("|---|---|---|---|---|")
    for verb, row in result.latency_ms.items():
        cells = [f"{row['count']:.0f}", *(f"{row[k]:.2f}" for k in ("p50", "p99", "max"))]
        print(f"| {verb} | {' | '.join(cells)} |")
    print(f"| baseline: filter, no GPU | 500 | {floor['p50']:.2f} | {floor['p99']:.2f} | |")
    print(
        f"# scheduled {result.scheduled_pods}, failed {result.failed_pods}, "
        f"bind errors {result.bind_errors}; allocation {result.milli_gpu_allocation_ratio:.2f}%"
    )
    print(
        f"# sustained: {result.extender_pods_per_second:.1f} GPU pods/s through the extender "
        f"({result.pods_per_second:.1f} pods/s with CPU-only ones) over {result.wall_seconds:.1f} s"
    )


if __name__ == "__main__":
    main()
