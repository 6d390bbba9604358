"""Admission's edges: repeated variables, debug containers added to a running GPU
pod, and the review's own limits."""

from __future__ import annotations

from typing import Any

import pytest

from tests.webhook.conftest import GPU, MEM, V1, applied, container, pod, review

VISIBLE = "NVIDIA_VISIBLE_DEVICES"


async def test_a_repeated_variable_is_checked_in_every_entry(admit: Any) -> None:
    sidecar = container(
        "side", env=[{"name": VISIBLE, "value": "none"}, {"name": VISIBLE, "value": "all"}]
    )
    status, answer = await admit(review(pod(container("main", {GPU: 1}), sidecar)))
    assert status == 200
    response = answer["response"]
    assert response["allowed"] is False
    assert "container 'side'" in response["status"]["message"]
    assert f"{VISIBLE}=all" in response["status"]["message"]


def debug_review(target: dict[str, Any], ephemeral: list[dict[str, Any]], old: list[str]) -> Any:
    """The UPDATE kubectl debug sends: the pod with its ephemeral containers."""
    new = {**target, "spec": {**target["spec"], "ephemeralContainers": ephemeral}}
    previous = {**target, "spec": {**target["spec"]}}
    previous["spec"]["ephemeralContainers"] = [e for e in ephemeral if e["name"] in old]
    body = review(new, operation="UPDATE", version=V1)
    body["request"]["subResource"] = "ephemeralcontainers"
    body["request"]["oldObject"] = previous
    return body, new


async def test_debug_containers_of_a_gpu_pod_get_no_gpu(admit: Any) -> None:
    gpu_pod = pod(container("main", {MEM: "1000"}))
    old = {"name": "debugger-1", "image": "busybox", "targetContainerName": "main"}
    new = {"name": "debugger-2", "image": "nvidia/cuda", "targetContainerName": "main"}
    body, sent = debug_review(gpu_pod, [old, new], old=["debugger-1"])
    status, answer = await admit(body)
    assert status == 200
    response = answer["response"]
    assert response["allowed"] is True
    result = applied(sent, response)
    ephemeral = result["spec"]["ephemeralContainers"]
    assert "env" not in ephemeral[0]  # existing ephemeral containers cannot change
    assert ephemeral[1]["env"] == [{"name": VISIBLE, "value": "none"}]


@pytest.mark.parametrize("value", ["all", "GPU-1234"])
async def test_debug_containers_may_not_show_gpus(admit: Any, value: str) -> None:
    debugger = {"name": "dbg", "image": "x", "env": [{"name": VISIBLE, "value": value}]}
    body, _ = debug_review(pod(container("main", {GPU: 1})), [debugger], old=[])
    _, answer = await admit(body)
    assert answer["response"]["allowed"] is False
    assert "container 'dbg'" in answer["response"]["status"]["message"]


async def test_debug_containers_of_other_pods_are_untouched(admit: Any) -> None:
    body, _ = debug_review(pod(container("main")), [{"name": "dbg", "image": "x"}], old=[])
    _, answer = await admit(body)
    assert answer["response"] == {"uid": body["request"]["uid"], "allowed": True}
