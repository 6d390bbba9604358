"""GPU preemption through the whole path: the stand-in API server (priority
admission, the Eviction API with PodDisruptionBudgets, Events, pods/status),
the real webhook, extender(s), inventory, device plugin, NATS and Redis, and
the stand-in kubelet stopping an evicted pod's containers.

One node of two 80 GB cards. Card 0 holds two halves (class ``low``, priority
10); card 1 holds one whole-card pod (class ``lowest``, priority 5). A pod
asking a whole card fits nowhere until a victim goes."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpuslice_cli.dev.driver import ClusterDriver, PodOutcome
from gpuslice_cli.dev.stack import NodeSpec, Stack
from gpuslice_common.bus import Bus
from gpuslice_common.events import AllocationEvent, EventType
from gpuslice_common.ledger import Ledger
from tests.conftest import Native
from tests.dev.conftest import Up, all_released, stack_up

NODE = NodeSpec("gpu-node-1", gpus=2)
HALF = 40_000  # MiB: two fill card 0, the whole-card preemptor does not fit beside one


@pytest.fixture
async def one_node(native: Native, tmp_path: Path) -> AsyncIterator[Up]:
    async with stack_up(Stack(tmp_path / "stack", heartbeat_s=1.0, nodes=(NODE,))) as up:
        yield up


@pytest.fixture
async def one_node_ha(native: Native, tmp_path: Path) -> AsyncIterator[Up]:
    """Two extender replicas (and the rest of the highly-available shapes)."""
    stack = Stack(tmp_path / "stack", heartbeat_s=1.0, nodes=(NODE,), ha=True)
    async with stack_up(stack) as up:
        yield up


def pod(
    name: str,
    command: list[str],
    *,
    priority_class: str,
    mem: int | None = None,
    card: str | None = None,
    labels: dict[str, str] | None = None,
) -> dict[str, Any]:
    limits: dict[str, Any] = {"nvidia.com/gpu": 1}
    if mem is not None:
        limits["nvidia.com/gpumem"] = mem
    annotations = {"nvidia.com/use-gpuuuid": card} if card else {}
    return {
        "metadata": {"name": name, "annotations": annotations, "labels": labels or {}},
        "spec": {
            "priorityClassName": priority_class,
            "terminationGracePeriodSeconds": 5,
            "containers": [{"name": "main", "command": command, "resources": {"limits": limits}}],
        },
    }


async def fill_the_node(
    stack: Stack, driver: ClusterDriver, ledger: Ledger, pdb_on_whole: bool = False
) -> dict[str, asyncio.Task[PodOutcome]]:
    """Classes and the three long-running holders, once each holds its cards."""
    kube = stack.kube
    kube.add_priority_class("lowest", 5)
    kube.add_priority_class("low", 10)
    kube.add_priority_class("high", 1000)
    kube.add_priority_class("high-never", 1000, preemption_policy="Never")
    card0, card1 = NODE.uuids
    sleeping = ["sleep", "300"]
    specs = {
        "half-a": pod("half-a", sleeping, priority_class="low", mem=HALF, card=card0),
        "half-b": pod("half-b", sleeping, priority_class="low", mem=HALF, card=card0),
        "whole": pod(
            "whole", sleeping, priority_class="lowest", card=card1, labels={"app": "batch"}
        ),
    }
    if pdb_on_whole:
        kube.add_pdb(
            "default",
            {
                "metadata": {"name": "batch"},
                "spec": {"selector": {"matchLabels": {"app": "batch"}}, "minAvailable": 1},
            },
        )
    holders = {}
    for name, spec in specs.items():
        holders[name] = asyncio.create_task(driver.run_pod(spec))
        await running(stack, name)
    return holders


async def running(stack: Stack, name: str, timeout: float = 60) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        with contextlib.suppress(Exception):
            held = await stack.kube.get_pod("default", name)
            if (held.get("status") or {}).get("phase") == "Running":
                return
        assert asyncio.get_running_loop().time() < deadline, f"{name} never ran"
        await asyncio.sleep(0.1)


async def end(stack: Stack, holders: dict[str, asyncio.Task[PodOutcome]]) -> None:
    """Evict the holders still running (PDBs aside: they are removed first)."""
    stack.kube._budgets.clear()
    for name, task in holders.items():
        if not task.done():
            with contextlib.suppress(Exception):
                await stack.kube.evict_pod("default", name, "")
    await asyncio.wait_for(asyncio.gather(*holders.values()), 60)


async def released(stack: Stack, ledger: Ledger, timeout: float = 30) -> None:
    """Every placement released: the pods' ends reached the inventory."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not await all_released(stack, ledger):
        assert asyncio.get_running_loop().time() < deadline, "a placement was never released"
        await asyncio.sleep(0.2)


def events(stack: Stack, reason: str) -> dict[str, str]:
    """The stand-in API server's Events of ``reason``: pod name -> message."""
    return {
        e["involvedObject"]["name"]: e["message"]
        for e in stack.kube.events
        if e["reason"] == reason
    }


async def preempted_in_audit(bus: Bus) -> list[AllocationEvent]:
    found = []
    for event in await bus.read_audit():
        if event.type is EventType.ALLOC_PREEMPTED:
            payload = event.payload()
            assert isinstance(payload, AllocationEvent)
            found.append(payload)
    return found


async def counted(stack: Stack, line: str) -> float:
    """The sum of one metric line's value over the extender replicas."""
    total = 0.0
    async with httpx.AsyncClient(timeout=5) as client:
        for name, url in stack.metrics_urls.items():
            if not name.startswith("scheduler"):
                continue
            for text in (await client.get(url)).text.splitlines():
                if text.startswith(line + " "):
                    total += float(text.split()[-1])
    return total


async def test_a_high_priority_pod_evicts_the_fewest_lowest_gpu_pods_and_binds(
    one_node: Up,
) -> None:
    stack, driver, bus, ledger = one_node
    holders = await fill_the_node(stack, driver, ledger)
    whole_uid = (await stack.kube.get_pod("default", "whole"))["metadata"]["uid"]
    try:
        # equal priority never preempts: "whole" (5) is the only pod not above it
        same = await driver.run_pod(pod("same", ["true"], priority_class="lowest"))
        assert same.phase == "Unschedulable", same
        # preemptionPolicy Never (from its class) is honoured
        never = await driver.run_pod(pod("never", ["true"], priority_class="high-never"))
        assert never.phase == "Unschedulable", never
        assert stack.kube.evictions == []
        assert await counted(stack, "gpuslice_scheduler_preemptions_total") <= 1  # same: none

        high = await driver.run_pod(pod("high", ["probe", "init", "ctx"], priority_class="high"))
        assert high.phase == "Succeeded", high
        # one victim, the lowest: the whole card of "whole", not the two halves
        assert stack.kube.evictions == [("default", "whole")]
        victim = await asyncio.wait_for(holders["whole"], 30)
        assert victim.phase == "Failed", victim
        assert victim.reason.startswith("Evicted"), victim
        assert not holders["half-a"].done()
        assert not holders["half-b"].done()
        assert high.placement is not None
        assert [d.uuid for c in high.placement.containers for d in c.devices] == [NODE.uuids[1]]

        preempted = events(stack, "Preempted")
        assert list(preempted) == ["whole"]
        assert "default/high (priority 1000)" in preempted["whole"]
        assert "whole" in events(stack, "Preempting")["high"]
        (audited,) = await preempted_in_audit(bus)
        assert audited.pod is not None
        assert audited.pod.uid == whole_uid
        assert "default/high" in audited.reason
        assert audited.node == NODE.name
        line = 'gpuslice_scheduler_preemptions_total{outcome="nominated"}'
        assert await counted(stack, line) == 1
        assert await counted(stack, "gpuslice_scheduler_preemption_victims_total") == 1
    finally:
        await end(stack, holders)
    await released(stack, ledger)


async def test_two_replicas_evict_once_and_a_disruption_budget_is_honoured(
    one_node_ha: Up,
) -> None:
    stack, driver, bus, ledger = one_node_ha
    assert len(stack.extender_urls) == 2
    holders = await fill_the_node(stack, driver, ledger, pdb_on_whole=True)
    try:
        # "whole" would be the one victim, but its budget allows no disruption:
        # the two halves of card 0 go instead, each once, though the pod's
        # filter calls (retried while they end) alternate between the replicas
        high = await driver.run_pod(pod("high", ["probe", "init", "ctx"], priority_class="high"))
        assert high.phase == "Succeeded", high
        assert sorted(stack.kube.evictions) == [("default", "half-a"), ("default", "half-b")]
        assert driver.retries["schedule"] >= 1  # it waited for them, through both replicas
        for name in ("half-a", "half-b"):
            outcome = await asyncio.wait_for(holders[name], 30)
            assert outcome.reason.startswith("Evicted"), outcome
        assert not holders["whole"].done()
        assert high.placement is not None
        assert [d.uuid for c in high.placement.containers for d in c.devices] == [NODE.uuids[0]]
        assert sorted(p.pod.name for p in await preempted_in_audit(bus)) == ["half-a", "half-b"]
        line = 'gpuslice_scheduler_preemptions_total{outcome="nominated"}'
        assert await counted(stack, line) == 1
    finally:
        await end(stack, holders)
    await released(stack, ledger)
