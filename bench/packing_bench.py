"""Packing: every policy on the four openb traces, seeds 42-51, beside the published numbers.

Usage: python bench/packing_bench.py [--traces DIR] [--seeds 42-51] [--jobs 2] [--policy P ...]
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from datetime import date
from pathlib import Path

from gpuslice_scheduler.sim import POLICIES, parse_seeds, replay_many, summarise

# milli-GPU allocation at 130% arrived, mean of 10 seeds (FGD paper, ATC'23)
PUBLISHED = {
    "default": {"BestFit": 93.08, "FGD": 95.39},
    "gpushare40": {"BestFit": 91.69, "FGD": 94.15},
    "gpuspec33": {"BestFit": 93.09, "FGD": 94.55},
    "multigpu50": {"BestFit": 95.74, "FGD": 97.18},
}
HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--traces", type=Path, default=HERE.parent.parent / "shared/traces/openb")
    parser.add_argument("--seeds", default="42-51")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--policy", action="append", choices=list(POLICIES))
    parser.add_argument("--trace", action="append", choices=list(PUBLISHED))
    args = parser.parse_args()
    seeds = parse_seeds(args.seeds)
    policies = args.policy or list(POLICIES)
    nodes = args.traces / "openb_node_list_gpu_node.csv"
    print(f"# packing benchmark, {date.today()}, {platform.node()}, {os.cpu_count()} CPUs")
    print(f"# seeds {args.seeds}, policies {', '.join(policies)}")
    header = ["trace", *policies, "published BestFit", "published FGD", "s/run (fragmentation)"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for trace in args.trace or list(PUBLISHED):
        started = time.perf_counter()
        results = replay_many(
            nodes, args.traces / f"openb_pod_list_{trace}.csv", policies, seeds, jobs=args.jobs
        )
        mean = summarise(results)
        cells = [f"{mean[p]['milli_gpu_allocation_ratio']:.2f}" for p in policies]
        frag = mean.get("fragmentation", {}).get("wall_seconds", float("nan"))
        row = [
            trace,
            *cells,
            f"{PUBLISHED[trace]['BestFit']:.2f}",
            f"{PUBLISHED[trace]['FGD']:.2f}",
        ]
        print("| " + " | ".join([*row, f"{frag:.1f}"]) + " |", flush=True)
        unalloc = ", ".join(f"{p} {mean[p]['unallocated_gpus']:.0f}" for p in policies)
        print(f"#   {trace}: unallocated GPUs {unalloc}; {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
