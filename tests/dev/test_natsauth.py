"""The local stack's NATS: nats-server with the manifests' accounts and users
(k8s/nats.yaml) and one run's credentials in its environment."""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path

import nats

from gpuslice_cli.dev.natsauth import AUTHORIZATION, USERS, NatsAuth
from gpuslice_common.servers import NatsServer


def test_each_run_has_its_own_passwords_and_callout_key() -> None:
    one, two = NatsAuth.generate(), NatsAuth.generate()
    assert set(one.passwords) == set(USERS)
    assert len(set(one.passwords.values())) == len(USERS)
    assert not set(one.passwords.values()) & set(two.passwords.values())
    assert one.issuer.public_key != two.issuer.public_key
    assert one.issuer.public_key.startswith("A")  # an account key
    # read by nats-server as configuration values: strings, never numbers
    assert all(not p[0].isdigit() for p in one.passwords.values())


async def test_services_log_in_with_their_own_passwords_only(tmp_path: Path) -> None:
    auth = NatsAuth.generate()
    with NatsServer(tmp_path / "nats", config=AUTHORIZATION, env=auth.server_env()) as server:
        for user in USERS:
            client = await nats.connect(
                server.url, user=user, password=auth.passwords[user], allow_reconnect=False
            )
            await client.close()
        for user, password in (("auditor", auth.passwords["admin"]), ("admin", "")):
            answer = await login(server.port, user, password)
            assert "authorization violation" in answer.lower(), answer


async def login(port: int, user: str, password: str) -> str:
    """The server's answer to a login (spoken raw: the client library would retry)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        assert (await reader.readline()).startswith(b"INFO ")
        connect = {"verbose": False, "protocol": 1, "user": user, "pass": password}
        writer.write(b"CONNECT " + json.dumps(connect).encode() + b"\r\nPING\r\n")
        await writer.drain()
        return (await reader.readline()).decode()
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
