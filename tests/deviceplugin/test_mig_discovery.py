"""MIG cards as discovery reports them, against the fake NVML's MIG geometries."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuslice_common.models import GpuDevice, MigInstance, MigPlacement, MigProfile, VgpuMode
from gpuslice_deviceplugin.discovery import SimulatedBackend
from gpuslice_deviceplugin.mig import A100_40GB
from gpuslice_deviceplugin.mig_nvml import profile_name
from gpuslice_deviceplugin.nodeconfig import parse_node_config
from tests.deviceplugin import test_discovery
from tests.deviceplugin.test_discovery import FAKE_UUID, Discover

A100 = "NVIDIA A100-SXM4-40GB"
STATIC_UUID = "MIG-0000002a-0000-4001-8000-00000000002a"
discover = test_discovery.discover  # the fixture that runs nvml_discover.py


def fake_a100(tmp_path: Path, *, mig: str = "1,0", instances: str = "") -> dict[str, str]:
    state = tmp_path / "mig-state"
    state.write_text(f"serial 42\n{instances}")
    return {
        "FAKECUDA_DEVICES": "2",
        "FAKECUDA_MEMORY": "40g",
        "FAKENVML_NAME": A100,
        "FAKENVML_MIG": mig,
        "FAKENVML_MIG_FILE": str(state),
    }


def warnings(logs: str) -> list[str]:
    return [
        line.removeprefix("WARNING gpuslice_deviceplugin.discovery: ")
        for line in logs.splitlines()
        if line.startswith("WARNING")
    ]


def placements(*starts: int, size: int) -> tuple[MigPlacement, ...]:
    return tuple(MigPlacement(start=s, size=size) for s in starts)


def test_a_mig_node_offers_the_allowed_profiles_and_lists_instances_already_there(
    discover: Discover, tmp_path: Path
) -> None:
    env = fake_a100(tmp_path, instances=f"gi 0 1 2 4 0 {STATIC_UUID}\n")
    config = """
defaults:
  operatingMode: mig
  migProfileAllowlist:
    - {models: [A30], profiles: [1g.6gb]}
    - {models: [A100-SXM4-40GB], profiles: [1g.5gb, 3g.20gb, 7g.40gb, 9g.99gb]}
"""
    proc = discover("nvml", env, config=config)
    first, second = proc.line(), proc.step()
    logs = proc.finish()
    assert first == second, logs
    mig, plain = (GpuDevice.model_validate(d) for d in first["devices"])
    assert (mig.mode, mig.mig, mig.healthy) == (VgpuMode.MIG, True, True)
    assert mig.mig_profiles == (
        MigProfile(name="1g.5gb", memory_mib=4864, cores=14, slices=1,
                   placements=placements(*range(7), size=1)),
        MigProfile(name="3g.20gb", memory_mib=19968, cores=42, slices=3,
                   placements=placements(0, 4, size=4)),
        MigProfile(name="7g.40gb", memory_mib=40192, cores=100, slices=7,
                   placements=placements(0, size=8)),
    )  # fmt: skip
    assert mig.mig_instances == (
        MigInstance(uuid=STATIC_UUID, profile="3g.20gb", placement=MigPlacement(start=4, size=4)),
    )
    assert (plain.mode, plain.mig, plain.mig_profiles) == (VgpuMode.HAMI_CORE, False, ())
    assert warnings(logs) == [f"GPU 1 ({FAKE_UUID.format(1)}) has no MIG or MIG is off: "
                              "shared by hami-core"]  # fmt: skip


def test_without_an_allowlist_every_profile_nvml_gives_is_offered(
    discover: Discover, tmp_path: Path
) -> None:
    env = {**fake_a100(tmp_path, mig="1"), "FAKECUDA_DEVICES": "1", "FAKECUDA_MEMORY": "80g",
           "FAKENVML_NAME": "NVIDIA H100 80GB HBM3"}  # fmt: skip
    proc = discover("nvml", env, config="defaults: {operatingMode: mig}")
    (device,) = (GpuDevice.model_validate(d) for d in proc.line()["devices"])
    proc.finish()
    assert [(p.name, p.memory_mib, p.cores, len(p.placements)) for p in device.mig_profiles] == [
        ("1g.10gb", 9984, 14, 7),
        ("2g.20gb", 20096, 28, 3),
        ("3g.40gb", 40320, 42, 2),
        ("4g.40gb", 40320, 57, 1),
        ("7g.80gb", 80896, 100, 1),
        ("1g.20gb", 20096, 14, 4),
    ]


def test_a_card_no_profile_is_allowed_on_is_left_out(discover: Discover, tmp_path: Path) -> None:
    config = """
defaults:
  operatingMode: mig
  migProfileAllowlist: [{models: [H100], profiles: [1g.10gb]}]
"""
    proc = discover("nvml", fake_a100(tmp_path), config=config)
    devices = proc.line()["devices"]
    logs = proc.finish()
    assert [d["index"] for d in devices] == [1]
    assert f"GPU 0 ({FAKE_UUID.format(0)}) is in MIG mode but no MIG profile is allowed for " \
        f"'{A100}' (migProfileAllowlist): left out" in warnings(logs)  # fmt: skip


def test_static_mig_keeps_the_card_from_hami_core_and_lists_its_instances(
    discover: Discover, tmp_path: Path
) -> None:
    env = fake_a100(tmp_path, instances=f"gi 0 3 1 2 0 {STATIC_UUID}\ngi 0 4 0 6 -1 -\n")
    proc = discover("nvml", env, config="defaults: {migStrategy: mixed}")
    static, plain = (GpuDevice.model_validate(d) for d in proc.line()["devices"])
    logs = proc.finish()
    assert (static.mode, static.mig, static.healthy, static.mig_profiles) == (
        VgpuMode.HAMI_CORE, True, False, ()
    )  # fmt: skip
    assert static.mig_instances == (
        MigInstance(uuid=STATIC_UUID, profile="2g.10gb", placement=MigPlacement(start=2, size=2)),
        MigInstance(uuid=f"{FAKE_UUID.format(0)}:gi6", profile="1g.5gb",
                    placement=MigPlacement(start=6, size=1)),
    )  # fmt: skip
    assert (plain.healthy, plain.mig) == (True, False)
    assert (f"GPU 0 ({FAKE_UUID.format(0)}) is in MIG mode: its instances are static, the card "
            "is not shared by hami-core") in warnings(logs)  # fmt: skip


def test_simulated_mig_cards_have_the_a100_40gb_geometry() -> None:
    config = parse_node_config(
        "defaults: {operatingMode: mig, simulate: {count: 2, mig: true}, "
        "migProfileAllowlist: [{models: [A100], profiles: [3g.20gb, 7g.40gb]}]}",
        "n",
    )
    backend = SimulatedBackend("n", config.simulate, config)
    devices = backend.devices()
    assert [d.mode for d in devices] == [VgpuMode.MIG, VgpuMode.MIG]
    assert devices[0].mig_profiles == tuple(
        p for p in A100_40GB if p.name in {"3g.20gb", "7g.40gb"}
    )
    made = backend.mig_create(devices[1].uuid, "3g.20gb", MigPlacement(start=4, size=4))
    assert (made.uuid or "").startswith("MIG-")
    (listed,) = backend.devices()[1].mig_instances
    assert (listed.uuid, listed.profile, listed.placement.start) == (made.uuid, "3g.20gb", 4)
    assert backend.mig_destroy(devices[1].uuid, MigPlacement(start=4, size=4))
    assert backend.devices()[1].mig_instances == ()


def test_simulated_static_instances_keep_the_cards_from_hami_core() -> None:
    """migStrategy mixed: each card holds the instances the config names, made
    once (static: the agent did not make them), at their first free placements;
    the card itself is not shared."""
    config = parse_node_config(
        "defaults: {migStrategy: mixed, simulate: {count: 2, mig: true, "
        "model: NVIDIA A100-SXM4-40GB, memoryMiB: 40960, instances: [3g.20gb, 2g.10gb]}}",
        "n",
    )
    backend = SimulatedBackend("n", config.simulate, config)
    first = backend.devices()
    for card in first:
        assert (card.mode, card.mig, card.healthy, card.mig_profiles) == (
            VgpuMode.HAMI_CORE, True, False, ()
        )  # fmt: skip
        assert [(i.profile, i.placement) for i in card.mig_instances] == [
            ("3g.20gb", MigPlacement(start=0, size=4)),
            ("2g.10gb", MigPlacement(start=4, size=2)),
        ]
        assert all(i.uuid.startswith("MIG-") for i in card.mig_instances)
    assert len({i.uuid for card in first for i in card.mig_instances}) == 4
    assert backend.devices() == first  # read again: the same instances, none made twice


@pytest.mark.parametrize(
    ("slices", "memory_mib", "card_mib", "name"),
    [
        (1, 4864, 40536, "1g.5gb"),  # A100-SXM4-40GB
        (3, 19968, 40536, "3g.20gb"),
        (7, 40192, 40536, "7g.40gb"),
        (1, 9984, 81559, "1g.10gb"),  # H100 80GB
        (2, 20096, 81559, "2g.20gb"),
        (7, 80896, 81559, "7g.80gb"),
    ],
)
def test_a_profile_nvml_gives_no_name_is_named_as_nvidia_does(
    slices: int, memory_mib: int, card_mib: int, name: str
) -> None:
    assert profile_name(slices, memory_mib, card_mib) == name
