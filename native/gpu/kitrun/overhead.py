"""Overhead: what a library costs a process that its limits do not hold back.
Configurations (no library; each library without limits; each library with
limits that do not bind) run interleaved, one round after another (A B C A B
C ...), so drift of the GPU's clocks spreads over all of them; each figure
is the median over the rounds, and each is set against no library."""

from __future__ import annotations

from .common import Checks, Lib, MiB, dig, median

# Goals printed beside the results (no pass/fail: the figures are information).
GOAL_TRAIN_PCT = 0.5
GOAL_LAUNCH_BOUND_PCT = 2.0
METRICS = (
    # key, which run of a round, where in its result, lower is better
    ("launch_ns", "launch", ("ns_median",), True),
    ("allocpair_ns", "allocpair", ("ns_median",), True),
    ("train_steps_per_s", "torch", ("workloads", "train", "steps_per_s"), False),
    ("infer_ms_median", "torch", ("workloads", "infer", "ms_median"), True),
    ("infer_ms_p95", "torch", ("workloads", "infer", "ms_p95"), True),
)


class OverheadSection:
    def overhead_configs(self) -> list[tuple[str, Lib | None, dict]]:
        """(name, library, limits): none, then per library: no limits, and
        limits that do not bind (all the GPU's memory, 100 % of its SMs)."""
        total = self.env_info.get("total_mem") or 1 << 40
        loose = {"mem": total, "sm": 100, "policy": "force"}
        out: list[tuple[str, Lib | None, dict]] = [("none", None, {})]
        for lib in self.libs():
            if self.lib_ready(lib):
                continue
            out += [(lib.name, lib, {}), (f"{lib.name}_limits", lib, loose)]
        return out

    def sec_overhead(self) -> dict:
        a = self.a
        torch_ok = self.torch_probe()["ok"]
        configs = self.overhead_configs()
        sec: dict = {
            "launch_count": a.launch_count,
            "alloc_pairs": a.alloc_pairs,
            "rounds": a.rounds,
            "train_seconds": a.bench_train_seconds if torch_ok else None,
            "infer_iters": a.infer_iters if torch_ok else None,
            "goals": {
                "train_slowdown_pct_max": GOAL_TRAIN_PCT,
                "launch_bound_slowdown_pct_max": GOAL_LAUNCH_BOUND_PCT,
            },
            "order": [name for name, _, _ in configs],
            "configs": {},
        }
        if not torch_ok:
            sec["torch_skipped"] = self.torch_probe().get("reason")
        checks = Checks()
        if self.lib_ready():
            checks.add("interposer available", False, detail=self.lib_ready())
        samples: dict = {name: {m[0]: [] for m in METRICS} for name, _, _ in configs}
        rounds: dict = {name: [] for name, _, _ in configs}
        for r in range(a.rounds):
            for name, lib, limits in configs:
                rec = self.overhead_round(name, lib, limits, torch_ok, r)
                rounds[name].append(rec)
                for key, run_key, path, _ in METRICS:
                    run = rec.get(run_key)
                    if run is None:
                        continue
                    ok, _why = self.script_ok(run)
                    if ok:
                        samples[name][key].append(dig(run, "result", *path))
        for name, lib, limits in configs:
            runs = rounds[name]
            c: dict = {
                "library": lib.name if lib else None,
                "limits": limits or None,
                "rounds": runs,
            }
            for key, *_ in METRICS:
                c[key] = _round(median(samples[name][key]))
                c[key + "_samples"] = samples[name][key]
            for i, rec in enumerate(runs):
                for run_key in ("launch", "allocpair", "torch"):
                    if run_key in rec:
                        ok, why = self.script_ok(rec[run_key])
                        res = rec[run_key].get("result") or {}
                        loaded = res.get("interposed") or res.get("interposer_mapped")
                        if ok and lib is not None and loaded is not True:
                            ok, why = False, "the library was not loaded in the process"
                        who = f"{name} round {i + 1} {run_key}"
                        if lib is None or lib.ours:
                            checks.add(f"{who}: ran", ok, detail=why or None)
                        elif not ok:
                            c.setdefault("findings", []).append(f"{who}: {why}")
            sec["configs"][name] = c
        sec["vs_none"] = self.overhead_vs_none(sec["configs"])
        # the report's older keys: gpuslice without and with a memory limit
        sec["added_vs_none"] = {k: v for k, v in sec["vs_none"].items() if k.startswith("gpuslice")}
        sec["checks"] = checks.items
        sec["status"] = "info" if checks.status() == "pass" else "error"
        return sec

    def overhead_round(self, name, lib, limits, torch_ok, r) -> dict:
        a = self.a
        rec: dict = {}
        env, region = self.lib_env(lib, f"overhead-{name}-{r}", **limits)
        rec["launch"] = self.run(
            self.kit_argv(
                "launch", "--count", a.launch_count, "--repeat", 1, region=region, lib=lib
            ),
            env,
            label=f"launch {name} #{r + 1}",
        )
        env, region = self.lib_env(lib, f"overhead-alloc-{name}-{r}", **limits)
        rec["allocpair"] = self.run(
            self.kit_argv(
                "allocpair",
                "--count",
                a.alloc_pairs,
                "--size",
                MiB,
                "--repeat",
                1,
                region=region,
                lib=lib,
            ),
            env,
            label=f"allocpair {name} #{r + 1}",
        )
        if torch_ok:
            env, _ = self.lib_env(lib, f"overhead-torch-{name}-{r}", **limits)
            secs = a.bench_train_seconds
            rec["torch"] = self.run(
                self.workload_argv(
                    "train,infer",
                    lib,
                    "--train-seconds",
                    secs,
                    "--infer-iters",
                    a.infer_iters,
                ),
                env,
                timeout=secs + max(a.timeout, 300),
                label=f"torch {name} #{r + 1}",
            )
        return rec

    @staticmethod
    def overhead_vs_none(configs: dict) -> dict:
        none = configs.get("none", {})
        out = {}
        for name, c in configs.items():
            if name == "none":
                continue
            d: dict = {}
            for key, _, _, lower_better in METRICS:
                v, base = c.get(key), none.get(key)
                if v is None or base is None or not base:
                    continue
                if lower_better:
                    d[key + "_added"] = round(v - base, 3)
                    d[key + "_ratio"] = round(v / base, 4)
                    d[key + "_slowdown_pct"] = round((v / base - 1) * 100, 2)
                else:  # a rate: slowdown is how much longer the same work takes
                    d[key + "_ratio"] = round(v / base, 4)
                    d[key + "_slowdown_pct"] = round((base / v - 1) * 100, 2) if v else None
            sd = d.get("train_steps_per_s_slowdown_pct")
            if sd is not None:
                d["train_within_goal"] = sd <= GOAL_TRAIN_PCT
            sd = d.get("infer_ms_median_slowdown_pct")
            if sd is not None:
                d["launch_bound_within_goal"] = sd <= GOAL_LAUNCH_BOUND_PCT
            out[name] = d
        return out


def _round(v):
    return None if v is None else round(v, 4)
