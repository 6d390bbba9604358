"""gpuslice_common.service.every: a periodic job outlives its failures and ends
when its task is cancelled, even if the job swallowed the cancellation."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import pytest

from gpuslice_common.service import SharedCheck, every


class Away(Exception):
    pass


async def test_failures_never_end_the_loop_and_are_logged_by_kind(
    caplog: pytest.LogCaptureFixture,
) -> None:
    runs = 0
    fourth = asyncio.Event()

    async def job() -> None:
        nonlocal runs
        runs += 1
        if runs == 4:
            fourth.set()
        if runs == 1:
            raise Away("redis is away")
        if runs == 2:
            raise RuntimeError("a bug")

    with caplog.at_level(logging.WARNING):
        task = asyncio.create_task(every(0.01, job, "the job", expected=(Away,)))
        await asyncio.wait_for(fourth.wait(), 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    warnings = [(r.levelno, r.getMessage(), r.exc_info is not None) for r in caplog.records]
    assert warnings == [
        (logging.WARNING, "the job skipped: redis is away", False),
        (logging.ERROR, "the job failed", True),
    ]


async def test_a_cancellation_the_job_swallowed_still_ends_the_loop() -> None:
    started = asyncio.Event()

    async def swallowing() -> None:
        started.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(10)

    task = asyncio.create_task(every(0.01, swallowing, "job"))
    await started.wait()
    task.cancel()
    done, _ = await asyncio.wait([task], timeout=2)
    assert done == {task}
    assert task.cancelled()


async def test_a_shared_check_runs_once_for_concurrent_and_recent_callers() -> None:
    """A probe anyone in the cluster network can call in a loop costs what it
    checks (the inventory, Redis) at most one check per ttl."""
    calls = 0
    release = asyncio.Event()

    async def check() -> bool:
        nonlocal calls
        calls += 1
        await release.wait()
        return calls == 1

    shared = SharedCheck(check, ttl=0.2)
    waiting = [asyncio.create_task(shared()) for _ in range(50)]
    await asyncio.sleep(0.01)
    release.set()
    assert await asyncio.gather(*waiting) == [True] * 50
    assert [await shared() for _ in range(20)] == [True] * 20
    assert calls == 1
    await asyncio.sleep(0.25)
    assert await shared() is False  # checked again once the answer is older than ttl
    assert calls == 2


async def test_a_shared_check_that_fails_fails_its_callers_and_is_tried_again() -> None:
    calls = 0

    async def check() -> bool:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise OSError("away")
        return True

    shared = SharedCheck(check, ttl=10)
    with pytest.raises(OSError, match="away"):
        await shared()
    assert await shared() is True
    assert calls == 2
