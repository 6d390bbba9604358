"""What a namespaced viewer may see of the console's data.

A cluster-wide viewer (``visible`` None, or a viewer whose ``namespaces`` is
None) sees everything. Any other viewer sees the pods of the namespaces in
``visible`` (those :meth:`Authenticator.visible` allowed) and, of every other
pod, only how much it takes: each card's hidden pods are summed into its
``others`` (pods, memory, cores), never named. Events of a hidden namespace,
and events that name no pod (a node's Allocate with no pod), are not shown.

The data comes from the ledger and the audit stream, which other parties
write: these functions read it as untrusted JSON. A field missing or of an
odd type never raises; what cannot be read as a visible pod is hidden (it
fails closed), and what cannot be read as a node or a card is left out of a
namespaced viewer's snapshot.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from gpuslice_inventory.console.auth import Viewer

# a pod's memory (MiB) or cores beyond this is no share of a card: not summed
MAX_AMOUNT = 2**40

__all__ = ["namespace_visible", "scope_snapshot", "snapshot_namespaces"]


def namespace_visible(namespace: Any, visible: Collection[str] | None) -> bool:
    """Whether the pods of ``namespace`` may be shown: always when ``visible``
    is None (a cluster-wide viewer); else only a namespace name in ``visible``."""
    if visible is None:
        return True
    if not isinstance(namespace, str) or not namespace or isinstance(visible, str | bytes):
        return False
    try:
        return namespace in visible
    except TypeError:
        return False


def snapshot_namespaces(snapshot: Any) -> set[str]:
    """The namespaces of every pod the snapshot shows on a card: what to ask
    :meth:`Authenticator.visible` about before :func:`scope_snapshot`."""
    found: set[str] = set()
    for card in _cards(snapshot):
        for pod in _list(card.get("pods")):
            namespace = pod.get("namespace") if isinstance(pod, Mapping) else None
            if isinstance(namespace, str) and namespace:
                found.add(namespace)
    return found


def scope_snapshot(
    snapshot: Any, viewer: Viewer, visible: Collection[str] | None
) -> dict[str, Any]:
    """The snapshot as ``viewer`` may see it: all of it for a cluster-wide
    viewer (or ``visible`` None); else a copy whose cards list only pods of ``visible``
    namespaces, the others summed into each card's ``others``
    (``{"pods", "memory_mib", "cores"}``, null when there are none), and whose
    ``cluster.pods`` counts the visible pods. Unchanged parts are shared with
    the input; neither is modified."""
    if not isinstance(snapshot, Mapping):
        return {}
    if viewer.namespaces is None or visible is None:
        return dict(snapshot)
    seen: set[Any] = set()
    nodes = [
        _scope_node(node, visible, seen)
        for node in _list(snapshot.get("nodes"))
        if isinstance(node, Mapping)
    ]
    scoped = {key: value for key, value in snapshot.items() if key != "nodes"}
    scoped["nodes"] = nodes
    cluster = snapshot.get("cluster")
    scoped["cluster"] = {
        **(cluster if isinstance(cluster, Mapping) else {}),
        "pods": len(seen),
    }
    return scoped


def _scope_node(
    node: Mapping[str, Any], visible: Collection[str], seen: set[Any]
) -> dict[str, Any]:
    scoped = dict(node)
    scoped["cards"] = [
        _scope_card(card, visible, seen)
        for card in _list(node.get("cards"))
        if isinstance(card, Mapping)
    ]
    return scoped


def _scope_card(
    card: Mapping[str, Any], visible: Collection[str], seen: set[Any]
) -> dict[str, Any]:
    shown: list[Any] = []
    hidden, memory, cores = 0, 0.0, 0.0
    for pod in _list(card.get("pods")):
        if isinstance(pod, Mapping) and namespace_visible(pod.get("namespace"), visible):
            shown.append(pod)
            seen.add(_identity(pod))
            continue
        hidden += 1
        if isinstance(pod, Mapping):
            memory += _amount(pod.get("memory_mib"))
            cores += _amount(pod.get("cores"))
    scoped = dict(card)
    scoped["pods"] = shown
    scoped["others"] = (
        {"pods": hidden, "memory_mib": _number(memory), "cores": _number(cores)} if hidden else None
    )
    return scoped


def _identity(pod: Mapping[str, Any]) -> Any:
    """One pod on several cards counts once: by its UID, else by its name."""
    uid = pod.get("uid")
    if isinstance(uid, str) and uid:
        return ("uid", uid)
    namespace, name = pod.get("namespace"), pod.get("name")
    return ("name", namespace, name if isinstance(name, str) else id(pod))


def _cards(snapshot: Any) -> list[Mapping[str, Any]]:
    nodes = snapshot.get("nodes") if isinstance(snapshot, Mapping) else None
    return [
        card
        for node in _list(nodes)
        if isinstance(node, Mapping)
        for card in _list(node.get("cards"))
        if isinstance(card, Mapping)
    ]


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _amount(value: Any) -> float:
    """A pod's share as a number to sum: a finite number from 0 to MAX_AMOUNT,
    else 0 (no card holds more; the sums stay finite JSON numbers)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return 0.0
    if not (0 <= value <= MAX_AMOUNT):  # NaN fails this too
        return 0.0
    return float(value)


def _number(total: float) -> int | float:
    """A whole sum as an int (how the snapshot writes MiB and cores)."""
    return int(total) if total.is_integer() else total
