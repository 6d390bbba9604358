#!/usr/bin/env python3
"""gpuslice GPU kit driver: runs the kit's programs and PyTorch workloads with
no library, with libgpuslice.so and with each peer library (--peer) preloaded,
checks what they print and writes one JSON report and a Markdown table.

Sections (each runs even when another failed; a failure is recorded, not raised):
  environment  GPU, driver, CUDA and PyTorch versions (no interposer)
  allocation   every allocation path allocates until refused under a memory limit
  lookup       cuGetProcAddress_v2 and dlsym hand out the interposer's functions
  nvml         NVML and nvidia-smi show the limit and the container's usage
  pytorch      PyTorch runs out of memory at the limit (skipped without torch)
  workloads    PyTorch training, launch-bound inference, CUDA graphs, allocation patterns
  compute      achieved compute share vs CUDA_DEVICE_SM_LIMIT: alone, pairs, priority, training
  agent_view   NVML's per-process memory and utilisation beside the region file
  overhead     launch, allocation, training and inference cost vs no library (interleaved)

allocation, pytorch, workloads, compute, agent_view and overhead run once per
library; a peer's failed checks are findings about the peer, and the verdict
(and the exit status) is about gpuslice alone.

Python 3 standard library only. Exit status: 0 when nothing failed, 1 when a
check failed or a section could not run, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import time
import traceback

from kitrun import budget
from kitrun.agentview import AgentViewSection
from kitrun.base import KitBase
from kitrun.common import (
    ALLOC_PATHS,
    PER_LIBRARY,
    SECTIONS,
    parse_int_list,
    parse_named,
    parse_sections,
    parse_size,
)
from kitrun.compute import ComputeSection
from kitrun.markdown import to_markdown
from kitrun.memory import MemorySections
from kitrun.overhead import OverheadSection
from kitrun.report import git_commit, human_summary, libraries_info, summarize, write_report
from kitrun.workloads import WorkloadsSection


class Kit(
    MemorySections,
    WorkloadsSection,
    ComputeSection,
    AgentViewSection,
    OverheadSection,
    KitBase,
):
    """Every section, on the shared core."""


def parse_pairs(text: str) -> list[list[int]]:
    """ "30/70,50/50" -> [[30, 70], [50, 50]]."""
    out = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        parts = item.split("/")
        try:
            pair = [int(p) for p in parts]
        except ValueError:
            pair = []
        if len(pair) != 2 or not all(0 < p <= 100 for p in pair):
            raise argparse.ArgumentTypeError(f"not a pair of limits like 30/70: {item!r}")
        out.append(pair)
    return out


def build_parser() -> argparse.ArgumentParser:
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser(
        description="Run the gpuslice GPU kit (needs an NVIDIA GPU) and write a JSON report.",
        epilog="Usually run through `make -C native gpu-check` or `gpu-proof`. Sections: "
        + ", ".join(SECTIONS),
    )
    p.add_argument("--kit", help="the kit binary (built by native/gpu/Makefile)")
    p.add_argument("--lib", help="libgpuslice.so to preload")
    p.add_argument(
        "--peer",
        type=parse_named,
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="a peer library measured beside gpuslice with the same environment, "
        "e.g. hami=/opt/hami/libvgpu.so (repeatable)",
    )
    p.add_argument(
        "--peer-note",
        type=parse_named,
        action="append",
        default=[],
        metavar="NAME=TEXT",
        help="what a peer is (its commit, its build type), kept in the report",
    )
    p.add_argument("--out", default="gpu-report.json", help="report path (default: %(default)s)")
    p.add_argument(
        "--report-dir",
        help="also write the report as DIR/<date>-<gpu>.json and .md (e.g. docs/gpu)",
    )
    p.add_argument("--lib-build-rc", help="file holding the library build's exit status")
    p.add_argument("--only", type=parse_sections, help="comma-separated sections to run")
    p.add_argument(
        "--skip", type=parse_sections, default=[], help="comma-separated sections to leave out"
    )
    p.add_argument(
        "--budget",
        type=float,
        help="seconds the whole run should take: sections that scale shrink to fit, and "
        "sections not started by 1.25 x this are skipped",
    )
    p.add_argument("--device", type=int, default=0, help="CUDA device ordinal (default: 0)")
    p.add_argument(
        "--limit",
        type=parse_size,
        default=parse_size("4g"),
        help="CUDA_DEVICE_MEMORY_LIMIT for memory sections (default: 4g)",
    )
    p.add_argument(
        "--chunk",
        type=parse_size,
        default=parse_size("300m"),
        help="bytes per allocation in the allocation section (default: 300m)",
    )
    p.add_argument(
        "--paths",
        type=lambda s: [x for x in s.split(",") if x],
        default=list(ALLOC_PATHS),
        help="allocation paths to test (default: all)",
    )
    p.add_argument(
        "--context-overhead",
        type=int,
        default=0,
        help="GPUSLICE_CONTEXT_OVERHEAD in bytes (default: 0 = count allocations only)",
    )
    p.add_argument(
        "--log-level", type=int, help="LIBCUDA_LOG_LEVEL for preloaded runs (default: unset)"
    )
    p.add_argument("--python", default="python3", help="Python with PyTorch (default: %(default)s)")
    p.add_argument("--torch-script", default=os.path.join(here, "torch_oom.py"))
    p.add_argument("--workload-script", default=os.path.join(here, "torch_workloads.py"))
    p.add_argument(
        "--torch-step",
        type=parse_size,
        default=parse_size("200m"),
        help="bytes per tensor in the PyTorch section (default: 200m)",
    )
    p.add_argument(
        "--train-steps", type=int, default=30, help="training steps in the workloads section"
    )
    p.add_argument(
        "--infer-iters", type=int, default=300, help="inference iterations per measurement"
    )
    p.add_argument(
        "--graph-tolerance",
        type=float,
        default=1e-3,
        help="max abs difference of CUDA-graph replay vs eager (default: 1e-3)",
    )
    p.add_argument(
        "--kernel-ms", type=float, default=2.0, help="calibrated kernel duration (default: 2)"
    )
    p.add_argument(
        "--compute-seconds", type=float, default=4.0, help="seconds per compute run (default: 4)"
    )
    p.add_argument(
        "--compute-warmup", type=float, default=0.5, help="warm-up seconds per compute run"
    )
    p.add_argument(
        "--compute-targets",
        type=parse_int_list,
        default=[10, 30, 50, 70, 90],
        help="CUDA_DEVICE_SM_LIMIT values, single process (default: 10,30,50,70,90)",
    )
    p.add_argument(
        "--pairs",
        type=parse_pairs,
        default=[[30, 70], [50, 50]],
        help="limits of concurrent pairs (default: 30/70,50/50)",
    )
    p.add_argument(
        "--no-priority-pair",
        dest="priority_pair",
        action="store_false",
        help="leave out the high/low priority pair",
    )
    p.add_argument(
        "--train-share",
        type=int,
        default=50,
        help="CUDA_DEVICE_SM_LIMIT of the training loop in the compute section (default: 50)",
    )
    p.add_argument(
        "--train-seconds",
        type=float,
        default=6.0,
        help="seconds of training per compute measurement (default: 6)",
    )
    p.add_argument(
        "--pair-start-delay",
        type=float,
        default=6.0,
        help="seconds from starting a pair to their common start (default: 6)",
    )
    p.add_argument(
        "--tolerance-pp",
        type=float,
        default=5.0,
        help="allowed |achieved - target| in percentage points, pass/fail (default: 5)",
    )
    p.add_argument(
        "--goal-pp",
        type=float,
        default=3.0,
        help="the accuracy goal reported beside each share (default: 3)",
    )
    p.add_argument(
        "--view-seconds", type=float, default=4.0, help="seconds per agent_view workload"
    )
    p.add_argument(
        "--view-sm", type=int, default=50, help="CUDA_DEVICE_SM_LIMIT in agent_view (default: 50)"
    )
    p.add_argument("--launch-count", type=int, default=200000, help="empty-kernel launches per run")
    p.add_argument(
        "--alloc-pairs", type=int, default=20000, help="cuMemAlloc_v2+cuMemFree_v2 pairs per run"
    )
    p.add_argument(
        "--rounds",
        "--repeat",
        type=int,
        default=5,
        help="interleaved rounds of the overhead section (median; default: 5)",
    )
    p.add_argument(
        "--bench-train-seconds",
        type=float,
        default=4.0,
        help="seconds of training per overhead round (default: 4)",
    )
    p.add_argument(
        "--timeout", type=float, default=180.0, help="seconds per program (default: 180)"
    )
    p.add_argument("--nvidia-smi", default="nvidia-smi", help="nvidia-smi to run (name or path)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="short runs (1 s compute, fewer launches): plumbing checks, not measurements",
    )
    p.add_argument(
        "--keep-tmp", action="store_true", help="keep the temporary directory of region files"
    )
    p.add_argument("--no-fail", action="store_true", help="exit 0 even when checks fail")
    return p


def check_args(args) -> str | None:
    if not args.kit:
        return "--kit is required (build it with `make -C native/gpu programs`)"
    if not os.access(args.kit, os.X_OK):
        return f"kit binary not executable: {args.kit}"
    bad = [p for p in args.paths if p not in ALLOC_PATHS]
    if bad:
        return f"unknown allocation path(s) {bad}; known: {', '.join(ALLOC_PATHS)}"
    names = [n for n, _ in args.peer]
    if len(set(names)) != len(names):
        return f"a peer name is given twice: {names}"
    stray = [n for n, _ in args.peer_note if n not in names]
    if stray:
        return f"--peer-note for no --peer: {stray}"
    if args.train_share is not None and not 0 < args.train_share <= 100:
        return f"--train-share {args.train_share}: not a percentage"
    return None


def quicken(args) -> None:
    args.compute_seconds = min(args.compute_seconds, 1.0)
    args.compute_warmup = min(args.compute_warmup, 0.2)
    args.pair_start_delay = min(args.pair_start_delay, 3.0)
    args.launch_count = min(args.launch_count, 20000)
    args.alloc_pairs = min(args.alloc_pairs, 2000)
    args.rounds = min(args.rounds, 2)
    args.train_seconds = min(args.train_seconds, 1.0)
    args.bench_train_seconds = min(args.bench_train_seconds, 0.5)
    args.train_steps = min(args.train_steps, 5)
    args.infer_iters = min(args.infer_iters, 20)
    args.view_seconds = min(args.view_seconds, 2.0)


def settings(args, selected) -> dict:
    keys = [
        "limit",
        "chunk",
        "context_overhead",
        "torch_step",
        "kernel_ms",
        "compute_seconds",
        "compute_targets",
        "pairs",
        "priority_pair",
        "train_share",
        "train_seconds",
        "train_steps",
        "infer_iters",
        "graph_tolerance",
        "tolerance_pp",
        "goal_pp",
        "view_seconds",
        "view_sm",
        "launch_count",
        "alloc_pairs",
        "rounds",
        "bench_train_seconds",
        "budget",
        "quick",
    ]
    out = {k: getattr(args, k) for k in keys}
    out["memory_limit"] = out.pop("limit")
    out["sections"] = selected
    return out


def dated_name(report: dict) -> str:
    """<date>-<gpu>, e.g. 2026-05-01-nvidia-h200."""
    gpu = (report.get("environment") or {}).get("name") or "unknown-gpu"
    slug = re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-") or "gpu"
    return f"{report['kit']['started_utc'][:10]}-{slug}"


def save(report: dict, out: str, report_dir: str | None) -> None:
    report.pop("summary", None)
    report["summary"] = summarize(report)
    write_report(out, report)
    md = to_markdown(report)
    md_path = os.path.splitext(out)[0] + ".md"
    with open(md_path + ".tmp", "w") as f:
        f.write(md)
    os.replace(md_path + ".tmp", md_path)
    if report_dir:
        base = os.path.join(report_dir, dated_name(report))
        write_report(base + ".json", report)
        shutil.copyfile(md_path, base + ".md")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    why = check_args(args)
    if why:
        print(f"run_kit.py: {why}", file=sys.stderr)
        return 2
    if args.quick:
        quicken(args)
    selected = [s for s in (args.only or SECTIONS) if s not in args.skip]

    kit = Kit(args)
    n_libs = len(kit.libs())
    torch = kit.torch_probe()["ok"]
    fitted = budget.fit(args, selected, n_libs, torch) if args.budget else []
    est = budget.estimate(args, selected, n_libs, torch)
    total = round(sum(est.values()))
    print(
        f"[gpu kit] {n_libs} librar{'y' if n_libs == 1 else 'ies'} "
        f"({', '.join(x.name for x in kit.libs()) or 'none'}), PyTorch "
        f"{'yes' if torch else 'no'}: expected duration about {total} s"
        + (f" (budget {args.budget:.0f} s)" if args.budget else ""),
        file=sys.stderr,
        flush=True,
    )
    for c in fitted:
        print(f"[gpu kit] budget: {c}", file=sys.stderr)
    t0 = time.time()
    report: dict = {
        "kit": {
            "version": 2,
            "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)),
            "argv": sys.argv,
            "commit": git_commit(),
            "tmp_dir": kit.tmp,
            "expected_s": est,
            "budget_changes": fitted,
        },
        "libraries": libraries_info(kit.ours, kit.peers, args.lib_build_rc),
        "settings": settings(args, selected),
    }
    report["library"] = report["libraries"].get("gpuslice") or {"path": None, "exists": False}
    out = os.path.abspath(args.out)
    started = time.monotonic()
    for name in SECTIONS:
        if name not in selected:
            report[name] = {"status": "skipped", "reason": "not selected"}
            continue
        if args.budget and time.monotonic() - started > 1.25 * args.budget:
            report[name] = {"status": "skipped", "reason": "time budget spent"}
            save(report, out, args.report_dir)
            continue
        ts = time.monotonic()
        per = " (per library)" if name in PER_LIBRARY else ""
        print(
            f"[gpu kit] {name}{per} ... (about {est.get(name, 0):.0f} s)",
            file=sys.stderr,
            flush=True,
        )
        try:
            report[name] = getattr(kit, f"sec_{name}")()
        except Exception as e:  # one section's bug must not lose the others
            report[name] = {
                "status": "error",
                "error": f"{type(e).__name__}: {e}",
                "traceback": traceback.format_exc(),
            }
        report[name]["section_s"] = round(time.monotonic() - ts, 2)
        print(
            f"[gpu kit] {name}: {report[name].get('status')} ({report[name]['section_s']} s)",
            file=sys.stderr,
            flush=True,
        )
        save(report, out, args.report_dir)  # a run cut short keeps what it finished
    report["kit"]["duration_s"] = round(time.time() - t0, 1)
    report["kit"]["finished_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    save(report, out, args.report_dir)
    if not args.keep_tmp:
        shutil.rmtree(kit.tmp, ignore_errors=True)
    print(human_summary(report))
    print(f"report: {out} and {os.path.splitext(out)[0]}.md")
    if args.report_dir:
        print(f"copies: {os.path.join(args.report_dir, dated_name(report))}.json/.md")
    if report["summary"]["status"] != "pass" and not args.no_fail:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
