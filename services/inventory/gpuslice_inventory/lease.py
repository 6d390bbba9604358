"""A lease in Redis: among the inventory's replicas, one runs the periodic jobs.

``SET key token NX PX ttl`` takes a free lease; :meth:`Lease.run` renews it
with a compare-and-expire script every third of ``ttl``, in a task of its own,
so no job, however long, delays a renewal. A replica that dies or stalls loses
it within ``ttl`` and another takes over. :attr:`Lease.held` is true only until
a safety margin before the lease could have run out since the start of the last
successful renewal (measured on this machine's monotonic clock, which runs at
the rate of Redis's), so a holder that cannot renew stops acting as one before
another replica can take over.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time

from redis.exceptions import RedisError

from gpuslice_common.ledger import RedisClient
from gpuslice_common.service import check_cancelled

log = logging.getLogger(__name__)

# Extend the lease only if it is still ours.
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


class Lease:
    """One named lease; :meth:`acquire` takes or renews it."""

    def __init__(self, redis: RedisClient, key: str, ttl_ms: int, holder: str = "") -> None:
        if ttl_ms < 100:
            raise ValueError("a lease must last at least 100 ms")
        self.redis = redis
        self.key = key
        self.ttl_ms = ttl_ms
        self.token = f"{holder or 'replica'}:{secrets.token_hex(8)}"
        self._ours = False  # as the last answer from Redis said
        self._valid_until = 0.0  # monotonic
        self._renew = redis.register_script(_RENEW)
        self._release = redis.register_script(_RELEASE)

    @property
    def held(self) -> bool:
        return self._ours and time.monotonic() < self._valid_until

    async def acquire(self) -> bool:
        """Take the lease if it is free, or renew it if it is ours; True while held.

        A Redis that cannot be reached means the lease is not held.
        """
        asked = time.monotonic()
        try:
            renewed = self._ours and await self._renew(
                keys=[self.key], args=[self.token, self.ttl_ms]
            )
            taken = renewed or await self.redis.set(self.key, self.token, nx=True, px=self.ttl_ms)
        except RedisError as exc:
            if self._ours:
                log.warning("lost the lease %s: %s", self.key, exc)
            self._ours = False
            return False
        if taken and not self._ours:
            log.info("took the lease %s", self.key)
        elif self._ours and not taken:
            log.warning("lost the lease %s: another replica holds it", self.key)
        self._ours = bool(taken)
        # a fifth of the TTL spare for the renewal's own round trip and clock drift
        self._valid_until = asked + self.ttl_ms / 1000 * 0.8
        return self.held

    async def run(self) -> None:
        """Take or renew the lease every third of its TTL, until cancelled."""
        while True:
            await self.acquire()
            check_cancelled()
            await asyncio.sleep(self.ttl_ms / 3000)

    async def release(self) -> None:
        """Give the lease up (if still ours), so another replica need not wait for it."""
        if not self._ours:
            return
        self._ours = False
        try:
            await self._release(keys=[self.key], args=[self.token])
        except RedisError as exc:
            log.warning("could not give the lease %s back: %s", self.key, exc)
