"""Dynamic Resource Allocation (``resource.k8s.io/v1``): the names both sides share.

In DRA mode a node's agent publishes its cards as devices of driver
:data:`DRIVER` in one ResourceSlice pool named after the node, kube-scheduler
allocates ResourceClaims of device class :data:`DEVICE_CLASS` from them, and
kubelet asks the agent's kubelet plugin to prepare each claim. A device's name
in the slice is derived from the card's UUID (:func:`device_name`), so it
stays the same across reboots and re-indexing; the inventory maps it back
(:func:`card_of`) and never trusts an index.

Capacity is published in the units kube-scheduler compares: ``memory`` in
bytes, ``cores`` as percent of the card (100 for a whole one).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Final

from gpuslice_common.models import ClaimRef

API_VERSION: Final = "resource.k8s.io/v1"
DRIVER: Final = "gpu.gpuslice.io"
DEVICE_CLASS: Final = "gpuslice.io"
MEMORY: Final = "memory"  # capacity name: bytes
CORES: Final = "cores"  # capacity name: percent of the card
# kubelet's plugin directories and the CDI spec directory on a node
PLUGINS_DIR: Final = "/var/lib/kubelet/plugins"
REGISTRY_DIR: Final = "/var/lib/kubelet/plugins_registry"
CDI_DIR: Final = "/var/run/cdi"
# CDI device kind (vendor/class) of the devices the plugin answers
CDI_KIND: Final = "gpuslice.io/container"
# the pod's claim the webhook adds (spec.resourceClaims[].name), made from its template
POD_CLAIM: Final = "gpuslice"

_CARD = re.compile(r"^(gpu|mig)-([0-9a-f][-0-9a-f]{0,57})$")


def device_name(uuid: str, *, mig: bool = False) -> str:
    """The slice's device name for the card (or MIG instance) with this UUID:
    ``gpu-<uuid>`` / ``mig-<uuid>`` in lower case without NVIDIA's ``GPU-``/``MIG-``
    prefix, a DNS label (at most 63 characters). Raises ValueError for a UUID that
    cannot make one."""
    body = uuid.lower()
    for prefix in ("gpu-", "mig-"):
        body = body.removeprefix(prefix)
    name = ("mig-" if mig else "gpu-") + body
    if not _CARD.fullmatch(name) or name.endswith("-"):
        raise ValueError(f"card UUID {uuid!r} makes no DRA device name")
    return name


def card_of(name: str, uuids: list[str] | tuple[str, ...]) -> str | None:
    """The UUID among ``uuids`` whose :func:`device_name` is ``name``; None if none."""
    for uuid in uuids:
        for mig in (False, True):
            try:
                if device_name(uuid, mig=mig) == name:
                    return uuid
            except ValueError:
                continue
    return None


__all__ = [
    "API_VERSION",
    "CDI_DIR",
    "CDI_KIND",
    "CORES",
    "DEVICE_CLASS",
    "DRIVER",
    "MEMORY",
    "PLUGINS_DIR",
    "POD_CLAIM",
    "REGISTRY_DIR",
    "ClaimRef",
    "card_of",
    "device_name",
    "has_pod_claim",
]


def has_pod_claim(pod: Mapping[str, Any]) -> bool:
    """Does the pod hold the claim the webhook adds (:data:`POD_CLAIM`)?"""
    spec = pod.get("spec")
    claims = spec.get("resourceClaims") if isinstance(spec, Mapping) else None
    return isinstance(claims, list) and any(
        isinstance(c, Mapping) and c.get("name") == POD_CLAIM for c in claims
    )
