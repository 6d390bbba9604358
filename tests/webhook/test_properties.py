"""Properties of admission over generated pods (hypothesis).

For any pod: the mutator either denies it with a message or returns a patch that
applies cleanly (jsonpatch, an independent RFC 6902 implementation); the patched
pod reads back as the same GPU request (admission and placement agree); a second
pass changes nothing; and the patch only adds or replaces what it must.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import jsonpatch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuslice_common.requests import parse_pod
from gpuslice_webhook.admission import Admission
from gpuslice_webhook.metrics import Metrics
from gpuslice_webhook.mutation import Denied, Mutator
from tests.webhook.conftest import CORES, GPU, MEM, MEM_PCT, PRIORITY, check_response, review
from tests.webhook.conftest import settings as webhook_settings

NAMES = st.sampled_from(["main", "side", "init-a", "init-b", "worker", "a/b~c"])
QUANTITY = st.one_of(
    st.integers(min_value=-2, max_value=120),
    st.sampled_from(["0", "1", "2", "50", "100", "101", "4Gi", "1.5", "-1", "x", "1e2", "4000"]),
)
RESOURCES = st.dictionaries(
    st.sampled_from([GPU, MEM, MEM_PCT, CORES, PRIORITY, "cpu", "memory"]),
    QUANTITY,
    max_size=4,
)
ENV_NAMES = st.sampled_from(
    [
        "PATH",
        "CUDA_TASK_PRIORITY",
        "GPU_CORE_UTILIZATION_POLICY",
        "CUDA_DISABLE_CONTROL",
        "NVIDIA_VISIBLE_DEVICES",
        "GPUSLICE_POD_NAME",
        "LIBCUDA_LOG_LEVEL",
    ]
)
ENV = st.lists(
    st.fixed_dictionaries(
        {"name": ENV_NAMES, "value": st.sampled_from(["0", "1", "true", "none", "force", "x"])}
    ),
    max_size=3,
)


@st.composite
def containers(draw: st.DrawFn) -> dict[str, Any]:
    spec: dict[str, Any] = {"name": draw(NAMES), "image": "img"}
    if draw(st.booleans()):
        limits = draw(RESOURCES)
        resources: dict[str, Any] = {"limits": limits}
        if draw(st.booleans()):
            resources["requests"] = dict(limits)
        spec["resources"] = resources
    if draw(st.booleans()):
        spec["env"] = draw(ENV)
    if draw(st.integers(0, 9)) == 0:
        spec["securityContext"] = {"privileged": True}
    if draw(st.integers(0, 5)) == 0:
        spec["restartPolicy"] = "Always"
    return spec


@st.composite
def pods(draw: st.DrawFn) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": draw(st.lists(containers(), min_size=1, max_size=3))}
    if draw(st.booleans()):
        spec["initContainers"] = draw(st.lists(containers(), max_size=2))
    choice = draw(st.sampled_from([None, "", "default-scheduler", "volcano", "gpuslice-scheduler"]))
    if choice is not None:
        spec["schedulerName"] = choice
    metadata: dict[str, Any] = {"name": "p", "namespace": "ns"}
    if draw(st.booleans()):
        metadata["annotations"] = {"nvidia.com/use-gputype": draw(st.sampled_from(["A100", ""]))}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec}


OPTIONS = st.fixed_dictionaries(
    {
        "keep_other_schedulers": st.booleans(),
        "hide_gpus_from_other_containers": st.booleans(),
        "core_policy": st.sampled_from([None, "default", "force"]),
        "allow_limit_opt_out": st.booleans(),
        "requests": st.fixed_dictionaries(
            {
                "defaults": st.fixed_dictionaries(
                    {
                        "memory_mib": st.sampled_from([0, 1024]),
                        "cores": st.sampled_from([0, 30]),
                    }
                )
            }
        ),
    }
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pod=pods(), options=OPTIONS)
def test_admission_denies_or_patches_consistently(pod: dict[str, Any], options: Any) -> None:
    config = webhook_settings(**options)
    mutator = Mutator(config)
    original = copy.deepcopy(pod)
    try:
        mutation = mutator.mutate(pod, "ns")
    except Denied as denied:
        refused = denied
    else:
        refused = None
    if refused is not None:
        assert refused.message
        assert refused.code in (400, 403)
        return
    assert pod == original, "the mutator must not change its input"
    if mutation is None:
        return
    ops = mutation.patch.operations
    assert all(op["op"] in ("add", "replace") for op in ops)
    assert all(op["path"] not in ("", "/spec", "/metadata") for op in ops), ops
    patched = jsonpatch.apply_patch(pod, ops)
    # the same demand whoever reads the pod next
    again = parse_pod(patched, config.requests)
    assert again is not None
    assert again.containers == mutation.request.containers
    # nothing left to change, and everything required is now stated
    second = mutator.mutate(patched, "ns")
    assert second is not None
    assert second.patch.operations == []
    assert patched["spec"]["schedulerName"] in (
        config.scheduler_name,
        *([pod["spec"].get("schedulerName")] if config.keep_other_schedulers else []),
    )
    for request in again.containers:
        field = "initContainers" if request.init else "containers"
        spec = next(c for c in patched["spec"][field] if c["name"] == request.name)
        limits = spec["resources"]["limits"]
        assert GPU in limits
        assert CORES in limits
        assert MEM in limits or MEM_PCT in limits
        names = [var["name"] for var in spec["env"]]
        priorities = [v.get("value") for v in spec["env"] if v["name"] == "CUDA_TASK_PRIORITY"]
        assert priorities
        assert set(priorities) == {str(request.priority)}
        assert "GPUSLICE_POD_UID" in names


@settings(max_examples=200, deadline=None)
@given(pod=pods())
async def test_pods_without_a_gpu_request_are_never_changed(pod: dict[str, Any]) -> None:
    for field in ("containers", "initContainers"):
        for spec in pod["spec"].get(field, []):
            spec.pop("resources", None)
    sent = review(pod)
    status, raw = await Admission(webhook_settings(), Metrics()).handle(json.dumps(sent).encode())
    assert status == 200
    response = check_response(sent, json.loads(raw))
    assert response["allowed"] is True
    assert "patch" not in response
