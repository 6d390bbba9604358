"""``gpuslice audit``: read the allocation and admission events of the audit stream.

``tail`` shows them as a table (and with ``--follow`` keeps showing new ones);
``export`` writes them as JSON Lines, one CloudEvent per line, for an auditor's
own tools. Both read the JetStream stream ``<prefix>_audit`` through one
ordered consumer that starts at ``--since``: the backlog and the live events
come from that one consumer, in stream order, so nothing between them is lost
or shown twice (events are also de-duplicated by id).

``--since`` selects by the time the stream stored an event, which is what
JetStream can seek to; the ``time`` an event carries (when its publisher says it
happened) is what the table shows.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Callable, Sequence
from datetime import UTC, datetime

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Column, Table

from gpuslice_cli.status import cli_settings, fail
from gpuslice_cli.table import closed_pipe, printable, show
from gpuslice_common.auditstream import (
    AuditStreamMissing,
    EventFilter,
    audit_events,
    event_node,
    event_pod,
    parse_since,
    parse_types,
)
from gpuslice_common.bus import Bus, BusError
from gpuslice_common.config import CommonSettings, without_password
from gpuslice_common.events import AllocationEvent, CloudEvent, PodAdmitted, PodDenied
from gpuslice_common.models import PodRef

audit = typer.Typer(
    help="Read the audit stream of allocation events.", no_args_is_help=True, rich_markup_mode=None
)

SINCE_HELP = (
    "how far back: a duration (30s, 15m, 1h, 7d) or an RFC 3339 time "
    "(2024-05-01T12:00:00Z); selects by when the stream stored the event"
)
TYPE_HELP = "only this event type (alloc.released or io.gpuslice.alloc.released); repeatable"
__all__ = ["audit", "parse_since", "parse_types"]  # the parsers are the options' own


# ---------------------------------------------------------------- rendering

COLUMNS = ("time", "type", "pod", "node", "detail")


def format_time(when: datetime) -> str:
    return when.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + "Z"


def format_pod(pod: PodRef | None) -> str:
    if pod is None:
        return "-"
    return f"{pod.namespace}/{pod.name}" if pod.name else f"{pod.namespace}/uid:{pod.uid}"


def event_detail(event: CloudEvent) -> str:
    """What happened, in one line: a reason, devices, or what a pod asked for."""
    payload = event.payload()
    parts: list[str] = []
    if isinstance(payload, PodDenied):
        parts.append(payload.reason)
    elif isinstance(payload, PodAdmitted):
        for asked in payload.containers:
            memory = asked.memory
            amount = f"{memory.mib} MiB" if memory.mib is not None else f"{memory.percent}%"
            parts.append(f"{asked.name}: {asked.count} GPU x {amount}, {asked.cores}% cores")
        parts.extend(f"warning: {w}" for w in payload.warnings)
    elif isinstance(payload, AllocationEvent):
        names = {c.name for c in payload.containers}
        if payload.container and payload.container not in names:
            parts.append(f"container {payload.container}")
        for assigned in payload.containers:
            devices = ", ".join(f"{d.uuid} {d.memory_mib} MiB {d.cores}%" for d in assigned.devices)
            parts.append(f"{assigned.name}: {devices}")
        if payload.policy:
            parts.append(f"policy {payload.policy}")
        if payload.reason:
            parts.append(f"reason: {payload.reason}")
    return "; ".join(parts)


def event_row(event: CloudEvent) -> list[str]:
    node = event_node(event)
    return [
        format_time(event.time),
        event.type.suffix,
        format_pod(event_pod(event)),
        node or "-",
        event_detail(event),
    ]


def events_table(events: Sequence[CloudEvent], title: str | None = None) -> Table:
    table = Table(
        Column("time"),
        Column("type", no_wrap=True),
        Column("pod", overflow="fold", min_width=14),
        Column("node", overflow="fold"),
        Column("detail", overflow="fold"),
        title=title,
    )
    for event in events:
        table.add_row(*(escape(cell) for cell in event_row(event)))
    return table


FOLLOW_WIDTHS = (24, 14, 24, 12)  # time, type, pod, node: padded to, never cut


def follow_line(cells: Sequence[str]) -> str:
    """One event (or the header) on one line, for --follow: each new event is
    printed as it comes and a line per event suits grep. The first columns are
    padded so that lines of ordinary widths line up; nothing is cut. Events
    come from nodes and pods: no cell breaks the line or reaches the terminal
    with a character it would act on (:func:`printable`)."""
    cells = [printable(" ".join(cell.split("\n"))) for cell in cells]
    padded = [cell.ljust(width) for cell, width in zip(cells, FOLLOW_WIDTHS, strict=False)]
    return "  ".join([*padded, *cells[len(FOLLOW_WIDTHS) :]]).rstrip()


# ---------------------------------------------------------------- commands


def _options(
    since: str, pod: str | None, node: str | None, types: Sequence[str]
) -> tuple[datetime, EventFilter]:
    try:
        start = parse_since(since)
    except ValueError as exc:
        fail(f"--since: {exc}", 2)
    try:
        wanted = parse_types(types)
    except ValueError as exc:
        fail(f"--type: {exc}", 2)
    return start, EventFilter(pod=pod, node=node, types=wanted)


def _warn(message: str) -> None:
    Console(stderr=True, highlight=False).print(
        f"[yellow]warning:[/] skipped a malformed event: {escape(printable(message))}",
        soft_wrap=True,
    )


async def _connect(settings: CommonSettings) -> Bus:
    """Connect; the client's complaints about each failed try are left out (the
    BusError that ends the tries says it once). Later ones (a lost connection
    while following) are printed as warnings."""
    bus_log = logging.getLogger("gpuslice.bus")
    level = bus_log.level
    bus_log.setLevel(logging.CRITICAL)
    try:
        return await Bus.connect(settings, "cli-audit")
    finally:
        bus_log.setLevel(level)


async def _read(settings: CommonSettings, start: datetime, wanted: EventFilter) -> list[CloudEvent]:
    bus = await _connect(settings)
    try:
        events = audit_events(bus, start, subject=wanted.subject(bus), on_malformed=_warn)
        async with contextlib.aclosing(events):  # its consumer gone before the bus drains
            return [e async for e in events if wanted.matches(e)]
    finally:
        await bus.close()


async def _follow(
    settings: CommonSettings, start: datetime, wanted: EventFilter, console: Console
) -> None:
    """Print matching events as they come until SIGINT (Ctrl-C) or SIGTERM."""
    bus = await _connect(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    handled = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (RuntimeError, ValueError):  # not the main thread: Ctrl-C stays KeyboardInterrupt
            continue
        handled.append(sig)

    def print_line(line: str) -> None:
        console.print(line, markup=False, highlight=False, soft_wrap=True)

    async def show() -> None:
        events = audit_events(
            bus,
            start,
            subject=wanted.subject(bus),
            follow=True,
            on_malformed=_warn,
            on_ready=lambda: print_line(follow_line(COLUMNS)),
        )
        # closed when it ends (Ctrl-C, a closed pipe): its consumer is gone
        # before the bus drains, which would otherwise wait on its messages
        async with contextlib.aclosing(events):
            async for event in events:
                if wanted.matches(event):
                    print_line(follow_line(event_row(event)))

    try:
        reader = asyncio.create_task(show())
        stopper = asyncio.create_task(stop.wait())
        await asyncio.wait({reader, stopper}, return_when=asyncio.FIRST_COMPLETED)
        stopper.cancel()
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader  # re-raises what ended the reader, if not the stop
    finally:
        for sig in handled:
            loop.remove_signal_handler(sig)
        await bus.close()


def _run_or_fail(settings: CommonSettings, what: Callable[[], None]) -> None:
    try:
        what()
    except AuditStreamMissing as exc:
        where = f"NATS at {without_password(settings.nats_url)}"
        fail(str(AuditStreamMissing(exc.stream, exc.prefix, where)), 1)
    except BusError as exc:
        fail(str(exc), 1)
    except KeyboardInterrupt:
        raise typer.Exit(130) from None


@audit.command()
def tail(
    since: str = typer.Option("1h", "--since", help=SINCE_HELP),
    pod: str | None = typer.Option(
        None, "--pod", help="only this pod (name, namespace/name or uid)"
    ),
    node: str | None = typer.Option(None, "--node", help="only events on this node"),
    types: list[str] = typer.Option([], "--type", help=TYPE_HELP),
    follow: bool = typer.Option(
        False, "--follow", "-f", help="keep showing new events until Ctrl-C"
    ),
    nats_url: str | None = typer.Option(
        None, "--nats-url", help="the NATS to read (default: GPUSLICE_NATS_URL)"
    ),
) -> None:
    """Show audited events as a table: time, type, pod, node and detail.

    Events appear in the order the stream stored them. --pod, --node and --type
    narrow them down (an event without a pod or node does not match those).
    Exit 1 when NATS or the audit stream is missing, 2 on a bad option or setting.
    """
    start, wanted = _options(since, pod, node, types)
    settings = cli_settings(nats_url=nats_url)
    console = Console()

    def run() -> None:
        if follow:
            asyncio.run(_follow(settings, start, wanted, console))
            return
        events = asyncio.run(_read(settings, start, wanted))
        if not events:
            console.print(f"no events since {format_time(start)}")
            return
        title = f"{len(events)} event{'s' if len(events) != 1 else ''} since {format_time(start)}"
        show(console, events_table(events, title=title))

    _run_or_fail(settings, run)


@audit.command()
def export(
    since: str = typer.Option(..., "--since", help=SINCE_HELP),
    pod: str | None = typer.Option(
        None, "--pod", help="only this pod (name, namespace/name or uid)"
    ),
    node: str | None = typer.Option(None, "--node", help="only events on this node"),
    types: list[str] = typer.Option([], "--type", help=TYPE_HELP),
    nats_url: str | None = typer.Option(
        None, "--nats-url", help="the NATS to read (default: GPUSLICE_NATS_URL)"
    ),
) -> None:
    """Write audited events as JSON Lines on stdout: one CloudEvent per line.

    Each line is the event's structured-mode JSON, in the order the stream
    stored them; nothing else goes to stdout (the count and any error go to
    stderr). Exit 1 when NATS or the audit stream is missing, 2 on a bad option.
    """
    start, wanted = _options(since, pod, node, types)
    settings = cli_settings(nats_url=nats_url)
    out = sys.stdout.buffer if hasattr(sys.stdout, "buffer") else None

    async def write() -> int | None:
        """How many events were written; None when the reader went away."""
        count = 0
        bus = await _connect(settings)
        try:
            events = audit_events(bus, start, subject=wanted.subject(bus), on_malformed=_warn)
            async with contextlib.aclosing(events):  # its consumer gone before the bus drains
                async for event in events:
                    if not wanted.matches(event):
                        continue
                    if out is not None:
                        out.write(event.to_json() + b"\n")
                    else:
                        sys.stdout.write(event.to_json().decode() + "\n")
                    count += 1
                sys.stdout.flush()
        except BrokenPipeError:  # the reader (head -1) has what it wanted
            return None
        finally:
            await bus.close()
        return count

    def run() -> None:
        count = asyncio.run(write())
        if count is None:
            closed_pipe()
            return
        Console(stderr=True, highlight=False).print(
            f"exported {count} event{'s' if count != 1 else ''} since {format_time(start)}",
            soft_wrap=True,
        )

    _run_or_fail(settings, run)


@audit.command()
def init(
    nats_url: str | None = typer.Option(
        None, "--nats-url", help="the NATS to set up (default: GPUSLICE_NATS_URL)"
    ),
) -> None:
    """Create the audit stream, or bring an existing one's retention up to date.

    Run once at install and at each upgrade, with the admin credential
    (GPUSLICE_NATS_USER=admin): no service may create, change or delete the
    stream. Retention comes from GPUSLICE_AUDIT_MAX_AGE, the number of copies
    from GPUSLICE_AUDIT_REPLICAS (3 on a three-member cluster). Exit 1 when NATS
    refuses or an existing stream is unfit for audit, 2 on a bad setting.
    """
    settings = cli_settings(nats_url=nats_url)

    async def make() -> str:
        bus = await _connect(settings)
        try:
            info = await bus.ensure_audit_stream(settings.audit_max_age, settings.audit_replicas)
        finally:
            await bus.close()
        days = settings.audit_max_age.total_seconds() / 86400
        return (
            f"audit stream {info.config.name}: {info.state.messages} events stored,"
            f" kept {days:g} days in {info.config.num_replicas or 1} copies,"
            " deleting and purging denied"
        )

    def run() -> None:
        Console(highlight=False).print(asyncio.run(make()), soft_wrap=True)

    _run_or_fail(settings, run)
