"""Other vendors' pods through the webhook's HTTP app: what it writes into them as
HAMi's webhook does, and their namespaces' quotas, kept per vendor.

The webhook serves plain HTTP on a free port, reads HAMi's default device
configuration as it does at start, and reads namespaces, ResourceQuotas and pods
from the local API server stand-in."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest

from gpuslice_common.devicetypes import read_vendors
from gpuslice_common.kube import LocalKubeApi
from gpuslice_common.models import (
    PLACEMENT_ANNOTATION,
    ContainerAssignment,
    DeviceGrant,
    Placement,
    PodRef,
)
from gpuslice_common.servers import free_port
from gpuslice_webhook.service import running
from tests.webhook.conftest import (
    MEM,
    applied,
    check_response,
    container,
    decoded_patch,
    pod,
    review,
    settings,
)
from tests.webhook.test_vendors import CONFIG

NS = "team-a"
HIDE = {
    "op": "add",
    "path": "/spec/containers/0/env",
    "value": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "none"}],
}
ROUTE = {"op": "add", "path": "/spec/schedulerName", "value": "gpuslice-scheduler"}

MT_COUNT, MT_MEM, MT_CORES = (
    "mthreads.com/vgpu",
    "mthreads.com/sgpu-memory",
    "mthreads.com/sgpu-core",
)
MLU, MLU_MEM, MLU_CORES = (
    "cambricon.com/vmlu",
    "cambricon.com/mlu.smlu.vmemory",
    "cambricon.com/mlu.smlu.vcore",
)
NPU, NPU_MEM = "huawei.com/Ascend910B3", "huawei.com/Ascend910B3-memory"
SGPU = "metax-tech.com/sgpu"
QOS = "metax-tech.com/sgpu-qos-policy"
DRS, GCU_MEM, GCU_CORES = "enflame.com/drs-gcu", "enflame.com/gcu-memory", "enflame.com/gcu-core"

Admit = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


@pytest.fixture
def kube() -> LocalKubeApi:
    return LocalKubeApi()


@pytest.fixture
async def webhook(kube: LocalKubeApi) -> AsyncIterator[tuple[Admit, httpx.AsyncClient]]:
    """(send one AdmissionReview over HTTP and get its checked response, a client of
    the metrics port)."""
    config = read_vendors(settings(listen_port=free_port(), device_config=str(CONFIG)))
    async with running(config, kube, None) as state:
        base = f"http://127.0.0.1:{state.port}"
        metrics = f"http://127.0.0.1:{state.metrics_port}"
        async with (
            httpx.AsyncClient(base_url=base, timeout=10) as client,
            httpx.AsyncClient(base_url=metrics, timeout=10) as scraper,
        ):

            async def admit(body: dict[str, Any]) -> dict[str, Any]:
                reply = await client.post("/mutate", json=body)
                assert reply.status_code == 200
                return check_response(body, reply.json())

            yield admit, scraper


def resources(limits: dict[str, Any], requests: dict[str, Any] | None = None) -> dict[str, Any]:
    found: dict[str, Any] = {"limits": limits}
    if requests is not None:
        found["requests"] = requests
    return found


def one(
    amounts: dict[str, Any] | None = None,
    requests: dict[str, Any] | None = None,
    annotations: dict[str, str] | None = None,
    name: str = "trainer",
) -> dict[str, Any]:
    spec = container("main", resources=resources(amounts or {}, requests))
    return pod(spec, name=name, annotations=annotations)


async def twice(admit: Admit, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The patch admission gives ``body``'s pod, after checking that the patched
    pod, admitted again, is admitted unchanged."""
    response = await admit(body)
    assert response["allowed"] is True
    again = review(applied(body["request"]["object"], response))
    second = await admit(again)
    assert second["allowed"] is True
    assert decoded_patch(second) == []
    return decoded_patch(response)


def limit_path(name: str, part: str = "limits") -> str:
    return f"/spec/containers/0/resources/{part}/{name.replace('/', '~1')}"


# ---------------------------------------------------------------- Moore Threads


async def test_moore_threads_whole_cards_are_stated_as_hamis_webhook_states_them(
    webhook: tuple[Admit, httpx.AsyncClient],
) -> None:
    admit, _ = webhook
    # as the API server sends it: requests defaulted from the limits
    patch = await twice(admit, review(one({MT_COUNT: "2"}, {MT_COUNT: "2"})))
    assert patch == [
        {"op": "add", "path": limit_path(MT_CORES), "value": "32"},
        {"op": "add", "path": limit_path(MT_MEM), "value": "192"},
        {"op": "add", "path": limit_path(MT_CORES, "requests"), "value": "32"},
        {"op": "add", "path": limit_path(MT_MEM, "requests"), "value": "192"},
        HIDE,
        {
            "op": "add",
            "path": "/metadata/annotations",
            "value": {"mthreads.com/request-gpu-num": "2"},
        },
        ROUTE,
    ]


async def test_one_moore_threads_card_without_memory_is_a_whole_card(
    webhook: tuple[Admit, httpx.AsyncClient],
) -> None:
    admit, _ = webhook
    # cores stated in the requests alone are overwritten, as HAMi's webhook does
    patch = await twice(admit, review(one({MT_COUNT: 1}, {MT_COUNT: 1, MT_CORES: 4})))
    assert patch == [
        {"op": "add", "path": limit_path(MT_CORES), "value": "16"},
        {"op": "add", "path": limit_path(MT_MEM), "value": "96"},
        {"op": "replace", "path": limit_path(MT_CORES, "requests"), "value": "16"},
        {"op": "add", "path": limit_path(MT_MEM, "requests"), "value": "96"},
        HIDE,
        ROUTE,
    ]


async def test_a_moore_threads_sgpu_is_left_as_it_is(
    webhook: tuple[Admit, httpx.AsyncClient],
) -> None:
    admit, _ = webhook
    patch = await twice(admit, review(one({MT_COUNT: 1, MT_MEM: 8, MT_CORES: 4})))
    assert patch == [HIDE, ROUTE]


async def test_a_moore_threads_card_count_annotation_saying_otherwise_is_refused(
    webhook: tuple[Admit, httpx.AsyncClient],
) -> None:
    admit, _ = webhook
    forged = one({MT_COUNT: 1}, annotations={"mthreads.com/request-gpu-num": "8"})
    response = await admit(review(forged))
    assert response["allowed"] is False
    assert response["status"]["code"] == 400
    assert response["status"]["message"] == (
        "annotation mthreads.com/request-gpu-num says '8' but the pod asks for 1 Moore "
        "Threads card(s); gpuslice writes it from the count: remove it"
    )
    # the count's own value is what gpuslice writes: accepted as it is
    stated = one({MT_COUNT: 2}, annotations={"mthreads.com/request-gpu-num": "2"})
    patch = await twice(admit, review(stated))
    assert [op["path"] for op in patch] == [
        limit_path(MT_CORES),
        limit_path(MT_MEM),
        "/spec/containers/0/env",
        "/spec/schedulerName",
    ]


async def test_more_moore_threads_cores_than_the_cards_hold_are_refused(
    webhook: tuple[Admit, httpx.AsyncClient],
) -> None:
    admit, _ = webhook
    response = await admit(review(one({MT_COUNT: 1, MT_MEM: 8, MT_CORES: 17})))
    assert response["allowed"] is False
    assert response["status"]["message"] == (
        "container 'main': mthreads.com/sgpu-core must be between 0 and 16, got 17"
    )
    response = await admit(review(one({MT_COUNT: 2, MT_CORES: 33})))
    assert (
        "mthreads.com/sgpu-core must be between 0 and 32, got 33" in (response["status"]["message"])
    )


# ---------------------------------------------------------------- Metax, Ascend, Enflame


async def test_metax_sgpu_qos_unset_becomes_best_effort(
    webhook: tuple[Admit, httpx.AsyncClient],
) -> None:
    admit, _ = webhook
    patch = await twice(admit, review(one({SGPU: 1}, annotations={"team": "a"})))
    assert patch == [
        HIDE,
        {
            "op": "add",
            "path": "/metadata/annotations/metax-tech.com~1sgpu-qos-policy",
            "value": "best-effort",
        },
        ROUTE,
    ]
    kept = one({SGPU: 1}, annotations={QOS: "fixed-share"})
    assert await twice(admit, review(kept)) == [HIDE, ROUTE]
    # the online class, which HAMi leaves without a policy, is refused before
    online = one({SGPU: 1}, annotations={"metax-tech.com/sgpu-app-class": "online"})
    assert (await admit(review(online)))["allowed"] is False


async def test_ascend_memory_is_the_template_it_was_rounded_up_to(
    webhook: tuple[Admit, httpx.AsyncClient],
) -> None:
    admit, _ = webhook
    asked = {NPU: "1", NPU_MEM: "1000"}
    patch = await twice(admit, review(one(asked, dict(asked))))
    assert patch == [
        {"op": "replace", "path": limit_path(NPU_MEM), "value": "16384"},
        {"op": "replace", "path": limit_path(NPU_MEM, "requests"), "value": "16384"},
        HIDE,
        ROUTE,
    ]
    # no memory: the whole card's memoryAllocatable, per card
    patch = await twice(admit, review(one({NPU: "2"}, {NPU: "2"})))
    assert patch[:2] == [
        {"op": "add", "path": limit_path(NPU_MEM), "value": "65536"},
        {"op": "add", "path": limit_path(NPU_MEM, "requests"), "value": "65536"},
    ]


async def test_a_vendor_resource_in_requests_alone_is_stated_in_limits(
    webhook: tuple[Admit, httpx.AsyncClient],
) -> None:
    admit, _ = webhook
    # Kubernetes refuses an extended resource requested without a limit
    patch = await twice(admit, review(one({}, {DRS: "2"})))
    assert patch == [
        {"op": "add", "path": limit_path(DRS), "value": "2"},
        HIDE,
        ROUTE,
    ]
    # limits alone are what the API server fills requests from: nothing to write
    assert await twice(admit, review(one({GCU_MEM: "20", GCU_CORES: "50"}))) == [HIDE, ROUTE]
    assert await twice(admit, review(one({MLU: 1, MLU_MEM: 4}))) == [HIDE, ROUTE]


# ---------------------------------------------------------------- quotas


def quota(name: str, **hard: str) -> dict[str, Any]:
    return {"metadata": {"name": name}, "spec": {"hard": dict(hard)}}


def running_pod(
    name: str, limits: dict[str, Any], grants: tuple[DeviceGrant, ...] = (), vendor: str = ""
) -> dict[str, Any]:
    found = one(limits, name=name)
    found["metadata"] |= {"namespace": NS, "uid": f"u-{name}"}
    found["status"] = {"phase": "Running"}
    if grants:
        record = Placement(
            pod=PodRef(uid=f"u-{name}", namespace=NS, name=name),
            node="n1",
            containers=(ContainerAssignment(name="main", vendor=vendor, devices=grants),),
        )
        found["metadata"]["annotations"] = {PLACEMENT_ANNOTATION: record.to_annotation()}
    return found


def exceeded(name: str, key: str, requested: int, used: int, limited: int) -> str:
    """Kubernetes' own message for a pod over a ResourceQuota."""
    return (
        f"exceeded quota: {name}, requested: {key}={requested}, used: {key}={used}, "
        f"limited: {key}={limited}"
    )


async def test_a_cambricon_memory_quota_counts_cambricon_pods_in_its_unit(
    webhook: tuple[Admit, httpx.AsyncClient], kube: LocalKubeApi
) -> None:
    admit, scraper = webhook
    key = f"limits.{MLU_MEM}"
    kube.add_resource_quota(NS, quota("mlu", **{key: "40"}))  # 40 x 256 MiB
    kube.add_resource_quota(NS, quota("gpu", **{f"limits.{MEM}": "100"}))
    kube.add_pod(running_pod("a", {MLU: 1, MLU_MEM: 16}))
    # placed: 1000 MiB held, 3.9 units, shown rounded up
    kube.add_pod(
        running_pod(
            "b",
            {MLU: 1, MLU_MEM: 4},
            (DeviceGrant(uuid="m-1", memory_mib=1000, cores=0),),
            "cambricon",
        )
    )
    kube.add_pod(running_pod("gpu", {MEM: "100"}))  # NVIDIA's: not counted against it
    over = await admit(review(one({MLU: 1, MLU_MEM: 21})))
    assert over["allowed"] is False
    assert over["status"]["code"] == 403
    assert over["status"]["message"] == exceeded("mlu", key, 21, 20, 40)
    # 16 x 256 + 1000 + 20 x 256 = 10216 MiB: within 40 units (10240 MiB)
    assert (await admit(review(one({MLU: 1, MLU_MEM: 20}))))["allowed"] is True
    scraped = (await scraper.get("/metrics")).text
    assert f'gpuslice_quota_used{{namespace="{NS}",quota="mlu",resource="{MLU_MEM}"}} 40.0' in (
        scraped
    )
    # NVIDIA's quota, full, is no obstacle to a Cambricon pod, nor theirs to it
    assert f'resource="{MEM}"}} 100.0' in scraped


async def test_nvidia_quotas_count_nvidia_pods_alone(
    webhook: tuple[Admit, httpx.AsyncClient], kube: LocalKubeApi
) -> None:
    admit, _ = webhook
    kube.add_resource_quota(NS, quota("gpu", **{f"limits.{MEM}": "1000"}))
    kube.add_pod(running_pod("mlu", {MLU: 1, MLU_MEM: 1000}))
    assert (await admit(review(one({MEM: "1000"}))))["allowed"] is True
    kube.add_pod(running_pod("gpu", {MEM: "600"}))
    over = await admit(review(one({MEM: "401"})))
    assert over["status"]["message"] == exceeded("gpu", f"limits.{MEM}", 401, 600, 1000)
    assert (await admit(review(one({MLU: 1, MLU_MEM: 1000}))))["allowed"] is True


async def test_a_vendor_cores_quota_counts_in_the_vendors_unit(
    webhook: tuple[Admit, httpx.AsyncClient], kube: LocalKubeApi
) -> None:
    admit, _ = webhook
    key = f"limits.{MT_CORES}"
    kube.add_resource_quota(NS, quota("mt", **{key: "40"}))  # sixteenths of a card
    kube.add_pod(running_pod("one", {MT_COUNT: 1, MT_MEM: 96, MT_CORES: 16}))
    over = await admit(review(one({MT_COUNT: 2})))  # two whole cards: 32
    assert over["status"]["message"] == exceeded("mt", key, 32, 16, 40)
    assert (await admit(review(one({MT_COUNT: 1, MT_MEM: 8, MT_CORES: 8}))))["allowed"]


async def test_a_vendor_memory_quota_needs_the_memory_stated(
    webhook: tuple[Admit, httpx.AsyncClient], kube: LocalKubeApi
) -> None:
    admit, _ = webhook
    kube.add_resource_quota(NS, quota("mlu", **{f"limits.{MLU_MEM}": "4000"}))
    refused = await admit(review(one({MLU: 1})))  # a whole card: known once placed
    assert refused["allowed"] is False
    assert refused["status"]["message"] == (
        f"namespace '{NS}' limits cambricon memory (limits.{MLU_MEM} in ResourceQuota "
        f"'mlu'), so cambricon memory must be given with {MLU_MEM}; container 'main' "
        "asks for 100% of a card, whose memory is known only once it is placed"
    )


async def test_enflame_pods_count_once_placed_and_are_refused_before_under_their_quota(
    webhook: tuple[Admit, httpx.AsyncClient], kube: LocalKubeApi
) -> None:
    admit, scraper = webhook
    # only an NVIDIA quota: an Enflame pod is not counted against it
    kube.add_resource_quota("team-b", quota("gpu", **{f"limits.{MEM}": "100"}))
    assert (await admit(review(one({DRS: 2}), namespace="team-b")))["allowed"] is True
    key = f"limits.{GCU_MEM}"
    kube.add_resource_quota(NS, quota("gcu", **{key: "65536"}))  # MiB: its factor is 1
    grant = DeviceGrant(uuid="gcu-1", memory_mib=20480, cores=50)  # a 2g.20gb profile
    kube.add_pod(running_pod("placed", {DRS: 2}, (grant,), "enflame"))
    kube.add_pod(running_pod("waiting", {DRS: 4}))  # not placed yet: nothing known
    refused = await admit(review(one({GCU_MEM: "20"})))
    assert refused["allowed"] is False
    assert refused["status"]["message"] == (
        f"namespace '{NS}' limits {key} (ResourceQuota 'gcu'); container 'main' asks "
        "for an Enflame DRS profile, whose memory and cores are known only once the pod "
        "is placed, so it cannot be counted against that limit: run Enflame pods in a "
        "namespace without one"
    )
    scraped = (await scraper.get("/metrics")).text
    assert f'gpuslice_quota_used{{namespace="{NS}",quota="gcu",resource="{GCU_MEM}"}} 20480.0' in (
        scraped
    )


async def test_a_pod_whose_annotations_its_owner_broke_still_counts_as_it_asks(
    webhook: tuple[Admit, httpx.AsyncClient], kube: LocalKubeApi
) -> None:
    """Annotations change after admission (the webhook sees CREATE only); what a
    pod holds is in its spec. One its owner made unreadable counts all the same,
    against its vendor's quota: neither as nothing nor as NVIDIA's."""
    admit, _ = webhook
    key = f"limits.{MLU_MEM}"
    kube.add_resource_quota(NS, quota("mlu", **{key: "40"}))  # 40 x 256 MiB
    kube.add_resource_quota(NS, quota("gpu", **{f"limits.{MEM}": "20000"}))
    placed = running_pod(
        "placed",
        {MLU: 1, MLU_MEM: 4},
        (DeviceGrant(uuid="m-1", memory_mib=5120, cores=0),),
        "cambricon",
    )
    waiting = running_pod("waiting", {MLU: 1, MLU_MEM: 10})
    waiting["status"] = {"phase": "Pending"}
    for found in (placed, waiting):
        found["metadata"].setdefault("annotations", {})["hami.io/gpu-scheduler-policy"] = "none"
    kube.add_pod(placed)
    kube.add_pod(waiting)
    # 20 units placed + 10 waiting: 10 of the 40 left
    over = await admit(review(one({MLU: 1, MLU_MEM: 11})))
    assert over["allowed"] is False
    assert over["status"]["message"] == exceeded("mlu", key, 11, 30, 40)
    # and the placed one is not NVIDIA's: NVIDIA's quota is whole
    assert (await admit(review(one({MEM: "20000"}))))["allowed"] is True
