"""The pod annotations HAMi's vendor device plugins read at Allocate.

A cluster that keeps a vendor's HAMi device plugin runs its pods when the
scheduler writes what HAMi's scheduler writes at bind (HAMi behaviour):

* ``hami.io/<word>-devices-to-allocate`` and ``hami.io/<word>-devices-allocated``,
  both the pod's cards of that vendor: per container of the pod, init
  containers first, then app containers, each in spec order, ``;``-ended; in
  each, per card, ``<uuid>,<device type>,<memory MiB>,<cores>`` ``:``-ended (a
  container without cards is an empty entry, so the plugin finds each
  container's by its index);
* ``hami.io/vgpu-node`` (the node), ``hami.io/bind-time`` (Unix seconds) and
  ``hami.io/bind-phase`` ``allocating``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Final

from gpuslice_common.config import VendorResources
from gpuslice_common.models import VENDOR_CARD_UUID_PATTERN, Placement

NODE: Final = "hami.io/vgpu-node"
BIND_TIME: Final = "hami.io/bind-time"
BIND_PHASE: Final = "hami.io/bind-phase"
ALLOCATING: Final = "allocating"
# what a card's field of the encoding may hold: never one of its separators
_FIELD: Final = re.compile(VENDOR_CARD_UUID_PATTERN)


class EncodingError(ValueError):
    """A value cannot be written in HAMi's encoding; the message names it."""


def allocate_keys(vendor: VendorResources) -> tuple[str, str]:
    """The two pod annotations naming a pod's cards of ``vendor``."""
    word = vendor.allocate_key
    return f"hami.io/{word}-devices-to-allocate", f"hami.io/{word}-devices-allocated"


def _names(pod: Mapping[str, Any]) -> list[str]:
    spec = pod.get("spec") or {}
    return [
        c.get("name", "")
        for field in ("initContainers", "containers")
        for c in (spec.get(field) or ())
        if isinstance(c, Mapping)
    ]


def encode_devices(pod: Mapping[str, Any], placement: Placement, vendor: VendorResources) -> str:
    """The pod's cards of ``vendor`` in HAMi's encoding (see the module's text)."""
    by_name = {c.name: c for c in placement.containers if c.vendor == vendor.vendor}
    out: list[str] = []
    for name in _names(pod):
        assignment = by_name.pop(name, None)
        for grant in assignment.devices if assignment is not None else ():
            if not _FIELD.fullmatch(grant.uuid):
                raise EncodingError(f"card {grant.uuid[:64]!r} cannot be written for HAMi")
            out.append(f"{grant.uuid},{vendor.device_type},{grant.memory_mib},{grant.cores}:")
        out.append(";")
    if by_name:
        raise EncodingError(f"container {next(iter(by_name))!r} is not in the pod's spec")
    return "".join(out)


def vendor_annotations(
    pod: Mapping[str, Any], placement: Placement, vendors: tuple[VendorResources, ...], now: int
) -> dict[str, str]:
    """What to write on a pod placed on other vendors' cards, beside gpuslice's own
    record ({} for a pod on NVIDIA's cards only); ``now`` in Unix seconds."""
    used = {c.vendor for c in placement.containers}
    annotations: dict[str, str] = {}
    for vendor in vendors:
        if vendor.vendor in used:
            encoded = encode_devices(pod, placement, vendor)
            for key in allocate_keys(vendor):
                annotations[key] = encoded
    if annotations:
        annotations |= {NODE: placement.node, BIND_TIME: str(now), BIND_PHASE: ALLOCATING}
    return annotations
