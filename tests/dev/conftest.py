"""The local stack for the end-to-end tests."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from gpuslice_cli.dev.driver import ClusterDriver
from gpuslice_cli.dev.stack import Stack
from gpuslice_common.bus import Bus
from gpuslice_common.ledger import Ledger
from gpuslice_common.models import PlacementState
from tests.conftest import Native


@pytest.fixture
async def up(
    native: Native, tmp_path: Path
) -> AsyncIterator[tuple[Stack, ClusterDriver, Bus, Ledger]]:
    stack = Stack(tmp_path / "stack", heartbeat_s=1.0)
    async with stack.running():
        # the auditor's view of the bus; pod ends reach the inventory through its pod watch
        bus = await Bus.connect(stack.bus_settings("auditor"), "e2e")
        ledger = Ledger.from_url(stack.redis_url or "", stack.prefix)
        driver = ClusterDriver(stack)
        try:
            yield stack, driver, bus, ledger
        finally:
            await driver.close()
            await ledger.close()
            await bus.close()
    assert stack.exit_codes
    assert set(stack.exit_codes.values()) == {0}, stack.exit_codes


async def all_released(stack: Stack, ledger: Ledger) -> bool:
    """No placement of any node still holds devices."""
    for node in stack.nodes:
        for placement in await ledger.node_placements(node.name):
            if placement.state is not PlacementState.RELEASED:
                return False
    return True
