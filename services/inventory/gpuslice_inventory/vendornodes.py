"""Other vendors' accelerators, as HAMi's device plugins announce them on node objects.

HAMi's vendor device plugins write two annotations on their node: a register
annotation listing the cards (a JSON list, or for some vendors an older text
form, see :class:`~gpuslice_common.devicetypes.AnnotationFormat`) and a
handshake annotation saying the plugin is alive. :func:`read_node` turns one
node object into a :class:`VendorReading` per announced device type, each
independent of the others: a bad annotation of one vendor refuses that vendor
only, with a message naming the node, the vendor and the annotation key.

Liveness, from the handshake (HAMi's protocol):

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
scales what pods ask for, not what cards report.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from pydantic import ValidationError

from gpuslice_common.devicetypes import AnnotationFormat, DeviceType
from gpuslice_common.models import (
    MAX_DEVICE_MEMORY_MIB,
    MAX_DEVICES,
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
    """

    node: str
    vendor: str
    state: State
    devices: tuple[GpuDevice, ...] = ()
    split_count: int = 10
    cores: tuple[int, ...] = ()
    message: str = ""

    def inventory(self) -> NodeInventory:
        """What to register: the live cards, or none (the vendor's cards go)."""
        devices = self.devices if self.state == "live" else ()
        return NodeInventory(
            node=self.node, devices=devices, split_count=self.split_count, vendor=self.vendor
        )


class _Refused(Exception):
    pass


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


# ---------------------------------------------------------------- register annotations


def _whole(value: Any, what: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _Refused(f"{what} is {str(value)[:20]!r}, not a whole number")
    if not low <= value <= high:
        raise _Refused(f"{what} is {value}, outside {low}..{high}")
    return value


def _depth(value: Any, level: int = 0) -> int:
    if level > MAX_JSON_DEPTH:
        return level
    if isinstance(value, dict):
        return max([level] + [_depth(v, level + 1) for v in value.values()])
    if isinstance(value, list):
        return max([level] + [_depth(v, level + 1) for v in value])
    return level


def _json_cards(text: str) -> list[dict[str, Any]]:
    try:
        cards = json.loads(text)
    except (ValueError, RecursionError):
        raise _Refused("it is not JSON") from None
    if not isinstance(cards, list) or not all(isinstance(c, dict) for c in cards):
        raise _Refused("it is not a JSON list of cards")
    if _depth(cards) > MAX_JSON_DEPTH:
        raise _Refused(f"it nests deeper than {MAX_JSON_DEPTH}")
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
        if not _CARD_UUID.fullmatch(uuid):
            # HAMi's plugins read it back from annotations where these separate cards
            raise _Refused(f"{what} uuid {uuid[:64]!r} is not letters, digits and -_./")
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
        try:
            devices.append(
                GpuDevice(
                    uuid=uuid,
                    index=index,
                    model=c["model"],
                    memory_mib=_whole(c["memory"], f"{what} memory", 1, MAX_DEVICE_MEMORY_MIB),
                    numa=_whole(c["numa"], f"{what} numa", 0, MAX_NUMA_NODE),
                    healthy=c["health"],
                    vendor=vendor,
                )
            )
        except ValidationError as exc:
            error = exc.errors()[0]
            where = ".".join(str(p) for p in error["loc"]) or "card"
            raise _Refused(f"{what} {where}: {error['msg']}") from None
    return tuple(devices), min(counts), tuple(cores)


def read_vendor(
    node: Mapping[str, Any],
    device_type: DeviceType,
    now: datetime,
    report_timeout: timedelta = REPORT_TIMEOUT,
) -> VendorReading | None:
    """One vendor's cards on ``node``; None when the node shows no sign of the vendor."""
    announcement = device_type.announcement
    name = _node_name(node)
    vendor = device_type.vendor
    if announcement is None or not device_type.supported:
        return None
    annos = _annotations(node)
    register = annos.get(announcement.register)
    handshake = annos.get(announcement.handshake) if announcement.handshake else None
    if register is None and handshake is None:
        return None

    def refused(key: str, why: str) -> VendorReading:
        return VendorReading(name, vendor, "refused", message=f"node {name}: {vendor} {key}: {why}")

    if announcement.handshake is None:
        capacity = _quantity(node, "capacity", device_type.count_resource)
        state: State = "live" if capacity > 0 else "gone"
        why = "" if capacity else f"the node has no {device_type.count_resource} capacity"
    else:
        allocatable = _quantity(node, "allocatable", device_type.count_resource)
        state, why = liveness(handshake, now, allocatable, report_timeout)
        if state == "refused":
            return refused(announcement.handshake, why)
    if state == "gone":
        return VendorReading(name, vendor, "gone", message=f"node {name}: {vendor}: {why}")
    if register is None:
        return refused(announcement.register, "the annotation is missing")
    if not isinstance(register, str):
        return refused(announcement.register, "the annotation is not text")
    if len(register) > MAX_ANNOTATION_BYTES:
        return refused(
            announcement.register,
            f"the annotation is {len(register)} bytes, above {MAX_ANNOTATION_BYTES}",
        )
    try:
        if announcement.format is AnnotationFormat.JSON:
            cards = _json_cards(register)
        else:
            cards = _colon_cards(register)
        devices, split_count, cores = _devices(vendor, cards, announcement.cores)
    except _Refused as exc:
        return refused(announcement.register, str(exc))
    return VendorReading(name, vendor, "live", devices, split_count, cores)


def read_node(
    node: Mapping[str, Any],
    types: Sequence[DeviceType],
    now: datetime,
    report_timeout: timedelta = REPORT_TIMEOUT,
) -> list[VendorReading]:
    """Every announced vendor's cards on ``node`` (vendors with no sign left out)."""
    readings = []
    for device_type in types:
        reading = read_vendor(node, device_type, now, report_timeout)
        if reading is not None:
            readings.append(reading)
    return readings


__all__ = [
    "MAX_ANNOTATION_BYTES",
    "REPORT_TIMEOUT",
    "REQUEST_TIMEOUT",
    "VendorReading",
    "liveness",
    "read_node",
    "read_vendor",
]
