"""Fixtures of the native tests: the interposer (native/) run under the fake driver.

``native``, ``native_tools``, ``run_probe`` and ``spawn_probe`` live in the
root conftest (the device plugin's tests use them too). Here:

* ``build``: "release" and "asan", for tests that run under both;
* ``region_path``: a fresh shared-region file path per test.

See tests/native/probe.py for the environment every probe gets.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.native.probe import Build


@pytest.fixture(params=["release", "asan"])
def build(request: pytest.FixtureRequest) -> Build:
    """Runs a test under the release and the sanitizer build of the interposer."""
    value: Build = request.param
    return value


@pytest.fixture
def region_path(tmp_path: Path) -> Path:
    """Where a test's shared region lives (CUDA_DEVICE_MEMORY_SHARED_CACHE)."""
    return tmp_path / "region.cache"
