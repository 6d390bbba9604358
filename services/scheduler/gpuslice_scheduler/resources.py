"""What each node has free of CPU and memory, as kube-scheduler's cache knows it.

:class:`NodeResources` follows every Node (its ``status.allocatable``) and every
Pod (a list, then a watch: :mod:`gpuslice_scheduler.reflector`). A pod counts on
its node while it is bound there (``spec.nodeName``) and has not terminated
(phase neither ``Succeeded`` nor ``Failed``), for what it requests
(:func:`~gpuslice_scheduler.requested.pod_request`). Pods are known by UID, so
a pod's every event replaces what it counted before: a pod moving nodes, ending
or deleted is counted where it is now, once.

A pod this scheduler binds counts at once (:meth:`NodeResources.assume`), before
the watch shows the Binding; the watch's event for it then takes its place
(never counted twice), and a failed bind takes it back
(:meth:`NodeResources.forget`).

A node nobody reported, or one whose allocatable cannot be read (missing,
unparsable, absurd), is *unknown*: free CPU and memory are infinite, as where
nothing is tracked (kube-scheduler checks fit itself). A pod's request that
cannot be read, or is above the sanity bound (a million cores, an exbibyte),
counts as that bound: the node then looks full, never emptier than it is, so
that no pod bound straight to a node (``spec.nodeName``) can make it look free.
What cannot be read, or is so counted, is logged once per object, and again
only if the problem changes.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from gpuslice_common.kube import KubeApi, object_uid, pod_node, pod_terminated
from gpuslice_scheduler.reflector import Source, reflect
from gpuslice_scheduler.requested import (
    MAX_CPU_MILLI,
    MAX_MEMORY,
    Amount,
    ResourceError,
    node_allocatable,
    pod_request,
)

log = logging.getLogger(__name__)

UNKNOWN: Final = (math.inf, math.inf)


@dataclass(frozen=True)
class Held:
    """What one pod holds on its node."""

    node: str
    amount: Amount
    assumed: bool = False  # counted by this scheduler's bind, not seen bound yet


@dataclass
class _Use:
    """The sum of what a node's pods hold."""

    cpu: int = 0
    memory: int = 0
    pods: int = 0

    def count(self, held: Held, sign: int) -> None:
        self.pods += sign
        self.cpu += sign * held.amount.cpu
        self.memory += sign * held.amount.memory


def _metadata(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    metadata = obj.get("metadata")
    return metadata if isinstance(metadata, Mapping) else {}


def pod_key(pod: Mapping[str, Any]) -> str:
    """The pod's UID, else its namespace/name (for a pod from a hand-made source)."""
    uid = object_uid(pod)
    if uid:
        return uid
    metadata = _metadata(pod)
    name, namespace = metadata.get("name"), metadata.get("namespace")
    return f"{namespace}/{name}" if isinstance(name, str) and name else ""


def _pod_name(pod: Mapping[str, Any]) -> str:
    metadata = _metadata(pod)
    return f"{metadata.get('namespace') or 'default'}/{metadata.get('name')}"


class NodeResources:
    """Per node: allocatable CPU and memory, and the requests of the pods there."""

    def __init__(self, kube: KubeApi) -> None:
        self.kube = kube
        self._allocatable: dict[str, Amount | None] = {}  # None: cannot be read
        self._pods: dict[str, Held] = {}  # by pod_key
        self._used: dict[str, _Use] = {}
        self._changed: set[str] = set()
        self._problems: dict[str, str] = {}  # object -> the problem logged for it

    # ------------------------------------------------------------ reading

    def free(self, node: str) -> tuple[float, float]:
        """Free milli-CPU and MiB of memory; infinite both where unknown. Negative
        where the pods there ask for more than the node has."""
        allocatable = self._allocatable.get(node)
        if allocatable is None:
            return UNKNOWN
        use = self._used.get(node)
        if use is None:
            return float(allocatable.cpu), allocatable.memory_mib
        left = allocatable - Amount(use.cpu, use.memory)
        return float(left.cpu), left.memory_mib

    def take_changed(self) -> set[str]:
        """The nodes whose free CPU or memory may have changed since the last call."""
        changed, self._changed = self._changed, set()
        return changed

    # ------------------------------------------------------------ this scheduler's binds

    def assume(self, pod: Mapping[str, Any], node: str) -> None:
        """Count ``pod`` on ``node`` now: this scheduler is binding it there.

        Nothing changes when the watch has shown it bound already."""
        key = pod_key(pod)
        held = self._pods.get(key)
        if not key or (held is not None and not held.assumed):
            return
        self._set(key, Held(node, self._request(key, pod), assumed=True))

    def forget(self, pod: Mapping[str, Any]) -> None:
        """Take back :meth:`assume`: the bind failed."""
        key = pod_key(pod)
        held = self._pods.get(key)
        if held is not None and held.assumed:
            self._set(key, None)

    # ------------------------------------------------------------ what the watches feed

    def replace_nodes(self, nodes: Iterable[Mapping[str, Any]]) -> None:
        """Every node there is (a list)."""
        fresh = {name: self._allocatable_of(name, n) for n in nodes if (name := _node_name(n))}
        for name in set(self._allocatable) | set(fresh):
            self._set_node(name, name in fresh, fresh.get(name))
        self._drop_problems("node ", {f"node {name}" for name in fresh})

    def apply_node(self, kind: str, node: Mapping[str, Any]) -> None:
        name = _node_name(node)
        if not name:
            return
        if kind == "DELETED":
            self._set_node(name, False, None)
            self._problems.pop(f"node {name}", None)
        else:
            self._set_node(name, True, self._allocatable_of(name, node))

    def replace_pods(self, pods: Iterable[Mapping[str, Any]]) -> None:
        """Every pod there is (a list). A pod this scheduler is binding stays
        counted while the list shows it not bound yet."""
        fresh: dict[str, Held] = {}
        waiting: set[str] = set()  # listed, neither bound nor ended
        for pod in pods:
            key = pod_key(pod)
            held = self._held(key, pod)
            if held is not None:
                fresh[key] = held
            elif key and not pod_terminated(pod):
                waiting.add(key)
        for key, held in self._pods.items():
            if held.assumed and key in waiting:
                fresh[key] = held
        for key in set(self._pods) | set(fresh):
            self._set(key, fresh.get(key))
        self._drop_problems("pod ", {f"pod {key}" for key in fresh})

    def apply_pod(self, kind: str, pod: Mapping[str, Any]) -> None:
        key = pod_key(pod)
        if not key:
            return
        if kind == "DELETED":
            self._set(key, None)
            self._problems.pop(f"pod {key}", None)
            return
        held = self._held(key, pod)
        old = self._pods.get(key)
        if held is None and old is not None and old.assumed and not pod_terminated(pod):
            return  # an event from before the Binding: the bind's count stands
        self._set(key, held)

    async def run(self) -> None:
        """Follow nodes and pods until cancelled; failures are logged and retried."""
        kube = self.kube
        await asyncio.gather(
            reflect(
                Source(
                    "nodes", kube.list_nodes, kube.watch_nodes, self.replace_nodes, self.apply_node
                )
            ),
            reflect(
                Source(
                    "pods", kube.list_all_pods, kube.watch_pods, self.replace_pods, self.apply_pod
                )
            ),
        )

    # ------------------------------------------------------------ bookkeeping

    def _held(self, key: str, pod: Mapping[str, Any]) -> Held | None:
        """What the pod holds, or None when it holds nothing (not bound, ended)."""
        node = pod_node(pod)
        if not key or not node or pod_terminated(pod):
            return None
        return Held(node, self._request(key, pod))

    def _request(self, key: str, pod: Mapping[str, Any]) -> Amount:
        """What the pod requests; one above the bound, or one that cannot be read,
        counts as the bound: its node looks full, never freer than it is."""
        where = pod_node(pod) or "no node yet"
        try:
            amount = pod_request(pod, clamp=True)
        except ResourceError as exc:
            self._problem(
                f"pod {key}",
                f"pod {_pod_name(pod)} (on {where}): {exc}; that node looks full until "
                "the pod ends or its request can be read",
            )
            return Amount(MAX_CPU_MILLI, MAX_MEMORY)
        if amount.cpu >= MAX_CPU_MILLI or amount.memory >= MAX_MEMORY:
            self._problem(
                f"pod {key}",
                f"pod {_pod_name(pod)} (on {where}) requests more CPU or memory than any "
                "node has (a quantity above the bound counts as the bound); "
                "that node looks full",
            )
        else:
            self._problems.pop(f"pod {key}", None)
        return amount

    def _allocatable_of(self, name: str, node: Mapping[str, Any]) -> Amount | None:
        try:
            amount = node_allocatable(node)
        except ResourceError as exc:
            self._problem(
                f"node {name}", f"node {name}: {exc}; its free CPU and memory count as unknown"
            )
            return None
        self._problems.pop(f"node {name}", None)
        return amount

    def _problem(self, what: str, message: str) -> None:
        if self._problems.get(what) != message:
            log.warning("%s", message)
        self._problems[what] = message

    def _drop_problems(self, prefix: str, present: set[str]) -> None:
        for what in [w for w in self._problems if w.startswith(prefix) and w not in present]:
            del self._problems[what]

    def _set(self, key: str, held: Held | None) -> None:
        old = self._pods.get(key)
        if old == held:
            return
        if old is not None:
            del self._pods[key]
            self._count(old, -1)
        if held is not None:
            self._pods[key] = held
            self._count(held, 1)

    def _count(self, held: Held, sign: int) -> None:
        use = self._used.setdefault(held.node, _Use())
        use.count(held, sign)
        if not use.pods:
            del self._used[held.node]
        self._changed.add(held.node)

    def _set_node(self, name: str, present: bool, allocatable: Amount | None) -> None:
        if (name in self._allocatable) == present and self._allocatable.get(name) == allocatable:
            return
        if present:
            self._allocatable[name] = allocatable
        else:
            self._allocatable.pop(name, None)
        self._changed.add(name)


def _node_name(node: Mapping[str, Any]) -> str:
    name = _metadata(node).get("name")
    return name if isinstance(name, str) else ""
