"""Why a pod ended, as its status tells: the release reason the ledger keeps and
the console and CLI show (``pod failed: container main exited 137 (OOMKilled)``,
not a bare ``pod failed``)."""

from __future__ import annotations

from typing import Any

from gpuslice_common.kube import (
    MAX_END_CONTAINERS,
    MAX_END_TEXT,
    LocalKubeApi,
    pod_end_reason,
    pod_failure,
)


def ended(phase: str, **status: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": "p", "namespace": "ns", "uid": "u"},
        "status": {"phase": phase, **status},
    }


def terminated(name: str, code: object, reason: object = None) -> dict[str, Any]:
    state: dict[str, Any] = {"exitCode": code}
    if reason is not None:
        state["reason"] = reason
    return {"name": name, "state": {"terminated": state}}


def test_a_failed_pod_names_each_container_that_failed_with_its_exit_code_and_reason() -> None:
    pod = ended(
        "Failed",
        initContainerStatuses=[terminated("setup", 0, "Completed")],
        containerStatuses=[
            terminated("main", 137, "OOMKilled"),
            terminated("sidecar", 0, "Completed"),
            terminated("log", 2, "Error"),
        ],
    )
    assert pod_end_reason(pod) == (
        "pod failed: container main exited 137 (OOMKilled), container log exited 2 (Error)"
    )


def test_an_evicted_pod_gives_its_reason_and_message() -> None:
    pod = ended("Failed", reason="Evicted", message="The node was low on resource: memory.")
    assert pod_end_reason(pod) == "pod failed: Evicted: The node was low on resource: memory."


def test_a_pod_whose_status_says_nothing_more_is_a_bare_failure() -> None:
    assert pod_end_reason(ended("Failed")) == "pod failed"
    assert pod_end_reason(ended("Succeeded")) == "pod succeeded"
    assert pod_end_reason(ended("Running")) is None
    assert pod_end_reason({}) is None


def test_what_a_hostile_kubelet_writes_is_bounded_and_one_printable_line() -> None:
    huge = "x" * 100_000
    statuses: list[Any] = [
        "not a mapping",
        {"name": "no-state"},
        {"name": "text-code", "state": {"terminated": {"exitCode": "137"}}},
        {"name": "bool-code", "state": {"terminated": {"exitCode": True}}},
        {"name": "float-code", "state": {"terminated": {"exitCode": 1.5}}},
        {"name": "still", "state": {"running": {}}},
        terminated("evil\nname\x1b[31m", 1, "line\nbreak\x00"),
        *(terminated(f"c{i}", 1, huge) for i in range(10)),
    ]
    pod = ended("Failed", reason=huge, message=["not text"], containerStatuses=statuses)
    why = pod_failure(pod)
    assert why.isprintable()
    assert "container evil name [31m exited 1 (line break)" in why  # control characters blanked
    # the pod's reason and every container's cut; only the first few containers named
    assert len(why) < (MAX_END_CONTAINERS + 2) * (MAX_END_TEXT + 40)
    assert why.endswith(f", {11 - MAX_END_CONTAINERS} more")
    for skipped in ("no-state", "text-code", "bool-code", "float-code", "still"):
        assert skipped not in why
    assert pod_failure(ended("Failed", containerStatuses={"main": 1})) == ""


def test_the_local_api_servers_pods_end_with_their_containers_exit_codes() -> None:
    api = LocalKubeApi()
    api.add_pod({"metadata": {"name": "p", "namespace": "ns", "uid": "u"}, "spec": {}})
    api.set_phase("ns", "p", "Failed", {"init": 0, "main": 3})
    [pod] = api.pods()
    assert pod_end_reason(pod) == "pod failed: container main exited 3 (Error)"
