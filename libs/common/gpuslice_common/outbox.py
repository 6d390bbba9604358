"""Events handed over without waiting, published to NATS in order by one background task.

A component that must answer quickly (the admission webhook) calls
:meth:`Outbox.submit`, which only puts the event in a bounded queue. The
outbox's task connects to NATS (retrying for as long as it takes), publishes
the events in submission order, and on a failed publish keeps the same event
and tries again: an event leaves the queue only once NATS has taken it. What
does not fit in the queue is dropped, counted and logged; what is still queued
when the outbox closes is counted and logged the same way.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from dataclasses import dataclass

from gpuslice_common.bus import Bus, BusError
from gpuslice_common.config import CommonSettings
from gpuslice_common.events import CloudEvent

log = logging.getLogger("gpuslice.outbox")

WARN_EVERY_S = 60.0  # at most one warning a minute for drops and for a bus still down


@dataclass
class OutboxStats:
    submitted: int = 0
    published: int = 0
    dropped: int = 0
    publish_errors: int = 0
    connect_attempts: int = 0


class Outbox:
    """A queue of events in front of a :class:`Bus` (given, or connected by the outbox)."""

    def __init__(
        self,
        settings: CommonSettings,
        name: str,
        *,
        capacity: int = 10_000,
        retry_interval: float = 1.0,
        bus: Bus | None = None,
    ) -> None:
        if capacity < 1 or retry_interval <= 0:
            raise ValueError("capacity and retry_interval must be positive")
        self.settings = settings
        self.name = name
        self.capacity = capacity
        self.retry_interval = retry_interval
        self.bus = bus
        self.stats = OutboxStats()
        self._owns_bus = bus is None
        self._queue: collections.deque[CloudEvent] = collections.deque()
        self._wakeup = asyncio.Event()
        self._drained = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._last_warning: dict[str, float] = {}

    @property
    def connected(self) -> bool:
        return self.bus is not None and self.bus.connected

    @property
    def pending(self) -> int:
        return len(self._queue)

    def submit(self, event: CloudEvent) -> bool:
        """Queue an event; never waits. False (and counted as dropped) when the queue is full."""
        self.stats.submitted += 1
        if len(self._queue) >= self.capacity:
            self.stats.dropped += 1
            self._warn("full", f"event queue full ({self.capacity}); dropped {event.type.value}")
            return False
        self._queue.append(event)
        self._drained.clear()
        self._wakeup.set()
        return True

    async def start(self) -> None:
        """Start the background task; returns at once."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"outbox-{self.name}")

    async def close(self, timeout: float = 2.0) -> None:
        """Publish what is queued for up to ``timeout`` seconds, then stop."""
        if self._task is not None:
            if self._queue and self.connected:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._drained.wait(), timeout)
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._queue:
            self.stats.dropped += len(self._queue)
            log.warning("closing with %d events unpublished; they are lost", len(self._queue))
            self._queue.clear()
        if self._owns_bus and self.bus is not None:
            await self.bus.close()
            self.bus = None

    # ------------------------------------------------------------ the task

    async def _run(self) -> None:
        bus = self.bus or await self._connect()
        while True:
            while not self._queue:
                self._wakeup.clear()
                await self._wakeup.wait()
            event = self._queue[0]
            try:
                await bus.publish(event)
            except BusError as exc:
                self.stats.publish_errors += 1
                self._warn("publish", f"cannot publish yet, will retry: {exc}")
                await asyncio.sleep(self.retry_interval)
                continue
            self._queue.popleft()
            self.stats.published += 1
            if not self._queue:
                self._drained.set()

    async def _connect(self) -> Bus:
        while True:
            self.stats.connect_attempts += 1
            try:
                self.bus = await Bus.connect(
                    self.settings, self.name, first_connect_wait=self.retry_interval
                )
            except BusError as exc:
                self._warn("connect", f"{exc}; events wait in the queue")
                await asyncio.sleep(self.retry_interval)
                continue
            log.info("connected to NATS; %d events waiting", len(self._queue))
            return self.bus

    def _warn(self, topic: str, message: str) -> None:
        now = time.monotonic()
        if now - self._last_warning.get(topic, -WARN_EVERY_S) >= WARN_EVERY_S:
            self._last_warning[topic] = now
            log.warning("%s", message)
