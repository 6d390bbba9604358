"""The node agent's view: what NVML says per process (memory from
nvmlDeviceGetComputeRunningProcesses, SM utilisation from
nvmlDeviceGetProcessUtilization) while a workload runs under a library,
beside what the interposer's region file counts for the same process. The
runner reads NVML itself through ctypes, unpreloaded, as the agent does."""

from __future__ import annotations

import contextlib
import ctypes
import subprocess
import threading
import time

from .base import finish_record
from .common import Checks, Lib, MiB, dig

NVML_SUCCESS = 0
NVML_ERROR_INSUFFICIENT_SIZE = 7
NVML_ERROR_NOT_FOUND = 6


class ProcessInfo(ctypes.Structure):  # nvmlProcessInfo_t (v2 layout, what _v3 fills)
    _fields_ = (
        ("pid", ctypes.c_uint),
        ("usedGpuMemory", ctypes.c_ulonglong),
        ("gpuInstanceId", ctypes.c_uint),
        ("computeInstanceId", ctypes.c_uint),
    )


class UtilSample(ctypes.Structure):  # nvmlProcessUtilizationSample_t
    _fields_ = (
        ("pid", ctypes.c_uint),
        ("timeStamp", ctypes.c_ulonglong),
        ("smUtil", ctypes.c_uint),
        ("memUtil", ctypes.c_uint),
        ("encUtil", ctypes.c_uint),
        ("decUtil", ctypes.c_uint),
    )


class Nvml:
    """The few NVML calls the view needs; errors are returned, never raised."""

    def __init__(self, ordinal: int, name: str = "libnvidia-ml.so.1") -> None:
        self.lib = ctypes.CDLL(name)
        rc = self.lib.nvmlInit_v2()
        if rc != NVML_SUCCESS:
            raise OSError(f"nvmlInit_v2 -> {rc}")
        self.dev = ctypes.c_void_p()
        rc = self.lib.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(ordinal), ctypes.byref(self.dev))
        if rc != NVML_SUCCESS:
            raise OSError(f"nvmlDeviceGetHandleByIndex_v2({ordinal}) -> {rc}")
        self.last_seen = 0

    def processes(self) -> dict:
        fn = getattr(self.lib, "nvmlDeviceGetComputeRunningProcesses_v3", None)
        if fn is None:
            return {"error": "no nvmlDeviceGetComputeRunningProcesses_v3"}
        count = ctypes.c_uint(64)
        buf = (ProcessInfo * 64)()
        rc = fn(self.dev, ctypes.byref(count), buf)
        if rc != NVML_SUCCESS:
            return {"error": f"nvmlDeviceGetComputeRunningProcesses_v3 -> {rc}"}
        return {
            "procs": {
                int(buf[i].pid): int(buf[i].usedGpuMemory) for i in range(min(count.value, 64))
            }
        }

    def utilization(self) -> dict:
        fn = getattr(self.lib, "nvmlDeviceGetProcessUtilization", None)
        if fn is None:
            return {"error": "no nvmlDeviceGetProcessUtilization"}
        count = ctypes.c_uint(64)
        buf = (UtilSample * 64)()
        rc = fn(self.dev, buf, ctypes.byref(count), ctypes.c_ulonglong(self.last_seen))
        if rc == NVML_ERROR_NOT_FOUND:
            return {"sm": {}}
        if rc != NVML_SUCCESS:
            return {"error": f"nvmlDeviceGetProcessUtilization -> {rc}"}
        sm: dict = {}
        for i in range(min(count.value, 64)):
            s = buf[i]
            self.last_seen = max(self.last_seen, int(s.timeStamp))
            sm.setdefault(int(s.pid), []).append(int(s.smUtil))
        return {"sm": sm}

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.lib.nvmlShutdown()


class AgentViewSection:
    def sec_agent_view(self) -> dict:
        try:
            nv = Nvml(self.a.device)
        except OSError as e:
            return {"status": "error", "error": f"NVML: {e}"}
        if self.iters is None:
            cal = self.run(
                self.kit_argv("calibrate", "--target-ms", self.a.kernel_ms),
                self.base_env(),
                label="calibrate",
            )
            ok, why = self.run_ok(cal)
            if not ok:
                nv.close()
                return {"status": "error", "error": f"kit calibrate: {why}"}
            self.iters = cal["result"]["iters"]
        try:
            sec = self.per_library(lambda lib: self.agent_view_for(nv, lib))
            sec["none"] = self.agent_view_for(nv, None)
        finally:
            nv.close()
        sec.update(hold=self.view_hold(), sm_limit=self.a.view_sm)
        return sec

    def view_hold(self) -> int:
        return min(1024 * MiB, (self.limit // 4) // MiB * MiB)

    def agent_view_for(self, nv: Nvml, lib: Lib | None) -> dict:
        """`kit compute --hold` under lib (memory limit, SM limit) for
        --view-seconds; NVML sampled every 250 ms; the region read halfway."""
        a = self.a
        hold, secs = self.view_hold(), a.view_seconds
        limits = {} if lib is None else {"mem": self.limit, "sm": a.view_sm, "policy": "force"}
        env, region = self.lib_env(lib, "agent-view", **limits)
        argv = self.kit_argv(
            "compute",
            "--iters",
            self.iters,
            "--seconds",
            secs,
            "--warmup",
            a.compute_warmup,
            "--hold",
            hold,
            region=region,
            lib=lib,
        )
        rec: dict = {"label": f"agent view {lib.name if lib else 'none'}", "argv": argv}
        out: dict = {"library": lib.name if lib else None, "run": rec}
        checks = Checks()
        try:
            p = subprocess.Popen(
                argv,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                errors="replace",
            )
        except OSError as e:
            rec["error"] = f"cannot start: {e}"
            checks.add("workload ran", False, detail=rec["error"])
            out.update(checks=checks.items, status=checks.status())
            return out
        streams: dict = {}

        def drain(name, f):
            streams[name] = f.read()

        pumps = [
            threading.Thread(target=drain, args=("out", p.stdout), daemon=True),
            threading.Thread(target=drain, args=("err", p.stderr), daemon=True),
        ]
        for t in pumps:
            t.start()
        samples: list[dict] = []
        region_rec = None
        t0 = time.monotonic()
        deadline = t0 + secs + a.timeout
        settle = a.compute_warmup + 1.0  # the context made, the memory held
        while p.poll() is None and time.monotonic() < deadline:
            now = time.monotonic() - t0
            if now >= settle:
                s = {"t": round(now, 2), **nv.processes(), **nv.utilization()}
                samples.append(s)
                if region is not None and region_rec is None:  # the memory is held by now
                    region_rec = self.run(
                        self.kit_argv("region", region=region, lib=lib),
                        self.base_env(),
                        timeout=30,
                        label="region",
                    )
            time.sleep(0.25)
        if p.poll() is None:
            p.kill()
            rec["timed_out"] = True
        p.wait()
        for t in pumps:
            t.join(timeout=5)
        rec["rc"] = p.returncode
        rec["elapsed_s"] = round(time.monotonic() - t0, 3)
        finish_record(rec, streams.get("out", ""), streams.get("err", ""))
        ok, why = self.run_ok(rec)
        checks.add("workload ran", ok, detail=why or None)
        pid = dig(rec, "result", "pid")
        out.update(self.view_summary(pid, samples, region_rec, hold))
        out["samples"] = samples[:80]
        if region_rec is not None:
            out["region_run"] = region_rec
        if ok and pid is not None:
            checks.add(
                "NVML lists the process",
                out.get("nvml_used_max") is not None,
                required=False,
                detail=out.get("nvml_error"),
            )
            if region is not None:
                checks.add(
                    "region counts what the process holds",
                    out.get("region_used") is not None and out["region_used"] >= hold,
                    required=False,
                    value=out.get("region_used"),
                    expected=f">= {hold}",
                )
        out["checks"] = checks.items
        out["status"] = "info" if checks.status() == "pass" else "error"
        return out

    @staticmethod
    def view_summary(pid, samples, region_rec, hold) -> dict:
        used = [s["procs"][pid] for s in samples if pid in (s.get("procs") or {})]
        sm = [v for s in samples for v in (s.get("sm") or {}).get(pid, [])]
        errors = sorted({s["error"] for s in samples if s.get("error")})
        out: dict = {
            "pid": pid,
            "samples_n": len(samples),
            "nvml_used_max": max(used) if used else None,
            "nvml_used_minus_held": (max(used) - hold) if used else None,
            "nvml_sm_util_mean": round(sum(sm) / len(sm), 1) if sm else None,
            "nvml_sm_util_samples": len(sm),
        }
        if errors:
            out["nvml_error"] = "; ".join(errors)
        r = dig(region_rec, "result", "region") or {}
        procs = r.get("proc_list") or []
        mine = next((x for x in procs if x.get("pid") == pid), None)
        out["region_used"] = r.get("used")
        out["region_proc_used"] = mine.get("used") if mine else None
        if r.get("error"):
            out["region_error"] = r["error"]
        return out
