"""Console: what open pages cost the inventory and Redis, and how late they see a change.

Starts nats-server (with the audit stream), redis-server and the inventory
(``python -m gpuslice_inventory``, console on a free port, ``console_auth
none``, no Kubernetes API) as child processes, so the inventory's CPU time and
memory can be read from ``/proc``. Loads a cluster as it would run:

* ``--nodes`` nodes x 8 cards, announced on NATS as the node agents do, again
  every 10 s (their heartbeat);
* ``--pods`` pods placed through the ledger (reserved, bound, allocated), a
  quarter on two cards, each sending telemetry every second on
  ``<prefix>.telemetry.<node>.<pod uid>`` as the interposer does;
* a trickle of ledger changes: every second (``--changes`` times a second) the
  pod ``bench/watched`` of the step before is released and a new incarnation
  reserved (uid
  ``trickle-NNNNNN``), with its ``alloc.released`` and ``alloc.reserved``
  audit events, as the inventory and the extender would publish them.

Then phases of equal length, each with a fresh viewer process that holds the
pages' event streams open (httpx, reading every byte; the cluster and pod
pages also ask for their last hour, ``/api/v1/history``, as console.js does):
1 and ``--viewers``
viewers of the cluster view, ``--viewers`` viewers of the pod view of
``bench/watched``, ``--viewers`` followers of the audit view; before and after
each, a phase with no viewer (the baseline, measured in the same run: on a
shared machine it drifts, so each phase is compared with the mean of the two
baselines around it). For each: the inventory's CPU seconds per second
and resident memory, Redis commands per second (``INFO stats``) and beyond the
baseline, Redis's CPU, bytes per second delivered to the viewers, events per
viewer, and how late viewers see a change: from the moment the reserve is sent
to a viewer receiving the first event that holds the new pod (median over every
viewer and change, then per change the last viewer to get it: median and max).
The machine's load and how busy its CPUs were (every process, ours or not) are
printed beside each phase.

Usage: python bench/console_bench.py [--phase-seconds 30] [--nodes 50] [--pods 300]
                                     [--viewers 100] [--changes 1] [--tick 2] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from multiprocessing.process import BaseProcess
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event as MpEvent
from pathlib import Path
from typing import Any

import httpx
import uvloop
from redis.asyncio import Redis

from gpuslice_common.bus import Bus
from gpuslice_common.config import CommonSettings
from gpuslice_common.events import AllocationEvent, EventType, make_event
from gpuslice_common.ledger import Ledger
from gpuslice_common.models import (
    ContainerAssignment,
    DeviceGrant,
    GpuDevice,
    NodeInventory,
    Placement,
    PodRef,
)
from gpuslice_common.servers import NatsServer, RedisServer, free_port

GPUS = 8
CARD_MIB = 81559
GIB = 1 << 30
PREFIX = "gpuslice"
HEARTBEAT_S = 10.0  # the node agent's inventory_interval
WATCHED = ("bench", "watched")  # the pod the trickle recreates; the pod view shows it
TRICKLE = re.compile(rb"trickle-(\d{6})")
CLK_TCK = os.sysconf("SC_CLK_TCK")


# ------------------------------------------------------------ the cluster


def node_name(n: int) -> str:
    return f"gpu-{n:03d}.pool-a.example.internal"


def inventory(n: int) -> NodeInventory:
    node = node_name(n)
    devices = tuple(
        GpuDevice(
            uuid=f"GPU-{n:08x}-1e2d-4c3b-a4f5-{i:012x}",
            index=i,
            model="NVIDIA H100 80GB HBM3",
            memory_mib=CARD_MIB,
            numa=i // 4,
        )
        for i in range(GPUS)
    )
    return NodeInventory(node=node, devices=devices, split_count=10)


def placement(i: int, nodes: int) -> Placement:
    """Pod i: on node i % nodes, one card (two for a quarter of the pods)."""
    n = i % nodes
    card = (i // nodes) % GPUS
    cards = (card, (card + 1) % GPUS) if i % 4 == 0 else (card,)
    grants = tuple(
        DeviceGrant(uuid=inventory(n).devices[c].uuid, memory_mib=8192, cores=20) for c in cards
    )
    return Placement(
        pod=PodRef(
            uid=f"5f0c{i:04x}-8d2e-4b1a-9c3f-{i:012x}",
            namespace=f"team-{i % 10}",
            name=f"train-{i}",
        ),
        node=node_name(n),
        containers=(ContainerAssignment(name="main", devices=grants),),
        policy="fragmentation",
    )


def trickle_placement(k: int, nodes: int) -> Placement:
    n = k % nodes
    grant = DeviceGrant(uuid=inventory(n).devices[GPUS - 1].uuid, memory_mib=1024, cores=5)
    return Placement(
        pod=PodRef(uid=f"trickle-{k:06d}", namespace=WATCHED[0], name=WATCHED[1]),
        node=node_name(n),
        containers=(ContainerAssignment(name="main", devices=(grant,)),),
        policy="fragmentation",
    )


def telemetry(p: Placement, i: int, tick: int) -> bytes:
    """Sample ``tick`` of pod ``i``, as the interposer writes it."""
    devices = ",".join(
        f'{{"uuid":"{d.uuid}","used_bytes":{((i + tick) % 64 + k + 1) * 64 << 20},'
        f'"limit_bytes":{8 * GIB},"sm_percent":{(i * 7 + tick) % 100}.{tick % 10},'
        f'"throttled_ns":{tick * 1000},"denied_allocations":0}}'
        for k, d in enumerate(p.containers[0].devices)
    )
    now = datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    return (
        f'{{"node":"{p.node}","pod_uid":"{p.pod.uid}","container":"main",'
        f'"pid":{4000 + i},"time":"{now}","devices":[{devices}],"dropped_samples":0}}'
    ).encode()


# ------------------------------------------------------------ /proc


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def machine_cpu() -> tuple[float, float]:
    """(busy, total) jiffies of every CPU, from /proc/stat."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    total = sum(values[:8])
    return total - values[3] - values[4], total


def loadavg() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


# ------------------------------------------------------------ the viewers' process


Frame = tuple[float, int, str, int]  # (received at, bytes, event name or "", newest trickle)
Fetch = tuple[float, int]  # a page's history request: (answered at, bytes)
HISTORY_MIN_S = 5.0  # as console.js: a page asks for its last hour at most this often
HISTORY_EVERY_S = 30.0  # and at least this often


def history_path(query: dict[str, str]) -> str | None:
    """The history a page of ``query``'s view asks for, as console.js does (none
    for the audit view)."""
    if query.get("view") == "cluster":
        return "/api/v1/history"
    if query.get("view") == "pod":
        return f"/api/v1/history?namespace={query['namespace']}&name={query['name']}"
    return None


def viewers_main(
    url: str,
    query: dict[str, str],
    count: int,
    ready: Queue[tuple[int, list[str]]],
    stop: MpEvent,
    out: Queue[tuple[list[list[Frame]], list[list[Fetch]], list[str], float]],
) -> None:
    """In the child: hold ``count`` event streams open until ``stop``, each
    asking for its page's history as console.js does (on opening, after an
    event at most every ``HISTORY_MIN_S``, and every ``HISTORY_EVERY_S``); put
    every frame and history answer each received, the errors, and this
    process's CPU seconds."""
    frames: list[list[Frame]] = [[] for _ in range(count)]
    fetches: list[list[Fetch]] = [[] for _ in range(count)]
    errors: list[str] = []
    path = history_path(query)

    async def fetch(client: httpx.AsyncClient, got: list[Fetch]) -> None:
        assert path is not None
        answer = await client.get(path)
        if answer.status_code != 200:
            errors.append(f"history answered {answer.status_code}")
        got.append((time.monotonic(), len(answer.content)))

    async def history(client: httpx.AsyncClient, got: list[Fetch], wanted: asyncio.Event) -> None:
        """One page's history requests: on opening, then when ``wanted`` (set by
        an event), at most every HISTORY_MIN_S, and every HISTORY_EVERY_S."""
        while True:
            asked = time.monotonic()
            await fetch(client, got)
            wanted.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wanted.wait(), HISTORY_EVERY_S)
            await asyncio.sleep(max(0.0, asked + HISTORY_MIN_S - time.monotonic()))

    async def view(
        client: httpx.AsyncClient, mine: list[Frame], got: list[Fetch], connected: asyncio.Event
    ) -> None:
        wanted = asyncio.Event()
        asking = None if path is None else asyncio.create_task(history(client, got, wanted))
        try:
            await stream(client, mine, connected, wanted)
        finally:
            if asking is not None:
                asking.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await asking

    async def stream(
        client: httpx.AsyncClient,
        mine: list[Frame],
        connected: asyncio.Event,
        wanted: asyncio.Event,
    ) -> None:
        async with client.stream("GET", "/api/v1/stream", params=query) as answer:
            if answer.status_code != 200:
                raise RuntimeError(f"stream answered {answer.status_code}")
            buf = bytearray()
            async for chunk in answer.aiter_raw():
                searched = max(0, len(buf) - 1)
                buf += chunk
                while (end := buf.find(b"\n\n", searched)) >= 0:
                    frame = bytes(buf[:end])
                    del buf[: end + 2]
                    searched = 0
                    now = time.monotonic()
                    if frame.startswith(b":"):
                        if frame == b": connected":
                            connected.set()
                        mine.append((now, len(frame) + 2, "", -1))
                        continue
                    name = frame[7 : frame.index(b"\n")].decode() if b"\n" in frame else "?"
                    wanted.set()
                    found = [int(m) for m in TRICKLE.findall(frame)]
                    mine.append((now, len(frame) + 2, name, max(found, default=-1)))

    async def run() -> None:
        limits = httpx.Limits(max_connections=count + 8, max_keepalive_connections=count + 8)
        timeout = httpx.Timeout(30.0, read=None)
        async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as client:
            connected = [asyncio.Event() for _ in range(count)]
            tasks = [
                asyncio.create_task(view(client, frames[i], fetches[i], connected[i]))
                for i in range(count)
            ]
            waiting = [asyncio.create_task(c.wait()) for c in connected]
            done, _ = await asyncio.wait(waiting, timeout=120)
            for w in waiting:
                w.cancel()
            errors.extend(str(t.exception()) for t in tasks if t.done() and t.exception())
            ready.put((len(done), list(errors)))
            await asyncio.to_thread(stop.wait)
            for t in tasks:
                t.cancel()
            for ended in await asyncio.gather(*tasks, return_exceptions=True):
                if isinstance(ended, Exception):
                    errors.append(f"{type(ended).__name__}: {ended}")

    uvloop.run(run())
    out.put((frames, fetches, errors, cpu_seconds(os.getpid())))


# ------------------------------------------------------------ the load


@dataclass
class Load:
    """The cluster's background work, running in this process for every phase."""

    bus: Bus
    ledger: Ledger
    nodes: int
    pods: list[Placement]
    rate: float  # release + reserve steps per second
    changes: list[tuple[int, float]] = field(default_factory=list)  # (k, reserve sent at)
    samples: int = 0
    problems: list[str] = field(default_factory=list)

    async def heartbeats(self) -> None:
        while True:
            for n in range(self.nodes):
                await self.bus.publish_model(
                    self.bus.subjects.inventory(node_name(n)), inventory(n)
                )
            await self.bus.flush()
            await asyncio.sleep(HEARTBEAT_S)

    async def telemetry(self) -> None:
        tick = 0
        while True:
            started = time.monotonic()
            for i, p in enumerate(self.pods):
                await self.bus.nc.publish(
                    self.bus.subjects.telemetry(p.node, p.pod.uid),
                    telemetry(p, i, tick),
                )
            await self.bus.nc.flush()
            self.samples += len(self.pods)
            tick += 1
            await asyncio.sleep(max(0.0, 1.0 - (time.monotonic() - started)))

    async def trickle(self) -> None:
        k = 0
        while True:
            started = time.monotonic()
            try:
                if k:
                    gone = trickle_placement(k - 1, self.nodes)
                    await self.ledger.release(gone.pod.uid, "bench")
                    await self.event(EventType.ALLOC_RELEASED, gone)
                new = trickle_placement(k, self.nodes)
                sent = time.monotonic()
                await self.ledger.reserve(new)
                self.changes.append((k, sent))
                await self.event(EventType.ALLOC_RESERVED, new)
            except Exception as exc:  # reported at the end; the load goes on
                self.problems.append(f"trickle {k}: {type(exc).__name__}: {exc}")
            k += 1
            await asyncio.sleep(max(0.0, 1.0 / self.rate - (time.monotonic() - started)))

    async def event(self, kind: EventType, p: Placement) -> None:
        payload = AllocationEvent(
            pod=p.pod, node=p.node, containers=p.containers, policy=p.policy, reason=""
        )
        await self.bus.publish_acked(make_event(kind, payload, source="/bench"))


# ------------------------------------------------------------ phases


@dataclass
class Sample:
    at: float
    inventory_cpu: float
    redis_cpu: float
    commands: int
    busy: float
    total: float
    load: float


@dataclass
class Result:
    name: str
    viewers: int
    seconds: float
    inventory_cpu: float  # s/s
    redis_cpu: float  # s/s
    rss: float
    commands: float  # per s
    bytes_per_s: float
    events_per_viewer: float
    history_per_viewer: float  # history requests each page made in the window
    history_bytes_per_s: float
    latency_all_p50: float | None
    last_p50: float | None
    last_max: float | None
    missed: int
    changes: int
    busy_cpus: float
    load: tuple[float, float]
    connected: int
    errors: list[str]
    viewer_cpu: float


@dataclass
class Bench:
    console_url: str
    inventory_pid: int
    redis_pid: int
    redis: Redis
    load: Load
    seconds: float
    grace: float

    async def sample(self) -> Sample:
        info = await self.redis.info("stats")
        busy, total = machine_cpu()
        return Sample(
            time.monotonic(),
            cpu_seconds(self.inventory_pid),
            cpu_seconds(self.redis_pid),
            int(info["total_commands_processed"]),
            busy,
            total,
            loadavg(),
        )

    async def phase(self, name: str, count: int, query: dict[str, str]) -> Result:
        ctx = multiprocessing.get_context("spawn")
        proc: BaseProcess | None = None
        connected, errors = 0, list[str]()
        ready: Queue[tuple[int, list[str]]] = ctx.Queue()
        out: Queue[tuple[list[list[Frame]], list[list[Fetch]], list[str], float]] = ctx.Queue()
        stop = ctx.Event()
        if count:
            proc = ctx.Process(
                target=viewers_main,
                args=(self.console_url, query, count, ready, stop, out),
                daemon=True,
            )
            proc.start()
            connected, errors = await asyncio.to_thread(ready.get, True, 180)
        await asyncio.sleep(1.0)  # the connections' first snapshots are behind us
        start = await self.sample()
        await asyncio.sleep(self.seconds)
        end = await self.sample()
        rss = rss_mib(self.inventory_pid)
        frames: list[list[Frame]] = []
        fetches: list[list[Fetch]] = []
        viewer_cpu = 0.0
        if proc is not None:
            await asyncio.sleep(self.grace)  # the window's last changes still arrive
            stop.set()
            frames, fetches, more, viewer_cpu = await asyncio.to_thread(out.get, True, 120)
            errors += more
            await asyncio.to_thread(proc.join, 30)
        elapsed = end.at - start.at
        window = [(k, t) for k, t in self.load.changes if start.at <= t <= end.at]
        in_window = [[f for f in mine if start.at <= f[0] <= end.at] for mine in frames]
        asked = [[f for f in got if start.at <= f[0] <= end.at] for got in fetches]
        all_lat: list[float] = []
        last: list[float] = []
        missed = 0
        for k, sent in window:
            worst = 0.0
            for mine in frames:
                got = next((f[0] for f in mine if f[0] >= sent and f[3] >= k), None)
                if got is None:
                    missed += 1
                    continue
                all_lat.append(got - sent)
                worst = max(worst, got - sent)
            if frames:
                last.append(worst)
        ncpu = os.cpu_count() or 1
        return Result(
            name=name,
            viewers=count,
            seconds=elapsed,
            inventory_cpu=(end.inventory_cpu - start.inventory_cpu) / elapsed,
            redis_cpu=(end.redis_cpu - start.redis_cpu) / elapsed,
            rss=rss,
            commands=(end.commands - start.commands) / elapsed,
            bytes_per_s=sum(f[1] for mine in in_window for f in mine) / elapsed,
            events_per_viewer=(
                statistics.mean(sum(1 for f in mine if f[2]) for mine in in_window)
                if in_window
                else 0.0
            ),
            history_per_viewer=statistics.mean(len(got) for got in asked) if asked else 0.0,
            history_bytes_per_s=sum(f[1] for got in asked for f in got) / elapsed,
            latency_all_p50=statistics.median(all_lat) if all_lat else None,
            last_p50=statistics.median(last) if last else None,
            last_max=max(last) if last else None,
            missed=missed,
            changes=len(window),
            busy_cpus=(end.busy - start.busy) / (end.total - start.total) * ncpu,
            load=(start.load, end.load),
            connected=connected,
            errors=errors,
            viewer_cpu=viewer_cpu,
        )


# ------------------------------------------------------------ set-up


@contextmanager
def inventory_process(nats_url: str, redis_url: str, tick: float) -> Iterator[tuple[int, int, int]]:
    """The inventory as operators run it: (pid, health port, console port)."""
    health, console = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUSLICE_")}
    env.update(
        {
            "GPUSLICE_NATS_URL": nats_url,
            "GPUSLICE_REDIS_URL": redis_url,
            "GPUSLICE_SUBJECT_PREFIX": PREFIX,
            "GPUSLICE_LEDGER_PREFIX": PREFIX,
            "GPUSLICE_KUBE_API": "none",
            "GPUSLICE_LISTEN_HOST": "127.0.0.1",
            "GPUSLICE_LISTEN_PORT": str(health),
            "GPUSLICE_CONSOLE_PORT": str(console),
            "GPUSLICE_CONSOLE_HOST": "127.0.0.1",
            "GPUSLICE_CONSOLE_AUTH": "none",
            "GPUSLICE_CONSOLE_TICK": str(tick),
            "GPUSLICE_LOG_LEVEL": "WARNING",
        }
    )
    process = subprocess.Popen([sys.executable, "-m", "gpuslice_inventory"], env=env)
    try:
        yield process.pid, health, console
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


async def until(what: str, check: Any, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise SystemExit(f"console bench: {what} did not happen in {timeout:.0f} s")
        await asyncio.sleep(0.2)


async def answers(url: str) -> bool:
    try:
        async with httpx.AsyncClient(timeout=2) as client:
            return (await client.get(url)).status_code == 200
    except httpx.TransportError:
        return False


async def bench(args: argparse.Namespace, nats_url: str, redis_url: str) -> list[Result]:
    settings = CommonSettings(nats_url=nats_url, subject_prefix=PREFIX)
    bus = await Bus.connect(settings, "bench")
    await bus.ensure_audit_stream(timedelta(days=1))
    ledger = Ledger.from_url(redis_url, PREFIX)
    redis = Redis.from_url(redis_url)
    tasks: list[asyncio.Task[None]] = []
    try:
        with inventory_process(nats_url, redis_url, args.tick) as (pid, health, port):
            console = f"http://127.0.0.1:{port}"
            await until(
                "the inventory's readiness",
                lambda: answers(f"http://127.0.0.1:{health}/readyz"),
            )
            pods = [placement(i, args.nodes) for i in range(args.pods)]
            load = Load(bus, ledger, args.nodes, pods, args.changes)
            tasks.append(asyncio.create_task(load.heartbeats()))
            names = [node_name(n) for n in range(args.nodes)]

            async def registered() -> bool:
                status = await ledger.rebuild_status(names)
                return all(n in status and status[n].rebuilt_at is not None for n in names)

            await until("the nodes' registration", registered)
            for p in load.pods:
                await ledger.reserve(p)
                await ledger.mark_bound(p.pod.uid, p.node)
                await ledger.allocate(p.node, len(p.containers[0].devices))
            tasks.append(asyncio.create_task(load.telemetry()))
            tasks.append(asyncio.create_task(load.trickle()))
            await until("the console's snapshot", lambda: answers(f"{console}/api/v1/cluster"))
            await asyncio.sleep(max(3.0, 2 * args.tick))  # telemetry stored, a full tick done
            async with httpx.AsyncClient(base_url=console, timeout=10) as client:
                snapshot = (await client.get("/api/v1/cluster")).content
                pod_doc = (await client.get(f"/api/v1/pods/{WATCHED[0]}/{WATCHED[1]}")).content
            info = await redis.info("server")
            b = Bench(
                console,
                pid,
                int(info["process_id"]),
                redis,
                load,
                args.phase_seconds,
                max(3.0, 2 * args.tick),
            )
            v = args.viewers
            pod = {"view": "pod", "namespace": WATCHED[0], "name": WATCHED[1]}
            watched = [
                ("cluster view", 1, {"view": "cluster"}),
                ("cluster view", v, {"view": "cluster"}),
                ("pod view", v, pod),
                ("audit, follow live", v, {"view": "audit"}),
            ]
            results = [await b.phase("no viewer (baseline)", 0, {})]
            for (
                name,
                count,
                query,
            ) in watched:  # each between two baselines: drift shows
                results.append(await b.phase(name, count, query))
                results.append(await b.phase("no viewer (baseline)", 0, {}))
            args.snapshot_bytes = len(snapshot)
            args.pod_bytes = len(pod_doc)
            args.samples = load.samples
            args.problems = load.problems
            return results
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await redis.aclose()
        await ledger.close()
        await bus.close()


def ms(value: float | None) -> str:
    return "—" if value is None else f"{value * 1000:.0f}"


def beyond(results: list[Result], i: int, value: str) -> str:
    """``value`` of phase i beyond the mean of the baselines before and after it."""
    if not results[i].viewers:
        return "—"
    around = [r for r in (results[i - 1], results[i + 1]) if not r.viewers]
    extra = getattr(results[i], value) - statistics.mean(getattr(r, value) for r in around)
    return f"{extra:+.3f}" if value.endswith("cpu") else f"{extra:+,.0f}"


def report(args: argparse.Namespace, results: list[Result]) -> None:
    base = results[0]
    print(
        f"# console benchmark, {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {platform.node()}, "
        f"{os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"load average {base.load[0]:.2f} at the start"
    )
    print(
        f"# {args.nodes} nodes x {GPUS} cards, {args.pods} pods sending telemetry every second "
        f"({args.samples:,} samples), {args.changes:g} reserve and release a second; console tick "
        f"{args.tick:g} s; phases of {args.phase_seconds:g} s; snapshot {args.snapshot_bytes:,} "
        f"bytes, pod document {args.pod_bytes:,} bytes"
    )
    print(
        "| phase | viewers | inventory CPU s/s (beyond the baselines around it) | "
        "inventory RSS MiB | Redis cmds/s (beyond) | Redis CPU s/s | to viewers MB/s | "
        "events per viewer | seen p50 ms, all viewers | last viewer p50 / max ms | missed | "
        "machine CPUs busy (load avg) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for i, r in enumerate(results):
        cpu, commands = (
            beyond(results, i, "inventory_cpu"),
            beyond(results, i, "commands"),
        )
        print(
            f"| {r.name} | {r.viewers} | {r.inventory_cpu:.3f} ({cpu}) | {r.rss:.0f} | "
            f"{r.commands:,.0f} ({commands}) | {r.redis_cpu:.3f} | "
            f"{r.bytes_per_s / 1e6:.2f} | {r.events_per_viewer:.1f} | {ms(r.latency_all_p50)} | "
            f"{ms(r.last_p50)} / {ms(r.last_max)} | {r.missed} of {r.changes * r.viewers} | "
            f"{r.busy_cpus:.2f} ({r.load[0]:.1f} to {r.load[1]:.1f}) |"
        )
    print()
    print(
        "| phase | viewers | connected | history requests per viewer | history MB/s | "
        "viewer process CPU s | errors |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in results:
        if not r.viewers:
            continue
        shown = "; ".join(sorted(set(r.errors))[:3]) or "none"
        print(
            f"| {r.name} | {r.viewers} | {r.connected} | {r.history_per_viewer:.1f} | "
            f"{r.history_bytes_per_s / 1e6:.3f} | {r.viewer_cpu:.1f} | {shown} |"
        )
    if args.problems:
        print(f"\nload problems ({len(args.problems)}): {args.problems[:3]}")
    if any(r.errors or r.connected != r.viewers for r in results) or args.problems:
        raise SystemExit("console bench: not every viewer was served (see above)")
    if any(r.missed for r in results):
        raise SystemExit("console bench: some viewers never saw a change (see 'missed')")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phase-seconds", type=float, default=30.0)
    parser.add_argument("--nodes", type=int, default=50)
    parser.add_argument("--pods", type=int, default=300)
    parser.add_argument("--viewers", type=int, default=100)
    parser.add_argument(
        "--changes",
        type=float,
        default=1.0,
        help="ledger release + reserve steps a second",
    )
    parser.add_argument("--tick", type=float, default=2.0, help="the console's tick, seconds")
    parser.add_argument("--quick", action="store_true", help="a short run: 5 s phases, 10 viewers")
    args = parser.parse_args()
    if args.quick:
        args.phase_seconds, args.nodes, args.pods, args.viewers = 5.0, 10, 60, 10
    if not (1 <= args.nodes <= 1000 and 0 <= args.pods <= args.nodes * GPUS * 5):
        parser.error("--nodes 1..1000, --pods 0..5 per card")
    if not (1 <= args.viewers <= 900 and args.phase_seconds > 0 and args.tick > 0):
        parser.error("--viewers 1..900 (the console takes 1000 streams), positive durations")
    if not 0.1 <= args.changes <= 100:
        parser.error("--changes 0.1..100 a second")
    with NatsServer() as nats_server, RedisServer(persist=False) as redis_server:
        results = uvloop.run(bench(args, nats_server.url, redis_server.url))
    report(args, results)


if __name__ == "__main__":
    main()
