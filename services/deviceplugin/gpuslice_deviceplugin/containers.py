"""The node agent's host directory: the interposer, ``ld.so.preload`` and one
directory per GPU container.

Layout under ``root`` (``DevicePluginSettings.host_dir``)::

    lib/libgpuslice.so                      the interposer, bind-mounted read-only
    ld.so.preload                           names it inside the container
    containers/                             0700: nothing but root on the host reaches in
        <pod uid>/<container>/              0755, mounted read-only at /run/gpuslice
            owner.json                      who the directory belongs to
            grant                           0444, the container's limits (gpuslice_common.grant)
            control                         0444, compute flags (gpuslice_common.control)
            region                          0666, the shared region, bind-mounted read-write

Everything in a container directory is written by the agent, at Allocate. The
container sees the directory read-only and only ``region`` writable, as a mount
point it can neither rename nor replace: no process in it can add, swap or link
a file the agent later opens. The region is mode 0666 because the container's
processes may run as any user, which the agent cannot know at Allocate (kubelet
names no pod and the image may choose its user); the 0700 ``containers``
directory keeps every other user of the host out.

The agent still opens what it reads there without following links (a
directory left from an older, container-writable layout may hold anything).
Files it writes are replaced atomically (a temporary file in the same
directory, then a rename): a reader sees the old file or the new one, and a
container that has the old library bind-mounted keeps the old inode.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import shutil
import stat
import tempfile
import threading
import time
from collections.abc import Collection, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Final

from gpuslice_common import grant as grant_format
from gpuslice_common.control import CONTROL_FILE, Control
from gpuslice_common.grant import Grant
from gpuslice_common.region import Region

__all__ = [
    "GRANT_FILE",
    "LIBRARY",
    "OWNER_FILE",
    "REGION_FILE",
    "ContainerOwner",
    "HostDir",
    "InstallError",
    "OwnerError",
    "check_container_name",
    "check_pod_uid",
]

log = logging.getLogger(__name__)

LIBRARY: Final = "libgpuslice.so"
REGION_FILE: Final = "region"
OWNER_FILE: Final = "owner.json"
GRANT_FILE: Final = grant_format.GRANT_FILE

_POD_UID: Final = re.compile(r"[A-Za-z0-9-]{1,128}")
_CONTAINER: Final = re.compile(r"[a-z0-9](?:[-a-z0-9]{0,61}[a-z0-9])?")

DIR_MODE: Final = 0o755
CONTAINERS_MODE: Final = 0o700
CONTAINER_DIR_MODE: Final = 0o755
LIBRARY_MODE: Final = 0o755
FILE_MODE: Final = 0o644
GRANT_MODE: Final = 0o444
REGION_MODE: Final = 0o666
OWNER_MAX_BYTES: Final = 64 * 1024


class OwnerError(ValueError):
    """An owner record that is not valid JSON or lacks a field of the right type."""


class InstallError(Exception):
    """The interposer could not be installed into the host directory."""


def check_pod_uid(pod_uid: str) -> str:
    """``pod_uid`` if it is a safe path component (``[A-Za-z0-9-]{1,128}``), else ValueError."""
    if not isinstance(pod_uid, str) or not _POD_UID.fullmatch(pod_uid):
        raise ValueError(f"pod UID {pod_uid!r} is not 1 to 128 letters, digits or '-'")
    return pod_uid


def check_container_name(name: str) -> str:
    """``name`` if it is an RFC 1123 label (what Kubernetes allows), else ValueError."""
    if not isinstance(name, str) or not _CONTAINER.fullmatch(name):
        raise ValueError(f"container name {name!r} is not an RFC 1123 label of at most 63")
    return name


@dataclass(frozen=True)
class ContainerOwner:
    """The pod container a container directory was prepared for."""

    pod_uid: str
    namespace: str
    pod_name: str
    container: str
    devices: tuple[str, ...]  # GPU UUIDs in the container's order
    allocated_at: float  # epoch seconds

    def __post_init__(self) -> None:
        check_pod_uid(self.pod_uid)
        check_container_name(self.container)
        for name in ("namespace", "pod_name"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a string")
        if not isinstance(self.devices, tuple) or not all(
            isinstance(d, str) and d for d in self.devices
        ):
            raise ValueError(f"devices must be a tuple of GPU UUIDs, not {self.devices!r}")
        at = self.allocated_at
        if isinstance(at, bool) or not isinstance(at, int | float) or not math.isfinite(at):
            raise ValueError(f"allocated_at must be a finite number, not {at!r}")

    def to_json(self) -> str:
        """One JSON object; :meth:`from_json` reads it back."""
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> ContainerOwner:
        """Parse :meth:`to_json`'s output; :class:`OwnerError` says what is wrong."""
        try:
            data: Any = json.loads(text)
        except ValueError as e:
            raise OwnerError(f"owner record is not JSON: {e}") from None
        if not isinstance(data, dict):
            raise OwnerError("owner record is not a JSON object")
        fields = ("pod_uid", "namespace", "pod_name", "container", "devices", "allocated_at")
        missing = [f for f in fields if f not in data]
        if missing:
            raise OwnerError(f"owner record lacks {', '.join(missing)}")
        devices = data["devices"]
        if not isinstance(devices, list):
            raise OwnerError("owner record: devices must be a list")
        try:
            return cls(
                pod_uid=data["pod_uid"],
                namespace=data["namespace"],
                pod_name=data["pod_name"],
                container=data["container"],
                devices=tuple(devices),
                allocated_at=data["allocated_at"],
            )
        except ValueError as e:
            raise OwnerError(f"owner record: {e}") from None


class HostDir:
    """The agent's host directory (see the module's docstring for the layout)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._warned: dict[Path, str] = {}  # owner file -> the last warning about it
        self._warned_lock = threading.Lock()  # the coordinator and clean-up run in threads

    @property
    def lib_path(self) -> Path:
        return self.root / "lib" / LIBRARY

    @property
    def preload_path(self) -> Path:
        return self.root / "ld.so.preload"

    @property
    def containers_root(self) -> Path:
        return self.root / "containers"

    def container_dir(self, pod_uid: str, container: str) -> Path:
        """Where a container's region lives; ValueError for an unsafe pod UID or name."""
        return self.containers_root / check_pod_uid(pod_uid) / check_container_name(container)

    # ------------------------------------------------------------ containers

    def prepare_container(self, owner: ContainerOwner, grant: Grant) -> Path:
        """Create the container's directory with its owner record, its grant and its
        region (kept if a valid one is there: a running container maps it); its path."""
        directory = self.container_dir(owner.pod_uid, owner.container)
        _make_dir(self.containers_root, CONTAINERS_MODE)
        _make_dir(directory.parent, DIR_MODE)
        _make_dir(directory, CONTAINER_DIR_MODE)
        # not synced: Allocate waits for this, and what a crash loses is written
        # again by the next Allocate (the containers are gone with the node anyway)
        write_atomic(
            directory / OWNER_FILE, owner.to_json().encode() + b"\n", FILE_MODE, durable=False
        )
        write_atomic(directory / GRANT_FILE, grant.render().encode(), GRANT_MODE, durable=False)
        devices = [(d.uuid, d.memory_bytes, d.sm_percent) for d in grant.devices]
        with self.open_container_dir(directory) as dir_fd:
            Region.create(dir_fd, REGION_FILE, devices, mode=REGION_MODE)
            Control.create(dir_fd, CONTROL_FILE)
        return directory

    @contextlib.contextmanager
    def open_container_dir(self, directory: Path) -> Iterator[int]:
        """A descriptor of a container directory under :attr:`containers_root`, every
        component opened without following a link (OSError otherwise)."""
        relative = directory.relative_to(self.containers_root).parts
        fd = os.open(
            self.containers_root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
        )
        try:
            for part in relative:
                child = os.open(
                    part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd
                )
                os.close(fd)
                fd = child
            yield fd
        finally:
            os.close(fd)

    def containers(self) -> list[tuple[ContainerOwner, Path]]:
        """Every prepared container directory with its owner, sorted by path.

        A directory whose owner record is missing (still being prepared) is left out
        quietly; one whose record is unreadable, corrupt or names another directory
        is left out with a warning (once, until the record changes or is fixed).
        Never raises for the directory's contents.
        """
        found: list[tuple[ContainerOwner, Path]] = []
        for pod_dir in self._pod_dirs():
            for directory in _subdirs(pod_dir):
                owner = self._owner(directory)
                if owner is not None:
                    found.append((owner, directory))
        return found

    def remove_pod(self, pod_uid: str) -> None:
        """Delete every container directory of a pod; nothing if there is none."""
        pod_dir = self.containers_root / check_pod_uid(pod_uid)
        with self._warned_lock:
            for path in [p for p in self._warned if p.parent.parent == pod_dir]:
                del self._warned[path]
        if pod_dir.is_symlink():
            pod_dir.unlink()
            return
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(pod_dir)

    def cleanup(
        self, live_pod_uids: Collection[str], grace_s: float, now: float | None = None
    ) -> list[str]:
        """Remove the directories of pods not in ``live_pod_uids`` prepared more than
        ``grace_s`` seconds before ``now`` (default: the current time); the pod UIDs removed.

        A pod's age is that of its newest container: the owner record's
        ``allocated_at``, or the directory's mtime where there is no readable record.
        Failures are logged, not raised.
        """
        at = time.time() if now is None else now
        removed: list[str] = []
        for pod_dir in self._pod_dirs():
            uid = pod_dir.name
            if uid in live_pod_uids or at - self._pod_stamp(pod_dir) < grace_s:
                continue
            try:
                self.remove_pod(uid)
            except OSError as e:
                log.warning("cannot remove %s: %s", pod_dir, e)
                continue
            removed.append(uid)
        return removed

    def _pod_dirs(self) -> list[Path]:
        return [d for d in _subdirs(self.containers_root) if _POD_UID.fullmatch(d.name)]

    def _owner(self, directory: Path) -> ContainerOwner | None:
        path = directory / OWNER_FILE
        try:
            owner = ContainerOwner.from_json(_read_regular(path, OWNER_MAX_BYTES))
        except FileNotFoundError:
            log.debug("%s: no owner record yet", directory)
            return None
        except (OSError, OwnerError) as e:
            self._warn_once(path, f"skipping {path}: {e}")
            return None
        if (owner.pod_uid, owner.container) != (directory.parent.name, directory.name):
            self._warn_once(
                path, f"skipping {path}: it names pod {owner.pod_uid} container {owner.container}"
            )
            return None
        with self._warned_lock:
            self._warned.pop(path, None)
        return owner

    def _warn_once(self, path: Path, message: str) -> None:
        """Log ``message`` unless it was the last one logged about ``path``."""
        with self._warned_lock:
            if self._warned.get(path) == message:
                return
            self._warned[path] = message
        log.warning("%s", message)

    def _pod_stamp(self, pod_dir: Path) -> float:
        stamps: list[float] = []
        for directory in _subdirs(pod_dir):
            owner = self._owner(directory)
            stamps.append(owner.allocated_at if owner else _mtime(directory))
        return max(stamps) if stamps else _mtime(pod_dir)

    # ------------------------------------------------------------ the interposer

    def install(self, library: Path, container_lib_dir: str) -> None:
        """Install ``library`` as :attr:`lib_path` and write :attr:`preload_path` naming it
        as containers see it, ``<container_lib_dir>/libgpuslice.so``.

        Identical content is left in place (same inode); otherwise the file is
        replaced atomically, so running containers keep the library they mapped.
        Raises :class:`InstallError` when the library is missing or cannot be copied.
        """
        in_container = PurePosixPath(container_lib_dir) / LIBRARY
        if not in_container.is_absolute() or re.search(r"[\s:]", str(in_container)):
            raise InstallError(
                f"container library directory {container_lib_dir!r} must be an absolute path "
                "without spaces or colons (ld.so.preload separates entries with them)"
            )
        try:
            if not Path(library).is_file():
                raise InstallError(f"interposer library {library} does not exist")
            content = Path(library).read_bytes()
            _make_dir(self.lib_path.parent, DIR_MODE)
            _install_file(self.lib_path, content, LIBRARY_MODE)
            _install_file(self.preload_path, f"{in_container}\n".encode(), FILE_MODE)
        except OSError as e:
            raise InstallError(f"cannot install {library} into {self.root}: {e}") from e
        log.info("interposer %s installed as %s", library, self.lib_path)


def _subdirs(directory: Path) -> list[Path]:
    """Real subdirectories (no symlinks), sorted; none when ``directory`` is unreadable."""
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return []
    except OSError as e:
        log.warning("cannot list %s: %s", directory, e)
        return []
    return sorted(Path(e.path) for e in entries if e.is_dir(follow_symlinks=False))


def _read_regular(path: Path, limit: int) -> bytes:
    """A regular file's content, at most ``limit`` bytes; never follows a symlink or
    waits on a FIFO a container may have put in its place."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"{path} is not a regular file")
        if st.st_size > limit:
            raise OSError(f"{path} is {st.st_size} bytes, more than {limit}")
        return os.pread(fd, limit, 0)
    finally:
        os.close(fd)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _make_dir(path: Path, mode: int) -> None:
    """``mkdir -p``, then the mode set explicitly (the umask does not apply)."""
    path.mkdir(parents=True, exist_ok=True)
    if not path.is_dir() or path.is_symlink():
        raise NotADirectoryError(f"{path} is not a directory")
    if stat.S_IMODE(path.stat().st_mode) != mode:
        path.chmod(mode)


def _install_file(path: Path, content: bytes, mode: int) -> None:
    """Write ``content`` unless ``path`` already holds it; the mode either way."""
    try:
        same = path.read_bytes() == content and not path.is_symlink()
    except FileNotFoundError:
        same = False
    if not same:
        write_atomic(path, content, mode)
    elif stat.S_IMODE(path.stat().st_mode) != mode:
        path.chmod(mode)


def write_atomic(path: Path, content: bytes, mode: int, *, durable: bool = True) -> None:
    """Replace ``path`` by a file holding ``content``, made in full beside it first;
    ``durable`` also syncs the file and its directory to disk."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(content)
            f.flush()
            os.fchmod(f.fileno(), mode)
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if not durable:
        return
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
