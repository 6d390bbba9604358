"""The report as Markdown tables (memory, compute, overhead, PyTorch, the
agent's NVML view), one column per library: none, gpuslice, each peer.
Every figure comes from the JSON report; what was not measured reads "n/a"."""

from __future__ import annotations

from .common import MiB, dig

NA = "n/a"


def _n(v, digits=0, unit=""):
    if v is None:
        return NA
    if isinstance(v, bool):
        return "yes" if v else "no"
    return f"{v:.{digits}f}{unit}"


def _mb(v):
    return NA if v is None else f"{v / MiB:.0f} MiB"


def _mark(status):
    return {"pass": "", "fail": " ✗", "error": " (error)"}.get(status or "", "")


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    if not rows:
        return ["(not measured in this run)", ""]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return [*out, ""]


def _libs(report: dict) -> list[str]:
    names = [n for n in (report.get("libraries") or {}) if n != "none"]
    return ["none", *names]


def _entry(sec: dict, name: str):
    """A per-library section's entry for `name` (none, gpuslice or a peer)."""
    if not isinstance(sec, dict):
        return None
    if name == "none":
        return sec.get("none")
    if name == "gpuslice":
        return sec if sec.get("status") not in (None, "error", "skipped") else None
    return (sec.get("peers") or {}).get(name)


def to_markdown(report: dict) -> str:
    env = report.get("environment") or {}
    kit = report.get("kit") or {}
    libs = _libs(report)
    out = [
        f"# gpuslice GPU proof: {env.get('name', '?')}",
        "",
        f"- driver {env.get('driver_version', '?')}, CUDA (driver) "
        f"{env.get('cuda_driver_version_str', '?')}, {_mb(env.get('total_mem'))}, "
        f"{env.get('sm_count', '?')} SMs",
        f"- PyTorch {env.get('torch') or NA} (CUDA {env.get('torch_cuda') or NA})",
        f"- run {kit.get('started_utc', '?')}, {kit.get('duration_s', '?')} s, "
        f"commit {kit.get('commit') or '?'}",
        f"- result (gpuslice): {(report.get('summary') or {}).get('status', '?')}",
        "",
        "| library | path | sha256 | note |",
        "|---|---|---|---|",
    ]
    for name, lib in (report.get("libraries") or {}).items():
        if name == "none":
            continue
        out.append(
            f"| {name} | `{lib.get('path')}` | `{(lib.get('sha256') or NA)[:16]}` | "
            f"{lib.get('note') or ''} |"
        )
    out.append("")
    out += _memory(report, libs) + _compute(report, libs) + _overhead(report)
    out += _workloads(report, libs) + _agent_view(report, libs)
    findings = (report.get("summary") or {}).get("peer_findings") or {}
    if findings:
        out += ["## Findings about peers", ""]
        for peer, items in findings.items():
            out.append(f"- {peer}: {len(items)} failed checks or warnings (see the JSON report)")
        out.append("")
    return "\n".join(out)


def _memory(report: dict, libs: list[str]) -> list[str]:
    al, pt = report.get("allocation") or {}, report.get("pytorch") or {}
    rows = []
    for path in al.get("paths") or {}:
        row = [f"`{path}`: allocations of {_mb(al.get('chunk'))} accepted", "—"]
        for name in libs[1:]:
            e = dig(_entry(al, name), "paths", path)
            row.append(NA if e is None else _n(e.get("accepted")) + _mark(e.get("status")))
        rows.append(row)
    for conf in pt.get("runs") or {}:
        row = [f"PyTorch `{conf}`: reserved at OOM", "—"]
        for name in libs[1:]:
            e = dig(_entry(pt, name), "runs", conf)
            row.append(
                NA
                if e is None
                else _mb(dig(e, "result", "memory_reserved_at_oom")) + _mark(e.get("status"))
            )
        rows.append(row)
    title = f"## Memory (limit {_mb(al.get('limit') or pt.get('limit'))})"
    return [title, "", *_table(["", *libs], rows)]


def _compute(report: dict, libs: list[str]) -> list[str]:
    cp = report.get("compute") or {}
    goal = cp.get("goal_pp")
    rows = []
    ref = cp.get("reference_kernels_per_s")
    if ref:
        rows.append(["reference kernels/s (no library)", _n(ref, 1)] + ["—"] * (len(libs) - 1))

    def cell(x):
        if not isinstance(x, dict) or x.get("achieved_pct") is None:
            return NA
        return f"{x['achieved_pct']:.1f} ({x['error_pp']:+.1f} pp)"

    entries = {n: _entry(cp, n) for n in libs[1:]}
    rows.append(
        ["policy=disable (want 100)", "—"]
        + [_n(dig(entries[n], "policy_disable_share_pct"), 1) for n in libs[1:]]
    )
    for i, x in enumerate(cp.get("single") or []):
        t = x["target_pct"]
        rows.append([f"limit {t} %", "—"] + [cell(dig(entries[n], "single", i)) for n in libs[1:]])
    for key in cp.get("pairs") or {}:
        row = [f"pair {key} (together)", "—"]
        for n in libs[1:]:
            procs = dig(entries[n], "pairs", key, "procs") or []
            row.append(" / ".join(cell(p) for p in procs) if procs else NA)
        rows.append(row)
    if cp.get("priority"):
        row = ["priority pair high / low (want 100 / 0)", "—"]
        for n in libs[1:]:
            procs = dig(entries[n], "priority", "procs") or []
            row.append(" / ".join(cell(p) for p in procs) if procs else NA)
        rows.append(row)
    if cp.get("train") or cp.get("train_reference_steps_per_s"):
        rows.append(
            [
                f"training at {dig(cp, 'train', 'target_pct') or '?'} %",
                _n(cp.get("train_reference_steps_per_s"), 2, " steps/s"),
            ]
            + [cell(dig(entries[n], "train")) for n in libs[1:]]
        )
    head = f"## Compute (share of the GPU, %; goal ±{goal} pp, pass ±{cp.get('tolerance_pp')} pp)"
    return [head, "", *_table(["", *libs], rows if len(rows) > 1 else [])]


def _overhead(report: dict) -> list[str]:
    ov = report.get("overhead") or {}
    configs = ov.get("configs") or {}
    vs = ov.get("vs_none") or {}
    names = list(configs)
    rows = []
    metrics = (
        ("launch_ns", "empty kernel launch, ns", 0),
        ("allocpair_ns", "cuMemAlloc+cuMemFree 1 MiB, ns", 0),
        ("train_steps_per_s", "training, steps/s", 2),
        ("infer_ms_median", "inference batch 1, ms median", 3),
        ("infer_ms_p95", "inference batch 1, ms p95", 3),
    )
    for key, label, digits in metrics:
        row = [label]
        for n in names:
            v = configs[n].get(key)
            txt = _n(v, digits)
            sd = dig(vs, n, key + "_slowdown_pct")
            if sd is not None:
                txt += f" ({sd:+.2f} %)"
            row.append(txt)
        if any(c != NA for c in row[1:]):
            rows.append(row)
    goals = ov.get("goals") or {}
    head = (
        f"## Overhead (median of {ov.get('rounds')} interleaved rounds; slowdown vs none; "
        f"goals ≤ {goals.get('train_slowdown_pct_max')} % training, "
        f"≤ {goals.get('launch_bound_slowdown_pct_max')} % launch-bound)"
    )
    return [head, "", *_table(["", *names], rows)]


def _workloads(report: dict, libs: list[str]) -> list[str]:
    wl = report.get("workloads") or {}
    rows = []
    fields = (
        ("train", "steps_per_s", "training, steps/s", 2),
        ("train", "loss_final", "training, final loss", 4),
        ("infer", "ms_median", "inference, ms median", 3),
        ("infer", "ms_p95", "inference, ms p95", 3),
        ("graph", "max_abs_diff", "CUDA graph vs eager, max abs diff", 6),
    )
    for part, key, label, digits in fields:
        row = [label] + [_n(dig(_entry(wl, n), part, key), digits) for n in libs]
        if any(c != NA for c in row[1:]):
            rows.append(row)
    for conf in ("default", "expandable_segments", "cudaMallocAsync"):
        row = [f"mixed sizes `{conf}`: peak reserved / regrow"]
        for n in libs:
            r = dig(_entry(wl, n), "alloc", conf, "result")
            row.append(
                "—"
                if n == "none"
                else NA
                if not r
                else f"{_mb(r.get('max_memory_reserved'))} / {_n(r.get('regrow_ok'))}"
            )
        if any(c not in (NA, "—") for c in row[1:]):
            rows.append(row)
    return ["## PyTorch workloads", "", *_table(["", *libs], rows)]


def _agent_view(report: dict, libs: list[str]) -> list[str]:
    av = report.get("agent_view") or {}
    rows = []
    fields = (
        ("nvml_used_max", "NVML per-process memory", _mb),
        ("nvml_sm_util_mean", "NVML per-process SM %", lambda v: _n(v, 1)),
        ("region_used", "region file: container used", _mb),
        ("region_proc_used", "region file: this process", _mb),
    )
    for key, label, fmt in fields:
        row = [label] + [fmt(dig(_entry(av, n), key)) for n in libs]
        if any(c != NA for c in row[1:]):
            rows.append(row)
    head = f"## Node agent's view (holding {_mb(av.get('hold'))}, SM limit {av.get('sm_limit')} %)"
    return [head, "", *_table(["", *libs], rows)]
