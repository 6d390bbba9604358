"""route_cpu_pods: pods without GPUs are given gpuslice's scheduler and nothing else."""

from __future__ import annotations

import json
from typing import Any

from gpuslice_common.kube import KubeError, LocalKubeApi
from gpuslice_webhook.admission import Admission
from gpuslice_webhook.metrics import Metrics
from gpuslice_webhook.namespaces import NamespaceCache
from tests.webhook.conftest import (
    GPU,
    applied,
    check_response,
    container,
    decoded_patch,
    pod,
    review,
    settings,
)

SCHED = "gpuslice-scheduler"


class Recorder:
    """An outbox that keeps what it is given."""

    def __init__(self) -> None:
        self.events: list[Any] = []

    def submit(self, event: Any) -> None:
        self.events.append(event)


class UnreadableNamespaces(LocalKubeApi):
    async def get_namespace(self, name: str) -> dict[str, Any]:
        raise KubeError("the API server is down", status=500)


async def admit(
    body: dict[str, Any], kube: LocalKubeApi | None = None, **overrides: Any
) -> tuple[dict[str, Any], Metrics, Recorder]:
    metrics, outbox = Metrics(), Recorder()
    namespaces = NamespaceCache(kube, ttl=30) if kube is not None else None
    admission = Admission(
        settings(**overrides),
        metrics,
        namespaces=namespaces,
        outbox=outbox,  # type: ignore[arg-type]
    )
    status, raw = await admission.handle(json.dumps(body).encode())
    assert status == 200
    return check_response(body, json.loads(raw)), metrics, outbox


def outcome(metrics: Metrics, name: str) -> float:
    value = metrics.registry.get_sample_value(
        "gpuslice_webhook_admissions_total", {"outcome": name}
    )
    return value or 0.0


def web_pod(**spec: Any) -> dict[str, Any]:
    limits = {"cpu": "2", "memory": "4Gi"}
    return pod(container("web", limits), name="web", **spec)


async def test_off_by_default_a_pod_without_gpus_is_left_alone() -> None:
    response, metrics, _ = await admit(review(web_pod()))
    assert response["allowed"] is True
    assert "patch" not in response
    assert outcome(metrics, "skipped") == 1


async def test_a_pod_without_gpus_gets_only_the_scheduler_name() -> None:
    sent = web_pod()
    response, metrics, outbox = await admit(review(sent), route_cpu_pods=True)
    assert decoded_patch(response) == [{"op": "add", "path": "/spec/schedulerName", "value": SCHED}]
    after = applied(sent, response)
    assert after == {**sent, "spec": {**sent["spec"], "schedulerName": SCHED}}
    assert "warnings" not in response
    assert outcome(metrics, "routed") == 1
    assert outbox.events == []  # no GPU request: nothing to record


async def test_the_default_scheduler_is_replaced_and_another_kept_unless_told() -> None:
    named = web_pod(schedulerName="default-scheduler")
    response, _, _ = await admit(review(named), route_cpu_pods=True)
    assert decoded_patch(response) == [
        {"op": "replace", "path": "/spec/schedulerName", "value": SCHED}
    ]
    other = web_pod(schedulerName="volcano")
    response, metrics, _ = await admit(review(other), route_cpu_pods=True)
    assert "patch" not in response
    assert "warnings" not in response  # the GPU pods' warning is about GPU containers
    assert outcome(metrics, "skipped") == 1
    response, _, _ = await admit(review(other), route_cpu_pods=True, keep_other_schedulers=False)
    assert decoded_patch(response) == [
        {"op": "replace", "path": "/spec/schedulerName", "value": SCHED}
    ]
    ours = web_pod(schedulerName=SCHED)
    response, _, _ = await admit(review(ours), route_cpu_pods=True)
    assert "patch" not in response


async def test_a_custom_scheduler_name_is_the_one_given() -> None:
    response, _, _ = await admit(review(web_pod()), route_cpu_pods=True, scheduler_name="packer")
    assert decoded_patch(response)[0]["value"] == "packer"


async def test_ignore_labels_on_the_pod_or_its_namespace_keep_it_unrouted() -> None:
    labelled = pod(container("web", {"cpu": "1"}), labels={"gpuslice.io/webhook": "ignore"})
    response, metrics, _ = await admit(review(labelled), route_cpu_pods=True)
    assert "patch" not in response
    assert outcome(metrics, "ignored") == 1
    kube = LocalKubeApi()
    kube.add_namespace("team-a", {"hami.io/webhook": "ignore"})
    response, metrics, _ = await admit(review(web_pod()), kube, route_cpu_pods=True)
    assert "patch" not in response
    assert outcome(metrics, "ignored") == 1
    response, _, _ = await admit(review(web_pod(), namespace="team-b"), kube, route_cpu_pods=True)
    assert decoded_patch(response)[0]["value"] == SCHED


async def test_an_unreadable_namespace_admits_the_pod_unchanged_never_refused() -> None:
    response, metrics, _ = await admit(
        review(web_pod()), UnreadableNamespaces(), route_cpu_pods=True
    )
    assert response["allowed"] is True
    assert "patch" not in response
    assert outcome(metrics, "unavailable") == 1


async def test_a_pod_that_sets_its_node_is_not_scheduled_and_not_routed() -> None:
    response, _, _ = await admit(review(web_pod(nodeName="node-1")), route_cpu_pods=True)
    assert response["allowed"] is True
    assert "patch" not in response


async def test_a_pod_asking_for_zero_gpus_is_routed_and_otherwise_unchanged() -> None:
    sent = pod(container("main", {GPU: "0", "cpu": "1"}))
    response, _, _ = await admit(review(sent), route_cpu_pods=True)
    assert decoded_patch(response) == [{"op": "add", "path": "/spec/schedulerName", "value": SCHED}]
    response, _, _ = await admit(review(sent))
    assert "patch" not in response


async def test_gpu_pods_are_answered_exactly_as_without_the_setting() -> None:
    bodies = [
        review(pod(container("main", {GPU: "1"}), container("side", {"cpu": "1"})), uid="u1"),
        review(pod(container("main", {GPU: "1"}), schedulerName="volcano"), uid="u2"),
        review(pod(container("main", {"nvidia.com/gpucores": "30"})), uid="u3"),
    ]
    for body in bodies:
        plain = Admission(settings(), Metrics())
        routing = Admission(settings(route_cpu_pods=True), Metrics())
        encoded = json.dumps(body).encode()
        assert (await plain.handle(encoded)) == (await routing.handle(encoded))
