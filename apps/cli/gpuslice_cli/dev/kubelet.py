"""A stand-in kubelet: kubelet's side of the device plugin API over real gRPC,
for the local stack and the tests.

It serves ``v1beta1.Registration`` on ``<dir>/kubelet.sock`` and, inside
Register, does what kubelet does (contract §2): checks the version and the
resource name, dials the plugin's socket with a 10 s timeout, asks for the
plugin's options, then keeps a ListAndWatch stream open in the background and
records every list. Containers are admitted as kubelet admits them: for each
container, in order, pick free healthy replicas (through GetPreferredAllocation
when the plugin offers it), call Allocate with one container request, and take
``container_responses[0]``. ``restart()`` deletes every socket in the
directory, as a restarted kubelet does, and serves a fresh ``kubelet.sock``.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from pathlib import Path

import grpc

from gpuslice_deviceplugin.api import deviceplugin_pb2 as pb
from gpuslice_deviceplugin.api import deviceplugin_pb2_grpc as pb_grpc

RESOURCE = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")


class Plugin:
    """One registered plugin as kubelet holds it."""

    def __init__(self, request: pb.RegisterRequest, channel: grpc.aio.Channel) -> None:
        self.request = request
        self.channel = channel
        self.stub = pb_grpc.DevicePluginStub(channel)
        self.options: pb.DevicePluginOptions | None = None
        self.lists: list[list[pb.Device]] = []
        self.changed = asyncio.Condition()
        self.stream_error: grpc.aio.AioRpcError | None = None
        self.stream_ended = asyncio.Event()
        self.allocated: set[str] = set()
        self.last_allocated: tuple[str, ...] = ()  # the replicas of the last Allocate
        self.watcher: asyncio.Task[None] | None = None

    async def watch(self) -> None:
        try:
            async for response in self.stub.ListAndWatch(pb.Empty()):
                async with self.changed:
                    self.lists.append(list(response.devices))
                    self.changed.notify_all()
        except grpc.aio.AioRpcError as exc:
            self.stream_error = exc
        finally:
            self.stream_ended.set()

    async def list_after(self, seen: int, timeout: float = 10.0) -> list[pb.Device]:
        """The first list received after ``seen`` lists."""
        async with self.changed:
            await asyncio.wait_for(self.changed.wait_for(lambda: len(self.lists) > seen), timeout)
            return self.lists[seen]

    @property
    def devices(self) -> list[pb.Device]:
        return self.lists[-1] if self.lists else []

    def free(self) -> list[str]:
        return [d.ID for d in self.devices if d.health == "Healthy" and d.ID not in self.allocated]

    async def admit_container(self, count: int) -> pb.ContainerAllocateResponse:
        """Choose ``count`` replicas and Allocate them, as kubelet does for one container."""
        free = self.free()
        if len(free) < count:
            raise RuntimeError(f"kubelet: {count} replicas wanted, {len(free)} free")
        ids = free[:count]
        if self.options is not None and self.options.get_preferred_allocation_available:
            preferred = await self.stub.GetPreferredAllocation(
                pb.PreferredAllocationRequest(
                    container_requests=[
                        pb.ContainerPreferredAllocationRequest(
                            available_deviceIDs=free, allocation_size=count
                        )
                    ]
                )
            )
            ids = list(preferred.container_responses[0].deviceIDs)
            if len(ids) != count or not set(ids) <= set(free):
                raise RuntimeError(
                    f"kubelet: the plugin preferred {ids} for {count} of the free {free}"
                )
        response = await self.stub.Allocate(
            pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=ids)])
        )
        self.allocated.update(ids)
        self.last_allocated = tuple(ids)
        return response.container_responses[0]

    async def close(self) -> None:
        if self.watcher is not None:
            self.watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.watcher
        await self.channel.close()


class DevKubelet(pb_grpc.RegistrationServicer):
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.socket = directory / "kubelet.sock"
        self.plugins: list[Plugin] = []
        self.refusals: list[str] = []
        self.registered = asyncio.Condition()
        self._server: grpc.aio.Server | None = None

    async def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        server = grpc.aio.server()
        pb_grpc.add_RegistrationServicer_to_server(self, server)
        if server.add_insecure_port(f"unix://{self.socket}") == 0:
            raise OSError(f"kubelet: cannot listen on {self.socket}")
        await server.start()
        self._server = server

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(0)
            self._server = None
        for plugin in self.plugins:
            await plugin.close()

    async def restart(self) -> None:
        """Stop, delete every socket in the directory, and serve again."""
        await self.stop()
        for path in self.directory.iterdir():
            if path.is_socket():
                path.unlink()
        await self.start()

    async def Register(
        self,
        request: pb.RegisterRequest,
        context: grpc.aio.ServicerContext[pb.RegisterRequest, pb.Empty],
    ) -> pb.Empty:
        problem = ""
        if request.version != "v1beta1":
            problem = f"unsupported API version {request.version!r}"
        elif not RESOURCE.fullmatch(request.resource_name):
            problem = f"resource name {request.resource_name!r} is not domain-qualified"
        elif "/" in request.endpoint or not request.endpoint:
            problem = f"endpoint {request.endpoint!r} is not a file name in {self.directory}"
        if problem:
            self.refusals.append(problem)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        channel = grpc.aio.insecure_channel(f"unix://{self.directory / request.endpoint}")
        try:
            await asyncio.wait_for(channel.channel_ready(), 10.0)
            plugin = Plugin(request, channel)
            plugin.options = await plugin.stub.GetDevicePluginOptions(pb.Empty(), timeout=10.0)
        except (TimeoutError, grpc.aio.AioRpcError) as exc:
            await channel.close()
            self.refusals.append(f"cannot reach the plugin: {exc!r}")
            await context.abort(grpc.StatusCode.UNAVAILABLE, "plugin unreachable")
        plugin.watcher = asyncio.create_task(plugin.watch())
        async with self.registered:
            self.plugins.append(plugin)
            self.registered.notify_all()
        return pb.Empty()

    def plugin_for(self, resource: str) -> Plugin | None:
        """The latest registration of ``resource``, as kubelet keeps one plugin per resource."""
        for plugin in reversed(self.plugins):
            if plugin.request.resource_name == resource:
                return plugin
        return None

    async def registration(self, number: int = 1, timeout: float = 10.0) -> Plugin:
        """The ``number``-th registration (1 = the first), waiting for it."""
        async with self.registered:
            await asyncio.wait_for(
                self.registered.wait_for(lambda: len(self.plugins) >= number), timeout
            )
            return self.plugins[number - 1]

    async def first_list(self, plugin: Plugin, timeout: float = 10.0) -> list[pb.Device]:
        return await plugin.list_after(0, timeout)
