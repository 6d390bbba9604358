"""The device plugin's /metrics: physical GPU figures (NVML and simulated), the
label sets, HAMi's vGPUmonitor names on and off. Scraped over HTTP from the agent."""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpuslice_cli.dev.stack import DEFAULT_NODES
from gpuslice_common.bus import Bus
from gpuslice_common.config import DevicePluginSettings
from gpuslice_common.servers import free_port
from gpuslice_deviceplugin.discovery import simulated_uuid
from gpuslice_deviceplugin.nodeconfig import SimulatedGpus
from gpuslice_deviceplugin.service import running
from tests.deviceplugin.conftest import FAST, NODE

GiB = 1 << 30
FAKE = [f"GPU-facefeed-0000-4000-8000-0000000000{i:02x}" for i in range(2)]
HAMI_NAMES = (
    "hami_host_gpu_memory_used_bytes",
    "hami_host_gpu_utilization_ratio",
    "hami_host_gpu_memory_controller_utilization_ratio",
    "hami_vgpu_memory_used_bytes",
    "hami_vgpu_memory_limit_bytes",
    "hami_container_device_memory_bytes",
    "hami_container_device_utilization_ratio",
    "HostGPUMemoryUsage",
    "HostCoreUtilization",
    "vGPU_device_memory_usage_in_bytes",
    "vGPU_device_memory_limit_in_bytes",
    "Device_utilization_desc_of_container",
)

Labels = tuple[tuple[str, str], ...]


Samples = dict[str, dict[Labels, float]]


def samples(text: str) -> Samples:
    """Sample name -> (sorted labels -> value)."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def types(text: str) -> dict[str, str]:
    return {f.name: f.type for f in text_string_to_metric_families(text)}


def gpu(node: str, uuid: str, index: int, model: str, **extra: str) -> Labels:
    return tuple(
        sorted({"node": node, "uuid": uuid, "index": str(index), "model": model, **extra}.items())
    )


TOTAL = "gpuslice_gpu_nvml_memory_total_bytes"


def showing(count: int) -> Callable[[Samples], bool]:
    """Whether a scrape shows the memory total of ``count`` cards."""
    return lambda got: len(got.get(TOTAL, {})) == count


async def scrape_until(port: int, done: Callable[[Samples], bool], timeout: float = 20) -> str:
    """/metrics once ``done`` holds for its samples."""
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
        while True:
            try:
                text = (await http.get("/metrics")).text
            except httpx.ConnectError:  # the agent's process is still starting
                text = ""
            if done(samples(text)):
                return text
            assert time.monotonic() < deadline, f"not there yet:\n{text}"
            await asyncio.sleep(0.1)


async def test_nvml_figures_per_gpu_and_what_a_card_cannot_give_is_left_out(
    agent_process: Callable[..., subprocess.Popen[str]], tmp_path: Path
) -> None:
    lost = tmp_path / "lost"
    proc = agent_process(
        FAKENVML_LOST_FILE=str(lost),
        FAKENVML_USED="3g",
        FAKENVML_GPU_UTIL="37,5",
        FAKENVML_MEM_UTIL="12,1",
        FAKENVML_TEMPERATURE="55",  # device 1: not supported
        FAKENVML_POWER="123456,80000",
        FAKENVML_ECC_CORRECTED="3,0",
        FAKENVML_ECC_UNCORRECTED="1",  # device 1: not supported
        GPUSLICE_HEALTH_INTERVAL="100ms",
    )
    port = proc.port  # type: ignore[attr-defined]
    text = await scrape_until(port, showing(2))
    await asyncio.sleep(0.5)  # several more readings: a refusal is still logged once
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
        text = (await http.get("/metrics")).text
        hami_text = (await http.get("/metrics/hami")).text
    lost.write_text("1\n")  # device 1 falls off the bus: its figures go, device 0's stay
    after = await scrape_until(port, showing(1))
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 0, out
    assert "Traceback" not in out

    got = samples(text)
    g0, g1 = (gpu("node-e2e", FAKE[i], i, "Fake GPU") for i in range(2))

    def per_gpu(name: str) -> dict[Labels, float]:
        return got.get(f"gpuslice_gpu_nvml_{name}", {})

    assert per_gpu("memory_used_bytes") == {g0: 3 * GiB, g1: 3 * GiB}
    assert per_gpu("memory_total_bytes") == {g0: 16 * GiB, g1: 16 * GiB}
    assert per_gpu("utilization_percent") == {g0: 37, g1: 5}
    assert per_gpu("memory_utilization_percent") == {g0: 12, g1: 1}
    assert per_gpu("temperature_celsius") == {g0: 55}  # no fake zero for device 1
    assert per_gpu("power_watts") == {g0: pytest.approx(123.456), g1: 80.0}
    assert per_gpu("ecc_errors_total") == {
        gpu("node-e2e", FAKE[0], 0, "Fake GPU", type="corrected"): 3,
        gpu("node-e2e", FAKE[1], 1, "Fake GPU", type="corrected"): 0,
        gpu("node-e2e", FAKE[0], 0, "Fake GPU", type="uncorrected"): 1,
    }
    assert types(text)["gpuslice_gpu_nvml_ecc_errors"] == "counter"
    assert types(text)["gpuslice_gpu_nvml_temperature_celsius"] == "gauge"
    assert got["gpuslice_gpu_active_containers"] == {g0: 0, g1: 0}
    assert len(re.findall(r"GPU 1 \(\S+\): NVML gives no temperature", out)) == 1, out
    assert len(re.findall(r"NVML gives no uncorrected ECC errors", out)) == 1, out
    later = samples(after)
    assert later["gpuslice_gpu_nvml_memory_total_bytes"] == {g0: 16 * GiB}
    assert later["gpuslice_gpu_nvml_power_watts"] == {g0: pytest.approx(123.456)}
    assert later["gpuslice_gpu_active_containers"] == {g0: 0, g1: 0}  # still a known card

    # HAMi's names with HAMi's labels and units: its camelCase ones on /metrics/hami
    legacy = {"nodeid": "node-e2e", "deviceidx": "0", "deviceuuid": FAKE[0]}
    legacy |= {"devicetype": "NVIDIA-Fake GPU", "zone": "vGPU"}
    old = samples(hami_text)
    assert old["HostGPUMemoryUsage"][tuple(sorted(legacy.items()))] == 3 * GiB
    assert old["HostCoreUtilization"][tuple(sorted(legacy.items()))] == 37
    assert "HostGPUMemoryUsage" not in got
    assert not [name for name in old if name.startswith(("gpuslice_", "hami_"))]
    current = {"node": "node-e2e", "device_index": "1", "device_uuid": FAKE[1]}
    current |= {"device_type": "NVIDIA-Fake GPU", "zone": "vGPU"}
    assert got["hami_host_gpu_utilization_ratio"][tuple(sorted(current.items()))] == 5
    del current["node"]
    assert got["hami_host_gpu_memory_controller_utilization_ratio"] == {
        tuple(sorted(current.items())): 1,
        tuple(sorted((current | {"device_index": "0", "device_uuid": FAKE[0]}).items())): 12,
    }


@pytest.mark.parametrize("hami", [True, False])
async def test_simulated_gpus_have_figures_and_hami_names_follow_the_setting(
    make_settings: Callable[..., DevicePluginSettings], bus: Bus, hami: bool
) -> None:
    port = free_port()
    settings = make_settings(metrics_port=port, listen_host="127.0.0.1", hami_metrics=hami)
    async with running(settings, bus=bus, timing=FAST):
        text = await scrape_until(port, showing(2))
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
            hami_answer = await http.get("/metrics/hami")
    got = samples(text)
    model = "NVIDIA A100-SXM4-40GB"  # the test configuration's simulated cards
    cards = [gpu(NODE, simulated_uuid(NODE, i), i, model) for i in range(2)]
    assert got["gpuslice_gpu_nvml_memory_total_bytes"] == dict.fromkeys(cards, 40 * GiB)
    assert got["gpuslice_gpu_nvml_memory_used_bytes"] == dict.fromkeys(cards, 0)  # no container
    assert got["gpuslice_gpu_nvml_utilization_percent"] == dict.fromkeys(cards, 0)
    assert got["gpuslice_gpu_nvml_temperature_celsius"] == dict.fromkeys(cards, 30)
    assert got["gpuslice_gpu_nvml_power_watts"] == dict.fromkeys(cards, 55)  # A100 SXM idle
    assert set(got["gpuslice_gpu_nvml_ecc_errors_total"].values()) == {0}
    assert len(got["gpuslice_gpu_nvml_ecc_errors_total"]) == 4
    assert "gpuslice_gpu_nvml_memory_utilization_percent" not in got  # not simulated
    names = {f.name for f in text_string_to_metric_families(text)}
    hami_families = {n for n in names if n in HAMI_NAMES}
    if hami:  # HAMi's snake_case names on /metrics, its camelCase ones on /metrics/hami
        assert hami_families == {n for n in HAMI_NAMES if n.startswith("hami_")}
        assert hami_answer.status_code == 200
        old = {f.name for f in text_string_to_metric_families(hami_answer.text)}
        assert old == {n for n in HAMI_NAMES if not n.startswith("hami_")}
        assert samples(hami_answer.text)["HostGPUMemoryUsage"]  # the cards' figures
    else:
        assert hami_families == set()
        assert not [line for line in text.splitlines() if "zone=" in line]
        assert hami_answer.status_code == 404
        assert "GPUSLICE_HAMI_METRICS" in hami_answer.json()["error"]


def test_simulated_cards_have_the_memory_their_model_names() -> None:
    """An "...-80GB" card has 80 GiB (81920 MiB), in the dev stack and the default config."""
    named = [(n.model, n.memory_mib) for n in DEFAULT_NODES]
    named.append((SimulatedGpus().model, SimulatedGpus().memory_mib))
    checked = 0
    for model, memory_mib in named:
        size = re.search(r"(\d+)GB$", model)
        if size:
            assert memory_mib == int(size.group(1)) * 1024, model
            checked += 1
    assert checked == 2
    assert ("NVIDIA A100-SXM4-80GB", 81920) in named
