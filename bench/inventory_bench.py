"""Telemetry ingestion: NATS -> TelemetryStore -> Redis, on loopback.

Starts nats-server and redis-server, then a publisher process that sends N
telemetry samples (as ``native/src/telemetry.c`` writes them) as fast as NATS
takes them, for a cluster of 500 nodes x 8 GPUs with several containers per GPU
(a quarter of the pods use two GPUs). This process subscribes to
``<prefix>.telemetry.*.*`` and hands every message to ``TelemetryStore.ingest``
while ``TelemetryStore.run`` flushes to Redis every ``--flush-interval``.

Baseline in the same run: the same subscription whose callback only counts
messages (the NATS delivery floor of one Python process). Also printed: the
cost per sample of parsing and checking alone, hand-checked (what ingest does)
and with pydantic (``TelemetrySample.model_validate_json``), without NATS.

Usage: python bench/inventory_bench.py [--samples 200000] [--nodes 500] [--no-uvloop]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import platform
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import date
from multiprocessing.process import BaseProcess
from multiprocessing.queues import Queue

import nats
import orjson
from nats.aio.msg import Msg
from redis.asyncio import Redis

from gpuslice_common.models import TelemetrySample
from gpuslice_common.servers import NatsServer, RedisServer
from gpuslice_common.subjects import Subjects
from gpuslice_inventory.telemetry import TelemetryStore

GPUS = 8
PODS_PER_GPU = 3  # pods whose (first) container sits on each GPU
GIB = 1 << 30

Handler = Callable[[Msg], Awaitable[None]]


@dataclass(frozen=True)
class Slot:
    """One container that reports: where, on which GPUs."""

    node: str
    pod_uid: str
    container: str
    uuids: tuple[str, ...]


def cluster(nodes: int) -> list[Slot]:
    slots = []
    for n in range(nodes):
        node = f"gpu-{n:04d}.pool-a.example.internal"
        for p in range(GPUS * PODS_PER_GPU):
            gpus = (p % GPUS, (p + 1) % GPUS) if p % 4 == 0 else (p % GPUS,)
            slots.append(
                Slot(
                    node=node,
                    pod_uid=f"5f0c{n:04x}-8d2e-4b1a-9c3f-{p:012x}",
                    container="trainer" if p % 2 else "inference-server",
                    uuids=tuple(f"GPU-{n:08x}-1e2d-4c3b-a4f5-{g:012x}" for g in gpus),
                )
            )
    return slots


def payload(slot: Slot, i: int) -> bytes:
    """Sample i of a slot, byte for byte what the interposer sends."""
    devices = ",".join(
        f'{{"uuid":"{uuid}","used_bytes":{(i % 64 + k + 1) * 64 << 20},'
        f'"peak_bytes":{(k + 65) * 64 << 20},"limit_bytes":{8 * GIB},'
        f'"sm_percent":{i % 100}.{i % 10},'
        f'"throttled_ns":{i * 1000},"denied_allocations":{i % 3}}}'
        for k, uuid in enumerate(slot.uuids)
    )
    return (
        f'{{"node":"{slot.node}","pod_uid":"{slot.pod_uid}","container":"{slot.container}",'
        f'"pid":{4000 + i % 50},"time":"2026-11-21T10:{i // 60000 % 60:02d}:'
        f'{i // 1000 % 60:02d}.{i % 1000:03d}Z","devices":[{devices}],"dropped_samples":0}}'
    ).encode()


def messages(prefix: str, nodes: int, count: int) -> list[tuple[str, bytes]]:
    """``count`` samples, the cluster's containers in turn (each reports every round)."""
    subjects = Subjects(prefix)
    slots = cluster(nodes)
    topics = [subjects.telemetry(s.node, s.pod_uid) for s in slots]
    return [(topics[i % len(slots)], payload(slots[i % len(slots)], i)) for i in range(count)]


# ------------------------------------------------------------ the publisher process


def publisher(url: str, prefix: str, nodes: int, count: int, out: Queue[float]) -> None:
    """In the child: build the samples, then publish them all; puts the seconds taken."""
    msgs = messages(prefix, nodes, count)

    async def send() -> float:
        nc = await nats.connect(url, max_reconnect_attempts=0)
        started = time.perf_counter()
        for subject, data in msgs:
            await nc.publish(subject, data)
        await nc.flush(timeout=60)
        elapsed = time.perf_counter() - started
        await nc.close()
        return elapsed

    out.put(asyncio.run(send()))


def start_publisher(
    url: str, prefix: str, nodes: int, count: int
) -> tuple[BaseProcess, Queue[float]]:
    ctx = multiprocessing.get_context("spawn")
    result: Queue[float] = ctx.Queue()
    proc = ctx.Process(target=publisher, args=(url, prefix, nodes, count, result), daemon=True)
    proc.start()
    return proc, result


# ------------------------------------------------------------ this process


class TimedStore(TelemetryStore):
    """The store, recording how long each flush takes and how much it writes."""

    def __init__(self, redis: Redis, prefix: str, flush_interval: float) -> None:
        super().__init__(redis, prefix, flush_interval=flush_interval, ttl=600.0)
        self.flush_ms: list[float] = []
        self.flush_sizes: list[int] = []
        self.last_write = 0.0

    async def flush(self) -> int:
        started = time.perf_counter()
        written = await super().flush()
        if written:
            self.last_write = time.perf_counter()
            self.flush_ms.append((self.last_write - started) * 1000)
            self.flush_sizes.append(written)
        return written


@dataclass
class Run:
    received: int = 0
    first: float = 0.0
    last: float = 0.0
    slow_consumer: int = 0
    publish_s: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)

    def rate(self) -> float:
        return (self.received - 1) / (self.last - self.first) if self.last > self.first else 0.0


async def wait_for(
    run: Run, count: int, proc: BaseProcess, result: Queue[float], stall: float = 10.0
) -> None:
    """Until ``count`` messages arrived, or none for ``stall`` seconds."""
    seen, since = -1, time.perf_counter()
    while run.received < count:
        await asyncio.sleep(0.02)
        if run.received != seen:
            seen, since = run.received, time.perf_counter()
        elif time.perf_counter() - since > stall:
            break
    await asyncio.to_thread(proc.join, 60)
    run.publish_s = result.get(timeout=60)


async def subscribe_and_publish(
    url: str, prefix: str, nodes: int, count: int, handle: Handler, run: Run
) -> None:
    errors: list[Exception] = []

    async def error_cb(err: Exception) -> None:
        errors.append(err)

    nc = await nats.connect(url, error_cb=error_cb)
    sub = await nc.subscribe(
        Subjects(prefix).telemetry_all,
        cb=handle,
        pending_msgs_limit=count + 1,
        pending_bytes_limit=4 << 30,
    )
    await nc.flush()
    proc, result = start_publisher(url, prefix, nodes, count)
    await wait_for(run, count, proc, result)
    await sub.unsubscribe()
    await nc.close()
    run.slow_consumer = sum("SlowConsumer" in type(e).__name__ for e in errors)


async def baseline(url: str, nodes: int, count: int) -> Run:
    run = Run()

    async def count_only(msg: Msg) -> None:
        if run.received == 0:
            run.first = time.perf_counter()
        run.received += 1
        run.last = time.perf_counter()

    await subscribe_and_publish(url, "benchfloor", nodes, count, count_only, run)
    return run


async def ingest(url: str, redis_url: str, nodes: int, count: int, interval: float) -> Run:
    redis = Redis.from_url(redis_url, decode_responses=True)
    await redis.flushall()
    store = TimedStore(redis, "bench", interval)
    flusher = asyncio.create_task(store.run())
    run = Run()

    async def take(msg: Msg) -> None:
        if run.received == 0:
            run.first = time.perf_counter()
        run.received += 1
        store.ingest(msg.subject, msg.data)
        run.last = time.perf_counter()

    await subscribe_and_publish(url, "bench", nodes, count, take, run)
    ingested = run.last
    # stored: once the flush that follows the last sample has written it
    await store.flush()  # after the flush in progress, if any: now everything is written
    stored_at = store.last_write
    flusher.cancel()
    await asyncio.gather(flusher, return_exceptions=True)

    slots = cluster(nodes)
    fields = 0
    for node in sorted({s.node for s in slots}):
        fields += len(await store.container_usage(node))
    expected_fields = sum(len(s.uuids) for s in slots[: min(count, len(slots))])
    # the latest sample of the last slot is what Redis holds
    last_i = count - 1
    last = slots[last_i % len(slots)]
    usage = {(u.uuid, u.pod_uid): u for u in await store.container_usage(last.node)}[
        (last.uuids[0], last.pod_uid)
    ]
    latest_ok = usage.throttled_ns == last_i * 1000 and usage.peak_bytes == 65 * 64 << 20
    await redis.aclose()
    stats = store.stats
    run.extra = {
        "ingested_s": ingested - run.first,
        "stored_s": stored_at - run.first,
        "accepted": stats.received - stats.malformed - stats.dropped,
        "malformed": stats.malformed,
        "dropped": stats.dropped,
        "flushes": stats.flushes,
        "flush_errors": stats.flush_errors,
        "written": stats.stored,
        "flush_p50_ms": statistics.median(store.flush_ms) if store.flush_ms else 0.0,
        "flush_max_ms": max(store.flush_ms, default=0.0),
        "flush_mean_samples": statistics.mean(store.flush_sizes) if store.flush_sizes else 0.0,
        "fields": fields,
        "expected_fields": expected_fields,
        "latest_ok": float(latest_ok),
    }
    return run


def parse_cost(nodes: int, count: int) -> dict[str, float]:
    """Microseconds per sample to parse and check, without NATS or Redis (best of 5)."""
    msgs = messages("gpuslice", nodes, count)
    store = TelemetryStore(Redis(), "gpuslice", max_pending=count + 1)

    def with_pydantic(subject: str, data: bytes) -> object:
        node, pod_uid = store._route(subject)
        sample = TelemetrySample.model_validate_json(data, strict=True)
        if sample.node != node or sample.pod_uid != pod_uid:
            raise ValueError("mismatch")
        return (node, pod_uid, sample.container), tuple(
            (
                d.uuid,
                f"{d.used_bytes},{d.limit_bytes},{d.sm_percent},{d.throttled_ns},"
                f"{d.denied_allocations}",
                f",{max(d.peak_bytes, d.used_bytes)}",
            )
            for d in sample.devices
        )

    cases: dict[str, Callable[[str, bytes], object]] = {
        "TelemetryStore.ingest (orjson, checked by hand)": store.ingest,
        "the same with pydantic (strict model_validate_json)": with_pydantic,
        "orjson.loads alone": lambda s, d: orjson.loads(d),
    }
    best = dict.fromkeys(cases, float("inf"))
    for _ in range(5):
        for name, fn in cases.items():
            started = time.perf_counter()
            for subject, data in msgs:
                fn(subject, data)
            best[name] = min(best[name], time.perf_counter() - started)
    assert store.stats.malformed == 0
    return {name: t / len(msgs) * 1e6 for name, t in best.items()}


async def flush_alone(redis_url: str, nodes: int) -> tuple[int, int, float]:
    """One flush of every container's sample with nothing else running: (samples,
    fields, ms), best of 5."""
    redis = Redis.from_url(redis_url, decode_responses=True)
    store = TelemetryStore(redis, "alone", max_pending=1_000_000)
    msgs = messages("alone", nodes, len(cluster(nodes)))
    best = float("inf")
    for _ in range(5):
        for subject, data in msgs:
            store.ingest(subject, data)
        started = time.perf_counter()
        written = await store.flush()
        best = min(best, time.perf_counter() - started)
    fields = sum([await redis.hlen(store.usage_key(n)) for n in {s.node for s in cluster(nodes)}])
    await redis.aclose()
    return written, fields, best * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=200_000)
    parser.add_argument("--nodes", type=int, default=500)
    parser.add_argument("--flush-interval", type=float, default=0.1)
    parser.add_argument("--no-uvloop", action="store_true", help="asyncio's own loop")
    args = parser.parse_args()
    runner = asyncio.run
    if not args.no_uvloop:
        import uvloop

        runner = uvloop.run
    containers = len(cluster(args.nodes))
    with NatsServer() as nats_server, RedisServer(persist=False) as redis_server:
        floor = runner(baseline(nats_server.url, args.nodes, args.samples))
        store = runner(
            ingest(nats_server.url, redis_server.url, args.nodes, args.samples, args.flush_interval)
        )
        alone = runner(flush_alone(redis_server.url, args.nodes))
    cost = parse_cost(args.nodes, min(args.samples, 50_000))
    x = store.extra
    loop = "asyncio" if args.no_uvloop else "uvloop"
    print(
        f"# inventory telemetry benchmark, {date.today()}, {platform.node()}, "
        f"{os.cpu_count()} CPUs, Python {platform.python_version()}, {loop}"
    )
    print(
        f"# {args.samples:,} samples from {args.nodes} nodes x {GPUS} GPUs, {containers:,} "
        f"containers ({x['expected_fields']:,.0f} container-GPU fields), one publisher "
        f"process; flush every {args.flush_interval * 1000:.0f} ms"
    )
    print("| run | received | samples/s received | samples/s stored | publisher msgs/s |")
    print("|---|---|---|---|---|")
    for name, run, stored in (
        ("baseline: callback counts only", floor, None),
        ("TelemetryStore.ingest + run()", store, x["accepted"] / x["stored_s"]),
    ):
        print(
            f"| {name} | {run.received:,} | {run.rate():,.0f} | "
            f"{'—' if stored is None else format(stored, ',.0f')} | "
            f"{args.samples / run.publish_s:,.0f} |"
        )
    print()
    print("| store | value |")
    print("|---|---|")
    for label, value in (
        (
            "accepted / malformed / dropped",
            f"{x['accepted']:,.0f} / {x['malformed']:,.0f} / {x['dropped']:,.0f}",
        ),
        ("slow-consumer errors (client side)", f"{floor.slow_consumer} / {store.slow_consumer}"),
        ("flushes (errors)", f"{x['flushes']:,.0f} ({x['flush_errors']:,.0f})"),
        ("samples per flush, mean (after coalescing)", f"{x['flush_mean_samples']:,.0f}"),
        ("samples written (after coalescing)", f"{x['written']:,.0f}"),
        (
            "flush wall time p50 / max (delivery goes on while it waits for Redis)",
            f"{x['flush_p50_ms']:.0f} ms / {x['flush_max_ms']:.0f} ms",
        ),
        (
            f"flush alone: {alone[0]:,} samples, {alone[1]:,} fields, one pipeline",
            f"{alone[2]:.0f} ms ({alone[2] * 1000 / alone[0]:.1f} µs per sample)",
        ),
        ("fields in Redis (expected)", f"{x['fields']:,.0f} ({x['expected_fields']:,.0f})"),
        ("latest sample stored", "yes" if x["latest_ok"] else "NO"),
    ):
        print(f"| {label} | {value} |")
    print()
    print("| parse and check only (no NATS, no Redis) | µs per sample |")
    print("|---|---|")
    for name, us in cost.items():
        print(f"| {name} | {us:.2f} |")
    if x["fields"] != x["expected_fields"] or not x["latest_ok"] or x["malformed"]:
        raise SystemExit("the store does not hold what was published")


if __name__ == "__main__":
    main()
