"""The console's access check (gpuslice_inventory.console.auth), driving the
real ``kubernetes`` client against a local API server (tests/kubeapi.py) that
reviews tokens and answers SubjectAccessReviews from a rule table; and the
FastAPI dependency over real HTTP."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import AsyncIterator
from typing import Annotated, Any

import httpx
import pytest
from fastapi import Depends, FastAPI, Request

from gpuslice_common.kube import KubeApi, KubernetesApi, LocalKubeApi
from gpuslice_common.servers import free_port
from gpuslice_common.service import http_server, plain_http
from gpuslice_inventory.console.auth import (
    MAX_TOKEN,
    AccessDenied,
    Authenticator,
    Viewer,
    dependency,
    install_error_responses,
)
from tests.kubeapi import ACCESS_REVIEWS, TOKEN_REVIEWS, FakeApiServer, status_body


@pytest.fixture
async def kube(kube_api_server: FakeApiServer) -> AsyncIterator[KubernetesApi]:
    api = KubernetesApi.connect(kube_api_server.host, token="inventory-token", timeout=3)
    try:
        yield api
    finally:
        await api.close()


def authenticator(kube: KubeApi, **kw: Any) -> Authenticator:
    return Authenticator("tokenreview", kube, **kw)


def bearer(token: str) -> str:
    return f"Bearer {token}"


async def denied(auth: Authenticator, header: str | None) -> AccessDenied:
    with pytest.raises(AccessDenied) as caught:
        await auth.viewer(header)
    return caught.value


async def test_a_user_who_may_list_pods_everywhere_sees_the_whole_cluster(
    kube_api_server: FakeApiServer, kube: KubernetesApi
) -> None:
    kube_api_server.access.grant(user="alice")
    token = kube_api_server.tokens.mint_user("alice", ["ops"])
    auth = authenticator(kube)
    viewer = await auth.viewer(bearer(token))
    assert viewer == Viewer("alice", None)
    assert await auth.may_see(viewer, "team-a")
    assert await auth.visible(viewer, ["team-a", "team-b"]) is None
    # the review named the token's user and groups, and asked about pods cluster-wide
    (review,) = kube_api_server.access_reviews
    spec = review.body["spec"]
    assert spec["user"] == "alice"
    assert spec["groups"] == ["ops", "system:authenticated"]
    assert spec["resourceAttributes"] == {"group": "", "verb": "list", "resource": "pods"}
    # the token was reviewed for the API server's own audience, by the inventory
    (token_review,) = kube_api_server.reviews
    assert not token_review.body["spec"].get("audiences")
    assert token_review.headers["authorization"] == "Bearer inventory-token"


async def test_a_user_who_may_list_pods_in_some_namespaces_sees_those(
    kube_api_server: FakeApiServer, kube: KubernetesApi
) -> None:
    kube_api_server.access.grant(user="bob", namespace="team-a")
    kube_api_server.access.grant(group="team-c-devs", namespace="team-c")
    token = kube_api_server.tokens.mint_user("bob", ["team-c-devs"])
    auth = authenticator(kube)
    viewer = await auth.viewer(bearer(token))
    assert viewer == Viewer("bob", frozenset())
    assert await auth.may_see(viewer, "team-a")
    assert not await auth.may_see(viewer, "team-b")
    assert await auth.may_see(viewer, "team-c")  # through the group the token review gave
    assert await auth.visible(viewer, ["team-a", "team-b", "team-c", "team-d"]) == {
        "team-a",
        "team-c",
    }
    asked = [
        r.body["spec"]["resourceAttributes"].get("namespace")
        for r in kube_api_server.access_reviews
    ]
    # cluster-wide first, then each namespace once: the answers were kept
    assert asked == [None, "team-a", "team-b", "team-c", "team-d"]


async def test_what_is_no_namespace_name_is_never_visible_nor_asked_about(
    kube_api_server: FakeApiServer, kube: KubernetesApi
) -> None:
    kube_api_server.access.grant(user="bob", namespace="team-a")
    auth = authenticator(kube)
    viewer = await auth.viewer(bearer(kube_api_server.tokens.mint_user("bob")))
    asked = len(kube_api_server.access_reviews)
    for name in ["", "Team-A", "team-a/../x", "a" * 64, "-a", "team a", 7, None]:
        assert not await auth.may_see(viewer, name)  # type: ignore[arg-type]
    assert len(kube_api_server.access_reviews) == asked


async def test_tokens_the_api_does_not_accept_are_refused_with_401(
    kube_api_server: FakeApiServer, kube: KubernetesApi
) -> None:
    kube_api_server.access.grant(user="alice")
    auth = authenticator(kube)
    refused = await denied(auth, bearer("not-a-token-anyone-minted"))
    assert refused.status == 401
    assert "not accepted" in refused.message
    # a node agent's token is for NATS's audience, not the API server's
    agent = kube_api_server.tokens.mint(
        "gpuslice",
        "gpuslice-deviceplugin",
        pod_name="agent",
        pod_uid="uid-agent",
        node="gpu-1",
        audiences=["gpuslice-nats"],
    )
    assert (await denied(auth, bearer(agent))).status == 401
    # an expired token
    expired = kube_api_server.tokens.mint_user("alice", ttl_s=-1)
    assert (await denied(auth, bearer(expired))).status == 401
    assert kube_api_server.access_reviews == []  # no one was asked about


@pytest.mark.parametrize(
    ("header", "why"),
    [
        (None, "required"),
        ("", "required"),
        ("   ", "required"),
        ("Bearer", "required"),
        ("Bearer ", "required"),
        ("Basic YWxpY2U6c2VjcmV0", "must be Bearer"),
        ("bearer " + "a" * (MAX_TOKEN + 1), "longer than 16 KiB"),
        ("Bearer " + "a" * 10_000_000, "longer than 16 KiB"),
        ("Bearer abc def", "characters"),
        ("Bearer abc\ndef", "characters"),
        ("Bearer tok\u00e9n", "characters"),
        ("Bearer ab=c", "characters"),
        ('Bearer {"a": 1}', "characters"),
    ],
)
async def test_a_missing_or_absurd_header_is_refused_without_asking_the_api(
    kube_api_server: FakeApiServer, kube: KubernetesApi, header: str | None, why: str
) -> None:
    refused = await denied(authenticator(kube), header)
    assert refused.status == 401
    assert why in refused.message
    assert kube_api_server.requests == []


async def test_a_token_of_16_kib_is_still_reviewed(
    kube_api_server: FakeApiServer, kube: KubernetesApi
) -> None:
    assert (await denied(authenticator(kube), bearer("a" * MAX_TOKEN))).status == 401
    (review,) = kube_api_server.reviews
    assert review.body["spec"]["token"] == "a" * MAX_TOKEN


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


async def test_an_api_server_that_cannot_be_reached_is_503_never_an_open_door() -> None:
    kube = KubernetesApi.connect(f"http://127.0.0.1:{closed_port()}", token="t", timeout=2)
    try:
        auth = authenticator(kube)
        for _ in range(2):  # nothing about the failure is kept
            refused = await denied(auth, bearer("some-token"))
            assert refused.status == 503
            assert "Kubernetes API did not answer" in refused.message
        with pytest.raises(AccessDenied) as caught:
            await auth.may_see(Viewer("bob", frozenset()), "team-a")
        assert caught.value.status == 503
    finally:
        await kube.close()


async def test_a_failing_review_is_503_and_not_kept(
    kube_api_server: FakeApiServer, kube: KubernetesApi
) -> None:
    kube_api_server.access.grant(user="alice")
    token = kube_api_server.tokens.mint_user("alice")
    auth = authenticator(kube)
    kube_api_server.answer("POST", TOKEN_REVIEWS, 500, status_body(500, "InternalError", "etcd"))
    assert (await denied(auth, bearer(token))).status == 503
    del kube_api_server.routes[("POST", TOKEN_REVIEWS)]
    forbidden = status_body(403, "Forbidden", "the inventory may not create subjectaccessreviews")
    kube_api_server.answer("POST", ACCESS_REVIEWS, 403, forbidden)
    assert (await denied(auth, bearer(token))).status == 503  # the access review failed
    del kube_api_server.routes[("POST", ACCESS_REVIEWS)]
    assert await auth.viewer(bearer(token)) == Viewer("alice", None)
    assert len(kube_api_server.reviews) == 3


async def test_a_reviewed_token_is_not_reviewed_again_while_cached(
    kube_api_server: FakeApiServer, kube: KubernetesApi
) -> None:
    kube_api_server.access.grant(user="bob", namespace="team-a")
    token = kube_api_server.tokens.mint_user("bob")
    auth = authenticator(kube)
    viewer = await auth.viewer(bearer(token))
    await auth.may_see(viewer, "team-a")
    before = len(kube_api_server.requests)
    for _ in range(5):
        assert await auth.viewer(bearer(token)) == viewer
        assert await auth.may_see(viewer, "team-a")
    assert len(kube_api_server.requests) == before
    # a refused token is refused again without asking, for a few seconds
    await denied(auth, bearer("unknown"))
    before = len(kube_api_server.requests)
    assert (await denied(auth, bearer("unknown"))).status == 401
    assert len(kube_api_server.requests) == before


async def test_many_requests_with_one_new_token_make_one_review(
    kube_api_server: FakeApiServer, kube: KubernetesApi
) -> None:
    kube_api_server.access.grant(user="alice")
    token = kube_api_server.tokens.mint_user("alice")
    kube_api_server.review_delay = 0.2
    auth = authenticator(kube)
    viewers = await asyncio.gather(*(auth.viewer(bearer(token)) for _ in range(8)))
    assert set(viewers) == {Viewer("alice", None)}
    assert len(kube_api_server.reviews) == 1
    assert len(kube_api_server.access_reviews) == 1


async def test_without_a_cache_a_revoked_token_or_grant_takes_effect_at_once(
    kube_api_server: FakeApiServer, kube: KubernetesApi
) -> None:
    kube_api_server.access.grant(user="bob", namespace="team-a")
    token = kube_api_server.tokens.mint_user("bob")
    auth = authenticator(kube, cache_ttl_s=0)
    viewer = await auth.viewer(bearer(token))
    assert await auth.may_see(viewer, "team-a")
    kube_api_server.access.revoke(user="bob")
    assert not await auth.may_see(viewer, "team-a")
    kube_api_server.tokens.revoke(token)
    assert (await denied(auth, bearer(token))).status == 401


async def test_the_cache_holds_at_most_max_cached_tokens(
    kube_api_server: FakeApiServer, kube: KubernetesApi
) -> None:
    kube_api_server.access.grant(user="alice")
    tokens = [kube_api_server.tokens.mint_user("alice") for _ in range(3)]
    auth = authenticator(kube, max_cached=2)
    for token in tokens:
        await auth.viewer(bearer(token))
    assert len(kube_api_server.reviews) == 3
    await auth.viewer(bearer(tokens[2]))
    await auth.viewer(bearer(tokens[1]))
    assert len(kube_api_server.reviews) == 3  # the two newest are held
    await auth.viewer(bearer(tokens[0]))
    assert len(kube_api_server.reviews) == 4  # the oldest was dropped


async def test_the_token_never_appears_in_the_log(
    kube_api_server: FakeApiServer, kube: KubernetesApi, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    kube_api_server.access.grant(user="alice")
    good = kube_api_server.tokens.mint_user("alice")
    bad = "forged-" + "x" * 40
    auth = authenticator(kube)
    await auth.viewer(bearer(good))
    await denied(auth, bearer(bad))
    kube_api_server.answer("POST", TOKEN_REVIEWS, 500, status_body(500, "InternalError", "etcd"))
    third = kube_api_server.tokens.mint_user("alice")
    await denied(auth, bearer(third))
    assert caplog.records  # the review outcomes were logged
    logged = caplog.text + repr([r.args for r in caplog.records])
    for token in (good, bad, third):
        assert token not in logged
        assert token[4:24] not in logged
    assert "Traceback" not in caplog.text


async def test_without_authentication_everyone_is_the_port_forward_operator() -> None:
    auth = Authenticator("none", None)
    for header in (None, "", "Bearer whatever", "garbage" * 10_000):
        viewer = await auth.viewer(header)
        assert viewer == Viewer("port-forward", None)
        assert await auth.may_see(viewer, "team-a")
    with pytest.raises(ValueError, match="needs the Kubernetes API"):
        Authenticator("tokenreview", None)
    with pytest.raises(ValueError, match="must be none or tokenreview"):
        Authenticator("open", None)  # type: ignore[arg-type]


async def test_the_local_api_grants_nothing_until_told() -> None:
    """The dev stack's in-memory API: a user token it minted is reviewed, and
    no one may list pods anywhere until a rule says so."""
    local = LocalKubeApi()
    token = local.tokens.mint_user("dev", ["devs"])
    auth = authenticator(local)
    viewer = await auth.viewer(bearer(token))
    assert viewer == Viewer("dev", frozenset())
    assert not await auth.may_see(viewer, "team-a")
    local.access.grant(group="devs", namespace="team-a")
    assert await Authenticator("tokenreview", local).may_see(viewer, "team-a")


# ---------------------------------------------------------------- over HTTP


async def authenticated(request: Request) -> Viewer:
    """The dependency the app was given (module level: annotations are strings)."""
    viewer: Viewer = await request.app.state.authenticate(request)
    return viewer


Authenticated = Annotated[Viewer, Depends(authenticated)]


@pytest.fixture
async def console(kube: KubernetesApi) -> AsyncIterator[str]:
    auth = authenticator(kube)
    app = FastAPI()
    install_error_responses(app)
    app.state.authenticate = dependency(auth)

    @app.get("/api/v1/session")
    async def session(viewer: Authenticated) -> dict[str, Any]:
        namespaces = None if viewer.namespaces is None else sorted(viewer.namespaces)
        return {"user": viewer.user, "namespaces": namespaces}

    @app.get("/api/v1/see/{namespace}")
    async def see(namespace: str, viewer: Authenticated) -> dict[str, bool]:
        return {"visible": await auth.may_see(viewer, namespace)}

    port = free_port()
    async with http_server(plain_http(app, "127.0.0.1", port), "console", max_body=1024):
        yield f"http://127.0.0.1:{port}"


async def test_the_dependency_answers_refusals_as_json_errors(
    kube_api_server: FakeApiServer, console: str
) -> None:
    kube_api_server.access.grant(user="bob", namespace="team-a")
    token = kube_api_server.tokens.mint_user("bob")
    async with httpx.AsyncClient(base_url=console, timeout=10) as http:
        missing = await http.get("/api/v1/session")
        assert missing.status_code == 401
        assert missing.headers["www-authenticate"] == "Bearer"
        assert "Bearer <token> header is required" in missing.json()["error"]
        huge = await http.get("/api/v1/session", headers={"Authorization": bearer("a" * 20_000)})
        assert huge.status_code == 401
        assert huge.json() == {"error": "the bearer token is longer than 16 KiB"}
        forged = await http.get("/api/v1/session", headers={"Authorization": bearer("forged")})
        assert forged.status_code == 401
        assert forged.json() == {"error": "the token was not accepted by the Kubernetes API"}
        ok = await http.get("/api/v1/session", headers={"Authorization": bearer(token)})
        assert ok.status_code == 200
        assert ok.json() == {"user": "bob", "namespaces": []}
        seen = await http.get("/api/v1/see/team-a", headers={"Authorization": bearer(token)})
        assert seen.json() == {"visible": True}
        unseen = await http.get("/api/v1/see/team-b", headers={"Authorization": bearer(token)})
        assert unseen.json() == {"visible": False}
        # the app's own errors take the same shape
        wrong = await http.post("/api/v1/session", headers={"Authorization": bearer(token)})
        assert wrong.status_code == 405
        assert wrong.json() == {"error": "Method Not Allowed"}
        nowhere = await http.get("/nowhere")
        assert nowhere.status_code == 404
        assert nowhere.json() == {"error": "Not Found"}
        # an API server that fails while the page is open: 503, JSON
        kube_api_server.answer("POST", ACCESS_REVIEWS, 500, status_body(500, "Internal", "x"))
        down = await http.get("/api/v1/see/team-z", headers={"Authorization": bearer(token)})
        assert down.status_code == 503
        assert "did not answer" in down.json()["error"]
        assert "www-authenticate" not in down.headers


async def test_a_flood_of_made_up_tokens_is_refused_beyond_a_bound_of_reviews(
    kube_api_server: FakeApiServer, kube: KubernetesApi
) -> None:
    """Anyone who reaches the port can make up tokens, each new one a TokenReview:
    beyond the reviews under way or waiting, more are refused with 503 at once
    (not queued without end, holding the review threads the NATS auth callout
    shares), and the refusal is not kept."""
    kube_api_server.review_delay = 1.0
    auth = authenticator(kube, reviews_at_once=2, reviews_queued=4)
    answers = await asyncio.gather(
        *(auth.viewer(bearer(f"made-up-{i}")) for i in range(40)), return_exceptions=True
    )
    statuses = sorted(a.status for a in answers if isinstance(a, AccessDenied))
    assert len(statuses) == 40
    assert statuses.count(401) == 4  # reviewed and refused by the API
    assert statuses.count(503) == 36
    assert len(kube_api_server.reviews) == 4
    assert auth.queued == 0
    kube_api_server.review_delay = 0.0
    kube_api_server.access.grant(user="alice")
    token = kube_api_server.tokens.mint_user("alice")
    assert await auth.viewer(bearer(token)) == Viewer("alice", None)
