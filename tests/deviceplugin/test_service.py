"""The agent as a whole: its HTTP side, heartbeat, clean-up, and the process end to end."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpuslice_cli.dev.kubelet import DevKubelet
from gpuslice_common.bus import Bus
from gpuslice_common.config import DevicePluginSettings
from gpuslice_common.kube import LocalKubeApi
from gpuslice_common.ledger import Ledger
from gpuslice_common.models import NodeInventory, TelemetrySample
from gpuslice_common.servers import free_port
from gpuslice_deviceplugin.containers import ContainerOwner
from gpuslice_deviceplugin.service import running
from gpuslice_inventory.service import Running as InventoryRunning
from tests.deviceplugin.conftest import FAST, NODE, bind, placement, uuids
from tests.native.probe import ProbeProcess, ProbeSpawner, probe_argv
from tests.rawhttp import post_huge

ROOT = Path(__file__).resolve().parents[2]


def exists(path: Path) -> bool:
    return path.exists()


def read_owner(directory: Path) -> bytes:
    return (directory / "owner.json").read_bytes()


def samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


async def test_heartbeat_publishes_the_inventory_every_interval(
    make_settings: Callable[..., DevicePluginSettings], kubelet: DevKubelet, bus: Bus
) -> None:
    got: list[NodeInventory] = []

    async def on_inventory(_subject: str, inv: NodeInventory) -> None:
        got.append(inv)

    await bus.subscribe(bus.subjects.inventory(NODE), NodeInventory, on_inventory)
    await bus.flush()
    settings = make_settings(inventory_interval="200ms")
    async with running(settings, bus=bus, serve_http=False, timing=FAST):
        await asyncio.sleep(1.1)
    assert 4 <= len(got) <= 8  # one at start, then one every 200 ms
    assert all(len(inv.devices) == 2 and inv.split_count == 4 for inv in got)
    assert got[-1].sent_at > got[0].sent_at


async def test_http_health_readiness_and_metrics(
    make_settings: Callable[..., DevicePluginSettings],
    short_dir: Path,
    bus: Bus,
    plugin_ledger: Ledger,
    inventory: InventoryRunning,
) -> None:
    port = free_port()
    settings = make_settings(metrics_port=port, listen_host="127.0.0.1")
    async with (
        running(settings, bus=bus, timing=FAST) as state,
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http,
    ):
        assert (await http.get("/healthz")).status_code == 200
        assert (await http.get("/readyz")).status_code == 503  # no kubelet yet
        # no request has a body: one over 64 KiB is refused unread, serving goes on
        status, _, _ = await asyncio.to_thread(
            post_huge, port, "/healthz", 64 * 1024 * 1024, chunked=False, send_body=False
        )
        assert status == 413
        status, _, _ = await asyncio.to_thread(
            post_huge, port, "/healthz", 64 * 1024 * 1024, chunked=True
        )
        assert status == 413
        assert (await http.get("/healthz")).status_code == 200
        kubelet = DevKubelet(short_dir / "kubelet")
        await kubelet.start()
        try:
            plugin = await kubelet.registration()
            await asyncio.wait_for(state.link.registered.wait(), 5)
            await plugin.list_after(0)
            assert (await http.get("/readyz")).status_code == 200
            await plugin_ledger.register_node(state.agent.inventory(), rebuilt=True)
            gpu = uuids(state)[0]
            await bind(plugin_ledger, placement("m1", [[(gpu, 512, 10)]]))
            await bind(plugin_ledger, placement("m2", [[(gpu, 512, 10)]]))  # the same shape
            with pytest.raises(grpc.aio.AioRpcError, match="any of pods m1, m2") as refused:
                await plugin.admit_container(1)  # either pod's: refused, not guessed
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            await plugin_ledger.release("m2", "bind undone", kubelet_may_admit=False)
            await plugin.admit_container(1)
            text = (await http.get("/metrics")).text
            await plugin.close()  # kubelet stops watching: not ready, once the stream ends
            deadline = time.monotonic() + 5
            while (await http.get("/readyz")).status_code != 503:
                assert time.monotonic() < deadline, "still ready with no ListAndWatch"
                await asyncio.sleep(0.05)
        finally:
            await kubelet.stop()
    assert samples(text, "gpuslice_deviceplugin_allocations_total") == {
        (("outcome", "ok"),): 1.0,
        (("outcome", "error"),): 1.0,
    }
    assert samples(text, "gpuslice_deviceplugin_ambiguous_allocations_total") == {(): 1.0}
    assert samples(text, "gpuslice_deviceplugin_registrations_total")[(("outcome", "ok"),)] == 1.0
    assert samples(text, "gpuslice_deviceplugin_devices") == {
        (("health", "healthy"),): 2.0,
        (("health", "unhealthy"),): 0.0,
    }


async def test_clean_up_removes_directories_of_pods_gone_from_the_ledger(
    make_settings: Callable[..., DevicePluginSettings],
    kubelet: DevKubelet,
    bus: Bus,
    plugin_ledger: Ledger,
    inventory: InventoryRunning,
) -> None:
    settings = make_settings(cleanup_grace="1ms")
    async with running(settings, bus=bus, serve_http=False, timing=FAST) as state:
        await plugin_ledger.register_node(state.agent.inventory(), rebuilt=True)
        plugin = await kubelet.registration()
        await plugin.list_after(0)
        gpu = uuids(state)[0]
        await bind(plugin_ledger, placement("done", [[(gpu, 100, 5)]]))
        await plugin.admit_container(1)
        await bind(plugin_ledger, placement("live", [[(gpu, 100, 5)]]))
        await plugin.admit_container(1)
        await plugin_ledger.release("done", reason="pod deleted")
        await asyncio.sleep(0.01)
        assert await state.clean_up() == ["done"]
        assert not exists(state.host.container_dir("done", "c0"))
        assert exists(state.host.container_dir("live", "c0"))
        await plugin_ledger.redis.flushdb()  # Redis lost its data: nothing proves 'live' ended
        await asyncio.sleep(0.01)
        assert await state.clean_up() == []
        assert state.gone == frozenset()
        assert exists(state.host.container_dir("live", "c0"))


async def test_with_the_api_a_pod_unknown_to_both_is_gone(
    make_settings: Callable[..., DevicePluginSettings],
    kubelet: DevKubelet,
    bus: Bus,
    plugin_ledger: Ledger,
    inventory: InventoryRunning,
) -> None:
    kube = LocalKubeApi()
    kube.add_pod({"metadata": {"name": "pod-kept", "namespace": "team", "uid": "kept"}})
    settings = make_settings(cleanup_grace="1ms")
    async with running(settings, bus=bus, kube=kube, serve_http=False, timing=FAST) as state:
        await plugin_ledger.register_node(state.agent.inventory(), rebuilt=True)
        plugin = await kubelet.registration()
        await plugin.list_after(0)
        gpu = uuids(state)[0]
        await bind(plugin_ledger, placement("kept", [[(gpu, 100, 5)]]))
        await plugin.admit_container(1)
        await bind(plugin_ledger, placement("lost", [[(gpu, 100, 5)]]))
        await plugin.admit_container(1)
        await plugin_ledger.redis.flushdb()
        await asyncio.sleep(0.01)
        assert await state.clean_up() == ["lost"]
        assert exists(state.host.container_dir("kept", "c0"))


async def test_a_busy_metrics_port_is_a_clear_error(
    make_settings: Callable[..., DevicePluginSettings], bus: Bus
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        settings = make_settings(metrics_port=port, listen_host="127.0.0.1")
        with pytest.raises(OSError, match=f"cannot serve HTTP on 127.0.0.1:{port}"):
            async with running(settings, bus=bus, timing=FAST):
                pass


def test_bad_settings_and_config_end_the_process_with_a_message(tmp_path: Path) -> None:
    base = {k: v for k, v in os.environ.items() if not k.startswith("GPUSLICE_")}
    base["GPUSLICE_METRICS_PORT"] = str(free_port())  # never bound: the start fails first
    missing = subprocess.run(
        [sys.executable, "-m", "gpuslice_deviceplugin"],
        env=base,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode == 2
    assert "GPUSLICE_NODE_NAME" in missing.stderr
    assert "Traceback" not in missing.stderr
    config = tmp_path / "nodes.yaml"
    config.write_text("defaults: {deviceSplitCnt: 3}\n")
    bad = subprocess.run(
        [sys.executable, "-m", "gpuslice_deviceplugin"],
        env={
            **base,
            "GPUSLICE_NODE_NAME": "n1",
            "GPUSLICE_NODE_CONFIG_FILE": str(config),
            "GPUSLICE_CONNECT_WAIT": "1s",
            "GPUSLICE_NATS_URL": f"nats://127.0.0.1:{free_port()}",
        },
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2, bad.stderr
    assert "devicesplitcnt" in bad.stderr.lower()
    assert "Traceback" not in bad.stderr


# ---------------------------------------------------------------- end to end


def container_env(response_env: dict[str, str], mounts: dict[str, str]) -> dict[str, str]:
    """What the container's processes see, run here as plain processes: the grant
    directory is where its mount comes from (/run/gpuslice does not exist here)."""
    env = dict(response_env)
    env["GPUSLICE_GRANT_DIR"] = mounts["/run/gpuslice"]
    env["LD_PRELOAD"] = mounts["/usr/local/gpuslice/libgpuslice.so"]
    return env


def bare_process(spawn_probe: ProbeSpawner, mounts: dict[str, str], *commands: str) -> ProbeProcess:
    """A process of the container started with nothing in its environment but the
    preload, the fake driver and where the grant is (as ``env -i`` would)."""
    native = spawn_probe.native
    env = {
        "LD_PRELOAD": mounts["/usr/local/gpuslice/libgpuslice.so"],
        "LD_LIBRARY_PATH": str(native.fake_dir),
        "FAKECUDA_DEVICES": "2",
        "FAKECUDA_MEMORY": "16g",
        "GPUSLICE_GRANT_DIR": mounts["/run/gpuslice"],
    }
    stderr = spawn_probe.directory / f"bare-{len(spawn_probe.started)}.stderr"
    proc = ProbeProcess(probe_argv(native, commands, ()), env, stderr)
    spawn_probe.started.append(proc)  # stopped at the test's end
    return proc


async def test_end_to_end_an_allocate_answer_drives_the_interposer(
    agent_process: Callable[[], subprocess.Popen[str]],
    kubelet: DevKubelet,
    plugin_ledger: Ledger,
    bus: Bus,
    spawn_probe: ProbeSpawner,
    inventory: InventoryRunning,
) -> None:
    inventories: asyncio.Queue[NodeInventory] = asyncio.Queue()
    telemetry: asyncio.Queue[TelemetrySample] = asyncio.Queue()

    async def on_inventory(_subject: str, inv: NodeInventory) -> None:
        await inventories.put(inv)

    async def on_sample(_subject: str, sample: TelemetrySample) -> None:
        await telemetry.put(sample)

    await bus.subscribe(bus.subjects.inventory("node-e2e"), NodeInventory, on_inventory)
    await bus.subscribe(bus.subjects.telemetry_node("node-e2e"), TelemetrySample, on_sample)
    await bus.flush()
    proc = agent_process()
    plugin = await kubelet.registration(timeout=90)
    devices = await plugin.list_after(0)
    fake = [f"GPU-facefeed-0000-4000-8000-0000000000{i:02x}" for i in range(2)]
    assert {d.ID.split("::")[0] for d in devices} == set(fake)
    assert len(devices) == 10
    # the inventory service's part: the published inventory becomes ledger state
    published = await asyncio.wait_for(inventories.get(), 10)
    assert [(d.uuid, d.memory_mib, d.model) for d in published.devices] == [
        (u, 16384, published.devices[0].model) for u in fake
    ]
    await plugin_ledger.register_node(published, rebuilt=True)
    pod = placement("e2e", [[(fake[1], 1024, 40)]], node="node-e2e")
    await bind(plugin_ledger, pod)
    response = await plugin.admit_container(1)
    mounts = {m.container_path: m.host_path for m in response.mounts}
    env = container_env(dict(response.envs), mounts)
    assert env["NVIDIA_VISIBLE_DEVICES"] == fake[1]
    assert env["GPUSLICE_CONTEXT_OVERHEAD"] == "64m"
    env.update(GPUSLICE_TELEMETRY_INTERVAL="100ms", FAKECUDA_DEVICES="2", FAKECUDA_MEMORY="16g")
    # the fake shows every GPU, as a runtime would not: the probe picks fake[1] (ordinal 1)
    probe = spawn_probe(
        "init", "ctx", "1", "alloc", "900m", "alloc", "100m", "info", "hold", build="none", env=env
    )
    lines = [probe.next_line(20) for _ in range(6)]
    allocs = [line for line in lines if line["cmd"] == "alloc"]
    assert [a["rc"] for a in allocs] == [0, 2]  # 64 + 900 fit in 1024 MiB; 100 more do not
    info = next(line for line in lines if line["cmd"] == "info")
    assert info["total"] == 1024 << 20
    sample = await asyncio.wait_for(telemetry.get(), 10)
    while not sample.devices[0].denied_allocations:  # samples from before the refusal
        sample = await asyncio.wait_for(telemetry.get(), 10)
    assert (sample.node, sample.pod_uid, sample.container) == ("node-e2e", "e2e", "c0")
    dev = sample.devices[0]  # the container's device 0 (the fake also shows fake[0])
    assert (dev.uuid, dev.limit_bytes, dev.used_bytes) == (fake[1], 1024 << 20, 964 << 20)
    assert dev.denied_allocations == 1
    # the agent reads the region and shows the usage before any telemetry is needed
    port = proc.port  # type: ignore[attr-defined]
    deadline = time.monotonic() + 10
    used: dict[tuple[tuple[str, str], ...], float] = {}
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
        while time.monotonic() < deadline and not used:
            used = samples(
                (await http.get("/metrics")).text, "gpuslice_container_memory_used_bytes"
            )
            await asyncio.sleep(0.1)
    mine = {dict(k)["uuid"]: v for k, v in used.items() if dict(k)["pod_uid"] == "e2e"}
    assert mine[fake[1]] == float(964 << 20)
    owner = ContainerOwner.from_json(read_owner(Path(mounts["/run/gpuslice"])))
    assert owner.devices == (fake[1],)
    probe.stop()
    # Another container, whose process starts with an empty environment: no limit,
    # no region path, no UUID list there. Its grant still holds it.
    await bind(plugin_ledger, placement("bare", [[(fake[0], 512, 40)]], node="node-e2e"))
    response = await plugin.admit_container(1)
    mounts = {m.container_path: m.host_path for m in response.mounts}
    assert "CUDA_DEVICE_MEMORY_LIMIT_0" in response.envs  # what the process does without
    bare = bare_process(
        spawn_probe, mounts, "init", "ctx", "0", "alloc", "400m", "alloc", "100m", "info"
    )
    result = bare.result(timeout=20)
    allocs = [line["rc"] for line in result.by_cmd("alloc")]
    assert allocs == [0, 2], result.describe()  # 64 + 400 fit in 512 MiB; 100 more do not
    assert result.one("info")["total"] == 512 << 20
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 0, out
    assert "Traceback" not in out
