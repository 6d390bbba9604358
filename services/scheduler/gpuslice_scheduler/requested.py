"""What a pod asks of its node's CPU and memory, and what a node has, counted
as kube-scheduler counts them (``resourcehelper.PodRequests``, NodeResourcesFit).

A pod's request, per resource:

* the sum of its app containers and its restartable init containers
  (``restartPolicy: Always``, "sidecars": they run beside the apps);
* or, if more, the largest plain init container together with the sidecars
  started before it (init containers run one at a time, in order);
* plus ``spec.overhead`` (the RuntimeClass's own cost).

A container counts its ``requests``; a resource it only limits counts its limit,
as the API server defaults a missing request to the limit. What a node has is its
``status.allocatable``. CPU is in milli-CPU and memory in bytes, both rounded up
as Kubernetes rounds quantities, so sums stay exact.

Every quantity must read as a Kubernetes quantity between 0 and a bound no node
comes near (a million cores, an exbibyte); anything else raises
:class:`ResourceError`, whose message names the container and resource. Where a
request above the bound is still a request (a pod already on a node, whose
request counts against it), ``pod_request(pod, clamp=True)`` counts it as the
bound instead: more than its node has, never less.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Final

from gpuslice_common.requests import QuantityTooLarge, RequestError, parse_quantity

__all__ = [
    "MAX_CPU_MILLI",
    "MAX_MEMORY",
    "MIB",
    "Amount",
    "ResourceError",
    "node_allocatable",
    "pod_request",
]

MIB: Final = 1 << 20
MAX_CPU_MILLI: Final = 10**9  # a million cores
MAX_MEMORY: Final = 1 << 60  # an exbibyte
RESOURCES: Final = ("cpu", "memory")


class ResourceError(RequestError):
    """A CPU or memory quantity that cannot be read or is out of bounds."""


@dataclass(frozen=True)
class Amount:
    """CPU (milli-CPU) and memory (bytes), both whole."""

    cpu: int = 0
    memory: int = 0

    def __add__(self, other: Amount) -> Amount:
        return Amount(self.cpu + other.cpu, self.memory + other.memory)

    def __sub__(self, other: Amount) -> Amount:
        return Amount(self.cpu - other.cpu, self.memory - other.memory)

    def most(self, other: Amount) -> Amount:
        """The larger of each resource."""
        return Amount(max(self.cpu, other.cpu), max(self.memory, other.memory))

    @property
    def memory_mib(self) -> float:
        return self.memory / MIB


ZERO: Final = Amount()


def _mapping(value: object, where: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ResourceError(f"{where} must be an object")
    return value


def _list(value: object, where: str) -> Sequence[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise ResourceError(f"{where} must be a list")
    return value


def _whole(raw: object, resource: str, where: str, clamp: bool = False) -> int:
    """One quantity as whole milli-CPU or bytes, rounded up, within bounds (with
    ``clamp``, one above the bound is the bound)."""
    bound = MAX_CPU_MILLI if resource == "cpu" else MAX_MEMORY
    try:
        value = parse_quantity(raw)
    except QuantityTooLarge:
        if clamp:
            return bound
        raise ResourceError(
            f"{where}: {resource} must be between 0 and {_bound(resource)}"
        ) from None
    except RequestError as exc:
        raise ResourceError(f"{where}: {resource} has an invalid value ({exc})") from None
    scaled = value * 1000 if resource == "cpu" else value
    if clamp and scaled > bound:
        return bound
    if not Decimal(0) <= scaled <= bound:
        raise ResourceError(f"{where}: {resource} must be between 0 and {_bound(resource)}")
    return math.ceil(scaled)


def _bound(resource: str) -> str:
    return f"{MAX_CPU_MILLI // 1000} cores" if resource == "cpu" else f"{MAX_MEMORY} bytes"


def _amount(resources: Mapping[str, Any], where: str, clamp: bool = False) -> Amount:
    """CPU and memory of a resource list (absent: 0)."""
    cpu, memory = (
        _whole(resources[r], r, where, clamp) if r in resources else 0 for r in RESOURCES
    )
    return Amount(cpu, memory)


def _container(container: object, kind: str, clamp: bool) -> Amount:
    """What one container requests: its requests, else its limits, per resource."""
    if not isinstance(container, Mapping):
        raise ResourceError(f"each {kind} must be an object")
    name = container.get("name")
    label = f"{kind} {name!r}" if isinstance(name, str) else kind
    resources = _mapping(container.get("resources"), f"{label}: resources")
    limits = _mapping(resources.get("limits"), f"{label}: resources.limits")
    requests = _mapping(resources.get("requests"), f"{label}: resources.requests")
    return _amount({**limits, **requests}, label, clamp)


def pod_request(pod: Mapping[str, Any], *, clamp: bool = False) -> Amount:
    """The pod's CPU and memory request, as kube-scheduler fits it on a node.

    With ``clamp``, a quantity above the bound (a well-formed one, however large)
    counts as the bound rather than raising :class:`ResourceError`."""
    spec = _mapping(pod.get("spec"), "spec")
    total = ZERO
    for container in _list(spec.get("containers"), "spec.containers"):
        total += _container(container, "container", clamp)
    sidecars = ZERO  # restartable init containers started so far
    init_peak = ZERO
    for container in _list(spec.get("initContainers"), "spec.initContainers"):
        need = _container(container, "init container", clamp)
        if isinstance(container, Mapping) and container.get("restartPolicy") == "Always":
            total += need
            sidecars += need
            init_peak = init_peak.most(sidecars)
        else:
            init_peak = init_peak.most(need + sidecars)
    overhead = _amount(_mapping(spec.get("overhead"), "spec.overhead"), "spec.overhead", clamp)
    return total.most(init_peak) + overhead


def node_allocatable(node: Mapping[str, Any]) -> Amount:
    """The node's ``status.allocatable`` CPU and memory; both must be there."""
    status = _mapping(node.get("status"), "status")
    allocatable = _mapping(status.get("allocatable"), "status.allocatable")
    missing = [r for r in RESOURCES if r not in allocatable]
    if missing:
        raise ResourceError(f"status.allocatable has no {' and no '.join(missing)}")
    return _amount(allocatable, "status.allocatable")
