"""Many processes of one container sharing a limit: races, crashes, stuck locks,
and a region file nobody else may write or misread."""

from __future__ import annotations

import os
import signal
import stat
import time
from pathlib import Path

from gpuslice_common.region import Region
from tests.native.probe import Build, ProbeRunner, ProbeSpawner, limited

MiB = 1 << 20


def test_racing_processes_never_exceed_the_limit_together(
    spawn_probe: ProbeSpawner, region_path: Path, build: Build
) -> None:
    # 10 processes each try 20 chunks of 10 MiB at the same instant: 1000 MiB hold
    # exactly 100 chunks, so exactly 100 succeed between them.
    start = time.time_ns() + 1_500_000_000
    procs = [
        spawn_probe(
            "init",
            "ctx",
            "race",
            "10m",
            20,
            start,
            "hold",
            env=limited(region_path, "1000m"),
            build=build,
        )
        for _ in range(10)
    ]
    won = [proc.wait_for("race", timeout=30)["ok"] for proc in procs]
    assert sum(won) == 100, won
    with Region.open(region_path) as region:
        assert region.devices()[0].used_bytes == 1000 * MiB
        assert region.devices()[0].denied_allocations == 200 - 100
        assert sorted(p.pid for p in region.processes()) == sorted(p.pid for p in procs)


def test_a_process_killed_mid_allocation_frees_its_share(
    spawn_probe: ProbeSpawner, run_probe: ProbeRunner, region_path: Path
) -> None:
    # The fake sleeps inside the allocation: the victim dies holding a reservation.
    victim = spawn_probe(
        "init",
        "ctx",
        "alloc",
        "600m",
        "alloc",
        "300m",
        env=limited(region_path, FAKECUDA_ALLOC_DELAY_MS=5000),
    )
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if region_path.exists():
            with Region.open(region_path) as region:
                if region.devices() and region.devices()[0].used_bytes == 900 * MiB:
                    break
        time.sleep(0.05)
    else:
        raise AssertionError(f"the victim never reserved 900 MiB\n{victim.describe()}")
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait(timeout=10)
    started = time.monotonic()
    result = run_probe("init", "ctx", "alloc", "1g", env=limited(region_path))
    assert result.one("alloc")["rc"] == 0, result.describe()
    assert time.monotonic() - started < 5
    with Region.open(region_path) as region:
        assert region.devices()[0].used_bytes == 0  # the second probe exited too


def test_a_process_killed_holding_the_region_lock_blocks_no_one(
    spawn_probe: ProbeSpawner, run_probe: ProbeRunner, region_path: Path
) -> None:
    first = spawn_probe("init", "ctx", "alloc", "800m", "hold", env=limited(region_path))
    first.wait_for("hold")
    locker = spawn_probe("lock", str(region_path), "hold", build="none")
    locker.wait_for("hold")
    os.kill(first.pid, signal.SIGKILL)
    os.kill(locker.pid, signal.SIGKILL)
    first.wait(timeout=10)
    locker.wait(timeout=10)
    started = time.monotonic()
    result = run_probe("init", "ctx", "alloc", "900m", env=limited(region_path))
    elapsed = time.monotonic() - started
    assert result.one("alloc")["rc"] == 0, result.describe()
    assert elapsed < 2, elapsed


def test_a_live_lock_holder_delays_others_at_most_a_second(
    spawn_probe: ProbeSpawner, run_probe: ProbeRunner, region_path: Path
) -> None:
    run_probe("init", "ctx", env=limited(region_path))  # creates the region
    locker = spawn_probe("lock", str(region_path), "hold", build="none")
    locker.wait_for("hold")
    started = time.monotonic()
    result = run_probe("init", "ctx", "alloc", "100m", env=limited(region_path))
    assert result.one("alloc")["rc"] == 0
    assert time.monotonic() - started < 3
    locker.stop()


def test_exited_processes_leave_nothing_behind(run_probe: ProbeRunner, region_path: Path) -> None:
    for _ in range(3):
        run_probe("init", "ctx", "alloc", "900m", env=limited(region_path))
    with Region.open(region_path) as region:
        assert region.devices()[0].used_bytes == 0
        assert region.devices()[0].peak_bytes == 900 * MiB
        assert region.processes() == ()


def test_the_region_file_is_not_world_writable(run_probe: ProbeRunner, region_path: Path) -> None:
    run_probe("init", "ctx", env=limited(region_path))
    mode = stat.S_IMODE(region_path.stat().st_mode)
    assert not mode & stat.S_IWOTH
    assert mode & stat.S_IWUSR


def test_an_incompatible_region_is_refused_loudly(
    run_probe: ProbeRunner, region_path: Path
) -> None:
    run_probe("init", "ctx", env=limited(region_path))
    data = bytearray(region_path.read_bytes())
    data[4:8] = (2).to_bytes(4, "little")  # layout version 2
    region_path.write_bytes(bytes(data))
    result = run_probe("init", "ctx", "alloc", "900m", "alloc", "200m", env=limited(region_path))
    assert "layout version 2" in result.stderr
    assert "every GPU allocation of this process is refused" in result.stderr
    # fail closed: no context, no allocation, and the file is left as it was
    assert result.one("ctx")["rc"] == 2
    assert all(line["rc"] != 0 for line in result.by_cmd("alloc"))
    assert region_path.read_bytes() == bytes(data)


def test_an_exec_leaves_no_usage_of_the_old_image(
    run_probe: ProbeRunner, region_path: Path
) -> None:
    # Same PID, same start time, a new image: the old one's memory went with it.
    result = run_probe(
        "init",
        "ctx",
        "alloc",
        "600m",
        "exec",
        "init",
        "ctx",
        "alloc",
        "900m",
        "info",
        env=limited(region_path),
    )
    assert result.one("exec")["rc"] == 0
    assert [line["rc"] for line in result.by_cmd("alloc")] == [0, 0]
    assert result.one("info")["free"] == 124 * MiB
