"""NVML inside the container: the limit as total, the container's usage as used."""

from __future__ import annotations

from pathlib import Path

from tests.native.probe import Build, ProbeRunner, ProbeSpawner, limited

GiB = 1 << 30
MiB = 1 << 20


def test_memory_info_shows_the_limit_and_the_usage(
    run_probe: ProbeRunner, region_path: Path, build: Build
) -> None:
    result = run_probe(
        "init",
        "ctx",
        "alloc",
        "300m",
        "nvml",
        "nvmlmem",
        0,
        env=limited(region_path, "2g"),
        build=build,
    )
    mem = result.one("nvmlmem")
    assert (mem["rc"], mem["v2_rc"]) == (0, 0), mem
    assert (mem["total"], mem["used"], mem["free"]) == (2 * GiB, 300 * MiB, 2 * GiB - 300 * MiB)
    assert (mem["v2_total"], mem["v2_used"], mem["v2_free"]) == (
        mem["total"],
        mem["used"],
        mem["free"],
    )


def test_a_process_without_cuda_sees_the_whole_container(
    spawn_probe: ProbeSpawner, run_probe: ProbeRunner, region_path: Path
) -> None:
    holder = spawn_probe("init", "ctx", "alloc", "700m", "hold", env=limited(region_path, "2g"))
    holder.wait_for("hold")
    mem = run_probe("nvml", "nvmlmem", 0, env=limited(region_path, "2g")).one("nvmlmem")
    assert (mem["total"], mem["used"]) == (2 * GiB, 700 * MiB)
    holder.stop()


def test_before_any_cuda_process_the_limit_is_shown_by_index(
    run_probe: ProbeRunner, region_path: Path
) -> None:
    mem = run_probe("nvml", "nvmlmem", 0, env=limited(region_path, "2g")).one("nvmlmem")
    assert (mem["total"], mem["used"], mem["free"]) == (2 * GiB, 0, 2 * GiB)


def test_usage_never_shows_negative_or_wrapped(run_probe: ProbeRunner, region_path: Path) -> None:
    # The driver's own view says 10 GiB are used (other containers); the container's
    # view stays within its limit.
    env = limited(region_path, "2g", FAKENVML_USED=str(10 * GiB))
    mem = run_probe("init", "ctx", "nvml", "nvmlmem", 0, env=env).one("nvmlmem")
    assert (mem["total"], mem["used"], mem["free"]) == (2 * GiB, 0, 2 * GiB)


def test_without_a_limit_nvml_is_untouched(run_probe: ProbeRunner, region_path: Path) -> None:
    env = {"CUDA_DEVICE_MEMORY_SHARED_CACHE": str(region_path), "FAKENVML_USED": str(GiB)}
    mem = run_probe("nvml", "nvmlmem", 0, env=env).one("nvmlmem")
    assert (mem["total"], mem["used"]) == (80 * GiB, GiB)


def test_process_lists_pass_through(run_probe: ProbeRunner, region_path: Path) -> None:
    env = limited(region_path, "2g", FAKENVML_PROCS="4242:1048576,4343:2097152")
    line = run_probe("nvml", "nvmlprocs", 0, env=env).one("nvmlprocs")
    assert line["procs"] == [{"pid": 4242, "used": MiB}, {"pid": 4343, "used": 2 * MiB}]
