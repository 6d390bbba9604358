"""Namespace labels and ResourceQuotas, read through the Kubernetes API and kept a while.

Admission reads them for every GPU pod; keeping each answer for ``ttl`` seconds
keeps the API server's load and admission's latency low, at the price of a
label or quota change taking up to ``ttl`` to apply. Concurrent admissions in
one namespace share a single read. Failed reads are not kept.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

from gpuslice_common.kube import KubeApi

T = TypeVar("T")
MAX_ENTRIES = 10_000


class _Cache(Generic[T]):
    def __init__(self, ttl: float, clock: Callable[[], float]) -> None:
        self._ttl = ttl
        self._clock = clock
        self._entries: dict[str, tuple[float, asyncio.Future[T]]] = {}

    async def get(self, key: str, read: Callable[[], Awaitable[T]]) -> T:
        now = self._clock()
        entry = self._entries.get(key)
        if entry is not None and entry[0] > now:
            return await asyncio.shield(entry[1])
        if len(self._entries) >= MAX_ENTRIES:
            self._entries = {k: e for k, e in self._entries.items() if e[0] > now}
            if len(self._entries) >= MAX_ENTRIES:
                self._entries.clear()
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._entries[key] = (now + self._ttl, future)
        try:
            value = await read()
        except BaseException as exc:
            self._entries.pop(key, None)
            if isinstance(exc, Exception):
                future.set_exception(exc)
                future.exception()  # waiters get it; no "never retrieved" warning
            else:
                future.cancel()
            raise
        future.set_result(value)
        return value


class NamespaceCache:
    """What admission needs to know of a namespace, from :class:`KubeApi`."""

    def __init__(
        self, kube: KubeApi, ttl: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._kube = kube
        self._labels: _Cache[dict[str, str]] = _Cache(ttl, clock)
        self._quotas: _Cache[list[dict[str, Any]]] = _Cache(ttl, clock)

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

    async def pods(self, namespace: str) -> list[dict[str, Any]]:
        """The namespace's pods that have not terminated; never cached."""
        return await self._kube.list_pods(namespace)
