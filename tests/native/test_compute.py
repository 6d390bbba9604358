"""The compute limiter on the fake GPU: the share a process gets, per policy, for
every launch path, and the node agent's flags."""

from __future__ import annotations

import mmap
import os
import threading
import time
from pathlib import Path

import pytest

from gpuslice_common.control import Control
from gpuslice_common.region import REGION_SIZE, Region, ffi
from tests.native.probe import Build, ProbeRunner, ProbeSpawner


def sm(region: Path, limit: int, policy: str = "force", **extra: str | int) -> dict[str, str | int]:
    return {
        "CUDA_DEVICE_SM_LIMIT": limit,
        "GPU_CORE_UTILIZATION_POLICY": policy,
        "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(region),
        **extra,
    }


def share(
    run_probe: ProbeRunner, env: dict[str, str | int], kind: str = "kernel", seconds: float = 2
) -> float:
    line = run_probe("init", "ctx", "run", seconds, 2000, kind, env=env, timeout=60).one("run")
    assert line["rc"] == 0, line
    return float(line["share"])


def test_without_a_limit_the_gpu_is_all_yours(run_probe: ProbeRunner, region_path: Path) -> None:
    assert share(run_probe, {"CUDA_DEVICE_MEMORY_SHARED_CACHE": str(region_path)}, seconds=1) > 0.9


@pytest.mark.parametrize("limit", [20, 50, 80])
def test_force_holds_the_share_within_five_points(
    run_probe: ProbeRunner, region_path: Path, limit: int
) -> None:
    got = share(run_probe, sm(region_path, limit))
    assert abs(got - limit / 100) <= 0.05, got


@pytest.mark.parametrize("kind", ["ex", "coop", "graph", "legacy", "grid", "gridasync", "multi"])
def test_every_launch_path_is_limited(run_probe: ProbeRunner, region_path: Path, kind: str) -> None:
    got = share(run_probe, sm(region_path, 40), kind=kind, seconds=1.5)
    assert abs(got - 0.40) <= 0.07, got


def test_per_thread_stream_launches_are_limited(run_probe: ProbeRunner, region_path: Path) -> None:
    line = run_probe(
        "init",
        "ctx",
        "run",
        1.5,
        2000,
        "kernel",
        env=sm(region_path, 40),
        options=("--proc", "--ptds"),
        timeout=60,
    ).one("run")
    assert abs(line["share"] - 0.40) <= 0.07, line


def test_disable_never_limits(run_probe: ProbeRunner, region_path: Path) -> None:
    assert share(run_probe, sm(region_path, 30, "disable"), seconds=1) > 0.9


def agent(region_path: Path, *, shared: bool, yield_: bool = False) -> None:
    """The node agent's control file of a container without a grant (beside its
    region), as the coordinator writes it for a granted one."""
    dir_fd = os.open(region_path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        Control.create(dir_fd, f"{region_path.name}.control")
    finally:
        os.close(dir_fd)
    with Control.open(Path(f"{region_path}.control"), writable=True) as control:
        control.set_flags(0, shared=shared, yield_=yield_)
        control.heartbeat()


class Scribbler:
    """A process of the container writing the region in a loop, as a hostile one
    would between its launches: ``fields`` maps offsets to the 8 bytes put there."""

    def __init__(self, region_path: Path, fields: dict[int, int]) -> None:
        self._path = region_path
        self._fields = fields
        self._stop = threading.Event()
        self.writes = 0
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with self._path.open("r+b") as f, mmap.mmap(f.fileno(), REGION_SIZE) as m:
            while not self._stop.is_set():
                for offset, value in self._fields.items():
                    m[offset : offset + 8] = value.to_bytes(8, "little")
                self.writes += 1
                time.sleep(0.0002)

    def __enter__(self) -> Scribbler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def device_field(name: str, index: int = 0) -> int:
    return (
        ffi.offsetof("gs_region_t", "devices")
        + index * ffi.sizeof("gs_device_t")
        + ffi.offsetof("gs_device_t", name)
    )


def test_stamping_the_regions_heartbeat_does_not_lift_the_limit(
    run_probe: ProbeRunner, region_path: Path
) -> None:
    # The agent's heartbeat and flags come from its control file: a process that
    # stamps the region's old heartbeat field and clears the flags (what made a
    # 10 % share run at 99.99 %) is still held to its share.
    run_probe("init", "ctx", env=sm(region_path, 30, "default"))  # creates the region
    heartbeat = ffi.offsetof("gs_region_t", "agent_heartbeat_ns")
    flags = device_field("flags")  # with the 4 bytes after it (sm_limit: unread under force)
    now = time.monotonic_ns
    with Scribbler(region_path, {heartbeat: now(), flags: 0}) as scribbler:
        got = share(run_probe, sm(region_path, 30, "default"), seconds=1.5)
    assert scribbler.writes > 100
    assert abs(got - 0.30) <= 0.07, got


def test_winding_the_regions_clock_back_does_not_lift_the_limit(
    run_probe: ProbeRunner, region_path: Path
) -> None:
    # Zeroing the container's clock in the region before each launch made a 10 %
    # share run at 97 %: the process keeps a clock of its own.
    run_probe("init", "ctx", env=sm(region_path, 20))
    with Scribbler(region_path, {device_field("tat_ns"): 0}) as scribbler:
        got = share(run_probe, sm(region_path, 20), seconds=2)
    assert scribbler.writes > 100
    assert abs(got - 0.20) <= 0.05, got


def test_default_limits_while_the_agent_says_the_gpu_is_shared(
    run_probe: ProbeRunner, region_path: Path
) -> None:
    run_probe("init", "ctx", env=sm(region_path, 30, "default"))  # creates the region
    agent(region_path, shared=False)
    assert share(run_probe, sm(region_path, 30, "default"), seconds=1) > 0.9
    agent(region_path, shared=True)
    assert abs(share(run_probe, sm(region_path, 30, "default"), seconds=1.5) - 0.30) <= 0.07


def test_default_without_a_live_agent_limits(run_probe: ProbeRunner, region_path: Path) -> None:
    assert abs(share(run_probe, sm(region_path, 30, "default"), seconds=1.5) - 0.30) <= 0.07


def test_the_region_records_busy_and_throttled_time(
    run_probe: ProbeRunner, region_path: Path
) -> None:
    share(run_probe, sm(region_path, 25), seconds=1)
    with Region.open(region_path) as region:
        device = region.devices()[0]
        assert device.sm_limit_percent == 25
        assert 0.15e9 < device.busy_ns < 0.4e9
        assert device.throttled_ns > 0.5e9


def test_a_low_priority_process_yields_while_the_agent_asks(
    spawn_probe: ProbeSpawner, run_probe: ProbeRunner, region_path: Path
) -> None:
    env = sm(region_path, 0, "default", CUDA_TASK_PRIORITY=1)
    run_probe("init", "ctx", env=env)
    agent(region_path, shared=True, yield_=True)
    proc = spawn_probe("init", "ctx", "launch", 1, 1000, "sync", env=env)
    time.sleep(1.0)
    assert proc.poll() is None  # still waiting to launch
    agent(region_path, shared=True, yield_=False)
    result = proc.result(timeout=10)
    assert result.one("launch")["rc"] == 0
    with Region.open(region_path) as region:
        assert region.devices()[0].throttled_ns >= 0.9e9


def test_processes_of_one_container_share_its_limit(
    spawn_probe: ProbeSpawner, region_path: Path
) -> None:
    # Each fake process has a GPU engine of its own, so the two do not contend:
    # only the container's shared clock holds them to 50 % together.
    procs = [
        spawn_probe("init", "ctx", "run", 2, 2000, "kernel", env=sm(region_path, 50))
        for _ in range(2)
    ]
    shares = [proc.result(timeout=60).one("run")["share"] for proc in procs]
    assert abs(sum(shares) - 0.50) <= 0.05, shares
    assert abs(shares[0] - shares[1]) <= 0.05, shares


def set_clock(region_path: Path, ahead_ns: int) -> None:
    """Puts device 0's limiter clock `ahead_ns` into the future, as a region file kept
    across a reboot (CLOCK_MONOTONIC restarts) would."""
    from gpuslice_common.region import ffi

    offset = ffi.offsetof("gs_region_t", "devices") + ffi.offsetof("gs_device_t", "tat_ns")
    with region_path.open("r+b") as f:
        f.seek(offset)
        f.write((time.monotonic_ns() + ahead_ns).to_bytes(8, "little"))


def test_a_stale_clock_far_ahead_does_not_stall_launches(
    spawn_probe: ProbeSpawner, run_probe: ProbeRunner, region_path: Path
) -> None:
    holder = spawn_probe("init", "ctx", "hold", env=sm(region_path, 50))
    holder.wait_for("hold")  # another process lives: the clock is not reset on joining
    set_clock(region_path, 3600 * 10**9)
    started = time.monotonic()
    result = run_probe(
        "init", "ctx", "launch", 4, 1000, "sync", env=sm(region_path, 50), timeout=20
    )
    assert result.one("launch")["rc"] == 0
    assert time.monotonic() - started < 5
    assert "limiter clock was" in result.stderr
    holder.stop()


def test_a_new_process_pays_the_debt_of_the_containers_earlier_ones(
    run_probe: ProbeRunner, region_path: Path
) -> None:
    # Five processes one after the other, each one 100 ms kernel at 10 %: each
    # is charged at exit, and the next starts from the container's clock. (A
    # process joining alone used to reset it, and one whose only window was never
    # charged by a later launch paid nothing: five ran in about 0.5 s.)
    started = time.monotonic()
    for _ in range(5):
        result = run_probe(
            "init", "ctx", "launch", 1, 100000, "sync", env=sm(region_path, 10), timeout=60
        )
        assert result.one("launch")["rc"] == 0
    took = time.monotonic() - started
    # 0.5 s of kernels at 10 % is 5 s; the last process's debt is left to a next one
    assert took >= 0.6 * 5 * 0.1 / 0.10, took
    with Region.open(region_path) as region:
        assert 0.45e9 < region.devices()[0].busy_ns < 0.7e9


@pytest.mark.parametrize("teardown", [("reset", "0"), ("release", "0")])
def test_the_limit_holds_after_the_context_is_torn_down(
    run_probe: ProbeRunner, region_path: Path, teardown: tuple[str, str]
) -> None:
    commands = ("init", "ctx", "0", "run", 1, 1000, *teardown, "ctx", "0", "run", 1, 1000)
    result = run_probe(*commands, env=sm(region_path, 25), timeout=60)
    first, second = (line["share"] for line in result.by_cmd("run"))
    assert abs(first - 0.25) <= 0.06, result.describe()
    assert abs(second - 0.25) <= 0.06, result.describe()


def measured_pause() -> tuple[str, ...]:
    """Bursts of launches around a pause: once a pause after a long enough burst has
    been measured with the GPU keeping pace, windows are unmarked (no event after
    each launch) and launches take the lock-free path."""
    return ("launch 40 0", "sleep 5", "launch 40 0")


@pytest.mark.parametrize("options", [(), ("--proc",), ("--proc", "--ptds")])
@pytest.mark.parametrize("windows", ["marked", "unmarked"])
def test_a_graph_captured_under_a_limit_stays_whole(
    run_probe: ProbeRunner, region_path: Path, windows: str, options: tuple[str, ...]
) -> None:
    # 300 launches into a capturing stream: more than a window holds, so a window
    # would end inside the capture. The fake invalidates a capture that gets an
    # event recorded into it; launches into it run nothing.
    before = measured_pause() if windows == "unmarked" else ()
    result = run_probe(
        "init", "ctx", *before, "capture 300 100", "launch 10 0", "capture 300 100",
        env=sm(region_path, 30), options=options,
    )  # fmt: skip
    for line in result.by_cmd("capture"):
        assert (line["rc"], line["end_rc"], line["graph_us"], line["ran"]) == (0, 0, 30000, 0), (
            result.describe()
        )
    assert result.last("launch")["rc"] == 0


@pytest.mark.parametrize(("switch", "options"), [("ctx 1", ()), ("push 1", ("--proc",))])
def test_each_device_is_charged_its_own_launches(
    run_probe: ProbeRunner, region_path: Path, switch: str, options: tuple[str, ...]
) -> None:
    # Back-to-back 2 ms kernels on one device, then the other, then the first:
    # each run gets its share of its own device.
    back = "ctx 0" if switch.startswith("ctx") else "pop"
    result = run_probe(
        "init", "ctx 0", "run 1 2000", switch, "run 1 2000", back, "run 1 2000",
        env={**sm(region_path, 50), "FAKECUDA_DEVICES": 2}, options=options, timeout=60,
    )  # fmt: skip
    shares = [line["share"] for line in result.by_cmd("run")]
    assert all(abs(got - 0.50) <= 0.08 for got in shares), result.describe()
    with Region.open(region_path) as region:
        busy = [device.busy_ns for device in region.devices()[:2]]
    # device 0 ran 2 s at 50 %, device 1 one second
    assert 0.8e9 < busy[0] < 1.2e9, (busy, result.describe())
    assert 0.4e9 < busy[1] < 0.6e9, (busy, result.describe())


@pytest.mark.parametrize(("switch", "options"), [("ctx", ()), ("push", ("--proc",))])
def test_a_thread_moving_between_devices_charges_each_its_own(
    run_probe: ProbeRunner, region_path: Path, switch: str, options: tuple[str, ...]
) -> None:
    # One thread alternates devices, bursts of 40 kernels of 5 us each, in
    # unmarked windows (a pause measured on each device first): the lock-free
    # path takes the device from a per-thread cache that must follow every
    # context switch (set, pushed, popped).
    if switch == "ctx":
        rounds = ("ctx 0", "launch 40 5", "ctx 1", "launch 40 5", "sleep 4") * 40
    else:
        rounds = ("launch 40 5", "push 1", "launch 40 5", "pop", "sleep 4") * 40
    result = run_probe(
        "init", "ctx 1", *measured_pause(), "ctx 0", *measured_pause(), *rounds,
        env={**sm(region_path, 30), "FAKECUDA_DEVICES": 2}, options=options, timeout=60,
    )  # fmt: skip
    assert all(line["rc"] == 0 for line in result.lines), result.describe()
    with Region.open(region_path) as region:
        busy = [device.busy_ns for device in region.devices()[:2]]
    # each device ran 40 x 40 x 5 us = 8 ms of kernels; windows charge what they
    # span (the fake engine wakes up late after a pause, later on a loaded
    # machine), so more, but alike for the two: a cache that missed a switch
    # would charge one device the other's kernels and leave it near nothing
    assert all(got > 6.4e6 for got in busy), busy
    assert max(busy) < 4 * min(busy), busy


def test_a_bursty_process_below_its_share_is_charged_its_launches_not_its_pauses(
    run_probe: ProbeRunner, region_path: Path
) -> None:
    # Bursts of empty kernels 6 ms apart: windows (unmarked once a pause was
    # measured) span pauses and take them out. Charged the pauses, the process
    # would be a GPU busy all the time, three times its share, and would wait
    # about two thirds of the time. (A start-up hiccup of the fake may be charged
    # once: the first launch starts its engine thread.)
    bursts = ("launch 50 0", "sleep 6") * 40
    started = time.monotonic()
    result = run_probe("init", "ctx", *bursts, env=sm(region_path, 30), timeout=60)
    wall_ns = (time.monotonic() - started) * 1e9
    assert all(line["rc"] == 0 for line in result.by_cmd("launch"))
    with Region.open(region_path) as region:
        device = region.devices()[0]
    assert device.busy_ns < 0.25 * wall_ns, (device, wall_ns)
    assert device.throttled_ns < 0.15 * wall_ns, (device, wall_ns)


@pytest.mark.parametrize("options", [(), ("--proc", "--ptds")])
def test_threads_launching_at_once_share_the_limit(
    run_probe: ProbeRunner, region_path: Path, build: Build, options: tuple[str, ...]
) -> None:
    # Four threads launch into one device together (the default stream, or each
    # its per-thread one): the lock-free path lets them into a window while
    # another thread may be closing it.
    line = run_probe(
        "init", "ctx", "threads 4 1.5 1000",
        env=sm(region_path, 40), build=build, options=options, timeout=90,
    ).one("threads")  # fmt: skip
    assert (line["rc"], line["threads"]) == (0, 4), line
    assert abs(line["share"] - 0.40) <= 0.07, line


def test_a_long_kernel_before_each_pause_is_charged_its_gpu_time(
    run_probe: ProbeRunner, region_path: Path
) -> None:
    # Each round a short pause the GPU keeps pace through (so windows are unmarked,
    # the next pauses estimated), then 40 empty kernels and a 50 ms one before a
    # 100 ms pause: the long kernel runs into the pause. Charged only up to its
    # launch (the pause taken as idle), this ran at 65-99 % under a 10 % share
    # (47 % with these pauses); the pause watcher records the window's end as the
    # pause begins.
    cycles = (*measured_pause(), "launch 1 50000", "sleep 100") * 6
    result = run_probe(
        "init", "ctx", *measured_pause(), "fakebusy", *cycles, "sync", "fakebusy",
        env=sm(region_path, 10), timeout=120,
    )  # fmt: skip
    before, after = result.by_cmd("fakebusy")
    got = (after["busy_ns"] - before["busy_ns"]) / (after["at_ns"] - before["at_ns"])
    assert got < 0.20, result.describe()


def test_a_kernel_still_running_is_charged_before_the_next_launch(
    spawn_probe: ProbeSpawner, run_probe: ProbeRunner, region_path: Path
) -> None:
    # A process of the container queues a 2 s kernel and launches again 0.5 s
    # later: the window's kernel still runs, so the 0.5 s it ran is charged then
    # (2.5 s at 20 %), before that launch waits for it. Another process of the
    # container launching meanwhile waits for that debt; it used to be charged
    # only once the kernel had ended, and the other process ran at once.
    holder = spawn_probe(
        "init", "ctx", "launch", 1, 2_000_000, "sleep", 500, "launch", 1, 0, "sync",
        env=sm(region_path, 20),
    )  # fmt: skip
    holder.wait_for("launch")
    time.sleep(1.0)
    line = run_probe("init", "ctx", "launch", 1, 1000, env=sm(region_path, 20), timeout=30).one(
        "launch"
    )
    assert line["rc"] == 0
    assert line["ns"] > 0.6e9, line
    holder.result(timeout=30)


@pytest.mark.parametrize("options", [(), ("--proc", "--ptds")])
def test_work_on_another_stream_is_charged(
    run_probe: ProbeRunner, region_path: Path, options: tuple[str, ...]
) -> None:
    # 2 ms kernels on a stream of their own, each followed by an empty kernel on
    # the NULL stream, with the streams running side by side (as non-blocking
    # streams do on a GPU): a window timed by events on the streams of its first
    # and last launch saw none of the other stream's work, and ran it at 100 %.
    line = run_probe(
        "init", "ctx", "twostreams", 1.5, 2000,
        env={**sm(region_path, 30), "FAKECUDA_STREAM_ENGINES": 1}, options=options, timeout=60,
    ).one("twostreams")  # fmt: skip
    assert line["rc"] == 0, line
    assert abs(line["share"] - 0.30) <= 0.07, line


def test_a_multi_device_launch_is_limited_on_each_device(
    run_probe: ProbeRunner, region_path: Path
) -> None:
    # cuLaunchCooperativeKernelMultiDevice with an empty kernel on device 0 and a
    # 2 ms one on device 1: each device's kernel is measured in its own window
    # (it used to be timed on the current device's stream only: device 1 at 100 %).
    line = run_probe(
        "init", "ctx", 0, "multi2", 1.5, 2000,
        env={**sm(region_path, 30), "FAKECUDA_DEVICES": 2}, timeout=60,
    ).one("multi2")  # fmt: skip
    assert line["rc"] == 0, line
    assert abs(line["share"] - 0.30) <= 0.07, line


@pytest.mark.parametrize("how", ["none", "destroy", "capture"])
def test_a_stream_whose_end_cannot_be_recorded_does_not_stop_the_charging(
    run_probe: ProbeRunner, region_path: Path, how: str
) -> None:
    # A process whose windows run unmarked launches once into a second stream and
    # then destroys it (or leaves it capturing): no end event can be recorded
    # there, so no full window could close, and with launches coming without a
    # pause nothing was charged again (the NULL stream's kernels ran at 100 %).
    line = run_probe(
        "init", "ctx", "lostream", 1.5, 100, how, env=sm(region_path, 30), timeout=60
    ).one("lostream")  # fmt: skip
    assert line["rc"] == 0, line
    assert line["share"] <= 0.40, line


def test_a_launch_config_changed_under_the_launch_is_measured_as_launched(
    run_probe: ProbeRunner, region_path: Path
) -> None:
    # cuLaunchKernelEx with a config whose stream another thread flips between
    # the NULL stream and one of its own: the library read the stream from the
    # config, then the driver read it again, so a kernel could run on a stream
    # the window did not follow.
    line = run_probe(
        "init", "ctx", "exflip", 1.5, 2000,
        env={**sm(region_path, 30), "FAKECUDA_STREAM_ENGINES": 1}, timeout=60,
    ).one("exflip")  # fmt: skip
    assert line["rc"] == 0, line
    assert abs(line["share"] - 0.30) <= 0.07, line


def test_a_kernel_running_on_with_no_launch_after_it_is_charged_while_it_runs(
    spawn_probe: ProbeSpawner, region_path: Path
) -> None:
    # One process queues a 4 s kernel and launches nothing after it (nor exits):
    # its window was charged only at its next launch or its exit, so the
    # container's other process ran at its full share beside it.
    env = sm(region_path, 30)
    hog = spawn_probe("init", "ctx", "launch", 1, 4000000, "sleep", 6000, env=env)
    time.sleep(1.5)
    other = spawn_probe("init", "ctx", "run", 2, 2000, "kernel", env=env)
    line = other.result(timeout=60).one("run")
    assert line["rc"] == 0, line
    assert line["share"] < 0.15, line
    hog.stop()
