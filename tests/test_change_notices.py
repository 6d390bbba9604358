"""The ledger's change notices against a real Redis: whoever may publish on the
changes channel can send any bytes; each is skipped, counted and logged once,
and the scheduler's copy (and the console, through the same reader) goes on
hearing real notices at once, never reported as listening when it is not."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis

from gpuslice_common.config import CommonSettings
from gpuslice_common.ledger import Ledger
from gpuslice_common.servers import RedisSentinelGroup
from gpuslice_scheduler.view import ClusterView
from tests.conftest import make_inventory

NOTICE_LOG = "skipped a change notice"


def hostile(ledger: Ledger) -> list[bytes]:
    """Bytes no gpuslice script publishes, each of a kind a reader could trip on."""
    meta = ledger.node_keys("node-x").meta
    return [
        b"\xff\xfe",  # not UTF-8
        meta.encode()[:-5] + b"\xc3\x28}:meta",  # a meta key, but its node is not UTF-8
        b"",
        b"x" * (4 * 1024 * 1024),
        b"not json {",
        b'{"node": "node-x", "deep": ' + b"[" * 10_000 + b"]" * 10_000 + b"}",
        f"{ledger.prefix}:{{../../etc}}:meta".encode(),  # a token that is no node's
        f"{ledger.prefix}:{{node.x}}:meta".encode(),  # '.' never appears in a token
        f"{ledger.prefix}:{{}}:meta".encode(),
        ("other:" + meta).encode(),
    ]


async def until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    """Wait for ``cond``; far below the 30 s a resync would take in these tests."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def task_of(coro: Any) -> AsyncIterator[asyncio.Task[Any]]:
    task = asyncio.create_task(coro)
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def publish_all(redis_url: str, channel: str, messages: list[bytes]) -> None:
    raw: Redis = Redis.from_url(redis_url)
    try:
        for message in messages:
            await raw.publish(channel, message)
    finally:
        await raw.aclose()


async def test_the_reader_skips_any_bytes_and_yields_the_next_real_notice(
    ledger: Ledger, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    seen: list[str] = []
    ready = asyncio.Event()

    async def follow() -> None:
        async for node in ledger.watch_changes(poll=0.05, on_subscribed=ready.set):
            seen.append(node)

    bad = hostile(ledger)
    async with task_of(follow()) as task:
        await asyncio.wait_for(ready.wait(), 10)
        await publish_all(redis_url, ledger.changes_channel, bad)
        await ledger.register_node(make_inventory("node-a", gpus=1), rebuilt=True)
        await until(lambda: seen == ["node-a"] or task.done())
        assert not task.done()
    assert ledger.refused_notices == len(bad) == 10
    logged = [r for r in caplog.records if NOTICE_LOG in r.getMessage()]
    # one line for the 1st and one for the 10th, not one each
    assert [
        r.getMessage().endswith(f"; {n} skipped since start")
        for r, n in zip(logged, (1, 10), strict=True)
    ] == [True, True]
    assert not any("\n" in r.getMessage() or r.exc_info for r in caplog.records)


async def test_the_copy_hears_a_new_node_at_once_after_hostile_notices(
    ledger: Ledger, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The extender sees a node registered after the bytes within a poll of the
    notices, not at the next resync (30 s here)."""
    caplog.set_level(logging.INFO)
    await ledger.register_node(make_inventory("node-a", gpus=1), rebuilt=True)
    view = ClusterView(ledger, interval=30.0, resync=30.0)
    await view.sync()
    async with task_of(view.run()):
        await until(lambda: view.listening)
        bad = hostile(ledger)
        await publish_all(redis_url, ledger.changes_channel, bad)
        await ledger.register_node(make_inventory("node-b", gpus=1), rebuilt=True)
        await until(lambda: "node-b" in view.cluster.node_index)
        assert view.listening
        # ninety more: the hundredth is logged again, with the count
        await publish_all(redis_url, ledger.changes_channel, [b"\xff"] * 90)
        await ledger.register_node(make_inventory("node-c", gpus=1), rebuilt=True)
        await until(lambda: "node-c" in view.cluster.node_index)
        assert view.listening
    assert ledger.refused_notices == len(bad) + 90 == 100
    logged = [r.getMessage() for r in caplog.records if NOTICE_LOG in r.getMessage()]
    assert len(logged) == 3
    assert logged[2].endswith("; 100 skipped since start")
    assert "Traceback" not in caplog.text
    assert view.skipped == {}  # a forged name never reached the copy


class FailingNotices(Ledger):
    """A ledger whose notice reader fails once with a fault of its own, after
    subscribing: the view must stop calling itself listening and poll."""

    failed = False

    async def watch_changes(  # type: ignore[override]
        self, poll: float = 1.0, on_subscribed: Callable[[], None] | None = None
    ) -> AsyncIterator[str]:
        if not self.failed:
            self.failed = True
            if on_subscribed is not None:
                on_subscribed()
            await asyncio.sleep(0.3)
            raise RuntimeError("a reader fault")
        await asyncio.sleep(3600)  # no notices any more: polling alone keeps the copy
        yield ""


async def test_a_reader_that_dies_is_never_reported_as_listening(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    base = Ledger.from_url(redis_url)
    ledger = FailingNotices(base.redis)
    try:
        view = ClusterView(ledger, interval=0.05, resync=30.0)
        await view.sync()
        async with task_of(view.run()):
            await until(lambda: ledger.failed and view.listening)
            await until(lambda: not view.listening)
            await ledger.register_node(make_inventory("node-a", gpus=1), rebuilt=True)
            await until(lambda: "node-a" in view.cluster.node_index)  # polled, not resynced
            assert not view.listening
    finally:
        await base.close()
    assert "following the ledger's change notices failed" in caplog.text


async def test_notices_through_the_sentinels_skip_any_bytes_too(tmp_path: Path) -> None:
    """The notices' own connection asks the sentinels for the primary, as the
    ledger's do."""
    with RedisSentinelGroup(tmp_path / "redis", replicas=1) as group:
        settings = CommonSettings(redis_url=group.url, redis_sentinels=group.sentinels)
        ledger = Ledger.from_settings(settings)
        primary = group.primary()
        assert primary is not None
        seen: list[str] = []
        ready = asyncio.Event()

        async def follow() -> None:
            async for node in ledger.watch_changes(poll=0.05, on_subscribed=ready.set):
                seen.append(node)

        try:
            async with task_of(follow()) as task:
                await asyncio.wait_for(ready.wait(), 10)
                await publish_all(primary.url, ledger.changes_channel, hostile(ledger))
                await ledger.register_node(make_inventory("node-a", gpus=1), rebuilt=True)
                await until(lambda: seen == ["node-a"] or task.done())
                assert not task.done()
        finally:
            await ledger.close()
        assert ledger.refused_notices == len(hostile(ledger))
