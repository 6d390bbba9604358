"""NVIDIA's own driver-API client, cuda-bindings, on the fake driver under the interposer.

tests/native/bindings_client.py runs cuda.bindings.driver calls named on its command
line. The bindings resolve every driver function through cuGetProcAddress_v2 with
the CUDA version that introduced it (and the per-thread-stream twins with
CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM=1), as the CUDA runtime does; unlike the
runtime they need none of the driver's private export tables, which the fake cannot
provide (libcudart 12 and 13 stop at initialisation with the fake's answer to
cuGetExportTable).
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest

from tests.native.probe import (
    NATIVE,
    Build,
    EnvOverrides,
    Line,
    Native,
    ProbeResult,
    ensure_built,
    finish,
    limited,
    probe_env,
    targets_for,
)

GiB = 1 << 30
MiB = 1 << 20
OOM = 2  # CUDA_ERROR_OUT_OF_MEMORY
LIB = "libgpuslice.so"
FAKE = "libcuda.so.1"
CLIENT = Path(__file__).with_name("bindings_client.py")
PTDS = {"CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM": "1"}

# Every wrapper the interposer exports for the driver, from its one table.
HOOKED = tuple(re.findall(r"^CUDA_HOOK\((\w+),", (NATIVE / "src/hooks.def").read_text(), re.M))
# The names applications ask cuGetProcAddress for: no version or stream suffix.
BASES = tuple(dict.fromkeys(re.sub(r"(_v\d)?(_ptsz)?$", "", name) for name in HOOKED))
# Hooked names of the pre-CUDA 3.2 ABI (refused, or counted as their _v2), and the forms
# of cuGraphInstantiate before CUDA 12 (WithFlags took its name): the bindings hold only
# the later forms.
LEGACY = frozenset(name for name in HOOKED if f"{name}_v2" in HOOKED) | {"cuGraphInstantiate_v2"}
VERSIONS = (2000, 3020, 4000, 6000, 10020, 11000, 11020, 11040, 12000, 12050, 13000)


def run_client(
    native: Native, *commands: str, build: Build, env: EnvOverrides | None = None
) -> ProbeResult:
    """Runs the client to completion in a probe's environment (exit 0 required,
    sanitizer reports fail the test)."""
    ensure_built(native, *targets_for(build))
    words = [word for command in commands for word in command.split()]
    argv = [sys.executable, "-W", "error", str(CLIENT), *words]
    done = subprocess.run(
        argv,
        env=probe_env(native, build, env),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    return finish(argv, done.returncode, done.stdout, done.stderr, check=True)


def test_the_hook_table_is_read() -> None:
    assert len(HOOKED) > 30
    assert {"cuMemAlloc_v2", "cuMemAllocAsync_ptsz", "cuGetProcAddress_v2"} <= set(HOOKED)
    assert {"cuMemAlloc", "cuMemAllocAsync", "cuCtxCreate", "cuLaunchKernel"} <= set(BASES)


# ----------------------------------------------------------------------------- no interposer


def test_the_bindings_run_on_the_fake_driver_alone(native_tools: Native) -> None:
    result = run_client(
        native_tools,
        "init ctx totalmem info alloc 600m alloc 600m info pointers",
        build="none",
        env={"FAKECUDA_MEMORY": "1g"},
    )
    assert [line["rc"] for line in result.by_cmd("alloc")] == [0, OOM], result.describe()
    assert result.one("totalmem")["bytes"] == GiB
    before, after = result.by_cmd("info")
    assert (before["free"], before["total"]) == (GiB, GiB)
    assert (after["free"], after["total"]) == (GiB - 600 * MiB, GiB)
    functions: Mapping[str, list[str | None]] = result.one("pointers")["functions"]
    assert functions["__cuMemAlloc_v2"][:2] == [FAKE, "cuMemAlloc_v2"]
    assert {lib for lib, _, _ in functions.values()} == {FAKE}


# ----------------------------------------------------------------------------- limits

# Each path: the client command that makes one object, its bytes, and the
# environment it needs (the per-thread-stream twins of the stream-ordered calls).
PATHS: dict[str, tuple[str, int, EnvOverrides]] = {
    "alloc": ("alloc 128m", 128 * MiB, {}),
    "managed": ("managed 128m", 128 * MiB, {}),
    "pitch": (f"pitch {32 * MiB} 4 1", 128 * MiB, {}),  # 32 MiB rows are their own pitch
    "async": ("async 128m", 128 * MiB, {}),
    "async-ptsz": ("async 128m", 128 * MiB, PTDS),
    "poolalloc": ("poolalloc 128m", 128 * MiB, {}),
    "poolalloc-ptsz": ("poolalloc 128m", 128 * MiB, PTDS),
    "array": ("array 8192 4096", 128 * MiB, {}),  # floats
    "array3d": ("array3d 1024 1024 32", 128 * MiB, {}),
    "mipmap": ("mipmap 8192 4096 0 2", 160 * MiB, {}),  # 128 MiB + its 32 MiB level
    "vmm": ("vmm 128m", 128 * MiB, {}),
}


@pytest.mark.parametrize("path", sorted(PATHS))
def test_every_allocation_path_of_the_bindings_is_limited(
    native: Native, region_path: Path, build: Build, path: str
) -> None:
    command, size, extra = PATHS[path]
    fits = GiB // size
    frees = [f"free {i}" for i in range(fits)]
    result = run_client(
        native,
        "init ctx",
        *[command] * (fits + 1),
        "info region",
        *frees,
        "info region",
        build=build,
        env={**limited(region_path, "1g"), **extra},
    )
    name = command.split()[0]
    assert [line["rc"] for line in result.by_cmd(name)] == [0] * fits + [OOM], result.describe()
    full, empty = result.by_cmd("info")
    assert (full["total"], full["free"]) == (GiB, GiB - fits * size)
    # Counted in the shared region, which only the wrappers write, and exactly what
    # the driver itself holds.
    held, released = result.by_cmd("region")
    assert held == {
        "cmd": "region", "used": fits * size, "limit": GiB, "process": fits * size,
        "fake": fits * size,
    }  # fmt: skip
    assert all(line["rc"] == 0 for line in result.by_cmd("free")), result.describe()
    # A pool keeps what was freed into it (the fake never trims by itself): it stays
    # charged, as much as the driver holds.
    kept = fits * size if name in ("async", "poolalloc") else 0
    assert (empty["total"], empty["free"]) == (GiB, GiB - kept)
    assert (released["used"], released["process"], released["fake"]) == (kept, kept, kept)


def test_memory_info_and_total_memory_show_the_limit(
    native: Native, region_path: Path, build: Build
) -> None:
    result = run_client(
        native,
        "init ctx totalmem info alloc 300m info",
        build=build,
        env=limited(region_path, "2g"),
    )
    assert result.one("totalmem")["bytes"] == 2 * GiB
    before, after = result.by_cmd("info")
    assert (before["total"], before["free"]) == (2 * GiB, 2 * GiB)
    assert (after["total"], after["free"]) == (2 * GiB, 2 * GiB - 300 * MiB)


def test_a_vmm_allocation_counts_until_released_and_unmapped(
    native: Native, region_path: Path, build: Build
) -> None:
    result = run_client(
        native,
        "init ctx vmm 256m region release 0 region unmap 0 region info",
        build=build,
        env=limited(region_path, "1g"),
    )
    assert result.one("vmm")["rc"] == 0
    mapped, released, unmapped = (line["used"] for line in result.by_cmd("region"))
    assert (mapped, released, unmapped) == (256 * MiB, 256 * MiB, 0)
    assert result.one("info")["free"] == GiB


# ----------------------------------------------------------------------------- lookups


def expected_wrapper(key: str, per_thread: bool) -> str:
    """The wrapper the bindings' pointer `key` ("__cuMemAllocAsync") must be."""
    name = key.removeprefix("__")
    twin = name + "_ptsz"
    return twin if per_thread and twin in HOOKED else name


@pytest.mark.parametrize("mode", ["default-stream", "per-thread-stream"])
def test_every_lookup_of_the_bindings_is_answered_with_the_wrappers(
    native: Native, region_path: Path, build: Build, mode: str
) -> None:
    per_thread = mode == "per-thread-stream"
    result = run_client(
        native,
        "init pointers",
        build=build,
        env={**limited(region_path), **(PTDS if per_thread else {})},
    )
    functions: Mapping[str, list[str | bool | None]] = result.one("pointers")["functions"]
    # The bindings hold one pointer per function: every hooked one is our wrapper, of
    # the stream variant the mode asks for, and the one a global lookup finds.
    # (cuGetProcAddress itself is only held as _v2: the CUDA 12 form.)
    plain = [name for name in HOOKED if not name.endswith("_ptsz")]
    for name in (name for name in plain if name not in LEGACY):
        key = "__" + name
        assert key in functions, f"cuda-bindings did not resolve {name}"
        assert functions[key] == [LIB, expected_wrapper(key, per_thread), True], key
    # Nothing hooked reaches the driver directly; everything else does.
    hooked = set(HOOKED)
    bypass = {k: v for k, v in functions.items() if v[1] in hooked and v[0] != LIB}
    assert not bypass
    assert functions["__cuCtxSynchronize"][:2] == [FAKE, "cuCtxSynchronize"]
    assert len(functions) > len(plain)


def test_get_proc_address_gives_the_wrapper_for_every_version_and_stream(
    native: Native, region_path: Path, build: Build
) -> None:
    sweep = f"procs {','.join(BASES)} {','.join(map(str, VERSIONS))} 0,2"
    alone = run_client(native, "init", sweep, build="none")
    under = run_client(native, "init", sweep, build=build, env=limited(region_path))

    def answers(result: ProbeResult) -> dict[tuple[str, int, int], Line]:
        return {(p["name"], p["version"], p["flags"]): p for p in result.by_cmd("proc")}

    driver, ours = answers(alone), answers(under)
    assert len(ours) == len(BASES) * len(VERSIONS) * 2
    assert ours.keys() == driver.keys()
    handed_out: set[str] = set()
    for key, got in ours.items():
        want = driver[key]
        # The driver's answer (found or not, which version) is kept ...
        assert (got["rc"], got["status"], got["sym"]) == (want["rc"], want["status"], want["sym"])
        if got["rc"] != 0:
            continue
        # ... and the function it chose is replaced by our wrapper of it.
        assert want["lib"] == FAKE, want
        assert (got["lib"], got["default"]) == (LIB, True), (key, got)
        handed_out.add(got["sym"])
    assert handed_out == set(HOOKED)
