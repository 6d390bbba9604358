"""Redis killed without persistence while waves of pods are placed through the real
extender (over HTTP) and the real inventory (registration, reconciliation):
a watcher reads every card all along, and no card is ever over capacity; every
pod ends placed and running, and the ledger holds exactly what the pods do."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from gpuslice_common.bus import Bus
from gpuslice_common.config import SchedulerSettings, load
from gpuslice_common.kube import LocalKubeApi
from gpuslice_common.ledger import Ledger, LedgerError, LedgerRebuilding
from gpuslice_common.models import PlacementState
from gpuslice_common.servers import NatsServer, RedisServer, free_port
from gpuslice_inventory.service import running as inventory_running
from gpuslice_scheduler.service import running as scheduler_running
from tests.conftest import make_inventory
from tests.inventory.conftest import announce, rebuilt, settings_for, until
from tests.test_extender import gpu_pod

log = logging.getLogger(__name__)

NODES = ["gpu-1", "gpu-2", "gpu-3"]
GPUS = 2
# three such pods fill a card (90 of 100 cores); a fourth never fits: the 18 pods
# fill the 6 cards exactly, so every one is placed only if the ledger is exact
POD_MEM, POD_CORES = 10000, 30
WAVE = 9
PLACE_WITHIN_S = 90.0
LIST_S = 1.0  # listing every pod takes this long (a large cluster): a wide window


class SlowList(LocalKubeApi):
    """The local API, whose list of every pod takes ``LIST_S``."""

    async def list_all_pods(self) -> list[dict[str, Any]]:
        listed = await super().list_all_pods()
        await asyncio.sleep(LIST_S)
        return listed


@dataclass
class Watch:
    """What the watcher saw: every card read, and any over capacity."""

    checks: int = 0
    over: list[str] = field(default_factory=list)


async def watch_cards(ledger: Ledger, seen: Watch, stop: asyncio.Event) -> None:
    while not stop.is_set():
        with contextlib.suppress(LedgerError):
            for node in NODES:
                for card in await ledger.node_gpus(node):
                    used, cap = card.used, card.capacity
                    if (
                        used.memory_mib > cap.memory_mib
                        or used.cores > cap.cores
                        or used.slots > cap.slots
                    ):
                        seen.over.append(f"{node}/{card.device.uuid}: {used} of {cap}")
                    seen.checks += 1
        await asyncio.sleep(0.01)


async def heartbeats(bus: Bus, stop: asyncio.Event) -> None:
    """The node agents: each node's inventory every 100 ms."""
    while not stop.is_set():
        for node in NODES:
            with contextlib.suppress(Exception):  # NATS is not under test here
                await announce(
                    bus, make_inventory(node, gpus=GPUS, memory_mib=40960, split_count=4)
                )
        await asyncio.sleep(0.1)


async def kubelets(kube: LocalKubeApi, ledger: Ledger, stop: asyncio.Event) -> int:
    """Each node's kubelet: Allocate for its bound pods, then report them running.
    Returns how many Allocate calls found the node being rebuilt."""
    waited = 0
    while not stop.is_set():
        for node in NODES:
            pending = [
                p
                for p in kube.pods()
                if p["spec"].get("nodeName") == node
                and (p.get("status") or {}).get("phase", "Pending") == "Pending"
            ]
            if not pending:
                continue
            try:
                allocation = await ledger.allocate(node, 1)
            except LedgerRebuilding:
                waited += 1
                continue
            except LedgerError:  # Redis away, or the pod is not back yet
                continue
            kube.set_phase("team", allocation.placement.pod.name, "Running")
        await asyncio.sleep(0.02)
    return waited


@dataclass
class Scheduler:
    """kube-scheduler's part: filter, prioritize, bind, and again until bound."""

    http: httpx.AsyncClient
    url: str
    kube: LocalKubeApi
    bound_at: dict[str, float] = field(default_factory=dict)  # pod name -> monotonic
    errors: list[str] = field(default_factory=list)

    async def place(self, pod: dict[str, Any]) -> str:
        self.kube.add_pod(pod)
        meta = pod["metadata"]
        deadline = time.monotonic() + PLACE_WITHIN_S
        while True:
            node = await self._try(pod)
            if node:
                self.bound_at[meta["name"]] = time.monotonic()
                return node
            assert time.monotonic() < deadline, f"{meta['name']} never placed: {self.errors[-3:]}"
            await asyncio.sleep(0.05)

    async def _try(self, pod: dict[str, Any]) -> str:
        body = {"Pod": pod, "NodeNames": NODES}
        try:
            passed = (await self.http.post(f"{self.url}/filter", json=body)).json()["NodeNames"]
            if not passed:
                return ""
            body["NodeNames"] = passed
            scored = (await self.http.post(f"{self.url}/prioritize", json=body)).json()
            scores = {entry["Host"]: entry["Score"] for entry in scored}
            node = max(passed, key=lambda n: scores.get(n, 0))
            meta = pod["metadata"]
            binding = {
                "PodName": meta["name"],
                "PodNamespace": meta["namespace"],
                "PodUID": meta["uid"],
                "Node": node,
            }
            error = (await self.http.post(f"{self.url}/bind", json=binding)).json()["Error"]
        except httpx.HTTPError as exc:
            self.errors.append(str(exc))
            return ""
        if error:
            self.errors.append(error)
            return ""
        return str(node)


@contextlib.asynccontextmanager
async def extender(redis_url: str, prefix: str, kube: LocalKubeApi) -> AsyncIterator[str]:
    settings = load(
        SchedulerSettings,
        redis_url=redis_url,
        ledger_prefix=prefix,
        listen_host="127.0.0.1",
        listen_port=free_port(),
        metrics_port=free_port(),
        sync_interval="50ms",
    )
    async with scheduler_running(settings, kube, handle_signals=False):
        yield f"http://127.0.0.1:{settings.listen_port}"


async def test_no_card_goes_over_capacity_when_redis_restarts_empty(
    nats_server: NatsServer, tmp_path: Path, prefix: str, bus: Bus
) -> None:
    redis = RedisServer(tmp_path / "redis", persist=False)
    kube = SlowList()
    stop = asyncio.Event()
    seen = Watch()
    # the periodic pass far off: only the prompt pass for unstamped nodes rebuilds
    config = settings_for(nats_server, redis.url, prefix, reconcile_interval=3600)
    with redis:
        watcher_ledger = Ledger.from_url(redis.url, prefix, retries=1)
        kubelet_ledger = Ledger.from_url(redis.url, prefix, retries=2)
        async with (
            inventory_running(config, bus, kube=kube, serve_http=False) as inventory,
            extender(redis.url, prefix, kube) as url,
            httpx.AsyncClient(timeout=30) as http,
        ):
            tasks = [
                asyncio.create_task(heartbeats(bus, stop)),
                asyncio.create_task(watch_cards(watcher_ledger, seen, stop)),
            ]
            allocating = asyncio.create_task(kubelets(kube, kubelet_ledger, stop))
            try:
                await until(lambda: rebuilt(inventory.ledger, *NODES), timeout=30)
                scheduler = Scheduler(http, url, kube)

                def wave(n: int) -> list[dict[str, Any]]:
                    return [gpu_pod(f"w{n}-{i}", mem=POD_MEM, cores=POD_CORES) for i in range(WAVE)]

                await asyncio.gather(*(scheduler.place(pod) for pod in wave(1)))
                checks_before = seen.checks
                second: list[asyncio.Task[str]] = []
                for pod in wave(2):  # one every 50 ms ...
                    second.append(asyncio.create_task(scheduler.place(pod)))
                    await asyncio.sleep(0.05)
                    if len(scheduler.bound_at) >= WAVE + 3:
                        break
                # ... and Redis is lost once three of them are bound
                await until(lambda: len(scheduler.bound_at) >= WAVE + 3, timeout=30)
                await asyncio.to_thread(redis.kill)
                await asyncio.to_thread(redis.start)
                restarted = time.monotonic()
                for pod in wave(2)[len(second) :]:
                    second.append(asyncio.create_task(scheduler.place(pod)))
                    await asyncio.sleep(0.05)
                await asyncio.gather(*second)
                await until(
                    lambda: all(
                        (p.get("status") or {}).get("phase") == "Running" for p in kube.pods()
                    ),
                    timeout=60,
                )
            finally:
                stop.set()
                await asyncio.gather(*tasks)
                rebuilding_allocates = await allocating
            assert seen.over == []
            led = inventory.ledger
            pods = kube.pods()
            assert len(pods) == 2 * WAVE

            async def all_held() -> bool:
                found = [await led.placement(p["metadata"]["uid"]) for p in pods]
                return all(f is not None and f.state is PlacementState.ALLOCATED for f in found)

            await until(all_held, timeout=30)
            for pod in pods:
                held = await led.placement(pod["metadata"]["uid"])
                assert held is not None, pod["metadata"]["name"]
                assert held.state is PlacementState.ALLOCATED
                assert held.node == pod["spec"]["nodeName"]
            for node in NODES:
                assert await led.check_node(node) == []
                for card in await led.node_gpus(node):
                    assert (card.used.cores, card.used.memory_mib, card.used.slots) == (
                        3 * POD_CORES,
                        3 * POD_MEM,
                        3,
                    )
            assert inventory.work.restore_conflicts == 0
            # every node is taken back after the loss, each by a pass of the inventory
            await until(lambda: rebuilt(led, *NODES), timeout=30)
            assert inventory.work.nodes_rebuilt >= 2 * len(NODES)  # at start, after the loss
        await watcher_ledger.close()
        await kubelet_ledger.close()
    assert seen.checks > checks_before  # the watcher read the cards through the loss
    after = sorted(t - restarted for t in scheduler.bound_at.values() if t > restarted)
    rebuild_refusals = sum("being rebuilt" in e for e in scheduler.errors)
    log.info(
        "after the loss: first bind %.2fs, last %.2fs after Redis was back; %d of the "
        "second wave bound after it; %d bind refusals (being rebuilt), %d Allocate calls waited",
        after[0] if after else -1,
        after[-1] if after else -1,
        len(after),
        rebuild_refusals,
        rebuilding_allocates,
    )


async def test_a_new_epoch_gets_a_reconciliation_pass_at_once(
    nats_server: NatsServer, own_redis: RedisServer, prefix: str, bus: Bus
) -> None:
    # Redis restarts with its data (append-only, synced at every write here):
    # a new epoch all the same, since a file synced once a second, or a promoted
    # replica, may miss acknowledged writes. The leader's next sweep sees every
    # node stale and runs a pass then, not a reconcile interval later.
    config = settings_for(nats_server, own_redis.url, prefix, reconcile_interval="1h")
    kube = LocalKubeApi()
    ledger = Ledger.from_url(own_redis.url, prefix)
    try:
        async with inventory_running(config, bus, kube=kube, serve_http=False):
            for node in NODES:
                await announce(bus, make_inventory(node, gpus=GPUS))
            await until(lambda: rebuilt(ledger, *NODES), timeout=30)
            epoch = (await ledger.rebuild_status())[NODES[0]].epoch
            own_redis.kill()
            own_redis.start()
            with contextlib.suppress(LedgerError):  # the first call may find it starting
                await ledger.ping()
            assert (await ledger.rebuild_status())[NODES[0]].epoch != epoch
            await until(lambda: rebuilt(ledger, *NODES), timeout=30)
    finally:
        await ledger.close()
