"""Follow one kind of Kubernetes object as client-go's reflector does: list it,
then watch from the list's resource version, forever.

A watch the server ends (its timeout) is renewed from the last version seen. A
watch whose version is gone (410, :class:`WatchExpired`) or that breaks (the
server or the stream fails, an event cannot be applied) is followed by a fresh
list, which replaces what was known: changes missed meanwhile are not lost. A
failure is logged once, then retried with a growing pause until a list works
again; it never ends the loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from gpuslice_common.kube import KubeError, Listing, WatchEvent, WatchExpired, resource_version

log = logging.getLogger(__name__)

RETRY_FIRST_S = 0.5
RETRY_MAX_S = 30.0


@dataclass
class Source:
    """One kind of object: how to list and watch it, and what to do with what comes."""

    what: str  # "nodes", "pods": for log lines
    list: Callable[[], Awaitable[Listing]]
    watch: Callable[[str], AsyncIterator[WatchEvent]]
    replace: Callable[[Listing], None]  # everything there is, after a list
    apply: Callable[[str, dict[str, Any]], None]  # one change (ADDED, MODIFIED, DELETED)


async def reflect(source: Source) -> None:
    """List, then watch, ``source`` until cancelled."""
    loop = asyncio.get_running_loop()
    listed, version = False, ""
    failing = False
    delay = RETRY_FIRST_S
    while True:
        started = loop.time()
        try:
            if not listed:
                items = await source.list()
                source.replace(items)
                listed, version = True, items.resource_version
                if failing:
                    log.info("following the %s again", source.what)
                failing = False
            version = await _watch(source, version)
            delay = RETRY_FIRST_S  # the server ended a watch that worked
        except WatchExpired:
            log.info("the %s watch's version %s is gone; listing again", source.what, version)
            listed = False
        except Exception as exc:  # the follow outlives any one failure
            listed = False
            if not failing:
                if isinstance(exc, KubeError):
                    log.warning("cannot follow the %s (trying again): %s", source.what, exc)
                else:
                    log.exception("following the %s failed (trying again)", source.what)
            failing = True
            if loop.time() - started >= RETRY_MAX_S:
                delay = RETRY_FIRST_S  # it had worked a while: not the same trouble
            # a list that works and a watch that breaks at once, again and again,
            # back off as a failing list does: each turn lists every object
            await asyncio.sleep(delay)
            delay = min(delay * 2, RETRY_MAX_S)
            continue
        # a watch the server ends at once, again and again, is not spun on
        if loop.time() - started < RETRY_FIRST_S:
            await asyncio.sleep(RETRY_FIRST_S)


async def _watch(source: Source, version: str) -> str:
    """Apply one watch's events; the last version seen when the server ends it."""
    events = source.watch(version)
    try:
        async for kind, obj in events:
            if kind != "BOOKMARK":
                source.apply(kind, obj)
            version = resource_version(obj) or version
    finally:
        close = getattr(events, "aclose", None)
        if close is not None:  # a watch left on a failure lets go of its stream now
            await close()
    return version
