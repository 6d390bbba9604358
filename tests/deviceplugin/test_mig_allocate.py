"""Dynamic MIG: instances made at Allocate, destroyed when the pod ends, and what a
restarted agent does with those it finds; simulated MIG cards in the agent, real
gRPC, NATS and Redis."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import subprocess
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import grpc
import pytest

from gpuslice_cli.dev.kubelet import DevKubelet
from gpuslice_common.bus import Bus
from gpuslice_common.config import DevicePluginSettings
from gpuslice_common.grant import Grant, GrantDevice
from gpuslice_common.grant import parse as parse_grant
from gpuslice_common.ledger import Ledger, ReservationConflict
from gpuslice_common.models import (
    ContainerAssignment,
    DeviceGrant,
    MigGrant,
    MigInstance,
    MigPlacement,
    NodeInventory,
    Placement,
    PodRef,
    VgpuMode,
)
from gpuslice_deviceplugin.discovery import SimulatedBackend
from gpuslice_deviceplugin.mig import A100_40GB, MigError, MigInstances, Record, SimulatedMig
from gpuslice_deviceplugin.nodeconfig import parse_node_config
from gpuslice_deviceplugin.service import Running, running
from gpuslice_inventory.service import Running as InventoryRunning
from tests.deviceplugin.conftest import FAST, MIB, NODE, SIMULATED, bind, uuids
from tests.deviceplugin.test_plugin import registered

MIG_NODE = """
defaults:
  deviceSplitCount: 4
  operatingMode: mig
  simulate: {count: 2, model: NVIDIA A100-SXM4-40GB, memoryMiB: 40960, mig: true}
"""
GPU = "GPU-00000000-0000-4000-8000-000000000000"


@pytest.fixture
def node_config(tmp_path: Path) -> Path:
    path = tmp_path / "nodes.yaml"
    path.write_text(MIG_NODE)
    return path


def mig_pod(uid: str, gpu: str, profile: str, start: int, size: int, node: str = NODE) -> Placement:
    """A pod holding one instance, booking what the ledger books for its profile."""
    (facts,) = [p for p in A100_40GB if p.name == profile]
    grant = DeviceGrant(
        uuid=gpu,
        memory_mib=facts.memory_mib,
        cores=facts.cores,
        mig=MigGrant(profile=profile, placement=MigPlacement(start=start, size=size)),
    )
    return Placement(
        pod=PodRef(uid=uid, namespace="team", name=f"pod-{uid}"),
        node=node,
        containers=(ContainerAssignment(name="c0", devices=(grant,)),),
        policy="binpack",
    )


def grant_of(profile: str, start: int, size: int, gpu: str = GPU) -> DeviceGrant:
    placement = MigPlacement(start=start, size=size)
    return DeviceGrant(
        uuid=gpu, memory_mib=1, cores=1, mig=MigGrant(profile=profile, placement=placement)
    )


async def test_allocate_makes_the_instance_and_the_pod_s_end_destroys_it(
    agent: Running, kubelet: DevKubelet, plugin_ledger: Ledger
) -> None:
    plugin = await registered(kubelet)
    gpu = uuids(agent)[0]
    assert agent.agent.devices[0].mode == VgpuMode.MIG
    await bind(plugin_ledger, mig_pod("m1", gpu, "3g.20gb", 4, 4))
    response = await plugin.admit_container(1)
    backend = agent.agent.backend
    (made,) = backend.mig_instances(gpu)
    assert (made.profile, made.placement) == ("3g.20gb", MigPlacement(start=4, size=4))
    assert made.uuid is not None
    env = dict(response.envs)
    # the MIG device, all of the instance's memory and no SM limit: MIG isolates
    assert env["NVIDIA_VISIBLE_DEVICES"] == made.uuid
    assert env["CUDA_DEVICE_MEMORY_LIMIT_0"] == "19968m"
    assert env["CUDA_DEVICE_SM_LIMIT"] == "0"
    directory = agent.host.container_dir("m1", "c0")
    # nothing for the interposer to hold: it is not preloaded
    assert "/etc/ld.so.preload" not in {m.container_path for m in response.mounts}
    grant = parse_grant((directory / "grant").read_text())
    assert grant.devices == (GrantDevice(uuid=made.uuid, memory_bytes=19968 * MIB, sm_percent=0),)
    assert isinstance(grant, Grant)
    # recorded as the agent's own, so the inventory does not report it as static
    (record,) = agent.mig.records()
    assert (record.pod_uid, record.container, record.uuid) == ("m1", "c0", made.uuid)
    await agent.agent.refresh()
    assert agent.agent.inventory().devices[0].mig_instances == ()
    # the pod ends: its instance goes with the next check, before any clean-up grace
    await plugin_ledger.release("m1", reason="pod deleted")
    await agent.refresh_gone()
    assert backend.mig_instances(gpu) == []
    assert agent.mig.records() == []


async def test_a_grant_nvml_does_not_offer_is_refused_with_nothing_made(
    agent: Running, plugin_ledger: Ledger, tmp_path: Path
) -> None:
    """The ledger refuses it before any node sees it; and should one reach the agent
    all the same (a ledger written by hand, a stale record), the agent refuses it."""
    gpu = uuids(agent)[0]
    with pytest.raises(ReservationConflict, match="InvalidRequest"):
        await bind(plugin_ledger, mig_pod("bad", gpu, "3g.20gb", 2, 4))
    mig = MigInstances(SimulatedMig(), tmp_path / "mig")
    with pytest.raises(
        MigError, match=f"GPU {GPU} offers MIG profile 3g.20gb at no placement 2\\+4"
    ):
        mig.prepare("bad", "c0", [grant_of("3g.20gb", 2, 4)])
    assert mig.records() == []
    assert agent.agent.backend.mig_instances(gpu) == []


async def test_a_grant_over_an_instance_someone_else_made_is_refused(
    agent: Running, kubelet: DevKubelet, plugin_ledger: Ledger
) -> None:
    plugin = await registered(kubelet)
    gpu = uuids(agent)[1]
    backend = agent.agent.backend
    # reserved while the slices were free; someone makes an instance there before
    # kubelet's Allocate (the ledger would refuse the grant once it is reported)
    await bind(plugin_ledger, mig_pod("over", gpu, "3g.20gb", 4, 4))
    theirs = backend.mig_create(gpu, "1g.5gb", MigPlacement(start=5, size=1))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await plugin.admit_container(1)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"overlaps the 1g.5gb instance {theirs.uuid} at 5+1" in str(err.value.details())
    assert backend.mig_instances(gpu) == [theirs]
    assert agent.mig.records() == []


async def test_an_ended_pod_s_instance_on_the_wanted_slices_is_destroyed_first(
    agent: Running, kubelet: DevKubelet, plugin_ledger: Ledger
) -> None:
    plugin = await registered(kubelet)
    gpu = uuids(agent)[0]
    await bind(plugin_ledger, mig_pod("old", gpu, "7g.40gb", 0, 8))
    await plugin.admit_container(1)
    await plugin_ledger.release("old", reason="pod deleted")  # not yet seen by the agent
    await bind(plugin_ledger, mig_pod("new", gpu, "3g.20gb", 0, 4))
    response = await plugin.admit_container(1)
    (made,) = agent.agent.backend.mig_instances(gpu)
    assert made.profile == "3g.20gb"
    assert dict(response.envs)["NVIDIA_VISIBLE_DEVICES"] == made.uuid
    assert [r.pod_uid for r in agent.mig.records()] == ["new"]


async def test_a_mig_grant_on_a_hami_core_node_is_refused(
    make_settings: Callable[..., DevicePluginSettings],
    kubelet: DevKubelet,
    bus: Bus,
    plugin_ledger: Ledger,
    inventory: InventoryRunning,
    tmp_path: Path,
) -> None:
    config = tmp_path / "hami-core.yaml"
    config.write_text(SIMULATED)
    settings = make_settings(node_config_file=str(config))
    async with running(settings, bus=bus, serve_http=False, timing=FAST) as state:
        await plugin_ledger.register_node(state.agent.inventory(), rebuilt=True)
        await registered(kubelet)
        # the ledger refuses an instance on a card not in mig mode before the node
        # sees it (the agent refuses one too: "makes no MIG instances")
        with pytest.raises(ReservationConflict, match="InvalidRequest"):
            await bind(plugin_ledger, mig_pod("m", uuids(state)[0], "3g.20gb", 0, 4))
        assert state.mig.records() == []


# ------------------------------------------------------------ the records alone


def test_a_simulated_node_makes_instances_only_on_its_own_mig_cards(tmp_path: Path) -> None:
    config = parse_node_config(MIG_NODE, NODE)
    backend = SimulatedBackend(NODE, config.simulate, config)
    mig = MigInstances(backend, tmp_path)
    with pytest.raises(MigError, match=f"GPU {GPU} offers no MIG profile 1g"):
        mig.prepare("p", "c0", [grant_of("1g.5gb", 0, 1)])
    assert mig.records() == []


def test_a_retried_allocate_finds_what_it_made(tmp_path: Path) -> None:
    driver = SimulatedMig()
    mig = MigInstances(driver, tmp_path)
    grant = grant_of("2g.10gb", 2, 2)
    first = mig.prepare("p", "c0", [grant])
    again = mig.prepare("p", "c0", [grant])
    assert first == again
    assert len(driver.mig_instances(GPU)) == 1
    # another container asking for the same slices is refused, nothing made
    with pytest.raises(MigError, match=r"overlaps the 2g\.10gb instance"):
        mig.prepare("p", "c1", [grant])
    assert len(driver.mig_instances(GPU)) == 1


def test_a_failing_grant_undoes_the_others_of_the_container(tmp_path: Path) -> None:
    driver = SimulatedMig()
    mig = MigInstances(driver, tmp_path)
    good = grant_of("1g.5gb", 0, 1)
    other = "GPU-00000000-0000-4000-8000-000000000001"
    bad = grant_of("5g.25gb", 0, 4, other)
    with pytest.raises(MigError, match=r"offers no MIG profile 5g\.25gb"):
        mig.prepare("p", "c0", [good, bad])
    assert driver.mig_instances(GPU) == []
    assert mig.records() == []


def test_reconcile_undoes_half_made_instances_and_forgets_vanished_ones(tmp_path: Path) -> None:
    driver = SimulatedMig()
    mig = MigInstances(driver, tmp_path)
    kept = mig.prepare("live", "c0", [grant_of("3g.20gb", 0, 4)])
    vanished = mig.prepare("x", "c0", [grant_of("1g.5gb", 6, 1)])
    driver.mig_destroy(GPU, MigPlacement(start=6, size=1))  # someone destroyed it
    # an agent stopped between recording its intent and the instance's UUID
    half = driver.mig_create(GPU, "1g.5gb", MigPlacement(start=4, size=1))
    mig._write(Record("y", "c0", GPU, "1g.5gb", 4, 1, 4864))  # what it wrote first
    mig.reconcile()
    assert driver.mig_instances(GPU) == [kept[GPU]]
    assert [r.pod_uid for r in mig.records()] == ["live"]
    assert half not in driver.mig_instances(GPU)
    assert vanished[GPU].uuid not in {i.uuid for i in driver.mig_instances(GPU)}


def test_unreadable_records_are_left_alone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    mig = MigInstances(SimulatedMig(), tmp_path)
    (tmp_path / "mig").mkdir(mode=0o700)
    (tmp_path / "mig" / "junk.json").write_text('{"pod_uid": 1}')
    (tmp_path / "mig" / "link.json").symlink_to("/etc/passwd")
    (tmp_path / "mig" / "huge.json").write_bytes(b" " * (1 << 20))
    os.mkfifo(tmp_path / "mig" / "fifo.json")  # would block a reader that waits on it
    assert mig.records() == []
    assert mig.records() == []
    said = [r.getMessage() for r in caplog.records if r.name == "gpuslice_deviceplugin.mig"]
    assert len(said) == 4  # once for each file, not at every look
    assert all("left alone" in m for m in said)


def test_a_record_under_another_name_destroys_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    driver = SimulatedMig()
    mig = MigInstances(driver, tmp_path)
    theirs = driver.mig_create(GPU, "3g.20gb", MigPlacement(start=4, size=4))  # not the agent's
    (tmp_path / "mig").mkdir(mode=0o700)
    forged = Record("ended", "c0", GPU, "3g.20gb", 4, 4, 19968, theirs.uuid)
    (tmp_path / "mig" / "planted.json").write_text(json.dumps(asdict(forged)))
    assert mig.records() == []
    assert mig.release({"ended"}) == []
    mig.reconcile()
    assert driver.mig_instances(GPU) == [theirs]
    said = [r.getMessage() for r in caplog.records if r.name == "gpuslice_deviceplugin.mig"]
    assert any("planted.json" in m and "not the name" in m for m in said)


@pytest.mark.parametrize("how", ["group-writable", "world-writable", "symlink"])
def test_records_in_a_directory_others_can_write_are_not_trusted(
    tmp_path: Path, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    driver = SimulatedMig()
    mig = MigInstances(driver, tmp_path)
    theirs = driver.mig_create(GPU, "3g.20gb", MigPlacement(start=4, size=4))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    if how == "symlink":
        (tmp_path / "mig").symlink_to(elsewhere)
    else:
        (tmp_path / "mig").mkdir()
        (tmp_path / "mig").chmod(0o770 if how == "group-writable" else 0o777)
    # what anyone who can write there could plant: a record naming someone else's instance
    forged = Record("ended", "c0", GPU, "3g.20gb", 4, 4, 19968, theirs.uuid)
    (elsewhere if how == "symlink" else tmp_path / "mig").joinpath(
        f"{hashlib.sha256(GPU.encode()).hexdigest()[:24]}.4.json"
    ).write_text(json.dumps(asdict(forged)))
    assert mig.records() == []
    assert mig.release({"ended"}) == []
    assert driver.mig_instances(GPU) == [theirs]
    with pytest.raises(MigError, match=r"MIG record directory .* not trusted"):
        mig.prepare("p", "c0", [grant_of("1g.5gb", 0, 1)])
    assert driver.mig_instances(GPU) == [theirs]  # nothing made
    said = [r.getMessage() for r in caplog.records if r.name == "gpuslice_deviceplugin.mig"]
    assert any("not trusted" in m for m in said)


# ------------------------------------------------------------ on the fake NVML

FAKE = "GPU-facefeed-0000-4000-8000-0000000000{:02x}"
THEIRS = "MIG-00000009-0000-4001-8000-000000000009"


def instances_in(state: Path) -> list[str]:
    return [line for line in state.read_text().splitlines() if line.startswith("gi ")]


async def test_on_nvml_an_instance_outlives_the_agent_and_goes_when_its_pod_has_ended(
    agent_process: Callable[..., subprocess.Popen[str]],
    kubelet: DevKubelet,
    plugin_ledger: Ledger,
    bus: Bus,
    inventory: InventoryRunning,
    tmp_path: Path,
) -> None:
    inventories: asyncio.Queue[NodeInventory] = asyncio.Queue()

    async def on_inventory(_subject: str, inv: NodeInventory) -> None:
        await inventories.put(inv)

    await bus.subscribe(bus.subjects.inventory("node-e2e"), NodeInventory, on_inventory)
    await bus.flush()
    config = tmp_path / "mig-nodes.yaml"
    config.write_text("defaults: {deviceSplitCount: 2, operatingMode: mig}\n")
    state = tmp_path / "mig-state"
    state.write_text(f"serial 9\ngi 0 5 0 0 0 {THEIRS}\n")  # someone else's 1g.5gb at 0
    env = {
        "GPUSLICE_NODE_CONFIG_FILE": str(config),
        "FAKECUDA_MEMORY": "40g",
        "FAKENVML_NAME": "NVIDIA A100-SXM4-40GB",
        "FAKENVML_MIG": "1,0",
        "FAKENVML_MIG_FILE": str(state),
    }
    proc = agent_process(**env)
    plugin = await kubelet.registration(timeout=90)
    await plugin.list_after(0)
    published = await asyncio.wait_for(inventories.get(), 10)
    card = published.devices[0]
    assert (card.uuid, card.mode, card.mig) == (FAKE.format(0), VgpuMode.MIG, True)
    assert card.mig_instances == (
        MigInstance(uuid=THEIRS, profile="1g.5gb", placement=MigPlacement(start=0, size=1)),
    )
    await plugin_ledger.register_node(published, rebuilt=True)
    await bind(plugin_ledger, mig_pod("e1", card.uuid, "3g.20gb", 4, 4, node="node-e2e"))
    response = await plugin.admit_container(1)
    mine = dict(response.envs)["NVIDIA_VISIBLE_DEVICES"]
    assert mine.startswith("MIG-")
    assert instances_in(state) == [f"gi 0 1 2 4 0 {mine}", f"gi 0 5 0 0 0 {THEIRS}"]
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 0, out
    assert instances_in(state) == [f"gi 0 1 2 4 0 {mine}", f"gi 0 5 0 0 0 {THEIRS}"]
    # the pod ends while no agent runs; the next one destroys its instance, not theirs
    await plugin_ledger.release("e1", reason="pod deleted")
    proc = agent_process(**env)
    await kubelet.registration(2, timeout=30)
    for _ in range(100):  # the pod check runs every 2 s
        if len(instances_in(state)) == 1:
            break
        await asyncio.sleep(0.2)
    assert instances_in(state) == [f"gi 0 5 0 0 0 {THEIRS}"]
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 0, out
    assert "Traceback" not in out
    assert f"destroyed MIG 3g.20gb at 4+4 on {card.uuid} (pod e1)" in out
