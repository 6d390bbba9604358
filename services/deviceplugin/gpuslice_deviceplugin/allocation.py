"""What kubelet puts into a GPU container: the interposer's environment and mounts.

The variables are the interposer's (HAMi's names where HAMi has one):
``NVIDIA_VISIBLE_DEVICES`` lists the container's GPUs by UUID, in the order the
per-device limits ``CUDA_DEVICE_MEMORY_LIMIT_<i>`` and ``CUDA_DEVICE_SM_LIMIT``
(or ``_<i>`` where they differ) follow. The mounts bring in the library,
``/etc/ld.so.preload`` (left out when the container asks
``CUDA_DISABLE_CONTROL=true``) and the container's own directory for its shared
region.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import PurePosixPath
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from gpuslice_common.config import DevicePluginSettings
from gpuslice_common.ledger import Allocation
from gpuslice_deviceplugin.api import deviceplugin_pb2 as pb
from gpuslice_deviceplugin.containers import REGION_FILE, HostDir
from gpuslice_deviceplugin.nodeconfig import NodeConfig

LIBRARY = "libgpuslice.so"
PRELOAD_PATH = "/etc/ld.so.preload"
DISABLE_CONTROL = "CUDA_DISABLE_CONTROL"


def environment(
    allocation: Allocation,
    settings: DevicePluginSettings,
    config: NodeConfig,
) -> dict[str, str]:
    placement = allocation.placement
    container = placement.containers[allocation.container_index]
    grants = container.devices
    env = {"NVIDIA_VISIBLE_DEVICES": ",".join(g.uuid for g in grants)}
    for i, grant in enumerate(grants):
        if grant.memory_mib > 0:
            env[f"CUDA_DEVICE_MEMORY_LIMIT_{i}"] = f"{grant.memory_mib}m"
    cores = {g.cores for g in grants}
    if len(cores) == 1:
        env["CUDA_DEVICE_SM_LIMIT"] = str(cores.pop())
    else:
        env.update({f"CUDA_DEVICE_SM_LIMIT_{i}": str(g.cores) for i, g in enumerate(grants)})
    region = PurePosixPath(settings.container_region_dir) / REGION_FILE
    env.update(
        {
            "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(region),
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
    credentials = {
        "GPUSLICE_NATS_USER": settings.telemetry_nats_user,
        "GPUSLICE_NATS_PASSWORD": settings.telemetry_nats_password,
        "GPUSLICE_NATS_TOKEN": settings.telemetry_nats_token,
    }
    env.update({k: v for k, v in credentials.items() if v})
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
    allocation: Allocation,
    settings: DevicePluginSettings,
    config: NodeConfig,
    host: HostDir,
    *,
    control: bool = True,
) -> pb.ContainerAllocateResponse:
    """The response for one container; ``control=False`` leaves the preload out."""
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
    mounts.append(
        pb.Mount(
            container_path=settings.container_region_dir,
            host_path=str(region_dir),
            read_only=False,
        )
    )
    return pb.ContainerAllocateResponse(
        envs=environment(allocation, settings, config), mounts=mounts
    )


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
