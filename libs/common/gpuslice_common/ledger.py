"""The live per-GPU usage ledger in Redis.

Every change that touches more than one key is a Lua script (``lua/``), so it is
all-or-nothing and never leaves a card over its capacity. All keys of one node
carry the node's hash tag (``{node}``), so the scripts run unchanged on Redis
Cluster. A pod's lifecycle is ``reserved -> bound -> allocated -> released``;
reserve, bind, allocate and release are idempotent, so a client may retry any of
them after a dropped connection.

The only key outside a node's slot is the pod index ``<p>:pod:{uid}``, which says
on which node a pod is reserved. A reserve claims it for its node, runs the node's
script, then confirms the claim; the claim and the confirmation are
compare-and-swaps on that one key (``lua/index.lua``). So of two reserves of one
pod on two nodes at most one keeps its reservation: a reserve elsewhere is refused
while the index is live or freshly claimed, a claim older than ``claim_lease``
whose pod is not live may be taken over, and a reserve that loses its claim before
confirming releases what it reserved. A process killed mid-reserve blocks that pod
on other nodes for at most the lease. A release marks the index released before it
frees the cards, and the next reserve elsewhere finishes a release that died
between the two.

Where every key is on one server (one Redis, or Sentinel's primary; not Redis
Cluster) a reserve takes the three steps in one script, one round trip
(``lua/claim_reserve.lua``), unless the index names another node: the three
steps, which look at that node, decide that rare case.

After Redis lost a node's keys, the node takes no reservation, bind or
allocation (:class:`LedgerRebuilding`) until the inventory's reconciliation has
put back the placements its pods record and stamped it rebuilt
(:meth:`Ledger.mark_rebuilt`); restores check fit, so the ledger never counts
more than a card holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from importlib import resources
from typing import Any, Concatenate, NamedTuple, ParamSpec, TypeVar, cast

from redis.asyncio import BlockingConnectionPool, ConnectionPool, Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import parse_url
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import (
    MasterNotFoundError,
    Sentinel,
    SentinelConnectionPool,
    SentinelManagedConnection,
)
from redis.backoff import ExponentialWithJitterBackoff
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gpuslice_common.config import CommonSettings, sentinel_addresses
from gpuslice_common.models import (
    DEVICE_UUID_PATTERN,
    MAX_CAPACITY_CORES,
    MAX_CAPACITY_MIB,
    MAX_DEVICE_MEMORY_MIB,
    MAX_DEVICES,
    MAX_MIG_SLICES,
    MAX_NAME_LENGTH,
    MAX_NUMA_NODE,
    MAX_SPLIT_COUNT,
    NVIDIA,
    PRINTABLE_PATTERN,
    VENDOR_PATTERN,
    CardLayers,
    ClaimRef,
    DeviceGrant,
    GpuCapacity,
    GpuDevice,
    GpuState,
    GpuUsage,
    MigInstance,
    MigPlacement,
    MigProfile,
    NodeInventory,
    Placement,
    PlacementState,
    VgpuMode,
)
from gpuslice_common.subjects import node_from_token, node_token

log = logging.getLogger(__name__)


class LedgerError(Exception):
    """Base of every ledger failure; the message is meant for an operator."""


class LedgerUnavailable(LedgerError):
    """Redis could not be reached, even after retrying."""


class ReservationConflict(LedgerError):
    """A card cannot take the reservation (capacity, health, exclusivity)."""

    def __init__(self, node: str, uuid: str, reason: str) -> None:
        where = f"{uuid} on {node}" if uuid else f"on {node}"  # no card: the node refuses
        super().__init__(f"cannot reserve {where}: {reason}")
        self.node = node
        self.uuid = uuid
        self.reason = reason


class AlreadyReserved(LedgerError):
    """The pod already holds a live reservation on another node."""

    def __init__(self, pod_uid: str, node: str) -> None:
        super().__init__(f"pod {pod_uid} is already reserved on node {node}")
        self.pod_uid = pod_uid
        self.node = node


class NotReserved(LedgerError):
    """The pod has no live reservation."""


class AmbiguousAllocation(NotReserved):
    """Kubelet's Allocate could be for any of several bound pods (its call names
    none): refused, since no answer is known to be the right pod's grant."""

    def __init__(self, node: str, count: int, pods: Sequence[str]) -> None:
        super().__init__(
            f"Allocate for {count} GPU(s) on node {node} could be for any of pods "
            f"{', '.join(pods)} (each waits for a container with {count}); refused, "
            "not guessed: one of them would run with another's grant"
        )
        self.node = node
        self.pods = tuple(pods)


class NodeBusy(LedgerError):
    """Another pod bound to the node still waits for kubelet's Allocate: binds
    take one pod per node at a time (:meth:`Ledger.mark_bound`, ``exclusive``)."""

    def __init__(self, node: str, pending: str) -> None:
        super().__init__(
            f"node {node} is taking pod {pending} (bound, waiting for kubelet's Allocate)"
        )
        self.node = node
        self.pending = pending


class ServesDra(NotReserved):
    """The node's agent serves kubelet through DRA (``NodeInventory.dra``): its
    cards go to prepared ResourceClaims only, never to kubelet's Allocate."""

    def __init__(self, node: str) -> None:
        super().__init__(
            f"node {node} serves GPUs through DRA: its cards are granted by prepared "
            "ResourceClaims, never by the device plugin's Allocate"
        )
        self.node = node


class ClaimConflict(LedgerError):
    """The pod already holds a placement that is not this claim's: another claim's,
    or one the device plugin path made."""

    def __init__(self, pod_uid: str, claim: ClaimRef, held: ClaimRef | None) -> None:
        holds = f"claim {held}" if held is not None else "a placement made without a claim"
        super().__init__(f"pod {pod_uid} already holds {holds}; claim {claim} not recorded")
        self.pod_uid = pod_uid
        self.claim = claim
        self.held = held


class LedgerRebuilding(LedgerError):
    """The node's part of the ledger is being rebuilt (Redis lost its data, or the
    node is new): retry once the inventory's reconciliation has stamped it."""

    def __init__(self, node: str) -> None:
        super().__init__(
            f"the ledger of node {node} is being rebuilt from its pods' placements "
            "(Redis lost its data or the node is new); retry shortly"
        )
        self.node = node


class BadRecord(LedgerError):
    """A node's record holds a value no gpuslice writes (an older version's, or one
    set by hand): that node cannot be read, every other node still can. Readers
    that go over many nodes catch it per node, skip the node and say why."""

    def __init__(self, node: str, problem: str) -> None:
        super().__init__(f"node {_shown(node)}: {problem}")
        self.node = node
        self.problem = problem


def _shown(node: str) -> str:
    """A node's name for a message: as it is when it is one, else quoted and escaped."""
    try:
        node_token(node)
    except ValueError:
        return repr(node[:80])
    return node


def _named(nodes: Sequence[str]) -> tuple[list[str], dict[str, BadRecord]]:
    """``nodes`` whose names can be node keys, and the others as BadRecords."""
    named: list[str] = []
    bad: dict[str, BadRecord] = {}
    for node in nodes:
        try:
            node_token(node)
        except ValueError:
            bad[node] = BadRecord(node, "its name is not a Kubernetes node name")
        else:
            named.append(node)
    return named, bad


@dataclass(frozen=True)
class NodeKeys:
    gpus: str
    meta: str
    pods: str
    pending: str
    released: str

    def all(self) -> list[str]:
        return [self.gpus, self.meta, self.pods, self.pending, self.released]


@dataclass(frozen=True)
class Allocation:
    """One container's devices, handed out in answer to a kubelet Allocate."""

    placement: Placement
    container_index: int

    @property
    def devices(self) -> tuple[DeviceGrant, ...]:
        return self.placement.containers[self.container_index].devices


@dataclass(frozen=True, slots=True)
class StoredCard:
    """One card as the ledger stores it, every number checked (:func:`stored_cards`)."""

    uuid: str
    index: int
    model: str
    memory_mib: int  # the card's own memory, before scaling
    numa: int | None
    healthy: bool
    mig: bool
    cap_mem: int
    cap_cores: int
    cap_slots: int
    used_mem: int
    used_cores: int
    used_slots: int
    owner: str  # the pod holding it exclusively, or ""
    present: bool
    cordoned: bool
    vendor: str = NVIDIA
    mode: VgpuMode = VgpuMode.HAMI_CORE
    mig_state: StoredMig | None = None  # mode mig: its profiles, instances and masks
    layers: CardLayers | None = None  # which layers enforce; None: the agent reports none


@dataclass(frozen=True)
class NodeCards:
    """A node's cards in index order, the revision they were read at, and whether
    a reconciliation pass has stamped the node rebuilt (it takes reservations)."""

    cards: list[StoredCard]
    rev: int
    rebuilt: bool
    dra: bool = False  # the node's agent serves kubelet through DRA (NodeInventory.dra)


class Reservation(NamedTuple):
    """What :meth:`Ledger.reserve_new` did."""

    placement: Placement
    created: bool  # False: the pod's live reservation on the node, made before
    rev: int  # the node's revision with the reservation counted; 0 when not created


@dataclass(frozen=True)
class NodeLiveness:
    """When a node's agent last registered, and since when it counts as gone."""

    heartbeat: datetime | None
    unavailable_since: datetime | None


@dataclass(frozen=True)
class NodeRebuild:
    """Where a registered node stands: its registration (the value that changes
    when Redis lost the node and it registered afresh), when it was stamped
    rebuilt in the current epoch (None: it takes no reservation yet), and that
    epoch (the primary's replication id: it changes with a failover or restart,
    and with it every stamp goes stale)."""

    registered: str
    rebuilt_at: datetime | None
    epoch: str = ""


@dataclass(frozen=True)
class Release:
    placement: Placement
    first: bool  # False when the pod had already been released
    clamped: int = 0  # usage counters that would have gone negative (a ledger defect)


# what a placement record holds besides its state and times (lua/reserve.lua)
RECORD_FIELDS = {"pod", "node", "containers", "policy", "claim"}


def _script_source(name: str) -> str:
    pkg = resources.files("gpuslice_common") / "lua"
    parts = [(pkg / "lib.lua").read_text()]
    if name == "claim_reserve":  # runs reserve.lua itself, as its function reserve()
        parts.append(f"local function reserve()\n{(pkg / 'reserve.lua').read_text()}\nend")
    parts.append((pkg / f"{name}.lua").read_text())
    return "\n".join(parts)


def _ms_to_datetime(value: Any) -> datetime | None:
    if value is None:
        return None
    return datetime.fromtimestamp(float(value) / 1000, UTC)


def _placement_from_record(raw: str) -> Placement:
    rec = json.loads(raw)
    times = rec.pop("times", {}) or {}
    rec.pop("footprint", None)
    for step in ("reserved", "bound", "allocated", "released"):
        rec[f"{step}_at"] = _ms_to_datetime(times.get(step))
    return Placement.model_validate(rec)


def _index_node(value: str) -> str:
    """The node named by a pod index value ``<state>:<ms>:<token>:<node>``."""
    parts = value.split(":", 3)
    return parts[3] if len(parts) == 4 else ""


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


RedisClient = Redis | RedisCluster
MAX_NOTICE_BYTES = 1024  # a meta key: the prefix and a node name (253) in its tag


class _PrimaryConnection(SentinelManagedConnection):
    """A connection to the primary the sentinels name at each (re)connect.

    redis-py's own reconnects a connection its retry dropped to the address it
    had (``send_packed_command`` calls ``connect_check_health``, not the
    sentinel-aware ``connect``): after a failover, to the dead primary, until the
    retries run out. Asking the sentinels here makes every reconnect follow.
    """

    async def connect_check_health(
        self, check_health: bool = True, retry_socket_connect: bool = True
    ) -> None:
        if not self.is_connected and self.connection_pool.is_master:
            pool = self.connection_pool
            try:
                self.host, self.port = await pool.get_master_address()
            except MasterNotFoundError:
                asked = len(pool.sentinel_manager.sentinels)
                raise RedisConnectionError(
                    f"none of the {asked} sentinels names a primary for {pool.service_name!r}"
                ) from None
        await super().connect_check_health(check_health, retry_socket_connect)

    async def read_response(self, *args: Any, **kwargs: Any) -> Any:
        """A primary that refuses writes for lack of a replica in sync (NOREPLICAS,
        ``min-replicas-to-write``) may be one the sentinels are demoting, cut off
        from the rest: like READONLY, the command is cut off and tried again on
        the primary the sentinels name."""
        try:
            return await super().read_response(*args, **kwargs)
        except ResponseError as exc:
            if not str(exc).startswith("NOREPLICAS"):
                raise
            await self.disconnect()
            raise RedisConnectionError(f"the primary refused a write: {exc}") from None


def _pool_options(max_connections: int, retries: int) -> dict[str, Any]:
    """One server's (or the sentinels' primary's) blocking pool: callers beyond
    ``max_connections`` wait; commands retry with backoff across a drop."""
    return {
        "max_connections": max_connections,
        "timeout": 10,
        "decode_responses": True,
        "socket_timeout": 5,
        "socket_connect_timeout": 2,
        "health_check_interval": 15,
        "retry": Retry(ExponentialWithJitterBackoff(base=0.05, cap=1.0), retries=retries),
        "retry_on_error": [RedisConnectionError, RedisTimeoutError, ConnectionResetError],
    }


class _PrimaryPool(SentinelConnectionPool, BlockingConnectionPool):
    """Connections to the sentinels' primary, from a pool that makes a burst wait
    for a free connection (as :meth:`Ledger.from_url`'s does) rather than fail."""


P = ParamSpec("P")
T = TypeVar("T")
TURN_POLL_FIRST_S = 0.02  # a bind waiting for its node's turn looks again after this,
TURN_POLL_MAX_S = 0.25  # doubling up to this, unless a change notice comes first


R = TypeVar("R")
_NOT_TEXT = "its record holds bytes that are not UTF-8, which gpuslice never writes"


def _not_text(node: str) -> BadRecord:
    return BadRecord(node, _NOT_TEXT)


async def _node_by_node(
    nodes: Sequence[str],
    read: Callable[[Sequence[str]], Awaitable[dict[str, R]]],
    bad: Callable[[str], R],
) -> dict[str, R]:
    """``read(nodes)`` in one round trip; when a record holds bytes that are not UTF-8
    (the client decodes every reply, and one such reply fails the whole round
    trip), node by node instead, the node that cannot be decoded ``bad(node)``: one
    node's record never stops the reading of the others."""
    try:
        return await read(nodes)
    except UnicodeDecodeError:
        result: dict[str, R] = {}
        for node in nodes:
            try:
                result.update(await read([node]))
            except UnicodeDecodeError:
                result[node] = bad(node)
        return result


def _gated(
    op: Callable[Concatenate[Ledger, P], Coroutine[Any, Any, T]],
) -> Callable[Concatenate[Ledger, P], Coroutine[Any, Any, T]]:
    """Bound the operations in flight: a burst waits instead of exhausting connections.

    Each operation holds at most one connection per Redis node at a time, so the
    gate keeps every node's pool within ``max_in_flight``. An outage that outlasts
    the client's retries surfaces as LedgerUnavailable.
    """

    @functools.wraps(op)
    async def gated(ledger: Ledger, /, *args: P.args, **kwargs: P.kwargs) -> T:
        async with ledger._gate:
            try:
                return await op(ledger, *args, **kwargs)
            except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
                raise LedgerUnavailable(f"Redis is unreachable: {exc}") from None
            except RedisError as exc:  # out of memory, read-only replica, ...
                raise LedgerError(f"Redis refused {op.__name__}: {exc}") from None

    return gated


class Ledger:
    """Async access to the ledger. Construct with :meth:`from_url` or a Redis client.

    Every operation is safe to retry and safe to run concurrently from many
    processes, including reserves of one pod on different nodes.
    """

    def __init__(
        self,
        redis: RedisClient,
        prefix: str = "gpuslice",
        released_retention: timedelta = timedelta(hours=1),
        answer_retention: timedelta = timedelta(minutes=10),
        claim_lease: timedelta = timedelta(seconds=10),
        max_in_flight: int = 64,
        fast_reserve: bool = True,
    ) -> None:
        self.redis = redis
        # one script per reserve where every key is on one server (False: three)
        self.fast_reserve = fast_reserve and not isinstance(redis, RedisCluster)
        self.prefix = prefix
        self.released_retention_ms = int(released_retention.total_seconds() * 1000)
        self.answer_retention_s = max(1, int(answer_retention.total_seconds()))
        self.claim_lease_ms = int(claim_lease.total_seconds() * 1000)
        self._gate = asyncio.Semaphore(max_in_flight)
        self._sentinel: Sentinel | None = None  # closed with the ledger
        self.refused_notices = 0  # change notices skipped: they named no node
        self._scripts: dict[str, AsyncScript] = {
            name: redis.register_script(_script_source(name))
            for name in (
                "reserve",
                "claim_reserve",
                "bind",
                "allocate",
                "release",
                "register",
                "index",
                "cordon",
                "unavailable",
                "rebuilt",
            )
        }

    @classmethod
    def from_url(
        cls,
        url: str,
        prefix: str = "gpuslice",
        max_connections: int = 64,
        cluster: bool = False,
        retries: int = 12,
        **kwargs: Any,
    ) -> Ledger:
        """Connect lazily; commands retry with backoff across a Redis restart (~10 s by default).

        Callers beyond ``max_connections`` wait for a free connection (a burst of
        scheduling requests queues rather than fails). With ``cluster`` the URL
        names any one node of a Redis Cluster.
        """
        if cluster:
            client = RedisCluster.from_url(
                url,
                decode_responses=True,
                max_connections=max_connections,
                socket_timeout=5,
                socket_connect_timeout=2,
                retry=Retry(ExponentialWithJitterBackoff(base=0.05, cap=1.0), retries=retries),
            )
            return cls(client, prefix, max_in_flight=max_connections, **kwargs)
        pool = BlockingConnectionPool.from_url(url, **_pool_options(max_connections, retries))
        return cls(Redis.from_pool(pool), prefix, max_in_flight=max_connections, **kwargs)

    @classmethod
    def from_sentinels(
        cls,
        sentinels: Sequence[tuple[str, int]],
        service: str,
        url: str,
        prefix: str = "gpuslice",
        max_connections: int = 64,
        retries: int = 12,
        sentinel_user: str | None = None,
        sentinel_password: str | None = None,
        **kwargs: Any,
    ) -> Ledger:
        """The primary that Redis Sentinel names for ``service``, found again after
        a failover; ``url`` gives the user, password and database only.

        A command cut off by a failover is retried, with backoff, on the primary
        the sentinels name next (~10 s by default): every ledger script is
        idempotent, so one that ran before the cut is not applied twice. A
        demoted primary's READONLY answer counts as cut off.
        """
        given = parse_url(url)
        login: dict[str, Any] = {
            k: given[k] for k in ("username", "password", "db") if given.get(k) is not None
        }
        # one try per sentinel per look-up: the command's own retries repeat it
        to_sentinels: dict[str, Any] = {
            "socket_timeout": 2,
            "socket_connect_timeout": 1,
            "retry": Retry(ExponentialWithJitterBackoff(base=0.05, cap=1.0), retries=0),
        }
        if sentinel_user:
            to_sentinels["username"] = sentinel_user
        if sentinel_password:
            to_sentinels["password"] = sentinel_password
        sentinel = Sentinel(list(sentinels), sentinel_kwargs=to_sentinels)  # type: ignore[no-untyped-call]
        client = sentinel.master_for(
            service,
            redis_class=Redis,
            connection_pool_class=_PrimaryPool,
            connection_class=_PrimaryConnection,
            **_pool_options(max_connections, retries),
            **login,
        )
        ledger = cls(client, prefix, max_in_flight=max_connections, **kwargs)
        ledger._sentinel = sentinel
        return ledger

    @classmethod
    def from_settings(cls, settings: CommonSettings, **kwargs: Any) -> Ledger:
        """The ledger a component's settings point at: through Redis Sentinel, on a
        Redis Cluster, or at one server."""
        if settings.redis_sentinels:
            return cls.from_sentinels(
                sentinel_addresses(settings.redis_sentinels),
                settings.redis_sentinel_service,
                settings.redis_url,
                settings.ledger_prefix,
                sentinel_user=settings.redis_sentinel_user,
                sentinel_password=settings.redis_sentinel_password,
                **kwargs,
            )
        return cls.from_url(
            settings.redis_url, settings.ledger_prefix, cluster=settings.redis_cluster, **kwargs
        )

    async def close(self) -> None:
        await self.redis.aclose()
        if self._sentinel is not None:
            await self._sentinel.aclose()

    @_gated
    async def ping(self) -> bool:
        return bool(await self.redis.ping())

    # ------------------------------------------------------------ keys

    def node_keys(self, node: str) -> NodeKeys:
        tag = "{" + node_token(node) + "}"
        base = f"{self.prefix}:{tag}"
        return NodeKeys(
            gpus=f"{base}:gpus",
            meta=f"{base}:meta",
            pods=f"{base}:pods",
            pending=f"{base}:pending",
            released=f"{base}:released",
        )

    def pod_index_key(self, pod_uid: str) -> str:
        return f"{self.prefix}:pod:{{{pod_uid}}}"

    @property
    def changes_channel(self) -> str:
        """Pub/sub channel on which every change announces its node's meta key."""
        return f"{self.prefix}:changes"

    def node_of_meta_key(self, key: str) -> str | None:
        """The node whose meta key ``key`` is, or None for anything else (a token
        that is not a node's: no gpuslice script writes it)."""
        head, tail = f"{self.prefix}:{{", "}:meta"
        if not key.startswith(head) or not key.endswith(tail) or len(key) <= len(head + tail):
            return None
        token = key[len(head) : -len(tail)]
        node = node_from_token(token)
        try:
            return node if node_token(node) == token else None
        except ValueError:
            return None

    def _notice_node(self, data: object) -> str | None:
        """The node a change notice announces; None, logged and counted in
        :attr:`refused_notices`, for bytes no gpuslice script publishes (not
        UTF-8, too long, empty, not a meta key of this ledger)."""
        raw = data if isinstance(data, bytes) else str(data).encode("utf-8", "backslashreplace")
        node = None
        if len(raw) <= MAX_NOTICE_BYTES:
            with contextlib.suppress(UnicodeDecodeError):
                node = self.node_of_meta_key(raw.decode("utf-8"))
        if node is None:
            self.refused_notices += 1
            count = self.refused_notices
            if count in (1, 10, 100) or count % 1000 == 0:
                log.warning(
                    "skipped a change notice on %s that names no node's meta key "
                    "(%d bytes: %r); %d skipped since start",
                    self.changes_channel,
                    len(raw),
                    raw[:80],
                    count,
                )
        return node

    async def watch_changes(
        self, poll: float = 1.0, on_subscribed: Callable[[], None] | None = None
    ) -> AsyncIterator[str]:
        """Names of nodes as their cards or usage change, announced by the scripts.

        Not on Redis Cluster (raises NotImplementedError). A dropped connection
        raises LedgerUnavailable: changes in between are lost, so re-read
        everything (revisions) after subscribing again. Anyone who may publish
        on the channel can send any bytes: what names no node is skipped
        (:meth:`_notice_node`), and the notices are read as bytes, on a
        connection of their own, so no bytes can stop the reading (decoded by the
        client, a byte that is not UTF-8 raised amid its parse).
        """
        if isinstance(self.redis, RedisCluster):
            raise NotImplementedError("change notices are not followed on Redis Cluster")
        pool = self.redis.connection_pool
        kwargs = {**pool.connection_kwargs, "decode_responses": False}
        raw = Redis.from_pool(ConnectionPool(connection_class=pool.connection_class, **kwargs))
        pubsub = raw.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.subscribe(self.changes_channel)
            if on_subscribed is not None:
                on_subscribed()
            while True:
                message = await pubsub.get_message(timeout=poll)
                if message is None or message.get("type") != "message":
                    continue
                node = self._notice_node(message["data"])
                if node is not None:
                    yield node
        except (RedisError, OSError) as exc:
            raise LedgerUnavailable(f"lost the ledger's change notices: {exc}") from None
        finally:
            with contextlib.suppress(RedisError, OSError):
                await pubsub.aclose()  # type: ignore[no-untyped-call]
            with contextlib.suppress(RedisError, OSError):
                await raw.aclose()

    @property
    def nodes_key(self) -> str:
        return f"{self.prefix}:nodes"

    async def _get(self, key: str) -> str | None:
        value = await self.redis.get(key)
        return None if value is None else _text(value)

    async def _run(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> list[str]:
        script = self._scripts[name]
        try:
            result = await script(keys=list(keys), args=list(args))
        except NoScriptError:
            # loaded, and still unknown: the load and the call went to different
            # servers, one a demoted primary (its script cache emptied by the
            # resync) that a pooled connection still reached after a failover.
            # Drop every connection so each asks the sentinels, then once more.
            if self._sentinel is None or not isinstance(self.redis, Redis):
                raise
            await self.redis.connection_pool.disconnect()
            result = await script(keys=list(keys), args=list(args))
        if isinstance(result, list):
            return [_text(v) for v in result]
        return [_text(result)]

    # ------------------------------------------------------------ nodes

    @_gated
    async def register_node(self, inventory: NodeInventory, *, rebuilt: bool = False) -> int:
        """Create or refresh a node's cards; returns how many cards it now lists.

        ``rebuilt`` also stamps the node rebuilt (:meth:`mark_rebuilt`): only for
        callers with no durable record of placements to restore first (an
        inventory without the Kubernetes API, tests, simulations).
        """
        devices = []
        for d in inventory.devices:  # one vendor's (NodeInventory checks)
            cap = inventory.capacity(d)
            devices.append(
                {
                    "uuid": d.uuid,
                    "index": d.index,
                    "model": d.model,
                    "memory_mib": d.memory_mib,
                    "numa": "" if d.numa is None else d.numa,
                    "healthy": int(d.healthy),
                    "mig": int(d.mig),
                    "cap_mem": cap.memory_mib,
                    "cap_cores": cap.cores,
                    "cap_slots": cap.slots,
                    **_mig_fields(d),
                    "layers": _layers_field(inventory.layers.get(d.uuid)),
                }
            )
        config = {
            "split_count": inventory.split_count,
            "memory_scaling": inventory.memory_scaling,
            "core_scaling": inventory.core_scaling,
        }
        payload = json.dumps(
            {
                "vendor": inventory.vendor,
                "devices": devices,
                "config": config,
                "dra": inventory.dra,
            }
        )
        keys = self.node_keys(inventory.node).all()
        outcome = await self._run("register", keys, [payload])
        if outcome[0] == "taken":
            raise LedgerError(
                f"cannot register {inventory.vendor} cards on {inventory.node}: "
                f"card {outcome[1]} is a {outcome[2]} card there"
            )
        count, waiting = outcome
        if waiting:
            log.warning(
                "node %s: card(s) %s listed by the node agent are another vendor's cards in "
                "use there (a vendor annotation named their UUIDs): registered once released",
                inventory.node,
                waiting,
            )
        await self.redis.sadd(self.nodes_key, inventory.node)
        if rebuilt:
            await self._run("rebuilt", keys, [""])
        return int(count)

    @_gated
    async def mark_rebuilt(self, node: str, registered: str = "", epoch: str = "") -> bool:
        """Stamp a registered node rebuilt in the current epoch: it takes
        reservations from now on.

        The inventory calls this after a reconciliation pass that read the node's
        ``registered`` value and epoch (pass them) before listing the pods, and
        restored what they record on it; a node that registered afresh since, or
        whose primary changed since (the restores may be lost), is not stamped.
        True when the node is stamped (by this call or before).
        """
        keys = self.node_keys(node).all()
        [outcome] = await self._run("rebuilt", keys, [registered, epoch])
        return outcome in ("ok", "already")

    @_gated
    async def rebuild_status(self, nodes: Sequence[str] | None = None) -> dict[str, NodeRebuild]:
        """Each registered node's registration and rebuilt stamp (all nodes by default);
        nodes not registered are left out."""
        if nodes is None:
            nodes = sorted(_text(m) for m in await self.redis.smembers(self.nodes_key))
        nodes, _ = _named(nodes)  # a name that is no node's has no record to read
        pipe = self.redis.pipeline(transaction=False)
        metas = [self.node_keys(node).meta for node in nodes]
        for meta in metas:
            pipe.hmget(meta, ["registered", "rebuilt", "epoch"])
        replies = await pipe.execute()
        epochs = await self._epochs(metas)
        status = {}
        for node, (registered, rebuilt, stamp_epoch), epoch in zip(
            nodes, replies, epochs, strict=True
        ):
            if registered is None:
                continue
            try:
                stamp = _stored_time(node, "rebuilt", rebuilt or None)
            except BadRecord:  # not a time gpuslice wrote: shown as none, never a failure
                stamp = None
            if _text(stamp_epoch or "") != epoch:
                stamp = None  # stamped before a failover or restart: stale
            status[node] = NodeRebuild(_text(registered), stamp, epoch)
        return status

    @_gated
    async def epochs(self, nodes: Sequence[str]) -> dict[str, str]:
        """The epoch of each node's part of the ledger (one primary's replication
        id; on Redis Cluster, its shard's): a reader that keeps a copy re-reads a
        node whose epoch changed, since every stamp went stale with it."""
        nodes, _ = _named(nodes)
        epochs = await self._epochs([self.node_keys(node).meta for node in nodes])
        return dict(zip(nodes, epochs, strict=True))

    async def _epochs(self, keys: Sequence[str]) -> list[str]:
        """The epoch (lib.lua) of the primary holding each key: one INFO per primary."""
        if not isinstance(self.redis, RedisCluster):
            epoch = _replid(await self.redis.info("replication")) if keys else ""
            return [epoch] * len(keys)
        by_primary: dict[str, str] = {}
        epochs = []
        for key in keys:
            primary = self.redis.get_node_from_key(key)
            if primary is None:
                raise RedisConnectionError(f"no Redis Cluster node holds the slot of {key}")
            if primary.name not in by_primary:
                reply = await self.redis.info("replication", target_nodes=primary)
                by_primary[primary.name] = _replid(reply)
            epochs.append(by_primary[primary.name])
        return epochs

    @_gated
    async def cordon(self, node: str, card: str, cordoned: bool = True) -> None:
        """Take a card out of scheduling (or back in); reservations it holds stay."""
        reply = await self._run("cordon", self.node_keys(node).all(), [card, int(cordoned)])
        if reply[0] != "ok":
            raise LedgerError(f"node {node} has no card {card}")

    @_gated
    async def mark_unavailable(self, node: str, heartbeat_before: datetime) -> bool:
        """Mark a node whose last heartbeat is older than ``heartbeat_before``: its
        cards become unhealthy (nothing new is placed there) while its reservations
        stay. True when this call marked it; its next registration undoes it."""
        cutoff = int(heartbeat_before.timestamp() * 1000)
        [outcome] = await self._run("unavailable", self.node_keys(node).all(), [cutoff])
        return outcome == "marked"

    @_gated
    async def now(self) -> datetime:
        """Redis's clock: the one every timestamp in the ledger was taken with."""
        seconds, micros = await self.redis.time()
        return datetime.fromtimestamp(int(seconds) + int(micros) / 1e6, UTC)

    async def node_liveness(self, nodes: Sequence[str]) -> dict[str, NodeLiveness]:
        """Each node's last heartbeat and, if marked, since when it is unavailable.

        Raises BadRecord for the first node whose times cannot be read.
        """
        return _all_read(await self.read_liveness(nodes))

    @_gated
    async def read_liveness(self, nodes: Sequence[str]) -> dict[str, NodeLiveness | BadRecord]:
        """:meth:`node_liveness`, with a node whose times cannot be read as its BadRecord."""
        return await _node_by_node(nodes, self._read_liveness, _not_text)

    async def _read_liveness(self, nodes: Sequence[str]) -> dict[str, NodeLiveness | BadRecord]:
        nodes, bad = _named(nodes)
        pipe = self.redis.pipeline(transaction=False)
        for node in nodes:
            pipe.hmget(self.node_keys(node).meta, ["heartbeat", "unavailable"])
        replies = await pipe.execute()
        result: dict[str, NodeLiveness | BadRecord] = dict(bad)
        for node, (beat, gone) in zip(nodes, replies, strict=True):
            try:
                result[node] = NodeLiveness(
                    _stored_time(node, "heartbeat", beat), _stored_time(node, "unavailable", gone)
                )
            except BadRecord as exc:
                result[node] = exc
        return result

    @_gated
    async def nodes(self) -> list[str]:
        members = await self.redis.smembers(self.nodes_key)
        return sorted(_text(m) for m in members)

    async def node_gpus(self, node: str, vendor: str | None = NVIDIA) -> list[GpuState]:
        """A node's cards with capacity and usage, read in one round trip.

        Raises BadRecord when the node's record cannot be read.
        """
        return (await self.nodes_gpus([node], vendor))[node]

    async def nodes_gpus(
        self, nodes: Sequence[str], vendor: str | None = NVIDIA
    ) -> dict[str, list[GpuState]]:
        """Several nodes' cards in one round trip (unknown nodes map to []).

        Raises BadRecord for the first node whose record cannot be read; readers
        of many nodes use :meth:`read_gpus` and skip that one.
        """
        return _all_read(await self.read_gpus(nodes, vendor))

    async def read_gpus(
        self, nodes: Sequence[str], vendor: str | None = NVIDIA
    ) -> dict[str, list[GpuState] | BadRecord]:
        """:meth:`nodes_gpus`, with a node whose record cannot be read as its BadRecord."""
        result: dict[str, list[GpuState] | BadRecord] = {}
        for node, read in (await self.read_nodes(nodes, vendor)).items():
            if isinstance(read, BadRecord):
                result[node] = read
                continue
            try:
                result[node] = [_gpu_state(node, card) for card in read.cards]
            except BadRecord as exc:
                result[node] = exc
        return result

    @_gated
    async def read_nodes(
        self, nodes: Sequence[str], vendor: str | None = NVIDIA
    ) -> dict[str, NodeCards | BadRecord]:
        """Per node, its cards as stored (numbers checked, see :func:`stored_cards`) and
        its revision; a node whose record cannot be read maps to its BadRecord.

        Only ``vendor``'s cards (None: every vendor's). The scheduler reads
        NVIDIA's, the default, so it never places a GPU request on another
        vendor's accelerator.

        One round trip; for readers that build their own arrays (the scheduler)
        without a model object per card.
        """
        return await _node_by_node(nodes, lambda some: self._read_nodes(some, vendor), _not_text)

    async def _read_nodes(
        self, nodes: Sequence[str], vendor: str | None
    ) -> dict[str, NodeCards | BadRecord]:
        nodes, bad = _named(nodes)
        pipe = self.redis.pipeline(transaction=False)
        metas = []
        for node in nodes:
            keys = self.node_keys(node)
            pipe.hgetall(keys.gpus)
            pipe.hmget(keys.meta, ["devices", "rev", "rebuilt", "epoch", "dra"])
            metas.append(keys.meta)
        # one server: its epoch in the same round trip; a cluster: one INFO per primary
        single = not isinstance(self.redis, RedisCluster) and bool(nodes)
        if single:
            pipe.info("replication")
        replies = await pipe.execute()
        epochs = [_replid(replies[-1])] * len(nodes) if single else await self._epochs(metas)
        result: dict[str, NodeCards | BadRecord] = dict(bad)
        for i, node in enumerate(nodes):
            fields = cast(dict[str, str], replies[2 * i])
            devices, rev, rebuilt, stamp_epoch, dra = replies[2 * i + 1]
            # stamped in this epoch, as the scripts check it
            trusted = rebuilt is not None and _text(stamp_epoch or "") == epochs[i]
            try:
                cards = stored_cards(node, devices, fields)
                if vendor is not None:
                    cards = [c for c in cards if c.vendor == vendor]
                result[node] = NodeCards(
                    cards, _stored_rev(node, rev), trusted, _text(dra or "") == "1"
                )
            except BadRecord as exc:
                result[node] = exc
        return result

    @_gated
    async def revisions(self, nodes: Sequence[str]) -> dict[str, int | None]:
        """Each node's revision: it grows with every change to the node's cards or usage.

        None for a node whose revision cannot be read (:meth:`read_nodes` says why).
        """
        return await _node_by_node(nodes, self._revisions, lambda _: None)

    async def _revisions(self, nodes: Sequence[str]) -> dict[str, int | None]:
        nodes, bad = _named(nodes)
        pipe = self.redis.pipeline(transaction=False)
        for node in nodes:
            pipe.hget(self.node_keys(node).meta, "rev")
        replies = await pipe.execute()
        result: dict[str, int | None] = dict.fromkeys(bad)
        for node, rev in zip(nodes, replies, strict=True):
            try:
                result[node] = _stored_rev(node, rev)
            except BadRecord:
                result[node] = None
        return result

    # ------------------------------------------------------------ pods

    async def reserve(self, placement: Placement) -> Placement:
        """Reserve every device of ``placement`` at once, or nothing.

        Retrying with the same pod UID returns the live reservation. Raises
        ReservationConflict when a card cannot take it, AlreadyReserved when the
        pod is reserved, or being reserved, on another node.
        """
        return (await self.reserve_new(placement)).placement

    async def restore(self, placement: Placement, running: bool) -> tuple[Placement, bool]:
        """Put back a pod's reservation from its own durable record (after Redis lost
        it): as allocated when its containers run, else reserved then bound, as a
        bound pod is. Allowed on a node not yet rebuilt (that is how it is
        rebuilt). The cards must be known and have room: health and cordons are
        not checked (the pod holds the cards already), capacity and exclusivity
        are, so records that claim more than a card holds (an outdated one) never
        all count; the one refused raises ReservationConflict. Returns the
        placement and whether this call restored it."""
        state = "allocated" if running else "bound"
        restored, new, _ = await self.reserve_new(placement, restoring=state)
        if new and not running:
            restored = await self.mark_bound(placement.pod.uid, placement.node)
        return restored, new

    async def record_claim(self, placement: Placement) -> Reservation:
        """Record a prepared ResourceClaim (DRA: ``placement.claim``) as allocated at
        once, in one step, counted as kube-scheduler counts what it allocated: the
        cards must be the node's and present, and the sums of memory and cores on
        each must fit it (no exclusive card, no split count, health and cordons not
        checked: the pod is bound to the cards already), and the node must be in
        DRA mode (else ReservationConflict with reason ``NodeNotDra``). Idempotent:
        the pod's live placement of the same claim is returned as it is
        (``created`` False); one of another claim, or made without one, raises
        :class:`ClaimConflict`."""
        if placement.claim is None:
            raise ValueError("record_claim needs a placement with its claim")
        made = await self.reserve_new(placement, restoring="prepared")
        held = made.placement.claim
        if not made.created and (held is None or held.uid != placement.claim.uid):
            raise ClaimConflict(placement.pod.uid, placement.claim, held)
        return made

    @_gated
    async def reserve_new(self, placement: Placement, *, restoring: str = "") -> Reservation:
        """:meth:`reserve`, also saying whether this call made the reservation or
        found the pod's live one on the node, and the node's revision it made.
        ``restoring`` is for :meth:`restore` and :meth:`record_claim` only. Raises
        LedgerRebuilding on a node not stamped rebuilt."""
        uid, node = placement.pod.uid, placement.node
        keys = self.node_keys(node).all()
        footprint = [
            [u, fp.memory_mib, fp.cores, fp.slots, int(fp.exclusive), fp.mig_mask]
            for u, fp in sorted(placement.footprint().items())
        ]
        record = placement.model_dump(mode="json", include=RECORD_FIELDS)
        args = [uid, json.dumps(record), json.dumps(footprint), restoring]
        reply = ["fallback"]
        if self.fast_reserve:
            token = uuid.uuid4().hex[:16]
            index = self.pod_index_key(uid)
            reply = await self._run("claim_reserve", [*keys, index], [*args, token, node])
        if reply[0] == "fallback":
            reply = await self._reserve_in_steps(uid, node, keys, args)
        if reply[0] == "rebuilding":
            raise LedgerRebuilding(node)
        if reply[0] == "fail":
            raise ReservationConflict(node, reply[1], reply[2])
        made = reply[0] == "ok"
        return Reservation(_placement_from_record(reply[1]), made, int(reply[2]) if made else 0)

    async def _reserve_in_steps(
        self, uid: str, node: str, keys: list[str], args: list[Any]
    ) -> list[str]:
        """Claim the pod index, run the reserve script, confirm the claim: the
        reserve script's reply. Three round trips, for an index and node keys on
        different servers, or an index that names another node."""
        mine, shared = await self._claim(uid, node)
        reply = await self._run("reserve", keys, args)
        if reply[0] in ("fail", "rebuilding"):
            if not shared:
                await self._index("abandon", uid, mine)
            return reply
        [confirmed] = await self._index("confirm", uid, mine, node)
        if confirmed != "ok":
            # Our claim was taken over (it outlived its lease): the other node wins.
            await self._free(node, uid, "claim lost")
            raise AlreadyReserved(uid, _index_node(confirmed) or "another node")
        return reply

    async def _claim(self, uid: str, node: str) -> tuple[str, bool]:
        """Claim the pod index for ``node``; returns (our claim, shared with another call)."""
        token = uuid.uuid4().hex[:16]
        reply = await self._index("claim", uid, node, token)
        for _ in range(8):
            if reply[0] != "busy":
                mine, previous = reply[1], reply[2]
                await self._finish_interrupted_release(uid, previous, node)
                return mine, mine == previous
            current, age_ms = reply[1], int(reply[2])
            if not current:  # the index vanished in between: claim afresh
                reply = await self._index("claim", uid, node, token)
                continue
            other = _index_node(current)
            if other == node:  # another call for this node claimed it first: share it
                return current, True
            stale = not current.startswith("claimed:") or age_ms >= self.claim_lease_ms
            if not stale or await self._live_on(other, uid):
                raise AlreadyReserved(uid, other)
            reply = await self._index("takeover", uid, current, node, token)
        raise AlreadyReserved(uid, "another node (the pod index keeps changing)")

    async def _finish_interrupted_release(self, uid: str, previous: str, node: str) -> None:
        """A release marks the index first; if it died before freeing the cards, free them."""
        other = _index_node(previous)
        if previous.startswith("released:") and other != node and await self._live_on(other, uid):
            await self._free(other, uid, "interrupted release")

    async def _free(
        self, node: str, uid: str, reason: str, kubelet_may_admit: bool = True
    ) -> list[str]:
        """Run the release script for ``uid`` on ``node``."""
        keys = self.node_keys(node).all()
        ghost = "1" if kubelet_may_admit else "0"
        return await self._run("release", keys, [uid, reason, self.released_retention_ms, ghost])

    async def _index(self, op: str, uid: str, *args: Any) -> list[str]:
        return await self._run("index", [self.pod_index_key(uid)], [op, *args])

    @_gated
    async def mark_bound(
        self, pod_uid: str, node: str | None = None, *, exclusive: bool = False
    ) -> Placement:
        """Move a reservation to ``bound``: kubelet may now ask to allocate it.

        Pass the node when known, to save looking it up in the pod index.
        ``exclusive``: raise :class:`NodeBusy`, binding nothing, while another pod
        bound to the node waits for kubelet to allocate a container of ours, so
        that kubelet's Allocate calls, which name no pod, are never ambiguous.
        """
        node = node or await self._node_of(pod_uid)
        reply = await self._run(
            "bind", self.node_keys(node).all(), [pod_uid, "1" if exclusive else "0"]
        )
        if reply[0] == "rebuilding":
            raise LedgerRebuilding(node)
        if reply[0] == "busy":
            raise NodeBusy(node, reply[1])
        if reply[0] != "ok":
            raise NotReserved(f"pod {pod_uid} has no live reservation to bind ({reply[0]})")
        return _placement_from_record(reply[1])

    async def mark_bound_in_turn(
        self,
        pod_uid: str,
        node: str,
        wait: float,
        changed: Callable[[str, float], Awaitable[None]] | None = None,
    ) -> tuple[Placement, bool]:
        """:meth:`mark_bound` ``exclusive``, waiting up to ``wait`` seconds for the
        node's turn. ``changed(node, timeout)`` returns at the node's next change
        notice (the allocation or release that passes the turn announces the
        node) or after ``timeout``; without it, or where notices are lost, the
        bind looks again after 20 ms, doubling to 250 ms. Returns the placement
        and whether it waited; raises the last :class:`NodeBusy`."""
        deadline = time.monotonic() + wait
        delay, waited = TURN_POLL_FIRST_S, False
        while True:
            try:
                return await self.mark_bound(pod_uid, node, exclusive=True), waited
            except NodeBusy:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise
            waited = True
            pause = min(delay, left)
            await (changed(node, pause) if changed is not None else asyncio.sleep(pause))
            delay = min(delay * 2, TURN_POLL_MAX_S)

    @_gated
    async def allocate(self, node: str, count: int, request_id: str | None = None) -> Allocation:
        """Take the next container of the bound pod on ``node`` whose next container
        asks for ``count`` GPUs. Raises :class:`AmbiguousAllocation` where more than
        one such pod waits (kubelet's call names none), NotReserved where none does.

        Pass the same ``request_id`` when retrying one kubelet call: the answer is
        remembered, so a retry never hands out a second container. Raises
        LedgerRebuilding while the node is not stamped rebuilt: wait and retry.
        """
        allocation = await self._allocate(node, count, request_id or uuid.uuid4().hex, peek=False)
        if isinstance(allocation, int):
            raise NotReserved(
                f"no bound pod on node {node} waits for a container with {count} GPU(s) "
                f"({allocation} pod(s) pending)"
            )
        return allocation

    @_gated
    async def next_allocation(self, node: str, count: int) -> Allocation | None:
        """The container ``allocate`` would hand out now, without handing it out."""
        allocation = await self._allocate(node, count, "peek", peek=True)
        return None if isinstance(allocation, int) else allocation

    async def _allocate(
        self, node: str, count: int, request_id: str, *, peek: bool
    ) -> Allocation | int:
        """The allocation, or the number of pods pending when none matches."""
        keys = self.node_keys(node)
        answer_key = f"{keys.gpus.removesuffix(':gpus')}:alloc:{request_id}"
        reply = await self._run(
            "allocate",
            [*keys.all(), answer_key],
            [count, self.answer_retention_s, "1" if peek else "0"],
        )
        if reply[0] == "rebuilding":
            raise LedgerRebuilding(node)
        if reply[0] == "dra":
            raise ServesDra(node)
        if reply[0] == "ambiguous":
            raise AmbiguousAllocation(node, count, json.loads(reply[1]))
        if reply[0] != "ok":
            return int(reply[1])
        answer = json.loads(reply[1])
        placement = _placement_from_record(json.dumps(answer["record"]))
        return Allocation(
            placement=placement,
            container_index=int(answer["index"]),
        )

    @_gated
    async def release(
        self, pod_uid: str, reason: str = "", *, kubelet_may_admit: bool = True
    ) -> Release | None:
        """Give a pod's devices back. Returns None if the ledger never had it.

        A pod released while bound with a container of ours not yet allocated
        stays a ghost for 30 s (lua/lib.lua): kubelet, lagging its watch, may
        still admit it, so it keeps the node's turn and an Allocate it could be
        meant by is refused as ambiguous. ``kubelet_may_admit=False`` where no
        Binding was made (a bind undone), so none is kept.

        The index is marked released first (compare-and-swap on the value read),
        then the node's cards are freed: a reserve that slips in between finds the
        pod released and claims afresh, so no live reservation is left unreachable.
        """
        ttl = max(1, self.released_retention_ms // 1000)
        key = self.pod_index_key(pod_uid)
        for _ in range(8):
            value = await self._get(key)
            if value is None:
                return None
            [marked] = await self._index("release", pod_uid, value, ttl)
            if marked == "ok":
                break
        else:
            raise LedgerError(f"the index of pod {pod_uid} keeps changing; release not done")
        reply = await self._free(_index_node(value), pod_uid, reason, kubelet_may_admit)
        if reply[0] == "absent":
            return None
        first = reply[0] == "ok"
        clamped = int(reply[2]) if first else 0
        return Release(_placement_from_record(reply[1]), first=first, clamped=clamped)

    @_gated
    async def placement(self, pod_uid: str) -> Placement | None:
        node = await self._index_node_of(pod_uid)
        if node is None:
            return None
        raw = await self.redis.hget(self.node_keys(node).pods, pod_uid)
        return None if raw is None else _placement_from_record(_text(raw))

    @_gated
    async def node_placements(self, node: str) -> list[Placement]:
        """Every placement recorded on ``node``; BadRecord if one cannot be read."""
        if bad := _named([node])[1]:
            raise bad[node]
        raw = await self.redis.hgetall(self.node_keys(node).pods)
        placements = []
        for uid, record in raw.items():
            try:
                placements.append(_placement_from_record(_text(record)))
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                problem = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                raise BadRecord(node, f"pod {_text(uid)!r:.80}: {problem[:200]}") from None
        return placements

    @_gated
    async def check_node(self, node: str) -> list[str]:
        """Compare each card's usage with the sum of live reservations; [] when consistent."""
        keys = self.node_keys(node)
        pipe = self.redis.pipeline(transaction=True)
        pipe.hgetall(keys.gpus)
        pipe.hgetall(keys.pods)
        gpus, pods = await pipe.execute()
        problems = await self._index_mismatches(node, pods)
        expected: dict[str, list[int]] = {}
        owners: dict[str, str] = {}
        slices: dict[str, int] = {}
        counted: dict[str, int] = {}  # slots of records checked against the slot count
        for uid, raw in pods.items():
            rec = json.loads(raw)
            if rec["state"] == PlacementState.RELEASED:
                continue
            for u, mem, cores, slots, excl, *mig in rec["footprint"]:
                if rec.get("claim") is None:  # a claim's are not: kube-scheduler sums shares
                    counted[u] = counted.get(u, 0) + slots
                acc = expected.setdefault(u, [0, 0, 0])
                acc[0] += mem
                acc[1] += cores
                acc[2] += slots
                if excl:
                    owners[u] = uid
                mask = mig[0] if mig else 0
                if slices.get(u, 0) & mask:
                    problems.append(f"{node}/{u}: two reservations hold the same MIG slices")
                slices[u] = slices.get(u, 0) | mask
        uuids = {k.split("|", 1)[0] for k in gpus}
        for u in sorted(uuids | set(expected)):
            used = [int(gpus.get(f"{u}|{f}", 0)) for f in ("mem", "cores", "slots")]
            want = expected.get(u, [0, 0, 0])
            if used != want:
                problems.append(f"{node}/{u}: usage {used} but reservations sum to {want}")
            caps = [int(gpus.get(f"{u}|{f}", 0)) for f in ("cap_mem", "cap_cores", "cap_slots")]
            held = [used[0], used[1], counted.get(u, 0)]
            if gpus.get(f"{u}|present") == "1" and any(
                a > c for a, c in zip(held, caps, strict=True)
            ):
                problems.append(f"{node}/{u}: usage {used} exceeds capacity {caps}")
            if gpus.get(f"{u}|owner", "") != owners.get(u, ""):
                problems.append(f"{node}/{u}: exclusive owner differs from reservations")
            if int(gpus.get(f"{u}|mig_used", 0)) != slices.get(u, 0):
                problems.append(f"{node}/{u}: MIG slices in use differ from reservations")
        return problems

    async def _index_mismatches(self, node: str, pods: dict[str, str]) -> list[str]:
        """Live reservations on ``node`` that the pod index does not lead to, or calls released."""
        live = [uid for uid, raw in pods.items() if json.loads(raw)["state"] != "released"]
        if not live:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for uid in live:
            pipe.get(self.pod_index_key(uid))
        values = await pipe.execute()
        return [
            f"{node}: pod {uid} is reserved here but its index says {value!r}"
            for uid, value in zip(live, values, strict=True)
            if value is None
            or _index_node(_text(value)) != node
            or _text(value).startswith("released:")
        ]

    # ------------------------------------------------------------ helpers

    async def _index_node_of(self, pod_uid: str) -> str | None:
        value = await self._get(self.pod_index_key(pod_uid))
        return None if value is None else _index_node(value)

    async def _node_of(self, pod_uid: str) -> str:
        node = await self._index_node_of(pod_uid)
        if node is None:
            raise NotReserved(f"pod {pod_uid} has no reservation")
        return node

    async def _live_on(self, node: str, pod_uid: str) -> bool:
        raw = await self.redis.hget(self.node_keys(node).pods, pod_uid)
        return raw is not None and json.loads(raw)["state"] != PlacementState.RELEASED


# ---------------------------------------------------------------- reading what is stored
#
# Every number the ledger keeps is written by Redis as plain decimal digits, and
# every one has a bound (gpuslice_common.models). Anything else (a float such as
# "1e+17", a sign, a value beyond its bound, a missing field) was not written by
# this version of gpuslice: the node is refused whole with BadRecord, so a reader
# never acts on half of a card.

MAX_USAGE = 2**40  # a card's usage counters; far beyond any capacity
MAX_MS = 2**53  # a time in milliseconds since the epoch
MAX_REV = 2**63 - 1  # Redis's own integer range
_CARD_NUMBERS: dict[str, int] = {
    "index": MAX_DEVICES - 1,
    "memory": MAX_DEVICE_MEMORY_MIB,
    "cap_mem": MAX_CAPACITY_MIB,
    "cap_cores": MAX_CAPACITY_CORES,
    "cap_slots": MAX_SPLIT_COUNT,
    "mem": MAX_USAGE,
    "cores": MAX_USAGE,
    "slots": MAX_USAGE,
}
_USAGE = ("mem", "cores", "slots")  # absent reads as 0: a card registered, never used
_UUID = re.compile(DEVICE_UUID_PATTERN)
_PRINTABLE = re.compile(PRINTABLE_PATTERN)
_VENDOR = re.compile(VENDOR_PATTERN)


def stored_number(node: str, what: str, value: Any, high: int) -> int:
    """A whole number as the ledger stores it: decimal digits only, at most ``high``.

    Raises BadRecord naming the node, the field and the value (shortened, escaped).
    """
    text = _text(value)
    if not (0 < len(text) <= 19 and text.isascii() and text.isdigit()):
        raise BadRecord(node, f"{what} is {text[:32]!r}, not a whole number")
    number = int(text)
    if number > high:
        raise BadRecord(node, f"{what} is {number}, above its bound {high}")
    return number


def _stored_rev(node: str, value: Any) -> int:
    return 0 if value is None else stored_number(node, "revision", value, MAX_REV)


def _replid(info: Any) -> str:
    """The primary's replication id from INFO replication, as the client parsed it."""
    if isinstance(info, dict):
        return _text(info.get("master_replid", ""))
    found = re.search(r"master_replid:([0-9a-f]+)", _text(info))
    return found.group(1) if found else ""


def _stored_time(node: str, what: str, value: Any) -> datetime | None:
    if value is None:
        return None
    return datetime.fromtimestamp(stored_number(node, what, value, MAX_MS) / 1000, UTC)


def stored_cards(node: str, devices: Any, fields: dict[str, str]) -> list[StoredCard]:
    """A node's cards from its ``devices`` list (JSON, meta hash) and its card fields.

    Cards listed without fields (being removed) are left out. Raises BadRecord
    when anything stored is not what gpuslice writes.
    """
    try:
        order = json.loads(_text(devices)) if devices is not None else []
    except ValueError:
        order = None
    if not isinstance(order, list) or not all(isinstance(u, str) for u in order):
        raise BadRecord(node, "its list of cards is not a JSON list of UUIDs")
    cards = []
    for u in order:
        if f"{u}|index" not in fields:
            continue
        if len(u) > MAX_NAME_LENGTH or not _UUID.fullmatch(u):
            raise BadRecord(node, f"card UUID {u[:32]!r} is not one a node reports")
        numbers: dict[str, int] = {}
        for name, high in _CARD_NUMBERS.items():
            value = fields.get(f"{u}|{name}")
            if value is None and name in _USAGE:
                value = "0"
            elif value is None:
                raise BadRecord(node, f"card {u} has no {name}")
            numbers[name] = stored_number(node, f"card {u} {name}", value, high)
        model = fields.get(f"{u}|model", "")
        if len(model) > MAX_NAME_LENGTH or not _PRINTABLE.fullmatch(model):
            raise BadRecord(node, f"card {u} model {model[:32]!r} is not one a node reports")
        numa = fields.get(f"{u}|numa", "")
        vendor = fields.get(f"{u}|vendor", NVIDIA)
        if len(vendor) > 32 or not _VENDOR.fullmatch(vendor):
            raise BadRecord(node, f"card {u} vendor {vendor[:32]!r} is not one gpuslice writes")
        mode = _stored_mode(node, u, fields)
        cards.append(
            StoredCard(
                uuid=u,
                index=numbers["index"],
                model=model,
                memory_mib=numbers["memory"],
                numa=None
                if numa == ""
                else stored_number(node, f"card {u} numa", numa, MAX_NUMA_NODE),
                healthy=fields.get(f"{u}|healthy") == "1",
                mig=fields.get(f"{u}|mig") == "1",
                cap_mem=numbers["cap_mem"],
                cap_cores=numbers["cap_cores"],
                cap_slots=numbers["cap_slots"],
                used_mem=numbers["mem"],
                used_cores=numbers["cores"],
                used_slots=numbers["slots"],
                owner=fields.get(f"{u}|owner", ""),
                present=fields.get(f"{u}|present") == "1",
                cordoned=fields.get(f"{u}|cordoned") == "1",
                vendor=vendor,
                mode=mode,
                mig_state=stored_mig(node, u, fields) if mode is VgpuMode.MIG else None,
                layers=stored_layers(node, u, fields),
            )
        )
    return cards


# MIG facts of a card, stored compactly (``mig_profiles``, ``mig_instances``: JSON
# lists) with the masks the scripts check reservations against (``mig_slices``,
# ``mig_static``; ``mig_used`` is the reservations' own). Bounded as the models
# bound them: at most MAX_MIG_PROFILES profiles of MAX_MIG_SLICES placements each.
MAX_MIG_JSON = 16384
_MIG_MASK_HIGH = (1 << MAX_MIG_SLICES) - 1


def _mig_fields(device: GpuDevice) -> dict[str, Any]:
    """A card's MIG facts as register.lua stores them ("" where the card is not in mode mig)."""
    if device.mode is not VgpuMode.MIG:
        return {
            "mode": device.mode.value,
            "mig_profiles": "",
            "mig_instances": "",
            "mig_slices": 0,
            "mig_static": 0,
        }
    profiles = [
        [p.name, p.memory_mib, p.cores, p.slices, [[q.start, q.size] for q in p.placements]]
        for p in device.mig_profiles
    ]
    instances = [
        [i.uuid, i.profile, i.placement.start, i.placement.size] for i in device.mig_instances
    ]
    return {
        "mode": device.mode.value,
        "mig_profiles": json.dumps(profiles, separators=(",", ":")),
        "mig_instances": json.dumps(instances, separators=(",", ":")),
        "mig_slices": device.mig_slice_mask,
        "mig_static": device.mig_static_mask,
    }


@dataclass(frozen=True, slots=True)
class StoredMig:
    """A card's MIG facts and use as stored, checked (:func:`stored_mig`)."""

    profiles: tuple[MigProfile, ...]
    instances: tuple[MigInstance, ...]
    slices: int  # every slice of the card
    static: int  # taken by the static instances
    used: int  # taken by gpuslice's reservations


def _mig_json(node: str, u: str, what: str, fields: dict[str, str]) -> list[Any]:
    raw = fields.get(f"{u}|{what}", "")
    if len(raw) > MAX_MIG_JSON:
        raise BadRecord(node, f"card {u} {what} is {len(raw)} characters long")
    try:
        value = json.loads(raw)
    except ValueError:
        value = None
    if not isinstance(value, list):
        raise BadRecord(node, f"card {u} {what} is not a JSON list")
    return value


def stored_mig(node: str, u: str, fields: dict[str, str]) -> StoredMig:
    """The MIG facts of card ``u`` (mode mig): every profile, instance and mask is
    checked as the models check a node's report, and the stored masks must be the
    ones the profiles and instances make. Raises BadRecord."""
    profiles = _mig_json(node, u, "mig_profiles", fields)
    instances = _mig_json(node, u, "mig_instances", fields)
    try:
        device = GpuDevice(
            uuid=u,
            index=0,
            model="mig",
            memory_mib=1,
            mode=VgpuMode.MIG,
            mig_profiles=tuple(
                MigProfile(
                    name=name,
                    memory_mib=mem,
                    cores=cores,
                    slices=slices,
                    placements=tuple(MigPlacement(start=a, size=b) for a, b in places),
                )
                for name, mem, cores, slices, places in profiles
            ),
            mig_instances=tuple(
                MigInstance(uuid=iu, profile=name, placement=MigPlacement(start=a, size=b))
                for iu, name, a, b in instances
            ),
        )
    except (ValueError, TypeError) as exc:  # ValidationError is a ValueError
        problem = str(exc).splitlines()
        detail = problem[-2].strip() if len(problem) > 1 else str(exc)
        raise BadRecord(node, f"card {u} MIG facts: {detail[:200]}") from None
    masks = {
        name: stored_number(
            node, f"card {u} {name}", fields.get(f"{u}|{name}", "0"), _MIG_MASK_HIGH
        )
        for name in ("mig_slices", "mig_static", "mig_used")
    }
    if (
        masks["mig_slices"] != device.mig_slice_mask
        or masks["mig_static"] != device.mig_static_mask
    ):
        raise BadRecord(node, f"card {u}: its MIG masks are not its profiles' and instances'")
    if masks["mig_used"] & ~device.mig_slice_mask:
        raise BadRecord(node, f"card {u}: MIG slices in use lie outside the card")
    return StoredMig(
        device.mig_profiles,
        device.mig_instances,
        masks["mig_slices"],
        masks["mig_static"],
        masks["mig_used"],
    )


# Which enforcement layers hold a card's containers (CardLayers), as the node agent
# reported it: compact JSON, "" where its agent reports none (older agents).
MAX_LAYERS_JSON = 1024


def _layers_field(layers: CardLayers | None) -> str:
    return "" if layers is None else layers.model_dump_json(exclude_defaults=True)


def stored_layers(node: str, u: str, fields: dict[str, str]) -> CardLayers | None:
    """Card ``u``'s layer report, checked as the models check a node's; raises BadRecord."""
    raw = fields.get(f"{u}|layers", "")
    if not raw:
        return None
    if len(raw) > MAX_LAYERS_JSON:
        raise BadRecord(node, f"card {u} layers is {len(raw)} characters long")
    try:
        return CardLayers.model_validate_json(raw)
    except ValueError:
        raise BadRecord(node, f"card {u} layers is not a layer report") from None


def _stored_mode(node: str, u: str, fields: dict[str, str]) -> VgpuMode:
    raw = fields.get(f"{u}|mode", VgpuMode.HAMI_CORE.value)  # absent: written before modes
    try:
        return VgpuMode(raw)
    except ValueError:
        raise BadRecord(node, f"card {u} mode {raw[:32]!r} is no sharing mode") from None


def _all_read(read: dict[str, T | BadRecord]) -> dict[str, T]:
    """The values of ``read``; raises the first BadRecord among them."""
    for value in read.values():
        if isinstance(value, BadRecord):
            raise value
    return read  # type: ignore[return-value]


def _gpu_state(node: str, card: StoredCard) -> GpuState:
    try:
        return GpuState(
            node=node,
            device=GpuDevice(
                uuid=card.uuid,
                index=card.index,
                model=card.model,
                memory_mib=card.memory_mib,
                numa=card.numa,
                healthy=card.healthy,
                mig=card.mig,
                vendor=card.vendor,
                mode=card.mode,
                mig_profiles=card.mig_state.profiles if card.mig_state else (),
                mig_instances=card.mig_state.instances if card.mig_state else (),
            ),
            capacity=GpuCapacity(
                memory_mib=card.cap_mem, cores=card.cap_cores, slots=card.cap_slots
            ),
            used=GpuUsage(
                memory_mib=card.used_mem,
                cores=card.used_cores,
                slots=card.used_slots,
                exclusive_owner=card.owner or None,
                mig_mask=card.mig_state.used if card.mig_state else 0,
            ),
            present=card.present,
            cordoned=card.cordoned,
            layers=card.layers,
        )
    except ValueError as exc:  # within the bounds, yet not a device (memory 0)
        problem = str(exc).splitlines()
        detail = problem[1].strip() if len(problem) > 1 else str(exc)
        raise BadRecord(node, f"card {card.uuid}: {detail}") from None


__all__ = [
    "RECORD_FIELDS",
    "Allocation",
    "AlreadyReserved",
    "BadRecord",
    "ClaimConflict",
    "Ledger",
    "LedgerError",
    "LedgerRebuilding",
    "LedgerUnavailable",
    "NodeCards",
    "NodeKeys",
    "NodeLiveness",
    "NodeRebuild",
    "NotReserved",
    "Release",
    "ReservationConflict",
    "ServesDra",
    "StoredCard",
    "StoredMig",
    "stored_cards",
    "stored_mig",
    "stored_number",
]
