"""How applications reach the driver through the interposer: versioned
cuGetProcAddress, dlsym on the driver's handle, other interposers, settings."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.native.probe import Build, Native, ProbeRunner

LIB = "libgpuslice.so"
FAKE = "libcuda.so.1"


@pytest.mark.parametrize(
    ("symbol", "version", "flags", "expected"),
    [
        ("cuMemAlloc", 12000, 0, "cuMemAlloc_v2"),
        ("cuMemFree", 12000, 0, "cuMemFree_v2"),
        ("cuMemGetInfo", 12000, 0, "cuMemGetInfo_v2"),
        ("cuCtxCreate", 11040, 0, "cuCtxCreate_v3"),
        ("cuCtxCreate", 12050, 0, "cuCtxCreate_v4"),
        ("cuCtxCreate", 11000, 0, "cuCtxCreate_v2"),
        ("cuLaunchKernel", 12000, 0, "cuLaunchKernel"),
        ("cuLaunchKernel", 12000, 2, "cuLaunchKernel_ptsz"),
        ("cuMemAllocAsync", 12000, 2, "cuMemAllocAsync_ptsz"),
        ("cuGraphLaunch", 12000, 2, "cuGraphLaunch_ptsz"),
        ("cuGetProcAddress", 12000, 0, "cuGetProcAddress_v2"),
        ("cuDevicePrimaryCtxRelease", 12000, 0, "cuDevicePrimaryCtxRelease_v2"),
    ],
)
def test_get_proc_address_hands_out_the_wrapper_of_the_version_asked_for(
    run_probe: ProbeRunner, build: Build, symbol: str, version: int, flags: int, expected: str
) -> None:
    for form in ((), ("v1",)):
        line = run_probe("proc", symbol, version, flags, *form, build=build).one("proc")
        assert line["rc"] == 0
        assert (line["lib"], line["sym"]) == (LIB, expected), line


def test_functions_not_hooked_come_straight_from_the_driver(run_probe: ProbeRunner) -> None:
    line = run_probe("proc", "cuCtxSynchronize", 12000, 0).one("proc")
    assert (line["lib"], line["sym"]) == (FAKE, "cuCtxSynchronize")


def test_unknown_symbols_stay_unknown(run_probe: ProbeRunner) -> None:
    line = run_probe("proc", "cuNoSuchFunction", 12000, 0).one("proc")
    assert line["rc"] == 500  # CUDA_ERROR_NOT_FOUND from the driver
    assert line["status"] == 1  # CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND
    assert line["sym"] is None


def test_a_version_too_old_is_the_driver_answer(run_probe: ProbeRunner) -> None:
    line = run_probe("proc", "cuDevicePrimaryCtxRelease", 10020, 0).one("proc")
    assert line["rc"] != 0
    assert line["status"] == 2  # VERSION_NOT_SUFFICIENT


@pytest.mark.parametrize(
    ("symbol", "library", "lib", "expected"),
    [
        ("cuMemAlloc_v2", "cuda", LIB, "cuMemAlloc_v2"),
        ("cuGetProcAddress_v2", "cuda", LIB, "cuGetProcAddress_v2"),
        ("cuLaunchKernel_ptsz", "cuda", LIB, "cuLaunchKernel_ptsz"),
        ("cuCtxSynchronize", "cuda", FAKE, "cuCtxSynchronize"),
        ("nvmlDeviceGetMemoryInfo_v2", "nvml", LIB, "nvmlDeviceGetMemoryInfo_v2"),
        ("nvmlDeviceGetUUID", "nvml", "libnvidia-ml.so.1", "nvmlDeviceGetUUID"),
    ],
)
def test_dlsym_on_the_driver_handle_finds_the_wrappers(
    run_probe: ProbeRunner, build: Build, symbol: str, library: str, lib: str, expected: str
) -> None:
    line = run_probe("dlsym", symbol, library, build=build).one("dlsym")
    assert (line["lib"], line["sym"]) == (lib, expected)


def test_another_interposer_keeps_rtld_next(
    run_probe: ProbeRunner, native: Native, build: Build
) -> None:
    result = run_probe(
        "getppid",
        "init",
        "ctx",
        "alloc",
        "1m",
        build=build,
        preload_after=[native.other_interposer],
    )
    assert result.one("getppid")["value"] > 0
    assert result.one("alloc")["rc"] == 0


def test_disable_control_passes_everything_through(
    run_probe: ProbeRunner, region_path: Path
) -> None:
    env = {
        "CUDA_DISABLE_CONTROL": "true",
        "CUDA_DEVICE_MEMORY_LIMIT": "100m",
        "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(region_path),
    }
    result = run_probe(
        "init", "ctx", "alloc", "500m", "info", "proc", "cuMemAlloc", 12000, 0, env=env
    )
    assert result.one("alloc")["rc"] == 0
    assert result.one("info")["total"] == 80 << 30
    assert result.one("proc")["lib"] == FAKE
    assert not region_path.exists()


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("LIBCUDA_LOG_LEVEL", "loud", "LIBCUDA_LOG_LEVEL=loud"),
        ("GPUSLICE_TELEMETRY_INTERVAL", "1ms", "GPUSLICE_TELEMETRY_INTERVAL=1ms"),
        ("GPUSLICE_TELEMETRY_RING", "0", "GPUSLICE_TELEMETRY_RING=0"),
    ],
)
def test_bad_settings_that_bound_nothing_are_named_and_the_application_runs_on(
    run_probe: ProbeRunner, variable: str, value: str, message: str
) -> None:
    result = run_probe("init", "ctx", "alloc", "1m", env={variable: value})
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert result.one("alloc")["rc"] == 0


def test_a_missing_driver_is_an_error_not_a_crash(run_probe: ProbeRunner) -> None:
    result = run_probe(
        "proc",
        "cuMemAlloc",
        12000,
        0,
        "init",
        env={"GPUSLICE_LIBCUDA": "/nonexistent/libcuda.so.1"},
    )
    assert "cannot load the CUDA driver /nonexistent/libcuda.so.1" in result.stderr
    assert result.one("init")["rc"] == 3  # CUDA_ERROR_NOT_INITIALIZED


def test_only_driver_symbols_and_the_loader_functions_are_exported(native: Native) -> None:
    out = subprocess.run(
        ["nm", "-D", "--defined-only", str(native.lib)], capture_output=True, text=True, check=True
    ).stdout
    names = {line.split()[-1] for line in out.splitlines() if line.strip()}
    assert {"dlsym", "cuMemAlloc_v2", "nvmlDeviceGetMemoryInfo"} <= names
    loader = {"dlsym", "dlopen", "dlmopen"}
    stray = {n for n in names if not (n.startswith(("cu", "nvml")) or n in loader)}
    assert not stray


def test_a_process_that_never_uses_cuda_is_left_alone(native: Native, tmp_path: Path) -> None:
    region = tmp_path / "region.cache"
    done = subprocess.run(
        ["sh", "-c", "umask"],
        env={
            "LD_PRELOAD": str(native.lib),
            "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(region),
            "CUDA_DEVICE_MEMORY_LIMIT": "1g",
            "PATH": "/usr/bin:/bin",
        },
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stderr == ""
    assert not region.exists()  # no region until a process calls cuInit


def test_valgrind_finds_no_memory_errors(native: Native, tmp_path: Path) -> None:
    """The release build, as deployed, under memcheck: a run through every kind of hook."""
    env = {
        "PATH": "/usr/bin:/bin",
        "LD_LIBRARY_PATH": str(native.fake_dir),
        "LD_PRELOAD": str(native.lib),
        "CUDA_DEVICE_MEMORY_LIMIT": "1g",
        "CUDA_DEVICE_SM_LIMIT": "50",
        "GPU_CORE_UTILIZATION_POLICY": "force",
        "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(tmp_path / "region.cache"),
        "GPUSLICE_CONTEXT_OVERHEAD": "0",
    }
    commands = [
        "init",
        "ctx",
        "alloc",
        "100m",
        "vmm",
        "64m",
        "async",
        "10m",
        "array",
        "64",
        "64",
        "0x20",
        "1",
        "free",
        "0",
        "free",
        "1",
        "free",
        "2",
        "free",
        "3",
        "alloc",
        "2g",
        "info",
        "launch",
        "20",
        "100",
        "sync",
        "nvml",
        "nvmlmem",
        "0",
        "proc",
        "cuMemAlloc",
        "12000",
        "0",
    ]
    done = subprocess.run(
        ["valgrind", "--error-exitcode=99", "--leak-check=no", str(native.probe), *commands],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ERROR SUMMARY: 0 errors" in done.stderr
