"""A local Kubernetes API server for tests: it records every request and answers
(method, path) from canned JSON, so the real ``kubernetes`` client can be driven
over HTTP. The ``kube_api_server`` fixture (tests/conftest.py) starts one.

It also reviews ServiceAccount tokens (TokenReview) that its ``tokens`` minted
for test pods, as the API server does for projected tokens: bound to a pod and
its node (``authentication.kubernetes.io/node-name``), for some audiences,
until they expire; and the user tokens ``tokens.mint_user`` made. It answers
SubjectAccessReviews from ``access``, a rule table the test fills (who may
list pods where, or cluster-wide).

:class:`WithoutWatchList` answers a collection as kube-apiserver 1.34 does when
its etcd lacks progress notifications (etcd before 3.5.13): lists and watches
from a version work, a watch from now is refused."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from gpuslice_cli.dev.apiserver import status_body
from gpuslice_common.kube import AccessRules, ServiceAccountTokens

TOKEN_REVIEWS = "/apis/authentication.k8s.io/v1/tokenreviews"
ACCESS_REVIEWS = "/apis/authorization.k8s.io/v1/subjectaccessreviews"

__all__ = [
    "ACCESS_REVIEWS",
    "TOKEN_REVIEWS",
    "FakeApiServer",
    "Recorded",
    "Stream",
    "WithoutWatchList",
    "fake_api_server",
    "review",
    "status_body",
]


@dataclass
class Recorded:
    method: str
    path: str
    headers: dict[str, str]
    body: Any

    @property
    def query(self) -> dict[str, str]:
        """The query string's parameters, URL-decoded."""
        return dict(parse_qsl(urlsplit(self.path).query))


@dataclass
class Stream:
    """A watch's answer: each event a JSON line in its own HTTP chunk, then the
    response held open ``hold`` seconds (or until the server stops) and ended;
    or, with ``cut``, the connection dropped after the events, mid-response."""

    events: list[Any]
    hold: float = 0.0
    cut: bool = False


# kube-apiserver's words (its watch cache) for a watch-list it cannot serve
WATCH_LIST_REFUSED = (
    "a watch stream was requested by the client but the required storage feature "
    "RequestWatchProgress is disabled"
)


@dataclass
class WithoutWatchList:
    """A collection's GET (``server.answer("GET", path, 200, WithoutWatchList(...))``)
    as kube-apiserver 1.34 serves it over an etcd without progress notifications.

    A list is paged (``limit``, ``continue``) and read at ``version``. A watch from
    a version streams the ``changes`` newer than it, then is held open ``hold``
    seconds. A watch from now ("" or "0", no ``resourceVersionMatch``), which the
    server's WatchList feature turns into ``sendInitialEvents=true``, or one that
    asks for that itself, is with bookmarks a watch-list: the server cannot
    stream the current state without progress notifications, and answers
    HTTP 200 with a single ERROR event (Status code 500, reason InternalError),
    then ends the response."""

    items: list[dict[str, Any]]
    version: int
    changes: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    hold: float = 30.0
    refused: int = 0  # watch-lists refused so far

    def __call__(self, query: dict[str, str]) -> Any:
        if query.get("watch") != "true":
            return self.page(query)
        since = query.get("resourceVersion", "")
        defaulted = "sendInitialEvents" not in query and "resourceVersionMatch" not in query
        initial = query.get("sendInitialEvents") == "true" or (defaulted and since in ("", "0"))
        if initial and query.get("allowWatchBookmarks") == "true":
            self.refused += 1
            error = status_body(500, "InternalError", WATCH_LIST_REFUSED)
            return Stream([{"type": "ERROR", "object": error}])
        newer = [
            {"type": kind, "object": obj}
            for kind, obj in self.changes
            if int(obj["metadata"]["resourceVersion"]) > int(since or 0)
        ]
        return Stream(newer, hold=self.hold)

    def page(self, query: dict[str, str]) -> dict[str, Any]:
        start = int(query.get("continue") or 0)
        end = start + int(query.get("limit") or len(self.items) or 1)
        metadata: dict[str, Any] = {"resourceVersion": str(self.version)}
        if end < len(self.items):
            metadata["continue"] = str(end)
        return {
            "kind": "List",
            "apiVersion": "v1",
            "metadata": metadata,
            "items": self.items[start:end],
        }


@dataclass
class FakeApiServer:
    """Answers (method, path) from ``routes`` with (status, JSON body[, delay]);
    anything else gets a 404 Status. A body that is callable is called with the
    request's query parameters (e.g. to answer each page of a list, or each
    watch with a :class:`Stream`)."""

    host: str = ""
    requests: list[Recorded] = field(default_factory=list)
    routes: dict[tuple[str, str], tuple[int, Any, float]] = field(default_factory=dict)
    stopping: threading.Event = field(default_factory=threading.Event)
    tokens: ServiceAccountTokens = field(default_factory=ServiceAccountTokens)
    review_delay: float = 0.0  # seconds each TokenReview takes (unless routed otherwise)
    access: AccessRules = field(default_factory=AccessRules)
    # collections (e.g. "/api/v1/namespaces/ns/secrets") whose objects are kept:
    # POST creates one, GET reads it, PUT replaces it if its resourceVersion is
    # the stored one (else 409, as the API server answers a stale update)
    collections: set[str] = field(default_factory=set)
    objects: dict[str, dict[str, Any]] = field(default_factory=dict)  # by object path
    versions: int = 0

    def keep(self, collection: str) -> None:
        self.collections.add(collection.rstrip("/"))

    def put(self, collection: str, obj: dict[str, Any]) -> dict[str, Any]:
        """Store ``obj`` in ``collection`` (kept from now on), with a new resourceVersion."""
        self.keep(collection)
        self.versions += 1
        stored = json.loads(json.dumps(obj))
        stored.setdefault("metadata", {})["resourceVersion"] = str(self.versions)
        self.objects[f"{collection.rstrip('/')}/{stored['metadata']['name']}"] = stored
        return stored

    def stored(self, method: str, path: str, body: Any) -> tuple[int, Any] | None:
        """The answer for a kept collection's object, or None if ``path`` is not one."""
        parent, _, name = path.rpartition("/")
        if method == "POST" and path in self.collections:
            name = str((body or {}).get("metadata", {}).get("name", ""))
            if f"{path}/{name}" in self.objects:
                return 409, status_body(409, "AlreadyExists", f"{name} already exists")
            return 201, self.put(path, body)
        if parent not in self.collections:
            return None
        current = self.objects.get(path)
        if current is None:
            return 404, status_body(404, "NotFound", f"{name} not found")
        if method == "GET":
            return 200, current
        if method == "PUT":
            version = (body or {}).get("metadata", {}).get("resourceVersion")
            if version != current["metadata"]["resourceVersion"]:
                return 409, status_body(409, "Conflict", f"{name} has been modified")
            return 200, self.put(parent, body)
        return None

    def answer(self, method: str, path: str, status: int, body: Any, delay: float = 0.0) -> None:
        self.routes[(method, path)] = (status, body, delay)

    @property
    def reviews(self) -> list[Recorded]:
        """The TokenReviews asked so far."""
        return [r for r in self.requests if r.method == "POST" and r.path == TOKEN_REVIEWS]

    @property
    def access_reviews(self) -> list[Recorded]:
        """The SubjectAccessReviews asked so far."""
        return [r for r in self.requests if r.method == "POST" and r.path == ACCESS_REVIEWS]


def make_handler(state: FakeApiServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _serve(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            body = json.loads(raw) if raw else None
            headers = {key.lower(): value for key, value in self.headers.items()}
            recorded = Recorded(self.command, self.path, headers, body)
            state.requests.append(recorded)
            route = (self.command, self.path.split("?")[0])
            default = (404, status_body(404, "NotFound", "the server could not find it"), 0.0)
            if route == ("POST", TOKEN_REVIEWS) and route not in state.routes:
                default = (201, review(state.tokens, body), state.review_delay)
            if route == ("POST", ACCESS_REVIEWS) and route not in state.routes:
                default = (201, access_review(state.access, body), 0.0)
            kept = None if route in state.routes else state.stored(*route, body)
            status, answer, delay = (*kept, 0.0) if kept else state.routes.get(route, default)
            if callable(answer):
                answer = answer(recorded.query)
            if delay:
                time.sleep(delay)
            if isinstance(answer, Stream):
                self._stream(status, answer)
                return
            data = json.dumps(answer).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except OSError:
                pass  # the client gave up (timeout test)

        def _stream(self, status: int, stream: Stream) -> None:
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for event in stream.events:
                    line = event if isinstance(event, bytes) else json.dumps(event).encode() + b"\n"
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                    self.wfile.flush()
                if stream.cut:
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                state.stopping.wait(stream.hold)
                self.wfile.write(b"0\r\n\r\n")
            except OSError:
                pass  # the client went away

        do_GET = do_POST = do_PATCH = do_PUT = _serve

    return Handler


def review(tokens: ServiceAccountTokens, body: Any) -> dict[str, Any]:
    """The TokenReview the API server answers a create with."""
    spec = body.get("spec") if isinstance(body, dict) else None
    token = spec.get("token") if isinstance(spec, dict) else None
    audiences = (spec.get("audiences") if isinstance(spec, dict) else None) or []
    status = tokens.review(str(token or ""), [str(a) for a in audiences])
    return {
        "apiVersion": "authentication.k8s.io/v1",
        "kind": "TokenReview",
        "metadata": {},
        "spec": {"audiences": audiences},
        "status": status,
    }


def access_review(access: AccessRules, body: Any) -> dict[str, Any]:
    """The SubjectAccessReview the API server answers a create with."""
    spec = body.get("spec") if isinstance(body, dict) else None
    return {
        "apiVersion": "authorization.k8s.io/v1",
        "kind": "SubjectAccessReview",
        "metadata": {},
        "spec": spec if isinstance(spec, dict) else {},
        "status": access.review(spec),
    }


class _Server(ThreadingHTTPServer):
    request_queue_size = 256  # many clients connecting at once (TokenReview bursts)


@contextmanager
def fake_api_server() -> Iterator[FakeApiServer]:
    """A FakeApiServer listening on a free loopback port until the block ends."""
    state = FakeApiServer()
    httpd = _Server(("127.0.0.1", 0), make_handler(state))
    httpd.daemon_threads = False  # server_close() waits for every handler
    state.host = f"http://127.0.0.1:{httpd.server_address[1]}"
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield state
    finally:
        state.stopping.set()
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)
