"""Golden AdmissionReview tests: each pod goes through the webhook in both review
versions and the patched pod is compared with one written out by hand from the
rules (mutation.py's docstring, gpuslice_common.requests, hami-compat.md), never
with the code's own output."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from gpuslice_webhook.admission import Admission
from gpuslice_webhook.metrics import Metrics
from tests.webhook.conftest import (
    CORES,
    GPU,
    HIDDEN,
    MEM,
    MEM_PCT,
    PRIORITY,
    V1,
    V1BETA1,
    applied,
    check_response,
    container,
    decoded_patch,
    gpu_env,
    pod,
    review,
    settings,
)

Admit = Callable[..., Any]
SCHED = "gpuslice-scheduler"
POLICY = "GPU_CORE_UTILIZATION_POLICY"
DEFAULTS = {"requests": {"defaults": {"memory_mib": 2048, "cores": 20}}}
REASONS = {400: "BadRequest", 403: "Forbidden"}


def var(name: str, value: str) -> dict[str, str]:
    return {"name": name, "value": value}


@pytest.fixture(params=[V1, V1BETA1])
def version(request: pytest.FixtureRequest) -> str:
    return str(request.param)


async def admitted(
    admit: Admit, obj: dict[str, Any], version: str, **overrides: Any
) -> dict[str, Any]:
    """The allowed response for ``obj`` (a pod CREATE), envelope checked."""
    sent = review(obj, version=version)
    status, answer = await admit(sent, **overrides)
    assert status == 200
    response = check_response(sent, answer)
    assert response["allowed"] is True, response.get("status")
    return response


async def untouched(admit: Admit, sent: dict[str, Any], **overrides: Any) -> None:
    """The review is allowed as is: no patch, no patchType, no status, no warnings."""
    status, answer = await admit(sent, **overrides)
    assert status == 200
    response = check_response(sent, answer)
    assert response == {"uid": sent["request"]["uid"], "allowed": True}


# ---------------------------------------------------------------- golden pods

# (request pod, expected pod after the patch, WebhookSettings overrides)
GOLDEN = [
    pytest.param(
        pod(container("main", {MEM: "4000"}), container("side")),
        pod(
            container("main", {MEM: "4000", GPU: "1", CORES: "0"}, env=gpu_env("main")),
            container("side", env=HIDDEN),
            schedulerName=SCHED,
        ),
        {},
        id="gpumem-only",
    ),
    pytest.param(
        pod(container("main", {GPU: 2})),
        pod(
            container("main", {GPU: 2, CORES: "100", MEM_PCT: "100"}, env=gpu_env("main")),
            schedulerName=SCHED,
        ),
        {},
        id="bare-count-whole-cards",
    ),
    pytest.param(
        pod(container("main", {CORES: "30"})),
        pod(
            container("main", {CORES: "30", GPU: "1", MEM_PCT: "100"}, env=gpu_env("main")),
            schedulerName=SCHED,
        ),
        {},
        id="gpucores-only",
    ),
    pytest.param(
        pod(container("main", {CORES: "50"})),
        pod(
            container("main", {CORES: "50", GPU: "1", MEM: "2048"}, env=gpu_env("main")),
            schedulerName=SCHED,
        ),
        DEFAULTS,
        id="default-mem",
    ),
    pytest.param(
        pod(container("main", {MEM_PCT: "40"})),
        pod(
            container("main", {MEM_PCT: "40", GPU: "1", CORES: "20"}, env=gpu_env("main")),
            schedulerName=SCHED,
        ),
        DEFAULTS,
        id="default-cores",
    ),
    pytest.param(
        pod(container("main", {MEM: "0"})),
        pod(
            container("main", {MEM: "2048", GPU: "1", CORES: "20"}, env=gpu_env("main")),
            schedulerName=SCHED,
        ),
        DEFAULTS,
        id="default-mem-replaces-gpumem-0",
    ),
    pytest.param(
        pod(container("main", {GPU: "1"})),
        pod(
            container("main", {GPU: "1", CORES: "100", MEM_PCT: "100"}, env=gpu_env("main")),
            schedulerName=SCHED,
        ),
        DEFAULTS,
        id="bare-count-ignores-defaults",
    ),
    pytest.param(
        # gpumem 0 is "not set": the defaults fill memory and cores, as in HAMi (a
        # memory resource present, even 0, keeps the card shared).
        pod(container("main", {GPU: "1", MEM: "0"})),
        pod(
            container("main", {GPU: "1", MEM: "2048", CORES: "20"}, env=gpu_env("main")),
            schedulerName=SCHED,
        ),
        DEFAULTS,
        id="bare-count-with-gpumem-0",
    ),
    pytest.param(
        # gpumem-percentage 0 is "not set" too, never a limit of 0 MiB (no limit).
        pod(container("main", {GPU: "1", MEM_PCT: "0"})),
        pod(
            container("main", {GPU: "1", MEM_PCT: "100", CORES: "0"}, env=gpu_env("main")),
            schedulerName=SCHED,
        ),
        {},
        id="percentage-0-is-unset",
    ),
    pytest.param(
        pod(container("main", {GPU: "1", MEM_PCT: "0"})),
        pod(
            container(
                "main", {GPU: "1", MEM_PCT: "0", MEM: "2048", CORES: "20"}, env=gpu_env("main")
            ),
            schedulerName=SCHED,
        ),
        DEFAULTS,
        id="percentage-0-takes-default-mem",
    ),
    pytest.param(
        # the whole memory without cores: the card alone, as HAMi's webhook makes it
        pod(container("main", {MEM_PCT: "100"})),
        pod(
            container("main", {MEM_PCT: "100", GPU: "1", CORES: "100"}, env=gpu_env("main")),
            schedulerName=SCHED,
        ),
        DEFAULTS,
        id="percentage-100-is-exclusive",
    ),
    pytest.param(
        # gpumem 0 is "not set" but brings the default count; memory is the whole card.
        pod(container("main", {MEM: "0"})),
        pod(
            container(
                "main", {MEM: "0", GPU: "1", CORES: "0", MEM_PCT: "100"}, env=gpu_env("main")
            ),
            schedulerName=SCHED,
        ),
        {},
        id="gpumem-0-whole-memory",
    ),
    pytest.param(
        pod(container("main", {MEM: "1000", MEM_PCT: "50"})),
        pod(
            container(
                "main", {MEM: "1000", MEM_PCT: "50", GPU: "1", CORES: "0"}, env=gpu_env("main")
            ),
            schedulerName=SCHED,
        ),
        {},
        id="gpumem-wins-over-percentage",
    ),
    pytest.param(
        pod(container("main", {MEM: "1000"}), container("zero", {GPU: 0})),
        pod(
            container("main", {MEM: "1000", GPU: "1", CORES: "0"}, env=gpu_env("main")),
            container("zero", {GPU: 0}, env=HIDDEN),
            schedulerName=SCHED,
        ),
        {},
        id="gpu-0-container-is-hidden",
    ),
    pytest.param(
        pod(container("main", {MEM: "1000", PRIORITY: "0"})),
        pod(
            container(
                "main",
                {MEM: "1000", PRIORITY: "0", GPU: "1", CORES: "0"},
                env=gpu_env("main", priority=0),
            ),
            schedulerName=SCHED,
        ),
        {},
        id="priority-0",
    ),
    pytest.param(
        pod(
            container("main", {MEM: "1000"}),
            container("own", {MEM: "1000"}, env=[var(POLICY, "force")]),
        ),
        pod(
            container(
                "main", {MEM: "1000", GPU: "1", CORES: "0"}, env=gpu_env("main", policy="force")
            ),
            container(
                "own",
                {MEM: "1000", GPU: "1", CORES: "0"},
                env=[var(POLICY, "force"), *gpu_env("own")],
            ),
            schedulerName=SCHED,
        ),
        {"core_policy": "force"},
        id="core-policy-force",
    ),
    pytest.param(
        pod(
            container(
                "main",
                resources={
                    "limits": {MEM: "3000", "cpu": "2"},
                    "requests": {MEM: "3000", "cpu": "1"},
                },
            ),
            container("cpu", resources={"limits": {CORES: "10"}, "requests": {"cpu": "1"}}),
            container("req-only", resources={"requests": {MEM: "1000"}}),
        ),
        pod(
            container(
                "main",
                resources={
                    "limits": {MEM: "3000", "cpu": "2", GPU: "1", CORES: "0"},
                    "requests": {MEM: "3000", "cpu": "1", GPU: "1", CORES: "0"},
                },
                env=gpu_env("main"),
            ),
            container(
                "cpu",
                resources={
                    "limits": {CORES: "10", GPU: "1", MEM_PCT: "100"},
                    "requests": {"cpu": "1"},
                },
                env=gpu_env("cpu"),
            ),
            container(
                "req-only",
                resources={
                    "requests": {MEM: "1000", GPU: "1", CORES: "0"},
                    "limits": {MEM: "1000", GPU: "1", CORES: "0"},
                },
                env=gpu_env("req-only"),
            ),
            schedulerName=SCHED,
        ),
        {},
        id="requests-mirror",
    ),
    pytest.param(
        pod(
            container("main", {GPU: 1}),
            init=[container("fetch", {MEM_PCT: "25"}), container("setup")],
        ),
        pod(
            container("main", {GPU: 1, CORES: "100", MEM_PCT: "100"}, env=gpu_env("main")),
            init=[
                container("fetch", {MEM_PCT: "25", GPU: "1", CORES: "0"}, env=gpu_env("fetch")),
                container("setup", env=HIDDEN),
            ],
            schedulerName=SCHED,
        ),
        {},
        id="init-containers",
    ),
    pytest.param(
        pod(
            container("main", {MEM: "2000"}, env=[var("A", "1")]),
            container("side", env=[var("B", "2")]),
        ),
        pod(
            container(
                "main", {MEM: "2000", GPU: "1", CORES: "0"}, env=[var("A", "1"), *gpu_env("main")]
            ),
            container("side", env=[var("B", "2"), *HIDDEN]),
            schedulerName=SCHED,
        ),
        {},
        id="env-appended",
    ),
    pytest.param(
        pod(container("main", {MEM: "2000"}, env=[var("CUDA_TASK_PRIORITY", "1")])),
        pod(
            container(
                "main",
                {MEM: "2000", GPU: "1", CORES: "0"},
                env=[var("CUDA_TASK_PRIORITY", "1"), *gpu_env("main")[1:]],
            ),
            schedulerName=SCHED,
        ),
        {},
        id="own-matching-priority-kept-once",
    ),
    pytest.param(
        pod(container("main", {GPU: "1"}), schedulerName="default-scheduler"),
        pod(
            container("main", {GPU: "1", CORES: "100", MEM_PCT: "100"}, env=gpu_env("main")),
            schedulerName=SCHED,
        ),
        {},
        id="default-scheduler-replaced",
    ),
    pytest.param(
        pod(container("main", {GPU: "1"}), schedulerName="volcano"),
        pod(
            container("main", {GPU: "1", CORES: "100", MEM_PCT: "100"}, env=gpu_env("main")),
            schedulerName="volcano",
        ),
        {},
        id="other-scheduler-kept",
    ),
    pytest.param(
        pod(container("main", {GPU: "1"}), schedulerName="volcano"),
        pod(
            container("main", {GPU: "1", CORES: "100", MEM_PCT: "100"}, env=gpu_env("main")),
            schedulerName=SCHED,
        ),
        {"keep_other_schedulers": False},
        id="other-scheduler-replaced",
    ),
    pytest.param(
        pod(container("main", {MEM: "4000"}), container("side")),
        pod(
            container("main", {MEM: "4000", GPU: "1", CORES: "0"}, env=gpu_env("main")),
            container("side"),
            schedulerName=SCHED,
        ),
        {"hide_gpus_from_other_containers": False},
        id="no-hiding",
    ),
    pytest.param(
        pod(container("main", {CORES: "50"}), container("side", env=HIDDEN)),
        pod(
            container("main", {CORES: "50", GPU: "1", MEM_PCT: "100"}, env=gpu_env("main")),
            container("side", env=HIDDEN),
            schedulerName=SCHED,
        ),
        {},
        id="own-hiding-not-duplicated",
    ),
    pytest.param(
        pod(container("main", {GPU: "1"}, securityContext={"privileged": True})),
        pod(
            container(
                "main",
                {GPU: "1", CORES: "100", MEM_PCT: "100"},
                securityContext={"privileged": True},
                env=gpu_env("main"),
            ),
            schedulerName=SCHED,
        ),
        {},
        id="privileged-whole-card",
    ),
    pytest.param(
        pod(container("main", {GPU: "1"}, env=[var("CUDA_DISABLE_CONTROL", "true")])),
        pod(
            container(
                "main",
                {GPU: "1", CORES: "100", MEM_PCT: "100"},
                env=[var("CUDA_DISABLE_CONTROL", "true"), *gpu_env("main")],
            ),
            schedulerName=SCHED,
        ),
        {},
        id="disable-control-whole-card",
    ),
    pytest.param(
        pod(
            container(
                "main",
                {CORES: "50"},
                env=[var("CUDA_DISABLE_CONTROL", "true"), var(POLICY, "disable")],
            )
        ),
        pod(
            container(
                "main",
                {CORES: "50", GPU: "1", MEM_PCT: "100"},
                env=[
                    var("CUDA_DISABLE_CONTROL", "true"),
                    var(POLICY, "disable"),
                    *gpu_env("main"),
                ],
            ),
            schedulerName=SCHED,
        ),
        {"allow_limit_opt_out": True},
        id="opt-out-allowed-by-setting",
    ),
]


@pytest.mark.parametrize(("obj", "expected", "overrides"), GOLDEN)
async def test_golden(
    admit: Admit, version: str, obj: dict[str, Any], expected: dict[str, Any], overrides: Any
) -> None:
    response = await admitted(admit, obj, version, **overrides)
    assert applied(obj, response) == expected


@pytest.mark.parametrize(("obj", "expected", "overrides"), GOLDEN)
async def test_idempotent(
    admit: Admit, version: str, obj: dict[str, Any], expected: dict[str, Any], overrides: Any
) -> None:
    once = applied(obj, await admitted(admit, obj, version, **overrides))
    again = await admitted(admit, once, version, **overrides)
    assert "patch" not in again, decoded_patch(again)
    assert "patchType" not in again


async def test_dry_run_still_mutates(admit: Admit, version: str) -> None:
    obj = pod(container("main", {MEM: "4000"}), container("side"))
    sent = review(obj, version=version, dry_run=True)
    status, answer = await admit(sent)
    assert status == 200
    assert applied(obj, check_response(sent, answer)) == pod(
        container("main", {MEM: "4000", GPU: "1", CORES: "0"}, env=gpu_env("main")),
        container("side", env=HIDDEN),
        schedulerName=SCHED,
    )


WARNINGS = [
    pytest.param(
        pod(container("main", {GPU: "1"}), schedulerName="volcano"), "volcano", id="scheduler"
    ),
    pytest.param(pod(container("main", {MEM: "1000", MEM_PCT: "50"})), MEM_PCT, id="mem-pct"),
]


@pytest.mark.parametrize(("obj", "named"), WARNINGS)
async def test_warnings(admit: Admit, version: str, obj: dict[str, Any], named: str) -> None:
    response = await admitted(admit, obj, version)
    assert any(named in warning for warning in response.get("warnings", ())), response


# ---------------------------------------------------------------- patch shape

MINIMAL_OPS = [
    pytest.param(
        pod(
            container("main", {MEM: "2000"}, env=[var("A", "1")]),
            container("side", env=[var("B", "2")]),
        ),
        {},
        [
            ("add", "/spec/containers/0/resources/limits/nvidia.com~1gpu"),
            ("add", "/spec/containers/0/resources/limits/nvidia.com~1gpucores"),
            *[("add", "/spec/containers/0/env/-")] * len(gpu_env("main")),
            ("add", "/spec/containers/1/env/-"),
            ("add", "/spec/schedulerName"),
        ],
        id="existing-env",
    ),
    pytest.param(
        pod(
            container("main", {MEM: "0"}),
            init=[container("setup")],
            schedulerName="default-scheduler",
        ),
        DEFAULTS,
        [
            ("add", "/spec/initContainers/0/env"),
            ("replace", "/spec/containers/0/resources/limits/nvidia.com~1gpumem"),
            ("add", "/spec/containers/0/resources/limits/nvidia.com~1gpu"),
            ("add", "/spec/containers/0/resources/limits/nvidia.com~1gpucores"),
            ("add", "/spec/containers/0/env"),
            ("replace", "/spec/schedulerName"),
        ],
        id="no-env-and-replacements",
    ),
]


@pytest.mark.parametrize(("obj", "overrides", "ops"), MINIMAL_OPS)
async def test_minimal_patch(
    admit: Admit, version: str, obj: dict[str, Any], overrides: Any, ops: list[tuple[str, str]]
) -> None:
    patch = decoded_patch(await admitted(admit, obj, version, **overrides))
    assert Counter((op["op"], op["path"]) for op in patch) == Counter(ops)


# ---------------------------------------------------------------- left alone

GPU_POD = pod(container("main", {MEM: "4000"}))
UNTOUCHED = [
    pytest.param(pod(container("main", {"cpu": "1"})), {}, id="no-gpu"),
    pytest.param(pod(container("main")), {}, id="no-resources"),
    pytest.param(pod(container("main", {GPU: 0})), {}, id="gpu-0"),
    pytest.param(
        pod(container("main", {CORES: "101"}), labels={"hami.io/webhook": "ignore"}),
        {},
        id="hami-ignore-label",
    ),
    pytest.param(
        pod(container("main", {CORES: "101"}), labels={"gpuslice.io/webhook": "ignore"}),
        {},
        id="gpuslice-ignore-label",
    ),
    pytest.param(GPU_POD, {"operation": "UPDATE"}, id="update"),
    pytest.param(GPU_POD, {"operation": "DELETE"}, id="delete"),
    pytest.param(GPU_POD, {"operation": "CONNECT"}, id="connect"),
    pytest.param(GPU_POD, {"kind": "Deployment"}, id="not-a-pod"),
]


@pytest.mark.parametrize(("obj", "fields"), UNTOUCHED)
async def test_untouched(
    admit: Admit, version: str, obj: dict[str, Any], fields: dict[str, Any]
) -> None:
    await untouched(admit, review(obj, version=version, **fields))


# ---------------------------------------------------------------- denials

SHARE = {CORES: "50"}


def env_pod(*env: dict[str, str], limits: dict[str, Any] = SHARE) -> dict[str, Any]:
    return pod(container("main", limits, env=list(env)))


# (pod, overrides, code, fragments the message must contain)
DENIALS = [
    pytest.param(
        pod(container("main", {CORES: "101"})), {}, 400, ["'main'", CORES], id="cores-101"
    ),
    pytest.param(
        pod(container("main", {MEM_PCT: "150"})), {}, 400, ["'main'", MEM_PCT], id="mem-pct-150"
    ),
    pytest.param(pod(container("main", {MEM: "-1"})), {}, 400, ["'main'", MEM], id="negative-mem"),
    pytest.param(pod(container("main", {GPU: "1.5"})), {}, 400, ["'main'", GPU], id="gpu-1.5"),
    pytest.param(
        pod(container("main", resources={"limits": {MEM: "1000"}, "requests": {MEM: "2000"}})),
        {},
        400,
        ["'main'", MEM],
        id="requests-differ",
    ),
    pytest.param(
        pod(container("main", {GPU: "0", MEM: "1000"})), {}, 400, ["'main'", GPU], id="gpu-0-mem"
    ),
    pytest.param(
        pod(container("main", {PRIORITY: "0"})), {}, 400, ["'main'", PRIORITY], id="priority-alone"
    ),
    pytest.param(
        pod(container("main", SHARE), nodeName="node-1"),
        {},
        403,
        ["spec.nodeName", "node-1"],
        id="node-name",
    ),
    pytest.param(
        pod(container("main", SHARE, securityContext={"privileged": True})),
        {},
        403,
        ["'main'", "privileged"],
        id="privileged-share",
    ),
    *(
        pytest.param(
            env_pod(var(name, value)), {}, 403, ["'main'", name], id=f"gpu-container-{name}"
        )
        for name, value in (
            ("CUDA_DEVICE_MEMORY_LIMIT", "1g"),
            ("CUDA_DEVICE_SM_LIMIT", "10"),
            ("NVIDIA_VISIBLE_DEVICES", "all"),
            ("GPUSLICE_POD_UID", "not-my-uid"),
            ("CUDA_TASK_PRIORITY", "0"),
            ("CUDA_DISABLE_CONTROL", "true"),
            (POLICY, "disable"),
        )
    ),
    *(
        pytest.param(
            env_pod(var(name, str(1 << 40))),
            {},
            403,
            ["'main'", name, "driver's memory limit", "grant"],
            id=f"gpu-container-driver-limit-{name}",
        )
        for name in ("NVIDIA_GPU_MEMORY_LIMIT", "NVIDIA_GPU_MEMORY_REQUEST")
    ),
    pytest.param(
        env_pod(var(POLICY, "sometimes")), {}, 400, ["'main'", POLICY], id="policy-unknown"
    ),
    pytest.param(
        env_pod(var(POLICY, "sometimes"), limits={GPU: "1"}),
        {},
        400,
        ["'main'", POLICY],
        id="policy-unknown-whole-card",
    ),
    pytest.param(
        pod(
            container("main", SHARE), container("side", env=[var("NVIDIA_VISIBLE_DEVICES", "all")])
        ),
        {},
        403,
        ["'side'", "NVIDIA_VISIBLE_DEVICES"],
        id="other-container-sees-gpus",
    ),
    pytest.param(
        pod(
            container("main", SHARE),
            init=[container("setup", env=[var("NVIDIA_VISIBLE_DEVICES", "0")])],
        ),
        {},
        403,
        ["'setup'", "NVIDIA_VISIBLE_DEVICES"],
        id="other-init-container-sees-gpus",
    ),
    pytest.param(
        env_pod(var("CUDA_DISABLE_CONTROL", "true")),
        {"core_policy": "force"},
        403,
        ["'main'", "CUDA_DISABLE_CONTROL"],
        id="disable-control-with-policy-setting",
    ),
]


@pytest.mark.parametrize(("obj", "overrides", "code", "fragments"), DENIALS)
async def test_denied(
    admit: Admit,
    version: str,
    obj: dict[str, Any],
    overrides: Any,
    code: int,
    fragments: list[str],
) -> None:
    sent = review(obj, version=version)
    status, answer = await admit(sent, **overrides)
    assert status == 200
    response = check_response(sent, answer)
    assert response["allowed"] is False
    assert "patch" not in response
    assert "patchType" not in response
    denial = response["status"]
    assert (denial["code"], denial["reason"]) == (code, REASONS[code]), denial
    for fragment in fragments:
        assert fragment in denial["message"], (fragment, denial["message"])


async def test_object_null_is_a_bad_request(admit: Admit, version: str) -> None:
    sent = review(None, version=version)
    status, answer = await admit(sent)
    assert status == 200
    response = check_response(sent, answer)
    assert response["allowed"] is False
    assert response["status"]["code"] == 400


# ---------------------------------------------------------------- malformed envelopes


async def handle_raw(body: bytes) -> tuple[int, dict[str, Any]]:
    status, raw = await Admission(settings(), Metrics()).handle(body)
    return status, json.loads(raw)


def pop_uid(body: dict[str, Any]) -> None:
    del body["request"]["uid"]


MALFORMED = [
    pytest.param(
        lambda b: b.update(apiVersion="admission.k8s.io/v2"), "apiVersion", id="wrong-api-version"
    ),
    pytest.param(lambda b: b.update(kind="TokenReview"), "kind", id="wrong-kind"),
    pytest.param(lambda b: b.pop("request"), "request", id="no-request"),
    pytest.param(lambda b: b.update(request=None), "request", id="null-request"),
    pytest.param(pop_uid, "request.uid", id="no-uid"),
    pytest.param(lambda b: b["request"].update(uid=""), "request.uid", id="empty-uid"),
]


@pytest.mark.parametrize(
    ("body", "named"),
    [(b"{not json", "not JSON"), (b"[]", "JSON object"), (b'"review"', "JSON object")],
)
async def test_body_not_a_json_object(body: bytes, named: str) -> None:
    status, answer = await handle_raw(body)
    assert status == 400
    assert set(answer) == {"error"}
    assert named in answer["error"], answer


@pytest.mark.parametrize(("change", "named"), MALFORMED)
async def test_malformed_envelope(
    version: str, change: Callable[[dict[str, Any]], None], named: str
) -> None:
    body = review(pod(container("main", {MEM: "4000"})), version=version)
    change(body)
    status, answer = await handle_raw(json.dumps(body).encode())
    assert status == 400
    assert set(answer) == {"error"}
    assert named in answer["error"], answer
