"""Every container gets its own pod's grant, whatever order kubelet admits the
pods bound to its node in.

Kubelet's Allocate names no pod: the node agent hands out the next container of
the pod bound to the node that waits for one. kube-scheduler binds pods
concurrently, and kubelet admits them in the order it learns of them, which is
not the bind order. Here three pods of different shapes are bound to one node
at once, through the extender as kube-scheduler calls it, and a kubelet admits
whichever bound pods it sees in each of the six orders: every container must
get its own pod's name and limits."""

from __future__ import annotations

import asyncio
import itertools
import uuid
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from gpuslice_cli.dev.stack import NodeSpec, Stack
from tests.conftest import Native
from tests.dev.conftest import everything_released, stack_up

NODE = NodeSpec("turn-node", gpus=2, model="NVIDIA A100-SXM4-80GB", memory_mib=81920)
# per pod, per container: (device memory MiB, cores %); one GPU each, so kubelet's
# calls all ask for one and only the pod's turn tells them apart
SHAPES: dict[str, list[tuple[int, int]]] = {
    "a": [(2000, 20)],
    "b": [(3000, 30)],
    "c": [(1000, 10), (1500, 15)],
}
LOOK_S = 0.5  # how long kubelet lets the binds in flight go on before it looks


def gpu_pod(name: str, shape: list[tuple[int, int]]) -> dict[str, Any]:
    containers: list[dict[str, Any]] = [
        {
            "name": f"c{i}",
            "image": "cuda",
            "command": ["true"],
            "resources": {
                "limits": {
                    "nvidia.com/gpu": 1,
                    "nvidia.com/gpumem": mem,
                    "nvidia.com/gpucores": cores,
                }
            },
        }
        for i, (mem, cores) in enumerate(shape)
    ]
    for container, (_, cores) in zip(containers, shape, strict=True):
        container["resources"]["limits"]["nvidia.com/gpucores"] = cores
    return {
        "metadata": {
            "name": name,
            "namespace": "default",
            "uid": str(uuid.uuid4()),
            "creationTimestamp": "2026-01-01T00:00:00Z",
        },
        "spec": {"containers": containers},
    }


async def test_no_container_gets_another_pods_grant_in_any_admission_order(
    native: Native, tmp_path: Path
) -> None:
    stack = Stack(tmp_path / "stack", nodes=(NODE,), heartbeat_s=1.0)
    async with stack_up(stack) as (_, driver, _bus, ledger):
        plugin = stack.plugin(NODE.name)
        extender = stack.extender_url
        wrong: list[str] = []
        async with httpx.AsyncClient(timeout=30) as http:

            async def bind(pod: dict[str, Any]) -> None:
                """kube-scheduler's filter and bind through the extender."""
                meta = pod["metadata"]
                body = {"Pod": pod, "NodeNames": [NODE.name]}
                filtered = (await http.post(f"{extender}/filter", json=body)).json()
                assert filtered.get("NodeNames") == [NODE.name], filtered
                binding = {
                    "PodName": meta["name"],
                    "PodNamespace": meta["namespace"],
                    "PodUID": meta["uid"],
                    "Node": NODE.name,
                }
                bound = (await http.post(f"{extender}/bind", json=binding)).json()
                assert not bound.get("Error"), bound

            async def bound_here(pod: dict[str, Any]) -> bool:
                meta = pod["metadata"]
                held = await stack.kube.get_pod(meta["namespace"], meta["name"])
                return bool(held["spec"].get("nodeName") == NODE.name)

            for round_, order in enumerate(itertools.permutations(SHAPES)):
                pods: dict[str, dict[str, Any]] = {}
                for name in SHAPES:
                    admitted, refusal, _ = await driver.admit(
                        gpu_pod(f"{name}-{round_}", SHAPES[name])
                    )
                    assert admitted is not None, refusal
                    admitted["status"] = {"phase": "Pending"}
                    stack.kube.add_pod(admitted)
                    pods[name] = admitted
                binds = [asyncio.ensure_future(bind(pods[name])) for name in SHAPES]
                held: list[str] = []
                try:
                    done: set[str] = set()
                    while len(done) < len(pods):
                        await asyncio.wait(binds, timeout=LOOK_S)
                        ready = [n for n in order if n not in done and await bound_here(pods[n])]
                        if not ready:
                            failed = [b.exception() for b in binds if b.done() and b.exception()]
                            assert not failed, failed
                            continue
                        name = ready[0]  # kubelet admits in its own order
                        meta = pods[name]["metadata"]
                        for index, (mem, cores) in enumerate(SHAPES[name]):
                            response = await plugin.admit_container(1)
                            held.extend(plugin.last_allocated)
                            env = dict(response.envs)
                            got = (
                                env.get("GPUSLICE_POD_NAME"),
                                env.get("GPUSLICE_CONTAINER_NAME"),
                                env.get("CUDA_DEVICE_MEMORY_LIMIT_0"),
                                env.get("CUDA_DEVICE_SM_LIMIT"),
                            )
                            wanted = (meta["name"], f"c{index}", f"{mem}m", str(cores))
                            if got != wanted:
                                wrong.append(f"order {order}: {wanted} got {got}")
                        done.add(name)
                    await asyncio.gather(*binds)
                finally:
                    for bind_task in binds:
                        bind_task.cancel()
                    for device in held:
                        plugin.allocated.discard(device)
                    for pod in pods.values():
                        await driver._delete(pod)
                await everything_released(stack, ledger)
        assert not wrong, "containers ran with another pod's grant:\n" + "\n".join(wrong)
        async with httpx.AsyncClient() as http:
            text = (await http.get(stack.metrics_urls["scheduler"])).text
        turns = {
            sample.labels["outcome"]: sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == "gpuslice_scheduler_bind_turns_total"
        }
        binds = 6 * len(SHAPES)
        assert turns.get("at-once", 0) + turns.get("waited", 0) == binds, turns
