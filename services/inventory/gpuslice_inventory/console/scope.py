"""What a namespaced viewer may see of the snapshot, the events and the pods.

A cluster-wide viewer (``namespaces`` None) sees everything. A namespaced one
sees its namespaces' pods; other pods on a card are summed into ``others``
(how much of the card they hold, not who they are); events without a pod (a
kubelet Allocate that found none) are for cluster-wide viewers only.
"""

from __future__ import annotations

from typing import Any

from gpuslice_inventory.console.auth import Viewer


def namespace_visible(namespace: str, viewer: Viewer) -> bool:
    return viewer.namespaces is None or namespace in viewer.namespaces


def event_visible(event: dict[str, Any], viewer: Viewer) -> bool:
    """Whether ``viewer`` may see ``event`` (a CloudEvent as JSON)."""
    if viewer.namespaces is None:
        return True
    data = event.get("data")
    pod = data.get("pod") if isinstance(data, dict) else None
    namespace = pod.get("namespace") if isinstance(pod, dict) else None
    return isinstance(namespace, str) and namespace in viewer.namespaces


def scope_snapshot(snapshot: dict[str, Any], viewer: Viewer) -> dict[str, Any]:
    """``snapshot`` as ``viewer`` may see it (the same object for a cluster-wide
    viewer; a scoped copy otherwise, the original untouched)."""
    if viewer.namespaces is None:
        return snapshot
    visible_pods: set[str] = set()
    nodes = []
    for node in snapshot.get("nodes", []):
        cards = []
        for card in node.get("cards", []):
            shown: list[dict[str, Any]] = []
            hidden: list[dict[str, Any]] = []
            for pod in card.get("pods", []):
                (shown if namespace_visible(pod["namespace"], viewer) else hidden).append(pod)
            visible_pods.update(p["uid"] for p in shown)
            others = None
            if hidden:
                others = {
                    "pods": len({p["uid"] for p in hidden}),
                    "memory_mib": sum(p["memory_mib"] for p in hidden),
                    "cores": sum(p["cores"] for p in hidden),
                }
            cards.append({**card, "pods": shown, "others": others})
        nodes.append({**node, "cards": cards})
    cluster = {**snapshot.get("cluster", {}), "pods": len(visible_pods)}
    return {**snapshot, "cluster": cluster, "nodes": nodes}
