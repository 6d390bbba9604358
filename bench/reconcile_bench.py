"""Reconciliation of 10,000 pods against a real redis-server.

A cluster of ``--nodes`` nodes x 8 GPUs holds ``--pods`` pods, each with its
placement annotation (1 to 2 containers, a quarter on two GPUs), in a
LocalKubeApi: the API server's list is not timed here, only what the inventory
does with it. Three passes of ``Reconciler.run_once``:

* **after Redis lost everything**: the nodes have registered again, every
  placement is restored from its annotation;
* **steady**: the ledger already agrees, nothing to do;
* **10 % ended**: a tenth of the pods succeeded, their devices are released
  (with an ``alloc.released`` event each, into an outbox with no bus).

Baseline in the same run: the ledger reads every pass makes (the node list and
every node's placements) with nothing written.

Usage: python bench/reconcile_bench.py [--pods 10000] [--nodes 1250]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import time
from collections.abc import Awaitable, Callable
from datetime import date, timedelta
from typing import Any

from gpuslice_common.config import InventorySettings
from gpuslice_common.kube import LocalKubeApi
from gpuslice_common.ledger import Ledger
from gpuslice_common.models import (
    PLACEMENT_ANNOTATION,
    ContainerAssignment,
    DeviceGrant,
    GpuDevice,
    NodeInventory,
    Placement,
    PodRef,
)
from gpuslice_common.outbox import Outbox
from gpuslice_common.servers import RedisServer
from gpuslice_inventory.reconcile import Reconciler, ReconcileResult
from gpuslice_inventory.upkeep import Upkeep

GPUS = 8


def inventory(node: str) -> NodeInventory:
    devices = tuple(
        GpuDevice(uuid=f"GPU-{node}-{i}", index=i, model="NVIDIA H100", memory_mib=81559)
        for i in range(GPUS)
    )
    return NodeInventory(node=node, devices=devices, split_count=10)


def pods(count: int, nodes: int) -> list[dict[str, Any]]:
    """``count`` running pods spread over the nodes, each annotated with its placement."""
    made = []
    for i in range(count):
        node = f"node-{i % nodes}"
        gpu = (i // nodes) % GPUS
        uuids = [f"GPU-{node}-{gpu}"]
        if i % 4 == 0:
            uuids.append(f"GPU-{node}-{(gpu + 1) % GPUS}")
        containers = tuple(
            ContainerAssignment(
                name=f"c{c}",
                devices=tuple(DeviceGrant(uuid=u, memory_mib=1000, cores=5) for u in uuids),
            )
            for c in range(1 + i % 2)
        )
        uid = f"pod-{i:06d}"
        record = Placement(
            pod=PodRef(uid=uid, namespace="bench", name=uid), node=node, containers=containers
        )
        made.append(
            {
                "metadata": {
                    "name": uid,
                    "namespace": "bench",
                    "uid": uid,
                    "annotations": {PLACEMENT_ANNOTATION: record.to_annotation()},
                },
                "spec": {"nodeName": node, "containers": [{"name": c.name} for c in containers]},
                "status": {"phase": "Running"},
            }
        )
    return made


async def timed(work: Callable[[], Awaitable[Any]]) -> tuple[Any, float]:
    started = time.perf_counter()
    result = await work()
    return result, time.perf_counter() - started


async def run(redis_url: str, count: int, nodes: int) -> list[tuple[str, float, str]]:
    ledger = Ledger.from_url(redis_url, "bench")
    kube = LocalKubeApi()
    for pod in pods(count, nodes):
        kube.add_pod(pod)
    outbox = Outbox(InventorySettings(), "bench", bus=None)
    upkeep = Upkeep(ledger, timedelta(seconds=10), timedelta(minutes=5), outbox)
    reconciler = Reconciler(ledger, kube, upkeep, grace=timedelta(0))
    await ledger.redis.flushall()
    for i in range(nodes):
        await ledger.register_node(inventory(f"node-{i}"), rebuilt=True)

    async def reads() -> int:
        held = 0
        for node in await ledger.nodes():
            held += len(await ledger.node_placements(node))
        return held

    rows: list[tuple[str, float, str]] = []
    _, listed = await timed(kube.list_all_pods)
    rows.append(("LocalKubeApi.list_all_pods (copies of every pod)", listed, f"{count:,} pods"))
    restored, seconds = await timed(reconciler.run_once)
    rows.append(("after Redis lost everything", seconds, describe(restored)))
    if restored.restored != count:
        raise SystemExit(f"restored {restored.restored} of {count} pods")
    held, seconds = await timed(reads)
    rows.append(("baseline: the ledger reads alone", seconds, f"{held:,} placements read"))
    steady, seconds = await timed(reconciler.run_once)
    rows.append(("steady (nothing to do)", seconds, describe(steady)))
    for pod in (await kube.list_all_pods())[::10]:
        kube.set_phase("bench", pod["metadata"]["name"], "Succeeded")
    ended, seconds = await timed(reconciler.run_once)
    rows.append(("10 % of the pods ended", seconds, describe(ended)))
    if ended.released != (count + 9) // 10:
        raise SystemExit(f"released {ended.released}, expected {(count + 9) // 10}")
    await ledger.close()
    return rows


def describe(result: ReconcileResult) -> str:
    return (
        f"{result.pods:,} pods, {result.held:,} held, {result.restored:,} restored, "
        f"{result.released:,} released"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pods", type=int, default=10_000)
    parser.add_argument("--nodes", type=int, default=1250)
    args = parser.parse_args()
    with RedisServer(persist=False) as redis_server:
        rows = asyncio.run(run(redis_server.url, args.pods, args.nodes))
    print(
        f"# reconcile benchmark, {date.today()}, {platform.node()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}; {args.pods:,} pods on {args.nodes:,} nodes "
        f"x {GPUS} GPUs"
    )
    print("| pass | seconds | pods/s | what it did |")
    print("|---|---|---|---|")
    for name, seconds, what in rows:
        print(f"| {name} | {seconds:.2f} | {args.pods / seconds:,.0f} | {what} |")


if __name__ == "__main__":
    main()
