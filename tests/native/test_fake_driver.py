"""The fake driver and NVML (native/tests/fake) on their own, driven by the probe with no
interposer: what the interposer's tests take for granted about them. These tests also
check the probe and the harness (tests/native/probe.py) themselves. One test runs the
interposer too: that it finds devices by the UUIDs FAKECUDA_UUIDS / FAKENVML_UUIDS give."""

from __future__ import annotations

import fcntl
import functools
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from gpuslice_common.region import Region
from tests.native.probe import (
    Native,
    ProbeResult,
    ProbeRunner,
    ProbeSpawner,
    check_sanitizers,
    probe_env,
    race_start,
)

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

# CUresult / nvmlReturn_t values the tests read
CUDA_SUCCESS = 0
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_OUT_OF_MEMORY = 2
CUDA_ERROR_NOT_INITIALIZED = 3
CUDA_ERROR_NO_DEVICE = 100
CUDA_ERROR_INVALID_DEVICE = 101
CUDA_ERROR_INVALID_CONTEXT = 201
CUDA_ERROR_INVALID_HANDLE = 400
CUDA_ERROR_NOT_FOUND = 500
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_INSUFFICIENT_SIZE = 7
PROC_SUCCESS = 0
PROC_SYMBOL_NOT_FOUND = 1
PROC_VERSION_NOT_SUFFICIENT = 2
PTDS = 2  # CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM

FakeProbe = Callable[..., ProbeResult]


@pytest.fixture
def fake(run_probe: ProbeRunner) -> FakeProbe:
    """The probe with no interposer."""
    return functools.partial(run_probe, build="none")


def used(result: ProbeResult) -> list[int]:
    """Every `fakeused` reading, in order."""
    return [int(line["bytes"]) for line in result.by_cmd("fakeused")]


# ----------------------------------------------------------------------------- memory


def test_memory_info_follows_allocations(fake: FakeProbe) -> None:
    res = fake(
        "init ctx info totalmem fakeused alloc 1g info fakeused free 0 info fakeused",
        env={"FAKECUDA_MEMORY": "4g"},
    )
    assert res.rcs() == [0] * len(res), res.describe()
    infos = res.by_cmd("info")
    assert [i["total"] for i in infos] == [4 * GiB] * 3
    assert [i["free"] for i in infos] == [4 * GiB, 3 * GiB, 4 * GiB]
    assert res.one("totalmem")["bytes"] == 4 * GiB
    assert used(res) == [0, GiB, 0]
    alloc = res.one("alloc")
    assert alloc["id"] == 0
    assert alloc["bytes"] == GiB
    assert alloc["ptr"] != 0


def test_default_capacity_is_80_gib(fake: FakeProbe) -> None:
    res = fake("init ctx info totalmem")
    assert res.one("info")["total"] == 80 * GiB
    assert res.one("totalmem")["bytes"] == 80 * GiB


def test_out_of_memory_at_capacity(fake: FakeProbe) -> None:
    res = fake(
        "init ctx alloc 512m alloc 512m alloc 1 info free 0 alloc 1 fakeused",
        env={"FAKECUDA_MEMORY": "1g"},
    )
    allocs = res.by_cmd("alloc")
    assert [a["rc"] for a in allocs] == [0, 0, CUDA_ERROR_OUT_OF_MEMORY, 0], res.describe()
    assert allocs[2]["id"] is None
    assert res.one("info")["free"] == 0
    assert used(res) == [512 * MiB + 1]


def test_fill_allocates_until_capacity(fake: FakeProbe) -> None:
    res = fake("init ctx fill 100m fakeused", env={"FAKECUDA_MEMORY": "1g"})
    fill = res.one("fill")
    assert fill["count"] == 10
    assert fill["rc"] == CUDA_ERROR_OUT_OF_MEMORY
    assert fill["bytes"] == 1000 * MiB
    assert fill["first"] == 0
    assert not fill["capped"]
    assert used(res) == [1000 * MiB]


def test_allocations_that_fit_exactly(fake: FakeProbe) -> None:
    res = fake("init ctx fill 256m", env={"FAKECUDA_MEMORY": "1g"})
    assert res.one("fill")["count"] == 4


def test_device_memory_is_real_host_memory(fake: FakeProbe) -> None:
    # 64 GiB of NORESERVE mappings: nothing is touched, so nothing is spent.
    res = fake("init ctx alloc 32g alloc 32g fakeused")
    assert [a["rc"] for a in res.by_cmd("alloc")] == [0, 0]
    assert used(res) == [64 * GiB]


def test_memory_is_per_device(fake: FakeProbe) -> None:
    res = fake(
        "init ctx 1 alloc 1g fakeused 0 fakeused 1 alloc 1 ctx 0 alloc 1g fakeused 0",
        env={"FAKECUDA_DEVICES": "2", "FAKECUDA_MEMORY": "1g"},
    )
    assert [a["rc"] for a in res.by_cmd("alloc")] == [0, CUDA_ERROR_OUT_OF_MEMORY, 0]
    assert used(res) == [0, GiB, GiB]


def test_errors_before_init_and_without_a_context(fake: FakeProbe) -> None:
    res = fake("alloc 1m info init alloc 1m info ctx 1 totalmem 1")
    assert res.rcs() == [
        CUDA_ERROR_NOT_INITIALIZED,
        CUDA_ERROR_NOT_INITIALIZED,
        0,
        CUDA_ERROR_INVALID_CONTEXT,
        CUDA_ERROR_INVALID_CONTEXT,
        CUDA_ERROR_INVALID_DEVICE,
        CUDA_ERROR_INVALID_DEVICE,
    ], res.describe()


def test_no_devices(fake: FakeProbe) -> None:
    res = fake("init", env={"FAKECUDA_DEVICES": "0"})
    assert res.one("init")["rc"] == CUDA_ERROR_NO_DEVICE


def test_pitch_rounds_rows_to_512_bytes(fake: FakeProbe) -> None:
    res = fake("init ctx pitch 1000 10 4 fakeused pitch 512 3 4 fakeused free 0 fakeused")
    first, second = res.by_cmd("pitch")
    assert (first["rc"], first["pitch"], first["bytes"]) == (0, 1024, 10240)
    assert (second["rc"], second["pitch"], second["bytes"]) == (0, 512, 1536)
    assert used(res) == [10240, 10240 + 1536, 1536]


def test_managed_memory_counts(fake: FakeProbe) -> None:
    res = fake("init ctx managed 3m fakeused free 0 fakeused")
    assert res.rcs() == [0] * len(res)
    assert res.one("free")["kind"] == "mem"
    assert used(res) == [3 * MiB, 0]


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        ("array 1024 1024 0x20 4", 1024 * 1024 * 4 * 4),  # float4
        ("array 1000 0 0x01 1", 1000),  # 1-D: height 0 counts as 1
        ("array 300 7 0x10 2", 300 * 7 * 2 * 2),  # half2
        ("array3d 16 16 16 0x10 2", 16 * 16 * 16 * 2 * 2),
        ("array3d 64 0 0 0x03 1", 64 * 4),
        # levels halve every non-zero dimension
        ("mipmap 64 64 0 0x20 1 3", (64 * 64 + 32 * 32 + 16 * 16) * 4),
        ("mipmap 8 0 0 0x03 4 5", (8 + 4 + 2 + 1 + 1) * 16),
        ("mipmap 4 4 4 0x01 1 3", 64 + 8 + 1),
    ],
)
def test_array_sizes(fake: FakeProbe, command: str, expected: int) -> None:
    res = fake("init ctx", command, "fakeused free 0 fakeused")
    created = res.lines[2]
    assert created["rc"] == 0, res.describe()
    assert "bytes" not in created  # the probe leaves array sizes to the driver
    assert used(res) == [expected, 0]
    assert res.one("free")["rc"] == 0


@pytest.mark.parametrize(
    "command",
    [
        "array 0 16 0x20 1",  # no width
        "array 16 16 0x20 3",  # 3 channels
        "array 16 16 0x07 1",  # no such format
        "mipmap 16 16 0 0x20 1 0",  # no levels
    ],
)
def test_malformed_arrays_are_refused(fake: FakeProbe, command: str) -> None:
    res = fake("init ctx", command, "fakeused")
    assert res.lines[2]["rc"] == CUDA_ERROR_INVALID_VALUE
    assert used(res) == [0]


def test_arrays_out_of_memory(fake: FakeProbe) -> None:
    res = fake(
        "init ctx array 1024 1024 0x20 4 array 1024 1024 0x20 4", env={"FAKECUDA_MEMORY": "20m"}
    )
    assert [a["rc"] for a in res.by_cmd("array")] == [0, CUDA_ERROR_OUT_OF_MEMORY]


def test_vmm_counts_on_its_device(fake: FakeProbe) -> None:
    res = fake(
        "init ctx 0 vmm 2m 1 fakeused 0 fakeused 1 free 0 fakeused 1 vmm 1m 5",
        env={"FAKECUDA_DEVICES": "2"},
    )
    vmm = res.by_cmd("vmm")
    assert (vmm[0]["rc"], vmm[0]["dev"]) == (0, 1)
    assert vmm[1]["rc"] == CUDA_ERROR_INVALID_VALUE  # no device 5
    assert res.one("free")["kind"] == "vmm"
    assert used(res) == [0, 2 * MiB, 0]


def test_vmm_out_of_memory(fake: FakeProbe) -> None:
    res = fake("init ctx vmm 4m vmm 2m", env={"FAKECUDA_MEMORY": "4m"})
    assert [v["rc"] for v in res.by_cmd("vmm")] == [0, CUDA_ERROR_OUT_OF_MEMORY]


def test_frees_of_unknown_handles_fail(fake: FakeProbe) -> None:
    res = fake("init ctx alloc 1m free 0 free 0 array 16 16 0x20 1 free 1 free 1 free 7")
    frees = res.by_cmd("free")
    assert [(f["rc"], f["again"]) for f in frees[:4]] == [
        (0, False),
        (CUDA_ERROR_INVALID_VALUE, True),
        (0, False),
        (CUDA_ERROR_INVALID_HANDLE, True),
    ]
    assert frees[4] == {"cmd": "free", "rc": -1, "id": 7, "error": "no such id"}
    raw = fake("init ctx freeraw 12345").one("freeraw")
    assert raw["rc"] == CUDA_ERROR_INVALID_VALUE


# ----------------------------------------------------------------------------- pools


def test_pool_reserve_outlives_frees_until_trimmed(fake: FakeProbe) -> None:
    res = fake(
        "init ctx",
        "async 10m poolattr fakeused",  # reserve grows with the allocation
        "free 0 poolattr fakeused",  # a free keeps the reserve
        "async 4m poolattr fakeused",  # reused: no growth
        "trim 0 poolattr fakeused",  # down to what is used
        "free 1 trim 2m poolattr fakeused",  # down to the floor asked for
        "trim 0 poolattr fakeused",
    )
    assert res.rcs() == [0] * len(res), res.describe()
    pools = [(p["reserved"], p["used"]) for p in res.by_cmd("poolattr")]
    assert pools == [
        (10 * MiB, 10 * MiB),
        (10 * MiB, 0),
        (10 * MiB, 4 * MiB),
        (4 * MiB, 4 * MiB),
        (2 * MiB, 0),
        (0, 0),
    ]
    assert used(res) == [10 * MiB, 10 * MiB, 10 * MiB, 4 * MiB, 2 * MiB, 0]
    assert res.by_cmd("free")[0]["kind"] == "async"


def test_pool_allocations_share_the_default_pool(fake: FakeProbe) -> None:
    res = fake("init ctx poolalloc 3m async 5m poolattr free 0 poolattr fakeused")
    assert res.rcs() == [0] * len(res), res.describe()
    pools = [(p["reserved"], p["used"]) for p in res.by_cmd("poolattr")]
    assert pools == [(8 * MiB, 8 * MiB), (8 * MiB, 5 * MiB)]
    assert used(res) == [8 * MiB]


def test_pool_growth_is_bounded_by_capacity_but_reuse_is_not(fake: FakeProbe) -> None:
    res = fake(
        "init ctx alloc 8m async 8m async 1 free 1 async 8m fakeused",
        env={"FAKECUDA_MEMORY": "16m"},
    )
    assert [a["rc"] for a in res.by_cmd("async")] == [0, CUDA_ERROR_OUT_OF_MEMORY, 0]
    assert used(res) == [16 * MiB]


def test_pool_attributes_without_allocations(fake: FakeProbe) -> None:
    res = fake("init ctx poolattr trim 0")
    assert res.one("poolattr") == {"cmd": "poolattr", "rc": 0, "reserved": 0, "used": 0}
    assert res.one("trim")["rc"] == 0


# ----------------------------------------------------------------------------- contexts


def test_contexts_consume_context_bytes(fake: FakeProbe) -> None:
    res = fake(
        "init fakeused ctx fakeused",
        "newctx fakeused newctx3 newctx4 fakeused",
        "destroyctx 2 destroyctx 1 destroyctx 0 fakeused",
        "release fakeused",
        env={"FAKECUDA_CONTEXT_BYTES": "64m", "FAKECUDA_MEMORY": "1g"},
    )
    assert res.rcs() == [0] * len(res), res.describe()
    assert [res.one(c)["id"] for c in ("newctx", "newctx3", "newctx4")] == [0, 1, 2]
    assert used(res) == [0, 64 * MiB, 128 * MiB, 256 * MiB, 64 * MiB, 0]


def test_a_context_that_does_not_fit_is_refused(fake: FakeProbe) -> None:
    res = fake(
        "init ctx newctx fakeused",
        env={"FAKECUDA_CONTEXT_BYTES": "64m", "FAKECUDA_MEMORY": "100m"},
    )
    assert res.one("ctx")["rc"] == 0
    assert res.one("newctx")["rc"] == CUDA_ERROR_OUT_OF_MEMORY
    assert used(res) == [64 * MiB]


def test_destroying_a_context_frees_what_was_made_in_it(fake: FakeProbe) -> None:
    res = fake(
        "init ctx alloc 1g",
        "newctx alloc 2g async 1g vmm 2m array 16 16 0x20 1 fakeused",
        "destroyctx 1 fakeused",
        "destroyctx 1",
    )
    assert used(res) == [4 * GiB + 2 * MiB + 1024, GiB]
    destroys = res.by_cmd("destroyctx")
    assert [d["rc"] for d in destroys] == [0, CUDA_ERROR_INVALID_CONTEXT]


def test_last_primary_release_destroys_the_context(fake: FakeProbe) -> None:
    res = fake(
        "init ctx ctx alloc 1g release fakeused release fakeused alloc 1m release",
        "ctx alloc 1m fakeused",
        env={"FAKECUDA_CONTEXT_BYTES": "1m"},
    )
    releases = res.by_cmd("release")
    assert [r["rc"] for r in releases] == [0, 0, CUDA_ERROR_INVALID_CONTEXT]
    allocs = res.by_cmd("alloc")
    # two retains: the first release keeps it; the second frees it and what it held
    assert used(res) == [GiB + MiB, 0, 2 * MiB]
    assert [a["rc"] for a in allocs] == [0, CUDA_ERROR_INVALID_CONTEXT, 0]


def test_primary_reset_destroys_the_context(fake: FakeProbe) -> None:
    res = fake("init ctx alloc 1g reset fakeused alloc 1m", env={"FAKECUDA_CONTEXT_BYTES": "1m"})
    assert res.one("reset")["rc"] == 0
    assert used(res) == [0]
    assert res.by_cmd("alloc")[1]["rc"] == CUDA_ERROR_INVALID_CONTEXT


def test_alloc_delay(fake: FakeProbe) -> None:
    res = fake(
        "init ctx alloc 1m alloc 3m vmm 2m",
        env={"FAKECUDA_ALLOC_DELAY_MS": "60", "FAKECUDA_MEMORY": "3m"},
    )
    ok, refused = res.by_cmd("alloc")
    assert ok["rc"] == 0
    assert ok["ns"] >= 60_000_000
    assert refused["rc"] == CUDA_ERROR_OUT_OF_MEMORY
    assert refused["ns"] < 60_000_000  # a refused allocation does not wait
    assert res.one("vmm")["ns"] >= 60_000_000


# ----------------------------------------------------------------------------- kernels


@pytest.mark.parametrize("via", ["kernel", "ex", "coop", "graph"])
def test_kernels_run_for_their_handle_in_microseconds(fake: FakeProbe, via: str) -> None:
    res = fake(f"init ctx launch 20 1000 {via} sync")
    launch = res.one("launch")
    assert (launch["rc"], launch["launched"], launch["fake_launches"]) == (0, 20, 20)
    assert launch["ns"] < 10_000_000, "launches are asynchronous"
    sync = res.one("sync")
    assert sync["rc"] == 0
    # 20 ms of work, minus what ran while launching
    assert 20_000_000 - launch["ns"] - 1_000_000 <= sync["ns"] < 20_000_000 + 50_000_000


@pytest.mark.parametrize("options", [(), ("--proc",), ("--ptds",)])
def test_back_to_back_kernels_keep_the_engine_busy(fake: FakeProbe, options: tuple[str]) -> None:
    res = fake("init ctx run 0.5 1000", options=options)
    run = res.one("run")
    assert run["rc"] == 0
    assert 0.5e9 <= run["wall_ns"] < 0.7e9
    assert 400 <= run["launches"] <= 520
    assert run["fake_launches"] == run["launches"]
    # busy time is nominal: every kernel finished by the sync
    assert run["busy_ns"] == run["launches"] * 1_000_000
    assert 0.9 <= run["share"] <= 1.01


def test_engines_are_per_device(fake: FakeProbe) -> None:
    res = fake(
        "init ctx 1 launch 5 100 sync ctx 0 launch 2 100 sync", env={"FAKECUDA_DEVICES": "2"}
    )
    assert [line["fake_launches"] for line in res.by_cmd("launch")] == [5, 2]


def test_launches_need_a_context(fake: FakeProbe) -> None:
    res = fake("init launch 1 10 sync")
    assert res.one("launch")["rc"] == CUDA_ERROR_INVALID_CONTEXT
    assert res.one("sync")["rc"] == CUDA_ERROR_INVALID_CONTEXT


# ----------------------------------------------------------------------------- cuGetProcAddress


@pytest.mark.parametrize(
    ("name", "version", "flags", "sym"),
    [
        ("cuMemAlloc", 13000, 0, "cuMemAlloc_v2"),
        ("cuMemAlloc", 3020, 0, "cuMemAlloc_v2"),
        ("cuMemAlloc", 13000, PTDS, "cuMemAlloc_v2"),  # no per-thread twin
        ("cuMemFree", 13000, 0, "cuMemFree_v2"),
        ("cuMemGetInfo", 13000, 0, "cuMemGetInfo_v2"),
        ("cuDeviceTotalMem", 13000, 0, "cuDeviceTotalMem_v2"),
        ("cuArrayCreate", 13000, 0, "cuArrayCreate_v2"),
        ("cuArray3DCreate", 13000, 0, "cuArray3DCreate_v2"),
        ("cuMemAllocPitch", 13000, 0, "cuMemAllocPitch_v2"),
        ("cuCtxDestroy", 13000, 0, "cuCtxDestroy_v2"),
        ("cuCtxCreate", 13000, 0, "cuCtxCreate_v4"),
        ("cuCtxCreate", 12050, 0, "cuCtxCreate_v4"),
        ("cuCtxCreate", 12040, 0, "cuCtxCreate_v3"),
        ("cuCtxCreate", 11040, 0, "cuCtxCreate_v3"),
        ("cuCtxCreate", 11030, 0, "cuCtxCreate_v2"),
        ("cuDevicePrimaryCtxRelease", 11000, 0, "cuDevicePrimaryCtxRelease_v2"),
        ("cuDevicePrimaryCtxReset", 13000, 0, "cuDevicePrimaryCtxReset_v2"),
        ("cuGetProcAddress", 13000, 0, "cuGetProcAddress_v2"),
        ("cuGetProcAddress", 11030, 0, "cuGetProcAddress"),
        ("cuDeviceGetUuid", 13000, 0, "cuDeviceGetUuid_v2"),
        ("cuInit", 13000, 0, "cuInit"),
        ("cuMemCreate", 13000, PTDS, "cuMemCreate"),
        ("cuLaunchKernel", 13000, 0, "cuLaunchKernel"),
        ("cuLaunchKernel", 13000, 1, "cuLaunchKernel"),  # legacy stream
        ("cuLaunchKernel", 13000, PTDS, "cuLaunchKernel_ptsz"),
        ("cuLaunchKernelEx", 13000, PTDS, "cuLaunchKernelEx_ptsz"),
        ("cuLaunchCooperativeKernel", 13000, PTDS, "cuLaunchCooperativeKernel_ptsz"),
        ("cuGraphLaunch", 13000, PTDS, "cuGraphLaunch_ptsz"),
        ("cuMemAllocAsync", 13000, PTDS, "cuMemAllocAsync_ptsz"),
        ("cuMemAllocFromPoolAsync", 13000, PTDS, "cuMemAllocFromPoolAsync_ptsz"),
        ("cuMemFreeAsync", 13000, PTDS, "cuMemFreeAsync_ptsz"),
        ("cuMemFreeAsync", 13000, 0, "cuMemFreeAsync"),
        ("cuStreamSynchronize", 13000, PTDS, "cuStreamSynchronize_ptsz"),
        ("cuEventRecord", 13000, PTDS, "cuEventRecord_ptsz"),
        # the pre-3.2 ABI for callers older than 3020
        ("cuMemAlloc", 3010, 0, "cuMemAlloc"),
        ("cuCtxCreate", 3010, 0, "cuCtxCreate"),
        # names with no version rows resolve to themselves
        ("cuMemAlloc_v2", 13000, 0, "cuMemAlloc_v2"),
    ],
)
def test_proc_address_picks_the_version(
    fake: FakeProbe, name: str, version: int, flags: int, sym: str
) -> None:
    res = fake(f"proc {name} {version} {flags} proc {name} {version} {flags} v1")
    v2, v1 = res.lines
    assert (v2["rc"], v2["status"], v2["lib"], v2["sym"]) == (0, 0, "libcuda.so.1", sym)
    assert (v1["rc"], v1["status"], v1["lib"], v1["sym"]) == (0, None, "libcuda.so.1", sym)


@pytest.mark.parametrize(
    ("name", "version", "status"),
    [
        ("cuDevicePrimaryCtxRelease", 10020, PROC_VERSION_NOT_SUFFICIENT),
        ("cuNoSuchFunction", 13000, PROC_SYMBOL_NOT_FOUND),
    ],
)
def test_proc_address_misses(fake: FakeProbe, name: str, version: int, status: int) -> None:
    res = fake(f"proc {name} {version} 0")
    line = res.one("proc")
    assert (line["rc"], line["status"], line["found"]) == (CUDA_ERROR_NOT_FOUND, status, False)
    assert line["sym"] is None


def test_proc_address_rejects_unknown_flags(fake: FakeProbe) -> None:
    assert fake("proc cuMemAlloc 13000 4").one("proc")["rc"] == CUDA_ERROR_INVALID_VALUE


@pytest.mark.parametrize("options", [("--proc",), ("--ptds",)])
def test_probe_through_proc_address(fake: FakeProbe, options: tuple[str]) -> None:
    """Every driver function the probe uses resolves through cuGetProcAddress_v2."""
    res = fake(
        "init ctx alloc 1m pitch 100 2 4 managed 1m array 16 16 0x20 1 array3d 4 4 4 0x20 1",
        "mipmap 8 8 0 0x20 1 2 vmm 2m async 1m poolalloc 1m poolattr trim 0 info totalmem",
        "uuid newctx newctx3 newctx4 destroyctx 11 destroyctx 10 destroyctx 9",
        "launch 2 10 launch 2 10 ex launch 2 10 coop launch 2 10 graph sync",
        "free 0 free 1 free 2 free 3 free 4 free 5 free 6 free 7 free 8 release reset",
        options=options,
    )
    assert res.stderr == "", res.describe()  # the probe names anything unresolved
    assert res.rcs() == [0] * len(res), res.describe()
    assert [line["id"] for line in res.by_cmd("newctx") + res.by_cmd("newctx4")] == [9, 11]


def test_dlsym_through_the_libraries(fake: FakeProbe) -> None:
    res = fake(
        "dlsym cuMemAlloc_v2 cuda dlsym cuGetProcAddress_v2 dlsym nvmlDeviceGetMemoryInfo_v2 nvml",
        "dlsym fakecuda_used_bytes dlsym cuNoSuchFunction",
    )
    found = [(d["found"], d["lib"], d["sym"]) for d in res.by_cmd("dlsym")]
    assert found == [
        (True, "libcuda.so.1", "cuMemAlloc_v2"),
        (True, "libcuda.so.1", "cuGetProcAddress_v2"),
        (True, "libnvidia-ml.so.1", "nvmlDeviceGetMemoryInfo_v2"),
        (True, "libcuda.so.1", "fakecuda_used_bytes"),
        (False, None, None),
    ]


# ----------------------------------------------------------------------------- NVML


def test_uuids_agree_between_driver_and_nvml(fake: FakeProbe) -> None:
    res = fake("init nvml uuid 0 uuid 1", env={"FAKECUDA_DEVICES": "2"})
    for dev, line in enumerate(res.by_cmd("uuid")):
        expected = f"GPU-facefeed-0000-4000-8000-0000000000{dev:02x}"
        assert (line["rc"], line["nvml_rc"]) == (0, 0)
        assert line["uuid"] == line["nvml_uuid"] == expected


def test_nvml_memory(fake: FakeProbe) -> None:
    res = fake(
        "nvmlmem 0 nvml nvmlmem 0 nvmlmem 1 init ctx alloc 1g nvmlmem 0",
        env={"FAKECUDA_MEMORY": "16g", "FAKENVML_USED": "1g"},
    )
    before, mem, missing, after = res.by_cmd("nvmlmem")
    assert before["rc"] == NVML_ERROR_UNINITIALIZED
    assert missing["rc"] == NVML_ERROR_INVALID_ARGUMENT  # one device only
    expected = {
        "rc": 0,
        "v1_rc": 0,
        "v2_rc": 0,
        "total": 16 * GiB,
        "used": GiB,
        "free": 15 * GiB,
        "v2_total": 16 * GiB,
        "v2_used": GiB,
        "v2_free": 15 * GiB,
        "v2_reserved": 0,
    }
    assert {k: mem[k] for k in expected} == expected
    # NVML shows FAKENVML_USED, not what the process allocated
    assert {k: after[k] for k in expected} == expected


def test_nvml_used_is_capped_at_the_total(fake: FakeProbe) -> None:
    res = fake("nvml nvmlmem 0", env={"FAKECUDA_MEMORY": "1g", "FAKENVML_USED": "2g"})
    mem = res.one("nvmlmem")
    assert (mem["used"], mem["free"]) == (GiB, 0)


def test_nvml_processes(fake: FakeProbe) -> None:
    res = fake(
        "nvml nvmlprocs 0",
        env={"FAKENVML_PROCS": "123:1g,456:512m,bad,789:4096"},
    )
    line = res.one("nvmlprocs")
    assert line["rc"] == 0
    assert line["size_rc"] == NVML_ERROR_INSUFFICIENT_SIZE
    assert line["procs"] == [
        {"pid": 123, "used": GiB},
        {"pid": 456, "used": 512 * MiB},
        {"pid": 789, "used": 4096},
    ]


def test_nvml_without_processes(fake: FakeProbe) -> None:
    line = fake("nvml nvmlprocs 0").one("nvmlprocs")
    assert (line["rc"], line["size_rc"], line["procs"]) == (0, 0, [])


# ----------------------------------------------------------------------------- chosen UUIDs

# UUIDs of a simulated node's GPUs; the second is given in upper case.
NODE_UUIDS = (
    "GPU-3f0c2a9e-5b7d-5e1f-9a2b-1c2d3e4f5a6b",
    "GPU-7A1E4C2B-9D3F-4E8A-B5C6-0F1E2D3C4B5A",
)


def default_uuid(dev: int) -> str:
    return f"GPU-facefeed-0000-4000-8000-0000000000{dev:02x}"


def lower_hex(uuid: str) -> str:
    """A UUID as the fakes print it: "GPU-" and lower-case hex."""
    return "GPU-" + uuid.removeprefix("GPU-").lower()


def test_fakecuda_uuids_name_the_devices(fake: FakeProbe) -> None:
    # Device i takes entry i (printed in lower case); a device past the list keeps the
    # default. NVML does not read FAKECUDA_UUIDS: it keeps its defaults.
    res = fake(
        "init nvml uuid 0 uuid 1 uuid 2",
        env={"FAKECUDA_DEVICES": "3", "FAKECUDA_UUIDS": ",".join(NODE_UUIDS)},
    )
    lines = res.by_cmd("uuid")
    assert [(line["rc"], line["nvml_rc"]) for line in lines] == [(0, 0)] * 3, res.describe()
    assert [line["uuid"] for line in lines] == [
        NODE_UUIDS[0],
        lower_hex(NODE_UUIDS[1]),
        default_uuid(2),
    ]
    assert [line["nvml_uuid"] for line in lines] == [default_uuid(d) for d in range(3)]


def test_fakenvml_uuids_name_the_devices(fake: FakeProbe) -> None:
    env = {"FAKECUDA_DEVICES": "3", "FAKENVML_UUIDS": ",".join(NODE_UUIDS)}
    res = fake(
        "nvml uuid 0 uuid 1 uuid 2",
        f"nvmlbyuuid {NODE_UUIDS[0]} nvmlbyuuid {NODE_UUIDS[1]}",
        f"nvmlbyuuid {lower_hex(NODE_UUIDS[1])} nvmlbyuuid {default_uuid(2)}",
        f"nvmlbyuuid {default_uuid(0)}",  # replaced: no device has it any more
        env=env,
    )
    lines = res.by_cmd("uuid")
    assert [line["nvml_rc"] for line in lines] == [0] * 3, res.describe()
    assert [line["nvml_uuid"] for line in lines] == [
        NODE_UUIDS[0],
        lower_hex(NODE_UUIDS[1]),  # NVML prints lower-case hex
        default_uuid(2),
    ]
    # the driver does not read FAKENVML_UUIDS (and is not initialised here)
    assert [line["rc"] for line in lines] == [CUDA_ERROR_NOT_INITIALIZED] * 3
    found = [(line["rc"], line["index"], line["nvml_uuid"]) for line in res.by_cmd("nvmlbyuuid")]
    assert found == [
        (0, 0, NODE_UUIDS[0]),
        (0, 1, lower_hex(NODE_UUIDS[1])),  # either case finds the device
        (0, 1, lower_hex(NODE_UUIDS[1])),
        (0, 2, default_uuid(2)),
        (NVML_ERROR_NOT_FOUND, None, None),
    ]


# (entry, whether it names its device); a device whose entry is malformed keeps the
# default UUID and the entries after it still apply, each to its own device.
UUID_ENTRIES = [
    ("GPU-3f0c2a9e-5b7d-5e1f-9a2b-1c2d3e4f5a6b", True),
    ("3f0c2a9e-5b7d-5e1f-9a2b-1c2d3e4f5a6b", False),  # no "GPU-" prefix
    ("gpu-3f0c2a9e-5b7d-5e1f-9a2b-1c2d3e4f5a6b", False),  # prefix in lower case
    ("GPU-3f0c2a9e-5b7d-5e1f-9a2b-1c2d3e4f5a6", False),  # one digit short
    ("GPU-3f0c2a9e-5b7d-5e1f-9a2b-1c2d3e4f5a6bc", False),  # one digit long
    ("GPU-3f0c2a9e-5b7d-5e1f-9a2b-1c2d3e4f5g6b", False),  # not hex
    ("GPU-3f0c2a9e5-b7d-5e1f-9a2b-1c2d3e4f5a6b", False),  # a '-' out of place
    ("", False),  # empty
    ("GPU-" + "f" * 5000, False),  # very long
    ("  GPU-00000000-1111-2222-3333-444444444444 ", True),  # blanks around it
]


@pytest.mark.parametrize("variable", ["FAKECUDA_UUIDS", "FAKENVML_UUIDS"])
def test_malformed_uuid_entries_keep_the_default(fake: FakeProbe, variable: str) -> None:
    n = len(UUID_ENTRIES) + 1  # the last device has no entry at all
    words = " ".join(f"uuid {dev}" for dev in range(n))
    env = {"FAKECUDA_DEVICES": str(n), variable: ",".join(entry for entry, _ in UUID_ENTRIES)}
    res = fake(f"init nvml {words}", env=env)
    assert res.returncode == 0
    assert res.stderr == "", res.describe()  # nothing is printed
    assert res.rcs() == [0] * len(res), res.describe()
    expected = [
        entry.strip() if ok else default_uuid(dev) for dev, (entry, ok) in enumerate(UUID_ENTRIES)
    ]
    expected.append(default_uuid(n - 1))
    key = "uuid" if variable == "FAKECUDA_UUIDS" else "nvml_uuid"
    assert [line[key] for line in res.by_cmd("uuid")] == expected


@pytest.mark.parametrize("variable", ["FAKECUDA_UUIDS", "FAKENVML_UUIDS"])
def test_uuid_entries_past_the_last_device_are_ignored(fake: FakeProbe, variable: str) -> None:
    uuids = [f"GPU-00000000-0000-4000-8000-{n:012x}" for n in range(20)]
    env = {"FAKECUDA_DEVICES": "16", variable: ",".join(uuids)}
    res = fake("init nvml uuid 0 uuid 15 uuid 16", env=env)
    key = "uuid" if variable == "FAKECUDA_UUIDS" else "nvml_uuid"
    first, last, beyond = res.by_cmd("uuid")
    assert (first[key], last[key]) == (uuids[0], uuids[15]), res.describe()
    invalid = (CUDA_ERROR_INVALID_DEVICE, NVML_ERROR_INVALID_ARGUMENT)
    assert (beyond["rc"], beyond["nvml_rc"]) == invalid  # 16 devices at most


def test_interposer_limits_the_device_named_by_a_custom_uuid(
    spawn_probe: ProbeSpawner, region_path: Path
) -> None:
    # A node whose GPUs have their own UUIDs: the container gets device 1 alone
    # (NVIDIA_VISIBLE_DEVICES), so container device 0's limit applies to CUDA ordinal 1,
    # found by its UUID in the driver and in NVML.
    node = [NODE_UUIDS[0], lower_hex(NODE_UUIDS[1])]
    env: dict[str, str | int] = {
        "FAKECUDA_DEVICES": 2,
        "FAKECUDA_UUIDS": ",".join(node),
        "FAKENVML_UUIDS": ",".join(node),
        "NVIDIA_VISIBLE_DEVICES": node[1],
        "CUDA_DEVICE_MEMORY_LIMIT_0": "256m",
        "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(region_path),
    }
    commands = ("init", "nvml", "ctx", 1, "alloc", "200m", "alloc", "100m", "info", "nvmlmem", 1)
    proc = spawn_probe(*commands, "hold", env=env)
    proc.wait_for("hold")
    allocs = [line["rc"] for line in proc.lines if line.get("cmd") == "alloc"]
    assert allocs == [CUDA_SUCCESS, CUDA_ERROR_OUT_OF_MEMORY], proc.describe()
    info = next(line for line in proc.lines if line.get("cmd") == "info")
    assert (info["total"], info["free"]) == (256 * MiB, 56 * MiB)
    nvml = next(line for line in proc.lines if line.get("cmd") == "nvmlmem")
    assert (nvml["rc"], nvml["total"], nvml["used"]) == (0, 256 * MiB, 200 * MiB)
    with Region.open(region_path) as region:
        named = [d for d in region.devices() if d.uuid == node[1]]
        assert [(d.limit_bytes, d.used_bytes) for d in named] == [(256 * MiB, 200 * MiB)]
    proc.stop()

    # Without the custom UUIDs no device is the one named: the container was
    # granted none of them, so none gives it a context or a byte.
    env.pop("FAKECUDA_UUIDS")
    env.pop("FAKENVML_UUIDS")
    env["CUDA_DEVICE_MEMORY_SHARED_CACHE"] = str(region_path.with_name("control.cache"))
    control = spawn_probe(*commands, env=env).result()
    assert control.one("ctx")["rc"] == CUDA_ERROR_OUT_OF_MEMORY, control.describe()
    assert all(line["rc"] != CUDA_SUCCESS for line in control.by_cmd("alloc"))
    assert (control.one("nvmlmem")["total"], control.one("nvmlmem")["free"]) == (0, 0)


# ----------------------------------------------------------------------------- the probe itself


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ("init alloc", "alloc: missing argument 1"),
        ("init alloc 1q", "alloc: bad argument 1: '1q'"),
        ("init nonsense", "unknown command 'nonsense'"),
        ("--nope init", "unknown option '--nope'"),
        ("init launch 1 10 sideways", "unknown command 'sideways'"),
        ("run x 10", "run: bad argument 1: 'x'"),
    ],
)
def test_malformed_command_lines_run_nothing(fake: FakeProbe, argv: str, message: str) -> None:
    res = fake(argv, check=False)
    assert res.returncode == 2
    assert len(res.lines) == 1, res.describe()
    assert res.lines[0]["error"].startswith(message)


def test_sizes_and_numbers(fake: FakeProbe) -> None:
    res = fake("init ctx alloc 4096 alloc 4k alloc 0x1000 alloc 2M alloc 1G alloc 0")
    assert [a["bytes"] for a in res.by_cmd("alloc")] == [4096, 4096, 4096, 2 * MiB, GiB, 0]
    assert res.by_cmd("alloc")[-1]["rc"] == CUDA_ERROR_INVALID_VALUE


def test_optional_device_arguments(fake: FakeProbe) -> None:
    res = fake("init ctx 1 totalmem fakeused 1 release 1", env={"FAKECUDA_DEVICES": "2"})
    assert [line.get("dev") for line in res.lines] == [None, 1, 0, 1, 1]


def test_other_interposer_finds_the_real_getppid(fake: FakeProbe, native_tools: Native) -> None:
    alone = fake("getppid").one("getppid")
    assert alone == {"cmd": "getppid", "rc": 0, "value": os.getpid(), "calls": None}
    wrapped = fake("getppid getppid", preload_after=[native_tools.other_interposer])
    assert [(g["value"], g["calls"]) for g in wrapped.by_cmd("getppid")] == [
        (os.getpid(), 1),
        (os.getpid(), 2),
    ]


def test_environment_of_a_probe(native_tools: Native, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKECUDA_MEMORY", "1g")
    monkeypatch.setenv("GPUSLICE_NODE_NAME", "leaked")
    monkeypatch.setenv("LD_PRELOAD", "/nonexistent.so")
    env = probe_env(native_tools, "none", {"FAKECUDA_DEVICES": 2, "PATH": None})
    assert "FAKECUDA_MEMORY" not in env
    assert "GPUSLICE_NODE_NAME" not in env
    assert "LD_PRELOAD" not in env
    assert "PATH" not in env
    assert env["FAKECUDA_DEVICES"] == "2"
    assert env["LD_LIBRARY_PATH"] == str(native_tools.fake_dir)
    assert env["GPUSLICE_CONTEXT_OVERHEAD"] == "0"
    release = probe_env(native_tools, "release", preload_after=["/x.so"])
    assert release["LD_PRELOAD"] == f"{native_tools.lib} /x.so"
    assert "GPUSLICE_CONTEXT_OVERHEAD" not in probe_env(
        native_tools, "release", {"GPUSLICE_CONTEXT_OVERHEAD": None}
    )


@pytest.mark.parametrize(
    "report",
    [
        "==12==ERROR: AddressSanitizer: heap-use-after-free on address 0x6020",
        "memory.c:42:7: runtime error: signed integer overflow",
    ],
)
def test_sanitizer_reports_fail_the_test(report: str) -> None:
    check_sanitizers("probe: fine\n")
    with pytest.raises(pytest.fail.Exception, match="sanitizer report"):
        check_sanitizers(f"noise\n{report}\n")


def test_hold_until_killed(spawn_probe: ProbeSpawner) -> None:
    proc = spawn_probe("init ctx alloc 1m hold", build="none")
    assert proc.wait_for("alloc")["rc"] == 0
    hold = proc.wait_for("hold")
    assert hold["pid"] == proc.pid
    assert proc.poll() is None
    proc.kill()
    assert proc.wait(timeout=10) == -9


def test_lock_is_held_until_the_holder_dies(spawn_probe: ProbeSpawner, tmp_path: Path) -> None:
    path = tmp_path / "region.lock"
    proc = spawn_probe(f"lock {path} hold", build="none")
    assert proc.wait_for("lock")["rc"] == 0
    proc.wait_for("hold")
    with open(path, "r+b") as f:
        with pytest.raises(BlockingIOError):
            fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        proc.kill()
        proc.wait(timeout=10)
        fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the kernel released it


def test_racers_start_together(spawn_probe: ProbeSpawner) -> None:
    start = race_start(1.0)
    procs = [
        spawn_probe(f"init ctx race 1g 4 {start}", build="none", env={"FAKECUDA_MEMORY": "3g"})
        for _ in range(8)
    ]
    for proc in procs:
        race = proc.wait_for("race", timeout=20)
        # memory is per process in the fake: each gets 3 of its 4
        assert (race["ok"], race["failed"], race["rc"]) == (3, 1, CUDA_ERROR_OUT_OF_MEMORY)
        assert race["late_ns"] < 200_000_000
        assert proc.result().returncode == 0


# ----------------------------------------------------------------------------- legacy ABI, sharing,
# graph memory, context limits: the fake holds the memory each of these takes, as the driver does


def test_the_legacy_entry_points_allocate_as_their_v2_forms(fake: FakeProbe) -> None:
    res = fake(
        "init ctx legacy alloc link 100m legacy pitch dlsym 100m legacy array proc 100m "
        "legacy array3d link 100m fakeused legacy info link 0 legacy totalmem proc 0",
        env={"FAKECUDA_MEMORY": "1g"},
    )
    assert res.rcs() == [0] * len(res), res.describe()
    assert used(res) == [400 * MiB]
    info, total = res.by_cmd("legacy")[4:]
    assert (info["a"], info["b"]) == (GiB - 400 * MiB, GiB)
    assert total["a"] == GiB


def test_a_retained_handle_outlives_its_release(fake: FakeProbe) -> None:
    # ids: vmm 0, its mapping 1, the retained handle 2
    res = fake("init ctx vmm 256m vmmmap 0 vmmretain 1 free 0 fakeused free 1 free 2 fakeused")
    assert res.rcs() == [0] * len(res), res.describe()
    assert res.one("vmmretain")["ptr"] == res.one("vmm")["ptr"]
    assert used(res) == [256 * MiB, 0]


def test_an_imported_handle_is_memory_of_the_importer(fake: FakeProbe) -> None:
    res = fake("init ctx vmm 256m vmmshare 0 free 0 fakeused free 1 fakeused")
    assert res.rcs() == [0] * len(res), res.describe()
    assert used(res) == [256 * MiB, 0]


def test_graph_memory_nodes_hold_memory(fake: FakeProbe) -> None:
    res = fake("init ctx graphalloc 100m graphalloc 100m node capalloc 100m fakeused")
    assert res.rcs() == [0] * len(res), res.describe()
    assert used(res) == [300 * MiB]


def test_a_graph_holds_its_memory_until_it_and_its_executables_are_destroyed(
    fake: FakeProbe,
) -> None:
    # What a graph frees inside itself stays the graph's. ids: captured graph 0,
    # its executable 1, a graph of nodes 2 (allocation and free node).
    res = fake(
        "init ctx capalloc 100m freed instantiate 0 graphlaunch 1 fakeused free 0 fakeused "
        "free 1 fakeused graphalloc 100m nodefreed fakeused free 2 fakeused"
    )
    assert res.rcs() == [0] * len(res), res.describe()
    assert used(res) == [100 * MiB, 100 * MiB, 0, 100 * MiB, 0]


def test_context_limits_take_device_memory(fake: FakeProbe) -> None:
    # The heap beyond its 8 MiB default; the stack per thread beyond 1 KiB, for
    # 132 SMs x 2048 threads.
    res = fake(
        "init ctx setlimit 2 108m fakeused setlimit 2 8m setlimit 0 2k fakeused setlimit 2 2g",
        env={"FAKECUDA_MEMORY": "1g"},
    )
    assert res.rcs()[:-1] == [0] * (len(res) - 1), res.describe()
    assert used(res) == [100 * MiB, 1024 * 132 * 2048]
    assert res.by_cmd("setlimit")[-1]["rc"] == CUDA_ERROR_OUT_OF_MEMORY
