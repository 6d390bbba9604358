"""Extender latency, throughput and memory, through HTTP and a real Redis ledger.

Starts nats-server, redis-server and the extender (``python -m gpuslice_scheduler``,
local Kubernetes API) as child processes, registers a cluster in the ledger,
then replays pods of the default trace the way kube-scheduler would: filter
over every node whose CPU and memory fit, prioritize over the feasible ones,
bind to the best. Three scenarios, each with its own servers:

1. the openb cluster (1,213 nodes, 6,212 GPUs);
2. a cluster of ``--large`` nodes (default 5,000) with 8 GPUs each, made from
   openb's 8-GPU nodes (CPU, memory and model of each in turn): how the cost
   grows with the cluster;
3. the openb cluster with ``--replicas`` extenders (default 2) and as many
   drivers placing at once, each its own kube-scheduler: the throughput of all
   together, and every card checked against its capacity afterwards.

Each prints p50/p99 per verb, filter+prioritize+bind per pod, sustained GPU
pods/s and the extender's resident memory. The baseline, in the same run, is a
filter call for a pod without GPUs over every node: the HTTP and JSON floor
under every verb, with no placement work.

Usage: python bench/extender_bench.py [--traces DIR] [--pods 3000] [--seed 42]
                                      [--large 5000] [--replicas 2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import date, timedelta
from itertools import cycle, islice
from pathlib import Path

import numpy as np
import orjson

from gpuslice_common.bus import Bus
from gpuslice_common.config import CommonSettings
from gpuslice_common.servers import NatsServer, RedisServer, free_port
from gpuslice_scheduler.sim import PodClass, TraceNode, load_nodes, load_pods
from gpuslice_scheduler.via import Connection, ReplicasResult, replay_via_replicas

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


def large_cluster(nodes: Sequence[TraceNode], count: int) -> list[TraceNode]:
    """``count`` nodes of 8 GPUs, each a copy of one of openb's 8-GPU nodes in turn."""
    eight = [n for n in nodes if n.gpus == 8]
    return [
        TraceNode(f"large-node-{i:05d}", n.cpu_milli, n.memory_mib, n.gpus, n.model)
        for i, n in enumerate(islice(cycle(eight), count))
    ]


def memory_mib(pid: int) -> tuple[float, float]:
    """A process's resident memory now and at its peak, MiB (Linux /proc)."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        fields[name] = value.split()[0] if value.split() else "0"
    return int(fields.get("VmRSS", 0)) / 1024, int(fields.get("VmHWM", 0)) / 1024


@contextmanager
def extenders(count: int) -> Iterator[tuple[str, list[subprocess.Popen[bytes]], list[str]]]:
    """NATS (with the audit stream), Redis and ``count`` extender processes:
    (Redis URL, processes, their URLs)."""
    with NatsServer() as nats, RedisServer(persist=False) as redis:
        asyncio.run(audit_stream(nats.url))
        processes, urls = [], []
        try:
            for _ in range(count):
                port = free_port()
                env = {
                    **os.environ,
                    "GPUSLICE_NATS_URL": nats.url,
                    "GPUSLICE_REDIS_URL": redis.url,
                    "GPUSLICE_KUBE_API": "local",
                    "GPUSLICE_LISTEN_HOST": "127.0.0.1",
                    "GPUSLICE_LISTEN_PORT": str(port),
                    "GPUSLICE_METRICS_HOST": "127.0.0.1",
                    "GPUSLICE_METRICS_PORT": str(free_port()),  # each replica its own
                    "GPUSLICE_LOG_LEVEL": "WARNING",
                }
                command = [sys.executable, "-m", "gpuslice_scheduler"]
                processes.append(subprocess.Popen(command, env=env))
                urls.append(f"http://127.0.0.1:{port}")
            yield redis.url, processes, urls
        finally:
            for process in processes:
                process.terminate()
            for process in processes:
                process.wait(timeout=10)


def scenario(
    title: str,
    nodes: Sequence[TraceNode],
    pods: Sequence[PodClass],
    args: argparse.Namespace,
    replicas: int = 1,
) -> None:
    with extenders(replicas) as (redis_url, processes, urls):
        result = asyncio.run(
            replay_via_replicas(urls, redis_url, nodes, pods, seed=args.seed, sample=args.pods)
        )
        memory = [memory_mib(p.pid) for p in processes]
        names = [n.name for n in nodes if n.gpus > 0]
        floor = asyncio.run(empty_call_baseline(urls[0], names))
    report(title, nodes, result, floor, memory)


def report(
    title: str,
    nodes: Sequence[TraceNode],
    result: ReplicasResult,
    floor: dict[str, float],
    memory: list[tuple[float, float]],
) -> None:
    gpus = sum(n.gpus for n in nodes)
    print(f"\n## {title}: {len(nodes)} nodes, {gpus} GPUs, {len(result.replicas)} extender(s)")
    print("| extender | verb | calls | p50 ms | p99 ms | max ms |")
    print("|---|---|---|---|---|---|")
    for k, replica in enumerate(result.replicas):
        for verb, row in replica.latency_ms.items():
            cells = [
                f"{row['count']:.0f}",
                *(f"{row.get(q, 0):.2f}" for q in ("p50", "p99", "max")),
            ]
            print(f"| {k + 1} | {verb} | {' | '.join(cells)} |")
    print(f"| 1 | baseline: filter, no GPU | 500 | {floor['p50']:.2f} | {floor['p99']:.2f} | |")
    per_pod = result.replicas[0].latency_ms["filter+prioritize+bind"]
    print(
        f"# per pod p50/p99 = {per_pod.get('p50', 0) / max(floor['p50'], 1e-9):.1f}x / "
        f"{per_pod.get('p99', 0) / max(floor['p99'], 1e-9):.1f}x the baseline's; filter p50 "
        f"{1000 * result.replicas[0].latency_ms['filter'].get('p50', 0) / len(nodes):.2f} us "
        "per node"
    )
    scheduled = sum(r.scheduled_pods for r in result.replicas)
    failed = sum(r.failed_pods for r in result.replicas)
    errors = sum(r.bind_errors for r in result.replicas)
    print(
        f"# scheduled {scheduled}, failed {failed}, bind errors {errors}; "
        f"allocation {result.milli_gpu_allocation_ratio:.2f}%; "
        f"over-committed cards or ledger mismatches: {len(result.overcommitted)}"
    )
    for line in result.overcommitted[:5]:
        print(f"#   {line}")
    print(
        f"# sustained: {result.extender_pods_per_second:.1f} GPU pods/s through the "
        f"extender(s) together over {result.wall_seconds:.1f} s"
    )
    for k, (now, peak) in enumerate(memory):
        print(f"# extender {k + 1} memory: {now:.0f} MiB resident, {peak:.0f} MiB at peak")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--traces",
        type=Path,
        default=HERE / "traces" / "openb",
        help="the openb traces (make traces)",
    )
    parser.add_argument("--pods", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--large", type=int, default=5000, help="nodes; 0 skips")
    parser.add_argument("--replicas", type=int, default=2, help="extenders; 1 skips")
    args = parser.parse_args()
    nodes = load_nodes(args.traces / "openb_node_list_gpu_node.csv")
    pods = load_pods(args.traces / "openb_pod_list_default.csv")
    print(f"# extender benchmark, {date.today()}, {platform.node()}, {os.cpu_count()} CPUs")
    print(f"# {args.pods} pods of openb's default trace (seed {args.seed}) in each scenario")
    scenario("openb", nodes, pods, args)
    if args.large:
        scenario("large", large_cluster(nodes, args.large), pods, args)
    if args.replicas > 1:
        scenario("openb, replicas", nodes, pods, args, replicas=args.replicas)


if __name__ == "__main__":
    main()
