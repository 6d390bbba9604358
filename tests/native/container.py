"""A GPU container as kubelet builds it from the device plugin's answer, for the probe.

``Container.prefix()`` is a command that execs the probe in a new mount namespace
(``unshare``) laid out as the runtime lays out a gpuslice container:

* the container's host directory, made by the real ``HostDir.prepare_container``
  (grant 0444, region 0666), mounted read-only at ``/run/gpuslice`` and its
  ``region`` bind-mounted read-write over it (``/run`` is a fresh tmpfs first, so
  the host's ``/run`` is untouched);
* with ``preload``, ``/etc`` overlaid so that ``/etc/ld.so.preload`` names the
  library (the host's ``/etc`` is untouched);
* with ``uid``, the probe runs as that user (needs real root).

As root the namespace is a plain mount namespace; otherwise a user namespace
maps the caller to root inside it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from gpuslice_common.grant import Grant, GrantDevice
from gpuslice_deviceplugin.containers import ContainerOwner, HostDir

MiB = 1 << 20
GiB = 1 << 30

SETUP = r"""
set -eu
dir=$1 work=$2 preload=$3 uid=$4
shift 4
mount -t tmpfs -o mode=0755 tmpfs /run
mkdir /run/gpuslice
mount --bind "$dir" /run/gpuslice
mount -o remount,bind,ro /run/gpuslice
mount --bind "$dir/region" /run/gpuslice/region
if [ -n "$preload" ]; then
    mkdir -p "$work/upper" "$work/work"
    mount -t overlay overlay -o "lowerdir=/etc,upperdir=$work/upper,workdir=$work/work" /etc
    printf '%s\n' "$preload" | tr ':' '\n' > /etc/ld.so.preload
fi
if [ "$uid" != - ]; then
    exec setpriv --reuid="$uid" --regid="$uid" --clear-groups -- "$@"
fi
exec "$@"
"""


def fake_uuid(index: int) -> str:
    """The UUID the fake driver gives device ``index``."""
    return f"GPU-facefeed-0000-4000-8000-0000000000{index:02x}"


def grant(
    memory: int = GiB,
    *,
    devices: Sequence[int] = (0,),
    sm: int = 0,
    control_optional: bool = False,
    overhead: int = 0,
) -> Grant:
    return Grant(
        node="node-1",
        pod_uid="pod-1",
        container="main",
        policy="default",
        priority=0,
        control_optional=control_optional,
        context_overhead_bytes=overhead,
        devices=tuple(
            GrantDevice(uuid=fake_uuid(i), memory_bytes=memory, sm_percent=sm) for i in devices
        ),
    )


@dataclass(frozen=True)
class Container:
    directory: Path  # the host directory the agent made
    work: Path

    @classmethod
    def prepare(cls, root: Path, limits: Grant) -> Container:
        """The container directory as the device plugin makes it at Allocate."""
        owner = ContainerOwner(
            pod_uid=limits.pod_uid,
            namespace="team",
            pod_name="pod",
            container=limits.container,
            devices=tuple(d.uuid for d in limits.devices),
            allocated_at=time.time(),
        )
        directory = HostDir(root / "host").prepare_container(owner, limits)
        work = root / "overlay"
        work.mkdir(exist_ok=True)
        return cls(directory, work)

    @property
    def region(self) -> Path:
        return self.directory / "region"

    def prefix(self, *, preload: Sequence[str | Path] = (), uid: int | None = None) -> list[str]:
        """The launcher's argv; the probe's own argv follows it."""
        if uid is not None and os.geteuid() != 0:
            raise RuntimeError("running a container as another user needs root")
        unshare = ["unshare", "-m"] if os.geteuid() == 0 else ["unshare", "-Urm"]
        return [
            *unshare,
            "--",
            "sh",
            "-c",
            SETUP,
            "container",
            str(self.directory),
            str(self.work),
            ":".join(str(p) for p in preload),
            "-" if uid is None else str(uid),
        ]
