"""The agent's way to the ledger: requests to the inventory on its own node's subjects.

The agent holds no ledger credential. It asks the inventory over NATS
(:mod:`gpuslice_common.nodeapi`) on ``<prefix>.node.<this node>.<verb>``; the
inventory acts on the node the subject names. A request that finds no
inventory, gets no answer in ``inventory_timeout`` (a lost reply, a replica
that died) or hears that the ledger is away or being rebuilt is sent again,
unchanged, until its deadline: an allocation is idempotent per request id, so a
second answer is the first one.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TypeVar

from nats.errors import Error as NatsError
from nats.errors import NoRespondersError

from gpuslice_common.bus import Bus
from gpuslice_common.config import DevicePluginSettings
from gpuslice_common.models import ClaimRef, Frozen
from gpuslice_common.nodeapi import (
    AllocateRequest,
    AllocationReply,
    ClaimReply,
    Done,
    EnforcedRequest,
    ErrorKind,
    ErrorReply,
    FailedRequest,
    NodeRequestError,
    PingRequest,
    PlacementsReply,
    PlacementsRequest,
    Pong,
    PreferredReply,
    PreferredRequest,
    PrepareRequest,
    UnprepareRequest,
    Verb,
    parse_reply,
)
from gpuslice_common.subjects import Subjects

log = logging.getLogger(__name__)

R = TypeVar("R", Pong, AllocationReply, ClaimReply, PreferredReply, PlacementsReply, Done)

FIRST_RETRY_S = 0.05
LAST_RETRY_S = 1.0


class InventoryGateway:
    """Requests to the inventory for this node. ``bus`` may be set later (NATS
    down at start); until then every request fails as unanswered."""

    def __init__(self, settings: DevicePluginSettings, bus: Bus | None = None) -> None:
        self.node = settings.node_name
        self.subjects = Subjects(settings.subject_prefix)
        self.bus = bus
        self.timeout = settings.inventory_timeout.total_seconds()
        self._subjects = {verb: self.subjects.node_request(self.node, verb) for verb in Verb}

    async def ping(self) -> None:
        """Raises NodeRequestError unless the inventory and its ledger answer."""
        await self._request(Verb.PING, PingRequest(), Pong, None)

    async def allocate(self, count: int, request_id: str, deadline: float) -> AllocationReply:
        """The next container asking for ``count`` GPUs, asked again until ``deadline``
        (event-loop time) while the inventory or the ledger is away."""
        request = AllocateRequest(request_id=request_id, count=count)
        return await self._request(Verb.ALLOCATE, request, AllocationReply, deadline)

    async def preferred(self, count: int) -> tuple[str, ...]:
        """The GPUs of the container ``allocate`` would hand out now; () when none waits."""
        reply = await self._request(
            Verb.PREFERRED, PreferredRequest(count=count), PreferredReply, None
        )
        return reply.devices

    async def placements(self) -> PlacementsReply:
        return await self._request(Verb.PLACEMENTS, PlacementsRequest(), PlacementsReply, None)

    async def failed(self, pod_uid: str, container: str, reason: str, deadline: float) -> None:
        """Tell the inventory a container it handed out could not be prepared."""
        request = FailedRequest(pod_uid=pod_uid, container=container, reason=reason[:1024])
        await self._request(Verb.FAILED, request, Done, deadline)

    async def enforced(self, request: EnforcedRequest, deadline: float) -> None:
        """Tell the inventory what the enforcer did, asked again until ``deadline``."""
        await self._request(Verb.ENFORCED, request, Done, deadline)

    async def prepare(self, claim: ClaimRef, deadline: float) -> ClaimReply:
        """DRA: the inventory checks and records ``claim`` and answers its grants,
        asked again until ``deadline`` while the inventory or the ledger is away
        (idempotent per claim)."""
        return await self._request(Verb.PREPARE, PrepareRequest(claim=claim), ClaimReply, deadline)

    async def unprepare(self, claim: ClaimRef, pod_uid: str | None, deadline: float) -> None:
        """DRA: release what ``prepare`` recorded for ``claim`` (prepared for the
        pod ``pod_uid``, where known), asked again until ``deadline``."""
        request = UnprepareRequest(claim=claim, pod_uid=pod_uid)
        await self._request(Verb.UNPREPARE, request, Done, deadline)

    async def _request(
        self, verb: Verb, request: Frozen, expect: type[R], deadline: float | None
    ) -> R:
        """One answer; with a deadline, transient failures are retried until it."""
        data = request.model_dump_json().encode()
        loop = asyncio.get_running_loop()
        delay = FIRST_RETRY_S
        while True:
            timeout = self.timeout
            if deadline is not None:
                timeout = min(timeout, max(deadline - loop.time(), 0.001))
            try:
                return await self._once(verb, data, expect, timeout)
            except NodeRequestError as exc:
                if deadline is None or not exc.transient or deadline - loop.time() <= delay:
                    raise
                log.info("%s: %s; asking again", verb, exc)
            await asyncio.sleep(delay)
            delay = min(2 * delay, LAST_RETRY_S)

    async def _once(self, verb: Verb, data: bytes, expect: type[R], timeout: float) -> R:
        bus = self.bus
        if bus is None:
            raise NodeRequestError("no-answer", "not connected to NATS")
        try:
            msg = await bus.nc.request(self._subjects[verb], data, timeout=timeout)
        except NoRespondersError:
            raise NodeRequestError("no-answer", "no inventory is listening") from None
        except (NatsError, OSError) as exc:  # timeouts, a closed or reconnecting connection
            raise NodeRequestError(
                "no-answer", f"the inventory did not answer: {type(exc).__name__}"
            ) from None
        reply = parse_reply(msg.data)
        if isinstance(reply, ErrorReply):
            raise NodeRequestError(reply.error, reply.message)
        if not isinstance(reply, expect):
            raise NodeRequestError(ErrorKind.INTERNAL, f"a {reply.kind} reply to {verb}")
        return reply
