"""Compute coordination between the containers sharing a GPU on this node.

Every tick the coordinator reads each container's shared region and writes, per
device record, the two flags the interposer's compute limiter obeys:

* ``shared``: another container is *active* on the same GPU. Under
  ``GPU_CORE_UTILIZATION_POLICY=default`` a container with ``CUDA_DEVICE_SM_LIMIT``
  is held to its share only while this is set, so a container alone on a GPU
  gets all of it.
* ``yield``: another container with *high priority* is active on the same GPU;
  set only for containers that are not high priority there. Their
  low-priority processes (``CUDA_TASK_PRIORITY=1``) wait before each launch
  while it is set.

A container is *active* on a GPU when its record for that UUID shows memory held
(``used_bytes > 0``, which includes each context's overhead) or its ``busy_ns``
grew since the previous tick (``busy_ns`` grows only while a limit applies; the
first sight of a region sets the baseline). It has *high priority* there when it
is active and one of its live processes has priority 0. Records without a UUID
(no process has named the device yet) take no part.

Then every region gets a heartbeat. The interposer honours the flags only while
the heartbeat is younger than 5 s (``AGENT_FRESH_NS``): if the agent stops,
containers fall back to being limited and nobody yields. Flags are written only
when they differ from what the record holds, and before the heartbeat, so a
region the agent has just found becomes live with its flags already right.

Regions stay mapped between ticks, keyed by directory and re-opened when the
file's inode changes (the agent made a new region). A region not there yet,
or one an older interposer is still setting up, is skipped quietly; one the
binding refuses (foreign, another layout version), a symlink or anything but a
regular file is skipped with one warning per file, and so is a mapped region
whose file shrank (reading a mapping past the end of its file would fault; the
size is checked every tick, just before the region is read). Nothing a container
puts in its directory makes a tick raise or wait.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from gpuslice_common.region import REGION_SIZE, DeviceUsage, ProcessUsage, Region, RegionError
from gpuslice_deviceplugin.containers import REGION_FILE, ContainerOwner, HostDir

__all__ = [
    "ContainerState",
    "Coordinator",
    "CoordinatorSnapshot",
    "DeviceState",
    "GpuState",
]

log = logging.getLogger(__name__)

# magic and version: zero while the interposer is still setting the file up
_HEADER_BYTES = 8


@dataclass(frozen=True)
class DeviceState:
    """One device record of a container's region, and what the coordinator made of it."""

    usage: DeviceUsage  # as read this tick (its flags: as the previous tick left them)
    shared: bool  # the flags as this tick left them
    yield_: bool
    active: bool
    processes: int  # live processes of the container holding memory on this device


@dataclass(frozen=True)
class ContainerState:
    """A prepared container; ``devices`` is empty until its region can be read."""

    owner: ContainerOwner
    directory: Path
    devices: tuple[DeviceState, ...]
    high_priority: bool  # one of its live processes has priority 0


@dataclass(frozen=True)
class GpuState:
    """A GPU some container's region names."""

    uuid: str
    active_containers: int


@dataclass(frozen=True)
class CoordinatorSnapshot:
    """What one tick saw and decided."""

    taken_at: float  # epoch seconds
    containers: tuple[ContainerState, ...]
    gpus: tuple[GpuState, ...]

    def container(self, pod_uid: str, name: str) -> ContainerState | None:
        """The state of one container, if it was seen."""
        for state in self.containers:
            if (state.owner.pod_uid, state.owner.container) == (pod_uid, name):
                return state
        return None

    def gpu(self, uuid: str) -> GpuState | None:
        return next((g for g in self.gpus if g.uuid == uuid), None)


@dataclass
class _Tracked:
    """A mapped region and what earlier ticks learnt from it."""

    region: Region
    inode: tuple[int, int]
    busy: dict[int, int] = field(default_factory=dict)  # record index -> busy_ns last tick


@dataclass(frozen=True)
class _Reading:
    owner: ContainerOwner
    directory: Path
    tracked: _Tracked | None
    devices: tuple[DeviceUsage, ...]
    processes: tuple[ProcessUsage, ...]
    active: frozenset[int]  # record indices


class Coordinator:
    """Sets the ``shared`` and ``yield`` flags of every container region under ``host``."""

    def __init__(self, host: HostDir) -> None:
        self._host = host
        self._tracked: dict[Path, _Tracked] = {}
        self._refused: dict[Path, tuple[int, int]] = {}  # warned about this inode
        self._lock = threading.Lock()

    def tick(self, gone: Collection[str] = ()) -> CoordinatorSnapshot:
        """Read every region, write the flags that changed and the heartbeats.

        A container of a pod in ``gone`` (known to have ended) is never active,
        whatever its region still shows: a killed process's usage stays there
        until its container's next process reclaims it, which never comes once
        the pod is gone.
        """
        with self._lock:
            readings = [
                self._read(owner, d, owner.pod_uid not in gone)
                for owner, d in self._host.containers()
            ]
            present = {r.directory for r in readings}
            self._forget(set(self._tracked) - present)
            for path in [p for p in self._refused if p.parent not in present]:
                del self._refused[path]
            active, high = _by_gpu(readings)
            states = tuple(self._decide(r, active, high) for r in readings)
            for r in readings:
                if r.tracked is not None:
                    r.tracked.region.heartbeat()
        gpus = tuple(GpuState(uuid, len(active[uuid])) for uuid in sorted(active))
        return CoordinatorSnapshot(taken_at=time.time(), containers=states, gpus=gpus)

    def close(self) -> None:
        """Unmap every region; a later tick maps them again."""
        with self._lock:
            self._forget(set(self._tracked))

    # ------------------------------------------------------------ reading

    def _read(self, owner: ContainerOwner, directory: Path, alive: bool) -> _Reading:
        tracked = self._region(directory)
        devices: tuple[DeviceUsage, ...] = ()
        processes: tuple[ProcessUsage, ...] = ()
        active: set[int] = set()
        if tracked is not None:
            devices = tuple(d for d in tracked.region.devices() if d.uuid)
            processes = tracked.region.processes()
            for dev in devices:
                before = tracked.busy.get(dev.index, dev.busy_ns)
                if alive and (dev.used_bytes > 0 or dev.busy_ns > before):
                    active.add(dev.index)
                tracked.busy[dev.index] = dev.busy_ns
        return _Reading(owner, directory, tracked, devices, processes, frozenset(active))

    def _region(self, directory: Path) -> _Tracked | None:
        """The mapped region of a container directory, (re)opened as needed.

        The file must be a regular file, opened without following a link: the
        agent made it and the container cannot replace it, but a directory left
        from an older, container-writable layout may hold anything.
        """
        path = directory / REGION_FILE
        tracked = self._tracked.get(directory)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            self._forget({directory})
            return None
        except OSError as e:
            self._forget({directory})
            self._refuse(path, (0, 0), f"cannot stat it: {e.strerror}")
            return None
        inode = (st.st_dev, st.st_ino)
        if tracked is not None and tracked.inode == inode:
            if st.st_size >= REGION_SIZE:
                return tracked
            # Reading a mapping past the end of its file faults: let go first.
            self._forget({directory})
            self._refuse(path, inode, f"truncated to {st.st_size} bytes while mapped")
            return None
        self._forget({directory})
        if not stat.S_ISREG(st.st_mode):
            self._refuse(path, inode, "not a regular file")
            return None
        if _being_set_up(path):
            log.debug("%s: not set up yet", path)
            return None
        try:
            region = Region.open(path, writable=True)
        except RegionError as e:
            self._refuse(path, inode, str(e))
            return None
        if region.inode != inode:  # replaced while it was opened: next tick
            region.close()
            return None
        self._refused.pop(path, None)
        log.info("coordinating %s", path)
        tracked = _Tracked(region, inode)
        self._tracked[directory] = tracked
        return tracked

    def _refuse(self, path: Path, inode: tuple[int, int], why: str) -> None:
        if self._refused.get(path) != inode:
            log.warning("skipping region %s: %s", path, why)
            self._refused[path] = inode

    def _forget(self, directories: Iterable[Path]) -> None:
        for directory in directories:
            tracked = self._tracked.pop(directory, None)
            if tracked is not None:
                tracked.region.close()
                log.info("no longer coordinating %s", directory / REGION_FILE)

    # ------------------------------------------------------------ deciding

    def _decide(
        self,
        reading: _Reading,
        active: dict[str, set[Path]],
        high: dict[str, set[Path]],
    ) -> ContainerState:
        me = reading.directory
        states: list[DeviceState] = []
        for dev in reading.devices:
            high_here = high.get(dev.uuid, set())
            shared = bool(active[dev.uuid] - {me})
            yield_ = me not in high_here and bool(high_here)
            if reading.tracked is not None and (dev.shared, dev.yield_) != (shared, yield_):
                reading.tracked.region.set_flags(dev.index, shared=shared, yield_=yield_)
                log.debug("%s device %d: shared=%s yield=%s", me, dev.index, shared, yield_)
            holding = sum(
                1
                for p in reading.processes
                if dev.index < len(p.used_bytes) and p.used_bytes[dev.index] > 0
            )
            states.append(
                DeviceState(
                    usage=dev,
                    shared=shared,
                    yield_=yield_,
                    active=dev.index in reading.active,
                    processes=holding,
                )
            )
        return ContainerState(
            owner=reading.owner,
            directory=me,
            devices=tuple(states),
            high_priority=_high_priority(reading.processes),
        )


def _high_priority(processes: tuple[ProcessUsage, ...]) -> bool:
    return any(p.priority == 0 for p in processes)


def _by_gpu(readings: list[_Reading]) -> tuple[dict[str, set[Path]], dict[str, set[Path]]]:
    """Per GPU UUID: the containers active on it, and those of them with high priority."""
    active: dict[str, set[Path]] = {}
    high: dict[str, set[Path]] = {}
    for r in readings:
        is_high = _high_priority(r.processes)
        for dev in r.devices:
            active.setdefault(dev.uuid, set())
            if dev.index in r.active:
                active[dev.uuid].add(r.directory)
                if is_high:
                    high.setdefault(dev.uuid, set()).add(r.directory)
    return active, high


def _being_set_up(path: Path) -> bool:
    """True while the interposer has created the file but not yet written its header."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False  # Region.open reports it
    try:
        head = os.pread(fd, _HEADER_BYTES, 0)
    except OSError:
        return False
    finally:
        os.close(fd)
    return head.count(0) == len(head)
