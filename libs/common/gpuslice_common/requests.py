"""Reading a pod's GPU demand from its spec and annotations (HAMi v2.10 compatible).

A pod asks for GPUs through five extended resources per container (names are
configurable through :class:`~gpuslice_common.config.ResourceNames`; HAMi's by default):

* ``nvidia.com/gpu`` - number of distinct cards (0-64);
* ``nvidia.com/gpumem`` - device memory per card in MiB (0 means "not set");
* ``nvidia.com/gpumem-percentage`` - device memory per card as 0-100 % of the card;
* ``nvidia.com/gpucores`` - compute share per card, 0-100 %;
* ``nvidia.com/priority`` - 0 (high) or 1 (low).

Rules applied to each container (init containers included):

* A value is read from ``resources.limits`` and else from ``resources.requests``; when
  both hold it they must be equal. Values are Kubernetes quantities (strings or
  integers) and must be whole, non-negative and within the bounds above.
* Setting memory, memory percentage or cores without a count asks for
  ``defaults.gpu_count`` cards (HAMi's ``defaultGPUNum``). A count of 0 together with
  any other GPU resource is an error; a count of 0 alone asks for nothing. Priority
  without any GPU is an error (no node advertises the priority resource).
* ``gpumem: 0`` and ``gpumem-percentage: 0`` are "not set" for memory (a limit of
  0 would read as no limit in the container), though their presence still brings
  in the default count.
* Without cores, a container takes whole cards exclusively (100 % cores) when it
  asks ``gpumem-percentage: 100``, or sets neither memory resource at all (a count
  alone: 100 % memory too), as HAMi's webhook does. Any other memory resource
  present, even a 0, leaves cores to ``defaults.cores``.
* ``gpumem`` wins over ``gpumem-percentage``; the pod gets a warning. Without
  either (or with only zeros), memory is ``defaults.memory_mib`` MiB when that is
  positive (``defaultMem``), else the whole card. Cores default to
  ``defaults.cores``, priority to ``defaults.priority``.
* Container names are non-empty and unique across init and app containers. The
  result lists init containers first, then app containers, each in spec order. An
  init container with ``restartPolicy: Always`` (a native sidecar) is flagged
  ``sidecar``: it keeps running beside the app containers.

Pod annotations (see :data:`ANNOTATIONS`) are read in HAMi's form and in gpuslice's
``gpuslice.io/...`` form; when both are present the gpuslice one wins. Annotation
values must be strings; a blank value counts as unset. Annotations are read only
when some container asks for a GPU, so a pod without GPUs never fails here. HAMi's
GPU policies ``topology-aware``, ``mutex`` and ``numa`` are accepted with a warning
and mean the default policy (``numa`` also binds each container to one NUMA node).
``device-scoring-weights`` is HAMi's ``slot=<n>,core=<n>,memory=<n>``: all three
keys once each, whole numbers from 0 to 10**9, not all 0; it weighs the card score
of the ``binpack`` and ``spread`` policies (the ``fragmentation`` policy has no use
for it).

Other vendors (``settings.vendors``, from HAMi's device configuration): a
container naming a vendor's resources asks for that vendor's cards, as HAMi's
plugins read them: the count resource is required; memory times the vendor's
memory factor is MiB, unset or 0 the whole card; cores unset are 100. A
container naming two vendors' resources (NVIDIA's included), or a pod whose
containers ask for different vendors' cards, is refused.

Every problem is reported as :class:`RequestError`, whose message names the
container and the resource (or the annotation) at fault.
"""

from __future__ import annotations

import decimal
import enum
import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Final, Literal, TypeVar

from pydantic import ValidationError

from gpuslice_common import vendorrequests
from gpuslice_common.config import RequestSettings, ResourceNames, VendorResources
from gpuslice_common.models import (
    MAX_SCORING_WEIGHT,
    NVIDIA,
    ContainerGpuRequest,
    DeviceSelector,
    GpuPolicy,
    MemoryRequest,
    NodePolicy,
    PodGpuRequest,
    PodRef,
    ScoringWeights,
    VgpuMode,
)
from gpuslice_common.requesterrors import QuantityTooLarge, RequestError

__all__ = [
    "ANNOTATIONS",
    "DEFAULT_SETTINGS",
    "MAX_GPU_COUNT",
    "MAX_GPU_MEMORY_MIB",
    "MAX_POD_GPU_COUNT",
    "AnnotationKey",
    "AnnotationKeys",
    "QuantityTooLarge",
    "RequestError",
    "asks_for_gpus",
    "has_gpu_request",
    "parse_container",
    "parse_pod",
    "parse_quantity",
    "pod_ref",
]

DEFAULT_SETTINGS: Final = RequestSettings()
MAX_GPU_COUNT: Final = 64
# the cards a pod asks for over all its containers: each container's are placed
# (and kept, per node, for every kind of pod the scheduler has seen) separately
MAX_POD_GPU_COUNT: Final = 64
MAX_GPU_MEMORY_MIB: Final = 2**31


# ---------------------------------------------------------------- annotation keys


@dataclass(frozen=True, slots=True)
class AnnotationKey:
    """One pod annotation in HAMi's spelling and in gpuslice's."""

    hami: str
    gpuslice: str

    def lookup_order(self) -> tuple[str, str]:
        """Keys to try, the winning one first."""
        return (self.gpuslice, self.hami)


@dataclass(frozen=True, slots=True)
class AnnotationKeys:
    """Every pod annotation this module reads."""

    use_gpu_type: AnnotationKey = AnnotationKey("nvidia.com/use-gputype", "gpuslice.io/use-gputype")
    nouse_gpu_type: AnnotationKey = AnnotationKey(
        "nvidia.com/nouse-gputype", "gpuslice.io/nouse-gputype"
    )
    use_gpu_uuid: AnnotationKey = AnnotationKey("nvidia.com/use-gpuuuid", "gpuslice.io/use-gpuuuid")
    nouse_gpu_uuid: AnnotationKey = AnnotationKey(
        "nvidia.com/nouse-gpuuuid", "gpuslice.io/nouse-gpuuuid"
    )
    numa_bind: AnnotationKey = AnnotationKey("nvidia.com/numa-bind", "gpuslice.io/numa-bind")
    vgpu_mode: AnnotationKey = AnnotationKey("nvidia.com/vgpu-mode", "gpuslice.io/vgpu-mode")
    gpu_policy: AnnotationKey = AnnotationKey(
        "hami.io/gpu-scheduler-policy", "gpuslice.io/gpu-scheduler-policy"
    )
    node_policy: AnnotationKey = AnnotationKey(
        "hami.io/node-scheduler-policy", "gpuslice.io/node-scheduler-policy"
    )
    scoring_weights: AnnotationKey = AnnotationKey(
        "hami.io/device-scoring-weights", "gpuslice.io/device-scoring-weights"
    )


ANNOTATIONS: Final = AnnotationKeys()

# HAMi GPU policies accepted for compatibility; they fall back to the default policy.
_COMPAT_GPU_POLICIES: Final = ("topology-aware", "mutex", "numa")
_NUMA_GPU_POLICY: Final = "numa"


# ---------------------------------------------------------------- quantities

_QUANTITY: Final = re.compile(
    r"(?P<number>[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))"
    r"(?:[eE](?P<exponent>[+-]?[0-9]+)|(?P<suffix>[KMGTPE]i|[numkMGTPE]))?"
)
_BINARY_SUFFIXES: Final = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
_DECIMAL_SUFFIXES: Final = {
    "n": -9,
    "u": -6,
    "m": -3,
    "k": 3,
    "M": 6,
    "G": 9,
    "T": 12,
    "P": 15,
    "E": 18,
}
_MAX_QUANTITY_LENGTH: Final = 128
_MAX_EXPONENT: Final = 64
_MAX_MAGNITUDE: Final = 10**30
_MAX_MAGNITUDE_DIGITS: Final = 30  # the power of ten of _MAX_MAGNITUDE
_MAX_EXPONENT_DIGITS: Final = 9
# Wide enough that scaling a <=128-digit mantissa by 1024**6 is always exact.
_EXACT: Final = decimal.Context(prec=512)


def parse_quantity(value: object) -> Decimal:
    """Parse a Kubernetes ``resource.Quantity`` given as a string or an integer.

    Grammar: optional sign, digits with an optional fraction, then an optional
    binary suffix (Ki Mi Gi Ti Pi Ei), decimal suffix (n u m k M G T P E) or
    exponent (``e``/``E`` and an integer). Magnitudes above 1e30, exponents beyond
    +-64 and strings over 128 characters are refused, so the arithmetic stays
    small. Raises :class:`RequestError` without naming a container
    (:class:`QuantityTooLarge` for a positive one above those limits).
    """
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise RequestError(f"quantity must be a string or an integer, got {_type_name(value)}")
    if isinstance(value, int):
        if abs(value) > _MAX_MAGNITUDE:
            error = QuantityTooLarge if value > 0 else RequestError
            raise error("quantity is too large (limit 1e30)")
        return Decimal(value)
    if len(value) > _MAX_QUANTITY_LENGTH:
        match = _QUANTITY.fullmatch(value)
        error = QuantityTooLarge if match is not None and _huge(match) else RequestError
        raise error(f"quantity is longer than {_MAX_QUANTITY_LENGTH} characters")
    match = _QUANTITY.fullmatch(value)
    if match is None:
        raise RequestError(f"not a Kubernetes quantity: {_clip(value)}")
    if match["exponent"] is not None and abs(int(match["exponent"])) > _MAX_EXPONENT:
        error = QuantityTooLarge if _huge(match) else RequestError
        raise error(f"quantity exponent is out of range: {_clip(value)}")
    result = _scale(Decimal(match["number"]), match["exponent"], match["suffix"])
    if abs(result) > _MAX_MAGNITUDE:
        error = QuantityTooLarge if result > 0 else RequestError
        raise error(f"quantity is too large (limit 1e30): {_clip(value)}")
    return result


def _scale(number: Decimal, exponent: str | None, suffix: str | None) -> Decimal:
    if exponent is not None:
        return _EXACT.scaleb(number, Decimal(int(exponent)))
    if suffix is None:
        return number
    if suffix in _BINARY_SUFFIXES:
        return _EXACT.multiply(number, Decimal(1024 ** _BINARY_SUFFIXES[suffix]))
    return _EXACT.scaleb(number, Decimal(_DECIMAL_SUFFIXES[suffix]))


def _huge(match: re.Match[str]) -> bool:
    """Whether a quantity past the length or exponent limits is positive and above
    1e30 all the same: its leading digit's power of ten, scaled, is beyond 30."""
    number = Decimal(match["number"])
    if number <= 0:
        return False
    exponent, suffix = match["exponent"], match["suffix"]
    if exponent is not None:
        digits = exponent.lstrip("+-").lstrip("0")
        if len(digits) > _MAX_EXPONENT_DIGITS:  # beyond any digit count of a mantissa
            return not exponent.startswith("-")
        power = int(exponent)
    elif suffix in _BINARY_SUFFIXES:
        power = 3 * _BINARY_SUFFIXES[suffix]  # 1024**k is above 10**(3k)
    else:
        power = _DECIMAL_SUFFIXES.get(suffix or "", 0)
    return number.adjusted() + power > _MAX_MAGNITUDE_DIGITS


# ---------------------------------------------------------------- small shape helpers


_JSON_TYPE_NAMES: Final = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}
_CLIP: Final = 60


def _type_name(value: object) -> str:
    """The JSON name of a value's type, for messages."""
    if value is None:
        return "null"
    if isinstance(value, Mapping):
        return "an object"
    if isinstance(value, list | tuple):
        return "a list"
    return _JSON_TYPE_NAMES.get(type(value), type(value).__name__)


def _clip(text: str) -> str:
    """``repr`` of user text, shortened so messages stay readable."""
    return repr(text if len(text) <= _CLIP else text[:_CLIP] + "...")


def _mapping(value: object, where: str) -> Mapping[Any, Any]:
    """An optional JSON object: missing or null reads as empty."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise RequestError(f"{where} must be an object, got {_type_name(value)}")
    return value


def _list(value: object, where: str) -> Sequence[Any]:
    """An optional JSON list: missing or null reads as empty."""
    if value is None:
        return ()
    if not isinstance(value, list | tuple):
        raise RequestError(f"{where} must be a list, got {_type_name(value)}")
    return value


def _optional_str(value: object, where: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise RequestError(f"{where} must be a string, got {_type_name(value)}")
    return value


# ---------------------------------------------------------------- containers


def _bounds(names: ResourceNames) -> tuple[tuple[str, int, int], ...]:
    """Each GPU resource with its lowest and highest accepted value."""
    return (
        (names.gpu, 0, MAX_GPU_COUNT),
        (names.memory, 0, MAX_GPU_MEMORY_MIB),
        (names.memory_percentage, 0, 100),
        (names.cores, 0, 100),
        (names.priority, 0, 1),
    )


def _container_name(container: object, where: str) -> str:
    if not isinstance(container, Mapping):
        raise RequestError(f"{where} must be an object, got {_type_name(container)}")
    name = container.get("name")
    if not isinstance(name, str) or not name:
        raise RequestError(f"{where}: container name must be a non-empty string")
    return name


def _quantity(label: str, resource: str, raw: object, source: str) -> Decimal:
    try:
        return parse_quantity(raw)
    except RequestError as err:
        raise RequestError(
            f"{label}: {resource} in {source} has an invalid value ({err})"
        ) from None


def _amount(
    label: str,
    resource: str,
    limits: Mapping[Any, Any],
    requests: Mapping[Any, Any],
    low: int,
    high: int,
) -> int | None:
    """The whole-number value of one resource, or None when the container omits it."""
    in_limits, in_requests = resource in limits, resource in requests
    if not (in_limits or in_requests):
        return None
    limit = _quantity(label, resource, limits[resource], "limits") if in_limits else None
    request = _quantity(label, resource, requests[resource], "requests") if in_requests else None
    if limit is not None and request is not None and limit != request:
        raise RequestError(
            f"{label}: {resource} requests and limits differ "
            f"(requests {requests[resource]}, limits {limits[resource]})"
        )
    raw = limits[resource] if in_limits else requests[resource]
    value = limit if limit is not None else request
    assert value is not None
    if value < 0:
        raise RequestError(f"{label}: {resource} must not be negative, got {raw}")
    if value != value.to_integral_value():
        raise RequestError(f"{label}: {resource} must be a whole number, got {raw}")
    number = int(value)
    if not low <= number <= high:
        raise RequestError(f"{label}: {resource} must be between {low} and {high}, got {raw}")
    return number


def _amounts(container: Mapping[Any, Any], label: str, names: ResourceNames) -> dict[str, int]:
    """The GPU resources a container sets, by resource name, checked against their bounds."""
    resources = _mapping(container.get("resources"), f"{label}: resources")
    limits = _mapping(resources.get("limits"), f"{label}: resources.limits")
    requests = _mapping(resources.get("requests"), f"{label}: resources.requests")
    found: dict[str, int] = {}
    for resource, low, high in _bounds(names):
        value = _amount(label, resource, limits, requests, low, high)
        if value is not None:
            found[resource] = value
    return found


def _set_together(names: Sequence[str]) -> str:
    return f"{', '.join(names)} {'is' if len(names) == 1 else 'are'} set"


def _build_container(
    name: str, init: bool, sidecar: bool, amounts: Mapping[str, int], settings: RequestSettings
) -> tuple[ContainerGpuRequest | None, list[str]]:
    """Apply HAMi's defaults to one container's amounts; also return its warnings."""
    names, defaults = settings.resources, settings.defaults
    label = f"container {name!r}"
    shares = [r for r in (names.memory, names.memory_percentage, names.cores) if r in amounts]
    count = amounts.get(names.gpu)
    if count == 0:
        others = [*shares, *([names.priority] if names.priority in amounts else [])]
        if others:
            raise RequestError(f"{label}: {names.gpu} is 0 but {_set_together(others)}")
        return None, []
    if count is None and not shares:
        if names.priority in amounts:
            raise RequestError(
                f"{label}: {names.priority} is set but no GPU is requested "
                f"(set {names.gpu}, {names.memory}, {names.memory_percentage} or {names.cores})"
            )
        return None, []

    mib = amounts.get(names.memory) or None  # 0 means "not set" for both
    percent = amounts.get(names.memory_percentage) or None
    cores = amounts.get(names.cores)
    warnings: list[str] = []
    if mib is not None and percent is not None:
        warnings.append(
            f"{label}: {names.memory_percentage} is ignored because {names.memory} is set"
        )
    if cores is None and _exclusive_without_cores(amounts, names):
        cores = 100
    if count is not None and not shares:
        memory = MemoryRequest(percent=100)  # a count alone: whole cards, alone
    elif mib is not None:
        memory = MemoryRequest(mib=mib)
    elif percent is not None:
        memory = MemoryRequest(percent=percent)
    elif defaults.memory_mib > 0:
        memory = MemoryRequest(mib=defaults.memory_mib)
    else:
        memory = MemoryRequest(percent=100)
    priority: Literal[0, 1] = 0 if amounts.get(names.priority, defaults.priority) == 0 else 1
    request = ContainerGpuRequest(
        name=name,
        init=init,
        sidecar=sidecar,
        count=count if count is not None else defaults.gpu_count,
        memory=memory,
        cores=cores if cores is not None else defaults.cores,
        priority=priority,
    )
    return request, warnings


def _exclusive_without_cores(amounts: Mapping[str, int], names: ResourceNames) -> bool:
    """HAMi's webhook makes a container without cores exclusive when it asks for 100 %
    memory, or names no memory resource at all; a memory resource present with any
    other value (0 included) leaves its cores to the default."""
    if names.memory_percentage in amounts:
        return amounts[names.memory_percentage] == 100
    return names.memory not in amounts


def _named(container: Mapping[Any, Any], names: Sequence[str]) -> list[str]:
    """Which of ``names`` the container's limits or requests mention."""
    resources = container.get("resources")
    found: list[str] = []
    if isinstance(resources, Mapping):
        for part in ("limits", "requests"):
            amounts = resources.get(part)
            if isinstance(amounts, Mapping):
                found += [n for n in names if n in amounts and n not in found]
    return found


def _vendor_of(
    container: Mapping[Any, Any], label: str, settings: RequestSettings
) -> VendorResources | None:
    """The other vendor a container asks for, or None for NVIDIA (or nothing); asking
    for two vendors' cards is refused, naming a resource of each."""
    if not settings.vendors:
        return None
    asked: list[tuple[str, str, VendorResources | None]] = [
        (NVIDIA, n, None) for n in _named(container, settings.resources.all())[:1]
    ]
    for v in settings.vendors:
        asked += [(v.vendor, n, v) for n in _named(container, v.all())[:1]]
    if len(asked) > 1:
        (first, a, _), (second, b, _) = asked[:2]
        raise RequestError(
            f"{label}: asks for {first} ({a}) and {second} ({b}) cards; "
            "a container uses one vendor's cards"
        )
    return asked[0][2] if asked else None


def _vendor_amounts(
    container: Mapping[Any, Any], label: str, vendor: VendorResources
) -> tuple[dict[str, int], frozenset[str]]:
    """The vendor's resources the container sets, and those written with a unit."""
    resources = _mapping(container.get("resources"), f"{label}: resources")
    limits = _mapping(resources.get("limits"), f"{label}: resources.limits")
    requests = _mapping(resources.get("requests"), f"{label}: resources.requests")
    found: dict[str, int] = {}
    with_unit: set[str] = set()
    for resource, high in vendorrequests.bounds(vendor):
        value = _amount(label, resource, limits, requests, 0, high)
        if value is not None:
            found[resource] = value
            raw = limits.get(resource, requests.get(resource))
            if isinstance(raw, str) and any(ch.isalpha() for ch in raw):
                with_unit.add(resource)
    return found, frozenset(with_unit)


def _parse_named_container(
    container: Mapping[Any, Any], name: str, init: bool, settings: RequestSettings
) -> tuple[ContainerGpuRequest | None, list[str]]:
    label = f"container {name!r}"
    sidecar = init and container.get("restartPolicy") == "Always"
    vendor = _vendor_of(container, label, settings)
    try:
        if vendor is not None:
            amounts, with_unit = _vendor_amounts(container, label, vendor)
            return vendorrequests.build(name, init, sidecar, vendor, amounts, with_unit)
        amounts = _amounts(container, label, settings.resources)
        return _build_container(name, init, sidecar, amounts, settings)
    except ValidationError as exc:
        raise RequestError(f"{label}: invalid GPU request ({_first_error(exc)})") from None


def parse_container(
    container: Mapping[str, Any], *, init: bool, settings: RequestSettings = DEFAULT_SETTINGS
) -> ContainerGpuRequest | None:
    """One container's GPU request with defaults applied, or None if it asks for no GPU.

    Warnings (such as an ignored memory percentage) are only reported by
    :func:`parse_pod`.
    """
    name = _container_name(container, "container")
    request, _warnings = _parse_named_container(container, name, init, settings)
    return request


# ---------------------------------------------------------------- annotations


def _annotations(metadata: Mapping[Any, Any]) -> Mapping[str, str]:
    annotations = _mapping(metadata.get("annotations"), "metadata.annotations")
    for key, value in annotations.items():
        if not isinstance(key, str):
            raise RequestError(f"annotation keys must be strings, got {_type_name(key)}")
        if not isinstance(value, str):
            raise RequestError(f"annotation {_clip(key)} must be a string, got {_type_name(value)}")
    return annotations


def _annotation(annotations: Mapping[str, str], key: AnnotationKey) -> tuple[str, str] | None:
    """The winning (key, stripped value) of an annotation, or None when unset or blank."""
    for name in key.lookup_order():
        if name in annotations:
            value = annotations[name].strip()
            return (name, value) if value else None
    return None


def _name_list(annotations: Mapping[str, str], key: AnnotationKey) -> tuple[str, ...]:
    found = _annotation(annotations, key)
    if found is None:
        return ()
    items = (item.strip() for item in found[1].split(","))
    return tuple(dict.fromkeys(item for item in items if item))


def _numa_bind(annotations: Mapping[str, str]) -> bool:
    found = _annotation(annotations, ANNOTATIONS.numa_bind)
    if found is None:
        return False
    key, value = found
    if value.lower() not in {"true", "false"}:
        raise RequestError(f"annotation {key} must be 'true' or 'false', got {_clip(value)}")
    return value.lower() == "true"


E = TypeVar("E", bound=enum.StrEnum)


def _choice(
    annotations: Mapping[str, str], key: AnnotationKey, kind: type[E], what: str
) -> E | None:
    """An annotation whose value must be one of ``kind``'s values (case-insensitive)."""
    found = _annotation(annotations, key)
    if found is None:
        return None
    name, value = found
    try:
        return kind(value.lower())
    except ValueError:
        accepted = ", ".join(member.value for member in kind)
        raise RequestError(
            f"annotation {name}: unknown {what} {_clip(value)}; accepted: {accepted}"
        ) from None


def _vgpu_mode(annotations: Mapping[str, str]) -> VgpuMode | None:
    return _choice(annotations, ANNOTATIONS.vgpu_mode, VgpuMode, "vGPU mode")


def _gpu_policy(annotations: Mapping[str, str]) -> tuple[GpuPolicy | None, bool, list[str]]:
    """The GPU policy, whether it asks for NUMA binding, and any compatibility warning."""
    found = _annotation(annotations, ANNOTATIONS.gpu_policy)
    if found is None:
        return None, False, []
    key, value = found
    policy = value.lower()
    if policy in {p.value for p in GpuPolicy}:
        return GpuPolicy(policy), False, []
    if policy in _COMPAT_GPU_POLICIES:
        numa = policy == _NUMA_GPU_POLICY
        effect = "the default GPU policy" + (" with NUMA binding" if numa else "")
        warning = f"annotation {key}={value!r} is accepted for HAMi compatibility; using {effect}"
        return None, numa, [warning]
    accepted = ", ".join([*(p.value for p in GpuPolicy), *_COMPAT_GPU_POLICIES])
    raise RequestError(f"annotation {key}: unknown GPU policy {_clip(value)}; accepted: {accepted}")


def _node_policy(annotations: Mapping[str, str]) -> NodePolicy | None:
    return _choice(annotations, ANNOTATIONS.node_policy, NodePolicy, "node policy")


_WEIGHT_KEYS: Final = ("slot", "core", "memory")
_WEIGHT: Final = re.compile(r"[+-]?[0-9]{1,12}")


def _scoring_weights(annotations: Mapping[str, str]) -> ScoringWeights:
    """HAMi's ``slot=<n>,core=<n>,memory=<n>``, each key once, in any order."""
    found = _annotation(annotations, ANNOTATIONS.scoring_weights)
    if found is None:
        return ScoringWeights()
    key, value = found
    where = f"annotation {key}={_clip(value)}"
    parts = value.split(",")
    if len(parts) != len(_WEIGHT_KEYS):
        raise RequestError(
            f"{where}: expected slot, core and memory weights, as slot=1,core=1,memory=1"
        )
    weights: dict[str, int] = {}
    for part in parts:
        name, equals, number = part.partition("=")
        name, number = name.strip(), number.strip()
        if not equals:
            raise RequestError(f"{where}: expected key=value entries")
        if name not in _WEIGHT_KEYS:
            raise RequestError(
                f"{where}: unknown weight {_clip(name)}; accepted: slot, core, memory"
            )
        if name in weights:
            raise RequestError(f"{where}: duplicate {name!r} weight")
        if _WEIGHT.fullmatch(number) is None:
            raise RequestError(f"{where}: {name!r} weight must be a whole number")
        weight = int(number)
        if not 0 <= weight <= MAX_SCORING_WEIGHT:
            raise RequestError(
                f"{where}: {name!r} weight must be between 0 and {MAX_SCORING_WEIGHT}"
            )
        weights[name] = weight
    if not any(weights.values()):
        raise RequestError(f"{where}: at least one weight must be positive")
    return ScoringWeights(**weights)


# ---------------------------------------------------------------- pods

_MAX_UID_LENGTH: Final = 128
_UID_HASH_LENGTH: Final = 16


def _placeholder_uid(namespace: str, name: str) -> str:
    """``namespace/name`` for a pod not yet given a UID, hashed down when too long."""
    text = f"{namespace}/{name}"
    if len(text) <= _MAX_UID_LENGTH:
        return text
    digest = hashlib.sha256(text.encode()).hexdigest()[:_UID_HASH_LENGTH]
    return f"{text[: _MAX_UID_LENGTH - _UID_HASH_LENGTH - 1]}~{digest}"


def pod_ref(metadata: Mapping[Any, Any]) -> PodRef:
    """Who a pod is, from its metadata (see :func:`parse_pod` for a pod without a UID)."""
    namespace = _optional_str(metadata.get("namespace"), "metadata.namespace") or "default"
    name = _optional_str(metadata.get("name"), "metadata.name")
    generate_name = _optional_str(metadata.get("generateName"), "metadata.generateName")
    uid = _optional_str(metadata.get("uid"), "metadata.uid")
    if len(uid) > _MAX_UID_LENGTH:
        raise RequestError(f"metadata.uid is longer than {_MAX_UID_LENGTH} characters")
    return PodRef(
        uid=uid or _placeholder_uid(namespace, name or generate_name),
        namespace=namespace,
        name=name,
    )


def _first_error(exc: ValidationError) -> str:
    errors = exc.errors()
    return str(errors[0]["msg"]) if errors else str(exc)


_NO_CARD: Final = "(no card is on every list)"  # never a card's UUID: it has spaces


def _keys(key: str | None) -> tuple[str, ...]:
    return (key,) if key else ()


def _pod_vendor(
    containers: Sequence[ContainerGpuRequest], settings: RequestSettings
) -> VendorResources | None:
    vendor = containers[0].vendor
    return next((v for v in settings.vendors if v.vendor == vendor), None)


def _selector(
    annotations: Mapping[str, str], vendor: VendorResources | None, numa_bind: bool
) -> DeviceSelector:
    """The pod's card selector: NVIDIA's annotations, or the vendor's own (HAMi's keys
    for that vendor); gpuslice's ``gpuslice.io/...`` keys apply to every vendor and win."""
    if vendor is None:
        keys = ANNOTATIONS
        return DeviceSelector(
            include_types=_name_list(annotations, keys.use_gpu_type),
            exclude_types=_name_list(annotations, keys.nouse_gpu_type),
            include_uuids=_name_list(annotations, keys.use_gpu_uuid),
            exclude_uuids=_name_list(annotations, keys.nouse_gpu_uuid),
            numa_bind=numa_bind,
        )

    def names(own: Sequence[str], generic: AnnotationKey, include: bool) -> tuple[str, ...]:
        ours = _name_list(annotations, AnnotationKey(generic.gpuslice, generic.gpuslice))
        if ours:
            return ours
        lists = [
            found for key in own if (found := _name_list(annotations, AnnotationKey(key, key)))
        ]
        if not lists:
            return ()
        if not include:  # each list excludes its cards
            return tuple(dict.fromkeys(n for found in lists for n in found))
        common = tuple(n for n in lists[0] if all(n in found for found in lists[1:]))
        return common or (_NO_CARD,)  # two lists that share no card leave none

    return DeviceSelector(
        include_types=names(_keys(vendor.use_type), ANNOTATIONS.use_gpu_type, True),
        exclude_types=names(_keys(vendor.nouse_type), ANNOTATIONS.nouse_gpu_type, False),
        include_uuids=names(vendor.use_uuid, ANNOTATIONS.use_gpu_uuid, True),
        exclude_uuids=names(vendor.nouse_uuid, ANNOTATIONS.nouse_gpu_uuid, False),
        numa_bind=numa_bind,
    )


def parse_pod(
    pod: Mapping[str, Any], settings: RequestSettings = DEFAULT_SETTINGS
) -> PodGpuRequest | None:
    """A pod's GPU demand, or None when no container asks for a GPU.

    ``pod`` is a Kubernetes Pod in its JSON shape. The result's ``pod.uid`` is
    ``metadata.uid``; at admission a pod may have none yet, and then it is
    ``"<namespace>/<name or generateName>"`` (hashed down to 128 characters when
    longer). Raises :class:`RequestError` for any malformed or out-of-range input.
    """
    if not isinstance(pod, Mapping):
        raise RequestError(f"pod must be an object, got {_type_name(pod)}")
    spec = _mapping(pod.get("spec"), "spec")
    containers: list[ContainerGpuRequest] = []
    warnings: list[str] = []
    seen: set[str] = set()
    for init, field in ((True, "initContainers"), (False, "containers")):
        for index, container in enumerate(_list(spec.get(field), f"spec.{field}")):
            name = _container_name(container, f"spec.{field}[{index}]")
            if name in seen:
                raise RequestError(f"container {name!r}: the name is used by another container")
            seen.add(name)
            request, notes = _parse_named_container(container, name, init, settings)
            warnings.extend(notes)
            if request is not None:
                containers.append(request)
    if not containers:
        return None
    vendors = {c.vendor: c.name for c in containers}
    if len(vendors) > 1:
        (first, a), (second, b) = list(vendors.items())[:2]
        raise RequestError(
            f"container {a!r} asks for {first} cards and container {b!r} for {second} "
            "cards; a pod's containers use one vendor's cards"
        )
    total = sum(c.count for c in containers)
    if total > MAX_POD_GPU_COUNT:
        raise RequestError(
            f"the pod's containers ask for {total} GPUs together, more than {MAX_POD_GPU_COUNT}"
        )

    metadata = _mapping(pod.get("metadata"), "metadata")
    annotations = _annotations(metadata)
    gpu_policy, policy_numa, policy_warnings = _gpu_policy(annotations)
    vendor = _pod_vendor(containers, settings)
    if vendor is not None:
        vendorrequests.check_pod(vendor, containers, annotations)
    selector = _selector(annotations, vendor, _numa_bind(annotations) or policy_numa)
    try:
        return PodGpuRequest(
            pod=pod_ref(metadata),
            containers=tuple(containers),
            selector=selector,
            gpu_policy=gpu_policy,
            node_policy=_node_policy(annotations),
            vgpu_mode=_vgpu_mode(annotations),
            scoring_weights=_scoring_weights(annotations),
            warnings=(*warnings, *policy_warnings),
        )
    except ValidationError as exc:
        raise RequestError(f"invalid GPU request: {_first_error(exc)}") from None


def has_gpu_request(pod: Mapping[str, Any], settings: RequestSettings = DEFAULT_SETTINGS) -> bool:
    """Cheap check: does any container mention a GPU resource in its limits or requests?

    Never raises; malformed parts are skipped. It may say True for a pod that
    :func:`parse_pod` maps to None (``nvidia.com/gpu: 0``) or rejects.
    """
    names = (*settings.resources.all(), *(n for v in settings.vendors for n in v.all()))
    spec = pod.get("spec") if isinstance(pod, Mapping) else None
    if not isinstance(spec, Mapping):
        return False
    for field in ("initContainers", "containers"):
        containers = spec.get(field)
        if not isinstance(containers, list | tuple):
            continue
        for container in containers:
            resources = container.get("resources") if isinstance(container, Mapping) else None
            if not isinstance(resources, Mapping):
                continue
            for part in ("limits", "requests"):
                amounts = resources.get(part)
                if isinstance(amounts, Mapping) and any(name in amounts for name in names):
                    return True
    return False


def asks_for_gpus(pod: Mapping[str, Any], settings: RequestSettings = DEFAULT_SETTINGS) -> bool:
    """Does the pod ask for a GPU, as :func:`parse_pod` reads it?

    False for a pod that names no GPU resource, and for one that names them only
    to ask for none (``nvidia.com/gpu: 0``): both are pods without GPUs. True for
    a pod whose request :func:`parse_pod` rejects, so that the caller reads it
    and reports why. Never raises.
    """
    if not has_gpu_request(pod, settings):
        return False
    try:
        return parse_pod(pod, settings) is not None
    except RequestError:
        return True
