"""Namespace GPU quotas: ResourceQuota limits on GPU memory and cores, kept at admission.

Kubernetes' own quota controller does not count ``limits.nvidia.com/gpumem`` or
``limits.nvidia.com/gpucores`` (it counts extended resources only under
``requests.``, per container), so gpuslice counts the ``limits.<resource>`` keys
of the configured memory and cores resources; ``requests.`` keys stay
Kubernetes' own. A pod's use is its peak:

* memory: MiB per card times the card count, cores: percent per card times the
  count, summed over the containers that run together (init containers one at a
  time beside the sidecars started before them, then every app container with
  every sidecar), the largest phase counting;
* a pod already placed counts what its placement annotation says it holds, so
  requests given as a share of a card are priced by the card they got;
* a pod translated in DRA mode counts as any other: its GPU resources stay in
  its limits beside its claim (it has no placement annotation: DRA places it).

A pod that gives memory as a share of a card cannot be priced before it is
placed; in a namespace with a memory quota it is refused with a message saying
to state the memory in MiB. Pods that have terminated do not count.
"""

from __future__ import annotations

import logging
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
    PodGpuRequest,
)
from gpuslice_common.requests import RequestError, parse_pod, parse_quantity
from gpuslice_webhook.denial import Denied

log = logging.getLogger(__name__)

Resource = Literal["memory", "cores"]
PREFIX: Final = "limits."


@dataclass(frozen=True)
class Demand:
    """GPU memory (MiB) and cores (percent of a card) a pod holds at its peak."""

    memory_mib: int = 0
    cores: int = 0
    # containers whose memory is a share of a card, unknown until placed
    unpriced: tuple[ContainerGpuRequest, ...] = ()

    def amount(self, resource: Resource) -> int:
        return self.memory_mib if resource == "memory" else self.cores


@dataclass(frozen=True)
class QuotaLimit:
    quota: str  # the ResourceQuota's name
    key: str  # e.g. "limits.nvidia.com/gpumem"
    resource: Resource
    hard: int


def request_demand(containers: Iterable[ContainerGpuRequest]) -> Demand:
    """The peak of a pod's requests (see the module's text for the phases)."""
    memory = {"sidecars": 0, "apps": 0, "peak": 0}
    cores = {"sidecars": 0, "apps": 0, "peak": 0}
    unpriced: list[ContainerGpuRequest] = []
    for container in containers:
        if container.vendor != NVIDIA:
            continue  # NVIDIA's resources are the ones quotas name
        mib = container.memory.mib
        if mib is None:
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
    return Demand(memory["peak"], cores["peak"], tuple(unpriced))


def placed_demand(annotation: str, uid: str) -> Demand:
    """What the pod ``uid`` holds, from its placement annotation. Raises ValueError,
    also for a record of another pod (one written into the pod when it was created:
    the API server gives the UID, so the scheduler never placed a pod of that UID)."""
    placement = Placement.from_annotation(annotation)
    if placement.pod.uid != uid:
        raise ValueError(f"the placement is pod {placement.pod.uid[:64]!r}'s")
    footprint = placement.footprint().values()
    return Demand(sum(f.memory_mib for f in footprint), sum(f.cores for f in footprint))


def pod_demand(pod: Mapping[str, Any], settings: RequestSettings) -> Demand:
    """What an existing pod counts against its namespace's quota (0 if unreadable).

    Whether it asks for another vendor's cards (not counted) is read from its spec,
    which cannot change, never from its placement annotation, which its owner may edit.
    """
    try:
        request: PodGpuRequest | None = parse_pod(pod, settings)
    except RequestError:
        request = None
    if request is not None and request.vendor != NVIDIA:
        return Demand()  # another vendor's cards: NVIDIA's quotas do not count them
    metadata = pod.get("metadata")
    annotations = metadata.get("annotations") if isinstance(metadata, Mapping) else None
    placement = annotations.get(PLACEMENT_ANNOTATION) if isinstance(annotations, Mapping) else None
    if isinstance(placement, str):
        try:
            return placed_demand(placement, object_uid(pod))
        except ValueError as exc:
            log.debug("placement annotation not used (%s); counting the pod's requests", exc)
    return Demand() if request is None else request_demand(request.containers)


def gpu_limits(quotas: Sequence[Mapping[str, Any]], settings: RequestSettings) -> list[QuotaLimit]:
    """The GPU memory and cores limits among a namespace's ResourceQuotas."""
    resources: dict[str, Resource] = {
        settings.resources.memory: "memory",
        settings.resources.cores: "cores",
    }
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
            resource = resources.get(str(key)[len(PREFIX) :])
            if resource is None:
                continue
            try:
                amount = parse_quantity(value)
            except RequestError as exc:
                log.warning("ResourceQuota %s: ignoring %s (%s)", name, key, exc)
                continue
            found.append(QuotaLimit(name, str(key), resource, int(amount)))
    return found


def check(
    limits: Sequence[QuotaLimit],
    wanted: Demand,
    used: Demand,
    namespace: str,
    settings: RequestSettings,
) -> None:
    """Raise Denied when the pod does not fit every limit."""
    memory_limits = [limit for limit in limits if limit.resource == "memory"]
    if memory_limits and wanted.unpriced:
        container = wanted.unpriced[0]
        limit = memory_limits[0]
        raise Denied(
            f"namespace {namespace!r} limits GPU memory ({limit.key} in ResourceQuota "
            f"{limit.quota!r}), so GPU memory must be given in MiB with "
            f"{settings.resources.memory}; container {container.name!r} asks for "
            f"{container.memory.percent}% of a card"
        )
    for limit in limits:
        want, have = wanted.amount(limit.resource), used.amount(limit.resource)
        if want and have + want > limit.hard:
            raise Denied(
                f"exceeded quota: {limit.quota}, requested: {limit.key}={want}, "
                f"used: {limit.key}={have}, limited: {limit.key}={limit.hard}"
            )


def namespace_usage(
    pods: Iterable[Mapping[str, Any]],
    settings: RequestSettings,
    *,
    skip: str = "",
) -> Demand:
    """What the namespace's pods hold; ``skip`` names a pod not to count (being replaced)."""
    memory = cores = 0
    for pod in pods:
        metadata = pod.get("metadata")
        if skip and isinstance(metadata, Mapping) and metadata.get("name") == skip:
            continue
        demand = pod_demand(pod, settings)
        memory += demand.memory_mib
        cores += demand.cores
    return Demand(memory, cores)
