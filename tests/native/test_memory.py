"""Memory limits under the interposer: every allocation path, the views the
container gets, contexts, and the shared region as Python reads it."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuslice_common.region import Region
from tests.native.probe import Build, ProbeRunner, ProbeSpawner, limited

GiB = 1 << 30
MiB = 1 << 20


# Each path: the probe command that allocates one 128 MiB chunk (arrays: 8192 x 4096
# floats = 128 MiB; a mipmap of two levels: 128 + 32 MiB).
PATHS = {
    "alloc": ("alloc", "128m"),
    "managed": ("managed", "128m"),
    "pitch": ("pitch", str(32 * MiB), "4", "1"),
    "array": ("array", "8192", "4096", "0x20", "1"),
    "array3d": ("array3d", "1024", "1024", "32", "0x20", "1"),
    "vmm": ("vmm", "128m"),
    "async": ("async", "128m"),
    "poolalloc": ("poolalloc", "128m"),
}


@pytest.mark.parametrize("path", sorted(PATHS))
def test_every_allocation_path_stops_exactly_at_the_limit(
    run_probe: ProbeRunner, region_path: Path, build: Build, path: str
) -> None:
    command = PATHS[path]
    # 1 GiB holds exactly eight 128 MiB chunks; the ninth is refused.
    result = run_probe("init", "ctx", *(command * 9), "info", env=limited(region_path), build=build)
    rcs = [line["rc"] for line in result.by_cmd(command[0])]
    assert rcs == [0] * 8 + [2], result.describe()  # 2 = CUDA_ERROR_OUT_OF_MEMORY
    info = result.one("info")
    assert info["total"] == GiB
    assert info["free"] == 0


def test_a_mipmapped_array_counts_every_level(run_probe: ProbeRunner, region_path: Path) -> None:
    # 4096 x 4096 floats = 64 MiB, its second level 16 MiB, third 4 MiB: 84 MiB.
    result = run_probe(
        "init",
        "ctx",
        "mipmap",
        "4096",
        "4096",
        "0",
        "0x20",
        "1",
        "3",
        "info",
        env=limited(region_path),
    )
    assert result.one("mipmap")["rc"] == 0
    assert result.one("info")["free"] == GiB - 84 * MiB


@pytest.mark.parametrize("path", sorted(PATHS))
def test_freeing_gives_everything_back(
    run_probe: ProbeRunner, region_path: Path, path: str
) -> None:
    command = PATHS[path]
    frees = [part for i in range(4) for part in ("free", str(i))]
    # A pool keeps what is freed into it (and is charged for it) until trimmed.
    trim = ["trim", "0"] if command[0] in ("async", "poolalloc") else []
    result = run_probe(
        "init", "ctx", *(command * 4), "info", *frees, *trim, "info", env=limited(region_path)
    )
    before, after = result.by_cmd("info")
    assert before["free"] == GiB - 4 * 128 * MiB, result.describe()
    assert after["free"] == GiB
    assert all(line["rc"] == 0 for line in result.by_cmd("free"))


def test_a_driver_failure_rolls_the_reservation_back(
    run_probe: ProbeRunner, region_path: Path
) -> None:
    # The fake device has 512 MiB, the limit is 1 GiB: the driver refuses the third
    # 200 MiB chunk itself, and what the interposer reserved for it is given back.
    env = limited(region_path, FAKECUDA_MEMORY="512m")
    result = run_probe("init", "ctx", *(("alloc", "200m") * 3), "alloc", "100m", env=env)
    assert [line["rc"] for line in result.by_cmd("alloc")] == [0, 0, 2, 0]
    with Region.open(region_path) as region:
        assert region.devices()[0].used_bytes == 0  # the probe has exited: all given back


def test_usage_is_visible_in_the_region_while_the_process_runs(
    spawn_probe: ProbeSpawner, region_path: Path
) -> None:
    proc = spawn_probe(
        "init", "ctx", "alloc", "300m", "vmm", "100m", "hold", env=limited(region_path)
    )
    proc.wait_for("hold")
    with Region.open(region_path) as region:
        (device,) = region.devices()
        assert device.used_bytes == 400 * MiB
        assert device.limit_bytes == GiB
        assert device.uuid == "GPU-facefeed-0000-4000-8000-000000000000"
        (process,) = region.processes()
        assert process.pid == proc.pid
        assert process.used_bytes[0] == 400 * MiB
    proc.stop()


def test_get_info_and_total_memory_show_the_limit(
    run_probe: ProbeRunner, region_path: Path
) -> None:
    result = run_probe(
        "init", "ctx", "totalmem", "alloc", "100m", "info", env=limited(region_path, "2g")
    )
    assert result.one("totalmem")["bytes"] == 2 * GiB
    assert result.one("info")["total"] == 2 * GiB
    assert result.one("info")["free"] == 2 * GiB - 100 * MiB


def test_without_a_limit_the_driver_view_is_unchanged(
    run_probe: ProbeRunner, region_path: Path
) -> None:
    env = {"CUDA_DEVICE_MEMORY_SHARED_CACHE": str(region_path), "FAKECUDA_MEMORY": "8g"}
    result = run_probe("init", "ctx", "alloc", "1g", "info", "totalmem", env=env)
    assert result.one("info")["total"] == 8 * GiB
    assert result.one("info")["free"] == 7 * GiB
    assert result.one("totalmem")["bytes"] == 8 * GiB


def test_limits_per_device(run_probe: ProbeRunner, region_path: Path) -> None:
    env = limited(region_path, "1g", CUDA_DEVICE_MEMORY_LIMIT_1="256m", FAKECUDA_DEVICES=2)
    result = run_probe(
        "init",
        "ctx",
        "1",
        "alloc",
        "200m",
        "alloc",
        "200m",
        "info",
        "ctx",
        "0",
        "alloc",
        "600m",
        "info",
        env=env,
    )
    assert [line["rc"] for line in result.by_cmd("alloc")] == [0, 2, 0]
    first, second = result.by_cmd("info")
    assert (first["total"], first["free"]) == (256 * MiB, 56 * MiB)
    assert (second["total"], second["free"]) == (GiB, GiB - 600 * MiB)


def test_a_pitch_allocation_counts_the_pitch_the_driver_chose(
    run_probe: ProbeRunner, region_path: Path
) -> None:
    # 1000-byte rows get a 1024-byte pitch from the fake: 1024 x 1000 bytes are used.
    result = run_probe(
        "init", "ctx", "pitch", "1000", "1000", "4", "info", env=limited(region_path)
    )
    assert result.one("pitch")["pitch"] == 1024
    assert result.one("info")["free"] == GiB - 1024 * 1000


def test_frees_of_unknown_pointers_go_to_the_driver(
    run_probe: ProbeRunner, region_path: Path
) -> None:
    result = run_probe(
        "init", "ctx", "alloc", "10m", "freeraw", "12345", "info", env=limited(region_path)
    )
    assert result.one("freeraw")["rc"] == 1  # the fake's CUDA_ERROR_INVALID_VALUE, unchanged
    assert result.one("info")["free"] == GiB - 10 * MiB


def test_trimming_a_pool_keeps_the_count_of_live_allocations(
    run_probe: ProbeRunner, region_path: Path
) -> None:
    result = run_probe(
        "init",
        "ctx",
        "async",
        "100m",
        "async",
        "100m",
        "free",
        "0",
        "trim",
        "0",
        "info",
        env=limited(region_path),
    )
    assert result.one("trim")["rc"] == 0
    assert result.one("info")["free"] == GiB - 100 * MiB


@pytest.mark.parametrize("options", [("--proc",), ("--proc", "--ptds")])
def test_functions_found_through_get_proc_address_are_counted(
    run_probe: ProbeRunner, region_path: Path, options: tuple[str, ...]
) -> None:
    result = run_probe(
        "init",
        "ctx",
        *(("alloc", "400m") * 3),
        "async",
        "224m",
        "async",
        "1m",
        "info",
        env=limited(region_path),
        options=options,
    )
    assert [line["rc"] for line in result.by_cmd("alloc")] == [0, 0, 2]
    assert [line["rc"] for line in result.by_cmd("async")] == [0, 2]
    assert result.one("info")["free"] == 0


class TestContexts:
    def test_the_primary_context_costs_its_overhead_once(
        self, run_probe: ProbeRunner, region_path: Path
    ) -> None:
        env = limited(region_path, GPUSLICE_CONTEXT_OVERHEAD="300m", FAKECUDA_CONTEXT_BYTES="300m")
        result = run_probe("init", "ctx", "ctx", "info", "alloc", "724m", "alloc", "1m", env=env)
        assert result.one("info")["free"] == GiB - 300 * MiB
        assert [line["rc"] for line in result.by_cmd("alloc")] == [0, 2]

    def test_a_context_that_does_not_fit_is_refused(
        self, run_probe: ProbeRunner, region_path: Path
    ) -> None:
        env = limited(region_path, "256m", GPUSLICE_CONTEXT_OVERHEAD="300m")
        result = run_probe("init", "ctx", env=env)
        assert result.one("ctx")["rc"] == 2

    @pytest.mark.parametrize("create", ["newctx", "newctx3", "newctx4"])
    def test_destroying_a_context_frees_its_allocations(
        self, run_probe: ProbeRunner, region_path: Path, create: str
    ) -> None:
        env = limited(region_path, GPUSLICE_CONTEXT_OVERHEAD="100m")
        result = run_probe(
            "init", create, "alloc", "200m", "info", "destroyctx", "0", "ctx", "info", env=env
        )
        first, second = result.by_cmd("info")
        assert first["free"] == GiB - 300 * MiB, result.describe()
        assert result.one("destroyctx")["rc"] == 0
        assert second["free"] == GiB - 100 * MiB  # only the primary context now

    def test_resetting_the_primary_context_frees_everything_in_it(
        self, run_probe: ProbeRunner, region_path: Path
    ) -> None:
        env = limited(region_path, GPUSLICE_CONTEXT_OVERHEAD="100m")
        result = run_probe("init", "ctx", "alloc", "500m", "reset", "ctx", "info", env=env)
        assert result.one("reset")["rc"] == 0
        assert result.one("info")["free"] == GiB - 100 * MiB

    def test_releasing_the_last_reference_frees_the_context(
        self, run_probe: ProbeRunner, region_path: Path
    ) -> None:
        env = limited(region_path, GPUSLICE_CONTEXT_OVERHEAD="100m")
        result = run_probe(
            "init",
            "ctx",
            "ctx",
            "alloc",
            "100m",
            "release",
            "info",
            "release",
            "newctx",
            "info",
            env=env,
        )
        first, second = result.by_cmd("info")
        assert first["free"] == GiB - 200 * MiB
        assert second["free"] == GiB - 100 * MiB  # the new context alone


def test_active_oom_killer_ends_the_process(run_probe: ProbeRunner, region_path: Path) -> None:
    env = limited(region_path, ACTIVE_OOM_KILLER="true")
    result = run_probe("init", "ctx", "alloc", "2g", "info", env=env, check=False)
    assert result.returncode == -9
    assert "ACTIVE_OOM_KILLER" in result.stderr
    assert not result.by_cmd("info")


def test_a_hook_called_before_cu_init_still_names_the_devices(
    spawn_probe: ProbeSpawner, region_path: Path
) -> None:
    proc = spawn_probe(
        "alloc", "1m", "init", "ctx", "alloc", "1m", "hold", env=limited(region_path)
    )
    proc.wait_for("hold")
    with Region.open(region_path) as region:
        (device,) = region.devices()
        assert device.uuid == "GPU-facefeed-0000-4000-8000-000000000000"
        assert device.used_bytes == MiB
    proc.stop()


def test_devices_are_the_containers_by_uuid_not_the_process_ordinal(
    spawn_probe: ProbeSpawner, region_path: Path
) -> None:
    # The container's device order (NVIDIA_VISIBLE_DEVICES, set by the device plugin)
    # is the reverse of CUDA's: CUDA ordinal 0 is container device 1 and gets its limit.
    uuid = "GPU-facefeed-0000-4000-8000-0000000000{:02x}"
    env = limited(
        region_path,
        "1g",
        CUDA_DEVICE_MEMORY_LIMIT_1="256m",
        FAKECUDA_DEVICES=2,
        NVIDIA_VISIBLE_DEVICES=f"{uuid.format(1)},{uuid.format(0)}",
    )
    proc = spawn_probe(
        "init",
        "ctx",
        "0",
        "alloc",
        "300m",
        "alloc",
        "200m",
        "ctx",
        "1",
        "alloc",
        "700m",
        "hold",
        env=env,
    )
    proc.wait_for("hold")
    assert [line["rc"] for line in proc.lines if line.get("cmd") == "alloc"] == [2, 0, 0]
    with Region.open(region_path) as region:
        first, second = region.devices()
        assert (first.uuid, first.limit_bytes, first.used_bytes) == (uuid.format(1), GiB, 700 * MiB)
        assert (second.uuid, second.limit_bytes, second.used_bytes) == (
            uuid.format(0),
            256 * MiB,
            200 * MiB,
        )
    proc.stop()


def test_vmm_memory_counts_until_released_and_unmapped(
    run_probe: ProbeRunner, region_path: Path, build: Build
) -> None:
    # Released right after mapping, as applications commonly do: the memory lives on
    # until the last mapping goes.
    result = run_probe(
        "init",
        "ctx",
        "vmm",
        "128m",
        "vmmmap",
        0,
        "vmmmap",
        0,
        "free",
        0,
        "info",
        "free",
        1,
        "info",
        "free",
        2,
        "info",
        env=limited(region_path),
        build=build,
    )
    assert result.one("vmm")["rc"] == 0
    assert [line["rc"] for line in result.by_cmd("vmmmap")] == [0, 0]
    assert [line["free"] for line in result.by_cmd("info")] == [GiB - 128 * MiB] * 2 + [GiB]
