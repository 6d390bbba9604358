"""Compute coordination on regions the real interposer writes under the fake driver:
which containers are active on a GPU, the flags they get, how the limiter reacts,
and the metrics exported from it.

Each container is prepared as the agent prepares it at Allocate (its grant and its
region), and its processes run as a container's do: held to the grant, found
through ``GPUSLICE_GRANT_DIR`` (the plain-process stand-in for the read-only
mount at ``/run/gpuslice``), with no limit in their environment."""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpuslice_common.control import CONTROL_FILE, Control
from gpuslice_common.models import GpuDevice
from gpuslice_common.region import REGION_SIZE
from gpuslice_common.region import ffi as region_ffi
from gpuslice_deviceplugin.containers import REGION_FILE, ContainerOwner, HostDir
from gpuslice_deviceplugin.coordinator import (
    ContainerState,
    Coordinator,
    CoordinatorSnapshot,
    DeviceState,
)
from gpuslice_deviceplugin.metrics import Names, NodeCollector, NodeView, registry_with
from gpuslice_deviceplugin.physical import BusyMeter, GpuFigures, Load, simulated_figures
from tests.deviceplugin.conftest import FAKE_MEMORY, make_grant
from tests.native.probe import ProbeProcess, ProbeSpawner

MiB = 1 << 20


def gpu(index: int) -> str:
    """The UUID the fake driver gives device ``index``."""
    return f"GPU-facefeed-0000-4000-8000-0000000000{index:02x}"


@pytest.fixture
def host(tmp_path: Path) -> HostDir:
    return HostDir(tmp_path / "host")


@pytest.fixture
def coordinator(host: HostDir) -> Iterator[Coordinator]:
    c = Coordinator(host)
    yield c
    c.close()


def prepare(
    host: HostDir,
    pod: str,
    devices: tuple[str, ...] = (gpu(0),),
    *,
    memory: int = FAKE_MEMORY,
    sm: int = 0,
    policy: str = "default",
    priority: int = 1,
) -> Path:
    """A container prepared by the agent, granted ``memory`` bytes and ``sm`` percent
    of each of ``devices`` with ``policy`` and ``priority``; the path of its region."""
    o = ContainerOwner(
        pod_uid=pod,
        namespace="team",
        pod_name=f"pod-{pod}",
        container="main",
        devices=devices,
        allocated_at=time.time(),
    )
    grant = make_grant(pod, "main", devices, memory=memory, sm=sm, policy=policy, priority=priority)
    return host.prepare_container(o, grant) / REGION_FILE


def env(region: Path, **extra: str | int) -> dict[str, str | int]:
    """A process of the container whose region is ``region``: its grant directory."""
    return {"GPUSLICE_GRANT_DIR": str(region.parent), **extra}


def holding(
    spawn_probe: ProbeSpawner, region: Path, *, device: int = 0, **extra: str | int
) -> ProbeProcess:
    """A process of the container holding 64 MiB on ``device`` until killed."""
    proc = spawn_probe("init", "ctx", device, "alloc", "64m", "hold", env=env(region, **extra))
    proc.wait_for("hold")
    return proc


def container(snapshot: CoordinatorSnapshot, pod: str) -> ContainerState:
    found = snapshot.container(pod, "main")
    assert found is not None, snapshot
    return found


def state(snapshot: CoordinatorSnapshot, pod: str, uuid: str = gpu(0)) -> DeviceState:
    found = container(snapshot, pod)
    for device in found.devices:
        if device.usage.uuid == uuid:
            return device
    raise AssertionError(f"pod {pod} has no record of {uuid}: {found}")


def active_on(snapshot: CoordinatorSnapshot, uuid: str) -> int:
    found = snapshot.gpu(uuid)
    assert found is not None, snapshot
    return found.active_containers


def flags(region: Path, index: int = 0) -> tuple[bool, bool]:
    """(shared, yield) of the grant's device ``index`` as the interposer reads them
    from the agent's control file beside the region."""
    with Control.open(region.parent / CONTROL_FILE) as control:
        return control.flags(index)


def mapped(path: Path) -> bool:
    """Whether this process maps ``path`` (or the file it was, since deleted)."""
    maps = Path("/proc/self/maps").read_text()
    return any(line.split(maxsplit=5)[-1].startswith(str(path)) for line in maps.splitlines())


class Ticker:
    """Ticks a coordinator in a background thread, as the service does."""

    def __init__(self, coordinator: Coordinator, interval: float) -> None:
        self._coordinator = coordinator
        self._interval = interval
        self._stop = threading.Event()
        self.snapshot: CoordinatorSnapshot | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="ticker", daemon=True)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self.snapshot = self._coordinator.tick()
                self._stop.wait(self._interval)
        except BaseException as e:
            self.error = e

    def __enter__(self) -> Ticker:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        assert self.error is None, self.error


# ----------------------------------------------------------------------------- flags


def test_a_container_alone_has_the_gpu_to_itself(
    host: HostDir, coordinator: Coordinator, spawn_probe: ProbeSpawner
) -> None:
    region = prepare(host, "a")
    holding(spawn_probe, region)
    snap = coordinator.tick()
    a = state(snap, "a")
    assert (a.active, a.shared, a.yield_) == (True, False, False)
    assert (a.usage.used_bytes, a.processes) == (64 * MiB, 1)
    assert flags(region) == (False, False)
    assert active_on(snap, gpu(0)) == 1


def test_flags_follow_a_second_container_within_one_tick(
    host: HostDir, coordinator: Coordinator, spawn_probe: ProbeSpawner
) -> None:
    a_region, b_region = prepare(host, "a"), prepare(host, "b")
    holding(spawn_probe, a_region)
    assert state(coordinator.tick(), "a").shared is False

    b = spawn_probe("init", "ctx", "alloc", "64m", "sleep", 300, env=env(b_region))
    b.wait_for("alloc")
    snap = coordinator.tick()
    assert state(snap, "a").shared
    assert state(snap, "b").shared
    assert flags(a_region) == flags(b_region) == (True, False)  # equal priority: no one yields
    assert active_on(snap, gpu(0)) == 2

    b.result(timeout=10)  # exits: its memory is freed
    snap = coordinator.tick()
    assert not state(snap, "a").shared
    assert not state(snap, "b").active
    assert flags(a_region) == (False, False)


def test_a_killed_container_of_a_pod_that_ended_shares_nothing(
    host: HostDir, coordinator: Coordinator, spawn_probe: ProbeSpawner
) -> None:
    a_region, b_region = prepare(host, "a"), prepare(host, "b")
    holding(spawn_probe, a_region)
    killed = spawn_probe("init", "ctx", "alloc", "64m", "hold", env=env(b_region))
    killed.wait_for("hold")
    killed.kill()  # SIGKILL: its usage stays in b's region
    killed.wait(10)
    assert state(coordinator.tick(), "a").shared  # b still looks active
    snap = coordinator.tick(gone={"b"})  # pod b has ended
    assert not state(snap, "b").active
    assert not state(snap, "a").shared
    assert flags(a_region) == (False, False)


def test_containers_on_different_gpus_do_not_share(
    host: HostDir, coordinator: Coordinator, spawn_probe: ProbeSpawner
) -> None:
    a_region = prepare(host, "a", (gpu(0),))
    b_region = prepare(host, "b", (gpu(1),))
    holding(spawn_probe, a_region, device=0, FAKECUDA_DEVICES=2)
    holding(spawn_probe, b_region, device=1, FAKECUDA_DEVICES=2)
    snap = coordinator.tick()
    assert state(snap, "a", gpu(0)).active
    assert state(snap, "b", gpu(1)).active
    assert not state(snap, "a", gpu(0)).shared
    assert not state(snap, "b", gpu(1)).shared
    assert flags(a_region) == flags(b_region) == (False, False)
    assert [(g.uuid, g.active_containers) for g in snap.gpus] == [(gpu(0), 1), (gpu(1), 1)]


def test_kernels_under_a_limit_make_a_container_active(
    host: HostDir, coordinator: Coordinator, spawn_probe: ProbeSpawner
) -> None:
    # No memory held (contexts cost nothing here): only its busy time shows it works.
    a_region = prepare(host, "a", sm=50, policy="force")
    b_region = prepare(host, "b")
    runner = spawn_probe("init", "ctx", "run", 5, 1000, env=env(a_region))
    holding(spawn_probe, b_region)
    deadline = time.monotonic() + 4
    while time.monotonic() < deadline:
        snap = coordinator.tick()
        if container(snap, "a").devices and state(snap, "a").active:
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the running container never became active")
    a = state(snap, "a")
    assert a.usage.used_bytes == 0
    assert a.usage.busy_ns > 0
    assert state(snap, "b").shared
    runner.stop()


def test_a_high_priority_container_makes_low_ones_yield_while_it_is_active(
    host: HostDir, coordinator: Coordinator, spawn_probe: ProbeSpawner
) -> None:
    high_region, low_region = prepare(host, "high", priority=0), prepare(host, "low", priority=1)
    holding(spawn_probe, low_region)
    high = spawn_probe("init", "ctx", "alloc", "64m", "sleep", 500, env=env(high_region))
    high.wait_for("alloc")
    snap = coordinator.tick()
    assert container(snap, "high").high_priority
    assert not container(snap, "low").high_priority
    assert (state(snap, "low").shared, state(snap, "low").yield_) == (True, True)
    assert (state(snap, "high").shared, state(snap, "high").yield_) == (True, False)
    assert flags(low_region) == (True, True)
    assert flags(high_region) == (True, False)

    high.result(timeout=10)  # exits: its slot is freed
    snap = coordinator.tick()
    assert (state(snap, "low").shared, state(snap, "low").yield_) == (False, False)
    assert flags(low_region) == (False, False)


def test_every_tick_stamps_a_heartbeat(
    host: HostDir, coordinator: Coordinator, spawn_probe: ProbeSpawner
) -> None:
    region = prepare(host, "a")
    holding(spawn_probe, region)
    with Control.open(region.parent / CONTROL_FILE) as control:
        assert control.heartbeat_ns == 0
        coordinator.tick()
        first = control.heartbeat_ns
        assert 0 < time.monotonic_ns() - first < 1_000_000_000
        time.sleep(0.01)
        coordinator.tick()
        assert control.heartbeat_ns > first


# ----------------------------------------------------------------------------- regions


def test_foreign_and_unfinished_regions_are_skipped(
    host: HostDir,
    coordinator: Coordinator,
    spawn_probe: ProbeSpawner,
    caplog: pytest.LogCaptureFixture,
) -> None:
    good = prepare(host, "good")
    holding(spawn_probe, good)
    # what a directory of the older, container-writable layout may hold
    foreign = prepare(host, "foreign")
    foreign.write_bytes(b"\x01" * 8192)
    unfinished = prepare(host, "unfinished")
    unfinished.write_bytes(bytes(8192))  # created, header not yet written
    prepare(host, "empty").unlink()  # no region
    link = prepare(host, "link")
    link.unlink()
    link.symlink_to(good)  # would count the good container twice
    fifo = prepare(host, "fifo")
    fifo.unlink()
    os.mkfifo(fifo)  # opening it to read would wait forever
    with caplog.at_level(logging.WARNING, logger="gpuslice_deviceplugin.coordinator"):
        snapshots = [coordinator.tick() for _ in range(3)]
    warned = sorted(r.getMessage() for r in caplog.records)
    assert len(warned) == 3, warned  # once per file, not per tick
    assert str(fifo) in warned[0]
    assert "not a regular file" in warned[0]
    assert str(foreign) in warned[1]
    assert "not a gpuslice region" in warned[1]
    assert str(link) in warned[2]
    assert "not a regular file" in warned[2]
    for snap in snapshots:
        assert len(snap.containers) == 6
        assert [c.owner.pod_uid for c in snap.containers if c.devices] == ["good"]
    assert state(snapshots[-1], "good").active
    assert not state(snapshots[-1], "good").shared
    assert foreign.read_bytes() == b"\x01" * 8192
    assert unfinished.read_bytes() == bytes(8192)


def test_a_removed_container_is_unmapped(
    host: HostDir, coordinator: Coordinator, spawn_probe: ProbeSpawner
) -> None:
    region = prepare(host, "a")
    holding(spawn_probe, region).stop()
    coordinator.tick()
    assert mapped(region)
    host.remove_pod("a")
    assert mapped(region)  # "(deleted)": still held until the next tick
    snap = coordinator.tick()
    assert snap.containers == ()
    assert not mapped(region)


def test_a_region_truncated_under_the_mapping_is_let_go(
    host: HostDir,
    coordinator: Coordinator,
    spawn_probe: ProbeSpawner,
    caplog: pytest.LogCaptureFixture,
) -> None:
    region = prepare(host, "a")
    holding(spawn_probe, region).stop()
    assert container(coordinator.tick(), "a").devices
    os.truncate(region, 0)  # reading the old mapping now would raise SIGBUS
    with caplog.at_level(logging.WARNING, logger="gpuslice_deviceplugin.coordinator"):
        snaps = [coordinator.tick() for _ in range(2)]
    assert all(container(snap, "a").devices == () for snap in snaps)
    assert not mapped(region)
    assert [r.getMessage() for r in caplog.records] == [
        f"skipping region {region}: truncated to 0 bytes while mapped"
    ]


def test_a_replaced_region_is_mapped_afresh(
    host: HostDir, coordinator: Coordinator, spawn_probe: ProbeSpawner
) -> None:
    region = prepare(host, "a")
    holding(spawn_probe, region).stop()  # killed: its 64 MiB stay in the old file
    assert state(coordinator.tick(), "a").usage.used_bytes == 64 * MiB
    region.unlink()
    assert prepare(host, "a") == region  # the agent makes a new one
    spawn_probe("init", "ctx", "alloc", "128m", "hold", env=env(region)).wait_for("hold")
    assert state(coordinator.tick(), "a").usage.used_bytes == 128 * MiB
    maps = Path("/proc/self/maps").read_text()
    assert f"{region} (deleted)" not in maps


# ----------------------------------------------------------------------------- the limiter


def test_the_default_policy_limits_only_while_another_container_is_active(
    host: HostDir, coordinator: Coordinator, spawn_probe: ProbeSpawner
) -> None:
    a_region = prepare(host, "a", sm=30, policy="default")
    b_region = prepare(host, "b", sm=30, policy="default")
    with Ticker(coordinator, 0.1) as ticker:
        a = spawn_probe(
            "init", "ctx", "alloc", "64m", "sleep", 300,
            "run", 1.5, 2000, "run", 1, 2000, "run", 1, 2000,
            env=env(a_region),
        )  # fmt: skip
        alone = a.wait_for("run", timeout=20)
        holding(spawn_probe, b_region)
        a.wait_for("run", timeout=20)  # the second in which the coordinator notices
        beside = a.wait_for("run", timeout=20)
        snap = ticker.snapshot
    assert alone["share"] > 0.6, alone
    assert abs(beside["share"] - 0.30) <= 0.08, beside
    assert snap is not None
    assert state(snap, "a").shared


# ----------------------------------------------------------------------------- metrics


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of an exposition: (name, sorted labels) -> value."""
    found = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            found[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return found


def test_metrics_show_the_region(
    host: HostDir, coordinator: Coordinator, spawn_probe: ProbeSpawner
) -> None:
    region = prepare(host, "a", memory=1 << 30, sm=25, policy="force")
    proc = spawn_probe(
        "init", "ctx", "alloc", "64m", "alloc", "2g", "run", 0.3, 1000, "hold", env=env(region)
    )
    proc.wait_for("hold")
    latest: list[CoordinatorSnapshot | None] = [None]
    card = GpuDevice(uuid=gpu(0), index=0, model="Fake GPU", memory_mib=FAKE_MEMORY // MiB)
    registry = registry_with(
        NodeCollector(
            lambda: NodeView("node-a", latest[0], (GpuFigures(device=card),)),
            names=Names.GPUSLICE,
        )
    )
    assert all(  # no snapshot yet: the GPU shows, no container on it
        name == "gpuslice_gpu_active_containers" and value == 0
        for (name, _), value in samples(generate_latest(registry).decode()).items()
    )

    snap = latest[0] = coordinator.tick()
    device = state(snap, "a")
    got = samples(generate_latest(registry).decode())
    labels = (
        ("container", "main"),
        ("namespace", "team"),
        ("node", "node-a"),
        ("pod", "pod-a"),
        ("pod_uid", "a"),
        ("uuid", gpu(0)),
    )

    def value(name: str) -> float:
        return got[(name, labels)]

    assert value("gpuslice_container_memory_used_bytes") == 64 * MiB
    assert value("gpuslice_container_memory_limit_bytes") == 1024 * MiB
    assert value("gpuslice_container_memory_peak_bytes") == 64 * MiB
    assert value("gpuslice_container_denied_allocations_total") == 1
    assert value("gpuslice_container_sm_limit_percent") == 25
    assert value("gpuslice_container_processes") == 1
    assert value("gpuslice_container_gpu_shared") == 0
    assert value("gpuslice_container_gpu_yield") == 0
    assert device.usage.busy_ns > 0
    assert device.usage.throttled_ns > 0
    assert value("gpuslice_container_gpu_busy_seconds_total") == pytest.approx(
        device.usage.busy_ns / 1e9
    )
    assert value("gpuslice_container_throttled_seconds_total") == pytest.approx(
        device.usage.throttled_ns / 1e9
    )
    gpu_labels = (("index", "0"), ("model", "Fake GPU"), ("node", "node-a"), ("uuid", gpu(0)))
    assert got[("gpuslice_gpu_active_containers", gpu_labels)] == 1
    assert not any(name.startswith("gpuslice_gpu_nvml_") for name, _ in got)  # none read
    families = {
        f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())
    }
    assert families["gpuslice_container_denied_allocations"].type == "counter"
    assert families["gpuslice_container_memory_used_bytes"].type == "gauge"
    assert "memory limit" in families["gpuslice_container_denied_allocations"].documentation


def test_simulated_figures_and_hami_series_come_from_the_regions(
    host: HostDir, coordinator: Coordinator, spawn_probe: ProbeSpawner
) -> None:
    region = prepare(host, "a", memory=1 << 30, sm=25, policy="force")
    proc = spawn_probe("init", "ctx", "alloc", "64m", "run", 0.3, 1000, "hold", env=env(region))
    meter = BusyMeter()
    proc.wait_for("alloc")
    first = coordinator.tick()
    assert meter.update(first) == {}  # a container seen once has no busy share yet
    proc.wait_for("hold")
    snap = coordinator.tick()
    busy = meter.update(snap)
    assert set(busy) == {("a", "main", gpu(0))}
    assert 0 < busy["a", "main", gpu(0)] <= 100
    card = GpuDevice(uuid=gpu(0), index=0, model="NVIDIA A100-SXM4-80GB", memory_mib=81920)
    other = GpuDevice(uuid=gpu(1), index=1, model="NVIDIA A100-SXM4-80GB", memory_mib=81920)
    figures = simulated_figures([card, other], Load.of(snap, busy))
    mine, idle = figures
    assert mine.memory_used_bytes == 64 * MiB  # what the container holds, nothing else
    assert mine.memory_total_bytes == 81920 * MiB
    assert mine.utilization_percent == busy["a", "main", gpu(0)]
    assert idle.memory_used_bytes == idle.utilization_percent == 0
    assert idle.power_watts is not None
    assert mine.power_watts is not None
    assert idle.power_watts < mine.power_watts <= 400
    assert (mine.ecc_corrected, mine.ecc_uncorrected) == (0, 0)
    assert mine.memory_utilization_percent is None

    view = NodeView("node-a", snap, tuple(figures), busy)

    def scraped(names: Names) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        return samples(
            generate_latest(registry_with(NodeCollector(lambda: view, names=names))).decode()
        )

    got = scraped(Names.GPUSLICE_AND_HAMI)
    old = scraped(Names.HAMI_LEGACY)
    legacy = (
        ("ctrname", "main"),
        ("deviceuuid", gpu(0)),
        ("podname", "pod-a"),
        ("podnamespace", "team"),
        ("vdeviceid", "0"),
        ("zone", "vGPU"),
    )
    assert old[("vGPU_device_memory_usage_in_bytes", legacy)] == 64 * MiB
    assert old[("vGPU_device_memory_limit_in_bytes", legacy)] == 1 << 30
    assert old[("Device_utilization_desc_of_container", legacy)] == busy["a", "main", gpu(0)]
    current = (
        ("container", "main"),
        ("device_uuid", gpu(0)),
        ("namespace", "team"),
        ("pod", "pod-a"),
        ("vdevice_index", "0"),
        ("zone", "vGPU"),
    )
    assert got[("hami_vgpu_memory_used_bytes", current)] == 64 * MiB
    assert got[("hami_vgpu_memory_limit_bytes", current)] == 1 << 30
    assert got[("hami_container_device_memory_bytes", current)] == 64 * MiB
    host_labels = (
        ("deviceidx", "0"),
        ("devicetype", "NVIDIA-NVIDIA A100-SXM4-80GB"),
        ("deviceuuid", gpu(0)),
        ("nodeid", "node-a"),
        ("zone", "vGPU"),
    )
    assert old[("HostGPUMemoryUsage", host_labels)] == 64 * MiB
    gpu_labels = (
        ("index", "0"),
        ("model", "NVIDIA A100-SXM4-80GB"),
        ("node", "node-a"),
        ("uuid", gpu(0)),
    )
    assert got[("gpuslice_gpu_nvml_memory_used_bytes", gpu_labels)] == 64 * MiB
    assert got[("gpuslice_gpu_active_containers", gpu_labels)] == 1
    # HAMi's camelCase names alone in their set (/metrics/hami), never beside gpuslice's
    assert {name for name, _ in old} == {
        "HostGPUMemoryUsage",
        "HostCoreUtilization",
        "vGPU_device_memory_usage_in_bytes",
        "vGPU_device_memory_limit_in_bytes",
        "Device_utilization_desc_of_container",
    }
    assert all(name.startswith(("gpuslice_", "hami_")) for name, _ in got)
    off = scraped(Names.GPUSLICE)
    assert {name for name, _ in off} == {n for n, _ in got if n.startswith("gpuslice_")}
    assert not [labels for _, labels in off if ("zone", "vGPU") in labels]
    assert off[("gpuslice_gpu_nvml_memory_used_bytes", gpu_labels)] == 64 * MiB


# ----------------------------------------------------------------------------- forged regions


def forge(region: Path, uuid: str) -> None:
    """What a hostile container writes into its own region: record 0 and record 1
    (past its one-device grant) naming ``uuid`` with memory held and work done, and
    a priority-0 process slot whose PID is long gone."""
    ids = region_ffi.offsetof("gs_region_t", "devices")
    size = region_ffi.sizeof("gs_device_t")
    procs = region_ffi.offsetof("gs_region_t", "procs")
    with region.open("r+b") as f, mmap.mmap(f.fileno(), REGION_SIZE) as m:

        def put(offset: int, value: int, width: int = 8) -> None:
            m[offset : offset + width] = value.to_bytes(width, "little")

        put(region_ffi.offsetof("gs_region_t", "device_count"), 2, 4)
        for index in (0, 1):
            base = ids + index * size
            raw = uuid.encode().ljust(96, b"\0")
            m[base : base + 96] = raw
            put(base + region_ffi.offsetof("gs_device_t", "used"), 64 * MiB)
            put(base + region_ffi.offsetof("gs_device_t", "busy_ns"), 10**9)
        put(procs + region_ffi.offsetof("gs_proc_t", "pid"), 4_000_000, 4)
        put(procs + region_ffi.offsetof("gs_proc_t", "priority"), 0, 4)
        put(region_ffi.offsetof("gs_region_t", "proc_high"), 1, 4)


def test_a_forged_region_record_neither_makes_a_victim_yield_nor_shares_its_gpu(
    host: HostDir, coordinator: Coordinator, spawn_probe: ProbeSpawner
) -> None:
    # The victim, low priority by its grant, holds memory on GPU 0; the attacker,
    # granted GPU 1 and holding nothing, forges records naming GPU 0 and a
    # priority-0 slot of a dead process. Card and priority come from the grants:
    # the victim is alone on its GPU, and nobody makes it yield.
    victim = prepare(host, "victim", priority=1, sm=10, policy="default")
    attacker = prepare(host, "attacker", (gpu(1),), priority=1)
    holding(spawn_probe, victim)
    forge(attacker, gpu(0))
    for _ in range(2):  # the second tick sees busy_ns "grow" if it counted
        snap = coordinator.tick()
        forge(attacker, gpu(0))
    assert flags(victim) == (False, False)
    assert active_on(snap, gpu(0)) == 1
    assert not container(snap, "attacker").high_priority
    assert [d.usage.uuid for d in container(snap, "attacker").devices] == [gpu(1)]
    # The victim's launches neither wait for a yield nor run at its 10 % share.
    with Ticker(coordinator, 0.1):
        proc = spawn_probe("init", "ctx", "run", 1, 2000, env=env(victim))
        line = proc.result(timeout=20).one("run")
    assert line["rc"] == 0
    assert line["share"] > 0.6, line


def test_a_forged_record_does_not_throttle_a_high_priority_victim(
    host: HostDir, coordinator: Coordinator, spawn_probe: ProbeSpawner
) -> None:
    # The same forgery against a high-priority victim alone on its GPU: it would
    # have been "shared" and held to its 10 % share.
    victim = prepare(host, "victim", priority=0, sm=10, policy="default")
    attacker = prepare(host, "attacker", (gpu(1),), priority=0)
    forge(attacker, gpu(0))
    with Ticker(coordinator, 0.1):
        proc = spawn_probe("init", "ctx", "run", 1.5, 2000, env=env(victim))
        line = proc.result(timeout=20).one("run")
    assert flags(victim) == (False, False)
    assert line["share"] > 0.6, line


@pytest.mark.parametrize("control", ["missing", "writable"])
def test_without_a_valid_control_file_a_granted_container_is_limited(
    host: HostDir, spawn_probe: ProbeSpawner, control: str
) -> None:
    # No agent has set up the container's control file, or one the container
    # could write stands there saying "not shared" with a fresh heartbeat: the
    # agent counts as absent, and the container is held to its share.
    region = prepare(host, "a", sm=30, policy="default")
    path = region.parent / CONTROL_FILE
    if control == "writable":
        path.chmod(0o666)
        with Control.open(path, writable=True) as c:
            c.set_flags(0, shared=False, yield_=False)
            c.heartbeat()
    else:
        path.unlink()
    proc = spawn_probe("init", "ctx", "run", 1.5, 2000, env=env(region))
    result = proc.result(timeout=30)
    line = result.one("run")
    assert abs(line["share"] - 0.30) <= 0.07, line
    assert "control file" in result.stderr, result.stderr
