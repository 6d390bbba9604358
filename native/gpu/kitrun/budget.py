"""How long a run takes, estimated from its settings before it starts, and
how a --budget shrinks the sections that scale (down to floors) so the
estimate fits. The per-program costs are estimates for an H100/H200 with a
warm page cache, not measurements."""

from __future__ import annotations

PROGRAM_S = 0.8  # a kit program: process, CUDA context, module load
TORCH_S = 5.0  # a PyTorch process: import, CUDA init, cuBLAS
LAUNCH_S = 3e-6  # one empty-kernel launch
ALLOCPAIR_S = 5e-6  # one cuMemAlloc_v2 + cuMemFree_v2 pair
INFER_ITER_S = 2e-3  # one batch-1 inference iteration, synchronised


def estimate(a, sections: list[str], n_libs: int, torch: bool) -> dict:
    """Seconds per section for n_libs libraries (gpuslice and the peers)."""
    n_libs = max(n_libs, 1)
    cs, warm = a.compute_seconds, a.compute_warmup
    run = cs + warm + PROGRAM_S
    pair = cs + a.pair_start_delay + PROGRAM_S
    t = TORCH_S if torch else 0.0
    train = (t + a.train_seconds + 2) if torch and a.train_share is not None else 0.0
    per_lib_compute = (
        (1 + len(a.compute_targets)) * run
        + len(a.pairs) * pair
        + (pair if a.priority_pair else 0)
        + train
    )
    bench = t + a.bench_train_seconds + a.infer_iters * INFER_ITER_S + 2 if torch else 0.0
    round_s = 2 * PROGRAM_S + a.launch_count * LAUNCH_S + a.alloc_pairs * ALLOCPAIR_S + bench
    est = {
        "environment": PROGRAM_S + t,
        "allocation": n_libs * len(a.paths) * (PROGRAM_S + 0.5),
        "lookup": PROGRAM_S + 1,
        "nvml": PROGRAM_S + 2,
        "pytorch": n_libs * 3 * (t + 2) if torch else 1,
        "workloads": ((n_libs + 1) * (t + 4) + n_libs * 3 * (t + 2)) if torch else 1,
        "compute": 2 + 2 * run + 2 * train + n_libs * per_lib_compute,
        "agent_view": (n_libs + 1) * (a.view_seconds + warm + PROGRAM_S + 1),
        "overhead": a.rounds * (1 + 2 * n_libs) * round_s,
    }
    return {k: round(v, 1) for k, v in est.items() if k in sections}


def fit(a, sections: list[str], n_libs: int, torch: bool) -> list[str]:
    """Shrink what scales until the estimate fits a.budget; what changed."""
    changed: list[str] = []
    steps = (
        ("compute_seconds", 2.0),
        ("bench_train_seconds", 2.0),
        ("train_seconds", 3.0),
        ("pair_start_delay", 3.0),
        ("view_seconds", 3.0),
        ("rounds", 3),
    )
    for name, floor in steps:
        if sum(estimate(a, sections, n_libs, torch).values()) <= a.budget:
            break
        old = getattr(a, name)
        if old > floor:
            setattr(a, name, floor)
            changed.append(f"{name} {old} -> {floor}")
    return changed
