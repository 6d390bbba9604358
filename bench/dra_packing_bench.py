"""DRA placement against gpuslice's on the four openb traces, in the same run.

gpuslice's own placement (the engine chooses node and cards; the fragmentation
policy) is the baseline, at the default limit of 10 pods per card and without
a limit, as DRA has none. Beside it the DRA models of ``gpuslice sim
--placement`` (:mod:`gpuslice_scheduler.drafit`): ``dra-first-fit``, DRA without
the extender (kube-scheduler's own node scores, cards first fit in device order),
and ``dra+extender``, the extender's best node for the claim, cards first fit.

Usage: python bench/dra_packing_bench.py [--traces DIR] [--seeds 42-51] [--jobs 2]
       [--trace NAME ...]
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from datetime import date
from pathlib import Path

from gpuslice_scheduler.sim import (
    DRA_EXTENDER,
    DRA_FIRST_FIT,
    GPUSLICE,
    NO_SLOT_LIMIT,
    RunResult,
    parse_seeds,
    replay_many,
    summarise,
)

TRACES = ("default", "gpushare40", "gpuspec33", "multigpu50")
POLICY = "fragmentation"
HERE = Path(__file__).resolve().parent
# column -> (placement, pods per card)
COLUMNS = {
    "gpuslice": (GPUSLICE, None),
    "gpuslice, no pod limit": (GPUSLICE, NO_SLOT_LIMIT),
    "dra+extender": (DRA_EXTENDER, None),
    "dra-first-fit": (DRA_FIRST_FIT, None),
}


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
    parser.add_argument("--trace", action="append", choices=TRACES)
    args = parser.parse_args()
    seeds = parse_seeds(args.seeds)
    nodes = args.traces / "openb_node_list_gpu_node.csv"
    print(
        f"# DRA packing benchmark, {date.today()}, {platform.node()}, "
        f"{os.cpu_count()} CPUs ({platform.machine()}), seeds {args.seeds}, policy {POLICY}"
    )
    print("# allocation % at 130 % arrived demand / GPUs' worth unallocated / failed pods")
    header = ["trace", *COLUMNS, "dra+extender - gpuslice", "dra-first-fit - gpuslice"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for trace in args.trace or TRACES:
        started = time.perf_counter()
        pods = args.traces / f"openb_pod_list_{trace}.csv"
        mean: dict[str, dict[str, float]] = {}
        for column, (placement, split) in COLUMNS.items():
            results: list[RunResult] = replay_many(
                nodes,
                pods,
                [POLICY],
                seeds,
                jobs=args.jobs,
                placements=[placement],
                **({"split_count": split} if split else {}),
            )
            mean[column] = next(iter(summarise(results).values()))
        ratio = {c: mean[c]["milli_gpu_allocation_ratio"] for c in COLUMNS}
        row = [trace]
        row += [
            f"{ratio[c]:.2f} / {mean[c]['unallocated_gpus']:.0f} / {mean[c]['failed_pods']:.0f}"
            for c in COLUMNS
        ]
        row += [f"{ratio[c] - ratio['gpuslice']:+.2f}" for c in ("dra+extender", "dra-first-fit")]
        print("| " + " | ".join(row) + " |", flush=True)
        print(f"#   {trace}: {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
