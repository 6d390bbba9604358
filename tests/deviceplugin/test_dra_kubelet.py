"""kubelet's DRA plugin API served by the agent, driven by the stand-in kubelet
over real gRPC on unix sockets, with a preparer that records and can refuse."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import stat
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from prometheus_client import CollectorRegistry

from gpuslice_cli.dev.drakubelet import DevDraKubelet, PreparedClaim
from gpuslice_common.dra import DRIVER, device_name
from gpuslice_common.models import ClaimRef
from gpuslice_deviceplugin.dra.api import dra_pb2 as dra_pb
from gpuslice_deviceplugin.dra.api import pluginregistration_pb2 as reg_pb
from gpuslice_deviceplugin.dra.api import pluginregistration_pb2_grpc as reg_grpc
from gpuslice_deviceplugin.dra.contract import ClaimError, PreparedDevice
from gpuslice_deviceplugin.dra.kubelet import (
    INTERNAL_ERROR,
    MAX_CLAIMS,
    SERVICE,
    DraPluginServer,
    SocketError,
)
from gpuslice_deviceplugin.metrics import DraMetrics

UUID = "GPU-0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"
NODE = "node-a"


def claim(n: int) -> ClaimRef:
    return ClaimRef(
        namespace="team", name=f"claim-{n}", uid=f"0000000{n}-aaaa-bbbb-cccc-dddddddddddd"
    )


@dataclass
class Preparer:
    """Records what it is asked; refuses or fails claims by uid on demand."""

    prepared: list[ClaimRef] = field(default_factory=list)
    unprepared: list[ClaimRef] = field(default_factory=list)
    refuse: dict[str, str] = field(default_factory=dict)
    crash: set[str] = field(default_factory=set)
    malformed: set[str] = field(default_factory=set)  # answers devices kubelet cannot take

    def _check(self, claim: ClaimRef) -> None:
        if claim.uid in self.crash:
            raise RuntimeError(f"the preparer broke on {claim.uid}")
        if claim.uid in self.refuse:
            raise ClaimError(self.refuse[claim.uid])

    async def prepare(self, claim: ClaimRef) -> Sequence[PreparedDevice]:
        self.prepared.append(claim)
        self._check(claim)
        if claim.uid in self.malformed:
            return [PreparedDevice(request_names=(), pool=NODE, device=7, cdi_ids=())]  # type: ignore[arg-type]
        return [
            PreparedDevice(
                request_names=("main",),
                pool=NODE,
                device=device_name(UUID),
                cdi_ids=(f"gpuslice.io/container={claim.uid}-main",),
            )
        ]

    async def unprepare(self, claim: ClaimRef) -> None:
        self.unprepared.append(claim)
        self._check(claim)


@dataclass
class Rig:
    server: DraPluginServer
    kubelet: DevDraKubelet
    preparer: Preparer
    registry: CollectorRegistry

    def count(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0


def new_server(base: Path, preparer: Preparer, registry: CollectorRegistry) -> DraPluginServer:
    return DraPluginServer(
        preparer,
        base / "plugins",
        base / "plugins_registry",
        metrics=DraMetrics(registry),
        poll_s=0.05,
    )


@pytest.fixture
async def rig(short_dir: Path) -> AsyncIterator[Rig]:
    preparer = Preparer()
    registry = CollectorRegistry()
    server = new_server(short_dir, preparer, registry)
    kubelet = DevDraKubelet(short_dir / "plugins_registry")
    await server.start()
    await kubelet.start()
    yield Rig(server, kubelet, preparer, registry)
    await kubelet.stop()
    await server.stop(0)


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


async def reappears(path: Path) -> None:
    """Wait until a socket is at ``path`` again (its inode may be the old one's)."""
    async with asyncio.timeout(10):
        while True:
            try:
                if stat.S_ISSOCK(os.lstat(path).st_mode):
                    return
            except FileNotFoundError:
                pass
            await asyncio.sleep(0.02)


def answers_connect(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(str(path))
        except ConnectionRefusedError:
            return False
    return True


async def test_registration_handshake(rig: Rig, short_dir: Path) -> None:
    plugin = await rig.kubelet.registration(DRIVER)
    assert plugin.info.type == "DRAPlugin"
    assert plugin.info.name == DRIVER
    assert list(plugin.info.supported_versions) == ["v1.DRAPlugin"]
    assert plugin.service == SERVICE
    endpoint = short_dir / "plugins" / DRIVER / "dra.sock"
    assert plugin.endpoint == str(endpoint)
    assert plugin.registration_socket == short_dir / "plugins_registry" / f"{DRIVER}-reg.sock"
    await asyncio.wait_for(rig.server.registered.wait(), 10)
    assert rig.count("gpuslice_dra_registrations_total", outcome="ok") == 1
    # the methods kubelet calls, by their wire names
    service = dra_pb.DESCRIPTOR.services_by_name["DRAPlugin"]
    assert service.full_name == "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin"
    assert f"{dra_pb.DESCRIPTOR.package.rsplit('.', 1)[-1]}.{service.name}" == SERVICE
    assert reg_pb.DESCRIPTOR.services_by_name["Registration"].full_name == (
        "pluginregistration.Registration"
    )
    # only the agent's user reaches the sockets; its directory is not world-readable
    assert mode(endpoint) == 0o600
    assert mode(plugin.registration_socket) == 0o600
    assert mode(endpoint.parent) == 0o750
    assert rig.kubelet.refusals == []


async def test_prepare_and_unprepare_round_trip(rig: Rig) -> None:
    await rig.kubelet.registration(DRIVER)
    a, b = claim(1), claim(2)
    answers = await rig.kubelet.prepare(DRIVER, [a, b])
    assert set(answers) == {a.uid, b.uid}
    for ref in (a, b):
        prepared = answers[ref.uid]
        assert isinstance(prepared, PreparedClaim)
        assert prepared.devices == (
            PreparedDevice(
                request_names=("main",),
                pool=NODE,
                device=device_name(UUID),
                cdi_ids=(f"gpuslice.io/container={ref.uid}-main",),
            ),
        )
    assert sorted(rig.preparer.prepared, key=lambda c: c.uid) == [a, b]
    assert await rig.kubelet.unprepare(DRIVER, [a, b]) == {a.uid: None, b.uid: None}
    assert sorted(rig.preparer.unprepared, key=lambda c: c.uid) == [a, b]
    assert rig.count("gpuslice_dra_claims_total", operation="prepare", outcome="ok") == 2
    assert rig.count("gpuslice_dra_claims_total", operation="unprepare", outcome="ok") == 2
    assert rig.count("gpuslice_dra_claim_seconds_count", operation="prepare") == 2


async def test_a_refused_claim_leaves_the_other_answered(rig: Rig) -> None:
    await rig.kubelet.registration(DRIVER)
    a, b = claim(1), claim(2)
    rig.preparer.refuse[a.uid] = "device gpu-x is not on this node"
    answers = await rig.kubelet.prepare(DRIVER, [a, b])
    assert answers[a.uid] == "device gpu-x is not on this node"
    assert isinstance(answers[b.uid], PreparedClaim)
    rig.preparer.refuse[b.uid] = "the inventory is unreachable"
    assert await rig.kubelet.unprepare(DRIVER, [a, b]) == {
        a.uid: "device gpu-x is not on this node",
        b.uid: "the inventory is unreachable",
    }
    assert rig.count("gpuslice_dra_claims_total", operation="prepare", outcome="refused") == 1
    assert rig.count("gpuslice_dra_claims_total", operation="unprepare", outcome="refused") == 2


async def test_invalid_claim_fields_are_named_and_nothing_is_prepared(rig: Rig) -> None:
    plugin = await rig.kubelet.registration(DRIVER)
    good = claim(1)
    request = dra_pb.NodePrepareResourcesRequest(
        claims=[
            dra_pb.Claim(namespace="Bad_NS", name="c", uid="11111111-0000-0000-0000-000000000000"),
            dra_pb.Claim(
                namespace="team", name="x/../y", uid="22222222-0000-0000-0000-000000000000"
            ),
            dra_pb.Claim(namespace="team", name="c", uid=""),
            dra_pb.Claim(namespace="team", name="a", uid="33333333-0000-0000-0000-000000000000"),
            dra_pb.Claim(namespace="team", name="b", uid="33333333-0000-0000-0000-000000000000"),
            dra_pb.Claim(namespace=good.namespace, name=good.name, uid=good.uid),
        ]
    )
    response = await plugin.stub.NodePrepareResources(request, timeout=10)
    errors = {uid: answer.error for uid, answer in response.claims.items()}
    assert errors["11111111-0000-0000-0000-000000000000"].startswith("invalid claim: namespace")
    assert errors["22222222-0000-0000-0000-000000000000"].startswith("invalid claim: name")
    assert errors[""].startswith("invalid claim: uid")
    assert "more than once" in errors["33333333-0000-0000-0000-000000000000"]
    assert errors[good.uid] == ""
    assert len(response.claims[good.uid].devices) == 1
    assert rig.preparer.prepared == [good]
    unprepare = await plugin.stub.NodeUnprepareResources(
        dra_pb.NodeUnprepareResourcesRequest(
            claims=[dra_pb.Claim(namespace="team", name="UPPER", uid=good.uid)]
        ),
        timeout=10,
    )
    assert unprepare.claims[good.uid].error.startswith("invalid claim: name")
    assert rig.preparer.unprepared == []
    assert rig.count("gpuslice_dra_claims_total", operation="prepare", outcome="invalid") == 4


async def test_a_crashing_preparer_gives_an_error_answer_and_the_server_goes_on(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    await rig.kubelet.registration(DRIVER)
    a, b = claim(1), claim(2)
    rig.preparer.crash.add(a.uid)
    caplog.set_level(logging.INFO)
    answers = await rig.kubelet.prepare(DRIVER, [a, b])
    assert answers[a.uid] == INTERNAL_ERROR
    assert "broke" not in INTERNAL_ERROR  # the exception's text stays in the log
    assert isinstance(answers[b.uid], PreparedClaim)
    crashes = [r for r in caplog.records if r.exc_info and "failed to prepare" in r.getMessage()]
    assert len(crashes) == 1
    assert rig.count("gpuslice_dra_claims_total", operation="prepare", outcome="error") == 1
    rig.preparer.crash.clear()
    again = await rig.kubelet.prepare(DRIVER, [a])
    assert isinstance(again[a.uid], PreparedClaim)
    # devices that do not make a protobuf answer are the agent's fault too
    rig.preparer.malformed.add(b.uid)
    answers = await rig.kubelet.prepare(DRIVER, [a, b])
    assert answers[b.uid] == INTERNAL_ERROR
    assert isinstance(answers[a.uid], PreparedClaim)
    assert rig.count("gpuslice_dra_claims_total", operation="prepare", outcome="error") == 2


async def test_too_many_claims_are_refused_whole(rig: Rig) -> None:
    plugin = await rig.kubelet.registration(DRIVER)
    claims = [
        dra_pb.Claim(namespace="team", name=f"c{i}", uid=f"{i:08d}-0000-0000-0000-000000000000")
        for i in range(MAX_CLAIMS + 1)
    ]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await plugin.stub.NodePrepareResources(
            dra_pb.NodePrepareResourcesRequest(claims=claims), timeout=10
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"at most {MAX_CLAIMS}" in str(err.value.details())
    assert rig.preparer.prepared == []
    assert rig.count("gpuslice_dra_refused_calls_total") == 1


async def test_undecodable_bytes_are_refused_and_the_server_goes_on(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    plugin = await rig.kubelet.registration(DRIVER)
    caplog.set_level(logging.DEBUG)
    for method in ("NodePrepareResources", "NodeUnprepareResources"):
        raw = plugin.channel.unary_unary(
            f"/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/{method}",
            request_serializer=lambda b: b,
            response_deserializer=lambda b: b,
        )
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await raw(b"\x0a\xff", timeout=10)  # a length past the end
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"not a valid k8s.io.kubelet.pkg.apis.dra.v1.{method}Request" in str(
            err.value.details()
        )
    assert rig.preparer.prepared == []
    assert "Traceback" not in caplog.text
    answers = await rig.kubelet.prepare(DRIVER, [claim(1)])
    assert isinstance(answers[claim(1).uid], PreparedClaim)


async def test_kubelet_told_of_a_failed_registration_is_logged(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    plugin = await rig.kubelet.registration(DRIVER)
    await asyncio.wait_for(rig.server.registered.wait(), 10)
    async with grpc.aio.insecure_channel(f"unix://{plugin.registration_socket}") as channel:
        await reg_grpc.RegistrationStub(channel).NotifyRegistrationStatus(
            reg_pb.RegistrationStatus(plugin_registered=False, error="driver name clash"),
            timeout=10,
        )
    assert not rig.server.registered.is_set()
    refused = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert any("driver name clash" in r.getMessage() for r in refused)
    assert rig.count("gpuslice_dra_registrations_total", outcome="error") == 1


async def test_a_deleted_registration_socket_is_served_again(rig: Rig) -> None:
    plugin = await rig.kubelet.registration(DRIVER)
    reg = plugin.registration_socket
    reg.unlink()
    await reappears(reg)
    # a kubelet reading the directory now registers the driver again
    await rig.kubelet.restart()
    again = await rig.kubelet.registration(DRIVER, number=2)
    assert again.registration_socket == reg
    assert mode(reg) == 0o600
    answers = await rig.kubelet.prepare(DRIVER, [claim(1)])
    assert isinstance(answers[claim(1).uid], PreparedClaim)


async def test_a_deleted_plugin_socket_is_served_again(rig: Rig, short_dir: Path) -> None:
    await rig.kubelet.registration(DRIVER)
    endpoint = short_dir / "plugins" / DRIVER / "dra.sock"
    endpoint.unlink()
    await reappears(endpoint)
    await rig.kubelet.restart()
    await rig.kubelet.registration(DRIVER, number=2)
    answers = await rig.kubelet.prepare(DRIVER, [claim(1)])
    assert isinstance(answers[claim(1).uid], PreparedClaim)


def leave_stale_socket(path: Path) -> None:
    """A socket file nobody listens on, as a killed agent leaves behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(path))


async def test_stale_sockets_are_replaced(short_dir: Path) -> None:
    plugin_socket = short_dir / "plugins" / DRIVER / "dra.sock"
    reg_socket = short_dir / "plugins_registry" / f"{DRIVER}-reg.sock"
    leave_stale_socket(plugin_socket)
    leave_stale_socket(reg_socket)
    assert not answers_connect(reg_socket)
    assert not answers_connect(plugin_socket)
    server = new_server(short_dir, Preparer(), CollectorRegistry())
    kubelet = DevDraKubelet(short_dir / "plugins_registry")
    await server.start()
    try:
        assert answers_connect(reg_socket)
        assert answers_connect(plugin_socket)
        await kubelet.start()
        await kubelet.registration(DRIVER)
        answers = await kubelet.prepare(DRIVER, [claim(1)])
        assert isinstance(answers[claim(1).uid], PreparedClaim)
    finally:
        await kubelet.stop()
        await server.stop(0)


@pytest.mark.parametrize("what", ["symlink", "file"])
async def test_something_else_in_place_of_the_socket_is_refused(short_dir: Path, what: str) -> None:
    reg_socket = short_dir / "plugins_registry" / f"{DRIVER}-reg.sock"
    reg_socket.parent.mkdir(parents=True)
    target = short_dir / "elsewhere"
    target.write_text("not ours")
    if what == "symlink":
        reg_socket.symlink_to(target)
    else:
        reg_socket.write_text("not a socket")
    server = new_server(short_dir, Preparer(), CollectorRegistry())
    with pytest.raises(SocketError) as err:
        await server.start()
    assert str(reg_socket) in str(err.value)
    assert ("symlink" if what == "symlink" else "not a socket") in str(err.value)
    assert target.read_text() == "not ours"
    assert reg_socket.is_symlink() if what == "symlink" else reg_socket.is_file()
    # nothing is left listening: the plugin socket that did start is gone again
    assert not (short_dir / "plugins" / DRIVER / "dra.sock").exists()
    await server.stop()


async def test_stop_is_idempotent_and_removes_the_sockets(rig: Rig, short_dir: Path) -> None:
    await rig.kubelet.registration(DRIVER)
    await rig.server.stop()
    await rig.server.stop()
    assert not (short_dir / "plugins" / DRIVER / "dra.sock").exists()
    assert not (short_dir / "plugins_registry" / f"{DRIVER}-reg.sock").exists()
    await rig.kubelet.gone(DRIVER)
    # and it serves again after a stop
    await rig.server.start()
    await rig.kubelet.registration(DRIVER, number=2)
    answers = await rig.kubelet.prepare(DRIVER, [claim(1)])
    assert isinstance(answers[claim(1).uid], PreparedClaim)


async def test_a_second_start_is_refused(rig: Rig) -> None:
    with pytest.raises(RuntimeError, match="already running"):
        await rig.server.start()


class BogusRegistration(reg_grpc.RegistrationServicer):
    """A registration socket kubelet must refuse, which hears why."""

    def __init__(self, info: reg_pb.PluginInfo) -> None:
        self.info = info
        self.statuses: list[reg_pb.RegistrationStatus] = []
        self.told = asyncio.Event()

    async def GetInfo(self, request: reg_pb.InfoRequest, context: object) -> reg_pb.PluginInfo:
        return self.info

    async def NotifyRegistrationStatus(
        self, request: reg_pb.RegistrationStatus, context: object
    ) -> reg_pb.RegistrationStatusResponse:
        self.statuses.append(request)
        self.told.set()
        return reg_pb.RegistrationStatusResponse()


@pytest.mark.parametrize(
    ("info", "problem"),
    [
        (
            reg_pb.PluginInfo(type="CSIPlugin", name="x.io", supported_versions=["v1.DRAPlugin"]),
            "plugin type 'CSIPlugin'",
        ),
        (
            reg_pb.PluginInfo(type="DRAPlugin", name="x.io", supported_versions=["v9.DRAPlugin"]),
            "none of the services",
        ),
        (reg_pb.PluginInfo(type="DRAPlugin", name="x.io"), "empty list of supported"),
    ],
)
async def test_the_stand_in_kubelet_refuses_what_kubelet_refuses(
    short_dir: Path, info: reg_pb.PluginInfo, problem: str
) -> None:
    registry = short_dir / "plugins_registry"
    registry.mkdir()
    bogus = BogusRegistration(info)
    server = grpc.aio.server()
    reg_grpc.add_RegistrationServicer_to_server(bogus, server)
    server.add_insecure_port(f"unix://{registry / 'x.io-reg.sock'}")
    await server.start()
    kubelet = DevDraKubelet(registry)
    await kubelet.start()
    try:
        assert problem in await kubelet.refusal()
        assert kubelet.plugin_for("x.io") is None
        await asyncio.wait_for(bogus.told.wait(), 10)
        assert not bogus.statuses[0].plugin_registered
        assert problem in bogus.statuses[0].error
    finally:
        await kubelet.stop()
        await server.stop(0)


async def test_a_symlink_in_place_of_the_driver_directory_is_refused(short_dir: Path) -> None:
    elsewhere = short_dir / "elsewhere"
    elsewhere.mkdir()
    (short_dir / "plugins").mkdir()
    (short_dir / "plugins" / DRIVER).symlink_to(elsewhere)
    server = new_server(short_dir, Preparer(), CollectorRegistry())
    with pytest.raises(SocketError, match="is a symlink"):
        await server.start()
    assert list(elsewhere.iterdir()) == []
    assert not (short_dir / "plugins_registry" / f"{DRIVER}-reg.sock").exists()
