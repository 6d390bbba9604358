"""The highly-available stack through the loss of its members: each NATS
member killed (SIGKILL) and started again, the Redis primary killed (a
sentinel promotes a replica, the old one comes back as a replica), one
extender replica and the inventory replica holding the lease killed and
restarted, each while a wave of pods is under way. Every pod still runs, no
card is ever over capacity, everything is released at the end, and the audit
stream holds each event of every pod's life exactly once."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from gpuslice_cli.dev.driver import PodOutcome
from gpuslice_cli.dev.stack import Stack
from gpuslice_common.bus import Bus
from gpuslice_common.events import CloudEvent, EventType
from tests.dev.conftest import Up, everything_released, never_over_committed, settled
from tests.dev.test_stack import gpu_pod

PODS_PER_WAVE = 3
PARK_S = 60.0  # kube-scheduler retries a parked pod within its 300 s; a minute here
# what every pod's life writes: once per pod, and alloc.allocated once per container
ONCE_PER_POD = (
    EventType.POD_ADMITTED,
    EventType.ALLOC_RESERVED,
    EventType.ALLOC_BOUND,
    EventType.ALLOC_RELEASED,
)


async def lease_holder(stack: Stack) -> str:
    """The inventory replica that holds the lease (its /readyz says so);
    the first when none says it yet."""
    replicas = stack.replicas("inventory")
    async with httpx.AsyncClient(timeout=2) as client:
        for name, url in zip(replicas, stack.inventory_urls, strict=True):
            try:
                reply = await client.get(f"{url}/readyz")
            except httpx.HTTPError:
                continue
            if reply.status_code == 200 and reply.json().get("leader") is True:
                return name
    return replicas[0]


def faults(stack: Stack) -> list[tuple[str, Callable[[], Awaitable[None]]]]:
    nats, redis = stack.nats_cluster, stack.redis_group
    assert nats is not None
    assert redis is not None

    def nats_member(i: int) -> Callable[[], Awaitable[None]]:
        async def kill_and_start() -> None:
            member = nats.members[i]
            member.kill()
            await asyncio.sleep(1.0)  # the wave goes on with two members
            member.start()
            await asyncio.to_thread(nats.wait_healthy, 30.0)

        return kill_and_start

    async def redis_primary() -> None:
        old = redis.kill_primary()
        await asyncio.to_thread(redis.wait_promoted, old, 30.0)
        await asyncio.to_thread(redis.rejoin, old, 30.0)

    async def extender() -> None:
        await stack.restart(stack.replicas("scheduler")[1], kill=True)

    async def inventory() -> None:
        await stack.restart(await lease_holder(stack), kill=True)

    return [
        *((f"NATS member n{i} killed", nats_member(i)) for i in range(len(nats.members))),
        ("Redis primary killed", redis_primary),
        ("an extender replica killed", extender),
        ("the inventory replica holding the lease killed", inventory),
    ]


def pod_uid(event: CloudEvent) -> str:
    pod = event.data.get("pod")
    return str(pod.get("uid", "")) if isinstance(pod, dict) else ""


def missing_or_repeated(events: list[CloudEvent], outcomes: list[PodOutcome]) -> list[str]:
    """Each pod's life as the audit stream tells it: what is missing or repeated."""
    seen: collections.Counter[tuple[str, EventType, str]] = collections.Counter()
    for event in events:
        container = str(event.data.get("container") or "")
        seen[pod_uid(event), event.type, container] += 1
    wrong = []
    for outcome in outcomes:
        wanted = [(outcome.uid, kind, "") for kind in ONCE_PER_POD]
        wanted += [(outcome.uid, EventType.ALLOC_ALLOCATED, c.name) for c in outcome.containers]
        for key in wanted:
            if seen[key] != 1:
                wrong.append(f"{outcome.name} {key[1].suffix} {key[2]}: {seen[key]} times")
    return wrong


async def audit_complete(
    bus: Bus, outcomes: list[PodOutcome], timeout: float = 30
) -> list[CloudEvent]:
    """The audit stream once every pod's life is in it (the last releases come
    after the pods end); as it stands at the timeout otherwise."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        events = await bus.read_audit()
        if not missing_or_repeated(events, outcomes) or loop.time() > deadline:
            return events
        await asyncio.sleep(0.5)


async def test_pods_run_and_nothing_is_lost_while_members_die(up_ha: Up) -> None:
    stack, driver, bus, ledger = up_ha
    # as kube-scheduler does, a pod the extender found no room for is tried again
    # (a fault can leave a node's cards unhealthy until its next heartbeat)
    driver.park_s = PARK_S
    assert len(stack.extender_urls) == len(stack.inventory_urls) == 2
    stop = asyncio.Event()
    watcher = asyncio.create_task(never_over_committed(stack, ledger, stop))
    outcomes: list[Any] = []
    try:
        for i, (what, fault) in enumerate(faults(stack)):
            wave = [
                gpu_pod(
                    f"h{i}-{j}", ["probe", "init", "ctx", "alloc", "512m", "sleep", "500"], mem=6000
                )
                for j in range(PODS_PER_WAVE)
            ]
            running = [asyncio.create_task(driver.run_pod(pod)) for pod in wave]
            await asyncio.sleep(0.3)  # the fault strikes while the wave is under way
            await fault()
            done = await asyncio.gather(*running)
            for outcome in done:
                assert outcome.phase == "Succeeded", (what, outcome)
            outcomes += done
            # each fault alone: the next strikes once everything is whole again
            await settled(stack, ledger, bus=bus)
    finally:
        stop.set()
        checks = await watcher
    assert checks > 0
    assert len(outcomes) == PODS_PER_WAVE * len(faults(stack))
    await everything_released(stack, ledger)

    # the auditor's record: every event once, every pod's whole life
    events = await audit_complete(bus, outcomes)
    ids = collections.Counter(event.id for event in events)
    assert [i for i, n in ids.items() if n > 1] == []
    wrong = missing_or_repeated(events, outcomes)
    assert not wrong, "the audit stream tells pods' lives wrong:\n" + "\n".join(wrong)
    info = await bus.js.stream_info(bus.subjects.audit_stream)
    assert info.config.num_replicas == 3
