"""Static MIG: instances someone else made, advertised as NVIDIA's ``mixed`` strategy does.

On a ``hami-core`` node with ``migStrategy: mixed`` a card in MIG mode is not
shared; each MIG device on it is a device of the resource
``nvidia.com/mig-<profile>`` (the domain of the node's GPU resource name), so a
pod asking for ``nvidia.com/mig-3g.20gb: 1`` gets one whole instance. Each
resource name has its own socket (``gpuslice-mig-<profile>.sock``) and kubelet
registration; ListAndWatch lists the MIG devices' UUIDs. Allocate needs no
ledger: kubelet chose the instances, and the container is given them by UUID
(``NVIDIA_VISIBLE_DEVICES``), without the interposer, since MIG divides the card
in hardware. A profile whose instances all went stays registered with no
devices.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import grpc

from gpuslice_common.models import GpuDevice, VgpuMode
from gpuslice_deviceplugin.api import deviceplugin_pb2 as pb
from gpuslice_deviceplugin.api import deviceplugin_pb2_grpc as pb_grpc
from gpuslice_deviceplugin.kubelet import KubeletLink, LinkTiming
from gpuslice_deviceplugin.metrics import PluginMetrics

log = logging.getLogger(__name__)

HEALTHY = "Healthy"
MAX_IDS = 64  # device IDs one container request may name


def static_devices(devices: Sequence[GpuDevice]) -> dict[str, list[pb.Device]]:
    """Profile -> its MIG devices on the cards shared statically, in card order."""
    out: dict[str, list[pb.Device]] = {}
    for card in devices:
        if not card.mig or card.mode is not VgpuMode.HAMI_CORE:
            continue
        topology = (
            pb.TopologyInfo(nodes=[pb.NUMANode(ID=card.numa)]) if card.numa is not None else None
        )
        for instance in card.mig_instances:
            if instance.uuid.startswith("MIG-"):  # a GPU instance with a MIG device
                out.setdefault(instance.profile, []).append(
                    pb.Device(ID=instance.uuid, health=HEALTHY, topology=topology)
                )
    return out


class MigResourcePlugin(pb_grpc.DevicePluginServicer):
    """The DevicePlugin service of one ``nvidia.com/mig-<profile>`` resource."""

    def __init__(self, resource: str) -> None:
        self.resource = resource
        self._devices: list[pb.Device] = []
        self._version = 0
        self._changed = asyncio.Condition()

    @property
    def ids(self) -> frozenset[str]:
        return frozenset(d.ID for d in self._devices)

    async def update(self, devices: list[pb.Device]) -> None:
        if devices == self._devices:
            return
        async with self._changed:
            self._devices = devices
            self._version += 1
            self._changed.notify_all()

    def _newer_than(self, version: int) -> Callable[[], bool]:
        return lambda: self._version != version

    async def GetDevicePluginOptions(
        self, request: pb.Empty, context: grpc.aio.ServicerContext[pb.Empty, pb.DevicePluginOptions]
    ) -> pb.DevicePluginOptions:
        return pb.DevicePluginOptions()

    async def ListAndWatch(
        self,
        request: pb.Empty,
        context: grpc.aio.ServicerContext[pb.Empty, pb.ListAndWatchResponse],
    ) -> AsyncIterator[pb.ListAndWatchResponse]:
        seen = -1
        while True:
            async with self._changed:
                await self._changed.wait_for(self._newer_than(seen))
                seen = self._version
                devices = list(self._devices)
            log.info("ListAndWatch %s: %d MIG device(s)", self.resource, len(devices))
            yield pb.ListAndWatchResponse(devices=devices)

    async def Allocate(
        self,
        request: pb.AllocateRequest,
        context: grpc.aio.ServicerContext[pb.AllocateRequest, pb.AllocateResponse],
    ) -> pb.AllocateResponse:
        known = self.ids
        out = []
        for wanted in request.container_requests:
            ids = list(wanted.devices_ids)
            if not ids or len(ids) > MAX_IDS or len(set(ids)) != len(ids):
                await _refuse(
                    context,
                    f"{self.resource}: a container request names 1 to {MAX_IDS} distinct devices",
                )
            unknown = [i for i in ids if i not in known]
            if unknown:
                await _refuse(
                    context, f"{self.resource}: unknown device IDs: {', '.join(unknown[:8])}"
                )
            log.info("allocated %s: %s", self.resource, ",".join(ids))
            out.append(pb.ContainerAllocateResponse(envs={"NVIDIA_VISIBLE_DEVICES": ",".join(ids)}))
        return pb.AllocateResponse(container_responses=out)

    async def GetPreferredAllocation(
        self,
        request: pb.PreferredAllocationRequest,
        context: grpc.aio.ServicerContext[
            pb.PreferredAllocationRequest, pb.PreferredAllocationResponse
        ],
    ) -> pb.PreferredAllocationResponse:
        await _refuse(
            context, "GetPreferredAllocation is not offered", grpc.StatusCode.UNIMPLEMENTED
        )

    async def PreStartContainer(
        self,
        request: pb.PreStartContainerRequest,
        context: grpc.aio.ServicerContext[
            pb.PreStartContainerRequest, pb.PreStartContainerResponse
        ],
    ) -> pb.PreStartContainerResponse:
        return pb.PreStartContainerResponse()


async def _refuse(
    context: grpc.aio.ServicerContext[Any, Any],
    message: str,
    code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT,
) -> NoReturn:
    await context.abort(code, message)
    raise AssertionError("unreachable: abort raises")


class StaticMig:
    """One plugin and kubelet link per MIG profile found on static cards."""

    def __init__(
        self,
        kubelet_dir: Path,
        gpu_resource: str,
        metrics: PluginMetrics,
        timing: LinkTiming | None = None,
    ) -> None:
        self.kubelet_dir = kubelet_dir
        self.domain = gpu_resource.partition("/")[0] if "/" in gpu_resource else "nvidia.com"
        self.metrics = metrics
        self.timing = timing
        self.plugins: dict[str, MigResourcePlugin] = {}
        self.links: dict[str, KubeletLink] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def resource(self, profile: str) -> str:
        return f"{self.domain}/mig-{profile}"

    async def update(self, devices: Sequence[GpuDevice]) -> None:
        """Advertise the static MIG devices of ``devices``, registering new profiles."""
        found = static_devices(devices)
        for profile in sorted(found.keys() - self.plugins.keys()):
            plugin = MigResourcePlugin(self.resource(profile))
            link = KubeletLink(
                plugin,
                self.kubelet_dir,
                f"gpuslice-mig-{profile}.sock",
                plugin.resource,
                self.metrics,
                self.timing,
            )
            self.plugins[profile], self.links[profile] = plugin, link
            self._tasks[profile] = asyncio.create_task(link.run(), name=f"kubelet-link-{profile}")
            log.info("static MIG devices of profile %s advertised as %s", profile, plugin.resource)
        for profile, plugin in self.plugins.items():
            await plugin.update(found.get(profile, []))

    def failed(self) -> BaseException | None:
        """The error of a link that gave up, if one did."""
        for task in self._tasks.values():
            if task.done() and not task.cancelled() and task.exception() is not None:
                return task.exception()
        return None

    async def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        for task in self._tasks.values():
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()
