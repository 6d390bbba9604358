"""TelemetryStore against a real redis-server (and once a real nats-server).

Samples are written byte for byte as ``native/src/telemetry.c`` writes them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from typing import Any

import nats
import orjson
import pytest
from nats.aio.msg import Msg
from redis.asyncio import Redis
from redis.exceptions import RedisError

from gpuslice_common import region
from gpuslice_common.bus import flush_client
from gpuslice_common.ledger import Ledger
from gpuslice_common.models import (
    MAX_TELEMETRY_DEVICES,
    ContainerAssignment,
    DeviceGrant,
    DeviceTelemetry,
    GpuDevice,
    NodeInventory,
    Placement,
    PodRef,
    TelemetrySample,
)
from gpuslice_common.servers import NatsServer, RedisServer
from gpuslice_common.subjects import Subjects
from gpuslice_inventory.telemetry import (
    ContainerUsage,
    GpuUsage,
    TelemetryStore,
)

NODE = "gpu-7.pool-a.example"
POD = "0b6f1d2e-5c51-4f0b-9d43-2c1f8a7e9b10"
POD2 = "7c1e0a55-0d4e-4f43-8b0e-0a9c2f6d1e22"
GPU_A = "GPU-1a2b3c4d-0000-1111-2222-333344445555"
GPU_B = "GPU-1a2b3c4d-0000-1111-2222-666677778888"
MIB = 1 << 20


class Clock:
    """An epoch clock the test moves by hand."""

    def __init__(self, now: float = 1_800_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def device(
    uuid: str = GPU_A,
    used: int = 100 * MIB,
    sm: str = "12.5",
    peak: int | str | None = "used",
    **kw: Any,
) -> str:
    """A device as the interposer writes it (sm_percent as "%u.%u"). ``peak``:
    the peak (by default the use), raw JSON text, or None to leave it out as
    interposers before peaks did."""
    fields: dict[str, int | str] = {"used_bytes": used}
    if peak is not None:
        fields["peak_bytes"] = used if peak == "used" else peak
    fields |= {
        "limit_bytes": kw.pop("limit", 1024 * MIB),
        "sm_percent": sm,
        "throttled_ns": kw.pop("throttled", 0),
        "denied_allocations": kw.pop("denied", 0),
    }
    assert not kw
    numbers = ",".join(f'"{k}":{v}' for k, v in fields.items())
    return f'{{"uuid":"{uuid}",{numbers}}}'


def sample(
    node: str = NODE,
    pod: str = POD,
    container: str = "main",
    devices: tuple[str, ...] | None = None,
    pid: int = 4242,
    when: str = "2026-11-21T10:11:12.345Z",
) -> bytes:
    devs = ",".join(devices if devices is not None else (device(),))
    return (
        f'{{"node":"{node}","pod_uid":"{pod}","container":"{container}","pid":{pid},'
        f'"time":"{when}","devices":[{devs}],"dropped_samples":0}}'
    ).encode()


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[Redis]:
    client: Redis = Redis.from_url(redis_url, decode_responses=True)
    yield client
    await client.aclose()


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def store(redis: Redis, prefix: str, clock: Clock) -> TelemetryStore:
    return TelemetryStore(redis, prefix, ttl=30.0, clock=clock)


def subject(prefix: str, node: str = NODE, pod: str = POD) -> str:
    return Subjects(prefix).telemetry(node, pod)


async def wait_for(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


# ------------------------------------------------------------ latest sample wins


async def test_the_latest_sample_in_a_batch_wins(
    store: TelemetryStore, prefix: str, clock: Clock
) -> None:
    for used in (1, 2, 3):
        assert store.ingest(subject(prefix), sample(devices=(device(used=used * MIB),)))
    assert store.pending == 1  # coalesced in memory
    assert await store.flush() == 1
    assert store.stats.stored == 1
    assert store.stats.flushes == 1
    assert await store.container_usage(NODE) == [
        ContainerUsage(
            node=NODE,
            uuid=GPU_A,
            pod_uid=POD,
            container="main",
            used_bytes=3 * MIB,
            limit_bytes=1024 * MIB,
            sm_percent=12.5,
            throttled_ns=0,
            denied_allocations=0,
            at_ms=int(clock.now * 1000),
            peak_bytes=3 * MIB,
        )
    ]


async def test_a_later_sample_replaces_the_whole_earlier_one_in_a_batch(
    store: TelemetryStore, redis: Redis, prefix: str
) -> None:
    store.ingest(subject(prefix), sample(devices=(device(GPU_A), device(GPU_B))))
    store.ingest(subject(prefix), sample(devices=(device(GPU_B, used=7),)))
    await store.flush()
    assert await redis.hkeys(store.usage_key(NODE)) == [f"{GPU_B}|{POD}|main"]


async def test_the_latest_sample_wins_across_flushes(
    store: TelemetryStore, prefix: str, clock: Clock
) -> None:
    store.ingest(subject(prefix), sample(devices=(device(used=5 * MIB, sm="90.0"),)))
    await store.flush()
    clock.now += 1
    store.ingest(
        subject(prefix), sample(devices=(device(used=6 * MIB, sm="0.0", throttled=9, denied=2),))
    )
    await store.flush()
    [usage] = await store.container_usage(NODE)
    assert (usage.used_bytes, usage.sm_percent, usage.throttled_ns, usage.denied_allocations) == (
        6 * MIB,
        0.0,
        9,
        2,
    )
    assert usage.at_ms == int(clock.now * 1000)
    assert store.stats.stored == 2


async def test_flush_with_nothing_pending_writes_nothing(
    store: TelemetryStore, redis: Redis
) -> None:
    assert await store.flush() == 0
    assert store.stats.flushes == 0
    assert await redis.dbsize() == 0


# ------------------------------------------------------------ aggregation


async def test_gpu_usage_sums_the_containers_of_each_gpu(
    store: TelemetryStore, prefix: str
) -> None:
    ingest = store.ingest
    # pod 1: two containers on GPU A; pod 2: one container on A and B (multi-GPU)
    ingest(subject(prefix), sample(container="main", devices=(device(GPU_A, 100, "10.0"),)))
    ingest(subject(prefix), sample(container="side", devices=(device(GPU_A, 20, "2.5"),)))
    two = (device(GPU_A, 300, "30.0"), device(GPU_B, 4000, "40.0"))
    ingest(subject(prefix, pod=POD2), sample(pod=POD2, container="main", devices=two))
    # another node's GPU is not this node's
    other = "gpu-8.pool-a.example"
    ingest(subject(prefix, node=other), sample(node=other, devices=(device(GPU_B, 1),)))
    assert await store.flush() == 4

    assert await store.gpu_usage(NODE) == {
        GPU_A: GpuUsage(uuid=GPU_A, used_bytes=420, sm_percent=42.5, containers=3),
        GPU_B: GpuUsage(uuid=GPU_B, used_bytes=4000, sm_percent=40.0, containers=1),
    }
    assert await store.gpu_usage(other) == {
        GPU_B: GpuUsage(uuid=GPU_B, used_bytes=1, sm_percent=12.5, containers=1)
    }
    usage = await store.container_usage(NODE)
    assert [(u.uuid, u.pod_uid, u.container) for u in usage] == [
        (GPU_A, POD, "main"),
        (GPU_A, POD, "side"),
        (GPU_A, POD2, "main"),
        (GPU_B, POD2, "main"),
    ]
    assert await store.gpu_usage("gpu-9.pool-a.example") == {}


# ------------------------------------------------------------ freshness


async def test_entries_older_than_ttl_are_ignored_and_removed(
    store: TelemetryStore, redis: Redis, prefix: str, clock: Clock
) -> None:
    store.ingest(subject(prefix), sample(container="old"))
    await store.flush()
    clock.now += 20
    store.ingest(subject(prefix), sample(container="new"))
    await store.flush()

    clock.now += 10  # "old" is 30 s old: still fresh
    assert [u.container for u in await store.container_usage(NODE)] == ["new", "old"]
    clock.now += 0.002  # now older than ttl
    assert [u.container for u in await store.container_usage(NODE)] == ["new"]
    assert await redis.hkeys(store.usage_key(NODE)) == [f"{GPU_A}|{POD}|new"]

    clock.now += 30
    assert await store.gpu_usage(NODE) == {}
    assert await redis.exists(store.usage_key(NODE)) == 0


async def test_an_entry_refreshed_while_being_read_is_not_removed(
    store: TelemetryStore,
    redis: Redis,
    prefix: str,
    clock: Clock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store.ingest(subject(prefix), sample(devices=(device(used=1),)))
    await store.flush()
    clock.now += 31
    read = redis.hgetall

    async def racing_read(key: str) -> Any:
        seen = await read(key)
        store.ingest(subject(prefix), sample(devices=(device(used=2),)))  # a fresh sample
        await store.flush()
        return seen

    monkeypatch.setattr(redis, "hgetall", racing_read)
    assert await store.container_usage(NODE) == []  # what it read was stale
    monkeypatch.undo()
    [usage] = await store.container_usage(NODE)
    assert usage.used_bytes == 2


async def test_each_flush_sets_the_node_key_to_expire_after_ttl(redis: Redis, prefix: str) -> None:
    store = TelemetryStore(redis, prefix, ttl=5.0)
    store.ingest(subject(prefix), sample())
    await store.flush()
    key = store.usage_key(NODE)
    assert key == f"{prefix}:usage:{NODE}"
    assert 4000 < await redis.pttl(key) <= 5000
    await redis.pexpire(key, 100)
    store.ingest(subject(prefix), sample())
    await store.flush()
    assert 4000 < await redis.pttl(key) <= 5000


async def test_a_node_that_stops_sending_disappears(redis: Redis, prefix: str) -> None:
    store = TelemetryStore(redis, prefix, ttl=0.2)
    store.ingest(subject(prefix), sample())
    await store.flush()
    assert await store.gpu_usage(NODE) != {}
    await asyncio.sleep(0.3)
    assert await redis.exists(store.usage_key(NODE)) == 0
    assert await store.gpu_usage(NODE) == {}


# ------------------------------------------------------------ malformed samples

GOOD = sample()
MALFORMED: dict[str, bytes] = {
    "not JSON": b'{"node": ',
    "not UTF-8": b"\xff\xfe",
    "a JSON list": b"[1, 2]",
    "missing devices": GOOD.replace(b',"devices":[', b',"devicez":['),
    "missing pid": GOOD.replace(b'"pid":4242,', b""),
    "an unknown field": GOOD.replace(b'"pid":4242,', b'"pid":4242,"extra":1,'),
    "pid as a string": GOOD.replace(b'"pid":4242', b'"pid":"4242"'),
    "pid a boolean": GOOD.replace(b'"pid":4242', b'"pid":true'),
    "negative pid": GOOD.replace(b'"pid":4242', b'"pid":-1'),
    "container not a string": GOOD.replace(b'"container":"main"', b'"container":7'),
    "time not a time": GOOD.replace(b"2026-11-21T10:11:12.345Z", b"yesterday"),
    "time a number": GOOD.replace(b'"2026-11-21T10:11:12.345Z"', b"1700000000"),
    "dropped_samples negative": GOOD.replace(b'"dropped_samples":0', b'"dropped_samples":-3'),
    "devices not a list": sample()
    .replace(b'"devices":[', b'"devices":{"x":[')
    .replace(b"],", b"]},"),
    "a device not an object": sample(devices=('"GPU-x"',)),
    "a device without used_bytes": sample(devices=(f'{{"uuid":"{GPU_A}","limit_bytes":1}}',)),
    "a device with an unknown field": sample(devices=(device().replace("{", '{"temp":70,'),)),
    "used_bytes a string": sample(
        devices=(device().replace('"used_bytes":', '"used_bytes":"1"+'),)
    ),
    "used_bytes a float": sample(devices=(device(used=5, peak=0).replace(":5,", ":5.5,"),)),
    "negative used_bytes": sample(devices=(device(used=-1, peak=0),)),
    "negative limit_bytes": sample(devices=(device(limit=-1),)),
    "negative throttled_ns": sample(devices=(device(throttled=-1),)),
    "negative denied_allocations": sample(devices=(device(denied=-5),)),
    "peak_bytes a string": sample(devices=(device(peak='"104857600"'),)),
    "peak_bytes negative": sample(devices=(device(peak=-1),)),
    "peak_bytes a float": sample(devices=(device(peak="104857600.5"),)),
    "peak_bytes in exponent form": sample(devices=(device(peak="1e9"),)),
    "peak_bytes null": sample(devices=(device(peak="null"),)),
    "peak_bytes a boolean": sample(devices=(device(peak="true"),)),
    "peak_bytes beyond 64 bits": sample(devices=(device(peak=1 << 64),)),
    "peak_bytes alone beside the required": sample(
        devices=(f'{{"uuid":"{GPU_A}","used_bytes":1,"limit_bytes":2,"peak_bytes":-1}}',)
    ),
    "peak_bytes misspelt": sample(
        devices=(device(peak=None).replace('"used_bytes"', '"peak_byte":1,"used_bytes"'),)
    ),
    "sm_percent over 100": sample(devices=(device(sm="100.1"),)),
    "sm_percent negative": sample(devices=(device(sm="-0.5"),)),
    "sm_percent a string": sample(devices=(device(sm='"5"'),)),
    "sm_percent null": sample(devices=(device(sm="null"),)),
    "uuid not a string": sample(devices=(device().replace(f'"{GPU_A}"', "17"),)),
    "uuid with a bar": sample(devices=(device(uuid="GPU-a|b"),)),
    "uuid empty": sample(devices=(device(uuid=""),)),
    "the same device twice": sample(devices=(device(), device())),
    "an integer beyond 64 bits": sample(devices=(device(used=1 << 70, peak=0),)),
    "more devices than a region holds": sample(
        devices=tuple(device(uuid=f"GPU-{i}") for i in range(MAX_TELEMETRY_DEVICES + 1))
    ),
    "container empty": sample(container=""),
    "container with capitals": sample(container="Main"),
    "container with a quote": sample(container='ma\\"in'),
    "container with a bar": sample(container="a|b"),
    "container longer than a label": sample(container="c" * 64),
    "container ending in a dash": sample(container="main-"),
    "pid beyond any pid": GOOD.replace(b'"pid":4242', b'"pid":4294967296'),
}


@pytest.mark.parametrize("kind", list(MALFORMED))
def test_each_kind_of_malformed_sample_is_counted_and_dropped(
    store: TelemetryStore, prefix: str, kind: str
) -> None:
    assert not store.ingest(subject(prefix), MALFORMED[kind])
    assert store.stats.malformed == 1
    assert store.stats.received == 1
    assert store.pending == 0


@pytest.mark.parametrize("kind", [k for k in MALFORMED if k.startswith("peak_bytes ")])
def test_a_bad_peak_is_refused_for_what_it_is(
    store: TelemetryStore, prefix: str, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Refused by the checks themselves, not by an error they happen to raise."""
    assert not store.ingest(subject(prefix), MALFORMED[kind])
    why = "device fields" if kind.endswith("misspelt") else "bad device counter"
    [record] = caplog.records
    assert record.getMessage().split(": ", 1)[1].startswith(why), record.getMessage()


async def test_bad_samples_never_stop_the_good_ones_in_a_batch(
    store: TelemetryStore, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    good = 0
    for i, bad in enumerate(MALFORMED.values()):
        assert not store.ingest(subject(prefix), bad)
        assert store.ingest(subject(prefix), sample(container=f"c{i}"))
        good += 1
    assert store.stats.malformed == len(MALFORMED)
    assert await store.flush() == good
    assert len(await store.container_usage(NODE)) == good
    # logged rarely: one line for all of them
    assert sum("malformed telemetry" in r.getMessage() for r in caplog.records) == 1


def test_a_valid_sample_written_by_the_model_is_accepted(
    store: TelemetryStore, prefix: str
) -> None:
    model = TelemetrySample(
        node=NODE,
        pod_uid=POD,
        container="main",
        pid=1,
        time=datetime.now(UTC),
        devices=(
            DeviceTelemetry(uuid=GPU_A, used_bytes=1, limit_bytes=2),
            DeviceTelemetry(uuid=GPU_B, used_bytes=3, limit_bytes=4, sm_percent=100),
        ),
    )
    assert store.ingest(subject(prefix), model.model_dump_json().encode())
    # optional fields may be left out, as the model allows
    assert store.ingest(
        subject(prefix, pod=POD2),
        orjson.dumps(
            {
                "node": NODE,
                "pod_uid": POD2,
                "container": "c" * 63,
                "pid": 0,
                "time": "2026-11-21T10:11:12",
                "devices": [{"uuid": GPU_A, "used_bytes": 0, "limit_bytes": 0}],
            }
        ),
    )
    assert store.stats.malformed == 0


# ------------------------------------------------------------ peak


async def test_the_peak_is_stored_as_the_values_seventh_field_and_read_back(
    store: TelemetryStore, redis: Redis, prefix: str, clock: Clock
) -> None:
    assert store.ingest(subject(prefix), sample(devices=(device(used=100 * MIB, peak=900 * MIB),)))
    await store.flush()
    at_ms = int(clock.now * 1000)
    value = await redis.hget(store.usage_key(NODE), f"{GPU_A}|{POD}|main")
    assert value == f"{100 * MIB},{1024 * MIB},12.5,0,0,{at_ms},{900 * MIB}"
    [usage] = await store.container_usage(NODE)
    assert (usage.used_bytes, usage.peak_bytes, usage.at_ms) == (100 * MIB, 900 * MIB, at_ms)


@pytest.mark.parametrize(
    ("name", "peak", "stored"),
    [
        ("above the use", 7 * MIB, 7 * MIB),
        ("equal to the use", 5 * MIB, 5 * MIB),
        # the region raises used a moment before its peak: the use is the peak
        ("below the use", 3 * MIB, 5 * MIB),
        ("zero", 0, 5 * MIB),
        # an interposer before peaks: the use, as old stored values are read
        ("left out", None, 5 * MIB),
    ],
)
async def test_the_peak_stored_is_never_below_the_use(
    store: TelemetryStore, prefix: str, name: str, peak: int | None, stored: int
) -> None:
    assert store.ingest(subject(prefix), sample(devices=(device(used=5 * MIB, peak=peak),))), name
    assert store.stats.malformed == 0
    await store.flush()
    [usage] = await store.container_usage(NODE)
    assert (usage.used_bytes, usage.peak_bytes) == (5 * MIB, stored), name


async def test_a_sample_of_an_interposer_before_peaks_is_accepted_whole(
    store: TelemetryStore, prefix: str
) -> None:
    """Every other field present and no peak_bytes, as such an interposer sends
    them, beside one that does send it, in one sample."""
    old = device(GPU_A, used=2 * MIB, peak=None, throttled=11, denied=3)
    assert '"peak_bytes"' not in old
    assert store.ingest(subject(prefix), sample(devices=(old, device(GPU_B, peak=200 * MIB))))
    await store.flush()
    a, b = await store.container_usage(NODE)
    assert (a.uuid, a.used_bytes, a.peak_bytes, a.throttled_ns, a.denied_allocations) == (
        GPU_A,
        2 * MIB,
        2 * MIB,
        11,
        3,
    )
    assert (b.uuid, b.used_bytes, b.peak_bytes) == (GPU_B, 100 * MIB, 200 * MIB)


async def test_a_value_stored_before_peaks_is_read_with_the_use_as_its_peak(
    store: TelemetryStore, redis: Redis, clock: Clock
) -> None:
    at_ms = int(clock.now * 1000)
    await redis.hset(store.usage_key(NODE), f"{GPU_A}|{POD}|main", f"4096,8192,2.5,7,1,{at_ms}")
    assert await store.container_usage(NODE) == [
        ContainerUsage(
            node=NODE,
            uuid=GPU_A,
            pod_uid=POD,
            container="main",
            used_bytes=4096,
            limit_bytes=8192,
            sm_percent=2.5,
            throttled_ns=7,
            denied_allocations=1,
            at_ms=at_ms,
            peak_bytes=4096,
        )
    ]


async def test_stored_values_that_are_no_entry_are_skipped(
    store: TelemetryStore, redis: Redis, clock: Clock
) -> None:
    at = int(clock.now * 1000)
    bad = {
        "five fields": "1,2,3.0,4,5",
        "eight fields": f"1,2,3.0,4,5,{at},6,7",
        "a peak that is no integer": f"1,2,3.0,4,5,{at},x",
        "a float peak": f"1,2,3.0,4,5,{at},6.5",
        "an empty peak": f"1,2,3.0,4,5,{at},",
        "a time that is no integer": "1,2,3.0,4,5,soon,6",
    }
    key = store.usage_key(NODE)
    for i, value in enumerate(bad.values()):
        await redis.hset(key, f"{GPU_A}|{POD}|c{i}", value)
    await redis.hset(key, f"{GPU_A}|{POD}|good", f"1,2,3.0,4,5,{at},6")
    assert [(u.container, u.peak_bytes) for u in await store.container_usage(NODE)] == [("good", 6)]


def test_the_model_takes_a_peak_and_defaults_it_to_zero() -> None:
    assert DeviceTelemetry(uuid=GPU_A, used_bytes=1, limit_bytes=2).peak_bytes == 0
    assert DeviceTelemetry(uuid=GPU_A, used_bytes=1, peak_bytes=9, limit_bytes=2).peak_bytes == 9
    for bad in (-1, 1 << 64):
        with pytest.raises(ValueError, match="peak_bytes"):
            DeviceTelemetry(uuid=GPU_A, used_bytes=1, peak_bytes=bad, limit_bytes=2)
    with pytest.raises(ValueError, match="peak_bytes"):
        DeviceTelemetry.model_validate_json(
            f'{{"uuid":"{GPU_A}","used_bytes":1,"peak_bytes":"9","limit_bytes":2}}', strict=True
        )


# ------------------------------------------------------------ subject and payload


@pytest.mark.parametrize(
    ("name", "subj", "payload"),
    [
        ("another node in the payload", None, sample(node="gpu-8.pool-a.example")),
        ("another pod in the payload", None, sample(pod=POD2)),
        ("the node spelt as its token", None, sample(node="gpu-7_pool-a_example")),
        ("another prefix", "other.telemetry.gpu-7_pool-a_example." + POD, sample()),
        ("not telemetry", "{prefix}.inventory.gpu-7_pool-a_example." + POD, sample()),
        ("a token too many", "{prefix}.telemetry.gpu-7_pool-a_example." + POD + ".x", sample()),
        ("no pod token", "{prefix}.telemetry.gpu-7_pool-a_example", sample()),
        (
            "a node token that is no node name",
            "{prefix}.telemetry.GPU-7." + POD,
            sample(node="GPU-7"),
        ),
        ("an empty node token", "{prefix}.telemetry.." + POD, sample(node="")),
    ],
)
def test_a_sample_on_a_subject_that_is_not_its_own_is_rejected(
    store: TelemetryStore, prefix: str, name: str, subj: str | None, payload: bytes
) -> None:
    topic = subject(prefix) if subj is None else subj.format(prefix=prefix)
    assert not store.ingest(topic, payload), name
    assert store.stats.malformed == 1
    assert store.pending == 0
    # the right subject still works afterwards (the subject cache holds only valid ones)
    assert store.ingest(subject(prefix), sample())


# ------------------------------------------------------------ back pressure


async def test_max_pending_drops_new_containers_but_takes_updates(
    redis: Redis, prefix: str
) -> None:
    store = TelemetryStore(redis, prefix, max_pending=2)
    assert store.ingest(subject(prefix), sample(container="a"))
    assert store.ingest(subject(prefix), sample(container="b"))
    assert not store.ingest(subject(prefix), sample(container="c"))
    assert not store.ingest(subject(prefix), sample(container="d"))
    assert (store.stats.dropped, store.stats.malformed) == (2, 0)
    # a newer sample of a waiting container takes no more room
    assert store.ingest(subject(prefix), sample(container="a", devices=(device(used=9),)))
    assert store.stats.dropped == 2
    assert await store.flush() == 2
    assert store.ingest(subject(prefix), sample(container="c"))
    await store.flush()
    usage = {u.container: u.used_bytes for u in await store.container_usage(NODE)}
    assert usage == {"a": 9, "b": 100 * MIB, "c": 100 * MIB}
    assert store.stats.received == 6


# ------------------------------------------------------------ run()


async def test_run_flushes_every_interval(redis: Redis, prefix: str) -> None:
    store = TelemetryStore(redis, prefix, flush_interval=0.05)
    task = asyncio.create_task(store.run())
    try:
        for i in range(3):
            store.ingest(subject(prefix), sample(devices=(device(used=i),)))
            flushes = i + 1
            await wait_for(lambda: store.pending == 0 and store.stats.flushes == flushes)  # noqa: B023
            [usage] = await store.container_usage(NODE)
            assert usage.used_bytes == i
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_run_flushes_once_more_when_cancelled(redis: Redis, prefix: str) -> None:
    store = TelemetryStore(redis, prefix, flush_interval=3600)
    task = asyncio.create_task(store.run())
    await asyncio.sleep(0.01)  # run() now sleeps for an hour
    store.ingest(subject(prefix), sample())
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert store.stats.flushes == 1
    assert store.pending == 0
    assert len(await store.container_usage(NODE)) == 1


async def test_a_failed_flush_keeps_its_samples_for_the_next(
    own_redis: RedisServer, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    redis: Redis = Redis.from_url(own_redis.url, decode_responses=True, socket_timeout=2)
    try:
        store = TelemetryStore(redis, prefix, flush_interval=0.02)
        store.ingest(subject(prefix), sample(container="a", devices=(device(used=1),)))
        store.ingest(subject(prefix), sample(container="b", devices=(device(used=1),)))
        own_redis.stop()
        with pytest.raises(RedisError):
            await store.flush()
        assert store.pending == 2
        # run() survives a Redis that is down, counting and logging (once)
        task = asyncio.create_task(store.run())
        await wait_for(lambda: store.stats.flush_errors >= 2)
        assert not task.done()
        # newer samples win over the ones put back
        store.ingest(subject(prefix), sample(container="a", devices=(device(used=2),)))
        own_redis.start()
        await wait_for(lambda: store.pending == 0, timeout=15)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        usage = {u.container: u.used_bytes for u in await store.container_usage(NODE)}
        assert usage == {"a": 2, "b": 1}
        assert store.stats.dropped == 0
        assert sum("cannot write telemetry" in r.getMessage() for r in caplog.records) == 1
    finally:
        await redis.aclose()


async def test_readers_work_without_decoded_responses(redis_url: str, prefix: str) -> None:
    raw: Redis = Redis.from_url(redis_url)
    try:
        store = TelemetryStore(raw, prefix, ttl=30.0)
        store.ingest(subject(prefix), sample())
        await store.flush()
        assert (await store.gpu_usage(NODE))[GPU_A].used_bytes == 100 * MIB
    finally:
        await raw.aclose()


# ------------------------------------------------------------ through NATS


async def test_samples_published_on_nats_reach_gpu_usage(
    nats_server: NatsServer, redis: Redis, prefix: str
) -> None:
    store = TelemetryStore(redis, prefix, flush_interval=0.02)
    flusher = asyncio.create_task(store.run())
    sub_conn = await nats.connect(nats_server.url)
    pub_conn = await nats.connect(nats_server.url)
    try:

        async def on_message(msg: Msg) -> None:
            store.ingest(msg.subject, msg.data)

        await sub_conn.subscribe(Subjects(prefix).telemetry_all, cb=on_message)
        await flush_client(sub_conn)
        containers = [(POD, "main", GPU_A), (POD, "side", GPU_A), (POD2, "main", GPU_B)]
        for round_ in range(1, 4):
            for pod, name, gpu in containers:
                payload = sample(pod=pod, container=name, devices=(device(gpu, used=round_),))
                await pub_conn.publish(subject(prefix, pod=pod), payload)
        # one from another node's credential, claiming to be this node, and garbage
        await pub_conn.publish(subject(prefix, node="gpu-8.pool-a.example"), sample())
        await pub_conn.publish(subject(prefix), b"\x00garbage")
        await flush_client(pub_conn)

        await wait_for(lambda: store.stats.received == 11 and store.pending == 0)
        # a flush may still be writing what it took: the store's own lock waits for it
        await store.flush()
        assert await store.gpu_usage(NODE) == {
            GPU_A: GpuUsage(uuid=GPU_A, used_bytes=6, sm_percent=25.0, containers=2),
            GPU_B: GpuUsage(uuid=GPU_B, used_bytes=3, sm_percent=12.5, containers=1),
        }
        assert store.stats.malformed == 2
        assert await store.gpu_usage("gpu-8.pool-a.example") == {}
    finally:
        await pub_conn.close()
        await sub_conn.close()
        flusher.cancel()
        await asyncio.gather(flusher, return_exceptions=True)


async def test_a_released_pod_is_forgotten_stored_and_waiting(
    store: TelemetryStore, prefix: str
) -> None:
    assert store.ingest(subject(prefix), sample(container="a"))
    assert store.ingest(subject(prefix, pod=POD2), sample(pod=POD2))
    assert await store.flush() == 2
    assert store.ingest(subject(prefix), sample(container="b"))  # waiting, not stored
    assert await store.forget_pod(NODE, POD) == 1
    assert store.pending == 0
    await store.flush()
    left = await store.container_usage(NODE)
    assert [(u.pod_uid, u.container) for u in left] == [(POD2, "main")]
    assert await store.forget_pod(NODE, POD) == 0


# ------------------------------------------------------------ bounds


def test_a_sample_holds_at_most_a_regions_devices() -> None:
    assert MAX_TELEMETRY_DEVICES == region.MAX_DEVICES
    devices = tuple(
        DeviceTelemetry(uuid=f"GPU-{i}", used_bytes=1, limit_bytes=1)
        for i in range(MAX_TELEMETRY_DEVICES + 1)
    )
    fields: dict[str, Any] = {
        "node": NODE,
        "pod_uid": POD,
        "container": "main",
        "pid": 1,
        "time": datetime.now(UTC),
    }
    TelemetrySample(**fields, devices=devices[:-1])
    with pytest.raises(ValueError, match="at most 16"):
        TelemetrySample(**fields, devices=devices)
    for name in ("", "Main", 'a"b', "c" * 64, "a\tb"):
        with pytest.raises(ValueError, match="container"):
            TelemetrySample(**fields | {"container": name}, devices=())
    with pytest.raises(ValueError, match="used_bytes"):
        DeviceTelemetry(uuid=GPU_A, used_bytes=1 << 64, limit_bytes=1)
    with pytest.raises(ValueError, match="sm_percent"):
        DeviceTelemetry(uuid=GPU_A, used_bytes=1, limit_bytes=1, sm_percent=float("nan"))


def test_a_pod_has_at_most_max_containers_waiting(redis: Redis, prefix: str) -> None:
    store = TelemetryStore(redis, prefix, max_containers=3)
    for name in ("a", "b", "c"):
        assert store.ingest(subject(prefix), sample(container=name))
    assert not store.ingest(subject(prefix), sample(container="d"))
    # a waiting container is updated; another pod has its own room
    assert store.ingest(subject(prefix), sample(container="a", devices=(device(used=9),)))
    assert store.ingest(subject(prefix, pod=POD2), sample(pod=POD2, container="d"))
    assert store.stats.dropped_by == {"containers": 1}
    assert (store.stats.dropped, store.stats.malformed, store.pending) == (1, 0, 4)


# ------------------------------------------------------------ the ledger's placement


async def place(ledger: Ledger, placement: Placement) -> None:
    cards = (GPU_A, GPU_B)
    devices = tuple(
        GpuDevice(uuid=u, index=i, model="NVIDIA A100", memory_mib=1024)
        for i, u in enumerate(cards)
    )
    await ledger.register_node(NodeInventory(node=placement.node, devices=devices), rebuilt=True)
    await ledger.reserve(placement)


def pod_placement(uid: str, node: str = NODE, **containers: tuple[str, ...]) -> Placement:
    return Placement(
        pod=PodRef(uid=uid, namespace="ns", name=uid),
        node=node,
        containers=tuple(
            ContainerAssignment(
                name=name, devices=tuple(DeviceGrant(uuid=u, memory_mib=1, cores=10) for u in uuids)
            )
            for name, uuids in containers.items()
        ),
    )


async def test_only_a_placements_containers_on_their_own_cards_are_stored(
    redis: Redis, prefix: str, ledger: Ledger
) -> None:
    """Each container reports on the cards granted to it, in a pod the ledger
    places on the sample's node; everything else is dropped and counted."""
    await place(ledger, pod_placement(POD, main=(GPU_A,), side=(GPU_B,)))
    await place(ledger, pod_placement(POD2, node="gpu-8.pool-a.example", main=(GPU_A,)))
    store = TelemetryStore(redis, prefix, placements=ledger.placement)
    others = [f"GPU-other-{i}" for i in range(MAX_TELEMETRY_DEVICES - 1)]
    dropped = {
        "foreign-container": sample(container="c0", devices=(device(GPU_A),)),
        "foreign-device": sample(
            container="main", devices=(device(GPU_A), *(device(u) for u in others))
        ),
        "not-placed": sample(pod=POD2, container="main"),  # placed on another node
        "never-placed": sample(pod="pod-9", container="main"),
    }
    for name, payload in dropped.items():
        pod = {"not-placed": POD2, "never-placed": "pod-9"}.get(name, POD)
        assert store.ingest(subject(prefix, pod=pod), payload), name
        assert await store.flush() == 0, name
    assert store.ingest(subject(prefix), sample(container="main", devices=(device(GPU_A, used=5),)))
    assert store.ingest(subject(prefix), sample(container="side", devices=(device(GPU_B, used=7),)))
    assert await store.flush() == 2
    assert store.stats.dropped_by == {
        "foreign-container": 1,
        "foreign-device": 1,
        "not-placed": 2,
    }
    assert store.stats.dropped == 4
    usage = await store.gpu_usage(NODE)
    assert {u: (g.used_bytes, g.containers) for u, g in usage.items()} == {
        GPU_A: (5, 1),
        GPU_B: (7, 1),
    }


async def test_a_released_pods_samples_are_not_stored(
    redis: Redis, prefix: str, ledger: Ledger
) -> None:
    await place(ledger, pod_placement(POD, main=(GPU_A,)))
    await place(ledger, pod_placement(POD2, main=(GPU_A,)))
    # a cache that never expires: only the release itself makes the store drop them
    store = TelemetryStore(redis, prefix, placements=ledger.placement, placement_cache=3600)
    for pod in (POD, POD2):
        assert store.ingest(subject(prefix, pod=pod), sample(pod=pod))
    assert await store.flush() == 2
    await ledger.release(POD, "done")
    assert await store.forget_pod(NODE, POD) == 1  # what the inventory does on release
    for pod in (POD, POD2):
        assert store.ingest(subject(prefix, pod=pod), sample(pod=pod))
    assert await store.flush() == 1
    assert store.stats.dropped_by == {"not-placed": 1}
    assert [u.pod_uid for u in await store.container_usage(NODE)] == [POD2]

    # another replica, which never saw the release, reads the ledger afresh
    other = TelemetryStore(redis, prefix, placements=ledger.placement)
    assert other.ingest(subject(prefix), sample())
    assert await other.flush() == 0
    assert other.stats.dropped_by == {"not-placed": 1}
