"""The ``v1beta1.DevicePlugin`` service kubelet calls.

Allocate carries no pod identity, only replica IDs; the pod comes from the
ledger: the oldest pod bound to this node whose next unallocated container asks
for that many GPUs, taken atomically. A call that finds none is refused with
``FAILED_PRECONDITION`` and an ``alloc.failed`` event, never answered with a
guess. While the node's ledger is being rebuilt (Redis lost its data), the call
waits for it, up to ``REBUILD_WAIT_S`` or kubelet's deadline.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, NoReturn

import grpc

from gpuslice_common.bus import Bus, BusError
from gpuslice_common.config import DevicePluginSettings
from gpuslice_common.events import AllocationEvent, EventType, make_event
from gpuslice_common.kube import KubeApi, KubeError
from gpuslice_common.ledger import Allocation, Ledger, LedgerError, LedgerRebuilding, NotReserved
from gpuslice_deviceplugin.allocation import answer, control_wanted, grant
from gpuslice_deviceplugin.api import deviceplugin_pb2 as pb
from gpuslice_deviceplugin.api import deviceplugin_pb2_grpc as pb_grpc
from gpuslice_deviceplugin.containers import ContainerOwner, HostDir
from gpuslice_deviceplugin.metrics import PluginMetrics
from gpuslice_deviceplugin.nodeconfig import NodeConfig
from gpuslice_deviceplugin.replicas import Replicas

log = logging.getLogger(__name__)
SOURCE = "gpuslice/deviceplugin"
REBUILD_WAIT_S = 60.0  # Allocate waits this long at most for the node's ledger to be rebuilt
REBUILD_POLL_S = 0.2


class DeviceList:
    """The advertised replicas; every ListAndWatch stream follows their changes."""

    def __init__(self, replicas: Replicas) -> None:
        self._replicas = replicas
        self._version = 0
        self._changed = asyncio.Condition()

    @property
    def replicas(self) -> Replicas:
        return self._replicas

    async def update(self, replicas: Replicas) -> bool:
        """Replace the list; True (and every stream re-sends) if it differs."""
        if replicas == self._replicas:
            return False
        async with self._changed:
            self._replicas = replicas
            self._version += 1
            self._changed.notify_all()
        return True

    async def watch(self) -> AsyncIterator[Replicas]:
        """The current list at once, then each new one."""
        seen = -1
        while True:
            async with self._changed:
                await self._changed.wait_for(self._newer_than(seen))
                seen = self._version
                replicas = self._replicas
            yield replicas

    def _newer_than(self, version: int) -> Callable[[], bool]:
        return lambda: self._version != version


class DevicePlugin(pb_grpc.DevicePluginServicer):
    def __init__(
        self,
        settings: DevicePluginSettings,
        devices: DeviceList,
        config: Callable[[], NodeConfig],
        ledger: Ledger,
        host: HostDir,
        metrics: PluginMetrics,
        *,
        bus: Bus | None = None,
        kube: KubeApi | None = None,
    ) -> None:
        self.settings = settings
        self.devices = devices
        self.config = config
        self.ledger = ledger
        self.host = host
        self.metrics = metrics
        self.bus = bus
        self.kube = kube
        self.watching = 0  # open ListAndWatch streams: kubelet is listening

    @property
    def node(self) -> str:
        return self.settings.node_name

    async def GetDevicePluginOptions(
        self, request: pb.Empty, context: grpc.aio.ServicerContext[pb.Empty, pb.DevicePluginOptions]
    ) -> pb.DevicePluginOptions:
        return pb.DevicePluginOptions(
            pre_start_required=False, get_preferred_allocation_available=True
        )

    async def ListAndWatch(
        self,
        request: pb.Empty,
        context: grpc.aio.ServicerContext[pb.Empty, pb.ListAndWatchResponse],
    ) -> AsyncIterator[pb.ListAndWatchResponse]:
        self.metrics.watchers.inc()
        self.watching += 1
        try:
            async for replicas in self.devices.watch():
                devices = replicas.advertised()
                log.info(
                    "ListAndWatch: %d replicas of %d GPU(s), %d unhealthy",
                    len(devices),
                    len(replicas.devices),
                    sum(d.health != "Healthy" for d in devices),
                )
                yield pb.ListAndWatchResponse(devices=devices)
        finally:
            self.watching -= 1
            self.metrics.watchers.dec()

    async def GetPreferredAllocation(
        self,
        request: pb.PreferredAllocationRequest,
        context: grpc.aio.ServicerContext[
            pb.PreferredAllocationRequest, pb.PreferredAllocationResponse
        ],
    ) -> pb.PreferredAllocationResponse:
        replicas = self.devices.replicas
        out = []
        for wanted in request.container_requests:
            size = wanted.allocation_size
            if size < 1:
                await self._refuse(
                    context, grpc.StatusCode.INVALID_ARGUMENT, "allocation_size must be at least 1"
                )
            chosen: list[str] = []
            try:
                upcoming = await self.ledger.next_allocation(self.node, size)
            except LedgerError as exc:
                log.warning("GetPreferredAllocation without the ledger's choice: %s", exc)
            else:
                chosen = [g.uuid for g in upcoming.devices] if upcoming else []
            ids = replicas.preferred(
                chosen, wanted.available_deviceIDs, wanted.must_include_deviceIDs, size
            )
            out.append(pb.ContainerPreferredAllocationResponse(deviceIDs=ids))
        return pb.PreferredAllocationResponse(container_responses=out)

    async def Allocate(
        self,
        request: pb.AllocateRequest,
        context: grpc.aio.ServicerContext[pb.AllocateRequest, pb.AllocateResponse],
    ) -> pb.AllocateResponse:
        started = time.perf_counter()
        try:
            response = await self._allocate(request, context)
        except BaseException:  # refusals (aborts) included
            self.metrics.allocations.labels("error").inc()
            raise
        finally:
            self.metrics.allocate_seconds.observe(time.perf_counter() - started)
        self.metrics.allocations.labels("ok").inc()
        return response

    async def _allocate(
        self,
        request: pb.AllocateRequest,
        context: grpc.aio.ServicerContext[pb.AllocateRequest, pb.AllocateResponse],
    ) -> pb.AllocateResponse:
        if len(request.container_requests) != 1:
            await self._refuse(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                "Allocate takes one container per call, got "
                f"{len(request.container_requests)} container requests",
            )
        ids = list(request.container_requests[0].devices_ids)
        problem = self._check_ids(ids)
        if problem:
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, problem)
        try:
            allocation = await self._allocate_when_rebuilt(len(ids), context.time_remaining())
        except NotReserved as exc:
            await self._failed(None, f"no pending pod: {exc}")
            await self._refuse(context, grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except LedgerError as exc:
            await self._failed(None, f"ledger unavailable: {exc}")
            await self._refuse(context, grpc.StatusCode.UNAVAILABLE, f"ledger unavailable: {exc}")
        try:
            response = await self._answer(allocation, ids)
        except Exception as exc:  # the container is taken in the ledger; say why it fails
            log.exception("Allocate answer for pod %s failed", allocation.placement.pod.uid)
            message = f"cannot prepare the container ({type(exc).__name__}): {exc}"
            await self._failed(allocation, message)
            await self._refuse(context, grpc.StatusCode.INTERNAL, message)
        await self._publish(EventType.ALLOC_ALLOCATED, allocation, "")
        return pb.AllocateResponse(container_responses=[response])

    async def _allocate_when_rebuilt(self, count: int, remaining: float | None) -> Allocation:
        """``ledger.allocate``, waiting while the node's ledger is being rebuilt."""
        deadline = time.monotonic() + min(REBUILD_WAIT_S, remaining or REBUILD_WAIT_S)
        while True:
            try:
                return await self.ledger.allocate(self.node, count)
            except LedgerRebuilding:
                if time.monotonic() + REBUILD_POLL_S >= deadline:
                    raise
                await asyncio.sleep(REBUILD_POLL_S)

    def _check_ids(self, ids: list[str]) -> str:
        if not ids:
            return "the container request names no device IDs"
        if len(set(ids)) != len(ids):
            return f"device IDs repeat: {', '.join(ids)}"
        unknown = [i for i in ids if self.devices.replicas.uuid_of(i) is None]
        if unknown:
            return f"unknown device IDs: {', '.join(unknown[:8])}"
        return ""

    async def _answer(self, allocation: Allocation, ids: list[str]) -> pb.ContainerAllocateResponse:
        placement = allocation.placement
        container = placement.containers[allocation.container_index]
        control = await self._control_wanted(allocation)
        config = self.config()  # once: the answer and the grant agree if it is reloaded
        response = answer(allocation, self.settings, config, self.host, control=control)
        uuids = tuple(g.uuid for g in container.devices)
        owner = ContainerOwner(
            pod_uid=placement.pod.uid,
            namespace=placement.pod.namespace,
            pod_name=placement.pod.name,
            container=container.name,
            devices=uuids,
            allocated_at=time.time(),
        )
        limits = grant(allocation, self.settings, config, control=control)
        await asyncio.to_thread(self.host.prepare_container, owner, limits)
        if allocation.rivals:
            self.metrics.ambiguous.inc()
            log.warning(
                "Allocate for %d GPU(s) had %d other pod(s) waiting for as many; pod %s, "
                "bound first, was chosen (kubelet names no pod)",
                len(ids),
                allocation.rivals,
                placement.pod.uid,
            )
        kubelet_chose = {self.devices.replicas.uuid_of(i) for i in ids}
        if kubelet_chose != set(uuids):
            log.info(
                "pod %s container %s: kubelet's replicas stand for %s, the ledger's GPUs are %s",
                placement.pod.uid,
                container.name,
                sorted(u or "?" for u in kubelet_chose),
                list(uuids),
            )
        log.info(
            "allocated pod %s/%s container %s: %s",
            placement.pod.namespace,
            placement.pod.name,
            container.name,
            ",".join(uuids),
        )
        return response

    async def _control_wanted(self, allocation: Allocation) -> bool:
        """Whether the preload goes in; the pod may opt out, a pod we cannot read may not."""
        if self.kube is None:
            return True
        pod = allocation.placement.pod
        container = allocation.placement.containers[allocation.container_index].name
        try:
            spec = await asyncio.wait_for(self.kube.get_pod(pod.namespace, pod.name), 5.0)
        except (KubeError, TimeoutError) as exc:
            log.warning(
                "pod %s/%s unreadable (%s); limits stay enforced", pod.namespace, pod.name, exc
            )
            return True
        return control_wanted(spec, container)

    async def _failed(self, allocation: Allocation | None, reason: str) -> None:
        log.warning("Allocate on %s failed: %s", self.node, reason)
        await self._publish(EventType.ALLOC_FAILED, allocation, reason)

    async def _publish(
        self, event_type: EventType, allocation: Allocation | None, reason: str
    ) -> None:
        if self.bus is None:
            return
        if allocation is None:
            payload = AllocationEvent(pod=None, node=self.node, reason=reason[:1024])
        else:
            placement = allocation.placement
            container = placement.containers[allocation.container_index]
            payload = AllocationEvent(
                pod=placement.pod,
                node=self.node,
                containers=(container,),
                container=container.name,
                policy=placement.policy,
                reason=reason[:1024],
            )
        subject = payload.pod.uid if payload.pod else None
        try:
            await self.bus.publish(make_event(event_type, payload, source=SOURCE, subject=subject))
        except BusError as exc:  # the answer stands; the client buffers across reconnects
            log.warning("event %s not published: %s", event_type, exc)

    @staticmethod
    async def _refuse(
        context: grpc.aio.ServicerContext[Any, Any], code: grpc.StatusCode, message: str
    ) -> NoReturn:
        await context.abort(code, message)
        raise AssertionError("unreachable: abort raises")

    async def PreStartContainer(
        self,
        request: pb.PreStartContainerRequest,
        context: grpc.aio.ServicerContext[
            pb.PreStartContainerRequest, pb.PreStartContainerResponse
        ],
    ) -> pb.PreStartContainerResponse:
        return pb.PreStartContainerResponse()
