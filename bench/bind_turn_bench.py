"""Bind turns: what one GPU pod per node between bind and Allocate costs.

A node takes one GPU pod at a time from its bind to kubelet's Allocate (which
names no pod). For a burst of pods bound to one node, each kubelet admitting a
bound pod ``--admit-ms`` after its bind, this prints binds per second per node:

- floor: the pods one after another by a single client (bind, wait for the
  admission, allocate, next): the best any one-pod-at-a-time scheme can do;
- turns: every bind at once through ``Ledger.mark_bound_in_turn``, as the
  extender's binds come: each waits for the node's turn, woken by the node's
  change notice (the scheduler's ``ClusterView.changed``) when the turn passes;
- polled: the same without notices (Redis Cluster, or notices down): each looks
  again after 20 ms, doubling to 250 ms;
- turns, many nodes: the same on ``--nodes`` nodes at once, per node: the turn
  is per node, so nodes do not wait for each other.

Against a real redis-server on loopback.

    python bench/bind_turn_bench.py [--pods 20] [--nodes 16] [--admit-ms 0,20,100] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import platform
import time
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
from gpuslice_scheduler.view import ClusterView

GPUS = 8
WAIT_S = 60.0  # far above any turn here: no bind gives up


def inventory(node: str) -> NodeInventory:
    devices = tuple(
        GpuDevice(uuid=f"GPU-{node}-{i}", index=i, model="NVIDIA A100", memory_mib=81920)
        for i in range(GPUS)
    )
    return NodeInventory(node=node, devices=devices)


def placement(node: str, i: int) -> Placement:
    grant = DeviceGrant(uuid=f"GPU-{node}-{i % GPUS}", memory_mib=256, cores=1)
    return Placement(
        pod=PodRef(uid=f"{node}-p{i}", namespace="bench", name=f"p{i}"),
        node=node,
        containers=(ContainerAssignment(name="main", devices=(grant,)),),
    )


async def prepare(ledger: Ledger, nodes: list[str], pods: int) -> list[list[Placement]]:
    bursts = []
    for node in nodes:
        await ledger.register_node(inventory(node), rebuilt=True)
        burst = [placement(node, i) for i in range(pods)]
        for p in burst:
            await ledger.reserve(p)
        bursts.append(burst)
    return bursts


async def floor(ledger: Ledger, burst: list[Placement], admit_s: float) -> float:
    started = time.perf_counter()
    for p in burst:
        await ledger.mark_bound(p.pod.uid, p.node, exclusive=True)
        await asyncio.sleep(admit_s)
        await ledger.allocate(p.node, 1)
    return len(burst) / (time.perf_counter() - started)


async def turns(
    ledger: Ledger, burst: list[Placement], admit_s: float, view: ClusterView | None
) -> float:
    changed = view.changed if view is not None else None

    async def one(p: Placement) -> None:
        await ledger.mark_bound_in_turn(p.pod.uid, p.node, WAIT_S, changed)
        await asyncio.sleep(admit_s)  # kubelet learns of the Binding and admits the pod
        await ledger.allocate(p.node, 1)

    started = time.perf_counter()
    await asyncio.gather(*(one(p) for p in burst))
    return len(burst) / (time.perf_counter() - started)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    rows = []
    with RedisServer(persist=False) as server:
        ledger = Ledger.from_url(server.url)
        view = ClusterView(ledger)
        following = asyncio.create_task(view.run())
        try:
            while not view.listening:  # noqa: ASYNC110 (the view keeps no event for it)
                await asyncio.sleep(0.01)
            for admit_ms in args.admit_ms:
                admit_s = admit_ms / 1000
                run_id = f"a{admit_ms}"
                [burst] = await prepare(ledger, [f"{run_id}-floor"], args.pods)
                floor_rate = await floor(ledger, burst, admit_s)
                [burst] = await prepare(ledger, [f"{run_id}-turns"], args.pods)
                turn_rate = await turns(ledger, burst, admit_s, view)
                [burst] = await prepare(ledger, [f"{run_id}-polled"], args.pods)
                polled_rate = await turns(ledger, burst, admit_s, None)
                names = [f"{run_id}-many-{n}" for n in range(args.nodes)]
                bursts = await prepare(ledger, names, args.pods)
                many = await asyncio.gather(*(turns(ledger, b, admit_s, view) for b in bursts))
                rows.append(
                    {
                        "admit_ms": admit_ms,
                        "floor_per_s": floor_rate,
                        "turns_per_s": turn_rate,
                        "polled_per_s": polled_rate,
                        "turns_many_nodes_per_s_min": min(many),
                        "turns_many_nodes_total_per_s": sum(many),
                    }
                )
        finally:
            following.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await following
            await ledger.close()
    return {
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()} {platform.processor() or platform.node()}",
        "pods_per_node": args.pods,
        "nodes": args.nodes,
        "rows": rows,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pods", type=int, default=20, help="pods in each node's burst")
    ap.add_argument("--nodes", type=int, default=16, help="nodes at once, last column")
    ap.add_argument(
        "--admit-ms",
        type=lambda v: [int(x) for x in v.split(",")],
        default=[0, 20, 100],
        help="kubelet's delay from the Binding to its Allocate, comma-separated",
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    result = asyncio.run(run(args))
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"bind turn benchmark  {result['date']}  {result['machine']}")
    print(f"{args.pods} pods per node in a burst; binds per second per node")
    many = f"{args.nodes} nodes min"
    print(f"{'admit ms':>9}{'floor':>9}{'turns':>9}{'ratio':>7}{'polled':>9}{many:>14}{'total':>9}")
    for row in result["rows"]:
        print(
            f"{row['admit_ms']:>9}{row['floor_per_s']:>9.1f}{row['turns_per_s']:>9.1f}"
            f"{row['turns_per_s'] / row['floor_per_s']:>7.2f}{row['polled_per_s']:>9.1f}"
            f"{row['turns_many_nodes_per_s_min']:>14.1f}{row['turns_many_nodes_total_per_s']:>9.1f}"
        )


if __name__ == "__main__":
    main()
