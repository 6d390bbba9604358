"""Admission latency and throughput over HTTPS on loopback.

Starts nats-server and the webhook (``python -m gpuslice_webhook``, TLS with a
test certificate, events published to NATS, no Kubernetes API) as child
processes, then posts AdmissionReviews over keep-alive HTTPS connections the way
the API server does. Prints p50/p99 per kind of pod at 1, 4 and 8 concurrent
connections, and admissions/s. Baselines in the same run: ``GET /healthz`` (the
HTTPS and HTTP floor, no admission work) and a pod without GPUs (the review is
read and answered, nothing is changed).

Usage: python bench/webhook_bench.py [--requests 3000]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import date
from pathlib import Path

import numpy as np
import orjson
import trustme

from gpuslice_common.servers import NatsServer, free_port


def gpu_pod(i: int) -> dict[str, object]:
    """A pod like those HAMi users write: a shared GPU, a sidecar, env and volumes."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "generateName": "trainer-",
            "labels": {"app": "trainer", "pod-template-hash": f"{i:08x}"},
            "annotations": {"nvidia.com/use-gputype": "A100,H100"},
        },
        "spec": {
            "containers": [
                {
                    "name": "train",
                    "image": "registry.example/train:1.4",
                    "command": ["python", "train.py", "--epochs", "10"],
                    "env": [{"name": "EPOCHS", "value": "10"}, {"name": "LR", "value": "3e-4"}],
                    "resources": {
                        "limits": {
                            "cpu": "4",
                            "memory": "16Gi",
                            "nvidia.com/gpu": "1",
                            "nvidia.com/gpumem": "8000",
                            "nvidia.com/gpucores": "30",
                        },
                        "requests": {"cpu": "2", "memory": "8Gi"},
                    },
                    "volumeMounts": [{"name": "data", "mountPath": "/data"}],
                },
                {
                    "name": "log-shipper",
                    "image": "registry.example/shipper:2",
                    "resources": {"limits": {"cpu": "100m", "memory": "64Mi"}},
                },
            ],
            "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "data"}}],
            "restartPolicy": "Never",
        },
    }


def cpu_pod(i: int) -> dict[str, object]:
    pod = gpu_pod(i)
    spec = pod["spec"]
    assert isinstance(spec, dict)
    spec["containers"][0]["resources"] = {"limits": {"cpu": "4", "memory": "16Gi"}}
    return pod


def review(pod: dict[str, object], i: int) -> bytes:
    return orjson.dumps(
        {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": f"00000000-0000-0000-0000-{i:012d}",
                "kind": {"group": "", "version": "v1", "kind": "Pod"},
                "resource": {"group": "", "version": "v1", "resource": "pods"},
                "namespace": "team-a",
                "operation": "CREATE",
                "userInfo": {"username": "system:serviceaccount:kube-system:job-controller"},
                "object": pod,
                "dryRun": False,
            },
        }
    )


class Connection:
    """One keep-alive HTTPS/1.1 connection, as light as the API server's client."""

    def __init__(self, port: int, context: ssl.SSLContext) -> None:
        self.port, self.context = port, context
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def call(self, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
        if self.reader is None or self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(
                "127.0.0.1", self.port, ssl=self.context, server_hostname="localhost"
            )
        head = (
            f"{method} {path} HTTP/1.1\r\nHost: localhost\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        self.writer.write(head.encode() + body)
        await self.writer.drain()
        status = int((await self.reader.readline()).split()[1])
        length = 0
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            if name.strip().lower() == "content-length":
                length = int(value)
        return status, await self.reader.readexactly(length)

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            with contextlib.suppress(OSError, ssl.SSLError):
                await self.writer.wait_closed()


async def measure(
    port: int,
    context: ssl.SSLContext,
    request: Callable[[int], tuple[str, str, bytes]],
    count: int,
    connections: int,
) -> dict[str, float]:
    """Latency of ``count`` calls spread over ``connections`` connections, and calls/s."""
    samples: list[float] = []
    clients = [Connection(port, context) for _ in range(connections)]
    for client in clients:  # handshakes and first-call costs are not measured
        method, path, body = request(0)
        await client.call(method, path, body)

    async def worker(client: Connection, offset: int) -> None:
        for i in range(offset, count, connections):
            method, path, body = request(i)
            started = time.perf_counter()
            status, reply = await client.call(method, path, body)
            samples.append(time.perf_counter() - started)
            if status != 200 or (path == "/mutate" and b'"allowed":true' not in reply):
                raise RuntimeError(f"unexpected answer {status}: {reply[:200]!r}")

    started = time.perf_counter()
    await asyncio.gather(*(worker(c, k) for k, c in enumerate(clients)))
    wall = time.perf_counter() - started
    for client in clients:
        await client.close()
    ms = np.asarray(samples) * 1000
    return {
        "p50": float(np.percentile(ms, 50)),
        "p99": float(np.percentile(ms, 99)),
        "max": float(ms.max()),
        "rate": count / wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=3000)
    args = parser.parse_args()
    ca = trustme.CA()
    cert = ca.issue_cert("localhost", "127.0.0.1")
    client_context = ssl.create_default_context()
    ca.configure_trust(client_context)
    gpu_bodies = [review(gpu_pod(i), i) for i in range(args.requests)]
    cpu_bodies = [review(cpu_pod(i), i) for i in range(args.requests)]
    cases: list[tuple[str, Callable[[int], tuple[str, str, bytes]]]] = [
        ("baseline: GET /healthz", lambda i: ("GET", "/healthz", b"")),
        ("baseline: pod without GPU", lambda i: ("POST", "/mutate", cpu_bodies[i])),
        ("GPU pod, admitted and patched", lambda i: ("POST", "/mutate", gpu_bodies[i])),
    ]
    results: list[tuple[str, int, dict[str, float]]] = []
    with tempfile.TemporaryDirectory() as tmp, NatsServer() as nats:
        cert_file, key_file = Path(tmp, "tls.crt"), Path(tmp, "tls.key")
        cert_file.write_bytes(b"".join(p.bytes() for p in cert.cert_chain_pems))
        key_file.write_bytes(cert.private_key_pem.bytes())
        port = free_port()
        env = {
            **os.environ,
            "GPUSLICE_NATS_URL": nats.url,
            "GPUSLICE_KUBE_API": "none",
            "GPUSLICE_LISTEN_HOST": "127.0.0.1",
            "GPUSLICE_LISTEN_PORT": str(port),
            "GPUSLICE_METRICS_HOST": "127.0.0.1",
            "GPUSLICE_METRICS_PORT": str(free_port()),
            "GPUSLICE_TLS_CERT_FILE": str(cert_file),
            "GPUSLICE_TLS_KEY_FILE": str(key_file),
            "GPUSLICE_LOG_LEVEL": "WARNING",
        }
        server = subprocess.Popen([sys.executable, "-m", "gpuslice_webhook"], env=env)
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    asyncio.run(measure(port, client_context, cases[0][1], 1, 1))
                    break
                except OSError:
                    if time.monotonic() > deadline or server.poll() is not None:
                        raise SystemExit("the webhook did not start") from None
                    time.sleep(0.1)
            for connections in (1, 4, 8):
                for name, request in cases:
                    row = asyncio.run(
                        measure(port, client_context, request, args.requests, connections)
                    )
                    results.append((name, connections, row))
        finally:
            server.terminate()
            server.wait(timeout=10)
    print(f"# webhook benchmark, {date.today()}, {platform.node()}, {os.cpu_count()} CPUs")
    print(f"# {args.requests} requests per row over keep-alive HTTPS (TLS 1.3) on loopback")
    print("| request | connections | p50 ms | p99 ms | max ms | requests/s |")
    print("|---|---|---|---|---|---|")
    for name, connections, row in results:
        print(
            f"| {name} | {connections} | {row['p50']:.2f} | {row['p99']:.2f} | "
            f"{row['max']:.2f} | {row['rate']:.0f} |"
        )


if __name__ == "__main__":
    main()
