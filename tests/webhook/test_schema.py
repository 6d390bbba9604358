"""Fuzzing the webhook against its own OpenAPI document (schemathesis) over real HTTPS.

How it runs: each test takes the ``https_webhook`` fixture, the webhook served by
uvicorn *in this process*, on the test's pytest-asyncio event loop, over HTTPS with
a certificate from the test CA. Schemathesis (and ``requests`` under it) is
synchronous: called straight from the test it would block the very loop that has to
answer, and the first request would hang. So each async test hands its whole
Hypothesis run to a worker thread (``asyncio.to_thread``) and awaits it; the loop
stays free to serve while the thread sends real requests through a TLS socket on
loopback, verifying the server's certificate against the test CA only
(``test_tls_is_verified`` shows the certificate is refused without it). This keeps
the fixture the other webhook tests use (no subprocess to start, poll and stop),
and a failure in the thread (a failed check, a falsifying example) is raised in
the test. Schemathesis's pytest plugin (``schema.parametrize()``) is not used: it
runs the test body synchronously on the loop's thread; ``schema.as_strategy()``
with ``@given`` gives the same cases.

The document is read from the running webhook's ``/openapi.json``. Every answer is
held to:

* schemathesis's own checks (``case.call_and_validate``: no 5xx, status code,
  content type and response schema conformance, positive data accepted, ...),
  except the two turned off where they are wrong for this service, each with its
  reason;
* the AdmissionReview contract (:func:`check_answer`): a 200 is an AdmissionReview
  in the request's apiVersion with ``response.uid == request.uid``, ``allowed`` a
  bool, ``patch`` present iff ``patchType == "JSONPatch"``, a denial with
  ``status.code`` and a non-empty ``status.message``, never the webhook's own
  "InternalError" denial (an exception caught inside admission), and a patch that
  decodes to JSON Patch operations which apply to the pod that was sent; anything
  else is exactly a 400 with a JSON object whose ``error`` is a non-empty string;
  and the 400 comes exactly for the bodies that are not an AdmissionReview request
  (an independent reading of that rule in :func:`is_review`).

Three runs of at most 150 examples each (``MAX_EXAMPLES``): schemathesis's positive
mode (steered half the time towards pods that ask for GPUs, see :func:`steer`),
its negative mode, and a hand-written Hypothesis test posting random bytes, random
JSON values and near-miss AdmissionReviews around odd GPU pods. Every request has a
timeout, so a hang fails the test instead of stalling it. Each run also asserts
that it reached what it is meant to reach (patched, denied and 400 answers), so a
generator that silently stops producing them fails. About 10-15 s in all on two
CPUs.
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonpatch
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from requests.adapters import HTTPAdapter
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import negative_data_rejection
from urllib3.util.retry import Retry

from gpuslice_webhook.service import Running
from tests.webhook.conftest import (
    CORES,
    GPU,
    MEM,
    MEM_PCT,
    PRIORITY,
    V1,
    V1BETA1,
    check_response,
    container,
    pod,
    review,
)

MUTATE = "/mutate"
MAX_EXAMPLES = 150
TIMEOUT = 10.0  # seconds a request may take: a hang fails the test, not the run

FUZZ = settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    database=None,  # nothing written under .hypothesis/ by this file
    suppress_health_check=[
        HealthCheck.too_slow,  # every example is an HTTPS round trip
        HealthCheck.filter_too_much,
        HealthCheck.data_too_large,
        HealthCheck.large_base_example,
    ],
)


class Target:
    """The running webhook as a synchronous client sees it (used in the worker thread)."""

    def __init__(self, running: Running, ca_file: Path) -> None:
        self.base = f"https://127.0.0.1:{running.port}"
        self.verify = str(ca_file)
        self.session = requests.Session()
        # Not the environment's: REQUESTS_CA_BUNDLE would override session.verify,
        # a proxy variable could route loopback through a proxy.
        self.session.trust_env = False
        self.session.verify = self.verify
        # uvicorn closes a keep-alive connection after a 500; the next request on it
        # is sent once more on a new one rather than failing as a dropped connection,
        # so a failure shows the answer at fault.
        retry = Retry(total=1, status=0, allowed_methods=None, raise_on_status=False)
        self.session.mount("https://", HTTPAdapter(max_retries=retry))

    def schema(self) -> schemathesis.BaseSchema:
        return schemathesis.openapi.from_url(
            f"{self.base}/openapi.json", verify=self.verify, timeout=TIMEOUT
        )

    def close(self) -> None:
        # urllib3 2.8 closes a pool's idle connections when the pool is garbage
        # collected, not on Session.close(). An idle TLS connection this client
        # leaves open stays in uvicorn's connections after it closes its side, which
        # holds the webhook's shutdown up to the 5 s that running() allows (seen after
        # the schemathesis runs); so close them here.
        for adapter in self.session.adapters.values():
            pools = getattr(adapter, "poolmanager", None)
            if pools is not None:
                for key in pools.pools.keys():  # noqa: SIM118 (the container cannot iterate)
                    pools.pools[key].close()
        self.session.close()

    def post(self, body: bytes, content_type: str = "application/json") -> requests.Response:
        return self.session.post(
            self.base + MUTATE,
            data=body,
            headers={"Content-Type": content_type},
            timeout=TIMEOUT,
            verify=self.verify,
        )


async def in_thread(running: Running, ca_file: Path, work: Callable[[Target], None]) -> None:
    """Run ``work`` in a worker thread while this loop keeps serving the webhook."""
    target = Target(running, ca_file)
    try:
        await asyncio.to_thread(work, target)
    finally:
        target.close()


# ---------------------------------------------------------------- the contract


def is_review(sent: Any) -> bool:
    """Whether ``sent`` (the decoded body) is an AdmissionReview request the webhook must answer."""
    if not isinstance(sent, dict) or sent.get("apiVersion") not in (V1, V1BETA1):
        return False
    if sent.get("kind") != "AdmissionReview" or not isinstance(sent.get("request"), dict):
        return False
    uid = sent["request"].get("uid")
    return isinstance(uid, str) and uid != ""


def _finite(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"{text} is out of a double's range")
    return value


def _int(text: str) -> int:
    _finite(text)
    return int(text)


def _constant(text: str) -> Any:
    raise ValueError(f"{text} is not JSON")


def decoded(body: bytes) -> Any:
    """The body as a strict JSON reader reads it (RFC 8259 in UTF-8, numbers that fit a
    double, no lone surrogates); None when it is not JSON. Python's own reader is
    laxer (NaN, Infinity, a byte order mark, other encodings), which would wrongly
    call such a body a review."""
    try:
        doc = json.loads(
            body.decode("utf-8"), parse_float=_finite, parse_int=_int, parse_constant=_constant
        )
        json.dumps(doc, ensure_ascii=False).encode()  # raises on a lone surrogate
    except (ValueError, RecursionError, UnicodeError):
        return None
    return doc


def check_answer(body: bytes, status: int, content_type: str, raw: bytes) -> str:
    """The AdmissionReview contract for one /mutate exchange (``body`` as sent);
    returns the outcome: "400", "denied", "patched" or "allowed" (unchanged)."""
    assert status < 500, f"{status} for {body!r}: {raw!r}"
    assert content_type.split(";")[0].strip() == "application/json", content_type
    answer = json.loads(raw)
    sent = decoded(body)
    if status != 200:
        assert status == 400, f"{status} for {body!r}: {raw!r}"
        assert isinstance(answer, dict), answer
        assert isinstance(answer.get("error"), str), answer
        assert answer["error"].strip(), answer
        assert not is_review(sent), f"400 for an AdmissionReview request: {raw!r}"
        return "400"
    assert is_review(sent), f"200 for a body that is not an AdmissionReview: {body!r}"
    response = check_response(sent, answer)
    assert set(answer) == {"apiVersion", "kind", "response"}, answer
    if not response["allowed"]:
        status_ = response["status"]
        assert isinstance(status_["message"], str), status_
        assert status_["message"].strip(), status_
        assert status_.get("reason") != "InternalError", f"admission raised for {body!r}"
        return "denied"
    if "patch" in response:
        ops = json.loads(base64.b64decode(response["patch"], validate=True))
        assert isinstance(ops, list), ops
        assert ops, "an empty patch is sent as none"
        pod_ = sent["request"].get("object")
        assert isinstance(pod_, dict), "a patch for a request without a pod"
        jsonpatch.apply_patch(pod_, ops)  # raises when the patch does not fit the pod
        return "patched"
    return "allowed"


def schema_paths(schema: schemathesis.BaseSchema) -> list[str]:
    return [result.ok().path for result in schema.get_all_operations()]


def sent_body(response: schemathesis.Response) -> bytes:
    body = response.request.body
    if body is None:
        return b""
    return body.encode() if isinstance(body, str) else bytes(body)


# ---------------------------------------------------------------- steering

# Documents generated from the schema alone almost never name a GPU resource, so
# nearly every review would be "no GPU: allowed unchanged" and the mutator would go
# untested. In positive mode half of the generated reviews are pointed at it: a pod
# CREATE whose containers carry GPU limits (valid and invalid quantities alike),
# sometimes with GPU annotations or the ignore label. Every edit keeps the body
# valid against the schema, so positive_data_acceptance still applies.
GPU_KEYS = (GPU, MEM, MEM_PCT, CORES, PRIORITY)
QUANTITIES = (
    st.integers(min_value=-2, max_value=130)
    | st.integers()
    | st.sampled_from(["0", "1", "2", "64", "65", "100", "101", "-1", "1.5", "1k", "1Gi", "2M"])
    | st.sampled_from(["", " 1", "1e3", "0x10", "abc", "+1", "99999999999999999999999"])
    | st.text(max_size=8)
)
VALID_LIMITS = st.fixed_dictionaries(
    {GPU: st.integers(1, 8) | st.sampled_from(["1", "2"])},
    optional={
        MEM: st.integers(0, 81920) | st.sampled_from(["1024", "3000"]),
        MEM_PCT: st.integers(0, 100),
        CORES: st.integers(0, 100) | st.just("30"),
        PRIORITY: st.integers(0, 1),
    },
)
GPU_LIMITS = VALID_LIMITS | st.dictionaries(st.sampled_from(GPU_KEYS), QUANTITIES, min_size=1)
ANNOTATION_KEYS = st.sampled_from(
    [
        "nvidia.com/use-gputype",
        "gpuslice.io/nouse-gputype",
        "nvidia.com/use-gpuuuid",
        "nvidia.com/numa-bind",
        "gpuslice.io/vgpu-mode",
        "hami.io/gpu-scheduler-policy",
        "gpuslice.io/node-scheduler-policy",
    ]
)
ANNOTATION_VALUES = st.sampled_from(["", "A100", "true", "binpack", "spread", "numa", "mig"]) | (
    st.text(max_size=12)
)


def steer(data: st.DataObject, body: Any) -> None:
    """Maybe turn a generated review (in place) into a GPU pod being created."""
    if not isinstance(body, dict) or not isinstance(body.get("request"), dict):
        return
    if not data.draw(st.booleans(), label="steer"):
        return
    request = body["request"]
    request["operation"] = "CREATE"
    request["kind"] = {"group": "", "version": "v1", "kind": "Pod"}
    request["resource"] = {"group": "", "version": "v1", "resource": "pods"}
    request["subResource"] = None
    pod_ = request.get("object")
    if not isinstance(pod_, dict) or not isinstance(pod_.get("spec"), dict):
        pod_ = request["object"] = pod(container("main"))  # the schema allows a null object
    spec = pod_["spec"]
    if not spec.get("containers"):
        spec["containers"] = [container("main")]
    spec["containers"][0]["resources"] = {"limits": data.draw(GPU_LIMITS, label="limits")}
    for item in [*(spec.get("initContainers") or []), *spec["containers"][1:]]:
        if data.draw(st.booleans(), label="gpu container"):
            item["resources"] = {"limits": data.draw(GPU_LIMITS, label="limits")}
    if data.draw(st.integers(0, 3), label="metadata") == 0:
        metadata = pod_["metadata"] = dict(pod_.get("metadata") or {})
        annotations = st.dictionaries(ANNOTATION_KEYS, ANNOTATION_VALUES, max_size=3)
        metadata["annotations"] = data.draw(annotations, label="annotations")
        if data.draw(st.booleans(), label="ignored"):
            metadata["labels"] = {"gpuslice.io/webhook": "ignore"}


def schemathesis_run(mode: GenerationMode) -> Callable[[Target], None]:
    """Fuzz every operation of the document in ``mode``; each answer goes through
    schemathesis's checks and, for /mutate, :func:`check_answer`."""

    # The webhook reads bodies leniently on purpose: whatever is an AdmissionReview
    # request with a uid gets a 200 AdmissionReview answer (unknown operations and
    # kinds are allowed unchanged, a pod the mutator cannot read is denied inside
    # the answer). Schema-invalid data (a numeric ``operation``, a pod without
    # ``spec``) is therefore often answered 200, which negative_data_rejection
    # would call a failure; the 400-iff-not-a-review rule of check_answer takes
    # its place.
    excluded = [negative_data_rejection] if mode is GenerationMode.NEGATIVE else []

    def run(target: Target) -> None:
        schema = target.schema()
        seen: Counter[str] = Counter()

        @FUZZ
        @given(case=schema.as_strategy(generation_mode=mode), data=st.data())
        def fuzz(case: schemathesis.Case, data: st.DataObject) -> None:
            if mode is GenerationMode.POSITIVE and case.path == MUTATE:
                steer(data, case.body)
            response = case.call_and_validate(
                base_url=target.base,
                session=target.session,
                excluded_checks=excluded,
                verify=target.verify,
                timeout=TIMEOUT,
            )
            seen[case.path] += 1
            if case.path == MUTATE:
                content_type = response.headers.get("content-type", [""])[0]
                sent = sent_body(response)
                seen[check_answer(sent, response.status_code, content_type, response.content)] += 1

        fuzz()
        # The run reached what it is meant to reach (a guard against a generator
        # that silently stops producing the interesting cases).
        if mode is GenerationMode.POSITIVE:
            assert set(schema_paths(schema)) <= set(seen), seen
            assert {"allowed", "patched", "denied"} <= set(seen), seen
            assert "400" not in seen, seen  # positive_data_acceptance says the same
        else:
            assert {"400", "allowed"} <= set(seen), seen

    return run


# ---------------------------------------------------------------- schemathesis


async def test_schema_positive(https_webhook: Running, ca_file: Path) -> None:
    """Schema-valid requests: every one is an AdmissionReview, so every answer is a 200 one."""
    await in_thread(https_webhook, ca_file, schemathesis_run(GenerationMode.POSITIVE))


async def test_schema_negative(https_webhook: Running, ca_file: Path) -> None:
    """Schema-invalid requests: a 200 AdmissionReview or a 400 naming the problem, never 5xx."""
    await in_thread(https_webhook, ca_file, schemathesis_run(GenerationMode.NEGATIVE))


# ---------------------------------------------------------------- raw bodies

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)

ODD = st.integers(0, 5).map(lambda n: n == 3)  # "now and then": about one time in six


@st.composite
def gpu_pods(draw: st.DrawFn) -> dict[str, Any]:
    """A pod asking for a GPU, its fields now and then of any JSON type where the
    mutator reads them."""
    main = container(
        "main", draw(st.dictionaries(st.sampled_from(GPU_KEYS), QUANTITIES, min_size=1))
    )
    others = st.builds(container, st.text(max_size=4), st.none() | GPU_LIMITS) | JSON_VALUES
    annotations = st.dictionaries(ANNOTATION_KEYS, ANNOTATION_VALUES | JSON_VALUES, max_size=3)
    body = pod(main, *draw(st.lists(others, max_size=2)), annotations=draw(annotations))
    if draw(ODD):
        main["resources"]["limits"][draw(st.sampled_from(GPU_KEYS))] = draw(JSON_VALUES)
    if draw(ODD):
        main["resources"]["requests"] = draw(GPU_LIMITS | JSON_VALUES)
    if draw(ODD):
        main[draw(st.sampled_from(["name", "env", "resources"]))] = draw(JSON_VALUES)
    if draw(ODD):
        body["spec"]["initContainers"] = draw(st.lists(others, max_size=2) | JSON_VALUES)
    return body


@st.composite
def envelopes(draw: st.DrawFn) -> Any:
    """Bodies near the line between a review and not one: a GPU pod's review whose
    envelope fields are now and then missing or of another value or type."""
    body = review(draw(st.none() | gpu_pods()), version=draw(st.sampled_from([V1, V1BETA1])))
    request = body["request"]
    if request["object"] is not None and draw(ODD):
        request["object"][draw(st.sampled_from(["metadata", "spec"]))] = draw(JSON_VALUES)
    for key, other in (
        ("apiVersion", st.just("admission.k8s.io/v2") | JSON_VALUES),
        ("kind", st.just("AdmissionReviewList") | JSON_VALUES),
        ("request", JSON_VALUES),
    ):
        if draw(ODD):
            body[key] = draw(other)
        elif draw(ODD):
            del body[key]
    if draw(ODD):
        request["uid"] = draw(st.just("") | JSON_VALUES)
    elif draw(ODD):
        del request["uid"]
    if draw(ODD):
        request[draw(st.sampled_from(["operation", "kind", "namespace", "dryRun"]))] = draw(
            JSON_VALUES
        )
    return body


RAW_BODIES = (
    st.binary(max_size=512)
    | JSON_VALUES.map(lambda value: json.dumps(value).encode())
    | envelopes().map(lambda value: json.dumps(value).encode())
    | st.integers(min_value=1, max_value=20_000).map(lambda depth: b"[" * depth + b"]" * depth)
    | st.sampled_from([b"", b"{", b'"\\ud800"', b"1e400", b"\xef\xbb\xbf{}", b"{}" * 3])
)


def random_bodies(target: Target) -> None:
    @FUZZ
    @given(
        body=RAW_BODIES,
        content_type=st.sampled_from(["application/json", "text/plain", "application/x-garbage"]),
    )
    def post(body: bytes, content_type: str) -> None:
        answer = target.post(body, content_type)
        answered_as = answer.headers.get("content-type", "")
        seen[check_answer(body, answer.status_code, answered_as, answer.content)] += 1

    seen: Counter[str] = Counter()
    post()
    assert {"400", "denied"} <= set(seen), seen


def tls_verified(target: Target) -> None:
    # Without the test CA the webhook's certificate is refused, so the runs above,
    # which get answers, did verify it against that CA.
    bare = requests.Session()
    bare.trust_env = False  # the default trust store, not REQUESTS_CA_BUNDLE's
    with bare, pytest.raises(requests.exceptions.SSLError):
        bare.get(target.base + "/healthz", timeout=TIMEOUT)
    answer = target.session.get(target.base + "/healthz", timeout=TIMEOUT)
    assert answer.json() == {"status": "ok"}


async def test_tls_is_verified(https_webhook: Running, ca_file: Path) -> None:
    await in_thread(https_webhook, ca_file, tls_verified)


async def test_random_bodies(https_webhook: Running, ca_file: Path) -> None:
    """Random bytes and JSON values posted to /mutate: 200 or 400, never 5xx, never a hang."""
    await in_thread(https_webhook, ca_file, random_bodies)
