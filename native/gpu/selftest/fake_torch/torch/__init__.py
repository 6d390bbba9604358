"""A stand-in for PyTorch in `make selftest` / `make fake-check` (PYTHONPATH):
the few torch.cuda calls torch_oom.py makes, backed by cuMemAlloc_v2 of
whatever libcuda.so.1 the process loads (through ctypes, so an interposer's
dlsym sees the lookups). No caching: reserved == allocated. Not PyTorch.

For torch_workloads.py (nn, optim, autocast, CUDA graphs: plumbing only) it
computes nothing: tensors carry no data, a training step is one 5 ms kernel
(the fake driver's gs_fma_loop, so a compute limit spaces it), each layer of
the inference model one empty kernel, and the loss falls with every step."""

from __future__ import annotations

import ctypes

__version__ = "0.0-gpuslice-selftest"


class version:  # mirrors torch.version
    cuda = "13.0"


uint8 = "uint8"
bfloat16 = "bfloat16"
float32 = "float32"


class device:  # mirrors torch.device
    def __init__(self, kind: str, index: int = 0) -> None:
        self.type, self.index = kind, index


class _Driver:
    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.ready = False
        self.held: dict[int, int] = {}
        self.peak = 0
        self.funcs: dict[str, ctypes.c_void_p] = {}
        self.steps = 0

    def kernel(self, name: str, iters: int = 0) -> None:
        """Launch the fake driver's gs_fma_loop (iters * 4 ns) or gs_empty."""
        self.init()
        if not self.funcs:
            mod = ctypes.c_void_p()
            image = ctypes.c_char_p(b".entry gs_fma_loop\n.entry gs_empty\n")
            self.lib.cuModuleLoadDataEx(ctypes.byref(mod), image, 0, None, None)
            for n in ("gs_fma_loop", "gs_empty"):
                f = ctypes.c_void_p()
                self.lib.cuModuleGetFunction(ctypes.byref(f), mod, n.encode())
                self.funcs[n] = f
        out = ctypes.c_uint64(0)
        n = ctypes.c_uint(iters)
        params = (ctypes.c_void_p * 2)(
            ctypes.cast(ctypes.byref(out), ctypes.c_void_p),
            ctypes.cast(ctypes.byref(n), ctypes.c_void_p),
        )
        self.lib.cuLaunchKernel(self.funcs[name], 1, 1, 1, 1, 1, 1, 0, None, params, None)

    def sync(self) -> None:
        self.init()
        self.lib.cuStreamSynchronize(None)

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

    def numel(self) -> int:
        return self.nbytes

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
    _drv.peak = max(_drv.peak, sum(_drv.held.values()))
    return _Tensor(p.value, n)


class _T:
    """A tensor with no data: every operation gives another."""

    def __init__(self, value: float = 0.0) -> None:
        self.value = value

    def __getattr__(self, name: str):
        return lambda *a, **k: _T(self.value)

    def __sub__(self, other) -> _T:
        return _T(0.0)

    def __call__(self, *a, **k) -> _T:
        return _T(self.value)

    def item(self) -> float:
        _drv.sync()
        return self.value

    def backward(self) -> None:
        return None


def manual_seed(seed: int) -> None:
    return None


def randint(lo, hi, shape, device=None) -> _T:
    return _T()


def randn(*shape, device=None) -> _T:
    return _T()


class _Ctx:
    def __init__(self, *a, **k) -> None:
        pass

    def __enter__(self) -> _Ctx:
        return self

    def __exit__(self, *exc) -> None:
        return None


autocast = no_grad = _Ctx


class _Param:
    def numel(self) -> int:
        return 1000


class nn:  # mirrors torch.nn
    class Module:
        def parameters(self):
            return [_Param()]

        def to(self, device):
            return self

        def eval(self):
            return self

        def __call__(self, x):
            return self.forward(x)

        def forward(self, x):
            return x

    class Embedding(Module):
        def __init__(self, *a, **k) -> None:
            pass

    Linear = TransformerEncoderLayer = Embedding

    class TransformerEncoder(Module):
        def __init__(self, layer, n) -> None:
            pass

    class GELU(Module):
        pass

    class Sequential(Module):
        def __init__(self, *layers) -> None:
            self.layers = layers

        def forward(self, x):
            for _ in self.layers:
                _drv.kernel("gs_empty")
            return x

    class functional:
        @staticmethod
        def cross_entropy(out, target) -> _T:
            return _T(5.0 / (1 + 0.1 * _drv.steps))


class optim:  # mirrors torch.optim
    class AdamW:
        def __init__(self, params, lr=1e-3) -> None:
            pass

        def zero_grad(self, set_to_none=True) -> None:
            return None

        def step(self) -> None:
            _drv.steps += 1
            _drv.kernel("gs_fma_loop", 1_250_000)  # 5 ms on the fake driver


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

    @staticmethod
    def max_memory_reserved(device=None) -> int:
        return _drv.peak

    @staticmethod
    def get_device_name(device=None) -> str:
        return "fake (gpuslice selftest)"

    class Stream:
        def __init__(self, device=None) -> None:
            pass

        def wait_stream(self, other) -> None:
            return None

    @staticmethod
    def current_stream(device=None) -> cuda.Stream:
        return cuda.Stream()

    stream = graph = _Ctx

    class CUDAGraph:
        def replay(self) -> None:
            return None

    @staticmethod
    def memory_stats(device=None) -> dict:
        return {}

    @staticmethod
    def synchronize(device=None) -> None:
        _drv.sync()

    @staticmethod
    def empty_cache() -> None:
        return None
