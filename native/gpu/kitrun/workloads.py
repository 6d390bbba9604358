"""PyTorch end to end (torch_workloads.py) under no library, gpuslice and
each peer: a training loop, a launch-bound inference loop, CUDA-graph capture
and replay against eager results, and allocation patterns under the memory
limit with each of PyTorch's allocator settings."""

from __future__ import annotations

from .common import Checks, Lib, dig

ALLOC_CONFS = (
    # name, PYTORCH_CUDA_ALLOC_CONF, required (our pass/fail)
    ("default", None, True),
    ("expandable_segments", "expandable_segments:True", True),
    ("cudaMallocAsync", "backend:cudaMallocAsync", False),
)


class WorkloadsSection:
    def sec_workloads(self) -> dict:
        t = self.torch_probe()
        if not t["ok"]:
            return {"status": "skipped", "reason": t["reason"]}
        sec = self.per_library(self.workloads_for)
        sec["none"] = self.workloads_for(None)
        sec["torch"], sec["torch_cuda"] = t.get("torch"), t.get("cuda")
        if sec.get("status") not in ("error",) and sec["none"].get("status") == "fail":
            sec["status"] = "fail"
        return sec

    def workloads_for(self, lib: Lib | None) -> dict:
        a = self.a
        checks = Checks()
        env, _ = self.lib_env(lib, "workloads")
        rec = self.run(
            self.workload_argv(
                "train,infer,graph",
                lib,
                "--train-steps",
                a.train_steps,
                "--infer-iters",
                a.infer_iters,
                "--graph-tolerance",
                a.graph_tolerance,
            ),
            env,
            timeout=max(a.timeout, 300),
            label=f"{lib.name if lib else 'none'} workloads",
        )
        out: dict = {"library": lib.name if lib else None, "run": rec}
        ok, why = self.script_ok(rec)
        checks.add("train, infer, graph: ran", ok, detail=why or None)
        w = dig(rec, "result", "workloads") or {}
        out["train"] = _pick(w.get("train"), "steps", "steps_per_s", "loss_first", "loss_final")
        out["infer"] = _pick(w.get("infer"), "iters", "kernels_per_iter", "ms_median", "ms_p95")
        out["graph"] = _pick(
            w.get("graph"), "max_abs_diff", "tolerance", "replay_ms_median", "eager_ms_median"
        )
        if ok:
            if lib is not None:
                checks.add(
                    "library mapped in the process",
                    dig(rec, "result", "interposer_mapped") is True,
                )
            for name in ("train", "infer", "graph"):
                err = (w.get(name) or {}).get("error")
                checks.add(f"{name}: finished", name in w and not err, detail=err)
            tr = w.get("train") or {}
            checks.add(
                "train: loss finite and lower at the end",
                tr.get("loss_final") is not None
                and tr.get("loss_first") is not None
                and tr["loss_final"] < tr["loss_first"],
                value=tr.get("loss_final"),
                expected=f"< {tr.get('loss_first')}",
            )
            g = w.get("graph") or {}
            checks.add(
                "graph replay == eager (max abs diff within tolerance)",
                g.get("max_abs_diff") is not None and g["max_abs_diff"] <= a.graph_tolerance,
                value=g.get("max_abs_diff"),
                expected=f"<= {a.graph_tolerance}",
            )
        if lib is not None:
            out["alloc"] = {}
            for name, conf, required in ALLOC_CONFS:
                out["alloc"][name] = self.alloc_pattern(lib, name, conf, required, checks)
        out["checks"] = checks.items
        out["status"] = checks.status()
        return out

    def alloc_pattern(self, lib: Lib, name, conf, required, checks: Checks) -> dict:
        """Mixed tensor sizes until the limit, then empty_cache and one tensor
        of what is left: the caching allocator against the limit."""
        L, oh = self.limit, self.overhead
        extra = {"PYTORCH_CUDA_ALLOC_CONF": conf} if conf else None
        env, _ = self.slice_env(f"workload-alloc-{name}", mem=L, extra=extra, lib=lib)
        rec = self.run(
            self.workload_argv("alloc", lib, "--limit", L),
            env,
            timeout=max(self.a.timeout, 300),
            label=f"{lib.name} alloc {name}",
        )
        ok, why = self.script_ok(rec)
        r = dig(rec, "result", "workloads", "alloc") or {}
        if ok and r.get("error"):
            ok, why = False, r["error"]
        pre = f"alloc {name}"
        checks.add(f"{pre}: ran", ok, required=required, detail=why or None)
        if ok:
            eff = L - oh
            peak = r.get("max_memory_reserved")
            checks.add(
                f"{pre}: mem_get_info total == limit",
                dig(r, "mem_get_info_before", "total") == L,
                required=required,
                value=dig(r, "mem_get_info_before", "total"),
                expected=L,
            )
            checks.add(
                f"{pre}: OutOfMemoryError raised",
                r.get("oom") is True,
                required=required,
                value=r.get("oom_type"),
            )
            checks.add(
                f"{pre}: max_memory_reserved <= limit",
                peak is not None and peak <= eff,
                required=required,
                value=peak,
                expected=f"<= {eff}",
            )
            checks.add(
                f"{pre}: reached within 10 % of the limit",
                peak is not None and peak > eff * 0.9,
                required=required,
                value=peak,
                expected=f"> {int(eff * 0.9)}",
            )
            checks.add(
                f"{pre}: after empty_cache one tensor of what is free fits",
                r.get("regrow_ok") is True,
                required=required,
                value=r.get("regrow_bytes"),
                detail=r.get("regrow_error"),
            )
            checks.add(
                f"{pre}: mem_get_info free tracks reserved (within 64 MiB)",
                r.get("free_tracks_reserved") is True,
                required=False,
                value=r.get("free_vs_reserved_max_gap"),
            )
        return {"alloc_conf": conf, "required": required, "result": r, "run": rec}


def _pick(d, *keys):
    if not isinstance(d, dict):
        return None
    out = {k: d.get(k) for k in keys}
    if d.get("error"):
        out["error"] = d["error"]
    return out
