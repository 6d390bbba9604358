#!/usr/bin/env python3
"""Allocate CUDA tensors of --step bytes until PyTorch raises OutOfMemoryError;
print one JSON line with torch.cuda.memory_reserved() at that moment and what
torch.cuda.mem_get_info() showed. run_kit.py runs it under libgpuslice.so with
CUDA_DEVICE_MEMORY_LIMIT set (and PYTORCH_CUDA_ALLOC_CONF per configuration).

Never raises: every failure ends up in the JSON ("error" / "other_error").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import traceback


def lib_mapped(lib: str | None):
    """Is `lib` mapped into this process (i.e. did LD_PRELOAD take effect)?"""
    if not lib:
        return None
    real = os.path.realpath(lib)
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) == 6:
                    path = parts[5].strip()
                    if path in (lib, real):
                        return True
    except OSError:
        return None
    return False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--limit",
        type=int,
        required=True,
        help="CUDA_DEVICE_MEMORY_LIMIT in bytes (for the record)",
    )
    ap.add_argument("--step", type=int, default=200 * 1024 * 1024, help="bytes per tensor")
    ap.add_argument("--max-steps", type=int, default=4096)
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--lib", help="the preloaded interposer, to confirm it is mapped")
    args = ap.parse_args()

    out: dict = {
        "event": "result",
        "cmd": "torch_oom",
        "limit": args.limit,
        "step": args.step,
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        "interposer_mapped": lib_mapped(args.lib),
    }
    t0 = time.monotonic()

    def emit() -> int:
        out["elapsed_s"] = round(time.monotonic() - t0, 3)
        print(json.dumps(out), flush=True)
        return 0

    try:
        import torch
    except Exception as e:  # any import failure is reported
        out["error"] = f"import torch: {type(e).__name__}: {e}"
        return emit()
    out["torch_version"] = torch.__version__
    out["torch_cuda"] = torch.version.cuda
    try:
        if not torch.cuda.is_available():
            out["error"] = "torch.cuda.is_available() is False"
            return emit()
        dev = torch.device("cuda", args.device)
        free, total = torch.cuda.mem_get_info(dev)
        out["mem_get_info_before"] = {"free": free, "total": total}
        with contextlib.suppress(Exception):  # older torch has no such call
            out["allocator_backend"] = torch.cuda.get_allocator_backend()
        oom_type = getattr(torch.cuda, "OutOfMemoryError", None)
        tensors = []
        oom_msg = None
        for _ in range(args.max_steps):
            try:
                tensors.append(torch.empty(args.step, dtype=torch.uint8, device=dev))
            except Exception as e:
                if (oom_type is not None and isinstance(e, oom_type)) or "out of memory" in str(
                    e
                ).lower():
                    oom_msg = str(e)
                    out["oom_type"] = type(e).__name__
                else:
                    out["other_error"] = traceback.format_exc()[-2000:]
                break
        out["steps_ok"] = len(tensors)
        out["oom"] = oom_msg is not None
        out["oom_message"] = oom_msg[:800] if oom_msg else None
        out["memory_reserved_at_oom"] = torch.cuda.memory_reserved(dev)
        out["memory_allocated_at_oom"] = torch.cuda.memory_allocated(dev)
        out["max_memory_reserved"] = torch.cuda.max_memory_reserved(dev)
        free, total = torch.cuda.mem_get_info(dev)
        out["mem_get_info_at_oom"] = {"free": free, "total": total}
        try:
            st = torch.cuda.memory_stats(dev)
            out["stats"] = {
                k: st.get(k)
                for k in ("num_alloc_retries", "num_ooms", "num_device_alloc", "num_device_free")
            }
        except Exception:  # not every backend keeps stats
            pass
        del tensors
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        out["memory_reserved_after_empty_cache"] = torch.cuda.memory_reserved(dev)
        free, total = torch.cuda.mem_get_info(dev)
        out["mem_get_info_after_empty_cache"] = {"free": free, "total": total}
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"
        out["traceback"] = traceback.format_exc()[-2000:]
    return emit()


if __name__ == "__main__":
    sys.exit(main())
