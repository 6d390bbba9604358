"""Packing: every policy on the four openb traces and on workloads derived from the
default one, seeds 42-51, beside the published numbers.

The derived workloads are made the way openb's own variants were (``sim.Derivation``):
the default trace with sharing pods raised to 60, 80 and 100 % of the GPU demand, and
with every pod's CPU request scaled 2x and 2.5x.

Usage: python bench/packing_bench.py [--traces DIR] [--seeds 42-51] [--jobs 2]
       [--policy P ...] [--trace NAME ...] [--plot DIR]
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from datetime import date
from pathlib import Path

from gpuslice_scheduler.sim import POLICIES, Derivation, parse_seeds, replay_many, summarise

# milli-GPU allocation at 130% arrived, mean of 10 seeds (FGD paper, ATC'23)
PUBLISHED = {
    "default": {"BestFit": 93.08, "FGD": 95.39},
    "gpushare40": {"BestFit": 91.69, "FGD": 94.15},
    "gpuspec33": {"BestFit": 93.09, "FGD": 94.55},
    "multigpu50": {"BestFit": 95.74, "FGD": 97.18},
}
DERIVED = [Derivation(sharing=s) for s in (0.6, 0.8, 1.0)]
DERIVED += [Derivation(cpu_scale=f) for f in (2.0, 2.5)]
# name -> (trace file, derivation)
WORKLOADS: dict[str, tuple[str, Derivation | None]] = {t: (t, None) for t in PUBLISHED}
WORKLOADS |= {f"default{d.suffix}": ("default", d) for d in DERIVED}
HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--traces",
        type=Path,
        default=HERE / "traces" / "openb",
        help="the openb traces (make traces)",
    )
    parser.add_argument("--seeds", default="42-51")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--policy", action="append", choices=list(POLICIES))
    parser.add_argument("--trace", action="append", choices=list(WORKLOADS))
    parser.add_argument("--plot", type=Path, help="also draw each workload's curves here")
    args = parser.parse_args()
    seeds = parse_seeds(args.seeds)
    policies = args.policy or list(POLICIES)
    nodes = args.traces / "openb_node_list_gpu_node.csv"
    print(f"# packing benchmark, {date.today()}, {platform.node()}, {os.cpu_count()} CPUs")
    print(f"# seeds {args.seeds}, policies {', '.join(policies)}")
    header = ["workload", *policies, "published BestFit", "published FGD"]
    if "fragmentation" in policies and "fgd" in policies:
        header.append("fragmentation - fgd")
    header += [f"s/run ({p})" for p in policies if p in ("fragmentation", "fgd")]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for name in args.trace or list(WORKLOADS):
        trace, derivation = WORKLOADS[name]
        started = time.perf_counter()
        results = replay_many(
            nodes,
            args.traces / f"openb_pod_list_{trace}.csv",
            policies,
            seeds,
            jobs=args.jobs,
            derivation=derivation,
        )
        mean = summarise(results)
        ratio = {p: mean[p]["milli_gpu_allocation_ratio"] for p in policies}
        published = PUBLISHED.get(name, {})
        row = [name, *(f"{ratio[p]:.2f}" for p in policies)]
        row += [f"{published[k]:.2f}" if k in published else "-" for k in ("BestFit", "FGD")]
        if "fragmentation - fgd" in header:
            row.append(f"{ratio['fragmentation'] - ratio['fgd']:+.2f}")
        row += [f"{mean[p]['wall_seconds']:.2f}" for p in policies if p in ("fragmentation", "fgd")]
        print("| " + " | ".join(row) + " |", flush=True)
        unalloc = ", ".join(f"{p} {mean[p]['unallocated_gpus']:.0f}" for p in policies)
        print(f"#   {name}: unallocated GPUs {unalloc}; {time.perf_counter() - started:.0f} s")
        if args.plot is not None:
            from gpuslice_cli.simulate import draw

            args.plot.mkdir(parents=True, exist_ok=True)
            draw(results, args.plot / f"{name}.png", 1.3)


if __name__ == "__main__":
    main()
