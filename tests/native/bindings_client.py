"""A driver-API program written with NVIDIA's own Python client, cuda-bindings.

Run as a script (never imported by pytest) in a process prepared like the probe's
(tests/native/probe.py: the fake driver on LD_LIBRARY_PATH, the interposer in
LD_PRELOAD). cuda.bindings.driver loads libcuda.so.1 and resolves every driver
function it knows through cuGetProcAddress_v2, asking each one for the CUDA version
that introduced it, and with CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM=1 for the
per-thread-stream twins: the lookups a CUDA application makes.

The command line is a list of commands, like the C probe's; each prints one JSON
line with its name ("cmd") and, for driver calls, the CUresult ("rc", "error"):

  init | ctx                         cuInit(0) | retain and set the primary context
  alloc N | managed N | async N | poolalloc N
                                     cuMemAlloc, cuMemAllocManaged (global),
                                     cuMemAllocAsync / cuMemAllocFromPoolAsync (the
                                     device's current pool) on stream 0, then a
                                     stream synchronize
  pitch W H E                        cuMemAllocPitch(W bytes, H rows, element E)
  array W H | array3d W H D | mipmap W H D LEVELS
                                     float arrays (cuArrayCreate, cuArray3DCreate,
                                     cuMipmappedArrayCreate)
  vmm N                              cuMemCreate + cuMemAddressReserve + cuMemMap +
                                     cuMemSetAccess ("step" names the call that failed)
  free I                             frees the I-th object that was made (0-based, in
                                     order of success); a vmm object is unmapped,
                                     released and its range freed
  release I | unmap I                a vmm object's cuMemRelease alone (still mapped) |
                                     its cuMemUnmap + cuMemAddressFree
  info | totalmem                    cuMemGetInfo | cuDeviceTotalMem
  region                             the shared region's device 0 (used, limit), this
                                     process's bytes there, and what the fake driver
                                     itself counts (fakecuda_used_bytes)
  pointers                           every function pointer cuda-bindings resolved:
                                     {key: [library, symbol, equals dlsym(RTLD_DEFAULT,
                                     symbol)]}
  procs NAMES VERSIONS FLAGS         cuGetProcAddress(name, version, flags) through the
                                     bindings for each combination of the comma lists;
                                     one line each: rc, status, library, symbol and
                                     whether the pointer is dlsym(RTLD_DEFAULT, symbol)

Sizes take k/m/g suffixes. A command that cannot run (bad arguments) exits 2.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

from cuda.bindings import driver
from cuda.bindings._internal import driver as resolved

SUFFIX = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
FLOAT = driver.CUarray_format.CU_AD_FORMAT_FLOAT


class DlInfo(ctypes.Structure):
    _fields_ = (
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    )


_libc = ctypes.CDLL(None)
_libc.dladdr.argtypes = (ctypes.c_void_p, ctypes.POINTER(DlInfo))
_libc.dladdr.restype = ctypes.c_int
_libc.dlsym.argtypes = (ctypes.c_void_p, ctypes.c_char_p)
_libc.dlsym.restype = ctypes.c_void_p


def where(pointer: int) -> tuple[str | None, str | None, bool]:
    """The library and exported symbol at `pointer`, and whether a global lookup of
    that symbol (dlsym(RTLD_DEFAULT, ...)) gives the same pointer."""
    info = DlInfo()
    if not pointer or not _libc.dladdr(pointer, ctypes.byref(info)) or not info.dli_fname:
        return None, None, False
    lib = os.path.basename(info.dli_fname.decode())
    sym = info.dli_sname.decode() if info.dli_sname else None
    exact = sym is not None and info.dli_saddr == pointer
    default = exact and _libc.dlsym(None, info.dli_sname) == pointer
    return lib, sym if exact else None, default


def size(text: str) -> int:
    unit = SUFFIX.get(text[-1:].lower(), 1)
    return int(text[:-1] if unit > 1 else text, 0) * unit


def out(cmd: str, rc: Any = None, **fields: Any) -> None:
    line: dict[str, Any] = {"cmd": cmd}
    if rc is not None:
        line["rc"] = int(rc)
        line["error"] = driver.CUresult(int(rc)).name
    line.update(fields)
    print(json.dumps(line), flush=True)


class Client:
    def __init__(self) -> None:
        self.dev = driver.CUdevice(0)
        self.stream = driver.CUstream(0)
        self.made: list[tuple[str, Any]] = []  # (kind, what free needs)

    # ------------------------------------------------------------------ objects
    def keep(self, cmd: str, rc: Any, kind: str, obj: Any, **fields: Any) -> None:
        if rc == driver.CUresult.CUDA_SUCCESS:
            self.made.append((kind, obj))
        out(cmd, rc, **fields)

    def sync(self, rc: Any) -> Any:
        if rc == driver.CUresult.CUDA_SUCCESS:
            (rc,) = driver.cuStreamSynchronize(self.stream)
        return rc

    def vmm(self, n: int) -> None:
        prop = driver.CUmemAllocationProp()
        prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = 0
        minimum = driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        rc, granularity = driver.cuMemGetAllocationGranularity(prop, minimum)
        if rc:
            out("vmm", rc, step="cuMemGetAllocationGranularity")
            return
        n = -(-n // granularity) * granularity
        rc, handle = driver.cuMemCreate(n, prop, 0)
        if rc:
            out("vmm", rc, step="cuMemCreate")
            return
        rc, va = driver.cuMemAddressReserve(n, 0, 0, 0)
        if rc:
            out("vmm", rc, step="cuMemAddressReserve")
            return
        (rc,) = driver.cuMemMap(va, n, 0, handle, 0)
        if rc:
            out("vmm", rc, step="cuMemMap")
            return
        access = driver.CUmemAccessDesc()
        access.location = prop.location
        access.flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        (rc,) = driver.cuMemSetAccess(va, n, [access], 1)
        state = {"handle": handle, "va": va, "size": n, "mapped": True, "released": False}
        self.keep("vmm", rc, "vmm", state, step="cuMemSetAccess", bytes=n)

    def release(self, state: dict[str, Any]) -> Any:
        (rc,) = driver.cuMemRelease(state["handle"])
        state["released"] = rc == driver.CUresult.CUDA_SUCCESS
        return rc

    def unmap(self, state: dict[str, Any]) -> Any:
        (rc,) = driver.cuMemUnmap(state["va"], state["size"])
        if rc == driver.CUresult.CUDA_SUCCESS:
            state["mapped"] = False
            (rc,) = driver.cuMemAddressFree(state["va"], state["size"])
        return rc

    def free(self, index: int) -> Any:
        kind, obj = self.made[index]
        if kind == "mem":
            return driver.cuMemFree(obj)[0]
        if kind == "async":
            return self.sync(driver.cuMemFreeAsync(obj, self.stream)[0])
        if kind == "array":
            return driver.cuArrayDestroy(obj)[0]
        if kind == "mipmap":
            return driver.cuMipmappedArrayDestroy(obj)[0]
        rc = self.unmap(obj) if obj["mapped"] else driver.CUresult.CUDA_SUCCESS
        if rc == driver.CUresult.CUDA_SUCCESS and not obj["released"]:
            rc = self.release(obj)
        return rc

    # ------------------------------------------------------------------ commands
    def run(self, words: Iterator[str]) -> None:
        for cmd in words:
            handler: Callable[[Iterator[str]], None] | None = getattr(self, "cmd_" + cmd, None)
            if handler is None:
                print(f"unknown command {cmd!r}", file=sys.stderr)
                sys.exit(2)
            handler(words)

    def cmd_init(self, words: Iterator[str]) -> None:
        out("init", driver.cuInit(0)[0])

    def cmd_ctx(self, words: Iterator[str]) -> None:
        rc, ctx = driver.cuDevicePrimaryCtxRetain(self.dev)
        if rc == driver.CUresult.CUDA_SUCCESS:
            (rc,) = driver.cuCtxSetCurrent(ctx)
        out("ctx", rc)

    def cmd_alloc(self, words: Iterator[str]) -> None:
        rc, ptr = driver.cuMemAlloc(size(next(words)))
        self.keep("alloc", rc, "mem", ptr)

    def cmd_managed(self, words: Iterator[str]) -> None:
        glob = driver.CUmemAttach_flags.CU_MEM_ATTACH_GLOBAL
        rc, ptr = driver.cuMemAllocManaged(size(next(words)), glob)
        self.keep("managed", rc, "mem", ptr)

    def cmd_pitch(self, words: Iterator[str]) -> None:
        width, height, elem = size(next(words)), size(next(words)), size(next(words))
        rc, ptr, pitch = driver.cuMemAllocPitch(width, height, elem)
        self.keep("pitch", rc, "mem", ptr, pitch=int(pitch or 0))

    def cmd_async(self, words: Iterator[str]) -> None:
        rc, ptr = driver.cuMemAllocAsync(size(next(words)), self.stream)
        self.keep("async", self.sync(rc), "async", ptr)

    def cmd_poolalloc(self, words: Iterator[str]) -> None:
        n = size(next(words))
        rc, pool = driver.cuDeviceGetMemPool(self.dev)
        ptr = None
        if rc == driver.CUresult.CUDA_SUCCESS:
            rc, ptr = driver.cuMemAllocFromPoolAsync(n, pool, self.stream)
        self.keep("poolalloc", self.sync(rc), "async", ptr)

    def cmd_array(self, words: Iterator[str]) -> None:
        desc = driver.CUDA_ARRAY_DESCRIPTOR()
        desc.Width, desc.Height = size(next(words)), size(next(words))
        desc.Format, desc.NumChannels = FLOAT, 1
        rc, array = driver.cuArrayCreate(desc)
        self.keep("array", rc, "array", array)

    def _desc3d(self, words: Iterator[str]) -> Any:
        desc = driver.CUDA_ARRAY3D_DESCRIPTOR()
        desc.Width, desc.Height, desc.Depth = (size(next(words)) for _ in range(3))
        desc.Format, desc.NumChannels, desc.Flags = FLOAT, 1, 0
        return desc

    def cmd_array3d(self, words: Iterator[str]) -> None:
        rc, array = driver.cuArray3DCreate(self._desc3d(words))
        self.keep("array3d", rc, "array", array)

    def cmd_mipmap(self, words: Iterator[str]) -> None:
        desc = self._desc3d(words)
        rc, mipmap = driver.cuMipmappedArrayCreate(desc, size(next(words)))
        self.keep("mipmap", rc, "mipmap", mipmap)

    def cmd_vmm(self, words: Iterator[str]) -> None:
        self.vmm(size(next(words)))

    def cmd_free(self, words: Iterator[str]) -> None:
        out("free", self.free(int(next(words))))

    def cmd_release(self, words: Iterator[str]) -> None:
        out("release", self.release(self.made[int(next(words))][1]))

    def cmd_unmap(self, words: Iterator[str]) -> None:
        out("unmap", self.unmap(self.made[int(next(words))][1]))

    def cmd_info(self, words: Iterator[str]) -> None:
        rc, free, total = driver.cuMemGetInfo()
        out("info", rc, free=int(free or 0), total=int(total or 0))

    def cmd_totalmem(self, words: Iterator[str]) -> None:
        rc, total = driver.cuDeviceTotalMem(self.dev)
        out("totalmem", rc, bytes=int(total or 0))

    def cmd_region(self, words: Iterator[str]) -> None:
        from gpuslice_common.region import Region

        fake = ctypes.CDLL("libcuda.so.1")
        fake.fakecuda_used_bytes.argtypes = (ctypes.c_int,)
        fake.fakecuda_used_bytes.restype = ctypes.c_ulonglong
        with Region.open(os.environ["CUDA_DEVICE_MEMORY_SHARED_CACHE"]) as region:
            device = region.devices()[0]
            mine = [p.used_bytes[0] for p in region.processes() if p.pid == os.getpid()]
            out(
                "region",
                used=device.used_bytes,
                limit=device.limit_bytes,
                process=mine[0] if mine else None,
                fake=fake.fakecuda_used_bytes(0),
            )

    def cmd_pointers(self, words: Iterator[str]) -> None:
        table = resolved._inspect_function_pointers()
        out("pointers", functions={key: where(p) for key, p in table.items() if p})

    def cmd_procs(self, words: Iterator[str]) -> None:
        names, versions, flags = (next(words).split(",") for _ in range(3))
        for name, version, flag in itertools.product(names, map(int, versions), map(int, flags)):
            rc, pfn, status = driver.cuGetProcAddress(name.encode(), version, flag)
            lib, sym, default = where(int(pfn or 0))
            out(
                "proc",
                rc,
                name=name,
                version=version,
                flags=flag,
                status=None if status is None else int(status),
                lib=lib,
                sym=sym,
                default=default,
            )


if __name__ == "__main__":
    try:
        Client().run(iter(sys.argv[1:]))
    except (StopIteration, ValueError, IndexError) as exc:
        print(f"bad command line: {exc!r}", file=sys.stderr)
        sys.exit(2)
