"""A host process as the node agent's enforcer sees it: its pod, its container, its cgroup.

NVML names the processes on a card by host PID and nothing else. Which pod a
PID belongs to is read from the one thing the pod's tenant cannot choose: the
cgroup kubelet and the runtime put the container in (``/proc/<pid>/cgroup``).
kubelet names pod cgroups after the pod's UID, in its systemd form::

    /kubepods.slice/kubepods-burstable.slice/
        kubepods-burstable-pod<uid, '-' written '_'>.slice/cri-containerd-<id>.scope

or its cgroupfs form::

    /kubepods/burstable/pod<uid>/<container id>

(Guaranteed pods have no QoS level; CRI-O and Docker name the container
``crio-<id>.scope`` and ``docker-<id>.scope``.) Only the first ``kubepods``
component counts, and the pod component right below it (or below its QoS
level): a container allowed to make cgroups below its own cannot make its
process look like another pod's. The container's cgroup is the component after
the pod's; freezing it freezes every process of the container.

Which of the pod's containers a process is in is read from its mount
namespace: the agent's container directory is mounted at ``/run/gpuslice`` in
each GPU container, so the device and inode of ``/proc/<pid>/root/run/gpuslice``
name one directory the agent made. The path is walked one component at a time
without following links, so a tenant's symlink cannot point the agent at
another directory. All of it fails with :class:`CgroupError` naming what could
not be read; nothing here guesses.
"""

from __future__ import annotations

import errno
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Final

__all__ = [
    "CgroupError",
    "Freezer",
    "PodCgroup",
    "ProcessInfo",
    "find_cgroup2_root",
    "grant_dir_key",
    "host_path",
    "namespace_root",
    "pod_cgroup",
    "read_process",
]

MAX_PROC_FILE: Final = 64 * 1024
_SYSTEMD_POD: Final = re.compile(
    r"kubepods(?:-(?:besteffort|burstable))?-pod([0-9A-Za-z_]{1,128})\.slice"
)
_CGROUPFS_POD: Final = re.compile(r"pod([0-9A-Za-z-]{1,128})")
_QOS: Final = frozenset({"besteffort", "burstable"})
_SYSTEMD_QOS: Final = frozenset({"kubepods-besteffort.slice", "kubepods-burstable.slice"})


class CgroupError(Exception):
    """A process's cgroup or mount namespace that could not be read or understood."""


@dataclass(frozen=True)
class PodCgroup:
    """Where a pod's container lives in the cgroup tree (paths from the hierarchy's root)."""

    pod_uid: str  # with '-', as the API server writes it
    container: str  # the container's cgroup, e.g. /kubepods.slice/.../cri-containerd-<id>.scope


@dataclass(frozen=True)
class ProcessInfo:
    """What the enforcer needs of a host process."""

    pid: int
    start_ticks: int  # /proc/<pid>/stat field 22: with the pid, names one process
    zombie: bool
    v2_path: str | None  # the "0::" line's path
    freezer_path: str | None  # cgroup v1's freezer hierarchy path


def _read(path: str) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, MAX_PROC_FILE)
    finally:
        os.close(fd)


def read_process(proc_root: str, pid: int) -> ProcessInfo:
    """``pid``'s identity and cgroups; :class:`CgroupError` when unreadable or malformed,
    ProcessLookupError when the process is gone."""
    base = f"{proc_root}/{pid}"
    try:
        stat = _read(f"{base}/stat")
        cgroup = _read(f"{base}/cgroup")
    except FileNotFoundError:
        raise ProcessLookupError(pid) from None
    except OSError as exc:
        raise CgroupError(f"process {pid}: {exc.strerror or exc}") from None
    # the command name may hold spaces and ')': the fields follow the last ')'
    close = stat.rfind(b")")
    fields = stat[close + 2 :].split() if close >= 0 else []
    if len(fields) < 20 or not fields[19].isdigit():
        raise CgroupError(f"process {pid}: /proc/{pid}/stat does not parse")
    v2: str | None = None
    freezer: str | None = None
    for raw in cgroup.split(b"\n"):
        if not raw:
            continue
        parts = raw.split(b":", 2)
        if len(parts) != 3:
            raise CgroupError(f"process {pid}: a /proc/{pid}/cgroup line does not parse")
        try:
            path = parts[2].decode()
        except UnicodeDecodeError:
            raise CgroupError(f"process {pid}: a cgroup path is not UTF-8") from None
        if parts[0] == b"0" and parts[1] == b"":
            v2 = path
        elif b"freezer" in parts[1].split(b","):
            freezer = path
    if v2 is None and freezer is None:
        raise CgroupError(f"process {pid}: no cgroup v2 or freezer line in /proc/{pid}/cgroup")
    # "Z" with threads left is a process whose main thread ended (pthread_exit) while
    # the others run on, holding its memory and contexts: a zombie only when alone
    if not fields[17].isdigit():
        raise CgroupError(f"process {pid}: /proc/{pid}/stat does not parse")
    zombie = fields[0] == b"Z" and int(fields[17]) <= 1
    return ProcessInfo(pid, int(fields[19]), zombie, v2, freezer)


def pod_cgroup(path: str) -> PodCgroup | None:
    """The pod and container cgroup ``path`` lies in; None when it is not below a
    ``kubepods`` cgroup (not a pod's process); :class:`CgroupError` when it is but
    names no pod and container as kubelet does."""
    parts = [p for p in path.split("/") if p]
    if ".." in parts:  # seen from another cgroup namespace: where it is cannot be told
        raise CgroupError(
            f"cgroup {path!r} is relative to the agent's cgroup namespace: the agent must "
            "see the host's cgroup paths"
        )
    start = next((i for i, p in enumerate(parts) if p in ("kubepods.slice", "kubepods")), None)
    if start is None:
        return None
    rest = parts[start + 1 :]
    if parts[start] == "kubepods.slice":
        if rest and rest[0] in _SYSTEMD_QOS:
            rest = rest[1:]
        match = _SYSTEMD_POD.fullmatch(rest[0]) if rest else None
        uid = match.group(1).replace("_", "-") if match else None
    else:
        if rest and rest[0] in _QOS:
            rest = rest[1:]
        match = _CGROUPFS_POD.fullmatch(rest[0]) if rest else None
        uid = match.group(1) if match else None
    if uid is None or len(rest) < 2:
        raise CgroupError(f"cgroup {path!r} is below kubepods but names no pod and container")
    depth = len(parts) - len(rest) + 2
    return PodCgroup(uid, "/" + "/".join(parts[:depth]))


def grant_dir_key(proc_root: str, pid: int, mount_point: str) -> tuple[int, int] | None:
    """(st_dev, st_ino) of ``mount_point`` (e.g. /run/gpuslice) as ``pid`` sees it, each
    component opened without following a link; None when the process has none."""
    flags = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = _open_root(proc_root, pid)
    try:
        for part in (p for p in mount_point.split("/") if p):
            try:
                child = os.open(part, flags, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                    return None
                raise CgroupError(f"process {pid}: {mount_point}: {exc.strerror}") from None
            os.close(fd)
            fd = child
        st = os.fstat(fd)
        return (st.st_dev, st.st_ino)
    finally:
        os.close(fd)


def _open_root(proc_root: str, pid: int) -> int:
    """``pid``'s root directory, opened. A process whose main thread has ended has
    none at ``/proc/<pid>/root``: a thread still running it gives it."""
    how = os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC
    try:
        return os.open(f"{proc_root}/{pid}/root", how)
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise CgroupError(f"process {pid}: its root cannot be opened: {exc.strerror}") from None
    try:
        threads = sorted(int(t) for t in os.listdir(f"{proc_root}/{pid}/task") if t.isdigit())
    except FileNotFoundError:
        raise ProcessLookupError(pid) from None
    except OSError as exc:
        raise CgroupError(f"process {pid}: its threads cannot be listed: {exc.strerror}") from None
    for tid in threads:
        if tid == pid:
            continue
        try:
            return os.open(f"{proc_root}/{pid}/task/{tid}/root", how)
        except FileNotFoundError:
            continue  # that thread ended meanwhile
        except OSError as exc:
            raise CgroupError(
                f"process {pid}: thread {tid}'s root cannot be opened: {exc.strerror}"
            ) from None
    raise ProcessLookupError(pid)


def namespace_root(v2_root: str, proc_root: str = "/proc") -> str:
    """Where this process's cgroup namespace is rooted in the host's v2 tree ("/" in
    the host's namespace).

    On cgroup v2 the runtime gives a container, the agent's own included, a cgroup
    namespace of its own: ``/proc/<pid>/cgroup`` then names every other process's
    cgroup relative to the agent's (``/../../kubepods-...``). The host's tree,
    mounted at ``v2_root``, shows where the agent's cgroup really is: the group
    whose ``cgroup.procs`` lists the agent's PID (a host PID, with hostPID).
    CgroupError when it cannot be found.
    """
    me = read_process(proc_root, os.getpid())
    seen = me.v2_path or "/"
    wanted = str(os.getpid())
    for directory, _, files in os.walk(v2_root):
        if "cgroup.procs" not in files:
            continue
        try:
            with open(os.path.join(directory, "cgroup.procs")) as f:
                if wanted not in f.read().split():
                    continue
        except OSError:
            continue
        actual = "/" + os.path.relpath(directory, v2_root).strip(".").strip("/")
        if seen == "/":
            return actual
        if actual == seen or actual.endswith(seen):
            return actual[: len(actual) - len(seen)] or "/"
        raise CgroupError(f"this process is in {actual} of the host's tree but sees {seen}")
    raise CgroupError(f"this process ({wanted}) is in no cgroup of {v2_root}")


def host_path(ns_root: str, path: str) -> str:
    """``path`` as /proc shows it in a namespace rooted at ``ns_root``, as the host's."""
    if ns_root == "/":
        return path
    joined = os.path.normpath(ns_root.rstrip("/") + "/" + path.lstrip("/"))
    return "/" + joined.lstrip("/")


def find_cgroup2_root(mountinfo: str = "/proc/self/mountinfo") -> str | None:
    """Where the cgroup v2 hierarchy is mounted here, or None."""
    try:
        text = Path(mountinfo).read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        fields = left.split()
        if sep and right.split()[:1] == ["cgroup2"] and len(fields) >= 5:
            return fields[4]
    return None


class Freezer:
    """Freezes and thaws containers' cgroups: cgroup v2's ``cgroup.freeze`` under
    ``v2_root``, else cgroup v1's ``freezer.state`` under ``v1_root``."""

    def __init__(self, v2_root: str | None, v1_root: str | None) -> None:
        self.v2_root = v2_root
        self.v1_root = v1_root

    def target(self, process: ProcessInfo, cgroup: PodCgroup) -> str | None:
        """The file that freezes ``cgroup`` (found from ``process``'s hierarchy), or None."""
        if process.v2_path is not None and self.v2_root and _within(process.v2_path, cgroup):
            path = f"{self.v2_root}{cgroup.container}/cgroup.freeze"
            if os.path.exists(path):
                return path
        if process.freezer_path is not None and self.v1_root:
            found = pod_cgroup(process.freezer_path)
            if found is not None and found.pod_uid == cgroup.pod_uid:
                path = f"{self.v1_root}{found.container}/freezer.state"
                if os.path.exists(path):
                    return path
        return None

    @staticmethod
    def set(target: str, frozen: bool) -> None:
        """Freeze or thaw; OSError when the file cannot be written."""
        if target.endswith("cgroup.freeze"):
            value = b"1" if frozen else b"0"
        else:
            value = b"FROZEN" if frozen else b"THAWED"
        fd = os.open(target, os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.write(fd, value)
        finally:
            os.close(fd)


def _within(path: str, cgroup: PodCgroup) -> bool:
    return path == cgroup.container or path.startswith(cgroup.container + "/")
