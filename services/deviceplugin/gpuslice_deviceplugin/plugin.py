"""The ``v1beta1.DevicePlugin`` service kubelet calls.

Allocate carries no pod identity, only replica IDs; the pod comes from the
ledger, through the inventory (:mod:`gpuslice_deviceplugin.gateway`): the
oldest pod bound to this node whose next unallocated container asks for that
many GPUs, taken atomically. A call that finds none is refused with
``FAILED_PRECONDITION`` (the inventory records ``alloc.failed``), never
answered with a guess. While the inventory or its ledger is away the call waits,
asking again with the same request id, until its deadline.

A container granted MIG instances gets them made first
(:mod:`gpuslice_deviceplugin.mig`); where an instance this agent made for
another pod still sits on the slices, that pod is asked after in the ledger
and its instances destroyed if it has ended. A grant that cannot be made is
refused with the reason, nothing made. A container whose every card is a MIG
instance gets no ``ld.so.preload``: the hardware holds it to its instances.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, NoReturn

import grpc

from gpuslice_common.config import DevicePluginSettings
from gpuslice_common.kube import KubeApi, KubeError
from gpuslice_common.models import PlacementState, PodRef
from gpuslice_common.nodeapi import MAX_DEVICES, AllocationReply, ErrorKind, NodeRequestError
from gpuslice_deviceplugin.allocation import answer, control_wanted, grant, on_mig
from gpuslice_deviceplugin.api import deviceplugin_pb2 as pb
from gpuslice_deviceplugin.api import deviceplugin_pb2_grpc as pb_grpc
from gpuslice_deviceplugin.containers import ContainerOwner, HostDir
from gpuslice_deviceplugin.driverlimits import CardSupport
from gpuslice_deviceplugin.gateway import InventoryGateway
from gpuslice_deviceplugin.metrics import PluginMetrics
from gpuslice_deviceplugin.mig import LiveInstance, MigError, MigInstances
from gpuslice_deviceplugin.nodeconfig import NodeConfig
from gpuslice_deviceplugin.replicas import Replicas

log = logging.getLogger(__name__)
# how long the inventory's report of a container that could not be prepared may take
FAILED_REPORT_S = 2.0
POD_READ_S = 5.0  # how long reading a pod's spec for CUDA_DISABLE_CONTROL may take

# the gRPC status of each kind of error the inventory answers
STATUS = {
    ErrorKind.BAD_REQUEST: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorKind.NOT_RESERVED: grpc.StatusCode.FAILED_PRECONDITION,
    ErrorKind.AMBIGUOUS: grpc.StatusCode.FAILED_PRECONDITION,
    ErrorKind.LEDGER_UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorKind.REBUILDING: grpc.StatusCode.UNAVAILABLE,
    ErrorKind.BUSY: grpc.StatusCode.UNAVAILABLE,
    ErrorKind.LEDGER_ERROR: grpc.StatusCode.UNAVAILABLE,
    ErrorKind.INTERNAL: grpc.StatusCode.INTERNAL,
}


def refusal(exc: NodeRequestError) -> tuple[grpc.StatusCode, str]:
    """The gRPC status and message for an Allocate the inventory could not answer."""
    if not isinstance(exc.kind, ErrorKind):
        return grpc.StatusCode.UNAVAILABLE, f"inventory unavailable: {exc}"
    code = STATUS[exc.kind]
    if code == grpc.StatusCode.UNAVAILABLE:
        return code, f"ledger unavailable: {exc}"
    return code, str(exc)


async def pod_allows_control(kube: KubeApi | None, pod: PodRef, container: str) -> bool:
    """Whether the preload goes in for ``container``: the pod may opt out
    (:func:`control_wanted`), a pod that cannot be read may not."""
    if kube is None:
        return True
    try:
        spec = await asyncio.wait_for(kube.get_pod(pod.namespace, pod.name), POD_READ_S)
    except (KubeError, TimeoutError) as exc:
        log.warning("pod %s/%s unreadable (%s); limits stay enforced", pod.namespace, pod.name, exc)
        return True
    return control_wanted(spec, container)


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
        gateway: InventoryGateway,
        host: HostDir,
        metrics: PluginMetrics,
        *,
        kube: KubeApi | None = None,
        mig: MigInstances | None = None,
        driver_support: Callable[[], Mapping[str, CardSupport]] | None = None,
    ) -> None:
        self.settings = settings
        self.driver_support = driver_support  # cards whose driver limits memory per cgroup
        self.mig = mig
        self.devices = devices
        self.config = config
        self.gateway = gateway
        self.host = host
        self.metrics = metrics
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
            if not 1 <= size <= MAX_DEVICES:
                problem = f"allocation_size {size} is not between 1 and {MAX_DEVICES}"
                await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, problem)
            chosen: list[str] = []
            try:
                chosen = list(await self.gateway.preferred(size))
            except NodeRequestError as exc:
                log.warning("GetPreferredAllocation without the ledger's choice: %s", exc)
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
        deadline = self._deadline(context)
        try:
            allocation = await self.gateway.allocate(len(ids), uuid.uuid4().hex, deadline)
        except NodeRequestError as exc:
            if exc.kind == ErrorKind.AMBIGUOUS:
                self.metrics.ambiguous.inc()
                log.error("Allocate on %s refused: %s", self.node, exc)
            else:
                log.warning("Allocate on %s failed: %s", self.node, exc)
            await self._refuse(context, *refusal(exc))
        try:
            response = await self._answer(allocation, ids)
        except MigError as exc:
            log.warning("Allocate for pod %s refused: %s", allocation.placement.pod.uid, exc)
            message = f"cannot make the container's MIG instance: {exc}"
            await self._report_failed(allocation, message)
            await self._refuse(context, grpc.StatusCode.FAILED_PRECONDITION, message)
        except Exception as exc:  # the container is taken in the ledger; say why it fails
            log.exception("Allocate answer for pod %s failed", allocation.placement.pod.uid)
            message = f"cannot prepare the container ({type(exc).__name__}): {exc}"
            await self._report_failed(allocation, message)
            await self._refuse(context, grpc.StatusCode.INTERNAL, message)
        return pb.AllocateResponse(container_responses=[response])

    def _deadline(self, context: grpc.aio.ServicerContext[Any, Any]) -> float:
        """When Allocate gives up waiting for the inventory (event-loop time)."""
        budget = self.settings.allocate_timeout.total_seconds()
        remaining = context.time_remaining()
        if remaining is not None and math.isfinite(remaining):
            budget = min(budget, remaining - 0.1)  # leave time to refuse
        return asyncio.get_running_loop().time() + max(budget, 0.0)

    def _check_ids(self, ids: list[str]) -> str:
        if not ids:
            return "the container request names no device IDs"
        if len(ids) > MAX_DEVICES:
            return f"{len(ids)} device IDs; a container takes at most {MAX_DEVICES}"
        if len(set(ids)) != len(ids):
            return f"device IDs repeat: {', '.join(ids)}"
        unknown = [i for i in ids if self.devices.replicas.uuid_of(i) is None]
        if unknown:
            return f"unknown device IDs: {', '.join(unknown[:8])}"
        return ""

    async def _answer(
        self, allocation: AllocationReply, ids: list[str]
    ) -> pb.ContainerAllocateResponse:
        placement = allocation.placement
        container = placement.containers[allocation.container_index]
        control = await self._control_wanted(allocation)
        config = self.config()  # once: the answer and the grant agree if it is reloaded
        made = await self._make_mig(allocation, config)
        try:
            return await self._prepare(allocation, ids, control, config, made)
        except BaseException:
            if made and self.mig is not None:
                await asyncio.to_thread(self.mig.undo, placement.pod.uid, container.name)
            raise

    async def _make_mig(
        self, allocation: AllocationReply, config: NodeConfig
    ) -> dict[str, LiveInstance]:
        """The MIG instances of the container's grants that have one, made."""
        placement = allocation.placement
        container = placement.containers[allocation.container_index]
        if not any(g.mig for g in container.devices):
            return {}
        if self.mig is None or config.operating_mode != "mig":
            raise MigError(f"node {self.node} makes no MIG instances (operatingMode is not mig)")
        uid = placement.pod.uid
        holders = await asyncio.to_thread(self.mig.holders, uid, container.devices)
        if holders:  # instances of pods that may have ended since the last check
            try:
                states = {p.uid: p.state for p in (await self.gateway.placements()).pods}
            except NodeRequestError as exc:
                log.warning("pods %s holding MIG slices not asked after: %s", sorted(holders), exc)
                states = {}
            ended = {h for h in holders if states.get(h) == PlacementState.RELEASED}
            await asyncio.to_thread(self.mig.release, ended)
        return await asyncio.to_thread(self.mig.prepare, uid, container.name, container.devices)

    async def _prepare(
        self,
        allocation: AllocationReply,
        ids: list[str],
        control: bool,
        config: NodeConfig,
        made: dict[str, LiveInstance],
    ) -> pb.ContainerAllocateResponse:
        cards = allocation
        if made and set(made) == set(cards.devices):
            # MIG divides the cards in hardware: nothing for the interposer to hold
            control = False
        allocation = on_mig(allocation, made)
        placement = allocation.placement
        container = placement.containers[allocation.container_index]
        support = self.driver_support() if self.driver_support is not None else None
        response = answer(
            allocation, self.settings, config, self.host, control=control, driver_support=support
        )
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
        kubelet_chose = {self.devices.replicas.uuid_of(i) for i in ids}
        if kubelet_chose != set(cards.devices):
            log.info(
                "pod %s container %s: kubelet's replicas stand for %s, the ledger's GPUs are %s",
                placement.pod.uid,
                container.name,
                sorted(u or "?" for u in kubelet_chose),
                list(cards.devices),
            )
        log.info(
            "allocated pod %s/%s container %s: %s",
            placement.pod.namespace,
            placement.pod.name,
            container.name,
            ",".join(uuids),
        )
        return response

    async def _control_wanted(self, allocation: AllocationReply) -> bool:
        container = allocation.placement.containers[allocation.container_index].name
        return await pod_allows_control(self.kube, allocation.placement.pod, container)

    async def _report_failed(self, allocation: AllocationReply, reason: str) -> None:
        """The inventory records alloc.failed for the container it handed out."""
        placement = allocation.placement
        container = placement.containers[allocation.container_index].name
        deadline = asyncio.get_running_loop().time() + FAILED_REPORT_S
        try:
            await self.gateway.failed(placement.pod.uid, container, reason, deadline)
        except NodeRequestError as exc:
            log.warning("failure of pod %s not reported: %s", placement.pod.uid, exc)

    @staticmethod
    async def _refuse(
        context: grpc.aio.ServicerContext[Any, Any], code: grpc.StatusCode, message: str
    ) -> NoReturn:
        if code == grpc.StatusCode.INVALID_ARGUMENT:  # kubelet's call, not ours, is at fault
            log.warning("refused a kubelet call: %s", message)
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
