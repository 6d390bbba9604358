"""The pod annotations other vendors' device plugins read at Allocate, written at bind.

A cluster that keeps a vendor's HAMi device plugin runs its pods when the
scheduler writes at bind what HAMi's scheduler writes for that vendor (HAMi
behaviour: each vendor's ``PatchAnnotations``). What that is depends on the
vendor's family (:class:`~gpuslice_common.devicetypes.Rules`, the vendor's
``rules``); :data:`FAMILIES` holds it, one row per family.

HAMi's encoding of a pod's cards of one vendor: per container of the pod, init
containers first, then app containers, each in spec order, ``;``-ended; in
each, per card, ``<uuid>,<device type>,<memory MiB>,<cores>`` ``:``-ended (a
container without cards is an empty entry, so the plugin finds each
container's by its index). With ``w`` the vendor's word (``allocate_key``):

* every family: ``hami.io/vgpu-node`` (the node), ``hami.io/bind-time`` (Unix
  seconds), ``hami.io/bind-phase: allocating``;
* ``hami``, ``metax-gpu``: ``hami.io/<w>-devices-to-allocate`` and
  ``hami.io/<w>-devices-allocated``, both the encoding;
* ``ascend``: those two; ``predicate-time`` (Unix seconds); and
  ``huawei.com/<device type>``, a JSON list over every card of every container
  of ``{"UUID", "temp", "memory", "core"}``, ``temp`` the smallest vNPU template
  that holds the card's memory (none: a whole card);
* ``cambricon``: those two; ``CAMBRICON_DSMLU_ASSIGNED: false``; and
  ``CAMBRICON_DSMLU_PROFILE``, ``<index>_<cores>_<memory / 256 MiB>`` of the
  first card of the first container with cards;
* ``mthreads``: ``hami.io/<w>-devices-allocated``; ``mthreads.com/gpu-index``,
  the indexes of the last container's cards, comma-joined;
  ``mthreads.com/predicate-time`` (Unix nanoseconds);
  ``mthreads.com/predicate-node`` (the node);
* ``metax-sgpu``: the two; ``metax-tech.com/gpu-devices-allocated``, a JSON list
  per container (``[]`` for one without cards) of ``{"uuid", "compute",
  "vRam"}``; ``metax-tech.com/predicate-time`` (Unix nanoseconds);
* ``enflame``: ``hami.io/<w>-devices-allocated``; ``enflame.com/gcu-assigned:
  false``; ``enflame.com/gcu-assigned-time`` (Unix nanoseconds);
  ``assigned-containers``, a JSON object by container name of ``{"allocated":
  false, "request": <slices>, "profileID", "profileName"}``, the DRS profile of
  the container's card (:mod:`gpuslice_common.drs`); and, of the first
  container with cards, its card's index as ``enflame.com/gcu-assigned-index``
  and ``enflame.com/gcu-assigned-id``, its device minor number as
  ``enflame.com/gcu-assigned-minor``, its profile's slices as
  ``enflame.com/gcu-request-size``;
* ``kunlun``: ``hami.io/<w>-allocated``; ``BAIDU_COM_DEVICE_IDX``, the indexes of
  the last container's cards, comma-joined.

"The last container": the last with cards of the vendor (HAMi overwrites the
value per container). JSON is written as Go writes it: no spaces, a map's keys
sorted, zero numbers and empty text left out where HAMi's fields say
``omitempty``. A value that cannot be written fails the bind
(:class:`EncodingError`, naming it): a separator in a card's UUID, a container
the pod's spec lacks, a card the scheduler's copy of the node does not hold
(its index and model are read there), an Enflame card whose model lists no
profile of the grant, a vendor whose family is unknown.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from gpuslice_common import drs
from gpuslice_common.config import VendorResources
from gpuslice_common.devicetypes import Rules
from gpuslice_common.models import NVIDIA, VENDOR_CARD_UUID_PATTERN, DeviceGrant, Placement
from gpuslice_scheduler.cluster import CardFacts

NODE: Final = "hami.io/vgpu-node"
BIND_TIME: Final = "hami.io/bind-time"
BIND_PHASE: Final = "hami.io/bind-phase"
ALLOCATING: Final = "allocating"
TO_ALLOCATE: Final = "hami.io/{}-devices-to-allocate"
ALLOCATED: Final = "hami.io/{}-devices-allocated"
KUNLUN_ALLOCATED: Final = "hami.io/{}-allocated"
NS_PER_S: Final = 1_000_000_000
# what a card's field of the encoding may hold: never one of its separators
_FIELD: Final = re.compile(VENDOR_CARD_UUID_PATTERN)


class EncodingError(ValueError):
    """A value cannot be written for a vendor's plugin; the message names it."""


@dataclass(frozen=True)
class VendorPod:
    """A pod being bound, as one vendor's plugin sees it: what a family's writer reads.

    ``containers``: every container of the pod in HAMi's order, each with its
    cards of the vendor (``()`` for none); ``cards``: the node's cards by UUID;
    ``now_ns``: the bind's time in Unix nanoseconds."""

    vendor: VendorResources
    node: str
    containers: tuple[tuple[str, tuple[DeviceGrant, ...]], ...]
    cards: Mapping[str, CardFacts]
    now_ns: int

    def encoded(self) -> str:
        """The pod's cards of the vendor in HAMi's encoding."""
        out: list[str] = []
        for _, grants in self.containers:
            for g in grants:
                out.append(f"{g.uuid},{self.vendor.device_type},{g.memory_mib},{g.cores}:")
            out.append(";")
        return "".join(out)

    def with_cards(self) -> list[tuple[str, tuple[DeviceGrant, ...]]]:
        """The containers holding cards of the vendor, in HAMi's order."""
        return [(name, grants) for name, grants in self.containers if grants]

    def card(self, grant: DeviceGrant) -> CardFacts:
        """The granted card's index and model; EncodingError when the node lacks it."""
        facts = self.cards.get(grant.uuid)
        if facts is None:
            raise EncodingError(
                f"card {grant.uuid!r} is not among node {self.node}'s cards in the scheduler's copy"
            )
        return facts

    def indexes(self, grants: tuple[DeviceGrant, ...]) -> str:
        return ",".join(str(self.card(g).index) for g in grants)

    @property
    def seconds(self) -> str:
        return str(self.now_ns // NS_PER_S)


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _omitempty(**fields: Any) -> dict[str, Any]:
    """``fields`` without the zero ones, as Go's ``omitempty`` leaves them out."""
    return {k: v for k, v in fields.items() if v}


def _ascend(p: VendorPod) -> dict[str, str]:
    templates = sorted(p.vendor.templates, key=lambda t: t.memory_mib)

    def temp(mib: int) -> str:
        return next((t.name for t in templates if mib <= t.memory_mib), "")

    cards = [
        _omitempty(UUID=g.uuid, temp=temp(g.memory_mib), memory=g.memory_mib, core=g.cores)
        for _, grants in p.with_cards()
        for g in grants
    ]
    return {"predicate-time": p.seconds, f"huawei.com/{p.vendor.device_type}": _json(cards)}


def _cambricon(p: VendorPod) -> dict[str, str]:
    _, grants = p.with_cards()[0]
    first = grants[0]
    profile = f"{p.card(first).index}_{first.cores}_{first.memory_mib // 256}"
    return {"CAMBRICON_DSMLU_ASSIGNED": "false", "CAMBRICON_DSMLU_PROFILE": profile}


def _mthreads(p: VendorPod) -> dict[str, str]:
    _, grants = p.with_cards()[-1]
    return {
        "mthreads.com/gpu-index": p.indexes(grants),
        "mthreads.com/predicate-time": str(p.now_ns),
        "mthreads.com/predicate-node": p.node,
    }


def _metax_sgpu(p: VendorPod) -> dict[str, str]:
    per_container = [
        [_omitempty(uuid=g.uuid, compute=g.cores, vRam=g.memory_mib) for g in grants]
        for _, grants in p.containers
    ]
    return {
        "metax-tech.com/gpu-devices-allocated": _json(per_container),
        "metax-tech.com/predicate-time": str(p.now_ns),
    }


def _profile(p: VendorPod, grant: DeviceGrant) -> drs.Profile:
    """The DRS profile ``grant`` is on its card (EncodingError when none)."""
    profiles = drs.profiles_of(p.card(grant).model)
    found = drs.granted(profiles, grant.memory_mib, grant.cores) if profiles else None
    if found is None:
        raise EncodingError(
            f"card {grant.uuid!r} on node {p.node} has no DRS profile of "
            f"{grant.memory_mib} MiB and {grant.cores}% cores"
        )
    return found


def _enflame(p: VendorPod) -> dict[str, str]:
    chosen = {name: (grants[0], _profile(p, grants[0])) for name, grants in p.with_cards()}
    assigned = {
        name: {
            "allocated": False,
            "request": prof.size,
            "profileID": prof.id,
            "profileName": prof.name,
        }
        for name, (_, prof) in sorted(chosen.items(), key=lambda item: item[0])
    }
    first, prof = next(iter(chosen.values()))
    facts = p.card(first)
    return {
        "enflame.com/gcu-assigned": "false",
        "enflame.com/gcu-assigned-time": str(p.now_ns),
        "assigned-containers": _json(assigned),
        "enflame.com/gcu-assigned-index": str(facts.index),
        "enflame.com/gcu-assigned-id": str(facts.index),
        "enflame.com/gcu-assigned-minor": drs.minor_of(facts.model) or "",
        "enflame.com/gcu-request-size": str(prof.size),
    }


def _kunlun(p: VendorPod) -> dict[str, str]:
    _, grants = p.with_cards()[-1]
    return {"BAIDU_COM_DEVICE_IDX": p.indexes(grants)}


def _nothing(p: VendorPod) -> dict[str, str]:
    return {}


@dataclass(frozen=True)
class Family:
    """What a family's plugin reads: the keys holding HAMi's encoding (``{}``: the
    vendor's word) and the family's own annotations."""

    encoded: tuple[str, ...]
    own: Callable[[VendorPod], dict[str, str]] = _nothing


BOTH: Final = (TO_ALLOCATE, ALLOCATED)
FAMILIES: Final[dict[Rules, Family]] = {
    Rules.HAMI: Family(BOTH),
    Rules.ASCEND: Family(BOTH, _ascend),
    Rules.CAMBRICON: Family(BOTH, _cambricon),
    Rules.MTHREADS: Family((ALLOCATED,), _mthreads),
    Rules.METAX_GPU: Family(BOTH),
    Rules.METAX_SGPU: Family(BOTH, _metax_sgpu),
    Rules.ENFLAME: Family((ALLOCATED,), _enflame),
    Rules.KUNLUN: Family((KUNLUN_ALLOCATED,), _kunlun),
}


def _names(pod: Mapping[str, Any]) -> list[str]:
    spec = pod.get("spec") or {}
    return [
        c.get("name", "")
        for field in ("initContainers", "containers")
        for c in (spec.get(field) or ())
        if isinstance(c, Mapping)
    ]


def _containers(
    pod: Mapping[str, Any], placement: Placement, vendor: VendorResources
) -> tuple[tuple[str, tuple[DeviceGrant, ...]], ...]:
    """Every container of ``pod`` in HAMi's order with its cards of ``vendor``."""
    by_name = {c.name: c.devices for c in placement.containers if c.vendor == vendor.vendor}
    out = tuple((name, by_name.pop(name, ())) for name in _names(pod))
    if by_name:
        raise EncodingError(f"container {next(iter(by_name))!r} is not in the pod's spec")
    for _, grants in out:
        for g in grants:
            if not _FIELD.fullmatch(g.uuid):
                raise EncodingError(f"card {g.uuid[:64]!r} cannot be written for HAMi")
    return out


def encode_devices(pod: Mapping[str, Any], placement: Placement, vendor: VendorResources) -> str:
    """The pod's cards of ``vendor`` in HAMi's encoding (see the module's text)."""
    return VendorPod(vendor, placement.node, _containers(pod, placement, vendor), {}, 0).encoded()


def family(vendor: VendorResources) -> Family:
    """The row of :data:`FAMILIES` for ``vendor`` (EncodingError for an unknown family)."""
    try:
        return FAMILIES[Rules(vendor.rules)]
    except ValueError:
        raise EncodingError(
            f"vendor {vendor.vendor}: rules {vendor.rules!r} name no family whose plugin "
            "gpuslice writes for"
        ) from None


def vendor_annotations(
    pod: Mapping[str, Any],
    placement: Placement,
    vendors: tuple[VendorResources, ...],
    cards: Mapping[str, CardFacts],
    now_ns: int,
) -> dict[str, str]:
    """What to write on a pod placed on other vendors' cards, beside gpuslice's own
    record ({} for a pod on NVIDIA's cards only). ``cards``: the node's cards by
    UUID; ``now_ns``: Unix nanoseconds."""
    used = {c.vendor for c in placement.containers} - {NVIDIA}
    known = {v.vendor: v for v in vendors}
    annotations: dict[str, str] = {}
    for name in sorted(used):
        vendor = known.get(name)
        if vendor is None:
            raise EncodingError(f"vendor {name} is not in the scheduler's device configuration")
        row = family(vendor)
        p = VendorPod(vendor, placement.node, _containers(pod, placement, vendor), cards, now_ns)
        encoded = p.encoded()
        annotations |= {key.format(vendor.allocate_key): encoded for key in row.encoded}
        annotations |= row.own(p)
    if annotations:
        seconds = str(now_ns // NS_PER_S)
        annotations |= {NODE: placement.node, BIND_TIME: seconds, BIND_PHASE: ALLOCATING}
    return annotations
