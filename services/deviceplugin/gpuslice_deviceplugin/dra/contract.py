"""What the kubelet plugin's gRPC service asks of the agent for one claim.

:class:`ClaimPreparer` is the agent's side (:mod:`.claims`): ``prepare`` puts the
claim's devices in place and says what kubelet hands the containers;
``unprepare`` takes them away. Both are idempotent, so kubelet may ask again after
either side restarted. A refusal is a :class:`ClaimError` whose message kubelet
shows on the pod.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from gpuslice_common.models import ClaimRef


@dataclass(frozen=True)
class PreparedDevice:
    """One allocated device as kubelet's NodePrepareResources answer names it."""

    request_names: tuple[str, ...]
    pool: str
    device: str
    cdi_ids: tuple[str, ...]


class ClaimError(Exception):
    """The claim cannot be prepared (or unprepared) here; the message says why."""


class ClaimPreparer(Protocol):
    async def prepare(self, claim: ClaimRef) -> Sequence[PreparedDevice]:
        """Prepare ``claim``; raises :class:`ClaimError`."""
        ...

    async def unprepare(self, claim: ClaimRef) -> None:
        """Unprepare ``claim`` (none prepared: nothing to do); raises :class:`ClaimError`."""
        ...
