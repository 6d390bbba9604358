"""Racing reservers against one real Redis never over-commit a card nor leave half a pod."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuslice_common.ledger import AlreadyReserved, Ledger, ReservationConflict
from gpuslice_common.models import ContainerAssignment, DeviceGrant, Placement, PodRef
from tests.conftest import make_inventory
from tests.ledger_worker import GPUS_PER_NODE, NODES, random_placement

ROOT = Path(__file__).resolve().parent.parent


async def setup_nodes(ledger: Ledger) -> None:
    await ledger.redis.flushall()
    for node in NODES:
        await ledger.register_node(
            make_inventory(node, gpus=GPUS_PER_NODE, memory_mib=10000), rebuilt=True
        )


async def assert_consistent(ledger: Ledger) -> None:
    for node in NODES:
        assert await ledger.check_node(node) == []
        for gpu in await ledger.node_gpus(node):
            assert gpu.used.memory_mib <= gpu.capacity.memory_mib
            assert gpu.used.cores <= gpu.capacity.cores
            assert gpu.used.slots <= gpu.capacity.slots


async def live_uids(ledger: Ledger) -> set[str]:
    return {
        p.pod.uid
        for node in NODES
        for p in await ledger.node_placements(node)
        if p.state != "released"
    }


async def watch_capacity(ledger: Ledger, stop: asyncio.Event) -> int:
    """Poll usage while reservers race; any over-commit seen fails the test."""
    polls = 0
    while not stop.is_set():
        for gpus in (await ledger.nodes_gpus(list(NODES))).values():
            for g in gpus:
                assert g.used.memory_mib <= g.capacity.memory_mib, g
                assert g.used.cores <= g.capacity.cores, g
                assert g.used.slots <= g.capacity.slots, g
        polls += 1
        await asyncio.sleep(0)
    return polls


async def race(ledger: Ledger, placements: list[Placement], retries: int) -> set[str]:
    async def one(p: Placement) -> str | None:
        try:
            got = await ledger.reserve(p)
        except (ReservationConflict, AlreadyReserved):
            return None
        for _ in range(retries):  # a retry after a lost reply returns the same record
            assert await ledger.reserve(p) == got
        return p.pod.uid

    stop = asyncio.Event()
    watcher = asyncio.create_task(watch_capacity(ledger, stop))
    results = await asyncio.gather(*(one(p) for p in placements))
    stop.set()
    assert await watcher > 0
    return {uid for uid in results if uid is not None}


async def test_1200_racing_reservations_in_one_process(redis_url: str) -> None:
    ledger = Ledger.from_url(redis_url)
    try:
        await setup_nodes(ledger)
        rng = random.Random(7)
        placements = [random_placement(rng, f"pod-{i}") for i in range(1200)]
        won = await race(ledger, placements, retries=1)
        assert 0 < len(won) < len(placements)  # the cluster fills up: some must lose
        assert await live_uids(ledger) == won
        await assert_consistent(ledger)
        # every winner holds exactly its own footprint: release all and reach zero
        for uid in won:
            released = await ledger.release(uid)
            assert released is not None
            assert released.first
            assert released.clamped == 0
        for node in NODES:
            assert all(
                g.used.slots == 0 and g.used.memory_mib == 0 for g in await ledger.node_gpus(node)
            )
    finally:
        await ledger.close()


def test_reservers_in_several_processes_never_overcommit(redis_url: str) -> None:
    asyncio.run(_prepare(redis_url))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    workers = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.ledger_worker", redis_url, str(seed), "300", "400"],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            env=env,
        )
        for seed in range(4)
    ]
    claimed: list[set[str]] = []
    for w in workers:
        out, _ = w.communicate(timeout=120)
        assert w.returncode == 0
        claimed.append(set(json.loads(out)))
    asyncio.run(_check_after_workers(redis_url, claimed))


async def _prepare(url: str) -> None:
    ledger = Ledger.from_url(url)
    await setup_nodes(ledger)
    await ledger.close()


async def _check_after_workers(url: str, claimed: list[set[str]]) -> None:
    ledger = Ledger.from_url(url)
    try:
        # A release killed between its two steps (index marked released, cards not
        # yet freed) is the one state a kill may leave; releasing again finishes it.
        live = await live_uids(ledger)
        for uid in live:
            index = await ledger.redis.get(ledger.pod_index_key(uid))
            if index is not None and str(index).startswith("released:"):
                finished = await ledger.release(uid, reason="finish an interrupted release")
                assert finished is not None
        await assert_consistent(ledger)
        live = await live_uids(ledger)
        assert live, "workers reserved nothing"
        # Every live pod was reserved by some worker; a pod UID shared by workers is
        # held once (AlreadyReserved or idempotent return), never twice.
        assert live <= set().union(*claimed)
    finally:
        await ledger.close()


def test_worker_killed_mid_operation_leaves_a_consistent_ledger(redis_url: str) -> None:
    asyncio.run(_prepare(redis_url))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    rng = random.Random(3)
    for round_ in range(6):
        w = subprocess.Popen(
            [sys.executable, "-m", "tests.ledger_worker", redis_url, str(round_), "0", "--loop"],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            env=env,
        )
        assert w.stdout is not None
        assert w.stdout.readline().strip() == b"ready"
        time.sleep(rng.uniform(0.05, 0.3))
        os.kill(w.pid, signal.SIGKILL)
        w.wait()
        w.stdout.close()
    asyncio.run(_check_after_kills(redis_url))


async def _check_after_kills(url: str) -> None:
    ledger = Ledger.from_url(url)
    try:
        # A release killed between its two steps (index marked released, cards not
        # yet freed) is the one state a kill may leave; releasing again finishes it.
        live = await live_uids(ledger)
        for uid in live:
            index = await ledger.redis.get(ledger.pod_index_key(uid))
            if index is not None and str(index).startswith("released:"):
                finished = await ledger.release(uid, reason="finish an interrupted release")
                assert finished is not None
        await assert_consistent(ledger)
        live = await live_uids(ledger)
        # pod index entries without a reservation (killed between the two writes) read as absent
        for key in await ledger.redis.keys(f"{ledger.prefix}:pod:*"):
            uid = str(key).split("{", 1)[1].rstrip("}")
            if uid not in live:
                p = await ledger.placement(uid)
                assert p is None or p.state == "released"
        for uid in live:
            released = await ledger.release(uid, reason="cleanup after crash")
            assert released is not None
            assert released.first
        await assert_consistent(ledger)
        for node in NODES:
            assert all(g.used.slots == 0 for g in await ledger.node_gpus(node))
    finally:
        await ledger.close()


grant = st.builds(
    DeviceGrant,
    uuid=st.sampled_from([f"GPU-node-a-{i}" for i in range(GPUS_PER_NODE)]),
    memory_mib=st.integers(0, 12000),
    cores=st.sampled_from([0, 5, 25, 50, 100]),
)
container = st.lists(grant, min_size=1, max_size=3, unique_by=lambda g: g.uuid)
pods = st.lists(st.lists(container, min_size=1, max_size=3), min_size=1, max_size=40)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(pods=pods, inits=st.lists(st.booleans(), min_size=3, max_size=3))
def test_property_any_workload_never_exceeds_capacity(
    redis_url: str, pods: list[list[list[DeviceGrant]]], inits: list[bool]
) -> None:
    placements = [
        Placement(
            pod=PodRef(uid=f"h-{i}"),
            node="node-a",
            containers=tuple(
                ContainerAssignment(name=f"c{j}", init=inits[j], devices=tuple(devs))
                for j, devs in enumerate(pod)
            ),
        )
        for i, pod in enumerate(pods)
    ]

    async def run() -> None:
        ledger = Ledger.from_url(redis_url)
        try:
            await setup_nodes(ledger)
            won = await race(ledger, placements, retries=0)
            assert await live_uids(ledger) == won
            await assert_consistent(ledger)
        finally:
            await ledger.close()

    asyncio.run(run())
