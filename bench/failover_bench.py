"""Failover benchmark: the pause each member's loss causes in a steady stream of placements.

Starts the highly-available local stack (``Stack(ha=True)``: three nats-servers
routed as one JetStream cluster, a Redis primary with two replicas and three
sentinels, two extender replicas, two inventory replicas, the webhook, two
simulated nodes) and keeps a steady stream of placements going through the
cluster driver, one at a time, started ``--rate`` a second: admission, filter,
prioritize and bind (spread over the extender replicas as a Service would),
Allocate through the node's device plugin, the container (``true``) run, the
pod deleted. A placement is counted when its pod has Succeeded. (Paced: the
node agent keeps an ended pod's container directory for ``cleanup_grace``, 10
minutes, and scans them all every coordination tick, so a stream as fast as
it can go slows down as the run goes on.)

Then, for each failure in turn (each NATS member killed with SIGKILL and
started again, the Redis primary killed (a sentinel promotes a replica; the old
one rejoins as a replica), an extender replica killed and restarted, the
inventory replica holding the lease killed and restarted), it measures over a
window of ``--window`` seconds from the fault: the longest gap between two
successful placements, and the placements that failed or had a step tried
again. The baseline, in the same run, is the window just before each fault,
as long, with no fault: its longest gap.

Usage: python bench/failover_bench.py [--window 12] [--rate 5] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import itertools
import os
import platform
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable
from datetime import date
from pathlib import Path

import httpx

from gpuslice_cli.dev.driver import ClusterDriver
from gpuslice_cli.dev.stack import NodeSpec, Stack

# two nodes of 8 simulated cards, 10 pods a card: releases (the inventory's pod
# watch, paused while no replica holds the lease) never run placements short
NODES = (
    NodeSpec("gpu-node-1", gpus=8, memory_mib=40960, split_count=10),
    NodeSpec("gpu-node-2", gpus=8, memory_mib=15360, split_count=10, model="Tesla T4"),
)


@dataclasses.dataclass
class Placed:
    started: float
    ended: float
    ok: bool
    retries: int  # steps the driver tried again for this pod
    why: str = ""  # a failure's reason


@dataclasses.dataclass
class Window:
    what: str
    start: float
    end: float
    recovered_s: float = 0.0  # how long the fault step took (to ready again)
    note: str = ""


def pod(i: int) -> dict[str, object]:
    limits = {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 1000}
    return {
        "metadata": {"name": f"bench-{i}"},
        "spec": {
            "containers": [
                {"name": "main", "image": "x", "command": ["true"], "resources": {"limits": limits}}
            ]
        },
    }


async def stream(
    driver: ClusterDriver, placed: list[Placed], stop: asyncio.Event, rate: float
) -> None:
    """Placements one at a time, one every 1/``rate`` s (or as soon as the
    previous one is done, when it took longer), until ``stop``."""
    i = 0
    loop = asyncio.get_running_loop()
    due = loop.time()
    while not stop.is_set():
        await asyncio.sleep(max(0.0, due - loop.time()))
        due = max(due + 1 / rate, loop.time())
        before = sum(driver.retries.values())
        started = time.monotonic()
        why = ""
        try:
            outcome = await driver.run_pod(pod(i))
            if outcome.phase != "Succeeded":
                why = f"{outcome.phase}: {outcome.reason}"
        except Exception as exc:  # the driver gave up: a failed placement, the next goes on
            why = f"{type(exc).__name__}: {exc}"
        retries = sum(driver.retries.values()) - before
        placed.append(Placed(started, time.monotonic(), not why, retries, why[:300]))
        i += 1


def longest_gap(placed: list[Placed], window: Window, within: bool = False) -> float:
    """The longest time between two successive successful placements whose
    interval overlaps the window (``within``: lies inside it, for a quiet
    window, so that a pause the next fault causes is not counted before it)."""
    done = sorted(p.ended for p in placed if p.ok)
    if within:
        gaps = [b - a for a, b in itertools.pairwise(done) if a >= window.start and b <= window.end]
    else:
        gaps = [b - a for a, b in itertools.pairwise(done) if b >= window.start and a <= window.end]
    return max(gaps, default=window.end - window.start)


def in_window(placed: list[Placed], window: Window) -> list[Placed]:
    return [p for p in placed if window.start <= p.ended < window.end]


async def lease_holder(stack: Stack) -> str:
    async with httpx.AsyncClient(timeout=2) as client:
        for name, url in zip(stack.replicas("inventory"), stack.inventory_urls, strict=True):
            with contextlib.suppress(httpx.HTTPError, ValueError):
                reply = await client.get(f"{url}/readyz")
                if reply.status_code == 200 and reply.json().get("leader") is True:
                    return name
    return stack.replicas("inventory")[0]


def faults(stack: Stack) -> list[tuple[str, Callable[[], Awaitable[str]]]]:
    """(what, the fault: it strikes, waits until the part is back, and says
    anything worth noting)."""
    nats, redis = stack.nats_cluster, stack.redis_group
    assert nats is not None
    assert redis is not None

    def nats_member(i: int) -> Callable[[], Awaitable[str]]:
        async def kill_and_start() -> str:
            member = nats.members[i]
            leader = nats.meta_leader() is member
            member.kill()
            await asyncio.sleep(2.0)  # two members carry on meanwhile
            member.start()
            await asyncio.to_thread(nats.wait_healthy, 30.0)
            return "JetStream meta leader" if leader else ""

        return kill_and_start

    async def redis_primary() -> str:
        old = redis.kill_primary()
        started = time.monotonic()
        await asyncio.to_thread(redis.wait_promoted, old, 30.0)
        promoted = time.monotonic() - started
        await asyncio.to_thread(redis.rejoin, old, 30.0)
        return f"replica promoted {promoted:.1f} s after"

    async def extender() -> str:
        await stack.restart(stack.replicas("scheduler")[1], kill=True)
        return ""

    async def inventory() -> str:
        holder = await lease_holder(stack)
        await stack.restart(holder, kill=True)
        return holder

    return [
        *((f"NATS member n{i} killed, restarted 2 s later", nats_member(i)) for i in range(3)),
        ("Redis primary killed (sentinel failover), rejoined", redis_primary),
        ("extender replica killed and restarted", extender),
        ("inventory lease holder killed and restarted", inventory),
    ]


async def run(
    workdir: Path, window_s: float, rate: float, log_level: str
) -> list[tuple[Window, Window]]:
    stack = Stack(workdir, NODES, heartbeat_s=1.0, log_level=log_level, ha=True)
    async with stack.running():
        driver = ClusterDriver(stack)
        placed: list[Placed] = []
        stop = asyncio.Event()
        placing = asyncio.create_task(stream(driver, placed, stop, rate))
        results = []
        try:
            await asyncio.sleep(3.0)  # warm up
            for what, fault in faults(stack):
                quiet = Window("no fault", time.monotonic(), 0.0)
                await asyncio.sleep(window_s)
                quiet.end = time.monotonic()
                hit = Window(what, time.monotonic(), 0.0)
                hit.note = await fault()
                hit.recovered_s = time.monotonic() - hit.start
                await asyncio.sleep(max(0.0, hit.start + window_s - time.monotonic()))
                hit.end = time.monotonic()
                results.append((quiet, hit))
            await asyncio.sleep(2.0)  # the last window's gap closes
        finally:
            stop.set()
            await placing
            await driver.close()
        report(placed, results, window_s, rate)
        redis = stack.redis_group
        assert redis is not None
        log = redis.sentinel_servers[0].log_path.read_text(errors="replace")
        print(f"# failovers the sentinels made: {log.count('+switch-master')} (1 injected)")
    return results


def report(
    placed: list[Placed], results: list[tuple[Window, Window]], window_s: float, rate: float
) -> None:
    ok = [p for p in placed if p.ok]
    total = ok[-1].ended - ok[0].ended if len(ok) > 1 else 0.0
    print(f"# failover benchmark, {date.today()}, {platform.node()}, {os.cpu_count()} CPUs")
    print(
        f"# {len(placed)} placements ({len(ok)} succeeded), one at a time, paced at"
        f" {rate:g}/s: {len(ok) / total if total else 0:.1f}/s overall; windows of {window_s:g} s"
    )
    for failure in [p for p in placed if not p.ok][:10]:
        print(f"# failed at {failure.ended - placed[0].started:.1f} s: {failure.why}")
    print(
        "| fault | back in | longest gap | placements | failed | retried "
        "| baseline longest gap | baseline placements |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for quiet, hit in results:
        during, before = in_window(placed, hit), in_window(placed, quiet)
        failed = sum(not p.ok for p in during)
        retried = sum(p.ok and p.retries > 0 for p in during)
        steps = sum(p.retries for p in during)
        what = f"{hit.what} ({hit.note})" if hit.note else hit.what
        gap = longest_gap(placed, hit) * 1000
        base = longest_gap(placed, quiet, within=True) * 1000
        cells = [
            what,
            f"{hit.recovered_s:.1f} s",
            f"**{gap:.0f} ms**",
            str(sum(p.ok for p in during)),
            str(failed),
            f"{retried} ({steps} steps)",
            f"{base:.0f} ms",
            f"{sum(p.ok for p in before)} (retried {sum(p.retries > 0 for p in before)})",
        ]
        print(f"| {' | '.join(cells)} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--window", type=float, default=12.0, help="seconds measured per fault")
    parser.add_argument("--rate", type=float, default=5.0, help="placements started per second")
    parser.add_argument("--log-level", default="WARNING", help="the services' log level")
    parser.add_argument("--workdir", type=Path, default=None, help="logs (default: a temp dir)")
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="gpuslice-failover-"))
    print(f"# logs under {workdir}")
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    model = next(
        (
            line.split(":", 1)[1].strip()
            for line in lscpu.splitlines()
            if line.startswith("Model name")
        ),
        "?",
    )
    print(f"# CPU: {model}")
    asyncio.run(run(workdir, args.window, args.rate, args.log_level))


if __name__ == "__main__":
    main()
