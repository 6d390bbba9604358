"""The kit's core: the environments it runs programs in (no library, gpuslice,
each peer), running a program under a timeout, and what every section asks
of a run (did it finish, was the library loaded)."""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time
import traceback

from .common import SCRUB_EXACT, SCRUB_PREFIX, Checks, Lib, env_size, parse_json_lines, tail


class KitBase:
    def __init__(self, args: argparse.Namespace) -> None:
        self.a = args
        self.kit = os.path.abspath(args.kit) if args.kit else None
        self.ours = Lib("gpuslice", os.path.abspath(args.lib), True) if args.lib else None
        notes = dict(args.peer_note or [])
        self.peers = [
            Lib(name, os.path.abspath(path), False, notes.get(name)) for name, path in args.peer
        ]
        args.torch_script = os.path.abspath(args.torch_script)
        args.workload_script = os.path.abspath(args.workload_script)
        self.tmp = tempfile.mkdtemp(prefix="gpuslice-kit-")
        self.n_region = 0
        self.env_info: dict = {}
        self.limit = args.limit
        self.overhead = args.context_overhead
        self.iters: int | None = None  # the calibrated kernel's, once compute ran
        self.torch: dict | None = None  # the probe's answer, once asked

    # ---- libraries
    @property
    def lib(self) -> str | None:
        return self.ours.path if self.ours else None

    def libs(self) -> list[Lib]:
        """gpuslice (when given) and then every peer."""
        return ([self.ours] if self.ours else []) + self.peers

    def lib_ready(self, lib: Lib | None = None) -> str | None:
        lib = lib or self.ours
        if lib is None:
            return "no --lib given"
        if not os.path.isfile(lib.path):
            return f"library not found: {lib.path}"
        return None

    def per_library(self, fn) -> dict:
        """fn(lib) for gpuslice, whose result is the section's, and for each
        peer, kept under "peers" (their failures are findings about the peer)."""
        why = self.lib_ready()
        if why:
            sec: dict = {"status": "error", "error": why}
        else:
            sec = fn(self.ours)
        peers = {}
        for p in self.peers:
            why = self.lib_ready(p)
            if why:
                peers[p.name] = {"status": "error", "error": why}
                continue
            try:
                peers[p.name] = fn(p)
            except Exception as e:  # a peer's trouble must not lose ours
                peers[p.name] = {
                    "status": "error",
                    "error": f"{type(e).__name__}: {e}",
                    "traceback": traceback.format_exc(),
                }
        if peers:
            sec["peers"] = peers
        return sec

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

    def slice_env(
        self, label: str, mem=None, sm=None, policy=None, extra=None, lib: Lib | None = None
    ):
        """Environment of a container: the library preloaded, a fresh region
        file. Peers such as HAMi-core read the same variables."""
        lib = lib or self.ours
        env = self.base_env()
        region = self.region_path(f"{lib.name if lib else 'none'}-{label}")
        env["LD_PRELOAD"] = lib.path if lib else ""
        env["CUDA_DEVICE_MEMORY_SHARED_CACHE"] = region
        env["GPUSLICE_CONTEXT_OVERHEAD"] = str(self.overhead)
        if mem is not None:
            env["CUDA_DEVICE_MEMORY_LIMIT"] = env_size(mem)
        if sm is not None:
            env["CUDA_DEVICE_SM_LIMIT"] = str(sm)
        if policy is not None:
            env["GPU_CORE_UTILIZATION_POLICY"] = policy
        if self.a.log_level is not None:
            env["LIBCUDA_LOG_LEVEL"] = str(self.a.log_level)
        if extra:
            env.update(extra)
        # Only gpuslice's region file has a layout the kit reads.
        return env, (region if lib is None or lib.ours else None)

    def lib_env(self, lib: Lib | None, label: str, **opts):
        """No library when lib is None, else slice_env for it."""
        if lib is None:
            env = self.base_env()
            if opts.get("extra"):
                env.update(opts["extra"])
            return env, None
        return self.slice_env(label, lib=lib, **opts)

    def kit_argv(
        self, cmd: str, *opts, region: str | None = None, lib: Lib | None = None
    ) -> list[str]:
        argv = [self.kit, cmd, "--device", str(self.a.device)]
        lib = lib or self.ours
        if lib:
            argv += ["--lib", lib.path]
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
            out = _text(e.stdout)
            err = _text(e.stderr)
        except OSError as e:
            rec.update(rc=None, timed_out=False, error=f"cannot start: {e}")
            out, err = "", ""
        rec["elapsed_s"] = round(time.monotonic() - t0, 3)
        return finish_record(rec, out, err)

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

    def script_ok(self, rec: dict) -> tuple[bool, str]:
        """run_ok for the Python scripts, which report their errors in the result."""
        ok, why = self.run_ok(rec)
        err = (rec.get("result") or {}).get("error")
        if ok and err:
            return False, str(err)[:800]
        return ok, why

    def check_run(self, checks: Checks, rec: dict, name: str, preload: bool) -> bool:
        ok, why = self.run_ok(rec)
        checks.add(f"{name}: ran", ok, detail=why or None)
        if ok and preload:
            res = rec["result"]
            ok = checks.add(
                f"{name}: interposer loaded",
                res.get("interposed") is True or res.get("interposer_mapped") is True,
                detail=f"cuMemAlloc_v2 resolved from {res.get('cuMemAlloc_v2_from')}"
                if "interposed" in res
                else "the library is not mapped in the process",
            )
        return ok

    # ---- PyTorch
    def torch_probe(self) -> dict:
        """Is PyTorch there with CUDA? Asked once; {"ok": bool, "reason"?, ...}."""
        if self.torch is not None:
            return self.torch
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
            self.torch = {
                "ok": False,
                "reason": f"`{py} -c 'import torch'` failed: {' '.join(last)}",
                "probe": probe,
            }
        elif not res.get("available"):
            self.torch = {"ok": False, "reason": "torch.cuda.is_available() is False", **res}
        else:
            self.torch = {"ok": True, **res}
        return self.torch

    def workload_argv(self, workloads: str, lib: Lib | None, *opts) -> list[str]:
        argv = [
            self.a.python,
            self.a.workload_script,
            "--workload",
            workloads,
            "--device",
            "cuda",
            "--ordinal",
            str(self.a.device),
            "--seed",
            "1234",
        ]
        if lib:
            argv += ["--lib", lib.path]
        return argv + [str(o) for o in opts]


def _text(v) -> str:
    if isinstance(v, bytes):
        return v.decode(errors="replace")
    return v or ""


def finish_record(rec: dict, out: str, err: str) -> dict:
    events, other, result = parse_json_lines(out)
    rec["result"] = result
    if len(events) > 1:
        rec["events"] = [e for e in events if e is not result][:20]
    if other:
        rec["stdout_other"] = tail("\n".join(other), 2000)
    if err.strip():
        rec["stderr_tail"] = tail(err, 3000)
    return rec
