"""The webhook as a server: HTTPS with a test CA, certificate rotation without a
restart, health, readiness and metrics, the OpenAPI document, and the process's
command line."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trustme

from gpuslice_common.servers import NatsServer, free_port
from gpuslice_webhook.service import Running
from tests.webhook.conftest import (
    CERT_NAMES,
    GPU,
    MEM,
    check_response,
    container,
    pod,
    review,
    trusting,
    write_cert,
)


def served_certificate(port: int, ca_file: Path) -> bytes:
    """The DER certificate the server presents to a client that checks it."""
    context = ssl.create_default_context(cafile=str(ca_file))
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
        context.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return der


def der_of(cert: trustme.LeafCert) -> bytes:
    return ssl.PEM_cert_to_DER_cert(cert.cert_chain_pems[0].bytes().decode())


async def wait_for(condition: object, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if callable(condition) and await asyncio.to_thread(condition):
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not met in time")


# ---------------------------------------------------------------- HTTPS


async def test_mutate_over_https(client: httpx.AsyncClient) -> None:
    body = review(pod(container("main", {MEM: "3000"})))
    reply = await client.post("/mutate", json=body)
    assert reply.status_code == 200
    assert reply.headers["content-type"] == "application/json"
    response = check_response(body, reply.json())
    assert response["allowed"] is True
    assert response["patchType"] == "JSONPatch"


async def test_clients_that_do_not_trust_the_ca_are_refused(https_webhook: Running) -> None:
    base = f"https://127.0.0.1:{https_webhook.port}"
    async with httpx.AsyncClient(base_url=base, timeout=5) as untrusting:
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            await untrusting.get("/healthz")


async def test_plain_http_to_the_https_port_gets_no_answer(https_webhook: Running) -> None:
    async with httpx.AsyncClient(timeout=5) as plain:
        with pytest.raises(httpx.HTTPError):
            await plain.get(f"http://127.0.0.1:{https_webhook.port}/healthz")


def negotiated(port: int, ca_file: Path, ciphers: str) -> str:
    """The cipher suite of a TLS 1.2 handshake offering only ``ciphers``."""
    context = trusting(ca_file)
    context.maximum_version = ssl.TLSVersion.TLSv1_2
    context.set_ciphers(ciphers)
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
        context.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
    ):
        suite = tls.cipher()
    assert suite is not None
    return suite[0]


CBC_SUITES = [
    f"ECDHE-{key}-{cipher}"
    for key in ("ECDSA", "RSA")
    for cipher in ("AES128-SHA256", "AES256-SHA384", "AES128-SHA", "AES256-SHA")
]


async def test_tls_1_2_offers_only_aead_suites(https_webhook: Running, ca_file: Path) -> None:
    port = https_webhook.port
    for cbc in CBC_SUITES:
        with pytest.raises(ssl.SSLError):  # no suite in common: the handshake fails
            await asyncio.to_thread(negotiated, port, ca_file, cbc)
    # the test certificate's key is ECDSA
    for aead in (
        "ECDHE-ECDSA-AES128-GCM-SHA256",
        "ECDHE-ECDSA-AES256-GCM-SHA384",
        "ECDHE-ECDSA-CHACHA20-POLY1305",
    ):
        assert await asyncio.to_thread(negotiated, port, ca_file, aead) == aead
    # TLS 1.3 is left as OpenSSL has it
    assert await asyncio.to_thread(served_certificate, port, ca_file)


async def test_certificate_rotation_without_restart(
    https_webhook: Running,
    client: httpx.AsyncClient,
    ca: trustme.CA,
    ca_file: Path,
    tls_files: tuple[Path, Path],
) -> None:
    cert_file, key_file = tls_files
    port = https_webhook.port
    first = await asyncio.to_thread(served_certificate, port, ca_file)
    renewed = ca.issue_cert(*CERT_NAMES)
    assert der_of(renewed) != first
    # a Secret update: new files appear in a new directory, then the link swaps
    fresh = cert_file.parent / "renewed"
    fresh.mkdir()
    write_cert(renewed, fresh / "tls.crt", fresh / "tls.key")
    for name, path in (("tls.crt", cert_file), ("tls.key", key_file)):
        link = path.with_suffix(".new")
        link.symlink_to(fresh / name)
        link.replace(path)
    await wait_for(lambda: served_certificate(port, ca_file) == der_of(renewed))
    assert https_webhook.tls is not None
    assert https_webhook.tls.stats.reloads == 1
    # the open keep-alive client goes on working across the swap
    metrics = (await client.get("/metrics")).text
    assert "gpuslice_webhook_tls_reloads_total 1.0" in metrics
    assert "gpuslice_webhook_tls_reload_failures_total 0.0" in metrics


async def test_a_broken_certificate_keeps_the_old_one(
    https_webhook: Running, ca: trustme.CA, ca_file: Path, tls_files: tuple[Path, Path]
) -> None:
    cert_file, key_file = tls_files
    port = https_webhook.port
    before = await asyncio.to_thread(served_certificate, port, ca_file)
    other = ca.issue_cert(*CERT_NAMES)
    # a certificate with the wrong key: half of a renewal
    cert_file.write_bytes(other.cert_chain_pems[0].bytes())
    tls = https_webhook.tls
    assert tls is not None
    await wait_for(lambda: tls.stats.failures >= 1)
    assert "not a usable certificate and key" in tls.stats.last_error
    assert await asyncio.to_thread(served_certificate, port, ca_file) == before
    # the other half arrives: the pair is good again and is served
    key_file.write_bytes(other.private_key_pem.bytes())
    await wait_for(lambda: served_certificate(port, ca_file) == der_of(other))


async def test_rotation_to_another_key_type_serves_the_new_certificate(
    https_webhook: Running, ca: trustme.CA, ca_file: Path, tls_files: tuple[Path, Path]
) -> None:
    # OpenSSL keeps one certificate per key type in a context: a reload into the
    # same context would go on serving the old ECDSA one next to the new RSA one.
    cert_file, key_file = tls_files
    rsa = ca.issue_cert(*CERT_NAMES, key_type=trustme.KeyType.RSA)
    write_cert(rsa, cert_file, key_file)
    port = https_webhook.port
    await wait_for(lambda: served_certificate(port, ca_file) == der_of(rsa))


async def test_a_missing_file_is_one_failure_and_its_return_is_served(
    https_webhook: Running, ca: trustme.CA, ca_file: Path, tls_files: tuple[Path, Path]
) -> None:
    cert_file, key_file = tls_files
    tls = https_webhook.tls
    assert tls is not None
    key_file.unlink()
    await wait_for(lambda: tls.stats.failures == 1)
    await asyncio.sleep(0.3)  # several more polls
    assert tls.stats.failures == 1
    assert "cannot read" in tls.stats.last_error
    renewed = ca.issue_cert(*CERT_NAMES)
    write_cert(renewed, cert_file, key_file)
    port = https_webhook.port
    await wait_for(lambda: served_certificate(port, ca_file) == der_of(renewed))


# ---------------------------------------------------------------- health, metrics, OpenAPI


async def test_health_and_readiness(client: httpx.AsyncClient) -> None:
    assert (await client.get("/healthz")).json() == {"status": "ok"}
    ready = await client.get("/readyz")
    assert ready.status_code == 200
    assert ready.json()["status"] == "ready"


async def test_metrics_count_outcomes_and_latency(client: httpx.AsyncClient) -> None:
    cases = [
        review(pod(container("main", {MEM: "3000"}))),  # admitted
        review(pod(container("main", {GPU: "1.5"}))),  # denied
        review(pod(container("main"))),  # skipped
        review(pod(container("main", {GPU: 1}), labels={"hami.io/webhook": "ignore"})),
    ]
    for body in cases:
        assert (await client.post("/mutate", json=body)).status_code == 200
    assert (await client.post("/mutate", content=b"{")).status_code == 400
    text = (await client.get("/metrics")).text
    for outcome in ("admitted", "denied", "skipped", "ignored", "invalid"):
        assert f'gpuslice_webhook_admissions_total{{outcome="{outcome}"}} 1.0' in text
    assert 'gpuslice_webhook_admissions_total{outcome="error"} 0.0' in text
    assert "gpuslice_webhook_admission_seconds_count 5.0" in text


async def test_a_body_over_the_limit_is_refused_unread(client: httpx.AsyncClient) -> None:
    huge = b'{"apiVersion": "admission.k8s.io/v1", "pad": "' + b"x" * (9 * 1024 * 1024) + b'"}'
    reply = await client.post("/mutate", content=huge)
    assert reply.status_code == 413
    assert "larger than" in reply.json()["error"]
    metrics = (await client.get("/metrics")).text
    assert 'gpuslice_webhook_admissions_total{outcome="too_large"} 1.0' in metrics


async def test_openapi_describes_the_admission_review(client: httpx.AsyncClient) -> None:
    doc = (await client.get("/openapi.json")).json()
    operation = doc["paths"]["/mutate"]["post"]
    schema = operation["requestBody"]["content"]["application/json"]["schema"]
    assert schema == {"$ref": "#/components/schemas/AdmissionReviewRequest"}
    components = doc["components"]["schemas"]
    assert {"AdmissionReviewRequest", "AdmissionRequest", "Pod", "Container"} <= set(components)
    assert set(operation["responses"]) >= {"200", "400"}


# ---------------------------------------------------------------- the process


def webhook_env(**values: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUSLICE_")}
    env.update(
        {
            "GPUSLICE_KUBE_API": "none",
            "GPUSLICE_LISTEN_HOST": "127.0.0.1",
            "GPUSLICE_METRICS_HOST": "127.0.0.1",
            "GPUSLICE_METRICS_PORT": str(free_port()),
        }
    )
    env.update(values)
    return env


def run_webhook(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpuslice_webhook"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"GPUSLICE_LISTEN_PORT": "99999"}, "GPUSLICE_LISTEN_PORT"),
        ({"GPUSLICE_TLS_CERT_FILE": "/nonexistent.crt"}, "GPUSLICE_TLS_KEY_FILE"),
        (
            {
                "GPUSLICE_TLS_CERT_FILE": "/nonexistent.crt",
                "GPUSLICE_TLS_KEY_FILE": "/nonexistent.key",
            },
            "cannot read /nonexistent.crt",
        ),
    ],
)
def test_bad_settings_exit_2_with_a_message(env: dict[str, str], message: str) -> None:
    result = run_webhook(webhook_env(**env))
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_a_busy_port_exits_2_with_a_message() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_webhook(webhook_env(GPUSLICE_LISTEN_PORT=str(port)))
    assert result.returncode == 2
    assert f"gpuslice-webhook: cannot serve HTTP on 127.0.0.1:{port}" in result.stderr
    assert "Traceback" not in result.stderr


def test_unusable_certificate_exits_2(tmp_path: Path) -> None:
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    cert.write_text("not a certificate\n")
    key.write_text("not a key\n")
    result = run_webhook(
        webhook_env(GPUSLICE_TLS_CERT_FILE=str(cert), GPUSLICE_TLS_KEY_FILE=str(key))
    )
    assert result.returncode == 2
    assert "not a usable certificate and key" in result.stderr
    assert "Traceback" not in result.stderr


@contextlib.contextmanager
def webhook_process(
    tls_files: tuple[Path, Path], ca_file: Path, nats_url: str
) -> Iterator[tuple[Callable[[dict[str, Any]], httpx.Response], subprocess.Popen[str]]]:
    """``python -m gpuslice_webhook`` over HTTPS: (post a review, the process).

    The first post waits for the webhook to listen. At the end the process gets
    SIGTERM and must exit 0 without a traceback.
    """
    cert_file, key_file = tls_files
    port = free_port()
    env = webhook_env(
        GPUSLICE_LISTEN_PORT=str(port),
        GPUSLICE_TLS_CERT_FILE=str(cert_file),
        GPUSLICE_TLS_KEY_FILE=str(key_file),
        GPUSLICE_NATS_URL=nats_url,
    )
    process = subprocess.Popen(
        [sys.executable, "-m", "gpuslice_webhook"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )

    def post(body: dict[str, Any]) -> httpx.Response:
        deadline = time.monotonic() + 20
        while True:
            try:
                url = f"https://127.0.0.1:{port}/mutate"
                return httpx.post(url, json=body, verify=trusting(ca_file), timeout=5)
            except httpx.TransportError:
                assert process.poll() is None, process.stdout and process.stdout.read()
                assert time.monotonic() < deadline, "the webhook did not start"
                time.sleep(0.1)

    try:
        yield post, process
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=20)
        assert process.returncode == 0, output
        assert "Traceback" not in output
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()


def test_nats_lost_after_connecting_still_stops_cleanly(
    tls_files: tuple[Path, Path], ca_file: Path, own_nats: NatsServer
) -> None:
    body = review(pod(container("main", {MEM: "1000"})))
    with webhook_process(tls_files, ca_file, own_nats.url) as (post, _):
        assert post(body).status_code == 200
        own_nats.stop()
        for _ in range(5):  # admitted while NATS is away
            assert check_response(body, post(body).json())["allowed"] is True


def test_process_serves_https_without_nats_and_stops_on_sigterm(
    tls_files: tuple[Path, Path], ca_file: Path
) -> None:
    body = review(pod(container("main", {MEM: "1000"})))
    nobody = f"nats://127.0.0.1:{free_port()}"
    with webhook_process(tls_files, ca_file, nobody) as (post, _):
        assert check_response(body, post(body).json())["allowed"] is True
