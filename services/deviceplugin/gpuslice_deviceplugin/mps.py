"""Sharing a node's cards through NVIDIA's MPS control daemon (``operatingMode: mps``).

The operator runs the daemon; this module gives each container on the node
what an MPS client needs, and watches that the daemon's pipe directory is there.

A container gets:

* ``CUDA_MPS_PIPE_DIRECTORY`` and the daemon's pipe directory mounted there,
  read-only unless the node configuration says otherwise. The path inside is
  MPS's own default, so a process that drops the variable still finds the daemon.
* the daemon's shared memory directory at ``/dev/shm``: MPS clients and their
  server talk through it.
* not the daemon's log directory (``CUDA_MPS_LOG_DIRECTORY``): the daemon and
  its servers write there, not clients, and its logs name every tenant's processes.
* ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``: its core share. MPS takes one figure
  for all of a client's devices, so a container with several cards gets the
  smallest share it was granted. A share of 0 (HAMi's "no core limit": the
  scheduler books no cores for it) sets nothing, and the container runs up to
  the daemon's default, as HAMi lets such a container run unthrottled.
* ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``: ``<ordinal>=<MiB>M`` for each card with
  a memory grant, numbered as the container sees its cards (the order of
  ``NVIDIA_VISIBLE_DEVICES``, as the interposer's ``CUDA_DEVICE_MEMORY_LIMIT_<i>``).

These variables are the tenant's to change: MPS holds a client to the lower of
its own figure and the control daemon's default, so a container can raise its
figures up to the daemon's defaults, which are the same for every container.
The limits a container cannot move are the daemon's defaults and the
interposer's memory limit from its grant (see :mod:`gpuslice_deviceplugin.allocation`).
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Sequence

from gpuslice_common.models import DeviceGrant
from gpuslice_deviceplugin.api import deviceplugin_pb2 as pb
from gpuslice_deviceplugin.nodeconfig import MpsDaemon

log = logging.getLogger(__name__)

CONTAINER_PIPE_DIRECTORY = "/tmp/nvidia-mps"  # MPS's default CUDA_MPS_PIPE_DIRECTORY
CONTAINER_SHM_DIRECTORY = "/dev/shm"


def environment(grants: Sequence[DeviceGrant]) -> dict[str, str]:
    """The MPS client variables of a container granted ``grants``, in its card order."""
    env = {"CUDA_MPS_PIPE_DIRECTORY": CONTAINER_PIPE_DIRECTORY}
    shares = [g.cores for g in grants if g.cores > 0]
    if shares:
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(min(shares))
    limits = [f"{i}={g.memory_mib}M" for i, g in enumerate(grants) if g.memory_mib > 0]
    if limits:
        env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = ",".join(limits)
    return env


def mounts(daemon: MpsDaemon) -> list[pb.Mount]:
    """The daemon's pipe and shared memory directories, where its clients look for them."""
    return [
        pb.Mount(
            container_path=CONTAINER_PIPE_DIRECTORY,
            host_path=daemon.pipe_directory,
            read_only=not daemon.writable_pipe,
        ),
        pb.Mount(
            container_path=CONTAINER_SHM_DIRECTORY,
            host_path=daemon.shm_directory,
            read_only=False,
        ),
    ]


def _not_a_directory(path: str) -> str:
    """Why ``path`` is not a directory the daemon can have made; "" when it is one."""
    try:
        st = os.stat(path)
    except OSError as exc:
        return f"{path} cannot be read ({exc.strerror or exc})"
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a directory"
    return ""


class DaemonCheck:
    """Whether the MPS daemon's directories are there; each change is logged once."""

    def __init__(self) -> None:
        self._last: str | None = None  # the problem last reported; None before the first

    def problem(self, daemon: MpsDaemon) -> str:
        """Why the node's cards cannot be used through MPS now; "" when they can."""
        problems = [
            f"MPS {what} directory {why}"
            for what, path in (("pipe", daemon.pipe_directory), ("shm", daemon.shm_directory))
            if (why := _not_a_directory(path))
        ]
        problem = "; ".join(problems)
        if problem != self._last:
            if problem:
                log.warning("GPUs unhealthy: %s (is the MPS control daemon running?)", problem)
            elif self._last:
                log.info("MPS daemon directory %s is back: GPUs healthy", daemon.pipe_directory)
            self._last = problem
        return problem
