"""What the interposer adds per hooked call, on the fake CUDA driver.

Runs native/build/launch_bench without the interposer (the baseline, same run) and
with it preloaded:
  - kernel launches: without limits (the launch fast path: no SM limit), and with
    CUDA_DEVICE_SM_LIMIT=30 (policy force) while the GPU stays below that share;
  - cuMemAlloc_v2 + cuMemFree_v2 pairs of 1 MiB: without limits, and with a memory
    limit and a shared region file (the allocation path every limited container
    takes).
Reports wall-clock ns per call (median of --repeat runs) and instructions per
call from callgrind, counted inside the loop only and taken as the slope between
two loop lengths, so start-up work cancels out. Instruction counts are exact and
repeatable; the nanoseconds depend on the machine and the fake's own queue.

Below its share: the compute limiter charges a window of launches the GPU time it
spans, so a tight loop of even empty kernels is a GPU busy all the time, and at 30
% the limiter would make it wait most of the time. Every launch row therefore runs
`launch_bench paced`: empty kernels (0 us on the fake) in bursts of 64, each burst
followed by a pause four times as long as it took (at least 8 ms: the limiter's
pause watcher may see a pause begin a millisecond or two late on a loaded machine
and charges that part as busy), and only the bursts are timed. The GPU is then
busy about 20 % of the time however slow the launches are, valgrind included. Each
limited run gets a fresh region file, and the script reads back how long the
limiter made launches wait (`throttled_ns`): for the timed runs it must stay
within 1 % of their launching time (the script fails otherwise). Under callgrind,
launches run some 30 times slower against the same millisecond windows, and code
translated on first use can stall a burst for milliseconds, which the fake's clock
counts as GPU time; a wait there is reported, and its few instructions hardly move
the count.

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
# launch_bench op, and the loop lengths for callgrind's slope (long, short)
OPS = {"launch": "paced", "alloc": "alloc"}
CALLS = {"launch": (200_000, 20_000), "alloc": (50_000, 5_000)}
WALL_CALLS = {"launch": 50_000, "alloc": 50_000}
SM_LIMIT = 30
# The limiter's pause watcher may see a pause begin late on a loaded machine and
# charge that part as busy: waits up to this part of the timed launching time
# move ns/call by as little, and are reported; more fails the run.
WAIT_TOLERANCE = 0.01


def env_for(build: Path, mode: str, region: Path) -> dict[str, str]:
    env = {**os.environ, "LD_LIBRARY_PATH": str(build / "fake"), "GPUSLICE_CONTEXT_OVERHEAD": "0"}
    for key in list(env):
        if key.startswith(("CUDA_", "GPU_CORE_", "GPUSLICE_NATS")) or key == "LD_PRELOAD":
            env.pop(key)
    if mode != "none":
        env["LD_PRELOAD"] = str(build / "libgpuslice.so")
    if mode == "limited":
        env["CUDA_DEVICE_MEMORY_LIMIT"] = "64g"
        env["CUDA_DEVICE_MEMORY_SHARED_CACHE"] = str(region)
    if mode == "sm-limit":
        env["CUDA_DEVICE_SM_LIMIT"] = str(SM_LIMIT)
        env["GPU_CORE_UTILIZATION_POLICY"] = "force"
        env["CUDA_DEVICE_MEMORY_SHARED_CACHE"] = str(region)
    return env


def throttled_ms(region: Path) -> float | None:
    """How long the limiter made launches wait, from the region file (None when the
    project's Python package is not importable, e.g. under the system python3)."""
    try:
        from gpuslice_common.region import Region
    except ImportError:
        return None
    with Region.open(region) as opened:
        return opened.devices()[0].throttled_ns / 1e6


class Runner:
    """Runs launch_bench in one mode, each run with a fresh region file, and keeps
    what the limiter made it wait (timed runs and callgrind runs apart)."""

    def __init__(self, build: Path, tmp: Path) -> None:
        self.build = build
        self.tmp = tmp
        self.runs = 0
        self.waited: dict[str, list[float | None]] = {"wall": [], "callgrind": []}

    def region(self) -> Path:
        self.runs += 1
        return self.tmp / f"region-{self.runs}.cache"

    def note(self, kind: str, mode: str, region: Path) -> None:
        if mode == "sm-limit":
            self.waited[kind].append(throttled_ms(region))

    def timed_ms(self, op: str, ns_per_call: float, repeat: int) -> float:
        """The launching time of the timed runs of one mode, in ms."""
        return ns_per_call * WALL_CALLS[op] * repeat / 1e6

    def wall_ns(self, op: str, mode: str, repeat: int) -> float:
        samples: list[float] = []
        for _ in range(repeat):
            region = self.region()
            out = subprocess.run(
                [str(self.build / "launch_bench"), OPS[op], str(WALL_CALLS[op])],
                env=env_for(self.build, mode, region),
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            samples.append(float(json.loads(out)["ns_per_call"]))
            self.note("wall", mode, region)
        return statistics.median(samples)

    def instructions(self, op: str, mode: str, n: int) -> int:
        loop = "run_launches" if op == "launch" else "run_allocs"
        region = self.region()
        out = self.tmp / f"callgrind-{self.runs}.out"
        subprocess.run(
            [
                "valgrind",
                "--tool=callgrind",
                f"--callgrind-out-file={out}",
                f"--toggle-collect={loop}",
                str(self.build / "launch_bench"),
                OPS[op],
                str(n),
            ],
            env=env_for(self.build, mode, region),
            capture_output=True,
            text=True,
            check=True,
        )
        self.note("callgrind", mode, region)
        match = re.search(r"^summary:\s+(\d+)", out.read_text(), re.MULTILINE)
        if not match:
            raise SystemExit(f"no callgrind summary for {op} {mode}")
        return int(match.group(1))

    def per_call(self, op: str, mode: str) -> float:
        """Instructions per call: the slope between a long and a short loop."""
        long_n, short_n = CALLS[op]
        a = self.instructions(op, mode, long_n)
        b = self.instructions(op, mode, short_n)
        return (a - b) / (long_n - short_n)


def describe_waits(kind: str, waits: list[float | None]) -> str:
    if not waits:
        return f"{kind}: not run"
    if any(w is None for w in waits):
        return f"{kind}: not read (gpuslice_common is not importable)"
    return f"{kind}: {sum(w or 0.0 for w in waits):.1f} ms in {len(waits)} runs"


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
    header = f"{'call':<28}{'mode':<22}{'ns/call':>10}{'added ns':>10}"
    header += f"{'instr/call':>12}{'added instr':>13}" if use_callgrind else ""
    print(header)
    modes = {
        "launch": (("none", "no interposer"), ("preloaded", "no SM limit"),
                   ("sm-limit", f"SM limit {SM_LIMIT} %")),
        "alloc": (("none", "no interposer"), ("preloaded", "preloaded"),
                  ("limited", "memory limit, region")),
    }  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        runner = Runner(build, Path(tmp))
        limited_ms = 0.0
        for op, name in (("launch", "cuLaunchKernel (paced)"), ("alloc", "alloc + free pair")):
            base_ns = runner.wall_ns(op, "none", args.repeat)
            base_instr = runner.per_call(op, "none") if use_callgrind else 0.0
            for mode, label in modes[op]:
                ns = base_ns if mode == "none" else runner.wall_ns(op, mode, args.repeat)
                if mode == "sm-limit":
                    limited_ms = runner.timed_ms(op, ns, args.repeat)
                line = f"{name:<28}{label:<22}{ns:>10.1f}{ns - base_ns:>10.1f}"
                if use_callgrind:
                    instr = base_instr if mode == "none" else runner.per_call(op, mode)
                    line += f"{instr:>12.1f}{instr - base_instr:>13.1f}"
                print(line, flush=True)
        print(f"SM limit {SM_LIMIT} %, time the limiter made launches wait:")
        for kind in ("wall", "callgrind"):
            print(
                "  " + describe_waits("timed runs" if kind == "wall" else kind, runner.waited[kind])
            )
        waited = sum(w or 0.0 for w in runner.waited["wall"])
        if None in runner.waited["wall"] or waited > WAIT_TOLERANCE * limited_ms:
            raise SystemExit("the limited launches were not below their share: see above")


if __name__ == "__main__":
    main()
