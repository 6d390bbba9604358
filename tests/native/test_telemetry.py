"""Telemetry from the interposer: samples published to a real nats-server over the
plain NATS protocol, and the CUDA calls never waiting on the network.

The probe runs under the fake driver with GPUSLICE_NATS_URL set; a nats-py
subscriber reads `<prefix>.telemetry.<node token>.<pod uid>` and parses every
message with TelemetrySample, the model the Python side uses.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager, closing
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.aio.client import Client
from nats.aio.subscription import Subscription
from nats.errors import TimeoutError as NatsTimeout

from gpuslice_common.bus import flush_client
from gpuslice_common.models import TelemetrySample
from gpuslice_common.region import Region, ffi
from gpuslice_common.servers import NatsServer, free_port
from gpuslice_common.subjects import Subjects
from tests.conftest import make_inventory
from tests.deploy.roles import PASSWORDS, manifest_roles, until
from tests.native.probe import Build, ProbeProcess, ProbeRunner, ProbeSpawner
from tests.test_ledger import placement

MiB = 1 << 20
GiB = 1 << 30
NODE = "gpu-node-7.example.com"  # a dot: the subject token writes it as '_'
FAKE_UUID = "GPU-facefeed-0000-4000-8000-000000000000"  # the fake driver's device 0


def pod_uid() -> str:
    return str(uuid.uuid4())


def telemetry_env(
    url: str,
    region: Path,
    uid: str,
    *,
    interval: str = "100ms",
    node: str = NODE,
    **extra: str | int | None,
) -> dict[str, str | int | None]:
    return {
        "GPUSLICE_NATS_URL": url,
        "GPUSLICE_NODE_NAME": node,
        "GPUSLICE_POD_UID": uid,
        "GPUSLICE_CONTAINER_NAME": "trainer",
        "GPUSLICE_TELEMETRY_INTERVAL": interval,
        "CUDA_DEVICE_MEMORY_LIMIT": "1g",
        "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(region),
        "LIBCUDA_LOG_LEVEL": 2,  # warnings and the connection's info lines
        **extra,
    }


def subject(uid: str, prefix: str = "gpuslice", node: str = NODE) -> str:
    return Subjects(prefix).telemetry(node, uid)


@dataclass
class Received:
    sample: TelemetrySample
    size: int  # payload bytes
    subject: str


@dataclass
class Feed:
    """The telemetry one subscription has received, in order."""

    client: Client
    sub: Subscription
    seen: list[Received] = field(default_factory=list)
    probe: ProbeProcess | None = None  # whose stderr a failure shows

    async def next(self, timeout: float = 5.0) -> Received:
        msg = await self.sub.next_msg(timeout=timeout)
        got = Received(TelemetrySample.model_validate_json(msg.data), len(msg.data), msg.subject)
        self.seen.append(got)
        return got

    async def until(
        self, check: Callable[[TelemetrySample], bool], timeout: float = 10.0, what: str = ""
    ) -> TelemetrySample:
        """The first sample that passes `check`; fails the test after `timeout`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while (left := deadline - loop.time()) > 0:
            try:
                got = await self.next(timeout=left)
            except NatsTimeout:
                break
            if check(got.sample):
                return got.sample
        last = [r.sample.model_dump_json() for r in self.seen[-3:]]
        stderr = f"\n--- probe stderr\n{self.probe.stderr_text()}" if self.probe else ""
        pytest.fail(
            f"no sample {what} within {timeout}s; {len(self.seen)} seen, last: {last}{stderr}"
        )

    async def quiet(self, seconds: float) -> list[Received]:
        """Everything that arrives within `seconds`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        got: list[Received] = []
        while (left := deadline - loop.time()) > 0:
            try:
                got.append(await self.next(timeout=left))
            except NatsTimeout:
                break
        return got


@asynccontextmanager
async def feed(
    url: str, subj: str, probe: ProbeProcess | None = None, **options: Any
) -> AsyncIterator[Feed]:
    client = await nats.connect(url, allow_reconnect=False, connect_timeout=5, **options)
    try:
        sub = await client.subscribe(subj)
        await flush_client(client)
        yield Feed(client, sub, probe=probe)
    finally:
        await client.close()


async def line(proc: ProbeProcess, cmd: str, timeout: float = 10) -> dict[str, Any]:
    return await asyncio.to_thread(proc.wait_for, cmd, timeout)


async def ended(proc: ProbeProcess, timeout: float = 30) -> str:
    """Waits for the probe's own exit (status 0); its stderr."""
    result = await asyncio.to_thread(proc.result, timeout)
    return result.stderr


def poke(region: Path, field_name: str, value: int, device: int = 0) -> None:
    """Writes one 64-bit counter of a device in the shared region, as the interposer would."""
    offset = (
        ffi.offsetof("gs_region_t", "devices")
        + device * ffi.sizeof("gs_device_t")
        + ffi.offsetof("gs_device_t", field_name)
    )
    fd = os.open(region, os.O_RDWR)
    try:
        os.pwrite(fd, value.to_bytes(8, "little"), offset)
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------- samples


@pytest.mark.parametrize("build", ["release", "asan"])
async def test_samples_report_usage_limit_and_denials(
    nats_server: NatsServer, spawn_probe: ProbeSpawner, region_path: Path, build: Build
) -> None:
    uid = pod_uid()
    async with feed(nats_server.url, subject(uid)) as f:
        started = datetime.now(UTC)
        proc = spawn_probe(
            "init", "ctx", "alloc 100m", "alloc 2g", "sleep 3000",
            env=telemetry_env(nats_server.url, region_path, uid), build=build,
        )  # fmt: skip
        f.probe = proc
        assert (await line(proc, "alloc"))["rc"] == 0
        denied = await line(proc, "alloc")
        assert denied["rc"] == 2, denied  # over the 1 GiB limit

        sample = await f.until(
            lambda s: bool(s.devices) and s.devices[0].denied_allocations >= 1,
            what="with the denial",
        )
        got = f.seen[-1]
        assert got.subject == f"gpuslice.telemetry.gpu-node-7_example_com.{uid}"
        assert sample.node == NODE
        assert sample.pod_uid == uid
        assert sample.container == "trainer"
        assert sample.pid == proc.pid
        assert started.timestamp() - 1 <= sample.time.timestamp() <= time.time() + 1
        assert sample.time.utcoffset() == timedelta(0)
        assert len(sample.devices) == 1  # the fake has one device
        dev = sample.devices[0]
        assert dev.uuid == FAKE_UUID
        assert dev.used_bytes == 100 * MiB
        assert dev.peak_bytes == 100 * MiB  # the refused 2 GiB never counted
        assert dev.limit_bytes == GiB
        assert dev.denied_allocations == 1
        assert dev.sm_percent == 0
        assert dev.throttled_ns == 0
        assert sample.dropped_samples == 0

        # one sample per interval (100 ms), in order
        more = await f.quiet(0.6)
        assert 3 <= len(more) <= 9, [r.sample.time for r in more]
        times = [r.sample.time for r in [got, *more]]
        assert times == sorted(times)
        stderr = await ended(proc)
    assert "connected to NATS" in stderr


async def test_usage_follows_allocations_and_frees(
    nats_server: NatsServer, spawn_probe: ProbeSpawner, region_path: Path, prefix: str
) -> None:
    uid = pod_uid()
    env = telemetry_env(nats_server.url, region_path, uid, GPUSLICE_SUBJECT_PREFIX=prefix)
    async with feed(nats_server.url, subject(uid, prefix)) as f:
        proc = spawn_probe(
            "init", "ctx", "sleep 500", "alloc 300m", "sleep 500", "free 0", "sleep 500", env=env
        )
        f.probe = proc
        await f.until(lambda s: s.devices[0].used_bytes == 300 * MiB, what="holding 300 MiB")
        await f.until(lambda s: s.devices[0].used_bytes == 0, what="after the free")
        await ended(proc)
    used = [r.sample.devices[0].used_bytes for r in f.seen]
    assert used[0] == 0, used
    assert f.seen[0].subject.startswith(f"{prefix}.telemetry."), f.seen[0].subject


async def test_samples_carry_the_regions_peak_after_the_memory_is_freed(
    nats_server: NatsServer, spawn_probe: ProbeSpawner, region_path: Path
) -> None:
    uid = pod_uid()
    async with feed(nats_server.url, subject(uid)) as f:
        proc = spawn_probe(
            "init", "ctx", "sleep 300", "alloc 300m", "alloc 100m", "sleep 500",
            "free 0", "free 1", "sleep 500",
            env=telemetry_env(nats_server.url, region_path, uid),
        )  # fmt: skip
        f.probe = proc
        await f.until(
            lambda s: bool(s.devices) and s.devices[0].used_bytes == 400 * MiB,
            what="holding 400 MiB",
        )
        freed = await f.until(lambda s: s.devices[0].used_bytes == 0, what="after the frees")
        await ended(proc)
    with Region.open(region_path) as region:
        [device] = region.devices()
    assert device.peak_bytes == 400 * MiB
    assert freed.devices[0].peak_bytes == device.peak_bytes
    # a region's peak only rises: from nothing before the allocations
    peaks = [r.sample.devices[0].peak_bytes for r in f.seen if r.sample.devices]
    assert peaks[0] == 0, peaks
    assert peaks == sorted(peaks), peaks


async def test_sm_use_and_throttling_under_a_compute_limit(
    nats_server: NatsServer, spawn_probe: ProbeSpawner, region_path: Path
) -> None:
    uid = pod_uid()
    env = telemetry_env(
        nats_server.url, region_path, uid, interval="250ms",
        CUDA_DEVICE_SM_LIMIT=40, GPU_CORE_UTILIZATION_POLICY="force",
    )  # fmt: skip
    async with feed(nats_server.url, subject(uid)) as f:
        proc = spawn_probe("init", "ctx", "run 2.5 2000 kernel", "sleep 300", env=env)
        f.probe = proc
        await line(proc, "ctx")
        await asyncio.sleep(1.0)  # let the limiter settle
        settled = datetime.now(UTC)
        busy = [
            (await f.until(lambda s: s.time >= settled)).devices[0],
            (await f.next()).sample.devices[0],
            (await f.next()).sample.devices[0],
        ]
        await ended(proc)
    # each sample: the share of the last 250 ms
    percents = [d.sm_percent for d in busy]
    assert all(25 <= p <= 55 for p in percents), percents
    assert busy[-1].throttled_ns > 0
    assert busy[0].throttled_ns <= busy[1].throttled_ns <= busy[2].throttled_ns


async def test_names_are_escaped_as_json(
    nats_server: NatsServer, run_probe: ProbeRunner, region_path: Path
) -> None:
    """The C client escapes what it writes; the raw JSON it sent is read here (the
    model refuses such a container name: no Kubernetes container has one)."""
    uid = pod_uid()
    name = 'main "trainer" \\ ünïcode\ttab'
    async with feed(nats_server.url, subject(uid)) as f:
        env = telemetry_env(nats_server.url, region_path, uid, GPUSLICE_CONTAINER_NAME=name)
        await asyncio.to_thread(run_probe, "init", "ctx", "sleep 400", env=env)
        raw = (await f.sub.next_msg(timeout=5)).data
    doc = json.loads(raw)  # strict: a raw control character in a string is an error
    assert doc["container"] == name
    assert b'\\"trainer\\"' in raw
    assert b"\t" not in raw


def blocked_signals(status: str) -> int:
    """The SigBlk mask of a /proc/<pid>/task/<tid>/status text."""
    for row in status.splitlines():
        if row.startswith("SigBlk:"):
            return int(row.split()[1], 16)
    raise AssertionError(f"no SigBlk in {status!r}")


@dataclass
class Threads:
    names: dict[int, str]  # tid -> comm
    blocked: dict[int, int]  # tid -> SigBlk
    socket_flags: list[int]  # the open flags of every socket


def threads_of(pid: int) -> Threads:
    proc = Path(f"/proc/{pid}")
    names: dict[int, str] = {}
    blocked: dict[int, int] = {}
    for task in (proc / "task").iterdir():
        names[int(task.name)] = (task / "comm").read_text().strip()
        blocked[int(task.name)] = blocked_signals((task / "status").read_text())
    flags = []
    for fd in (proc / "fd").iterdir():
        if os.readlink(fd).startswith("socket:"):
            info = (proc / "fdinfo" / fd.name).read_text().splitlines()
            flags += [int(row.split()[1], 8) for row in info if row.startswith("flags:")]
    return Threads(names, blocked, flags)


async def test_the_publisher_thread_keeps_out_of_the_applications_way(
    nats_server: NatsServer, spawn_probe: ProbeSpawner, region_path: Path
) -> None:
    """Named gpuslice-telem, every signal blocked in it (the application's handlers
    never run there) and none in the application's threads, a close-on-exec socket."""
    uid = pod_uid()
    async with feed(nats_server.url, subject(uid)) as f:
        proc = spawn_probe(
            "init", "ctx", "sleep 1500", env=telemetry_env(nats_server.url, region_path, uid)
        )
        f.probe = proc
        await f.next()  # connected and publishing
        threads = threads_of(proc.pid)
        await ended(proc)
    telem = [tid for tid, name in threads.names.items() if name == "gpuslice-telem"]
    assert len(telem) == 1, threads.names
    # every standard signal but SIGKILL and SIGSTOP, which cannot be blocked
    wanted = sum(1 << (sig - 1) for sig in range(1, 32) if sig not in (9, 19))
    assert threads.blocked[telem[0]] & wanted == wanted, hex(threads.blocked[telem[0]])
    assert threads.blocked[proc.pid] == 0, threads.blocked
    assert len(threads.socket_flags) == 1, threads.socket_flags
    assert threads.socket_flags[0] & os.O_CLOEXEC, oct(threads.socket_flags[0])


# ----------------------------------------------------------------------------- outages


def closed_port_url() -> str:
    return f"nats://127.0.0.1:{free_port()}"


@pytest.mark.parametrize("build", ["release", "asan"])
@pytest.mark.parametrize("server", ["closed-port", "silent", "unresolvable", "tls"])
def test_cuda_calls_never_wait_for_nats(
    run_probe: ProbeRunner, region_path: Path, build: Build, server: str
) -> None:
    with closing(socket.socket()) as silent:
        # "silent" accepts connections (the kernel's backlog) and never says a word
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        url = {
            "closed-port": closed_port_url(),
            "silent": f"nats://127.0.0.1:{silent.getsockname()[1]}",
            "unresolvable": "nats://nats.gpuslice.invalid:4222",
            "tls": "tls://127.0.0.1:4222",
        }[server]
        env = telemetry_env(url, region_path, pod_uid(), interval="10ms")
        started = time.monotonic()
        result = run_probe("init", "ctx", *["alloc 1m"] * 20, "sleep 300", env=env, build=build)
        took = time.monotonic() - started
    allocs = result.by_cmd("alloc")
    assert [a["rc"] for a in allocs] == [0] * 20, result.describe()
    assert sum(a["ns"] for a in allocs) < 1e9, result.describe()
    assert took < 10, result.describe()  # the process exits without waiting for the thread
    if server == "tls":
        assert result.stderr.count("TLS is not supported") == 1, result.stderr
    elif server == "closed-port":
        # one warning for the outage, not one per attempt or sample
        assert result.stderr.count("cannot reach NATS") == 1, result.stderr


async def test_samples_wait_in_the_ring_until_nats_starts_and_drops_are_counted(
    own_nats: NatsServer, spawn_probe: ProbeSpawner, region_path: Path
) -> None:
    uid = pod_uid()
    own_nats.stop()
    env = telemetry_env(own_nats.url, region_path, uid, interval="50ms", GPUSLICE_TELEMETRY_RING=2)
    proc = spawn_probe("init", "ctx", "alloc 64m", "sleep 6000", env=env)
    assert (await line(proc, "alloc"))["rc"] == 0
    await asyncio.sleep(1.0)  # ~20 samples taken, the ring keeps 2
    own_nats.start()
    async with feed(own_nats.url, subject(uid), proc) as f:
        sample = await f.until(lambda s: s.dropped_samples > 0, what="counting drops")
        assert sample.devices[0].used_bytes == 64 * MiB
        assert sample.pid == proc.pid
        # drops stay counted, and later samples keep coming
        later = await f.until(lambda s: s.time > sample.time, timeout=5)
        assert later.dropped_samples >= sample.dropped_samples >= 10
    proc.stop()
    stderr = proc.stderr_text()
    assert stderr.count("cannot reach NATS") == 1, stderr


async def test_publishing_resumes_after_nats_is_killed_and_restarted(
    own_nats: NatsServer, spawn_probe: ProbeSpawner, region_path: Path
) -> None:
    uid = pod_uid()
    proc = spawn_probe(
        "init", "ctx", "alloc 32m", "sleep 8000",
        env=telemetry_env(own_nats.url, region_path, uid),
    )  # fmt: skip
    assert (await line(proc, "alloc"))["rc"] == 0
    async with feed(own_nats.url, subject(uid), proc) as f:
        before = (await f.next()).sample
    own_nats.kill()
    await asyncio.sleep(0.7)
    own_nats.start()
    restarted = datetime.now(UTC)
    async with feed(own_nats.url, subject(uid), proc) as f:
        after = await f.until(lambda s: s.time >= restarted, what="after the restart")
    assert after.pid == before.pid == proc.pid
    assert after.devices[0].used_bytes == 32 * MiB
    proc.stop()
    stderr = proc.stderr_text()
    assert stderr.count("lost the connection to NATS") == 1, stderr
    assert stderr.count("connected to NATS") == 2, stderr


async def test_a_second_url_takes_over(
    nats_server: NatsServer, run_probe: ProbeRunner, region_path: Path
) -> None:
    uid = pod_uid()
    urls = f"{closed_port_url()}, {nats_server.url}"
    async with feed(nats_server.url, subject(uid)) as f:
        env = telemetry_env(urls, region_path, uid)
        await asyncio.to_thread(run_probe, "init", "ctx", "sleep 1000", env=env)
        sample = await f.until(lambda s: bool(s.devices), timeout=5)
    assert sample.devices[0].uuid == FAKE_UUID


class PingCountingServer:
    """Just enough of a NATS server on a thread: INFO, a PONG for every PING (the
    handshake's and the keep-alives), and a count of connections and PINGs."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.connections = 0
        self.pings = 0  # from the client, after each connection's first (the handshake's)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.sock.getsockname()[1]}"

    def _serve(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self.sock.accept()
                self.connections += 1
                threading.Thread(target=self._talk, args=(conn,), daemon=True).start()

    def _talk(self, conn: socket.socket) -> None:
        with closing(conn), contextlib.suppress(OSError):
            conn.sendall(b'INFO {"server_id":"fake","max_payload":1048576}\r\n')
            buf, first = b"", True
            while data := conn.recv(65536):
                buf += data
                *lines, buf = buf.split(b"\r\n")
                for row in lines:
                    if row == b"PING":
                        self.pings += 0 if first else 1
                        first = False
                        conn.sendall(b"PONG\r\n")

    def close(self) -> None:
        self.sock.close()


@pytest.mark.slow
def test_a_healthy_link_survives_its_keepalive_pings(
    run_probe: ProbeRunner, region_path: Path
) -> None:
    """The link PINGs every 15 s; queueing that PING must not look like a server that
    takes no data (which dropped and reconnected a healthy link every 15 s)."""
    server = PingCountingServer()
    try:
        env = telemetry_env(server.url, region_path, pod_uid())
        result = run_probe("init", "ctx", "sleep 17000", env=env, timeout=40)
    finally:
        server.close()
    assert "lost the connection" not in result.stderr, result.stderr
    assert result.stderr.count("connected to NATS") == 1, result.stderr
    assert server.connections == 1
    assert server.pings >= 1  # the keep-alive went out, and its PONG kept the link


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


async def test_an_enormous_interval_does_not_spin(
    spawn_probe: ProbeSpawner, region_path: Path
) -> None:
    """An interval near 2**64 ns once made next_sample wrap into the past: a sample
    per loop and poll() with no timeout, a core burnt."""
    env = telemetry_env(closed_port_url(), region_path, pod_uid(), interval="18446744073")
    proc = spawn_probe("init", "ctx", "sleep 3000", env=env)
    await line(proc, "ctx")
    await asyncio.sleep(0.3)
    before = cpu_seconds(proc.pid)
    await asyncio.sleep(1.5)
    burnt = cpu_seconds(proc.pid) - before
    await ended(proc)
    assert burnt < 0.3, f"{burnt:.2f}s of CPU in 1.5s\n{proc.stderr_text()}"


# ----------------------------------------------------------------------------- credentials

USER, PASSWORD, TOKEN = "probe", "p@ss:w0rd", "s3cr3t-t0ken"


@pytest.mark.parametrize("how", ["env-user", "url-user", "env-token", "url-token"])
async def test_credentials(
    tmp_path: Path, spawn_probe: ProbeSpawner, region_path: Path, how: str
) -> None:
    token = how.endswith("token")
    config = (
        f'authorization {{ token: "{TOKEN}" }}\n'
        if token
        else f'authorization {{ user: "{USER}", password: "{PASSWORD}" }}\n'
    )
    uid = pod_uid()
    with NatsServer(tmp_path / "nats", config=config) as server:
        host = f"127.0.0.1:{server.port}"
        creds: Mapping[str, str] = {
            "env-user": {"GPUSLICE_NATS_USER": USER, "GPUSLICE_NATS_PASSWORD": PASSWORD},
            "url-user": {},
            "env-token": {"GPUSLICE_NATS_TOKEN": TOKEN},
            "url-token": {},
        }[how]
        url = {
            "url-user": f"nats://{USER}:p%40ss%3Aw0rd@{host}",
            "url-token": f"nats://{TOKEN}@{host}",
        }.get(how, f"nats://{host}")
        login: dict[str, Any] = {"token": TOKEN} if token else {"user": USER, "password": PASSWORD}
        async with feed(f"nats://{host}", subject(uid), **login) as f:
            proc = spawn_probe(
                "init", "ctx", "sleep 1500", env=telemetry_env(url, region_path, uid, **creds)
            )
            f.probe = proc
            sample = await f.until(lambda s: bool(s.devices), timeout=5)
            assert sample.pid == proc.pid
            await ended(proc)


async def test_wrong_credentials_publish_nothing_and_warn_once(
    tmp_path: Path, run_probe: ProbeRunner, region_path: Path
) -> None:
    uid = pod_uid()
    config = f'authorization {{ user: "{USER}", password: "{PASSWORD}" }}\n'
    with NatsServer(tmp_path / "nats", config=config) as server:
        async with feed(server.url, subject(uid), user=USER, password=PASSWORD) as f:
            env = telemetry_env(
                server.url, region_path, uid,
                GPUSLICE_NATS_USER=USER, GPUSLICE_NATS_PASSWORD="wrong",
            )  # fmt: skip
            result = await asyncio.to_thread(
                run_probe, "init", "ctx", "alloc 1m", "sleep 1500", env=env
            )
            assert await f.quiet(0.3) == []
    assert result.one("alloc")["rc"] == 0
    assert result.stderr.count("Authorization Violation") == 1, result.stderr


# ----------------------------------------------------------------------------- payload limit


async def test_samples_above_max_payload_are_dropped_not_sent(
    own_nats: NatsServer, tmp_path: Path, spawn_probe: ProbeSpawner, region_path: Path
) -> None:
    """A sample larger than the server's max_payload would make the server close the
    connection (-ERR 'Maximum Payload Violation'): it is dropped and counted instead.

    The probe first publishes to own_nats, which tells the size of its samples; then
    it fails over to a server whose max_payload is just above that size, and the test
    makes samples grow (a large throttled_ns in the region) and shrink again."""
    uid = pod_uid()
    tight = NatsServer(tmp_path / "tight")
    env = telemetry_env(f"{own_nats.url},{tight.url}", region_path, uid)
    proc = spawn_probe("init", "ctx", "alloc 1m", "sleep 10000", env=env)
    async with feed(own_nats.url, subject(uid), proc) as f:
        await f.until(lambda s: s.devices[0].used_bytes == MiB)  # no size changes after this
        size = f.seen[-1].size
    tight.config = f"max_payload: {size + 6}\n"
    with tight:
        own_nats.stop()
        async with feed(tight.url, subject(uid), proc) as f:
            first = await f.until(lambda s: True, what="on the tight server")
            small = first.dropped_samples
            poke(region_path, "throttled_ns", 10**15)  # 15 more digits: above max_payload
            await asyncio.sleep(0.3)
            grown = await f.quiet(0.7)
            # the largest that can pass is 6 bytes above the first one
            assert all(r.sample.devices[0].throttled_ns != 10**15 for r in grown)
            poke(region_path, "throttled_ns", 0)
            back = await f.until(lambda s: s.dropped_samples > small, what="after the drops")
    assert back.devices[0].throttled_ns == 0
    assert back.dropped_samples - small >= 5
    proc.stop()
    stderr = proc.stderr_text()
    assert f"connected to NATS at 127.0.0.1:{tight.port}" in stderr
    assert stderr.count("connected to NATS") == 2, stderr  # own_nats, then tight: no reconnect
    assert "Maximum Payload" not in stderr
    assert stderr.count("exceeds the server's max_payload") == 1, stderr


async def test_a_container_connects_with_its_telemetry_token_under_the_manifests_nats(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    redis_url: str,
    spawn_probe: ProbeSpawner,
    region_path: Path,
) -> None:
    """k8s/nats.yaml's server and the inventory's auth callout: the token the
    inventory issued for this pod lets the interposer in, for its own subject."""
    uid = pod_uid()
    async with manifest_roles(tmp_path, monkeypatch, redis_url) as roles:
        await roles.ledger.register_node(make_inventory(NODE, gpus=1), rebuilt=True)
        await roles.ledger.reserve(placement(uid, NODE, [[(0, 100, 1)]]))
        token = roles.telemetry_token(NODE, uid)
        inventory = PASSWORDS["inventory"]
        async with feed(roles.server.url, subject(uid), user="inventory", password=inventory) as f:
            env = telemetry_env(roles.server.url, region_path, uid, GPUSLICE_NATS_TOKEN=token)
            proc = spawn_probe("init", "ctx", "sleep 1500", env=env)
            f.probe = proc
            sample = await f.until(lambda s: bool(s.devices), timeout=10)
            assert sample.pod_uid == uid
            assert sample.pid == proc.pid
            stderr = await ended(proc)
        assert "connected to NATS" in stderr
        assert roles.callout.stats.accepted == {"telemetry": 1}


async def test_a_containers_session_ends_and_it_reconnects_only_while_its_pod_lives(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    redis_url: str,
    spawn_probe: ProbeSpawner,
    region_path: Path,
) -> None:
    """The callout gives a container's user an expiry (telemetry_session): the
    server closes the connection then, and the interposer connects again through
    the callout, which lets it back in while the ledger places the pod and refuses
    it once the pod is released."""
    uid = pod_uid()
    async with manifest_roles(tmp_path, monkeypatch, redis_url, telemetry_session="2s") as roles:
        await roles.ledger.register_node(make_inventory(NODE, gpus=1), rebuilt=True)
        await roles.ledger.reserve(placement(uid, NODE, [[(0, 100, 1)]]))
        token = roles.telemetry_token(NODE, uid)
        stats = roles.callout.stats
        inventory = PASSWORDS["inventory"]
        async with feed(roles.server.url, subject(uid), user="inventory", password=inventory) as f:
            env = telemetry_env(roles.server.url, region_path, uid, GPUSLICE_NATS_TOKEN=token)
            proc = spawn_probe("init", "ctx", "sleep 30000", env=env)
            f.probe = proc
            await f.until(lambda s: bool(s.devices), what="from the first session")
            await until(lambda: stats.accepted["telemetry"] >= 2, timeout=15)
            again = datetime.now(UTC)
            await f.until(lambda s: s.time > again, what="from the second session")

            await roles.ledger.release(uid, "done")
            await until(lambda: stats.refused["pod-released"] >= 1, timeout=15)
            await f.quiet(0.5)  # what was under way when the session ended
            refused = stats.refused["pod-released"]
            await until(lambda: stats.refused["pod-released"] > refused, timeout=15)
            assert f.sub.pending_msgs == 0  # no sample since
            proc.kill()
        assert "lost the connection to NATS" in proc.stderr_text()
