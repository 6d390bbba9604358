"""gpuslice_common.service.BodyLimit through http_server, over real sockets: a body
over the cap is answered 413 without the application seeing it, and the server
keeps serving."""

from __future__ import annotations

import asyncio

import httpx
from fastapi import FastAPI, Request

from gpuslice_common.servers import free_port
from gpuslice_common.service import http_server, plain_http
from tests.rawhttp import post_huge

LIMIT = 64 * 1024


async def test_bodies_over_the_cap_are_refused_before_the_application_sees_them() -> None:
    seen: list[int] = []
    refused = 0

    def count() -> None:
        nonlocal refused
        refused += 1

    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request) -> dict[str, int]:
        seen.append(len(await request.body()))
        return {"length": seen[-1]}

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    port = free_port()
    config = plain_http(app, "127.0.0.1", port)
    async with http_server(config, "test-http", max_body=LIMIT, on_refused=count):
        # declared too large: answered without waiting for a byte of the body
        status, body, _ = await asyncio.to_thread(
            post_huge, port, "/echo", 256 * 1024 * 1024, chunked=False, send_body=False
        )
        assert status == 413
        assert b"larger than 65536 bytes" in body
        # and when the client sends it anyway, it gets the answer all the same
        status, _, _ = await asyncio.to_thread(
            post_huge, port, "/echo", 16 * 1024 * 1024, chunked=False
        )
        assert status == 413
        # chunked: read up to the cap, then answered while the client still sends
        status, _, sent = await asyncio.to_thread(
            post_huge, port, "/echo", 64 * 1024 * 1024, chunked=True, chunk=16 * 1024
        )
        assert status == 413
        assert sent < 64 * 1024 * 1024
        # at the cap, in either framing, the application gets the whole body
        for chunked in (False, True):
            status, body, _ = await asyncio.to_thread(
                post_huge, port, "/echo", LIMIT, chunked=chunked, chunk=4096
            )
            assert (status, body) == (200, b'{"length":65536}')
        async with httpx.AsyncClient(timeout=5) as client:
            reply = await client.get(f"http://127.0.0.1:{port}/healthz")
            assert reply.json() == {"status": "ok"}
            reply = await client.post(f"http://127.0.0.1:{port}/echo", content=b"{}")
            assert reply.json() == {"length": 2}
    assert seen == [LIMIT, LIMIT, 2]
    assert refused == 3
