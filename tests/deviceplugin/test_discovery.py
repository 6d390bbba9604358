"""GPU discovery: simulated GPUs from the node config, and NVML against the fake library.

NVML is loaded once per process, so every NVML case runs nvml_discover.py in a
process of its own with LD_LIBRARY_PATH naming the fake's directory (or an
empty one, where no libnvidia-ml.so.1 can load).
"""

from __future__ import annotations

import json
import select
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from gpuslice_common.models import GpuDevice
from gpuslice_deviceplugin.discovery import (
    APPLICATION_XIDS,
    SimulatedBackend,
    open_backend,
    pci_numa_node,
    simulated_uuid,
    visible,
)
from gpuslice_deviceplugin.nodeconfig import FilterDevices, NodeConfig, SimulatedGpus
from tests.native.probe import Native, probe_env

SCRIPT = Path(__file__).with_name("nvml_discover.py")
FAKE_UUID = "GPU-facefeed-0000-4000-8000-0000000000{:02x}"
MiB = 1 << 20


class Discoverer:
    """nvml_discover.py running: each ``step()`` asks for the devices once more."""

    def __init__(self, argv: list[str], env: dict[str, str], timeout: float = 30) -> None:
        self.timeout = timeout
        self.proc = subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.stderr = ""

    def line(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], self.timeout)
        text = self.proc.stdout.readline() if ready else ""
        if not text:
            self.finish()
            pytest.fail(f"no line from nvml_discover.py\n--- stderr\n{self.stderr}")
        parsed: dict[str, Any] = json.loads(text)
        return parsed

    def step(self) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        return self.line()

    def finish(self) -> str:
        """Ends stdin, waits for the exit and returns stderr (the logs)."""
        if self.proc.poll() is None:
            try:
                _, self.stderr = self.proc.communicate(input="", timeout=self.timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                _, self.stderr = self.proc.communicate()
        else:
            self.stderr = self.proc.communicate()[1]
        return self.stderr


Discover = Callable[..., Discoverer]


@pytest.fixture
def discover(native_tools: Native, tmp_path: Path) -> Iterator[Discover]:
    """Starts nvml_discover.py: ``discover(kind, env={...}, nvml=True, config=None)``."""
    started: list[Discoverer] = []

    def start(
        kind: str,
        env: Mapping[str, str | int] | None = None,
        nvml: bool = True,
        config: str | None = None,
    ) -> Discoverer:
        full = probe_env(native_tools, "none", env)
        if not nvml:
            empty = tmp_path / "no-nvml"
            empty.mkdir(exist_ok=True)
            full["LD_LIBRARY_PATH"] = str(empty)
        argv = [sys.executable, str(SCRIPT), kind, "node-a"]
        if config is not None:
            path = tmp_path / f"config-{len(started)}.yaml"
            path.write_text(config)
            argv.append(str(path))
        proc = Discoverer(argv, full)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.proc.poll() is None:
            proc.proc.kill()
        proc.proc.communicate()


@pytest.fixture
def no_system_nvml(native_tools: Native, tmp_path: Path) -> None:
    """Skips where a real libnvidia-ml.so.1 loads without LD_LIBRARY_PATH (a GPU host)."""
    env = probe_env(native_tools, "none", {"LD_LIBRARY_PATH": str(tmp_path)})
    probe = "import ctypes; ctypes.CDLL('libnvidia-ml.so.1')"
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, timeout=30)
    if done.returncode == 0:
        pytest.skip("this host has a system libnvidia-ml.so.1")


# ---------------------------------------------------------------------- simulated


def test_simulated_uuids_are_stable_per_node_and_distinct_across_nodes() -> None:
    gpus = SimulatedGpus(count=4)
    a = [d.uuid for d in SimulatedBackend("node-a", gpus).devices()]
    assert a == [d.uuid for d in SimulatedBackend("node-a", gpus).devices()]
    assert a == [simulated_uuid("node-a", i) for i in range(4)]
    b = [d.uuid for d in SimulatedBackend("node-b", gpus).devices()]
    assert len(set(a) | set(b)) == 8
    assert all(u.startswith("GPU-") and len(u) == 40 for u in a + b)
    # the same in every process and release: uuid5 of a fixed namespace
    assert simulated_uuid("node-a", 0) == "GPU-4e37b7f0-351d-55bd-95c6-c8c7597cb305"
    assert simulated_uuid("node-a", 1) != simulated_uuid("node-a1", 0)


def test_simulated_devices_follow_the_config() -> None:
    gpus = SimulatedGpus(count=4, model="NVIDIA L4", memory_mib=23034, numa_nodes=2, unhealthy=(2,))
    backend = SimulatedBackend("node-a", gpus)
    assert backend.name == "simulated"
    devices = backend.devices()
    assert [d.index for d in devices] == [0, 1, 2, 3]
    assert {(d.model, d.memory_mib, d.mig) for d in devices} == {("NVIDIA L4", 23034, False)}
    assert [d.numa for d in devices] == [0, 0, 1, 1]
    assert [d.healthy for d in devices] == [True, True, False, True]


def test_simulated_update_changes_health_and_count() -> None:
    backend = SimulatedBackend("node-a", SimulatedGpus(count=2))
    before = backend.devices()
    backend.update(SimulatedGpus(count=3, unhealthy=(0,)))
    after = backend.devices()
    assert [d.healthy for d in after] == [False, True, True]
    assert [d.uuid for d in after[:2]] == [d.uuid for d in before]
    backend.close()


def test_visible_drops_filtered_devices() -> None:
    devices = SimulatedBackend("node-a", SimulatedGpus(count=4)).devices()
    filt = FilterDevices(uuids=(devices[1].uuid.upper(),), indices=(3,))
    assert visible(devices, filt) == [devices[0], devices[2]]
    assert visible(devices, FilterDevices()) == devices


def test_open_backend_simulated_uses_the_config() -> None:
    config = NodeConfig(simulate=SimulatedGpus(count=2, model="X"))
    backend = open_backend("simulated", "node-a", config)
    assert isinstance(backend, SimulatedBackend)
    assert [d.model for d in backend.devices()] == ["X", "X"]


def test_pci_numa_node_reads_sysfs(tmp_path: Path) -> None:
    for name, text in (("0000:3b:00.0", "1\n"), ("0000:5e:00.0", "-1\n"), ("0001:af:00.0", "x")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "numa_node").write_text(text)
    assert pci_numa_node("00000000:3B:00.0", tmp_path) == 1
    assert pci_numa_node("0000:3b:00.0", tmp_path) == 1
    assert pci_numa_node("00000000:5E:00.0", tmp_path) is None  # -1: no NUMA affinity
    assert pci_numa_node("00000001:AF:00.0", tmp_path) is None  # unreadable number
    assert pci_numa_node("00000000:86:00.0", tmp_path) is None  # no such device
    assert pci_numa_node("garbage", tmp_path) is None


def test_application_xids_are_the_documented_ones() -> None:
    assert frozenset({13, 31, 43, 45, 68, 109}) == APPLICATION_XIDS


# --------------------------------------------------------------------------- NVML


def test_nvml_backend_reads_the_fake(discover: Discover) -> None:
    env = {
        "FAKECUDA_DEVICES": "4",
        "FAKECUDA_MEMORY": str(16 * 1024 * MiB + MiB - 1),  # MiB are floored
        "FAKENVML_NAME": "NVIDIA H100 80GB HBM3",
        "FAKENVML_NUMA": "0,0,1",  # device 3: not supported, and no PCI info
        "FAKENVML_MIG": "0,0,0,1",
    }
    proc = discover("nvml", env)
    first, second = proc.line(), proc.step()
    logs = proc.finish()
    assert proc.proc.returncode == 0, logs
    assert first == second
    assert first["backend"] == "nvml"
    devices = [GpuDevice.model_validate(d) for d in first["devices"]]
    assert devices == [
        GpuDevice(
            uuid=FAKE_UUID.format(i),
            index=i,
            model="NVIDIA H100 80GB HBM3",
            memory_mib=16384,
            numa=numa,
        )
        for i, numa in enumerate([0, 0, 1])
    ]
    # the MIG card is left out (migStrategy none), said once; the missing event
    # API is noted at debug level only
    warnings = [line for line in logs.splitlines() if line.startswith("WARNING")]
    assert warnings == [
        "WARNING gpuslice_deviceplugin.discovery: "
        f"GPU 3 ({FAKE_UUID.format(3)}) is in MIG mode and migStrategy is none: left out"
    ]
    assert "DEBUG gpuslice_deviceplugin.discovery: NVML events unavailable" in logs, logs


def test_a_lost_gpu_turns_unhealthy_and_back(discover: Discover, tmp_path: Path) -> None:
    lost = tmp_path / "lost"
    proc = discover("nvml", {"FAKECUDA_DEVICES": "3", "FAKENVML_LOST_FILE": str(lost)})
    assert [d["healthy"] for d in proc.line()["devices"]] == [True, True, True]
    lost.write_text("1\n")
    devices = proc.step()["devices"]
    assert [d["healthy"] for d in devices] == [True, False, True]
    assert devices[1]["uuid"] == FAKE_UUID.format(1)  # the facts of the last good read
    assert devices[1]["model"] == "Fake GPU"
    assert [d["healthy"] for d in proc.step()["devices"]] == [True, False, True]
    lost.write_text("0, 1 2")
    assert [d["healthy"] for d in proc.step()["devices"]] == [False, False, False]
    lost.unlink()
    assert [d["healthy"] for d in proc.step()["devices"]] == [True, True, True]
    logs = proc.finish()
    assert proc.proc.returncode == 0, logs
    assert logs.count("GPU 1 (GPU-facefeed-0000-4000-8000-000000000001) cannot be read") == 1
    assert "GPU 1 (GPU-facefeed-0000-4000-8000-000000000001) answers again" in logs


def test_a_gpu_lost_before_its_first_read_is_left_out(discover: Discover, tmp_path: Path) -> None:
    lost = tmp_path / "lost"
    lost.write_text("1")
    proc = discover("nvml", {"FAKECUDA_DEVICES": "2", "FAKENVML_LOST_FILE": str(lost)})
    assert [d["index"] for d in proc.line()["devices"]] == [0]
    assert [d["index"] for d in proc.step()["devices"]] == [0]
    lost.unlink()
    assert [(d["index"], d["healthy"]) for d in proc.step()["devices"]] == [(0, True), (1, True)]
    logs = proc.finish()
    assert logs.count("GPU 1 cannot be read (GPU is lost) and was never seen: left out") == 1


def test_auto_takes_nvml_when_it_sees_gpus(discover: Discover) -> None:
    proc = discover("auto", {"FAKECUDA_DEVICES": "2"})
    report = proc.line()
    proc.finish()
    assert report["backend"] == "nvml"
    assert [d["uuid"] for d in report["devices"]] == [FAKE_UUID.format(0), FAKE_UUID.format(1)]


def test_auto_falls_back_when_nvml_sees_no_gpu(discover: Discover) -> None:
    proc = discover("auto", {"FAKECUDA_DEVICES": "0"}, config="defaults: {simulate: {count: 2}}")
    report = proc.line()
    logs = proc.finish()
    assert report["backend"] == "simulated"
    assert [d["uuid"] for d in report["devices"]] == [simulated_uuid("node-a", i) for i in (0, 1)]
    assert (
        "WARNING gpuslice_deviceplugin.discovery: NVML reports no GPUs: using 2 simulated" in logs
    )


@pytest.mark.usefixtures("no_system_nvml")
def test_auto_falls_back_when_nvml_cannot_load(discover: Discover) -> None:
    proc = discover("auto", nvml=False)
    report = proc.line()
    logs = proc.finish()
    assert proc.proc.returncode == 0, logs
    assert report["backend"] == "simulated"
    assert len(report["devices"]) == 4
    assert (
        "WARNING gpuslice_deviceplugin.discovery: NVML did not initialise: "
        "NVML Shared Library Not Found: using 4 simulated GPUs"
    ) in logs


@pytest.mark.usefixtures("no_system_nvml")
def test_nvml_kind_fails_when_nvml_cannot_load(discover: Discover) -> None:
    proc = discover("nvml", nvml=False)
    report = proc.line()
    proc.finish()
    assert proc.proc.returncode == 1
    assert report == {"error": "NVML did not initialise: NVML Shared Library Not Found"}
