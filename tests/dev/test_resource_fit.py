"""The stand-in kube-scheduler's resource fit against a running static MIG
node: pods asking more instances at once than the node has left are not
bound to it, and none ever fails for lack of them at Allocate."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from gpuslice_cli.dev.stack import NodeSpec, Stack
from tests.conftest import Native
from tests.dev.conftest import stack_up

STATIC = NodeSpec(
    "static-node",
    model="NVIDIA A100-SXM4-40GB",
    memory_mib=40960,
    static_mig=("3g.20gb", "3g.20gb"),
)


def mig_pod(name: str, count: int, command: list[str]) -> dict[str, Any]:
    return {
        "metadata": {"name": name},
        "spec": {
            "containers": [
                {
                    "name": "main",
                    "image": "cuda",
                    "command": command,
                    "resources": {"limits": {"nvidia.com/mig-3g.20gb": count}},
                }
            ]
        },
    }


async def test_two_pods_wanting_more_instances_than_there_are_do_not_both_bind(
    native: Native, tmp_path: Path
) -> None:
    """Both fit the empty node; the one that comes second to it finds 1 of 4
    instances left and stays unscheduled with kube-scheduler's reason."""
    stack = Stack(tmp_path / "stack", nodes=(STATIC,), heartbeat_s=1.0)
    async with stack_up(stack) as (_, driver, _bus, _ledger):
        plugin = stack.plugin("static-node", "nvidia.com/mig-3g.20gb")
        assert len(plugin.free()) == 4
        holder = mig_pod("holder", 3, ["sh", "-c", "sleep 8"])
        other = mig_pod("other", 3, ["probe", "init"])
        first, second = await asyncio.gather(driver.run_pod(holder), driver.run_pod(other))
        outcomes = sorted([(first.phase, first.reason), (second.phase, second.reason)])
        assert outcomes == [
            ("Succeeded", ""),
            ("Unschedulable", "0/1 nodes are available: 1 Insufficient nvidia.com/mig-3g.20gb."),
        ], outcomes
        ran = first if first.phase == "Succeeded" else second
        [run] = ran.containers
        instances = run.extended["nvidia.com/mig-3g.20gb"]
        assert len(set(instances)) == 3
        # the kubelet's Allocate gave the container exactly those instances
        assert sorted(run.env["NVIDIA_VISIBLE_DEVICES"].split(",")) == sorted(instances)
        assert len(plugin.free()) == 4  # given back when it ended
