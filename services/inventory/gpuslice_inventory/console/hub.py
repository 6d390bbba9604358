"""One refresher per inventory process, shared by every viewer of the console.

Every ``tick`` (and at once when the ledger announces a change or the audit
feed brings an alloc.* event, changes closer together than ``MIN_REFRESH_S``
read in one refresh) the :class:`Hub` refreshes the snapshot; when its
content changed, every open stream is woken. A stream's slot holds no copy of
the snapshot: woken, it takes the newest bytes, so a slow viewer skips
snapshots and never grows memory. Bytes are serialised once per version and
namespace set (100 viewers of one scope cost one serialisation), and pod
documents once per version and change to the pod's story.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal

import orjson
from redis.exceptions import RedisError

from gpuslice_common.auditstream import EventFilter
from gpuslice_common.ledger import Ledger, LedgerError
from gpuslice_common.service import check_cancelled
from gpuslice_inventory.console.auditfeed import AuditFeed, FeedEvent
from gpuslice_inventory.console.auth import PORT_FORWARD, AccessDenied, Authenticator, Viewer
from gpuslice_inventory.console.pods import PodSummary, find_pod, pod_document, pod_list
from gpuslice_inventory.console.scope import scope_snapshot, snapshot_namespaces
from gpuslice_inventory.console.snapshot import SnapshotBuilder

log = logging.getLogger(__name__)
KEEPALIVE_S = 15.0
MAX_STREAMS = 1000  # open event streams per process; more are refused (503)
# open event streams of one user (behind TokenReview): one tenant cannot take
# every stream the console has from the others; a page holds one or two
STREAMS_PER_USER = 32
EVENTS_PER_STREAM = 1000  # audit events waiting for one slow viewer; older ones are dropped
SCOPED_CACHE = 256  # distinct namespace sets (and pods) kept serialised per version
RETRY_S = 2.0  # after a failed refresh or lost change notices, however long the tick
# changes closer together than this are read in one refresh: a busy cluster (ten
# changes a second) is refreshed and pushed at most four times a second, not once
# per change to every page
MIN_REFRESH_S = 0.25
MIN_RECHECK_S = 1.0  # an open stream asks again who its viewer is at most this often

View = Literal["cluster", "pod", "audit"]


@dataclass(frozen=True)
class AuditQuery:
    """An audit view's filters."""

    wanted: EventFilter = field(default_factory=EventFilter)
    since: datetime | None = None
    until: datetime | None = None

    def matches(self, fed: FeedEvent) -> bool:
        """Whether ``fed`` passes the filters (who may see it is checked apart)."""
        when = fed.time
        if self.since is not None and when < self.since:
            return False
        if self.until is not None and when > self.until:
            return False
        return fed.matches(self.wanted)


@dataclass(eq=False)
class Slot:
    """One open event stream: what it watches and a flag that something changed."""

    viewer: Viewer
    view: View
    namespace: str = ""
    name: str = ""
    audit: AuditQuery = field(default_factory=AuditQuery)
    # who the viewer is now (its token reviewed again once the answer kept for
    # it expires); None: no token to review (console_auth none)
    recheck: Callable[[], Awaitable[Viewer]] | None = None
    recheck_s: float = 60.0
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    events: deque[FeedEvent] = field(default_factory=lambda: deque(maxlen=EVENTS_PER_STREAM))


class TooManyStreams(Exception):
    pass


class Hub:
    """The shared snapshot, its refresher and the open streams."""

    def __init__(
        self,
        ledger: Ledger,
        builder: SnapshotBuilder,
        feed: AuditFeed,
        authenticator: Authenticator,
        tick: float,
        keepalive: float = KEEPALIVE_S,
        min_refresh: float = MIN_REFRESH_S,
    ) -> None:
        self.ledger = ledger
        self.authenticator = authenticator
        self.builder = builder
        self.feed = feed
        self.tick = tick
        self.min_refresh = min_refresh
        self.keepalive = keepalive
        self.streams_per_user = STREAMS_PER_USER
        self.slots: set[Slot] = set()
        self.closing = False  # set by close(): every open stream ends
        self.ready = asyncio.Event()  # set after the first refresh
        self.serialisations = 0  # scoped snapshots serialised (tests count them)
        self.pod_builds = 0  # pod documents worked out (tests count them)
        self._dirty: set[str] = set()
        self._wake = asyncio.Event()
        self._scoped: dict[frozenset[str] | None, bytes] = {}
        self._scoped_version = 0
        self._namespaces: tuple[int, set[str]] = (-1, set())
        self._pods: dict[tuple[str, str], tuple[tuple[int, object], bytes | None, float]] = {}
        self._pod_list: tuple[tuple[int, int], list[PodSummary]] = ((-1, -1), [])
        feed.followers.append(self.on_event)

    # ------------------------------------------------------------ refreshing

    def poke(self, node: str | None = None) -> None:
        """Refresh now (``node``: its cards and placements are read again)."""
        if node is not None:
            self._dirty.add(node)
        self._wake.set()

    def on_event(self, fed: FeedEvent) -> None:
        """A new audit event: allocation changes refresh at once; streams that
        show it are woken."""
        if fed.node is not None:
            self.poke(fed.node)
        pod = fed.pod
        for slot in self.slots:
            if slot.view == "audit" and slot.audit.matches(fed):
                slot.events.append(fed)
                slot.wake.set()
            elif (
                slot.view == "pod"
                and pod is not None
                and pod.namespace == slot.namespace
                and pod.name in ("", slot.name)  # its story's events only
            ):
                slot.wake.set()

    async def _listen(self) -> None:
        """Follow the ledger's change notices (none on Redis Cluster: the tick only)."""
        while True:
            try:
                async for node in self.ledger.watch_changes(on_subscribed=self._subscribed):
                    self.poke(node)
            except NotImplementedError:
                return
            except LedgerError as exc:
                check_cancelled()  # the Redis client may turn a cancellation into an error
                log.debug("console: %s", exc)
                await asyncio.sleep(min(self.tick, RETRY_S))
            except Exception:  # a fault of ours: the notices are followed again
                check_cancelled()
                log.exception("console: following the ledger's change notices failed")
                await asyncio.sleep(min(self.tick, RETRY_S))

    def _subscribed(self) -> None:
        """Change notices (again): what changed before them is read in full now."""
        self.builder.resync_soon()
        self.poke()

    async def run(self) -> None:
        """Refresh forever; a Redis outage is logged once and retried, never fatal.
        Cancelled, it ends, even when the Redis client turned the cancellation
        into an error on the way (the inventory's stop waits for it)."""
        listener = asyncio.create_task(self._listen(), name="console-changes")
        next_full = 0.0
        failing = False
        try:
            while True:
                self._wake.clear()
                dirty, self._dirty = self._dirty, set()
                full = time.monotonic() >= next_full
                try:
                    changed = await self.builder.refresh(full=full, dirty=dirty)
                    if full:
                        next_full = time.monotonic() + self.tick
                    if failing:
                        log.info("console: the ledger answers again")
                    failing = False
                    if changed:
                        for slot in self.slots:
                            slot.wake.set()
                    self.ready.set()
                except (LedgerError, RedisError, OSError) as exc:
                    self._dirty |= dirty
                    if not failing:
                        log.warning("console: cannot refresh the snapshot: %s", exc)
                    failing = True
                    self._stale("the ledger cannot be read")
                except Exception as exc:  # data no reader expects: stale, said so, retried
                    self._dirty |= dirty
                    if not failing:
                        log.error("console: cannot build the snapshot: %r", exc)
                    failing = True
                    self._stale("the snapshot cannot be built from what the ledger holds")
                check_cancelled()  # one the Redis client swallowed still ends the loop
                wait = max(0.0, next_full - time.monotonic())
                if failing:
                    wait = min(self.tick, RETRY_S)
                refreshed = time.monotonic()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), wait)
                    # woken by a change: the ones that follow it closely come along
                    await asyncio.sleep(max(0.0, refreshed + self.min_refresh - time.monotonic()))
        finally:
            listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await listener

    def _stale(self, why: str) -> None:
        """Tell viewers the snapshot they see is stale, and why."""
        if self.builder.failed(why):
            for slot in self.slots:
                slot.wake.set()

    # ------------------------------------------------------------ what viewers get

    def namespaces(self) -> set[str]:
        """The namespaces of the snapshot's pods (worked out once per version)."""
        version = self.builder.version
        if self._namespaces[0] != version:
            self._namespaces = (version, snapshot_namespaces(self.builder.document))
        return self._namespaces[1]

    async def visible(self, viewer: Viewer, namespaces: set[str]) -> set[str] | None:
        """Which of ``namespaces`` ``viewer`` may see (None: all); AccessDenied
        when the Kubernetes API cannot tell."""
        return await self.authenticator.visible(viewer, namespaces)

    async def cluster_for(self, viewer: Viewer) -> bytes:
        """The snapshot as ``viewer`` may see it; AccessDenied as :meth:`visible`."""
        if viewer.namespaces is None:
            return self.cluster_bytes(viewer, None)
        return self.cluster_bytes(viewer, await self.visible(viewer, self.namespaces()))

    def cluster_bytes(self, viewer: Viewer, visible: set[str] | None) -> bytes:
        """The snapshot scoped to ``visible`` namespaces, serialised once per
        version and namespace set."""
        version = self.builder.version
        if version != self._scoped_version or len(self._scoped) > SCOPED_CACHE:
            self._scoped = {}
            self._scoped_version = version
        key = None if viewer.namespaces is None or visible is None else frozenset(visible)
        body = self._scoped.get(key)
        if body is None:
            if key is None:
                body = self.builder.body
            else:
                body = orjson.dumps(scope_snapshot(self.builder.document, viewer, key))
                self.serialisations += 1
            self._scoped[key] = body
        return body

    def pod_bytes(self, namespace: str, name: str) -> bytes | None:
        """The pod document of ``namespace/name`` as it is now; None when nothing
        knows it. Callers check that the viewer may see the namespace first."""
        return self.pod_answer(namespace, name, throttle=False)[0]

    def pod_answer(
        self, namespace: str, name: str, throttle: bool = True
    ) -> tuple[bytes | None, float]:
        """The pod document of ``namespace/name``, and how long until a newer one
        may be worked out (0: this one is current). A document is worked out again
        only when its pod's story or the snapshot changed, and for streams
        (``throttle``) at most every ``min_refresh``: a pod re-created ten times a
        second gives its pages four documents a second, not one per viewer and
        change."""
        key = (namespace, name)
        stamp = (self.builder.version, self.feed.pod_stamp(namespace, name))
        now = time.monotonic()
        cached = self._pods.get(key)
        if cached is not None:
            then, body, built = cached
            if then == stamp:
                return body, 0.0
            if throttle and now - built < self.min_refresh:
                return body, built + self.min_refresh - now
        self.pod_builds += 1
        summary = find_pod(self.builder, self.feed, namespace, name)
        body = None if summary is None else orjson.dumps(pod_document(self.builder, summary))
        if len(self._pods) > SCOPED_CACHE:
            self._pods.clear()
        self._pods[key] = (stamp, body, now)
        return body, 0.0

    def pod_summaries(self) -> list[PodSummary]:
        """Every known pod, newest first, worked out once per version and feed position."""
        stamp = (self.builder.version, self.feed.received)
        if self._pod_list[0] != stamp:
            self._pod_list = (stamp, pod_list(self.builder, self.feed))
        return self._pod_list[1]

    # ------------------------------------------------------------ streams

    def check_room(self, viewer: Viewer | None = None) -> None:
        """Raise TooManyStreams when no more streams may open (for ``viewer``:
        each user but the port-forward operator has a share of its own)."""
        if len(self.slots) >= MAX_STREAMS:
            raise TooManyStreams(f"{MAX_STREAMS} event streams are open on this console")
        if viewer is None or viewer.user == PORT_FORWARD:
            return
        if sum(1 for s in self.slots if s.viewer.user == viewer.user) >= self.streams_per_user:
            raise TooManyStreams(
                f"{self.streams_per_user} event streams of {viewer.user[:100]} are open "
                f"on this console: close one"
            )

    def unsubscribe(self, slot: Slot) -> None:
        self.slots.discard(slot)

    def close(self) -> None:
        """End every open stream: the service is stopping. A viewer never hangs
        up, so without this its HTTP server waits for them until it gives up and
        cancels them (logging each as an error)."""
        self.closing = True
        for slot in self.slots:
            slot.wake.set()

    async def stream(self, slot: Slot) -> AsyncIterator[bytes]:
        """Server-sent events for ``slot`` until the viewer goes (then the slot is
        gone), until the Kubernetes API cannot tell what the viewer may see, or
        until :meth:`close`, or until the viewer is no longer who opened it:
        every ``recheck_s`` the token is reviewed again (from the cache while
        its answer is kept), and a token revoked, expired, or whose user lost or
        gained grants ends the stream (the page reconnects and is answered as it
        is now)."""
        self.slots.add(slot)
        every = max(slot.recheck_s, MIN_RECHECK_S)
        next_check = time.monotonic() + every
        try:
            sent: bytes | None = None
            first = True
            while not self.closing:
                later = 0.0
                if slot.recheck is not None and time.monotonic() >= next_check:
                    if not await self._still_allowed(slot):
                        yield b": your access changed: reconnect\n\n"
                        return
                    next_check = time.monotonic() + every
                if slot.view == "cluster":
                    body = await self.cluster_for(slot.viewer)
                    if body != sent:
                        sent = body
                        yield b"event: cluster\ndata: " + body + b"\n\n"
                elif slot.view == "pod":  # its namespace was checked when it opened
                    pod, later = self.pod_answer(slot.namespace, slot.name)
                    if pod is not None and pod != sent:
                        sent = pod
                        yield b"event: pod\ndata: " + pod + b"\n\n"
                else:
                    while slot.events:
                        fed = slot.events.popleft()
                        if await self._may_see(slot.viewer, fed):
                            yield b"event: audit\ndata: " + fed.line + b"\n\n"
                if first:
                    first = False
                    yield b": connected\n\n"
                wait = self.keepalive
                if slot.recheck is not None:
                    wait = min(wait, max(0.0, next_check - time.monotonic()))
                if later:  # a newer pod document is due: look again then
                    wait = min(wait, later)
                try:
                    await asyncio.wait_for(slot.wake.wait(), wait)
                    slot.wake.clear()
                except TimeoutError:
                    if not later:
                        yield b": keepalive\n\n"
        except AccessDenied as denied:
            yield b": " + denied.message.encode() + b"\n\n"
        finally:
            self.unsubscribe(slot)

    async def _still_allowed(self, slot: Slot) -> bool:
        """Whether the stream's viewer is still the one it was opened for (same
        identity, same cluster-wide or namespaced view) and, for a pod view,
        may still see the pod's namespace. AccessDenied as :meth:`visible`, and
        401 for a token the API no longer accepts."""
        assert slot.recheck is not None
        now = await slot.recheck()
        then = slot.viewer
        if (now.user, now.namespaces, now.groups, now.uid, now.extra) != (
            then.user,
            then.namespaces,
            then.groups,
            then.uid,
            then.extra,
        ):
            return False
        if slot.view == "pod":
            return await self.authenticator.may_see(now, slot.namespace)
        return True

    async def _may_see(self, viewer: Viewer, fed: FeedEvent) -> bool:
        if viewer.namespaces is None:
            return True
        namespaces = {fed.pod.namespace} if fed.pod is not None else set()
        return fed.visible_to(await self.visible(viewer, namespaces))
