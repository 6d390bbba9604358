"""The scheduler's report: how fragmented the free share is and what still fits.

Each scheduler replica writes it to Redis under ``<ledger_prefix>:report:scheduler``
(with an expiry: a stopped scheduler's report vanishes); the inventory's console
reads it. A value that does not parse is refused (None, logged once), never
shown as data.
"""

from __future__ import annotations

import logging
from typing import Annotated, Literal

from pydantic import AwareDatetime, Field, ValidationError
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from gpuslice_common.models import Frozen

log = logging.getLogger(__name__)

REPORT_TTL_S = 60
MAX_REPORT_BYTES = 1 << 20  # a report over this is refused unread
MAX_SHARE = 1e12
Fraction = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]
Share = Annotated[float, Field(ge=0.0, le=MAX_SHARE, allow_inf_nan=False)]
Label = Annotated[str, Field(min_length=1, max_length=200)]
NodeKey = Annotated[str, Field(min_length=1, max_length=253)]


class ShareReport(Frozen):
    """A node's (or the cluster's) free share and the fraction of it that is a fragment."""

    fragmentation: Fraction | None
    free_share: Share


class KindReport(Frozen):
    """One kind of the learned mix and how many more pods of it alone would fit."""

    label: Label
    weight: Fraction
    count: Annotated[int, Field(ge=1, le=64)]
    memory_mib: Annotated[int, Field(ge=1, le=1 << 30)] | None
    memory_percent: Annotated[int, Field(ge=1, le=100)] | None
    cores: Annotated[int, Field(ge=0, le=100)]
    exclusive: bool
    fits: Annotated[int, Field(ge=0, le=1 << 40)]


class SchedulerReport(Frozen):
    version: Literal[1] = 1
    at: AwareDatetime
    policy: Annotated[str, Field(min_length=1, max_length=64)]
    cluster: ShareReport
    nodes: Annotated[dict[NodeKey, ShareReport], Field(max_length=100_000)]
    kinds: Annotated[tuple[KindReport, ...], Field(max_length=5)]


def report_key(prefix: str) -> str:
    return f"{prefix}:report:scheduler"


async def write_report(
    redis: Redis | RedisCluster, prefix: str, report: SchedulerReport, ttl_s: int = REPORT_TTL_S
) -> None:
    """Store ``report``, expiring in ``ttl_s`` seconds."""
    await redis.set(report_key(prefix), report.model_dump_json(), ex=ttl_s)


_refused: set[str] = set()  # reasons already logged (each once)


async def read_report(redis: Redis | RedisCluster, prefix: str) -> SchedulerReport | None:
    """The current report; None when there is none or it does not parse (logged once).

    Raises RedisError when Redis cannot be read.
    """
    raw = await redis.get(report_key(prefix))
    if raw is None:
        return None
    if len(raw) > MAX_REPORT_BYTES:
        _refuse(f"it is over {MAX_REPORT_BYTES} bytes")
        return None
    try:
        return SchedulerReport.model_validate_json(raw)
    except ValidationError as exc:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": str(exc)}
        where = ".".join(str(p)[:64] for p in first["loc"]) or "report"
        _refuse(f"{where}: {first['msg']}")
        return None


def _refuse(why: str) -> None:
    if why not in _refused and len(_refused) < 100:
        _refused.add(why)
        log.warning("ignored the scheduler's report in Redis: %s", why)
