"""The stack through faults: Redis killed and restarted, NATS restarted, and each
service restarted (some killed) in turn, each fault striking while a wave of
pods is under way; every pod still runs (the driver retries as the API server,
kube-scheduler and kubelet do), no card is ever over-committed, and everything
is released at the end."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from gpuslice_cli.dev.driver import ClusterDriver
from gpuslice_cli.dev.stack import Stack
from gpuslice_common.bus import Bus
from gpuslice_common.ledger import Ledger
from tests.dev.conftest import everything_released, never_over_committed, settled
from tests.dev.test_stack import gpu_pod


async def test_pods_run_through_restarts_of_every_part(
    up: tuple[Stack, ClusterDriver, Bus, Ledger],
) -> None:
    stack, driver, _, ledger = up

    async def restart_redis() -> None:
        server = stack.server("redis")
        server.kill()
        server.start()

    async def restart_nats() -> None:
        server = stack.server("nats")
        server.stop()
        server.start()

    def service(name: str, kill: bool = False) -> Callable[[], Awaitable[None]]:
        return lambda: stack.restart(name, kill=kill)

    faults: list[tuple[str, Callable[[], Awaitable[None]]]] = [
        ("redis killed", restart_redis),
        ("nats restarted", restart_nats),
        ("webhook restarted", service("webhook")),
        ("scheduler killed", service("scheduler", kill=True)),
        ("inventory killed", service("inventory", kill=True)),
        ("device plugin of gpu-node-1 killed", service("gpu-node-1", kill=True)),
        ("device plugin of gpu-node-2 restarted", service("gpu-node-2")),
    ]
    stop = asyncio.Event()
    watcher = asyncio.create_task(never_over_committed(stack, ledger, stop))
    outcomes: list[Any] = []
    try:
        for i, (what, fault) in enumerate(faults):
            wave = [
                gpu_pod(
                    f"f{i}-{j}", ["probe", "init", "ctx", "alloc", "512m", "sleep", "800"], mem=6000
                )
                for j in range(3)
            ]
            running = [asyncio.create_task(driver.run_pod(pod)) for pod in wave]
            await asyncio.sleep(0.3)  # the fault strikes while the wave is under way
            await fault()
            done = await asyncio.gather(*running)
            for outcome in done:
                assert outcome.phase == "Succeeded", (what, outcome)
            outcomes += done
            await settled(stack, ledger)
    finally:
        stop.set()
        checks = await watcher
    assert checks > 0
    assert len(outcomes) == 3 * len(faults)

    await everything_released(stack, ledger)
