"""What a namespaced viewer sees of the console's data
(gpuslice_inventory.console.scope), with well-formed and with hostile data."""

from __future__ import annotations

import copy
import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from gpuslice_common.events import (
    AllocationEvent,
    EventType,
    PodAdmitted,
    PodDenied,
    make_event,
)
from gpuslice_common.models import PodRef
from gpuslice_inventory.console.auditfeed import FeedEvent
from gpuslice_inventory.console.auth import Viewer
from gpuslice_inventory.console.scope import (
    namespace_visible,
    scope_snapshot,
    snapshot_namespaces,
)

EVERYONE = Viewer("alice", None)
TEAM_A = Viewer("bob", frozenset())


def pod(namespace: str, name: str, memory: Any = 4096, cores: Any = 25, uid: str = "") -> Any:
    return {
        "uid": uid or f"uid-{namespace}-{name}",
        "namespace": namespace,
        "name": name,
        "container": "main",
        "memory_mib": memory,
        "cores": cores,
    }


def card(uuid: str, *pods: Any) -> dict[str, Any]:
    return {
        "uuid": uuid,
        "index": 0,
        "model": "A100-SXM4-40GB",
        "memory_mib": 40960,
        "cores": 100,
        "used": {"memory_mib": 12288, "cores": 75, "slots": 3},
        "pods": list(pods),
        "others": None,
    }


def snapshot() -> dict[str, Any]:
    two_cards = pod("team-a", "wide", uid="uid-wide")
    return {
        "version": 17,
        "at": "2026-11-25T01:00:00Z",
        "cluster": {"nodes": 2, "cards": 3, "pods": 5, "fragmentation": 0.12, "fits": []},
        "nodes": [
            {
                "name": "gpu-1",
                "live": True,
                "cards": [
                    card("GPU-1", pod("team-a", "train"), pod("team-b", "x", 8192, 50), two_cards),
                    card("GPU-2", two_cards, pod("team-b", "y", 1024.5, 10)),
                ],
            },
            {"name": "gpu-2", "live": True, "cards": [card("GPU-3", pod("team-c", "z"))]},
        ],
    }


def test_a_cluster_wide_viewer_sees_everything() -> None:
    data = snapshot()
    assert scope_snapshot(data, EVERYONE, {"team-a"}) == data
    assert scope_snapshot(data, TEAM_A, None) == data


def test_a_namespaced_viewer_sees_its_pods_and_sums_of_the_others() -> None:
    data = snapshot()
    original = copy.deepcopy(data)
    scoped = scope_snapshot(data, TEAM_A, {"team-a"})
    assert data == original  # the shared snapshot is not touched
    gpu1, gpu2 = scoped["nodes"]
    first, second = gpu1["cards"]
    assert [p["name"] for p in first["pods"]] == ["train", "wide"]
    assert first["others"] == {"pods": 1, "memory_mib": 8192, "cores": 50}
    assert [p["name"] for p in second["pods"]] == ["wide"]
    assert second["others"] == {"pods": 1, "memory_mib": 1024.5, "cores": 10}
    (third,) = gpu2["cards"]
    assert third["pods"] == []
    assert third["others"] == {"pods": 1, "memory_mib": 4096, "cores": 25}
    # the pod on two cards counts once; totals of the cluster stay
    assert scoped["cluster"]["pods"] == 2
    assert scoped["cluster"]["fragmentation"] == 0.12
    assert first["used"] == {"memory_mib": 12288, "cores": 75, "slots": 3}
    # nothing of another namespace's pods is left anywhere in what is sent
    text = json.dumps(scoped)
    for hidden in ("team-b", "team-c", "uid-team-b-x", '"x"', '"y"', '"z"'):
        assert hidden not in text


def test_a_viewer_of_no_namespace_sees_only_sums() -> None:
    scoped = scope_snapshot(snapshot(), TEAM_A, set())
    assert scoped["cluster"]["pods"] == 0
    cards = [c for n in scoped["nodes"] for c in n["cards"]]
    assert all(c["pods"] == [] for c in cards)
    assert [c["others"]["pods"] for c in cards] == [3, 2, 1]
    assert snapshot_namespaces(snapshot()) == {"team-a", "team-b", "team-c"}


def test_odd_pods_are_hidden_and_odd_numbers_not_summed() -> None:
    data = {
        "nodes": [
            {
                "name": "gpu-1",
                "cards": [
                    card(
                        "GPU-1",
                        pod("team-a", "ok"),
                        "team-a",  # no object
                        None,
                        {"namespace": ["team-a"], "name": "list"},
                        {"name": "no-namespace", "memory_mib": 5},
                        pod("team-b", "nan", float("nan"), float("inf")),
                        pod("team-b", "huge", 10**400, -5),
                        pod("team-b", "bool", True, "25"),
                    ),
                    "not a card",
                    {"uuid": "GPU-odd", "pods": {"team-a": 1}},
                ],
            },
            "not a node",
            {"name": "gpu-3", "cards": "none"},
        ],
    }
    scoped = scope_snapshot(data, TEAM_A, {"team-a"})
    first, odd = scoped["nodes"][0]["cards"]
    assert [p["name"] for p in first["pods"]] == ["ok"]
    assert first["others"] == {"pods": 7, "memory_mib": 5, "cores": 0}
    assert odd["pods"] == []
    assert odd["others"] is None
    assert [n["name"] for n in scoped["nodes"]] == ["gpu-1", "gpu-3"]
    assert scoped["nodes"][1]["cards"] == []
    assert scoped["cluster"] == {"pods": 1}
    json.dumps(scoped, allow_nan=False)  # still JSON


def test_what_is_no_snapshot_scopes_to_nothing() -> None:
    for junk in (None, [], "nodes", 7, {"nodes": "x"}, {"nodes": [None, 1]}, {"cluster": 3}):
        scoped = scope_snapshot(junk, TEAM_A, {"team-a"})
        assert scoped.get("nodes", []) == []
        assert snapshot_namespaces(junk) == set()


def test_events_of_visible_namespaces_only_and_none_without_a_pod() -> None:
    def event(kind: EventType, payload: Any) -> FeedEvent:
        return FeedEvent.of(make_event(kind, payload, source="/test"))

    a = PodRef(uid="u", namespace="team-a", name="a")
    b = PodRef(uid="v", namespace="team-b", name="b")
    admitted = event(EventType.POD_ADMITTED, PodAdmitted(pod=a, containers=()))
    other = event(EventType.POD_DENIED, PodDenied(pod=b, reason="no"))
    no_pod = event(EventType.ALLOC_FAILED, AllocationEvent(pod=None, node="gpu-1", reason="x"))
    assert admitted.visible_to({"team-a"})
    assert not other.visible_to({"team-a"})
    assert not no_pod.visible_to({"team-a"})
    assert not admitted.visible_to(set())
    for fed in (admitted, other, no_pod):
        assert fed.visible_to(None)  # a cluster-wide viewer sees every one


def test_namespace_visible_reads_only_names_in_the_set() -> None:
    assert namespace_visible("team-a", {"team-a"})
    assert namespace_visible("anything", None)
    assert not namespace_visible("team", {"team-a"})
    assert not namespace_visible("team", "team-a")  # type: ignore[arg-type]
    assert not namespace_visible(["team-a"], {"team-a"})
    assert not namespace_visible({"x": 1}, {"team-a"})
    assert not namespace_visible("", {""})


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(max_size=8)
    | st.sampled_from(["team-a", "team-b", "pods", "nodes", "cards", "namespace"]),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(
            st.sampled_from(
                [
                    "nodes",
                    "cards",
                    "pods",
                    "namespace",
                    "cluster",
                    "memory_mib",
                    "cores",
                    "uid",
                    "data",
                    "pod",
                ]
            ),
            inner,
            max_size=5,
        )
    ),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(JSON)
def test_no_data_makes_scoping_raise_or_leak(data: Any) -> None:
    scoped = scope_snapshot(data, TEAM_A, {"team-a"})
    snapshot_namespaces(data)
    for node in scoped.get("nodes", []):
        for c in node["cards"]:
            assert all(p["namespace"] == "team-a" for p in c["pods"])
            if c["others"] is not None:
                assert c["others"]["pods"] > 0
