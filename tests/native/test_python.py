"""Python programs under the interposer: ctypes on the driver (as frameworks load
it) and pynvml, in a real interpreter with the library preloaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.native.probe import Native

GiB = 1 << 30
MiB = 1 << 20

DRIVER_SCRIPT = textwrap.dedent(
    """
    import ctypes, json
    cuda = ctypes.CDLL("libcuda.so.1")
    def check(rc, what):
        assert rc == 0, (what, rc)
    check(cuda.cuInit(0), "cuInit")
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    check(cuda.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
    check(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "retain")
    check(cuda.cuCtxSetCurrent(ctx), "set current")
    ptrs, rcs = [], []
    while True:
        p = ctypes.c_uint64()
        rc = cuda.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(256 << 20))
        rcs.append(rc)
        if rc:
            break
        ptrs.append(p.value)
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    check(cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)), "info")
    import pynvml
    pynvml.nvmlInit()
    mem = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0))
    print(json.dumps({"held": len(ptrs), "last_rc": rcs[-1], "free": free.value,
                      "total": total.value, "nvml_total": mem.total, "nvml_used": mem.used}))
    """
)


def test_ctypes_and_pynvml_see_the_limit(native: Native, tmp_path: Path) -> None:
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "LD_LIBRARY_PATH": str(native.fake_dir),
        "LD_PRELOAD": str(native.lib),
        "CUDA_DEVICE_MEMORY_LIMIT": "1g",
        "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(tmp_path / "region.cache"),
        "GPUSLICE_CONTEXT_OVERHEAD": "0",
    }
    done = subprocess.run(
        [sys.executable, "-c", DRIVER_SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["held"] == 4  # 4 x 256 MiB fill 1 GiB
    assert seen["last_rc"] == 2  # CUDA_ERROR_OUT_OF_MEMORY
    assert (seen["total"], seen["free"]) == (GiB, 0)
    assert (seen["nvml_total"], seen["nvml_used"]) == (GiB, GiB)
