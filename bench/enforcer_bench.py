"""Node agent's enforcer: CPU per sample on a full node, and how fast an escape is killed.

Needs root (cgroups, mount namespaces) and the native fakes (``make -C native
fakes progs``). Lays out a node as kubelet would: ``--cards`` fake cards
(FAKECUDA_DEVICES) and ``--containers`` pod containers spread over them, each a
probe holding 64 MiB in its own kubelet-named cgroup (under a parent of the
bench's own in the cgroup v2 tree) and its own mount namespace with the agent's
grant directory at /run/gpuslice (1 GiB, 50 % share). The fake NVML is loaded
into this process, as NVML is into the agent.

1. Cost: ``--samples`` samples at ``--interval``, each measured in CPU seconds
   of this process (``time.process_time``): the enforcer's whole sample (NVML,
   /proc, cgroups, grants, decisions), and beside it, in the same run and
   interleaved, the sampler's NVML calls alone (the baseline the mapping adds to).
2. Escape to kill: ``--escapes`` times, a probe in a container of its own (no
   interposer) allocates 2 GiB past its 1 GiB grant and holds; the enforcer runs
   its loop. The time from the probe's line saying the allocation succeeded to
   its death (its exit seen by waitpid): median, p95 and max.

Usage: sudo python bench/enforcer_bench.py [--cards 8] [--containers 64]
                                           [--interval 0.25] [--samples 200] [--escapes 20]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from prometheus_client import CollectorRegistry  # noqa: E402

from gpuslice_common.config import DevicePluginSettings  # noqa: E402
from gpuslice_common.grant import Grant, GrantDevice  # noqa: E402
from gpuslice_deviceplugin.cgroups import find_cgroup2_root  # noqa: E402
from gpuslice_deviceplugin.containers import HostDir  # noqa: E402
from gpuslice_deviceplugin.enforcer import Enforcer, NvmlSampler  # noqa: E402
from gpuslice_deviceplugin.metrics import EnforcerMetrics  # noqa: E402
from tests.native.container import Container, fake_uuid  # noqa: E402

NATIVE = ROOT / "native" / "build"
GiB = 1 << 30
JOIN = 'echo $$ > "$0/cgroup.procs" && exec "$@"'


class Node:
    def __init__(self, work: Path, v2: Path, cards: int) -> None:
        self.work = work
        self.cards = cards
        self.parent = v2 / f"gs-bench-{uuid.uuid4().hex[:8]}"
        self.parent.mkdir()
        self.groups: list[Path] = []
        self.procs: list[subprocess.Popen[str]] = []
        self.state = work / "state"
        self.state.mkdir()
        self.env = {
            **os.environ,
            "LD_LIBRARY_PATH": str(NATIVE / "fake"),
            "FAKEGPU_STATE_DIR": str(self.state),
            "FAKECUDA_DEVICES": str(cards),
        }

    def container(self, card: int, memory: int = GiB, sm: int = 50) -> tuple[Path, Container]:
        pod = str(uuid.uuid4())
        scope = (
            self.parent
            / "kubepods.slice"
            / "kubepods-burstable.slice"
            / f"kubepods-burstable-pod{pod.replace('-', '_')}.slice"
            / f"cri-containerd-{uuid.uuid4().hex}.scope"
        )
        scope.mkdir(parents=True)
        self.groups += [scope, scope.parent]
        limits = Grant(
            node="bench",
            pod_uid=pod,
            container="main",
            policy="default",
            priority=0,
            control_optional=False,
            context_overhead_bytes=0,
            devices=(GrantDevice(uuid=fake_uuid(card), memory_bytes=memory, sm_percent=sm),),
        )
        return scope, Container.prepare(self.work, limits)

    def start(self, scope: Path, box: Container, *commands: str) -> subprocess.Popen[str]:
        argv = ["sh", "-c", JOIN, str(scope), *box.prefix(), str(NATIVE / "probe"), *commands]
        proc = subprocess.Popen(
            argv, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        for group in sorted(set(self.groups), key=lambda p: len(p.parts), reverse=True):
            with contextlib.suppress(OSError):
                (group / "cgroup.kill").write_text("1")
            for _ in range(100):
                with contextlib.suppress(OSError):
                    if not (group / "cgroup.procs").read_text().strip():
                        break
                time.sleep(0.02)
            with contextlib.suppress(OSError):
                group.rmdir()
        for path in sorted(self.parent.rglob("*"), key=lambda p: len(p.parts), reverse=True):
            with contextlib.suppress(OSError):
                path.rmdir()
        with contextlib.suppress(OSError):
            self.parent.rmdir()


def wait_line(proc: subprocess.Popen[str], cmd: str) -> dict[str, object]:
    assert proc.stdout is not None
    for raw in proc.stdout:
        with contextlib.suppress(ValueError):
            line = json.loads(raw)
            if line.get("cmd") == cmd:
                return dict(line)
    raise RuntimeError(f"probe {proc.pid} ended before {cmd}")


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def cost(node: Node, enforcer: Enforcer, sampler: NvmlSampler, args: argparse.Namespace) -> None:
    full: list[float] = []
    base: list[float] = []
    reports = 0
    for i in range(args.samples):
        start = time.monotonic()
        t0 = time.process_time()
        if i % 2 == 0:
            reports += len(enforcer.tick())
            full.append(time.process_time() - t0)
        else:
            sampler.sample()
            base.append(time.process_time() - t0)
        time.sleep(max(0.0, args.interval - (time.monotonic() - start)))
    per_s = 1 / args.interval
    print(f"cost: {args.cards} cards, {args.containers} containers, every {args.interval:g} s")
    for name, values in (("enforcer sample", full), ("NVML alone (baseline)", base)):
        mean = statistics.mean(values)
        print(
            f"  {name:24s} CPU per sample: median {statistics.median(values) * 1e3:.2f} ms, "
            f"p95 {pct(values, 0.95) * 1e3:.2f} ms, mean {mean * 1e3:.2f} ms "
            f"= {mean * per_s * 100:.1f} % of a core at this interval"
        )
    print(f"  actions taken during the cost run: {reports} (expected 0)")


async def escapes(node: Node, enforcer: Enforcer, args: argparse.Namespace) -> None:
    task = asyncio.create_task(enforcer.run())
    delays: list[float] = []
    try:
        for i in range(args.escapes):
            scope, box = node.container(i % node.cards)
            proc = node.start(scope, box, "init", "ctx", str(i % node.cards), "alloc", "3g", "hold")
            await asyncio.to_thread(wait_line, proc, "alloc")
            allocated = time.monotonic()
            await asyncio.to_thread(proc.wait)
            delays.append(time.monotonic() - allocated)
            await asyncio.sleep(0.05 + (i % 5) * 0.05)  # land at different points of the interval
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    print(f"escape to kill over {len(delays)} escapes (sample interval {args.interval:g} s):")
    print(
        f"  median {statistics.median(delays) * 1e3:.0f} ms, p95 {pct(delays, 0.95) * 1e3:.0f} ms, "
        f"max {max(delays) * 1e3:.0f} ms"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cards", type=int, default=8)
    parser.add_argument("--containers", type=int, default=64)
    parser.add_argument("--interval", type=float, default=0.25)
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--escapes", type=int, default=20)
    args = parser.parse_args()
    v2 = find_cgroup2_root()
    if os.geteuid() != 0 or v2 is None:
        print("needs root and a cgroup v2 hierarchy", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="gs-enforce-bench-"))
    node = Node(work, Path(v2), args.cards)
    os.environ["FAKEGPU_STATE_DIR"] = str(node.state)
    os.environ["FAKECUDA_DEVICES"] = str(args.cards)
    ctypes.CDLL(str(NATIVE / "fake" / "libnvidia-ml.so.1"), mode=ctypes.RTLD_GLOBAL)
    try:
        for i in range(args.containers):
            scope, box = node.container(i % args.cards)
            proc = node.start(
                scope, box, "init", "ctx", str(i % args.cards), "alloc", "64m", "hold"
            )
            wait_line(proc, "hold")
        settings = DevicePluginSettings(
            node_name="bench",
            host_dir=str(work / "host"),
            cgroup_root=v2,
            enforce_interval=f"{int(args.interval * 1000)}ms",
        )
        sampler = NvmlSampler()
        enforcer = Enforcer(
            settings, HostDir(work / "host"), sampler, EnforcerMetrics(CollectorRegistry())
        )
        try:
            cost(node, enforcer, sampler, args)
            asyncio.run(escapes(node, enforcer, args))
        finally:
            enforcer.close()
    finally:
        node.close()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
