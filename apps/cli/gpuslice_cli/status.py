"""``gpuslice status``: what the ledger holds, node by node and card by card.

Every vendor's cards are shown, each with its vendor: NVIDIA's first, then the
others by vendor name; a node's totals are per vendor, since vendors count
cores in their own units (percent of a card for most, sixteenths of a card for
Moore Threads, AI cores for Ascend).

Gathering (:func:`gather_status`, async, plain dataclasses) is kept apart from
rendering (:func:`table_rows`, :func:`status_table`, :func:`status_document`), so
each is tested on its own. What the cards actually use comes from the
inventory's telemetry store (:func:`gather_usage`), as a ``usage`` mapping.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import typer
from redis.exceptions import RedisError
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from gpuslice_cli.table import printable, show
from gpuslice_common.config import CommonSettings, ConfigError, load, without_password
from gpuslice_common.ledger import BadRecord, Ledger, LedgerError
from gpuslice_common.models import NVIDIA, CardLayers, GpuState, Placement, vendor_order
from gpuslice_common.occupancy import card_grants
from gpuslice_inventory.telemetry import TelemetryStore

# uuid -> (device memory in use, bytes; SM utilisation, percent), from telemetry
Usage = Mapping[str, tuple[int, float]]

JSON_VERSION = 1
MIB = 1024 * 1024


# ---------------------------------------------------------------- command-line plumbing
# (shared with the audit command)


def fail(message: str, code: int) -> NoReturn:
    """Print ``error: message`` as one line on stderr and exit with ``code``."""
    Console(stderr=True, highlight=False).print(
        f"[red]error:[/] {escape(printable(message))}", soft_wrap=True
    )
    raise typer.Exit(code)


def cli_settings(nats_url: str | None = None, redis_url: str | None = None) -> CommonSettings:
    """GPUSLICE_* settings, with the URLs given on the command line taking precedence."""
    overrides = {"nats_url": nats_url, "redis_url": redis_url}
    try:
        return load(CommonSettings, **{k: v for k, v in overrides.items() if v is not None})
    except ConfigError as exc:
        fail(str(exc), 2)


def ledger_source(settings: CommonSettings) -> tuple[str, bool]:
    """Where the ledger is read, for people (no password), and whether that is
    only the built-in default because nothing named a Redis."""
    if settings.redis_sentinels:
        where = (
            f"Redis service {settings.redis_sentinel_service} through the sentinels"
            f" at {settings.redis_sentinels}"
        )
        return where, False
    return without_password(settings.redis_url), "redis_url" not in settings.model_fields_set


# ---------------------------------------------------------------- data


@dataclass(frozen=True)
class PodOnCard:
    uid: str
    namespace: str
    name: str
    state: str
    memory_mib: int = 0  # what the pod's containers were granted on this card
    cores: int = 0


@dataclass(frozen=True)
class CardStatus:
    """One card: what the ledger has allocated on it, against its schedulable capacity."""

    node: str
    index: int
    uuid: str
    model: str
    memory_physical_mib: int  # the card's own memory, before memory scaling
    memory_total_mib: int  # schedulable memory: capacity after scaling
    memory_allocated_mib: int
    cores_capacity: int  # in the vendor's units: percent of a card for NVIDIA's
    cores_allocated: int
    slots_total: int  # the node's split count
    slots_used: int
    pods: tuple[PodOnCard, ...]  # live placements using the card, by uid
    healthy: bool
    cordoned: bool
    present: bool  # False: gone from the node's inventory but still holding pods
    exclusive_owner: str | None
    layers: CardLayers | None = None  # which layers enforce; None: the node reports none
    vendor: str = NVIDIA

    @property
    def health(self) -> str:
        if not self.present:
            return "missing"
        if not self.healthy:
            return "unhealthy"
        if self.cordoned:
            return "cordoned"
        return "healthy"


@dataclass(frozen=True)
class NodeStatus:
    node: str
    gpus: tuple[CardStatus, ...]
    problem: str = ""  # why the node's record cannot be read (then no gpus); "" when it can


class UnknownNode(LookupError):
    def __init__(self, node: str, known: Sequence[str]) -> None:
        listed = ", ".join(known) if known else "none"
        super().__init__(f"node {node!r} is not in the ledger (known nodes: {listed})")


def card_status(gpu: GpuState, placements: Sequence[Placement]) -> CardStatus:
    """A card with the live placements among ``placements`` that use it."""
    by_pod: dict[str, PodOnCard] = {}
    for grant in card_grants(gpu.device.uuid, placements):  # by uid, then container
        seen = by_pod.get(grant.uid)
        memory = grant.memory_mib + (seen.memory_mib if seen else 0)
        cores = grant.cores + (seen.cores if seen else 0)
        by_pod[grant.uid] = PodOnCard(
            grant.uid, grant.namespace, grant.name, grant.state, memory, cores
        )
    pods = list(by_pod.values())
    return CardStatus(
        node=gpu.node,
        index=gpu.device.index,
        uuid=gpu.device.uuid,
        model=gpu.device.model,
        memory_physical_mib=gpu.device.memory_mib,
        memory_total_mib=gpu.capacity.memory_mib,
        memory_allocated_mib=gpu.used.memory_mib,
        cores_capacity=gpu.capacity.cores,
        cores_allocated=gpu.used.cores,
        slots_total=gpu.capacity.slots,
        slots_used=gpu.used.slots,
        pods=tuple(pods),
        healthy=gpu.device.healthy,
        cordoned=gpu.cordoned,
        present=gpu.present,
        exclusive_owner=gpu.used.exclusive_owner,
        layers=gpu.layers,
        vendor=gpu.device.vendor,
    )


async def gather_status(ledger: Ledger, node: str | None = None) -> list[NodeStatus]:
    """Every node (or just ``node``) with its cards of every vendor, sorted by
    name, then NVIDIA's cards and the other vendors' by vendor name, each by index.

    Raises UnknownNode when ``node`` is not registered, LedgerError when Redis fails.
    """
    known = await ledger.nodes()
    if node is not None and node not in known:
        raise UnknownNode(node, known)
    names = [node] if node is not None else known
    if not names:
        return []
    gpus = await ledger.read_gpus(names, vendor=None)
    placements = await asyncio.gather(*(_placements(ledger, n) for n in names))
    result = []
    for name, pods in zip(names, placements, strict=True):
        cards = gpus.get(name, [])
        if isinstance(cards, BadRecord) or isinstance(pods, BadRecord):
            problem = cards if isinstance(cards, BadRecord) else pods
            assert isinstance(problem, BadRecord)
            result.append(NodeStatus(node=name, gpus=(), problem=problem.problem))
            continue
        ordered = sorted(cards, key=lambda g: (*vendor_order(g.device.vendor), g.device.index))
        result.append(NodeStatus(node=name, gpus=tuple(card_status(g, pods) for g in ordered)))
    return result


def by_vendor(cards: Sequence[CardStatus]) -> dict[str, list[CardStatus]]:
    """A node's cards grouped by vendor, in :func:`vendor_order`."""
    groups: dict[str, list[CardStatus]] = {}
    for card in sorted(cards, key=lambda c: (*vendor_order(c.vendor), c.index)):
        groups.setdefault(card.vendor, []).append(card)
    return groups


def pod_count(cards: Sequence[CardStatus]) -> int:
    """Distinct live pods on ``cards``."""
    return len({p.uid for c in cards for p in c.pods})


async def _placements(ledger: Ledger, node: str) -> list[Placement] | BadRecord:
    try:
        return await ledger.node_placements(node)
    except BadRecord as exc:
        return exc


def readable(nodes: Sequence[NodeStatus]) -> list[NodeStatus]:
    return [n for n in nodes if not n.problem]


def skipped(nodes: Sequence[NodeStatus]) -> dict[str, str]:
    """Nodes whose record cannot be read, with why."""
    return {n.node: n.problem for n in nodes if n.problem}


# ---------------------------------------------------------------- rendering


USED_COLUMN = 5  # where the "used" column goes, after "memory MiB"


def table_columns(usage: Usage | None = None) -> list[str]:
    columns = ["node", "gpu", "vendor", "model", "memory MiB", "cores", "slots", "pods", "health"]
    if usage is not None:
        columns.insert(USED_COLUMN, "used")
    return columns


def _used_cell(cards: Sequence[CardStatus], usage: Usage) -> str:
    seen = [usage[c.uuid] for c in cards if c.uuid in usage]
    if not seen:
        return "-"
    used_mib = sum(b for b, _ in seen) // MIB
    sm = sum(s for _, s in seen) / len(seen)
    return f"{used_mib} MiB {sm:.0f}%"


def _health_summary(cards: Sequence[CardStatus]) -> str:
    counts: dict[str, int] = {}
    for card in cards:
        counts[card.health] = counts.get(card.health, 0) + 1
    order = ("healthy", "cordoned", "unhealthy", "missing")
    return ", ".join(f"{counts[h]} {h}" for h in order if h in counts)


def table_rows(nodes: Sequence[NodeStatus], usage: Usage | None = None) -> list[list[str]]:
    """The table's cells: per node and vendor its cards, then one ``total`` row.

    With ``usage`` (uuid -> (used bytes, SM percent)) a ``used`` column follows
    ``memory MiB``: "-" for a card without telemetry; the total row sums the
    memory and averages the SM percentage of the cards that have it.
    """
    rows: list[list[str]] = []
    for node in readable(nodes):
        # a node without cards still gets its total row
        for vendor, cards in (by_vendor(node.gpus) or {"-": []}).items():
            for card in cards:
                row = [
                    node.node,
                    str(card.index),
                    vendor,
                    card.model,
                    f"{card.memory_allocated_mib} / {card.memory_total_mib}",
                    f"{card.cores_allocated} / {card.cores_capacity}",
                    f"{card.slots_used} / {card.slots_total}",
                    str(len(card.pods)),
                    card.health,
                ]
                if usage is not None:
                    row.insert(USED_COLUMN, _used_cell([card], usage))
                rows.append(row)
            total = [
                node.node,
                "total",
                vendor,
                f"{len(cards)} GPU" + ("" if len(cards) == 1 else "s"),
                f"{sum(c.memory_allocated_mib for c in cards)} / "
                f"{sum(c.memory_total_mib for c in cards)}",
                f"{sum(c.cores_allocated for c in cards)} / {sum(c.cores_capacity for c in cards)}",
                f"{sum(c.slots_used for c in cards)} / {sum(c.slots_total for c in cards)}",
                str(pod_count(cards)),
                _health_summary(cards),
            ]
            if usage is not None:
                total.insert(USED_COLUMN, _used_cell(cards, usage))
            rows.append(total)
    return rows


def status_table(nodes: Sequence[NodeStatus], usage: Usage | None = None) -> Table:
    table = Table(title="gpuslice ledger")
    right = {"gpu", "memory MiB", "used", "cores", "slots", "pods"}
    for name in table_columns(usage):
        table.add_column(name, justify="right" if name in right else "left")
    health_style = {"healthy": "green", "cordoned": "yellow", "unhealthy": "red", "missing": "red"}
    for row in table_rows(nodes, usage):
        is_total = row[1] == "total"
        cells = [escape(c) for c in row]
        if not is_total and (style := health_style.get(row[-1])):
            cells[-1] = f"[{style}]{cells[-1]}[/]"
        table.add_row(*cells, style="bold" if is_total else None, end_section=is_total)
    return table


POD_COLUMNS = ("node", "gpu", "vendor", "pod", "state", "memory MiB", "cores")
NO_CORE_LIMIT = "no limit"  # cores 0: none asked, the card's compute unlimited (HAMi's gpucores 0)


def pod_rows(nodes: Sequence[NodeStatus]) -> list[list[str]]:
    """One row per pod and card it uses: what it was granted there (cores
    :data:`NO_CORE_LIMIT` where its containers asked for none, not 0)."""
    return [
        [
            node.node,
            str(card.index),
            card.vendor,
            f"{pod.namespace}/{pod.name}",
            pod.state,
            str(pod.memory_mib),
            str(pod.cores) if pod.cores else NO_CORE_LIMIT,
        ]
        for node in readable(nodes)
        for card in node.gpus
        for pod in sorted(card.pods, key=lambda p: (p.namespace, p.name, p.uid))
    ]


def pods_table(nodes: Sequence[NodeStatus]) -> Table:
    table = Table(title="pods by card")
    for name in POD_COLUMNS:
        table.add_column(
            name, justify="right" if name in ("gpu", "memory MiB", "cores") else "left"
        )
    for row in pod_rows(nodes):
        table.add_row(*(escape(cell) for cell in row))
    return table


LAYER_COLUMNS = (
    "node",
    "gpu",
    "driver",
    "agent memory",
    "agent compute",
    "interposer",
    "driver note",
)
UNREPORTED = "-"  # the node's agent does not report its layers


def layer_rows(nodes: Sequence[NodeStatus]) -> list[list[str]]:
    """One row per NVIDIA card: which enforcement layers hold its containers to
    their grants (gpuslice's node agent and interposer; other vendors' cards are
    held to theirs by their own device plugins)."""
    rows = []
    for node in readable(nodes):
        for card in node.gpus:
            if card.vendor != NVIDIA:
                continue
            layers = card.layers
            if layers is None:
                rows.append([node.node, str(card.index), *[UNREPORTED] * 4, ""])
                continue
            rows.append(
                [
                    node.node,
                    str(card.index),
                    layers.driver.value,
                    layers.agent_memory.value,
                    layers.agent_compute.value,
                    layers.interposer.value,
                    layers.driver_note or "",
                ]
            )
    return rows


def layers_table(nodes: Sequence[NodeStatus]) -> Table:
    table = Table(title="enforcement layers")
    for name in LAYER_COLUMNS:
        table.add_column(name, justify="right" if name == "gpu" else "left")
    style = {"enforcing": "green", "missing": "yellow"}
    for row in layer_rows(nodes):
        cells = [escape(c) for c in row]
        for i in range(2, 6):
            if s := style.get(row[i]):
                cells[i] = f"[{s}]{cells[i]}[/]"
        table.add_row(*cells)
    return table


def _layers_document(layers: CardLayers | None) -> dict[str, Any] | None:
    return None if layers is None else layers.model_dump(mode="json")


def _card_document(card: CardStatus, usage: Usage | None) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "index": card.index,
        "uuid": card.uuid,
        "vendor": card.vendor,
        "model": card.model,
        "memory_physical_mib": card.memory_physical_mib,
        "memory_total_mib": card.memory_total_mib,
        "memory_allocated_mib": card.memory_allocated_mib,
        "cores_capacity": card.cores_capacity,
        "cores_allocated": card.cores_allocated,
        "slots_total": card.slots_total,
        "slots_used": card.slots_used,
        "health": card.health,
        "healthy": card.healthy,
        "cordoned": card.cordoned,
        "present": card.present,
        "exclusive_owner": card.exclusive_owner,
        "layers": _layers_document(card.layers),
        "pod_count": len(card.pods),
        "pods": [
            {
                "uid": p.uid,
                "namespace": p.namespace,
                "name": p.name,
                "state": p.state,
                "memory_mib": p.memory_mib,
                "cores": p.cores,
            }
            for p in card.pods
        ],
    }
    if usage is not None:
        used = usage.get(card.uuid)
        doc["used_bytes"] = None if used is None else used[0]
        doc["sm_percent"] = None if used is None else used[1]
    return doc


def _totals(cards: Sequence[CardStatus]) -> dict[str, int]:
    return {
        "gpus": len(cards),
        "memory_total_mib": sum(c.memory_total_mib for c in cards),
        "memory_allocated_mib": sum(c.memory_allocated_mib for c in cards),
        "cores_capacity": sum(c.cores_capacity for c in cards),
        "cores_allocated": sum(c.cores_allocated for c in cards),
        "slots_total": sum(c.slots_total for c in cards),
        "slots_used": sum(c.slots_used for c in cards),
        "pod_count": pod_count(cards),
    }


def status_document(nodes: Sequence[NodeStatus], usage: Usage | None = None) -> dict[str, Any]:
    """The ``--json`` document (see the command's help for its keys)."""
    return {
        "version": JSON_VERSION,
        "skipped": skipped(nodes),
        "nodes": [
            {
                "node": node.node,
                "gpus": [_card_document(card, usage) for card in node.gpus],
                "totals": _totals(node.gpus),
                "vendors": {
                    vendor: _totals(cards) for vendor, cards in by_vendor(node.gpus).items()
                },
            }
            for node in readable(nodes)
        ],
    }


# ---------------------------------------------------------------- the command


async def gather_usage(
    ledger: Ledger, prefix: str, nodes: Sequence[NodeStatus]
) -> dict[str, tuple[int, float]]:
    """What the containers on each card use now, from the inventory's telemetry
    store: uuid -> (used bytes, SM percent); cards without fresh samples are absent."""
    store = TelemetryStore(ledger.redis, prefix)
    usage: dict[str, tuple[int, float]] = {}
    for node in readable(nodes):
        for uuid, used in (await store.gpu_usage(node.node, prune=False)).items():
            usage[uuid] = (used.used_bytes, used.sm_percent)
    return usage


async def _read_status(
    settings: CommonSettings, node: str | None
) -> tuple[list[NodeStatus], Usage]:
    # few retries: an operator waiting at a prompt wants the error, not a 10 s wait
    ledger = Ledger.from_settings(settings, retries=2)
    try:
        nodes = await gather_status(ledger, node)
        return nodes, await gather_usage(ledger, settings.ledger_prefix, nodes)
    finally:
        await ledger.close()


def status(
    as_json: bool = typer.Option(False, "--json", help="print a JSON document instead"),
    node: str | None = typer.Option(None, "--node", help="only this node"),
    redis_url: str | None = typer.Option(
        None, "--redis-url", help="the ledger's Redis (default: GPUSLICE_REDIS_URL)"
    ),
    pods: bool = typer.Option(False, "--pods", help="also list the pods on each card"),
) -> None:
    """Show nodes and GPUs as the ledger holds them.

    Every vendor's cards, NVIDIA's first, then the others by vendor. Per card:
    its vendor and model, memory allocated / schedulable total in MiB (after
    memory scaling), what its containers use now by their interposers'
    telemetry (memory and SM percent; "-" without fresh samples), compute
    cores allocated / capacity (in the vendor's units, after core scaling:
    percent of a card for NVIDIA and most vendors, 16 a card for Moore
    Threads, AI cores for Ascend), slots used / split count, the number of
    live pods on the card (a pod counts once on every card it uses) and its
    health (healthy, cordoned, unhealthy, or missing from the node's
    inventory). A bold row per node and vendor gives its totals.
    A node whose record in the ledger cannot be read (a value no gpuslice
    writes) is left out, with a warning on stderr saying why. --pods adds a
    table of the pods on each card with the memory (MiB) and cores they were
    granted there ("no limit" where a pod asked for no cores: its compute is
    not limited). A second table says per NVIDIA card which enforcement layers hold
    its containers to their grants: the driver's per-cgroup memory limits, the
    node agent's memory and compute checks, the interposer ("enforcing" or
    "missing"; "-" where the node's agent does not report them), with the
    driver's backend (dmem, driver) or why its limits are missing. The Redis
    read is named under the last table (without its password); stderr warns when
    it is the built-in default 127.0.0.1:6379 because neither --redis-url nor
    GPUSLICE_REDIS_URL named one. On a
    terminal the tables fit its width; piped, they are tab-separated columns
    with whole cells.

    --json prints {"version": 1, "skipped": {...}, "nodes": [...]} instead;
    "skipped" maps each node left out to why; each node is
    {"node", "gpus", "totals", "vendors"}, each gpu is {"index", "uuid", "vendor", "model",
    "memory_physical_mib", "memory_total_mib", "memory_allocated_mib",
    "cores_capacity", "cores_allocated", "slots_total", "slots_used", "health",
    "healthy", "cordoned", "present", "exclusive_owner", "layers", "pod_count",
    "pods", "used_bytes", "sm_percent"} (the last two null without telemetry;
    "layers" null where the node does not report them, else {"driver",
    "driver_note", "agent_memory", "agent_compute", "interposer"}), each
    pod {"uid", "namespace", "name", "state", "memory_mib", "cores"} sorted by uid, and totals
    {"gpus", "memory_total_mib", "memory_allocated_mib", "cores_capacity",
    "cores_allocated", "slots_total", "slots_used", "pod_count"} (pods counted once
    per node) over all the node's cards; "vendors" maps each vendor to the same
    totals over its cards (cores add up within a vendor's units only). Nodes
    are sorted by name, cards as in the table.

    Exit 1 when Redis cannot be read or --node is unknown, 2 on bad settings.
    """
    settings = cli_settings(redis_url=redis_url)
    source, by_default = ledger_source(settings)
    warnings = Console(stderr=True, highlight=False)
    if by_default:
        warnings.print(
            f"[yellow]warning:[/] no --redis-url or GPUSLICE_REDIS_URL: reading the"
            f" default {escape(source)}",
            soft_wrap=True,
        )
    try:
        nodes, usage = asyncio.run(_read_status(settings, node))
    except UnknownNode as exc:
        fail(str(exc), 1)
    except (LedgerError, RedisError, OSError) as exc:
        fail(f"cannot read the ledger at {source}: {exc}", 1)
    if as_json:
        typer.echo(json.dumps(status_document(nodes, usage), indent=2))
        return
    console = Console()
    for name, problem in skipped(nodes).items():
        shown = name if name.isprintable() else repr(name)
        warnings.print(
            f"[yellow]warning:[/] node {escape(shown)} left out, "
            f"its record cannot be read: {escape(printable(problem))}",
            soft_wrap=True,
        )
    if not nodes:
        console.print(f"no GPU nodes in the ledger at {escape(source)}", soft_wrap=True)
        return
    if readable(nodes):
        table = status_table(nodes, usage)
        show(console, table)
        if pods:
            show(console, pods_table(nodes))
        layers = layers_table(nodes)
        layers.caption = f"read from {escape(source)}"
        show(console, layers)
