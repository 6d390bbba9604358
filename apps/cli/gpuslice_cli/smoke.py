"""A short scenario that exercises NATS, Redis, the request parser and the ledger together.

It stands in for the full local stack: two simulated GPU nodes register, HAMi-style
pod specs are parsed and reserved (sharing a card, an exclusive request refused,
two pods racing for the last memory of a card), then bound, allocated and
released, each step published as an audited event. It ends by reading the audit
stream back and checking the ledger, and reports every check that failed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from rich.console import Console
from rich.table import Table

from gpuslice_common.bus import Bus
from gpuslice_common.config import CommonSettings
from gpuslice_common.events import AllocationEvent, EventType, make_event
from gpuslice_common.ledger import Ledger, ReservationConflict
from gpuslice_common.models import (
    ContainerAssignment,
    DeviceGrant,
    GpuDevice,
    GpuState,
    NodeInventory,
    Placement,
    PodGpuRequest,
    utcnow,
)
from gpuslice_common.requests import parse_pod

NODES = (
    NodeInventory(
        node="gpu-node-1",
        devices=tuple(
            GpuDevice(
                uuid=f"GPU-sim-a100-{i}",
                index=i,
                model="NVIDIA A100-SXM4-80GB",
                memory_mib=81920,
                numa=0,
            )
            for i in range(2)
        ),
    ),
    NodeInventory(
        node="gpu-node-2",
        devices=tuple(
            GpuDevice(
                uuid=f"GPU-sim-t4-{i}", index=i, model="Tesla T4", memory_mib=15360, numa=i // 2
            )
            for i in range(4)
        ),
    ),
)


def pod(
    name: str, resources: Mapping[str, Any], annotations: Mapping[str, str] | None = None
) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "namespace": "demo",
            "uid": f"uid-{name}",
            "annotations": dict(annotations or {}),
        },
        "spec": {"containers": [{"name": "main", "resources": {"limits": dict(resources)}}]},
    }


@dataclass
class Outcome:
    checks: list[tuple[str, bool]] = field(default_factory=list)

    def check(self, what: str, ok: bool) -> None:
        self.checks.append((what, ok))

    @property
    def ok(self) -> bool:
        return all(ok for _, ok in self.checks)


def grants(request: PodGpuRequest, gpus: list[GpuState], cards: list[int]) -> Placement:
    """Give each container the listed cards (by index): the scheduler's job, done by hand."""
    containers = []
    for c in request.containers:
        devs = tuple(
            DeviceGrant(
                uuid=gpus[i].device.uuid,
                memory_mib=c.memory.on_card(gpus[i].capacity.memory_mib),
                cores=c.cores,
            )
            for i in cards[: c.count]
        )
        containers.append(
            ContainerAssignment(
                name=c.name, init=c.init, sidecar=c.sidecar, devices=devs, priority=c.priority
            )
        )
    return Placement(
        pod=request.pod, node=gpus[0].node, containers=tuple(containers), policy="manual"
    )


async def announce(bus: Bus, t: EventType, p: Placement, reason: str = "") -> None:
    data = AllocationEvent(
        pod=p.pod, node=p.node, containers=p.containers, policy=p.policy, reason=reason
    )
    await bus.publish_acked(make_event(t, data, source=bus.source, subject=p.pod.uid))


def usage_table(states: dict[str, list[GpuState]]) -> Table:
    table = Table(title="ledger")
    for col in ("node", "gpu", "model", "memory MiB used/total", "cores", "slots", "exclusive"):
        table.add_column(col)
    for node, gpus in states.items():
        for g in gpus:
            table.add_row(
                node,
                str(g.device.index),
                g.device.model,
                f"{g.used.memory_mib}/{g.capacity.memory_mib}",
                f"{g.used.cores}/{g.capacity.cores}",
                f"{g.used.slots}/{g.capacity.slots}",
                g.used.exclusive_owner or "",
            )
    return table


async def run_scenario(settings: CommonSettings, console: Console) -> Outcome:
    out = Outcome()
    bus = await Bus.connect(settings, "smoke")
    ledger = Ledger.from_settings(settings)
    try:
        started = utcnow()
        await bus.ensure_audit_stream(timedelta(days=1))
        for inv in NODES:
            await ledger.register_node(inv, rebuilt=True)
        node1 = await ledger.node_gpus("gpu-node-1")
        out.check(
            "two simulated nodes registered", await ledger.nodes() == ["gpu-node-1", "gpu-node-2"]
        )

        serve = parse_pod(pod("llm-serve", {"nvidia.com/gpumem": 40000, "nvidia.com/gpucores": 50}))
        notebook = parse_pod(
            pod("notebook", {"nvidia.com/gpumem-percentage": 25, "nvidia.com/gpucores": 20})
        )
        train = parse_pod(pod("train", {"nvidia.com/gpu": 2}, {"nvidia.com/use-gputype": "A100"}))
        assert serve
        assert notebook
        assert train
        placed: list[Placement] = []
        for req in (serve, notebook):
            p = await ledger.reserve(grants(req, node1, [0]))
            await announce(bus, EventType.ALLOC_RESERVED, p)
            placed.append(p)
        console.print("[green]llm-serve and notebook share card 0 of gpu-node-1[/]")

        try:
            await ledger.reserve(grants(train, node1, [0, 1]))
            out.check("an exclusive two-card request is refused on the shared card", False)
        except ReservationConflict as exc:
            console.print(f"[yellow]train refused: {exc.reason} on {exc.uuid}[/]")
            failed = grants(train, node1, [0, 1])
            await announce(bus, EventType.ALLOC_FAILED, failed, reason=exc.reason)
            out.check(
                "an exclusive two-card request is refused on the shared card",
                exc.uuid == node1[0].device.uuid,
            )

        left = 81920 - 40000 - 81920 * 25 // 100
        racers = [
            parse_pod(pod(f"racer-{i}", {"nvidia.com/gpumem": left, "nvidia.com/gpucores": 10}))
            for i in range(2)
        ]
        results = await asyncio.gather(
            *(ledger.reserve(grants(r, node1, [0])) for r in racers if r), return_exceptions=True
        )
        winners = [r for r in results if isinstance(r, Placement)]
        out.check(
            "two pods race for the last memory of a card: exactly one wins", len(winners) == 1
        )
        console.print(f"race for the last {left} MiB: {len(winners)} winner")
        placed += winners
        for p in winners:
            await announce(bus, EventType.ALLOC_RESERVED, p)

        for p in placed:  # a node takes one pod at a time from its bind to kubelet's Allocate
            bound = await ledger.mark_bound(p.pod.uid, exclusive=True)
            await announce(bus, EventType.ALLOC_BOUND, bound)
            a = await ledger.allocate("gpu-node-1", 1)
            await announce(bus, EventType.ALLOC_ALLOCATED, a.placement)
        states = await ledger.nodes_gpus([n.node for n in NODES])
        console.print(usage_table(states))
        card0 = states["gpu-node-1"][0]
        out.check(
            "card 0 holds exactly its full memory",
            card0.used.memory_mib == card0.capacity.memory_mib,
        )

        for p in placed:
            r = await ledger.release(p.pod.uid, reason="pod completed")
            if r:
                await announce(bus, EventType.ALLOC_RELEASED, r.placement, reason="pod completed")
        after = await ledger.nodes_gpus([n.node for n in NODES])
        out.check(
            "every card is free after the releases",
            all(g.used.slots == 0 for gpus in after.values() for g in gpus),
        )
        for inv in NODES:
            out.check(
                f"ledger of {inv.node} is consistent", await ledger.check_node(inv.node) == []
            )

        audit = [e for e in await bus.read_audit(since=started) if e.source == bus.source]
        table = Table(title="audit stream")
        for col in ("time", "type", "pod", "reason"):
            table.add_column(col)
        for e in audit:
            table.add_row(
                e.time.strftime("%H:%M:%S.%f")[:-3],
                e.type.suffix,
                e.subject or "",
                str(e.data.get("reason", "")),
            )
        console.print(table)
        expected = 2 + 1 + len(winners) + 3 * len(placed)
        out.check(f"the audit stream holds all {expected} events", len(audit) == expected)
    finally:
        await ledger.close()
        await bus.close()
    return out
