"""A stand-in for PyTorch in `make selftest` / `make fake-check` (PYTHONPATH):
the few torch.cuda calls torch_oom.py makes, backed by cuMemAlloc_v2 of
whatever libcuda.so.1 the process loads (through ctypes, so an interposer's
dlsym sees the lookups). No caching: reserved == allocated. Not PyTorch."""

from __future__ import annotations

import ctypes

__version__ = "0.0-gpuslice-selftest"


class version:  # mirrors torch.version
    cuda = "13.0"


uint8 = "uint8"


class device:  # mirrors torch.device
    def __init__(self, kind: str, index: int = 0) -> None:
        self.type, self.index = kind, index


class _Driver:
    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.ready = False
        self.held: dict[int, int] = {}

    def init(self) -> bool:
        if not self.ready:
            ctx = ctypes.c_void_p()
            dev = ctypes.c_int()
            if self.lib.cuInit(0) != 0 or self.lib.cuDeviceGet(ctypes.byref(dev), 0) != 0:
                return False
            if self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) != 0:
                return False
            self.ready = self.lib.cuCtxSetCurrent(ctx) == 0
        return self.ready


_drv = _Driver()


class _Tensor:
    def __init__(self, ptr: int, nbytes: int) -> None:
        self.ptr, self.nbytes = ptr, nbytes

    def __del__(self) -> None:
        if _drv.held.pop(self.ptr, None) is not None:
            _drv.lib.cuMemFree_v2(ctypes.c_uint64(self.ptr))


def empty(n: int, dtype=None, device=None) -> _Tensor:
    _drv.init()
    p = ctypes.c_uint64()
    rc = _drv.lib.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(n))
    if rc == 2:
        raise cuda.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {n} bytes")
    if rc != 0:
        raise RuntimeError(f"cuMemAlloc_v2 failed: {rc}")
    _drv.held[p.value] = n
    return _Tensor(p.value, n)


class cuda:  # mirrors torch.cuda
    class OutOfMemoryError(RuntimeError):
        pass

    @staticmethod
    def is_available() -> bool:
        return _drv.init()

    @staticmethod
    def mem_get_info(device=None) -> tuple[int, int]:
        _drv.init()
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        _drv.lib.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))
        return free.value, total.value

    @staticmethod
    def get_allocator_backend() -> str:
        return "native"

    @staticmethod
    def memory_reserved(device=None) -> int:
        return sum(_drv.held.values())

    memory_allocated = memory_reserved
    max_memory_reserved = memory_reserved

    @staticmethod
    def memory_stats(device=None) -> dict:
        return {}

    @staticmethod
    def synchronize(device=None) -> None:
        return None

    @staticmethod
    def empty_cache() -> None:
        return None
