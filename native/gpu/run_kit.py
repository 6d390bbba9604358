#!/usr/bin/env python3
"""gpuslice GPU kit driver: runs the kit's programs with and without
libgpuslice.so preloaded, checks what they print and writes one JSON report.

Sections (each runs even when another failed; a failure is recorded, not raised):
  environment  GPU, driver and CUDA versions (no interposer)
  allocation   every allocation path allocates until refused under a memory limit
  lookup       cuGetProcAddress_v2 and dlsym hand out the interposer's functions
  nvml         NVML and nvidia-smi show the limit and the container's usage
  pytorch      PyTorch runs out of memory at the limit (skipped without torch)
  compute      achieved compute share vs CUDA_DEVICE_SM_LIMIT, one and two processes
  overhead     ns per kernel launch and per cuMemAlloc/cuMemFree pair, with and without

Python 3 standard library only. Exit status: 0 when nothing failed, 1 when a
check failed or a section could not run, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import platform
import queue
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback

MiB = 1024 * 1024
SECTIONS = ("environment", "allocation", "lookup", "nvml", "pytorch", "compute", "overhead")
ALLOC_PATHS = (
    "cuMemAlloc_v2",
    "cuMemAllocPitch_v2",
    "cuMemAllocManaged",
    "cuArrayCreate_v2",
    "cuArray3DCreate_v2",
    "cuMipmappedArrayCreate",
    "cuMemCreate",
    "cuMemAllocAsync",
    "cuMemAllocFromPoolAsync",
)
POOL_PATHS = ("cuMemAllocAsync", "cuMemAllocFromPoolAsync")
ARRAY_PATHS = ("cuArrayCreate_v2", "cuArray3DCreate_v2", "cuMipmappedArrayCreate")
CUDA_ERROR_OUT_OF_MEMORY = 2
# Settings of the interposer (and of its deployment) that must not leak into
# the kit's runs from the calling environment.
SCRUB_EXACT = (
    "LD_PRELOAD",
    "GPU_CORE_UTILIZATION_POLICY",
    "CUDA_DEVICE_MEMORY_SHARED_CACHE",
    "LIBCUDA_LOG_LEVEL",
    "CUDA_DISABLE_CONTROL",
    "CUDA_TASK_PRIORITY",
    "ACTIVE_OOM_KILLER",
    "PYTORCH_CUDA_ALLOC_CONF",
)
SCRUB_PREFIX = ("CUDA_DEVICE_MEMORY_LIMIT", "CUDA_DEVICE_SM_LIMIT", "GPUSLICE_")


# --------------------------------------------------------------------------- helpers
def parse_size(text: str) -> int:
    t = text.strip().lower().rstrip("b").rstrip("i")
    mul = 1
    if t and t[-1] in "kmgt":
        mul = 1024 ** ("kmgt".index(t[-1]) + 1)
        t = t[:-1]
    try:
        v = float(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4g, 300m, 4096)") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"negative size: {text!r}")
    return int(v * mul + 0.5)


def parse_int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a comma-separated list of integers: {text!r}"
        ) from None


def parse_sections(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in SECTIONS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown section(s) {bad}; known: {', '.join(SECTIONS)}")
    return names


def mib(v) -> str:
    return "?" if v is None else f"{v / MiB:.0f} MiB"


def tail(text: str, n: int = 3000) -> str:
    return text if len(text) <= n else "..." + text[-n:]


def dig(d, *keys, default=None):
    for k in keys:
        in_dict = isinstance(d, dict) and k in d
        in_list = isinstance(d, list) and isinstance(k, int) and -len(d) <= k < len(d)
        if in_dict or in_list:
            d = d[k]
        else:
            return default
    return d


def parse_json_lines(text: str):
    """Every JSON object line; the last {"event":"result"} is the result."""
    events, other, result = [], [], None
    for line in text.splitlines():
        s = line.strip()
        if not s:
            continue
        if s.startswith("{"):
            try:
                obj = json.loads(s)
            except ValueError:
                other.append(s)
                continue
            events.append(obj)
            if obj.get("event") == "result":
                result = obj
        else:
            other.append(s)
    return events, other, result


class Checks:
    """Named checks: required ones decide pass/fail, the others are warnings."""

    def __init__(self) -> None:
        self.items: list[dict] = []

    def add(self, name: str, ok, required: bool = True, **detail) -> bool:
        item = {"name": name, "ok": bool(ok), "required": required}
        item.update(detail)
        self.items.append(item)
        return bool(ok)

    def status(self) -> str:
        if any(not c["ok"] and c["required"] for c in self.items):
            return "fail"
        return "pass"


# --------------------------------------------------------------------------- the kit
class Kit:
    def __init__(self, args: argparse.Namespace) -> None:
        self.a = args
        self.kit = os.path.abspath(args.kit) if args.kit else None
        self.lib = os.path.abspath(args.lib) if args.lib else None
        args.torch_script = os.path.abspath(args.torch_script)
        self.tmp = tempfile.mkdtemp(prefix="gpuslice-kit-")
        self.n_region = 0
        self.env_info: dict = {}
        self.limit = args.limit
        self.overhead = args.context_overhead

    # ---- environments
    def base_env(self) -> dict:
        return {
            k: v
            for k, v in os.environ.items()
            if k not in SCRUB_EXACT and not k.startswith(SCRUB_PREFIX)
        }

    def region_path(self, label: str) -> str:
        self.n_region += 1
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in label)
        return os.path.join(self.tmp, f"region-{self.n_region:03d}-{safe}.cache")

    def slice_env(self, label: str, mem=None, sm=None, policy=None, extra=None):
        """Environment of a container: the interposer preloaded, a fresh region file."""
        env = self.base_env()
        region = self.region_path(label)
        env["LD_PRELOAD"] = self.lib or ""
        env["CUDA_DEVICE_MEMORY_SHARED_CACHE"] = region
        env["GPUSLICE_CONTEXT_OVERHEAD"] = str(self.overhead)
        if mem is not None:
            env["CUDA_DEVICE_MEMORY_LIMIT"] = str(mem)
        if sm is not None:
            env["CUDA_DEVICE_SM_LIMIT"] = str(sm)
        if policy is not None:
            env["GPU_CORE_UTILIZATION_POLICY"] = policy
        if self.a.log_level is not None:
            env["LIBCUDA_LOG_LEVEL"] = str(self.a.log_level)
        if extra:
            env.update(extra)
        return env, region

    def lib_ready(self) -> str | None:
        if not self.lib:
            return "no --lib given"
        if not os.path.isfile(self.lib):
            return f"library not found: {self.lib}"
        return None

    def kit_argv(self, cmd: str, *opts, region: str | None = None) -> list[str]:
        argv = [self.kit, cmd, "--device", str(self.a.device)]
        if self.lib:
            argv += ["--lib", self.lib]
        if region:
            argv += ["--region", region]
        return argv + [str(o) for o in opts]

    # ---- running programs
    def run(self, argv, env, timeout=None, label=None) -> dict:
        timeout = timeout or self.a.timeout
        t0 = time.monotonic()
        rec: dict = {"label": label, "argv": argv, "timeout_s": timeout}
        try:
            p = subprocess.run(
                argv,
                env=env,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=timeout,
                text=True,
                errors="replace",
            )
            rec.update(rc=p.returncode, timed_out=False)
            out, err = p.stdout, p.stderr
        except subprocess.TimeoutExpired as e:
            rec.update(rc=None, timed_out=True)
            out = (
                e.stdout.decode(errors="replace")
                if isinstance(e.stdout, bytes)
                else (e.stdout or "")
            )
            err = (
                e.stderr.decode(errors="replace")
                if isinstance(e.stderr, bytes)
                else (e.stderr or "")
            )
        except OSError as e:
            rec.update(rc=None, timed_out=False, error=f"cannot start: {e}")
            out, err = "", ""
        rec["elapsed_s"] = round(time.monotonic() - t0, 3)
        events, other, result = parse_json_lines(out)
        rec["result"] = result
        if len(events) > 1:
            rec["events"] = [e for e in events if e is not result][:20]
        if other:
            rec["stdout_other"] = tail("\n".join(other), 2000)
        if err.strip():
            rec["stderr_tail"] = tail(err, 3000)
        return rec

    @staticmethod
    def run_ok(rec: dict) -> tuple[bool, str]:
        """Did the program finish and print a result without a fatal error?"""
        if rec.get("error"):
            return False, rec["error"]
        if rec.get("timed_out"):
            return False, f"timed out after {rec['timeout_s']} s"
        res = rec.get("result")
        if res is None:
            return (
                False,
                f"no result line (rc={rec.get('rc')}); stderr: {rec.get('stderr_tail', '')[-400:]}",
            )
        if res.get("fatal"):
            f = res["fatal"]
            return False, f"{f.get('call')} -> {f.get('name', '')} ({f.get('code', '')})"
        if rec.get("rc") != 0:
            return False, f"exit status {rec.get('rc')}"
        return True, ""

    def check_run(self, checks: Checks, rec: dict, name: str, preload: bool) -> bool:
        ok, why = self.run_ok(rec)
        checks.add(f"{name}: ran", ok, detail=why or None)
        if ok and preload:
            res = rec["result"]
            ok = checks.add(
                f"{name}: interposer loaded",
                res.get("interposed") is True,
                detail=f"cuMemAlloc_v2 resolved from {res.get('cuMemAlloc_v2_from')}",
            )
        return ok

    # ---- sections
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
        why = self.lib_ready()
        if why:
            return {"status": "error", "error": why}
        L, oh = self.limit, self.overhead
        base = L - oh  # free memory a fresh container process starts with
        sec: dict = {"limit": L, "chunk": self.a.chunk, "context_overhead": oh, "paths": {}}
        statuses = []
        for path in self.a.paths:
            env, region = self.slice_env(f"alloc-{path}", mem=L)
            rec = self.run(
                self.kit_argv(
                    "alloc", "--path", path, "--limit", L, "--chunk", self.a.chunk, region=region
                ),
                env,
                label=path,
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
        events, other, result = parse_json_lines("".join(out_lines))
        rec["result"] = result
        rec["events"] = [e for e in events if e is not result][:20]
        if other:
            rec["stdout_other"] = tail("\n".join(other), 2000)
        err = "".join(err_chunks)
        if err.strip():
            rec["stderr_tail"] = tail(err, 3000)
        return rec, smi

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
        py = self.a.python
        probe = self.run(
            [
                py,
                "-c",
                "import json, torch; print(json.dumps({'event': 'result', "
                "'torch': torch.__version__, 'cuda': torch.version.cuda, "
                "'available': torch.cuda.is_available()}))",
            ],
            self.base_env(),
            timeout=180,
            label="torch probe",
        )
        res = probe.get("result")
        if probe.get("rc") != 0 or not res:
            last = (probe.get("stderr_tail") or probe.get("error") or "").strip().splitlines()[-1:]
            return {
                "status": "skipped",
                "reason": f"`{py} -c 'import torch'` failed: {' '.join(last)}",
                "probe": probe,
            }
        if not res.get("available"):
            return {
                "status": "skipped",
                "reason": "torch.cuda.is_available() is False",
                "probe": res,
            }
        why = self.lib_ready()
        if why:
            return {"status": "error", "error": why, "probe": res}
        L, oh, step = self.limit, self.overhead, self.a.torch_step
        eff = L - oh  # one CUDA context per process
        sec: dict = {
            "torch": res.get("torch"),
            "torch_cuda": res.get("cuda"),
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
            env, _region = self.slice_env(f"torch-{name}", mem=L, extra=extra)
            rec = self.run(
                [
                    py,
                    self.a.torch_script,
                    "--limit",
                    str(L),
                    "--step",
                    str(step),
                    "--lib",
                    self.lib,
                ],
                env,
                timeout=max(self.a.timeout, 300),
                label=f"torch {name}",
            )
            checks = Checks()
            ok, why = self.run_ok(rec)
            r = rec.get("result") or {}
            if ok and r.get("error"):
                ok, why = False, r["error"]
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

    # ---- compute
    def compute_run(self, label, iters, env, seconds, start_at=None, region=None):
        opts = ["--iters", iters, "--seconds", seconds, "--warmup", self.a.compute_warmup]
        if start_at:
            opts += ["--start-at", f"{start_at:.3f}"]
        return self.run(
            self.kit_argv("compute", *opts, region=region),
            env,
            timeout=seconds + self.a.timeout,
            label=label,
        )

    def sec_compute(self) -> dict:
        a = self.a
        secs = a.compute_seconds
        tol = a.tolerance_pp
        sec: dict = {"seconds_per_run": secs, "tolerance_pp": tol, "target_kernel_ms": a.kernel_ms}
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
        sec["iters"] = iters
        sec["kernel_ms"] = cal["result"].get("kernel_ms")
        sec["grid"] = cal["result"].get("grid")

        runs: dict = {}
        runs["baseline"] = self.compute_run("baseline", iters, self.base_env(), secs)
        base_ok = self.check_run(
            checks, runs["baseline"], "baseline (no interposer)", preload=False
        )
        lib_why = self.lib_ready()
        limited: list[tuple[str, int]] = []
        if lib_why:
            checks.add("interposer available", False, detail=lib_why)
        else:
            env, region = self.slice_env("compute-disable", sm=50, policy="disable")
            runs["preload_policy_disable"] = self.compute_run(
                "policy=disable, limit 50", iters, env, secs, region=region
            )
            self.check_run(checks, runs["preload_policy_disable"], "policy=disable", preload=True)
            for t in a.compute_targets:
                env, region = self.slice_env(f"compute-{t}", sm=t, policy="force")
                key = f"limit_{t}"
                runs[key] = self.compute_run(key, iters, env, secs, region=region)
                if self.check_run(checks, runs[key], f"limit {t}%", preload=True):
                    limited.append((key, t))
            pair = self.compute_pair(iters, a.pair_targets, secs)
            sec["pair"] = pair
        runs["baseline_after"] = self.compute_run("baseline after", iters, self.base_env(), secs)
        after_ok = self.check_run(
            checks, runs["baseline_after"], "baseline after (no interposer)", preload=False
        )
        sec["runs"] = runs

        def tput(rec):
            return dig(rec, "result", "kernels_per_s")

        if not base_ok:
            sec["checks"] = checks.items
            sec["status"] = "error"
            return sec
        b0 = tput(runs["baseline"])
        b1 = tput(runs["baseline_after"]) if after_ok else None
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

        def share(rec):
            v = tput(rec)
            return None if v is None else v / ref * 100

        table = []
        if "preload_policy_disable" in runs and self.run_ok(runs["preload_policy_disable"])[0]:
            s = share(runs["preload_policy_disable"])
            sec["policy_disable_share_pct"] = round(s, 2)
            checks.add(
                "policy=disable is not throttled (share 100 %)",
                abs(s - 100) <= tol,
                value=round(s, 2),
                expected=100,
            )
        for key, t in limited:
            s = share(runs[key])
            err = s - t
            rr = runs[key]["result"]
            table.append(
                {
                    "target_pct": t,
                    "achieved_pct": round(s, 2),
                    "error_pp": round(err, 2) + 0.0,
                    "kernels_per_s": rr.get("kernels_per_s"),
                    "launch_call_ms_max": rr.get("launch_call_ms_max"),
                    "throttled_ns": dig(rr, "region", "throttled_ns"),
                }
            )
            checks.add(
                f"limit {t}%: |achieved - target| <= {tol} pp",
                abs(err) <= tol,
                value=round(s, 2),
                expected=t,
                error_pp=round(err, 2),
            )
        sec["single"] = table
        if table:
            errs = [abs(x["error_pp"]) for x in table]
            sec["single_max_abs_error_pp"] = round(max(errs), 2)
            sec["single_mean_abs_error_pp"] = round(statistics.mean(errs), 2)
        pair = sec.get("pair")
        if pair:
            procs = pair.get("procs", [])
            for pr in procs:
                ok, why = self.run_ok(pr["run"])
                if ok and pr["run"]["result"].get("interposed") is not True:
                    ok, why = False, "interposer not loaded"
                checks.add(f"pair limit {pr['target_pct']}%: ran", ok, detail=why or None)
                if ok:
                    s = share(pr["run"])
                    pr["achieved_pct"] = round(s, 2)
                    pr["error_pp"] = round(s - pr["target_pct"], 2)
                    checks.add(
                        f"pair limit {pr['target_pct']}%: |achieved - target| <= {tol} pp",
                        abs(s - pr["target_pct"]) <= tol,
                        value=round(s, 2),
                        expected=pr["target_pct"],
                        error_pp=pr["error_pp"],
                    )
            done = [pr for pr in procs if "achieved_pct" in pr]
            if len(done) == 2:
                lo, hi = sorted(done, key=lambda x: x["target_pct"])
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
                    "pair ran concurrently (overlap >= 90 % of the run)",
                    pair["overlap_s"] >= 0.9 * secs,
                    required=False,
                    value=pair["overlap_s"],
                )
        sec["checks"] = checks.items
        sec["status"] = checks.status()
        return sec

    def compute_pair(self, iters, targets, secs) -> dict:
        """Two containers (two region files) at once, each with its own limit."""
        start_at = time.time() + self.a.pair_start_delay
        procs = []
        for t in targets:
            env, region = self.slice_env(f"pair-{t}", sm=t, policy="force")
            opts = [
                "--iters",
                iters,
                "--seconds",
                secs,
                "--warmup",
                self.a.compute_warmup,
                "--start-at",
                f"{start_at:.3f}",
            ]
            argv = self.kit_argv("compute", *opts, region=region)
            procs.append({"target_pct": t, "argv": argv, "env": env})
        results: list = [None] * len(procs)

        def go(i):
            pr = procs[i]
            results[i] = self.run(
                pr["argv"],
                pr["env"],
                timeout=secs + self.a.pair_start_delay + self.a.timeout,
                label=f"pair {pr['target_pct']}",
            )

        threads = [threading.Thread(target=go, args=(i,)) for i in range(len(procs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        out = {"start_at_epoch": start_at, "procs": []}
        for pr, rec in zip(procs, results, strict=True):
            late = dig(rec, "result", "late_s")
            out["procs"].append({"target_pct": pr["target_pct"], "late_s": late, "run": rec})
        return out

    # ---- overhead
    def sec_overhead(self) -> dict:
        a = self.a
        sec: dict = {
            "launch_count": a.launch_count,
            "alloc_pairs": a.alloc_pairs,
            "repeat": a.repeat,
            "configs": {},
        }
        checks = Checks()
        configs = [("none", None)]
        why = self.lib_ready()
        if why:
            checks.add("interposer available", False, detail=why)
        else:
            configs += [("preload", {}), ("preload_mem_limit", {"mem": self.limit})]
        for name, opts in configs:
            if opts is None:
                env, region, preload = self.base_env(), None, False
            else:
                env, region = self.slice_env(f"overhead-{name}", **opts)
                preload = True
            c: dict = {}
            rec = self.run(
                self.kit_argv(
                    "launch", "--count", a.launch_count, "--repeat", a.repeat, region=region
                ),
                env,
                label=f"launch {name}",
            )
            c["launch_run"] = rec
            if self.check_run(checks, rec, f"launch {name}", preload):
                c["launch_ns_median"] = rec["result"].get("ns_median")
                c["launch_ns_min"] = rec["result"].get("ns_min")
            if opts is not None:
                env, region = self.slice_env(f"overhead-alloc-{name}", **opts)
            rec = self.run(
                self.kit_argv(
                    "allocpair",
                    "--count",
                    a.alloc_pairs,
                    "--size",
                    MiB,
                    "--repeat",
                    a.repeat,
                    region=region,
                ),
                env,
                label=f"allocpair {name}",
            )
            c["allocpair_run"] = rec
            if self.check_run(checks, rec, f"allocpair {name}", preload):
                c["allocpair_ns_median"] = rec["result"].get("ns_median")
                c["allocpair_ns_min"] = rec["result"].get("ns_min")
            sec["configs"][name] = c
        none = sec["configs"].get("none", {})
        diffs = {}
        for name, c in sec["configs"].items():
            if name == "none":
                continue
            d = {}
            for k in ("launch_ns_median", "allocpair_ns_median"):
                if c.get(k) is not None and none.get(k) is not None:
                    d[k.replace("_median", "_added")] = round(c[k] - none[k], 1)
                    d[k.replace("_ns_median", "_ratio")] = (
                        round(c[k] / none[k], 3) if none[k] else None
                    )
            diffs[name] = d
        sec["added_vs_none"] = diffs
        sec["checks"] = checks.items
        sec["status"] = "info" if checks.status() == "pass" else "error"
        return sec


# --------------------------------------------------------------------------- report
def library_info(args) -> dict:
    info: dict = {"path": os.path.abspath(args.lib) if args.lib else None}
    if args.lib and os.path.isfile(args.lib):
        st = os.stat(args.lib)
        h = hashlib.sha256()
        with open(args.lib, "rb") as f:
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
    if args.lib_build_rc:
        try:
            with open(args.lib_build_rc) as f:
                info["build_rc"] = int(f.read().strip() or "-1")
        except (OSError, ValueError) as e:
            info["build_rc_error"] = str(e)
    return info


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
                if k in ("checks", "run", "runs"):
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
    bad = any(s in ("fail", "error") for s in sections.values()) or bool(failed)
    return {
        "status": "fail" if bad else "pass",
        "sections": sections,
        "failed_checks": failed,
        "warnings": warnings,
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
    lib = report.get("library", {})
    out.append(
        f"library: {lib.get('path')} ({'found' if lib.get('exists') else 'MISSING'}"
        + (f", build rc={lib['build_rc']}" if "build_rc" in lib else "")
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
    ov = report.get("overhead", {})
    if ov.get("configs"):
        c = ov["configs"]
        d = ov.get("added_vs_none", {}).get("preload", {})
        line(
            "overhead",
            "launch {} ns ({} with preload), alloc+free 1 MiB {} ns ({})".format(
                _fmt(dig(c, "none", "launch_ns_median")),
                _fmt(d.get("launch_ns_added"), True),
                _fmt(dig(c, "none", "allocpair_ns_median")),
                _fmt(d.get("allocpair_ns_added"), True),
            ),
        )
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
    return "\n".join(out)


def _fmt(v, signed=False):
    if v is None:
        return "?"
    return f"{v:+.0f}" if signed else f"{v:.0f}"


# --------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser(
        description="Run the gpuslice GPU kit (needs an NVIDIA GPU) and write a JSON report.",
        epilog="Usually run through `make -C native gpu-check`. Sections: " + ", ".join(SECTIONS),
    )
    p.add_argument("--kit", help="the kit binary (built by native/gpu/Makefile)")
    p.add_argument("--lib", help="libgpuslice.so to preload")
    p.add_argument("--out", default="gpu-report.json", help="report path (default: %(default)s)")
    p.add_argument("--lib-build-rc", help="file holding the library build's exit status")
    p.add_argument("--only", type=parse_sections, help="comma-separated sections to run")
    p.add_argument(
        "--skip", type=parse_sections, default=[], help="comma-separated sections to leave out"
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
    p.add_argument(
        "--torch-step",
        type=parse_size,
        default=parse_size("200m"),
        help="bytes per tensor in the PyTorch section (default: 200m)",
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
        "--pair-targets",
        type=parse_int_list,
        default=[30, 70],
        help="limits of the two concurrent processes (default: 30,70)",
    )
    p.add_argument(
        "--pair-start-delay",
        type=float,
        default=6.0,
        help="seconds from starting the pair to their common start (default: 6)",
    )
    p.add_argument(
        "--tolerance-pp",
        type=float,
        default=5.0,
        help="allowed |achieved - target| in percentage points (default: 5)",
    )
    p.add_argument("--launch-count", type=int, default=200000, help="empty-kernel launches per run")
    p.add_argument(
        "--alloc-pairs", type=int, default=20000, help="cuMemAlloc_v2+cuMemFree_v2 pairs per run"
    )
    p.add_argument("--repeat", type=int, default=3, help="runs per overhead measurement (median)")
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


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if not args.kit:
        print(
            "run_kit.py: --kit is required (build it with `make -C native/gpu programs`)",
            file=sys.stderr,
        )
        return 2
    if not os.access(args.kit, os.X_OK):
        print(f"run_kit.py: kit binary not executable: {args.kit}", file=sys.stderr)
        return 2
    bad = [p for p in args.paths if p not in ALLOC_PATHS]
    if bad:
        print(
            f"run_kit.py: unknown allocation path(s) {bad}; known: {', '.join(ALLOC_PATHS)}",
            file=sys.stderr,
        )
        return 2
    if args.quick:
        args.compute_seconds = min(args.compute_seconds, 1.0)
        args.compute_warmup = min(args.compute_warmup, 0.2)
        args.pair_start_delay = min(args.pair_start_delay, 3.0)
        args.launch_count = min(args.launch_count, 20000)
        args.alloc_pairs = min(args.alloc_pairs, 2000)
        args.repeat = 1
    selected = [s for s in (args.only or SECTIONS) if s not in args.skip]

    kit = Kit(args)
    t0 = time.time()
    report: dict = {
        "kit": {
            "version": 1,
            "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)),
            "argv": sys.argv,
            "commit": git_commit(),
            "tmp_dir": kit.tmp,
        },
        "library": library_info(args),
        "settings": {
            "memory_limit": args.limit,
            "chunk": args.chunk,
            "context_overhead": args.context_overhead,
            "torch_step": args.torch_step,
            "kernel_ms": args.kernel_ms,
            "compute_seconds": args.compute_seconds,
            "compute_targets": args.compute_targets,
            "pair_targets": args.pair_targets,
            "tolerance_pp": args.tolerance_pp,
            "launch_count": args.launch_count,
            "alloc_pairs": args.alloc_pairs,
            "repeat": args.repeat,
            "quick": args.quick,
            "sections": selected,
        },
    }
    out = os.path.abspath(args.out)
    for name in SECTIONS:
        if name not in selected:
            report[name] = {"status": "skipped", "reason": "not selected"}
            continue
        ts = time.monotonic()
        print(f"[gpu kit] {name} ...", file=sys.stderr, flush=True)
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
        report.pop("summary", None)
        report["summary"] = summarize(report)
        write_report(out, report)
    report["kit"]["duration_s"] = round(time.time() - t0, 1)
    report["kit"]["finished_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    report.pop("summary", None)
    report["summary"] = summarize(report)
    write_report(out, report)
    if not args.keep_tmp:
        shutil.rmtree(kit.tmp, ignore_errors=True)
    print(human_summary(report))
    print(f"report: {out}")
    if report["summary"]["status"] != "pass" and not args.no_fail:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
