"""A hostile tenant against its limits: every attempt is held to the grant or refused.

Most attempts run in a container laid out as kubelet lays out a gpuslice
container (tests/native/container.py): the grant and region at /run/gpuslice,
read-only but for the region, and /etc/ld.so.preload naming the library. The
rest need no container: the strict parsing of the environment where there is no
grant, and the library's own hooks.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import time
from pathlib import Path

import pytest

from gpuslice_common.region import Region, ffi
from tests.native.container import Container, GiB, MiB, grant
from tests.native.probe import (
    Build,
    Native,
    ProbeRunner,
    ProbeSpawner,
    asan_runtime,
    probe_argv,
    probe_env,
)

OK = 0
OOM = 2
REFUSED = "every GPU allocation of this process is refused"


def preload_of(native: Native, build: Build) -> list[str]:
    if build == "asan":
        return [*asan_runtime(native.asan_lib), str(native.asan_lib)]
    return [str(native.lib)]


@pytest.fixture
def box(tmp_path: Path) -> Container:
    """A container granted 1 GiB on fake GPU 0."""
    return Container.prepare(tmp_path, grant(GiB))


def rcs(result_lines: list[dict[str, object]], cmd: str) -> list[object]:
    return [line["rc"] for line in result_lines if line.get("cmd") == cmd]


# ----------------------------------------------------------------------------- the grant holds


def test_a_cleaned_environment_is_held_to_the_grant(
    native: Native, spawn_probe: ProbeSpawner, run_probe: ProbeRunner, box: Container, build: Build
) -> None:
    """env -i: no LD_PRELOAD, no limit variable; ld.so.preload and the grant still hold."""
    preload = preload_of(native, build)
    sibling = spawn_probe(
        "init", "ctx", "alloc", "512m", "hold", build=build, prefix=box.prefix(preload=preload)
    )
    sibling.wait_for("hold")
    clean = ["env", "-i", f"LD_LIBRARY_PATH={native.fake_dir}", "ASAN_OPTIONS=detect_leaks=0"]
    result = run_probe(
        "init", "ctx", "alloc", "600m", "alloc", "400m", "info",
        build=build, prefix=[*box.prefix(preload=preload), *clean],
    )  # fmt: skip
    assert rcs(result.lines, "alloc") == [OOM, OK], result.describe()
    assert result.one("info")["total"] == GiB
    with Region.open(box.region) as region:  # counted together; the exited one gave back
        device = region.devices()[0]
        assert (device.used_bytes, device.peak_bytes) == (512 * MiB, 912 * MiB)
    sibling.stop()


def test_unsetting_ld_preload_leaves_the_preload_file(
    native: Native, run_probe: ProbeRunner, box: Container, build: Build
) -> None:
    result = run_probe(
        "init", "ctx", "alloc", "2g", "alloc", "1g",
        build=build, env={"LD_PRELOAD": None}, prefix=box.prefix(preload=preload_of(native, build)),
    )  # fmt: skip
    assert rcs(result.lines, "alloc") == [OOM, OK], result.describe()


def test_the_environment_cannot_raise_lower_or_remove_the_grant(
    run_probe: ProbeRunner, box: Container, tmp_path: Path, build: Build
) -> None:
    elsewhere = tmp_path / "mine.region"
    env: dict[str, str | int | None] = {
        "CUDA_DEVICE_MEMORY_LIMIT": "100g",
        "CUDA_DEVICE_MEMORY_LIMIT_0": "100g",
        "CUDA_DEVICE_SM_LIMIT": "100",
        "GPU_CORE_UTILIZATION_POLICY": "disable",
        "CUDA_DISABLE_CONTROL": "true",
        "GPUSLICE_CONTEXT_OVERHEAD": "0",
        "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(elsewhere),
        "GPUSLICE_GRANT_DIR": str(tmp_path),
        "NVIDIA_VISIBLE_DEVICES": "all",
    }
    result = run_probe(
        "init", "ctx", "alloc", "1500m", "alloc", "1g", "info",
        build=build, env=env, prefix=box.prefix(),
    )  # fmt: skip
    assert rcs(result.lines, "alloc") == [OOM, OK], result.describe()
    assert result.one("info")["total"] == GiB
    assert "CUDA_DISABLE_CONTROL ignored" in result.stderr
    assert not elsewhere.exists()
    lower = run_probe(
        "init", "ctx", "alloc", "900m", build=build,
        env={"CUDA_DEVICE_MEMORY_LIMIT": "1m"}, prefix=box.prefix(),
    )  # fmt: skip
    assert lower.one("alloc")["rc"] == OK  # the grant, not the environment, in both directions


def test_disable_control_is_honoured_where_the_grant_allows_it(
    run_probe: ProbeRunner, tmp_path: Path
) -> None:
    box = Container.prepare(tmp_path, grant(GiB, control_optional=True))
    result = run_probe(
        "init", "ctx", "alloc", "2g", env={"CUDA_DISABLE_CONTROL": "true"}, prefix=box.prefix()
    )
    assert result.one("alloc")["rc"] == OK


def test_a_device_outside_the_grant_gives_nothing(
    run_probe: ProbeRunner, box: Container, build: Build
) -> None:
    result = run_probe(
        "init", "nvml", "ctx", 1, "alloc", "1m", "nvmlmem", 1, "ctx", 0, "alloc", "1m",
        build=build, env={"FAKECUDA_DEVICES": 2, "FAKENVML_DEVICES": 2}, prefix=box.prefix(),
    )  # fmt: skip
    ctx = rcs(result.lines, "ctx")
    assert ctx == [OOM, OK], result.describe()
    assert rcs(result.lines, "alloc")[0] != OK
    assert rcs(result.lines, "alloc")[1] == OK
    nvml = result.one("nvmlmem")
    assert (nvml["total"], nvml["free"]) == (0, 0)


@pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root")
def test_a_container_running_as_any_user_shares_the_region(
    native: Native, run_probe: ProbeRunner, box: Container
) -> None:
    result = run_probe(
        "init", "ctx", "alloc", "600m", "alloc", "600m",
        env={"LD_PRELOAD": None}, prefix=box.prefix(preload=[native.lib], uid=4242),
    )  # fmt: skip
    assert rcs(result.lines, "alloc") == [OK, OOM], result.describe()


# ----------------------------------------------------------------------------- files


def test_nothing_in_the_container_directory_can_be_added_swapped_or_renamed(
    box: Container,
) -> None:
    before = sorted((p.name, p.stat().st_ino) for p in box.directory.iterdir())
    attempts = [
        "ln -s /etc/shadow /run/gpuslice/evil",
        "mv /run/gpuslice/region /run/gpuslice/old",
        "rm -f /run/gpuslice/region",
        "rm -f /run/gpuslice/grant",
        "chmod 0666 /run/gpuslice/grant",
        "echo 'device GPU-x 99999999999 100' >> /run/gpuslice/grant",
    ]
    for attempt in attempts:
        done = subprocess.run(
            [*box.prefix(), "sh", "-c", attempt], capture_output=True, text=True, check=False
        )
        assert done.returncode != 0, f"{attempt!r} succeeded inside the container"
    assert sorted((p.name, p.stat().st_ino) for p in box.directory.iterdir()) == before
    assert stat.S_IMODE((box.directory / "grant").stat().st_mode) == 0o444


def test_a_writable_grant_is_refused(run_probe: ProbeRunner, box: Container, build: Build) -> None:
    (box.directory / "grant").chmod(0o644)
    result = run_probe(
        "init", "ctx", "alloc", "1m",
        build=build, env={"GPUSLICE_GRANT_DIR": str(box.directory)},
    )  # fmt: skip
    assert "is writable" in result.stderr
    assert REFUSED in result.stderr
    assert result.one("ctx")["rc"] == OOM


@pytest.mark.parametrize(
    ("mangle", "named"),
    [
        (lambda t: t.replace("gpuslice-grant 1", "gpuslice-grant 2"), "gpuslice-grant 1"),
        (lambda t: t.replace(f" {GiB} ", " -1 "), "line 9"),
        (lambda t: t.replace(f" {GiB} ", " 1e400 "), "line 9"),
        (lambda t: t.replace(f" {GiB} ", " 99999999999999999999999 "), "line 9"),
        (lambda t: t.replace(f"{GiB} 0\n", f"{GiB} 101\n"), "line 9"),
        (lambda t: t + "limit unlimited\n", "unknown key"),
        (lambda t: t + t.splitlines()[-1] + "\n", "device given twice"),
        (lambda t: t.replace("policy default\n", ""), "incomplete"),
        (lambda t: t.replace("policy default", "policy  default"), "empty field"),
        (lambda t: "", "bytes"),
    ],
)
def test_a_malformed_grant_fails_closed(
    run_probe: ProbeRunner, box: Container, mangle: object, named: str
) -> None:
    path = box.directory / "grant"
    text = path.read_text()
    path.chmod(0o644)
    assert callable(mangle)
    path.write_text(mangle(text))
    path.chmod(0o444)
    result = run_probe("init", "ctx", "alloc", "1m", env={"GPUSLICE_GRANT_DIR": str(box.directory)})
    assert named in result.stderr, result.stderr
    assert REFUSED in result.stderr, result.stderr
    assert result.one("ctx")["rc"] == OOM
    assert result.one("alloc")["rc"] != OK


@pytest.mark.parametrize(
    ("change", "why"),
    [
        (lambda p: p.chmod(0o644), "mode 0644"),
        (lambda p: os.truncate(p, 4096), "4096 bytes"),
    ],
)
def test_a_region_not_as_the_agent_made_it_is_refused(
    run_probe: ProbeRunner, box: Container, change: object, why: str
) -> None:
    assert callable(change)
    change(box.region)
    result = run_probe("init", "ctx", "alloc", "1m", env={"GPUSLICE_GRANT_DIR": str(box.directory)})
    assert why in result.stderr, result.stderr
    assert REFUSED in result.stderr, result.stderr
    assert result.one("ctx")["rc"] == OOM


def test_a_process_that_rewrites_the_region_stays_within_its_grant(
    spawn_probe: ProbeSpawner, run_probe: ProbeRunner, box: Container, build: Build
) -> None:
    sibling = spawn_probe("init", "ctx", "alloc", "512m", "hold", build=build, prefix=box.prefix())
    sibling.wait_for("hold")
    # What any process of the container can do to the file it maps: forget every
    # use and raise the limit.
    with Region.open(box.region, writable=True) as region:
        r = ffi.cast("gs_region_t *", ffi.from_buffer(region._mmap))
        r.devices[0].used = 0
        r.devices[0].limit = 1 << 50
        for slot in range(int(r.proc_high)):
            r.procs[slot].used[0] = 0
    result = run_probe(
        "init", "ctx", "alloc", "1500m", "alloc", "1g", "alloc", "1m",
        build=build, prefix=box.prefix(),
    )  # fmt: skip
    # Its own use never passes the grant, whatever the shared counters say, and
    # joining puts the grant's limit back for everyone to see.
    assert rcs(result.lines, "alloc") == [OOM, OK, OOM], result.describe()
    with Region.open(box.region) as region:
        assert region.devices()[0].limit_bytes == GiB
    sibling.stop()


# ----------------------------------------------------------------------------- no grant


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("CUDA_DEVICE_MEMORY_LIMIT", "abc"),
        ("CUDA_DEVICE_MEMORY_LIMIT", "-1"),
        ("CUDA_DEVICE_MEMORY_LIMIT", "99999999999999g"),
        ("CUDA_DEVICE_MEMORY_LIMIT", "1e400"),
        ("CUDA_DEVICE_MEMORY_LIMIT", "nan"),
        ("CUDA_DEVICE_MEMORY_LIMIT", "1g junk"),
        ("CUDA_DEVICE_MEMORY_LIMIT", "0.0000001"),
        ("CUDA_DEVICE_MEMORY_LIMIT", "0"),
        ("CUDA_DEVICE_MEMORY_LIMIT_0", "abc"),
        ("CUDA_DEVICE_SM_LIMIT", "150"),
        ("GPU_CORE_UTILIZATION_POLICY", "sometimes"),
        ("CUDA_DISABLE_CONTROL", "maybe"),
        ("CUDA_TASK_PRIORITY", "high"),
    ],
)
def test_a_malformed_limit_fails_closed(
    run_probe: ProbeRunner, variable: str, value: str, build: Build
) -> None:
    result = run_probe("init", "ctx", "alloc", "1m", build=build, env={variable: value})
    assert f"{variable}={value}" in result.stderr, result.stderr
    assert REFUSED in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert result.one("ctx")["rc"] == OOM
    assert result.one("alloc")["rc"] != OK


def test_a_later_process_cannot_raise_the_recorded_limit(
    run_probe: ProbeRunner, region_path: Path
) -> None:
    env = {"CUDA_DEVICE_MEMORY_LIMIT": "1g", "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(region_path)}
    first = run_probe("init", "ctx", env=env)
    assert first.one("ctx")["rc"] == OK
    for env in ({"CUDA_DEVICE_MEMORY_LIMIT": "8g"}, {}):
        later = run_probe(
            "init", "ctx", "alloc", "2g", "info",
            env={**env, "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(region_path)},
        )  # fmt: skip
        assert later.one("alloc")["rc"] == OOM, later.describe()
        assert later.one("info")["total"] == GiB


def test_a_symlinked_region_is_never_followed(run_probe: ProbeRunner, tmp_path: Path) -> None:
    target = tmp_path / "victim"
    target.write_bytes(b"precious")
    (tmp_path / "link").symlink_to(target)
    (tmp_path / "dirlink").symlink_to(tmp_path)
    for path in (tmp_path / "link", tmp_path / "dirlink" / "region"):
        result = run_probe(
            "init", "ctx", "alloc", "1m",
            env={"CUDA_DEVICE_MEMORY_LIMIT": "1g", "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(path)},
        )  # fmt: skip
        assert "safely" in result.stderr, result.stderr
        assert REFUSED in result.stderr, result.stderr
        assert result.one("alloc")["rc"] != OK
    assert target.read_bytes() == b"precious"
    assert not (tmp_path / "region").exists()


def test_a_region_open_to_others_or_of_another_user_is_refused(
    run_probe: ProbeRunner, region_path: Path
) -> None:
    env = {"CUDA_DEVICE_MEMORY_LIMIT": "1g", "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(region_path)}
    assert run_probe("init", "ctx", env=env).one("ctx")["rc"] == OK
    region_path.chmod(0o666)
    result = run_probe("init", "ctx", "alloc", "1m", env=env)
    assert "closed to others" in result.stderr
    assert result.one("alloc")["rc"] != OK
    if os.geteuid() == 0:
        region_path.chmod(0o600)
        os.chown(region_path, 4242, 4242)
        result = run_probe("init", "ctx", "alloc", "1m", env=env)
        assert "must belong to this user" in result.stderr
        assert result.one("alloc")["rc"] != OK


# ----------------------------------------------------------------------------- the library's paths


def test_a_library_loaded_with_deepbind_still_goes_through_the_limits(
    run_probe: ProbeRunner, region_path: Path
) -> None:
    # Release build only: the sanitizer runtime, preloaded first, intercepts dlopen
    # before the library and aborts on RTLD_DEEPBIND (google/sanitizers#611).
    env = {"CUDA_DEVICE_MEMORY_LIMIT": "1g", "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(region_path)}
    result = run_probe("init", "ctx", "deepalloc", "2g", "deepalloc", "512m", env=env)
    assert rcs(result.lines, "deepalloc") == [OOM, OK], result.describe()
    with Region.open(region_path) as region:  # counted while the probe ran
        assert region.devices()[0].peak_bytes == 512 * MiB


def test_a_driver_loaded_into_another_namespace_is_refused(
    run_probe: ProbeRunner, region_path: Path, build: Build
) -> None:
    env = {"CUDA_DEVICE_MEMORY_LIMIT": "1g", "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(region_path)}
    result = run_probe(
        "init", "ctx", "alloc", "2g", build=build, env=env, options=["--dlmopen"], check=False
    )
    assert "dlmopen" in result.stderr
    assert "refused" in result.stderr, result.describe()
    assert all(line["rc"] != OK for line in result.lines if line.get("cmd") == "alloc")


def test_one_unmap_over_side_by_side_mappings_gives_back_both(
    run_probe: ProbeRunner, region_path: Path, build: Build
) -> None:
    env = {"CUDA_DEVICE_MEMORY_LIMIT": "1g", "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(region_path)}
    result = run_probe(
        "init", "ctx", "vmmpair", "256m", "info", "alloc", "1g", build=build, env=env
    )
    assert result.one("vmmpair")["rc"] == OK
    assert result.one("info")["free"] == GiB, result.describe()
    assert result.one("alloc")["rc"] == OK


def test_a_killed_process_not_yet_reaped_holds_nothing(
    native: Native, run_probe: ProbeRunner, region_path: Path
) -> None:
    env = {"CUDA_DEVICE_MEMORY_LIMIT": "1g", "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(region_path)}
    holder = subprocess.Popen(
        probe_argv(native, ("init", "ctx", "alloc", "800m", "hold"), ()),
        env=probe_env(native, "release", env),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        assert holder.stdout is not None
        while b'"cmd":"hold"' not in holder.stdout.readline():
            pass
        os.kill(holder.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while Path(f"/proc/{holder.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.monotonic() < deadline, "the holder did not become a zombie"
            time.sleep(0.01)
        result = run_probe("init", "ctx", "alloc", "800m", env=env)
        assert result.one("alloc")["rc"] == OK, result.describe()
        assert Path(f"/proc/{holder.pid}").exists()  # still unreaped
    finally:
        holder.kill()
        holder.wait()
        if holder.stdout is not None:
            holder.stdout.close()
