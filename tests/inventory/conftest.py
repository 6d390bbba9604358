"""Fixtures and helpers of the inventory's tests: a bus on the test's own subject
prefix, the events it sees, settings with short intervals."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from datetime import timedelta
from typing import Any

import pytest

from gpuslice_common.bus import Bus
from gpuslice_common.config import InventorySettings
from gpuslice_common.events import CloudEvent
from gpuslice_common.ledger import Ledger
from gpuslice_common.models import NodeInventory
from gpuslice_common.servers import NatsServer, free_port


def settings_for(nats: NatsServer, redis_url: str, prefix: str, **kw: Any) -> InventorySettings:
    values: dict[str, Any] = {
        "nats_url": nats.url,
        "redis_url": redis_url,
        "subject_prefix": prefix,
        "ledger_prefix": prefix,
        "heartbeat_interval": 0.2,
        "sweep_interval": 0.05,
        "lease_ttl": 1,
        "metrics_interval": 0.1,
        "listen_host": "127.0.0.1",
        "listen_port": free_port(),
        "console_port": 0,  # the console's tests ask for one (on a free port)
    }
    values.update(kw)
    return InventorySettings(**values)


async def until(condition: Callable[[], Any], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.03)


@pytest.fixture
async def bus(nats_server: NatsServer, prefix: str) -> AsyncIterator[Bus]:
    b = await Bus.connect(InventorySettings(nats_url=nats_server.url, subject_prefix=prefix), "t")
    await b.ensure_audit_stream(timedelta(hours=1))
    yield b
    await b.close()


@pytest.fixture
async def events(bus: Bus) -> list[CloudEvent]:
    received: list[CloudEvent] = []

    async def keep(event: CloudEvent) -> None:
        received.append(event)

    await bus.subscribe_events(bus.subjects.events_all, keep)
    await bus.flush()
    return received


async def announce(bus: Bus, inventory: NodeInventory) -> None:
    await bus.publish_model(bus.subjects.inventory(inventory.node), inventory)
    await bus.flush()


async def rebuilt(ledger: Ledger, *nodes: str) -> bool:
    """Are all ``nodes`` registered and stamped rebuilt (they take reservations)?"""
    status = await ledger.rebuild_status(nodes)
    return all(node in status and status[node].rebuilt_at is not None for node in nodes)
