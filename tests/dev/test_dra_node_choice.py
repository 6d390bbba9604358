"""In DRA mode gpuslice's extender still chooses the node: the webhook keeps a
pod's HAMi resources beside its claim, so kube-scheduler (the local stack's, as
the real one) asks the extender among the nodes where the claim fits, allocates
the claim on the node it prefers and binds through it."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import httpx

from gpuslice_cli.dev.stack import NodeSpec, Stack
from tests.conftest import Native
from tests.dev.conftest import everything_released, stack_up

# first fit takes the first node where the claim fits: "wide" (two cards); the
# fragmentation score prefers filling the one-card node, "narrow"
NODES = (
    NodeSpec("wide", gpus=2, dra=True),
    NodeSpec("narrow", gpus=1, dra=True),
)


def gpu_pod(name: str) -> dict[str, Any]:
    limits = {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 8000, "nvidia.com/gpucores": 10}
    return {
        "metadata": {"name": name, "namespace": "default", "uid": str(uuid.uuid4())},
        "spec": {
            "containers": [
                {
                    "name": "main",
                    "image": "cuda",
                    "command": ["true"],
                    "resources": {"limits": limits},
                }
            ]
        },
    }


async def test_the_extender_chooses_a_dra_pod_s_node(native: Native, tmp_path: Path) -> None:
    stack = Stack(tmp_path / "stack", nodes=NODES, heartbeat_s=1.0)
    async with stack_up(stack) as (_, driver, _bus, ledger):
        pod = gpu_pod("chosen")
        admitted, refusal, _ = await driver.admit(pod)
        assert admitted is not None, refusal
        assert admitted["spec"]["resourceClaims"][0]["name"] == "gpuslice"
        assert admitted["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
        # the extender's preference among the two, asked as kube-scheduler asks it
        async with httpx.AsyncClient(timeout=30) as http:
            body = {"Pod": admitted, "NodeNames": ["wide", "narrow"]}
            scores = (await http.post(f"{stack.extender_url}/prioritize", json=body)).json()
        ranked = {s["Host"]: s["Score"] for s in scores}
        assert ranked["narrow"] > ranked["wide"], ranked
        outcome = await driver.run_pod(gpu_pod("chosen"))
        assert outcome.phase == "Succeeded", outcome.reason
        assert outcome.node == "narrow"  # not first fit's "wide"
        assert outcome.placement is not None
        assert outcome.placement.node == "narrow"
        assert outcome.placement.claim is not None  # recorded when kubelet prepared it
        await everything_released(stack, ledger)
