"""Compute: the share a limited process gets against a baseline without any
library (kernels/s, or training steps/s for PyTorch): alone at each limit,
in concurrent pairs (30/70, 50/50), as a high/low priority pair, and a
training loop at 50 %. Measured for gpuslice and each peer against the same
baseline.

The priority pair needs the node agent's coordinator, which sets `yield` for
a low-priority container while a high-priority one is active on its GPU. The
kit plays that part: it writes the control file the interposer reads without
a grant (the region's path + ".control", `gs_control_t`), with a fresh
heartbeat, and sets `yield` for the low-priority process while the
high-priority one runs."""

from __future__ import annotations

import os
import statistics
import struct
import threading
import time

from .common import Checks, Lib, dig

# gs_control_t (region_layout.h): magic, version, heartbeat_ns, flags[16],
# tat_floor_ns[16], reserved[8]
CONTROL_MAGIC = 0x31435347
CONTROL_VERSION = 1
CONTROL_SIZE = 272
CONTROL_HEARTBEAT_AT = 8
CONTROL_FLAGS_AT = 16
DEV_SHARED, DEV_YIELD = 1, 2
PRIORITY_TARGETS = {"high": 100, "low": 0}


class AgentStandIn:
    """The coordinator's part for one container: its control file, a
    heartbeat every 250 ms, and flags for device `ordinal`."""

    def __init__(self, region: str, ordinal: int) -> None:
        self.path = region + ".control"
        self.flags_at = CONTROL_FLAGS_AT + 4 * ordinal
        head = struct.pack("<IIQ", CONTROL_MAGIC, CONTROL_VERSION, time.monotonic_ns())
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        os.write(self.fd, head + bytes(CONTROL_SIZE - len(head)))
        os.fchmod(self.fd, 0o444)  # as the agent's; this descriptor stays writable
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._beat, daemon=True)
        self.thread.start()

    def _beat(self) -> None:
        while not self.stop.is_set():
            os.pwrite(self.fd, struct.pack("<Q", time.monotonic_ns()), CONTROL_HEARTBEAT_AT)
            self.stop.wait(0.25)

    def set_flags(self, flags: int) -> None:
        os.pwrite(self.fd, struct.pack("<I", flags), self.flags_at)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=2)
        os.close(self.fd)


class ComputeSection:
    def compute_run(self, label, iters, env, seconds, start_at=None, region=None, lib=None):
        opts = ["--iters", iters, "--seconds", seconds, "--warmup", self.a.compute_warmup]
        if start_at:
            opts += ["--start-at", f"{start_at:.3f}"]
        return self.run(
            self.kit_argv("compute", *opts, region=region, lib=lib),
            env,
            timeout=seconds + self.a.timeout,
            label=label,
        )

    def train_run(self, label, env, lib: Lib | None) -> dict:
        secs = self.a.train_seconds
        return self.run(
            self.workload_argv("train", lib, "--train-seconds", secs),
            env,
            timeout=secs + max(self.a.timeout, 300),
            label=label,
        )

    def sec_compute(self) -> dict:
        a = self.a
        secs = a.compute_seconds
        sec: dict = {
            "seconds_per_run": secs,
            "tolerance_pp": a.tolerance_pp,
            "goal_pp": a.goal_pp,
            "target_kernel_ms": a.kernel_ms,
        }
        checks = Checks()
        cal = self.run(
            self.kit_argv("calibrate", "--target-ms", a.kernel_ms),
            self.base_env(),
            label="calibrate",
        )
        sec["calibration"] = cal
        if not self.check_run(checks, cal, "calibrate", preload=False):
            sec["checks"] = checks.items
            sec["status"] = "error"
            return sec
        iters = cal["result"]["iters"]
        self.iters = iters
        sec["iters"] = iters
        sec["kernel_ms"] = cal["result"].get("kernel_ms")
        sec["grid"] = cal["result"].get("grid")
        torch_ok = self.torch_probe()["ok"] and a.train_share is not None

        runs: dict = {"baseline": self.compute_run("baseline", iters, self.base_env(), secs)}
        base_ok = self.check_run(
            checks, runs["baseline"], "baseline (no interposer)", preload=False
        )
        if torch_ok:
            runs["train_baseline"] = self.train_run("train baseline", self.base_env(), None)
        raw: dict = {}
        ready = [lib for lib in self.libs() if not self.lib_ready(lib)]
        if self.lib_ready():
            checks.add("interposer available", False, detail=self.lib_ready())
        for lib in ready:
            raw[lib.name] = self.compute_raw(lib, iters, secs, torch_ok)
        runs["baseline_after"] = self.compute_run("baseline after", iters, self.base_env(), secs)
        after_ok = self.check_run(
            checks, runs["baseline_after"], "baseline after (no interposer)", preload=False
        )
        if torch_ok:
            runs["train_baseline_after"] = self.train_run(
                "train baseline after", self.base_env(), None
            )
        sec["runs"] = runs
        if not base_ok:
            sec["checks"] = checks.items
            sec["status"] = "error"
            return sec
        b0 = _tput(runs["baseline"])
        b1 = _tput(runs["baseline_after"]) if after_ok else None
        ref = (b0 + b1) / 2 if b1 else b0
        sec["baseline_kernels_per_s"] = b0
        sec["baseline_after_kernels_per_s"] = b1
        sec["reference_kernels_per_s"] = ref
        if b1:
            drift = (b1 - b0) / b0 * 100
            sec["baseline_drift_pct"] = round(drift, 2)
            checks.add(
                "baseline drift <= 5 %", abs(drift) <= 5, required=False, value=round(drift, 2)
            )
        train_ref = None
        if torch_ok:
            sps = [
                dig(runs, k, "result", "workloads", "train", "steps_per_s")
                for k in ("train_baseline", "train_baseline_after")
                if self.script_ok(runs[k])[0]
            ]
            sps = [v for v in sps if v]
            train_ref = statistics.mean(sps) if sps else None
            sec["train_reference_steps_per_s"] = train_ref
        elif a.train_share is not None:
            sec["train_skipped"] = self.torch_probe().get("reason")
        peers = {}
        for lib in ready:
            c = checks if lib.ours else Checks()
            res = self.compute_eval(lib, raw[lib.name], ref, train_ref, c, secs)
            if lib.ours:
                sec.update(res)
            else:
                res["checks"] = c.items
                res["status"] = c.status()
                peers[lib.name] = res
        if peers:
            sec["peers"] = peers
        sec["checks"] = checks.items
        sec["status"] = checks.status()
        return sec

    def compute_raw(self, lib: Lib, iters, secs, torch_ok: bool) -> dict:
        """Every limited run of one library (evaluated once the baseline is known)."""
        a = self.a
        runs: dict = {}
        env, region = self.slice_env("compute-disable", sm=50, policy="disable", lib=lib)
        runs["policy_disable"] = self.compute_run(
            f"{lib.name} policy=disable, limit 50", iters, env, secs, region=region, lib=lib
        )
        for t in a.compute_targets:
            env, region = self.slice_env(f"compute-{t}", sm=t, policy="force", lib=lib)
            runs[f"limit_{t}"] = self.compute_run(
                f"{lib.name} limit {t}", iters, env, secs, region=region, lib=lib
            )
        pairs = {"/".join(map(str, p)): self.compute_pair(iters, p, secs, lib) for p in a.pairs}
        out = {"runs": runs, "pairs": pairs}
        if a.priority_pair:
            out["priority"] = self.compute_priority(iters, secs, lib)
        if torch_ok:
            env, _ = self.slice_env("train-share", sm=a.train_share, policy="force", lib=lib)
            out["train"] = self.train_run(f"{lib.name} train at {a.train_share}%", env, lib)
        return out

    def compute_eval(self, lib: Lib, raw: dict, ref, train_ref, checks: Checks, secs) -> dict:
        a = self.a
        tol, goal = a.tolerance_pp, a.goal_pp
        runs = raw["runs"]
        out: dict = {"library": lib.name, "runs": runs}

        def share(rec):
            v = _tput(rec)
            return None if v is None else v / ref * 100

        def judge(name, achieved, target, **extra) -> dict:
            err = achieved - target
            checks.add(
                f"{name}: |achieved - target| <= {tol} pp",
                abs(err) <= tol,
                value=round(achieved, 2),
                expected=target,
                error_pp=round(err, 2),
            )
            return {
                "target_pct": target,
                "achieved_pct": round(achieved, 2),
                "error_pp": round(err, 2) + 0.0,
                "within_goal": abs(err) <= goal,
                **extra,
            }

        if self.check_run(checks, runs["policy_disable"], "policy=disable", preload=True):
            s = share(runs["policy_disable"])
            out["policy_disable_share_pct"] = round(s, 2)
            checks.add(
                "policy=disable is not throttled (share 100 %)",
                abs(s - 100) <= tol,
                value=round(s, 2),
                expected=100,
            )
        table = []
        for t in a.compute_targets:
            rec = runs[f"limit_{t}"]
            if self.check_run(checks, rec, f"limit {t}%", preload=True):
                rr = rec["result"]
                table.append(
                    judge(
                        f"limit {t}%",
                        share(rec),
                        t,
                        kernels_per_s=rr.get("kernels_per_s"),
                        launch_call_ms_max=rr.get("launch_call_ms_max"),
                        throttled_ns=dig(rr, "region", "throttled_ns"),
                    )
                )
        out["single"] = table
        if table:
            errs = [abs(x["error_pp"]) for x in table]
            out["single_max_abs_error_pp"] = round(max(errs), 2)
            out["single_mean_abs_error_pp"] = round(statistics.mean(errs), 2)
        pairs = {}
        for key, pair in raw["pairs"].items():
            pairs[key] = self.pair_eval(pair, f"pair {key}", share, judge, checks, secs)
        out["pairs"] = pairs
        if "30/70" in pairs:  # the report's first pair, where it always was
            out["pair"] = pairs["30/70"]
        if "priority" in raw:
            out["priority"] = self.pair_eval(
                raw["priority"], "priority pair", share, judge, checks, secs
            )
        if "train" in raw:
            rec = raw["train"]
            ok, why = self.script_ok(rec)
            checks.add(f"training at {a.train_share}%: ran", ok, detail=why or None)
            sps = dig(rec, "result", "workloads", "train", "steps_per_s")
            if ok and sps and train_ref:
                out["train"] = judge(
                    f"training at {a.train_share}%",
                    sps / train_ref * 100,
                    a.train_share,
                    steps_per_s=sps,
                    reference_steps_per_s=train_ref,
                )
            else:
                out["train"] = {"target_pct": a.train_share, "error": why or "no steps/s"}
        return out

    def pair_eval(self, pair: dict, name: str, share, judge, checks: Checks, secs) -> dict:
        procs = pair.get("procs", [])
        for pr in procs:
            who = f"{name} {pr.get('role') or str(pr['target_pct']) + '%'}"
            if self.check_run(checks, pr["run"], who, preload=True):
                res = judge(who, share(pr["run"]), pr["target_pct"])
                pr.update({k: res[k] for k in ("achieved_pct", "error_pp", "within_goal")})
        done = [pr for pr in procs if "achieved_pct" in pr]
        if len(done) == 2:
            lo, hi = sorted(done, key=lambda x: x["target_pct"])
            if lo["target_pct"]:
                pair["ratio"] = (
                    round(hi["achieved_pct"] / lo["achieved_pct"], 3)
                    if lo["achieved_pct"]
                    else None
                )
                pair["expected_ratio"] = round(hi["target_pct"] / lo["target_pct"], 3)
            pair["sum_pct"] = round(lo["achieved_pct"] + hi["achieved_pct"], 2)
            starts = [pr["run"]["result"]["t_start_epoch"] for pr in done]
            ends = [pr["run"]["result"]["t_end_epoch"] for pr in done]
            pair["overlap_s"] = round(min(ends) - max(starts), 3)
            checks.add(
                f"{name} ran concurrently (overlap >= 90 % of the run)",
                pair["overlap_s"] >= 0.9 * secs,
                required=False,
                value=pair["overlap_s"],
            )
        return pair

    def compute_pair(self, iters, targets, secs, lib: Lib, roles=None) -> dict:
        """Two containers (two region files) at once, each with its own limit."""
        start_at = time.time() + self.a.pair_start_delay
        procs = []
        for i, t in enumerate(targets):
            role = roles[i] if roles else None
            extra = {"CUDA_TASK_PRIORITY": "0" if role == "high" else "1"} if role else None
            sm = None if role else t
            env, region = self.slice_env(
                f"pair-{role or t}", sm=sm, policy="force", extra=extra, lib=lib
            )
            argv = self.kit_argv(
                "compute",
                "--iters",
                iters,
                "--seconds",
                secs,
                "--warmup",
                self.a.compute_warmup,
                "--start-at",
                f"{start_at:.3f}",
                region=region,
                lib=lib,
            )
            procs.append(
                {"target_pct": t, "role": role, "argv": argv, "env": env, "region": region}
            )
        agent = None
        if roles and lib.ours:
            low = next(p for p in procs if p["role"] == "low")
            agent = AgentStandIn(low["region"], self.a.device)
        results: list = [None] * len(procs)

        def go(i):
            pr = procs[i]
            results[i] = self.run(
                pr["argv"],
                pr["env"],
                timeout=secs + self.a.pair_start_delay + self.a.timeout,
                label=f"{lib.name} pair {pr['role'] or pr['target_pct']}",
            )

        threads = [threading.Thread(target=go, args=(i,)) for i in range(len(procs))]
        for t in threads:
            t.start()
        if agent:
            # yield from the common start until the high-priority process is done
            time.sleep(max(0.0, start_at - time.time()))
            agent.set_flags(DEV_SHARED | DEV_YIELD)
            high = next(i for i, p in enumerate(procs) if p["role"] == "high")
            threads[high].join()
            agent.set_flags(DEV_SHARED)
        for t in threads:
            t.join()
        if agent:
            agent.close()
        out: dict = {"start_at_epoch": start_at, "procs": []}
        if roles:
            out["agent_stand_in"] = bool(agent)
        for pr, rec in zip(procs, results, strict=True):
            late = dig(rec, "result", "late_s")
            entry = {"target_pct": pr["target_pct"], "late_s": late, "run": rec}
            if pr["role"]:
                entry["role"] = pr["role"]
            out["procs"].append(entry)
        return out

    def compute_priority(self, iters, secs, lib: Lib) -> dict:
        """High (CUDA_TASK_PRIORITY=0) and low (1) priority, no compute limit:
        the high one should keep the whole GPU, the low one wait while it runs."""
        pair = self.compute_pair(
            iters,
            [PRIORITY_TARGETS["high"], PRIORITY_TARGETS["low"]],
            secs,
            lib,
            roles=["high", "low"],
        )
        pair["note"] = (
            "the kit sets yield for the low-priority process while the high-priority one "
            "runs, as the node agent's coordinator does (gpuslice's control file)"
        )
        return pair


def _tput(rec):
    return dig(rec, "result", "kernels_per_s")
