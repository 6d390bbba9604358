"""The node agent's control file: what the compute limiter takes from the agent.

The interposer's compute limiter obeys two per-device flags the node agent sets
(``shared``: another container is active on the GPU; ``yield``: a container of
higher priority is) while the agent's heartbeat is fresh. They used to live in
the shared region, which every process of the container can write: a process
could stamp the heartbeat and clear ``shared`` and so lift its own limit. They
live here instead, in ``control`` beside the grant: the agent writes it (mode
0444, in the directory the container sees read-only), in place, and the
interposer maps it read-only. A container with a grant but no readable control
file is treated as having no live agent: limited, and nobody yields.

Besides the flags the agent writes, per device, the highest limiter clock it
has seen in the container's region (``tat_floor_ns``): a process that joins
starts from it, so a process of the container that winds the region's clock
back once between two processes wins at most what one tick of the agent
missed. (A process that keeps the region's clock at zero leaves the agent
little to see: each process is then held to the share alone, and the node
agent's throttling from NVML holds the container.)

The layout is ``gs_control_t`` in ``region_layout.h`` (read with the same cffi
:data:`gpuslice_common.region.ffi`). Every field is one aligned store.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import stat
import time
from pathlib import Path
from types import TracebackType
from typing import Any, Final, Self

from gpuslice_common.region import (
    _DEFINES,
    DEV_SHARED,
    DEV_YIELD,
    MAX_DEVICES,
    ffi,
    replace_at,
)

__all__ = ["CONTROL_FILE", "CONTROL_MODE", "CONTROL_SIZE", "Control", "ControlError"]

CONTROL_FILE: Final = "control"
CONTROL_MODE: Final = 0o444
MAGIC: Final = _DEFINES["GS_CONTROL_MAGIC"]
VERSION: Final = _DEFINES["GS_CONTROL_VERSION"]
CONTROL_SIZE: Final[int] = ffi.sizeof("gs_control_t")


class ControlError(Exception):
    """A control file that is missing, not a regular file, or not of this layout."""


class Control:
    """A mapped control file (read-write for the agent, read-only for tools)."""

    def __init__(self, path: Path, mapping: mmap.mmap, inode: tuple[int, int]) -> None:
        self.path = path
        self.inode = inode
        self._mmap: mmap.mmap | None = mapping
        self._buf: Any = ffi.from_buffer(mapping)
        self._c: Any = ffi.cast("gs_control_t *", self._buf)

    @staticmethod
    def create(dir_fd: int, name: str = CONTROL_FILE) -> None:
        """Make an empty control file (no heartbeat: the agent is not live yet) in
        ``dir_fd`` unless a valid one is there (this layout, this user's, mode
        0444, one link); written in full under a temporary name and renamed into
        place."""
        with contextlib.suppress(ControlError, OSError):
            fd = _open(name, os.O_RDONLY, dir_fd)
            try:
                st = os.fstat(fd)
            finally:
                os.close(fd)
            # the interposer takes only the agent's own file that no one may write
            if (st.st_uid, stat.S_IMODE(st.st_mode), st.st_nlink) == (
                os.geteuid(),
                CONTROL_MODE,
                1,
            ):
                return
        c = ffi.new("gs_control_t *")
        c.magic, c.version = MAGIC, VERSION
        replace_at(dir_fd, name, bytes(ffi.buffer(c)), CONTROL_MODE)

    @classmethod
    def open(cls, path: Path, *, writable: bool = False) -> Control:
        """Map the control file at ``path`` (no link followed). Writing it needs the
        right to write a 0444 file: the agent runs as root."""
        fd = _open(str(path), os.O_RDWR if writable else os.O_RDONLY, None)
        try:
            st = os.fstat(fd)
            access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ
            mapping = mmap.mmap(fd, CONTROL_SIZE, access=access)
        except OSError as e:
            raise ControlError(f"{path}: cannot map: {e.strerror}") from None
        finally:
            os.close(fd)
        return cls(Path(path), mapping, (st.st_dev, st.st_ino))

    def close(self) -> None:
        if self._mmap is None:
            return
        ffi.release(self._buf)
        self._c = self._buf = None
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

    @property
    def heartbeat_ns(self) -> int:
        return int(self._control().heartbeat_ns)

    def flags(self, index: int) -> tuple[bool, bool]:
        """(shared, yield) of device ``index``."""
        value = int(self._control().flags[_index(index)])
        return bool(value & DEV_SHARED), bool(value & DEV_YIELD)

    def tat_floor_ns(self, index: int) -> int:
        return int(self._control().tat_floor_ns[_index(index)])

    def set_flags(self, index: int, *, shared: bool, yield_: bool) -> None:
        """Device ``index``'s flags in one 32-bit store (only when they change)."""
        value = (DEV_SHARED if shared else 0) | (DEV_YIELD if yield_ else 0)
        c = self._control()
        if int(c.flags[_index(index)]) != value:
            c.flags[index] = value

    def raise_floor(self, index: int, tat_ns: int) -> None:
        """Raise device ``index``'s clock floor to ``tat_ns``; never lowers it."""
        c = self._control()
        if tat_ns > int(c.tat_floor_ns[_index(index)]):
            c.tat_floor_ns[index] = tat_ns

    def heartbeat(self) -> int:
        """Stamp the heartbeat with ``time.monotonic_ns()`` (``CLOCK_MONOTONIC``)."""
        now = time.monotonic_ns()
        self._control().heartbeat_ns = now
        return now

    def _control(self) -> Any:
        if self._mmap is None:
            raise ControlError(f"{self.path}: closed")
        return self._c


def _index(index: int) -> int:
    if not 0 <= index < MAX_DEVICES:
        raise ValueError(f"device index {index} out of range 0..{MAX_DEVICES - 1}")
    return index


def _open(path: str, flags: int, dir_fd: int | None) -> int:
    """A descriptor of a valid control file (regular, full size, this layout)."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as e:
        raise ControlError(f"{path}: cannot open: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ControlError(f"{path}: not a regular file")
        if st.st_size != CONTROL_SIZE:
            raise ControlError(f"{path}: {st.st_size} bytes, expected {CONTROL_SIZE}")
        head = os.pread(fd, 8, 0)
        magic, version = int.from_bytes(head[:4], "little"), int.from_bytes(head[4:], "little")
        if (magic, version) != (MAGIC, VERSION):
            raise ControlError(f"{path}: magic {magic:#x} version {version}, not a control file")
    except BaseException:
        os.close(fd)
        raise
    return fd
