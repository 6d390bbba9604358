"""The inventory against real nats-server and redis-server: node registration and
liveness, expiry of reservations never allocated, the lease between replicas,
metrics."""

from __future__ import annotations

import asyncio
import json
import logging
from contextlib import AsyncExitStack

import httpx
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from redis.asyncio import Redis

from gpuslice_common.bus import Bus
from gpuslice_common.events import AllocationEvent, CloudEvent, EventType
from gpuslice_common.kube import LocalKubeApi
from gpuslice_common.ledger import Ledger
from gpuslice_common.models import (
    PLACEMENT_ANNOTATION,
    ContainerAssignment,
    DeviceGrant,
    Placement,
    PlacementState,
    PodRef,
)
from gpuslice_common.servers import NatsServer
from gpuslice_inventory.lease import Lease
from gpuslice_inventory.service import Running, running
from tests.conftest import make_inventory, make_vendor_inventory
from tests.inventory.conftest import announce, settings_for, until
from tests.rawhttp import post_huge
from tests.test_ledger import placement
from tests.test_ledger_vendors import dcus

# ---------------------------------------------------------------- nodes


async def test_inventories_register_nodes(
    nats_server: NatsServer, redis_url: str, prefix: str, bus: Bus, ledger: Ledger
) -> None:
    config = settings_for(nats_server, redis_url, prefix)
    async with running(config, bus, serve_http=False) as state:
        await announce(bus, make_inventory("gpu-1", gpus=2, memory_mib=40960))
        await announce(bus, make_inventory("gpu-2.zone-a", gpus=1, memory_scaling=1.5))
        # the node named in the payload must be the one in the subject
        await bus.publish_model(bus.subjects.inventory("gpu-3"), make_inventory("gpu-4"))
        await until(lambda: state.work.registrations == 2)
        await asyncio.sleep(0.1)
    led = Ledger.from_url(redis_url, prefix)
    try:
        assert await led.nodes() == ["gpu-1", "gpu-2.zone-a"]
        cards = await led.node_gpus("gpu-2.zone-a")
        assert cards[0].capacity.memory_mib == int(16384 * 1.5)
    finally:
        await led.close()


ANY_BYTES = [
    b"\xff\xfe",
    b"",
    b"not json {",
    b"[1, 2]",
    b"null",
    b"[" * 100_000,
    b'{"node": "\xc3\x28"}',
    b"x" * 500_000,
]


async def test_any_bytes_on_every_subject_the_inventory_follows_are_counted_and_skipped(
    nats_server: NatsServer,
    redis_url: str,
    prefix: str,
    bus: Bus,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Inventories, ended pods and telemetry: each message of bytes no gpuslice
    sends is counted and dropped without a traceback, and the good one after
    them is still taken."""
    config = settings_for(nats_server, redis_url, prefix)
    subjects = [
        f"{prefix}.inventory.gpu-1",
        f"{prefix}.pods.ended",
        f"{prefix}.telemetry.gpu-1.uid-1",
    ]
    async with running(config, bus, serve_http=False) as state:
        for payload in ANY_BYTES:
            for subject in subjects:
                await bus.nc.publish(subject, payload)
        await bus.publish_model(f"{prefix}.inventory.gpu-1", make_inventory("gpu-1"))
        await bus.flush()
        await until(lambda: state.work.registrations == 1)
        await until(lambda: state.telemetry.stats.malformed == len(ANY_BYTES))
        await until(lambda: state.bus.stats.malformed == len(ANY_BYTES))
        assert sum(state.work.refused.values()) == len(ANY_BYTES)
        text = generate_latest(state.registry).decode()
    assert f"gpuslice_inventory_bus_messages_malformed_total {float(len(ANY_BYTES))}" in text
    assert "gpuslice_inventory_change_notices_refused_total 0.0" in text
    assert "Traceback" not in caplog.text
    assert not any(r.exc_info for r in caplog.records)


async def test_inventories_out_of_bounds_or_on_another_subject_are_refused_in_one_line(
    nats_server: NatsServer,
    redis_url: str,
    prefix: str,
    bus: Bus,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A report that the ledger could not store as written, or whose node is not
    exactly the subject's, never reaches the ledger: counted by reason, one line."""
    config = settings_for(nats_server, redis_url, prefix)
    good = json.loads(make_inventory("gpu-1").model_dump_json())
    huge = {**good, "node": "gpu-2"}
    huge["devices"] = [{**d, "memory_mib": 10**17} for d in good["devices"]]
    bad_model = {**good, "node": "gpu-3"}
    bad_model["devices"] = [{**d, "model": "A100\nERROR forged line"} for d in good["devices"]]
    upper = {**good, "node": "Node-A"}
    wrong = {
        f"{prefix}.inventory.gpu-2": huge,  # invalid: memory beyond 16 TiB
        f"{prefix}.inventory.gpu-3": bad_model,  # invalid: a line break in the model
        f"{prefix}.inventory.Node-A": upper,  # invalid: not a Kubernetes node name
        f"{prefix}.inventory.Node-B": {**good, "node": "node-b"},  # subject: case differs
        f"{prefix}.inventory.gpu-5": {**good, "node": "gpu-6"},  # subject: another node
    }
    caplog.set_level(logging.INFO)
    async with running(config, bus, serve_http=False) as state:
        for subject, payload in wrong.items():
            await bus.nc.publish(subject, json.dumps(payload).encode())
        await bus.nc.publish(f"{prefix}.inventory.gpu-7", b"{not json")
        await bus.nc.publish(f"{prefix}.inventory.gpu-1", json.dumps(good).encode())
        await bus.flush()
        await until(lambda: state.work.registrations == 1)
        await until(lambda: sum(state.work.refused.values()) == 6)
        assert state.work.refused == {"invalid": 3, "subject": 2, "malformed": 1}
        text = generate_latest(state.registry).decode()
    assert 'gpuslice_inventory_inventories_refused_total{reason="invalid"} 3.0' in text
    assert 'gpuslice_inventory_inventories_refused_total{reason="subject"} 2.0' in text
    led = Ledger.from_url(redis_url, prefix)
    try:
        assert await led.nodes() == ["gpu-1"]
    finally:
        await led.close()
    refusals = [r for r in caplog.records if "refused the inventory" in r.getMessage()]
    assert len(refusals) == 6
    assert all("\n" not in r.getMessage() and r.exc_info is None for r in refusals)
    assert "less than or equal to 16777216" in caplog.text
    assert "Traceback" not in caplog.text
    assert not any(r.exc_info for r in caplog.records)


async def test_a_silent_node_is_unavailable_until_it_returns(
    nats_server: NatsServer, redis_url: str, prefix: str, bus: Bus
) -> None:
    config = settings_for(nats_server, redis_url, prefix)
    async with running(config, bus, serve_http=False) as state:
        led = state.ledger
        await announce(bus, make_inventory("gpu-1", gpus=2))
        await until(lambda: state.work.registrations == 1)
        held = await led.reserve(placement("p1", "gpu-1", [[(0, 1000, 10)]]))
        # three missed heartbeats (0.2 s each) later
        await until(lambda: state.upkeep.stats.nodes_marked == 1, timeout=3)
        cards = await led.node_gpus("gpu-1")
        assert [c.device.healthy for c in cards] == [False, False]
        assert cards[0].used.memory_mib == 1000  # its reservation stays
        assert (await led.placement("p1")) == held
        liveness = (await led.node_liveness(["gpu-1"]))["gpu-1"]
        assert liveness.unavailable_since is not None
        await announce(bus, make_inventory("gpu-1", gpus=2))  # back
        await until(lambda: state.work.registrations == 2)
        cards = await led.node_gpus("gpu-1")
        assert [c.device.healthy for c in cards] == [True, True]
        assert (await led.node_liveness(["gpu-1"]))["gpu-1"].unavailable_since is None


async def test_a_heartbeat_in_time_keeps_the_node(
    nats_server: NatsServer, redis_url: str, prefix: str, bus: Bus
) -> None:
    config = settings_for(nats_server, redis_url, prefix)
    async with running(config, bus, serve_http=False) as state:
        for _ in range(10):  # every 0.1 s, well inside three 0.2 s intervals
            await announce(bus, make_inventory("gpu-1"))
            await asyncio.sleep(0.1)
        assert state.upkeep.stats.sweeps > 5
        assert state.upkeep.stats.nodes_marked == 0


# ---------------------------------------------------------------- expiry


async def test_reservations_never_allocated_expire(
    nats_server: NatsServer, redis_url: str, prefix: str, bus: Bus, events: list[CloudEvent]
) -> None:
    config = settings_for(nats_server, redis_url, prefix, reservation_ttl=0.4)
    async with running(config, bus, serve_http=False) as state:
        led = state.ledger
        await announce(bus, make_inventory("gpu-1", gpus=1))
        await until(lambda: state.work.registrations == 1)
        await led.reserve(placement("stuck", "gpu-1", [[(0, 1000, 10)]]))
        await led.reserve(placement("running", "gpu-1", [[(0, 2000, 20)]]))
        await led.mark_bound("running")
        await led.allocate("gpu-1", 1)
        for _ in range(5):
            await announce(bus, make_inventory("gpu-1", gpus=1))
            await asyncio.sleep(0.1)
        await until(lambda: state.upkeep.stats.released["expired"] == 1, timeout=3)
        stuck = await led.placement("stuck")
        assert stuck is not None
        assert stuck.state is PlacementState.RELEASED
        kept = await led.placement("running")
        assert kept is not None
        assert kept.state is PlacementState.ALLOCATED
        assert (await led.node_gpus("gpu-1"))[0].used.memory_mib == 2000
        await until(lambda: any(e.type is EventType.ALLOC_RELEASED for e in events))
    released = [e for e in events if e.type is EventType.ALLOC_RELEASED]
    assert len(released) == 1
    payload = released[0].payload()
    assert isinstance(payload, AllocationEvent)
    assert payload.pod is not None
    assert payload.pod.uid == "stuck"
    assert payload.reason == "expired"


async def test_bound_vendor_pods_do_not_expire_their_plugin_allocates_them(
    nats_server: NatsServer, redis_url: str, prefix: str, bus: Bus
) -> None:
    config = settings_for(nats_server, redis_url, prefix, reservation_ttl=0.4)
    async with running(config, bus, serve_http=False) as state:
        led = state.ledger
        await announce(bus, make_inventory("gpu-1", gpus=1))
        await until(lambda: state.work.registrations == 1)
        await led.register_node(dcus("gpu-1", count=1))

        def on_dcu(uid: str) -> Placement:
            grant = DeviceGrant(uuid="DCU-gpu-1-0", memory_mib=1000, cores=10)
            main = ContainerAssignment(name="main", devices=(grant,), vendor="hygon")
            return Placement(pod=PodRef(uid=uid), node="gpu-1", containers=(main,))

        await led.reserve(on_dcu("dcu-bound"))
        await led.mark_bound("dcu-bound")
        await led.reserve(on_dcu("dcu-stuck"))  # never bound: expires as any other
        await led.reserve(placement("cuda-bound", "gpu-1", [[(0, 1000, 10)]]))
        await led.mark_bound("cuda-bound")  # bound, never allocated: expires
        for _ in range(10):
            await announce(bus, make_inventory("gpu-1", gpus=1))
            await asyncio.sleep(0.1)
        await until(lambda: state.upkeep.stats.released["expired"] == 2, timeout=3)
        states = {uid: await led.placement(uid) for uid in ("dcu-bound", "dcu-stuck", "cuda-bound")}
        assert {uid: p.state for uid, p in states.items() if p is not None} == {
            "dcu-bound": PlacementState.BOUND,
            "dcu-stuck": PlacementState.RELEASED,
            "cuda-bound": PlacementState.RELEASED,
        }
        [dcu] = await led.node_gpus("gpu-1", vendor="hygon")
        assert dcu.used.memory_mib == 1000


async def test_two_replicas_share_the_work_and_release_once(
    nats_server: NatsServer, redis_url: str, prefix: str, bus: Bus, events: list[CloudEvent]
) -> None:
    states: list[Running] = []
    async with AsyncExitStack() as stack:
        for name in ("a", "b"):
            config = settings_for(nats_server, redis_url, prefix, reservation_ttl=0.3)
            states.append(
                await stack.enter_async_context(running(config, bus, serve_http=False, name=name))
            )
        for round_ in range(20):
            for node in ("gpu-1", "gpu-2"):
                await announce(bus, make_inventory(node, gpus=1))
            if round_ == 0:
                await until(lambda: sum(s.work.registrations for s in states) == 2)
                for i in range(6):
                    node = f"gpu-{i % 2 + 1}"
                    await states[0].ledger.reserve(placement(f"p{i}", node, [[(0, 100, 1)]]))
            await asyncio.sleep(0.05)
        await until(lambda: sum(s.upkeep.stats.released["expired"] for s in states) == 6)
        leaders = [s for s in states if s.lease.held]
        assert len(leaders) == 1
        # only the leader exports the cluster's gauges: scraped together, no GPU counts twice
        for s in states:
            await s.cluster.refresh()
            exposed = generate_latest(s.registry).decode()
            assert ("gpuslice_gpu_memory_capacity_mib{" in exposed) is s.lease.held
        # each inventory handled by one replica only (a NATS queue group)
        assert sum(s.work.registrations for s in states) == 40
        assert all(s.work.registrations > 0 for s in states)
        await until(lambda: sum(e.type is EventType.ALLOC_RELEASED for e in events) == 6)
        await asyncio.sleep(0.3)
    released = [e.payload() for e in events if e.type is EventType.ALLOC_RELEASED]
    uids = sorted(p.pod.uid for p in released if isinstance(p, AllocationEvent) and p.pod)
    assert uids == [f"p{i}" for i in range(6)]  # once each


# ---------------------------------------------------------------- the lease


async def test_lease_is_held_by_one_and_passes_on_when_it_lapses(redis_url: str) -> None:
    led = Ledger.from_url(redis_url, "lease-test")
    try:
        first = Lease(led.redis, "lease-test:lease", 1000, holder="a")
        second = Lease(led.redis, "lease-test:lease", 1000, holder="b")
        assert await first.acquire()
        assert not await second.acquire()
        await asyncio.sleep(0.5)
        assert await first.acquire()  # renewed before it lapsed
        await asyncio.sleep(0.5)
        assert first.held
        assert not await second.acquire()
        # first stops renewing: it stops believing it holds the lease before
        # Redis lets it lapse, and only then can another take it
        await asyncio.sleep(0.35)
        assert not first.held
        assert not await second.acquire()
        await asyncio.sleep(0.4)
        assert await second.acquire()
        assert not await first.acquire()
        await second.release()
        assert await first.acquire()  # no need to wait for the lapse
    finally:
        await led.close()


# ---------------------------------------------------------------- HTTP


async def test_metrics_and_readiness_over_http(
    nats_server: NatsServer, redis_url: str, prefix: str, bus: Bus
) -> None:
    # one announcement: the node must stay live however slowly the test runs
    config = settings_for(nats_server, redis_url, prefix, heartbeat_interval=3600)
    async with running(config, bus) as state:
        await announce(bus, make_inventory("gpu-1", gpus=2, memory_mib=40960))
        await until(lambda: state.work.registrations == 1)
        await state.ledger.reserve(placement("p1", "gpu-1", [[(1, 3000, 25)]]))
        base = f"http://127.0.0.1:{config.listen_port}"
        async with httpx.AsyncClient(base_url=base, timeout=5) as client:
            ready = await client.get("/readyz")
            assert ready.status_code == 200
            assert ready.json()["status"] == "ready"
            # anyone in the cluster network may call it in a loop: Redis is
            # pinged at most once a second for all of them
            pings = 0
            ping = state.ledger.ping

            async def counted() -> bool:
                nonlocal pings
                pings += 1
                return await ping()

            state.ledger.ping = counted  # type: ignore[method-assign]
            answers = await asyncio.gather(*(client.get("/readyz") for _ in range(30)))
            assert {a.status_code for a in answers} == {200}
            assert pings <= 1
            state.ledger.ping = ping  # type: ignore[method-assign]
            assert (await client.get("/healthz")).status_code == 200
            # no request has a body: one over 64 KiB is refused unread, serving goes on
            for chunked in (False, True):
                status, _, _ = await asyncio.to_thread(
                    post_huge, config.listen_port, "/readyz", 64 * 1024 * 1024, chunked=chunked
                )
                assert status == 413
            assert (await client.get("/healthz")).status_code == 200

            async def allocated_shows() -> bool:
                text = (await client.get("/metrics")).text
                return 'node="gpu-1",uuid="GPU-gpu-1-1"' in text and "3000.0" in text

            await until(allocated_shows)
            text = (await client.get("/metrics")).text
            metrics_task = next(t for t in state.tasks if t.get_name() == "metrics")
            metrics_task.cancel()  # a background task that stopped fails the liveness probe
            await asyncio.wait([metrics_task])
            dead = await client.get("/healthz")
            assert dead.status_code == 503
            assert dead.json() == {"status": "failed", "stopped": ["metrics"]}
    labels = (
        'index="1",model="NVIDIA A100-SXM4-80GB",node="gpu-1",uuid="GPU-gpu-1-1",vendor="nvidia"'
    )
    assert f"gpuslice_gpu_memory_allocated_mib{{{labels}}} 3000.0" in text
    assert f"gpuslice_gpu_cores_allocated_percent{{{labels}}} 25.0" in text
    assert f"gpuslice_gpu_memory_capacity_mib{{{labels}}} 40960.0" in text
    assert 'gpuslice_node_available{node="gpu-1"} 1.0' in text
    assert 'gpuslice_pods{state="reserved"} 1.0' in text
    assert "gpuslice_inventory_registrations_total 1.0" in text


async def test_the_metrics_job_skips_an_unreadable_node_and_counts_it(
    nats_server: NatsServer,
    redis_url: str,
    prefix: str,
    bus: Bus,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A node record no gpuslice writes (an older version's, or one set by hand)
    leaves that node out of the metrics; the others are exported as before."""
    config = settings_for(nats_server, redis_url, prefix)
    led = Ledger.from_url(redis_url, prefix)
    try:
        for node in ("gpu-1", "gpu-2", "gpu-3"):
            await led.register_node(make_inventory(node, gpus=1))
        await led.redis.hset(led.node_keys("gpu-2").gpus, "GPU-gpu-2-0|cap_mem", "1e+17")
        await led.redis.hset(led.node_keys("gpu-3").pods, "pod-x", "{not a record")
    finally:
        await led.close()
    caplog.set_level(logging.INFO)
    async with running(config, bus, serve_http=False) as state:
        await until(lambda: state.lease.held)

        def exported() -> str:
            return generate_latest(state.registry).decode()

        await until(lambda: 'node="gpu-1",uuid="GPU-gpu-1-0"' in exported())
        text = exported()
        assert state.cluster.skipped.keys() == {"gpu-2", "gpu-3"}
    assert "gpuslice_ledger_unreadable_nodes 2.0" in text
    assert 'node="gpu-2"' not in text
    assert 'node="gpu-3"' not in text
    assert "'1e+17', not a whole number" in state.cluster.skipped["gpu-2"]
    assert "pod 'pod-x'" in state.cluster.skipped["gpu-3"]
    assert "metrics failed" not in caplog.text
    assert "Traceback" not in caplog.text
    assert not any(r.exc_info for r in caplog.records)


async def test_each_card_s_series_carry_its_vendor(
    nats_server: NatsServer, redis_url: str, prefix: str, bus: Bus
) -> None:
    """NVIDIA's cards and another vendor's on one node, in the real ledger: every
    per-card series names the card's vendor, with the cores the card has in its
    vendor's units (Moore Threads: 16); HAMi's per-card names stay NVIDIA's."""
    config = settings_for(nats_server, redis_url, prefix)
    async with running(config, bus, serve_http=False) as state:
        await announce(bus, make_inventory("gpu-1", gpus=1, memory_mib=40960))
        await until(lambda: state.work.registrations == 1)
        vendor = make_vendor_inventory("gpu-1", "mthreads", "MTT S4000", cards=1, cores=16)
        await state.ledger.register_node(vendor)
        grant = DeviceGrant(uuid="MTHREADS-gpu-1-0", memory_mib=8192, cores=4)
        mt = Placement(
            pod=PodRef(uid="mt-1", namespace="ns", name="mt-pod"),
            node="gpu-1",
            containers=(ContainerAssignment(name="c0", vendor="mthreads", devices=(grant,)),),
        )
        await state.ledger.reserve(mt)
        await until(lambda: state.lease.held)
        await state.cluster.refresh()
        families = {
            f.name: f
            for f in text_string_to_metric_families(generate_latest(state.registry).decode())
        }
        hami_registry = state.hami_registry
        assert hami_registry is not None
        hami = generate_latest(hami_registry).decode()

    def series(name: str) -> dict[tuple[str, str, str, str], float]:
        """(vendor, index, model, uuid) -> value, for the node's cards."""
        return {
            (s.labels["vendor"], s.labels["index"], s.labels["model"], s.labels["uuid"]): s.value
            for s in families[name].samples
            if s.labels["node"] == "gpu-1"
        }

    nvidia = ("nvidia", "0", "NVIDIA A100-SXM4-80GB", "GPU-gpu-1-0")
    mthreads = ("mthreads", "0", "MTT S4000", "MTHREADS-gpu-1-0")
    assert series("gpuslice_gpu_cores_capacity_percent") == {nvidia: 100, mthreads: 16}
    assert series("gpuslice_gpu_cores_allocated_percent") == {nvidia: 0, mthreads: 4}
    assert series("gpuslice_gpu_memory_capacity_mib") == {nvidia: 40960, mthreads: 49152}
    assert series("gpuslice_gpu_memory_allocated_mib") == {nvidia: 0, mthreads: 8192}
    assert series("gpuslice_gpu_slots_used") == {nvidia: 0, mthreads: 1}
    assert series("gpuslice_gpu_healthy") == {nvidia: 1, mthreads: 1}
    # every per-card series has the one label set
    for family in families.values():
        if family.name.startswith("gpuslice_gpu_"):
            assert {frozenset(s.labels) for s in family.samples} == {
                frozenset({"node", "uuid", "index", "model", "vendor"})
            }, family.name
    cards = {
        f.name: {s.labels["deviceuuid"] for s in f.samples}
        for f in text_string_to_metric_families(hami)
        if f.name.startswith(("GPUDevice", "nodeGPU"))
    }
    assert cards
    assert all(uuids == {"GPU-gpu-1-0"} for uuids in cards.values()), cards


# ---------------------------------------------------------------- reconciliation


async def test_the_leader_reconciles_at_start_and_after_redis_loses_its_data(
    nats_server: NatsServer, redis_url: str, prefix: str, bus: Bus
) -> None:
    kube = LocalKubeApi()
    record = placement("p1", "gpu-1", [[(0, 5000, 50)]])
    pod = {
        "metadata": {
            "name": "p1",
            "namespace": "ns",
            "uid": "p1",
            "annotations": {PLACEMENT_ANNOTATION: record.to_annotation()},
        },
        "spec": {"nodeName": "gpu-1", "containers": [{"name": "c0"}]},
        "status": {"phase": "Running"},
    }
    kube.add_pod(pod)
    config = settings_for(nats_server, redis_url, prefix, reconcile_interval=0.3)
    async with running(config, bus, kube=kube, serve_http=False) as state:
        led = state.ledger

        async def restored() -> bool:
            await announce(bus, make_inventory("gpu-1", gpus=1))  # heartbeats go on
            found = await led.placement("p1")
            return found is not None and found.state is PlacementState.ALLOCATED

        await until(restored)
        client: Redis = Redis.from_url(redis_url)
        await client.flushall()
        await client.aclose()
        await until(restored)  # within one reconcile period
        assert (await led.node_gpus("gpu-1"))[0].used.memory_mib == 5000
        pod["status"]["phase"] = "Succeeded"
        kube.add_pod(pod)

        async def released() -> bool:
            found = await led.placement("p1")
            return found is not None and found.state is PlacementState.RELEASED

        await until(released)
        assert state.upkeep.stats.released["pod succeeded"] == 1


@pytest.mark.parametrize("hami", [True, False])
async def test_hami_s_names_are_served_on_metrics_hami_while_the_setting_is_on(
    nats_server: NatsServer, redis_url: str, prefix: str, bus: Bus, hami: bool
) -> None:
    config = settings_for(nats_server, redis_url, prefix, hami_metrics=hami)
    async with running(config, bus) as state:
        await announce(bus, make_inventory("gpu-1", gpus=1, memory_mib=40960))
        await until(lambda: state.work.registrations == 1)
        await until(lambda: state.lease.held)
        await state.cluster.refresh()
        base = f"http://127.0.0.1:{config.listen_port}"
        async with httpx.AsyncClient(base_url=base, timeout=5) as client:
            answer = await client.get("/metrics/hami")
            plain = (await client.get("/metrics")).text
    assert "GPUDeviceMemoryLimit" not in plain
    assert 'gpuslice_gpu_memory_capacity_mib{index="0"' in plain
    if hami:
        assert answer.status_code == 200
        assert answer.headers["content-type"].startswith("text/plain; version=0.0.4")
        assert 'GPUDeviceMemoryLimit{deviceidx="0",deviceuuid="GPU-gpu-1-0"' in answer.text
    else:
        assert answer.status_code == 404
        assert "GPUSLICE_HAMI_METRICS is false" in answer.json()["error"]


@pytest.mark.parametrize("hami", [True, False])
async def test_hami_s_scheduler_names_follow_the_setting(
    nats_server: NatsServer, redis_url: str, prefix: str, bus: Bus, hami: bool
) -> None:
    """With GPUSLICE_HAMI_METRICS on, HAMi's names carry the ledger's figures in
    HAMi's units (bytes, percent, a 0-1 ratio); off, only gpuslice's names."""
    config = settings_for(nats_server, redis_url, prefix, hami_metrics=hami)
    async with running(config, bus, serve_http=False) as state:
        await announce(bus, make_inventory("gpu-1", gpus=2, memory_mib=40960))
        await until(lambda: state.work.registrations == 1)
        await state.ledger.reserve(placement("p1", "gpu-1", [[(1, 3000, 25)], [(1, 1000, 5)]]))
        await until(lambda: state.lease.held)
        await state.cluster.refresh()
        plain = {
            f.name: f
            for f in text_string_to_metric_families(generate_latest(state.registry).decode())
        }
        hami_registry = state.hami_registry
        assert (hami_registry is not None) is hami
        if hami_registry is None:
            families = plain
        else:
            families = {
                f.name: f
                for f in text_string_to_metric_families(generate_latest(hami_registry).decode())
            }
            # camelCase: apart from gpuslice's names, for /metrics to pass promtool
            assert not [name for name in families if name.startswith("gpuslice_")]
            state.cluster.active = lambda: False  # another replica holds the lease
            assert generate_latest(hami_registry) == b""

    def value(name: str, **labels: str) -> float:
        found = [
            s.value
            for s in (families.get(name) or plain[name]).samples
            if labels.items() <= s.labels.items()
        ]
        assert len(found) == 1, (name, labels, found)
        return found[0]

    card = {"nodeid": "gpu-1", "deviceuuid": "GPU-gpu-1-1", "deviceidx": "1", "zone": "vGPU"}
    assert value("gpuslice_gpu_memory_allocated_mib", uuid="GPU-gpu-1-1") == 4000
    assert not [name for name in plain if not name.startswith("gpuslice_")]
    if not hami:
        return
    assert value("GPUDeviceMemoryAllocated", **card) == 4000 * 2**20
    assert value("GPUDeviceMemoryLimit", **card) == 40960 * 2**20
    assert value("GPUDeviceCoreAllocated", **card) == 30
    assert value("GPUDeviceCoreLimit", **card) == 100
    assert value("GPUDeviceSharedNum", **card) == 2
    assert value("nodeGPUMemoryPercentage", **card) == pytest.approx(4000 / 40960)
    assert value("nodeGPUOverview", **card, devicememorylimit="40960") == 4000 * 2**20
    second = {"podnamespace": "ns", "podname": "p1", "nodename": "gpu-1", "containeridx": "1"}
    assert value("vGPUMemoryAllocated", **second) == 1000 * 2**20
    assert value("vGPUCoreAllocated", **second) == 5
    assert value("vGPUPodsDeviceAllocated", **second, deviceusedcore="5") == 1000 * 2**20
    assert value("GPUDeviceMemoryAllocated", deviceuuid="GPU-gpu-1-0") == 0
