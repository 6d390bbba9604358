"""The console's last hour: how each card's and pod's memory and compute, and
the cluster's allocation and fragmentation, moved.

Kept in the inventory process from what it already reads for the snapshot
(the ledger's cards and placements, the telemetry store, the scheduler's
report): nothing more is asked of Redis. Bounded in memory whatever the
cluster does:

* a series is a fixed ring of ``POINTS`` points, one per ``step`` seconds
  (its resolution: 120 points of 30 s make the hour); samples within one step
  fold into one point (the last wins), and a step with no sample is a gap;
* at most ``MAX_SERIES`` series (cards and pods together; the cluster's is
  kept apart): a new series beyond them evicts the one updated least
  recently, and a series with no sample for an hour is dropped.

Each point is ``len(fields)`` 4-byte floats (NaN: not known), so the store
holds at most ``MAX_SERIES * POINTS * 5 * 4`` bytes of points (about 9.4 MiB
for 4,096 series), plus a few hundred bytes of bookkeeping per series.
"""

from __future__ import annotations

import math
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from gpuslice_inventory.telemetry import ContainerUsage

MIB = 1024 * 1024
STEP_S = 30.0
POINTS = 120  # an hour at STEP_S
MAX_SERIES = 4096

# what a card's and a pod's points hold, in this order
USAGE_FIELDS = ("allocated_mib", "measured_mib", "limit_mib", "sm_percent", "cores")
# what the cluster's points hold
CLUSTER_FIELDS = ("memory_mib", "used_memory_mib", "cores", "used_cores", "fragmentation")

Key = tuple[str, ...]  # ("card", node, uuid), ("pod", namespace, name), ("cluster",)


class Series:
    """One ring of points, ``step`` seconds apart, ``points`` long."""

    def __init__(self, fields: int, step: float = STEP_S, points: int = POINTS) -> None:
        self.fields = fields
        self.step = step
        self.points = points
        self.values = array("f", [math.nan]) * (fields * points)
        self.last = -1  # the step number of the newest point; -1: none yet

    def record(self, at: float, values: Sequence[float | None]) -> None:
        """Set the point of the step holding ``at`` (seconds since the epoch).
        Steps skipped since the newest become gaps; a sample older than the
        newest point (the clock went back) is dropped."""
        bucket = int(at // self.step)
        if bucket < self.last:
            return
        if bucket > self.last:
            first = max(self.last + 1, bucket - self.points + 1)
            for gap in range(first, bucket):
                self._set(gap, [None] * self.fields)
            self.last = bucket
        self._set(bucket, values)

    def _set(self, bucket: int, values: Sequence[float | None]) -> None:
        base = (bucket % self.points) * self.fields
        for i in range(self.fields):
            value = values[i] if i < len(values) else None
            self.values[base + i] = math.nan if value is None else value

    def read(self, now: float) -> list[list[float | None]]:
        """The points of the hour before ``now``, oldest first, each
        ``[time in ms, value, ...]`` (None for what was not known); steps
        with nothing known are left out."""
        newest = int(now // self.step)
        found: list[list[float | None]] = []
        for bucket in range(max(self.last - self.points + 1, newest - self.points + 1, 0),
                            min(self.last, newest) + 1):  # fmt: skip
            base = (bucket % self.points) * self.fields
            values = [_plain(self.values[base + i]) for i in range(self.fields)]
            if any(v is not None for v in values):
                found.append([bucket * self.step * 1000, *values])
        return found

    def newest_at(self) -> float:
        """When the newest point's step began (seconds since the epoch)."""
        return self.last * self.step


def _plain(value: float) -> float | None:
    """A stored float as JSON shows it: None for NaN, rounded to a tenth."""
    return None if math.isnan(value) else round(value, 1)


class HistoryStore:
    """Every card's and pod's series and the cluster's, bounded (module docstring)."""

    def __init__(
        self,
        *,
        step: float = STEP_S,
        points: int = POINTS,
        max_series: int = MAX_SERIES,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.step = step
        self.points = points
        self.max_series = max_series
        self.clock = clock
        self.series: OrderedDict[Key, Series] = OrderedDict()  # least recently updated first
        self.cluster = Series(len(CLUSTER_FIELDS), step, points)
        self.evicted = 0  # series dropped to make room (tests and metrics count them)

    def record(self, key: Key, values: Sequence[float | None], at: float | None = None) -> None:
        """A sample of a card's or pod's series (``USAGE_FIELDS``)."""
        when = self.clock() if at is None else at
        series = self.series.get(key)
        if series is None:
            while len(self.series) >= self.max_series:
                self.series.popitem(last=False)
                self.evicted += 1
            series = self.series[key] = Series(len(USAGE_FIELDS), self.step, self.points)
        else:
            self.series.move_to_end(key)
        series.record(when, values)

    def forget_old(self, now: float | None = None) -> None:
        """Drop the series with no sample in the last hour (a pod long gone)."""
        when = self.clock() if now is None else now
        horizon = when - self.step * self.points
        while self.series:
            key, oldest = next(iter(self.series.items()))
            if oldest.newest_at() >= horizon:
                break
            del self.series[key]

    def document(self, key: Key | None) -> dict[str, Any]:
        """The JSON answer for ``key`` (None: the cluster's); no points for a
        series not (or no longer) kept: a pod denied or gone has no hour to show."""
        now = self.clock()
        found = self.cluster if key is None else self.series.get(key)
        fields = CLUSTER_FIELDS if key is None else USAGE_FIELDS
        return {
            "step_s": self.step,
            "span_s": self.step * self.points,
            "fields": ["at_ms", *fields],
            "points": [] if found is None else found.read(now),
        }

    # ------------------------------------------------------------ from the snapshot

    def record_snapshot(
        self, document: Mapping[str, Any], usage: Mapping[str, list[ContainerUsage]]
    ) -> None:
        """A sample of every series from a composed snapshot ``document`` and
        the telemetry ``usage`` it was composed from (per node, sane entries)."""
        now = self.clock()
        cluster = document.get("cluster") or {}
        self.cluster.record(now, [_number(cluster.get(f)) for f in CLUSTER_FIELDS])
        pods: dict[tuple[str, str], list[float]] = {}  # granted memory, cores
        uids: dict[str, tuple[str, str]] = {}
        for node in document.get("nodes") or []:
            for card in node.get("cards") or []:
                used = card.get("used") or {}
                measured = card.get("measured") or {}
                self.record(
                    ("card", node["name"], card["uuid"]),
                    [
                        _number(used.get("memory_mib")),
                        _number(measured.get("memory_mib")),
                        _number(card.get("memory_mib")),
                        _number(measured.get("sm_percent")),
                        _number(used.get("cores")),
                    ],
                    now,
                )
                for grant in card.get("pods") or []:
                    name = (grant["namespace"], grant["name"])
                    uids[grant["uid"]] = name
                    total = pods.setdefault(name, [0.0, 0.0])
                    total[0] += _number(grant.get("memory_mib")) or 0.0
                    total[1] += _number(grant.get("cores")) or 0.0
        measured_by: dict[tuple[str, str], list[float]] = {}  # used, limit, SM
        for entries in usage.values():
            for entry in entries:
                pod = uids.get(entry.pod_uid)
                if pod is None:
                    continue
                sums = measured_by.setdefault(pod, [0.0, 0.0, 0.0])
                sums[0] += entry.used_bytes / MIB
                sums[1] += entry.limit_bytes / MIB
                sums[2] += entry.sm_percent
        for pod, (memory, cores) in pods.items():
            seen = measured_by.get(pod)
            self.record(
                ("pod", *pod),
                [
                    memory,
                    seen[0] if seen else None,
                    seen[1] if seen and seen[1] else memory,
                    seen[2] if seen else None,
                    cores,
                ],
                now,
            )
        self.forget_old(now)


def _number(value: Any) -> float | None:
    """A finite number of the snapshot as a float; None for anything else."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    number = float(value)
    return number if math.isfinite(number) else None
