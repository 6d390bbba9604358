"""Other vendors' accelerators, read from their node objects as HAMi's scheduler reads them.

:func:`read_node` turns one node object into a :class:`VendorReading` per
readable device type, each independent of the others: a bad annotation or
capacity of one vendor refuses that vendor only, with a message naming the
node, the vendor and the annotation key or resource. Where a type's cards are
read is its :class:`~gpuslice_common.devicetypes.CardSource`:

* ``register``: HAMi's vendor device plugins write a register annotation listing
  the cards (a JSON list, or for some vendors an older text form, see
  :class:`~gpuslice_common.devicetypes.AnnotationFormat`) and a handshake
  annotation saying the plugin is alive (below).
* ``capacity`` (Cambricon, Moore Threads, whole Metax GPUs, whole Kunlun XPUs):
  the vendor's plugin publishes only extended resources, and the cards are
  derived from the node's capacity as HAMi derives them
  (:class:`~gpuslice_common.devicetypes.CapacityCards`): card ``i`` is
  ``<node>-<word>-<i>``. No capacity of the resource at all: no sign of the
  vendor; a capacity of 0: its cards are gone.
* ``metax`` (shared Metax GPUs): Metax's plugin lists its cards in
  ``metax-tech.com/node-gpu-devices``, a JSON list in Metax's own form
  (``uuid``, ``model``, ``totalDevCount``, ``totalCompute``, ``totalVRam``,
  ``numa``, ``healthy``; a number left out is 0, ``healthy`` left out false).
  A card's cores are its ``totalCompute``, one value for all of a node's cards.
* ``enflame``: Enflame's plugin publishes ``enflame.com/gcu-drs-capacity``, a
  JSON object of the cards (``index``, ``minor``, ``capacity`` in slices) and
  the DRS profiles a card can be cut into; a card's model carries its minor and
  profiles (:mod:`gpuslice_common.drs`), its memory is the largest profile's,
  and its capacity must be the largest profile's slices.

The Metax and Enflame annotations have no handshake: present, they are read
(an empty list of cards: the cards are gone); absent, there is no sign of the
vendor.

Liveness, from a register type's handshake (HAMi's protocol):

* ``Reported_<time>``: the plugin wrote it at that time; it rewrites it every
  30 s, so one older than ``report_timeout`` (HAMi's documented five minutes)
  means the plugin stopped, and its cards are gone. A time further ahead than
  ``report_timeout`` is refused, here and for ``Requesting``: a node cannot
  keep its cards by dating its report or a request in the future.
* ``Requesting_<time>``: a scheduler asked and the plugin has not answered; past
  ``REQUEST_TIMEOUT`` (HAMi's 60 s) the cards are gone unless the node still
  has the vendor's count resource allocatable (what HAMi checks too).
* ``Deleted_<time>``: the plugin (older HAMi) withdrew its cards: gone.
* No handshake annotation: nothing says the plugin is alive: gone. A vendor
  without a handshake (AMD) is alive while the node has capacity of its count
  resource.

Memory in a register annotation is MiB already: a vendor's memory factor
scales what pods ask for, not what cards report. A card's cores other than 100
(Moore Threads' 16, Metax's ``totalCompute``) are registered as the node's
core scaling (:attr:`VendorReading.core_scaling`), so that the ledger's
capacity of each card is exactly those cores.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from pydantic import ValidationError

from gpuslice_common import drs
from gpuslice_common.devicetypes import AnnotationFormat, CapacityCards, CardSource, DeviceType
from gpuslice_common.models import (
    MAX_DEVICE_MEMORY_MIB,
    MAX_DEVICES,
    MAX_NAME_LENGTH,
    MAX_NUMA_NODE,
    MAX_SPLIT_COUNT,
    VENDOR_CARD_UUID_PATTERN,
    GpuDevice,
    NodeInventory,
    VgpuMode,
)

_CARD_UUID = re.compile(VENDOR_CARD_UUID_PATTERN)

# Kubernetes bounds all of a node's annotations together to 256 KiB.
MAX_ANNOTATION_BYTES = 256 * 1024
MAX_JSON_DEPTH = 8
REQUEST_TIMEOUT = timedelta(seconds=60)
REPORT_TIMEOUT = timedelta(minutes=5)
MAX_CORES = 1_000_000  # what a card may report as its cores (Ascend reports AI cores)
# A node capacity read for cards: far above any node's cores or memory units, and
# short enough to be read without cost.
MAX_CAPACITY = 10**15
METAX_ANNOTATION = "metax-tech.com/node-gpu-devices"
METAX_MODEL = "Metax-SGPU"  # HAMi's type of a shared Metax card, for one that names no model
ENFLAME_ANNOTATION = "enflame.com/gcu-drs-capacity"

_TIME = re.compile(
    r"^(\d{4})[-.](\d{2})[-.](\d{2})[ T](\d{2}):(\d{2}):(\d{2})(?:\.\d{1,9})?"
    r"(?: ([+-])(\d{2})(\d{2})\b.*)?$"
)
_STATES = ("Reported", "Requesting", "Deleted")

State = Literal["live", "gone", "refused"]


@dataclass(frozen=True)
class VendorReading:
    """One vendor's cards on one node, as read from its node object.

    ``state`` ``live``: ``devices`` are the cards to register. ``gone``: the
    plugin stopped or withdrew them (``message`` says how). ``refused``: an
    annotation is malformed or out of bounds (``message`` says which).
    ``cores`` are what each card reports (percent, or Ascend's AI cores).
    ``core_scaling`` makes the ledger's capacity of each card its cores where a
    card has other than 100 (Moore Threads, Metax): see :func:`core_scaling`.
    """

    node: str
    vendor: str
    state: State
    devices: tuple[GpuDevice, ...] = ()
    split_count: int = 10
    cores: tuple[int, ...] = ()
    message: str = ""
    core_scaling: float = 1.0

    def inventory(self) -> NodeInventory:
        """What to register: the live cards, or none (the vendor's cards go)."""
        devices = self.devices if self.state == "live" else ()
        return NodeInventory(
            node=self.node,
            devices=devices,
            split_count=self.split_count,
            core_scaling=self.core_scaling,
            vendor=self.vendor,
        )


def core_scaling(cores: int) -> float:
    """The core scaling under which a card's capacity is ``cores``:
    :meth:`NodeInventory.capacity` floors ``100 * scaling``, and ``cores / 100``
    alone can fall short of it (``100 * 0.29`` is 28.999999999999996)."""
    scaling = cores / 100
    while math.floor(100 * scaling) < cores:
        scaling = math.nextafter(scaling, math.inf)
    if math.floor(100 * scaling) != cores:
        raise ValueError(f"no core scaling gives {cores} cores")
    return scaling


class _Refused(Exception):
    """Why a vendor's cards are refused; ``key`` names the annotation or resource
    when it is not the one the reader is reading."""

    def __init__(self, why: str, key: str | None = None) -> None:
        super().__init__(why)
        self.key = key


def _node_name(node: Mapping[str, Any]) -> str:
    meta = node.get("metadata")
    name = meta.get("name") if isinstance(meta, Mapping) else None
    return name if isinstance(name, str) else ""


def _annotations(node: Mapping[str, Any]) -> Mapping[str, Any]:
    meta = node.get("metadata")
    annos = meta.get("annotations") if isinstance(meta, Mapping) else None
    return annos if isinstance(annos, Mapping) else {}


def _quantity(node: Mapping[str, Any], part: str, resource: str | None) -> int:
    """A whole-number extended resource of ``status.<part>``; 0 when absent or odd."""
    status = node.get("status")
    values = status.get(part) if isinstance(status, Mapping) else None
    value = values.get(resource) if isinstance(values, Mapping) and resource else None
    if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 9:
        return int(value)
    return 0


def _when(text: str) -> datetime | None:
    found = _TIME.match(text)
    if found is None:
        return None
    y, mo, d, h, mi, s, sign, oh, om = found.groups()
    try:
        at = datetime(int(y), int(mo), int(d), int(h), int(mi), int(s), tzinfo=UTC)
    except ValueError:
        return None
    if sign:
        offset = timedelta(hours=int(oh), minutes=int(om))
        at = at - offset if sign == "+" else at + offset
    return at


def liveness(
    handshake: str | None,
    now: datetime,
    allocatable: int,
    report_timeout: timedelta = REPORT_TIMEOUT,
) -> tuple[State, str]:
    """What a handshake annotation's value says of the plugin: ``live``, ``gone``
    (with why) or ``refused`` (with why). Times without a zone are UTC."""
    if handshake is None:
        return "gone", "no handshake annotation: nothing says its device plugin runs"
    if not isinstance(handshake, str) or len(handshake) > 128:
        return "refused", "the handshake is not a short text"
    word, sep, rest = handshake.partition("_")
    if not sep:
        word, sep, rest = handshake.partition(" ")
    if word not in _STATES:
        return "refused", f"the handshake {handshake[:40]!r} is none of {', '.join(_STATES)}"
    if word == "Deleted":
        return "gone", "its device plugin withdrew the cards (Deleted)"
    at = _when(rest)
    if at is None:
        return "refused", f"the handshake time {rest[:40]!r} cannot be read"
    age = now - at
    if -age > report_timeout:  # a request dated ahead would never time out
        return "refused", f"the handshake is dated {_age(-age)} in the future"
    if word == "Requesting":
        if age <= REQUEST_TIMEOUT or allocatable > 0:
            return "live", ""
        return "gone", f"its device plugin has not answered a request for {_age(age)}"
    if age > report_timeout:
        return "gone", f"its device plugin last reported {_age(age)} ago"
    return "live", ""


def _age(delta: timedelta) -> str:
    return f"{int(delta.total_seconds())}s"


# ---------------------------------------------------------------- card facts


def _shown(value: Any) -> str:
    """A value in a message: short, and never a cost to write out."""
    if isinstance(value, int) and abs(value) > 10**30:
        return "a number above 10**30"
    try:
        text = str(value)[:20]
    except (ValueError, RecursionError):
        return "an unreadable value"
    return text if isinstance(value, int) and not isinstance(value, bool) else repr(text)


def _whole(value: Any, what: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _Refused(f"{what} is {_shown(value)}, not a whole number")
    if not low <= value <= high:
        raise _Refused(f"{what} is {_shown(value)}, outside {low}..{high}")
    return value


def _number(value: Any, what: str, low: int, high: int) -> int:
    """A whole number given as a number or as decimal digits (Kubernetes quantities,
    Enflame's JSON): nothing else, no sign, no suffix, no exponent."""
    if isinstance(value, str) and value.isascii() and value.isdigit():
        if len(value) > 16:
            raise _Refused(f"{what} is {len(value)} digits long, outside {low}..{high}")
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise _Refused(f"{what} is {_shown(value)}, not a whole number")
    if not low <= value <= high:
        raise _Refused(f"{what} is {_shown(value)}, outside {low}..{high}")
    return value


def _depth(value: Any, level: int = 0) -> int:
    if level > MAX_JSON_DEPTH:
        return level
    if isinstance(value, dict):
        return max([level] + [_depth(v, level + 1) for v in value.values()])
    if isinstance(value, list):
        return max([level] + [_depth(v, level + 1) for v in value])
    return level


def _json(text: str) -> Any:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        raise _Refused("it is not JSON") from None
    if _depth(value) > MAX_JSON_DEPTH:
        raise _Refused(f"it nests deeper than {MAX_JSON_DEPTH}")
    return value


def _json_list(text: str) -> list[dict[str, Any]]:
    cards = _json(text)
    if not isinstance(cards, list) or not all(isinstance(c, dict) for c in cards):
        raise _Refused("it is not a JSON list of cards")
    return cards


def _annotation(annos: Mapping[str, Any], key: str) -> str | None:
    text = annos.get(key)
    if text is None:
        return None
    if not isinstance(text, str):
        raise _Refused("the annotation is not text")
    if len(text) > MAX_ANNOTATION_BYTES:
        raise _Refused(f"the annotation is {len(text)} bytes, above {MAX_ANNOTATION_BYTES}")
    return text


def _device(uuid: str, what: str, **fields: Any) -> GpuDevice:
    """A card made from a node's facts; a uuid too long for the ledger is refused."""
    if len(uuid) > MAX_NAME_LENGTH:
        raise _Refused(f"{what} uuid {uuid[:64]!r}... is longer than {MAX_NAME_LENGTH} characters")
    if not _CARD_UUID.fullmatch(uuid):
        # HAMi's plugins read it back from annotations where , : ; separate cards
        raise _Refused(f"{what} uuid {uuid[:64]!r} is not letters, digits and -_./")
    try:
        return GpuDevice(uuid=uuid, **fields)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(p) for p in error["loc"]) or "card"
        raise _Refused(f"{what} {where}: {error['msg']}") from None


# ---------------------------------------------------------------- register annotations


def _json_cards(text: str) -> list[dict[str, Any]]:
    cards = _json_list(text)
    return [
        {
            "uuid": c.get("id"),
            "index": c.get("index", 0),
            "count": c.get("count", 0),
            "memory": c.get("devmem", 0),
            "cores": c.get("devcore", 0),
            "model": c.get("type"),
            "numa": c.get("numa", 0),
            "health": c.get("health", False),
            "mode": c.get("mode") or "",
        }
        for c in cards
    ]


def _field_number(items: list[str]) -> Any:
    def number(i: int, what: str) -> int:
        raw = items[i].strip()
        digits = raw[1:] if raw.startswith("-") else raw
        if not (digits.isascii() and digits.isdigit() and len(digits) <= 10):
            raise _Refused(f"{what} {raw[:20]!r} is not a whole number")
        return int(raw)

    return number


def _colon_cards(text: str) -> list[dict[str, Any]]:
    """The text form: ``uuid,count,mem,cores,type,numa,health[,index,mode]:`` per card."""
    if ":" not in text:
        raise _Refused("it has no ':' between cards")
    cards = []
    for entry in text.split(":"):
        if not entry:
            continue
        items = entry.split(",")
        if len(items) not in (7, 9):
            raise _Refused(f"a card has {len(items)} fields, not 7 or 9")
        number = _field_number(items)
        health = items[6].strip().lower()
        if health not in ("true", "false", "1", "0", "t", "f"):
            raise _Refused(f"health {items[6][:20]!r} is not true or false")
        cards.append(
            {
                "uuid": items[0],
                "count": number(1, "count"),
                "memory": number(2, "memory"),
                "cores": number(3, "cores"),
                "model": items[4],
                "numa": number(5, "numa"),
                "health": health in ("true", "1", "t"),
                "index": number(7, "index") if len(items) == 9 else 0,
                "mode": items[8] if len(items) == 9 else "",
            }
        )
    return cards


def _devices(
    vendor: str, cards: list[dict[str, Any]], cores_fixed: int | None
) -> tuple[tuple[GpuDevice, ...], int, tuple[int, ...]]:
    if not cards:
        raise _Refused("it lists no cards")
    if len(cards) > MAX_DEVICES:
        raise _Refused(f"it lists {len(cards)} cards, above {MAX_DEVICES}")
    devices, counts, cores = [], [], []
    uuids: set[Any] = set()
    indexes: set[Any] = set()
    for n, c in enumerate(cards):
        what = f"card {n}"
        uuid = c["uuid"]
        if not isinstance(uuid, str):
            raise _Refused(f"{what} has no id")
        if uuid in uuids:
            raise _Refused(f"card {uuid[:64]!r} is listed twice")
        index = _whole(c["index"], f"{what} index", 0, MAX_DEVICES - 1)
        if index in indexes:
            raise _Refused(f"index {index} is listed twice")
        uuids.add(uuid)
        indexes.add(index)
        counts.append(_whole(c["count"], f"{what} split count", 1, MAX_SPLIT_COUNT))
        card_cores = cores_fixed if cores_fixed is not None else c["cores"]
        cores.append(_whole(card_cores, f"{what} cores", 0, MAX_CORES))
        mode = c["mode"]
        if not isinstance(mode, str) or mode not in ("", VgpuMode.HAMI_CORE):
            raise _Refused(f"{what} mode {str(mode)[:20]!r} is not one a {vendor} card has")
        if not isinstance(c["health"], bool):
            raise _Refused(f"{what} health is not true or false")
        devices.append(
            _device(
                uuid,
                what,
                index=index,
                model=c["model"],
                memory_mib=_whole(c["memory"], f"{what} memory", 1, MAX_DEVICE_MEMORY_MIB),
                numa=_whole(c["numa"], f"{what} numa", 0, MAX_NUMA_NODE),
                healthy=c["health"],
                vendor=vendor,
            )
        )
    return tuple(devices), min(counts), tuple(cores)


# ---------------------------------------------------------------- node capacity


def _capacity_cards(
    node: Mapping[str, Any], name: str, device_type: DeviceType, cards: CapacityCards
) -> tuple[GpuDevice, ...] | None:
    """The cards HAMi's scheduler derives from the node's capacity: None when the
    node has no capacity of the vendor's resource, none when it is 0. Raises
    _Refused (naming the memory resource where that is the one at fault)."""
    key = cards.cores_resource or device_type.count_resource
    status = node.get("status")
    capacity = status.get("capacity") if isinstance(status, Mapping) else None
    if key is None or not isinstance(capacity, Mapping) or key not in capacity:
        return None
    amount = _number(capacity[key], "the capacity", 0, MAX_CAPACITY)
    if amount == 0:
        return ()
    memory = cards.memory_mib
    count = amount
    if cards.cores_resource:
        count = -(-amount // cards.cores_per_card)  # HAMi counts a part card as one
    if count > MAX_DEVICES:
        raise _Refused(f"the capacity {amount} makes {count} cards, above {MAX_DEVICES}")
    if cards.cores_resource:
        memory_key = cards.memory_resource or "memory"
        if memory_key not in capacity:
            raise _Refused("the node has no capacity of it", memory_key)
        try:
            total = _number(capacity[memory_key], "the capacity", 0, MAX_CAPACITY)
        except _Refused as exc:
            raise _Refused(str(exc), memory_key) from None
        # each card's share of the node's memory, as HAMi shares it
        memory = total * cards.memory_unit * cards.cores_per_card // amount
        if not 1 <= memory <= MAX_DEVICE_MEMORY_MIB:
            raise _Refused(
                f"the capacity {total} gives {memory} MiB per card, outside "
                f"1..{MAX_DEVICE_MEMORY_MIB}",
                memory_key,
            )
    return tuple(
        _device(
            f"{name}-{cards.word}-{i}",
            f"card {i}",
            index=i,
            model=cards.model,
            memory_mib=memory,
            # HAMi puts the upper half on NUMA node 1 (a single card too: 0 >= 1 // 2)
            numa=1 if cards.numa_halves and i >= count // 2 else 0,
            healthy=True,
            vendor=device_type.vendor,
        )
        for i in range(count)
    )


# ---------------------------------------------------------------- Metax's annotation


def _metax_cards(
    listed: list[dict[str, Any]], device_type: DeviceType
) -> tuple[tuple[GpuDevice, ...], int, tuple[int, ...]]:
    """Metax's own list of shared cards; a card's index is its place in the list."""
    if len(listed) > MAX_DEVICES:
        raise _Refused(f"it lists {len(listed)} cards, above {MAX_DEVICES}")
    compute = None
    cards = []
    for n, c in enumerate(listed):
        cores = _whole(c.get("totalCompute", 0), f"card {n} totalCompute", 1, 100)
        if compute is not None and cores != compute:
            raise _Refused(
                f"card {n} totalCompute is {cores}, not card 0's {compute}: "
                "one node's cards share one core scaling"
            )
        compute = cores
        model = c.get("model")
        cards.append(
            {
                "uuid": c.get("uuid"),
                "index": n,
                "count": c.get("totalDevCount", 0),
                "memory": c.get("totalVRam", 0),
                "cores": cores,
                "model": METAX_MODEL if model is None or model == "" else model,
                "numa": c.get("numa", 0),
                "health": c.get("healthy", False),
                "mode": "",
            }
        )
    return _devices(device_type.vendor, cards, None)


# ---------------------------------------------------------------- Enflame's annotation


def _enflame_cards(
    name: str, text: str, device_type: DeviceType
) -> tuple[tuple[GpuDevice, ...], int]:
    """Enflame's DRS capacity: its cards, each cut by the node's profiles, and the
    slices of a card (its largest profile's)."""
    spec = _json(text)
    if not isinstance(spec, dict):
        raise _Refused("it is not a JSON object")
    listed = spec.get("devices", [])
    if not isinstance(listed, list) or not all(isinstance(d, dict) for d in listed):
        raise _Refused("devices is not a list of cards")
    if not listed:
        return (), 0
    if len(listed) > MAX_DEVICES:
        raise _Refused(f"it lists {len(listed)} cards, above {MAX_DEVICES}")
    named = spec.get("profiles")
    if not isinstance(named, dict):
        raise _Refused("profiles is not a mapping of profile names to IDs")
    try:
        profiles = drs.table([drs.profile(p, i) for p, i in named.items()])
    except drs.ProfileError as exc:
        raise _Refused(f"profiles: {exc}") from None
    top = drs.largest(profiles)
    memory = max(p.memory_mib for p in profiles)  # HAMi: the most memory any profile has
    devices = []
    indexes: set[int] = set()
    for n, d in enumerate(listed):
        what = f"card {n}"
        raw_index = d.get("index")
        if raw_index is None or raw_index == "":
            index = n  # HAMi's place in the list for a card without one
        else:
            index = _number(raw_index, f"{what} index", 0, MAX_DEVICES - 1)
        if index in indexes:
            raise _Refused(f"index {index} is listed twice")
        indexes.add(index)
        slices = _number(d.get("capacity"), f"{what} capacity", 1, MAX_SPLIT_COUNT)
        if slices != top.size:
            raise _Refused(
                f"{what} capacity is {slices} slices, not the {top.size} of its largest "
                f"profile {top.name}"
            )
        minor = d.get("minor")
        if isinstance(minor, str):
            minor = minor.strip()
        if minor is None or minor == "":
            minor = str(index)  # HAMi's, for a card that names no minor
        elif not isinstance(minor, str):
            minor = str(_whole(minor, f"{what} minor", 0, 999_999))
        try:
            model = drs.model_of(profiles, minor)
        except drs.ProfileError as exc:
            raise _Refused(f"{what}: {exc}") from None
        devices.append(
            _device(
                f"{name}-enflame-drs-{index}",
                what,
                index=index,
                model=model,
                memory_mib=memory,
                numa=0,
                healthy=True,
                vendor=device_type.vendor,
            )
        )
    return tuple(devices), top.size


# ---------------------------------------------------------------- one vendor of a node


def read_vendor(
    node: Mapping[str, Any],
    device_type: DeviceType,
    now: datetime,
    report_timeout: timedelta = REPORT_TIMEOUT,
) -> VendorReading | None:
    """One vendor's cards on ``node``; None when the node shows no sign of the vendor."""
    if not device_type.supported or not device_type.readable:
        return None
    name = _node_name(node)
    vendor = device_type.vendor
    key, reader = _SOURCES[device_type.source]
    try:
        reading = reader(node, name, device_type, now, report_timeout)
    except _Refused as exc:
        why = f"node {name}: {vendor} {exc.key or key(device_type)}: {exc}"
        return VendorReading(name, vendor, "refused", message=why)
    if reading is not None and reading.state == "live":
        try:
            reading.inventory()  # what the sync registers: it is sure to make one
        except ValidationError as exc:
            error = exc.errors()[0]
            where = ".".join(str(p) for p in error["loc"]) or "inventory"
            why = f"its cards make no inventory: {where}: {error['msg']}"
            return VendorReading(
                name, vendor, "refused", message=f"node {name[:64]!r}: {vendor}: {why}"
            )
    return reading


def _gone(name: str, vendor: str, why: str) -> VendorReading:
    return VendorReading(name, vendor, "gone", message=f"node {name}: {vendor}: {why}")


def _read_capacity(
    node: Mapping[str, Any],
    name: str,
    device_type: DeviceType,
    now: datetime,
    report_timeout: timedelta,
) -> VendorReading | None:
    cards = device_type.capacity
    if cards is None:
        return None
    devices = _capacity_cards(node, name, device_type, cards)
    if devices is None:
        return None
    vendor = device_type.vendor
    if not devices:
        return _gone(name, vendor, f"the node has no {_capacity_key(device_type)} capacity")
    return VendorReading(
        name,
        vendor,
        "live",
        devices,
        cards.split_count,
        (cards.cores_per_card,) * len(devices),
        core_scaling=core_scaling(cards.cores_per_card),
    )


def _read_metax(
    node: Mapping[str, Any],
    name: str,
    device_type: DeviceType,
    now: datetime,
    report_timeout: timedelta,
) -> VendorReading | None:
    text = _annotation(_annotations(node), METAX_ANNOTATION)
    if text is None:
        return None
    listed = _json_list(text)
    if not listed:
        return _gone(name, device_type.vendor, "its device plugin lists no cards")
    devices, split_count, cores = _metax_cards(listed, device_type)
    return VendorReading(
        name,
        device_type.vendor,
        "live",
        devices,
        split_count,
        cores,
        core_scaling=core_scaling(cores[0]),
    )


def _read_enflame(
    node: Mapping[str, Any],
    name: str,
    device_type: DeviceType,
    now: datetime,
    report_timeout: timedelta,
) -> VendorReading | None:
    text = _annotation(_annotations(node), ENFLAME_ANNOTATION)
    if text is None:
        return None
    devices, slices = _enflame_cards(name, text, device_type)
    if not devices:
        return _gone(name, device_type.vendor, "its device plugin lists no cards")
    return VendorReading(name, device_type.vendor, "live", devices, slices, (100,) * len(devices))


def _read_register(
    node: Mapping[str, Any],
    name: str,
    device_type: DeviceType,
    now: datetime,
    report_timeout: timedelta,
) -> VendorReading | None:
    """HAMi's register and handshake annotations."""
    announcement = device_type.announcement
    vendor = device_type.vendor
    if announcement is None:
        return None
    annos = _annotations(node)
    register = annos.get(announcement.register)
    handshake = annos.get(announcement.handshake) if announcement.handshake else None
    if register is None and handshake is None:
        return None
    if announcement.handshake is None:
        capacity = _quantity(node, "capacity", device_type.count_resource)
        state: State = "live" if capacity > 0 else "gone"
        why = "" if capacity else f"the node has no {device_type.count_resource} capacity"
    else:
        allocatable = _quantity(node, "allocatable", device_type.count_resource)
        state, why = liveness(handshake, now, allocatable, report_timeout)
        if state == "refused":
            raise _Refused(why, announcement.handshake)
    if state == "gone":
        return _gone(name, vendor, why)
    text = _annotation(annos, announcement.register)
    if text is None:
        raise _Refused("the annotation is missing")
    if announcement.format is AnnotationFormat.JSON:
        cards = _json_cards(text)
    else:
        cards = _colon_cards(text)
    devices, split_count, cores = _devices(vendor, cards, announcement.cores)
    return VendorReading(name, vendor, "live", devices, split_count, cores)


def _capacity_key(t: DeviceType) -> str | None:
    return t.capacity.cores_resource or t.count_resource if t.capacity else None


def _register_key(t: DeviceType) -> str | None:
    return t.announcement.register if t.announcement else None


_Reader = Callable[[Mapping[str, Any], str, DeviceType, datetime, timedelta], VendorReading | None]
# per source: the key a refusal names unless it names its own, and the reader
_SOURCES: dict[CardSource, tuple[Callable[[DeviceType], str | None], _Reader]] = {
    CardSource.REGISTER: (_register_key, _read_register),
    CardSource.CAPACITY: (_capacity_key, _read_capacity),
    CardSource.METAX: (lambda t: METAX_ANNOTATION, _read_metax),
    CardSource.ENFLAME: (lambda t: ENFLAME_ANNOTATION, _read_enflame),
}


def read_node(
    node: Mapping[str, Any],
    types: Sequence[DeviceType],
    now: datetime,
    report_timeout: timedelta = REPORT_TIMEOUT,
) -> list[VendorReading]:
    """Every readable vendor's cards on ``node`` (vendors with no sign left out)."""
    readings = []
    for device_type in types:
        reading = read_vendor(node, device_type, now, report_timeout)
        if reading is not None:
            readings.append(reading)
    return readings


__all__ = [
    "ENFLAME_ANNOTATION",
    "MAX_ANNOTATION_BYTES",
    "MAX_CAPACITY",
    "METAX_ANNOTATION",
    "REPORT_TIMEOUT",
    "REQUEST_TIMEOUT",
    "VendorReading",
    "core_scaling",
    "liveness",
    "read_node",
    "read_vendor",
]
