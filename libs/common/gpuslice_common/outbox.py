"""Events handed over without waiting, kept until the audit stream has stored them.

A component that must answer quickly (the admission webhook, the extender, the
inventory) calls :meth:`Outbox.submit`, which only appends the event to a bounded
in-memory queue: it never waits and never fails because of NATS. The outbox's
task connects (retrying for as long as it takes), then publishes the events in
submission order, up to ``window`` at a time, each waiting for JetStream's
acknowledgement that the audit stream stored it (replicated, on a cluster).

An event leaves the queue only when acknowledged. One whose acknowledgement
does not come (a NATS member died with it, the stream is electing a leader,
NATS is away) stays in the queue and is sent again, with the same
``Nats-Msg-Id`` (its event id): the stream stores it once even when the first
copy was stored and only the acknowledgement was lost, provided the retry comes
within the stream's duplicate window (``bus.DEDUP_WINDOW``). Events are stored in
submission order, except that an event sent again is stored after those that
went through meanwhile.

Events are dropped (counted in :attr:`Outbox.stats` and logged) when the queue is
full (submit returns False), when the event itself cannot be published (an
invalid payload, larger than NATS takes), when the stream stored other events
of its batches but never it, ``STRIKES`` times in a row (NATS refuses this very
event, e.g. a permission it lacks: kept, it would be sent for ever and hold up
the rest), or when they are still queued after :meth:`Outbox.close` has waited
its timeout. While no event at all is stored (NATS or the stream away), none
is dropped: they wait.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import time
from dataclasses import dataclass

from gpuslice_common.bus import Bus, BusError, EventRefused
from gpuslice_common.config import BusSettings
from gpuslice_common.events import CloudEvent

log = logging.getLogger("gpuslice.outbox")

WARN_EVERY_S = 60.0  # at most one warning a minute per kind of trouble
STRIKES = 3  # batches in a row in which others were stored but not this event


@dataclass
class OutboxStats:
    submitted: int = 0  # submit() calls
    published: int = 0  # events the audit stream acknowledged
    dropped: int = 0  # events given up: queue full, unpublishable, left at close
    publish_errors: int = 0  # failed publish attempts (most are retried)
    retried: int = 0  # events sent again after an attempt got no acknowledgement
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
        window: int = 64,
        ack_timeout: float = 2.0,
    ) -> None:
        if capacity < 1 or retry_interval <= 0 or window < 1 or ack_timeout <= 0:
            raise ValueError("capacity, retry_interval, window and ack_timeout must be positive")
        self.settings = settings
        self.name = name
        self.capacity = capacity
        self.retry_interval = retry_interval
        self.window = window
        self.ack_timeout = ack_timeout
        self.bus = bus
        self.stats = OutboxStats()
        self._owns_bus = bus is None
        self._queue: collections.deque[CloudEvent] = collections.deque()
        self._wakeup = asyncio.Event()  # set by submit: the queue may have events
        self._drained = asyncio.Event()  # set by the task: the queue is empty
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._last_warning: dict[str, float] = {}
        self._strikes: dict[str, int] = {}  # event id -> batches it alone failed in

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
                # nats-py can swallow a cancellation that lands inside its
                # connect: cancel again until the task has really ended
                task.cancel()
                while not task.done():
                    await asyncio.wait([task], timeout=0.2)
                    task.cancel()
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
                # The client would take them into its reconnect buffer, where an
                # acknowledgement can only time out: they wait here instead.
                self._warn("publish", "NATS is away; events wait in the queue")
                await asyncio.sleep(self.retry_interval)
                continue
            batch = list(itertools.islice(self._queue, self.window))
            results = await asyncio.gather(
                *(self._send(bus, event) for event in batch), return_exceptions=False
            )
            done = {event.id for event, gone in zip(batch, results, strict=True) if gone}
            kept = [event for event in batch if event.id not in done]
            if kept and done:
                kept = [event for event in kept if not self._struck(event)]
            for event in batch:
                self._queue.popleft()
                if event.id in done:
                    self._strikes.pop(event.id, None)
            self._queue.extendleft(reversed(kept))  # the unacknowledged keep their turn
            if kept:
                self.stats.retried += len(kept)
                await asyncio.sleep(self.retry_interval)

    def _struck(self, event: CloudEvent) -> bool:
        """One more batch in which the stream stored others but not ``event``;
        True (dropped, logged) at the STRIKES-th in a row."""
        strikes = self._strikes.get(event.id, 0) + 1
        if strikes < STRIKES:
            self._strikes[event.id] = strikes
            return False
        self._strikes.pop(event.id, None)
        self.stats.dropped += 1
        log.error(
            "dropped %s %s: the audit stream stored the events around it but not it,"
            " %d times (does the publisher's NATS user lack permission for it?)",
            event.type.value,
            event.id,
            STRIKES,
        )
        return True

    async def _send(self, bus: Bus, event: CloudEvent) -> bool:
        """Publish one event and wait for the stream's acknowledgement; True when it
        leaves the queue (stored, or dropped because it can never be)."""
        try:
            await bus.publish_acked(event, timeout=self.ack_timeout)
        except EventRefused as exc:
            self.stats.publish_errors += 1
            self.stats.dropped += 1
            log.error("dropped an event NATS cannot take: %s", exc)
            return True
        except BusError as exc:
            self.stats.publish_errors += 1
            self._warn("publish", f"not stored yet, will send again: {exc}")
            return False
        self.stats.published += 1
        return True

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
