"""A separate process that hammers the ledger; used by the concurrency and crash tests.

    python -m tests.ledger_worker URL SEED COUNT [--loop]

Prints one JSON line: the pod UIDs it reserved and still holds. With --loop it
reserves, binds and releases forever (until killed).
"""

from __future__ import annotations

import asyncio
import json
import random
import sys

from gpuslice_common.ledger import AlreadyReserved, Ledger, ReservationConflict
from gpuslice_common.models import ContainerAssignment, DeviceGrant, Placement, PodRef

NODES = ("node-a", "node-b")
GPUS_PER_NODE = 4
CORE_CHOICES = (0, 0, 10, 20, 30, 50, 100)


def random_placement(rng: random.Random, uid: str) -> Placement:
    node = rng.choice(NODES)
    containers = []
    for c in range(rng.randint(1, 2)):
        cards = rng.sample(range(GPUS_PER_NODE), rng.randint(1, 2))
        grants = tuple(
            DeviceGrant(
                uuid=f"GPU-{node}-{i}",
                memory_mib=rng.randrange(250, 6000, 250),
                cores=rng.choice(CORE_CHOICES),
            )
            for i in cards
        )
        containers.append(ContainerAssignment(name=f"c{c}", devices=grants))
    return Placement(pod=PodRef(uid=uid), node=node, containers=tuple(containers))


async def reserve_some(url: str, seed: int, count: int, uid_space: int) -> list[str]:
    rng = random.Random(seed)
    ledger = Ledger.from_url(url)
    held: list[str] = []
    try:
        for _ in range(count):
            uid = f"pod-{rng.randrange(uid_space)}"
            try:
                await ledger.reserve(random_placement(rng, uid))
                held.append(uid)
            except (ReservationConflict, AlreadyReserved):
                pass
            if held and rng.random() < 0.2:
                await ledger.release(held.pop(rng.randrange(len(held))))
    finally:
        await ledger.close()
    return sorted(set(held))


async def loop_forever(url: str, seed: int) -> None:
    rng = random.Random(seed)
    ledger = Ledger.from_url(url)
    n = 0
    while True:
        n += 1
        uid = f"loop-{seed}-{n}"
        try:
            await ledger.reserve(random_placement(rng, uid))
        except ReservationConflict:
            continue
        if rng.random() < 0.5:
            await ledger.mark_bound(uid)
        if rng.random() < 0.7:
            await ledger.release(uid)


def main() -> None:
    url, seed, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    if "--loop" in sys.argv:
        print("ready", flush=True)
        asyncio.run(loop_forever(url, seed))
        return
    uid_space = int(sys.argv[4]) if len(sys.argv) > 4 else 10**9
    print(json.dumps(asyncio.run(reserve_some(url, seed, count, uid_space))))


if __name__ == "__main__":
    main()
