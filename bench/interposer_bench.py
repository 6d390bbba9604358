"""What the interposer adds per hooked call, on the fake CUDA driver.

Runs native/build/launch_bench (kernel launches; cuMemAlloc_v2 + cuMemFree_v2 pairs
of 1 MiB) without the interposer (the baseline, same run) and with it preloaded:
  - without limits (the launch fast path: no SM limit),
  - with a memory limit and a shared region file (the allocation path every
    limited container takes).
Reports wall-clock ns per call (median of --repeat runs) and instructions per
call from callgrind, counted inside the loop only and taken as the slope between
two loop lengths, so start-up work cancels out. Instruction counts are exact and
repeatable; the nanoseconds depend on the machine and the fake's own queue.

Usage: python bench/interposer_bench.py [--build native/build] [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import tempfile
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CALLS = {"launch": (200_000, 20_000), "alloc": (50_000, 5_000)}


def env_for(build: Path, mode: str, region: Path) -> dict[str, str]:
    env = {**os.environ, "LD_LIBRARY_PATH": str(build / "fake"), "GPUSLICE_CONTEXT_OVERHEAD": "0"}
    for key in ("LD_PRELOAD", "CUDA_DEVICE_MEMORY_LIMIT", "CUDA_DEVICE_SM_LIMIT"):
        env.pop(key, None)
    if mode != "none":
        env["LD_PRELOAD"] = str(build / "libgpuslice.so")
    if mode == "limited":
        env["CUDA_DEVICE_MEMORY_LIMIT"] = "64g"
        env["CUDA_DEVICE_MEMORY_SHARED_CACHE"] = str(region)
    return env


def wall_ns(build: Path, op: str, mode: str, region: Path, repeat: int) -> float:
    n = CALLS[op][0]
    samples = []
    for _ in range(repeat):
        out = subprocess.run(
            [str(build / "launch_bench"), op, str(n)],
            env=env_for(build, mode, region),
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        samples.append(json.loads(out)["ns_per_call"])
    return statistics.median(samples)


def instructions(build: Path, op: str, mode: str, region: Path, n: int) -> int:
    loop = "run_launches" if op == "launch" else "run_allocs"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        subprocess.run(
            [
                "valgrind",
                "--tool=callgrind",
                f"--callgrind-out-file={out}",
                f"--toggle-collect={loop}",
                str(build / "launch_bench"),
                op,
                str(n),
            ],
            env=env_for(build, mode, region),
            capture_output=True,
            text=True,
            check=True,
        )
        match = re.search(r"^summary:\s+(\d+)", out.read_text(), re.MULTILINE)
        if not match:
            raise SystemExit(f"no callgrind summary for {op} {mode}")
        return int(match.group(1))


def per_call(build: Path, op: str, mode: str, region: Path) -> float:
    """Instructions per call: the slope between a long and a short loop."""
    long_n, short_n = CALLS[op]
    a = instructions(build, op, mode, region, long_n)
    b = instructions(build, op, mode, region, short_n)
    return (a - b) / (long_n - short_n)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--build", type=Path, default=ROOT / "native/build")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--no-callgrind", action="store_true")
    args = parser.parse_args()
    build = args.build.resolve()
    if not (build / "launch_bench").exists():
        subprocess.run(
            ["make", "-C", str(ROOT / "native"), "all", "fakes", "build/launch_bench"], check=True
        )
    use_callgrind = not args.no_callgrind and shutil.which("valgrind") is not None
    print(
        f"machine: {platform.node()} {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs; {date.today()}"
    )
    header = f"{'call':<28}{'mode':<18}{'ns/call':>10}{'added ns':>10}"
    header += f"{'instr/call':>12}{'added instr':>13}" if use_callgrind else ""
    print(header)
    with tempfile.TemporaryDirectory() as tmp:
        region = Path(tmp) / "region.cache"
        for op, name in (("launch", "cuLaunchKernel"), ("alloc", "cuMemAlloc_v2+cuMemFree_v2")):
            base_ns = wall_ns(build, op, "none", region, args.repeat)
            base_instr = per_call(build, op, "none", region) if use_callgrind else 0.0
            for mode in ("none", "preloaded", "limited"):
                if op == "launch" and mode == "limited":
                    continue  # a memory limit does not touch the launch path
                ns = base_ns if mode == "none" else wall_ns(build, op, mode, region, args.repeat)
                line = f"{name:<28}{mode:<18}{ns:>10.1f}{ns - base_ns:>10.1f}"
                if use_callgrind:
                    instr = base_instr if mode == "none" else per_call(build, op, mode, region)
                    line += f"{instr:>12.1f}{instr - base_instr:>13.1f}"
                print(line, flush=True)


if __name__ == "__main__":
    main()
