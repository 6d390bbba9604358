"""The report: each library's identity, the pass/fail summary (about
gpuslice; a peer's failed checks are findings about the peer), the short
text summary and the Markdown table."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import time

from .common import SECTIONS, Lib, dig, mib


# --------------------------------------------------------------------------- report
def library_info(path: str | None, build_rc_file: str | None = None) -> dict:
    info: dict = {"path": os.path.abspath(path) if path else None}
    if path and os.path.isfile(path):
        st = os.stat(path)
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        info.update(
            exists=True,
            size=st.st_size,
            mtime_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(st.st_mtime)),
            sha256=h.hexdigest(),
        )
    else:
        info["exists"] = False
    if build_rc_file:
        try:
            with open(build_rc_file) as f:
                info["build_rc"] = int(f.read().strip() or "-1")
        except (OSError, ValueError) as e:
            info["build_rc_error"] = str(e)
    return info


def libraries_info(ours: Lib | None, peers: list[Lib], build_rc_file: str | None) -> dict:
    """Every library the run compares, by name: path, sha256 and, for a peer,
    the note given with --peer-note (its commit, its build type)."""
    out: dict = {"none": {"path": None, "note": "no library preloaded"}}
    if ours:
        out["gpuslice"] = {**library_info(ours.path, build_rc_file), "ours": True}
    for p in peers:
        out[p.name] = {**library_info(p.path), "ours": False, "note": p.note}
    return out


def git_commit() -> str | None:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        p = subprocess.run(
            ["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        )
        dirty = subprocess.run(
            ["git", "-C", here, "status", "--porcelain", "--", ".."],
            capture_output=True,
            text=True,
            timeout=10,
        )
        if p.returncode == 0:
            return p.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return None


def write_report(path: str, report: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1, sort_keys=False, default=str)
        f.write("\n")
    os.replace(tmp, path)


def summarize(report: dict) -> dict:
    failed, warnings, sections = [], [], {}
    lib = report.get("library", {})
    if lib.get("build_rc") not in (None, 0):
        failed.append(f"library build failed (rc={lib.get('build_rc')})")

    def walk(prefix, node):
        if isinstance(node, dict):
            for c in node.get("checks", []) or []:
                if not c.get("ok"):
                    text = f"{prefix}: {c.get('name')}"
                    if c.get("detail"):
                        text += f" [{' '.join(str(c['detail']).split())[:200]}]"
                    elif "value" in c:
                        text += (
                            f" [got {str(c['value'])[:120]}, want {str(c.get('expected'))[:60]}]"
                        )
                    (failed if c.get("required") else warnings).append(text)
            for k, v in node.items():
                if k in ("checks", "run", "runs", "peers"):
                    continue
                if isinstance(v, dict):
                    walk(f"{prefix}/{k}", v)

    for name in SECTIONS:
        sec = report.get(name)
        if not isinstance(sec, dict):
            continue
        sections[name] = sec.get("status")
        if sec.get("status") == "error":
            failed.append(f"{name}: error: {sec.get('error') or 'see checks'}")
        walk(name, sec)
    # A peer's failed checks (and its overhead runs that failed) are findings
    # about the peer, kept apart from gpuslice's verdict.
    ours_failed, ours_warnings = failed, warnings
    findings: dict = {}
    for name in SECTIONS:
        sec = report.get(name)
        if not isinstance(sec, dict):
            continue
        for peer, psec in (sec.get("peers") or {}).items():
            failed, warnings = [], []
            if psec.get("status") == "error":
                failed.append(f"{name}: error: {psec.get('error') or 'see checks'}")
            walk(name, psec)
            findings.setdefault(peer, []).extend(failed + [f"(warning) {w}" for w in warnings])
        for cname, c in (sec.get("configs") or {}).items():
            lib = c.get("library") if isinstance(c, dict) else None
            if lib and lib != "gpuslice":
                findings.setdefault(lib, []).extend(
                    f"{name}/{cname}: {f}" for f in c.get("findings", [])
                )
    failed, warnings = ours_failed, ours_warnings
    bad = any(s in ("fail", "error") for s in sections.values()) or bool(failed)
    return {
        "status": "fail" if bad else "pass",
        "sections": sections,
        "failed_checks": failed,
        "warnings": warnings,
        "peer_findings": findings,
    }


def human_summary(report: dict) -> str:
    out = []
    env = report.get("environment", {})
    out.append(
        "gpuslice GPU kit: {} | driver {} | CUDA {} | {} | {} SMs".format(
            env.get("name", "?"),
            env.get("driver_version", "?"),
            env.get("cuda_driver_version_str", "?"),
            mib(env.get("total_mem")),
            env.get("sm_count", "?"),
        )
    )
    for name, lib in (report.get("libraries") or {}).items():
        if name == "none":
            continue
        out.append(
            f"library {name}: {lib.get('path')} ({'found' if lib.get('exists') else 'MISSING'}"
            + (f", build rc={lib['build_rc']}" if "build_rc" in lib else "")
            + (f", sha256 {lib['sha256'][:12]}" if lib.get("sha256") else "")
            + ")"
        )

    def line(name, text):
        sec = report.get(name) or {}
        st = sec.get("status", "-")
        if not text and st in ("skipped", "error"):
            text = sec.get("reason") or sec.get("error") or ""
        out.append(f"  {name:<12} {st.upper():<7} {text}")

    al = report.get("allocation", {})
    if al.get("paths"):
        bits = []
        for p, e in al["paths"].items():
            n = dig(e, "accepted")
            bits.append(
                f"{p}={'ok' if e.get('status') == 'pass' else 'FAIL'}"
                + (f"({n})" if n is not None else "")
            )
        line(
            "allocation",
            f"limit {mib(al.get('limit'))}, chunk {mib(al.get('chunk'))}: " + " ".join(bits),
        )
    else:
        line("allocation", al.get("error") or al.get("reason") or "")
    lk = report.get("lookup", {})
    nfail = sum(1 for c in lk.get("checks", []) if not c["ok"] and c["required"])
    line(
        "lookup",
        f"{len(lk.get('checks', []))} checks, {nfail} failed"
        if lk.get("checks")
        else lk.get("error", ""),
    )
    nv = report.get("nvml", {})
    v1 = dig(nv, "run", "result", "holding", "v1") or {}
    smi_rows = dig(nv, "nvidia_smi", "rows") or []
    smi_txt = (
        f"{smi_rows[0]['total_mib']} MiB/{smi_rows[0]['used_mib']} MiB"
        if smi_rows
        else dig(nv, "nvidia_smi", "error", default="-")
    )
    line(
        "nvml",
        f"holding {mib(nv.get('hold'))}: NVML total {mib(v1.get('total'))} "
        f"used {mib(v1.get('used'))}; nvidia-smi total/used {smi_txt}"
        if nv.get("run")
        else nv.get("error", ""),
    )
    pt = report.get("pytorch", {})
    if pt.get("runs"):
        bits = []
        for n, e in pt["runs"].items():
            r = e.get("result") or {}
            bits.append(
                f"{n}: reserved at OOM {mib(r.get('memory_reserved_at_oom'))}"
                + ("" if e.get("status") == "pass" else " (FAIL)")
            )
        line(
            "pytorch",
            f"limit {mib(pt.get('limit'))}, step {mib(pt.get('step'))}; " + "; ".join(bits),
        )
    else:
        line("pytorch", pt.get("reason") or pt.get("error") or "")
    cp = report.get("compute", {})
    if cp.get("single") is not None:
        bits = [f"{x['target_pct']}%->{x['achieved_pct']:.1f}" for x in cp.get("single", [])]
        pair = cp.get("pair") or {}
        pb = [
            f"{p['target_pct']}%->{p['achieved_pct']:.1f}"
            for p in pair.get("procs", [])
            if "achieved_pct" in p
        ]
        txt = "single " + " ".join(bits)
        if "single_max_abs_error_pp" in cp:
            txt += f" (max err {cp['single_max_abs_error_pp']} pp)"
        if pb:
            want = pair.get("expected_ratio")
            txt += f"; pair {' '.join(pb)} ratio {pair.get('ratio')} (want {want})"
        if "policy_disable_share_pct" in cp:
            txt += f"; disable {cp['policy_disable_share_pct']:.1f}%"
        line("compute", txt)
    else:
        line("compute", cp.get("error") or "")
    wl = report.get("workloads", {})
    if wl.get("status") not in (None, "skipped", "error") or wl.get("none"):
        bits = []
        for who, e in _by_library(wl):
            tr, inf, g = e.get("train") or {}, e.get("infer") or {}, e.get("graph") or {}
            bits.append(
                f"{who}: train {_fmt(tr.get('steps_per_s'), digits=1)} steps/s, "
                f"infer {_fmt(inf.get('ms_median'), digits=3)} ms, "
                f"graph diff {tr and g.get('max_abs_diff')}"
            )
        line("workloads", "; ".join(bits))
    else:
        line("workloads", wl.get("reason") or wl.get("error") or "")
    av = report.get("agent_view", {})
    if av.get("status") not in (None, "skipped", "error") or av.get("none"):
        bits = [
            f"{who}: NVML {mib(e.get('nvml_used_max'))}, sm {e.get('nvml_sm_util_mean')}%"
            + (f", region {mib(e.get('region_used'))}" if e.get("region_used") else "")
            for who, e in _by_library(av)
        ]
        line("agent_view", "; ".join(bits))
    else:
        line("agent_view", av.get("reason") or av.get("error") or "")
    ov = report.get("overhead", {})
    if ov.get("configs"):
        c = ov["configs"]
        d = ov.get("vs_none", {})
        bits = [
            f"none launch {_fmt(dig(c, 'none', 'launch_ns'))} ns, "
            f"alloc+free {_fmt(dig(c, 'none', 'allocpair_ns'))} ns"
        ]
        for name, v in d.items():
            bits.append(
                f"{name}: launch {_fmt(v.get('launch_ns_added'), True)} ns, "
                f"alloc+free {_fmt(v.get('allocpair_ns_added'), True)} ns, "
                f"train {_fmt(v.get('train_steps_per_s_slowdown_pct'), True, 2)} %, "
                f"infer {_fmt(v.get('infer_ms_median_slowdown_pct'), True, 2)} %"
            )
        line("overhead", "; ".join(bits))
    else:
        line("overhead", ov.get("error") or "")
    s = report.get("summary", {})
    out.append(
        f"result: {s.get('status', '?').upper()}"
        + (f" ({len(s.get('failed_checks', []))} failed, {len(s.get('warnings', []))} warnings)")
    )
    for f in s.get("failed_checks", [])[:25]:
        out.append(f"  FAILED  {f}")
    for w in s.get("warnings", [])[:10]:
        out.append(f"  warning {w}")
    for peer, items in (s.get("peer_findings") or {}).items():
        if not items:
            continue
        out.append(f"peer {peer}: {len(items)} findings (not gpuslice's failures)")
        for f in items[:8]:
            out.append(f"  {peer}: {f}")
    return "\n".join(out)


def _fmt(v, signed=False, digits=0):
    if v is None:
        return "?"
    return f"{v:+.{digits}f}" if signed else f"{v:.{digits}f}"


def _by_library(sec: dict):
    """(name, entry) for none (when measured), gpuslice and each peer."""
    if isinstance(sec.get("none"), dict):
        yield "none", sec["none"]
    if sec.get("status") != "error":
        yield "gpuslice", sec
    yield from (sec.get("peers") or {}).items()
