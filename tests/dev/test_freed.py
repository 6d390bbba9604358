"""Cards freed by a deleted pod are taken by the pod waiting for them at once,
through the real flow: webhook, extender, inventory, device plugin, NATS,
Redis, and the stand-in kube-scheduler parking the waiting pod as
kube-scheduler 1.34 does (tried again only on a cluster event, here the
holder's deletion, or after five minutes).

kube-scheduler and the inventory each learn of the deletion from their own
watch: the test runs it in both orders. With the inventory stopped
(SIGSTOP) while the holder is deleted, kube-scheduler's retry comes while the
ledger still holds the cards; with it running, whichever comes first."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Any

from gpuslice_cli.dev.driver import ClusterDriver, PodOutcome
from gpuslice_cli.dev.stack import Stack
from gpuslice_common.bus import Bus
from gpuslice_common.ledger import Ledger
from tests.dev.conftest import everything_released

A100 = {"nvidia.com/use-gputype": "A100"}  # gpu-node-1's two cards, nowhere else
PARK_S = 300.0  # kube-scheduler's podMaxInUnschedulablePodsDuration
# the property: the waiting pod binds long before kube-scheduler's parking would
# let it (its 300 s); seconds on an idle machine, a minute is room for a loaded one
REUSE_S = 60.0
WAIT_S = 60.0  # generous bounds for everything else (a loaded machine)


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


async def until(check: Any, what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, f"{what} not within {timeout:.0f}s"
        await asyncio.sleep(0.02)


async def bound(stack: Stack, name: str) -> str:
    """The node pod ``name`` is bound to, "" while it is not (or is gone)."""
    with contextlib.suppress(Exception):
        pod = await stack.kube.get_pod("default", name)
        return str((pod.get("spec") or {}).get("nodeName") or "")
    return ""


async def one_round(
    stack: Stack, driver: ClusterDriver, tmp_path: Path, tag: str, pause_inventory: bool
) -> tuple[PodOutcome, PodOutcome, float]:
    hold = ["sh", "-c", f"while [ ! -e {tmp_path / tag} ]; do sleep 0.05; done"]
    holder_name, waiter_name = f"holder-{tag}", f"waiter-{tag}"
    holder = asyncio.ensure_future(driver.run_pod(both_cards(holder_name, hold)))
    waiter: asyncio.Future[PodOutcome] | None = None
    inventory = stack.children["inventory"].proc
    assert inventory is not None
    stopped = False
    try:

        async def holder_running() -> bool:
            assert not holder.done(), holder.result()
            with contextlib.suppress(Exception):
                pod = await stack.kube.get_pod("default", holder_name)
                return (pod.get("status") or {}).get("phase") == "Running"
            return False

        await until(holder_running, "the holder running on both A100s")
        waiter = asyncio.ensure_future(driver.run_pod(both_cards(waiter_name, ["true"])))

        async def parked() -> bool:
            assert not waiter.done(), waiter.result()
            return f"default/{waiter_name}" in driver.parked

        await until(parked, "the waiting pod parked as unschedulable")
        if pause_inventory:
            os.kill(inventory.pid, signal.SIGSTOP)
            stopped = True
        deleted = time.monotonic()
        await driver.delete_pod("default", holder_name)

        async def waiter_bound() -> bool:
            return bool(await bound(stack, waiter_name))

        with contextlib.suppress(AssertionError):
            await until(waiter_bound, "", REUSE_S)
        took = time.monotonic() - deleted
        assert await bound(stack, waiter_name) == "gpu-node-1", (
            f"{tag}: the pod waiting for the two A100s was not bound within {REUSE_S:.0f}s "
            f"of the holder's deletion; kube-scheduler would keep it parked until its "
            f"{PARK_S:.0f}s timeout (parked: {driver.parked})"
        )
        if stopped:
            os.kill(inventory.pid, signal.SIGCONT)
            stopped = False
        waited, held = await asyncio.wait_for(asyncio.gather(waiter, holder), WAIT_S)
        return held, waited, took
    finally:
        if stopped:
            os.kill(inventory.pid, signal.SIGCONT)
        (tmp_path / tag).touch()
        for task in (waiter, holder):
            if task is not None and not task.done():
                task.cancel()
        await asyncio.gather(
            *(t for t in (waiter, holder) if t is not None), return_exceptions=True
        )


async def test_a_deleted_pods_cards_go_to_the_pod_waiting_for_them_within_seconds(
    up: tuple[Stack, ClusterDriver, Bus, Ledger], tmp_path: Path
) -> None:
    stack, driver, _bus, ledger = up
    driver.park_s = PARK_S
    for tag, pause in (("before-inventory", True), ("either-order", False)):
        held, waited, took = await one_round(stack, driver, tmp_path, tag, pause)
        assert (held.phase, held.node) == ("Deleted", "gpu-node-1"), (held.phase, held.reason)
        assert (waited.phase, waited.node) == ("Succeeded", "gpu-node-1"), (
            waited.phase,
            waited.reason,
        )
        assert waited.placement is not None
        assert len(waited.placement.containers[0].devices) == 2
        assert took < REUSE_S
    await everything_released(stack, ledger)
