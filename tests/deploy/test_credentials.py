"""The manifests' NATS users and Redis ACL users, run on real servers: each role
can do its work and no more."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shlex
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
from gpuslice_common.bus import Bus
from gpuslice_common.config import CommonSettings
from gpuslice_common.events import AllocationEvent, EventType, PodDenied, make_event
from gpuslice_common.ledger import Ledger
from gpuslice_common.models import PodRef
from gpuslice_common.nkeys import KeyPair, Role
from gpuslice_common.servers import NatsServer, free_port
from tests.conftest import make_inventory
from tests.deploy.kustomize import render
from tests.deploy.roles import PASSWORDS, manifest, manifest_nats, until
from tests.test_ledger import placement

ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------- Redis


@pytest.fixture
def acl_redis(tmp_path: Path) -> Iterator[int]:
    """redis-server started with the manifest's own command line."""
    spec = manifest("StatefulSet", "gpuslice-redis")["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    assert container["command"] == ["sh", "-c"]
    script = container["args"][0]
    for role in ("scheduler", "inventory", "deviceplugin", "operator", "probe"):
        script = script.replace(f"$REDIS_{role.upper()}_PASSWORD", PASSWORDS[role])
    assert "$" not in script, script
    argv = shlex.split(script)
    assert argv[:2] == ["exec", "redis-server"]
    port = free_port()
    argv = [shutil.which("redis-server") or "redis-server", *argv[2:]]
    argv[argv.index("--dir") + 1] = str(tmp_path)
    argv += ["--port", str(port), "--bind", "127.0.0.1", "--save", ""]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 15
        while True:
            assert proc.poll() is None, f"redis-server exited: {argv}"
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                break
            assert time.monotonic() < deadline, "redis-server did not listen"
            time.sleep(0.05)
        yield port
    finally:
        proc.terminate()
        proc.wait(10)


async def test_each_redis_user_runs_the_ledger_and_nothing_else(acl_redis: int) -> None:
    for role in ("scheduler", "inventory", "deviceplugin"):
        url = f"redis://{role}:{PASSWORDS[role]}@127.0.0.1:{acl_redis}/0"
        ledger = Ledger.from_url(url, "gpuslice", retries=1)
        try:
            await ledger.register_node(make_inventory(f"node-{role}", gpus=1), rebuilt=True)
            await ledger.reserve(placement(f"pod-{role}", f"node-{role}", [[(0, 100, 1)]]))
            await ledger.mark_bound(f"pod-{role}")
            await ledger.allocate(f"node-{role}", 1)
            released = await ledger.release(f"pod-{role}", "done")
            assert released is not None
            assert released.first
            assert await ledger.now()
            with pytest.raises(NoPermissionError):
                await ledger.redis.flushall()
            with pytest.raises(NoPermissionError):
                await ledger.redis.set("not-gpuslice", "x")
        finally:
            await ledger.close()
    anonymous = aioredis.Redis(port=acl_redis)
    try:
        with pytest.raises((AuthenticationError, ResponseError)):
            await anonymous.ping()
    finally:
        await anonymous.aclose()
    # operators read what gpuslice status shows, and write nothing
    url = f"redis://operator:{PASSWORDS['operator']}@127.0.0.1:{acl_redis}/0"
    operator = Ledger.from_url(url, "gpuslice", retries=1)
    try:
        nodes = await gather_status(operator)
        assert [n.node for n in nodes] == ["node-deviceplugin", "node-inventory", "node-scheduler"]
        assert await gather_usage(operator, "gpuslice", nodes) == {}
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
        await auditor.flush()
        await webhook.publish("gpuslice.events.pod.denied", b"{}")
        # the webhook cannot pose as a node
        await webhook.publish("gpuslice.inventory.node-1", b"{}")
        await webhook.flush()
        await until(lambda: got)
        assert got == ["gpuslice.events.pod.denied"]
        assert any("permissions violation" in e.lower() for e in errors), errors
    finally:
        for client in (auditor, webhook):
            await client.close()
    # a wrong password is refused, for a service user and for the old shared
    # node and container users, which no longer exist (spoken raw: the client
    # library would retry)
    for user in ("inventory", "telemetry", "deviceplugin"):
        reader, writer = await asyncio.open_connection("127.0.0.1", role_nats.port)
        try:
            assert (await reader.readline()).startswith(b"INFO ")
            login = {"user": user, "pass": PASSWORDS[user] + "x", "verbose": False}
            writer.write(b"CONNECT " + json.dumps(login).encode() + b"\r\nPING\r\n")
            await writer.drain()
            assert b"Authorization Violation" in await reader.readline(), user
        finally:
            writer.close()
            await writer.wait_closed()


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
    finally:
        for bus in (auditor, webhook, scheduler, inventory):
            await bus.close()


def test_every_secret_key_the_manifests_read_is_in_the_install_guide() -> None:
    keys = set()
    for obj in render(ROOT / "k8s"):
        text = yaml.safe_dump(obj)
        keys |= set(re.findall(r"key: ((?:nats|redis)-[a-z-]+)", text))
    guide = (ROOT / "docs" / "install.md").read_text()
    assert keys, "no secret keys found"
    missing = sorted(k for k in keys if f"--from-literal={k}=" not in guide)
    assert not missing, f"docs/install.md does not create {missing}"
    assert os.path.exists(ROOT / "k8s" / "kustomization.yaml")
