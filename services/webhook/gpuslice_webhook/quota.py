"""Namespace GPU quotas: ResourceQuota limits on GPU memory and cores, kept at admission.

Kubernetes' own quota controller does not count ``limits.nvidia.com/gpumem`` or
``limits.nvidia.com/gpucores`` (it counts extended resources only under
``requests.``, per container), so gpuslice counts the ``limits.<resource>`` keys
of the configured memory and cores resources, NVIDIA's and every other
vendor's, as HAMi's scheduler does (its ``FitQuota``); ``requests.`` keys stay
Kubernetes' own. A vendor's keys count only the pods asking for that vendor's
cards (read from the pod's spec, which cannot change): NVIDIA's keys count
NVIDIA pods alone, ``limits.cambricon.com/mlu.smlu.vmemory`` Cambricon pods
alone. A memory key counts in its resource's unit, MiB divided by the vendor's
memory factor (rounded up); a pod fits while the MiB held and asked for stay
within the limit times the factor. A cores key counts in the vendor's unit
(percent of a card; Moore Threads' sixteenths). A pod's use is its peak:

* memory: MiB per card times the card count, cores: percent per card times the
  count, summed over the containers that run together (init containers one at a
  time beside the sidecars started before them, then every app container with
  every sidecar), the largest phase counting;
* a pod already placed counts what its placement annotation says it holds, so
  requests given as a share of a card are priced by the card they got;
* a pod translated in DRA mode counts as any other: its GPU resources stay in
  its limits beside its claim (it has no placement annotation: DRA places it).

A pod that gives memory as a share of a card cannot be priced before it is
placed; in a namespace with a memory quota of its vendor it is refused with a
message saying to state the memory with the memory resource. An Enflame pod's
memory and cores are those of the DRS profile it gets on its node: it counts
from its placement once placed and, before, is refused in a namespace with an
Enflame memory or cores quota (counting it as nothing would let it past either).
Pods that have terminated do not count.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

from gpuslice_common.config import RequestSettings
from gpuslice_common.kube import object_uid
from gpuslice_common.models import (
    NVIDIA,
    PLACEMENT_ANNOTATION,
    ContainerGpuRequest,
    Placement,
)
from gpuslice_common.requests import RequestError, parse_pod, parse_quantity
from gpuslice_webhook.denial import Denied

log = logging.getLogger(__name__)

Resource = Literal["memory", "cores"]
PREFIX: Final = "limits."


@dataclass(frozen=True)
class Demand:
    """GPU memory (MiB) and cores (the vendor's unit) a pod holds at its peak, of
    ``vendor``'s cards."""

    memory_mib: int = 0
    cores: int = 0
    # containers whose memory is a share of a card, unknown until placed
    unpriced: tuple[ContainerGpuRequest, ...] = ()
    vendor: str = NVIDIA
    # Enflame containers: memory and cores are the DRS profile's, known once placed
    profiled: tuple[ContainerGpuRequest, ...] = ()


@dataclass(frozen=True)
class QuotaLimit:
    quota: str  # the ResourceQuota's name
    key: str  # e.g. "limits.nvidia.com/gpumem"
    resource: Resource
    hard: int
    vendor: str = NVIDIA  # whose pods it counts
    factor: int = 1  # MiB per unit of a memory resource

    def amount(self, demand: Demand) -> int:
        """``demand`` in this key's unit: memory rounded up to whole units."""
        if self.resource == "cores":
            return demand.cores
        return -(-demand.memory_mib // self.factor)

    def exceeded_by(self, used: Demand, wanted: Demand) -> bool:
        """Would ``used`` and ``wanted`` together pass the limit?"""
        if self.resource == "cores":
            return used.cores + wanted.cores > self.hard
        return used.memory_mib + wanted.memory_mib > self.hard * self.factor


def request_demand(containers: Iterable[ContainerGpuRequest]) -> Demand:
    """The peak of a pod's requests (see the module's text for the phases); its
    containers ask for one vendor's cards (``parse_pod`` keeps them so)."""
    memory = {"sidecars": 0, "apps": 0, "peak": 0}
    cores = {"sidecars": 0, "apps": 0, "peak": 0}
    unpriced: list[ContainerGpuRequest] = []
    profiled: list[ContainerGpuRequest] = []
    vendor = NVIDIA
    for container in containers:
        vendor = container.vendor
        mib = container.memory.mib
        if container.drs is not None:
            profiled.append(container)
        elif mib is None:
            unpriced.append(container)
        for totals, amount in (
            (memory, (mib or 0) * container.count),
            (cores, container.cores * container.count),
        ):
            if container.sidecar:
                totals["sidecars"] += amount
                totals["peak"] = max(totals["peak"], totals["sidecars"])
            elif container.init:
                totals["peak"] = max(totals["peak"], totals["sidecars"] + amount)
            else:
                totals["apps"] += amount
    for totals in (memory, cores):
        totals["peak"] = max(totals["peak"], totals["sidecars"] + totals["apps"])
    return Demand(memory["peak"], cores["peak"], tuple(unpriced), vendor, tuple(profiled))


def placed_demand(annotation: str, uid: str, vendor: str = NVIDIA) -> Demand:
    """What the pod ``uid`` holds, from its placement annotation, counted as
    ``vendor``'s. Raises ValueError, also for a record of another pod (one written
    into the pod when it was created: the API server gives the UID, so the
    scheduler never placed a pod of that UID)."""
    placement = Placement.from_annotation(annotation)
    if placement.pod.uid != uid:
        raise ValueError(f"the placement is pod {placement.pod.uid[:64]!r}'s")
    footprint = placement.footprint().values()
    memory, cores = sum(f.memory_mib for f in footprint), sum(f.cores for f in footprint)
    return Demand(memory, cores, vendor=vendor)


def pod_demand(pod: Mapping[str, Any], settings: RequestSettings) -> Demand:
    """What an existing pod counts against its namespace's quotas (0 if unreadable).

    Whose cards it asks for, and how many, is read from its spec, which cannot
    change, never from its annotations, which its owner may edit after admission
    (one made unreadable would count the pod as nothing, or its placement as
    NVIDIA's); a spec that cannot be read counts its placement as NVIDIA's.
    """
    metadata = pod.get("metadata")
    annotations = metadata.get("annotations") if isinstance(metadata, Mapping) else None
    try:
        request = parse_pod(_without_annotations(pod), settings)
    except RequestError:
        request = None
    vendor = NVIDIA if request is None else request.vendor
    placement = annotations.get(PLACEMENT_ANNOTATION) if isinstance(annotations, Mapping) else None
    if isinstance(placement, str):
        try:
            return placed_demand(placement, object_uid(pod), vendor)
        except ValueError as exc:
            log.debug("placement annotation not used (%s); counting the pod's requests", exc)
    return Demand() if request is None else request_demand(request.containers)


def _without_annotations(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    metadata = pod.get("metadata")
    if not isinstance(metadata, Mapping):
        return pod
    return {**pod, "metadata": {k: v for k, v in metadata.items() if k != "annotations"}}


def gpu_limits(quotas: Sequence[Mapping[str, Any]], settings: RequestSettings) -> list[QuotaLimit]:
    """The memory and cores limits of every vendor among a namespace's ResourceQuotas."""
    resources: dict[str, tuple[Resource, str, int]] = {
        settings.resources.memory: ("memory", NVIDIA, 1),
        settings.resources.cores: ("cores", NVIDIA, 1),
    }
    for vendor in settings.vendors:
        if vendor.memory is not None:
            resources[vendor.memory] = ("memory", vendor.vendor, vendor.memory_factor)
        if vendor.cores is not None:
            resources[vendor.cores] = ("cores", vendor.vendor, 1)
    found: list[QuotaLimit] = []
    for quota in quotas:
        metadata = quota.get("metadata")
        spec = quota.get("spec")
        hard = spec.get("hard") if isinstance(spec, Mapping) else None
        if not isinstance(hard, Mapping):
            continue
        name = str(metadata.get("name", "")) if isinstance(metadata, Mapping) else ""
        for key, value in hard.items():
            if not str(key).startswith(PREFIX):
                continue
            named = resources.get(str(key)[len(PREFIX) :])
            if named is None:
                continue
            resource, owner, factor = named
            try:
                amount = parse_quantity(value)
            except RequestError as exc:
                log.warning("ResourceQuota %s: ignoring %s (%s)", name, key, exc)
                continue
            found.append(QuotaLimit(name, str(key), resource, int(amount), owner, factor))
    return found


def check(limits: Sequence[QuotaLimit], wanted: Demand, used: Demand, namespace: str) -> None:
    """Raise Denied when the pod does not fit every limit of its vendor; ``used``
    is what the namespace's pods of that vendor hold."""
    own = [limit for limit in limits if limit.vendor == wanted.vendor]
    if own and wanted.profiled:
        container, limit = wanted.profiled[0], own[0]
        raise Denied(
            f"namespace {namespace!r} limits {limit.key} (ResourceQuota {limit.quota!r}); "
            f"container {container.name!r} asks for an Enflame DRS profile, whose memory "
            "and cores are known only once the pod is placed, so it cannot be counted "
            "against that limit: run Enflame pods in a namespace without one"
        )
    memory_limits = [limit for limit in own if limit.resource == "memory"]
    if memory_limits and wanted.unpriced:
        container = wanted.unpriced[0]
        limit = memory_limits[0]
        resource = limit.key[len(PREFIX) :]
        what = "GPU" if limit.vendor == NVIDIA else limit.vendor
        unit = " in MiB" if limit.vendor == NVIDIA else ""
        raise Denied(
            f"namespace {namespace!r} limits {what} memory ({limit.key} in ResourceQuota "
            f"{limit.quota!r}), so {what} memory must be given{unit} with {resource}; "
            f"container {container.name!r} asks for {container.memory.percent}% of a card, "
            "whose memory is known only once it is placed"
        )
    for limit in own:
        want = limit.amount(wanted)
        if want and limit.exceeded_by(used, wanted):
            have = limit.amount(used)
            raise Denied(
                f"exceeded quota: {limit.quota}, requested: {limit.key}={want}, "
                f"used: {limit.key}={have}, limited: {limit.key}={limit.hard}"
            )


def namespace_usage(
    pods: Iterable[Mapping[str, Any]],
    settings: RequestSettings,
    *,
    skip: str = "",
) -> dict[str, Demand]:
    """What the namespace's pods hold, per vendor; ``skip`` names a pod not to count
    (being replaced)."""
    memory: defaultdict[str, int] = defaultdict(int)
    cores: defaultdict[str, int] = defaultdict(int)
    for pod in pods:
        metadata = pod.get("metadata")
        if skip and isinstance(metadata, Mapping) and metadata.get("name") == skip:
            continue
        demand = pod_demand(pod, settings)
        memory[demand.vendor] += demand.memory_mib
        cores[demand.vendor] += demand.cores
    return {v: Demand(memory[v], cores[v], vendor=v) for v in memory.keys() | cores.keys()}
