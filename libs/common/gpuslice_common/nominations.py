"""Nominations: the room a preempting pod holds on a node while its victims end.

When the scheduler evicts pods of lower priority to make room for a pod, that
pod is *nominated* to the node: until it binds (or the nomination expires),
pods of lower or equal priority are not placed into the room, and no second
set of victims is chosen for it. Every extender replica reads and writes the
same nominations, one Redis hash ``<p>:nominations`` (pod UID -> record): one
key, so it works unchanged on Redis Cluster, and the claim is one script
(``lua/nominate.lua``), atomic:

* a pod with a live nomination made by another call keeps it (``held``): a
  retried filter, on this replica or another, never evicts a second set;
* a claim on a node where a live nomination appeared that the caller did not
  count is refused (``changed``): it chose its victims without that room held,
  and chooses again;
* expired nominations are removed on the way (by the Redis server's clock).

A record holds the pod, its priority, the node, the placement it would take
there (its cards, as the engine chose them with the victims gone) and the
victims' UIDs.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import resources
from typing import Any

import orjson
from pydantic import ValidationError
from redis.exceptions import RedisError

from gpuslice_common.ledger import Ledger, LedgerUnavailable
from gpuslice_common.models import Placement

MAX_VICTIMS = 256  # more UIDs in one record are refused (no filter call picks so many)


class NominationError(ValueError):
    """A stored nomination that cannot be read; the message says what."""


@dataclass(frozen=True)
class Nomination:
    """A preempting pod's claim on a node's room."""

    placement: Placement  # the pod, the node, the cards it would take
    priority: int
    victims: tuple[str, ...]  # UIDs of the pods evicted for it
    expires: datetime  # by the Redis server's clock
    token: str = ""  # the call that made it

    @property
    def uid(self) -> str:
        return self.placement.pod.uid

    @property
    def node(self) -> str:
        return self.placement.node

    def record(self) -> str:
        return orjson.dumps(
            {
                "placement": orjson.Fragment(self.placement.to_annotation()),
                "priority": self.priority,
                "victims": list(self.victims),
            }
        ).decode()

    @classmethod
    def parse(cls, uid: str, value: str) -> Nomination:
        """A stored value ``<expires ms>|<node>|<token>|<record>``; raises NominationError."""
        parts = value.split("|", 3)
        if len(parts) != 4 or not parts[0].isdigit():
            raise NominationError(f"nomination of {uid!r:.80}: not <expires>|<node>|<token>|…")
        try:
            record = orjson.loads(parts[3])
            placement = Placement.from_annotation(orjson.dumps(record["placement"]).decode())
            priority, victims = record["priority"], record["victims"]
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, ValidationError) as exc:
            first = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
            raise NominationError(f"nomination of {uid!r:.80}: {first}") from None
        if (
            placement.pod.uid != uid
            or placement.node != parts[1]
            or not isinstance(priority, int)
            or not isinstance(victims, list)
            or len(victims) > MAX_VICTIMS
            or not all(isinstance(v, str) for v in victims)
        ):
            raise NominationError(f"nomination of {uid!r:.80}: a record no gpuslice writes")
        expires = datetime.fromtimestamp(int(parts[0]) / 1000, UTC)
        return cls(placement, priority, tuple(victims), expires, parts[2])


@dataclass(frozen=True)
class Claim:
    """What a claim came to: ``ok`` (stored), ``held`` (``nomination`` is the
    pod's live one, made by another call), ``changed`` (choose again)."""

    outcome: str
    nomination: Nomination | None = None


def _script() -> str:
    return (resources.files("gpuslice_common") / "lua" / "nominate.lua").read_text()


class Nominations:
    """The nominations in the ledger's Redis."""

    def __init__(self, ledger: Ledger) -> None:
        self.redis = ledger.redis
        self.key = f"{ledger.prefix}:nominations"
        self._claim = self.redis.register_script(_script())

    @staticmethod
    def new_token() -> str:
        return secrets.token_hex(8)

    async def live(self) -> tuple[list[Nomination], list[str]]:
        """Every nomination not expired, and a line for each that cannot be read
        (left out, as if absent). The expiry was set by the Redis server's clock
        and is read against this host's: hosts kept in time (NTP) differ by far
        less than a nomination lasts."""
        try:
            raw = await self.redis.hgetall(self.key)
        except (RedisError, OSError) as exc:
            raise LedgerUnavailable(f"cannot read the nominations: {exc}") from None
        now = datetime.now(UTC)
        found, problems = [], []
        for uid, value in raw.items():
            try:
                nomination = Nomination.parse(_text(uid), _text(value))
            except NominationError as exc:
                problems.append(str(exc))
                continue
            if nomination.expires > now:
                found.append(nomination)
        return found, problems

    async def get(self, uid: str) -> Nomination | None:
        """The pod's nomination if it is live."""
        live, _ = await self.live()
        return next((n for n in live if n.uid == uid), None)

    async def claim(
        self,
        placement: Placement,
        priority: int,
        victims: Iterable[str],
        ttl_s: float,
        counted: Iterable[str],
        token: str,
    ) -> Claim:
        """Nominate ``placement``'s pod to its node for ``ttl_s`` seconds, unless it
        holds a live nomination made by another call, or a live nomination on the
        node appeared that is not among ``counted`` (UIDs)."""
        pending = Nomination(placement, priority, tuple(victims), datetime.now(UTC), token)
        try:
            answer = await self._claim(
                keys=[self.key],
                args=[
                    pending.uid,
                    pending.node,
                    token,
                    max(1, int(ttl_s * 1000)),
                    pending.record(),
                    ",".join(counted),
                ],
            )
        except (RedisError, OSError) as exc:
            raise LedgerUnavailable(f"cannot store the nomination: {exc}") from None
        outcome, value = _text(answer[0]), _text(answer[1])
        if outcome == "held":
            return Claim("held", Nomination.parse(pending.uid, value))
        return Claim(outcome)

    async def drop(self, uids: Iterable[str]) -> None:
        """Remove these pods' nominations (bound, or a preemption that did not happen)."""
        names = list(uids)
        if not names:
            return
        try:
            await self.redis.hdel(self.key, *names)
        except (RedisError, OSError) as exc:
            raise LedgerUnavailable(f"cannot remove nominations: {exc}") from None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
