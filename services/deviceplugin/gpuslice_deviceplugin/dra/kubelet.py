"""kubelet's side of DRA for the agent: the DRA plugin gRPC service and the
plugin registration kubelet's plugin watcher finds.

kubelet's plugin watcher registers every socket that appears in its
``plugins_registry`` directory: it calls ``Registration.GetInfo`` there, checks
the type (``DRAPlugin``) and the gRPC services the plugin lists as its
"supported versions" (``v1.DRAPlugin``), dials the endpoint the answer names
and calls ``NotifyRegistrationStatus``. When the socket goes away, kubelet
forgets the plugin. A restarted kubelet reads the directory again, so nothing
needs doing then; but a registration socket that someone deleted is served
again (and the plugin socket likewise), since without it kubelet cannot find
the driver.

``NodePrepareResources`` carries all claims of one pod for this driver; each
is prepared through the :class:`ClaimPreparer` (a few at a time) and answered
on its own, by uid: its devices, or the error kubelet shows on the pod. A
claim whose namespace, name or uid is not valid is refused by naming the
field, and nothing is prepared for it; the preparer raising anything but a
:class:`ClaimError` gives an "internal error" answer for that claim and a
logged traceback, never a dead server.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import stat
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, TypeVar

import grpc
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from gpuslice_common.dra import DRIVER
from gpuslice_common.models import ClaimRef
from gpuslice_deviceplugin.dra.api import dra_pb2 as dra_pb
from gpuslice_deviceplugin.dra.api import dra_pb2_grpc as dra_grpc
from gpuslice_deviceplugin.dra.api import pluginregistration_pb2 as reg_pb
from gpuslice_deviceplugin.dra.api import pluginregistration_pb2_grpc as reg_grpc
from gpuslice_deviceplugin.dra.contract import ClaimError, ClaimPreparer, PreparedDevice
from gpuslice_deviceplugin.kubelet import RefuseUndecodable
from gpuslice_deviceplugin.metrics import DraMetrics

log = logging.getLogger(__name__)

PLUGIN_TYPE: Final = "DRAPlugin"
# kubelet matches the "supported versions" against the gRPC services it can
# call, named "<proto package's last part>.<service>".
SERVICE: Final = "v1.DRAPlugin"
PLUGIN_SOCKET: Final = "dra.sock"
MAX_CLAIMS: Final = 128  # claims in one call; one pod's claims of one driver
CONCURRENCY: Final = 8  # claims prepared or unprepared at once
MAX_ERROR: Final = 1024  # characters of an error kubelet shows on the pod
MAX_SOCKET_PATH: Final = 107  # bytes of a unix socket path (sun_path, NUL excluded)
INTERNAL_ERROR: Final = "internal error in the gpuslice node agent (see its log)"
T = TypeVar("T")


class SocketError(OSError):
    """A socket's path cannot be served: the message names the path and why."""


@dataclass(frozen=True)
class _Identity:
    dev: int
    ino: int


def _identity(path: Path) -> _Identity | None:
    """The file at ``path`` itself (a symlink is not followed), or None."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return _Identity(st.st_dev, st.st_ino)


def _ensure_dir(path: Path, own: bool) -> None:
    """``path`` as a directory, creating what is missing with mode 0750; the
    agent's ``own`` directory must not be a symlink (kubelet's may be)."""
    missing: list[Path] = []
    probe = path
    while not probe.exists() and not probe.is_symlink():
        missing.append(probe)
        probe = probe.parent
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):
            directory.mkdir(mode=0o750)
            os.chmod(directory, 0o750)  # whatever the umask
    if own and path.is_symlink():
        raise SocketError(f"{path} is a symlink: refusing to serve a socket in it")
    if not path.is_dir():
        raise SocketError(f"{path} is not a directory: refusing to serve a socket in it")


def _clear_socket_path(path: Path, own_dir: bool) -> None:
    """Make room for a socket at ``path``: a stale socket file is removed, a
    symlink or any other file there is refused."""
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        raise SocketError(
            f"socket path {path} is longer than {MAX_SOCKET_PATH} bytes: choose a shorter directory"
        )
    _ensure_dir(path.parent, own_dir)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise SocketError(f"{path} is a symlink: refusing to replace it with a socket")
    if not stat.S_ISSOCK(st.st_mode):
        raise SocketError(f"{path} exists and is not a socket: refusing to replace it")
    log.info("removing the stale socket %s", path)
    path.unlink()


class _Socket:
    """One grpc.aio server on one unix socket, which it made and removes."""

    def __init__(
        self, path: Path, add: Callable[[grpc.aio.Server], None], what: str, own_dir: bool
    ) -> None:
        self.path = path
        self.what = what
        self.own_dir = own_dir
        self._add = add
        self._server: grpc.aio.Server | None = None
        self._identity: _Identity | None = None

    async def start(self) -> None:
        _clear_socket_path(self.path, self.own_dir)
        server = grpc.aio.server(interceptors=[RefuseUndecodable()])
        self._add(server)
        if server.add_insecure_port(f"unix://{self.path}") == 0:
            raise SocketError(f"cannot listen on {self.path}")
        try:
            await server.start()
            os.chmod(self.path, 0o600)
        except BaseException:
            await server.stop(0)
            raise
        self._server = server
        self._identity = _identity(self.path)
        log.info("serving %s on %s", self.what, self.path)

    @property
    def down(self) -> bool:
        """Not serving, or the socket file this server made is no longer at its path."""
        return self._server is None or _identity(self.path) != self._identity

    async def stop(self, grace: float) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        await server.stop(grace)
        if self._identity is not None and _identity(self.path) == self._identity:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()  # only ours: a newer agent's socket stays
        self._identity = None


def _invalid_claim(claim: dra_pb.Claim) -> str | None:
    """Why ``claim`` is not a valid ClaimRef (naming the field), or None."""
    try:
        ClaimRef(namespace=claim.namespace, name=claim.name, uid=claim.uid)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(part) for part in first["loc"]) or "claim"
        value = getattr(claim, field, "")
        shown = repr(value[:80]) + ("..." if len(value) > 80 else "")
        return f"invalid claim: {field} {shown}: {first['msg']}"
    return None


def _bounded(message: str) -> str:
    message = message or "refused without a reason"
    return message if len(message) <= MAX_ERROR else message[: MAX_ERROR - 3] + "..."


def _devices(devices: Sequence[PreparedDevice]) -> list[dra_pb.Device]:
    return [
        dra_pb.Device(
            request_names=list(d.request_names),
            pool_name=d.pool,
            device_name=d.device,
            cdi_device_ids=list(d.cdi_ids),
        )
        for d in devices
    ]


class _DraServicer(dra_grpc.DRAPluginServicer):
    def __init__(self, preparer: ClaimPreparer, metrics: DraMetrics) -> None:
        self.preparer = preparer
        self.metrics = metrics
        self._slots = asyncio.Semaphore(CONCURRENCY)

    async def NodePrepareResources(
        self,
        request: dra_pb.NodePrepareResourcesRequest,
        context: grpc.aio.ServicerContext[
            dra_pb.NodePrepareResourcesRequest, dra_pb.NodePrepareResourcesResponse
        ],
    ) -> dra_pb.NodePrepareResourcesResponse:
        await self._check_size(len(request.claims), context)
        answers = await self._each(request.claims, "prepare", self._prepare)
        response = dra_pb.NodePrepareResourcesResponse()
        for uid, answer in answers.items():
            if isinstance(answer, str):
                response.claims[uid].error = answer
            else:
                response.claims[uid].devices.extend(answer)
        return response

    async def NodeUnprepareResources(
        self,
        request: dra_pb.NodeUnprepareResourcesRequest,
        context: grpc.aio.ServicerContext[
            dra_pb.NodeUnprepareResourcesRequest, dra_pb.NodeUnprepareResourcesResponse
        ],
    ) -> dra_pb.NodeUnprepareResourcesResponse:
        await self._check_size(len(request.claims), context)
        answers = await self._each(request.claims, "unprepare", self._unprepare)
        response = dra_pb.NodeUnprepareResourcesResponse()
        for uid, answer in answers.items():
            response.claims[uid].error = answer if isinstance(answer, str) else ""
        return response

    async def _check_size(self, count: int, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        if count > MAX_CLAIMS:
            self.metrics.refused_calls.inc()
            problem = f"{count} claims in one call; at most {MAX_CLAIMS} are taken"
            log.warning("refused a DRA call: %s", problem)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)

    async def _prepare(self, claim: ClaimRef) -> list[dra_pb.Device]:
        return _devices(await self.preparer.prepare(claim))

    async def _unprepare(self, claim: ClaimRef) -> None:
        await self.preparer.unprepare(claim)

    async def _each(
        self,
        claims: Sequence[dra_pb.Claim],
        operation: str,
        act: Callable[[ClaimRef], Awaitable[T]],
    ) -> dict[str, T | str]:
        """``act`` on every claim (a few at a time): by uid, what it gave or the error."""
        answers: dict[str, T | str] = {}
        counts = collections.Counter(c.uid for c in claims)
        repeated = {uid for uid, n in counts.items() if n > 1}
        valid: dict[str, ClaimRef] = {}
        for claim in claims:
            problem = (
                f"claim uid {claim.uid[:80]!r} appears more than once in the call"
                if claim.uid in repeated
                else _invalid_claim(claim)
            )
            if problem is not None:
                if claim.uid not in answers:
                    self.metrics.claims.labels(operation, "invalid").inc()
                    log.warning("refused to %s a claim: %s", operation, problem)
                answers[claim.uid] = problem
            else:
                valid[claim.uid] = ClaimRef(
                    namespace=claim.namespace, name=claim.name, uid=claim.uid
                )

        async def one(ref: ClaimRef) -> T | str:
            async with self._slots:
                started = time.perf_counter()
                try:
                    result = await act(ref)
                except ClaimError as exc:
                    self.metrics.claims.labels(operation, "refused").inc()
                    log.info("refused to %s claim %s: %s", operation, ref, exc)
                    return _bounded(str(exc))
                except Exception:
                    self.metrics.claims.labels(operation, "error").inc()
                    log.exception("failed to %s claim %s", operation, ref)
                    return INTERNAL_ERROR
                finally:
                    self.metrics.claim_seconds.labels(operation).observe(
                        time.perf_counter() - started
                    )
                self.metrics.claims.labels(operation, "ok").inc()
                return result

        refs = list(valid.values())
        results = await asyncio.gather(*(one(ref) for ref in refs))
        for ref, result in zip(refs, results, strict=True):
            answers[ref.uid] = result
        return answers


class _RegistrationServicer(reg_grpc.RegistrationServicer):
    def __init__(self, driver: str, endpoint: Path, metrics: DraMetrics) -> None:
        self.driver = driver
        self.endpoint = endpoint
        self.metrics = metrics
        self.registered = asyncio.Event()

    async def GetInfo(
        self,
        request: reg_pb.InfoRequest,
        context: grpc.aio.ServicerContext[reg_pb.InfoRequest, reg_pb.PluginInfo],
    ) -> reg_pb.PluginInfo:
        return reg_pb.PluginInfo(
            type=PLUGIN_TYPE,
            name=self.driver,
            endpoint=str(self.endpoint),
            supported_versions=[SERVICE],
        )

    async def NotifyRegistrationStatus(
        self,
        request: reg_pb.RegistrationStatus,
        context: grpc.aio.ServicerContext[
            reg_pb.RegistrationStatus, reg_pb.RegistrationStatusResponse
        ],
    ) -> reg_pb.RegistrationStatusResponse:
        if request.plugin_registered:
            self.metrics.registrations.labels("ok").inc()
            self.registered.set()
            log.info("kubelet registered the DRA driver %s", self.driver)
        else:
            self.metrics.registrations.labels("error").inc()
            self.registered.clear()
            log.error(
                "kubelet did not register the DRA driver %s: %s",
                self.driver,
                request.error[:MAX_ERROR] or "no reason given",
            )
        return reg_pb.RegistrationStatusResponse()


class DraPluginServer:
    """Serves ``v1.DRAPlugin`` on ``<plugins_dir>/<driver>/dra.sock`` for ``preparer``
    and the registration on ``<registry_dir>/<driver>-reg.sock``."""

    def __init__(
        self,
        preparer: ClaimPreparer,
        plugins_dir: Path,
        registry_dir: Path,
        driver: str = DRIVER,
        metrics: DraMetrics | None = None,
        poll_s: float = 1.0,
    ) -> None:
        self.preparer = preparer
        self.plugins_dir = plugins_dir
        self.registry_dir = registry_dir
        self.driver = driver
        self.metrics = metrics if metrics is not None else DraMetrics(CollectorRegistry())
        self.poll_s = poll_s
        self.plugin_socket = plugins_dir / driver / PLUGIN_SOCKET
        self.registration_socket = registry_dir / f"{driver}-reg.sock"
        self._dra = _DraServicer(preparer, self.metrics)
        self._registration = _RegistrationServicer(driver, self.plugin_socket, self.metrics)
        self._plugin = _Socket(
            self.plugin_socket,
            lambda s: dra_grpc.add_DRAPluginServicer_to_server(self._dra, s),
            f"the DRA plugin {SERVICE}",
            own_dir=True,
        )
        self._registrar = _Socket(
            self.registration_socket,
            lambda s: reg_grpc.add_RegistrationServicer_to_server(self._registration, s),
            f"the DRA driver {driver}'s registration",
            own_dir=False,
        )
        self._keeper: asyncio.Task[None] | None = None

    @property
    def registered(self) -> asyncio.Event:
        """Set while kubelet's last word was that it registered the plugin."""
        return self._registration.registered

    async def start(self) -> None:
        """Serve both sockets (replacing stale files); returns once they listen."""
        if self._keeper is not None:
            raise RuntimeError("the DRA plugin server is already running")
        try:
            await self._plugin.start()
            await self._registrar.start()
        except BaseException:
            await self._plugin.stop(0)
            await self._registrar.stop(0)
            raise
        self._keeper = asyncio.create_task(self._keep_sockets(), name="dra-sockets")

    async def stop(self, grace: float = 1.0) -> None:
        """Stop serving and remove both sockets."""
        keeper, self._keeper = self._keeper, None
        if keeper is not None:
            keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keeper
        # the registration first: kubelet forgets the plugin before its socket goes
        await self._registrar.stop(grace)
        await self._plugin.stop(grace)
        self.registered.clear()

    async def _keep_sockets(self) -> None:
        """Serve a socket again when its file disappears or is replaced."""
        said: set[str] = set()
        while True:
            await asyncio.sleep(self.poll_s)
            for sock in (self._plugin, self._registrar):
                if not sock.down:
                    continue
                if sock.what not in said:
                    log.warning("%s is gone: serving %s again", sock.path, sock.what)
                await sock.stop(0)
                try:
                    await sock.start()
                except (OSError, RuntimeError) as exc:
                    if sock.what not in said:  # once per socket until it works again
                        log.error("cannot serve %s again (retrying): %s", sock.what, exc)
                        said.add(sock.what)
                    continue
                said.discard(sock.what)
