"""The shared-region binding, on real region files laid out with the header's own structs."""

from __future__ import annotations

import os
import stat
import struct
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from gpuslice_common.region import (
    DEV_SHARED,
    DEV_YIELD,
    MAGIC,
    MAX_DEVICES,
    MAX_PROCS,
    REGION_SIZE,
    VERSION,
    DeviceUsage,
    ProcessUsage,
    Region,
    RegionError,
    ffi,
    layout_cdef,
)

GiB = 1 << 30
UUID0 = "GPU-0b3a9c3e-5d1f-4c7a-9e2b-1f2e3d4c5b6a"
UUID1 = "GPU-7f6e5d4c-3b2a-4190-8f7e-6d5c4b3a2910"


def blank_region() -> Any:
    """A zeroed region with its header set up, as the interposer leaves it."""
    r = ffi.new("gs_region_t *")
    r.magic = MAGIC
    r.version = VERSION
    r.size = ffi.sizeof("gs_region_t")
    return r


def sample_region() -> Any:
    r = blank_region()
    r.device_count = 2
    r.proc_high = 4
    d0 = r.devices[0]
    d0.uuid = UUID0.encode()
    d0.limit = 4 * GiB
    d0.used = 3 * GiB
    d0.peak = 3 * GiB + 5
    d0.denied = 7
    d0.throttled_ns = 1_500_000
    d0.busy_ns = 9_000_000
    d0.sm_limit = 30
    d0.flags = DEV_SHARED
    d1 = r.devices[1]
    d1.uuid = UUID1.encode()
    d1.used = 1 << 62  # counters are full 64-bit values
    d1.peak = (1 << 64) - 1
    d1.flags = DEV_SHARED | DEV_YIELD
    # a device beyond device_count must not be reported
    r.devices[2].uuid = b"GPU-not-seen"
    # slots 0 and 2 live, 1 freed, 3 live, 4 beyond proc_high
    for slot, pid, prio, used0, used1 in (
        (0, 101, 0, GiB, 0),
        (2, 202, 1, 2 * GiB, 5),
        (3, 303, 0, 0, 9),
    ):
        p = r.procs[slot]
        p.pid = pid
        p.priority = prio
        p.start_time = 1000 + slot
        p.used[0] = used0
        p.used[1] = used1
        p.used[2] = 77  # beyond device_count
    r.procs[4].pid = 404
    return r


def write(path: Path, region: Any) -> Path:
    path.write_bytes(bytes(ffi.buffer(region)))
    return path


def test_layout_matches_the_header_comments() -> None:
    assert ffi.sizeof("gs_device_t") == 256
    assert ffi.sizeof("gs_proc_t") == 192
    assert ffi.sizeof("gs_region_t") == REGION_SIZE
    assert ffi.offsetof("gs_region_t", "procs") == ffi.offsetof("gs_region_t", "devices") + (
        MAX_DEVICES * 256
    )
    assert ffi.offsetof("gs_region_t", "procs") + MAX_PROCS * 192 == REGION_SIZE


def test_cdef_keeps_integer_defines_and_drops_other_preprocessor_lines() -> None:
    source, defines = layout_cdef(
        "#ifndef X_H\n#define X_H\n#include <stdint.h>\n"
        "/* #define IN_COMMENT 1 */\n#define A 0x10 // sixteen\n#define B 5000000000\n"
        "typedef struct { uint64_t v[A]; } t; /* trailing */\n#endif\n"
    )
    assert defines == {"A": 16, "B": 5_000_000_000}
    assert "#include" not in source
    assert "#ifndef" not in source
    assert "IN_COMMENT" not in source
    assert "typedef struct { uint64_t v[A]; } t;" in source


def test_layout_matches_the_c_compiler(tmp_path: Path) -> None:
    """cffi's offsets are the ones a C compiler gives the same header."""
    header = resources.files("gpuslice_common").joinpath("region_layout.h")
    (tmp_path / "region_layout.h").write_text(header.read_text(encoding="utf-8"))
    fields = [
        ("gs_region_t", f)
        for f in ("magic", "version", "size", "device_count", "agent_heartbeat_ns", "proc_high")
    ]
    fields += [("gs_region_t", "devices"), ("gs_region_t", "procs")]
    fields += [
        ("gs_device_t", f)
        for f in ("uuid", "limit", "used", "peak", "denied", "throttled_ns", "busy_ns")
    ]
    fields += [("gs_device_t", f) for f in ("tat_ns", "sm_limit", "flags")]
    fields += [("gs_proc_t", f) for f in ("pid", "priority", "start_time", "used")]
    lines = [f'printf("%zu\\n", offsetof({t}, {f}));' for t, f in fields]
    lines += [
        f'printf("%zu\\n", sizeof({t}));' for t in ("gs_device_t", "gs_proc_t", "gs_region_t")
    ]
    (tmp_path / "probe.c").write_text(
        '#include <stddef.h>\n#include <stdio.h>\n#include "region_layout.h"\n'
        "int main(void) {\n" + "\n".join(lines) + "\nreturn 0;\n}\n"
    )
    subprocess.run(["cc", "-o", str(tmp_path / "probe"), str(tmp_path / "probe.c")], check=True)
    out = subprocess.run([str(tmp_path / "probe")], check=True, capture_output=True, text=True)
    expected = [ffi.offsetof(t, f) for t, f in fields]
    expected += [ffi.sizeof(t) for t in ("gs_device_t", "gs_proc_t", "gs_region_t")]
    assert [int(v) for v in out.stdout.split()] == expected


def test_reads_devices(tmp_path: Path) -> None:
    path = write(tmp_path / "region", sample_region())
    with Region.open(path) as region:
        assert region.device_count == 2
        assert region.agent_heartbeat_ns == 0
        assert region.devices() == (
            DeviceUsage(
                index=0,
                uuid=UUID0,
                limit_bytes=4 * GiB,
                used_bytes=3 * GiB,
                peak_bytes=3 * GiB + 5,
                denied_allocations=7,
                throttled_ns=1_500_000,
                busy_ns=9_000_000,
                sm_limit_percent=30,
                shared=True,
                yield_=False,
            ),
            DeviceUsage(
                index=1,
                uuid=UUID1,
                limit_bytes=0,
                used_bytes=1 << 62,
                peak_bytes=(1 << 64) - 1,
                denied_allocations=0,
                throttled_ns=0,
                busy_ns=0,
                sm_limit_percent=0,
                shared=True,
                yield_=True,
            ),
        )


def test_reads_live_processes_below_proc_high(tmp_path: Path) -> None:
    path = write(tmp_path / "region", sample_region())
    with Region.open(path) as region:
        assert region.processes() == (
            ProcessUsage(pid=101, priority=0, start_time_ticks=1000, used_bytes=(GiB, 0)),
            ProcessUsage(pid=202, priority=1, start_time_ticks=1002, used_bytes=(2 * GiB, 5)),
            ProcessUsage(pid=303, priority=0, start_time_ticks=1003, used_bytes=(0, 9)),
        )


def test_uuid_of_full_length_and_empty_region(tmp_path: Path) -> None:
    r = blank_region()
    r.device_count = 1
    r.devices[0].uuid = b"G" * 96  # no terminating NUL: the field's length bounds it
    with Region.open(write(tmp_path / "region", r)) as region:
        assert region.devices()[0].uuid == "G" * 96
        assert region.processes() == ()
    with Region.open(write(tmp_path / "blank", blank_region())) as region:
        assert region.devices() == ()
        assert region.processes() == ()


def test_counts_beyond_the_layout_are_clamped(tmp_path: Path) -> None:
    r = blank_region()
    r.device_count = 1000
    r.proc_high = 100_000
    r.procs[MAX_PROCS - 1].pid = 9
    with Region.open(write(tmp_path / "region", r)) as region:
        assert len(region.devices()) == MAX_DEVICES
        (proc,) = region.processes()
        assert proc.pid == 9
        assert len(proc.used_bytes) == MAX_DEVICES


def test_values_are_frozen(tmp_path: Path) -> None:
    with Region.open(write(tmp_path / "region", sample_region())) as region:
        dev = region.devices()[0]
        proc = region.processes()[0]
    with pytest.raises(ValidationError):
        dev.used_bytes = 0  # type: ignore[misc]
    with pytest.raises(ValidationError):
        proc.pid = 1  # type: ignore[misc]


def test_a_larger_file_is_accepted(tmp_path: Path) -> None:
    path = tmp_path / "region"
    path.write_bytes(bytes(ffi.buffer(sample_region())) + b"\0" * 4096)
    with Region.open(path) as region:
        assert region.device_count == 2


# ---------------------------------------------------------------- refusals


def expect_error(path: Path, message: str) -> None:
    with pytest.raises(RegionError) as info:
        Region.open(path)
    assert str(info.value) == f"{path}: {message}"
    assert "\n" not in str(info.value)


def test_missing_file(tmp_path: Path) -> None:
    expect_error(tmp_path / "nope", "no such region file")


@pytest.mark.parametrize("length", [0, 5, 12, REGION_SIZE - 1])
def test_truncated(tmp_path: Path, length: int) -> None:
    path = tmp_path / "region"
    path.write_bytes(bytes(ffi.buffer(sample_region()))[:length])
    expect_error(path, f"truncated: {length} bytes, expected {REGION_SIZE}")


def test_bad_magic(tmp_path: Path) -> None:
    r = sample_region()
    r.magic = 0x12345678
    expect_error(write(tmp_path / "region", r), "not a gpuslice region (magic 0x12345678)")
    (tmp_path / "text").write_bytes(b"hello, I am not a region at all\n" * 10_000)
    expect_error(tmp_path / "text", "not a gpuslice region (magic 0x6c6c6568)")


def test_a_region_not_set_up_yet_has_no_magic(tmp_path: Path) -> None:
    (tmp_path / "zero").write_bytes(b"\0" * REGION_SIZE)
    expect_error(tmp_path / "zero", "not a gpuslice region (magic 0x00000000)")


def test_other_version(tmp_path: Path) -> None:
    r = sample_region()
    r.version = VERSION + 1
    expect_error(
        write(tmp_path / "region", r),
        f"layout version {VERSION + 1}, this gpuslice reads {VERSION}",
    )


def test_other_version_wins_over_truncation(tmp_path: Path) -> None:
    """A region of another layout may be shorter: the version is the useful message."""
    r = sample_region()
    r.version = VERSION + 1
    path = tmp_path / "region"
    path.write_bytes(bytes(ffi.buffer(r))[:4096])
    expect_error(path, f"layout version {VERSION + 1}, this gpuslice reads {VERSION}")


def test_size_field_mismatch(tmp_path: Path) -> None:
    r = sample_region()
    r.size = REGION_SIZE - 8
    expect_error(
        write(tmp_path / "region", r),
        f"size field {REGION_SIZE - 8}, this gpuslice expects {REGION_SIZE}",
    )


def test_not_a_file(tmp_path: Path) -> None:
    expect_error(tmp_path, "not a regular file")


def test_a_link_is_not_followed(tmp_path: Path) -> None:
    target = write(tmp_path / "target", sample_region())
    (tmp_path / "link").symlink_to(target)
    expect_error(tmp_path / "link", "cannot open: Too many levels of symbolic links")


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo")
    expect_error(tmp_path / "fifo", "not a regular file")


def test_open_beneath_a_directory_descriptor_and_the_inode(tmp_path: Path) -> None:
    path = write(tmp_path / "region", sample_region())
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with Region.open("region", dir_fd=fd) as r:
            assert r.devices()[0].uuid == UUID0
            st = path.stat()
            assert r.inode == (st.st_dev, st.st_ino)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- the agent's region


@pytest.fixture
def dir_fd(tmp_path: Path) -> Iterator[int]:
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    yield fd
    os.close(fd)


def test_create_sets_up_the_devices_in_order(tmp_path: Path, dir_fd: int) -> None:
    old = os.umask(0o077)
    try:
        Region.create(dir_fd, "region", [(UUID1, 4 * GiB, 30), (UUID0, GiB, 100)])
    finally:
        os.umask(old)
    path = tmp_path / "region"
    st = path.stat()
    assert (stat.S_IMODE(st.st_mode), st.st_size, st.st_nlink) == (0o666, REGION_SIZE, 1)
    with Region.open(path) as r:
        assert [(d.uuid, d.limit_bytes, d.sm_limit_percent) for d in r.devices()] == [
            (UUID1, 4 * GiB, 30),
            (UUID0, GiB, 0),  # a whole device is no SM limit
        ]
        assert r.processes() == ()
        assert r.agent_heartbeat_ns == 0
    assert [p.name for p in tmp_path.iterdir()] == ["region"]  # no temporary left


def test_create_takes_the_mode_asked(tmp_path: Path, dir_fd: int) -> None:
    Region.create(dir_fd, "region", [(UUID0, GiB, 10)], mode=0o600)
    assert stat.S_IMODE((tmp_path / "region").stat().st_mode) == 0o600


def test_create_keeps_a_region_the_interposer_takes(tmp_path: Path, dir_fd: int) -> None:
    Region.create(dir_fd, "region", [(UUID0, GiB, 10)])
    path = tmp_path / "region"
    inode = path.stat().st_ino
    with Region.open(path, writable=True) as r:
        r.heartbeat()
    Region.create(dir_fd, "region", [(UUID1, 2 * GiB, 20)])
    assert path.stat().st_ino == inode
    with Region.open(path) as r:
        assert r.agent_heartbeat_ns > 0
        assert r.devices()[0].uuid == UUID0


@pytest.mark.parametrize("mode", [0o600, 0o644, 0o660])
def test_create_replaces_a_region_of_another_mode(tmp_path: Path, dir_fd: int, mode: int) -> None:
    Region.create(dir_fd, "region", [(UUID0, GiB, 10)])
    path = tmp_path / "region"
    path.chmod(mode)
    inode = path.stat().st_ino
    Region.create(dir_fd, "region", [(UUID0, GiB, 10)])
    assert path.stat().st_ino != inode
    assert stat.S_IMODE(path.stat().st_mode) == 0o666


def test_create_refuses_what_the_region_cannot_hold(tmp_path: Path, dir_fd: int) -> None:
    too_many = [(f"GPU-{i}", GiB, 10) for i in range(MAX_DEVICES + 1)]
    with pytest.raises(ValueError, match=f"{MAX_DEVICES + 1} devices"):
        Region.create(dir_fd, "region", too_many)
    with pytest.raises(ValueError, match="does not fit the region"):
        Region.create(dir_fd, "region", [("GPU-" + "f" * 92, GiB, 10)])
    with pytest.raises(ValueError, match="does not fit the region"):
        Region.create(dir_fd, "region", [("", GiB, 10)])
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- the agent's writes


def raw_u32(path: Path, offset: int) -> int:
    value: int = struct.unpack_from("=I", path.read_bytes(), offset)[0]
    return value


def raw_u64(path: Path, offset: int) -> int:
    value: int = struct.unpack_from("=Q", path.read_bytes(), offset)[0]
    return value


@pytest.mark.parametrize(
    ("shared", "yield_", "flags"),
    [(False, False, 0), (True, False, DEV_SHARED), (False, True, DEV_YIELD), (True, True, 3)],
)
def test_set_flags_round_trip(tmp_path: Path, shared: bool, yield_: bool, flags: int) -> None:
    path = write(tmp_path / "region", sample_region())
    with Region.open(path, writable=True) as writer, Region.open(path) as reader:
        writer.set_flags(1, shared=shared, yield_=yield_)
        writer.set_flags(5, shared=True, yield_=True)  # beyond device_count: allowed
        # a second, independent mapping of the same file sees the store at once
        dev = reader.devices()[1]
        assert (dev.shared, dev.yield_) == (shared, yield_)
        assert reader.devices()[0].shared  # untouched
    assert raw_u32(path, ffi.offsetof("gs_region_t", "devices", 1, "flags")) == flags
    assert raw_u32(path, ffi.offsetof("gs_region_t", "devices", 5, "flags")) == 3
    # the offset is the one the layout gives, by hand: header, devices before, fields before
    assert ffi.offsetof("gs_region_t", "devices", 1, "flags") == (
        ffi.offsetof("gs_region_t", "devices") + 256 + 96 + 7 * 8 + 4
    )
    with Region.open(path) as again:
        assert (again.devices()[1].shared, again.devices()[1].yield_) == (shared, yield_)


def test_heartbeat_round_trip(tmp_path: Path) -> None:
    path = write(tmp_path / "region", sample_region())
    before = time.monotonic_ns()
    with Region.open(path, writable=True) as writer:
        stamped = writer.heartbeat()
    after = time.monotonic_ns()
    assert before <= stamped <= after
    assert raw_u64(path, ffi.offsetof("gs_region_t", "agent_heartbeat_ns")) == stamped
    with Region.open(path) as reader:
        assert reader.agent_heartbeat_ns == stamped


def test_writes_touch_only_their_fields(tmp_path: Path) -> None:
    path = write(tmp_path / "region", sample_region())
    before = bytearray(path.read_bytes())
    with Region.open(path, writable=True) as region:
        region.set_flags(0, shared=False, yield_=True)
        stamped = region.heartbeat()
    flags_at = ffi.offsetof("gs_region_t", "devices", 0, "flags")
    beat_at = ffi.offsetof("gs_region_t", "agent_heartbeat_ns")
    struct.pack_into("=I", before, flags_at, DEV_YIELD)
    struct.pack_into("=Q", before, beat_at, stamped)
    assert path.read_bytes() == bytes(before)


@pytest.mark.parametrize(
    "write_op",
    [
        lambda r: r.set_flags(0, shared=True, yield_=False),
        lambda r: r.heartbeat(),
    ],
)
def test_read_only_region_refuses_writes(
    tmp_path: Path, write_op: Callable[[Region], object]
) -> None:
    path = write(tmp_path / "region", sample_region())
    original = path.read_bytes()
    with Region.open(path) as region:
        with pytest.raises(RegionError) as info:
            write_op(region)
        assert str(info.value) == f"{path}: region is open read-only"
    assert path.read_bytes() == original


def test_set_flags_index_out_of_range(tmp_path: Path) -> None:
    with Region.open(write(tmp_path / "region", sample_region()), writable=True) as region:
        with pytest.raises(ValueError, match="out of range"):
            region.set_flags(MAX_DEVICES, shared=True, yield_=True)
        with pytest.raises(ValueError, match="out of range"):
            region.set_flags(-1, shared=True, yield_=True)


def test_closed_region(tmp_path: Path) -> None:
    region = Region.open(write(tmp_path / "region", sample_region()), writable=True)
    assert not region.closed
    region.close()
    region.close()  # idempotent
    assert region.closed
    with pytest.raises(RegionError, match="closed"):
        region.devices()
    with pytest.raises(RegionError, match="closed"):
        region.set_flags(0, shared=True, yield_=True)


# ---------------------------------------------------------------- concurrent writer

WRITER = textwrap.dedent(
    """
    import mmap, sys
    from gpuslice_common.region import ffi

    path, count = sys.argv[1], int(sys.argv[2])
    with open(path, "r+b") as f:
        m = mmap.mmap(f.fileno(), ffi.sizeof("gs_region_t"))
    r = ffi.from_buffer("gs_region_t *", m)
    dev, proc = r.devices[0], r.procs[0]
    print("ready", flush=True)
    for i in range(1, count + 1):
        # both 32-bit halves hold i: a torn 64-bit read would show unequal halves
        value = i * 0x1_0000_0001
        proc.used[0] = value
        dev.used = value
        if dev.peak < value:
            dev.peak = value
        r.proc_high = 1 + i % 2
    """
)


def test_reads_a_region_another_process_is_writing(tmp_path: Path) -> None:
    count = 300_000
    r = blank_region()
    r.device_count = 1
    r.proc_high = 1
    r.procs[0].pid = 4242
    path = write(tmp_path / "region", r)
    seen_used: list[int] = []
    seen_peak: list[int] = []
    seen_proc: list[int] = []
    with (
        subprocess.Popen(
            [sys.executable, "-c", WRITER, str(path), str(count)],
            stdout=subprocess.PIPE,
            text=True,
        ) as writer,
        Region.open(path) as region,
    ):
        assert writer.stdout is not None
        assert writer.stdout.readline() == "ready\n"
        while writer.poll() is None:
            (dev,) = region.devices()
            (proc,) = region.processes()
            seen_used.append(dev.used_bytes)
            seen_peak.append(dev.peak_bytes)
            seen_proc.append(proc.used_bytes[0])
        assert writer.wait() == 0
        (final,) = region.devices()
    for series in (seen_used, seen_peak, seen_proc):
        assert all(v >> 32 == v & 0xFFFF_FFFF for v in series), "torn 64-bit read"
        assert series == sorted(series), "values went backwards"
    assert len(set(seen_used)) > 1, "the reader never overlapped the writer"
    assert final.used_bytes == final.peak_bytes == count * 0x1_0000_0001
