"""Every gpuslice HTTP server (metrics ports, probes, the webhook, the
extender) against a client that reaches it from anywhere in the cluster: a
request head or body that never ends, or a head of hundreds of megabytes,
holds neither a connection nor memory for long; the server keeps serving."""

from __future__ import annotations

import asyncio
import contextlib
import time

import httpx
import pytest

from gpuslice_common import service
from gpuslice_common.service import metrics_server


async def _closed(reader: asyncio.StreamReader, within: float) -> bool:
    """Whether the server closes the connection (or answers and closes) within ``within`` s."""
    try:
        async with asyncio.timeout(within):
            while await reader.read(65536):
                pass
    except TimeoutError:
        return False
    except ConnectionError:
        return True
    return True


async def test_a_request_head_that_never_ends_is_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(service, "REQUEST_TIMEOUT_S", 0.5)
    async with metrics_server(lambda: b"up 1\n", "127.0.0.1", 0, "test-metrics") as port:
        idle_r, idle_w = await asyncio.open_connection("127.0.0.1", port)
        slow_r, slow_w = await asyncio.open_connection("127.0.0.1", port)
        slow_w.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")

        async def trickle() -> None:  # a header line now and then, never the end
            with contextlib.suppress(ConnectionError):
                for _ in range(40):
                    await asyncio.sleep(0.1)
                    slow_w.write(b"X-Slow: y\r\n")
                    await slow_w.drain()

        trickling = asyncio.create_task(trickle())
        started = time.monotonic()
        assert await _closed(idle_r, 3.0)
        assert await _closed(slow_r, 3.0)
        assert time.monotonic() - started < 3.0
        trickling.cancel()
        # after an answer, the kept-alive connection gets a new deadline too
        ka_r, ka_w = await asyncio.open_connection("127.0.0.1", port)
        ka_w.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        await ka_w.drain()
        assert b"200 OK" in await ka_r.readuntil(b"\r\n\r\n")
        ka_w.write(b"GET /metrics HTTP/1.1\r\n")
        await ka_w.drain()
        assert await _closed(ka_r, 3.0)
        async with httpx.AsyncClient() as client:
            assert (await client.get(f"http://127.0.0.1:{port}/metrics")).text == "up 1\n"
        for writer in (idle_w, slow_w, ka_w):
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()


async def _send_huge_head(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, size: int
) -> tuple[int, bytes | None]:
    """Send a request head of about ``size`` bytes: (bytes sent, the answer or
    None when the server hung up first)."""
    writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
    line = b"X-Big: " + b"a" * (1024 * 1024) + b"\r\n"
    sent = 0
    try:
        while sent < size:
            writer.write(line)
            await writer.drain()
            sent += len(line)
        writer.write(b"\r\n")
        await writer.drain()
        return sent, await reader.read(100)
    except ConnectionError:
        return sent, None


async def test_a_huge_request_head_is_refused_before_it_is_held() -> None:
    async with metrics_server(lambda: b"up 1\n", "127.0.0.1", 0, "test-metrics") as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        sent, answer = await _send_huge_head(reader, writer, 256 * 1024 * 1024)
        assert answer is None, f"answered {answer!r} after {sent} bytes"  # hung up mid-head
        assert sent < 16 * 1024 * 1024
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
        async with httpx.AsyncClient() as client:
            assert (await client.get(f"http://127.0.0.1:{port}/metrics")).status_code == 200


async def test_a_request_body_that_never_ends_is_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(service, "REQUEST_TIMEOUT_S", 0.5)
    async with metrics_server(lambda: b"up 1\n", "127.0.0.1", 0, "test-metrics") as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        await writer.drain()
        started = time.monotonic()
        assert await _closed(reader, 3.0)
        assert time.monotonic() - started < 3.0
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
