"""Events handed over without waiting, published to NATS in order by one background task.

A component that must answer quickly (the admission webhook) calls
:meth:`Outbox.submit`, which only appends the event to a bounded in-memory queue:
it never waits and never fails because of NATS. The outbox's task connects
(retrying for as long as it takes), then publishes the events in submission
order, one at a time. A publish that fails while NATS is away keeps the event at
the head of the queue and is retried: nothing is lost or reordered by a failed
publish, and nothing is published twice.

Events are dropped (counted in :attr:`Outbox.stats` and logged) when the queue is
full (submit returns False), when NATS refuses the event itself while connected
(invalid, too large), or when they are still queued after :meth:`Outbox.close`
has waited its timeout. An event leaves the queue once the NATS client has taken
it; from then on delivery is core NATS's: kept across a reconnect, lost if the
server dies with it in flight or if the outbox closes while NATS is down.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from dataclasses import dataclass

from gpuslice_common.bus import Bus, BusError
from gpuslice_common.config import BusSettings
from gpuslice_common.events import CloudEvent

log = logging.getLogger("gpuslice.outbox")

WARN_EVERY_S = 60.0  # at most one warning a minute per kind of trouble


@dataclass
class OutboxStats:
    submitted: int = 0  # submit() calls
    published: int = 0  # events the NATS client took
    dropped: int = 0  # events given up: queue full, refused by NATS, left at close
    publish_errors: int = 0  # failed publish attempts (most are retried)
    connect_attempts: int = 0


class Outbox:
    """Events handed over without waiting, published in order by one background task.

    With ``bus=None`` the outbox connects (and at close, closes) its own
    :class:`Bus`; a given bus is used as it is and left open.
    """

    def __init__(
        self,
        settings: BusSettings,
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
        self._wakeup = asyncio.Event()  # set by submit: the queue may have events
        self._drained = asyncio.Event()  # set by the task: the queue is empty
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._last_warning: dict[str, float] = {}

    @property
    def connected(self) -> bool:
        return self.bus is not None and self.bus.connected

    @property
    def pending(self) -> int:
        return len(self._queue)

    def submit(self, event: CloudEvent) -> bool:
        """Queue an event; never blocks, never raises for NATS trouble.

        False (and counted as dropped, logged at most once a minute) when the
        queue is full or the outbox is closed.
        """
        self.stats.submitted += 1
        if len(self._queue) >= self.capacity or self._closed:
            self.stats.dropped += 1
            why = "closed" if self._closed else f"full ({self.capacity} events)"
            self._warn("full", f"event queue {why}: dropped {event.type.value} {event.id}")
            return False
        self._queue.append(event)
        self._drained.clear()
        self._wakeup.set()
        return True

    async def start(self) -> None:
        """Start the background task; returns at once."""
        if self._task is None and not self._closed:
            self._task = asyncio.create_task(self._run(), name=f"outbox-{self.name}")
            self._task.add_done_callback(self._task_done)

    async def close(self, timeout: float = 2.0) -> None:
        """Publish what is queued for up to ``timeout`` seconds, then stop.

        Closes the bus only if the outbox opened it. Events still queued are
        counted as dropped and logged.
        """
        self._closed = True
        task, self._task = self._task, None
        if task is not None:
            try:
                if self._queue and not task.done():
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._drained.wait(), timeout)
            finally:
                task.cancel()
                await asyncio.wait([task])
        if self._queue:
            self.stats.dropped += len(self._queue)
            log.warning("closing with %d events unpublished; they are lost", len(self._queue))
            self._queue.clear()
        if self._owns_bus and self.bus is not None:
            bus, self.bus = self.bus, None
            await bus.close()

    # ------------------------------------------------------------ the task

    async def _run(self) -> None:
        bus = self.bus or await self._connect()
        while True:
            if not self._queue:
                self._drained.set()
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            if not bus.connected:
                # The client would take it into its reconnect buffer: the event
                # would count as published while NATS is away, and be lost if the
                # process stopped before the reconnect. It waits here instead.
                self._warn("publish", "NATS is away; events wait in the queue")
                await asyncio.sleep(self.retry_interval)
                continue
            event = self._queue[0]
            try:
                await bus.publish(event)
            except BusError as exc:
                self.stats.publish_errors += 1
                if bus.connected:
                    # NATS is there and the client refuses this very event (an
                    # invalid payload, too large): retrying cannot help.
                    self._queue.popleft()
                    self.stats.dropped += 1
                    log.error("dropped an event NATS cannot take: %s", exc)
                    continue
                self._warn("publish", f"cannot publish yet, will retry: {exc}")
                await asyncio.sleep(self.retry_interval)
                continue
            self._queue.popleft()
            self.stats.published += 1

    async def _connect(self) -> Bus:
        while True:
            self.stats.connect_attempts += 1
            try:
                bus = await Bus.connect(
                    self.settings, self.name, first_connect_wait=self.retry_interval
                )
            except BusError as exc:
                self._warn("connect", f"{exc}; events wait in the queue, retrying")
                await asyncio.sleep(self.retry_interval)
                continue
            log.info("connected to NATS; %d events waiting", len(self._queue))
            self.bus = bus
            return bus

    def _task_done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("the outbox task failed; events are no longer published", exc_info=exc)

    def _warn(self, topic: str, message: str) -> None:
        now = time.monotonic()
        if now - self._last_warning.get(topic, -WARN_EVERY_S) >= WARN_EVERY_S:
            self._last_warning[topic] = now
            log.warning("%s", message)
