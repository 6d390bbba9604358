"""Compute coordination between the containers sharing a GPU on this node.

Every tick the coordinator reads each container's grant (written by the agent at
Allocate, read-only to the container) and its shared region, and writes, per
device of the grant, the two flags the interposer's compute limiter obeys into
the container's control file (:mod:`gpuslice_common.control`: written by the
agent only, read-only to the container):

* ``shared``: another container is *active* on the same GPU. Under
  ``GPU_CORE_UTILIZATION_POLICY=default`` a container with ``CUDA_DEVICE_SM_LIMIT``
  is held to its share only while this is set, so a container alone on a GPU
  gets all of it.
* ``yield``: another container with *high priority* is active on the same GPU;
  set only for containers that are not high priority there. Their
  low-priority processes wait before each launch while it is set.

What decides a neighbour's treatment comes from the agent's own files, never
from the region, which every process of the container can write: which GPUs a
container holds are its grant's devices (record i of its region is the grant's
i-th device, whatever UUID the region shows; records past the grant are
ignored), and its priority is the grant's (``priority 0``: high). The region's
process slots (priorities, PIDs that may be long dead) are not read.

Activity is read from the region, for the container's own granted devices
only: a container is *active* on a GPU when its record shows memory held
(``used_bytes > 0``, which includes each context's overhead) or its ``busy_ns``
grew since the previous tick (the first sight of a region sets the baseline).
A container can fake that, but only about itself: it makes itself look busy on
the GPUs it was granted, which is what running kernels there would do anyway
(it can make neighbours on those GPUs limited, or yield to it if the grant made
it high priority there, exactly as real work would); it cannot name a GPU it
was not granted, nor lift a flag the agent set on it.

Each tick also raises the control file's clock floor of each device to the
limiter clock the region shows (at most ``MAX_AHEAD_NS`` ahead, as the
interposer bounds it): a process joining the container starts from it, so
winding the region's clock back once between two processes buys at most a
tick (kept at zero, it shows the floor little: each process is then held to
its share alone, and the enforcer's throttling holds the container).

Then every control file gets a heartbeat. The interposer honours the flags only
while the heartbeat is younger than 5 s (``AGENT_FRESH_NS``): if the agent stops,
containers fall back to being limited and nobody yields; a container with a
grant and no control file is treated so too. Flags are written before the
heartbeat, so a control file the agent has just made becomes live with its
flags already right.

Regions and control files stay mapped between ticks, keyed by directory and
re-opened when a file's inode changes. A region not there yet, or one an older
interposer is still setting up, is skipped quietly; one the binding refuses
(foreign, another layout version), a symlink or anything but a regular file is
skipped with one warning per file, and so is a mapped region whose file shrank
(reading a mapping past the end of its file would fault; the size is checked
every tick, just before the region is read). A missing or invalid control file
is made afresh. Nothing a container puts in its directory makes a tick raise or
wait.
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

from gpuslice_common import grant as grant_format
from gpuslice_common.control import CONTROL_FILE, Control, ControlError
from gpuslice_common.grant import Grant, GrantError
from gpuslice_common.region import REGION_SIZE, DeviceUsage, Region, RegionError
from gpuslice_deviceplugin.containers import GRANT_FILE, REGION_FILE, ContainerOwner, HostDir

__all__ = [
    "MAX_AHEAD_NS",
    "ContainerState",
    "Coordinator",
    "CoordinatorSnapshot",
    "DeviceState",
    "GpuState",
]

log = logging.getLogger(__name__)

# magic and version: zero while the interposer is still setting the file up
_HEADER_BYTES = 8
_GRANT_MAX_BYTES = grant_format.MAX_BYTES
# A limiter clock further ahead than this is stale (GS_MAX_AHEAD_NS in launch.c).
MAX_AHEAD_NS = 120_000_000_000


@dataclass(frozen=True)
class DeviceState:
    """One device of a container's grant, its region record, and what the coordinator
    made of it. ``usage.uuid`` and ``usage.index`` are the grant's."""

    usage: DeviceUsage  # as read this tick
    shared: bool  # the flags as this tick left them in the control file
    yield_: bool
    active: bool
    processes: int  # live processes of the container holding memory on this device


@dataclass(frozen=True)
class ContainerState:
    """A prepared container; ``devices`` is empty until its grant and region can be read."""

    owner: ContainerOwner
    directory: Path
    devices: tuple[DeviceState, ...]
    high_priority: bool  # its grant says priority 0


@dataclass(frozen=True)
class GpuState:
    """A GPU some container's grant names."""

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
    grant: Grant | None
    tracked: _Tracked | None
    control: Control | None
    devices: tuple[DeviceUsage, ...]  # the grant's, each with its region record
    holders: tuple[int, ...]  # per device: live processes holding memory on it
    active: frozenset[int]  # grant device indices


class Coordinator:
    """Sets the ``shared`` and ``yield`` flags of every container under ``host``."""

    def __init__(self, host: HostDir) -> None:
        self._host = host
        self._tracked: dict[Path, _Tracked] = {}
        self._controls: dict[Path, Control] = {}
        self._refused: dict[Path, tuple[int, int]] = {}  # warned about this inode
        self._bad_grants: dict[Path, str] = {}  # warned about this
        # parsed grants by file identity: the agent replaces a grant, never edits it
        self._grants: dict[Path, tuple[tuple[int, int, int, int], Grant]] = {}
        self._lock = threading.Lock()

    def tick(self, gone: Collection[str] = ()) -> CoordinatorSnapshot:
        """Read every grant and region, write the flags that changed and the heartbeats.

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
            self._forget_controls(set(self._controls) - present)
            for path in [p for p in self._refused if p.parent not in present]:
                del self._refused[path]
            for path in [p for p in self._bad_grants if p.parent not in present]:
                del self._bad_grants[path]
            for path in [p for p in self._grants if p.parent not in present]:
                del self._grants[path]
            active, high = _by_gpu(readings)
            states = tuple(self._decide(r, active, high) for r in readings)
            for r in readings:
                if r.control is not None and r.grant is not None:
                    r.control.heartbeat()
        gpus = tuple(GpuState(uuid, len(active[uuid])) for uuid in sorted(active))
        return CoordinatorSnapshot(taken_at=time.time(), containers=states, gpus=gpus)

    def close(self) -> None:
        """Unmap every region and control file; a later tick maps them again."""
        with self._lock:
            self._forget(set(self._tracked))
            self._forget_controls(set(self._controls))

    # ------------------------------------------------------------ reading

    def _read(self, owner: ContainerOwner, directory: Path, alive: bool) -> _Reading:
        grant = self._grant(directory)
        tracked = self._region(directory) if grant is not None else None
        control = self._control(directory) if grant is not None else None
        devices: list[DeviceUsage] = []
        holders: list[int] = []
        active: set[int] = set()
        if grant is not None and tracked is not None:
            records = {d.index: d for d in tracked.region.devices()}
            processes = tracked.region.processes()
            now = time.monotonic_ns()
            for index, granted in enumerate(grant.devices):
                record = records.get(index)
                if record is None:
                    continue
                dev = record.model_copy(update={"uuid": granted.uuid})
                devices.append(dev)
                holders.append(
                    sum(1 for p in processes if index < len(p.used_bytes) and p.used_bytes[index])
                )
                before = tracked.busy.get(index, dev.busy_ns)
                if alive and (dev.used_bytes > 0 or dev.busy_ns > before):
                    active.add(index)
                tracked.busy[index] = dev.busy_ns
                if control is not None:
                    control.raise_floor(index, min(dev.clock_ns, now + MAX_AHEAD_NS))
        return _Reading(
            owner,
            directory,
            grant,
            tracked,
            control,
            tuple(devices),
            tuple(holders),
            frozenset(active),
        )

    def _grant(self, directory: Path) -> Grant | None:
        """The grant the agent wrote for the container; None (warned once) if unreadable."""
        path = directory / GRANT_FILE
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise OSError(f"{path} is not a regular file")
                key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
                cached = self._grants.get(path)
                if cached is not None and cached[0] == key:
                    return cached[1]
                text = os.pread(fd, _GRANT_MAX_BYTES + 1, 0)
            finally:
                os.close(fd)
            if len(text) > _GRANT_MAX_BYTES:
                raise GrantError(f"more than {_GRANT_MAX_BYTES} bytes")
            found = grant_format.parse(text.decode("utf-8"))
            self._grants[path] = (key, found)
        except FileNotFoundError:
            log.debug("%s: no grant yet", directory)
            self._grants.pop(path, None)
            return None
        except (OSError, UnicodeDecodeError, GrantError) as e:
            self._grants.pop(path, None)
            why = str(e)
            if self._bad_grants.get(path) != why:
                log.warning("not coordinating %s: its grant cannot be read: %s", directory, why)
                self._bad_grants[path] = why
            return None
        self._bad_grants.pop(path, None)
        return found

    def _control(self, directory: Path) -> Control | None:
        """The container's control file, mapped for writing; made afresh when missing
        or invalid. None (logged) when it cannot be made."""
        path = directory / CONTROL_FILE
        control = self._controls.get(directory)
        try:
            st = os.lstat(path)
            if control is not None and control.inode == (st.st_dev, st.st_ino):
                return control
        except OSError:
            pass
        self._forget_controls({directory})
        try:
            with self._host.open_container_dir(directory) as dir_fd:
                Control.create(dir_fd, CONTROL_FILE)
            control = Control.open(path, writable=True)
        except (OSError, ControlError) as e:
            log.warning("cannot set up the control file of %s: %s", directory, e)
            return None
        self._controls[directory] = control
        return control

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
            region = Region.open(path)
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

    def _forget_controls(self, directories: Iterable[Path]) -> None:
        for directory in directories:
            control = self._controls.pop(directory, None)
            if control is not None:
                control.close()

    # ------------------------------------------------------------ deciding

    def _decide(
        self,
        reading: _Reading,
        active: dict[str, set[Path]],
        high: dict[str, set[Path]],
    ) -> ContainerState:
        me = reading.directory
        states: list[DeviceState] = []
        for dev, holding in zip(reading.devices, reading.holders, strict=True):
            high_here = high.get(dev.uuid, set())
            shared = bool(active[dev.uuid] - {me})
            yield_ = me not in high_here and bool(high_here)
            if reading.control is not None:
                if reading.control.flags(dev.index) != (shared, yield_):
                    log.debug("%s device %d: shared=%s yield=%s", me, dev.index, shared, yield_)
                reading.control.set_flags(dev.index, shared=shared, yield_=yield_)
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
            high_priority=reading.grant is not None and reading.grant.priority == 0,
        )


def _by_gpu(readings: list[_Reading]) -> tuple[dict[str, set[Path]], dict[str, set[Path]]]:
    """Per GPU UUID of a grant: the containers active on it, and those of them whose
    grant gives them high priority."""
    active: dict[str, set[Path]] = {}
    high: dict[str, set[Path]] = {}
    for r in readings:
        is_high = r.grant is not None and r.grant.priority == 0
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
