"""The scheduler's report: its own view of fragmentation, kept in Redis for the web console.

Each scheduler replica writes :class:`SchedulerReport` under :func:`report_key`
every few seconds when its content changed, with an expiry of a minute, so a
stopped scheduler's report vanishes instead of going stale. Readers (the
console) take it with :func:`read_report`, which refuses anything that does not
parse into the model, bounds included: a value planted by hand or by another
version is never shown as data.
"""

from __future__ import annotations

import logging
import time
from datetime import datetime
from typing import Annotated, Final, Literal

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, ValidationError
from redis.exceptions import ResponseError

from gpuslice_common.ledger import RedisClient
from gpuslice_common.models import MAX_CAPACITY_MIB, MAX_DEVICES, GpuPolicy

log = logging.getLogger(__name__)

REPORT_VERSION: Final = 1
REPORT_TTL_S: Final = 60.0
MAX_NODES: Final = 100_000
MAX_KINDS: Final = 5
MAX_LABEL: Final = 160
MAX_NODE_NAME: Final = 253  # a Kubernetes node name is a DNS subdomain
MAX_FITS: Final = 10**15
# 100k nodes of at most ~330 bytes each: a larger value is refused before parsing
MAX_REPORT_BYTES: Final = 48 * 1024 * 1024
WARN_EVERY_S: Final = 60.0

Fraction = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]
Share = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]
NodeName = Annotated[str, Field(min_length=1, max_length=MAX_NODE_NAME)]


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


class Fragmentation(_Strict):
    """How much of the free share is a fragment: ``fragmentation`` is a fraction of
    ``free_share`` (free compute in milli-GPU, 1000 = one whole free card); None
    where there is no free share."""

    fragmentation: Fraction | None
    free_share: Share


class ReportKind(_Strict):
    """One common kind of pod of the scheduler's learned mix, and how many more
    pods of that kind alone would fit on the cluster now."""

    label: Annotated[str, Field(min_length=1, max_length=MAX_LABEL)]
    weight: Fraction  # its share of the pods the mix expects
    count: Annotated[int, Field(ge=1, le=MAX_DEVICES)]  # cards per pod
    memory_mib: Annotated[int, Field(ge=0, le=MAX_CAPACITY_MIB)] | None  # per card
    memory_percent: Annotated[int, Field(ge=1, le=100)] | None  # per card
    cores: Annotated[int, Field(ge=0, le=100)]  # percent of each card's cores
    exclusive: bool
    fits: Annotated[int, Field(ge=0, le=MAX_FITS)]


class SchedulerReport(_Strict):
    """The scheduler's view of the cluster's fragmentation (docs/architecture.md)."""

    version: Literal[1] = REPORT_VERSION
    at: AwareDatetime
    policy: GpuPolicy  # the default GPU policy of the scheduler that wrote it
    cluster: Fragmentation
    nodes: Annotated[dict[NodeName, Fragmentation], Field(max_length=MAX_NODES)]
    kinds: Annotated[tuple[ReportKind, ...], Field(max_length=MAX_KINDS)]

    def same_content(self, other: SchedulerReport) -> bool:
        """Equal but for the time it was made."""
        return (self.policy, self.cluster, self.kinds, self.nodes) == (
            other.policy,
            other.cluster,
            other.kinds,
            other.nodes,
        )

    def made_at(self, at: datetime) -> SchedulerReport:
        """The same report, made at ``at`` (timezone-aware)."""
        return self.model_copy(update={"at": at})


def report_key(prefix: str) -> str:
    """The Redis key of the scheduler's report under the ledger prefix ``prefix``."""
    return f"{prefix}:report:scheduler"


async def write_report(
    redis: RedisClient, prefix: str, report: SchedulerReport, ttl_s: float = REPORT_TTL_S
) -> None:
    """Store ``report`` for ``ttl_s`` seconds (Redis errors are the caller's)."""
    await redis.set(report_key(prefix), report.model_dump_json(), px=max(1, round(ttl_s * 1000)))


_warned: dict[str, float] = {}


async def read_report(redis: RedisClient, prefix: str) -> SchedulerReport | None:
    """The scheduler's report; None when there is none or it does not parse (then a
    warning naming the key, at most once a minute per key). Redis errors are the
    caller's."""
    key = report_key(prefix)
    try:
        raw = await redis.get(key)
    except UnicodeDecodeError:  # a client that decodes replies, and a value that is not UTF-8
        _refuse(key, "not UTF-8 text")
        return None
    except ResponseError as exc:
        if not str(exc).startswith("WRONGTYPE"):
            raise
        _refuse(key, "not a string value")  # a hash or list planted under the key
        return None
    if raw is None:
        return None
    if len(raw) > MAX_REPORT_BYTES:
        _refuse(key, f"{len(raw)} bytes, more than {MAX_REPORT_BYTES}")
        return None
    try:
        return SchedulerReport.model_validate_json(raw)
    except ValidationError as exc:
        first = exc.errors(include_url=False, include_input=False, include_context=False)[0]
        where = ".".join(str(part) for part in first["loc"]) or "the value"
        _refuse(key, f"{exc.error_count()} problem(s), first at {where}: {first['msg']}")
        return None


def _refuse(key: str, why: str) -> None:
    now = time.monotonic()
    if now - _warned.get(key, -WARN_EVERY_S) >= WARN_EVERY_S:
        _warned[key] = now
        # %r: a node name in the reason is the writer's text, control characters and all
        log.warning(
            "ignoring the scheduler report under %s, which does not parse: %r", key, why[:300]
        )
