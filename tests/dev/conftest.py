"""The local stack for the end-to-end tests, and what the fault tests share:
waiting for the stack to settle, a watcher that no card is ever over
capacity, and the final check that everything was released."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from nats.errors import Error as NatsError

from gpuslice_cli.dev.driver import ClusterDriver
from gpuslice_cli.dev.stack import Stack
from gpuslice_common.bus import Bus
from gpuslice_common.ledger import Ledger, LedgerError
from gpuslice_common.models import PlacementState
from tests.conftest import Native

Up = tuple[Stack, ClusterDriver, Bus, Ledger]


@contextlib.asynccontextmanager
async def stack_up(stack: Stack) -> AsyncIterator[Up]:
    """The stack running, with a driver, the auditor's view of the bus and the
    ledger (pod ends reach the inventory through its pod watch); every child
    must have exited cleanly at the end."""
    async with stack.running():
        bus = await Bus.connect(stack.bus_settings("auditor"), "e2e")
        ledger = stack.ledger()
        driver = ClusterDriver(stack)
        try:
            yield stack, driver, bus, ledger
        finally:
            await driver.close()
            await ledger.close()
            await bus.close()
    assert stack.exit_codes
    assert set(stack.exit_codes.values()) == {0}, stack.exit_codes


@pytest.fixture
async def up(native: Native, tmp_path: Path) -> AsyncIterator[Up]:
    async with stack_up(Stack(tmp_path / "stack", heartbeat_s=1.0)) as running:
        yield running


@pytest.fixture
async def up_ha(native: Native, tmp_path: Path) -> AsyncIterator[Up]:
    """The highly-available stack: a NATS cluster, Redis with sentinels, two
    extenders and two inventories."""
    async with stack_up(Stack(tmp_path / "stack", heartbeat_s=1.0, ha=True)) as running:
        yield running


async def all_released(stack: Stack, ledger: Ledger) -> bool:
    """No placement of any node still holds devices."""
    for node in stack.nodes:
        for placement in await ledger.node_placements(node.name):
            if placement.state is not PlacementState.RELEASED:
                return False
    return True


async def audit_stream_whole(bus: Bus) -> bool:
    """The audit stream has a leader and every copy is current: it takes events,
    and losing another member leaves a quorum that holds them all."""
    try:
        info = await bus.js.stream_info(bus.subjects.audit_stream)
    except (TimeoutError, NatsError):
        return False
    cluster = info.cluster
    if cluster is None:  # one server: there is nothing to elect
        return True
    copies = cluster.replicas or []
    return (
        bool(cluster.leader)
        and len(copies) == (info.config.num_replicas or 1) - 1
        and all(c.current and not c.offline for c in copies)
    )


async def settled(
    stack: Stack, ledger: Ledger, timeout: float = 60, bus: Bus | None = None
) -> None:
    """Every service replica ready and every node's cards registered and
    healthy; with ``bus``, the audit stream whole again (a NATS member that
    held its leader died: the others elect one within seconds, and until then
    events wait in their publishers' outboxes)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    urls = [f"{u}/readyz" for u in stack.service_urls]
    async with httpx.AsyncClient(timeout=2) as client:
        while True:
            ok = True
            for url in urls:
                with contextlib.suppress(httpx.HTTPError):
                    ok &= (await client.get(url)).status_code == 200
                    continue
                ok = False
            with contextlib.suppress(LedgerError):
                for node in stack.nodes:
                    cards = await ledger.node_gpus(node.name)
                    ok &= len(cards) == node.gpus and all(c.device.healthy for c in cards)
            if ok and bus is not None:
                ok = await audit_stream_whole(bus)
            if ok:
                return
            assert loop.time() < deadline, "the stack did not settle after the fault"
            await asyncio.sleep(0.2)


async def never_over_committed(stack: Stack, ledger: Ledger, stop: asyncio.Event) -> int:
    """Watch the cards until ``stop``; the number of checks made."""
    checks = 0
    while not stop.is_set():
        with contextlib.suppress(LedgerError):
            for node in stack.nodes:
                for card in await ledger.node_gpus(node.name):
                    assert card.used.memory_mib <= card.capacity.memory_mib, card
                    assert card.used.slots <= card.capacity.slots, card
                    checks += 1
        await asyncio.sleep(0.05)
    return checks


async def everything_released(stack: Stack, ledger: Ledger, timeout: float = 30) -> None:
    """Wait until no placement holds devices, then check every card is empty."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await all_released(stack, ledger):
        held = [
            (p.pod.name, p.state.value)
            for node in stack.nodes
            for p in await ledger.node_placements(node.name)
            if p.state is not PlacementState.RELEASED
        ]
        assert loop.time() < deadline, f"placements still held after every pod ended: {held}"
        await asyncio.sleep(0.2)
    for node in stack.nodes:
        for card in await ledger.node_gpus(node.name):
            assert (card.used.memory_mib, card.used.slots) == (0, 0)
