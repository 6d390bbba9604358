"""Layer 1, the driver's per-cgroup memory limits, against the fake NVML and driver.

The limit is set through gpuslice_deviceplugin.driverlimits (in a process of its
own: driverlimits_cli.py) on a real cgroup v2 group of the test's own; the probe
runs in that group WITHOUT the interposer, so only the "driver" can refuse it.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuslice_common.models import DRIVER_LIMIT_ENV
from gpuslice_deviceplugin import driverlimits
from gpuslice_deviceplugin.driverlimits import CardSupport, hook_environment
from tests.native.probe import Native, probe_env

SCRIPT = Path(__file__).with_name("driverlimits_cli.py")
MIB = 1 << 20
GIB = 1 << 30
OOM = 2  # CUDA_ERROR_OUT_OF_MEMORY
ROOT = driverlimits.cgroup2_root()

needs_cgroup2 = pytest.mark.skipif(
    ROOT is None or not os.access(ROOT, os.W_OK), reason="needs a writable cgroup v2 hierarchy"
)


@pytest.fixture
def group() -> Iterator[Path]:
    """A fresh cgroup v2 group; its processes are killed and it is removed after."""
    assert ROOT is not None
    path = ROOT / f"gpuslice-test-{uuid.uuid4().hex[:12]}"
    path.mkdir()
    yield path
    if (path / "cgroup.kill").exists():
        (path / "cgroup.kill").write_text("1")
    for _ in range(200):
        try:
            path.rmdir()
            return
        except OSError:
            os.sched_yield()
            subprocess.run(["sleep", "0.05"], check=False)
    raise AssertionError(f"{path} still busy")


@pytest.fixture
def state(tmp_path: Path) -> Path:
    path = tmp_path / "fakegpu"
    (path / "procs").mkdir(parents=True)
    return path


def _env(native: Native, state: Path | None, **extra: str) -> dict[str, str]:
    env = probe_env(native, "none", {"FAKECUDA_DEVICES": "2", **extra})
    if state is not None:
        env["FAKEGPU_STATE_DIR"] = str(state)
    return env


def limits(native: Native, state: Path | None, *args: str | int, **extra: str) -> Any:
    """Runs driverlimits_cli.py; its JSON answer."""
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, args)],
        env=_env(native, state, **extra),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def rel(group: Path) -> str:
    assert ROOT is not None
    return "/" + str(group.relative_to(ROOT))


def _join(group: Path) -> None:
    (group / "cgroup.procs").write_text(str(os.getpid()))


def probe_in(native: Native, group: Path | None, state: Path, *commands: str) -> list[Any]:
    """The probe's lines, run (without the interposer) inside ``group``."""
    preexec = None if group is None else (lambda: _join(group))
    done = subprocess.run(
        [str(native.probe), *" ".join(commands).split()],
        env=_env(native, state),
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=preexec,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


def allocs(lines: list[Any]) -> list[int]:
    return [line["rc"] for line in lines if line["cmd"] == "alloc"]


def proc_state(pid: int, used: dict[int, int]) -> bytes:
    """A fake_proc_state (native/tests/fake/fake_state.h) of pid holding ``used``."""
    used_bytes = [used.get(i, 0) for i in range(16)]
    return struct.pack("<IIiI16Q16Q16Q16Q", 0x53504746, 1, pid, 2, *used_bytes, *[0] * 48)


@needs_cgroup2
def test_a_process_in_a_limited_group_gets_out_of_memory_from_the_driver(
    native_tools: Native, state: Path, group: Path
) -> None:
    commands = ("init", "ctx", "alloc 600m", "alloc 600m")
    assert allocs(probe_in(native_tools, group, state, *commands)) == [0, 0]  # no limit yet
    result = limits(native_tools, state, "ensure", 0, rel(group), GIB)
    assert result["outcome"] == "set"
    assert result["hard_before"] == driverlimits.NO_LIMIT
    assert allocs(probe_in(native_tools, group, state, *commands)) == [0, OOM]
    # the limit is the group's: outside it, and on the other card, nothing is refused
    assert allocs(probe_in(native_tools, None, state, *commands)) == [0, 0]
    assert allocs(probe_in(native_tools, group, state, "init ctx 1 alloc 600m alloc 600m")) == [
        0,
        0,
    ]
    read = limits(native_tools, state, "read", 0, rel(group))
    assert read == {"soft": 0, "hard": GIB, "used": 0}


@needs_cgroup2
def test_the_limit_counts_every_process_of_the_group(
    native_tools: Native, state: Path, group: Path
) -> None:
    assert limits(native_tools, state, "ensure", 0, rel(group), GIB)["outcome"] == "set"
    holder = subprocess.Popen(["sleep", "60"], preexec_fn=lambda: _join(group))
    try:
        (state / "procs" / str(holder.pid)).write_bytes(proc_state(holder.pid, {0: 700 * MIB}))
        lines = probe_in(native_tools, group, state, "init ctx alloc 200m alloc 200m")
        assert allocs(lines) == [0, OOM]  # 700 + 200 fits in 1 GiB, 700 + 400 does not
        assert limits(native_tools, state, "read", 0, rel(group))["used"] == 700 * MIB
    finally:
        holder.kill()
        holder.wait()
    # a dead process's file no longer counts
    assert allocs(probe_in(native_tools, group, state, "init ctx alloc 900m")) == [0]


@needs_cgroup2
def test_a_lower_limit_is_kept_and_a_higher_one_lowered(
    native_tools: Native, state: Path, group: Path
) -> None:
    assert limits(native_tools, state, "ensure", 0, rel(group), 512 * MIB)["outcome"] == "set"
    kept = limits(native_tools, state, "ensure", 0, rel(group), GIB)
    assert kept == {"outcome": "kept", "hard_before": 512 * MIB, "detail": ""}
    lowered = limits(native_tools, state, "ensure", 0, str(group), 256 * MIB)  # full path too
    assert lowered["outcome"] == "set"
    assert lowered["hard_before"] == 512 * MIB
    assert limits(native_tools, state, "read", 0, rel(group))["hard"] == 256 * MIB
    assert allocs(probe_in(native_tools, group, state, "init ctx alloc 300m")) == [OOM]


@needs_cgroup2
def test_cards_without_driver_limits_are_reported_and_left_alone(
    native_tools: Native, state: Path, group: Path
) -> None:
    found = limits(native_tools, state, "support", FAKENVML_NO_MEMORY_LIMITS="1")
    by_index = [found[u] for u in sorted(found)]  # fake UUIDs sort by index
    assert by_index[0] == {"supported": True, "note": "driver"}
    assert by_index[1]["supported"] is False
    assert "nvmlDeviceGetMemoryLimits_v1" in by_index[1]["note"]
    result = limits(
        native_tools, state, "ensure", 1, rel(group), GIB, FAKENVML_NO_MEMORY_LIMITS="1"
    )
    assert result["outcome"] == "unsupported"
    # no driver to enforce (no state directory): no card is supported
    found = limits(native_tools, None, "support")
    assert [s["supported"] for s in found.values()] == [False, False]


@needs_cgroup2
def test_a_group_path_that_escapes_the_hierarchy_is_refused(
    native_tools: Native, state: Path, group: Path
) -> None:
    for bad in (rel(group) + "/../..", "relative/path", rel(group) + " x"):
        result = limits(native_tools, state, "ensure", 0, bad, GIB)
        assert result["outcome"] == "failed", bad
    missing = limits(native_tools, state, "ensure", 0, rel(group) + "/gone", GIB)
    assert missing["outcome"] == "failed"
    assert "does not exist" in missing["detail"]
    assert not (state / "limits").exists() or (state / "limits").read_text() == ""


@needs_cgroup2
def test_the_fake_nvml_checks_limits_and_clears_them(
    native_tools: Native, state: Path, group: Path
) -> None:
    invalid, no_limit = 2, driverlimits.NO_LIMIT  # NVML_ERROR_INVALID_ARGUMENT
    assert limits(native_tools, state, "write", 0, rel(group), 2 * GIB, GIB) == invalid
    assert not (state / "limits").exists()
    assert limits(native_tools, state, "write", 0, rel(group), 0, GIB) == 0
    assert limits(native_tools, state, "write", 1, rel(group), 0, 2 * GIB) == 0
    lines = (state / "limits").read_text().splitlines()
    assert lines == [f"0 {group} 0 {GIB}", f"1 {group} 0 {2 * GIB}"]
    # soft 0 and hard "max" clear a limit: that card's line goes, the other stays
    assert limits(native_tools, state, "write", 0, rel(group), 0, no_limit) == 0
    assert (state / "limits").read_text().splitlines() == [f"1 {group} 0 {2 * GIB}"]
    assert limits(native_tools, state, "read", 0, rel(group))["hard"] == no_limit
    assert allocs(probe_in(native_tools, group, state, "init ctx alloc 1500m")) == [0]


def test_nvml_without_the_calls_supports_no_card(native_tools: Native, tmp_path: Path) -> None:
    """An NVML older than r615 (no nvmlDeviceSetMemoryLimits_v1) is reported as such."""
    code = (
        "import pynvml, json; from gpuslice_deviceplugin import driverlimits as d;"
        "pynvml.nvmlInit(); d.SET_LIMITS = 'nvmlDeviceSetMemoryLimits_v0';"
        "from gpuslice_common.models import GpuDevice as G;"
        "print(json.dumps(d.card_support([G(uuid='GPU-a', index=0, model='m', memory_mib=1)])"
        "['GPU-a'].note))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=_env(native_tools, tmp_path),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "NVML has no nvmlDeviceSetMemoryLimits_v0" in json.loads(done.stdout)


def test_dmem_capacity_names_the_cards_it_limits(tmp_path: Path) -> None:
    (tmp_path / "dmem.capacity").write_text(
        "nvidia/0000:3B:00.0/vidmem 85899345920\ndrm/0000:00:02.0/vram0 1\nnvidia/bad 1\n\n"
    )
    assert driverlimits.dmem_cards(tmp_path) == frozenset({"0000:3b:00.0"})
    assert driverlimits.dmem_cards(tmp_path / "none") == frozenset()


def test_cgroup2_root_is_read_from_mountinfo(tmp_path: Path) -> None:
    info = tmp_path / "mountinfo"
    info.write_text(
        "30 1 0:26 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"
        "41 31 0:38 / /sys/fs/cgroup rw,relatime - cgroup2 cgroup2 rw\n"
    )
    assert driverlimits.cgroup2_root(info) == Path("/sys/fs/cgroup")
    info.write_text("30 1 0:26 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n")
    assert driverlimits.cgroup2_root(info) is None


def test_the_hook_gets_one_limit_only_where_every_card_supports_it() -> None:
    yes, no = CardSupport(True, "driver"), CardSupport(False, "MIG mode")
    grants = {"GPU-a": GIB, "GPU-b": GIB}
    assert hook_environment(grants, {"GPU-a": yes, "GPU-b": yes}) == {DRIVER_LIMIT_ENV: str(GIB)}
    assert hook_environment(grants, {"GPU-a": yes, "GPU-b": no}) == {}
    assert hook_environment(grants, {"GPU-a": yes}) == {}
    assert hook_environment({"GPU-a": GIB, "GPU-b": 2 * GIB}, {"GPU-a": yes, "GPU-b": yes}) == {}
