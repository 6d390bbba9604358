"""The console's last hour (gpuslice_inventory.console.history): the bounded
store on its own, and ``/api/v1/history`` over real HTTP on a real inventory."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from typing import Any

import pytest

from gpuslice_common.bus import Bus
from gpuslice_common.events import EventType
from gpuslice_common.servers import NatsServer
from gpuslice_inventory.console.history import (
    CLUSTER_FIELDS,
    MAX_SERIES,
    POINTS,
    STEP_S,
    USAGE_FIELDS,
    HistoryStore,
    Series,
)
from tests.inventory.conftest import until
from tests.inventory.test_console import (
    MIB,
    OTHER,
    TRAIN,
    WAIT_S,
    Console,
    alloc_event,
    placed,
    register,
    reviewed_console,
    start_console,
    telemetry_sample,
)
from tests.kubeapi import FakeApiServer

T0 = 1_800_000_000.0  # a step boundary: 30 s divides it


class Clock:
    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def values(points: list[list[Any]], field: int = 1) -> list[Any]:
    return [p[field] for p in points]


# ---------------------------------------------------------------- the store


def test_samples_within_one_step_fold_into_one_point_the_last_winning() -> None:
    series = Series(2, step=30.0, points=4)
    series.record(T0, [1.0, 10.0])
    series.record(T0 + 29.9, [2.0, None])
    series.record(T0 + 30, [3.0, 30.0])
    assert series.read(T0 + 30) == [
        [T0 * 1000, 2.0, None],
        [(T0 + 30) * 1000, 3.0, 30.0],
    ]


def test_each_series_keeps_its_own_resolution_and_only_its_span() -> None:
    fine, coarse = Series(1, step=10.0, points=3), Series(1, step=60.0, points=3)
    for second in range(0, 300, 10):
        fine.record(T0 + second, [float(second)])
        coarse.record(T0 + second, [float(second)])
    now = T0 + 290
    # three points of 10 s, the newest last; three of 60 s, each the last sample in its minute
    assert values(fine.read(now)) == [270.0, 280.0, 290.0]
    assert values(coarse.read(now)) == [170.0, 230.0, 290.0]
    assert [p[0] for p in coarse.read(now)] == [(T0 + s) * 1000 for s in (120, 180, 240)]


def test_a_skipped_step_is_a_gap_and_an_hour_old_point_is_not_shown() -> None:
    series = Series(1, step=30.0, points=POINTS)
    series.record(T0, [1.0])
    series.record(T0 + 90, [4.0])  # two steps with no sample
    assert [p[0] for p in series.read(T0 + 90)] == [T0 * 1000, (T0 + 90) * 1000]
    # an hour later the first point is out of the span; nothing new came
    assert values(series.read(T0 + STEP_S * POINTS)) == [4.0]
    assert series.read(T0 + 90 + STEP_S * POINTS) == []


def test_a_sample_from_before_the_newest_point_is_dropped() -> None:
    series = Series(1, step=30.0, points=4)
    series.record(T0 + 60, [2.0])
    series.record(T0, [9.0])  # the clock went back
    assert values(series.read(T0 + 60)) == [2.0]


def test_the_number_of_series_is_bounded_evicting_the_least_recently_updated() -> None:
    clock = Clock()
    store = HistoryStore(max_series=3, clock=clock)
    for name in ("a", "b", "c"):
        store.record(("pod", "ns", name), [1.0] * len(USAGE_FIELDS))
    store.record(("pod", "ns", "a"), [2.0] * len(USAGE_FIELDS))  # a is fresh again
    store.record(("pod", "ns", "d"), [3.0] * len(USAGE_FIELDS))
    assert list(store.series) == [("pod", "ns", "c"), ("pod", "ns", "a"), ("pod", "ns", "d")]
    assert store.evicted == 1
    assert store.document(("pod", "ns", "b"))["points"] == []
    for i in range(100):
        store.record(("card", "node", f"GPU-{i}"), [None] * len(USAGE_FIELDS))
    assert len(store.series) == 3
    assert store.evicted == 101


def test_a_series_with_no_sample_for_an_hour_is_dropped() -> None:
    clock = Clock()
    store = HistoryStore(clock=clock)
    store.record(("pod", "ns", "gone"), [1.0] * len(USAGE_FIELDS))
    clock.now += STEP_S * POINTS + STEP_S
    store.record(("pod", "ns", "here"), [1.0] * len(USAGE_FIELDS))
    store.forget_old()
    assert list(store.series) == [("pod", "ns", "here")]


def test_the_default_bound_is_what_the_docstring_states() -> None:
    series = Series(len(USAGE_FIELDS))
    assert series.values.itemsize * len(series.values) == POINTS * len(USAGE_FIELDS) * 4
    assert (MAX_SERIES, POINTS, STEP_S) == (4096, 120, 30.0)
    assert MAX_SERIES * POINTS * len(USAGE_FIELDS) * 4 / MIB < 9.5


def test_a_snapshot_gives_cards_pods_and_the_cluster_their_points() -> None:
    clock = Clock()
    store = HistoryStore(clock=clock)
    grant = {"uid": "u1", "namespace": "team-a", "name": "train", "memory_mib": 4096, "cores": 25}
    card = {
        "uuid": "GPU-0",
        "memory_mib": 16384,
        "used": {"memory_mib": 4096, "cores": 25},
        "measured": {"memory_mib": 512.0, "sm_percent": 40.0},
        "pods": [grant],
    }
    document = {
        "cluster": {
            "memory_mib": 16384,
            "used_memory_mib": 4096,
            "cores": 100,
            "used_cores": 25,
            "fragmentation": math.nan,  # what no JSON holds is not kept
        },
        "nodes": [{"name": "gpu-1", "cards": [card]}],
    }
    store.record_snapshot(document, {})
    pod = store.document(("pod", "team-a", "train"))
    # no telemetry yet: nothing measured, and the limit is the grant
    assert pod["points"] == [[T0 * 1000, 4096.0, None, 4096.0, None, 25.0]]
    assert pod["fields"] == ["at_ms", *USAGE_FIELDS]
    cardpoints = store.document(("card", "gpu-1", "GPU-0"))
    assert cardpoints["points"] == [[T0 * 1000, 4096.0, 512.0, 16384.0, 40.0, 25.0]]
    cluster = store.document(None)
    assert cluster["fields"] == ["at_ms", *CLUSTER_FIELDS]
    assert cluster["points"] == [[T0 * 1000, 16384.0, 4096.0, 100.0, 25.0, None]]
    assert (cluster["step_s"], cluster["span_s"]) == (STEP_S, STEP_S * POINTS)


# ---------------------------------------------------------------- over HTTP


@pytest.fixture
async def console(
    nats_server: NatsServer, redis_url: str, prefix: str, bus: Bus
) -> AsyncIterator[Console]:
    async with start_console(nats_server, redis_url, prefix, bus, console_tick=0.2) as c:
        yield c


async def test_the_history_of_a_pod_and_its_card_follows_its_telemetry(
    console: Console, bus: Bus
) -> None:
    await register(console, bus, ("gpu-1", 1))
    await console.state.ledger.reserve(placed(TRAIN, "gpu-1", [(0, 4096, 25)]))
    await bus.publish_acked(alloc_event(EventType.ALLOC_RESERVED, TRAIN, "gpu-1"))
    telemetry = console.state.telemetry

    async def send(used_mib: int, sm: float) -> None:
        telemetry.ingest(
            bus.subjects.telemetry("gpu-1", TRAIN.uid),
            telemetry_sample("gpu-1", TRAIN.uid, used_mib * MIB, sm, limit=4096 * MIB),
        )
        assert await telemetry.flush() == 1

    async def newest(**params: str) -> list[Any]:
        answer = await console.get("/api/v1/history", **params)
        if answer.status_code != 200:
            return []
        points = answer.json()["points"]
        return points[-1] if points else []

    await send(512, 40.0)
    pod = {"namespace": "team-a", "name": "train-1"}
    await until(lambda: _is(newest(**pod), [4096.0, 512.0, 4096.0, 40.0, 25.0]), WAIT_S)
    await send(1536, 70.0)  # the same step: its point moves
    await until(lambda: _is(newest(**pod), [4096.0, 1536.0, 4096.0, 70.0, 25.0]), WAIT_S)
    card = {"node": "gpu-1", "card": "GPU-gpu-1-0"}
    await until(lambda: _is(newest(**card), [4096.0, 1536.0, 16384.0, 70.0, 25.0]), WAIT_S)
    cluster = await newest()
    assert cluster[1:5] == [16384.0, 4096.0, 100.0, 25.0]

    for params, why in (
        ({"namespace": "team-a"}, "namespace and name: both or neither"),
        ({"node": "gpu-1"}, "node and card: both or neither"),
        ({**pod, **card}, "node and card: not with namespace and name"),
        ({"node": "x" * 300, "card": "c"}, "node: not a name (at most 253 printable characters)"),
    ):
        answer = await console.get("/api/v1/history", **params)
        assert (answer.status_code, answer.json()) == (400, {"error": why}), params
    missing = await console.json("/api/v1/history", namespace="team-a", name="nobody")
    assert missing["points"] == []
    unknown = await console.json("/api/v1/history", node="gpu-1", card="GPU-none")
    assert unknown["points"] == []


async def _is(points: Any, want: list[float]) -> bool:
    found = await points
    return bool(found) and found[1:] == want


async def test_a_namespaced_viewer_sees_only_its_pods_history(
    nats_server: NatsServer, redis_url: str, prefix: str, bus: Bus, kube_api_server: FakeApiServer
) -> None:
    api = kube_api_server
    api.access.grant(user="alice")
    api.access.grant(user="bob", namespace="team-a")
    alice = {"Authorization": f"Bearer {api.tokens.mint_user('alice')}"}
    bob = {"Authorization": f"Bearer {api.tokens.mint_user('bob')}"}
    async with reviewed_console(nats_server, redis_url, prefix, bus, api) as console:
        await register(console, bus, ("gpu-1", 1))
        await console.state.ledger.reserve(placed(TRAIN, "gpu-1", [(0, 4096, 25)]))
        await console.state.ledger.reserve(placed(OTHER, "gpu-1", [(0, 2048, 10)]))

        async def status(headers: dict[str, str], **params: str) -> int:
            answer = await console.client.get("/api/v1/history", params=params, headers=headers)
            return answer.status_code

        async def points(headers: dict[str, str], **params: str) -> list[Any]:
            answer = await console.client.get("/api/v1/history", params=params, headers=headers)
            assert answer.status_code == 200, answer.text
            return list(answer.json()["points"])

        other = {"namespace": "team-b", "name": "other-1"}
        await until(lambda: points(alice, **other), WAIT_S)
        assert (await points(alice, **other))[-1][1] == 2048.0
        assert (await points(bob, namespace="team-a", name="train-1"))[-1][1] == 4096.0
        assert await status(bob, namespace="team-a", name="train-1") == 200
        hidden = await console.client.get("/api/v1/history", params=other, headers=bob)
        assert (hidden.status_code, hidden.json()) == (
            404,
            {"error": "no pod team-b/other-1 is known"},
        )
        # the card's totals are in bob's snapshot too, and so is the cluster's
        assert await status(bob, node="gpu-1", card="GPU-gpu-1-0") == 200
        assert await status(bob) == 200
        assert await status({}) == 401
