"""Read a container's shared region without CUDA.

Every CUDA process of a container maps one "shared region" file (its path is the
container's ``CUDA_DEVICE_MEMORY_SHARED_CACHE``); the interposer in ``native/``
accounts memory and compute there, and the node agent reads it. Every process of
the container can write it, so nothing read from it decides a limit: the flags
the compute limiter obeys come from the agent's control file
(:mod:`gpuslice_common.control`). ``set_flags`` and ``heartbeat`` write fields
the interposer no longer reads (kept for tools of the earlier layout).

The layout has one definition, the C header ``region_layout.h`` shipped inside this
package. This module does not restate it: at import it reads the header with
:mod:`importlib.resources`, drops comments and every preprocessor line except
``#define NAME <integer>``, and hands the rest to cffi's ``cdef`` (ABI mode: no
compiler, no shared library). Struct sizes and field offsets are therefore the
ones cffi computes for the platform's C ABI, the same the interposer is compiled
with; :data:`ffi` is that FFI, public so that tools and tests can lay out a region
exactly as the C side does (``ffi.new("gs_region_t *")``, ``ffi.buffer(...)``).

Usage::

    with Region.open(path) as region:             # read-only mapping
        for dev in region.devices(): ...
    with Region.open(path, writable=True) as region:
        region.set_flags(0, shared=True, yield_=False)
        region.heartbeat()

:meth:`Region.open` refuses (with :class:`RegionError`) a missing file, a file that
is not a region, a region of another layout version and a truncated one.

Concurrency. The interposer's processes update the region while it is read, with
atomic builtins on their side. Here every 64-bit counter is read with one load
through cffi (an aligned ``uint64_t`` load is a single instruction on x86-64 and
arm64), so a value is never torn; but a snapshot returned by :meth:`Region.devices`
or :meth:`Region.processes` is *not* atomic across fields: ``used`` and ``peak``,
or two processes, may come from slightly different moments. In particular a
device's ``used`` may briefly exceed the sum of its processes' ``used`` (an
allocation in flight is counted on the device first); both are unsigned and never
negative. The node agent writes only ``flags`` (one aligned 32-bit store, which
the C side reads atomically) and ``agent_heartbeat_ns`` (one aligned 64-bit store
of ``time.monotonic_ns()``, i.e. ``CLOCK_MONOTONIC``, the clock the C side compares
against ``GS_AGENT_FRESH_NS``). Region files are never shrunk while mapped; a file
truncated under a live mapping would fault on access, as it would in C.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import stat
import time
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from types import TracebackType
from typing import Any, Final, Self

from cffi import FFI
from pydantic import Field

from gpuslice_common.models import Frozen, NonNegInt

__all__ = [
    "AGENT_FRESH_NS",
    "DEV_SHARED",
    "DEV_YIELD",
    "MAGIC",
    "MAX_DEVICES",
    "MAX_PROCS",
    "REGION_SIZE",
    "UUID_LEN",
    "VERSION",
    "DeviceUsage",
    "ProcessUsage",
    "Region",
    "RegionError",
    "ffi",
    "header_ffi",
    "layout_cdef",
    "replace_at",
]

HEADER: Final = "region_layout.h"

_COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.DOTALL)
_INT_DEFINE = re.compile(r"^#\s*define\s+([A-Za-z_]\w*)\s+(0[xX][0-9a-fA-F]+|\d+)[uUlL]*$")


def layout_cdef(header: str) -> tuple[str, dict[str, int]]:
    """The header's text as cffi's ``cdef`` takes it, and its integer ``#define``\\ s.

    Comments go, and every preprocessor line but ``#define NAME <integer>`` (the
    include guard, ``#include <stdint.h>``: cffi knows the fixed-width types).
    """
    kept: list[str] = []
    defines: dict[str, int] = {}
    for line in _COMMENT.sub(" ", header).splitlines():
        stripped = line.strip()
        if not stripped.startswith("#"):
            kept.append(line)
            continue
        if m := _INT_DEFINE.match(stripped):
            name, value = m.group(1), int(m.group(2), 0)
            defines[name] = value
            kept.append(f"#define {name} {value}")
    return "\n".join(kept), defines


def header_ffi(package: str, header: str) -> tuple[Any, dict[str, int]]:
    """An FFI that knows the C header ``header`` shipped in ``package``, and the
    header's integer ``#define``\\ s (see :func:`layout_cdef`)."""
    text = resources.files(package).joinpath(header).read_text(encoding="utf-8")
    source, defines = layout_cdef(text)
    ffi = FFI()
    ffi.cdef(source)
    return ffi, defines


_LOADED = header_ffi("gpuslice_common", HEADER)
ffi: Final[Any] = _LOADED[0]
_DEFINES: Final = _LOADED[1]

MAGIC: Final = _DEFINES["GS_REGION_MAGIC"]
VERSION: Final = _DEFINES["GS_REGION_VERSION"]
MAX_DEVICES: Final = _DEFINES["GS_MAX_DEVICES"]
MAX_PROCS: Final = _DEFINES["GS_MAX_PROCS"]
UUID_LEN: Final = _DEFINES["GS_UUID_LEN"]
DEV_SHARED: Final = _DEFINES["GS_DEV_SHARED"]
DEV_YIELD: Final = _DEFINES["GS_DEV_YIELD"]
AGENT_FRESH_NS: Final = _DEFINES["GS_AGENT_FRESH_NS"]
REGION_SIZE: Final[int] = ffi.sizeof("gs_region_t")

# magic, version, size: the leading fields checked before the region is mapped
_HEADER_BYTES: Final[int] = ffi.offsetof("gs_region_t", "device_count")


def replace_at(dir_fd: int, name: str, data: bytes, mode: int) -> None:
    """Write ``data`` as ``name`` in the directory ``dir_fd``, whole: under a
    temporary name made without following a link, given ``mode``, then renamed
    into place, so a reader (the interposer) sees the old file or the new one."""
    tmp = f".{name}.{os.getpid()}.{time.monotonic_ns()}.tmp"
    fd = os.open(
        tmp,
        os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
        0o600,
        dir_fd=dir_fd,
    )
    try:
        try:
            os.write(fd, data)
            os.fchmod(fd, mode)
        finally:
            os.close(fd)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise


class RegionError(Exception):
    """A shared region could not be opened or used; the message names the file."""


class DeviceUsage(Frozen):
    """One device's accounting in a container's region, as read at one moment."""

    index: NonNegInt
    uuid: str  # empty until a process of the container attached to the device
    limit_bytes: NonNegInt  # 0: no limit
    used_bytes: NonNegInt
    peak_bytes: NonNegInt
    denied_allocations: NonNegInt
    throttled_ns: NonNegInt
    busy_ns: NonNegInt
    sm_limit_percent: NonNegInt  # 0: no limit
    shared: bool  # what the region's unused flags field holds (see region_layout.h)
    yield_: bool
    clock_ns: NonNegInt = 0  # the container's limiter clock (tat_ns)


class ProcessUsage(Frozen):
    """One live process slot of a region."""

    pid: int = Field(gt=0)
    priority: NonNegInt  # CUDA_TASK_PRIORITY: 0 high, 1 low
    start_time_ticks: NonNegInt  # clock ticks after boot: tells a reused PID
    used_bytes: tuple[NonNegInt, ...]  # per device index, for the region's device_count


class Region:
    """A mapping of one container's shared region file; use :meth:`open`."""

    def __init__(self, path: Path, mapping: mmap.mmap, *, writable: bool) -> None:
        self._path = path
        self._mmap: mmap.mmap | None = mapping
        self._writable = writable
        self._r: Any = ffi.from_buffer("gs_region_t *", mapping)
        self.inode: tuple[int, int] = (0, 0)  # (st_dev, st_ino) of the file opened

    # ------------------------------------------------------------ open and close

    @classmethod
    def open(
        cls, path: str | os.PathLike[str], *, writable: bool = False, dir_fd: int | None = None
    ) -> Self:
        """Map the region at ``path`` (relative to ``dir_fd`` if given), read-only unless
        ``writable``.

        The file is opened without following a link and without waiting on a FIFO,
        and checked on the open descriptor. Raises :class:`RegionError` when it is
        missing or unreadable, is not a regular file or not a gpuslice region, has
        another layout version, or is truncated.
        """
        p = Path(path)
        flags = (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW | os.O_NONBLOCK
        try:
            fd = os.open(p, flags | os.O_CLOEXEC, dir_fd=dir_fd)
        except FileNotFoundError:
            raise RegionError(f"{p}: no such region file") from None
        except OSError as e:
            raise RegionError(f"{p}: cannot open: {e.strerror}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise RegionError(f"{p}: not a regular file")
            size = st.st_size
            _check(p, size, os.pread(fd, _HEADER_BYTES, 0))
            # ACCESS_WRITE is MAP_SHARED read-write; ACCESS_READ also marks the
            # buffer read-only, so no Python write can reach a PROT_READ page.
            access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ
            mapping = mmap.mmap(fd, REGION_SIZE, access=access)
        except OSError as e:
            raise RegionError(f"{p}: cannot map: {e.strerror}") from None
        finally:
            os.close(fd)  # the mapping keeps its own reference to the file
        region = cls(p, mapping, writable=writable)
        region.inode = (st.st_dev, st.st_ino)
        return region

    @staticmethod
    def create(
        dir_fd: int, name: str, devices: Sequence[tuple[str, int, int]], *, mode: int = 0o666
    ) -> None:
        """Make the region file ``name`` in the directory ``dir_fd``, set up for the
        container's ``devices`` (UUID, memory limit in bytes, SM percent) in order,
        unless a region the interposer takes is already there (a running container
        maps it): a regular file of this user with ``mode``, one link, the exact
        size and a valid header.

        The file is written in full under a temporary name, given ``mode``, then
        renamed into place, so the interposer never sees it half made. Anything
        else at ``name`` (a link, a FIFO, a truncated or foreign file, a region of
        another owner, mode or size, or with other links) is replaced.
        """
        if len(devices) > MAX_DEVICES:
            raise ValueError(f"{len(devices)} devices; a region holds {MAX_DEVICES}")
        if _reusable(dir_fd, name, mode):
            return
        r = ffi.new("gs_region_t *")
        r.magic, r.version, r.size = MAGIC, VERSION, REGION_SIZE
        r.device_count = len(devices)
        for i, (uuid, limit, sm) in enumerate(devices):
            raw = uuid.encode()
            if not 0 < len(raw) < UUID_LEN:
                raise ValueError(f"device UUID {uuid!r} does not fit the region")
            r.devices[i].uuid = raw
            r.devices[i].limit = limit
            r.devices[i].sm_limit = 0 if sm >= 100 else sm
        replace_at(dir_fd, name, bytes(ffi.buffer(r)), mode)

    def close(self) -> None:
        """Unmap the region; idempotent."""
        if self._mmap is None:
            return
        ffi.release(self._r)
        self._r = None
        self._mmap.close()
        self._mmap = None

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._mmap is None else ("rw" if self._writable else "ro")
        return f"Region({str(self._path)!r}, {state})"

    @property
    def path(self) -> Path:
        return self._path

    @property
    def writable(self) -> bool:
        return self._writable

    @property
    def closed(self) -> bool:
        return self._mmap is None

    # ------------------------------------------------------------ reads

    @property
    def device_count(self) -> int:
        """Devices the container's processes have seen (at most ``MAX_DEVICES``)."""
        return min(int(self._region().device_count), MAX_DEVICES)

    @property
    def agent_heartbeat_ns(self) -> int:
        """``CLOCK_MONOTONIC`` of the node agent's last :meth:`heartbeat`; 0 if none."""
        return int(self._region().agent_heartbeat_ns)

    def devices(self) -> tuple[DeviceUsage, ...]:
        """Every device below ``device_count``; each counter is one load (see module doc)."""
        r = self._region()
        return tuple(_device(i, r.devices[i]) for i in range(self.device_count))

    def processes(self) -> tuple[ProcessUsage, ...]:
        """Live process slots (``pid != 0``) below ``proc_high``."""
        r = self._region()
        high = min(int(r.proc_high), MAX_PROCS)
        count = self.device_count
        found: list[ProcessUsage] = []
        for slot in range(high):
            proc = r.procs[slot]
            pid = int(proc.pid)  # read once: the slot may be freed meanwhile
            if pid <= 0:
                continue
            used = proc.used
            found.append(
                ProcessUsage(
                    pid=pid,
                    priority=int(proc.priority),
                    start_time_ticks=int(proc.start_time),
                    used_bytes=tuple(int(used[d]) for d in range(count)),
                )
            )
        return tuple(found)

    # ------------------------------------------------------------ the agent's writes

    def set_flags(self, index: int, *, shared: bool, yield_: bool) -> None:
        """Set device ``index``'s ``GS_DEV_SHARED`` and ``GS_DEV_YIELD`` in one 32-bit store.

        The index may be at or above ``device_count``: the agent may set flags
        before a process of the container has seen the device.
        """
        if not 0 <= index < MAX_DEVICES:
            raise ValueError(f"device index {index} out of range 0..{MAX_DEVICES - 1}")
        r = self._writable_region()
        r.devices[index].flags = (DEV_SHARED if shared else 0) | (DEV_YIELD if yield_ else 0)

    def heartbeat(self) -> int:
        """Stamp ``agent_heartbeat_ns`` with ``time.monotonic_ns()`` and return it.

        The interposer honours the flags only while this stamp is younger than
        ``AGENT_FRESH_NS``.
        """
        r = self._writable_region()
        now = time.monotonic_ns()
        r.agent_heartbeat_ns = now
        return now

    # ------------------------------------------------------------ internals

    def _region(self) -> Any:
        if self._mmap is None:
            raise RegionError(f"{self._path}: region is closed")
        return self._r

    def _writable_region(self) -> Any:
        r = self._region()
        if not self._writable:
            raise RegionError(f"{self._path}: region is open read-only")
        return r


def _reusable(dir_fd: int, name: str, mode: int) -> bool:
    """Whether ``name`` in ``dir_fd`` is a region the interposer takes as the agent's
    (native/src/region.c, check_region_fd): checked on the open descriptor."""
    try:
        fd = os.open(
            name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd
        )
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if not (
            stat.S_ISREG(st.st_mode)
            and st.st_uid == os.geteuid()
            and stat.S_IMODE(st.st_mode) == mode
            and st.st_nlink == 1
            and st.st_size == REGION_SIZE
        ):
            return False
        _check(Path(name), st.st_size, os.pread(fd, _HEADER_BYTES, 0))
    except (OSError, RegionError):
        return False
    finally:
        os.close(fd)
    return True


def _check(path: Path, size: int, header: bytes) -> None:
    if len(header) < _HEADER_BYTES:
        raise RegionError(f"{path}: truncated: {size} bytes, expected {REGION_SIZE}")
    # only the leading fields are read through this pointer: they lie in `header`
    head = ffi.cast("gs_region_t *", ffi.from_buffer(header))
    magic, version, declared = int(head.magic), int(head.version), int(head.size)
    if magic != MAGIC:
        raise RegionError(f"{path}: not a gpuslice region (magic {magic:#010x})")
    if version != VERSION:
        raise RegionError(f"{path}: layout version {version}, this gpuslice reads {VERSION}")
    if declared != REGION_SIZE:
        raise RegionError(f"{path}: size field {declared}, this gpuslice expects {REGION_SIZE}")
    if size < REGION_SIZE:
        raise RegionError(f"{path}: truncated: {size} bytes, expected {REGION_SIZE}")


def _device(index: int, dev: Any) -> DeviceUsage:
    flags = int(dev.flags)
    return DeviceUsage(
        index=index,
        uuid=ffi.string(dev.uuid, UUID_LEN).decode("utf-8", "replace"),
        limit_bytes=int(dev.limit),
        used_bytes=int(dev.used),
        peak_bytes=int(dev.peak),
        denied_allocations=int(dev.denied),
        throttled_ns=int(dev.throttled_ns),
        busy_ns=int(dev.busy_ns),
        sm_limit_percent=int(dev.sm_limit),
        shared=bool(flags & DEV_SHARED),
        yield_=bool(flags & DEV_YIELD),
        clock_ns=int(dev.tat_ns),
    )
