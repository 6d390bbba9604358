"""The console's refresher ends when the inventory stops, even when the Redis
client turns the cancellation into an error on the way (it can, mid-command):
otherwise the inventory's stop waits for it in vain ("task console did not
stop"). The Redis client's slip is played by a refresh, or a change-notice
watch, that waits until cancelled and then fails as Redis would."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError

from gpuslice_common.bus import Bus
from gpuslice_common.ledger import Ledger, LedgerUnavailable
from gpuslice_inventory.console.auditfeed import AuditFeed
from gpuslice_inventory.console.auth import Authenticator
from gpuslice_inventory.console.hub import Hub
from gpuslice_inventory.console.snapshot import SnapshotBuilder
from gpuslice_inventory.telemetry import TelemetryStore

WAIT_S = 15.0


class SlippingBuilder(SnapshotBuilder):
    """After its first refresh, each one waits, and fails with a Redis error when cancelled."""

    def __init__(self, ledger: Ledger, prefix: str) -> None:
        super().__init__(ledger, TelemetryStore(ledger.redis, prefix), prefix)
        self.stuck = asyncio.Event()
        self.slipping = True

    async def refresh(self, *, full: bool, dirty: Iterable[str] = ()) -> bool:
        if not self.refreshes:
            return await super().refresh(full=full, dirty=dirty)
        self.stuck.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            if self.slipping:
                raise RedisConnectionError("Connection closed by server.") from None
            raise
        return False


class SlippingLedger(Ledger):
    """Change notices that never come; cancelled, the watch fails as a lost connection."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.watching = asyncio.Event()
        self.slipping = True

    async def watch_changes(
        self, poll: float = 1.0, on_subscribed: Callable[[], None] | None = None
    ) -> AsyncIterator[str]:
        if on_subscribed is not None:
            on_subscribed()
        self.watching.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            if self.slipping:
                raise LedgerUnavailable("lost the ledger's change notices: closed") from None
            raise
        yield ""


def hub_of(ledger: Ledger, builder: SnapshotBuilder, bus: Bus) -> Hub:
    return Hub(ledger, builder, AuditFeed(bus, 100), Authenticator("none", None), tick=0.05)


async def stops(task: asyncio.Task[None], slip: SlippingBuilder | SlippingLedger) -> bool:
    """Whether cancelling ``task`` ends it while ``slip`` turns cancellations into errors."""
    task.cancel()
    await asyncio.wait({task}, timeout=WAIT_S)
    stopped = task.done() and task.cancelled()
    if not task.done():  # it did not stop: let the test end, and fail
        slip.slipping = False
        task.cancel()
        await asyncio.wait({task}, timeout=WAIT_S)
    return stopped


async def test_a_refresh_whose_cancellation_turns_into_a_redis_error_still_stops(
    redis_url: str, prefix: str, bus: Bus
) -> None:
    ledger = Ledger.from_url(redis_url, prefix)
    builder = SlippingBuilder(ledger, prefix)
    hub = hub_of(ledger, builder, bus)
    task = asyncio.create_task(hub.run())
    try:
        await asyncio.wait_for(builder.stuck.wait(), WAIT_S)
        assert hub.ready.is_set()
        assert await stops(task, builder)
    finally:
        await ledger.close()


async def test_a_change_watch_whose_cancellation_turns_into_an_error_still_stops(
    redis_url: str, prefix: str, bus: Bus
) -> None:
    ledger = SlippingLedger.from_url(redis_url, prefix)
    assert isinstance(ledger, SlippingLedger)
    hub = hub_of(ledger, SnapshotBuilder(ledger, TelemetryStore(ledger.redis, prefix), prefix), bus)
    task = asyncio.create_task(hub.run())
    try:
        await asyncio.wait_for(ledger.watching.wait(), WAIT_S)
        await asyncio.wait_for(hub.ready.wait(), WAIT_S)
        assert await stops(task, ledger)
    finally:
        await ledger.close()
