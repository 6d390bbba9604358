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
    instances left and stays unscheduled with kube-scheduler's reason. The one
    that runs holds its instances until that outcome is in: on a loaded
    machine a fixed sleep could end first and free them."""
    stack = Stack(tmp_path / "stack", nodes=(STATIC,), heartbeat_s=1.0)
    release = tmp_path / "release"
    hold = ["sh", "-c", f"while [ ! -e {release} ]; do sleep 0.05; done"]
    async with stack_up(stack) as (_, driver, _bus, _ledger):
        plugin = stack.plugin("static-node", "nvidia.com/mig-3g.20gb")
        assert len(plugin.free()) == 4
        runs = [asyncio.ensure_future(driver.run_pod(mig_pod(n, 3, hold))) for n in ("a", "b")]
        try:
            done, _ = await asyncio.wait(runs, timeout=120, return_when=asyncio.FIRST_COMPLETED)
        finally:
            release.touch()
        first, second = await asyncio.gather(*runs)
        assert done, "neither pod was found unschedulable while the other held the node"
        [refused] = [run.result() for run in done]
        assert (refused.phase, refused.reason) == (
            "Unschedulable",
            "0/1 nodes are available: 1 Insufficient nvidia.com/mig-3g.20gb.",
        ), (refused.phase, refused.reason)
        ran = first if first is not refused else second
        assert (ran.phase, ran.reason) == ("Succeeded", ""), (ran.phase, ran.reason)
        [run] = ran.containers
        instances = run.extended["nvidia.com/mig-3g.20gb"]
        assert len(set(instances)) == 3
        # the kubelet's Allocate gave the container exactly those instances
        assert sorted(run.env["NVIDIA_VISIBLE_DEVICES"].split(",")) == sorted(instances)
        assert len(plugin.free()) == 4  # given back when it ended
