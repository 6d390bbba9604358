"""``python -m gpuslice_inventory`` as operators run it: ready over HTTP, riding out
a Redis restart, stopping cleanly on SIGTERM, and one-line errors for bad settings."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from nats.js.errors import NotFoundError

from gpuslice_common.bus import Bus
from gpuslice_common.config import InventorySettings
from gpuslice_common.ledger import Ledger
from gpuslice_common.servers import NatsServer, RedisServer, free_port
from tests.conftest import make_inventory
from tests.inventory.conftest import announce, until


def inventory_env(**values: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUSLICE_")}
    # the console on a port of its own: the default one may be taken
    env.update(
        {
            "GPUSLICE_KUBE_API": "none",
            "GPUSLICE_LISTEN_HOST": "127.0.0.1",
            "GPUSLICE_CONSOLE_PORT": str(free_port()),
        }
    )
    env.update(values)
    return env


@contextlib.contextmanager
def inventory_process(env: dict[str, str]) -> Iterator[subprocess.Popen[str]]:
    """The process; at the end SIGTERM, which must end it with 0 and no traceback."""
    process = subprocess.Popen(
        [sys.executable, "-m", "gpuslice_inventory"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        yield process
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=20)
        assert process.returncode == 0, output
        assert "Traceback" not in output
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()


async def readiness(port: int) -> int:
    try:
        async with httpx.AsyncClient(timeout=2) as client:
            return (await client.get(f"http://127.0.0.1:{port}/readyz")).status_code
    except httpx.TransportError:
        return 0


async def test_the_process_rides_out_a_redis_restart_and_stops_on_sigterm(
    nats_server: NatsServer, own_redis: RedisServer, prefix: str
) -> None:
    port = free_port()
    env = inventory_env(
        GPUSLICE_NATS_URL=nats_server.url,
        GPUSLICE_REDIS_URL=own_redis.url,
        GPUSLICE_SUBJECT_PREFIX=prefix,
        GPUSLICE_LEDGER_PREFIX=prefix,
        GPUSLICE_LISTEN_PORT=str(port),
        GPUSLICE_SWEEP_INTERVAL="0.1",
    )
    settings = InventorySettings(nats_url=nats_server.url, subject_prefix=prefix)
    bus = await Bus.connect(settings, "test")
    await bus.ensure_audit_stream(settings.audit_max_age)
    ledger = Ledger.from_url(own_redis.url, prefix)
    try:
        with inventory_process(env) as process:
            await until(lambda: readiness(port), timeout=20)
            assert await readiness(port) == 200
            await until(lambda: announce_and_check(bus, ledger, "gpu-1"), timeout=10)
            own_redis.stop()
            await until(lambda: _equals(readiness(port), 503), timeout=10)
            await asyncio.sleep(0.5)  # the periodic jobs meet the outage too
            assert process.poll() is None
            own_redis.start()
            await until(lambda: _equals(readiness(port), 200), timeout=20)
            await until(lambda: announce_and_check(bus, ledger, "gpu-2"), timeout=20)
    finally:
        await ledger.close()
        await bus.close()


async def _equals(value: asyncio.Future[int] | object, expected: int) -> bool:
    return await value == expected  # type: ignore[misc]


async def announce_and_check(bus: Bus, ledger: Ledger, node: str) -> bool:
    await announce(bus, make_inventory(node))
    with contextlib.suppress(Exception):
        return node in await ledger.nodes()
    return False


async def test_the_process_waits_for_the_audit_stream_it_may_not_make(
    nats_server: NatsServer, own_redis: RedisServer, prefix: str
) -> None:
    """No service creates the audit stream: the inventory says what is missing,
    waits, and starts once the install step (with the admin credential) made it."""
    port = free_port()
    env = inventory_env(
        GPUSLICE_NATS_URL=nats_server.url,
        GPUSLICE_REDIS_URL=own_redis.url,
        GPUSLICE_SUBJECT_PREFIX=prefix,
        GPUSLICE_LEDGER_PREFIX=prefix,
        GPUSLICE_LISTEN_PORT=str(port),
    )
    settings = InventorySettings(nats_url=nats_server.url, subject_prefix=prefix)
    bus = await Bus.connect(settings, "admin")
    try:
        with inventory_process(env) as process:
            assert process.stdout is not None
            line = await asyncio.to_thread(process.stdout.readline)
            assert "waiting for the audit stream" in line, line
            assert f"audit stream {prefix}_audit does not exist" in line
            assert "gpuslice audit init" in line
            assert await readiness(port) == 0  # not serving: not started
            with pytest.raises(NotFoundError):  # the inventory made nothing meanwhile
                await bus.js.stream_info(f"{prefix}_audit")
            await bus.ensure_audit_stream(settings.audit_max_age)
            await until(lambda: _equals(readiness(port), 200), timeout=20)
    finally:
        await bus.close()


def run_inventory(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpuslice_inventory"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_bad_settings_are_one_line_and_exit_2() -> None:
    result = run_inventory(inventory_env(GPUSLICE_KUBE_API="sometimes"))
    assert result.returncode == 2
    assert "GPUSLICE_KUBE_API: Input should be 'cluster' or 'none'" in result.stderr
    assert "Traceback" not in result.stderr


def test_missing_kubernetes_credentials_are_one_line_and_exit_2(tmp_path: Path) -> None:
    env = inventory_env(GPUSLICE_KUBE_API="cluster", KUBECONFIG=str(tmp_path / "absent"))
    env.pop("KUBERNETES_SERVICE_HOST", None)
    result = run_inventory(env)
    assert result.returncode == 2, result.stderr
    assert "cannot load Kubernetes credentials" in result.stderr
    assert "Traceback" not in result.stderr
