"""Releases as pods end: a watch on the Kubernetes API, or word on the bus.

A pod's devices are released the moment it ends: its phase turns
``Succeeded`` or ``Failed``, or it is deleted. On a cluster the replica holding
the lease watches every pod (:class:`PodWatcher`); in the dev stack, where no
API server exists, its stand-in publishes :class:`~gpuslice_common.models.PodEnded`
on ``<prefix>.pods.ended``, which every replica shares through the queue group.
Either way the release is one atomic ledger step, so a pod reported twice, or by
both paths, is released once and announced once.

A watch that breaks is resumed from the last resource version it saw; one the
server no longer remembers starts again from now, which lists every pod again
(streamed by the server, or, where it refuses to stream the current state, as
over an etcd without progress notifications, listed first by the client).
What a gap between watches hides, reconciliation finds on its next pass.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from gpuslice_common.kube import (
    KubeApi,
    KubeError,
    WatchExpired,
    object_uid,
    pod_end_reason,
    resource_version,
)
from gpuslice_common.ledger import LedgerError
from gpuslice_common.models import PodEnded
from gpuslice_common.service import check_cancelled
from gpuslice_inventory.upkeep import Upkeep

log = logging.getLogger(__name__)

# release reasons (a pod the API server reports Failed gets its status's why:
# :func:`~gpuslice_common.kube.pod_end_reason`)
TERMINATED = {"Succeeded": "pod succeeded", "Failed": "pod failed"}
DELETED = "pod deleted"
ENDED = {**TERMINATED, "Deleted": DELETED}

RETRY_FIRST_S = 0.5
RETRY_MAX_S = 30.0


def end_reason(kind: str, pod: Mapping[str, Any]) -> str | None:
    """Why a watch event ends the pod's hold on its devices, or None."""
    if kind == "DELETED":
        return DELETED
    if kind in ("ADDED", "MODIFIED"):
        return pod_end_reason(pod)
    return None


async def release_ended(upkeep: Upkeep, ended: PodEnded) -> bool:
    """Release the devices of a pod the dev stack's stand-in reports ended."""
    return await upkeep.release(ended.pod.uid, ENDED[ended.phase])


@dataclass
class WatchStats:
    events: int = 0
    restarts: int = 0  # watches begun again after a failure or an expired version


class PodWatcher:
    """Releases pods as the API server reports them ending, while ``active()``."""

    def __init__(self, kube: KubeApi, upkeep: Upkeep, active: Callable[[], bool]) -> None:
        self.kube = kube
        self.upkeep = upkeep
        self.active = active
        self.version = ""  # the last resource version seen; "" is from now
        self.stats = WatchStats()

    async def run(self, idle_s: float) -> None:
        """Watch while active (checking every ``idle_s`` otherwise), resuming
        after every end and backing off after failures; never returns."""
        delay = RETRY_FIRST_S
        while True:
            if not self.active():
                self.version = ""  # a later leader's state is not ours to resume
                await asyncio.sleep(idle_s)
                continue
            started = asyncio.get_running_loop().time()
            try:
                await self.watch_once()
                # a watch the server ends at once, again and again, is not spun on
                if asyncio.get_running_loop().time() - started < RETRY_FIRST_S:
                    await asyncio.sleep(RETRY_FIRST_S)
                delay = RETRY_FIRST_S
                check_cancelled()
                continue
            except WatchExpired:
                log.info("pod watch: version %s is gone; watching from now", self.version)
                self.version = ""
                delay = RETRY_FIRST_S
            except (KubeError, LedgerError) as exc:
                log.warning("pod watch failed (again in %.1fs): %s", delay, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, RETRY_MAX_S)
            except Exception:  # the watch must outlive any one bad event
                log.exception("pod watch failed (again in %.1fs)", delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, RETRY_MAX_S)
            self.stats.restarts += 1
            check_cancelled()

    async def watch_once(self) -> None:
        """One watch request, from :attr:`version`, until it ends or this
        replica stops being active."""
        async for kind, pod in self.kube.watch_pods(self.version):
            self.stats.events += 1
            version = resource_version(pod)
            reason = end_reason(kind, pod)
            uid = object_uid(pod)
            if reason is not None and uid:
                await self.upkeep.release(uid, reason)
            if version:
                self.version = version
            if not self.active():
                return
