"""MIG through NVML: a card's GPU instance profiles and placements, the instances on
it, and making and destroying one.

Every function takes the card's NVML handle and raises ``pynvml.NVMLError`` as
NVML does; the caller holds the NVML backend's lock. An instance is named by
its placement (its first memory slice): NVML lets no two overlap. What gpuslice
makes is one GPU instance with one compute instance covering all of it, the
MIG device a container is given.
"""

from __future__ import annotations

import ctypes
import logging
import math
import re
from dataclasses import dataclass
from typing import Any, Final

import pynvml  # type: ignore[import-untyped]

from gpuslice_common.models import (
    MAX_MIG_PROFILES,
    MIG_PROFILE_PATTERN,
    MigPlacement,
    MigProfile,
)
from gpuslice_deviceplugin.mig import LiveInstance, MigError

log = logging.getLogger(__name__)

MiB: Final = 1 << 20
# NVML's GPU instance profile ids: 0 .. NVML_GPU_INSTANCE_PROFILE_COUNT - 1
GI_PROFILE_IDS: Final = range(int(getattr(pynvml, "NVML_GPU_INSTANCE_PROFILE_COUNT", 0x12)))
CI_PROFILE_IDS: Final = range(int(getattr(pynvml, "NVML_COMPUTE_INSTANCE_PROFILE_COUNT", 9)))
MAX_INSTANCES: Final = 16  # array room for one profile's instances (NVML has at most 7 or 8)
_PROFILE = re.compile(MIG_PROFILE_PATTERN)


@dataclass(frozen=True)
class NvmlProfile:
    """A profile as NVML describes it, with its id."""

    id: int
    profile: MigProfile


def profile_name(slices: int, memory_mib: int, card_mib: int) -> str:
    """NVIDIA's ``<slices>g.<GB>gb``: the share of the card's memory rounded up to
    eighths, times the card's size in whole GB (how ``nvidia-smi`` names them)."""
    eighths = math.ceil(memory_mib * 8 / max(card_mib, 1))
    return f"{slices}g.{round(eighths * math.ceil(card_mib / 1024) / 8)}gb"


def _name(info: Any, card_mib: int) -> str:
    raw = getattr(info, "name", b"")
    name = (raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)).strip()
    name = name.removeprefix("MIG ").strip()
    if name:  # a variant NVIDIA names otherwise ("-me", "+me.all") is not offered
        return name
    return profile_name(int(info.sliceCount), int(info.memorySizeMB), card_mib)


def profiles(handle: Any, card_mib: int) -> list[NvmlProfile]:
    """Every GPU instance profile NVML offers on the card, with its placements."""
    infos: list[Any] = []
    for pid in GI_PROFILE_IDS:
        try:
            info = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, pid)
        except pynvml.NVMLError:
            continue  # not on this card
        if int(info.instanceCount) > 0:
            infos.append(info)
    if not infos:
        return []
    whole = max(int(i.sliceCount) for i in infos)
    out: dict[str, NvmlProfile] = {}
    for info in infos:
        name = _name(info, card_mib)
        if not _PROFILE.match(name) or name in out or len(out) >= MAX_MIG_PROFILES:
            log.debug("MIG profile %r (id %d) not offered", name, int(info.id))
            continue
        try:
            places = placements(handle, int(info.id), int(info.instanceCount))
            profile = MigProfile(
                name=name,
                memory_mib=int(info.memorySizeMB),
                cores=max(1, int(info.sliceCount) * 100 // whole),
                slices=int(info.sliceCount),
                placements=places,
            )
        except (pynvml.NVMLError, ValueError) as exc:
            log.debug("MIG profile %s not offered: %s", name, exc)
            continue
        out[name] = NvmlProfile(int(info.id), profile)
    return list(out.values())


def placements(handle: Any, profile_id: int, room: int) -> tuple[MigPlacement, ...]:
    count = ctypes.c_uint(max(room, 1))
    array = (pynvml.c_nvmlGpuInstancePlacement_t * max(room, 1))()
    pynvml.nvmlDeviceGetGpuInstancePossiblePlacements(
        handle, profile_id, array, ctypes.byref(count)
    )
    return tuple(MigPlacement(start=int(p.start), size=int(p.size)) for p in array[: count.value])


def _gpu_instances(handle: Any, known: list[NvmlProfile]) -> list[tuple[NvmlProfile, Any]]:
    out: list[tuple[NvmlProfile, Any]] = []
    for p in known:
        array = (pynvml.c_nvmlGpuInstance_t * MAX_INSTANCES)()
        count = ctypes.c_uint(MAX_INSTANCES)
        try:
            pynvml.nvmlDeviceGetGpuInstances(handle, p.id, array, ctypes.byref(count))
        except pynvml.NVMLError_NotFound:
            continue
        out.extend((p, array[i]) for i in range(min(count.value, MAX_INSTANCES)))
    return out


def _mig_uuids(handle: Any) -> dict[int, str]:
    """GPU instance id -> the UUID of the MIG device on it."""
    out: dict[int, str] = {}
    try:
        room = int(pynvml.nvmlDeviceGetMaxMigDeviceCount(handle))
    except pynvml.NVMLError:
        return out
    for index in range(min(room, MAX_INSTANCES)):
        try:
            mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, index)
        except pynvml.NVMLError_NotFound:
            continue
        out[int(pynvml.nvmlDeviceGetGpuInstanceId(mig))] = str(pynvml.nvmlDeviceGetUUID(mig))
    return out


def instances(handle: Any, known: list[NvmlProfile]) -> list[LiveInstance]:
    """The GPU instances on the card (of the profiles ``known``), by placement."""
    uuids = _mig_uuids(handle)
    out = []
    for p, gi in _gpu_instances(handle, known):
        info = pynvml.nvmlGpuInstanceGetInfo(gi)
        placement = MigPlacement(start=int(info.placement.start), size=int(info.placement.size))
        out.append(
            LiveInstance(
                profile=p.profile.name,
                placement=placement,
                uuid=uuids.get(int(info.id)),
                memory_mib=p.profile.memory_mib,
            )
        )
    return sorted(out, key=lambda i: i.placement.start)


def _find(handle: Any, known: list[NvmlProfile], placement: MigPlacement) -> tuple[Any, Any]:
    """(profile, GPU instance) at ``placement``; (None, None) when there is none."""
    for p, gi in _gpu_instances(handle, known):
        info = pynvml.nvmlGpuInstanceGetInfo(gi)
        if (int(info.placement.start), int(info.placement.size)) == (
            placement.start,
            placement.size,
        ):
            return p, gi
    return None, None


def _compute_profile(gi: Any, slices: int) -> int:
    """The compute instance profile that covers a GPU instance of ``slices`` slices."""
    for cid in CI_PROFILE_IDS:
        try:
            info = pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, cid, 0)
        except pynvml.NVMLError:
            continue
        if int(info.sliceCount) == slices:
            return cid
    raise MigError(f"no compute instance profile covers a {slices}-slice GPU instance")


def _compute_instances(gi: Any) -> list[Any]:
    out: list[Any] = []
    for cid in CI_PROFILE_IDS:
        array = (pynvml.c_nvmlComputeInstance_t * MAX_INSTANCES)()
        count = ctypes.c_uint(MAX_INSTANCES)
        try:
            pynvml.nvmlGpuInstanceGetComputeInstances(gi, cid, array, ctypes.byref(count))
        except pynvml.NVMLError:
            continue
        out.extend(array[i] for i in range(min(count.value, MAX_INSTANCES)))
    return out


def create(
    handle: Any, known: list[NvmlProfile], profile: str, placement: MigPlacement
) -> LiveInstance:
    """A GPU instance of ``profile`` at exactly ``placement`` and a compute instance
    covering it; nothing is left behind when a step fails."""
    chosen = next((p for p in known if p.profile.name == profile), None)
    if chosen is None:
        raise MigError(f"the card offers no MIG profile {profile}")
    c_placement = pynvml.c_nvmlGpuInstancePlacement_t(placement.start, placement.size)
    gi = pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(
        handle, chosen.id, ctypes.byref(c_placement)
    )
    try:
        cid = _compute_profile(gi, chosen.profile.slices)
        pynvml.nvmlGpuInstanceCreateComputeInstance(gi, cid)
        gi_id = int(pynvml.nvmlGpuInstanceGetInfo(gi).id)
        uuid = _mig_uuids(handle).get(gi_id)
        if uuid is None:
            raise MigError(f"the MIG device of GPU instance {gi_id} did not appear")
    except BaseException:
        try:
            _destroy(gi)
        except pynvml.NVMLError as exc:
            log.error(
                "MIG %s at %d+%d half made and not undone: %s",
                profile,
                placement.start,
                placement.size,
                exc,
            )
        raise
    return LiveInstance(profile, placement, uuid, chosen.profile.memory_mib)


def _destroy(gi: Any) -> None:
    for ci in _compute_instances(gi):
        pynvml.nvmlComputeInstanceDestroy(ci)
    pynvml.nvmlGpuInstanceDestroy(gi)


def destroy(handle: Any, known: list[NvmlProfile], placement: MigPlacement) -> bool:
    """Destroy the instance at ``placement``, compute instances first; False when
    there is none."""
    _, gi = _find(handle, known, placement)
    if gi is None:
        return False
    _destroy(gi)
    return True
