"""The engine's tests again, on the compiled core built with the address and
undefined-behaviour sanitizers (native/build/asan/libgsengine.so), in a child
process that preloads the sanitizer runtime: an out-of-bounds read or write, a
use after free or an overflow in engine.c fails them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.native.probe import Native, asan_runtime

ROOT = Path(__file__).resolve().parents[1]
# the example-based tests, and of the differential ones against the NumPy
# reference a few that together reach every path of the core
COMPILED = "tests/test_engine_compiled.py::test_"
SUITES = (
    "tests/test_engine.py",
    "tests/test_fragmentation.py",
    "tests/test_engine_attack.py",
    f"{COMPILED}pods_placed_one_after_another_are_placed_as_the_reference_places_them",
    f"{COMPILED}pods_on_nodes_short_of_cpu_or_memory_are_placed_as_the_reference_places_them[None]",
    f"{COMPILED}gpu_pods_are_placed_as_the_reference_places_them[fragmentation-None]",
    f"{COMPILED}gpu_pods_are_placed_as_the_reference_places_them[binpack-spread]",
    f"{COMPILED}gpu_pods_are_placed_as_the_reference_places_them[spread-binpack]",
    f"{COMPILED}node_fragmentation_is_the_references",
)


def _sanitized_env(native: Native) -> dict[str, str]:
    lib = native.asan_lib.parent / "libgsengine.so"
    assert lib.is_file(), f"make -C native check did not build {lib}"
    return {
        **os.environ,
        "GPUSLICE_NATIVE_DIR": str(lib.parent),
        "LD_PRELOAD": ":".join(asan_runtime(lib)),
        # Python itself is not built for the leak checker; the core frees what it takes
        "ASAN_OPTIONS": "detect_leaks=0:halt_on_error=1",
        "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1",
    }


def test_the_child_loads_the_sanitized_core(native: Native) -> None:
    script = (
        "from gpuslice_scheduler import core; core.load(); "
        "import sys; sys.stdout.write(str(core.library_path()))"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        env=_sanitized_env(native),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == str(native.asan_lib.parent / "libgsengine.so")


def test_engine_tests_pass_on_the_sanitized_core(native: Native) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-x",
            "-p",
            "no:randomly",
            "-p",
            "no:cacheprovider",
            *SUITES,
        ],
        cwd=ROOT,
        env=_sanitized_env(native),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    assert "AddressSanitizer" not in output, output[-6000:]
    assert "runtime error" not in output, output[-6000:]
    assert " passed" in output
