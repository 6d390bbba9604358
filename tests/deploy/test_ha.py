"""The servers' members as the manifests run them, one member lost at a time.

NATS: three nats-servers with k8s/nats.yaml's own configuration and
environment, routed to each other on loopback. Redis: three members started by
k8s/redis.yaml's own scripts (redis-server and a sentinel each), on three
loopback addresses standing for the pods' names."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError

from gpuslice_common.bus import Bus, BusError
from gpuslice_common.config import CommonSettings
from gpuslice_common.events import EventType, PodDenied, make_event
from gpuslice_common.ledger import Ledger, LedgerError
from gpuslice_common.models import PodRef
from gpuslice_common.nkeys import KeyPair, Role
from gpuslice_common.servers import NatsServer, free_port
from tests.conftest import make_inventory
from tests.deploy.kustomize import overlay, render
from tests.deploy.roles import (
    PASSWORDS,
    container,
    container_env,
    manifest,
    redis_scripts,
    until,
)
from tests.test_ledger import placement

ROOT = Path(__file__).resolve().parents[2]
NATS_MEMBERS = tuple(f"gpuslice-nats-{i}.gpuslice-nats-cluster.gpuslice.svc" for i in range(3))
ROUTE_PASSWORD = "route-secret"


# ---------------------------------------------------------------- NATS


def nats_container() -> dict[str, Any]:
    (container,) = manifest("StatefulSet", "gpuslice-nats")["spec"]["template"]["spec"][
        "containers"
    ]
    return container


@dataclasses.dataclass
class NatsMember:
    """One member: its client, route and monitoring ports on loopback."""

    index: int
    server: NatsServer
    route_port: int
    http_port: int

    def healthy(self) -> bool:
        """/healthz, the full check (the startup probe's): JetStream current here."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/healthz", timeout=2):
                return True
        except OSError:
            return False


def addresses(members: list[NatsMember]) -> dict[str, str]:
    """The members' route and client addresses by DNS name, as their loopback ports."""
    found = {}
    for member, name in zip(members, NATS_MEMBERS, strict=True):
        found[f"{name}:6222"] = f"127.0.0.1:{member.route_port}"
        found[f"{name}:4222"] = f"127.0.0.1:{member.server.port}"
    return found


def loopback(text: str, members: list[NatsMember]) -> str:
    """The members' DNS names in ``text`` (route or client URLs) as their loopback ports."""
    for name, address in addresses(members).items():
        text = text.replace(name, address)
    return text


def secret(key: str, issuer: KeyPair) -> str:
    """The test's value for a key of the Secret gpuslice-credentials."""
    if key == "nats-route":
        return ROUTE_PASSWORD
    if key == "nats-callout-issuer":
        return issuer.public_key
    return PASSWORDS[key.removeprefix("nats-")]


def member_env(
    index: int, issuer: KeyPair, members: list[NatsMember] | None = None
) -> dict[str, str]:
    """Member ``index``'s environment as kubelet gives it from the StatefulSet;
    with ``members``, their addresses on loopback for the pods' names."""
    env: dict[str, str] = {}
    for var in nats_container()["env"]:
        source = var.get("valueFrom", {})
        if "fieldRef" in source:
            assert source["fieldRef"]["fieldPath"] == "metadata.name"
            env[var["name"]] = f"gpuslice-nats-{index}"
        elif "secretKeyRef" in source:
            env[var["name"]] = secret(source["secretKeyRef"]["key"], issuer)
        else:  # $(NAME): a variable defined before
            value = var["value"]
            for name, defined in env.items():
                value = value.replace(f"$({name})", defined)
            env[var["name"]] = value if members is None else loopback(value, members)
    return env


def member_config(member: NatsMember, directory: Path) -> str:
    """The member's nats.conf, its listeners on loopback; authorization.conf beside it."""
    data = manifest("ConfigMap", "gpuslice-nats")["data"]
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "authorization.conf").write_text(data["authorization.conf"])
    config: str = data["nats.conf"]
    for old, new in (
        ("http_port: 8222", f"http_port: {member.http_port}"),
        ("  port: 6222", f"  listen: 127.0.0.1:{member.route_port}"),
        # NatsServer names the store directory (-sd)
        ("store_dir: /data/jetstream", ""),
    ):
        assert config.count(old) == 1, old
        config = config.replace(old, new)
    return config


@contextlib.contextmanager
def nats_cluster(tmp_path: Path, issuer: KeyPair) -> Iterator[list[NatsMember]]:
    members = [
        NatsMember(i, NatsServer(tmp_path / f"nats-{i}"), free_port(), free_port())
        for i in range(len(NATS_MEMBERS))
    ]
    for member in members:
        member.server.config = member_config(member, member.server.workdir)
        member.server.env = member_env(member.index, issuer, members)
    try:
        for member in members:
            member.server.start()
        yield members
    finally:
        for member in members:
            member.server.cleanup()


def test_every_member_s_nats_configuration_parses(tmp_path: Path) -> None:
    """nats-server -t: the ConfigMap's files as they are, and each member's
    environment, make a configuration nats-server accepts."""
    issuer = KeyPair.generate(Role.ACCOUNT)
    for name, text in manifest("ConfigMap", "gpuslice-nats")["data"].items():
        (tmp_path / name).write_text(text)
    binary = NatsServer(tmp_path / "nats").binary
    for index in range(len(NATS_MEMBERS)):
        done = subprocess.run(
            [binary, "-t", "-c", str(tmp_path / "nats.conf")],
            env=member_env(index, issuer),
            capture_output=True,
            text=True,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        assert "is valid" in done.stderr + done.stdout


def denial(i: int) -> Any:
    return make_event(
        EventType.POD_DENIED, PodDenied(pod=PodRef(uid=f"d{i}"), reason="quota"), source="test"
    )


async def stored(bus: Bus, event: Any, within: float = 90.0) -> None:
    """Publishes ``event`` until the audit stream acknowledges it (the same id:
    stored once however often it is sent)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while True:
        try:
            await bus.publish_acked(event, timeout=1.0)
            return
        except BusError:
            if loop.time() > deadline:
                raise
            await asyncio.sleep(0.2)


async def trail(auditor: Bus, within: float = 90.0) -> list[Any]:
    """The audit trail, read again while JetStream's API does not answer (its
    leader among the members is being elected again)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while True:
        try:
            return await auditor.read_audit(timeout=10)
        except BusError:
            if loop.time() > deadline:
                raise
            await asyncio.sleep(0.5)


async def test_three_nats_members_keep_the_audit_trail_with_one_lost(tmp_path: Path) -> None:
    issuer = KeyPair.generate(Role.ACCOUNT)
    with nats_cluster(tmp_path, issuer) as members:
        await until(lambda: all(m.healthy() for m in members), timeout=90)
        # the clients' list of members, as the manifests give it
        job = manifest("Job", "gpuslice-audit-init")["spec"]["template"]["spec"]
        env = {e["name"]: e.get("value") for e in job["containers"][0]["env"]}
        urls = loopback(env["GPUSLICE_NATS_URL"], members)
        assert urls.count("127.0.0.1") == 3

        def settings(role: str) -> CommonSettings:
            return CommonSettings(nats_url=urls, nats_user=role, nats_password=PASSWORDS[role])

        # the install Job, as it runs: its command and environment
        (init,) = job["containers"]
        assert init["command"][0] == "gpuslice"
        done = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "gpuslice_cli.main", *init["command"][1:]],
            env={
                **os.environ,
                **container_env(init, "gpuslice-audit-init-x", addresses=addresses(members)),
            },
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        assert "in 3 copies" in done.stdout
        webhook = await Bus.connect(settings("webhook"), "webhook")
        auditor = await Bus.connect(settings("auditor"), "auditor")
        try:
            for i in range(10):
                await stored(webhook, denial(i))
            info = await auditor.check_audit_stream()
            assert info.config.num_replicas == 3
            assert info.cluster is not None
            assert len(info.cluster.replicas or []) == 2
            # the member leading the stream is lost: another takes over, and the
            # clients that were on it go on with the others
            leader = next(m for m in members if f"gpuslice-nats-{m.index}" == info.cluster.leader)
            leader.server.kill()
            for i in range(10, 20):
                await stored(webhook, denial(i))
            events = await trail(auditor)
            assert [e.data["pod"]["uid"] for e in events] == [f"d{i}" for i in range(20)]
            # a second lost: no majority, JetStream stores nothing
            second = next(m for m in members if m.server.running)
            second.server.kill()
            late = denial(20)
            with pytest.raises(BusError):
                await webhook.publish_acked(late, timeout=2.0)
            # one back, and the trail goes on where it stopped
            leader.server.start()
            await stored(webhook, late, within=90)
            await until(lambda: any(m.healthy() for m in members if m.server.running), 90)
            # The refused event, sent again with its id, is in the trail once
            # (the stream's duplicate window), after all the others.
            events = await trail(auditor)
            ids = [e.id for e in events]
            assert len(set(ids)) == 21
            assert ids[-1] == late.id
        finally:
            await auditor.close()
            await webhook.close()


async def test_members_refuse_a_route_without_the_route_password(tmp_path: Path) -> None:
    """A fourth server that knows the members' addresses but not the password
    does not join: its routes are refused."""
    issuer = KeyPair.generate(Role.ACCOUNT)

    def routes(member: NatsMember) -> int:
        url = f"http://127.0.0.1:{member.http_port}/routez"
        with urllib.request.urlopen(url, timeout=30) as answer:
            return int(json.load(answer)["num_routes"])

    def joined(member: NatsMember) -> bool:
        try:
            return routes(member) > 0
        except OSError:  # still starting, or slow on a loaded machine: ask again
            return False

    with nats_cluster(tmp_path, issuer) as members:
        await until(lambda: joined(members[0]), 60)
        intruder = NatsMember(3, NatsServer(tmp_path / "intruder"), free_port(), free_port())
        intruder.server.config = member_config(intruder, intruder.server.workdir)
        env = member_env(0, issuer, members)
        env["POD_NAME"] = "intruder"
        env["NATS_ROUTES"] = env["NATS_ROUTES"].replace(ROUTE_PASSWORD, "guessed")
        intruder.server.env = env
        with intruder.server:
            log = intruder.server.log_path
            await until(lambda: "Authorization Violation" in log.read_text(), 60)
            assert routes(intruder) == 0


# ---------------------------------------------------------------- Redis

REDIS_MEMBERS = tuple(f"gpuslice-redis-{i}.gpuslice-redis.gpuslice.svc" for i in range(3))
# each member's server and sentinel on an address of its own, the same ports
REDIS_ADDRESSES = ("127.0.0.2", "127.0.0.3", "127.0.0.4")


@dataclasses.dataclass
class RedisMember:
    """One member (pod): its redis-server and sentinel, each started by the
    container's own command and environment."""

    index: int
    directory: Path
    config: Path  # the ConfigMap's files (REDIS_CONFIG_DIR)
    redis_port: int
    sentinel_port: int
    processes: dict[str, subprocess.Popen[bytes]] = dataclasses.field(default_factory=dict)

    @property
    def address(self) -> str:
        return REDIS_ADDRESSES[self.index]

    def env(self, name: str) -> dict[str, str]:
        spec = container("StatefulSet", "gpuslice-redis", name)
        env = container_env(
            spec,
            f"gpuslice-redis-{self.index}",
            addresses=dict(zip(REDIS_MEMBERS, REDIS_ADDRESSES, strict=True)),
        )
        for var, value in (
            ("REDIS_PORT", str(self.redis_port)),
            ("SENTINEL_PORT", str(self.sentinel_port)),
            ("REDIS_CONFIG_DIR", str(self.config)),
            ("REDIS_RUN_DIR", str(self.directory / "run")),
            ("REDIS_DATA_DIR", str(self.directory / "data")),
            ("SENTINEL_RUN_DIR", str(self.directory / "sentinel")),
            # the server listens on the member's own address here (in the pod,
            # on all of the pod's, 127.0.0.1 among them)
            ("REDIS_LOCAL", self.address),
        ):
            if var in env:
                env[var] = value
        return {"PATH": os.environ["PATH"], **env}

    def command(self, name: str) -> list[str]:
        spec = container("StatefulSet", "gpuslice-redis", name)
        return [part.replace("/etc/redis", str(self.config)) for part in spec["command"]]

    def start(self, *names: str) -> None:
        for name in names or ("redis", "sentinel"):
            for sub in ("run", "data", "sentinel"):
                (self.directory / sub).mkdir(parents=True, exist_ok=True)
            with (self.directory / f"{name}.log").open("ab") as log:
                self.processes[name] = subprocess.Popen(
                    [*self.command(name), "--bind", self.address],
                    env=self.env(name),
                    cwd=self.directory,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )

    def kill(self, *names: str) -> None:
        """Lost: SIGKILL, no chance to hand over."""
        for name in names or tuple(self.processes):
            process = self.processes.pop(name, None)
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()

    def probe(self, name: str, kind: str, hook: bool = False) -> bool:
        """Runs the container's probe (or with ``hook``, its preStop) as kubelet would."""
        spec = container("StatefulSet", "gpuslice-redis", name)
        handler = spec["lifecycle"]["preStop"] if hook else spec[kind]
        argv = [part.replace("/etc/redis", str(self.config)) for part in handler["exec"]["command"]]
        done = subprocess.run(
            argv, env=self.env(name), capture_output=True, timeout=60, check=False
        )
        return done.returncode == 0

    def log(self) -> str:
        return "".join(
            (self.directory / f"{name}.log").read_text(errors="replace")
            for name in ("redis", "sentinel")
            if (self.directory / f"{name}.log").exists()
        )


@contextlib.contextmanager
def redis_members(tmp_path: Path) -> Iterator[list[RedisMember]]:
    config = redis_scripts(tmp_path / "config")
    redis_port, sentinel_port = free_port(), free_port()
    members = [
        RedisMember(i, tmp_path / f"member-{i}", config, redis_port, sentinel_port)
        for i in range(len(REDIS_MEMBERS))
    ]
    try:
        for member in members:
            member.start()
        yield members
    finally:
        for member in members:
            member.kill()


async def ask_sentinels(members: list[RedisMember], *command: str) -> list[Any] | None:
    """Each running sentinel's answer, asked as the services ask (user "client")."""
    answers = []
    for member in members:
        if "sentinel" not in member.processes:
            continue
        client = aioredis.Redis(
            host=member.address,
            port=member.sentinel_port,
            username="client",
            password=PASSWORDS["sentinel-client"],
            socket_timeout=2,
            decode_responses=True,
        )
        try:
            answers.append(await client.execute_command("SENTINEL", *command))
        except (RedisError, OSError):
            return None
        finally:
            await client.aclose()
    return answers


async def primary(members: list[RedisMember]) -> str | None:
    """The member the running sentinels agree on."""
    answers = await ask_sentinels(members, "GET-MASTER-ADDR-BY-NAME", "gpuslice")
    if not answers or any(not a for a in answers):
        return None
    names = {a[0] for a in answers}
    return names.pop() if len(names) == 1 else None


async def replicas_known(members: list[RedisMember], count: int) -> bool:
    """Every running sentinel knows ``count`` replicas up (they learn of one from
    the primary's INFO, every 10 s: a replica joined since is not failed over to
    nor moved to a new primary)."""
    answers = await ask_sentinels(members, "REPLICAS", "gpuslice")
    if answers is None:
        return False
    for replicas in answers:
        up = [r for r in replicas if "s_down" not in str(r["flags"])]
        if len(up) != count:
            return False
    return True


def service_settings(members: list[RedisMember], service: str) -> CommonSettings:
    """A ledger client's settings from its Deployment's environment (the scheduler's
    extender or the inventory), the members' sentinels where the test runs them."""
    name = {"scheduler": "extender", "inventory": "inventory"}[service]
    env = container_env(
        container("Deployment", f"gpuslice-{service}", name),
        f"gpuslice-{service}-x",
        secrets={"nats-callout-seed": "not used here"},
        addresses={
            f"{member}:26379": f"{m.address}:{m.sentinel_port}"
            for member, m in zip(REDIS_MEMBERS, members, strict=True)
        },
    )
    redis = {k: v for k, v in env.items() if k.startswith("GPUSLICE_REDIS_")}
    assert set(redis) == {
        "GPUSLICE_REDIS_URL",
        "GPUSLICE_REDIS_SENTINELS",
        "GPUSLICE_REDIS_SENTINEL_USER",
        "GPUSLICE_REDIS_SENTINEL_PASSWORD",
    }
    return CommonSettings(**{k.removeprefix("GPUSLICE_").lower(): v for k, v in redis.items()})


async def ready(members: list[RedisMember]) -> bool:
    """Every running member's readiness probe passes (a primary, or a replica in sync)."""
    for member in members:
        running = "redis" in member.processes
        if running and not await asyncio.to_thread(member.probe, "redis", "readinessProbe"):
            return False
    return True


async def the_sentinels_tell_clients_only_where_the_primary_is(member: RedisMember) -> None:
    """The services' user on the sentinels reads; it changes nothing (a service
    credential cannot make the sentinels fail over, forget the primary or run
    scripts); nobody gets in without a user."""
    client = aioredis.Redis(
        host=member.address,
        port=member.sentinel_port,
        username="client",
        password=PASSWORDS["sentinel-client"],
        decode_responses=True,
    )
    try:
        assert await client.execute_command("SENTINEL", "MASTERS")
        for command in (
            ("SENTINEL", "FAILOVER", "gpuslice"),
            ("SENTINEL", "REMOVE", "gpuslice"),
            ("SENTINEL", "RESET", "*"),
            ("SENTINEL", "SET", "gpuslice", "down-after-milliseconds", "1"),
            ("SENTINEL", "MONITOR", "other", "127.0.0.1", "6379", "1"),
            ("SENTINEL", "CONFIG", "SET", "resolve-hostnames", "no"),
            ("SENTINEL", "DEBUG"),
            ("ACL", "LIST"),
            ("SHUTDOWN",),
        ):
            with pytest.raises(RedisError, match="permission"):
                await client.execute_command(*command)
    finally:
        await client.aclose()
    anonymous = aioredis.Redis(host=member.address, port=member.sentinel_port)
    try:
        with pytest.raises(RedisError):
            await anonymous.execute_command("SENTINEL", "MASTERS")
    finally:
        await anonymous.aclose()


async def nodes_are(ledger: Ledger, nodes: list[str]) -> bool:
    return await ledger.nodes() == nodes


async def test_the_ledger_goes_on_when_its_primary_is_lost(tmp_path: Path) -> None:
    with redis_members(tmp_path) as members:
        try:
            # no sentinel answered at start: the first member is the primary
            await until(lambda: primary(members), timeout=60)
            assert await primary(members) == members[0].address
            await until(lambda: ready(members), timeout=60)
            await until(lambda: replicas_known(members, 2), timeout=60)
            await the_sentinels_tell_clients_only_where_the_primary_is(members[0])
            # the inventory, with its Deployment's own settings: it asks a
            # sentinel, then writes on the primary named
            inventory = Ledger.from_settings(service_settings(members, "inventory"), retries=2)
            try:
                assert (
                    await inventory.register_node(make_inventory("node-1", gpus=1), rebuilt=True)
                    == 1
                )
                # (replication is asynchronous: what the primary took in its last
                # moments may never reach a replica; here the replicas have it)
                for member in members[1:]:
                    replica = Ledger(
                        aioredis.Redis(
                            host=member.address,
                            port=member.redis_port,
                            username="operator",
                            password=PASSWORDS["operator"],
                            decode_responses=True,
                        ),
                        "gpuslice",
                    )
                    try:
                        await until(lambda r=replica: nodes_are(r, ["node-1"]), timeout=60)
                    finally:
                        await replica.close()
                # the primary's pod is lost: the two sentinels left make a replica the
                # primary, which has what was written
                members[0].kill()

                async def moved(left: list[RedisMember], old: str) -> bool:
                    return await primary(left) not in (None, old)

                await until(lambda: moved(members[1:], members[0].address), timeout=60)
                new = await primary(members[1:])
                assert new in (members[1].address, members[2].address)

                async def written() -> bool:
                    # refused until a replica follows the new primary
                    # (NOREPLICAS: min-replicas-to-write), a moment
                    with contextlib.suppress(LedgerError):
                        await inventory.register_node(
                            make_inventory("node-2", gpus=1), rebuilt=True
                        )
                        return True
                    return False

                await until(written, timeout=60)
                assert await inventory.nodes() == ["node-1", "node-2"]
                # the extender, with its own settings, finds the new primary too
                scheduler = Ledger.from_settings(service_settings(members, "scheduler"), retries=2)
                try:
                    assert await scheduler.nodes() == ["node-1", "node-2"]
                finally:
                    await scheduler.close()
                # the member comes back and, asking the sentinels, a replica of the new one
                members[0].start()
                await until(lambda: ready(members), timeout=60)
                await until(lambda: replicas_known(members, 2), timeout=60)
                assert "the sentinels name " + new in members[0].log()
                # a primary that is stopped hands over first (its preStop)
                (leaving,) = [m for m in members if m.address == new]
                assert await asyncio.to_thread(leaving.probe, "redis", "", True)
                await until(lambda: moved(members, new), timeout=60)
                await until(written, timeout=60)
                assert await inventory.nodes() == ["node-1", "node-2"]
            finally:
                await inventory.close()
        except BaseException:
            for member in members:
                print(f"---- member {member.index}\n{member.log()}")
            raise


# ---------------------------------------------------------------- Redis Cluster

CLUSTER_MEMBERS = tuple(f"gpuslice-redis-{i}.gpuslice-redis.gpuslice.svc" for i in range(6))


def with_redis_cluster(directory: Path) -> list[dict[str, Any]]:
    """k8s/ with the k8s/redis-cluster component, as an overlay of one's own
    beside it includes them (docs/install.md)."""
    return render(overlay(directory, ROOT / "k8s", "redis-cluster"))


def find(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (found,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


class Names:
    """The members' DNS names, resolved by a getent of the test's (first on
    PATH): the scripts look names up with getent, and a name can be moved to
    another address, as a pod's when it is rescheduled."""

    def __init__(self, directory: Path) -> None:
        self.bin = directory / "bin"
        self.bin.mkdir(parents=True)
        self.table = directory / "hosts"
        self.table.write_text("")
        getent = self.bin / "getent"
        getent.write_text(
            "#!/bin/sh\n"
            '[ "$1" = hosts ] || exit 1\n'
            f"awk -v name=\"$2\" '$2 == name {{ print; found = 1 }} END {{ exit !found }}' \\\n"
            f"  {self.table}\n"
        )
        getent.chmod(0o755)
        self.addresses: dict[str, str] = {}

    def place(self, addresses: dict[str, str]) -> None:
        self.addresses = dict(addresses)
        self.table.write_text("".join(f"{a} {n}\n" for n, a in addresses.items()))

    def env(self) -> dict[str, str]:
        return {"PATH": f"{self.bin}:{os.environ['PATH']}"}


@dataclasses.dataclass
class ClusterMember:
    index: int
    directory: Path
    names: Names
    container: dict[str, Any]
    config: Path
    port: int
    process: subprocess.Popen[bytes] | None = None

    @property
    def name(self) -> str:
        return CLUSTER_MEMBERS[self.index]

    @property
    def address(self) -> str:
        return self.names.addresses[self.name]

    def env(self) -> dict[str, str]:
        env = container_env(self.container, f"gpuslice-redis-{self.index}")
        for var, value in (
            ("REDIS_PORT", str(self.port)),
            ("REDIS_CONFIG_DIR", str(self.config)),
            ("REDIS_RUN_DIR", str(self.directory / "run")),
            ("REDIS_DATA_DIR", str(self.directory / "data")),
            ("REDIS_LOCAL", self.address),
        ):
            assert var in env, var
            env[var] = value
        return {**env, **self.names.env()}

    def start(self) -> None:
        for sub in ("run", "data"):
            (self.directory / sub).mkdir(parents=True, exist_ok=True)
        command = [p.replace("/etc/redis", str(self.config)) for p in self.container["command"]]
        with (self.directory / "redis.log").open("ab") as log:
            # (one address here, as a pod has: connections to other members
            # leave from it too, not from 127.0.0.1)
            self.process = subprocess.Popen(
                [*command, "--bind", self.address, "--bind-source-addr", self.address],
                env=self.env(),
                cwd=self.directory,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def stop(self, kill: bool = False) -> None:
        if self.process is not None and self.process.poll() is None:
            if kill:
                self.process.kill()
            else:
                self.process.terminate()
            self.process.wait(15)
        self.process = None


def cluster_port() -> int:
    """A port free on every member's address, with its cluster bus port (+10000)."""
    while True:
        port = free_port()
        if port + 10000 < 65536:
            return port


def redis_cli(address: str, port: int, user: str, *command: str) -> str:
    done = subprocess.run(
        [
            "redis-cli",
            "--no-auth-warning",
            "--user",
            user,
            "-h",
            address,
            "-p",
            str(port),
            *command,
        ],
        env={
            **os.environ,
            "REDISCLI_AUTH": PASSWORDS[user.replace("clusteradmin", "cluster-admin")],
        },
        capture_output=True,
        text=True,
        check=False,
        timeout=10,
    )
    return done.stdout


async def test_the_redis_cluster_component_runs_the_ledger_and_survives_losing_a_member(
    tmp_path: Path,
) -> None:
    objects = with_redis_cluster(tmp_path / "overlay")
    config = tmp_path / "config"
    config.mkdir()
    for name, text in find(objects, "ConfigMap", "gpuslice-redis")["data"].items():
        (config / name).write_text(text)
    (member_spec,) = find(objects, "StatefulSet", "gpuslice-redis")["spec"]["template"]["spec"][
        "containers"
    ]
    (job_spec,) = find(objects, "Job", "gpuslice-redis-cluster-create")["spec"]["template"]["spec"][
        "containers"
    ]
    names = Names(tmp_path)
    names.place({n: f"127.0.0.{11 + i}" for i, n in enumerate(CLUSTER_MEMBERS)})
    port = cluster_port()
    members = [
        ClusterMember(i, tmp_path / f"member-{i}", names, member_spec, config, port)
        for i in range(len(CLUSTER_MEMBERS))
    ]

    def create() -> str:
        """The Job's command, with its environment."""
        env = container_env(job_spec, "gpuslice-redis-cluster-create-x")
        env |= {"REDIS_PORT": str(port), "REDIS_CONFIG_DIR": str(config), **names.env()}
        command = [p.replace("/etc/redis", str(config)) for p in job_spec["command"]]
        done = subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=120, check=False
        )
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    def ledger(role: str) -> Ledger:
        """The ledger as a service reaches it (by the members' names, here remapped)."""
        client = RedisCluster(
            host=members[0].address,
            port=port,
            username=role,
            password=PASSWORDS[role],
            decode_responses=True,
            socket_timeout=2,
            address_remap=lambda a: (names.addresses.get(a[0], a[0]), a[1]),
        )
        return Ledger(client, "gpuslice")

    def ready() -> bool:
        """Every running member's readiness probe passes: a primary, or a
        replica in sync with its primary (one that never was cannot take over)."""
        probe = member_spec["readinessProbe"]["exec"]["command"]
        command = [p.replace("/etc/redis", str(config)) for p in probe]
        return all(
            subprocess.run(command, env=m.env(), capture_output=True, check=False).returncode == 0
            for m in members
            if m.process is not None
        )

    def state_ok() -> bool:
        running = [m for m in members if m.process is not None]
        return all(
            "cluster_state:ok" in redis_cli(m.address, port, "clusteradmin", "cluster", "info")
            for m in running
        )

    async def registered(ledger: Ledger, nodes: list[str]) -> bool:
        """Every node registered again (a write to each node's keys, wherever they are)."""
        try:
            for node in nodes:
                await ledger.register_node(make_inventory(node, gpus=1), rebuilt=True)
        except LedgerError:
            return False
        return True

    nodes = [f"node-{i}" for i in range(1, 7)]
    try:
        for member in members:
            member.start()
        assert "All 16384 slots covered" in create()
        await until(state_ok, timeout=60)
        await until(ready, timeout=60)
        # the services' users run the ledger on the cluster
        inventory = ledger("inventory")
        scheduler = ledger("scheduler")
        try:
            assert await registered(inventory, nodes)
            assert await scheduler.nodes() == nodes
            _, new, _ = await scheduler.reserve_new(placement("p1", "node-1", [[(0, 100, 1)]]))
            assert new
            await scheduler.mark_bound("p1", "node-1")
            assert await inventory.allocate("node-1", 1, "request-1") is not None
            # a primary lost: its replica takes over its slots (cluster-node-timeout)
            primaries = [
                m
                for m in members
                if redis_cli(m.address, port, "probe", "role").startswith("master")
            ]
            assert len(primaries) == 3
            primaries[0].stop(kill=True)
            await until(lambda: registered(inventory, nodes), timeout=60)
        finally:
            await inventory.close()
            await scheduler.close()
        # every member moves at once (a full restart, all pods rescheduled): the
        # members find each other again by name
        for member in members:
            member.stop()
        names.place({n: f"127.0.0.{21 + i}" for i, n in enumerate(CLUSTER_MEMBERS)})
        for member in members:
            member.start()
        await until(state_ok, timeout=60)
        await until(ready, timeout=60)
        operator = ledger("operator")
        try:
            assert await operator.nodes() == nodes
            assert (await operator.placement("p1")) is not None
        finally:
            await operator.close()
        # the Job again, at the next apply: nothing to do
        assert "joins" not in create()
        # a member whose volume was replaced starts empty and alone: the Job
        # (run again) makes it a replica
        replaced = members[-1]
        replaced.stop()
        shutil.rmtree(replaced.directory / "data")
        replaced.start()
        assert f"{replaced.address} joins as a replica" in create()
        await until(ready, timeout=60)
        assert redis_cli(replaced.address, port, "probe", "role").startswith("slave")
    except BaseException:
        for member in members:
            log = member.directory / "redis.log"
            print(f"---- member {member.index}\n{log.read_text(errors='replace')[-3000:]}")
        raise
    finally:
        for member in members:
            member.stop(kill=True)
