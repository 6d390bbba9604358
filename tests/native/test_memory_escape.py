"""A hostile tenant against its memory grant: the ways round the allocation hooks.

Each test is one way a process got device memory, or a view of it, past the
interposer: a driver of its own named in the environment, a lookup that skips
the preloaded library, the driver's pre-CUDA 3.2 entry points, memory pools that
keep what was freed, handles retained or imported, graph memory, context limits.
Each must be held to the grant (or refused); host-attached managed memory, which
cannot hold a neighbour's device memory, is the one thing let through uncharged.
Graph memory is charged to its graph while the graph or an executable of it
lives, whatever the graph frees inside itself.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.native.container import Container, GiB, MiB, grant
from tests.native.probe import Build, Native, ProbeRunner

OK = 0
OOM = 2
NOT_SUPPORTED = 801


def rcs(lines: list[dict[str, object]], cmd: str) -> list[object]:
    return [line["rc"] for line in lines if line.get("cmd") == cmd]


def limited(region: Path, limit: str = "1g") -> dict[str, str | int | None]:
    return {"CUDA_DEVICE_MEMORY_LIMIT": limit, "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(region)}


@pytest.fixture
def box(tmp_path: Path) -> Container:
    """A container granted 1 GiB on fake GPU 0."""
    return Container.prepare(tmp_path, grant(GiB))


# ----------------------------------------------------------------------------- the driver loaded


def test_a_driver_named_by_the_process_is_ignored_under_a_grant(
    native: Native, run_probe: ProbeRunner, box: Container, build: Build
) -> None:
    # The tenant's "driver": the real one behind a cuCtxGetDevice that always fails,
    # so an interposer that loaded it would find no device to charge.
    env: dict[str, str | int | None] = {
        "GPUSLICE_LIBCUDA": str(native.build / "driver_shim.so"),
        "GPUSLICE_LIBNVML": str(native.build / "driver_shim.so"),
        "LIBCUDA_LOG_LEVEL": 2,
    }
    result = run_probe(
        "init", "ctx", "alloc", "900m", "alloc", "900m", "alloc", "900m", "info",
        build=build, env=env, prefix=box.prefix(),
    )  # fmt: skip
    assert rcs(result.lines, "alloc") == [OK, OOM, OOM], result.describe()
    assert result.one("info")["total"] == GiB
    assert "GPUSLICE_LIBCUDA and GPUSLICE_LIBNVML ignored" in result.stderr


# ----------------------------------------------------------------------------- lookups


def test_a_linked_library_looking_past_the_interposer_gets_the_wrapper(
    run_probe: ProbeRunner, region_path: Path, build: Build
) -> None:
    # next_lib.so, linked into the probe after the preloaded library, looks
    # cuMemAlloc_v2 up itself: RTLD_NEXT skips everything loaded before it.
    result = run_probe(
        "init", "ctx", "nextalloc", "900m", "nextalloc", "900m", "nextalloc", "900m", "default",
        "info", build=build, env=limited(region_path),
    )  # fmt: skip
    assert rcs(result.lines, "nextalloc") == [OK, OOM, OOM], result.describe()
    assert result.one("info")["free"] == GiB - 900 * MiB


def test_a_version_the_library_does_not_wrap_is_refused_in_every_lookup(
    run_probe: ProbeRunner, region_path: Path, build: Build
) -> None:
    # The fake driver's cuMemAlloc_v3 stands for a version a later driver adds:
    # looked up on the driver's handle or in the global scope (RTLD_DEFAULT, which
    # finds the driver past the library), it is refused, not handed out.
    result = run_probe(
        "init", "ctx", "dlsym", "cuMemAlloc_v3", "cuda", "dlsym", "cuMemAlloc_v3", "default",
        "dlsym", "cuMemAlloc_v2", "default", "dlsym", "cuMemAlloc_v3", "default",
        build=build, env=limited(region_path),
    )  # fmt: skip
    found = [(line["found"], line.get("lib")) for line in result.by_cmd("dlsym")]
    assert found[0][0] is False, result.describe()
    assert found[1][0] is False, result.describe()
    assert found[2] == (True, "libgpuslice.so"), result.describe()
    assert found[3][0] is False, result.describe()
    off = run_probe(
        "dlsym", "cuMemAlloc_v3", "default", build=build, env={"CUDA_DISABLE_CONTROL": "true"}
    )
    assert off.one("dlsym")["found"] is True, off.describe()  # control off: the driver's own


@pytest.mark.parametrize("how", ["link", "dlsym", "proc"])
def test_the_legacy_entry_points_are_refused_or_counted(
    run_probe: ProbeRunner, region_path: Path, build: Build, how: str
) -> None:
    # The pre-CUDA 3.2 ABI, called by its linked name, looked up on the driver's
    # handle, or handed out by cuGetProcAddress for cudaVersion 3010.
    result = run_probe(
        "init", "ctx",
        "legacy", "alloc", how, "900m", "legacy", "pitch", how, "900m",
        "legacy", "array", how, "900m", "legacy", "array3d", how, "900m",
        "legacy", "info", how, 0, "legacy", "totalmem", how, 0,
        "fakeused",
        "legacy", "ctx", how, 0, "legacy", "ctx", how, 0,
        build=build,
        env={**limited(region_path), "GPUSLICE_CONTEXT_OVERHEAD": "512m"},
    )  # fmt: skip
    answers = rcs(result.lines, "legacy")
    assert answers[:6] == [NOT_SUPPORTED] * 6, result.describe()
    assert result.one("fakeused")["bytes"] == 0
    # cuCtxCreate kept its arguments: counted as cuCtxCreate_v2 (primary 512m + 512m).
    assert answers[6:] == [OK, OOM], result.describe()


# ----------------------------------------------------------------------------- managed memory


def test_host_attached_managed_memory_is_not_charged_global_is(
    run_probe: ProbeRunner, box: Container, build: Build
) -> None:
    result = run_probe(
        "init", "ctx", "managed", "2g", "host", "managed", "2g", "global", "managed", "2g",
        "managed", "900m", "info", build=build, prefix=box.prefix(),
    )  # fmt: skip
    assert rcs(result.lines, "managed") == [OK, OOM, OOM, OK], result.describe()
    assert result.one("info")["free"] == GiB - 900 * MiB


# ----------------------------------------------------------------------------- pools


def test_memory_pools_are_charged_for_what_they_keep(
    run_probe: ProbeRunner, region_path: Path, build: Build
) -> None:
    # Four pools that never give freed memory back by themselves, each used once.
    result = run_probe(
        "init", "ctx", "pools", 4, "900m", "fakeused", "alloc", "900m", "fakeused", "info",
        build=build, env=limited(region_path),
    )  # fmt: skip
    assert result.one("pools")["rcs"] == [OK] * 4, result.describe()
    kept, after = (line["bytes"] for line in result.by_cmd("fakeused"))
    assert isinstance(kept, int)
    assert isinstance(after, int)
    assert kept <= GiB, result.describe()  # each pool trimmed when the next needed room
    assert result.one("alloc")["rc"] == OK
    assert after <= GiB, result.describe()  # what the driver holds stays within the grant
    assert result.one("info")["free"] == GiB - 900 * MiB


def test_what_pools_keep_makes_room_for_a_context(
    run_probe: ProbeRunner, region_path: Path, build: Build
) -> None:
    # 512 MiB per context: the primary one and a pool keeping 900 MiB leave no room
    # for a second context under 1.5 GiB until the pool is trimmed.
    env = {**limited(region_path, "1536m"), "GPUSLICE_CONTEXT_OVERHEAD": "512m"}
    result = run_probe(
        "init", "ctx", "pools", 1, "900m", "info", "newctx", "fakeused",
        build=build, env=env,
    )  # fmt: skip
    assert result.one("info")["free"] == 1536 * MiB - 512 * MiB - 900 * MiB, result.describe()
    assert result.one("newctx")["rc"] == OK
    assert result.one("fakeused")["bytes"] == 0  # the pool gave its 900 MiB back


# ----------------------------------------------------------------------------- VMM handles


def test_a_retained_handle_keeps_its_memory_counted(
    run_probe: ProbeRunner, region_path: Path, build: Build
) -> None:
    # ids: vmm 0, its mapping 1, the retained handle 2
    result = run_probe(
        "init", "ctx", "vmm", "512m", "vmmmap", 0, "vmmretain", 1,
        "free", 0, "free", 1, "info", "alloc", "600m", "free", 2, "info",
        build=build, env=limited(region_path),
    )  # fmt: skip
    assert result.one("vmmretain")["rc"] == OK, result.describe()
    assert rcs(result.lines, "free") == [OK, OK, OK]
    retained, gone = result.by_cmd("info")
    assert retained["free"] == GiB - 512 * MiB, result.describe()
    assert result.one("alloc")["rc"] == OOM
    assert gone["free"] == GiB


def test_an_imported_handle_is_charged_to_the_importer(
    run_probe: ProbeRunner, region_path: Path, build: Build
) -> None:
    # ids: vmm 0 (the exporter's), its import 1, the import's mapping 2
    result = run_probe(
        "init", "ctx", "vmm", "512m", "vmmshare", 0, "free", 0, "vmmmap", 1, "info",
        "alloc", "600m", "free", 2, "free", 1, "info",
        build=build, env=limited(region_path),
    )  # fmt: skip
    assert result.one("vmmshare")["rc"] == OK, result.describe()
    mapped, released = result.by_cmd("info")
    assert mapped["free"] == GiB - 512 * MiB, result.describe()
    assert result.one("alloc")["rc"] == OOM
    assert released["free"] == GiB


# ----------------------------------------------------------------------------- graphs, limits


def test_the_memory_a_graph_keeps_is_charged_until_the_graph_goes(
    run_probe: ProbeRunner, region_path: Path, build: Build
) -> None:
    # The graph allocates and frees 900 MiB inside itself (ids: graph 0, its
    # executable 1): the driver keeps the 900 MiB for the graph while it or its
    # executable lives, so the grant has no room for another 900 MiB until both go.
    result = run_probe(
        "init", "ctx", "capalloc", "900m", "freed", "alloc", "900m", "fakeused",
        "instantiate", 0, "graphlaunch", 1, "free", 0, "alloc", "900m",
        "free", 1, "fakeused", "alloc", "900m", "info",
        build=build, env=limited(region_path),
    )  # fmt: skip
    captured = result.one("capalloc")
    assert (captured["rc"], captured["free_rc"], captured["end_rc"]) == (OK, OK, OK), (
        result.describe()
    )
    assert rcs(result.lines, "alloc") == [OOM, OOM, OK], result.describe()
    held, gone = (line["bytes"] for line in result.by_cmd("fakeused"))
    assert (held, gone) == (900 * MiB, 0)
    assert result.one("info")["free"] == GiB - 900 * MiB


@pytest.mark.parametrize("how", ["capture", "alloc node", "add node"])
def test_a_graph_within_the_grant_runs_end_to_end(
    run_probe: ProbeRunner, region_path: Path, build: Build, how: str
) -> None:
    # A graph that allocates and frees 600 MiB (ids: graph 0, executable 1):
    # captured, or built of an allocation and a free node (cuGraphAddMemAllocNode
    # and cuGraphAddMemFreeNode, or both through cuGraphAddNode_v2).
    make = {
        "capture": ("capalloc", "600m", "freed"),
        "alloc node": ("graphalloc", "600m", "freed"),
        "add node": ("graphalloc", "600m", "nodefreed"),
    }[how]
    result = run_probe(
        "init", "ctx", *make, "info", "instantiate", 0, "graphlaunch", 1, "alloc", "300m",
        "alloc", "300m", "free", 1, "free", 0, "free", 2, "info", "alloc", "600m", "info",
        build=build, env=limited(region_path),
    )  # fmt: skip
    made = result.one(make[0])
    assert (made["rc"], made["free_rc"]) == (OK, OK), result.describe()
    assert result.one("instantiate")["rc"] == OK
    assert result.one("graphlaunch")["rc"] == OK
    assert rcs(result.lines, "alloc") == [OK, OOM, OK], result.describe()
    assert rcs(result.lines, "free") == [OK, OK, OK]
    with_graph, gone, again = (line["free"] for line in result.by_cmd("info"))
    assert with_graph == GiB - 600 * MiB, result.describe()
    assert gone == GiB
    assert again == GiB - 600 * MiB


def test_graph_memory_goes_with_its_context_and_outlives_a_graph_not_freeing_it(
    run_probe: ProbeRunner, region_path: Path, build: Build
) -> None:
    # ids: context 0, a graph allocating 900 MiB in it 1 (never freed by the graph);
    # then in the primary context a graph allocating 600 MiB 2, destroyed.
    result = run_probe(
        "init", "ctx", "newctx", "graphalloc", "900m", "info", "destroyctx", 0, "ctx", "info",
        "graphalloc", "600m", "free", 2, "info",
        build=build, env=limited(region_path),
    )  # fmt: skip
    assert rcs(result.lines, "graphalloc") == [OK, OK], result.describe()
    held, ctx_gone, outlived = (line["free"] for line in result.by_cmd("info"))
    assert held == GiB - 900 * MiB, result.describe()
    assert ctx_gone == GiB
    # Launched, the allocation would live on until freed: it stays charged.
    assert outlived == GiB - 600 * MiB


def test_context_limits_are_charged(run_probe: ProbeRunner, box: Container, build: Build) -> None:
    # The malloc heap beyond its 8 MiB default; the stack per resident thread
    # (the fake: 132 SMs x 2048 threads), beyond its 1 KiB default.
    result = run_probe(
        "init", "ctx", "setlimit", 2, "2g", "setlimit", 2, "520m", "alloc", "600m",
        "setlimit", 2, "8m", "alloc", "600m", "setlimit", 0, "8k", "setlimit", 0, "1k",
        build=build, prefix=box.prefix(),
    )  # fmt: skip
    assert rcs(result.lines, "setlimit") == [OOM, OK, OK, OOM, OK], result.describe()
    assert rcs(result.lines, "alloc") == [OOM, OK]


# ----------------------------------------------------------------------------- families

HOOKS = (Native.at().root / "src" / "hooks.def").read_text()
FAMILIES = tuple(re.findall(r"CUDA_FAMILY\((\w+)\)", HOOKS))
VERSIONS = (2000, 3010, 3020, 4000, 11000, 11040, 12000, 12030, 12050, 13000)


def test_no_function_of_an_accounted_family_is_handed_out_unwrapped(
    run_probe: ProbeRunner, region_path: Path, build: Build
) -> None:
    # Every name that allocates, maps, shows memory or launches, at every version and
    # stream flavour: what cuGetProcAddress hands out is the library's wrapper or nothing.
    words = [
        word
        for name in FAMILIES
        for version in VERSIONS
        for flags in (0, 2)
        for word in ("proc", name, str(version), str(flags))
    ]
    result = run_probe(*words, build=build, env=limited(region_path))
    answers = result.by_cmd("proc")
    assert len(answers) == len(FAMILIES) * len(VERSIONS) * 2
    found = [line for line in answers if line["rc"] == OK]
    assert {line["name"] for line in found} >= {"cuMemAlloc", "cuCtxCreate", "cuMemGetInfo"}
    unwrapped = [(line["name"], line["version"], line["sym"]) for line in found
                 if line["lib"] != "libgpuslice.so"]  # fmt: skip
    assert not unwrapped
