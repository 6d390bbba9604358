"""fork() under the interposer: the child joins the container's region in a process slot
of its own, so the container's limit covers parent and child together; what the child
used comes back when it exits; parent and child each publish telemetry under their own
pid.

The probe's `fork ... forkwait` (native/tests/probe.c) runs the commands in between in
the child, whose lines say "child": true, while the parent waits for it; on the fake
driver the child initialises the driver and takes its context again.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from gpuslice_common.region import Region
from gpuslice_common.servers import NatsServer
from tests.native.probe import (
    Build,
    Line,
    ProbeProcess,
    ProbeRunner,
    ProbeSpawner,
    limited,
)
from tests.native.test_telemetry import ended, feed, line, pod_uid, subject, telemetry_env

MiB = 1 << 20
GiB = 1 << 30


def lines_until(
    proc: ProbeProcess, done: Callable[[list[Line]], bool], timeout: float = 20
) -> list[Line]:
    """Every line so far, once `done` holds for them. Parent and child write in no fixed
    order, so this reads on rather than waiting for one command."""
    deadline = time.monotonic() + timeout
    while not done(proc.lines):
        proc.next_line(timeout=max(0.0, deadline - time.monotonic()))
    return list(proc.lines)


def of(lines: list[Line], cmd: str, child: bool) -> list[Line]:
    return [x for x in lines if x["cmd"] == cmd and x.get("child", False) == child]


def slots(region_path: Path) -> tuple[dict[int, int], int]:
    """pid -> bytes of every live process slot, and the container's usage, on device 0."""
    with Region.open(region_path) as region:
        used = {p.pid: p.used_bytes[0] for p in region.processes()}
        return used, region.devices()[0].used_bytes


def test_the_limit_covers_parent_and_child_and_the_child_gives_back_on_exit(
    spawn_probe: ProbeSpawner, region_path: Path, build: Build
) -> None:
    proc = spawn_probe(
        "init", "ctx", "alloc 600m",
        "fork", "init", "ctx", "alloc 300m", "alloc 200m", "sleep 2000", "forkwait",
        "info", "hold",
        env=limited(region_path), build=build,
    )  # fmt: skip
    seen = lines_until(proc, lambda ls: len(of(ls, "alloc", True)) == 2 and of(ls, "fork", False))
    child = of(seen, "fork", False)[0]["pid"]
    assert of(seen, "alloc", False)[0]["rc"] == 0, proc.describe()
    # 600m + 300m fit the 1 GiB; 200m more would not
    assert [a["rc"] for a in of(seen, "alloc", True)] == [0, 2], proc.describe()
    assert slots(region_path) == ({proc.pid: 600 * MiB, child: 300 * MiB}, 900 * MiB)

    proc.wait_for("hold", timeout=20)
    waited = of(proc.lines, "forkwait", False)
    assert [w["status"] for w in waited] == [0], proc.describe()
    assert of(proc.lines, "info", False)[0]["free"] == GiB - 600 * MiB, proc.describe()
    assert slots(region_path) == ({proc.pid: 600 * MiB}, 600 * MiB)


def test_a_child_pays_for_its_own_context_and_releases_only_its_own(
    run_probe: ProbeRunner, region_path: Path
) -> None:
    """The parent's primary context is the parent's: the child's costs the context
    overhead again, and releasing it gives back the child's context and memory only."""
    result = run_probe(
        "init", "ctx", "alloc 500m",
        "fork", "init", "ctx", "alloc 200m", "alloc 200m", "release", "info", "forkwait",
        "info",
        env=limited(region_path, GPUSLICE_CONTEXT_OVERHEAD="100m"),
    )  # fmt: skip
    lines = result.lines
    # parent 100m + 500m, child 100m + 200m: the second 200m is over the limit
    assert [a["rc"] for a in of(lines, "alloc", True)] == [0, 2], result.describe()
    assert of(lines, "release", True)[0]["rc"] == 0, result.describe()
    assert of(lines, "info", True)[0]["free"] == GiB - 600 * MiB, result.describe()
    assert of(lines, "forkwait", False)[0]["status"] == 0, result.describe()
    assert of(lines, "info", False)[0]["free"] == GiB - 600 * MiB, result.describe()


async def test_parent_and_child_publish_under_their_own_pid(
    nats_server: NatsServer, spawn_probe: ProbeSpawner, region_path: Path
) -> None:
    uid = pod_uid()
    async with feed(nats_server.url, subject(uid)) as f:
        proc = spawn_probe(
            "init", "ctx", "alloc 100m", "sleep 300",
            "fork", "init", "ctx", "alloc 50m", "sleep 1500", "forkwait",
            "sleep 1000",
            env=telemetry_env(nats_server.url, region_path, uid),
        )  # fmt: skip
        f.probe = proc
        child = (await line(proc, "fork"))["pid"]
        both = 150 * MiB
        from_child = await f.until(
            lambda s: s.pid == child and s.devices[0].used_bytes == both, what="from the child"
        )
        await f.until(
            lambda s: s.pid == proc.pid and s.devices[0].used_bytes == both,
            what="from the parent while the child lives",
        )
        assert (await line(proc, "forkwait"))["status"] == 0
        exited = datetime.now(UTC)
        # the child closed only its copy of the parent's connection
        after = await f.until(
            lambda s: s.pid == proc.pid and s.time >= exited, what="from the parent afterwards"
        )
        stderr = await ended(proc)
    assert after.devices[0].used_bytes == 100 * MiB
    assert {r.sample.pid for r in f.seen} == {proc.pid, child}
    assert (from_child.pod_uid, from_child.container) == (uid, "trainer")
    # the child starts with an empty ring and no drops of its own
    assert all(r.sample.dropped_samples == 0 for r in f.seen if r.sample.pid == child)
    for pid in (proc.pid, child):
        assert stderr.count(f"gpuslice[{pid}] info: telemetry: connected to NATS") == 1, stderr
    assert "lost the connection" not in stderr, stderr
