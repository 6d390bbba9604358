"""What kubelet puts into a GPU container: the grant, the interposer's environment
and the mounts.

The container's limits are its grant (:mod:`gpuslice_common.grant`), written by
the agent into the container's host directory; that directory is mounted
read-only at ``GRANT_DIR`` and its ``region`` file read-write over it, so the
container can change neither. The interposer reads the grant, whatever the
environment says. The environment still carries HAMi's variables
(``NVIDIA_VISIBLE_DEVICES`` by UUID, ``CUDA_DEVICE_MEMORY_LIMIT_<i>``,
``CUDA_DEVICE_SM_LIMIT`` or ``_<i>``) for tools that read them, and what the
grant does not: who reports telemetry and where to, with the container's own
telemetry token when the inventory issued one (none where no auth callout
runs). The mounts also bring in
the library and ``/etc/ld.so.preload`` (left out when the container asks
``CUDA_DISABLE_CONTROL=true``, which its grant then allows).

On an MPS node (:func:`by_mps`) the interposer stays, as the memory limit no
tenant can move, but MPS partitions the cores: the grant gives no core limit,
HAMi's limit variables are left out, and the container gets MPS's client
variables and the daemon's directories (:mod:`gpuslice_deviceplugin.mps`).

Where the node's driver limits device memory per cgroup on every card of the
container (:mod:`gpuslice_deviceplugin.driverlimits`) and the container has the
same grant on each, the environment also carries the grant as the hard limit
nvidia-container-toolkit's ``apply-cuda-memory-limits`` CDI hook sets on the
container's cgroup before its first process runs, where the runtime has that
hook; the node agent sets and checks the limit itself either way.

A grant on a MIG card stands for the MIG instance made for it
(:func:`on_mig`): the container is given the instance's MIG device by UUID,
with all of the instance's memory and no SM limit, since MIG divides the card
in hardware; a container with nothing but MIG instances runs without the
interposer's preload.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import PurePosixPath
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from gpuslice_common.config import DevicePluginSettings
from gpuslice_common.grant import GRANT_DIR, Grant, GrantDevice
from gpuslice_common.models import DeviceGrant, VgpuMode
from gpuslice_common.nodeapi import AllocationReply
from gpuslice_deviceplugin import driverlimits, mps
from gpuslice_deviceplugin.api import deviceplugin_pb2 as pb
from gpuslice_deviceplugin.containers import REGION_FILE, HostDir
from gpuslice_deviceplugin.mig import LiveInstance
from gpuslice_deviceplugin.nodeconfig import NodeConfig

LIBRARY = "libgpuslice.so"
PRELOAD_PATH = "/etc/ld.so.preload"
DISABLE_CONTROL = "CUDA_DISABLE_CONTROL"
# what the interposer counts per CUDA context where the node configuration sets none
DEFAULT_CONTEXT_OVERHEAD_MIB = 384
MIB = 1 << 20


def by_mps(config: NodeConfig) -> bool:
    """Whether MPS partitions this node's cores (else the interposer throttles them)."""
    return config.mode is VgpuMode.MPS


def on_mig(allocation: AllocationReply, made: Mapping[str, LiveInstance]) -> AllocationReply:
    """``allocation`` with each card in ``made`` replaced by its MIG instance's device."""
    if not made:
        return allocation
    placement = allocation.placement
    index = allocation.container_index
    container = placement.containers[index]
    devices = tuple(
        DeviceGrant(uuid=made[g.uuid].uuid or g.uuid, memory_mib=made[g.uuid].memory_mib, cores=0)
        if g.uuid in made
        else g
        for g in container.devices
    )
    containers = list(placement.containers)
    containers[index] = container.model_copy(update={"devices": devices})
    return allocation.model_copy(
        update={"placement": placement.model_copy(update={"containers": tuple(containers)})}
    )


def grant(
    allocation: AllocationReply,
    settings: DevicePluginSettings,
    config: NodeConfig,
    *,
    control: bool,
) -> Grant:
    """The container's grant; ``control=False`` lets it turn the interposer off."""
    placement = allocation.placement
    container = placement.containers[allocation.container_index]
    overhead = config.context_overhead_mib
    # Under MPS the interposer throttling launches too would cut a share twice; 0 is no limit.
    throttled = not by_mps(config)
    return Grant(
        node=settings.node_name,
        pod_uid=placement.pod.uid,
        container=container.name,
        policy=config.core_policy,
        priority=container.priority,
        control_optional=not control,
        context_overhead_bytes=(DEFAULT_CONTEXT_OVERHEAD_MIB if overhead is None else overhead)
        * MIB,
        devices=tuple(
            GrantDevice(
                uuid=g.uuid, memory_bytes=g.memory_mib * MIB, sm_percent=g.cores if throttled else 0
            )
            for g in container.devices
        ),
    )


def environment(
    allocation: AllocationReply,
    settings: DevicePluginSettings,
    config: NodeConfig,
) -> dict[str, str]:
    placement = allocation.placement
    container = placement.containers[allocation.container_index]
    grants = container.devices
    env = {"NVIDIA_VISIBLE_DEVICES": ",".join(g.uuid for g in grants)}
    if by_mps(config):
        env.update(mps.environment(grants))
    else:
        env.update(hami_limits(grants))
    env.update(
        {
            "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(PurePosixPath(GRANT_DIR) / REGION_FILE),
            "CUDA_TASK_PRIORITY": str(container.priority),
            "GPU_CORE_UTILIZATION_POLICY": config.core_policy,
            "LIBCUDA_LOG_LEVEL": str(config.log_level),
            "GPUSLICE_NODE_NAME": settings.node_name,
            "GPUSLICE_POD_UID": placement.pod.uid,
            "GPUSLICE_POD_NAMESPACE": placement.pod.namespace,
            "GPUSLICE_POD_NAME": placement.pod.name,
            "GPUSLICE_CONTAINER_NAME": container.name,
            "GPUSLICE_NATS_URL": settings.telemetry_nats_url
            or without_credentials(settings.nats_url),
            "GPUSLICE_SUBJECT_PREFIX": settings.subject_prefix,
        }
    )
    if config.context_overhead_mib is not None:
        env["GPUSLICE_CONTEXT_OVERHEAD"] = f"{config.context_overhead_mib}m"
    if allocation.telemetry_token:  # the container's own credential, from the inventory
        env["GPUSLICE_NATS_TOKEN"] = allocation.telemetry_token
    return env


def hami_limits(grants: Sequence[DeviceGrant]) -> dict[str, str]:
    """HAMi's limit variables, in the container's card order, for tools that read them."""
    env = {}
    for i, device in enumerate(grants):
        if device.memory_mib > 0:
            env[f"CUDA_DEVICE_MEMORY_LIMIT_{i}"] = f"{device.memory_mib}m"
    cores = {g.cores for g in grants}
    if len(cores) == 1:
        env["CUDA_DEVICE_SM_LIMIT"] = str(cores.pop())
    else:
        env.update({f"CUDA_DEVICE_SM_LIMIT_{i}": str(g.cores) for i, g in enumerate(grants)})
    return env


def without_credentials(urls: str) -> str:
    """The agent's NATS URLs with any user and password taken out: those are the
    agent's own, and containers get only the telemetry credential."""
    out = []
    for url in urls.split(","):
        parts = urlsplit(url.strip())
        host = parts.netloc.rpartition("@")[2]
        out.append(urlunsplit(parts._replace(netloc=host)))
    return ",".join(out)


def answer(
    allocation: AllocationReply,
    settings: DevicePluginSettings,
    config: NodeConfig,
    host: HostDir,
    *,
    control: bool = True,
    driver_support: Mapping[str, driverlimits.CardSupport] | None = None,
) -> pb.ContainerAllocateResponse:
    """The response for one container; ``control=False`` leaves the preload out;
    ``driver_support`` (card UUID -> whether the driver limits memory per cgroup)
    adds the toolkit hook's limit where every card of the container has it."""
    placement = allocation.placement
    container = placement.containers[allocation.container_index]
    region_dir = host.container_dir(placement.pod.uid, container.name)
    lib_dir = PurePosixPath(settings.container_lib_dir)
    mounts = [
        pb.Mount(
            container_path=str(lib_dir / LIBRARY), host_path=str(host.lib_path), read_only=True
        )
    ]
    if control:
        mounts.append(
            pb.Mount(container_path=PRELOAD_PATH, host_path=str(host.preload_path), read_only=True)
        )
    # The runtime mounts the shallower path first, so the region lands over the
    # read-only directory: writable, but a mount point no one inside can replace.
    mounts += [
        pb.Mount(container_path=GRANT_DIR, host_path=str(region_dir), read_only=True),
        pb.Mount(
            container_path=str(PurePosixPath(GRANT_DIR) / REGION_FILE),
            host_path=str(region_dir / REGION_FILE),
            read_only=False,
        ),
    ]
    if by_mps(config):
        mounts += mps.mounts(config.mps)
    envs = environment(allocation, settings, config)
    if driver_support:
        # a MIG instance's UUID is no card's: the hardware holds it, no limit is given
        grants = {g.uuid: g.memory_mib * MIB for g in container.devices if g.memory_mib > 0}
        if len(grants) == len(container.devices):
            envs.update(driverlimits.hook_environment(grants, driver_support))
    return pb.ContainerAllocateResponse(envs=envs, mounts=mounts)


def control_wanted(pod: Mapping[str, Any], container: str) -> bool:
    """False when the pod's container sets ``CUDA_DISABLE_CONTROL=true`` itself."""
    spec = pod.get("spec")
    if not isinstance(spec, Mapping):
        return True
    for field in ("initContainers", "containers"):
        for entry in spec.get(field) or ():
            if not isinstance(entry, Mapping) or entry.get("name") != container:
                continue
            for var in entry.get("env") or ():
                if (
                    isinstance(var, Mapping)
                    and var.get("name") == DISABLE_CONTROL
                    and str(var.get("value", "")).strip().lower() in ("true", "1", "yes")
                ):
                    return False
    return True
