"""Fixtures of the native tests: the interposer (native/) run under the fake driver.

* ``native``: builds everything (`make -C native check`) once and gives the paths;
* ``native_tools``: only the fake driver, NVML and test programs (`fakes progs`),
  for tests of the fake itself;
* ``run_probe(*commands, env=None, build="release", options=(), timeout=30,
  check=True, preload_after=())``: runs build/probe to completion, a ProbeResult;
* ``spawn_probe(...)``: the same in the background, a ProbeProcess (a
  subprocess.Popen) for tests that kill or race processes; killed at the test's end;
* ``build``: "release" and "asan", for tests that run under both;
* ``region_path``: a fresh shared-region file path per test.

See tests/native/probe.py for the environment every probe gets.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.native.probe import (
    Build,
    Native,
    ProbeRunner,
    ProbeSpawner,
    asan_runtime,
    ensure_built,
)


@pytest.fixture(scope="session")
def native() -> Native:
    """Everything `make -C native check` builds; the session fails if make fails."""
    paths = Native.at()
    ensure_built(paths, "check")
    for path in (paths.lib, paths.asan_lib, paths.probe, paths.other_interposer):
        assert path.exists(), f"make check did not build {path}"
    asan_runtime(paths.asan_lib)  # fail early when the sanitizer runtime is missing
    return paths


@pytest.fixture(scope="session")
def native_tools() -> Native:
    """The fake driver and NVML, the probe and other_interposer.so; not the interposer."""
    paths = Native.at()
    ensure_built(paths, "fakes", "progs")
    return paths


@pytest.fixture
def run_probe(native_tools: Native) -> ProbeRunner:
    """Runs the probe; a build other than "none" builds the interposer first."""
    return ProbeRunner(native_tools)


@pytest.fixture
def spawn_probe(native_tools: Native, tmp_path: Path) -> Iterator[ProbeSpawner]:
    spawner = ProbeSpawner(native_tools, tmp_path)
    yield spawner
    spawner.close()


@pytest.fixture(params=["release", "asan"])
def build(request: pytest.FixtureRequest) -> Build:
    """Runs a test under the release and the sanitizer build of the interposer."""
    value: Build = request.param
    return value


@pytest.fixture
def region_path(tmp_path: Path) -> Path:
    """Where a test's shared region lives (CUDA_DEVICE_MEMORY_SHARED_CACHE)."""
    return tmp_path / "region.cache"
