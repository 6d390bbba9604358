"""Claims prepared from the inventory's answer over a real NATS server: container
directories and a CDI spec equal to what Allocate gives, idempotence, unprepare
after a restart, and refusals that leave nothing behind.

The inventory's side of prepare/unprepare is stood in for by a responder that
answers with the node API's own models.
"""

from __future__ import annotations

import asyncio
import json
import re
import stat
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from nats.aio.msg import Msg

from gpuslice_common.bus import Bus
from gpuslice_common.config import DevicePluginSettings
from gpuslice_common.dra import CDI_KIND, device_name
from gpuslice_common.grant import parse as parse_grant
from gpuslice_common.models import (
    ClaimRef,
    ContainerAssignment,
    DeviceGrant,
    MigGrant,
    MigPlacement,
    Placement,
    PlacementState,
    PodRef,
)
from gpuslice_common.nodeapi import (
    AllocationReply,
    ClaimDevice,
    ClaimReply,
    Done,
    ErrorKind,
    ErrorReply,
    PrepareRequest,
    UnprepareRequest,
)
from gpuslice_common.servers import NatsServer
from gpuslice_common.subjects import Subjects
from gpuslice_deviceplugin.allocation import PRELOAD_PATH, answer, grant
from gpuslice_deviceplugin.containers import ContainerOwner, HostDir
from gpuslice_deviceplugin.dra.claims import CDI_VERSION, Claims, cdi_file, container_edits
from gpuslice_deviceplugin.dra.contract import ClaimError
from gpuslice_deviceplugin.gateway import InventoryGateway
from gpuslice_deviceplugin.nodeconfig import NodeConfig
from tests.deviceplugin.conftest import NODE

GPU0 = "GPU-00000000-1111-2222-3333-444455556666"
GPU1 = "GPU-00000001-1111-2222-3333-444455556666"
CLAIM = ClaimRef(namespace="team", name="trainer-gpu-x7k2p", uid="c1a1m-0001")
POD = PodRef(uid="0d1e2f3a-4b5c-6d7e-8f90-a1b2c3d4e5f6", namespace="team", name="trainer")
TOKEN = "telemetry-token-of-the-pod"


def placement(*, claim: ClaimRef = CLAIM, node: str = NODE, mig: bool = False) -> Placement:
    first = DeviceGrant(
        uuid=GPU0,
        memory_mib=4096,
        cores=30,
        mig=MigGrant(profile="1g.5gb", placement=MigPlacement(start=0, size=1)) if mig else None,
    )
    return Placement(
        pod=POD,
        node=node,
        containers=(
            ContainerAssignment(name="main", devices=(first,)),
            ContainerAssignment(
                name="helper",
                devices=(
                    DeviceGrant(uuid=GPU0, memory_mib=1024, cores=0),
                    DeviceGrant(uuid=GPU1, memory_mib=2048, cores=50),
                ),
                priority=0,
            ),
        ),
        state=PlacementState.ALLOCATED,
        claim=claim,
    )


def claim_reply(**changes: Any) -> ClaimReply:
    devices = (
        ClaimDevice(
            request="main", pool=NODE, device=device_name(GPU0), uuid=GPU0, container="main"
        ),
        ClaimDevice(
            request="helper", pool=NODE, device=device_name(GPU0), uuid=GPU0, container="helper"
        ),
        ClaimDevice(
            request="helper", pool=NODE, device=device_name(GPU1), uuid=GPU1, container="helper"
        ),
    )
    values: dict[str, Any] = {
        "claim": CLAIM,
        "placement": placement(),
        "devices": devices,
        "telemetry_token": TOKEN,
    }
    values.update(changes)
    return ClaimReply(**values)


@dataclass
class Inventory:
    """Stands in for the inventory's prepare and unprepare: answers what it is told."""

    prepare: bytes = b""
    unprepare: bytes = Done().model_dump_json().encode()
    prepared: list[PrepareRequest] = field(default_factory=list)
    unprepared: list[UnprepareRequest] = field(default_factory=list)

    def answer_prepare(self, reply: Any) -> None:
        self.prepare = reply if isinstance(reply, bytes) else reply.model_dump_json().encode()

    async def on_prepare(self, msg: Msg) -> None:
        self.prepared.append(PrepareRequest.model_validate_json(msg.data))
        await msg.respond(self.prepare)

    async def on_unprepare(self, msg: Msg) -> None:
        self.unprepared.append(UnprepareRequest.model_validate_json(msg.data))
        await msg.respond(self.unprepare)


@pytest.fixture
async def stand_in(bus: Bus, prefix: str) -> AsyncIterator[Inventory]:
    responder = Inventory()
    responder.answer_prepare(claim_reply())
    subjects = Subjects(prefix)
    subs = [
        await bus.nc.subscribe(subjects.node_request(NODE, "prepare"), cb=responder.on_prepare),
        await bus.nc.subscribe(subjects.node_request(NODE, "unprepare"), cb=responder.on_unprepare),
    ]
    await bus.flush()
    yield responder
    for sub in subs:
        await sub.unsubscribe()


@pytest.fixture
def settings(tmp_path: Path, nats_server: NatsServer, prefix: str) -> DevicePluginSettings:
    return DevicePluginSettings(
        node_name=NODE,
        host_dir=str(tmp_path / "host"),
        cdi_dir=str(tmp_path / "cdi"),
        nats_url=nats_server.url,
        subject_prefix=prefix,
        kube_api="none",
        dra=True,
        inventory_timeout="500ms",
        allocate_timeout="2s",
    )


CONFIG = NodeConfig()


def record_tag(settings: DevicePluginSettings) -> str:
    """The secret suffix of the claim's CDI device names, from the agent's record."""
    tag = str(
        json.loads((Path(settings.host_dir) / "dra" / f"{CLAIM.uid}.json").read_text())["tag"]
    )
    assert re.fullmatch(r"[0-9a-f]{32}", tag)
    return tag


def claims(settings: DevicePluginSettings, bus: Bus) -> Claims:
    """A new agent's claims (the same directories each time)."""
    host = HostDir(Path(settings.host_dir))
    return Claims(settings, InventoryGateway(settings, bus), host, lambda: CONFIG)


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def listing(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*")) if path.exists() else []


def allocate_answer(settings: DevicePluginSettings, index: int) -> tuple[dict[str, Any], str]:
    """The CDI edits and the grant text Allocate gives container ``index`` of the pod."""
    allocation = AllocationReply(
        placement=placement(), container_index=index, telemetry_token=TOKEN
    )
    host = HostDir(Path(settings.host_dir))
    response = answer(allocation, settings, CONFIG, host, control=True)
    return container_edits(response), grant(allocation, settings, CONFIG, control=True).render()


async def test_prepare_writes_what_allocate_gives_each_container(
    settings: DevicePluginSettings, bus: Bus, stand_in: Inventory
) -> None:
    prepared = await claims(settings, bus).prepare(CLAIM)
    assert stand_in.prepared == [PrepareRequest(claim=CLAIM)]
    tag = record_tag(settings)
    main_id = f"{CDI_KIND}={POD.uid}-main-{tag}"
    helper_id = f"{CDI_KIND}={POD.uid}-helper-{tag}"
    assert [(d.request_names, d.pool, d.device, d.cdi_ids) for d in prepared] == [
        (("main",), NODE, device_name(GPU0), (main_id,)),
        (("helper",), NODE, device_name(GPU0), (helper_id,)),
        (("helper",), NODE, device_name(GPU1), ()),  # the container has its edits once
    ]
    spec_path = cdi_file(Path(settings.cdi_dir), CLAIM)
    assert spec_path.name == f"gpuslice.io-{CLAIM.uid}.json"
    assert mode_of(spec_path) == 0o600  # it carries the telemetry tokens
    spec = read_json(spec_path)
    assert spec["cdiVersion"] == CDI_VERSION
    assert spec["kind"] == CDI_KIND == "gpuslice.io/container"
    by_name = {d["name"]: d["containerEdits"] for d in spec["devices"]}
    assert sorted(by_name) == sorted([f"{POD.uid}-main-{tag}", f"{POD.uid}-helper-{tag}"])
    host = HostDir(Path(settings.host_dir))
    for index, name in enumerate(("main", "helper")):
        edits, grant_text = allocate_answer(settings, index)
        assert by_name[f"{POD.uid}-{name}-{tag}"] == edits
        directory = host.container_dir(POD.uid, name)
        assert (directory / "grant").read_text() == grant_text
        owner = ContainerOwner.from_json((directory / "owner.json").read_bytes())
        assert (owner.pod_uid, owner.namespace, owner.pod_name, owner.container) == (
            POD.uid,
            "team",
            "trainer",
            name,
        )
        assert (directory / "region").exists()
    # what the runtime gets, spelled out for the main container
    main = by_name[f"{POD.uid}-main-{tag}"]
    env = dict(e.split("=", 1) for e in main["env"])
    assert env["NVIDIA_VISIBLE_DEVICES"] == GPU0
    assert env["GPUSLICE_POD_UID"] == POD.uid
    assert env["GPUSLICE_CONTAINER_NAME"] == "main"
    assert env["GPUSLICE_NATS_TOKEN"] == TOKEN
    assert env["CUDA_DEVICE_MEMORY_LIMIT_0"] == "4096m"
    assert env["CUDA_DEVICE_SM_LIMIT"] == "30"
    mounts = {m["containerPath"]: m for m in main["mounts"]}
    assert mounts[PRELOAD_PATH]["options"][0] == "ro"
    assert mounts["/run/gpuslice/region"]["options"][0] == "rw"
    assert mounts["/run/gpuslice/region"]["hostPath"] == str(
        host.container_dir(POD.uid, "main") / "region"
    )
    assert all("bind" in m["options"] and m["type"] == "bind" for m in main["mounts"])
    grants = {g.uuid: g for g in parse_grant(read_text(host, "helper")).devices}
    assert (grants[GPU1].memory_bytes, grants[GPU1].sm_percent) == (2048 << 20, 50)


def read_text(host: HostDir, container: str) -> str:
    return (host.container_dir(POD.uid, container) / "grant").read_text()


async def test_prepare_again_gives_the_same_answer(
    settings: DevicePluginSettings, bus: Bus, stand_in: Inventory
) -> None:
    first = await claims(settings, bus).prepare(CLAIM)
    spec = read_json(cdi_file(Path(settings.cdi_dir), CLAIM))
    again = await claims(settings, bus).prepare(CLAIM)
    assert again == first
    assert read_json(cdi_file(Path(settings.cdi_dir), CLAIM)) == spec
    assert len(stand_in.prepared) == 2


async def test_every_container_gets_the_preload(
    settings: DevicePluginSettings, bus: Bus, stand_in: Inventory
) -> None:
    """In DRA mode no webhook may have checked the pod (a hand-written claim), and
    whether a card stays unshared is kube-scheduler's to decide later: the
    interposer is always preloaded, and the pod's spec (CUDA_DISABLE_CONTROL) is
    not read at all."""
    await claims(settings, bus).prepare(CLAIM)
    spec = read_json(cdi_file(Path(settings.cdi_dir), CLAIM))
    tag = record_tag(settings)
    for container in ("main", "helper"):
        [edits] = [
            d["containerEdits"]
            for d in spec["devices"]
            if d["name"] == f"{POD.uid}-{container}-{tag}"
        ]
        assert PRELOAD_PATH in {m["containerPath"] for m in edits["mounts"]}
        grant_file = HostDir(Path(settings.host_dir)).container_dir(POD.uid, container) / "grant"
        assert "optional" not in grant_file.read_text()


async def test_unprepare_after_a_restart_names_the_pod_and_removes_the_spec(
    settings: DevicePluginSettings, bus: Bus, stand_in: Inventory
) -> None:
    await claims(settings, bus).prepare(CLAIM)
    spec_path = cdi_file(Path(settings.cdi_dir), CLAIM)
    assert spec_path.exists()
    await claims(settings, bus).unprepare(CLAIM)  # a new agent, the same directories
    assert stand_in.unprepared == [UnprepareRequest(claim=CLAIM, pod_uid=POD.uid)]
    assert not spec_path.exists()
    assert listing(Path(settings.host_dir) / "dra") == []
    # the container directories go with the agent's clean-up, once the pod released
    assert HostDir(Path(settings.host_dir)).container_dir(POD.uid, "main").exists()
    await claims(settings, bus).unprepare(CLAIM)  # again: nothing kept, the inventory decides
    assert stand_in.unprepared[-1] == UnprepareRequest(claim=CLAIM, pod_uid=None)


async def test_an_unprepare_the_inventory_refuses_keeps_the_record(
    settings: DevicePluginSettings, bus: Bus, stand_in: Inventory
) -> None:
    await claims(settings, bus).prepare(CLAIM)
    stand_in.unprepare = (
        ErrorReply(error=ErrorKind.LEDGER_ERROR, message="Redis refused the release")
        .model_dump_json()
        .encode()
    )
    with pytest.raises(ClaimError, match="Redis refused the release"):
        await claims(settings, bus).unprepare(CLAIM)
    stand_in.unprepare = Done().model_dump_json().encode()
    await claims(settings, bus).unprepare(CLAIM)
    assert stand_in.unprepared[-1].pod_uid == POD.uid


async def refused_with_nothing_written(
    settings: DevicePluginSettings, bus: Bus, match: str
) -> None:
    with pytest.raises(ClaimError, match=match):
        await claims(settings, bus).prepare(CLAIM)
    assert listing(Path(settings.cdi_dir)) == []
    assert listing(Path(settings.host_dir)) == []


async def test_the_inventory_s_refusal_is_the_claim_s_error_and_nothing_is_written(
    settings: DevicePluginSettings, bus: Bus, stand_in: Inventory
) -> None:
    why = "claim team/trainer-gpu-x7k2p: device gpu-ffff is no card of node node-a"
    stand_in.answer_prepare(ErrorReply(error=ErrorKind.BAD_CLAIM, message=why))
    await refused_with_nothing_written(settings, bus, why)
    assert len(stand_in.prepared) == 1  # a refusal is not asked again


async def test_bad_reply_bytes_are_refused_and_nothing_is_written(
    settings: DevicePluginSettings, bus: Bus, stand_in: Inventory
) -> None:
    stand_in.answer_prepare(b"\x00not json{")
    await refused_with_nothing_written(settings, bus, "unreadable reply")
    stand_in.answer_prepare(Done())  # a reply of another verb
    await refused_with_nothing_written(settings, bus, "a done reply to prepare")


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"claim": CLAIM.model_copy(update={"uid": "other"})}, "another claim"),
        ({"placement": placement(node="node-b")}, "on node 'node-b'"),
        ({"placement": placement(mig=True)}, "MIG instances are not prepared through DRA"),
    ],
)
async def test_answers_for_another_claim_node_or_a_mig_grant_are_refused(
    settings: DevicePluginSettings,
    bus: Bus,
    stand_in: Inventory,
    changes: dict[str, Any],
    match: str,
) -> None:
    stand_in.answer_prepare(claim_reply(**changes))
    await refused_with_nothing_written(settings, bus, match)


async def test_a_pod_uid_that_makes_no_directory_is_refused(
    settings: DevicePluginSettings, bus: Bus, stand_in: Inventory
) -> None:
    bad = placement().model_copy(update={"pod": POD.model_copy(update={"uid": "../../etc"})})
    stand_in.answer_prepare(claim_reply(placement=bad))
    await refused_with_nothing_written(settings, bus, "pod UID")


async def test_a_device_not_granted_to_its_container_is_refused(
    settings: DevicePluginSettings, bus: Bus, stand_in: Inventory
) -> None:
    wrong = ClaimDevice(
        request="main", pool=NODE, device=device_name(GPU1), uuid=GPU1, container="main"
    )
    reply = claim_reply()
    stand_in.answer_prepare(reply.model_copy(update={"devices": (wrong, *reply.devices[1:])}))
    await refused_with_nothing_written(settings, bus, "holds no grant on")
    pool = reply.devices[0].model_copy(update={"pool": "node-b"})
    stand_in.answer_prepare(reply.model_copy(update={"devices": (pool, *reply.devices[1:])}))
    await refused_with_nothing_written(settings, bus, "is not card")


async def test_no_inventory_is_an_error_naming_it(settings: DevicePluginSettings, bus: Bus) -> None:
    await refused_with_nothing_written(settings, bus, "inventory unavailable")


async def test_calls_done_leave_no_lock_behind(
    settings: DevicePluginSettings, bus: Bus, stand_in: Inventory
) -> None:
    """Each claim kubelet names gets a lock while it is prepared or unprepared,
    none after: the agent's memory does not grow with the claims it served."""
    preparer = claims(settings, bus)
    await asyncio.gather(preparer.prepare(CLAIM), preparer.prepare(CLAIM))
    assert preparer._locks == {}
    await preparer.unprepare(CLAIM)
    assert preparer._locks == {}
