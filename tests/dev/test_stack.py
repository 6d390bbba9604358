"""End to end on the local stack: real nats-server and redis-server, the four
services as processes over HTTP and gRPC, two simulated nodes whose kubelet
is the stand-in, and every GPU container run as a process with the interposer
preloaded on the fake CUDA driver."""

from __future__ import annotations

import asyncio
import json
import sys
import uuid
from pathlib import Path
from typing import Any

from gpuslice_cli.dev.driver import ClusterDriver, PodOutcome
from gpuslice_cli.dev.stack import Stack
from gpuslice_common.bus import Bus
from gpuslice_common.events import EventType
from gpuslice_common.ledger import Ledger
from gpuslice_inventory.telemetry import TelemetryStore
from tests.dev.conftest import all_released

GIB = 1 << 30


def gpu_pod(
    name: str,
    command: list[str],
    *,
    gpus: int = 1,
    mem: int | None = None,
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    limits: dict[str, Any] = {"nvidia.com/gpu": gpus}
    if mem is not None:
        limits["nvidia.com/gpumem"] = mem
    return {
        "metadata": {"name": name, "annotations": annotations or {}},
        "spec": {
            "containers": [
                {
                    "name": "main",
                    "image": "cuda",
                    "command": command,
                    "resources": {"limits": limits},
                }
            ]
        },
    }


def probe_lines(outcome: PodOutcome) -> list[str]:
    return outcome.containers[0].output.splitlines()


async def test_a_mixed_workload_end_to_end(
    up: tuple[Stack, ClusterDriver, Bus, Ledger],
) -> None:
    stack, driver, bus, ledger = up
    stack.kube.add_resource_quota(
        "team",
        {"metadata": {"name": "gpu"}, "spec": {"hard": {"limits.nvidia.com/gpumem": "4000"}}},
    )
    sharing = [
        gpu_pod(f"share-{i}", ["probe", "init", "ctx", "alloc", "1g", "sleep", "1500"], mem=8000)
        for i in range(3)
    ]
    over = gpu_pod("over", ["probe", "init", "ctx", "alloc", "1g", "alloc", "2g"], mem=2000)
    t4 = gpu_pod(
        "t4", ["probe", "init", "ctx"], mem=1000, annotations={"nvidia.com/use-gputype": "Tesla T4"}
    )
    multi = gpu_pod("multi", ["probe", "init", "ctx", "ctx", "1"], gpus=2, mem=1000)
    whole = gpu_pod("whole", ["probe", "init", "ctx", "info"])
    # a process that sets its own limits and region: the grant holds it all the same
    rogue = gpu_pod(
        "rogue",
        [
            "sh",
            "-c",
            "CUDA_DEVICE_MEMORY_LIMIT=100g CUDA_DEVICE_MEMORY_LIMIT_0=100g"
            " CUDA_DEVICE_MEMORY_SHARED_CACHE=/tmp/gpuslice-rogue-region"
            " exec probe init ctx alloc 1g alloc 2g info",
        ],
        mem=2000,
    )
    quota = gpu_pod("greedy", ["probe", "init"], mem=8000)

    async def telemetry_seen() -> bool:
        store = TelemetryStore(ledger.redis, stack.prefix)
        for node in stack.nodes:
            for usage in (await store.gpu_usage(node.name, prune=False)).values():
                if usage.used_bytes >= GIB:
                    return True
        return False

    running = [asyncio.create_task(driver.run_pod(pod)) for pod in sharing]
    seen = False
    while not all(task.done() for task in running):
        seen = seen or await telemetry_seen()
        await asyncio.sleep(0.1)
    shared = [task.result() for task in running]
    outcomes = [
        *shared,
        await driver.run_pod(over),
        await driver.run_pod(t4),
        await driver.run_pod(multi),
        await driver.run_pod(whole),
        await driver.run_pod(rogue),
        await driver.run_pod(quota, namespace="team"),
    ]
    by_name = {o.name: o for o in outcomes}
    assert seen, "no telemetry reached the inventory while the sharing pods ran"

    # NATS knows each part as on a cluster: the services as their own users,
    # the node agents by their projected tokens, the containers by the
    # telemetry tokens Allocate gave them (the telemetry above came with those)
    assert stack.nats_auth is not None
    for service in ("webhook", "scheduler", "inventory"):
        assert stack.children[service].env["GPUSLICE_NATS_USER"] == service
    for node in stack.nodes:
        agent = stack.children[node.name].env
        assert "GPUSLICE_NATS_PASSWORD" not in agent
        assert "GPUSLICE_NATS_USER" not in agent
        assert await asyncio.to_thread(Path(agent["GPUSLICE_NATS_TOKEN_FILE"]).read_text)
    for outcome in outcomes:
        if outcome.placement is not None:
            allocated = outcome.containers[0].env
            assert allocated["GPUSLICE_NATS_TOKEN"], outcome.name
            assert "GPUSLICE_NATS_PASSWORD" not in allocated

    # every pod placed or denied for the right reason
    for name in ("share-0", "share-1", "share-2", "t4", "multi", "whole", "rogue"):
        assert by_name[name].phase == "Succeeded", (name, by_name[name].containers)
    assert by_name["greedy"].phase == "Denied"
    assert "exceeded quota" in by_name["greedy"].reason
    assert by_name["t4"].node == "gpu-node-2"

    # Allocate's environment matches the ledger's record
    for outcome in outcomes:
        if outcome.placement is None:
            continue
        env = outcome.containers[0].env
        grants = outcome.placement.containers[0].devices
        assert env["NVIDIA_VISIBLE_DEVICES"] == ",".join(g.uuid for g in grants)
        for i, grant in enumerate(grants):
            assert env[f"CUDA_DEVICE_MEMORY_LIMIT_{i}"] == f"{grant.memory_mib}m"
    assert len(by_name["multi"].containers[0].env["NVIDIA_VISIBLE_DEVICES"].split(",")) == 2
    whole_grant = by_name["whole"].placement
    assert whole_grant is not None
    assert (
        whole_grant.containers[0].devices[0].memory_mib
        == stack.node(by_name["whole"].node).memory_mib
    )

    # within the limit succeeds; beyond it fails with out of memory, inside the process
    over_lines = probe_lines(by_name["over"])
    allocs = [line for line in over_lines if '"cmd":"alloc"' in line]
    assert '"rc":0' in allocs[0]
    assert '"rc":2' in allocs[1]  # CUDA_ERROR_OUT_OF_MEMORY
    assert by_name["over"].phase == "Succeeded"  # the probe reports, it does not crash
    # (the interposer's log shares the output)
    rogue_lines = [json.loads(x) for x in probe_lines(by_name["rogue"]) if x.startswith("{")]
    assert [line["rc"] for line in rogue_lines if line["cmd"] == "alloc"] == [0, 2]
    assert [line["total"] for line in rogue_lines if line["cmd"] == "info"] == [2000 << 20]

    # the audit stream holds the whole story of every placed pod
    placed = [o for o in outcomes if o.placement is not None]

    async def stories_complete() -> bool:
        events = await bus.read_audit()
        for outcome in placed:
            kinds = [
                e.type for e in events if e.subject == outcome.ref or _uid_of(e) == outcome.uid
            ]
            for wanted in (
                EventType.POD_ADMITTED,
                EventType.ALLOC_RESERVED,
                EventType.ALLOC_BOUND,
                EventType.ALLOC_ALLOCATED,
                EventType.ALLOC_RELEASED,
            ):
                if wanted not in kinds:
                    return False
        return True

    await _until(stories_complete, 20)
    denied = [e for e in await bus.read_audit() if e.type is EventType.POD_DENIED]
    assert any(_uid_of(e) == by_name["greedy"].uid for e in denied)

    # everything released at the end, nothing ever over-committed
    await _until(lambda: all_released(stack, ledger), 20)
    for node in stack.nodes:
        for card in await ledger.node_gpus(node.name):
            assert card.used.memory_mib == 0
            assert card.used.slots == 0
    assert not stack.kube.pods()


def _uid_of(event: Any) -> str:
    pod = event.data.get("pod") if isinstance(event.data, dict) else None
    return str(pod.get("uid", "")) if isinstance(pod, dict) else ""


async def _until(condition: Any, timeout: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await condition():
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.2)


async def test_a_container_ends_with_its_first_process_and_takes_the_rest_along(
    up: tuple[Stack, ClusterDriver, Bus, Ledger],
) -> None:
    _, driver, _, _ = up
    marker = f"gpuslice-orphan-{uuid.uuid4().hex[:8]}"
    # a background process that would outlive the container and hold its output
    sleeper = f"{sys.executable} -c 'import time; time.sleep(60)' {marker}"
    pod = gpu_pod("bg", ["sh", "-c", f"{sleeper} & echo started"], mem=1000)
    started = asyncio.get_running_loop().time()
    outcome = await driver.run_pod(pod)
    assert asyncio.get_running_loop().time() - started < 20
    assert outcome.phase == "Succeeded", outcome
    assert "started" in outcome.containers[0].output
    pgrep = await asyncio.create_subprocess_exec(
        "pgrep", "-f", marker, stdout=asyncio.subprocess.PIPE
    )
    found, _ = await pgrep.communicate()
    assert found.decode().strip() == ""
