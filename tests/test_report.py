"""The scheduler's report (gpuslice_common.reports, gpuslice_scheduler.report) against a
real Redis: its numbers for small clusters worked out by hand, the model's bounds,
the reader's refusal of values that do not parse, and the periodic writer."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from typing import Any

import numpy as np
import orjson
import pytest
from pydantic import ValidationError
from redis.asyncio import Redis

from gpuslice_common.kube import LocalKubeApi
from gpuslice_common.ledger import Ledger
from gpuslice_common.models import DeviceSelector, GpuPolicy
from gpuslice_common.reports import (
    MAX_LABEL,
    Fragmentation,
    ReportKind,
    SchedulerReport,
    read_report,
    report_key,
    write_report,
)
from gpuslice_common.servers import RedisServer
from gpuslice_scheduler.cluster import Cluster, Row
from gpuslice_scheduler.fit import CardDemand
from gpuslice_scheduler.fragmentation import WorkloadClass, WorkloadMix, default_mix
from gpuslice_scheduler.report import (
    Measures,
    ReportPublisher,
    build_report,
    card_fits,
    kind_fits,
    label,
)
from gpuslice_scheduler.service import running
from gpuslice_scheduler.view import ClusterView
from tests.conftest import make_inventory
from tests.test_extender import local_settings
from tests.test_ledger import placement

PREFIX = "gpuslice"


def share(percent: int, frequency: float = 1.0) -> WorkloadClass:
    """A pod of one card asking ``percent`` of its memory and cores."""
    return WorkloadClass(frequency, CardDemand(1, -1, percent, percent, False))


def whole(count: int, frequency: float = 1.0) -> WorkloadClass:
    return WorkloadClass(frequency, CardDemand(count, -1, 100, 100, True))


def kind_named(report: SchedulerReport, text: str) -> ReportKind:
    found = [k for k in report.kinds if k.label == text]
    assert len(found) == 1, [k.label for k in report.kinds]
    return found[0]


async def view_of(ledger: Ledger) -> ClusterView:
    view = ClusterView(ledger)
    await view.sync()
    return view


async def reserve(ledger: Ledger, uid: str, node: str, grants: list[tuple[int, int, int]]) -> None:
    made = await ledger.reserve_new(placement(uid, node, [grants]))
    assert made.created


# ---------------------------------------------------------------- numbers


async def test_a_half_used_card_by_hand(ledger: Ledger) -> None:
    await ledger.register_node(make_inventory("node-a", gpus=1, memory_mib=16384), rebuilt=True)
    await reserve(ledger, "p1", "node-a", [(0, 8192, 50)])
    view = await view_of(ledger)
    mix = WorkloadMix.of([share(25), share(75)])
    report = build_report(view.cluster, mix, GpuPolicy.FRAGMENTATION)

    # half the card's cores are free: 500 milli-GPU
    node = report.nodes["node-a"]
    assert node.free_share == 500.0
    # the 25 % pods can use the card, the 75 % pods cannot: the card's free share is a
    # fragment for them alone, weighed by frequency x sqrt(share): sqrt(750) against sqrt(250)
    expected = math.sqrt(3) / (1 + math.sqrt(3))
    assert node.fragmentation == pytest.approx(expected, abs=1e-6)
    assert report.cluster == node
    assert report.policy is GpuPolicy.FRAGMENTATION

    quarter = kind_named(report, "1 card, 25% of cores, 25% of memory")
    # 8192 MiB left / 4096 MiB (25 % of 16384) = 2; 50 cores left / 25 = 2; 9 slots left
    assert quarter.fits == 2
    assert (quarter.count, quarter.cores, quarter.memory_percent, quarter.memory_mib) == (
        1,
        25,
        25,
        None,
    )
    assert quarter.weight == 0.5
    assert not quarter.exclusive
    assert kind_named(report, "1 card, 75% of cores, 75% of memory").fits == 0
    # each kind at most once, the most common first
    assert [k.label for k in report.kinds] == sorted(k.label for k in report.kinds)


async def test_an_idle_node_is_no_fragment_and_a_full_one_has_no_free_share(
    ledger: Ledger,
) -> None:
    await ledger.register_node(make_inventory("idle", gpus=2, memory_mib=16384), rebuilt=True)
    await ledger.register_node(make_inventory("full", gpus=1, memory_mib=16384), rebuilt=True)
    await reserve(ledger, "p1", "full", [(0, 16384, 100)])
    view = await view_of(ledger)
    report = build_report(view.cluster, WorkloadMix.of([share(50)]), GpuPolicy.BINPACK)
    assert report.nodes["idle"] == Fragmentation(fragmentation=0.0, free_share=2000.0)
    assert report.nodes["full"] == Fragmentation(fragmentation=None, free_share=0.0)
    assert report.cluster == Fragmentation(fragmentation=0.0, free_share=2000.0)
    assert kind_named(report, "1 card, 50% of cores, 50% of memory").fits == 4


async def test_multi_card_kinds_need_distinct_cards(ledger: Ledger) -> None:
    await ledger.register_node(make_inventory("two", gpus=2, memory_mib=16384), rebuilt=True)
    await ledger.register_node(make_inventory("four", gpus=4, memory_mib=16384), rebuilt=True)
    await reserve(ledger, "p1", "two", [(0, 14745, 90)])
    view = await view_of(ledger)
    tenth = WorkloadClass(1.0, CardDemand(2, -1, 10, 10, False))
    mix = WorkloadMix.of([tenth, whole(1), whole(2)])
    report = build_report(view.cluster, mix, GpuPolicy.FRAGMENTATION)

    # node "two": card 0 takes one more 10 % container (1639 MiB left, 1638 needed;
    # 10 cores left), card 1 ten; a pod's two containers need two cards, so one pod,
    # not (1 + 10) // 2. Node "four": four cards of ten: 20 pods.
    assert kind_named(report, "2 cards, 10% of cores, 10% of memory").fits == 1 + 20
    # whole cards: card 1 of "two", and the four of "four"
    assert kind_named(report, "1 whole card").fits == 1 + 4
    assert kind_named(report, "2 whole cards").fits == 0 + 2


async def test_exclusive_kinds_want_an_idle_card(ledger: Ledger) -> None:
    await ledger.register_node(make_inventory("node-a", gpus=1, memory_mib=16384), rebuilt=True)
    await reserve(ledger, "p1", "node-a", [(0, 1000, 10)])
    view = await view_of(ledger)
    alone = WorkloadClass(1.0, CardDemand(1, 1000, -1, 10, True))
    shared = WorkloadClass(1.0, CardDemand(1, 1000, -1, 10, False))
    report = build_report(view.cluster, WorkloadMix.of([alone, shared]), GpuPolicy.FRAGMENTATION)
    assert kind_named(report, "1 card, 10% of cores, 1000 MiB, alone on its cards").fits == 0
    # 9 slots, 90 cores / 10, 15384 MiB / 1000: 9
    shared_kind = kind_named(report, "1 card, 10% of cores, 1000 MiB")
    assert (shared_kind.fits, shared_kind.memory_mib, shared_kind.memory_percent) == (9, 1000, None)
    # once released, the card is idle: one exclusive pod fits
    await ledger.release("p1", "done")
    await view.sync()
    report = build_report(view.cluster, WorkloadMix.of([alone, shared]), GpuPolicy.FRAGMENTATION)
    assert kind_named(report, "1 card, 10% of cores, 1000 MiB, alone on its cards").fits == 1
    assert kind_named(report, "1 card, 10% of cores, 1000 MiB").fits == 10


def card(uuid: str, *, used_cores: int = 0, cordoned: bool = False, model: str = "A100") -> Row:
    used_mem = used_cores * 160
    return (uuid, model, 0, 16000, 100, 10, used_mem, used_cores, used_cores // 10, False,
            True, True, cordoned)  # fmt: skip


def test_free_cpu_and_memory_cordons_types_and_closed_nodes_bound_the_fits() -> None:
    cluster = Cluster.from_rows(
        [
            ("cpu-short", [card("a0"), card("a1")]),
            ("cordoned", [card("b0", cordoned=True), card("b1", model="T4")]),
            ("open", [card("c0", used_cores=60)]),
        ],
        node_cpu=[3000.0, math.inf, math.inf],
        node_mem=[math.inf, 500.0, math.inf],
    )
    demand = CardDemand(1, -1, 25, 25, False)
    quarter = WorkloadClass(1.0, demand, cpu=1500.0, memory=100.0)
    # cpu-short: 8 by its cards, 3000 / 1500 = 2 by CPU; cordoned: b0 takes none,
    # b1 four, memory for 5; open: 40 cores left, one
    assert card_fits(cluster, demand).tolist() == [4, 4, 0, 4, 1]
    assert kind_fits(cluster, quarter) == 2 + 4 + 1
    assert kind_fits(cluster, quarter, closed={"cordoned", "ghost"}) == 2 + 1
    a100 = WorkloadClass(
        1.0, CardDemand(1, -1, 25, 25, False), DeviceSelector(include_types=("a100",))
    )
    assert kind_fits(cluster, a100) == 8 + 0 + 1
    assert label(a100) == "1 card, 25% of cores, 25% of memory, only a100"


def test_labels_are_plain_and_bounded() -> None:
    assert label(whole(1)) == "1 whole card"
    assert label(whole(8)) == "8 whole cards"
    assert label(WorkloadClass(1.0, CardDemand(1, 8192, -1, 50, False))) == (
        "1 card, 50% of cores, 8192 MiB"
    )
    assert label(WorkloadClass(1.0, CardDemand(2, -1, -1, 0, False), cpu=2500.0)) == (
        "2 cards, shared cores, any memory, 2.5 CPU"
    )
    demand = CardDemand(1, -1, 100, 100, True)
    hostile = WorkloadClass(1.0, demand, DeviceSelector(include_types=("x" * 5000,)))
    assert len(label(hostile)) == MAX_LABEL
    planted = WorkloadClass(1.0, demand, DeviceSelector(include_types=("a100\n\x1b[2J",)))
    assert label(planted) == "1 whole card, only a100??[2J"


def test_only_the_five_most_common_gpu_kinds_are_listed() -> None:
    classes = [share(p, frequency=p) for p in (10, 20, 30, 40, 50, 60)]
    classes.append(WorkloadClass(1000.0, None, cpu=500.0))  # no GPU: strands no card
    classes.append(share(60, frequency=60))  # the same kind again: weights add up
    cluster = Cluster.from_rows([("n", [card("a0")])])
    report = build_report(cluster, WorkloadMix.of(classes), GpuPolicy.SPREAD)
    assert [k.cores for k in report.kinds] == [60, 50, 40, 30, 20]
    assert report.kinds[0].weight == pytest.approx(120 / (210 + 1000 + 60), abs=1e-6)


def test_kept_measures_agree_with_measuring_afresh() -> None:
    cluster = Cluster.from_rows(
        [(f"n{i}", [card(f"g{i}-{k}") for k in range(2)]) for i in range(4)]
    )
    mix = WorkloadMix.of([share(25), share(75), whole(2)])
    measures = Measures()
    first = build_report(cluster, mix, GpuPolicy.FRAGMENTATION, measures=measures)
    entry = first.nodes["n0"]
    # one node's first card takes 60 % of its cores: only that node is measured again
    one = np.asarray([0], dtype=np.int64)
    cluster.take(one, one + 9600, one + 60, one + 1, np.zeros(1, np.bool_), 0)
    kept = build_report(cluster, mix, GpuPolicy.FRAGMENTATION, measures=measures)
    fresh = build_report(cluster, mix, GpuPolicy.FRAGMENTATION)
    assert kept.same_content(fresh)
    assert kept.nodes["n0"] != entry
    assert kept.nodes["n1"] is first.nodes["n1"]  # not measured again
    assert kind_named(kept, "2 whole cards").fits == 3
    # another copy of the cluster (a node more) is measured whole
    bigger = Cluster.from_rows(
        [("m", [card("x")]), *[(f"n{i}", [card(f"g{i}")]) for i in range(4)]]
    )
    again = build_report(bigger, mix, GpuPolicy.FRAGMENTATION, measures=measures)
    assert again.same_content(build_report(bigger, mix, GpuPolicy.FRAGMENTATION))
    assert sorted(again.nodes) == ["m", "n0", "n1", "n2", "n3"]


def test_an_empty_cluster_reports_no_fragmentation() -> None:
    report = build_report(Cluster.from_rows([]), WorkloadMix.of([share(50)]), GpuPolicy.BINPACK)
    assert report.cluster == Fragmentation(fragmentation=None, free_share=0.0)
    assert report.nodes == {}
    assert [k.fits for k in report.kinds] == [0]


# ---------------------------------------------------------------- the model and Redis


def sample() -> SchedulerReport:
    return SchedulerReport(
        at=datetime(2026, 11, 25, 1, 0, tzinfo=UTC),
        policy=GpuPolicy.FRAGMENTATION,
        cluster=Fragmentation(fragmentation=0.12, free_share=5300.0),
        nodes={"gpu-1": Fragmentation(fragmentation=0.05, free_share=1250.0)},
        kinds=(
            ReportKind(
                label="1 card, 25% of cores, any memory",
                weight=0.18,
                count=1,
                memory_mib=None,
                memory_percent=None,
                cores=25,
                exclusive=False,
                fits=37,
            ),
        ),
    )


async def test_a_report_round_trips_and_expires(redis_url: str) -> None:
    redis: Redis = Redis.from_url(redis_url, decode_responses=True)
    try:
        assert await read_report(redis, PREFIX) is None  # none written
        await write_report(redis, PREFIX, sample(), ttl_s=60)
        assert report_key(PREFIX) == "gpuslice:report:scheduler"
        assert 0 < await redis.pttl(report_key(PREFIX)) <= 60_000
        assert await read_report(redis, PREFIX) == sample()
        assert await read_report(redis, "other") is None
    finally:
        await redis.aclose()


def mutate(change: Callable[[dict[str, Any]], None]) -> bytes:
    doc = orjson.loads(sample().model_dump_json())
    change(doc)
    return orjson.dumps(doc)


ABSURD: dict[str, bytes] = {
    "not json": b"not json",
    "not an object": b"[1, 2]",
    "NaN share": sample()
    .model_dump_json()
    .replace('"free_share":5300.0', '"free_share":NaN')
    .encode(),
    "infinite share": sample().model_dump_json().replace("5300.0", "1e999").encode(),
    "negative share": mutate(lambda d: d["cluster"].update(free_share=-1.0)),
    "fraction above 1": mutate(lambda d: d["nodes"]["gpu-1"].update(fragmentation=1.5)),
    "negative fits": mutate(lambda d: d["kinds"][0].update(fits=-1)),
    "too many kinds": mutate(lambda d: d["kinds"].extend(d["kinds"] * 5)),
    "a long label": mutate(lambda d: d["kinds"][0].update(label="x" * (MAX_LABEL + 1))),
    "a long node name": mutate(lambda d: d["nodes"].update({"n" * 254: d["cluster"]})),
    "an unknown field": mutate(lambda d: d.update(extra=1)),
    "another version": mutate(lambda d: d.update(version=2)),
    "an unknown policy": mutate(lambda d: d.update(policy="random")),
    "a time without zone": mutate(lambda d: d.update(at="2026-11-25T01:00:00")),
    "a string for a number": mutate(lambda d: d["cluster"].update(free_share="5300")),
    "not UTF-8": b'{"version": 1, "at": "\xff\xfe"}',
}


@pytest.mark.parametrize("raw", ABSURD.values(), ids=ABSURD.keys())
async def test_a_value_that_does_not_parse_reads_as_none_and_warns_once(
    redis_url: str, raw: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    redis: Redis = Redis.from_url(redis_url, decode_responses=True)  # as the ledger's
    prefix = f"p{abs(hash(raw))}"  # its own key: the warning is once a minute per key
    try:
        await redis.set(report_key(prefix), raw)
        assert await redis.exists(report_key(prefix)) == 1
        with caplog.at_level(logging.WARNING, logger="gpuslice_common.reports"):
            assert await read_report(redis, prefix) is None
            assert await read_report(redis, prefix) is None
    finally:
        await redis.aclose()
    assert_warned_once(caplog, prefix)


def assert_warned_once(caplog: pytest.LogCaptureFixture, prefix: str) -> None:
    warnings = [r for r in caplog.records if r.name == "gpuslice_common.reports"]
    assert len(warnings) == 1
    assert report_key(prefix) in warnings[0].getMessage()
    assert warnings[0].exc_info is None


async def test_a_hash_planted_under_the_key_reads_as_none(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    redis: Redis = Redis.from_url(redis_url, decode_responses=True)
    try:
        await redis.hset(report_key("planted"), "version", "1")
        with caplog.at_level(logging.WARNING, logger="gpuslice_common.reports"):
            assert await read_report(redis, "planted") is None
            assert await read_report(redis, "planted") is None
    finally:
        await redis.aclose()
    assert_warned_once(caplog, "planted")


def test_the_model_refuses_absurd_values() -> None:
    good = sample()
    for bad in (
        {"fragmentation": math.nan, "free_share": 1.0},
        {"fragmentation": 0.5, "free_share": math.inf},
        {"fragmentation": 0.5, "free_share": -0.5},
        {"fragmentation": 1.01, "free_share": 1.0},
        {"fragmentation": -0.01, "free_share": 1.0},
    ):
        with pytest.raises(ValidationError):
            Fragmentation(**bad)
    with pytest.raises(ValidationError):
        SchedulerReport(
            at=good.at, policy=good.policy, cluster=good.cluster, nodes={}, kinds=good.kinds * 6
        )
    with pytest.raises(ValidationError):
        SchedulerReport(
            at=datetime(2026, 1, 1), policy=good.policy, cluster=good.cluster, nodes={}, kinds=()
        )
    with pytest.raises(ValidationError):
        ReportKind(**{**good.kinds[0].model_dump(), "cores": 101})
    with pytest.raises(ValidationError):
        ReportKind(**{**good.kinds[0].model_dump(), "fits": -1})
    with pytest.raises(ValidationError):  # frozen
        good.cluster.free_share = 1.0  # type: ignore[misc]


# ---------------------------------------------------------------- the writer


async def test_the_writer_writes_on_change_and_refreshes_only_when_due(ledger: Ledger) -> None:
    await ledger.register_node(make_inventory("node-a", gpus=1, memory_mib=16384), rebuilt=True)
    view = await view_of(ledger)
    mix = WorkloadMix.of([share(25)])
    publisher = ReportPublisher(ledger, view, lambda: mix, GpuPolicy.FRAGMENTATION, refresh=3600)
    assert await publisher.publish()
    first = await read_report(ledger.redis, ledger.prefix)
    assert first is not None
    assert kind_named(first, "1 card, 25% of cores, 25% of memory").fits == 4
    assert not await publisher.publish()  # nothing changed, the write is not due
    await reserve(ledger, "p1", "node-a", [(0, 4096, 25)])
    await view.sync()
    assert await publisher.publish()
    second = await read_report(ledger.redis, ledger.prefix)
    assert second is not None
    assert kind_named(second, "1 card, 25% of cores, 25% of memory").fits == 3
    assert second.nodes["node-a"].free_share == 750.0
    # a node being rebuilt takes no pod
    await ledger.register_node(make_inventory("node-b", gpus=1, memory_mib=16384))
    await view.sync()
    assert "node-b" in view.rebuilding
    assert await publisher.publish()
    third = await read_report(ledger.redis, ledger.prefix)
    assert third is not None
    assert kind_named(third, "1 card, 25% of cores, 25% of memory").fits == 3
    # due again: the same content is written with a new time
    publisher.refresh = 0.0
    assert await publisher.publish()
    fourth = await read_report(ledger.redis, ledger.prefix)
    assert fourth is not None
    assert fourth.same_content(third)
    assert fourth.at > third.at


async def eventually(condition: Callable[[], Any], timeout: float = 30.0) -> None:
    """Wait until the async ``condition`` holds; fail after ``timeout`` seconds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not await condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def publishing(publisher: ReportPublisher) -> AsyncIterator[asyncio.Task[None]]:
    task = asyncio.create_task(publisher.run())
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_the_running_writer_follows_changes_and_keeps_the_key_alive(ledger: Ledger) -> None:
    await ledger.register_node(make_inventory("node-a", gpus=1, memory_mib=16384), rebuilt=True)
    view = ClusterView(ledger, interval=0.05)
    mix = WorkloadMix.of([share(25)])
    publisher = ReportPublisher(
        ledger, view, lambda: mix, GpuPolicy.FRAGMENTATION, interval=0.05, refresh=0.3, ttl=1.0
    )
    syncing = asyncio.create_task(view.run())
    try:
        async with publishing(publisher):

            async def fits(n: int) -> bool:
                report = await read_report(ledger.redis, ledger.prefix)
                return report is not None and report.kinds[0].fits == n

            await eventually(lambda: fits(4))
            await reserve(ledger, "p1", "node-a", [(0, 8192, 50)])
            await eventually(lambda: fits(2))
            # three expiries later the key is still there: refreshed before each lapsed
            await asyncio.sleep(3.0)
            assert await fits(2)
            assert 0 < await ledger.redis.pttl(report_key(ledger.prefix)) <= 1000
    finally:
        syncing.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await syncing
    # stopped: the report vanishes
    await eventually(lambda: _gone(ledger))


async def _gone(ledger: Ledger) -> bool:
    return await ledger.redis.exists(report_key(ledger.prefix)) == 0


async def test_a_redis_outage_is_logged_once_and_the_writer_carries_on(
    own_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    ledger = Ledger.from_url(own_redis.url, retries=0)
    await ledger.register_node(make_inventory("node-a", gpus=1, memory_mib=16384), rebuilt=True)
    view = await view_of(ledger)
    mix = WorkloadMix.of([share(25)])
    publisher = ReportPublisher(
        ledger, view, lambda: mix, GpuPolicy.FRAGMENTATION, interval=0.05, refresh=0.1
    )
    try:
        with caplog.at_level(logging.INFO, logger="gpuslice_scheduler.report"):
            async with publishing(publisher) as task:
                await eventually(lambda: _written(ledger))
                own_redis.stop()
                writes = publisher.writes
                await eventually(lambda: _logged(caplog, "cannot write the scheduler report"))
                own_redis.start()

                async def resumed() -> bool:
                    return publisher.writes > writes

                await eventually(resumed)
                assert await _written(ledger)
                assert not task.done()
        failures = [r for r in caplog.records if "cannot write" in r.getMessage()]
        assert len(failures) == 1  # not one per round
        assert failures[0].exc_info is None
        assert any("written again" in r.getMessage() for r in caplog.records)
    finally:
        await ledger.close()


async def _written(ledger: Ledger) -> bool:
    with contextlib.suppress(Exception):
        return await read_report(ledger.redis, ledger.prefix) is not None
    return False


async def _logged(caplog: pytest.LogCaptureFixture, text: str) -> bool:
    return any(text in r.getMessage() for r in caplog.records)


async def test_the_scheduler_service_publishes_its_report(redis_url: str) -> None:
    ledger = Ledger.from_url(redis_url)
    try:
        await ledger.register_node(make_inventory("node-a", gpus=2), rebuilt=True)
        async with running(local_settings(redis_url), LocalKubeApi()):

            async def published() -> bool:
                report = await read_report(ledger.redis, ledger.prefix)
                return report is not None and "node-a" in report.nodes

            await eventually(published)
        report = await read_report(ledger.redis, ledger.prefix)
        assert report is not None
        # before any pod was seen, the default mix: of its kinds, those of 4 and 8 whole
        # cards cannot go on two cards at all, so all free share is a fragment for them
        mix = default_mix()
        stranded = sum(
            w for c, w in zip(mix.classes, mix.weight, strict=True) if c.card and c.card.count > 2
        )
        node = report.nodes["node-a"]
        assert node.free_share == 2000.0
        assert node.fragmentation == pytest.approx(stranded, abs=1e-6)
        assert report.policy is GpuPolicy.FRAGMENTATION
        assert report.kinds  # the default mix's kinds, before any pod was seen
        assert report.kinds[0].label == "1 whole card"
        assert report.kinds[0].fits == 2
    finally:
        await ledger.close()
