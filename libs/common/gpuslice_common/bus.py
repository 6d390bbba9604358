"""The NATS bus: connect with reconnect, publish and subscribe typed messages,
and keep the JetStream audit stream that records every event.

A malformed message is logged and counted in :class:`BusStats`; it never reaches
a handler and never stops a subscription. A handler that raises is logged and
counted the same way.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import math
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, TypeVar

import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import Error as NatsError
from nats.errors import MaxPayloadError, NoServersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import (
    ConsumerConfig,
    DeliverPolicy,
    RetentionPolicy,
    StorageType,
    StreamConfig,
    StreamInfo,
)
from nats.js.errors import NotFoundError
from pydantic import BaseModel, ValidationError

from gpuslice_common.config import BusSettings, without_password
from gpuslice_common.events import CloudEvent, EventError, parse_event
from gpuslice_common.subjects import Subjects

log = logging.getLogger("gpuslice.bus")

M = TypeVar("M", bound=BaseModel)
EventHandler = Callable[[CloudEvent], Awaitable[None]]
MessageHandler = Callable[[str, M], Awaitable[None]]

DEDUP_WINDOW = timedelta(minutes=2)
# what nats-py reports for a server's -ERR on a publish the user may not make
_DENIED_PUBLISH = re.compile(r'permissions violation for publish to "?([^"\s]+)', re.IGNORECASE)


async def flush_client(nc: NATS, timeout: float = 2) -> None:
    """``nc.flush()`` that keeps its promise: once it returns, the server has
    every command sent before it. nats-py writes a flush's PING to the socket at
    once, ahead of commands (a SUB, PUBs) still queued for its flusher task, so
    its PONG can come back before the server has seen them: a subscription
    "flushed" that way may miss a message published right after. Waits for the
    queue to be written first (the flusher empties it in one turn of the loop;
    within ``timeout`` whatever else is publishing meanwhile)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    # nats-py signals nothing when its queue empties: yield until it has
    while nc.pending_data_size and nc.is_connected and loop.time() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0)
    await nc.flush(max(1, math.ceil(timeout)))


class BusError(Exception):
    """The bus could not do what was asked; the message says why."""


class EventRefused(BusError):
    """This very event can never be published (an invalid payload, larger than
    NATS takes): sending it again cannot help."""


def nats_reason(exc: BaseException) -> str:
    """What went wrong talking to NATS, in words for a message: the client's own
    text without its ``nats:`` prefix, never a repr such as ``NoServersError()``."""
    if isinstance(exc, NoServersError):
        return "no server answered there"
    text = str(exc).strip()
    while text.startswith("nats:"):
        text = text.removeprefix("nats:").strip()
    if text:
        return text
    if isinstance(exc, TimeoutError | NatsTimeoutError):
        return "timed out"
    return type(exc).__name__


def _read_token(path: str) -> str:
    """The token file as it is now (kubelet replaces it before it expires)."""
    try:
        with open(path, encoding="utf-8") as file:
            return file.read().strip()
    except OSError as exc:
        log.warning("nats: cannot read the token file %s: %s", path, exc)
        return ""


@dataclass
class BusStats:
    published: int = 0
    publish_failures: int = 0
    received: int = 0
    malformed: int = 0
    handler_errors: int = 0
    disconnects: int = 0
    reconnects: int = 0
    last_malformed: str = field(default="", repr=False)
    closing: bool = field(default=False, repr=False)
    # subjects the server refused this connection to publish to (its -ERR comes
    # apart from the publish; an acknowledgement that never came is then why)
    denied_subjects: set[str] = field(default_factory=set, repr=False)


class Bus:
    """One component's connection to NATS. Create with :meth:`connect`."""

    def __init__(self, nc: NATS, subjects: Subjects, source: str, stats: BusStats) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.subjects = subjects
        self.source = source
        self.stats = stats

    @classmethod
    async def connect(
        cls,
        settings: BusSettings,
        name: str,
        *,
        connect_timeout: float = 2.0,
        reconnect_wait: float = 0.5,
        first_connect_wait: float | None = None,
        inbox_prefix: str = "_INBOX",
    ) -> Bus:
        """Connect, reconnecting forever after a drop. ``name`` identifies the component.

        The first connection is tried for about ``first_connect_wait`` seconds
        (default: the ``connect_wait`` setting) before BusError; once connected, a
        lost server is retried without end. ``inbox_prefix`` is where replies
        come (a node agent may subscribe only below its own).
        """
        if first_connect_wait is None:
            first_connect_wait = settings.connect_wait.total_seconds()
        stats = BusStats()

        async def on_error(exc: Exception) -> None:
            log.warning("nats: %s", exc)
            if denied := _DENIED_PUBLISH.search(str(exc)):
                stats.denied_subjects.add(denied.group(1))

        async def on_disconnect() -> None:
            if stats.closing:
                return
            stats.disconnects += 1
            log.warning("nats: disconnected from %s", without_password(settings.nats_url))

        async def on_reconnect() -> None:
            stats.reconnects += 1
            log.info("nats: reconnected")

        options: dict[str, Any] = {
            "name": name,
            "connect_timeout": connect_timeout,
            "reconnect_time_wait": reconnect_wait,
            "max_reconnect_attempts": max(1, math.ceil(first_connect_wait / reconnect_wait)),
            "allow_reconnect": True,
            "error_cb": on_error,
            "disconnected_cb": on_disconnect,
            "reconnected_cb": on_reconnect,
            "inbox_prefix": inbox_prefix,
            # a stop waits at most this for subscriptions to drain (the
            # default, 30 s, outlasts a pod's grace period)
            "drain_timeout": 2,
        }
        if settings.nats_user:
            options["user"] = settings.nats_user
            options["password"] = settings.nats_password or ""
        if settings.nats_creds_file:
            options["user_credentials"] = settings.nats_creds_file
        if settings.nats_token_file:
            options["token"] = functools.partial(_read_token, settings.nats_token_file)
        servers = [s.strip() for s in settings.nats_url.split(",")]
        try:
            nc = await nats.connect(servers, **options)
        except (TimeoutError, OSError, NatsError) as exc:
            where = without_password(settings.nats_url)
            raise BusError(f"cannot connect to NATS at {where}: {nats_reason(exc)}") from None
        nc.options["max_reconnect_attempts"] = -1
        return cls(nc, Subjects(settings.subject_prefix), source=f"/gpuslice/{name}", stats=stats)

    @property
    def connected(self) -> bool:
        return bool(self.nc.is_connected)

    async def close(self) -> None:
        """Drain and close; never raises, whatever state the connection is in
        (closing while NATS is away must not turn a clean shutdown into a crash)."""
        if self.nc.is_closed:
            return
        self.stats.closing = True
        try:
            await self.nc.drain()
        except Exception as exc:  # reconnecting, timed out, or the socket is gone
            log.debug("nats: drain at close failed (%r); closing", exc)
            try:
                await self.nc.close()
            except Exception as again:
                log.warning("nats: close failed: %r", again)

    # ------------------------------------------------------------ publishing

    async def publish(self, event: CloudEvent) -> None:
        """Publish without waiting for the server; buffered across a reconnect.

        The event id doubles as ``Nats-Msg-Id``, so the audit stream stores a
        retried event once.
        """
        subject = self._checked_subject(event)
        payload = self._fitting(event)
        try:
            await self.nc.publish(subject, payload, headers={"Nats-Msg-Id": event.id})
        except (NatsError, OSError) as exc:
            self.stats.publish_failures += 1
            raise BusError(f"cannot publish {event.type.value}: {exc}") from None
        self.stats.published += 1

    async def publish_acked(self, event: CloudEvent, timeout: float = 2.0) -> int:
        """Publish and wait until the audit stream has stored it; returns its sequence."""
        subject = self._checked_subject(event)
        payload = self._fitting(event)
        try:
            ack = await self.js.publish(
                subject, payload, timeout=timeout, headers={"Nats-Msg-Id": event.id}
            )
        except MaxPayloadError as exc:
            self.stats.publish_failures += 1
            raise EventRefused(f"{event.type.value} {event.id} is too large: {exc}") from None
        except (TimeoutError, NatsError, OSError) as exc:
            self.stats.publish_failures += 1
            if subject in self.stats.denied_subjects:
                raise EventRefused(
                    f"NATS does not let {self.source} publish {event.type.value} to {subject}"
                ) from None
            raise BusError(
                f"audit stream did not store {event.type.value}: {nats_reason(exc)}"
            ) from None
        self.stats.denied_subjects.discard(subject)
        self.stats.published += 1
        return int(ack.seq)

    def _fitting(self, event: CloudEvent) -> bytes:
        """The event's bytes, refused when they and the headers exceed what the
        server takes: nats-py checks the payload alone, and the server closes a
        connection that sends more (for good: the client does not reconnect)."""
        payload = event.to_json()
        headers = len(b"NATS/1.0\r\nNats-Msg-Id: \r\n\r\n") + len(event.id.encode())
        limit = self.nc.max_payload
        if limit and len(payload) + headers > limit:
            self.stats.publish_failures += 1
            raise EventRefused(
                f"{event.type.value} {event.id} is too large: {len(payload) + headers} bytes"
                f" with headers, the server takes {limit}"
            )
        return payload

    def _checked_subject(self, event: CloudEvent) -> str:
        """Validate the payload once more (its dict may have been changed) and route it."""
        try:
            event.payload()
        except ValidationError as exc:
            self.stats.publish_failures += 1
            raise EventRefused(
                f"refusing to publish an invalid {event.type.value}: {exc}"
            ) from None
        return self.subjects.event(event.type)

    async def publish_model(self, subject: str, message: BaseModel) -> None:
        """Publish a typed non-event message (inventories, telemetry)."""
        try:
            await self.nc.publish(subject, message.model_dump_json().encode())
        except (NatsError, OSError) as exc:
            self.stats.publish_failures += 1
            raise BusError(f"cannot publish to {subject}: {exc}") from None
        self.stats.published += 1

    async def flush(self, timeout: int = 2) -> None:
        """Returns once the server has everything sent before it (subscriptions
        included); BusError when it does not confirm within ``timeout``."""
        try:
            await flush_client(self.nc, timeout)
        except (TimeoutError, NatsError) as exc:
            raise BusError(f"NATS did not confirm within {timeout}s: {nats_reason(exc)}") from None

    # ------------------------------------------------------------ subscribing

    def _malformed(self, subject: str, problem: str) -> None:
        self.stats.malformed += 1
        self.stats.last_malformed = f"{subject}: {problem}"
        log.warning("dropped malformed message on %s: %s", subject, problem)

    async def _call(self, subject: str, handler: Callable[[], Awaitable[None]]) -> None:
        try:
            await handler()
        except asyncio.CancelledError:
            raise
        except Exception:
            self.stats.handler_errors += 1
            log.exception("handler failed for a message on %s", subject)

    async def subscribe_events(
        self, subject: str, handler: EventHandler, queue: str = ""
    ) -> Subscription:
        """Deliver each valid CloudEvent on ``subject`` (wildcards allowed) to ``handler``."""

        async def on_msg(msg: Msg) -> None:
            self.stats.received += 1
            try:
                event = parse_event(msg.data)
            except EventError as exc:
                self._malformed(msg.subject, str(exc))
                return
            await self._call(msg.subject, lambda: handler(event))

        return await self.nc.subscribe(subject, queue=queue, cb=on_msg)

    async def subscribe(
        self, subject: str, model: type[M], handler: MessageHandler[M], queue: str = ""
    ) -> Subscription:
        """Deliver each message on ``subject`` that validates as ``model`` to ``handler``."""

        async def on_msg(msg: Msg) -> None:
            self.stats.received += 1
            try:
                value = model.model_validate_json(msg.data)
            except ValidationError as exc:
                errors = "; ".join(
                    f"{'.'.join(str(p) for p in e['loc']) or 'message'}: {e['msg']}"
                    for e in exc.errors()[:5]
                )
                self._malformed(msg.subject, f"not a valid {model.__name__}: {errors}")
                return
            await self._call(msg.subject, lambda: handler(msg.subject, value))

        return await self.nc.subscribe(subject, queue=queue, cb=on_msg)

    # ------------------------------------------------------------ audit stream

    def _audit_config(self, max_age: timedelta, replicas: int) -> StreamConfig:
        return StreamConfig(
            name=self.subjects.audit_stream,
            description="gpuslice allocation and admission events, for audit",
            subjects=[self.subjects.events_all],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            max_age=max_age.total_seconds(),
            duplicate_window=min(DEDUP_WINDOW, max_age).total_seconds(),
            deny_delete=True,
            deny_purge=True,
            num_replicas=replicas,
        )

    async def ensure_audit_stream(self, max_age: timedelta, replicas: int = 1) -> StreamInfo:
        """Create the audit stream, or check an existing one and bring its retention
        and its number of copies (``replicas``: 3 on a three-member cluster, so it
        survives losing any one member) up to date.

        Needs the install-time ``admin`` credential: no service may create, change
        or delete the stream. Raises BusError if an existing stream cannot be made
        to match (for example it uses memory storage, or allows deletes), rather
        than audit on a weaker one.
        """
        wanted = self._audit_config(max_age, replicas)
        name = self.subjects.audit_stream
        try:
            info = await self.js.stream_info(name)
        except NotFoundError:
            try:
                return await self.js.add_stream(wanted)
            except (TimeoutError, NatsError) as exc:
                raise BusError(f"cannot create audit stream {name}: {nats_reason(exc)}") from None
        except (TimeoutError, NatsError) as exc:
            raise BusError(f"cannot read audit stream {name}: {nats_reason(exc)}") from None
        have = info.config
        problems = _unfit_for_audit(have)
        if problems:
            raise BusError(f"existing stream {name} is unfit for audit: " + "; ".join(problems))
        if (
            set(have.subjects or []) != {self.subjects.events_all}
            or have.max_age != wanted.max_age
            or have.duplicate_window != wanted.duplicate_window
            or (have.num_replicas or 1) != replicas
        ):
            # change only what this command owns; placement stays as set
            updated = dataclasses.replace(
                have,
                subjects=wanted.subjects,
                max_age=wanted.max_age,
                duplicate_window=wanted.duplicate_window,
                num_replicas=replicas,
            )
            try:
                return await self.js.update_stream(updated)
            except (TimeoutError, NatsError) as exc:
                raise BusError(f"cannot update audit stream {name}: {nats_reason(exc)}") from None
        return info

    async def check_audit_stream(self) -> StreamInfo:
        """The audit stream's state, read only; BusError naming what is wrong when it
        is missing, unreadable or unfit for audit (a service checks, never creates)."""
        name = self.subjects.audit_stream
        try:
            info = await self.js.stream_info(name)
        except NotFoundError:
            raise BusError(
                f"audit stream {name} does not exist: create it with `gpuslice audit init`"
                " and the admin credential (the gpuslice-audit-init Job in Kubernetes)"
            ) from None
        except (TimeoutError, NatsError) as exc:
            raise BusError(f"cannot read audit stream {name}: {nats_reason(exc)}") from None
        problems = _unfit_for_audit(info.config)
        if set(info.config.subjects or []) != {self.subjects.events_all}:
            problems.append(f"it captures {info.config.subjects}, not {self.subjects.events_all}")
        if problems:
            raise BusError(f"stream {name} is unfit for audit: " + "; ".join(problems))
        return info

    async def read_audit(
        self,
        since: datetime | None = None,
        subject: str | None = None,
        timeout: float = 5.0,
    ) -> list[CloudEvent]:
        """Every event stored in the audit stream (since a time, on a subject), in order.

        Stored messages that do not parse are counted as malformed and skipped. If
        the stream stops delivering before the last matching event, BusError is
        raised rather than a silently shortened list.
        """
        name = self.subjects.audit_stream
        config = ConsumerConfig(
            deliver_policy=DeliverPolicy.BY_START_TIME if since else DeliverPolicy.ALL,
            opt_start_time=since,
        )
        events: list[CloudEvent] = []
        try:
            info = await self.js.stream_info(name)
            if info.state.messages == 0:
                return []
            sub = await self.js.subscribe(
                subject or self.subjects.events_all,
                stream=name,
                ordered_consumer=True,
                config=config,
            )
        except NotFoundError:
            raise BusError(f"audit stream {name} does not exist") from None
        except (NatsError, TimeoutError) as exc:
            raise BusError(f"cannot read audit stream {name}: {nats_reason(exc)}") from None
        try:
            # Everything pushed to this client so far plus what the server still
            # holds: the messages on their way count too, so none is missed.
            info_now = await sub.consumer_info()
            delivered = info_now.delivered.consumer_seq if info_now.delivered else 0
            remaining = (info_now.num_pending or 0) + (delivered or 0)
            while remaining > 0:
                try:
                    msg = await sub.next_msg(timeout)
                except NatsTimeoutError:
                    raise BusError(
                        f"audit stream {name} stopped delivering after {len(events)} events"
                    ) from None
                remaining -= 1
                try:
                    events.append(parse_event(msg.data))
                except EventError as exc:
                    self._malformed(msg.subject, str(exc))
        except (NatsError, TimeoutError) as exc:
            raise BusError(f"cannot read audit stream {name}: {nats_reason(exc)}") from None
        finally:
            await sub.unsubscribe()
        return events


def _unfit_for_audit(have: StreamConfig) -> list[str]:
    """What makes a stream's configuration too weak to keep an audit trail."""
    problems = []
    if have.storage != StorageType.FILE:
        problems.append(f"storage is {have.storage}, not file")
    if not have.deny_delete or not have.deny_purge:
        problems.append("it allows deleting or purging messages")
    if have.retention != RetentionPolicy.LIMITS:
        problems.append(f"retention is {have.retention}, not limits")
    if have.allow_msg_ttl:
        problems.append("publishers may set a message's time to live (allow_msg_ttl)")
    for limit in ("max_msgs", "max_bytes", "max_msgs_per_subject"):
        if (getattr(have, limit) or -1) > 0:
            problems.append(f"{limit} is {getattr(have, limit)}: old events would be dropped")
    return problems
