"""MIG instances the agent makes for containers, and what it remembers of them.

On a node in ``mig`` mode the scheduler gives a container a MIG profile at a
placement on a card (``DeviceGrant.mig``). At Allocate the agent makes that
instance (a GPU instance with one compute instance covering it) and gives the
container its MIG device. Before making one it writes down what it is about to
make, and after, the MIG device's UUID: one record per instance, in
``<host dir>/mig/`` (0700), so an agent that restarts knows which instances are
its own. When the pod has ended the instance is destroyed (compute instance
first) and the record removed. Records are read only from a directory that the
agent's user alone can write, and only under their own name: a record is what
makes the agent destroy an instance.

At start the agent reconciles: an instance it was making when it stopped is
destroyed (its container never got it), a record whose instance is gone is
forgotten. Records of pods that ended while it was away go with the other
ended pods. An instance someone else made is never touched; the node's
inventory reports it (``GpuDevice.mig_instances``) so no grant is put on its
slices. A grant NVML does not offer, or whose slices are taken, is refused
with nothing made.

A backend that can make instances is a :class:`MigDriver`: NVML
(:mod:`gpuslice_deviceplugin.mig_nvml`) or :class:`SimulatedMig`, which keeps
them in memory.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import stat
import threading
import uuid as uuidlib
from collections.abc import Collection, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final, Protocol

from gpuslice_common.models import DeviceGrant, GpuDevice, MigInstance, MigPlacement, MigProfile
from gpuslice_deviceplugin.containers import write_atomic

log = logging.getLogger(__name__)

RECORDS_DIR: Final = "mig"
RECORDS_MODE: Final = 0o700
RECORD_FILE_MODE: Final = 0o600  # a record: the agent's alone
RECORD_MAX_BYTES: Final = 4096


class MigError(Exception):
    """A MIG instance that cannot be made or found; the message says which and why."""


@dataclass(frozen=True)
class LiveInstance:
    """A GPU instance on a card; ``uuid`` is its MIG device's, None without one."""

    profile: str
    placement: MigPlacement
    uuid: str | None
    memory_mib: int


class MigDriver(Protocol):
    """What makes and lists a node's MIG instances (cards named by UUID)."""

    def mig_profiles(self, gpu: str) -> tuple[MigProfile, ...]:
        """Every profile the card offers, with its placements; () without MIG."""
        ...

    def mig_instances(self, gpu: str) -> list[LiveInstance]: ...

    def mig_create(self, gpu: str, profile: str, placement: MigPlacement) -> LiveInstance:
        """Make ``profile`` at exactly ``placement``; MigError when it cannot be made."""
        ...

    def mig_destroy(self, gpu: str, placement: MigPlacement) -> bool:
        """Destroy the instance at ``placement``; False when there is none."""
        ...


def _profile(
    name: str, memory_mib: int, slices: int, starts: Iterable[int], size: int
) -> MigProfile:
    return MigProfile(
        name=name,
        memory_mib=memory_mib,
        cores=slices * 100 // 7,
        slices=slices,
        placements=tuple(MigPlacement(start=s, size=size) for s in starts),
    )


# The profiles NVML gives an A100-SXM4-40GB: the simulated MIG cards'
A100_40GB: Final = (
    _profile("1g.5gb", 4864, 1, range(7), 1),
    _profile("1g.10gb", 9856, 1, (0, 2, 4, 6), 2),
    _profile("2g.10gb", 9856, 2, (0, 2, 4), 2),
    _profile("3g.20gb", 19968, 3, (0, 4), 4),
    _profile("4g.20gb", 19968, 4, (0,), 4),
    _profile("7g.40gb", 40192, 7, (0,), 8),
)


def check_offered(
    gpu: str, offered: Sequence[MigProfile], profile: str, placement: MigPlacement
) -> MigProfile:
    """The profile ``profile`` if the card offers it at ``placement``, else MigError."""
    found = next((p for p in offered if p.name == profile), None)
    if found is None:
        names = ", ".join(p.name for p in offered) or "none"
        raise MigError(f"GPU {gpu} offers no MIG profile {profile} (it offers {names})")
    if placement not in found.placements:
        raise MigError(
            f"GPU {gpu} offers MIG profile {profile} at no placement "
            f"{placement.start}+{placement.size}"
        )
    return found


def overlapping(live: Iterable[LiveInstance], placement: MigPlacement) -> LiveInstance | None:
    return next((i for i in live if i.placement.mask & placement.mask), None)


def first_fit(offered: Sequence[MigProfile], profiles: Sequence[str]) -> list[MigPlacement]:
    """Where ``profiles``, in order, go on an empty card: each at its first
    placement clear of those before it; MigError naming the first that does not fit."""
    taken = 0
    out: list[MigPlacement] = []
    for name in profiles:
        found = next((p for p in offered if p.name == name), None)
        if found is None:
            names = ", ".join(p.name for p in offered) or "none"
            raise MigError(f"no MIG profile {name} (the card offers {names})")
        place = next((p for p in found.placements if not p.mask & taken), None)
        if place is None:
            raise MigError(
                f"MIG profile {name} does not fit beside {', '.join(profiles[: len(out)])}"
            )
        taken |= place.mask
        out.append(place)
    return out


class SimulatedMig:
    """MIG instances of simulated cards, in memory (the A100-40GB geometry)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._made: dict[str, dict[int, LiveInstance]] = {}
        self._serial = 0

    def mig_profiles(self, gpu: str) -> tuple[MigProfile, ...]:
        return A100_40GB

    def mig_instances(self, gpu: str) -> list[LiveInstance]:
        with self._lock:
            return sorted(self._made.get(gpu, {}).values(), key=lambda i: i.placement.start)

    def mig_create(self, gpu: str, profile: str, placement: MigPlacement) -> LiveInstance:
        found = check_offered(gpu, self.mig_profiles(gpu), profile, placement)
        with self._lock:
            on_card = self._made.setdefault(gpu, {})
            taken = overlapping(on_card.values(), placement)
            if taken is not None:
                raise MigError(f"GPU {gpu}: slices {placement.start}+{placement.size} are taken")
            self._serial += 1
            made = LiveInstance(
                profile,
                placement,
                f"MIG-{uuidlib.uuid5(uuidlib.NAMESPACE_URL, f'{gpu}/{self._serial}')}",
                found.memory_mib,
            )
            on_card[placement.start] = made
            return made

    def mig_destroy(self, gpu: str, placement: MigPlacement) -> bool:
        with self._lock:
            return self._made.get(gpu, {}).pop(placement.start, None) is not None


@dataclass(frozen=True)
class Record:
    """An instance the agent makes or made for a container; ``uuid`` None while making."""

    pod_uid: str
    container: str
    gpu: str
    profile: str
    start: int
    size: int
    memory_mib: int
    uuid: str | None = None

    @property
    def placement(self) -> MigPlacement:
        return MigPlacement(start=self.start, size=self.size)

    def is_of(self, live: LiveInstance) -> bool:
        """Whether ``live`` is this record's instance (a pending record: at its place)."""
        if live.placement != self.placement or live.profile != self.profile:
            return False
        return self.uuid is None or live.uuid == self.uuid

    @classmethod
    def parse(cls, text: bytes) -> Record:
        data: Any = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        record = cls(**data)
        for name in ("pod_uid", "container", "gpu", "profile"):
            if not isinstance(getattr(record, name), str):
                raise ValueError(f"{name} is not a string")
        for name in ("start", "size", "memory_mib"):
            if type(getattr(record, name)) is not int:
                raise ValueError(f"{name} is not a whole number")
        if not (record.uuid is None or isinstance(record.uuid, str)):
            raise ValueError("uuid is neither null nor a string")
        record.placement  # noqa: B018 (checks start and size)
        return record


class MigInstances:
    """The instances this agent made, kept in ``<root>/mig/``."""

    def __init__(self, driver: MigDriver, root: Path) -> None:
        self.driver = driver
        self.dir = Path(root) / RECORDS_DIR
        self._lock = threading.Lock()  # Allocate and release run in worker threads
        self._warned: dict[str, str] = {}  # record file -> the last warning about it

    # -------------------------------------------------------------- records

    def _path(self, gpu: str, start: int) -> Path:
        return self.dir / f"{hashlib.sha256(gpu.encode()).hexdigest()[:24]}.{start}.json"

    def _open_dir(self) -> int | None:
        """The records directory, open; None when there is none. MigError when someone
        other than the agent's user could write there (a symlink, another owner, group
        or world write): a record there could make the agent destroy any instance."""
        try:
            fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as exc:  # a symlink (ELOOP) or not a directory
            raise MigError(
                f"MIG record directory {self.dir} is not trusted: {exc.strerror}"
            ) from None
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or st.st_mode & 0o022:
            os.close(fd)
            raise MigError(
                f"MIG record directory {self.dir} is not trusted: owner uid {st.st_uid}, "
                f"mode {stat.S_IMODE(st.st_mode):o}; it must be the agent's own, "
                "writable by it alone"
            )
        return fd

    def _warn(self, key: str, message: str) -> None:
        if self._warned.get(key) != message:
            self._warned[key] = message
            log.warning("%s", message)

    def records(self) -> list[Record]:
        """Every readable record; one that is not, or one under another name than
        its own, is logged (once) and left alone; none at all from a directory
        others can write."""
        try:
            fd = self._open_dir()
        except MigError as exc:
            self._warn("", f"{exc}: its records are left alone")
            return []
        self._warned.pop("", None)
        if fd is None:
            return []
        out = []
        try:
            for name in sorted(os.listdir(fd)):
                if not name.endswith(".json"):
                    continue
                try:
                    record = Record.parse(_read(name, fd))
                    if name != self._path(record.gpu, record.start).name:
                        raise ValueError(f"{name} is not the name of the record it holds")
                except (OSError, ValueError, TypeError) as exc:
                    self._warn(name, f"MIG record {self.dir / name} unreadable ({exc}): left alone")
                else:
                    self._warned.pop(name, None)
                    out.append(record)
        finally:
            os.close(fd)
        return out

    def _write(self, record: Record) -> None:
        self.dir.mkdir(mode=RECORDS_MODE, parents=True, exist_ok=True)
        fd = self._open_dir()  # MigError, nothing written, where others could write
        if fd is not None:
            os.close(fd)
        content = json.dumps(asdict(record), sort_keys=True).encode()
        write_atomic(self._path(record.gpu, record.start), content, RECORD_FILE_MODE)

    def _forget(self, record: Record) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._path(record.gpu, record.start).unlink()

    # ---------------------------------------------------------------- views

    def foreign(self, devices: Sequence[GpuDevice]) -> list[GpuDevice]:
        """``devices`` with the instances this agent made taken out of ``mig_instances``."""
        ours = {(r.gpu, r.start) for r in self.records()}
        return [
            d.model_copy(
                update={
                    "mig_instances": tuple(
                        i for i in d.mig_instances if (d.uuid, i.placement.start) not in ours
                    )
                }
            )
            if d.mig_instances
            else d
            for d in devices
        ]

    def holders(self, pod_uid: str, grants: Sequence[DeviceGrant]) -> set[str]:
        """Other pods whose instances (made here) sit on slices these grants want."""
        out = set()
        for r in self.records():
            if r.pod_uid == pod_uid:
                continue
            for g in grants:
                if g.mig and g.uuid == r.gpu and g.mig.placement.mask & r.placement.mask:
                    out.add(r.pod_uid)
        return out

    # ------------------------------------------------------------ lifecycle

    def prepare(
        self, pod_uid: str, container: str, grants: Sequence[DeviceGrant]
    ) -> dict[str, LiveInstance]:
        """The MIG instance of each grant with one, made (or, made already for this
        container by an earlier try, found), by card UUID; MigError with nothing new
        left made when one cannot be."""
        wanted = [g for g in grants if g.mig is not None]
        if not wanted:
            return {}
        with self._lock:
            records = {(r.gpu, r.start): r for r in self.records()}
            made: list[Record] = []
            out: dict[str, LiveInstance] = {}
            try:
                for grant in wanted:
                    live, record = self._make(pod_uid, container, grant, records)
                    if record is not None:
                        made.append(record)
                    out[grant.uuid] = live
            except BaseException:
                for record in reversed(made):
                    self._destroy(record)
                raise
            return out

    def _make(
        self,
        pod_uid: str,
        container: str,
        grant: DeviceGrant,
        records: dict[tuple[str, int], Record],
    ) -> tuple[LiveInstance, Record | None]:
        assert grant.mig is not None
        gpu, profile, placement = grant.uuid, grant.mig.profile, grant.mig.placement
        found = check_offered(gpu, self.driver.mig_profiles(gpu), profile, placement)
        live = self.driver.mig_instances(gpu)
        earlier = records.get((gpu, placement.start))
        if earlier is not None and (earlier.pod_uid, earlier.container) == (pod_uid, container):
            mine = next((i for i in live if earlier.is_of(i) and i.uuid), None)
            if mine is not None and earlier.uuid == mine.uuid:
                log.info("MIG instance %s of pod %s made by an earlier try", mine.uuid, pod_uid)
                return mine, None
        taken = overlapping(live, placement)
        if taken is not None:
            raise MigError(
                f"GPU {gpu}: MIG {profile} at {placement.start}+{placement.size} overlaps the "
                f"{taken.profile} instance {taken.uuid or '(no MIG device)'} at "
                f"{taken.placement.start}+{taken.placement.size}"
            )
        record = Record(
            pod_uid, container, gpu, profile, placement.start, placement.size, found.memory_mib
        )
        self._write(record)  # first: an agent stopped while making it finds it after
        try:
            instance = self.driver.mig_create(gpu, profile, placement)
        except BaseException:
            self._forget(record)
            raise
        if instance.uuid is None:  # a driver that returns one without a device
            self.driver.mig_destroy(gpu, placement)
            self._forget(record)
            raise MigError(f"GPU {gpu}: MIG {profile} made no MIG device")
        done = Record(**{**asdict(record), "uuid": instance.uuid})
        self._write(done)
        log.info(
            "made MIG %s at %d+%d on %s for pod %s container %s: %s",
            profile,
            placement.start,
            placement.size,
            gpu,
            pod_uid,
            container,
            instance.uuid,
        )
        return instance, done

    def _destroy(self, record: Record) -> bool:
        """Destroy ``record``'s instance if it is still there, then forget it; False
        (and the record kept) when the driver fails."""
        try:
            live = self.driver.mig_instances(record.gpu)
            if any(record.is_of(i) for i in live):
                self.driver.mig_destroy(record.gpu, record.placement)
                log.info(
                    "destroyed MIG %s at %d+%d on %s (pod %s)",
                    record.profile,
                    record.start,
                    record.size,
                    record.gpu,
                    record.pod_uid,
                )
        except Exception as exc:  # the record stays: the next pass tries again
            log.warning(
                "MIG instance at %d+%d on %s of pod %s not destroyed: %s",
                record.start,
                record.size,
                record.gpu,
                record.pod_uid,
                exc,
            )
            return False
        self._forget(record)
        return True

    def undo(self, pod_uid: str, container: str) -> None:
        """Destroy what was made for a container whose Allocate failed after."""
        with self._lock:
            for r in self.records():
                if (r.pod_uid, r.container) == (pod_uid, container):
                    self._destroy(r)

    def release(self, pod_uids: Collection[str]) -> list[Record]:
        """Destroy the instances of pods that ended; the records done with."""
        if not pod_uids:
            return []
        with self._lock:
            return [r for r in self.records() if r.pod_uid in pod_uids and self._destroy(r)]

    def reconcile(self) -> None:
        """At start: destroy what was being made, forget what is gone."""
        with self._lock:
            for record in self.records():
                if record.uuid is None:
                    log.info("MIG instance of pod %s was being made: undone", record.pod_uid)
                    self._destroy(record)
                    continue
                try:
                    live = self.driver.mig_instances(record.gpu)
                except Exception as exc:
                    log.warning("MIG instances of %s unreadable: %s", record.gpu, exc)
                    continue
                if not any(record.is_of(i) for i in live):
                    log.info(
                        "MIG instance %s of pod %s is gone: forgotten", record.uuid, record.pod_uid
                    )
                    self._forget(record)


def static_instances(gpu: str, live: Iterable[LiveInstance]) -> tuple[MigInstance, ...]:
    """``live`` as the inventory reports them; one without a MIG device is named by
    its card and first slice."""
    return tuple(
        MigInstance(
            uuid=i.uuid or f"{gpu}:gi{i.placement.start}",
            profile=i.profile,
            placement=i.placement,
        )
        for i in live
    )


def _read(name: str, dir_fd: int) -> bytes:
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > RECORD_MAX_BYTES:
            raise OSError(f"{name} is not a regular file of at most {RECORD_MAX_BYTES} bytes")
        return os.pread(fd, RECORD_MAX_BYTES, 0)
    finally:
        os.close(fd)
