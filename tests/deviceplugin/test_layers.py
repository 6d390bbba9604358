"""The node agent's per-card report of the enforcement layers: in its inventory and
as the gpuslice_enforcement_layer gauge, on the fake NVML and on simulated cards."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from gpuslice_common.bus import Bus
from gpuslice_common.config import DevicePluginSettings
from gpuslice_common.models import LayerState
from gpuslice_deviceplugin import driverlimits
from gpuslice_deviceplugin.discovery import simulated_uuid
from gpuslice_deviceplugin.driverlimits import CardSupport, LimitResult
from gpuslice_deviceplugin.service import running
from tests.deviceplugin.conftest import FAST, NODE
from tests.deviceplugin.test_metrics import FAKE, Samples, samples, scrape_until

LAYER = "gpuslice_enforcement_layer"
ON, OFF = LayerState.ENFORCING, LayerState.MISSING
ROOT = driverlimits.cgroup2_root()


def layer(node: str, uuid: str, name: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted({"node": node, "uuid": uuid, "layer": name}.items()))


def reported(count: int) -> Callable[[Samples], bool]:
    return lambda got: len(got.get(LAYER, {})) == count


async def test_the_agent_on_nvml_reports_driver_limits_per_card(
    agent_process: Callable[..., subprocess.Popen[str]], tmp_path: Path
) -> None:
    """Card 0's driver limits memory per cgroup; card 1's does not (NOT_SUPPORTED)."""
    state = tmp_path / "fakegpu"
    (state / "procs").mkdir(parents=True)
    proc = agent_process(
        FAKEGPU_STATE_DIR=str(state),
        FAKENVML_NO_MEMORY_LIMITS="1",
        GPUSLICE_HEALTH_INTERVAL="100ms",
    )
    text = await scrape_until(proc.port, reported(8))  # type: ignore[attr-defined]
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 0, out
    got = samples(text)[LAYER]
    node = "node-e2e"
    assert got[layer(node, FAKE[0], "driver")] == 1
    assert got[layer(node, FAKE[1], "driver")] == 0
    for card in FAKE:
        assert got[layer(node, card, "interposer")] == 1
        # no sampler report yet: the agent's own layers are missing, never guessed
        assert got[layer(node, card, "agent-memory")] == 0
        assert got[layer(node, card, "agent-compute")] == 0
    assert f"GPU {FAKE[0]}: driver memory limits supported (driver)" in out
    assert f"GPU {FAKE[1]}: driver memory limits missing (nvmlDeviceGetMemoryLimits_v1" in out


async def test_the_sampler_decides_the_agents_layers_and_a_broken_one_leaves_them_missing(
    settings: DevicePluginSettings, bus: Bus, caplog: pytest.LogCaptureFixture
) -> None:
    first, second = simulated_uuid(NODE, 0), simulated_uuid(NODE, 1)
    sampled: Mapping[str, tuple[bool, bool]] = {first: (True, False), "GPU-gone": (True, True)}
    async with running(settings, bus=bus, timing=FAST) as state:
        agent = state.agent
        inventory = agent.inventory()
        # no sampler: every agent layer missing; simulated cards have no driver limits
        assert {u: c.enforcing() for u, c in inventory.layers.items()} == {
            first: ("interposer",),
            second: ("interposer",),
        }
        assert inventory.layers[first].driver_note == "no NVML (simulated backend)"

        agent.card_layers = lambda: sampled
        await agent.refresh()
        layers = agent.inventory().layers
        assert set(layers) == {first, second}  # a card the node does not list is left out
        assert (layers[first].agent_memory, layers[first].agent_compute) == (ON, OFF)
        assert (layers[second].agent_memory, layers[second].agent_compute) == (OFF, OFF)
        got = samples(generate_latest(state.registry).decode())[LAYER]
        assert got[layer(NODE, first, "agent-memory")] == 1
        assert got[layer(NODE, second, "agent-memory")] == 0

        def broken() -> Mapping[str, tuple[bool, bool]]:
            raise RuntimeError("sampler gone")

        agent.card_layers = broken
        with caplog.at_level(logging.ERROR):
            await agent.refresh()
            await agent.refresh()
        assert all(c.agent_memory is OFF for c in agent.inventory().layers.values())
        assert caplog.text.count("could not be read") == 1  # said once, not at every refresh


@pytest.mark.skipif(ROOT is None or not os.access(ROOT, os.W_OK), reason="needs cgroup v2")
async def test_a_container_the_driver_does_not_hold_marks_its_card_missing(
    settings: DevicePluginSettings, bus: Bus
) -> None:
    assert ROOT is not None
    first, second = simulated_uuid(NODE, 0), simulated_uuid(NODE, 1)
    group = ROOT / f"gpuslice-test-{uuid.uuid4().hex[:12]}"
    group.mkdir()
    cgroup = "/" + group.name
    try:
        async with running(settings, bus=bus, timing=FAST) as state:
            agent = state.agent
            agent.driver_support = {u: CardSupport(True, "dmem") for u in (first, second)}
            assert agent.inventory().layers[first].driver is ON
            agent.note_driver_limit(first, cgroup, LimitResult("failed", detail="NO_PERMISSION"))
            layers = agent.inventory().layers
            assert layers[first].driver is OFF
            assert layers[first].driver_note == "limit not applied: NO_PERMISSION"
            assert layers[second].driver is ON  # the other card's containers are held
            agent.note_driver_limit(first, cgroup, LimitResult("set", driverlimits.NO_LIMIT))
            assert agent.inventory().layers[first].driver is ON
            agent.note_driver_limit(first, cgroup, LimitResult("failed", detail="gone soon"))
            assert agent.inventory().layers[first].driver is OFF
            group.rmdir()  # the container ended: its failure no longer counts
            assert agent.inventory().layers[first].driver is ON
            got = samples(generate_latest(state.registry).decode())
            assert got["gpuslice_driver_limits_total"] == {
                (("outcome", "failed"),): 2,
                (("outcome", "set"),): 1,
            }
    finally:
        if group.exists():
            group.rmdir()
