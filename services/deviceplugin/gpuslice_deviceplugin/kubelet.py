"""Staying known to kubelet: serve the plugin socket, register, and do it again.

The handshake (contract §2): serve ``DevicePlugin`` on ``<dir>/<name>.sock``,
then call ``Registration.Register`` on ``<dir>/kubelet.sock``; kubelet dials
back, asks for the options and opens ListAndWatch. A restarted kubelet deletes
every socket in the directory and creates its own anew, so the link watches
both files: when ours disappears or ``kubelet.sock`` is a different file, the
server is restarted and registered again. Consecutive failures back off and,
past a bound, end the agent with an error (its DaemonSet restarts it).
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import grpc

from gpuslice_deviceplugin.api import deviceplugin_pb2 as pb
from gpuslice_deviceplugin.api import deviceplugin_pb2_grpc as pb_grpc
from gpuslice_deviceplugin.metrics import PluginMetrics

log = logging.getLogger(__name__)

API_VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"
REGISTER_TIMEOUT_S = 10.0


class KubeletLinkError(Exception):
    """Serving or registering kept failing; the agent cannot do its job."""


def _identity(path: Path) -> tuple[int, int] | None:
    """Which file sits at ``path`` (device and inode), or None when nothing does."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


class PluginServer:
    """The gRPC server of the DevicePlugin service on its unix socket."""

    def __init__(self, servicer: pb_grpc.DevicePluginServicer, socket: Path) -> None:
        self.servicer = servicer
        self.socket = socket
        self._server: grpc.aio.Server | None = None

    async def start(self) -> None:
        self.socket.unlink(missing_ok=True)
        server = grpc.aio.server()
        pb_grpc.add_DevicePluginServicer_to_server(self.servicer, server)
        if server.add_insecure_port(f"unix://{self.socket}") == 0:
            raise OSError(f"cannot listen on {self.socket}")
        await server.start()
        self._server = server
        log.info("serving the device plugin on %s", self.socket)

    async def stop(self, grace: float = 1.0) -> None:
        server, self._server = self._server, None
        if server is not None:
            await server.stop(grace)


async def register(
    kubelet_socket: Path, endpoint: str, resource_name: str, timeout: float = REGISTER_TIMEOUT_S
) -> None:
    """Call kubelet's Register; raises grpc.aio.AioRpcError when kubelet refuses."""
    async with grpc.aio.insecure_channel(f"unix://{kubelet_socket}") as channel:
        stub = pb_grpc.RegistrationStub(channel)
        await stub.Register(
            pb.RegisterRequest(
                version=API_VERSION,
                endpoint=endpoint,
                resource_name=resource_name,
                options=pb.DevicePluginOptions(
                    pre_start_required=False, get_preferred_allocation_available=True
                ),
            ),
            timeout=timeout,
        )


@dataclass
class LinkTiming:
    poll_s: float = 0.5  # how often the sockets are looked at
    backoff_s: float = 0.5  # first wait after a failure, doubling
    backoff_max_s: float = 10.0
    max_failures: int = 8  # consecutive failures before giving up


class KubeletLink:
    """Keeps the plugin served and registered with kubelet for as long as it runs."""

    def __init__(
        self,
        servicer: pb_grpc.DevicePluginServicer,
        kubelet_dir: Path,
        socket_name: str,
        resource_name: str,
        metrics: PluginMetrics,
        timing: LinkTiming | None = None,
    ) -> None:
        self.kubelet_dir = kubelet_dir
        self.kubelet_socket = kubelet_dir / KUBELET_SOCKET
        self.socket_name = socket_name
        self.resource_name = resource_name
        self.metrics = metrics
        self.timing = timing or LinkTiming()
        self.server = PluginServer(servicer, kubelet_dir / socket_name)
        self.registered = asyncio.Event()

    async def run(self) -> None:
        """Serve and register, again after every kubelet restart; never returns normally."""
        failures = 0
        try:
            while True:
                kubelet = await self._kubelet_appears()
                try:
                    await self.server.start()
                    await register(self.kubelet_socket, self.socket_name, self.resource_name)
                except (grpc.RpcError, OSError, RuntimeError) as exc:
                    await self.server.stop(0)
                    failures += 1
                    self.metrics.registrations.labels("error").inc()
                    if failures >= self.timing.max_failures:
                        raise KubeletLinkError(
                            f"registration with kubelet failed {failures} times in a row; "
                            f"last: {_describe(exc)}"
                        ) from None
                    wait = min(
                        self.timing.backoff_max_s, self.timing.backoff_s * 2 ** (failures - 1)
                    )
                    log.warning(
                        "registration with kubelet failed (%s); retrying in %.1fs",
                        _describe(exc),
                        wait,
                    )
                    await asyncio.sleep(wait)
                    continue
                failures = 0
                self.metrics.registrations.labels("ok").inc()
                self.registered.set()
                log.info("registered %s with kubelet at %s", self.resource_name, self.kubelet_dir)
                await self._until_kubelet_restarts(kubelet)
                self.registered.clear()
                await self.server.stop()
        finally:
            self.registered.clear()
            await self.server.stop(0)

    async def _kubelet_appears(self) -> tuple[int, int]:
        said = False
        while (kubelet := _identity(self.kubelet_socket)) is None:
            if not said:
                log.info("waiting for kubelet's socket %s", self.kubelet_socket)
                said = True
            await asyncio.sleep(self.timing.poll_s)
        return kubelet

    async def _until_kubelet_restarts(self, kubelet: tuple[int, int]) -> None:
        while True:
            await asyncio.sleep(self.timing.poll_s)
            if _identity(self.server.socket) is None:
                log.warning("our socket %s is gone: kubelet restarted", self.server.socket)
                return
            if _identity(self.kubelet_socket) != kubelet:
                log.warning("kubelet's socket was re-created: kubelet restarted")
                return


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return str(exc) or type(exc).__name__
