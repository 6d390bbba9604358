"""``gpuslice audit tail`` and ``audit export`` against a real nats-server with JetStream."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import pytest
from click.testing import Result
from typer.testing import CliRunner

from gpuslice_cli.audit import parse_since, parse_types
from gpuslice_cli.main import app
from gpuslice_common.bus import Bus
from gpuslice_common.config import CommonSettings
from gpuslice_common.events import (
    AllocationEvent,
    CloudEvent,
    EventType,
    PodAdmitted,
    PodDenied,
    make_event,
    parse_event,
)
from gpuslice_common.models import (
    ContainerAssignment,
    ContainerGpuRequest,
    DeviceGrant,
    MemoryRequest,
    PodRef,
    utcnow,
)
from gpuslice_common.servers import NatsServer, free_port

ROOT = Path(__file__).resolve().parent.parent
TRAIN = PodRef(uid="uid-train-0", namespace="team-a", name="train-0")
INFER = PodRef(uid="uid-infer-1", namespace="team-b", name="infer-1")


def alloc(
    kind: EventType,
    pod: PodRef | None,
    node: str,
    reason: str = "",
    time_ago: timedelta | None = None,
) -> CloudEvent:
    grant = DeviceGrant(uuid=f"GPU-{node}-0", memory_mib=4096, cores=30)
    containers = () if pod is None else (ContainerAssignment(name="main", devices=(grant,)),)
    payload = AllocationEvent(
        pod=pod, node=node, containers=containers, policy="binpack", reason=reason
    )
    when = None if time_ago is None else utcnow() - time_ago
    return make_event(kind, payload, source="/test", time=when)


def history() -> list[CloudEvent]:
    """Two pods' lives on two nodes, and a kubelet Allocate that found no pod."""
    asked = ContainerGpuRequest(name="main", count=1, memory=MemoryRequest(mib=4096), cores=30)
    return [
        make_event(
            EventType.POD_ADMITTED, PodAdmitted(pod=TRAIN, containers=(asked,)), source="/test"
        ),
        alloc(EventType.ALLOC_RESERVED, TRAIN, "node-a"),
        alloc(EventType.ALLOC_BOUND, TRAIN, "node-a"),
        make_event(
            EventType.POD_DENIED,
            PodDenied(pod=INFER, reason="nvidia.com/gpucores above 100"),
            source="/test",
        ),
        alloc(EventType.ALLOC_RESERVED, INFER, "node-b"),
        alloc(EventType.ALLOC_FAILED, None, "node-b", reason="no pending pod asks for 1 GPU"),
        alloc(EventType.ALLOC_RELEASED, TRAIN, "node-a", reason="pod deleted"),
    ]


@pytest.fixture
def settings(nats_server: NatsServer, prefix: str) -> CommonSettings:
    return CommonSettings(nats_url=nats_server.url, subject_prefix=prefix)


@pytest.fixture
async def bus(settings: CommonSettings) -> AsyncIterator[Bus]:
    b = await Bus.connect(settings, "test-audit")
    await b.ensure_audit_stream(timedelta(days=1))
    yield b
    await b.close()


def env_for(settings: CommonSettings) -> dict[str, str]:
    return {
        "GPUSLICE_NATS_URL": settings.nats_url,
        "GPUSLICE_SUBJECT_PREFIX": settings.subject_prefix,
        "GPUSLICE_CONNECT_WAIT": "1s",
        "COLUMNS": "250",
    }


async def cli(settings: CommonSettings, *args: str) -> Result:
    """Run ``gpuslice`` in-process (in a thread: the command runs its own event loop)."""
    return await asyncio.to_thread(CliRunner().invoke, app, list(args), env=env_for(settings))


def rows(output: str) -> list[list[str]]:
    """The body rows of the tail table as written to a pipe (tab-separated
    lines after its title and header), as lists of cells."""
    lines = [line for line in output.splitlines() if not line.startswith("# ")]
    if not lines or lines[0] != "time\ttype\tpod\tnode\tdetail":  # no table
        return []
    return [line.split("\t") for line in lines[1:]]


async def publish(bus: Bus, events: list[CloudEvent]) -> None:
    for event in events:
        await bus.publish_acked(event)


async def test_tail_shows_events_in_order_with_details(bus: Bus, settings: CommonSettings) -> None:
    events = history()
    await publish(bus, events)
    result = await cli(settings, "audit", "tail", "--since", "1h")
    assert result.exit_code == 0, result.output
    assert result.stderr == ""
    got = rows(result.stdout)
    assert [r[0] for r in got] == [
        e.time.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + "Z" for e in events
    ]
    assert [r[1:] for r in got] == [
        ["pod.admitted", "team-a/train-0", "-", "main: 1 GPU x 4096 MiB, 30% cores"],
        [
            "alloc.reserved",
            "team-a/train-0",
            "node-a",
            "main: GPU-node-a-0 4096 MiB 30%; policy binpack",
        ],
        [
            "alloc.bound",
            "team-a/train-0",
            "node-a",
            "main: GPU-node-a-0 4096 MiB 30%; policy binpack",
        ],
        ["pod.denied", "team-b/infer-1", "-", "nvidia.com/gpucores above 100"],
        [
            "alloc.reserved",
            "team-b/infer-1",
            "node-b",
            "main: GPU-node-b-0 4096 MiB 30%; policy binpack",
        ],
        [
            "alloc.failed",
            "-",
            "node-b",
            "policy binpack; reason: no pending pod asks for 1 GPU",
        ],
        [
            "alloc.released",
            "team-a/train-0",
            "node-a",
            "main: GPU-node-a-0 4096 MiB 30%; policy binpack; reason: pod deleted",
        ],
    ]
    assert "7 events since" in result.stdout


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (["--pod", "train-0"], [0, 1, 2, 6]),
        (["--pod", "uid-infer-1"], [3, 4]),
        (["--pod", "team-b/infer-1"], [3, 4]),
        (["--pod", "nobody"], []),
        (["--node", "node-b"], [4, 5]),
        (["--type", "alloc.released"], [6]),
        (["--type", "alloc.reserved", "--type", "io.gpuslice.pod.denied"], [1, 3, 4]),
        (["--type", "alloc.reserved,alloc.failed", "--node", "node-b"], [4, 5]),
        (["--pod", "train-0", "--node", "node-a", "--type", "alloc.bound"], [2]),
    ],
)
async def test_tail_filters(
    bus: Bus, settings: CommonSettings, options: list[str], expected: list[int]
) -> None:
    events = history()
    await publish(bus, events)
    result = await cli(settings, "audit", "tail", *options)
    assert result.exit_code == 0, result.output
    want = [events[i] for i in expected]
    assert [(r[1], r[2], r[3]) for r in rows(result.stdout)] == [
        (
            e.type.suffix,
            f"{e.data['pod']['namespace']}/{e.data['pod']['name']}" if e.data.get("pod") else "-",
            e.data.get("node", "-"),
        )
        for e in want
    ]
    if not want:
        assert result.stdout.startswith("no events since ")


async def test_export_writes_one_event_per_line_and_nothing_else(
    bus: Bus, settings: CommonSettings
) -> None:
    events = history()
    await publish(bus, events)
    result = await cli(settings, "audit", "export", "--since", "1h")
    assert result.exit_code == 0, result.output
    lines = result.stdout_bytes.split(b"\n")
    assert lines[-1] == b""
    assert lines[:-1] == [e.to_json() for e in events]
    assert [parse_event(line) for line in lines[:-1]] == events
    assert [parse_event(line).id for line in lines[:-1]] == [e.id for e in events]
    assert result.stderr.startswith("exported 7 events since ")

    only = await cli(settings, "audit", "export", "--since", "1h", "--type", "alloc.reserved")
    assert [parse_event(line).id for line in only.stdout_bytes.splitlines()] == [
        events[1].id,
        events[4].id,
    ]


async def test_an_event_stored_twice_is_shown_once(bus: Bus, settings: CommonSettings) -> None:
    """Re-published after the stream's duplicate window (here: with another message
    id), an event is stored twice; readers see it once."""
    events = history()[:3]
    await publish(bus, events)
    again = events[1]
    await bus.js.publish(
        bus.subjects.event(again.type), again.to_json(), headers={"Nats-Msg-Id": "retry"}
    )
    info = await bus.js.stream_info(bus.subjects.audit_stream)
    assert info.state.messages == 4
    result = await cli(settings, "audit", "export", "--since", "1h")
    assert [parse_event(line).id for line in result.stdout_bytes.splitlines()] == [
        e.id for e in events
    ]
    tail = await cli(settings, "audit", "tail")
    assert len(rows(tail.stdout)) == 3


async def test_a_malformed_stored_message_is_skipped_with_a_warning(
    bus: Bus, settings: CommonSettings
) -> None:
    events = history()[:2]
    await publish(bus, events[:1])
    await bus.js.publish(bus.subjects.event(EventType.ALLOC_BOUND), b"{not json")
    await publish(bus, events[1:])
    result = await cli(settings, "audit", "export", "--since", "1h")
    assert result.exit_code == 0, result.output
    assert result.stdout_bytes.splitlines() == [e.to_json() for e in events]
    assert result.stderr.startswith("warning: skipped a malformed event: stream sequence 2: ")
    assert "exported 2 events since" in result.stderr


async def test_since_selects_by_the_time_the_stream_stored_the_event(
    bus: Bus, settings: CommonSettings
) -> None:
    """JetStream seeks by its own storage time: an event's ``time`` (its publisher's
    word) does not decide whether --since includes it."""
    # stored now, though they claim to have happened days ago
    old = alloc(EventType.ALLOC_RESERVED, TRAIN, "node-a", time_ago=timedelta(days=2))
    await publish(bus, [old])
    await asyncio.sleep(0.05)
    cutoff = utcnow()
    await asyncio.sleep(0.05)
    new = alloc(EventType.ALLOC_BOUND, TRAIN, "node-a", time_ago=timedelta(days=3))
    await publish(bus, [new])

    async def exported(since: str) -> list[str]:
        result = await cli(settings, "audit", "export", "--since", since)
        assert result.exit_code == 0, result.output
        return [parse_event(line).id for line in result.stdout_bytes.splitlines()]

    assert await exported("1h") == [old.id, new.id]
    assert await exported(cutoff.isoformat()) == [new.id]
    assert await exported(cutoff.isoformat().replace("+00:00", "Z")) == [new.id]
    assert await exported((utcnow() + timedelta(seconds=1)).isoformat()) == []

    # a duration counts back from when the command starts
    await asyncio.sleep(2.5)
    newest = alloc(EventType.ALLOC_RELEASED, TRAIN, "node-a", time_ago=timedelta(days=4))
    await publish(bus, [newest])
    assert await exported("1500ms") == [newest.id]
    assert await exported("1h") == [old.id, new.id, newest.id]


async def test_empty_stream_and_nothing_since(bus: Bus, settings: CommonSettings) -> None:
    result = await cli(settings, "audit", "tail")
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("no events since ")
    exported = await cli(settings, "audit", "export", "--since", "1d")
    assert (exported.exit_code, exported.stdout, exported.stderr.split(" since")[0]) == (
        0,
        "",
        "exported 0 events",
    )


async def test_missing_stream_is_a_clean_error(settings: CommonSettings) -> None:
    for args in (["tail"], ["tail", "--follow"], ["export", "--since", "1h"]):
        result = await cli(settings, "audit", *args)
        assert result.exit_code == 1, result.output
        assert isinstance(result.exception, SystemExit)
        assert result.stdout == ""
        assert result.stderr == (
            f"error: audit stream {settings.subject_prefix}_audit does not exist on NATS at "
            f"{settings.nats_url} (subject prefix {settings.subject_prefix!r}; "
            "gpuslice's services create it)\n"
        )


async def test_the_missing_stream_error_names_nats_without_the_password(
    settings: CommonSettings,
) -> None:
    """A URL with a login (as dev up prints it) is named without its password."""
    host = settings.nats_url.removeprefix("nats://")
    with_login = settings.model_copy(update={"nats_url": f"nats://auditor:hunter2secret@{host}"})
    result = await cli(with_login, "audit", "tail")
    assert result.exit_code == 1, result.output
    assert f"NATS at nats://auditor@{host} " in result.stderr
    assert "hunter2secret" not in result.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["tail", "--since", "forever"], "error: --since: not a duration: 'forever'"),
        (["tail", "--since", "-5m"], "error: --since: not a duration: '-5m'"),
        (["export", "--since", "0s"], "error: --since: duration must be positive"),
        (
            ["export", "--since", "2024-05-01T12:00:00"],
            "error: --since: time '2024-05-01T12:00:00' has no UTC offset",
        ),
        (
            ["tail", "--type", "alloc.exploded"],
            "error: --type: unknown event type 'alloc.exploded'",
        ),
    ],
)
async def test_bad_options_exit_2_with_one_line(
    settings: CommonSettings, args: list[str], message: str
) -> None:
    result = await cli(settings, "audit", *args)
    assert result.exit_code == 2
    assert result.stdout == ""
    assert result.stderr.startswith(message)
    assert result.stderr.count("\n") == 1


def test_export_requires_since() -> None:
    result = CliRunner().invoke(app, ["audit", "export"])
    assert result.exit_code == 2
    assert "--since" in result.output


def test_parse_since_and_types() -> None:
    now = utcnow()
    assert parse_since("90m", now) == now - timedelta(minutes=90)
    assert parse_since("2024-05-01T12:00:00+02:00").isoformat() == "2024-05-01T10:00:00+00:00"
    assert parse_types(["alloc.bound", "io.gpuslice.alloc.bound,pod.denied"]) == {
        EventType.ALLOC_BOUND,
        EventType.POD_DENIED,
    }
    assert parse_types([]) == frozenset()


async def run_process(*args: str, env: dict[str, str]) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "gpuslice_cli.main",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, **env},
        cwd=ROOT,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_nats_down_is_a_clean_error_not_a_traceback() -> None:
    dead = f"nats://127.0.0.1:{free_port()}"
    env = {"GPUSLICE_CONNECT_WAIT": "300ms"}
    for args in (["tail"], ["export", "--since", "1h"], ["tail", "--follow"]):
        code, out, err = await run_process("audit", *args, "--nats-url", dead, env=env)
        assert code == 1
        assert out == ""
        assert err == f"error: cannot connect to NATS at {dead}: no server answered there\n"
        assert "Error()" not in err  # the client's exception in words, not its repr


async def test_follow_shows_backlog_then_new_events_each_once(
    bus: Bus, settings: CommonSettings
) -> None:
    backlog = history()
    await publish(bus, backlog)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "gpuslice_cli.main",
        "audit",
        "tail",
        "--follow",
        "--since",
        "1h",
        "--pod",
        "train-0",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, **env_for(settings)},
        cwd=ROOT,
    )
    assert proc.stdout is not None
    assert proc.stderr is not None
    seen: list[str] = []
    lines: list[str] = []

    async def read_until(count: int) -> None:
        assert proc.stdout is not None
        while len(seen) < count:
            line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
            assert line, "gpuslice audit tail --follow ended early"
            lines.append(line)
            if "team-a/train-0" in line:
                seen.append(line)

    try:
        # Publish while the command starts, reads the backlog and turns to live
        # events: each must show up once, in order, whenever it lands.
        live = []
        started = time.monotonic()
        while time.monotonic() - started < 3.0:
            event = alloc(EventType.ALLOC_BOUND, TRAIN, "node-a", reason=f"live-{len(live)}")
            await publish(bus, [event])
            live.append(event)
            await asyncio.sleep(0.1)
        await read_until(4 + len(live))
        # and one more well after it follows
        last = alloc(EventType.ALLOC_RELEASED, TRAIN, "node-a", reason="the end")
        await publish(bus, [last])
        await read_until(5 + len(live))
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        code = await asyncio.wait_for(proc.wait(), 10)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    stderr = (await proc.stderr.read()).decode()
    assert code == 0, stderr
    assert "Traceback" not in stderr
    assert lines[0].split() == ["time", "type", "pod", "node", "detail"]
    wanted = [backlog[i] for i in (0, 1, 2, 6)] + live + [last]
    assert [line.split()[2] for line in seen] == [e.type.suffix for e in wanted]
    assert [line.rsplit("reason: ", 1)[-1].strip() for line in seen[4:]] == [
        f"live-{i}" for i in range(len(live))
    ] + ["the end"]
    rest = (await proc.stdout.read()).decode()
    assert "team-a/train-0" not in rest  # nothing shown twice after the end either


async def piped_to_head(settings: CommonSettings, *args: str) -> tuple[int, str, bytes]:
    """``gpuslice audit ... | head -1`` through a real pipe: the command's exit
    code and stderr, and what head printed."""
    reader, writer = os.pipe()
    try:
        command = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "gpuslice_cli.main",
            "audit",
            *args,
            stdout=writer,
            stderr=asyncio.subprocess.PIPE,
            env={**os.environ, **env_for(settings)},
            cwd=ROOT,
        )
        head = await asyncio.create_subprocess_exec(
            "head", "-1", stdin=reader, stdout=asyncio.subprocess.PIPE
        )
    finally:
        os.close(reader)
        os.close(writer)
    first, _ = await asyncio.wait_for(head.communicate(), 60)
    _, err = await asyncio.wait_for(command.communicate(), 60)
    assert command.returncode is not None
    return command.returncode, err.decode(), first


async def test_a_reader_that_stops_early_ends_the_command_quietly(
    bus: Bus, settings: CommonSettings
) -> None:
    """``| head -1`` closes the pipe after one line: a normal end for a command
    that writes lines (exit 0, nothing on stderr), also for the table. The
    events are far more than a pipe and stdout's buffer hold, so the command
    is still writing when head is gone."""
    events = [e for _ in range(300) for e in history()]
    for start in range(0, len(events), 100):
        await asyncio.gather(*(bus.publish_acked(e) for e in events[start : start + 100]))
    code, err, first = await piped_to_head(settings, "export", "--since", "10m")
    assert (code, err) == (0, "")
    assert parse_event(first.rstrip(b"\n")).type is EventType.POD_ADMITTED
    code, err, first = await piped_to_head(settings, "tail", "--since", "10m")
    assert (code, err) == (0, "")
    assert first.startswith(b"# 2100 events since ")
