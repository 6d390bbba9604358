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
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError

from gpuslice_deviceplugin.api import deviceplugin_pb2 as pb
from gpuslice_deviceplugin.api import deviceplugin_pb2_grpc as pb_grpc
from gpuslice_deviceplugin.metrics import PluginMetrics

log = logging.getLogger(__name__)

API_VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"
REGISTER_TIMEOUT_S = 10.0
Req = TypeVar("Req")
Resp = TypeVar("Resp")


class KubeletLinkError(Exception):
    """Serving or registering kept failing; the agent cannot do its job."""


def _identity(path: Path) -> tuple[int, int] | None:
    """Which file sits at ``path`` (device and inode), or None when nothing does."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


@dataclass(frozen=True)
class _Undecodable:
    """What a request that is not the protobuf message it should be decodes to."""

    problem: str


def _lenient(deserialize: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    """``deserialize``, but bytes that do not decode give an :class:`_Undecodable`:
    grpc would log the DecodeError with its traceback and answer UNKNOWN."""
    message = getattr(getattr(deserialize, "__self__", None), "DESCRIPTOR", None)
    name = getattr(message, "full_name", "request message")

    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except (DecodeError, ValueError) as exc:
            detail = str(exc).rsplit(": ", 1)[-1].splitlines()[0][:200] if str(exc) else ""
            return _Undecodable(f"the request is not a valid {name}: {detail or 'undecodable'}")

    return parse


class RefuseUndecodable(grpc.aio.ServerInterceptor):
    """Answer a request that does not decode with INVALID_ARGUMENT and one log line,
    before any servicer method sees it (unary and server-streaming methods)."""

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Req, Resp] | None]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Req, Resp] | None:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        method = str(getattr(handler_call_details, "method", "?"))
        parse = _lenient(handler.request_deserializer)
        serialize = handler.response_serializer
        if handler.unary_unary is not None:
            unary: Any = handler.unary_unary

            async def unary_unary(request: Any, context: Any) -> Any:
                await _refuse_undecodable(method, request, context)
                return await unary(request, context)

            return grpc.unary_unary_rpc_method_handler(
                unary_unary, request_deserializer=parse, response_serializer=serialize
            )
        if handler.unary_stream is not None:
            stream: Any = handler.unary_stream

            async def unary_stream(request: Any, context: Any) -> AsyncIterator[Any]:
                await _refuse_undecodable(method, request, context)
                async for reply in stream(request, context):
                    yield reply

            return grpc.unary_stream_rpc_method_handler(
                unary_stream, request_deserializer=parse, response_serializer=serialize
            )
        return handler


async def _refuse_undecodable(
    method: str, request: Any, context: grpc.aio.ServicerContext[Any, Any]
) -> None:
    if isinstance(request, _Undecodable):
        log.warning("refused %s: %s", method, request.problem)
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.problem)


class PluginServer:
    """The gRPC server of the DevicePlugin service on its unix socket.

    A request that does not decode is refused with INVALID_ARGUMENT
    (:class:`RefuseUndecodable`), never handed to the servicer.
    """

    def __init__(self, servicer: pb_grpc.DevicePluginServicer, socket: Path) -> None:
        self.servicer = servicer
        self.socket = socket
        self._server: grpc.aio.Server | None = None

    async def start(self) -> None:
        self.socket.unlink(missing_ok=True)
        server = grpc.aio.server(interceptors=[RefuseUndecodable()])
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
