"""The manifests' NATS server, run for tests: nats-server with k8s/nats.yaml's own
configuration and the roles' passwords, and the inventory running beside it
with its auth callout, reviewing node agents' tokens on a test API server. And
what it takes to run the manifests' containers' own scripts and configuration
here: their environment as kubelet gives it, the Secret's keys as the tests'
passwords.

The test API server mints projected ServiceAccount tokens for test pods
(:meth:`Roles.node_token`), and the inventory's callout issues containers'
telemetry tokens (:meth:`Roles.telemetry_token`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.aio.client import Client

from gpuslice_cli.dev.natsauth import (
    NODE_AGENT_AUDIENCE,
    NODE_AGENT_NAMESPACE,
    NODE_AGENT_SERVICE_ACCOUNT,
    USERS,
)
from gpuslice_common.bus import Bus
from gpuslice_common.config import InventorySettings
from gpuslice_common.kube import KubernetesApi
from gpuslice_common.ledger import Ledger
from gpuslice_common.nkeys import KeyPair, Role
from gpuslice_common.servers import NatsServer
from gpuslice_inventory.authcallout import AuthCallout
from gpuslice_inventory.service import Running, running
from tests.deploy.kustomize import render
from tests.kubeapi import FakeApiServer, Stream, fake_api_server

ROOT = Path(__file__).resolve().parents[2]
PASSWORDS = {
    role: f"{role}-secret-{i}"
    for i, role in enumerate(
        (
            "webhook",
            "scheduler",
            "inventory",
            "deviceplugin",
            "telemetry",
            "auditor",
            "admin",
            "probe",
            "operator",
            "callout",
            "replica",
            "sentinel",
            "sentinel-client",
            "route",
            "cluster-admin",
        )
    )
}
SERVICE_ROLES = USERS
AUDIENCE = NODE_AGENT_AUDIENCE
NAMESPACE = NODE_AGENT_NAMESPACE
AGENT_SA = NODE_AGENT_SERVICE_ACCOUNT


def manifest(kind: str, name: str) -> dict[str, Any]:
    for obj in render(ROOT / "k8s"):
        if obj["kind"] == kind and obj["metadata"]["name"] == name:
            return obj
    raise AssertionError(f"no {kind} {name}")


def manifest_env(kind: str, name: str) -> dict[str, Any]:
    """The first container's environment, by name."""
    spec = manifest(kind, name)["spec"]["template"]["spec"]
    return {e["name"]: e for e in spec["containers"][0]["env"]}


def secret(key: str) -> str:
    """The tests' value for a key of the Secret gpuslice-credentials: the
    password of the role it names (nats-webhook, redis-replica, ...)."""
    return PASSWORDS[key.removeprefix("nats-").removeprefix("redis-")]


def container(kind: str, name: str, container_name: str) -> dict[str, Any]:
    spec = manifest(kind, name)["spec"]["template"]["spec"]
    (found,) = [c for c in spec["containers"] if c["name"] == container_name]
    return found


def container_env(
    spec: dict[str, Any],
    pod_name: str,
    *,
    secrets: Mapping[str, str] | None = None,
    addresses: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """A container's environment as kubelet gives it to pod ``pod_name``: the
    pod's name from the downward API, the Secret's keys (``secrets``, else the
    tests' passwords), $(NAME) expanded from the variables before. Then in
    every value each of ``addresses`` (a pod's DNS name, say) is replaced by
    its value (where the test runs that pod's server)."""
    env: dict[str, str] = {}
    for var in spec["env"]:
        source = var.get("valueFrom", {})
        if "fieldRef" in source:
            assert source["fieldRef"]["fieldPath"] == "metadata.name", var
            value = pod_name
        elif "secretKeyRef" in source:
            key = source["secretKeyRef"]["key"]
            value = (secrets or {}).get(key) or secret(key)
        else:
            value = var["value"]
            for defined, known in env.items():
                value = value.replace(f"$({defined})", known)
        for name, address in (addresses or {}).items():
            value = value.replace(name, address)
        env[var["name"]] = value
    return env


def redis_scripts(directory: Path) -> Path:
    """The ConfigMap gpuslice-redis's files in ``directory``, as the members mount
    them (REDIS_CONFIG_DIR)."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in manifest("ConfigMap", "gpuslice-redis")["data"].items():
        (directory / name).write_text(text)
    return directory


def redis_render(directory: Path, name: str, env: Mapping[str, str]) -> str:
    """A file of the ConfigMap as the members' own start scripts write it out
    (lib.sh's render, the variables from ``env``)."""
    done = subprocess.run(
        ["sh", "-c", '. "$REDIS_CONFIG_DIR/lib.sh" && render "$REDIS_CONFIG_DIR/$1"', "sh", name],
        env={"PATH": os.environ["PATH"], **env, "REDIS_CONFIG_DIR": str(directory)},
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout


@contextlib.contextmanager
def manifest_nats(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, issuer: KeyPair
) -> Iterator[NatsServer]:
    """nats-server with the manifest's accounts and users, the roles' passwords
    and ``issuer`` as the callout's account key: one server, standing for the
    cluster (whose members all run this configuration; test_k8s runs the
    members' own part, the cluster, on its own)."""
    data = manifest("ConfigMap", "gpuslice-nats")["data"]
    assert "include ./authorization.conf" in data["nats.conf"]
    config = data["authorization.conf"]
    env = manifest_env("StatefulSet", "gpuslice-nats")
    for role in SERVICE_ROLES:
        assert f"NATS_{role.upper()}_PASSWORD" in env, role
        monkeypatch.setenv(f"NATS_{role.upper()}_PASSWORD", PASSWORDS[role])
    assert "NATS_CALLOUT_ISSUER" in env
    monkeypatch.setenv("NATS_CALLOUT_ISSUER", issuer.public_key)
    with NatsServer(tmp_path / "nats", config=config) as server:
        yield server


@dataclass
class Roles:
    """The manifests' NATS, the inventory with its callout, the test API server."""

    server: NatsServer
    api: FakeApiServer
    inventory: Running
    ledger: Ledger
    clients: list[Client] = field(default_factory=list)  # closed at the end

    @property
    def callout(self) -> AuthCallout:
        assert self.inventory.callout is not None
        return self.inventory.callout

    def node_token(
        self,
        node: str,
        *,
        audiences: tuple[str, ...] = (AUDIENCE,),
        service_account: str = AGENT_SA,
        namespace: str = NAMESPACE,
        ttl_s: float = 600.0,
    ) -> str:
        """A projected token of a node agent's pod on ``node``, as kubelet mounts it."""
        return self.api.tokens.mint(
            namespace,
            service_account,
            pod_name=f"gpuslice-deviceplugin-{node}",
            pod_uid=f"uid-agent-{node}",
            node=node,
            audiences=audiences,
            ttl_s=ttl_s,
        )

    def telemetry_token(self, node: str, pod_uid: str) -> str:
        issue = self.inventory.issue_telemetry_token
        assert issue is not None
        return issue(node, pod_uid)

    async def service(self, role: str, errors: list[str] | None = None) -> Client:
        client = await connect(self.server, errors, user=role, password=PASSWORDS[role])
        self.clients.append(client)
        return client

    async def client(self, token: str, errors: list[str] | None = None, **options: Any) -> Client:
        client = await connect(self.server, errors, token=token, **options)
        self.clients.append(client)
        return client

    async def refusal(self, token: str | None) -> str:
        """The server's answer to a client connecting with ``token``."""
        return await raw_login(self.server.port, {} if token is None else {"auth_token": token})


async def connect(server: NatsServer, errors: list[str] | None, **options: Any) -> Client:
    async def on_error(exc: Exception) -> None:
        if errors is not None:
            errors.append(str(exc))

    return await nats.connect(server.url, error_cb=on_error, allow_reconnect=False, **options)


@contextlib.asynccontextmanager
async def manifest_roles(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, redis_url: str, **settings: Any
) -> AsyncIterator[Roles]:
    """The manifests' NATS and the inventory (with its callout) on it; ``settings``
    are the inventory's own (say a short ``telemetry_session``)."""
    issuer = KeyPair.generate(Role.ACCOUNT)
    env = manifest_env("Deployment", "gpuslice-inventory")
    assert env["GPUSLICE_CALLOUT_ISSUER_SEED"]["valueFrom"]["secretKeyRef"]["key"]
    with manifest_nats(tmp_path, monkeypatch, issuer) as server, fake_api_server() as api:
        # the pod watch and the reconciliation see no pods
        empty = {"kind": "PodList", "metadata": {"resourceVersion": "1"}, "items": []}
        api.answer(
            "GET", "/api/v1/pods", 200, lambda q: Stream([], hold=1) if q.get("watch") else empty
        )
        settings = InventorySettings(
            nats_url=server.url,
            nats_user="inventory",
            nats_password=PASSWORDS["inventory"],
            redis_url=redis_url,
            callout_issuer_seed=issuer.seed,
            callout_nats_user=env["GPUSLICE_CALLOUT_NATS_USER"]["value"],
            callout_nats_password=PASSWORDS["callout"],
            node_agent_audience=env["GPUSLICE_NODE_AGENT_AUDIENCE"]["value"],
            node_agent_service_account=env["GPUSLICE_NODE_AGENT_SERVICE_ACCOUNT"]["value"],
            **settings,
        )
        kube = KubernetesApi.connect(api.host, timeout=5)
        bus = await Bus.connect(settings, "inventory")
        ledger = Ledger.from_settings(settings)
        try:
            async with running(settings, bus, kube=kube, serve_http=False) as inventory:
                roles = Roles(server, api, inventory, ledger)
                try:
                    yield roles
                finally:
                    for client in roles.clients:
                        await client.close()
        finally:
            await ledger.close()
            await bus.close()
            await kube.close()


async def until(check: Any, timeout: float = 10.0) -> None:
    """Waits until ``check()`` (sync or async) is true; fails the test after ``timeout``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        result = check()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        if loop.time() > deadline:
            raise AssertionError(f"not true within {timeout}s")
        await asyncio.sleep(0.05)


async def raw_login(port: int, fields: dict[str, Any]) -> str:
    """The server's first answer to a CONNECT with ``fields`` (spoken raw: the client
    library would retry a refused login)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        assert (await reader.readline()).startswith(b"INFO ")
        login = {"verbose": False, "protocol": 1, **fields}
        writer.write(b"CONNECT " + json.dumps(login).encode() + b"\r\nPING\r\n")
        await writer.drain()
        return (await reader.readline()).decode()
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
