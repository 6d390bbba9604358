"""Other vendors' requests, read as HAMi reads each vendor's (its ``pkg/device/<vendor>``).

:func:`build` turns one container's amounts of a vendor's resources into a
:class:`~gpuslice_common.models.ContainerGpuRequest`; :func:`check_pod` applies
the rules that concern the whole pod. Each family of
:class:`~gpuslice_common.config.VendorResources` (its ``rules``):

* ``hami`` (Hygon, Iluvatar, Kunlun vXPU, AMD, Biren, Vastai): the count is
  required; memory times the vendor's memory factor is MiB, unset or 0 the whole
  card; cores unset are ``default_cores`` (100: the card alone).
* ``ascend``: memory (times the factor) is rounded up to the smallest vNPU
  template that holds it; above every template but within ``memoryCapacity`` it
  is the whole card's ``memoryAllocatable``; above that it is refused. Unset, it
  is ``memoryAllocatable``. Several cards are whole cards only. The cores
  resource is refused (HAMi takes it only in its ``hami-core`` vNPU mode, which
  gpuslice does not place), and so is ``huawei.com/vnpu-mode: hami-core``.
* ``cambricon``: as ``hami``, one card per container (HAMi's dynamic-smlu
  profile names one card).
* ``mthreads``: cores are sixteenths of a card (``sgpu-core`` 0-16, unset 0);
  memory (units of 512 MiB) must be one of 2, 4, 8, 16, 32, 64, 96; a count above
  1, no memory, or 96 units with 16 cores is whole cards. HAMi's webhook writes
  whole cards into the limits as the count's total (16 cores and 96 units a
  card, so ``sgpu-core`` may be up to 16 per card) and, above one card, the count
  into ``mthreads.com/request-gpu-num``, which must not say otherwise.
* ``metax-gpu``: whole cards, by count.
* ``metax-sgpu``: memory in GiB (``vmemory: 4``), or bytes when written with a
  unit (``4Gi``); cores unset are 100. QoS (``metax-tech.com/sgpu-qos-policy``:
  best-effort, fixed-share or burst-share) is checked; ``sgpu-app-class: online``
  is refused (gpuslice does not place HAMi's online class).
* ``enflame``: one card per container, always; ``drs-gcu: N`` asks for the DRS
  profile of N slices, else ``gcu-memory`` and ``gcu-core`` for the smallest
  profile that holds them (chosen per node: :class:`~gpuslice_common.models.DrsDemand`).
* ``kunlun``: whole XPUs, 1, 2, 4 or 8.

In the families whose plugin reads one choice of cards per pod (``mthreads``'s
``mthreads.com/gpu-index``, ``kunlun``'s ``BAIDU_COM_DEVICE_IDX``, ``enflame``'s
``enflame.com/gcu-assigned-index``, ``cambricon``'s ``CAMBRICON_DSMLU_PROFILE``,
``metax-gpu``'s one card per pod) a pod has one container asking for cards.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Final

from gpuslice_common.config import VendorResources
from gpuslice_common.models import (
    MAX_DRS_SLICES,
    ContainerGpuRequest,
    DrsDemand,
    MemoryRequest,
)
from gpuslice_common.requesterrors import RequestError

MAX_COUNT: Final = 64
MAX_MIB: Final = 2**31
MTHREADS_MEMORY_UNITS: Final = (2, 4, 8, 16, 32, 64, 96)
MTHREADS_WHOLE_UNITS: Final = 96  # HAMi's webhook writes a whole card as 96 units (48 GiB)
# the pod annotation HAMi's webhook writes for a count above 1 (Moore Threads' plugin reads it)
MTHREADS_GPU_NUM: Final = "mthreads.com/request-gpu-num"
KUNLUN_COUNTS: Final = (1, 2, 4, 8)
ONE_CONTAINER: Final = frozenset({"mthreads", "kunlun", "enflame", "cambricon", "metax-gpu"})
WHOLE: Final = frozenset({"metax-gpu", "kunlun"})

METAX_QOS: Final = "metax-tech.com/sgpu-qos-policy"
METAX_QOS_POLICIES: Final = ("best-effort", "fixed-share", "burst-share")
METAX_APP_CLASS: Final = "metax-tech.com/sgpu-app-class"
ASCEND_MODE: Final = "huawei.com/vnpu-mode"


def bounds(vendor: VendorResources) -> list[tuple[str, int]]:
    """Each of the vendor's resources with its highest accepted value."""
    count_high = MAX_DRS_SLICES if vendor.rules == "enflame" else MAX_COUNT  # drs-gcu: slices
    found = [(vendor.count, count_high)]
    if vendor.memory is not None:
        if vendor.rules == "metax-sgpu":
            high = MAX_MIB * 1024 * 1024  # bytes, when written with a unit (checked in build)
        elif vendor.rules == "enflame":
            high = MAX_MIB  # GB or MiB (DrsDemand)
        else:
            high = MAX_MIB // vendor.memory_factor
        found.append((vendor.memory, high))
    if vendor.cores is not None:
        # Moore Threads: whole cards are stated as the count's total (checked in build)
        per_card = MAX_COUNT if vendor.rules == "mthreads" else 1
        found.append((vendor.cores, vendor.max_cores * per_card))
    return found


WHOLE_CARD: Final = MemoryRequest(percent=100)


def _refuse_shares(label: str, vendor: VendorResources, amounts: Mapping[str, int]) -> None:
    count = amounts.get(vendor.count)
    shares = [r for r in (vendor.memory, vendor.cores) if r is not None and r in amounts]
    if not count and shares:
        why = "is 0" if count == 0 else "is not set"
        named = ", ".join(shares)
        raise RequestError(f"{label}: {vendor.count} {why} but {named} {_verb(shares)} set")


def _verb(names: Sequence[str]) -> str:
    return "is" if len(names) == 1 else "are"


def build(
    name: str,
    init: bool,
    sidecar: bool,
    vendor: VendorResources,
    amounts: Mapping[str, int],
    with_unit: frozenset[str] = frozenset(),
) -> tuple[ContainerGpuRequest | None, list[str]]:
    """One container's request of ``vendor``'s cards and its warnings; None when it
    asks for none. ``with_unit``: the resources whose quantity carried a unit
    suffix (``4Gi``). Raises RequestError naming the container and resource."""
    label = f"container {name!r}"
    rules = vendor.rules
    if rules == "enflame":
        return _enflame(name, init, sidecar, vendor, amounts, label), []
    _refuse_shares(label, vendor, amounts)
    count = amounts.get(vendor.count)
    if not count:
        return None, []
    units = amounts.get(vendor.memory) if vendor.memory is not None else None
    cores = amounts.get(vendor.cores) if vendor.cores is not None else None
    warnings: list[str] = []
    memory: MemoryRequest
    if rules in WHOLE:
        if rules == "kunlun" and count not in KUNLUN_COUNTS:
            raise RequestError(
                f"{label}: {vendor.count} must be 1, 2, 4 or 8 (whole XPUs), got {count}"
            )
        memory, cores = WHOLE_CARD, 100
    elif rules == "ascend":
        memory = _ascend_memory(label, vendor, units, count)
        if cores:
            raise RequestError(
                f"{label}: {vendor.cores} needs HAMi's hami-core vNPU mode, which gpuslice "
                "does not place; vNPU templates set the AI cores"
            )
        cores = 0
    elif rules == "mthreads":
        memory, cores, note = _mthreads(label, vendor, count, units, cores)
        warnings += note
    elif rules == "metax-sgpu" and units and vendor.memory in with_unit:
        memory = MemoryRequest(mib=max(units // (1024 * 1024), 1))
    elif units and units * vendor.memory_factor > MAX_MIB:
        raise RequestError(f"{label}: {vendor.memory} {units} is more memory than any card has")
    else:
        if rules == "cambricon" and count > 1:
            raise RequestError(
                f"{label}: {vendor.count} is {count}; a container gets one MLU (HAMi's "
                "dynamic-smlu profile names one card)"
            )
        memory = MemoryRequest(mib=units * vendor.memory_factor) if units else WHOLE_CARD
    request = ContainerGpuRequest(
        name=name,
        init=init,
        sidecar=sidecar,
        count=count,
        memory=memory,
        cores=vendor.default_cores if cores is None else cores,
        vendor=vendor.vendor,
    )
    return request, warnings


def _ascend_memory(
    label: str, vendor: VendorResources, units: int | None, count: int
) -> MemoryRequest:
    whole = vendor.memory_allocatable_mib
    if not units:
        return MemoryRequest(mib=whole) if whole else WHOLE_CARD
    mib = units * vendor.memory_factor
    trimmed = next((t.memory_mib for t in vendor.templates if mib <= t.memory_mib), None)
    if trimmed is None:
        capacity = vendor.memory_capacity_mib or whole
        if whole is None or capacity is None or mib > capacity:
            limit = f" (memoryCapacity {capacity} MiB)" if capacity else ""
            raise RequestError(f"{label}: {vendor.memory} {units} is more than a card holds{limit}")
        trimmed = whole
    if count > 1 and trimmed != whole:
        raise RequestError(
            f"{label}: {vendor.count} is {count} with {vendor.memory} {units}: several "
            "cards are whole cards only (vNPU templates are one card's)"
        )
    return MemoryRequest(mib=trimmed)


def _mthreads(
    label: str, vendor: VendorResources, count: int, units: int | None, cores: int | None
) -> tuple[MemoryRequest, int, list[str]]:
    high = vendor.max_cores * count  # HAMi's webhook states whole cards as the count's total
    if cores is not None and cores > high:
        raise RequestError(f"{label}: {vendor.cores} must be between 0 and {high}, got {cores}")
    # what HAMi's webhook writes for one whole card reads as one whole card again
    whole = units == MTHREADS_WHOLE_UNITS and cores == vendor.max_cores
    if count > 1 or not units or whole:
        notes = []
        other_units = units is not None and units != count * MTHREADS_WHOLE_UNITS
        if count > 1 and (other_units or (cores is not None and cores != high)):
            notes.append(
                f"{label}: {vendor.count} {count} takes whole cards; its memory and cores "
                "are set to the whole card's, as HAMi's webhook does"
            )
        return WHOLE_CARD, vendor.max_cores, notes
    if units not in MTHREADS_MEMORY_UNITS:
        allowed = ", ".join(str(u) for u in MTHREADS_MEMORY_UNITS)
        raise RequestError(
            f"{label}: {vendor.memory} {units} is not a Moore Threads sGPU size; "
            f"valid values are {allowed}"
        )
    return MemoryRequest(mib=units * vendor.memory_factor), cores or 0, []


def _enflame(
    name: str,
    init: bool,
    sidecar: bool,
    vendor: VendorResources,
    amounts: Mapping[str, int],
    label: str,
) -> ContainerGpuRequest | None:
    size = amounts.get(vendor.count)
    memory = amounts.get(vendor.memory) if vendor.memory is not None else None
    cores = amounts.get(vendor.cores) if vendor.cores is not None else None
    if size is not None:
        if size <= 0:
            raise RequestError(f"{label}: {vendor.count} must be greater than 0")
        demand = DrsDemand(size=size)
    else:
        if memory is None and cores is None:
            return None
        if memory is not None and memory <= 0:
            raise RequestError(f"{label}: {vendor.memory} must be greater than 0")
        if cores is not None and not 0 < cores <= 100:
            raise RequestError(f"{label}: {vendor.cores} must be in 1..100")
        demand = DrsDemand(memory=memory or 0, cores=cores or 0)
    return ContainerGpuRequest(
        name=name,
        init=init,
        sidecar=sidecar,
        count=1,
        memory=WHOLE_CARD,  # the profile's, once chosen on a node
        cores=0,
        vendor=vendor.vendor,
        drs=demand,
    )


def check_pod(
    vendor: VendorResources,
    containers: Sequence[ContainerGpuRequest],
    annotations: Mapping[str, str],
) -> None:
    """The rules of ``vendor`` that concern the whole pod; raises RequestError."""
    if vendor.rules in ONE_CONTAINER and len(containers) > 1:
        a, b = containers[0].name, containers[1].name
        raise RequestError(
            f"containers {a!r} and {b!r} both ask for {vendor.vendor} cards; its device "
            "plugin reads one choice of cards per pod, so one container may ask for them"
        )
    if vendor.rules == "mthreads":
        stated = annotations.get(MTHREADS_GPU_NUM)
        count = containers[0].count if containers else 0
        if stated is not None and stated.strip() != str(count):
            raise RequestError(
                f"annotation {MTHREADS_GPU_NUM} says {stated[:32]!r} but the pod asks for "
                f"{count} Moore Threads card(s); gpuslice writes it from the count: remove it"
            )
    if vendor.rules == "ascend":
        mode = annotations.get(ASCEND_MODE, "").strip()
        if mode == "hami-core":
            raise RequestError(
                f"annotation {ASCEND_MODE}: hami-core vNPUs are not placed by gpuslice; "
                "leave it unset for template vNPUs"
            )
    if vendor.rules == "metax-sgpu":
        app = annotations.get(METAX_APP_CLASS, "").strip()
        if app and app not in ("online", "offline"):
            raise RequestError(f"annotation {METAX_APP_CLASS} must be online or offline")
        if app == "online":
            raise RequestError(
                f"annotation {METAX_APP_CLASS}: the online class is not placed by gpuslice"
            )
        if app and any(c.count != 1 for c in containers):
            raise RequestError(f"annotation {METAX_APP_CLASS}: a pod of a class asks for one card")
        qos = annotations.get(METAX_QOS, "").strip()
        if qos and qos not in METAX_QOS_POLICIES:
            raise RequestError(
                f"annotation {METAX_QOS} must be one of {', '.join(METAX_QOS_POLICIES)}"
            )


def metax_qos(annotations: Mapping[str, str]) -> str:
    """The pod's Metax sGPU QoS policy (HAMi's webhook sets best-effort when unset)."""
    return annotations.get(METAX_QOS, "").strip() or METAX_QOS_POLICIES[0]


__all__ = [
    "ASCEND_MODE",
    "KUNLUN_COUNTS",
    "METAX_APP_CLASS",
    "METAX_QOS",
    "MTHREADS_GPU_NUM",
    "MTHREADS_MEMORY_UNITS",
    "MTHREADS_WHOLE_UNITS",
    "bounds",
    "build",
    "check_pod",
    "metax_qos",
]
