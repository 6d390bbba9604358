#!/usr/bin/env python3
"""PyTorch end to end for the GPU kit: run_kit.py runs it under no library,
libgpuslice.so and each peer library (LD_PRELOAD), as it runs torch_oom.py.

Workloads (--workload, comma-separated):
  train  a small transformer encoder (bf16 autocast, AdamW, fixed seed and
         batch): steps/s and the loss at the first and the last step;
         --train-steps N steps, or as many as fit in --train-seconds S
  infer  launch-bound inference: batch 1 through many small layers (dozens of
         tiny kernels per iteration), latency per iteration (median, p95)
  graph  the inference model captured in a CUDA graph (torch.cuda.CUDAGraph)
         and replayed, checked against eager results (max abs difference)
  alloc  tensors of mixed sizes until OutOfMemoryError under the memory limit
         (whatever PYTORCH_CUDA_ALLOC_CONF says), mem_get_info beside
         memory_reserved as it grows, then empty_cache and one tensor of what
         is free (the caching allocator hands memory back and regrows)

--device cpu runs the same code on the CPU (no CUDA graphs: the replay is a
second eager call; no alloc), so the logic can be tried without a GPU.

Prints one JSON line per workload ({"event": "workload", ...}) and a result
line ({"event": "result", "workloads": {...}}). Never raises: a workload's
failure is its "error", a failure outside them the result's.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
import traceback

MiB = 1024 * 1024


def lib_mapped(lib: str | None):
    """Is `lib` mapped into this process (did LD_PRELOAD take effect)?"""
    if not lib:
        return None
    real = os.path.realpath(lib)
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) == 6 and parts[5].strip() in (lib, real):
                    return True
    except OSError:
        return None
    return False


def pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, max(0, math.ceil(q * len(v)) - 1))]


class Workloads:
    def __init__(self, torch, args) -> None:
        self.torch = torch
        self.a = args
        self.cuda = args.device == "cuda"
        self.dev = torch.device("cuda", args.ordinal) if self.cuda else torch.device("cpu")

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize(self.dev)

    # ---- train
    def train_model(self):
        nn = self.torch.nn
        a = self.a

        class Net(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.emb = nn.Embedding(a.vocab, a.d_model)
                layer = nn.TransformerEncoderLayer(
                    a.d_model, a.heads, 4 * a.d_model, dropout=0.0, batch_first=True
                )
                self.enc = nn.TransformerEncoder(layer, a.layers)
                self.head = nn.Linear(a.d_model, a.vocab)

            def forward(self, x):
                return self.head(self.enc(self.emb(x)))

        return Net().to(self.dev)

    def train(self) -> dict:
        t, a = self.torch, self.a
        t.manual_seed(a.seed)
        model = self.train_model()
        opt = t.optim.AdamW(model.parameters(), lr=1e-3)
        x = t.randint(0, a.vocab, (a.batch, a.seq), device=self.dev)
        y = t.randint(0, a.vocab, (a.batch, a.seq), device=self.dev)
        amp = t.autocast(device_type=self.dev.type, dtype=t.bfloat16)

        def step() -> float:
            opt.zero_grad(set_to_none=True)
            with amp:
                out = model(x)
                loss = t.nn.functional.cross_entropy(out.reshape(-1, a.vocab), y.reshape(-1))
            loss.backward()
            opt.step()
            return loss.item()  # synchronises, as a logging loop does

        first = step()  # also the warm-up: kernels chosen, memory cached
        for _ in range(2):
            step()
        self.sync()
        n, last = 0, first
        t0 = time.perf_counter()
        while True:
            last = step()
            n += 1
            el = time.perf_counter() - t0
            if a.train_seconds is not None:
                if el >= a.train_seconds:
                    break
            elif n >= a.train_steps:
                break
        return {
            "steps": n,
            "elapsed_s": round(el, 4),
            "steps_per_s": n / el,
            "loss_first": first,
            "loss_final": last,
            "loss_finite": math.isfinite(last),
            "model": {
                "d_model": a.d_model,
                "layers": a.layers,
                "heads": a.heads,
                "seq": a.seq,
                "batch": a.batch,
                "vocab": a.vocab,
                "dtype": "bf16 autocast",
                "params": sum(p.numel() for p in model.parameters()),
            },
        }

    # ---- infer
    def infer_model(self):
        nn = self.torch.nn
        layers = []
        for _ in range(self.a.infer_layers):
            layers += [nn.Linear(self.a.infer_width, self.a.infer_width), nn.GELU()]
        return nn.Sequential(*layers).to(self.dev).eval()

    def infer(self) -> dict:
        t, a = self.torch, self.a
        t.manual_seed(a.seed)
        model = self.infer_model()
        x = t.randn(1, a.infer_width, device=self.dev)
        lat = []
        with t.no_grad():
            for _ in range(10):  # warm-up
                model(x)
            self.sync()
            for _ in range(a.infer_iters):
                t0 = time.perf_counter()
                model(x)
                self.sync()
                lat.append((time.perf_counter() - t0) * 1e3)
        return {
            "iters": len(lat),
            "kernels_per_iter": 2 * a.infer_layers,
            "ms_median": pct(lat, 0.5),
            "ms_p95": pct(lat, 0.95),
            "ms_min": min(lat),
        }

    # ---- graph
    def graph(self) -> dict:
        t, a = self.torch, self.a
        t.manual_seed(a.seed)
        model = self.infer_model()
        static_x = t.randn(8, a.infer_width, device=self.dev)
        inputs = [t.randn(8, a.infer_width, device=self.dev) for _ in range(4)]
        out: dict = {"tolerance": a.graph_tolerance}
        with t.no_grad():
            if self.cuda:
                side = t.cuda.Stream(self.dev)
                side.wait_stream(t.cuda.current_stream(self.dev))
                with t.cuda.stream(side):
                    for _ in range(3):
                        model(static_x)
                t.cuda.current_stream(self.dev).wait_stream(side)
                g = t.cuda.CUDAGraph()
                with t.cuda.graph(g):
                    static_y = model(static_x)

                def replay():
                    g.replay()
                    return static_y

                out["mode"] = "cuda graph"
            else:

                def replay():
                    return model(static_x)

                out["mode"] = "cpu: no capture, the replay is a second eager call"
            diffs, replay_ms, eager_ms = [], [], []
            for inp in inputs:
                static_x.copy_(inp)
                t0 = time.perf_counter()
                got = replay()
                self.sync()
                replay_ms.append((time.perf_counter() - t0) * 1e3)
                t0 = time.perf_counter()
                want = model(inp)
                self.sync()
                eager_ms.append((time.perf_counter() - t0) * 1e3)
                diffs.append((got - want).abs().max().item())
        out.update(
            max_abs_diff=max(diffs),
            replays=len(diffs),
            replay_ms_median=pct(replay_ms, 0.5),
            eager_ms_median=pct(eager_ms, 0.5),
        )
        return out

    # ---- alloc
    def alloc(self) -> dict:
        t, a = self.torch, self.a
        if not self.cuda:
            return {"skipped": "memory limits apply to CUDA allocations only"}
        dev = self.dev
        rng = random.Random(a.seed)
        sizes_mib = (1, 2, 3, 8, 20, 64, 130)
        oom_type = getattr(t.cuda, "OutOfMemoryError", None)
        out: dict = {"limit": a.limit, "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}
        free, total = t.cuda.mem_get_info(dev)
        out["mem_get_info_before"] = {"free": free, "total": total}
        base_gap = (total - free) - t.cuda.memory_reserved(dev)
        tensors, gaps = [], []
        for i in range(a.max_allocs):
            n = rng.choice(sizes_mib) * MiB + rng.randrange(0, 4096)
            try:
                tensors.append(t.empty(n, dtype=t.uint8, device=dev))
            except Exception as e:
                if (oom_type and isinstance(e, oom_type)) or "out of memory" in str(e).lower():
                    out["oom"] = True
                    out["oom_type"] = type(e).__name__
                    out["oom_message"] = str(e)[:600]
                else:
                    out["other_error"] = traceback.format_exc()[-1500:]
                break
            if i % 16 == 0:
                free, total = t.cuda.mem_get_info(dev)
                gaps.append(abs((total - free) - t.cuda.memory_reserved(dev) - base_gap))
        out.setdefault("oom", False)
        out["tensors"] = len(tensors)
        out["bytes_held"] = sum(x.numel() for x in tensors)
        out["memory_reserved_at_oom"] = t.cuda.memory_reserved(dev)
        out["max_memory_reserved"] = t.cuda.max_memory_reserved(dev)
        free, total = t.cuda.mem_get_info(dev)
        out["mem_get_info_at_oom"] = {"free": free, "total": total}
        out["free_vs_reserved_max_gap"] = max(gaps) if gaps else None
        out["free_tracks_reserved"] = bool(gaps) and max(gaps) <= 64 * MiB
        del tensors
        self.sync()
        t.cuda.empty_cache()
        free, total = t.cuda.mem_get_info(dev)
        out["mem_get_info_after_empty_cache"] = {"free": free, "total": total}
        want = max(0, free - 64 * MiB)
        out["regrow_bytes"] = want
        try:
            big = t.empty(want, dtype=t.uint8, device=dev)
            out["regrow_ok"] = True
            del big
        except Exception as e:
            out["regrow_ok"] = False
            out["regrow_error"] = f"{type(e).__name__}: {str(e)[:400]}"
        return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="train,infer,graph", help="comma-separated")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--ordinal", type=int, default=0, help="CUDA device ordinal")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--lib", help="the preloaded library, to confirm it is mapped")
    ap.add_argument("--train-steps", type=int, default=30)
    ap.add_argument("--train-seconds", type=float, help="train for this long instead")
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--infer-iters", type=int, default=300)
    ap.add_argument("--infer-layers", type=int, default=32)
    ap.add_argument("--infer-width", type=int, default=256)
    ap.add_argument("--graph-tolerance", type=float, default=1e-3)
    ap.add_argument("--limit", type=int, help="CUDA_DEVICE_MEMORY_LIMIT in bytes (the record)")
    ap.add_argument("--max-allocs", type=int, default=100000)
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    names = [w.strip() for w in args.workload.split(",") if w.strip()]
    out: dict = {
        "event": "result",
        "cmd": "torch_workloads",
        "device": args.device,
        "interposer_mapped": lib_mapped(args.lib),
        "workloads": {},
    }
    t0 = time.monotonic()

    def emit() -> int:
        out["elapsed_s"] = round(time.monotonic() - t0, 3)
        print(json.dumps(out), flush=True)
        return 0

    bad = [n for n in names if n not in ("train", "infer", "graph", "alloc")]
    if bad:
        out["error"] = f"unknown workload(s) {bad}"
        return emit()
    try:
        import torch
    except Exception as e:  # any import failure is reported
        out["error"] = f"import torch: {type(e).__name__}: {e}"
        return emit()
    out["torch_version"] = torch.__version__
    out["torch_cuda"] = torch.version.cuda
    try:
        if args.device == "cuda":
            if not torch.cuda.is_available():
                out["error"] = "torch.cuda.is_available() is False"
                return emit()
            out["device_name"] = torch.cuda.get_device_name(args.ordinal)
        w = Workloads(torch, args)
        for name in names:
            ts = time.monotonic()
            try:
                res = getattr(w, name)()
            except Exception as e:
                res = {
                    "error": f"{type(e).__name__}: {e}"[:800],
                    "traceback": traceback.format_exc()[-1500:],
                }
            res["seconds"] = round(time.monotonic() - ts, 3)
            out["workloads"][name] = res
            print(json.dumps({"event": "workload", "name": name, **res}), flush=True)
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"
        out["traceback"] = traceback.format_exc()[-2000:]
    return emit()


if __name__ == "__main__":
    sys.exit(main())
