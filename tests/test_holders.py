"""The holder check against a real Redis ledger and an API server over HTTP:
only the API server's word that a pod is gone or terminal frees its cards."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from gpuslice_common.kube import KubernetesApi
from gpuslice_common.ledger import Ledger
from gpuslice_common.models import (
    ContainerAssignment,
    DeviceGrant,
    Placement,
    PlacementState,
    PodRef,
)
from gpuslice_scheduler import holders
from gpuslice_scheduler.holders import Freed, HolderCheck
from gpuslice_scheduler.metrics import Metrics
from tests.conftest import make_inventory
from tests.kubeapi import FakeApiServer

NODE = "node-a"


def pod(name: str, uid: str, phase: str = "Running", **metadata: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "team", "uid": uid, **metadata},
        "spec": {"nodeName": NODE},
        "status": {"phase": phase},
    }


def oom_killed(found: dict[str, Any]) -> dict[str, Any]:
    """``found`` with its container ``main`` ended by the kernel's OOM killer."""
    terminated = {"exitCode": 137, "reason": "OOMKilled"}
    found["status"]["containerStatuses"] = [{"name": "main", "state": {"terminated": terminated}}]
    return found


def path(name: str) -> str:
    return f"/api/v1/namespaces/team/pods/{name}"


async def hold(ledger: Ledger, name: str, card: int, uid: str = "") -> None:
    grant = DeviceGrant(uuid=f"GPU-{NODE}-{card}", memory_mib=1000, cores=10)
    await ledger.reserve(
        Placement(
            pod=PodRef(uid=uid or f"uid-{name}", namespace="team", name=name),
            node=NODE,
            containers=(ContainerAssignment(name="main", devices=(grant,)),),
        )
    )


async def state(ledger: Ledger, name: str) -> tuple[PlacementState, str]:
    found = await ledger.placement(f"uid-{name}")
    assert found is not None
    return found.state, found.release_reason


@pytest.fixture
async def api(kube_api_server: FakeApiServer) -> AsyncIterator[KubernetesApi]:
    client = KubernetesApi.connect(kube_api_server.host, timeout=3.0)
    try:
        yield client
    finally:
        await client.close()


@pytest.fixture
async def node(ledger: Ledger) -> Ledger:
    await ledger.register_node(make_inventory(NODE, gpus=32), rebuilt=True)
    return ledger


async def test_only_pods_the_api_server_says_are_gone_or_terminal_are_freed(
    node: Ledger, api: KubernetesApi, kube_api_server: FakeApiServer
) -> None:
    ledger, server = node, kube_api_server
    answers = {
        "gone": None,  # no route: 404
        "replaced": (200, pod("replaced", "uid-of-a-new-pod")),
        "succeeded": (200, pod("succeeded", "uid-succeeded", "Succeeded")),
        "failed": (200, oom_killed(pod("failed", "uid-failed", "Failed"))),
        "running": (200, pod("running", "uid-running")),
        "terminating": (
            200,
            pod("terminating", "uid-terminating", deletionTimestamp="2026-01-01T00:00:00Z"),
        ),
        "broken": (500, {"kind": "Status", "message": "etcd is away", "code": 500}),
        "forbidden": (403, {"kind": "Status", "message": "no", "code": 403}),
    }
    for card, (name, answer) in enumerate(answers.items()):
        await hold(ledger, name, card)
        if answer is not None:
            server.answer("GET", path(name), *answer)
    await hold(ledger, "waiting", len(answers))  # the pending pod's own: never asked
    told: list[Freed] = []

    async def announce(freed: Freed) -> None:
        told.append(freed)

    metrics = Metrics()
    check = HolderCheck(ledger, api, metrics, announce)
    freed = await check.free([NODE], "uid-waiting", "filter")

    assert sorted(f.placement.pod.name for f in freed) == [
        "failed",
        "gone",
        "replaced",
        "succeeded",
    ]
    assert told == freed
    assert await state(ledger, "gone") == (PlacementState.RELEASED, "pod deleted")
    assert await state(ledger, "replaced") == (PlacementState.RELEASED, "pod deleted")
    assert await state(ledger, "succeeded") == (PlacementState.RELEASED, "pod succeeded")
    assert await state(ledger, "failed") == (
        PlacementState.RELEASED,
        "pod failed: container main exited 137 (OOMKilled)",
    )
    for name in ("running", "terminating", "broken", "forbidden", "waiting"):
        assert (await state(ledger, name))[0] is PlacementState.RESERVED, name
    asked = {r.path for r in server.requests if r.method == "GET"}
    assert path("waiting") not in asked
    assert len(asked) == len(answers)

    def count(answer: str) -> float:
        value = metrics.registry.get_sample_value(
            "gpuslice_scheduler_holder_checks_total", {"answer": answer}
        )
        return value or 0.0

    assert (count("gone"), count("terminal"), count("alive"), count("error")) == (2, 2, 2, 2)
    assert (
        metrics.registry.get_sample_value(
            "gpuslice_scheduler_holders_freed_total", {"verb": "filter"}
        )
        == 4
    )

    # Asked again, the live ones are asked again (an answer from before a
    # deletion must not hold), and nothing more is freed.
    assert await check.free([NODE], "uid-waiting", "filter") == []
    assert count("alive") == 4


async def test_a_slow_api_server_frees_nothing_and_holds_the_call_for_the_budget_only(
    node: Ledger, api: KubernetesApi, kube_api_server: FakeApiServer, monkeypatch: Any
) -> None:
    monkeypatch.setattr(holders, "BUDGET_S", 0.3)
    await hold(node, "slow", 0)
    kube_api_server.answer("GET", path("slow"), 200, pod("slow", "other-uid"), 2.0)
    check = HolderCheck(node, api, Metrics())
    assert await check.free([NODE], "uid-waiting", "bind") == []
    assert (await state(node, "slow"))[0] is PlacementState.RESERVED


async def test_one_call_asks_about_a_bounded_number_of_pods(
    node: Ledger, api: KubernetesApi, kube_api_server: FakeApiServer
) -> None:
    for card in range(holders.MAX_CHECKS + 8):
        await hold(node, f"p{card}", card)
        kube_api_server.answer("GET", path(f"p{card}"), 200, pod(f"p{card}", f"uid-p{card}"))
    check = HolderCheck(node, api, Metrics())
    assert await check.free([NODE], "uid-waiting", "filter") == []
    assert len([r for r in kube_api_server.requests if r.method == "GET"]) == holders.MAX_CHECKS
