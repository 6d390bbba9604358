"""DRA mode: a pod's HAMi-style GPU request as one ResourceClaimTemplate.

The request :func:`~gpuslice_common.requests.parse_pod` read (after the checks
and quotas of device-plugin mode) becomes a ``resource.k8s.io/v1``
ResourceClaimTemplate with one device request per GPU container, named after
the container, of device class :data:`~gpuslice_common.dra.DEVICE_CLASS`:

* ``count`` cards (``allocationMode: ExactCount``); with several, a
  ``distinctAttribute`` constraint on the card UUID keeps them distinct cards,
  as ``nvidia.com/gpu: N`` means (a shared card could otherwise be taken twice);
  NUMA binding is a ``matchAttribute`` constraint on the NUMA node;
* with consumable capacity, ``capacity.requests``: ``memory`` in MiB (absent
  for a whole card: the device's policy gives the whole card by default) and
  ``cores`` in percent (always, 0 included);
* CEL selectors over the attributes the node agent publishes under the
  driver's domain (``uuid``, ``model``, ``mode`` strings): card types as HAMi
  matches them (a case-insensitive substring of the model), UUIDs exactly.

Memory given as a share of a card (``gpumem-percentage`` below 100) depends on
the card. With consumable capacity such a container's request is a
``firstAvailable`` list: one subrequest per memory size of the cards the nodes
publish (read from the ResourceSlices of gpuslice's driver), each selecting
cards of exactly that size and asking for the share of it in MiB. Without
consumable capacity every device is a whole card, so a share is given a whole
card (the pod is warned).

The template's name is derived from its content, so pods of one shape share
one template and a template made for an earlier pod is reused.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import orjson

from gpuslice_common import dra
from gpuslice_common.config import ResourceNames
from gpuslice_common.kube import ObjectRef
from gpuslice_common.models import (
    ContainerGpuRequest,
    PodGpuRequest,
    ScoringWeights,
)
from gpuslice_common.requests import RequestError, parse_quantity
from gpuslice_webhook.denial import Denied, bad_request

__all__ = [
    "CLAIM_NAME",
    "MANAGED_BY",
    "MODE_LABEL",
    "TEMPLATES",
    "CardSizes",
    "ClaimTemplate",
    "NeedCardSizes",
    "card_sizes",
    "claim_template",
    "dra_mode",
    "ours_and_equal",
]

TEMPLATES: Final = ObjectRef(dra.API_VERSION, "resourceclaimtemplates")
SLICES: Final = ObjectRef(dra.API_VERSION, "resourceslices")
CLAIMS: Final = ObjectRef(dra.API_VERSION, "resourceclaims")
# a namespace's label choosing its pods' mode over the webhook's setting
MODE_LABEL: Final = "gpuslice.io/mode"
MODE_DRA: Final = "dra"
MODE_DEVICE_PLUGIN: Final = "device-plugin"
# the pod's claim made from the template, as its containers name it
CLAIM_NAME: Final = dra.POD_CLAIM
MANAGED_BY: Final = ("app.kubernetes.io/managed-by", "gpuslice")
NAME_PREFIX: Final = "gpuslice-"
ATTRIBUTES: Final = f'device.attributes["{dra.DRIVER}"]'
# what a name in a selector annotation may hold: printable ASCII without the
# quote and backslash, so that it is a CEL string literal as it stands
_LITERAL: Final = re.compile(r"^[ !#-\[\]-~]{1,256}$")
_DNS_LABEL: Final = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
MAX_REQUESTS: Final = 32  # resource.k8s.io/v1 DeviceRequestsMaxSize
MIB: Final = 1024 * 1024


def dra_mode(default: bool, labels: Mapping[str, str]) -> bool:
    """The mode of a namespace's pods: its ``gpuslice.io/mode`` label, else
    ``default``. Raises Denied for a label of another value."""
    value = labels.get(MODE_LABEL)
    if value is None:
        return default
    if value == MODE_DRA:
        return True
    if value == MODE_DEVICE_PLUGIN:
        return False
    raise Denied(
        f"the namespace's label {MODE_LABEL}={value!r} is neither {MODE_DRA!r} nor "
        f"{MODE_DEVICE_PLUGIN!r}; fix the label"
    )


@dataclass(frozen=True)
class ClaimTemplate:
    """The template a pod references: its name and the object to create."""

    name: str
    body: dict[str, Any]
    warnings: tuple[str, ...]

    @property
    def devices(self) -> dict[str, Any]:
        return dict(self.body["spec"]["spec"]["devices"])


class NeedCardSizes(Exception):
    """A container asks for a share of a card's memory: the template needs the
    memory sizes of the cluster's cards (:func:`card_sizes`)."""


@dataclass(frozen=True)
class CardSizes:
    """The memory sizes (bytes, ascending) a share of a card's memory is sized
    for: the configured ones, or those enough nodes publish, the most widespread
    :data:`MAX_SUBREQUESTS` of them; ``left_out`` sizes are rarer."""

    sizes: tuple[int, ...]
    left_out: int = 0


MAX_SUBREQUESTS: Final = 8  # resource.k8s.io/v1 FirstAvailableDeviceRequestMaxSize
MIN_NODES: Final = 2  # nodes that must publish a size (fewer nodes: all of them)


def card_sizes(
    slices: Sequence[Mapping[str, Any]], configured_mib: Sequence[int] = ()
) -> CardSizes:
    """The card memory sizes a share of a card's memory is sized for.

    ``configured_mib`` (GPUSLICE_DRA_CARD_MEMORY_MIB), when given, is the list.
    Otherwise the sizes of the cards in the ResourceSlices of gpuslice's driver
    that a node publishes for itself (``spec.nodeName`` set and the pool named
    after it, as gpuslice's agents publish: a kubelet's credential may publish
    slices of any pool for its node, but not in other nodes' names), counted by
    the distinct nodes that publish each: a size counts once at least
    :data:`MIN_NODES` nodes publish it (or all of them, when fewer publish), so
    one node publishing sizes of its own adds none, and the most widespread
    :data:`MAX_SUBREQUESTS` are kept, the larger first among as widespread."""
    if configured_mib:
        wanted = sorted({mib * MIB for mib in configured_mib})
        return CardSizes(tuple(wanted[:MAX_SUBREQUESTS]), max(0, len(wanted) - MAX_SUBREQUESTS))
    nodes: dict[int, set[str]] = {}
    publishing: set[str] = set()
    for obj in slices:
        spec = obj.get("spec") if isinstance(obj, Mapping) else None
        if not isinstance(spec, Mapping) or spec.get("driver") != dra.DRIVER:
            continue
        node = spec.get("nodeName")
        pool = spec.get("pool")
        if not isinstance(node, str) or not node:
            continue
        if not isinstance(pool, Mapping) or pool.get("name") != node:
            continue
        devices = spec.get("devices")
        for device in devices if isinstance(devices, list) else ():
            capacity = device.get("capacity") if isinstance(device, Mapping) else None
            memory = capacity.get(dra.MEMORY) if isinstance(capacity, Mapping) else None
            value = memory.get("value") if isinstance(memory, Mapping) else None
            try:
                size = int(parse_quantity(value))
            except RequestError:
                continue
            if size >= MIB:
                nodes.setdefault(size, set()).add(node)
                publishing.add(node)
    enough = min(MIN_NODES, len(publishing))
    ranked = sorted(
        (size for size, by in nodes.items() if len(by) >= enough),
        key=lambda size: (-len(nodes[size]), -size),
    )
    kept = ranked[:MAX_SUBREQUESTS]
    return CardSizes(tuple(sorted(kept)), len(nodes) - len(kept))


def claim_template(
    request: PodGpuRequest,
    namespace: str,
    *,
    consumable: bool,
    names: ResourceNames,
    sizes: CardSizes | None = None,
) -> ClaimTemplate:
    """The template for ``request`` (every container NVIDIA's). Raises Denied,
    and NeedCardSizes where a share of a card's memory needs ``sizes``."""
    gpu = request.containers
    if len(gpu) > MAX_REQUESTS:
        raise Denied(
            f"{len(gpu)} containers ask for GPUs; a ResourceClaim holds at most "
            f"{MAX_REQUESTS} requests"
        )
    selectors = _selectors(request)
    requests: list[dict[str, Any]] = []
    constraints: list[dict[str, Any]] = []
    warnings: list[str] = []
    for container in gpu:
        if not _DNS_LABEL.fullmatch(container.name):
            raise bad_request(
                f"container {container.name!r}: its name must be a DNS label to name "
                "its device request"
            )
        exactly: dict[str, Any] = {
            "deviceClassName": dra.DEVICE_CLASS,
            "allocationMode": "ExactCount",
            "count": container.count,
        }
        if selectors:
            exactly["selectors"] = [{"cel": {"expression": e}} for e in selectors]
        share = container.memory.percent not in (None, 100)
        if consumable and share:
            entry, notes = _by_card_size(container, exactly, names, sizes)
            requests.append(entry)
            warnings.extend(notes)
        else:
            if consumable:
                exactly["capacity"] = {"requests": _capacity(container)}
            elif share or container.cores < 100:
                warnings.append(
                    f"container {container.name!r}: the cluster's DRA devices are whole "
                    "cards (no consumable capacity), so it is given whole cards"
                )
            requests.append({"name": container.name, "exactly": exactly})
        if container.count > 1 and consumable:
            constraints.append(
                {"requests": [container.name], "distinctAttribute": f"{dra.DRIVER}/uuid"}
            )
        if container.count > 1 and request.selector.numa_bind:
            constraints.append(
                {"requests": [container.name], "matchAttribute": f"{dra.DRIVER}/numa"}
            )
    if request.gpu_policy is not None or request.scoring_weights != ScoringWeights():
        warnings.append(
            "in DRA mode kube-scheduler chooses the cards of a claim without scoring "
            "them: the pod's GPU scheduling policy and scoring weights have no effect"
        )
    devices: dict[str, Any] = {"requests": requests}
    if constraints:
        devices["constraints"] = constraints
    digest = hashlib.sha256(orjson.dumps(devices, option=orjson.OPT_SORT_KEYS)).hexdigest()
    name = NAME_PREFIX + digest[:24]
    body = {
        "apiVersion": dra.API_VERSION,
        "kind": "ResourceClaimTemplate",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {MANAGED_BY[0]: MANAGED_BY[1]},
        },
        "spec": {"spec": {"devices": devices}},
    }
    return ClaimTemplate(name, body, tuple(warnings))


def _capacity(container: ContainerGpuRequest, mib: int | None = None) -> dict[str, str]:
    """Capacity requests: memory in MiB (none for a whole card: the device's
    default is all of it) and cores, always stated (0 included), so that a
    request without them reads back as a whole card's."""
    capacity: dict[str, str] = {}
    mib = container.memory.mib if mib is None else mib
    if mib is not None:
        capacity[dra.MEMORY] = mib_quantity(mib)
    capacity[dra.CORES] = str(container.cores)
    return capacity


def _by_card_size(
    container: ContainerGpuRequest,
    exactly: Mapping[str, Any],
    names: ResourceNames,
    sizes: CardSizes | None,
) -> tuple[dict[str, Any], list[str]]:
    """A share of a card's memory: one subrequest per card memory size, each
    for cards of exactly that size and the share of it in MiB (rounded down, as
    device-plugin mode rounds it), the smallest cards first."""
    if sizes is None:
        raise NeedCardSizes
    percent = container.memory.percent
    assert percent is not None
    if not sizes.sizes:
        why = (
            f"no card size is published by {MIN_NODES} nodes (set GPUSLICE_DRA_CARD_MEMORY_MIB)"
            if sizes.left_out
            else "no node publishes gpuslice's devices yet"
        )
        raise Denied(
            f"container {container.name!r} asks for {percent}% of a card's memory "
            f"({names.memory_percentage}), but {why} to size it by; give the memory in MiB "
            f"with {names.memory}"
        )
    subrequests = []
    for size in sizes.sizes:
        mib = container.memory.on_card(size // MIB)
        selector = (
            f'device.capacity["{dra.DRIVER}"].{dra.MEMORY}.compareTo(quantity("{size}")) == 0'
        )
        sub = {
            **exactly,
            "name": f"mem-{size // MIB}mi",
            "selectors": [*exactly.get("selectors", ()), {"cel": {"expression": selector}}],
            "capacity": {"requests": _capacity(container, mib)},
        }
        subrequests.append(sub)
    notes = []
    if sizes.left_out:
        notes.append(
            f"container {container.name!r}: its share of a card's memory is sized for "
            f"the {len(sizes.sizes)} most common card sizes; cards of {sizes.left_out} "
            "rarer sizes are not used for it"
        )
    return {"name": container.name, "firstAvailable": subrequests}, notes


_BINARY: Final = ("Mi", "Gi", "Ti", "Pi", "Ei")


def mib_quantity(mib: int) -> str:
    """``mib`` MiB as the API server writes the quantity back (its canonical
    form: the largest binary suffix that keeps the number whole), so that the
    template read back is the one made: 1024 is ``1Gi``, 1536 ``1536Mi``."""
    value, suffix = mib, 0
    while value % 1024 == 0 and suffix < len(_BINARY) - 1:
        value //= 1024
        suffix += 1
    return f"{value}{_BINARY[suffix]}"


def _literal(value: str, annotation: str) -> str:
    if not _LITERAL.fullmatch(value):
        raise bad_request(
            f"annotation {annotation}: {value[:64]!r} holds characters a device selector "
            "cannot match (printable ASCII without quotes and backslashes)"
        )
    return f'"{value}"'


def _selectors(request: PodGpuRequest) -> list[str]:
    """CEL expressions a card must satisfy, all of them (HAMi's type and UUID
    annotations, the vGPU mode)."""
    selector = request.selector
    found: list[str] = []
    model = f"{ATTRIBUTES}.model.lowerAscii()"
    if selector.include_types:
        found.append(
            " || ".join(
                f"{model}.contains({_literal(t.lower(), 'use-gputype')})"
                for t in selector.include_types
            )
        )
    if selector.exclude_types:
        found.extend(
            f"!{model}.contains({_literal(t.lower(), 'nouse-gputype')})"
            for t in selector.exclude_types
        )
    uuid = f"{ATTRIBUTES}.uuid"
    if selector.include_uuids:
        listed = ", ".join(_literal(u, "use-gpuuuid") for u in selector.include_uuids)
        found.append(f"{uuid} in [{listed}]")
    if selector.exclude_uuids:
        listed = ", ".join(_literal(u, "nouse-gpuuuid") for u in selector.exclude_uuids)
        found.append(f"!({uuid} in [{listed}])")
    if request.vgpu_mode is not None:
        found.append(f'{ATTRIBUTES}.mode == "{request.vgpu_mode.value}"')
    return found


def ours_and_equal(found: Mapping[str, Any], template: ClaimTemplate) -> bool:
    """Is the template of our name in the namespace the one we would create?"""
    metadata = found.get("metadata")
    labels = metadata.get("labels") if isinstance(metadata, Mapping) else None
    if not isinstance(labels, Mapping) or labels.get(MANAGED_BY[0]) != MANAGED_BY[1]:
        return False
    spec = found.get("spec")
    inner = spec.get("spec") if isinstance(spec, Mapping) else None
    devices = inner.get("devices") if isinstance(inner, Mapping) else None
    return bool(_quantities(_normal(devices)) == _quantities(_normal(template.devices)))


def _normal(value: Any) -> Any:
    """``value`` with empty lists and maps left out (the API server drops them)."""
    if isinstance(value, Mapping):
        return {k: _normal(v) for k, v in value.items() if v not in ({}, [], None)}
    if isinstance(value, list):
        return [_normal(v) for v in value]
    return value


def _quantities(devices: Any) -> Any:
    """``devices`` with each capacity request read as a number (the API server
    writes quantities in its canonical form; unreadable ones stay as they are)."""
    if not isinstance(devices, Mapping):
        return devices
    out = copy.deepcopy(dict(devices))
    for entry in out.get("requests") or ():
        exactly = entry.get("exactly") if isinstance(entry, dict) else None
        capacity = exactly.get("capacity") if isinstance(exactly, dict) else None
        amounts = capacity.get("requests") if isinstance(capacity, dict) else None
        if isinstance(amounts, dict):
            for name, amount in amounts.items():
                with contextlib.suppress(RequestError):
                    amounts[name] = parse_quantity(amount)
    return out


def claimed_classes(objects: Sequence[Mapping[str, Any]]) -> set[str]:
    """Device classes the ResourceClaims / ResourceClaimTemplates ask for."""
    classes: set[str] = set()
    for obj in objects:
        spec = obj.get("spec")
        if isinstance(spec, Mapping) and obj.get("kind") == "ResourceClaimTemplate":
            spec = spec.get("spec")
        devices = spec.get("devices") if isinstance(spec, Mapping) else None
        requests = devices.get("requests") if isinstance(devices, Mapping) else None
        for entry in requests if isinstance(requests, list) else ():
            if not isinstance(entry, Mapping):
                continue
            parts = [entry.get("exactly"), *(entry.get("firstAvailable") or ())]
            for part in parts:
                if isinstance(part, Mapping) and isinstance(part.get("deviceClassName"), str):
                    classes.add(part["deviceClassName"])
    return classes
