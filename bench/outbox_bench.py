"""Outbox benchmark: events kept until the audit stream acknowledges them.

Publishes N events through an :class:`~gpuslice_common.outbox.Outbox` (each
waits for JetStream's acknowledgement, up to ``window`` in flight) to a real
nats-server with the audit stream, and prints the events per second beside a
baseline measured in the same run: the same events by core NATS publish (fire
and forget, then one flush), which is what the services did before and the
most NATS can take from one connection. With ``--cluster`` the server is a
three-member cluster and the stream has three copies.

    python bench/outbox_bench.py [--events 20000] [--window 64] [--cluster] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import time
from contextlib import ExitStack
from datetime import UTC, datetime, timedelta
from typing import Any

from gpuslice_common.bus import Bus
from gpuslice_common.config import CommonSettings
from gpuslice_common.events import CloudEvent, EventType, PodAdmitted, make_event
from gpuslice_common.models import ContainerGpuRequest, MemoryRequest, PodRef
from gpuslice_common.outbox import Outbox
from gpuslice_common.servers import NatsCluster, NatsServer


def events(n: int, tag: str) -> list[CloudEvent]:
    request = ContainerGpuRequest(name="main", count=1, memory=MemoryRequest(mib=1024), cores=10)
    return [
        make_event(
            EventType.POD_ADMITTED,
            PodAdmitted(
                pod=PodRef(uid=f"{tag}-{i}", namespace="bench", name=f"p{i}"), containers=(request,)
            ),
            source="/gpuslice/bench",
        )
        for i in range(n)
    ]


async def core(settings: CommonSettings, batch: list[CloudEvent]) -> float:
    bus = await Bus.connect(settings, "bench-core")
    try:
        start = time.perf_counter()
        for event in batch:
            await bus.publish(event)
        await bus.flush(30)
        return time.perf_counter() - start
    finally:
        await bus.close()


async def acked(settings: CommonSettings, batch: list[CloudEvent], window: int) -> float:
    outbox = Outbox(settings, "bench-outbox", capacity=len(batch), window=window)
    await outbox.start()
    start = time.perf_counter()
    for event in batch:
        outbox.submit(event)
    await outbox.close(timeout=600)  # returns once every event is acknowledged
    elapsed = time.perf_counter() - start
    if outbox.stats.published != len(batch):
        raise SystemExit(f"only {outbox.stats.published} of {len(batch)} events were stored")
    return elapsed


async def run(n: int, window: int, cluster: bool) -> dict[str, Any]:
    with ExitStack() as stack:
        if cluster:
            url = stack.enter_context(NatsCluster()).url
        else:
            url = stack.enter_context(NatsServer()).url
        settings = CommonSettings(nats_url=url)
        admin = await Bus.connect(settings, "bench-admin")
        await admin.ensure_audit_stream(timedelta(hours=1), 3 if cluster else 1)
        await admin.close()
        await core(settings, events(1000, "warm"))
        base = await core(settings, events(n, "core"))
        mine = await acked(settings, events(n, "acked"), window)
    return {
        "events": n,
        "window": window,
        "servers": "3-member cluster, stream R3" if cluster else "one server, stream R1",
        "core_publish_per_s": round(n / base),
        "outbox_acked_per_s": round(n / mine),
        "machine": f"{platform.machine()}, {platform.processor() or platform.node()}",
        "date": datetime.now(UTC).date().isoformat(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=20000)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--cluster", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = asyncio.run(run(args.events, args.window, args.cluster))
    if args.json:
        print(json.dumps(result))
        return
    print(f"{result['events']} events, {result['servers']}, window {result['window']}")
    print(f"  baseline, core publish (no acknowledgement): {result['core_publish_per_s']:>8} /s")
    print(f"  outbox, each acknowledged by the stream:     {result['outbox_acked_per_s']:>8} /s")


if __name__ == "__main__":
    main()
