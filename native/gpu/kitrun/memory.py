"""Memory sections: the environment (GPU, driver, versions), every
allocation path under a limit, the versioned lookups, NVML and nvidia-smi,
and PyTorch running out of memory at the limit."""

from __future__ import annotations

import contextlib
import os
import platform
import queue
import shutil
import socket
import subprocess
import sys
import threading
import time

from .base import finish_record
from .common import (
    ARRAY_PATHS,
    CUDA_ERROR_OUT_OF_MEMORY,
    POOL_PATHS,
    Checks,
    Lib,
    MiB,
    dig,
)


class MemorySections:
    def sec_environment(self) -> dict:
        sec: dict = {
            "host": socket.gethostname(),
            "kernel": platform.release(),
            "python": sys.version.split()[0],
        }
        checks = Checks()
        rec = self.run(self.kit_argv("env"), self.base_env(), label="env")
        sec["run"] = rec
        if self.check_run(checks, rec, "kit env", preload=False):
            r = rec["result"]
            for k in (
                "name",
                "driver_version",
                "cuda_driver_version_str",
                "total_mem",
                "sm_count",
                "cc_major",
                "cc_minor",
                "uuid",
                "pci_bus_id",
                "device_count",
                "l2_bytes",
                "context_bytes",
            ):
                sec[k] = r.get(k)
            self.env_info = sec
        t = self.torch_probe()
        sec["torch"] = t.get("torch")
        sec["torch_cuda"] = t.get("cuda")
        sec["torch_cuda_available"] = t.get("available")
        if not t["ok"]:
            sec["torch_reason"] = t.get("reason")
        smi = self.nvidia_smi_path()
        if smi:
            q = [smi, "--query-gpu=name,driver_version,memory.total,memory.used", "--format=csv"]
            s = self.run(q, self.base_env(), timeout=60, label="nvidia-smi")
            sec["nvidia_smi"] = {
                "rc": s.get("rc"),
                "output": s.get("stdout_other"),
                "stderr": s.get("stderr_tail"),
            }
            if not sec.get("driver_version") and s.get("rc") == 0 and s.get("stdout_other"):
                rows = s["stdout_other"].splitlines()
                if len(rows) > 1:
                    sec["driver_version"] = rows[1].split(",")[1].strip()
        else:
            sec["nvidia_smi"] = {"error": f"{self.a.nvidia_smi} not found"}
        sec["checks"] = checks.items
        sec["status"] = checks.status()
        return sec

    def sec_allocation(self) -> dict:
        return self.per_library(self.allocation_for)

    def allocation_for(self, lib: Lib) -> dict:
        L, oh = self.limit, self.overhead
        base = L - oh  # free memory a fresh container process starts with
        sec: dict = {"limit": L, "chunk": self.a.chunk, "context_overhead": oh, "paths": {}}
        statuses = []
        for path in self.a.paths:
            env, region = self.slice_env(f"alloc-{path}", mem=L, lib=lib)
            rec = self.run(
                self.kit_argv(
                    "alloc",
                    "--path",
                    path,
                    "--limit",
                    L,
                    "--chunk",
                    self.a.chunk,
                    region=region,
                    lib=lib,
                ),
                env,
                label=f"{lib.name} {path}",
            )
            checks = Checks()
            entry: dict = {"run": rec}
            if self.check_run(checks, rec, "kit alloc", preload=True):
                entry.update(self.alloc_checks(checks, path, rec["result"], L, base))
            entry["checks"] = checks.items
            entry["status"] = checks.status()
            statuses.append(entry["status"])
            sec["paths"][path] = entry
        sec["status"] = "fail" if "fail" in statuses else "pass"
        return sec

    @staticmethod
    def alloc_checks(checks: Checks, path: str, r: dict, L: int, base: int) -> dict:
        n = r.get("accepted", 0)
        nominal = r.get("nominal_after") or r.get("nominal") or 0
        acc = r.get("accepted_bytes", 0)
        before = r.get("info_before", {})
        after = r.get("info_after_alloc", {})
        released = r.get("info_after_trim") if path in POOL_PATHS else r.get("info_after_release")
        released = released or {}
        # What the library may add per allocation (documented rounding): 2 MiB
        # granularity everywhere, plus up to 5 % for arrays (the driver's layout).
        per = 2 * MiB + (nominal * 5 // 100 if path in ARRAY_PATHS else 0)
        allowance = n * per
        if path in POOL_PATHS:
            reserved = dig(r, "pool_after_alloc", "reserved")
            if isinstance(reserved, int) and reserved - acc > allowance:
                allowance = reserved - acc
        accounted = None if after.get("free") is None else base - after["free"]
        diff = None if accounted is None else accounted - acc
        summary = {
            "accepted": n,
            "nominal": nominal,
            "accepted_bytes": acc,
            "accounted_bytes": accounted,
            "accounted_minus_accepted": diff,
            "allowance": allowance,
            "refusal": r.get("refusal"),
        }
        checks.add(
            "cuMemGetInfo total == limit",
            before.get("total") == L,
            value=before.get("total"),
            expected=L,
        )
        checks.add(
            "cuDeviceTotalMem_v2 == limit",
            r.get("device_total_mem") == L,
            value=r.get("device_total_mem"),
            expected=L,
        )
        checks.add(
            "free before == limit - context overhead",
            before.get("free") == base,
            value=before.get("free"),
            expected=base,
        )
        checks.add("at least one allocation accepted", n > 0, value=n)
        refusal = r.get("refusal") or {}
        checks.add(
            "refused with CUDA_ERROR_OUT_OF_MEMORY",
            refusal.get("code") == CUDA_ERROR_OUT_OF_MEMORY,
            value=refusal or None,
            detail=None if refusal else f"never refused after {n} allocations",
        )
        checks.add("accepted <= limit", acc <= base, value=acc, expected=f"<= {base}")
        checks.add(
            "accepted > limit - one chunk",
            acc > base - nominal,
            value=acc,
            expected=f"> {base - nominal}",
        )
        checks.add(
            "total after allocating == limit",
            after.get("total") == L,
            value=after.get("total"),
            expected=L,
        )
        checks.add(
            "free == limit - accepted (within allowance)",
            diff is not None and 0 <= diff <= allowance,
            value=after.get("free"),
            expected=base - acc,
            accounted_minus_accepted=diff,
            allowance=allowance,
        )
        checks.add(
            "free == limit - accepted exactly",
            diff == 0,
            required=False,
            accounted_minus_accepted=diff,
        )
        checks.add(
            "release calls succeeded",
            r.get("release_errors", 1) == 0,
            value=r.get("release_errors"),
            detail=r.get("release_first_error"),
        )
        checks.add(
            "freeing everything restores free == limit",
            released.get("free") == base,
            value=released.get("free"),
            expected=base,
            detail="after cuMemPoolTrimTo(pool, 0)" if path in POOL_PATHS else None,
        )
        if path in POOL_PATHS:
            rel = r.get("info_after_release") or {}
            checks.add(
                "free restored before cuMemPoolTrimTo",
                rel.get("free") == base,
                required=False,
                value=rel.get("free"),
                expected=base,
            )
        return summary

    def sec_lookup(self) -> dict:
        why = self.lib_ready()
        if why:
            return {"status": "error", "error": why}
        L = self.limit
        env, region = self.slice_env("lookup", mem=L)
        rec = self.run(self.kit_argv("lookup", "--limit", L, region=region), env, label="lookup")
        checks = Checks()
        sec: dict = {"run": rec}
        if self.check_run(checks, rec, "kit lookup", preload=True):
            r = rec["result"]
            for item in r.get("proc_address", []):
                expect = item.get("expect_in_lib")
                where = item.get("where") or {}
                ok = dig(item, "result", "code") == 0 and where.get("in_lib") == expect
                where_txt = "in" if expect else "not in"
                checks.add(
                    f"cuGetProcAddress_v2 {item.get('label')}: {where_txt} libgpuslice",
                    ok,
                    required=bool(expect),
                    value={
                        "file": where.get("file"),
                        "symbol": where.get("symbol"),
                        "result": dig(item, "result", "name"),
                    },
                )
            dl = r.get("dlsym") or {}
            checks.add("dlopen(libcuda.so.1)", dl.get("dlopen_ok"))
            for name, where in dl.items():
                if isinstance(where, dict):
                    checks.add(
                        f"dlsym {name} in libgpuslice",
                        where.get("in_lib"),
                        value={"file": where.get("file"), "symbol": where.get("symbol")},
                    )
            v1 = r.get("proc_address_v1") or {}
            checks.add(
                "cuGetProcAddress (v1, by dlsym) cuMemAlloc@11030 in libgpuslice",
                dig(v1, "result", "code") == 0 and dig(v1, "where", "in_lib"),
                value=v1.get("where") or v1.get("error"),
            )
            fn = r.get("functional") or {}
            checks.add(
                "resolved cuMemAlloc refuses limit + 64 MiB",
                dig(fn, "alloc_over_limit", "code") == CUDA_ERROR_OUT_OF_MEMORY,
                value=fn.get("alloc_over_limit") or fn.get("error"),
            )
            checks.add(
                "resolved cuMemAlloc accepts 64 MiB",
                dig(fn, "alloc_64m", "code") == 0,
                value=fn.get("alloc_64m"),
            )
            checks.add(
                "resolved cuMemGetInfo total == limit",
                fn.get("total_holding") == L,
                value=fn.get("total_holding"),
                expected=L,
            )
            fb, fh = fn.get("free_before"), fn.get("free_holding")
            checks.add(
                "resolved cuMemGetInfo free drops by 64 MiB",
                fb is not None and fh is not None and fb - fh == 64 * MiB,
                value=None if fb is None or fh is None else fb - fh,
                expected=64 * MiB,
            )
        sec["checks"] = checks.items
        sec["status"] = checks.status()
        return sec

    def sec_nvml(self) -> dict:
        why = self.lib_ready()
        if why:
            return {"status": "error", "error": why}
        L, oh = self.limit, self.overhead
        hold = min(1024 * MiB, (L // 4) // MiB * MiB)
        env, region = self.slice_env("nvml", mem=L)
        argv = self.kit_argv("nvml", "--limit", L, "--hold", hold, "--wait", region=region)
        sec: dict = {"limit": L, "hold": hold}
        checks = Checks()
        rec, smi = self.run_holding(argv, env, hold_cmd=self.nvidia_smi_cmd())
        sec["run"] = rec
        sec["nvidia_smi"] = smi
        if self.check_run(checks, rec, "kit nvml", preload=True):
            r = rec["result"]
            used = hold + oh
            for fname, where in (r.get("nvml_functions") or {}).items():
                checks.add(
                    f"dlsym {fname} in libgpuslice",
                    where.get("in_lib"),
                    required=False,
                    value={"file": where.get("file"), "symbol": where.get("symbol")},
                )
            checks.add(
                "cuMemGetInfo free == limit - held",
                dig(r, "cuda_meminfo_holding", "free") == L - used,
                value=dig(r, "cuda_meminfo_holding", "free"),
                expected=L - used,
            )
            for ver in ("v1", "v2"):
                m = dig(r, "holding", ver)
                fn = "nvmlDeviceGetMemoryInfo" + ("" if ver == "v1" else "_v2")
                if m is None:
                    checks.add(f"{fn} answered", False, value=dig(r, "holding", f"{ver}_error"))
                    continue
                checks.add(
                    f"{fn} total == limit", m.get("total") == L, value=m.get("total"), expected=L
                )
                checks.add(
                    f"{fn} used == container usage",
                    m.get("used") == used,
                    value=m.get("used"),
                    expected=used,
                )
                if ver == "v1":
                    checks.add(
                        f"{fn} free == total - used",
                        m.get("free") == L - used,
                        value=m.get("free"),
                        expected=L - used,
                    )
                else:
                    s = (m.get("free") or 0) + (m.get("used") or 0) + (m.get("reserved") or 0)
                    checks.add(
                        f"{fn} free + used + reserved == total",
                        s == m.get("total"),
                        required=False,
                        value=m,
                    )
                rel = dig(r, "released", ver) or {}
                checks.add(
                    f"{fn} used after release == overhead",
                    rel.get("used") == oh,
                    value=rel.get("used"),
                    expected=oh,
                )
        # nvidia-smi reads the same region file while the kit holds `hold` bytes.
        if smi.get("rows"):
            row = smi["rows"][0]
            checks.add(
                "nvidia-smi memory.total == limit",
                row.get("total_mib") == L // MiB,
                required=False,
                value=row.get("total_mib"),
                expected=L // MiB,
            )
            checks.add(
                "nvidia-smi memory.used == container usage",
                row.get("used_mib") == (hold + oh) // MiB,
                required=False,
                value=row.get("used_mib"),
                expected=(hold + oh) // MiB,
            )
        else:
            checks.add("nvidia-smi ran", False, required=False, detail=smi.get("error"))
        sec["checks"] = checks.items
        sec["status"] = checks.status()
        return sec

    def nvidia_smi_path(self):
        smi = self.a.nvidia_smi
        path = smi if os.sep in smi else shutil.which(smi)
        return path if path and os.access(path, os.X_OK) else None

    def nvidia_smi_cmd(self):
        path = self.nvidia_smi_path()
        return [path, "--query-gpu=memory.total,memory.used", "--format=csv"] if path else None

    def run_holding(self, argv, env, hold_cmd):
        """Start the kit, wait for its "holding" line, run hold_cmd under the same
        environment (same container), then let the kit finish."""
        rec: dict = {"label": "nvml", "argv": argv}
        smi: dict = {}
        t0 = time.monotonic()
        try:
            p = subprocess.Popen(
                argv,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                errors="replace",
            )
        except OSError as e:
            rec.update(rc=None, error=f"cannot start: {e}")
            return rec, {"error": "kit did not start"}
        lines: queue.Queue = queue.Queue()
        out_lines: list[str] = []
        err_chunks: list[str] = []

        def pump_out():
            for line in p.stdout:
                out_lines.append(line)
                lines.put(line)
            lines.put(None)

        def pump_err():
            err_chunks.append(p.stderr.read())

        threads = [
            threading.Thread(target=pump_out, daemon=True),
            threading.Thread(target=pump_err, daemon=True),
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + self.a.timeout
        holding = False
        while time.monotonic() < deadline:
            try:
                line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                break
            if '"holding"' in line:
                holding = True
                break
        if holding:
            if hold_cmd:
                s = self.run(hold_cmd, env, timeout=60, label="nvidia-smi (preloaded)")
                smi = {
                    "argv": hold_cmd,
                    "rc": s.get("rc"),
                    "output": s.get("stdout_other"),
                    "stderr": s.get("stderr_tail"),
                }
                smi["rows"] = self.parse_smi(s.get("stdout_other") or "")
                if not smi["rows"]:
                    smi["error"] = "no memory.total/memory.used row in the output"
            else:
                smi = {"error": f"{self.a.nvidia_smi} not found"}
        else:
            smi = {"error": "the kit never reported holding its allocation"}
        with contextlib.suppress(OSError):
            p.stdin.close()
        try:
            p.wait(timeout=max(5, deadline - time.monotonic()))
            rec.update(rc=p.returncode, timed_out=False)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            rec.update(rc=None, timed_out=True, timeout_s=self.a.timeout)
        for t in threads:
            t.join(timeout=5)
        rec["elapsed_s"] = round(time.monotonic() - t0, 3)
        return finish_record(rec, "".join(out_lines), "".join(err_chunks)), smi

    @staticmethod
    def parse_smi(text: str) -> list[dict]:
        rows = []
        for line in text.splitlines():
            parts = [x.strip() for x in line.split(",")]
            if len(parts) != 2 or not parts[0].endswith("MiB"):
                continue
            try:
                rows.append(
                    {"total_mib": int(parts[0].split()[0]), "used_mib": int(parts[1].split()[0])}
                )
            except (ValueError, IndexError):
                continue
        return rows

    def sec_pytorch(self) -> dict:
        t = self.torch_probe()
        if not t["ok"]:
            return {"status": "skipped", "reason": t["reason"], "probe": t.get("probe")}
        sec = self.per_library(self.pytorch_for)
        sec["torch"], sec["torch_cuda"] = t.get("torch"), t.get("cuda")
        return sec

    def pytorch_for(self, lib: Lib) -> dict:
        L, oh, step = self.limit, self.overhead, self.a.torch_step
        eff = L - oh  # one CUDA context per process
        sec: dict = {
            "limit": L,
            "step": step,
            "context_overhead": oh,
            "runs": {},
        }
        statuses = []
        configs = [
            ("default", None, True),
            ("expandable_segments", "expandable_segments:True", True),
            ("cudaMallocAsync", "backend:cudaMallocAsync", False),
        ]
        for name, conf, required in configs:
            extra = {"PYTORCH_CUDA_ALLOC_CONF": conf} if conf else None
            env, _region = self.slice_env(f"torch-{name}", mem=L, extra=extra, lib=lib)
            rec = self.run(
                [
                    self.a.python,
                    self.a.torch_script,
                    "--limit",
                    str(L),
                    "--step",
                    str(step),
                    "--lib",
                    lib.path,
                ],
                env,
                timeout=max(self.a.timeout, 300),
                label=f"{lib.name} torch {name}",
            )
            checks = Checks()
            ok, why = self.script_ok(rec)
            r = rec.get("result") or {}
            checks.add("ran", ok, required=required, detail=why or None)
            if ok:
                checks.add(
                    "interposer mapped in the process",
                    r.get("interposer_mapped") is True,
                    required=required,
                )
                checks.add(
                    "mem_get_info total == limit",
                    dig(r, "mem_get_info_before", "total") == L,
                    required=required,
                    value=dig(r, "mem_get_info_before", "total"),
                    expected=L,
                )
                checks.add(
                    "torch.cuda.OutOfMemoryError raised",
                    r.get("oom") is True,
                    required=required,
                    value=r.get("oom_type"),
                    detail=(r.get("other_error") or "")[-800:] or None,
                )
                res_b = r.get("memory_reserved_at_oom")
                checks.add(
                    "memory_reserved at OOM <= limit",
                    res_b is not None and res_b <= eff,
                    required=required,
                    value=res_b,
                    expected=f"<= {eff}",
                )
                checks.add(
                    "memory_reserved at OOM > limit - one step",
                    res_b is not None and res_b > eff - step,
                    required=required,
                    value=res_b,
                    expected=f"> {eff - step}",
                )
            rec_s = dict(rec)
            entry = {
                "alloc_conf": conf,
                "required": required,
                "result": r,
                "run": rec_s,
                "checks": checks.items,
                "status": checks.status(),
            }
            statuses.append(entry["status"] if required else "pass")
            sec["runs"][name] = entry
        sec["status"] = "fail" if "fail" in statuses else "pass"
        return sec
