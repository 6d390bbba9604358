"""The manifests' NATS users and Redis ACL users, run on real servers: each role
can do its work and no more."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import nats
import pytest
import redis.asyncio as aioredis
import yaml
from redis.exceptions import AuthenticationError, NoPermissionError, ResponseError

from gpuslice_cli.status import gather_status, gather_usage
from gpuslice_common.auditstream import audit_events
from gpuslice_common.bus import Bus, flush_client
from gpuslice_common.config import CommonSettings
from gpuslice_common.events import AllocationEvent, EventType, PodDenied, make_event
from gpuslice_common.ledger import Ledger, LedgerError
from gpuslice_common.models import DeviceTelemetry, PodRef, TelemetrySample
from gpuslice_common.nkeys import KeyPair, Role
from gpuslice_common.nominations import Nominations
from gpuslice_common.servers import NatsServer, free_port
from gpuslice_inventory.lease import Lease
from gpuslice_inventory.telemetry import TelemetryStore
from tests.conftest import make_inventory
from tests.deploy.roles import (
    PASSWORDS,
    container,
    container_env,
    manifest,
    manifest_nats,
    raw_login,
    redis_render,
    redis_scripts,
    until,
)
from tests.test_ledger import placement

ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------- Redis


class LedgerMember:
    """redis-server with a member's own configuration and ACL users, written out
    by the member's own start script (lib.sh's render): a primary alone, so
    without the replicas min-replicas-to-write asks for. Stopped and started
    again on the same port and append-only file."""

    def __init__(self, directory: Path) -> None:
        redis = container("StatefulSet", "gpuslice-redis", "redis")
        assert redis["command"] == ["sh", "/etc/redis/redis.sh"]
        self.port = free_port()
        run, data = directory / "run", directory / "data"
        run.mkdir()
        data.mkdir()
        env = container_env(redis, "gpuslice-redis-0")
        env |= {
            "REDIS_PORT": str(self.port),
            "REDIS_RUN_DIR": str(run),
            "REDIS_DATA_DIR": str(data),
        }
        config = redis_scripts(directory / "config")
        for name in ("redis.conf", "users.acl"):
            (run / name).write_text(redis_render(config, name, env))
        self.argv = [shutil.which("redis-server") or "redis-server", str(run / "redis.conf")]
        self.argv += ["--bind", "127.0.0.1", "--save", ""]
        self.argv += ["--min-replicas-to-write", "0", "--replica-announce-ip", "127.0.0.1"]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            self.argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + 15
        while True:
            assert self.proc.poll() is None, f"redis-server exited: {self.argv}"
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), 1),
            ):
                return
            assert time.monotonic() < deadline, "redis-server did not listen"
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:  # busy in a script: it cannot stop cleanly
            self.proc.kill()
            self.proc.wait()
        self.proc = None


@pytest.fixture
def acl_redis(tmp_path: Path) -> Iterator[int]:
    member = LedgerMember(tmp_path)
    member.start()
    try:
        yield member.port
    finally:
        member.stop()


async def test_a_member_restarted_from_its_append_only_file_keeps_what_scripts_wrote(
    tmp_path: Path,
) -> None:
    """The ledger's scripts' writes are transactions in the append-only file,
    which Redis replays as the default user: the member's ACLs must let that
    replay through (the default user is off, not powerless)."""
    member = LedgerMember(tmp_path)
    member.start()
    try:
        inventory = Ledger.from_url(redis_url(member.port, "inventory"), "gpuslice", retries=1)
        scheduler = Ledger.from_url(redis_url(member.port, "scheduler"), "gpuslice", retries=1)
        try:
            assert await inventory.register_node(make_inventory("node-1", gpus=1), rebuilt=True)
            await scheduler.reserve(placement("p1", "node-1", [[(0, 100, 1)]]))
        finally:
            await inventory.close()
            await scheduler.close()
        member.stop()
        member.start()
        operator = Ledger.from_url(redis_url(member.port, "operator"), "gpuslice", retries=1)
        try:
            assert await operator.nodes() == ["node-1"]
            assert (await operator.placement("p1")) is not None
        finally:
            await operator.close()
        # and no one logs in as the default user
        for password in ("", "x", PASSWORDS["probe"]):
            client = aioredis.Redis(port=member.port, username="default", password=password)
            try:
                with pytest.raises((AuthenticationError, ResponseError)):
                    await client.ping()
            finally:
                await client.aclose()
    finally:
        member.stop()


def test_the_members_acl_file_is_the_manifest_s_with_the_secret_s_passwords(
    tmp_path: Path,
) -> None:
    redis = container("StatefulSet", "gpuslice-redis", "redis")
    env = container_env(redis, "gpuslice-redis-0")
    config = redis_scripts(tmp_path)
    template = manifest("ConfigMap", "gpuslice-redis")["data"]["users.acl"]
    rendered = redis_render(config, "users.acl", env)
    users = {line.split()[1]: line for line in rendered.splitlines()}
    assert set(users) == {
        "default",
        "scheduler",
        "inventory",
        "operator",
        "probe",
        "replica",
        "sentinel",
    }
    assert users["default"] == "user default off resetpass ~* &* +@all"
    for user in set(users) - {"default"}:
        assert f" on >{PASSWORDS[user]} " in users[user], user
    assert rendered == re.sub(
        r"\$\{REDIS_([A-Z]+)_PASSWORD\}", lambda m: PASSWORDS[m[1].lower()], template
    )
    # a variable the container does not have stops the start script
    with pytest.raises(subprocess.CalledProcessError):
        redis_render(config, "users.acl", {k: v for k, v in env.items() if "PROBE" not in k})


def redis_url(port: int, role: str) -> str:
    return f"redis://{role}:{PASSWORDS[role]}@127.0.0.1:{port}/0"


async def refused_what_is_not_theirs(client: aioredis.Redis) -> None:
    """Nothing outside the ledger's keys and channel, nothing that runs arbitrary code,
    changes the server or empties it."""
    for command in (
        ("SCRIPT", "FLUSH"),
        ("SCRIPT", "KILL"),
        ("FUNCTION", "LIST"),
        ("FUNCTION", "FLUSH"),
        ("FLUSHALL",),
        ("FLUSHDB",),
        ("CONFIG", "GET", "*"),
        ("CONFIG", "SET", "appendonly", "no"),
        ("KEYS", "*"),
        ("DEBUG", "SLEEP", "0"),
        ("EVAL", "return 1", "0"),
        ("SHUTDOWN",),
        ("ACL", "LIST"),
        ("SET", "not-gpuslice", "x"),
        ("GET", "not-gpuslice"),
        ("HGETALL", "other:gpus"),
        ("PUBLISH", "other-channel", "x"),
        ("SUBSCRIBE", "other-channel"),
    ):
        # DEBUG is off in the server as well, and says so first
        refused = ResponseError if command[0] == "DEBUG" else NoPermissionError
        with pytest.raises(refused, match=r"permissions|not allowed"):
            await client.execute_command(*command)


async def test_each_redis_user_runs_its_part_of_the_ledger_and_nothing_else(
    acl_redis: int,
) -> None:
    inventory = Ledger.from_url(redis_url(acl_redis, "inventory"), "gpuslice", retries=1)
    scheduler = Ledger.from_url(redis_url(acl_redis, "scheduler"), "gpuslice", retries=1)
    try:
        # the inventory registers the nodes its agents announce
        for node in ("node-1", "node-2"):
            assert await inventory.register_node(make_inventory(node, gpus=1), rebuilt=True) == 1
        # the scheduler follows changes, reads the ledger, reserves and binds
        subscribed = asyncio.Event()
        changed: asyncio.Queue[str] = asyncio.Queue()

        async def follow() -> None:
            async for node in scheduler.watch_changes(0.05, on_subscribed=subscribed.set):
                await changed.put(node)

        watcher = asyncio.create_task(follow())
        try:
            await asyncio.wait_for(subscribed.wait(), 5)
            assert await scheduler.ping()
            assert await scheduler.nodes() == ["node-1", "node-2"]
            assert set(await scheduler.read_nodes(["node-1"])) == {"node-1"}
            assert await scheduler.revisions(["node-1"])
            _, new, _ = await scheduler.reserve_new(placement("p1", "node-1", [[(0, 100, 1)]]))
            assert new
            assert await asyncio.wait_for(changed.get(), 5) == "node-1"
            await scheduler.mark_bound("p1", "node-1")
            assert (await scheduler.placement("p1")) is not None
            await scheduler.reserve(placement("p2", "node-2", [[(0, 100, 1)]]))
            released = await scheduler.release("p2", "bind failed")
            assert released is not None
            assert released.first
            # and keeps the nominations of GPU preemption
            nominations = Nominations(scheduler)
            claim = await nominations.claim(
                placement("p9", "node-2", [[(0, 100, 1)]]), 100, ["p3"], 60, [], "t"
            )
            assert claim.outcome == "ok"
            assert [n.uid for n in (await nominations.live())[0]] == ["p9"]
            await nominations.drop(["p9"])
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        # the inventory allocates, keeps liveness, expiry and reconciliation
        assert await inventory.next_allocation("node-1", 1) is not None
        allocation = await inventory.allocate("node-1", 1, "request-1")
        assert allocation.placement.pod.uid == "p1"
        assert [p.pod.uid for p in await inventory.node_placements("node-1")] == ["p1"]
        now = await inventory.now()
        assert set(await inventory.node_liveness(["node-1"])) == {"node-1"}
        assert not await inventory.mark_unavailable("node-1", now - timedelta(hours=1))
        assert await inventory.nodes_gpus(["node-1"])
        restored, _ = await inventory.restore(placement("p3", "node-2", [[(0, 100, 1)]]), True)
        assert restored.pod.uid == "p3"
        assert (await inventory.release("p1", "pod deleted")) is not None
        lease = Lease(inventory.redis, "gpuslice:inventory:lease", 1000)
        assert await lease.acquire()
        assert await lease.acquire()  # renewed
        await lease.release()
        store = TelemetryStore(inventory.redis, "gpuslice")
        sample = TelemetrySample(
            node="node-2",
            pod_uid="p3",
            container="main",
            pid=1,
            time=now,
            devices=(DeviceTelemetry(uuid="GPU-node-2-0", used_bytes=1, limit_bytes=2),),
        )
        assert store.ingest(
            store.subjects.telemetry("node-2", "p3"), sample.model_dump_json().encode()
        )
        assert await store.flush() == 1
        assert [u.pod_uid for u in await store.container_usage("node-2")] == ["p3"]
        assert await store.forget_pod("node-2", "p3") >= 1
        for ledger in (inventory, scheduler):
            await refused_what_is_not_theirs(ledger.redis)
        # the scheduler registers no node and allocates nothing
        with pytest.raises(NoPermissionError):
            await scheduler.redis.sadd("gpuslice:nodes", "node-9")
        with pytest.raises(LedgerError, match=r"can.t run this command"):
            await scheduler.allocate("node-1", 1, "from-the-scheduler")
    finally:
        await inventory.close()
        await scheduler.close()
    # node agents have no Redis user at all
    # (spoken raw: the client library retries a refused login)
    reader, writer = await asyncio.open_connection("127.0.0.1", acl_redis)
    try:
        for password in (PASSWORDS["deviceplugin"], PASSWORDS["inventory"], "x"):
            writer.write(f"AUTH deviceplugin {password}\r\n".encode())
            await writer.drain()
            assert (await reader.readline()).startswith(b"-WRONGPASS")
    finally:
        writer.close()
        await writer.wait_closed()
    anonymous = aioredis.Redis(port=acl_redis)
    try:
        with pytest.raises((AuthenticationError, ResponseError)):
            await anonymous.ping()
    finally:
        await anonymous.aclose()
    # operators read what gpuslice status shows, and write nothing
    operator = Ledger.from_url(redis_url(acl_redis, "operator"), "gpuslice", retries=1)
    try:
        nodes = await gather_status(operator)
        assert [n.node for n in nodes] == ["node-1", "node-2"]
        await gather_usage(operator, "gpuslice", nodes)
        with pytest.raises(NoPermissionError):
            await operator.redis.hset("gpuslice:nodes", "x", "y")
    finally:
        await operator.close()
    probe = aioredis.Redis(port=acl_redis, username="probe", password=PASSWORDS["probe"])
    try:
        assert await probe.ping()
        with pytest.raises(NoPermissionError):
            await probe.get("gpuslice:nodes")
    finally:
        await probe.aclose()


async def test_replication_and_the_sentinels_touch_no_key(acl_redis: int) -> None:
    """The members' own users: a replica's login (the replication stream only)
    and the sentinels' (roles, INFO, failover commands), neither reading nor
    writing the ledger nor changing the server's configuration."""
    for role in ("replica", "sentinel"):
        client = aioredis.Redis(port=acl_redis, username=role, password=PASSWORDS[role])
        try:
            assert await client.ping()
            for command in (
                ("GET", "gpuslice:nodes"),
                ("SET", "gpuslice:x", "1"),
                ("FLUSHALL",),
                ("CONFIG", "SET", "appendonly", "no"),
                ("EVAL", "return 1", "0"),
                ("KEYS", "*"),
                ("ACL", "LIST"),
            ):
                with pytest.raises(NoPermissionError):
                    await client.execute_command(*command)
        finally:
            await client.aclose()
    sentinel = aioredis.Redis(port=acl_redis, username="sentinel", password=PASSWORDS["sentinel"])
    try:
        assert (await sentinel.info("replication"))["role"] == "master"
        assert (await sentinel.execute_command("ROLE"))[0] == b"master"
    finally:
        await sentinel.aclose()


def test_no_redis_user_or_password_is_left_for_node_agents() -> None:
    script = manifest("StatefulSet", "gpuslice-redis")["spec"]["template"]["spec"]["containers"]
    assert "deviceplugin" not in yaml.safe_dump(script)
    plugin = manifest("DaemonSet", "gpuslice-deviceplugin")
    assert "REDIS" not in yaml.safe_dump(plugin).upper()


# ---------------------------------------------------------------- NATS


@pytest.fixture
def role_nats(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[NatsServer]:
    """nats-server with the manifest's configuration and the roles' passwords."""
    with manifest_nats(tmp_path, monkeypatch, KeyPair.generate(Role.ACCOUNT)) as server:
        yield server


async def connect(server: NatsServer, role: str, errors: list[str]) -> nats.NATS:
    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    return await nats.connect(
        server.url,
        user=role,
        password=PASSWORDS[role],
        error_cb=on_error,
        allow_reconnect=False,
    )


async def test_service_users_log_in_with_their_passwords_and_no_other(
    role_nats: NatsServer,
) -> None:
    errors: list[str] = []
    auditor = await connect(role_nats, "auditor", errors)
    webhook = await connect(role_nats, "webhook", errors)
    try:
        got: list[str] = []

        async def keep(msg: Any) -> None:
            got.append(msg.subject)

        await auditor.subscribe("gpuslice.events.>", cb=keep)
        await flush_client(auditor)
        await webhook.publish("gpuslice.events.pod.denied", b"{}")
        # the webhook cannot pose as a node
        await webhook.publish("gpuslice.inventory.node-1", b"{}")
        await flush_client(webhook)
        await until(lambda: got)
        assert got == ["gpuslice.events.pod.denied"]
        assert any("permissions violation" in e.lower() for e in errors), errors

    finally:
        for client in (auditor, webhook):
            await client.close()
    # a wrong password is refused for a service user, and a password is no way in
    # for a node agent or a container: no such user has one (the callout, asked
    # about them, refuses a login without a token)
    for user, password in (
        ("inventory", PASSWORDS["inventory"] + "x"),
        ("telemetry", PASSWORDS["telemetry"]),
        ("deviceplugin", PASSWORDS["deviceplugin"]),
    ):
        answer = await raw_login(role_nats.port, {"user": user, "pass": password})
        assert "Authorization Violation" in answer, user


async def test_services_fill_the_audit_stream_and_the_auditor_reads_all_of_it(
    role_nats: NatsServer,
) -> None:
    def settings(role: str) -> CommonSettings:
        return CommonSettings(nats_url=role_nats.url, nats_user=role, nats_password=PASSWORDS[role])

    admin = await Bus.connect(settings("admin"), "admin")
    await admin.ensure_audit_stream(timedelta(days=1))
    await admin.close()
    inventory = await Bus.connect(settings("inventory"), "inventory")
    scheduler = await Bus.connect(settings("scheduler"), "scheduler")
    webhook = await Bus.connect(settings("webhook"), "webhook")
    auditor = await Bus.connect(settings("auditor"), "auditor")
    try:
        await inventory.check_audit_stream()
        # more than one flow-control window: the auditor must answer JetStream's
        for i in range(20000):
            await webhook.publish(
                make_event(
                    EventType.POD_DENIED,
                    PodDenied(pod=PodRef(uid=f"d{i}"), reason="quota"),
                    source="test",
                )
            )
        await webhook.flush()
        event = make_event(
            EventType.ALLOC_RELEASED,
            AllocationEvent(pod=PodRef(uid="p1"), node="node-1", reason="done"),
            source="test",
        )
        await inventory.publish_acked(event)
        for _ in range(100):  # JetStream stores what came without an ack a little later
            info = await inventory.check_audit_stream()
            if info.state.messages == 20001:
                break
            await asyncio.sleep(0.1)
        events = await auditor.read_audit(timeout=15)
        assert len(events) == 20001
        assert event.id in {e.id for e in events}
        # the inventory's console keeps a feed of the newest events: it may read them too
        newest = [e.id async for e in audit_events(inventory, 19990)]
        assert len(newest) == 12
        assert event.id in newest
    finally:
        for bus in (auditor, webhook, scheduler, inventory):
            await bus.close()


def test_the_install_guide_makes_no_credential_by_hand() -> None:
    """Every key the manifests read is made by the bootstrap Job (tests/test_cli_install.py
    checks the Job's list against the manifests); the guide asks for none by hand."""
    guide = (ROOT / "docs" / "install.md").read_text()
    assert "openssl rand" not in guide  # no password generated by hand
    assert "$(pw)" not in guide
    assert "gpuslice install secrets" in guide


def liveness_command() -> list[str]:
    command: list[str] = container("StatefulSet", "gpuslice-redis", "redis")["livenessProbe"][
        "exec"
    ]["command"]
    return command


async def test_a_redis_held_by_a_script_that_never_ends_fails_its_liveness_probe(
    acl_redis: int,
) -> None:
    """A service credential may load scripts, so one could run a script that never
    ends: Redis then answers only BUSY. The liveness probe must fail so that
    kubelet restarts Redis (the append-only file keeps the ledger)."""
    env = {**os.environ, "REDISCLI_AUTH": PASSWORDS["probe"]}
    argv = [*liveness_command()]
    argv[-1] = argv[-1].replace("redis-cli", f"redis-cli -p {acl_redis}")

    def probe() -> bool:
        try:
            done = subprocess.run(argv, env=env, timeout=5, capture_output=True, check=False)
        except subprocess.TimeoutExpired:
            return False
        return done.returncode == 0

    assert await asyncio.to_thread(probe)
    scheduler = aioredis.Redis.from_url(redis_url(acl_redis, "scheduler"))
    sha = await scheduler.script_load("while true do end")
    stuck = asyncio.create_task(scheduler.evalsha(sha, 0))
    try:
        await asyncio.sleep(0.2)
        assert not await asyncio.to_thread(probe)
    finally:
        stuck.cancel()
        with contextlib.suppress(BaseException):
            await stuck
        with contextlib.suppress(Exception):
            await scheduler.aclose()
