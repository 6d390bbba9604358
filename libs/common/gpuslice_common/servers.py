"""nats-server and redis-server run as child processes.

Used by the test harness and the local stack: each server gets a free loopback
port and its own directory, and can be stopped, killed and started again on the
same port with the same data (for fault tests).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Self


class ServerError(RuntimeError):
    """A server binary is missing or did not come up."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


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
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise ServerError(f"server exited with code {proc.returncode}:\n{tail}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.02)
    raise ServerError(f"server did not listen on 127.0.0.1:{port} within {timeout:.0f}s")


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
        self.start()
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
        self.log_path = self.workdir / f"{self.name}.log"
        self._proc: subprocess.Popen[bytes] | None = None
        self.env: dict[str, str] = {}  # added to this process's environment

    def command(self) -> list[str]:
        raise NotImplementedError

    @property
    def url(self) -> str:
        raise NotImplementedError

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout: float = 15.0) -> None:
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

    def command(self) -> list[str]:
        return [
            *super().command(),
            *("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"),
            *("--cluster-port", str(self.bus_port)),
        ]
