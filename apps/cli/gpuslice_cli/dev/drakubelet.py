"""A stand-in kubelet for DRA: kubelet's plugin watcher and its DRA plugin client
over real gRPC, for the local stack and the tests.

It watches a ``plugins_registry`` directory (polling) and, for every socket that
appears there (names starting with ``.`` are skipped, as kubelet skips them),
does what kubelet does: calls ``Registration.GetInfo``, checks the type
(``DRAPlugin``), the driver name and that one of the plugin's "supported
versions" is a DRA gRPC service it speaks (``v1.DRAPlugin``), opens a channel
to the endpoint the answer names and calls ``NotifyRegistrationStatus`` with the
outcome. A socket that goes away (or is replaced) deregisters its plugin.

:meth:`DevDraKubelet.prepare` and :meth:`DevDraKubelet.unprepare` call the
driver's plugin the way kubelet does for a pod: one call carrying all the pod's
claims of that driver, with kubelet's 45 s deadline; an answer that leaves a
claim out is an error, as it is for kubelet. ``restart()`` drops every plugin
and reads the directory anew, as a restarted kubelet does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from gpuslice_common.models import ClaimRef
from gpuslice_deviceplugin.dra.api import dra_pb2 as dra_pb
from gpuslice_deviceplugin.dra.api import dra_pb2_grpc as dra_grpc
from gpuslice_deviceplugin.dra.api import pluginregistration_pb2 as reg_pb
from gpuslice_deviceplugin.dra.api import pluginregistration_pb2_grpc as reg_grpc
from gpuslice_deviceplugin.dra.contract import PreparedDevice

log = logging.getLogger(__name__)

PLUGIN_TYPE = "DRAPlugin"
SERVICES = ("v1.DRAPlugin",)  # the DRA services this stand-in calls, newest first
CALL_TIMEOUT_S = 45.0  # kubelet's default deadline for a DRA plugin's calls
REGISTRATION_TIMEOUT_S = 10.0


class DraKubeletError(Exception):
    """The plugin answered in a way kubelet does not accept."""


@dataclass(frozen=True)
class PreparedClaim:
    """A claim the plugin prepared: the devices kubelet hands the containers."""

    devices: tuple[PreparedDevice, ...]


@dataclass
class DraPlugin:
    """One registered plugin of a DRA driver as kubelet holds it."""

    registration_socket: Path
    info: reg_pb.PluginInfo
    service: str
    channel: grpc.aio.Channel
    stub: dra_grpc.DRAPluginAsyncStub = field(init=False)

    def __post_init__(self) -> None:
        self.stub = dra_grpc.DRAPluginStub(self.channel)

    @property
    def driver(self) -> str:
        return self.info.name

    @property
    def endpoint(self) -> str:
        return self.info.endpoint


def _claims(claims: Sequence[ClaimRef]) -> list[dra_pb.Claim]:
    return [dra_pb.Claim(namespace=c.namespace, name=c.name, uid=c.uid) for c in claims]


def _check_answered(
    asked: Sequence[ClaimRef], answered: Sequence[str], driver: str, method: str
) -> None:
    missing = sorted({c.uid for c in asked} - set(answered))
    extra = sorted(set(answered) - {c.uid for c in asked})
    if missing or extra:
        raise DraKubeletError(
            f"{method} of DRA driver {driver}: claims left out {missing}, claims not asked {extra}"
        )


class DevDraKubelet:
    def __init__(self, registry_dir: Path, poll_s: float = 0.05) -> None:
        self.registry_dir = registry_dir
        self.poll_s = poll_s
        self.plugins: list[DraPlugin] = []  # in the order they registered
        self.refusals: list[str] = []
        self.registrations = 0  # plugins registered, restarts included
        self.changed = asyncio.Condition()
        self._seen: dict[Path, tuple[int, int]] = {}
        self._watcher: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.registry_dir.mkdir(parents=True, exist_ok=True)
        self._watcher = asyncio.create_task(self._watch(), name="dra-kubelet-watch")

    async def stop(self) -> None:
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        for plugin in self.plugins:
            await plugin.channel.close()
        self.plugins.clear()
        self._seen.clear()

    async def restart(self) -> None:
        """Forget every plugin and read the registry directory anew."""
        await self.stop()
        await self.start()

    # the plugin watcher

    async def _watch(self) -> None:
        while True:
            await self._scan()
            await asyncio.sleep(self.poll_s)

    async def _scan(self) -> None:
        present: dict[Path, tuple[int, int]] = {}
        with contextlib.suppress(FileNotFoundError):
            for path in self.registry_dir.iterdir():
                if path.name.startswith("."):
                    continue
                with contextlib.suppress(OSError):
                    st = os.lstat(path)
                    if stat.S_ISSOCK(st.st_mode):
                        present[path] = (st.st_dev, st.st_ino)
        for path, identity in list(self._seen.items()):
            if present.get(path) != identity:
                del self._seen[path]
                await self._deregister(path)
        for path, identity in present.items():
            if path not in self._seen:
                self._seen[path] = identity
                await self._register(path)

    async def _deregister(self, path: Path) -> None:
        async with self.changed:
            for plugin in [p for p in self.plugins if p.registration_socket == path]:
                self.plugins.remove(plugin)
                await plugin.channel.close()
            self.changed.notify_all()

    async def _register(self, path: Path) -> None:
        async with grpc.aio.insecure_channel(f"unix://{path}") as channel:
            stub = reg_grpc.RegistrationStub(channel)
            try:
                info = await stub.GetInfo(reg_pb.InfoRequest(), timeout=REGISTRATION_TIMEOUT_S)
            except grpc.aio.AioRpcError as exc:
                await self._refuse(f"{path}: GetInfo failed: {exc.code().name}: {exc.details()}")
                return
            problem = self._problem(info)
            if problem is not None:
                await self._refuse(f"{path}: {problem}")
                with contextlib.suppress(grpc.aio.AioRpcError):
                    await stub.NotifyRegistrationStatus(
                        reg_pb.RegistrationStatus(plugin_registered=False, error=problem),
                        timeout=REGISTRATION_TIMEOUT_S,
                    )
                return
            service = next(s for s in info.supported_versions if s in SERVICES)
            endpoint = info.endpoint or str(path)
            plugin = DraPlugin(path, info, service, grpc.aio.insecure_channel(f"unix://{endpoint}"))
            async with self.changed:
                self.plugins.append(plugin)
                self.registrations += 1
                self.changed.notify_all()
            try:
                await stub.NotifyRegistrationStatus(
                    reg_pb.RegistrationStatus(plugin_registered=True),
                    timeout=REGISTRATION_TIMEOUT_S,
                )
            except grpc.aio.AioRpcError as exc:
                log.warning("NotifyRegistrationStatus on %s failed: %s", path, exc.code().name)

    def _problem(self, info: reg_pb.PluginInfo) -> str | None:
        if info.type != PLUGIN_TYPE:
            return f"plugin type {info.type!r} is not {PLUGIN_TYPE!r}"
        if not info.name:
            return "the plugin names no DRA driver"
        if not info.supported_versions:
            return "empty list of supported gRPC services (aka supported versions)"
        if not any(s in SERVICES for s in info.supported_versions):
            return (
                f"none of the services supported by the plugin ({list(info.supported_versions)}) "
                f"are supported by the kubelet ({list(SERVICES)})"
            )
        if any(p.driver == info.name and p.endpoint == info.endpoint for p in self.plugins):
            return f"endpoint {info.endpoint} already registered for DRA driver {info.name}"
        return None

    async def _refuse(self, problem: str) -> None:
        async with self.changed:
            self.refusals.append(problem)
            self.changed.notify_all()

    # what tests wait for

    def plugin_for(self, driver: str) -> DraPlugin | None:
        """The latest registered plugin of ``driver``, as kubelet picks it."""
        for plugin in reversed(self.plugins):
            if plugin.driver == driver:
                return plugin
        return None

    async def registration(self, driver: str, number: int = 1, timeout: float = 10.0) -> DraPlugin:
        """The plugin of ``driver`` once ``number`` registrations happened in all."""
        async with self.changed:
            await asyncio.wait_for(
                self.changed.wait_for(
                    lambda: self.registrations >= number and self.plugin_for(driver) is not None
                ),
                timeout,
            )
            plugin = self.plugin_for(driver)
            assert plugin is not None
            return plugin

    async def refusal(self, number: int = 1, timeout: float = 10.0) -> str:
        """The ``number``-th refused registration (1 = the first), waiting for it."""
        async with self.changed:
            await asyncio.wait_for(
                self.changed.wait_for(lambda: len(self.refusals) >= number), timeout
            )
            return self.refusals[number - 1]

    async def gone(self, driver: str, timeout: float = 10.0) -> None:
        """Wait until no plugin of ``driver`` is registered."""
        async with self.changed:
            await asyncio.wait_for(
                self.changed.wait_for(lambda: self.plugin_for(driver) is None), timeout
            )

    # the DRA calls

    def _plugin(self, driver: str) -> DraPlugin:
        plugin = self.plugin_for(driver)
        if plugin is None:
            raise DraKubeletError(f"DRA driver {driver} is not registered")
        return plugin

    async def prepare(
        self, driver: str, claims: Sequence[ClaimRef], timeout: float = CALL_TIMEOUT_S
    ) -> dict[str, PreparedClaim | str]:
        """NodePrepareResources for one pod's ``claims`` of ``driver``: by claim uid,
        the prepared devices or the error the plugin gave. A failed call raises
        grpc.aio.AioRpcError."""
        plugin = self._plugin(driver)
        response = await plugin.stub.NodePrepareResources(
            dra_pb.NodePrepareResourcesRequest(claims=_claims(claims)), timeout=timeout
        )
        _check_answered(claims, list(response.claims), driver, "NodePrepareResources")
        answers: dict[str, PreparedClaim | str] = {}
        for uid, answer in response.claims.items():
            if answer.error:
                answers[uid] = answer.error
                continue
            answers[uid] = PreparedClaim(
                tuple(
                    PreparedDevice(
                        request_names=tuple(d.request_names),
                        pool=d.pool_name,
                        device=d.device_name,
                        cdi_ids=tuple(d.cdi_device_ids),
                    )
                    for d in answer.devices
                )
            )
        return answers

    async def unprepare(
        self, driver: str, claims: Sequence[ClaimRef], timeout: float = CALL_TIMEOUT_S
    ) -> dict[str, str | None]:
        """NodeUnprepareResources for ``claims`` of ``driver``: by claim uid, None
        when unprepared, else the plugin's error."""
        plugin = self._plugin(driver)
        response = await plugin.stub.NodeUnprepareResources(
            dra_pb.NodeUnprepareResourcesRequest(claims=_claims(claims)), timeout=timeout
        )
        _check_answered(claims, list(response.claims), driver, "NodeUnprepareResources")
        return {uid: answer.error or None for uid, answer in response.claims.items()}
