"""nats-server and redis-server run as child processes.

Used by the test harness and the local stack: each server gets a free loopback
port and its own directory, and can be stopped, killed and started again on the
same port with the same data (for fault tests).

The highly-available shapes run the same way on loopback: :class:`NatsCluster`
(three nats-servers with routes between them, JetStream clustered) and
:class:`RedisSentinelGroup` (a primary, replicas and three sentinels that
promote a replica when the primary dies).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Self

import redis


class ServerError(RuntimeError):
    """A server binary is missing or did not come up."""


# Ports handed out for servers to bind later are drawn below the kernel's
# ephemeral range: a port the kernel chose for bind(0) and that was let go can
# be the next outgoing connection's own port (or another process's bind(0))
# before the server binds it, which several test workers made happen.
_LOWEST_PORT = 10000
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


@functools.cache
def _ephemeral_start() -> int:
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A loopback TCP port nothing listens on now, for a server to bind soon."""
    top = _ephemeral_start()
    for _ in range(200) if top - _LOWEST_PORT > 1000 else ():
        # not random: pytest-randomly seeds it alike in every test worker
        port = _LOWEST_PORT + secrets.randbelow(top - _LOWEST_PORT)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        chosen: int = s.getsockname()[1]
        return chosen


def find_binary(name: str, env_var: str) -> str:
    """Locate a server binary: the env variable, next to this Python, then PATH."""
    explicit = os.environ.get(env_var)
    if explicit:
        if not os.access(explicit, os.X_OK):
            raise ServerError(f"{env_var}={explicit} is not an executable file")
        return explicit
    beside_python = Path(sys.executable).parent / name
    if os.access(beside_python, os.X_OK):
        return str(beside_python)
    found = shutil.which(name)
    if found is None:
        raise ServerError(
            f"{name} not found: install it (`make deps` does) or set {env_var} to its path"
        )
    return found


def _wait_for_port(port: int, proc: subprocess.Popen[bytes], timeout: float, log: Path) -> None:
    """Wait until ``proc`` itself listens on ``port``: a connection alone could
    reach another process that took the port first, while ``proc`` is exiting."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise ServerError(f"server exited with code {proc.returncode}:\n{tail}")
        if _listens(proc.pid, port):
            return
        time.sleep(0.02)
    raise ServerError(f"server did not listen on 127.0.0.1:{port} within {timeout:.0f}s")


def _listens(pid: int, port: int) -> bool:
    """Whether process ``pid`` holds a socket listening on loopback ``port``
    (read from /proc: the listening sockets' inodes, then the process's fds)."""
    wanted = f"0100007F:{port:04X}"
    inodes: set[str] = set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
            fields = line.split()
            if len(fields) > 9 and fields[1] == wanted and fields[3] == "0A":  # LISTEN
                inodes.add(fields[9])
    if not inodes:
        return False
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith("socket:[") and link[8:-1] in inodes:
                return True
    return False


class _Managed:
    """Started on entering a ``with`` block, stopped and cleaned up on leaving it.

    Works in ``workdir``, or in a temporary directory it removes afterwards.
    """

    name = "server"

    def __init__(self, workdir: Path | None) -> None:
        self._own_dir = workdir is None
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix=f"gpuslice-{self.name}-"))
        self.workdir.mkdir(parents=True, exist_ok=True)

    def start(self, timeout: float = 15.0) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def cleanup(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self.cleanup()  # what did start (a cluster's other members) stops too
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.cleanup()


class ServerProcess(_Managed):
    """Base: one server process with a fixed port and a working directory."""

    def __init__(self, workdir: Path | None = None, port: int | None = None) -> None:
        super().__init__(workdir)
        self.port = port or free_port()
        self._ports_chosen = port is None  # ours to choose again if taken meanwhile
        self._listened = False  # once it has, its ports stay (a restart keeps them)
        self.log_path = self.workdir / f"{self.name}.log"
        self._proc: subprocess.Popen[bytes] | None = None
        self.env: dict[str, str] = {}  # added to this process's environment

    def repick_ports(self) -> bool:
        """Choose fresh ports after one chosen here was taken between choosing and
        binding (another test's server); False where the ports were given."""
        if not self._ports_chosen:
            return False
        self.port = free_port()
        return True

    def command(self) -> list[str]:
        raise NotImplementedError

    @property
    def url(self) -> str:
        raise NotImplementedError

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout: float = 15.0) -> None:
        for attempt in range(3):
            logged = self.log_path.stat().st_size if self.log_path.exists() else 0
            try:
                self._start_once(timeout)
            except ServerError:
                with self.log_path.open("rb") as log:
                    log.seek(logged)
                    taken = b"already in use" in log.read().lower()
                if not taken or self._listened or attempt == 2 or not self.repick_ports():
                    raise
            else:
                self._listened = True
                return

    def _start_once(self, timeout: float) -> None:
        if self.running:
            return
        with self.log_path.open("ab") as log:
            self._proc = subprocess.Popen(
                self.command(),
                cwd=self.workdir,
                env={**os.environ, **self.env} if self.env else None,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        _wait_for_port(self.port, self._proc, timeout, self.log_path)

    def stop(self) -> None:
        """Graceful stop (SIGTERM), then SIGKILL if it lingers for 10 s."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._proc = None

    def kill(self) -> None:
        """Crash it: SIGKILL, no chance to flush."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        self._proc = None

    def freeze(self, frozen: bool = True) -> None:
        """SIGSTOP it, as a host that hangs (it answers nothing, its sockets stay
        open), or with ``frozen=False`` SIGCONT it again."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGSTOP if frozen else signal.SIGCONT)


class NatsServer(ServerProcess):
    """nats-server with JetStream on file storage under the working directory."""

    name = "nats"

    def __init__(
        self,
        workdir: Path | None = None,
        port: int | None = None,
        config: str | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        """``config``: a configuration file's text (the command line sets the
        address, port and store); ``env``: variables it reads (``$NAME``)."""
        super().__init__(workdir, port)
        self.binary = find_binary("nats-server", "GPUSLICE_NATS_SERVER")
        self.store_dir = self.workdir / "jetstream"
        self.config = config
        self.env = dict(env or {})

    def command(self) -> list[str]:
        cmd = [self.binary, "-a", "127.0.0.1", "-p", str(self.port), "-js"]
        cmd += ["-sd", str(self.store_dir)]
        if self.config is not None:
            conf = self.workdir / "nats.conf"
            conf.write_text(self.config)
            cmd += ["-c", str(conf)]
        return cmd

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"


class RedisServer(ServerProcess):
    """redis-server on loopback; append-only persistence so a restart keeps data."""

    name = "redis"

    def __init__(
        self, workdir: Path | None = None, port: int | None = None, persist: bool = True
    ) -> None:
        super().__init__(workdir, port)
        self.binary = find_binary("redis-server", "GPUSLICE_REDIS_SERVER")
        self.persist = persist

    def command(self) -> list[str]:
        cmd = [self.binary, "--bind", "127.0.0.1", "--port", str(self.port)]
        cmd += ["--dir", str(self.workdir), "--save", "", "--daemonize", "no"]
        cmd += ["--appendonly", "yes" if self.persist else "no", "--appendfsync", "always"]
        cmd += ["--protected-mode", "yes", "--loglevel", "warning"]
        return cmd

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"


class RedisClusterServers(_Managed):
    """A Redis Cluster of ``shards`` masters on loopback (no replicas), for tests."""

    name = "rediscluster"

    def __init__(self, shards: int = 3, workdir: Path | None = None) -> None:
        super().__init__(workdir)
        self.nodes = [_ClusterNode(self.workdir / f"shard{i}") for i in range(shards)]

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def start(self, timeout: float = 20.0) -> None:
        for node in self.nodes:
            node.start()
        cli = find_binary("redis-cli", "GPUSLICE_REDIS_CLI")
        addresses = [f"127.0.0.1:{n.port}" for n in self.nodes]
        created = subprocess.run(
            [cli, "--cluster", "create", *addresses, "--cluster-yes"],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if created.returncode != 0:
            raise ServerError(f"redis-cli --cluster create failed: {created.stdout[-1000:]}")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = [
                subprocess.run(
                    [cli, "-p", str(n.port), "cluster", "info"],
                    capture_output=True,
                    text=True,
                    check=False,
                ).stdout
                for n in self.nodes
            ]
            if all("cluster_state:ok" in st for st in states):
                return
            time.sleep(0.05)
        raise ServerError(f"the Redis cluster did not converge within {timeout:.0f}s")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


class _ClusterNode(RedisServer):
    """One cluster master; its bus port is chosen freely (not port + 10000)."""

    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir, persist=False)
        self.bus_port = free_port()

    def repick_ports(self) -> bool:
        self.bus_port = free_port()
        return super().repick_ports()

    def command(self) -> list[str]:
        return [
            *super().command(),
            *("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"),
            *("--cluster-port", str(self.bus_port)),
        ]


# ---------------------------------------------------------------- NATS cluster


class NatsClusterMember(NatsServer):
    """One nats-server of a :class:`NatsCluster`: its name, a route port, routes
    to the other members and a monitoring port (``/healthz``, ``/jsz``)."""

    def __init__(
        self,
        workdir: Path,
        server_name: str,
        config: str | None = None,
        env: dict[str, str] | None = None,
        cluster_name: str = "gpuslice",
    ) -> None:
        super().__init__(workdir, config=config, env=env)
        self.server_name = server_name
        self.cluster_name = cluster_name
        self.cluster_port = free_port()
        self.monitor_port = free_port()
        self.routes: list[str] = []  # the other members' route URLs

    def repick_ports(self) -> bool:
        # the route port stays: the other members' routes name it
        self.monitor_port = free_port()
        return super().repick_ports()

    @property
    def route_url(self) -> str:
        return f"nats://127.0.0.1:{self.cluster_port}"

    def command(self) -> list[str]:
        cmd = super().command()
        cmd += ["--server_name", self.server_name, "--cluster_name", self.cluster_name]
        cmd += ["--cluster", self.route_url, "-m", str(self.monitor_port)]
        if self.routes:
            cmd += ["--routes", ",".join(self.routes)]
        return cmd

    def monitor(self, path: str, timeout: float = 2.0) -> tuple[int, dict[str, object]]:
        """GET the monitoring endpoint ``path``: (HTTP status, its JSON); (0, {})
        when it does not answer."""
        url = f"http://127.0.0.1:{self.monitor_port}{path}"
        try:
            with urllib.request.urlopen(url, timeout=timeout) as reply:
                return reply.status, _json_object(reply.read())
        except urllib.error.HTTPError as exc:
            return exc.code, _json_object(exc.read())
        except (OSError, ValueError):
            return 0, {}

    def healthy(self) -> bool:
        """Up, routed, and JetStream current with its meta group (which has a leader)."""
        if not self.running:
            return False
        status, _ = self.monitor("/healthz")
        if status != 200:
            return False
        _, jsz = self.monitor("/jsz")
        meta = jsz.get("meta_cluster")
        return isinstance(meta, dict) and bool(meta.get("leader"))


def _json_object(raw: bytes) -> dict[str, object]:
    try:
        value = json.loads(raw or b"{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class NatsCluster(_Managed):
    """``size`` nats-servers on loopback, routed to each other as one JetStream
    cluster (``cluster_name`` gpuslice, servers n0, n1, ...), each with its own
    store. Every member takes the same ``config`` text (accounts, auth callout)
    and ``env``. :attr:`url` names all members, as clients take it."""

    name = "natscluster"

    def __init__(
        self,
        workdir: Path | None = None,
        size: int = 3,
        config: str | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        super().__init__(workdir)
        self.members = [
            NatsClusterMember(self.workdir / f"n{i}", f"n{i}", config=config, env=env)
            for i in range(size)
        ]
        for member in self.members:
            member.routes = [m.route_url for m in self.members if m is not member]

    @property
    def url(self) -> str:
        return ",".join(m.url for m in self.members)

    def start(self, timeout: float = 30.0) -> None:
        for member in self.members:
            member.start(timeout)
        self.wait_healthy(timeout)

    def wait_healthy(
        self, timeout: float = 30.0, members: list[NatsClusterMember] | None = None
    ) -> None:
        """Wait until every running member (or those named) is healthy: routed,
        JetStream current, a meta leader elected; and the leader counts every
        running member as a current peer (before that, placing a replicated
        stream can be refused)."""
        deadline = time.monotonic() + timeout
        for member in members or [m for m in self.members if m.running]:
            while not member.healthy():
                if not member.running and member._proc is not None:
                    tail = member.log_path.read_text(errors="replace")[-2000:]
                    raise ServerError(f"{member.server_name} exited:\n{tail}")
                if time.monotonic() > deadline:
                    _, jsz = member.monitor("/jsz")
                    raise ServerError(
                        f"nats {member.server_name} not healthy within {timeout:.0f}s: "
                        f"{jsz.get('meta_cluster')}"
                    )
                time.sleep(0.1)
        while not self._peers_current():
            if time.monotonic() > deadline:
                raise ServerError(
                    f"the meta leader does not see every member within {timeout:.0f}s"
                )
            time.sleep(0.1)

    def _peers_current(self) -> bool:
        leader = self.meta_leader()
        if leader is None:
            return False
        _, jsz = leader.monitor("/jsz")
        meta = jsz.get("meta_cluster")
        peers = meta.get("replicas") if isinstance(meta, dict) else None
        current = {
            str(p.get("name"))
            for p in peers or []
            if isinstance(p, dict) and p.get("current") and not p.get("offline")
        }
        others = {m.server_name for m in self.members if m.running and m is not leader}
        return others <= current

    def meta_leader(self) -> NatsClusterMember | None:
        """The member the running members name as JetStream's meta leader, if any."""
        for member in self.members:
            if not member.running:
                continue
            _, jsz = member.monitor("/jsz")
            meta = jsz.get("meta_cluster")
            leader = meta.get("leader") if isinstance(meta, dict) else None
            for candidate in self.members:
                if candidate.server_name == leader:
                    return candidate
        return None

    def stop(self) -> None:
        for member in self.members:
            member.stop()


# ---------------------------------------------------------------- Redis sentinels


class RedisMember(RedisServer):
    """One redis-server of a :class:`RedisSentinelGroup`; ``primary_port`` set:
    it starts as that server's replica."""

    def __init__(
        self, workdir: Path, primary_port: int | None = None, min_replicas: int = 0
    ) -> None:
        super().__init__(workdir, persist=True)
        self.primary_port = primary_port
        self.min_replicas = min_replicas

    def repick_ports(self) -> bool:
        # a group's primary keeps its port: its replicas and sentinels name it
        return self.primary_port is not None and super().repick_ports()

    def command(self) -> list[str]:
        cmd = super().command()
        # fsync once a second, as k8s/redis.yaml runs it: the replicas keep the
        # writes; a fsync per write stalls the primary on a busy disk past the
        # sentinels' down-after time, and they fail over a live primary
        cmd[cmd.index("--appendfsync") + 1] = "everysec"
        # a replica's full sync starts at once (diskless, default: after 5 s)
        cmd += ["--repl-diskless-sync-delay", "0"]
        if self.min_replicas:
            # as a primary, refuse writes no replica has acknowledged within
            # 2 s: a primary cut off from the rest stops taking writes it would lose
            cmd += ["--min-replicas-to-write", str(self.min_replicas)]
            cmd += ["--min-replicas-max-lag", "2"]
        if self.primary_port is not None:
            cmd += ["--replicaof", "127.0.0.1", str(self.primary_port)]
        return cmd

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=2, socket_connect_timeout=1)

    def replication(self) -> dict[str, object]:
        """INFO replication, or {} when it does not answer."""
        try:
            with self.client() as client:
                info: dict[str, object] = client.info("replication")
                return info
        except redis.RedisError:
            return {}


class RedisSentinel(ServerProcess):
    """redis-server in sentinel mode; its sentinel.conf lives in its directory
    (a sentinel rewrites it with what it learns, and reads it on restart)."""

    name = "sentinel"

    def __init__(
        self,
        workdir: Path,
        service: str,
        primary_port: int,
        quorum: int,
        down_after_ms: int,
        failover_timeout_ms: int,
    ) -> None:
        super().__init__(workdir)
        self.binary = find_binary("redis-server", "GPUSLICE_REDIS_SERVER")
        self.conf = self.workdir / "sentinel.conf"
        self.service = service
        self._initial = "\n".join(
            [
                "bind 127.0.0.1",
                f"port {self.port}",
                f"dir {self.workdir}",
                "daemonize no",
                "loglevel warning",
                f"sentinel monitor {service} 127.0.0.1 {primary_port} {quorum}",
                f"sentinel down-after-milliseconds {service} {down_after_ms}",
                f"sentinel failover-timeout {service} {failover_timeout_ms}",
                f"sentinel parallel-syncs {service} 1",
                "",
            ]
        )

    def command(self) -> list[str]:
        if not self.conf.exists():  # a restart reads what it rewrote
            self.conf.write_text(self._initial)
        return [self.binary, str(self.conf), "--sentinel"]

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.port}"

    def client(self) -> redis.Redis:
        return redis.Redis(
            port=self.port, socket_timeout=2, socket_connect_timeout=1, decode_responses=True
        )

    def primary_port(self) -> int | None:
        """The port of the primary this sentinel names now, or None."""
        try:
            with self.client() as client:
                addr = client.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.service)
        except redis.RedisError:
            return None
        return int(addr[1]) if addr else None

    def known(self) -> tuple[int, int]:
        """(replicas, other sentinels) this sentinel knows of, up or not."""
        try:
            with self.client() as client:
                replicas = client.execute_command("SENTINEL", "REPLICAS", self.service)
                others = client.execute_command("SENTINEL", "SENTINELS", self.service)
        except redis.RedisError:
            return 0, 0
        return len(replicas), len(others)


class RedisSentinelGroup(_Managed):
    """A Redis primary with ``replicas`` replicas and ``sentinels`` sentinels
    (quorum: a majority) watching it as ``service``, all on loopback with
    append-only persistence. A primary that dies is found down after
    ``down_after_ms`` and a replica promoted."""

    name = "redissentinel"

    def __init__(
        self,
        workdir: Path | None = None,
        replicas: int = 2,
        sentinels: int = 3,
        service: str = "gpuslice",
        down_after_ms: int = 2000,
        failover_timeout_ms: int = 3000,
        min_replicas: int = 1,
    ) -> None:
        """``min_replicas``: the primary refuses writes unless that many replicas
        acknowledged within 2 s (``min-replicas-to-write``, as the manifests run);
        0 lets a primary cut off from its replicas take writes it will lose.

        ``down_after_ms``: at 1 s, on two busy cores, a sentinel found the
        replica it had just promoted down (busy with the full sync of the old
        primary rejoining) and the sentinels failed over a second time."""
        super().__init__(workdir)
        self.service = service
        first = RedisMember(self.workdir / "redis0", min_replicas=min_replicas)
        self.servers = [first] + [
            RedisMember(self.workdir / f"redis{i + 1}", first.port, min_replicas)
            for i in range(replicas)
        ]
        self.quorum = sentinels // 2 + 1
        self.sentinel_servers = [
            RedisSentinel(
                self.workdir / f"sentinel{i}",
                service,
                first.port,
                self.quorum,
                down_after_ms,
                failover_timeout_ms,
            )
            for i in range(sentinels)
        ]

    @property
    def sentinels(self) -> str:
        """The sentinels' addresses, as GPUSLICE_REDIS_SENTINELS takes them."""
        return ",".join(s.url for s in self.sentinel_servers)

    @property
    def url(self) -> str:
        """The URL of the first primary: its database and (no) credentials; a
        client finds the primary of the moment through the sentinels."""
        return self.servers[0].url

    def start(self, timeout: float = 30.0) -> None:
        for server in self.servers:
            server.start(timeout)
        deadline = time.monotonic() + timeout
        for server in self.servers[1:]:
            self._wait(functools.partial(self._replicating, server), deadline, "replica in sync")
        for sentinel in self.sentinel_servers:
            sentinel.start(timeout)
        # a failover needs sentinels that know each other (they vote) and the replicas
        wanted = (len(self.servers) - 1, len(self.sentinel_servers) - 1)
        for sentinel in self.sentinel_servers:
            self._wait(
                functools.partial(_knows, sentinel, wanted), deadline, "sentinels acquainted"
            )

    def stop(self) -> None:
        for sentinel in self.sentinel_servers:
            sentinel.stop()
        for server in self.servers:
            server.stop()

    @staticmethod
    def _wait(check: Callable[[], bool], deadline: float, what: str) -> None:
        while not check():
            if time.monotonic() > deadline:
                raise ServerError(f"redis sentinel group: no {what} in time")
            time.sleep(0.1)

    def _replicating(self, server: RedisMember) -> bool:
        info = server.replication()
        return info.get("role") == "slave" and info.get("master_link_status") == "up"

    def primary(self) -> RedisMember | None:
        """The member a majority of the sentinels name as primary now, or None."""
        votes: dict[int, int] = {}
        for sentinel in self.sentinel_servers:
            if sentinel.running and (port := sentinel.primary_port()) is not None:
                votes[port] = votes.get(port, 0) + 1
        for port, count in votes.items():
            if count >= self.quorum:
                for server in self.servers:
                    if server.port == port:
                        return server
        return None

    def kill_primary(self) -> RedisMember:
        """SIGKILL the primary the sentinels name; the killed member."""
        primary = self.primary()
        if primary is None:
            raise ServerError("the sentinels name no primary")
        primary.kill()
        return primary

    def wait_promoted(self, old: RedisMember, timeout: float = 30.0) -> RedisMember:
        """Wait until the sentinels name another member, which says it is primary."""
        deadline = time.monotonic() + timeout
        while True:
            new = self.primary()
            if new is not None and new is not old and new.replication().get("role") == "master":
                return new
            if time.monotonic() > deadline:
                raise ServerError(f"no replica promoted within {timeout:.0f}s")
            time.sleep(0.1)

    def rejoin(self, member: RedisMember, timeout: float = 30.0) -> None:
        """Start a stopped member again as a replica of the current primary and
        wait until it is in sync."""
        primary = self.primary()
        if primary is None or primary is member:
            raise ServerError("the sentinels name no other primary to follow")
        member.primary_port = primary.port
        member.start(timeout)
        deadline = time.monotonic() + timeout
        self._wait(lambda: self._replicating(member), deadline, "rejoined replica in sync")


def _knows(sentinel: RedisSentinel, wanted: tuple[int, int]) -> bool:
    return sentinel.known() == wanted
