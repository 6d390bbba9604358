"""Live GPU usage from the interposers' telemetry, kept in Redis per node.

Every process with the interposer publishes a :class:`TelemetrySample` (JSON) on
``<subject prefix>.telemetry.<node token>.<pod uid>`` every interval (see
``native/src/telemetry.c``); its numbers are the container's, read from the
container's shared region, so all processes of one container report the same
thing. :class:`TelemetryStore` takes those messages at thousands per second and
keeps, per node, the latest numbers of every container on every GPU.

Ingesting
    :meth:`TelemetryStore.ingest` is synchronous and cheap (about 5 us a sample
    on a 2-vCPU VM): it checks the subject, parses the payload with orjson and
    checks every field by hand against the pydantic model: exact JSON types (no
    ``"5"`` for a number, no ``true`` for an integer), no unknown or missing
    fields (those with a default in the model may be left out: an interposer
    older than ``peak_bytes`` sends none), non-negative counters,
    ``0 <= sm_percent <= 100``, an ISO 8601 time; and more: a device's UUID
    must look like one, and none comes twice. That is
    a little faster than ``TelemetrySample.model_validate_json`` followed by the
    same subject checks (``bench/inventory_bench.py`` prints both) and builds no
    objects that would be thrown away. The sample's ``node`` and ``pod_uid`` must
    be the ones its subject names (:class:`~gpuslice_common.subjects.Subjects`;
    the node token maps back with ``node_from_token``), so a container
    credential, which may publish only under its own node, cannot write another
    node's usage. A sample that fails is counted (``stats.malformed``), logged at
    most once a minute and dropped; it never raises and never holds up the others.

    Accepted samples wait in memory, one per container: a later sample of the
    same container replaces the waiting one (only the latest matters). When
    ``max_pending`` containers already wait (Redis slow or down), a sample of a
    container not yet waiting is dropped and counted (``stats.dropped``); one that
    replaces a waiting sample is always taken.

Flushing
    :meth:`TelemetryStore.flush` writes everything waiting in one pipeline: per
    node one HSET with all its fields, then PEXPIRE of the node's key to ``ttl``.
    :meth:`TelemetryStore.run` flushes every ``flush_interval`` and once more when
    cancelled. A flush that fails puts its samples back (unless newer ones of the
    same container arrived meanwhile) and the next one retries.

Redis layout (``<p>`` is the store's Redis prefix)
    ``<p>:usage:<node>``: a hash per node, expiring ``ttl`` after its last flush,
    so a node that stops sending disappears.

    - field ``<uuid>|<pod_uid>|<container>`` (UUIDs and pod UIDs hold no ``|``;
      the container name is the rest);
    - value ``<used_bytes>,<limit_bytes>,<sm_percent>,<throttled_ns>,<denied_allocations>,``
      ``<at_ms>,<peak_bytes>`` (one line, no spaces),
      the container's latest numbers on that GPU, when the inventory stored
      them (epoch milliseconds), and the highest use its region has seen. The
      peak stored is never below ``used_bytes``: the region raises ``used`` a
      moment before its peak, and a sample without ``peak_bytes`` (an older
      interposer) gives ``used_bytes``. The readers also take values of six
      fields, written before the peak was kept, with the peak equal to
      ``used_bytes``; anything else is not an entry and is skipped.

    Redis 7.0 has no per-field expiry, so the readers (:meth:`container_usage`,
    :meth:`gpu_usage`) ignore entries older than ``ttl`` and delete them, each only
    if it still holds the value they read (a small Lua script), so a flush that
    refreshed it in between is kept.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import orjson
from redis.exceptions import RedisError
from redis.typing import EncodableT, FieldT

from gpuslice_common.ledger import RedisClient
from gpuslice_common.models import (
    MAX_CONTAINER_NAME,
    MAX_PID,
    MAX_TELEMETRY_DEVICES,
    Placement,
    PlacementState,
)
from gpuslice_common.service import check_cancelled
from gpuslice_common.subjects import Subjects, node_from_token

log = logging.getLogger(__name__)

# A device UUID as the node agent reports it (GpuDevice.uuid).
_UUID = re.compile(r"[A-Za-z0-9_.:/-]{1,128}")
# A Kubernetes container name (models.CONTAINER_NAME_PATTERN).
_CONTAINER = re.compile(rf"[a-z0-9](?:[-a-z0-9]{{0,{MAX_CONTAINER_NAME - 2}}}[a-z0-9])?")
MAX_POD_CONTAINERS = 64  # containers of one pod waiting at once; more are dropped
PLACEMENT_CACHE_S = 5.0  # how long a pod's placement is trusted without asking the ledger
_PLACEMENT_CACHE_SIZE = 65536  # pods remembered; forgotten all at once when full
_SAMPLE_REQUIRED = frozenset({"node", "pod_uid", "container", "pid", "time", "devices"})
_SAMPLE_ALL = _SAMPLE_REQUIRED | {"dropped_samples"}
_DEVICE_REQUIRED = frozenset({"uuid", "used_bytes", "limit_bytes"})
_DEVICE_ALL = _DEVICE_REQUIRED | {
    "peak_bytes",
    "sm_percent",
    "throttled_ns",
    "denied_allocations",
}
_DEVICE_NO_PEAK = _DEVICE_ALL - {"peak_bytes"}  # all an interposer without peaks sends
_ROUTE_CACHE = 65536  # subjects remembered as valid; forgotten all at once when full
_LOG_EVERY = 60.0  # seconds between two log lines about malformed or dropped samples

# Deletes each field that still holds the value the reader saw.
_FORGET_LUA = """
local n = 0
for i = 1, #ARGV, 2 do
  if redis.call('HGET', KEYS[1], ARGV[i]) == ARGV[i + 1] then
    n = n + redis.call('HDEL', KEYS[1], ARGV[i])
  end
end
return n
"""

# (node, pod_uid, container) -> ((uuid, "used,limit,sm,throttled,denied", ",peak"), ...):
# a flush writes the first part, the time, then the peak.
_Key = tuple[str, str, str]
_Devices = tuple[tuple[str, str, str], ...]
# What the ledger places: a pod's node and, per container, the cards granted to it.
_Placed = tuple[str, dict[str, frozenset[str]]]
PlacementLookup = Callable[[str], Awaitable[Placement | None]]


@dataclass(frozen=True)
class ContainerUsage:
    """The latest sample of one container on one GPU."""

    node: str
    uuid: str
    pod_uid: str
    container: str
    used_bytes: int
    limit_bytes: int
    sm_percent: float
    throttled_ns: int
    denied_allocations: int
    at_ms: int  # when the inventory stored it (epoch ms)
    peak_bytes: int  # the most the container's region has held, never below used_bytes


@dataclass(frozen=True)
class GpuUsage:
    """One GPU: what its containers use now (sums over fresh entries)."""

    uuid: str
    used_bytes: int
    sm_percent: float
    containers: int


@dataclass
class TelemetryStats:
    received: int = 0  # messages given to ingest
    stored: int = 0  # samples written to Redis (after coalescing)
    malformed: int = 0
    dropped: int = 0  # well-formed samples not stored, all reasons (dropped_by)
    # by reason: "full" (max_pending), "flush-failed", "containers" (a pod's
    # max_containers already waiting), and, checked against the ledger's
    # placement: "not-placed" (no live placement of the pod on that node),
    # "foreign-container", "foreign-device" (not a card granted to that container)
    dropped_by: Counter[str] = field(default_factory=Counter)
    flushes: int = 0  # pipelines that succeeded
    flush_errors: int = 0  # pipelines that failed
    flush_seconds: float = 0.0  # time spent in successful flushes


class _Malformed(Exception):
    pass


class TelemetryStore:
    """Ingests telemetry messages and keeps the latest usage per node in Redis."""

    def __init__(
        self,
        redis: RedisClient,
        prefix: str,
        *,
        ttl: float = 30.0,
        flush_interval: float = 0.1,
        max_pending: int = 100_000,
        clock: Callable[[], float] = time.time,
        subjects: Subjects | None = None,
        placements: PlacementLookup | None = None,
        placement_cache: float = PLACEMENT_CACHE_S,
        max_containers: int = MAX_POD_CONTAINERS,
    ) -> None:
        """``prefix`` names the Redis keys and, unless ``subjects`` is given, the
        subjects too; ``clock`` gives epoch seconds (store times and freshness).
        With ``placements`` (pod UID -> the ledger's placement), a flush stores only
        samples of a live placement's containers on their granted cards; each
        answer is kept ``placement_cache`` seconds."""
        if ttl <= 0 or flush_interval <= 0 or max_pending < 1 or max_containers < 1:
            raise ValueError("ttl, flush_interval, max_pending and max_containers must be positive")
        self.redis = redis
        self.prefix = prefix
        self.ttl = ttl
        self.ttl_ms = max(1, round(ttl * 1000))
        self.flush_interval = flush_interval
        self.max_pending = max_pending
        self.clock = clock
        self.subjects = subjects or Subjects(prefix)
        self.stats = TelemetryStats()
        self._head = self.subjects.telemetry_all.removesuffix("*.*")
        self._routes: dict[str, tuple[str, str]] = {}  # valid subject -> (node, pod_uid)
        self._pending: dict[_Key, _Devices] = {}
        self._waiting: dict[tuple[str, str], int] = {}  # (node, pod_uid) -> containers pending
        self.max_containers = max_containers
        self.placements = placements
        self.placement_cache = placement_cache
        self._placed: dict[str, tuple[float, _Placed | None]] = {}  # pod -> (until, placed)
        self._lock = asyncio.Lock()
        self._forget = redis.register_script(_FORGET_LUA)
        self._logged: dict[str, tuple[float, int]] = {}  # what -> (last logged, unlogged since)

    def usage_key(self, node: str) -> str:
        return f"{self.prefix}:usage:{node}"

    @property
    def pending(self) -> int:
        """Samples (one per container) waiting for the next flush."""
        return len(self._pending)

    # ------------------------------------------------------------ ingesting

    def ingest(self, subject: str, data: bytes) -> bool:
        """Take one raw NATS message; never awaits and never raises.

        False, counted as malformed, for a payload that is not a valid
        TelemetrySample or whose node or pod_uid is not the subject's; False,
        counted as dropped, when ``max_pending`` other containers already wait.
        """
        self.stats.received += 1
        try:
            key, devices = self._parse(subject, data)
        except _Malformed as err:
            self._count_malformed(subject, str(err))
            return False
        except Exception as err:  # never let one message break the subscription
            self._count_malformed(subject, f"{type(err).__name__}: {err}")
            return False
        pending = self._pending
        if key not in pending:
            if len(pending) >= self.max_pending:
                self._count_dropped("full")
                return False
            pod = key[:2]
            waiting = self._waiting.get(pod, 0)
            if waiting >= self.max_containers:
                self._count_dropped("containers")
                return False
            self._waiting[pod] = waiting + 1
        pending[key] = devices
        return True

    def _route(self, subject: str) -> tuple[str, str]:
        """The (node, pod_uid) a telemetry subject names."""
        route = self._routes.get(subject)
        if route is not None:
            return route
        if not subject.startswith(self._head):
            raise _Malformed("not a telemetry subject")
        token, _, uid = subject[len(self._head) :].partition(".")
        node = node_from_token(token)
        try:
            if self.subjects.telemetry(node, uid) != subject:
                raise _Malformed("not a telemetry subject")
        except ValueError as err:
            raise _Malformed(str(err)) from None
        if len(self._routes) >= _ROUTE_CACHE:
            self._routes.clear()
        route = self._routes[subject] = (node, uid)
        return route

    def _parse(self, subject: str, data: bytes) -> tuple[_Key, _Devices]:
        node, pod_uid = self._route(subject)
        try:
            doc = orjson.loads(data)
        except orjson.JSONDecodeError:
            raise _Malformed("not JSON") from None
        if type(doc) is not dict:
            raise _Malformed("not a JSON object")
        keys = doc.keys()
        if keys != _SAMPLE_ALL and keys != _SAMPLE_REQUIRED:
            missing = _SAMPLE_REQUIRED - keys
            raise _Malformed(
                f"missing {sorted(missing)}" if missing else f"unknown {sorted(keys - _SAMPLE_ALL)}"
            )
        if doc["node"] != node or doc["pod_uid"] != pod_uid:
            raise _Malformed(
                f"sample of node {doc['node']!r} pod {doc['pod_uid']!r} on another's subject"
            )
        container = doc["container"]
        if type(container) is not str or _CONTAINER.fullmatch(container) is None:
            raise _Malformed("bad container")
        pid = doc["pid"]
        if type(pid) is not int or not 0 <= pid <= MAX_PID:
            raise _Malformed("bad pid")
        when = doc["time"]
        if type(when) is not str:
            raise _Malformed("bad time")
        try:
            datetime.fromisoformat(when)
        except ValueError:
            raise _Malformed("bad time") from None
        lost = doc.get("dropped_samples", 0)
        if type(lost) is not int or lost < 0:
            raise _Malformed("bad dropped_samples")
        devices = doc["devices"]
        if type(devices) is not list:
            raise _Malformed("devices is not a list")
        if len(devices) > MAX_TELEMETRY_DEVICES:
            raise _Malformed(f"{len(devices)} devices")
        if len(devices) == 1:
            return (node, pod_uid, container), (_device(devices[0]),)
        out = tuple([_device(d) for d in devices])
        if len({d[0] for d in out}) != len(out):
            raise _Malformed("a device twice")
        return (node, pod_uid, container), out

    def _count_malformed(self, subject: str, why: str) -> None:
        self.stats.malformed += 1
        quiet = self._quiet("malformed")
        if quiet is not None:
            log.warning("malformed telemetry on %.200s: %.200s%s", subject, why, quiet)

    def _count_dropped(self, reason: str, n: int = 1) -> None:
        self.stats.dropped += n
        self.stats.dropped_by[reason] += n
        quiet = self._quiet(f"dropped {reason}")
        if quiet is not None:
            why = _DROPPED.get(reason, reason)
            log.warning("telemetry dropped: %s%s", why, quiet)

    def _quiet(self, what: str) -> str | None:
        """None while a line about ``what`` was logged in the last minute, else what
        to append to the next line (how many went unlogged)."""
        now = time.monotonic()
        last, unlogged = self._logged.get(what, (-_LOG_EVERY, 0))
        if now - last < _LOG_EVERY:
            self._logged[what] = (last, unlogged + 1)
            return None
        self._logged[what] = (now, 0)
        return f" ({unlogged} more since the last report)" if unlogged else ""

    # ------------------------------------------------------------ flushing

    async def flush(self) -> int:
        """Write everything pending in one pipeline; returns the samples written.

        Raises what Redis (or the ledger) raised; the samples then wait for the
        next flush.
        """
        async with self._lock:
            batch = self._pending
            if not batch:
                return 0
            self._pending = {}
            self._waiting = {}
            started = time.perf_counter()
            try:
                admitted = await self._admit(batch)
                at = f",{int(self.clock() * 1000)}"
                by_node: dict[str, dict[FieldT, EncodableT]] = {}
                for (node, pod_uid, container), devices in admitted.items():
                    fields = by_node.get(node)
                    if fields is None:
                        fields = by_node[node] = {}
                    tail = f"|{pod_uid}|{container}"
                    for uuid, numbers, peak in devices:
                        fields[uuid + tail] = numbers + at + peak
                pipe = self.redis.pipeline(transaction=False)
                for node, fields in by_node.items():
                    key = self.usage_key(node)
                    if fields:
                        pipe.hset(key, mapping=fields)
                    pipe.pexpire(key, self.ttl_ms)
                await pipe.execute()
            except BaseException:
                self._restore(batch)
                raise
            self.stats.flushes += 1
            self.stats.stored += len(admitted)
            self.stats.flush_seconds += time.perf_counter() - started
            return len(admitted)

    def _restore(self, batch: dict[_Key, _Devices]) -> None:
        """Put a failed flush's samples back, behind any newer ones."""
        pending = self._pending
        for key, devices in batch.items():
            if key in pending:
                continue
            if len(pending) >= self.max_pending:
                self._count_dropped("flush-failed")
                continue
            pending[key] = devices
            pod = key[:2]
            self._waiting[pod] = self._waiting.get(pod, 0) + 1

    async def _admit(self, batch: dict[_Key, _Devices]) -> dict[_Key, _Devices]:
        """The samples of ``batch`` that belong to their pod's placement (all of
        them without ``placements``); the others are dropped and counted."""
        if self.placements is None:
            return batch
        now = time.monotonic()
        cached = self._placed
        unknown = {pod_uid for _, pod_uid, _ in batch}
        unknown = {p for p in unknown if p not in cached or cached[p][0] <= now}
        if unknown:
            asked = list(unknown)
            found = await asyncio.gather(*(self.placements(p) for p in asked))
            if len(cached) + len(asked) > _PLACEMENT_CACHE_SIZE:
                cached.clear()
            until = time.monotonic() + self.placement_cache
            for pod_uid, placement in zip(asked, found, strict=True):
                cached[pod_uid] = (until, _placed(placement))
        admitted: dict[_Key, _Devices] = {}
        for key, devices in batch.items():
            node, pod_uid, container = key
            placed = cached[pod_uid][1]
            if placed is None or placed[0] != node:
                self._count_dropped("not-placed")
                continue
            granted = placed[1].get(container)
            if granted is None:
                self._count_dropped("foreign-container")
                continue
            if any(d[0] not in granted for d in devices):
                self._count_dropped("foreign-device")
                continue
            admitted[key] = devices
        return admitted

    async def run(self) -> None:
        """Flush every ``flush_interval`` until cancelled, then once more."""
        try:
            while True:
                await asyncio.sleep(self.flush_interval)
                await self._flush_logged()
                check_cancelled()
        finally:
            await self._flush_logged()

    async def _flush_logged(self) -> None:
        try:
            await self.flush()
        except Exception as err:
            self.stats.flush_errors += 1
            quiet = self._quiet("flush")
            if quiet is None:
                pass
            elif isinstance(err, RedisError):
                log.warning(
                    "cannot write telemetry to Redis (%s); %d samples wait%s",
                    err,
                    self.pending,
                    quiet,
                )
            else:
                log.exception("telemetry flush failed; %d samples wait%s", self.pending, quiet)

    # ------------------------------------------------------------ reading

    async def container_usage(self, node: str, prune: bool = True) -> list[ContainerUsage]:
        """The latest usage of every container on the node's GPUs, fresh entries only.

        Entries older than ``ttl`` are left out and, with ``prune``, deleted
        (readers without write access pass False).
        """
        key = self.usage_key(node)
        raw: dict[Any, Any] = await self.redis.hgetall(key)
        now_ms = int(self.clock() * 1000)
        fresh: list[ContainerUsage] = []
        stale: list[str] = []
        for f, v in raw.items():
            field, value = _text(f), _text(v)
            entry = _decode(node, field, value)
            if entry is None:
                continue
            if now_ms - entry.at_ms > self.ttl_ms:
                stale += (field, value)
            else:
                fresh.append(entry)
        if stale and prune:
            await self._forget(keys=[key], args=stale)
        fresh.sort(key=lambda u: (u.uuid, u.pod_uid, u.container))
        return fresh

    async def forget_pod(self, node: str, pod_uid: str) -> int:
        """Drop what a released pod's containers reported, stored or waiting, so
        the GPUs it left stop showing its use; the entries deleted."""
        for key in [k for k in self._pending if k[0] == node and k[1] == pod_uid]:
            del self._pending[key]
        self._waiting.pop((node, pod_uid), None)
        if self.placements is not None:  # released: its late samples are not stored
            self._placed[pod_uid] = (time.monotonic() + self.placement_cache, None)
        usage = self.usage_key(node)
        fields = [_text(f) async for f, _ in self.redis.hscan_iter(usage, match=f"*|{pod_uid}|*")]
        if not fields:
            return 0
        return int(await self.redis.hdel(usage, *fields))

    async def gpu_usage(self, node: str, prune: bool = True) -> dict[str, GpuUsage]:
        """Per GPU UUID of the node, the sums over its containers' fresh entries."""
        sums: dict[str, tuple[int, float, int]] = {}
        for u in await self.container_usage(node, prune):
            used, sm, count = sums.get(u.uuid, (0, 0.0, 0))
            sums[u.uuid] = (used + u.used_bytes, sm + u.sm_percent, count + 1)
        return {
            uuid: GpuUsage(uuid=uuid, used_bytes=used, sm_percent=sm, containers=count)
            for uuid, (used, sm, count) in sums.items()
        }


_DROPPED = {
    "full": "too many samples wait to be written",
    "flush-failed": "too many samples wait after a failed flush",
    "containers": "a pod sent more containers than it may have waiting",
    "not-placed": "a sample of a pod the ledger does not place on that node (or released)",
    "foreign-container": "a sample of a container not in its pod's placement",
    "foreign-device": "a sample naming a card not granted to its container",
}


def _placed(placement: Placement | None) -> _Placed | None:
    """What a live placement allows to report; None for none or a released one."""
    if placement is None or placement.state == PlacementState.RELEASED:
        return None
    return placement.node, {
        c.name: frozenset(d.uuid for d in c.devices) for c in placement.containers
    }


def _device(d: Any) -> tuple[str, str, str]:
    """One device of a sample: (uuid, the stored numbers before the time, the
    stored peak after it), or _Malformed."""
    if type(d) is not dict:
        raise _Malformed("a device is not an object")
    keys = d.keys()
    if keys == _DEVICE_ALL:  # what the interposer sends
        uuid, used, peak, limit = d["uuid"], d["used_bytes"], d["peak_bytes"], d["limit_bytes"]
        sm, throttled, denied = d["sm_percent"], d["throttled_ns"], d["denied_allocations"]
    elif keys == _DEVICE_NO_PEAK:  # what an interposer without peaks sends
        uuid, used, limit = d["uuid"], d["used_bytes"], d["limit_bytes"]
        sm, throttled, denied = d["sm_percent"], d["throttled_ns"], d["denied_allocations"]
        peak = 0
    elif keys >= _DEVICE_REQUIRED and keys <= _DEVICE_ALL:
        uuid, used, limit = d["uuid"], d["used_bytes"], d["limit_bytes"]
        peak = d.get("peak_bytes", 0)
        sm = d.get("sm_percent", 0.0)
        throttled = d.get("throttled_ns", 0)
        denied = d.get("denied_allocations", 0)
    else:
        raise _Malformed(f"device fields {sorted(keys)}")
    if type(uuid) is not str or _UUID.fullmatch(uuid) is None:
        raise _Malformed("bad device uuid")
    if (
        type(used) is not int
        or type(peak) is not int
        or type(limit) is not int
        or type(throttled) is not int
        or type(denied) is not int
        or used | peak | limit | throttled | denied < 0  # a negative int has its sign bit set
    ):
        raise _Malformed("bad device counter")
    kind = type(sm)
    if (kind is not float and kind is not int) or not 0 <= sm <= 100:
        raise _Malformed("bad sm_percent")
    # a peak that lags used (see the module's docstring) is stored as used
    return uuid, f"{used},{limit},{sm},{throttled},{denied}", f",{peak if peak > used else used}"


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _decode(node: str, field: str, value: str) -> ContainerUsage | None:
    """A stored entry, or None when it is not one this module wrote."""
    parts = field.split("|", 2)
    numbers = value.split(",")
    if len(parts) != 3 or not 6 <= len(numbers) <= 7:
        return None
    try:
        used = int(numbers[0])
        return ContainerUsage(
            node=node,
            uuid=parts[0],
            pod_uid=parts[1],
            container=parts[2],
            used_bytes=used,
            limit_bytes=int(numbers[1]),
            sm_percent=float(numbers[2]),
            throttled_ns=int(numbers[3]),
            denied_allocations=int(numbers[4]),
            at_ms=int(numbers[5]),
            # six fields: stored before peaks were kept
            peak_bytes=int(numbers[6]) if len(numbers) == 7 else used,
        )
    except ValueError:
        return None
