"""The node agent's enforcer against real processes under the fake driver, in real
cgroups laid out as kubelet lays them out, with the fake NVML loaded in this process.

Each GPU process is the probe (native/tests/probe.c) started in a pod container's
cgroup (under a per-test parent of the cgroup v2 tree) and, where it has a grant,
in a mount namespace with the agent's container directory at /run/gpuslice, as
the runtime makes it. The fake driver's processes publish their memory and kernel
time under FAKEGPU_STATE_DIR (native/tests/fake/fake_state.h); the fake NVML
reads them as NVML reads the driver. Nothing of the enforcer is mocked.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import struct
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import pytest
from prometheus_client import CollectorRegistry

from gpuslice_common.bus import Bus
from gpuslice_common.config import DevicePluginSettings
from gpuslice_common.events import EnforcementEvent, EventType, parse_event
from gpuslice_common.grant import Grant, GrantDevice
from gpuslice_common.nodeapi import EnforcedRequest
from gpuslice_common.region import REGION_SIZE
from gpuslice_common.servers import NatsServer
from gpuslice_deviceplugin import driverlimits
from gpuslice_deviceplugin.cgroups import Freezer, find_cgroup2_root
from gpuslice_deviceplugin.containers import HostDir
from gpuslice_deviceplugin.enforcer import DriverLimit, Enforcer, NvmlSampler
from gpuslice_deviceplugin.gateway import InventoryGateway
from gpuslice_deviceplugin.metrics import EnforcerMetrics
from gpuslice_deviceplugin.service import Running as AgentRunning
from tests.deviceplugin.conftest import NODE, an_inventory
from tests.native.container import Container, fake_uuid
from tests.native.probe import Native, ProbeProcess, ProbeSpawner

GiB = 1 << 30
MiB = 1 << 20
CARDS = 2
STATE_FORMAT = "<IIiI" + "Q" * 64  # struct fake_proc_state
DEADLINE_S = 20.0

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="cgroups and namespaces need root")


# ----------------------------------------------------------------------------- the node


class PodCgroups:
    """Pod containers' cgroups as kubelet's systemd driver names them, under a parent
    of the test's own; every process in them is killed and every group removed at the end."""

    def __init__(self, v2_root: Path) -> None:
        self.root = v2_root
        self.parent = v2_root / f"gs-enforce-{uuid.uuid4().hex[:8]}"
        self.parent.mkdir()
        self.made: list[Path] = [self.parent]

    def _make(self, path: Path) -> Path:
        for part in reversed([path, *path.parents]):
            if part.is_relative_to(self.parent) and not part.exists():
                part.mkdir()
                self.made.append(part)
        return path

    def container(self, pod_uid: str, container_id: str | None = None) -> Path:
        slice_ = f"kubepods-burstable-pod{pod_uid.replace('-', '_')}.slice"
        scope = f"cri-containerd-{container_id or uuid.uuid4().hex}.scope"
        base = self.parent / "kubepods.slice" / "kubepods-burstable.slice"
        return self._make(base / slice_ / scope)

    def host(self) -> Path:
        return self._make(self.parent / "system.slice" / "host-service.scope")

    def close(self) -> None:
        for path in sorted(self.made, key=lambda p: len(p.parts), reverse=True):
            with contextlib.suppress(OSError):
                (path / "cgroup.freeze").write_text("0")
            with contextlib.suppress(OSError):
                (path / "cgroup.kill").write_text("1")
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                try:
                    if not (path / "cgroup.procs").read_text().strip():
                        break
                except OSError:
                    break
                time.sleep(0.05)
            with contextlib.suppress(OSError):
                path.rmdir()


@pytest.fixture
def cgroups() -> Iterator[PodCgroups]:
    found = find_cgroup2_root()
    if found is None:
        pytest.skip("no cgroup v2 hierarchy is mounted")
    tree = PodCgroups(Path(found))
    yield tree
    tree.close()


@pytest.fixture
def state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, native_tools: Native) -> Path:
    """The fake GPU state both the probes and this process's fake NVML use."""
    path = tmp_path / "gpu-state"
    path.mkdir()
    monkeypatch.setenv("FAKEGPU_STATE_DIR", str(path))
    monkeypatch.setenv("FAKECUDA_DEVICES", str(CARDS))
    monkeypatch.delenv("FAKENVML_NO_PROCESS_INFO", raising=False)
    # pynvml opens libnvidia-ml.so.1 by name: the fake, loaded first, is that library
    ctypes.CDLL(str(native_tools.fake_dir / "libnvidia-ml.so.1"), mode=ctypes.RTLD_GLOBAL)
    return path


def grant(
    pod_uid: str,
    container: str,
    *devices: tuple[int, int, int],
    overhead: int = 0,
    policy: Literal["default", "force", "disable"] = "force",
) -> Grant:
    """A grant of (card index, memory bytes, sm percent) per card; policy ``force``
    holds a share whether or not the card is shared."""
    return Grant(
        node=NODE,
        pod_uid=pod_uid,
        container=container,
        policy=policy,
        priority=0,
        control_optional=False,
        context_overhead_bytes=overhead,
        devices=tuple(
            GrantDevice(uuid=fake_uuid(i), memory_bytes=memory, sm_percent=sm)
            for i, memory, sm in devices
        ),
    )


class Node:
    """The agent's host directory, the test's cgroups and the probes started in them."""

    def __init__(self, root: Path, cgroups: PodCgroups, spawn: ProbeSpawner, state: Path) -> None:
        self.root = root
        self.host = HostDir(root / "host")
        self.cgroups = cgroups
        self.spawn = spawn
        self.state = state

    def container(self, limits: Grant) -> Container:
        return Container.prepare(self.root, limits)

    def start(
        self,
        cgroup: Path,
        container: Container | None,
        *commands: str,
        build: str = "none",
        env: dict[str, str | int] | None = None,
        prefix_cmd: str = "",
    ) -> ProbeProcess:
        """The probe as the first process of ``cgroup`` (in ``container``'s namespace);
        ``prefix_cmd`` runs first in the same shell (another hierarchy to join)."""
        join = 'echo $$ > "$0/cgroup.procs" && exec "$@"'
        prefix = ["sh", "-c", f"{prefix_cmd} && {join}" if prefix_cmd else join, str(cgroup)]
        if container is not None:
            prefix += container.prefix()
        environment: dict[str, str | int] = {"FAKEGPU_STATE_DIR": str(self.state)}
        environment["FAKECUDA_DEVICES"] = CARDS
        environment.update(env or {})
        return self.spawn(*commands, build=build, env=environment, prefix=prefix)  # type: ignore[arg-type]

    def busy_ns(self, pid: int, card: int) -> int:
        """Kernel time the process has run on ``card``, from its state file."""
        data = (self.state / "procs" / str(pid)).read_bytes()[: struct.calcsize(STATE_FORMAT)]
        fields = struct.unpack(STATE_FORMAT, data)
        return int(fields[4 + 16 + card])


@pytest.fixture
def node(tmp_path: Path, cgroups: PodCgroups, spawn_probe: ProbeSpawner, state_dir: Path) -> Node:
    return Node(tmp_path, cgroups, spawn_probe, state_dir)


def settings_for(node: Node, cgroups: PodCgroups, **overrides: Any) -> DevicePluginSettings:
    values: dict[str, Any] = {
        "node_name": NODE,
        "host_dir": str(node.root / "host"),
        "cgroup_root": str(cgroups.root),
        "enforce_interval": "100ms",
        "enforce_window": "1s",
        "enforce_hog_after": "2s",
        **overrides,
    }
    return DevicePluginSettings(**values)


class Running:
    """An enforcer running its loop, with what it reported."""

    def __init__(self, enforcer: Enforcer, registry: CollectorRegistry) -> None:
        self.enforcer = enforcer
        self.registry = registry
        self.reports: list[EnforcedRequest] = []

    async def record(self, request: EnforcedRequest) -> None:
        self.reports.append(request)

    def metric(self, name: str, **labels: str) -> float:
        value = self.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value

    def kinds(self) -> list[str]:
        return [r.kind for r in self.reports]


@contextlib.asynccontextmanager
async def enforcing(
    settings: DevicePluginSettings,
    send: Callable[[EnforcedRequest], Any] | None = None,
    driver_limit: DriverLimit | None = None,
) -> AsyncIterator[Running]:
    registry = CollectorRegistry()
    sampler = NvmlSampler()
    enforcer = Enforcer(
        settings,
        HostDir(Path(settings.host_dir)),
        sampler,
        EnforcerMetrics(registry),
        driver_limit=driver_limit,
    )
    running = Running(enforcer, registry)

    async def both(request: EnforcedRequest) -> None:
        await running.record(request)
        if send is not None:
            await send(request)

    task = asyncio.create_task(enforcer.run(both))
    try:
        yield running
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        enforcer.close()


async def until(check: Callable[[], bool], what: str, timeout: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"not within {timeout}s: {what}")
        await asyncio.sleep(0.05)


def dead(proc: ProbeProcess) -> bool:
    return proc.poll() is not None


# ----------------------------------------------------------------------------- memory


async def test_a_process_escaping_the_interposer_is_killed_and_the_event_recorded(
    node: Node, cgroups: PodCgroups, nats_server: NatsServer, redis_url: str, prefix: str
) -> None:
    """Finding 11: a process the interposer does not run in (no preload: a private
    driver copy, a static binary) allocates past its grant; NVML shows it, the agent
    kills it and the inventory records io.gpuslice.enforce.memory-kill."""
    pod = str(uuid.uuid4())
    box = node.container(grant(pod, "main", (0, 1 * GiB, 0)))
    settings = settings_for(node, cgroups, nats_url=nats_server.url, subject_prefix=prefix)
    async with an_inventory(nats_server.url, redis_url, prefix):
        bus = await Bus.connect(settings, "test/node", inbox_prefix=f"_INBOX.{NODE}")
        watcher = await Bus.connect(settings, "test/watcher")
        try:
            events: asyncio.Queue[bytes] = asyncio.Queue()

            async def seen(msg: Any) -> None:
                await events.put(msg.data)

            await watcher.nc.subscribe(f"{prefix}.events.enforce.>", cb=seen)
            await watcher.nc.flush()
            gateway = InventoryGateway(settings, bus)
            loop = asyncio.get_running_loop()

            async def send(request: EnforcedRequest) -> None:
                await gateway.enforced(request, loop.time() + 10)

            probe = node.start(
                node.cgroups.container(pod), box, "init", "ctx", "alloc", "3g", "hold"
            )
            line = probe.wait_for("alloc")
            assert line["rc"] == 0, probe.describe()  # nothing inside the process refused it
            async with enforcing(settings, send) as running:
                await until(lambda: dead(probe), "the escaping process killed")
                raw = await asyncio.wait_for(events.get(), DEADLINE_S)
            event = parse_event(raw)
            assert event.type is EventType.ENFORCE_MEMORY_KILL
            payload = event.payload()
            assert isinstance(payload, EnforcementEvent)
            assert (payload.node, payload.pod_uid, payload.container) == (NODE, pod, "main")
            assert payload.card == fake_uuid(0)
            assert payload.pid == probe.pid
            assert payload.used_bytes >= 3 * GiB
            assert payload.allowed_bytes < 2 * GiB
            assert probe.returncode == -9
            assert running.metric("gpuslice_enforce_kills_total", kind="memory") == 1
        finally:
            await bus.close()
            await watcher.close()


@pytest.mark.parametrize("listed", ["FAKENVML_GRAPHICS_PROCS", "FAKENVML_MPS_PROCS"])
async def test_a_process_nvml_lists_as_graphics_or_mps_is_held_to_the_grant(
    node: Node, cgroups: PodCgroups, monkeypatch: pytest.MonkeyPatch, listed: str
) -> None:
    """A tenant's own Vulkan or OpenGL driver, or an MPS server of its own, uses the
    card without a compute context of its own: NVML lists such processes apart from
    the compute ones, and they are held to the grant the same."""
    pod = str(uuid.uuid4())
    box = node.container(grant(pod, "main", (0, 1 * GiB, 0), (1, 1 * GiB, 0)))
    probe = node.start(node.cgroups.container(pod), box, "hold")
    probe.wait_for("hold")
    monkeypatch.setenv(listed, f"{probe.pid}:3g")
    async with enforcing(settings_for(node, cgroups)) as running:
        await until(lambda: dead(probe), "the process past its grant killed")
        await until(lambda: running.kinds() == ["memory-kill"], "one memory-kill report")
    assert running.reports[0].used_bytes == 3 * GiB


async def test_memory_the_driver_takes_outside_hooked_calls_is_caught(
    node: Node, cgroups: PodCgroups, native: Native
) -> None:
    """Finding 10's class: device memory the driver takes without a hooked call
    (here each context's own memory, which the grant's context overhead of 0 does
    not cover) passes the grant while the interposer, preloaded, counts none of it."""
    pod = str(uuid.uuid4())
    box = node.container(grant(pod, "main", (0, 1 * GiB, 0)))
    probe = node.start(
        node.cgroups.container(pod),
        box,
        *["init", "ctx", "newctx", "newctx", "alloc", "512m", "hold"],
        build="release",
        env={"FAKECUDA_CONTEXT_BYTES": "1g"},
    )
    line = probe.wait_for("alloc")
    assert line["rc"] == 0, probe.describe()  # the interposer let it through
    async with enforcing(settings_for(node, cgroups)) as running:
        await until(lambda: dead(probe), "the process holding uncounted memory killed")
        await until(lambda: running.kinds() == ["memory-kill"], "one memory-kill report")
    report = running.reports[0]
    assert report.used_bytes >= 3 * GiB + 512 * MiB, report


async def test_a_process_whose_main_thread_left_is_still_held_to_its_grant(
    node: Node, cgroups: PodCgroups
) -> None:
    """A process that escapes the interposer and then ends its main thread (another
    thread keeps it and its memory) reads "Z" in /proc/<pid>/stat and has no
    /proc/<pid>/root: it is no zombie, and is killed like any escape."""
    pod = str(uuid.uuid4())
    box = node.container(grant(pod, "main", (0, 1 * GiB, 0)))
    probe = node.start(node.cgroups.container(pod), box, "init", "ctx", "alloc", "3g", "hideleader")
    assert probe.wait_for("hideleader")["rc"] == 0, probe.describe()
    stat = Path(f"/proc/{probe.pid}/stat")
    await until(
        lambda: stat.read_text().rsplit(")", 1)[1].split()[0] == "Z", "the main thread gone"
    )
    async with enforcing(settings_for(node, cgroups)) as running:
        await until(lambda: dead(probe), "the process without its main thread killed")
        await until(lambda: running.kinds() == ["memory-kill"], "one memory-kill report")
    assert running.reports[0].pid == probe.pid
    assert running.reports[0].container == "main"


async def test_a_grant_of_no_memory_is_not_taken_as_no_limit(
    node: Node, cgroups: PodCgroups
) -> None:
    """A grant's 0 bytes on a card is nothing (the interposer refuses every allocation
    under it), so a process past it without the interposer is killed."""
    pod = str(uuid.uuid4())
    box = node.container(grant(pod, "main", (0, 0, 0)))
    probe = node.start(node.cgroups.container(pod), box, "init", "ctx", "alloc", "1g", "hold")
    assert probe.wait_for("alloc")["rc"] == 0, probe.describe()
    async with enforcing(settings_for(node, cgroups)) as running:
        await until(lambda: dead(probe), "the process past a grant of 0 bytes killed")
        await until(lambda: running.kinds() == ["memory-kill"], "one memory-kill report")
    assert running.reports[0].allowed_bytes < 1 * GiB


async def test_a_region_written_past_its_size_is_cut_back(node: Node, cgroups: PodCgroups) -> None:
    """The region is the one file a container may write, and it lies on the node's
    disk: a tenant writing past its end (through its /run/gpuslice/region) would
    fill that disk. The agent cuts it back to its size; the container runs on."""
    pod = str(uuid.uuid4())
    box = node.container(grant(pod, "main", (0, 1 * GiB, 0)))
    probe = node.start(node.cgroups.container(pod), box, "init", "ctx", "alloc", "1m", "hold")
    probe.wait_for("hold")
    region = box.region
    with region.open("r+b") as f:  # what the tenant's writes do to the host's file
        f.seek(REGION_SIZE + 64 * MiB)
        f.write(b"x" * MiB)
    assert region.stat().st_size > REGION_SIZE
    async with enforcing(settings_for(node, cgroups)) as running:
        await until(lambda: region.stat().st_size == REGION_SIZE, "the region cut back")
        assert running.metric("gpuslice_enforce_regions_truncated_total") == 1
    assert not dead(probe)
    assert running.reports == []


async def test_a_container_within_its_grant_is_left_alone(node: Node, cgroups: PodCgroups) -> None:
    pod = str(uuid.uuid4())
    box = node.container(grant(pod, "main", (0, 1 * GiB, 0)))
    probe = node.start(node.cgroups.container(pod), box, "init", "ctx", "alloc", "900m", "hold")
    probe.wait_for("hold")
    async with enforcing(settings_for(node, cgroups)) as running:
        await until(
            lambda: (
                running.metric("gpuslice_enforce_layer", uuid=fake_uuid(0), layer="memory") == 1
            ),
            "card sampled",
        )
        await asyncio.sleep(1.0)
    assert not dead(probe)
    assert running.reports == []


async def test_a_container_seen_on_a_card_is_then_held_by_the_driver(
    node: Node, cgroups: PodCgroups
) -> None:
    """Layer 1 reached through layer 2: the container's cgroup, learnt from its first
    GPU process, gets its grant as the driver's hard limit; a later process of the
    container allocating past the grant without the interposer is refused by the
    driver itself, and nothing needs killing."""
    pod = str(uuid.uuid4())
    box = node.container(grant(pod, "main", (0, 1 * GiB, 0)))
    group = node.cgroups.container(pod)
    first = node.start(group, box, "init", "ctx", "alloc", "100m", "hold")
    first.wait_for("hold")
    held: list[tuple[str, str, driverlimits.LimitResult]] = []

    def hold(card: str, cgroup: str, memory: int) -> None:
        held.append(
            (card, cgroup, driverlimits.ensure_limit(card, cgroup, memory, root=cgroups.root))
        )

    async with enforcing(settings_for(node, cgroups), driver_limit=hold) as running:
        await until(lambda: bool(held), "the container's driver limit ensured")
        card, cgroup, result = held[0]
        assert (card, result.outcome) == (fake_uuid(0), "set"), held
        assert Path(cgroups.root, cgroup.lstrip("/")) == group
        second = node.start(group, box, "init", "ctx", "alloc", "2g", "hold")
        assert second.wait_for("alloc")["rc"] == 2, second.describe()  # out of memory
        await asyncio.sleep(0.5)
        assert not dead(first)
        assert not dead(second)
        assert running.reports == []
    assert len({(c, g) for c, g, _ in held}) == 1  # one container on one card


# ----------------------------------------------------------------------------- ungranted


async def test_a_pod_process_on_a_card_without_a_grant_is_killed(
    node: Node, cgroups: PodCgroups
) -> None:
    pod = str(uuid.uuid4())
    box = node.container(grant(pod, "main", (0, 1 * GiB, 0)))
    other_card = node.start(
        node.cgroups.container(pod), box, "init", "ctx", "1", "alloc", "1m", "hold"
    )
    stranger = str(uuid.uuid4())  # a pod gpuslice gave nothing: no grant directory
    no_grant = node.start(
        node.cgroups.container(stranger), None, "init", "ctx", "alloc", "1m", "hold"
    )
    other_card.wait_for("hold")
    no_grant.wait_for("hold")
    async with enforcing(settings_for(node, cgroups)) as running:
        await until(lambda: dead(other_card) and dead(no_grant), "both ungranted processes killed")
        await until(lambda: len(running.reports) == 2, "two reports")
    by_pod = {r.pod_uid: r for r in running.reports}
    assert set(running.kinds()) == {"ungranted-kill"}
    assert (by_pod[pod].container, by_pod[pod].card) == ("main", fake_uuid(1))
    assert (by_pod[stranger].container, by_pod[stranger].card) == (None, fake_uuid(0))


async def test_a_process_showing_another_containers_grant_directory_is_killed(
    node: Node, cgroups: PodCgroups
) -> None:
    """A process of one container that takes another container's root as its own
    (chroot into /proc/<pid>/root, with the pod's process namespace shared) shows
    that container's grant directory from its own cgroup. Counted as that container,
    it would have the duty cycle freeze its own cgroup while the other runs free:
    once a container's processes are seen in one cgroup, one in another is killed."""
    pod = str(uuid.uuid4())
    box = node.container(grant(pod, "main", (0, 1 * GiB, 10)))
    first = node.start(node.cgroups.container(pod), box, "init", "ctx", "alloc", "1m", "hold")
    first.wait_for("hold")
    async with enforcing(settings_for(node, cgroups)) as running:
        await until(
            lambda: (
                running.metric("gpuslice_enforce_layer", uuid=fake_uuid(0), layer="memory") == 1
            ),
            "the container seen on its card",
        )
        other = node.start(node.cgroups.container(pod), box, "init", "ctx", "hold")
        other.wait_for("hold")
        await until(lambda: dead(other), "the process in another container's cgroup killed")
        await until(lambda: running.kinds() == ["ungranted-kill"], "one ungranted-kill report")
        await asyncio.sleep(0.5)
    assert not dead(first)
    assert running.reports[0].pid == other.pid
    assert running.reports[0].container == "main"


async def test_a_restarted_container_in_a_new_cgroup_is_not_taken_for_another(
    node: Node, cgroups: PodCgroups
) -> None:
    """A container restarted between two samples runs in a new cgroup with the same
    grant directory; its old cgroup runs nothing any more, so the new one is the
    container's, not a stray's."""
    pod = str(uuid.uuid4())
    box = node.container(grant(pod, "main", (0, 1 * GiB, 0)))
    first = node.start(node.cgroups.container(pod), box, "init", "ctx", "alloc", "1m", "hold")
    first.wait_for("hold")
    settings = settings_for(node, cgroups, enforce_interval="3s")
    async with enforcing(settings) as running:
        await until(
            lambda: (
                running.metric("gpuslice_enforce_layer", uuid=fake_uuid(0), layer="memory") == 1
            ),
            "the container seen on its card",
        )
        first.kill()
        first.wait()
        second = node.start(node.cgroups.container(pod), box, "init", "ctx", "alloc", "1m", "hold")
        second.wait_for("hold")
        sampled = running.metric("gpuslice_enforce_sample_seconds_count")
        await until(
            lambda: running.metric("gpuslice_enforce_sample_seconds_count") >= sampled + 2,
            "two samples since",
        )
    assert not dead(second)
    assert running.reports == []


async def test_a_host_process_outside_kubepods_is_left_alone(
    node: Node, cgroups: PodCgroups
) -> None:
    probe = node.start(node.cgroups.host(), None, "init", "ctx", "alloc", "70g", "hold")
    probe.wait_for("hold")
    async with enforcing(settings_for(node, cgroups)) as running:
        await until(
            lambda: running.metric("gpuslice_enforce_host_processes", uuid=fake_uuid(0)) == 1,
            "the host process counted",
        )
        await asyncio.sleep(1.0)
    assert not dead(probe)
    assert running.reports == []


# ----------------------------------------------------------------------------- compute


async def test_a_container_over_its_compute_share_is_frozen_and_slowed(
    node: Node, cgroups: PodCgroups
) -> None:
    """No interposer paces it: kernels back to back run the card at ~100 % against a
    20 % share; the agent freezes its cgroup part of each interval and its share falls."""
    pod = str(uuid.uuid4())
    box = node.container(grant(pod, "main", (0, 1 * GiB, 20)))
    cgroup = node.cgroups.container(pod)
    probe = node.start(cgroup, box, "init", "ctx", "run", "60", "2000", "hold")
    await until(lambda: (node.state / "procs" / str(probe.pid)).exists(), "the probe running")

    def share(seconds: float) -> float:
        before = node.busy_ns(probe.pid, 0)
        time.sleep(seconds)
        return (node.busy_ns(probe.pid, 0) - before) / (seconds * 1e9)

    free = await asyncio.to_thread(share, 1.5)
    assert free > 0.8, free
    frozen_seen = False
    async with enforcing(settings_for(node, cgroups)) as running:
        await until(lambda: running.kinds() == ["throttle"], "a throttle report")

        def watch_freeze(seconds: float) -> bool:
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                if (cgroup / "cgroup.freeze").read_text().strip() == "1":
                    return True
                time.sleep(0.01)
            return False

        frozen_seen = await asyncio.to_thread(watch_freeze, 2.0)
        await asyncio.sleep(1.0)  # the duty cycle settles
        throttled = await asyncio.to_thread(share, 3.0)
    assert frozen_seen
    assert throttled < 0.6, throttled
    assert (cgroup / "cgroup.freeze").read_text().strip() == "0"  # thawed at the end
    assert not dead(probe)
    report = running.reports[0]
    assert report.share_percent == 20
    assert report.busy_percent > 50


async def test_a_container_frozen_when_the_agent_died_is_thawed_when_it_starts_again(
    node: Node, cgroups: PodCgroups, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An agent killed outright (OOM, SIGKILL) never runs its thaw: a container it
    had frozen for its part of an interval would stay frozen for good. The agent
    notes the freeze files of the containers it throttles and thaws them at start."""
    pod = str(uuid.uuid4())
    box = node.container(grant(pod, "main", (0, 1 * GiB, 20)))
    cgroup = node.cgroups.container(pod)
    probe = node.start(cgroup, box, "init", "ctx", "run", "60", "2000", "hold")
    await until(lambda: (node.state / "procs" / str(probe.pid)).exists(), "the probe running")
    settings = settings_for(node, cgroups)
    monkeypatch.setattr(Enforcer, "thaw_all", lambda self: None)  # it dies: nothing thaws
    async with enforcing(settings) as running:
        await until(lambda: running.kinds() == ["throttle"], "a throttle report")
    Freezer.set(str(cgroup / "cgroup.freeze"), True)  # it died in a frozen part
    assert (cgroup / "cgroup.freeze").read_text().strip() == "1"
    monkeypatch.undo()
    again = Enforcer(
        settings, HostDir(Path(settings.host_dir)), None, EnforcerMetrics(CollectorRegistry())
    )
    assert (cgroup / "cgroup.freeze").read_text().strip() == "0"
    again.close()
    assert not dead(probe)


@pytest.mark.parametrize("policy", ["default", "disable"])
async def test_a_policy_that_lets_a_container_use_a_card_it_has_alone_is_kept(
    node: Node, cgroups: PodCgroups, policy: Literal["default", "disable"]
) -> None:
    """Under the node's ``default`` policy a share holds only while the card is shared
    (the interposer lets a container alone on its card run free), under ``disable``
    never: an honest container running so is not throttled. With ``default``, once
    another pod's container runs on the card, the share holds again."""
    pod = str(uuid.uuid4())
    box = node.container(grant(pod, "main", (0, 1 * GiB, 20), policy=policy))
    probe = node.start(node.cgroups.container(pod), box, "init", "ctx", "run", "60", "2000", "hold")
    await until(lambda: (node.state / "procs" / str(probe.pid)).exists(), "the probe running")
    async with enforcing(settings_for(node, cgroups)) as running:
        sampled = running.metric("gpuslice_enforce_sample_seconds_count")
        await until(
            lambda: running.metric("gpuslice_enforce_sample_seconds_count") >= sampled + 20,
            "twenty samples",
        )
        assert running.reports == []
        other = str(uuid.uuid4())
        neighbour = node.container(grant(other, "main", (0, 1 * GiB, 50)))
        node.start(node.cgroups.container(other), neighbour, "init", "ctx", "hold")
        if policy == "default":
            await until(
                lambda: running.kinds() == ["throttle"], "throttled once the card is shared"
            )
        else:
            sampled = running.metric("gpuslice_enforce_sample_seconds_count")
            await until(
                lambda: running.metric("gpuslice_enforce_sample_seconds_count") >= sampled + 20,
                "twenty samples more",
            )
            assert running.reports == []
    assert not dead(probe)


async def test_without_cgroup_v2_freezing_the_v1_freezer_throttles(
    node: Node, cgroups: PodCgroups, tmp_path: Path
) -> None:
    """A node whose containers' freeze files are the v1 freezer's: the process is
    placed in a kubelet-named freezer group too, and that group is frozen."""
    v1 = Path("/sys/fs/cgroup/freezer")
    if not (v1 / "cgroup.procs").exists():
        pytest.skip("no cgroup v1 freezer hierarchy is mounted")
    pod = str(uuid.uuid4())
    box = node.container(grant(pod, "main", (0, 1 * GiB, 20)))
    cgroup = node.cgroups.container(pod)
    frozen_group = v1 / cgroup.relative_to(cgroups.root)
    frozen_group.mkdir(parents=True)
    try:
        join = f'echo $$ > "{frozen_group}/cgroup.procs"'
        probe = node.start(cgroup, box, "init", "ctx", "run", "60", "2000", "hold", prefix_cmd=join)
        await until(lambda: (node.state / "procs" / str(probe.pid)).exists(), "the probe running")
        no_v2 = tmp_path / "no-v2"  # a v2 tree without the container's freeze file
        no_v2.mkdir()
        settings = settings_for(
            node, cgroups, cgroup_root=str(no_v2), cgroup_v1_freezer_root=str(v1)
        )

        def watch_freeze(seconds: float) -> bool:
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                if (frozen_group / "freezer.state").read_text().strip() != "THAWED":
                    return True
                time.sleep(0.01)
            return False

        async with enforcing(settings) as running:
            await until(lambda: running.kinds() == ["throttle"], "a throttle report")
            assert await asyncio.to_thread(watch_freeze, 2.0)
        assert (frozen_group / "freezer.state").read_text().strip() == "THAWED"
        assert (cgroup / "cgroup.freeze").read_text().strip() == "0"  # v2 left alone
    finally:
        with contextlib.suppress(OSError):
            (frozen_group / "freezer.state").write_text("THAWED")
        with contextlib.suppress(OSError):
            (cgroup / "cgroup.kill").write_text("1")
        for _ in range(100):
            with contextlib.suppress(OSError):
                if not (frozen_group / "cgroup.procs").read_text().strip():
                    break
            await asyncio.sleep(0.05)
        for path in [frozen_group, *frozen_group.parents]:
            if path == v1:
                break
            with contextlib.suppress(OSError):
                path.rmdir()


async def test_a_kernel_holding_the_card_while_frozen_is_killed(
    node: Node, cgroups: PodCgroups
) -> None:
    """One kernel that never ends: freezing the process does not stop it on the card."""
    pod = str(uuid.uuid4())
    box = node.container(grant(pod, "main", (0, 1 * GiB, 10)))
    probe = node.start(
        node.cgroups.container(pod), box, "init", "ctx", "launch", "1", "600000000", "hold"
    )
    probe.wait_for("hold")
    async with enforcing(settings_for(node, cgroups)) as running:
        await until(lambda: dead(probe), "the kernel hog killed")
        await until(lambda: "compute-kill" in running.kinds(), "a compute-kill report")
    assert running.kinds() == ["throttle", "compute-kill"]
    assert running.reports[1].busy_percent >= 90


async def test_kernels_that_outlast_the_freeze_with_short_gaps_are_killed(
    node: Node, cgroups: PodCgroups
) -> None:
    """Kernels shorter than enforce_hog_after with a short idle gap between them: no
    run of samples at 90 % lasts long enough to count as one hog, freezing does not
    stop a kernel on the card, and the container keeps ~80 % of the card against a
    10 % share. Its busy share far above the part of the time it is left thawed says
    freezing does not hold it: killed."""
    pod = str(uuid.uuid4())
    box = node.container(grant(pod, "main", (0, 1 * GiB, 10)))
    kernels = ["launch", "1", "1500000", "sync", "sleep", "300"] * 30
    probe = node.start(node.cgroups.container(pod), box, "init", "ctx", *kernels, "hold")
    probe.wait_for("ctx")
    async with enforcing(settings_for(node, cgroups)) as running:
        await until(lambda: dead(probe), "the container its freezing does not hold killed", 40)
        await until(lambda: "compute-kill" in running.kinds(), "a compute-kill report")
    assert running.kinds() == ["throttle", "compute-kill"]
    assert running.reports[1].share_percent == 10


async def test_a_container_leaving_the_card_between_processes_stays_throttled(
    node: Node, cgroups: PodCgroups
) -> None:
    """The same kernels from a new process each time, with a moment between two in
    which no process of the container is on the card: that moment must not end the
    throttle and its record, or freezing that does not hold the container is never
    found out (it was reset before enforce_hog_after each time)."""
    pod = str(uuid.uuid4())
    box = node.container(grant(pod, "main", (0, 1 * GiB, 10)))
    child = ["fork", "init", "ctx", "launch", "1", "600000", "sync", "forkwait", "sleep", "300"]
    probe = node.start(node.cgroups.container(pod), box, *(child * 60), "hold")
    async with enforcing(settings_for(node, cgroups)) as running:
        await until(lambda: "compute-kill" in running.kinds(), "a compute-kill report", 40)
    assert running.kinds()[-1] == "compute-kill"
    assert running.kinds().count("throttle") == 1  # one throttle, however many processes
    assert not dead(probe)  # the parent, on no card, is not the one killed


# ----------------------------------------------------------------------------- what cannot be read


async def test_an_unreadable_cgroup_reports_the_layer_missing_and_kills_nothing(
    node: Node, cgroups: PodCgroups, tmp_path: Path
) -> None:
    """The agent's /proc (a tree of the test's own) gives garbage for one process's
    cgroup and stat: nothing is guessed, the card's layers are missing, the loop goes on."""
    pod = str(uuid.uuid4())
    box = node.container(grant(pod, "main", (0, 1 * GiB, 0)))
    probe = node.start(node.cgroups.container(pod), box, "init", "ctx", "alloc", "3g", "hold")
    probe.wait_for("hold")
    proc = tmp_path / "proc"
    (proc / str(probe.pid)).mkdir(parents=True)
    (proc / str(probe.pid) / "stat").write_bytes(b"\xff\xfe garbage )) \x00\n")
    (proc / str(probe.pid) / "cgroup").write_bytes(b"0::/kubepods.slice/\xff\xff\n")
    settings = settings_for(node, cgroups, proc_root=str(proc))
    async with enforcing(settings) as running:
        await until(lambda: fake_uuid(0) in running.enforcer.card_layers(), "card 0 sampled")
        await asyncio.sleep(0.5)
        assert running.enforcer.card_layers()[fake_uuid(0)] == (False, False)
        assert running.enforcer.card_layers()[fake_uuid(1)] == (True, True)  # nothing there
        assert running.metric("gpuslice_enforce_layer", uuid=fake_uuid(0), layer="memory") == 0
        assert running.metric("gpuslice_enforce_unreadable_total", what="cgroup") >= 1
        # the cgroup file turns into a path below kubepods that names no pod
        (proc / str(probe.pid) / "stat").write_text(f"{probe.pid} (probe) S" + " 1" * 30 + "\n")
        (proc / str(probe.pid) / "cgroup").write_text("0::/kubepods.slice/not-a-pod\n")
        await asyncio.sleep(0.5)
        assert running.enforcer.card_layers()[fake_uuid(0)] == (False, False)
    assert not dead(probe)
    assert running.reports == []


async def test_a_card_whose_nvml_cannot_list_processes_reports_the_layer_missing(
    node: Node, cgroups: PodCgroups, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKENVML_NO_PROCESS_INFO", "1")
    pod = str(uuid.uuid4())
    box = node.container(grant(pod, "main", (0, 1 * GiB, 0)))
    probe = node.start(node.cgroups.container(pod), box, "init", "ctx", "1", "alloc", "1m", "hold")
    probe.wait_for("hold")
    async with enforcing(settings_for(node, cgroups)) as running:
        await until(lambda: len(running.enforcer.card_layers()) == CARDS, "both cards sampled")
        await asyncio.sleep(0.5)
        layers = running.enforcer.card_layers()
    assert layers == {fake_uuid(0): (True, True), fake_uuid(1): (False, False)}
    assert not dead(probe)
    assert running.reports == []


async def test_a_process_whose_memory_nvml_cannot_give_reports_the_layer_missing(
    node: Node, cgroups: PodCgroups, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NVML lists a process with usedGpuMemory NVML_VALUE_NOT_AVAILABLE (pynvml: None):
    what it holds is unknown, not 0, so the card's memory layer is missing (said and
    counted) rather than reported as holding the container to its grant."""
    pod = str(uuid.uuid4())
    box = node.container(grant(pod, "main", (0, 1 * GiB, 0), (1, 1 * GiB, 0)))
    probe = node.start(node.cgroups.container(pod), box, "hold")
    probe.wait_for("hold")
    monkeypatch.delenv("FAKEGPU_STATE_DIR")  # the fake NVML lists FAKENVML_PROCS instead
    monkeypatch.setenv("FAKENVML_PROCS", f"{probe.pid}:{(1 << 64) - 1}")
    async with enforcing(settings_for(node, cgroups)) as running:
        await until(lambda: len(running.enforcer.card_layers()) == CARDS, "both cards sampled")
        await asyncio.sleep(0.5)
        layers = running.enforcer.card_layers()
    assert layers == {fake_uuid(0): (False, True), fake_uuid(1): (False, True)}
    assert running.metric("gpuslice_enforce_unreadable_total", what="memory") >= 2
    assert running.metric("gpuslice_enforce_layer", uuid=fake_uuid(0), layer="memory") == 0
    assert not dead(probe)
    assert running.reports == []


def test_the_fake_driver_state_file_is_the_shared_struct(node: Node, cgroups: PodCgroups) -> None:
    """Contract 1's layout, read here with Python's struct as another process would."""
    probe = node.start(node.cgroups.host(), None, "init", "ctx", "1", "alloc", "5m", "hold")
    probe.wait_for("hold")
    data = (node.state / "procs" / str(probe.pid)).read_bytes()
    fields = struct.unpack(STATE_FORMAT, data[: struct.calcsize(STATE_FORMAT)])
    magic, version, pid, ndev = fields[:4]
    used, ctx = fields[4 : 4 + 16], fields[4 + 48 : 4 + 64]
    assert (magic, version, pid, ndev) == (0x53504746, 1, probe.pid, CARDS)
    assert used[1] == 5 * MiB
    assert used[0] == 0
    assert ctx[1] == 1
    assert ctx[0] == 0
    # NVML's unversioned query (rows of pid, bytes) lists it on card 1 only
    nvml = ctypes.CDLL("libnvidia-ml.so.1")
    assert nvml.nvmlInit_v2() == 0
    try:
        rows = (ctypes.c_uint64 * 2 * 8)()
        for card, expected in ((0, []), (1, [(probe.pid, 5 * MiB)])):
            handle = ctypes.c_void_p()
            assert nvml.nvmlDeviceGetHandleByIndex_v2(card, ctypes.byref(handle)) == 0
            count = ctypes.c_uint(8)
            fn = nvml.nvmlDeviceGetComputeRunningProcesses
            assert fn(handle, ctypes.byref(count), rows) == 0
            found = [(int(rows[i][0]) & 0xFFFFFFFF, int(rows[i][1])) for i in range(count.value)]
            assert found == expected
    finally:
        nvml.nvmlShutdown()
    assert json.dumps(probe.lines)  # the probe ran its commands


async def test_the_agent_runs_an_enforcer_that_reports_no_layer_without_nvml(
    agent: AgentRunning,
) -> None:
    """Wired into the agent process; the simulated backend has no NVML to sample, so
    no card has a layer to report (the inventory's default, missing, stands)."""
    assert agent.enforcer is not None
    assert agent.enforcer.sampler is None
    assert any(task.get_name() == "enforcer" for task in agent.tasks)
    await asyncio.sleep(0.3)
    assert agent.enforcer.card_layers() == {}
