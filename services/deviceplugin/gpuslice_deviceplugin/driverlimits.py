"""Layer 1: the driver's own per-cgroup device-memory limits.

NVIDIA's driver r615 / CUDA 13.4 holds a cgroup v2 group to a hard limit of
device memory on a card: an allocation past it fails with out-of-memory in the
driver, where no program of the container reaches. The limit is set through
NVML (``nvmlDeviceSetMemoryLimits_v1`` on the card's handle, with the group's
full sysfs path as ``nameSpace``) and read back with
``nvmlDeviceGetMemoryLimits_v1``. The driver keeps it through the kernel's
cgroup v2 ``dmem`` controller where the kernel has one that lists the card
(``<cgroup2 root>/dmem.capacity``, a ``nvidia/<pci>/vidmem`` line), else
through its own fallback. MIG handles are not supported.

pynvml does not know these calls, so they are made through ctypes on the
library pynvml already loaded, with the structs laid out as CUDA 13.4's
``nvml.h`` has them (no version field). A hard limit of all ones
(``NVML_DEVICE_MEMORY_LIMIT_MAX``) with a soft limit of 0 is "no limit".

:func:`card_support` says per card whether this node can hold containers to
their grants this way; :func:`ensure_limit` makes sure one container's group
on one card is limited to its grant, lowering a missing or higher limit and
leaving a lower one be. The same limit also reaches the toolkit's CDI hook
through the Allocate response (:func:`hook_environment`), so that where the
runtime runs the hook the limit is in place before the container's first
process; the node agent checks and sets it either way.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Literal

import pynvml  # type: ignore[import-untyped]

from gpuslice_common.models import DRIVER_LIMIT_ENV, GpuDevice

log = logging.getLogger(__name__)

NO_LIMIT = (1 << 64) - 1  # NVML_DEVICE_MEMORY_LIMIT_MAX: the hard limit of "none"
MOUNTINFO = Path("/proc/self/mountinfo")
SET_LIMITS = "nvmlDeviceSetMemoryLimits_v1"
GET_LIMITS = "nvmlDeviceGetMemoryLimits_v1"
NVML_SUCCESS = 0


class _SetLimits(ctypes.Structure):
    """nvmlSetMemoryLimits_v1_t."""

    _fields_ = [
        ("nameSpace", ctypes.c_char_p),
        ("softLimit", ctypes.c_ulonglong),
        ("hardLimit", ctypes.c_ulonglong),
    ]


class _GetLimits(ctypes.Structure):
    """nvmlGetMemoryLimits_v1_t."""

    _fields_ = [
        ("nameSpace", ctypes.c_char_p),
        ("softLimit", ctypes.c_ulonglong),
        ("hardLimit", ctypes.c_ulonglong),
        ("currentUsed", ctypes.c_ulonglong),
    ]


@dataclass(frozen=True, slots=True)
class CardSupport:
    """Whether the driver can limit containers on one card: ``note`` names the
    backend ("dmem" or "driver") when it can, and says why not when it cannot."""

    supported: bool
    note: str


@dataclass(frozen=True, slots=True)
class Limits:
    soft: int
    hard: int
    used: int

    @property
    def limited(self) -> bool:
        return self.hard != NO_LIMIT


@dataclass(frozen=True, slots=True)
class LimitResult:
    """What :func:`ensure_limit` did: ``set`` (the limit is now the grant),
    ``kept`` (a limit at or below the grant was already there), ``unsupported``
    (the driver cannot limit on that card) or ``failed`` (``detail`` says why)."""

    outcome: Literal["set", "kept", "unsupported", "failed"]
    hard_before: int | None = None  # the hard limit found; NO_LIMIT where none was set
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.outcome in ("set", "kept")


# ---------------------------------------------------------------- cgroup v2


def cgroup2_root(mountinfo: Path = MOUNTINFO) -> Path | None:
    """Where the node's cgroup v2 hierarchy is mounted (the first cgroup2 mount),
    or None where there is none."""
    try:
        lines = mountinfo.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields, sep, rest = line.partition(" - ")
        parts = fields.split()
        if sep and rest.split()[:1] == ["cgroup2"] and len(parts) >= 5:
            return Path(parts[4].replace("\\040", " "))
    return None


def group_path(root: Path, cgroup: str) -> Path:
    """The full sysfs path of a group given as /proc/<pid>/cgroup's ``0::`` line
    names it (relative to the v2 root) or as a path under ``root`` already.
    Raises ValueError for anything else: a relative path, ``..``, blanks."""
    if not cgroup.startswith("/") or any(c.isspace() or c == "\0" for c in cgroup):
        raise ValueError(f"cgroup path {cgroup[:200]!r} is not an absolute path")
    parts = PurePosixPath(cgroup).parts
    if ".." in parts or "." in parts:
        raise ValueError(f"cgroup path {cgroup[:200]!r} is not normalised")
    path = Path(cgroup)
    if path == root or root in path.parents:
        return path
    return root.joinpath(*parts[1:])


def dmem_cards(root: Path) -> frozenset[str]:
    """The PCI addresses the kernel's dmem controller lists for NVIDIA cards
    (lower case), from ``dmem.capacity``; empty where the kernel has none."""
    try:
        lines = (root / "dmem.capacity").read_text().splitlines()
    except OSError:
        return frozenset()
    found = set()
    for line in lines:
        region = line.split(maxsplit=1)[0] if line.strip() else ""
        parts = region.split("/")
        if len(parts) == 3 and parts[0] == "nvidia" and parts[2] == "vidmem":
            found.add(parts[1].lower())
    return frozenset(found)


# ---------------------------------------------------------------- NVML


def _function(name: str) -> Any | None:
    """NVML's ``name`` from the library pynvml loaded, or None where it lacks it."""
    try:
        return pynvml._nvmlGetFunctionPointer(name)
    except pynvml.NVMLError:
        return None


def _error(rc: int) -> str:
    try:
        return str(pynvml.nvmlErrorString(rc))
    except pynvml.NVMLError:
        return f"NVML error {rc}"


def _handle(card: int | str | Any) -> Any:
    """An NVML handle for a card given as its handle, index or UUID."""
    if isinstance(card, int):
        return pynvml.nvmlDeviceGetHandleByIndex(card)
    if isinstance(card, str):
        return pynvml.nvmlDeviceGetHandleByUUID(card)
    return card


def read_limits(card: int | Any, path: Path) -> Limits | int:
    """The limits on ``path`` for the card (a handle or an index), or NVML's error code."""
    get = _function(GET_LIMITS)
    if get is None:
        return int(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
    query = _GetLimits(nameSpace=os.fsencode(path))
    rc = int(get(_handle(card), ctypes.byref(query)))
    if rc != NVML_SUCCESS:
        return rc
    return Limits(int(query.softLimit), int(query.hardLimit), int(query.currentUsed))


def write_limits(card: int | Any, path: Path, soft: int, hard: int) -> int:
    """Sets the limits on ``path`` for the card; NVML's return code."""
    put = _function(SET_LIMITS)
    if put is None:
        return int(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
    limits = _SetLimits(nameSpace=os.fsencode(path), softLimit=soft, hardLimit=hard)
    return int(put(_handle(card), ctypes.byref(limits)))


def card_support(devices: Iterable[GpuDevice], root: Path | None = None) -> dict[str, CardSupport]:
    """Per card (by UUID): whether the driver limits device memory per cgroup here.

    NVML must be initialised (the NVML backend keeps it so). A card is supported
    when NVML has both calls, the node has a cgroup v2 hierarchy, the card is not
    in MIG mode, and reading the limits of the v2 root on it answers.
    """
    devices = list(devices)
    if root is None:
        root = cgroup2_root()
    missing = [name for name in (SET_LIMITS, GET_LIMITS) if _function(name) is None]
    if missing:
        why = f"NVML has no {missing[0]} (driver r615+ / CUDA 13.4 needed)"
        return {d.uuid: CardSupport(False, why) for d in devices}
    if root is None:
        return {d.uuid: CardSupport(False, "no cgroup v2 hierarchy") for d in devices}
    listed = dmem_cards(root)
    out = {}
    for device in devices:
        out[device.uuid] = _one_card(device, root, listed)
    return out


def _one_card(device: GpuDevice, root: Path, listed: frozenset[str]) -> CardSupport:
    if device.mig:
        return CardSupport(False, "MIG mode: the driver limits whole cards only")
    try:
        handle = pynvml.nvmlDeviceGetHandleByUUID(device.uuid)
    except pynvml.NVMLError as exc:
        return CardSupport(False, f"card not found in NVML: {exc}")
    answer = read_limits(handle, root)
    if isinstance(answer, int):
        return CardSupport(False, f"{GET_LIMITS}: {_error(answer)}")
    return CardSupport(True, "dmem" if _pci(handle) in listed else "driver")


def _pci(handle: Any) -> str:
    """The card's PCI address as dmem names it (``0000:3b:00.0``), or ""."""
    try:
        bus = pynvml.nvmlDeviceGetPciInfo(handle).busId
    except (pynvml.NVMLError, AttributeError):
        return ""
    text = bus.decode() if isinstance(bus, bytes) else str(bus)
    # NVML prints an 8-digit domain ("00000000:3B:00.0"); the kernel a 4-digit one
    domain, _, rest = text.partition(":")
    return f"{domain[-4:]}:{rest}".lower() if rest else ""


def ensure_limit(
    card: int | Any,
    cgroup_path: str,
    hard_bytes: int,
    *,
    soft_bytes: int = 0,
    root: Path | None = None,
) -> LimitResult:
    """Make sure the driver holds the group ``cgroup_path`` to ``hard_bytes`` on the card.

    ``card`` is an NVML device handle, index or UUID; ``cgroup_path`` the
    container's group as a process's ``/proc/<pid>/cgroup`` ``0::`` line names it
    (or its full path under the v2 root). Pass the container's own group, not a
    deeper one a process of it may have made: the limit holds the group and
    everything below it. ``root`` is the host's cgroup v2 tree as this process
    sees it (the node agent's ``cgroup_root()``; by default the first cgroup2
    mount): NVML is given the group's path under it, on the assumption that the
    driver resolves ``nameSpace`` in the caller's mount namespace, as a path
    lookup in the kernel does (NVIDIA's documentation says only "full path to
    sysfs cgroup file name"). A limit at or below ``hard_bytes`` is kept; none, or a higher
    one, is replaced by ``hard_bytes`` (``soft_bytes`` the soft limit). Never raises
    for what NVML or the file system answers: the result says what happened.
    """
    if not 0 < hard_bytes < NO_LIMIT or not 0 <= soft_bytes <= hard_bytes:
        return LimitResult("failed", detail=f"limits soft {soft_bytes} hard {hard_bytes} refused")
    if root is None:
        root = cgroup2_root()
    if root is None:
        return LimitResult("unsupported", detail="no cgroup v2 hierarchy")
    try:
        path = group_path(root, cgroup_path)
    except ValueError as exc:
        return LimitResult("failed", detail=str(exc))
    if not path.is_dir():
        return LimitResult("failed", detail=f"cgroup {path} does not exist")
    try:
        before = read_limits(card, path)
    except pynvml.NVMLError as exc:
        return LimitResult("failed", detail=f"card not found in NVML: {exc}")
    if isinstance(before, int):
        outcome: Literal["unsupported", "failed"] = (
            "unsupported"
            if before in (pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
            else "failed"
        )
        return LimitResult(outcome, detail=f"{GET_LIMITS} on {path}: {_error(before)}")
    if before.limited and before.hard <= hard_bytes:
        return LimitResult("kept", before.hard)
    rc = write_limits(card, path, soft_bytes, hard_bytes)
    if rc != NVML_SUCCESS:
        return LimitResult("failed", before.hard, f"{SET_LIMITS} on {path}: {_error(rc)}")
    log.info("driver limit on %s: %d bytes (was %s)", path, hard_bytes, _shown(before.hard))
    return LimitResult("set", before.hard)


def _shown(hard: int) -> str:
    return "none" if hard == NO_LIMIT else str(hard)


# ---------------------------------------------------------------- the CDI hook


def hook_environment(
    grants: Mapping[str, int], supported: Mapping[str, CardSupport]
) -> dict[str, str]:
    """The variable the toolkit's ``apply-cuda-memory-limits`` hook reads, for a
    container granted ``grants`` (card UUID -> bytes): its hard limit in decimal
    bytes. The hook takes one value for the container, so it is given only when
    every card of the container has the same grant and supports the driver's
    limits; otherwise it is not, and the node agent sets each card's limit
    itself. No soft limit (``NVIDIA_GPU_MEMORY_REQUEST``) is given, as
    :func:`ensure_limit` sets none: where memory scaling oversubscribes a card
    the driver could not keep such a promise."""
    values = set(grants.values())
    if len(values) != 1 or not all(
        (s := supported.get(u)) is not None and s.supported for u in grants
    ):
        return {}
    return {DRIVER_LIMIT_ENV: str(values.pop())}
