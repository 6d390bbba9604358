"""Namespace labels and ResourceQuotas (and in DRA mode the cluster's
ResourceSlices), read through the Kubernetes API and kept a while.

Admission reads them for every GPU pod; keeping each answer for ``ttl`` seconds
keeps the API server's load and admission's latency low, at the price of a
label or quota change taking up to ``ttl`` to apply. Concurrent admissions in
one namespace share a single read. Failed reads are not kept.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Coroutine
from typing import Any, Generic, TypeVar

from gpuslice_common.kube import KubeApi, ObjectRef

T = TypeVar("T")
MAX_ENTRIES = 10_000


class _Cache(Generic[T]):
    """Values by key for ``ttl`` seconds. Each read runs in its own task, so a
    caller that gives up (a deadline, a cancelled request) cancels nobody else's
    wait; a failed read is forgotten, unless a newer one has replaced it."""

    def __init__(self, ttl: float, clock: Callable[[], float]) -> None:
        self._ttl = ttl
        self._clock = clock
        self._entries: dict[str, tuple[float, asyncio.Task[T]]] = {}

    async def get(self, key: str, read: Callable[[], Coroutine[Any, Any, T]]) -> T:
        now = self._clock()
        entry = self._entries.get(key)
        if entry is None or entry[0] <= now:
            if len(self._entries) >= MAX_ENTRIES:
                self._entries = {k: e for k, e in self._entries.items() if e[0] > now}
                if len(self._entries) >= MAX_ENTRIES:
                    self._entries.clear()
            entry = (now + self._ttl, asyncio.create_task(read()))
            self._entries[key] = entry
            entry[1].add_done_callback(functools.partial(self._done, key, entry))
        return await asyncio.shield(entry[1])

    def _done(self, key: str, entry: tuple[float, asyncio.Task[T]], task: asyncio.Task[T]) -> None:
        failed = task.cancelled() or task.exception() is not None  # retrieved: no warning
        if failed and self._entries.get(key) is entry:
            del self._entries[key]


class NamespaceCache:
    """What admission needs to know of a namespace, from :class:`KubeApi`."""

    def __init__(
        self, kube: KubeApi, ttl: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._kube = kube
        self._labels: _Cache[dict[str, str]] = _Cache(ttl, clock)
        self._quotas: _Cache[list[dict[str, Any]]] = _Cache(ttl, clock)
        self._cluster: _Cache[list[dict[str, Any]]] = _Cache(ttl, clock)

    @property
    def kube(self) -> KubeApi:
        """The API the cache reads (DRA mode creates claim templates through it)."""
        return self._kube

    async def labels(self, namespace: str) -> dict[str, str]:
        """The namespace's labels. Raises KubeError (NotFound when it does not exist)."""

        async def read() -> dict[str, str]:
            found = await self._kube.get_namespace(namespace)
            metadata = found.get("metadata")
            labels = metadata.get("labels") if isinstance(metadata, dict) else None
            if not isinstance(labels, dict):
                return {}
            return {str(k): str(v) for k, v in labels.items()}

        return await self._labels.get(namespace, read)

    async def quotas(self, namespace: str) -> list[dict[str, Any]]:
        """The namespace's ResourceQuotas. Raises KubeError."""
        return await self._quotas.get(namespace, lambda: self._kube.list_resource_quotas(namespace))

    async def cluster_objects(self, ref: ObjectRef) -> list[dict[str, Any]]:
        """Every object of a cluster-scoped collection (DRA mode: ResourceSlices,
        for the cards' memory sizes). Raises KubeError."""
        return await self._cluster.get(ref.path, lambda: self._list(ref))

    async def _list(self, ref: ObjectRef) -> list[dict[str, Any]]:
        return list(await self._kube.list_objects(ref))

    async def pods(self, namespace: str) -> list[dict[str, Any]]:
        """The namespace's pods that have not terminated; never cached."""
        return await self._kube.list_pods(namespace)
