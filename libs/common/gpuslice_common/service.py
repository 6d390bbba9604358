"""What every gpuslice service process shares: its command line and its HTTP server.

:func:`run_service` is the body of each ``python -m gpuslice_<service>``: read
the settings (exit 2 naming the bad variable), set up logging, run the service's
``main`` on uvloop where it is installed, and turn the errors the service
declares into a one-line message and an exit code, never a traceback.

:func:`http_server` runs uvicorn for the block of a ``with``: it returns once the
server listens, raises OSError when it cannot (uvicorn itself would exit the
process), and stops the server when the block ends. Every request body passes
:class:`BodyLimit` on its way in, with the cap the service names.

:func:`every` runs a service's periodic job for as long as its task lives.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from collections import deque
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Coroutine,
    Iterator,
    MutableMapping,
)
from typing import Any, TypeVar, cast

import uvicorn
from pydantic_settings import BaseSettings
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gpuslice_common.config import ConfigError, load

S = TypeVar("S", bound=BaseSettings)
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
STOP_TIMEOUT_S = 5.0
# A request head (request line and headers) larger than this is answered 400
# and the connection closed; a request (head and body) not whole this long
# after the connection opened, or after the last answer on it, has its
# connection closed.
MAX_HEAD_BYTES = 64 * 1024
REQUEST_TIMEOUT_S = 10.0


def run_service(
    name: str,
    settings_class: type[S],
    main: Callable[[S], Coroutine[Any, Any, None]],
    *,
    fatal: tuple[type[Exception], ...] = (),
    failed: tuple[type[Exception], ...] = (OSError,),
    uvloop: bool = True,
) -> int:
    """Run a service to its end; the process's exit code.

    ``fatal`` errors are ones of setup (configuration, files): exit 2. ``failed``
    errors are ones of running (a server unreachable for good): exit 1. Both are
    printed as ``name: message``. ``uvloop=False`` keeps asyncio's own loop (for
    libraries that need it, such as grpc.aio).
    """
    try:
        settings = load(settings_class)
    except ConfigError as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return 2
    level = getattr(settings, "log_level", "INFO")
    logging.basicConfig(level=level, format=LOG_FORMAT)
    try:
        if uvloop:
            _run_loop(main(settings))
        else:
            asyncio.run(main(settings))
    except fatal as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return 2
    except failed as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    return 0


def _run_loop(coroutine: Coroutine[Any, Any, None]) -> None:
    """Run on uvloop where it is installed (it is a dependency off Windows)."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(coroutine)
    else:
        uvloop.run(coroutine)


Message = MutableMapping[str, Any]
Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
AsgiApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class BodyLimit:
    """ASGI middleware: a request body over ``limit`` bytes is answered 413, and
    nothing beyond the limit is ever held in memory.

    A declared ``Content-Length`` over the limit is refused before any of the
    body is read; a body without one (chunked) is read up to the limit and
    refused as soon as it passes it. Whatever of the body follows the 413, uvicorn
    reads and discards (so the client gets to read the answer), holding none of
    it. The application sees a body only once it has arrived whole within the
    limit; ``on_refused`` is called per refusal.
    """

    def __init__(
        self, app: AsgiApp, limit: int, on_refused: Callable[[], None] | None = None
    ) -> None:
        self.app = app
        self.limit = limit
        self.on_refused = on_refused

    async def __call__(self, scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > self.limit:
                await self._refuse(send)
                return
        chunks: deque[bytes] = deque()
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away: no one to answer
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                chunks.clear()
                await self._refuse(send)
                return
            if chunk:
                chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if chunks:
                chunk = chunks.popleft()
                replayed = not chunks
                return {"type": "http.request", "body": chunk, "more_body": bool(chunks)}
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"", "more_body": False}
            return await receive()  # after the body: what the server says next (disconnect)

        await self.app(scope, replay, send)

    async def _refuse(self, send: Send) -> None:
        if self.on_refused is not None:
            self.on_refused()
        body = b'{"error": "the request body is larger than %d bytes"}' % self.limit
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


class BoundedHttpTools(HttpToolsProtocol):
    """uvicorn's httptools protocol with two bounds it lacks. A request head
    (request line and headers) over :data:`MAX_HEAD_BYTES` is answered 400 and
    the connection closed, before more of it is held in memory. A connection
    without a whole request (head and body) :data:`REQUEST_TIMEOUT_S` after it
    opened or after its last answer is closed: a client that sends nothing, a
    header line now and then (slowloris), or a body that never ends holds a
    connection that long at most. A request being answered is never cut."""

    _deadline: asyncio.TimerHandle | None = None
    _head_bytes = 0  # of the request head being received, counted by whole reads
    _in_head = True  # bytes now received belong to a request head
    _steps = 0  # heads and messages completed on this connection
    _whole = False  # a whole request arrived since the deadline was set

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._start_deadline()

    def data_received(self, data: bytes) -> None:
        steps = self._steps
        super().data_received(data)
        # a read in which no head or message completed was all head: counted
        # after the parser had it, so at most one read is held beyond the bound
        if self._in_head and self._steps == steps and not self.transport.is_closing():
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                self.send_400_response("Request head too large.")

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._head_bytes = 0
        self._steps += 1
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._whole = True
        self._in_head = True  # what comes next is the next request's head
        self._steps += 1
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._start_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        super().connection_lost(exc)

    def _start_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._whole = False
        self._deadline = self.loop.call_later(REQUEST_TIMEOUT_S, self._request_overdue)

    def _request_overdue(self) -> None:
        if not self._whole and not self.transport.is_closing():
            self.transport.close()


class _QuietServer(uvicorn.Server):
    """uvicorn without signal handling of its own: the service handles SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def _serve(server: uvicorn.Server) -> None:
    try:
        await server.serve()
    except SystemExit:  # uvicorn exits when it cannot listen
        config = server.config
        raise OSError(f"cannot serve HTTP on {config.host}:{config.port}") from None


@contextlib.asynccontextmanager
async def http_server(
    config: uvicorn.Config,
    name: str,
    *,
    max_body: int,
    on_refused: Callable[[], None] | None = None,
    handle_signals: bool = True,
) -> AsyncIterator[tuple[uvicorn.Server, asyncio.Task[None]]]:
    """uvicorn serving ``config`` until the block ends: (server, its task).

    Request bodies over ``max_body`` bytes are answered 413 (:class:`BodyLimit`),
    request heads over :data:`MAX_HEAD_BYTES` 400, and a connection without a
    whole request for :data:`REQUEST_TIMEOUT_S` is closed (:class:`BoundedHttpTools`).
    With ``handle_signals`` uvicorn stops on SIGINT/SIGTERM and the task ends;
    without, the service handles them. Raises OSError if it cannot listen.
    """
    config.app = BodyLimit(cast(AsgiApp, config.app), max_body, on_refused)
    config.http = BoundedHttpTools
    server = uvicorn.Server(config) if handle_signals else _QuietServer(config)
    serving = asyncio.create_task(_serve(server), name=name)
    try:
        while not server.started:
            if serving.done():
                serving.result()  # raises the start-up error
                raise OSError(f"{name}: the HTTP server stopped during start-up")
            await asyncio.sleep(0.01)
        yield server, serving
    finally:
        server.should_exit = True
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(serving), STOP_TIMEOUT_S)
        if not serving.done():
            serving.cancel()
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await serving


def check_cancelled() -> None:
    """Raise CancelledError if the current task was cancelled and the cancellation
    was swallowed on the way (the Redis client can do that mid-command), so a
    loop that calls this after each pass still ends when asked."""
    me = asyncio.current_task()
    if me is not None and me.cancelling():
        raise asyncio.CancelledError


def plain_http(app: Any, host: str, port: int, log_level: str = "warning") -> uvicorn.Config:
    """uvicorn's settings for a service's plain-HTTP endpoints (probes, metrics,
    the extender's verbs): no access log, no lifespan."""
    return uvicorn.Config(
        app, host=host, port=port, log_level=log_level.lower(), access_log=False, lifespan="off"
    )


async def every(
    seconds: float,
    job: Callable[[], Awaitable[object]],
    what: str,
    *,
    expected: tuple[type[Exception], ...] = (),
) -> None:
    """Run ``job`` every ``seconds`` until cancelled. A failure never ends the
    loop: an ``expected`` one (a server away) is a warning, any other is logged
    with its traceback. A cancellation that a library swallowed inside ``job``
    (the task stays "cancelling") still ends it."""
    log = logging.getLogger(__name__)
    while True:
        try:
            await job()
        except expected as exc:
            log.warning("%s skipped: %s", what, exc)
        except Exception:
            log.exception("%s failed", what)
        check_cancelled()
        await asyncio.sleep(seconds)


class SharedCheck:
    """An async check (a readiness probe's) whose answer callers share for
    ``ttl`` seconds, and whose run in progress concurrent callers wait on: a
    probe that anyone in the cluster network can call in a loop costs what it
    checks (the inventory, Redis) at most one check per ``ttl``. A check that
    raises fails the callers waiting on it and is not kept."""

    def __init__(self, check: Callable[[], Awaitable[bool]], ttl: float = 1.0) -> None:
        self.check = check
        self.ttl = ttl
        self._answer: tuple[float, bool] | None = None  # (when, what)
        self._running: asyncio.Future[bool] | None = None

    async def __call__(self) -> bool:
        answer = self._answer
        if answer is not None and time.monotonic() - answer[0] < self.ttl:
            return answer[1]
        if self._running is None:
            self._running = asyncio.ensure_future(self._run())
        return await asyncio.shield(self._running)

    async def _run(self) -> bool:
        try:
            value = await self.check()
            self._answer = (time.monotonic(), value)
            return value
        finally:
            self._running = None


class MetricsEndpoint:
    """A bare ASGI app for a service's plain-HTTP metrics port: ``GET /metrics``
    answers ``render()`` as Prometheus text, ``GET /metrics/hami`` HAMi's names
    (:func:`hami_answer`), ``GET /healthz`` answers ok; any other path is 404 and
    any other method 405, each with a one-line JSON error. Put it behind
    :func:`http_server` with ``max_body=0`` so that a request with a body is
    refused (413) before it is read."""

    def __init__(
        self, render: Callable[[], bytes], hami: Callable[[], bytes] | None = None
    ) -> None:
        self.render = render
        self.hami = hami

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return  # lifespan is off; websockets are not served
        path, method = scope["path"], scope["method"]
        if path not in ("/metrics", HAMI_PATH, "/healthz"):
            status, body, kind = 404, NOT_FOUND, JSON
        elif method not in ("GET", "HEAD"):
            status, body, kind = 405, b'{"error": "method not allowed: use GET"}', JSON
        elif path == "/healthz":
            status, body, kind = 200, b'{"status": "ok"}', JSON
        elif path == HAMI_PATH:
            status, body, kind = hami_answer(self.hami)
        else:
            status, body, kind = 200, self.render(), PROMETHEUS_TEXT
        headers = [(b"content-type", kind), (b"content-length", b"%d" % len(body))]
        if status == 405:
            headers.append((b"allow", b"GET, HEAD"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": b"" if method == "HEAD" else body})


def hami_answer(render: Callable[[], bytes] | None) -> tuple[int, bytes, bytes]:
    """What ``GET /metrics/hami`` answers, as (status, body, content type).

    HAMi's metric names (``GPUDeviceMemoryAllocated``, ``QuotaUsed``, ...) are
    camelCase, which Prometheus's naming rules flag, so each service serves them
    on this path of its metrics port, apart from ``/metrics``, which then passes
    ``promtool check metrics``. ``render`` is None while ``hami_metrics`` is off:
    404, naming the setting. A service with no HAMi names renders an empty text.
    """
    if render is None:
        return 404, HAMI_OFF, JSON
    return 200, render(), PROMETHEUS_TEXT


JSON = b"application/json"
PROMETHEUS_TEXT = b"text/plain; version=0.0.4; charset=utf-8"
HAMI_PATH = "/metrics/hami"
NOT_FOUND = b'{"error": "not found: only /metrics, /metrics/hami and /healthz"}'
HAMI_OFF = b'{"error": "HAMi\'s metric names are off: GPUSLICE_HAMI_METRICS is false"}'


@contextlib.asynccontextmanager
async def metrics_server(
    render: Callable[[], bytes],
    host: str,
    port: int,
    name: str,
    *,
    hami: Callable[[], bytes] | None = None,
    log_level: str = "warning",
) -> AsyncIterator[int]:
    """:class:`MetricsEndpoint` serving on ``host:port`` until the block ends
    (``hami`` renders ``/metrics/hami``; None: the setting is off); yields the
    port bound. Raises OSError when it cannot listen."""
    config = plain_http(MetricsEndpoint(render, hami), host, port, log_level)
    async with http_server(config, name, max_body=0, handle_signals=False) as (server, _):
        yield bound_port(server, port)


def bound_port(server: uvicorn.Server, default: int) -> int:
    """The port ``server`` actually listens on (0 in its settings picks a free one)."""
    for listener in server.servers:
        for sock in listener.sockets:
            return int(sock.getsockname()[1])
    return default
