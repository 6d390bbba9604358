"""Time to reuse: from a pod's deletion to the bind of the pod waiting for its cards.

Starts the local stack (webhook, extender, inventory, two simulated nodes,
NATS, Redis) with the stand-in kube-scheduler parking an unschedulable pod as
kube-scheduler 1.34 does: tried again only on a cluster event (here the
holder's deletion) or after ``--park`` seconds (kube-scheduler's
``podMaxInUnschedulablePodsDuration``, 300). Each round: a holder takes both
A100s of gpu-node-1; a pod asking for both is filtered and parked; the holder
is deleted (``kubectl delete --force``); the time until the waiter is bound is
measured. The inventory releases the holder's reservation from its own pod
watch, in a race with the stand-in's retry, as on a cluster.

Two modes in the same run, on the same stack: ``before``, the extender with
``GPUSLICE_FREE_ENDED_HOLDERS=false`` (a retry that comes before the
inventory's release fails, and the pod waits for the park timeout); ``after``,
the default (the extender asks the API server about the reservations in the
way and releases those of pods that are gone). The extender is restarted
between the modes.

Usage: python bench/reuse_bench.py [--rounds 10] [--before-rounds 3] [--park 300]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import statistics
import tempfile
import time
from datetime import date
from pathlib import Path
from typing import Any

from gpuslice_cli.dev.driver import ClusterDriver
from gpuslice_cli.dev.stack import Stack

A100 = {"nvidia.com/use-gputype": "A100"}  # gpu-node-1's two cards, nowhere else


def both_cards(name: str, command: list[str]) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "annotations": A100},
        "spec": {
            "containers": [
                {
                    "name": "main",
                    "image": "cuda",
                    "command": command,
                    "resources": {"limits": {"nvidia.com/gpu": 2}},
                }
            ]
        },
    }


async def until(check: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not within {timeout:.0f}s")
        await asyncio.sleep(0.005)


async def one_round(stack: Stack, driver: ClusterDriver, workdir: Path, tag: str) -> float:
    """Seconds from the holder's deletion to the waiter's bind."""
    release = workdir / f"release-{tag}"
    hold = ["sh", "-c", f"while [ ! -e {release} ]; do sleep 0.05; done"]
    holder = asyncio.ensure_future(driver.run_pod(both_cards(f"holder-{tag}", hold)))
    waiter: asyncio.Future[Any] | None = None

    async def phase(name: str) -> str:
        with contextlib.suppress(Exception):
            pod = await stack.kube.get_pod("default", name)
            return str((pod.get("status") or {}).get("phase") or "")
        return ""

    async def node(name: str) -> str:
        with contextlib.suppress(Exception):
            pod = await stack.kube.get_pod("default", name)
            return str((pod.get("spec") or {}).get("nodeName") or "")
        return ""

    try:
        await until(lambda: _is(phase(f"holder-{tag}"), "Running"), 60, "holder running")
        waiter = asyncio.ensure_future(driver.run_pod(both_cards(f"waiter-{tag}", ["true"])))
        await until(lambda: _true(f"default/waiter-{tag}" in driver.parked), 60, "waiter parked")
        deleted = time.monotonic()
        await driver.delete_pod("default", f"holder-{tag}")
        await until(lambda: _is(node(f"waiter-{tag}"), "gpu-node-1"), driver.park_s + 60, "bind")
        took = time.monotonic() - deleted
        await asyncio.wait_for(asyncio.gather(holder, waiter), 60)
        return took
    finally:
        release.touch()
        tasks = [t for t in (holder, waiter) if t is not None]
        for task in tasks:
            if not task.done():
                task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _is(value: Any, wanted: str) -> bool:
    return bool(await value == wanted)


async def _true(value: bool) -> bool:
    return value


async def set_mode(stack: Stack, enabled: bool) -> None:
    stack.children["scheduler"].env["GPUSLICE_FREE_ENDED_HOLDERS"] = str(enabled).lower()
    await stack.restart("scheduler")


async def run(workdir: Path, rounds: int, before_rounds: int, park_s: float) -> None:
    stack = Stack(workdir / "stack", heartbeat_s=1.0, log_level="WARNING")
    async with stack.running():
        driver = ClusterDriver(stack, park_s=park_s)
        try:
            results: dict[str, list[float]] = {}
            for mode, count, enabled in (("before", before_rounds, False), ("after", rounds, True)):
                await set_mode(stack, enabled)
                times = results[mode] = []
                for i in range(count):
                    times.append(await one_round(stack, driver, workdir, f"{mode}-{i}"))
                    print(f"# {mode} round {i + 1}: {times[-1] * 1000:.0f} ms", flush=True)
        finally:
            await driver.close()
    print(f"# time to reuse, {date.today()}, {platform.node()}, {os.cpu_count()} CPUs")
    print(f"# park timeout (podMaxInUnschedulablePodsDuration) {park_s:.0f} s")
    print("| mode | rounds | median | min | max | within 5 s |")
    print("|---|---|---|---|---|---|")
    for mode, times in results.items():
        if not times:
            continue
        within = sum(t <= 5.0 for t in times)
        print(
            f"| {mode} | {len(times)} | {statistics.median(times) * 1000:,.0f} ms"
            f" | {min(times) * 1000:,.0f} ms | {max(times) * 1000:,.0f} ms"
            f" | {within} of {len(times)} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10, help="rounds with the holder check")
    parser.add_argument(
        "--before-rounds", type=int, default=3, help="rounds without it (each may wait --park)"
    )
    parser.add_argument("--park", type=float, default=300.0, help="the park timeout, seconds")
    parser.add_argument("--workdir", type=Path, default=None, help="logs (default: a temp dir)")
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="gpuslice-reuse-"))
    print(f"# logs under {workdir}")
    asyncio.run(run(workdir, args.rounds, args.before_rounds, args.park))


if __name__ == "__main__":
    main()
