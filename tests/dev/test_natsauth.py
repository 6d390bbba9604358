"""The local stack's NATS: nats-server with the manifests' accounts and users
(k8s/nats.yaml) and one run's credentials in its environment; the node agents'
projected tokens, minted for their node and renewed."""

from __future__ import annotations

import asyncio
import contextlib
import os
from pathlib import Path

import nats
import pytest

from gpuslice_cli.dev.natsauth import (
    AUTHORIZATION,
    NODE_AGENT_AUDIENCE,
    NODE_AGENT_NAMESPACE,
    NODE_AGENT_SERVICE_ACCOUNT,
    USERS,
    NatsAuth,
)
from gpuslice_cli.dev.stack import AgentTokens
from gpuslice_common.kube import NODE_NAME_EXTRA, LocalKubeApi
from gpuslice_common.servers import NatsServer
from tests.deploy.roles import raw_login


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
            answer = await raw_login(server.port, {"user": user, "pass": password})
            assert "authorization violation" in answer.lower(), answer


async def test_node_agent_tokens_are_minted_for_their_node_and_renewed(tmp_path: Path) -> None:
    kube = LocalKubeApi()
    tokens = AgentTokens(kube, ttl_s=0.5)
    path = tokens.write("gpu-node-1", tmp_path / "token")
    first = path.read_text()
    review = await kube.review_token(first, [NODE_AGENT_AUDIENCE])
    assert review["authenticated"] is True
    assert review["user"]["username"] == (
        f"system:serviceaccount:{NODE_AGENT_NAMESPACE}:{NODE_AGENT_SERVICE_ACCOUNT}"
    )
    assert review["user"]["extra"][NODE_NAME_EXTRA] == ["gpu-node-1"]
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    renewing = asyncio.create_task(tokens.renew())
    try:
        for _ in range(200):
            if path.read_text() != first:
                break
            await asyncio.sleep(0.05)
    finally:
        renewing.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await renewing
    renewed = path.read_text()
    assert renewed != first
    assert (await kube.review_token(renewed, [NODE_AGENT_AUDIENCE]))["authenticated"] is True


def test_a_token_file_is_never_readable_by_others_not_even_while_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a --workdir others may list, a file made with the umask's mode and
    narrowed after could be opened (and kept open) by them meanwhile: it is
    made 0600 from the start."""
    modes: list[int] = []
    real_replace = Path.replace

    def replace(self: Path, target: Path) -> Path:
        modes.append(self.stat().st_mode & 0o777)  # as it was before it took its name
        return real_replace(self, target)

    monkeypatch.setattr(Path, "replace", replace)
    monkeypatch.setattr(Path, "chmod", lambda self, mode: None)  # no narrowing after
    old = os.umask(0)
    try:
        AgentTokens(LocalKubeApi(), ttl_s=60).write("gpu-node-1", tmp_path / "token")
    finally:
        os.umask(old)
    assert modes == [0o600]
