"""A lease in Redis: among the inventory's replicas, one runs the periodic jobs.

``SET key token NX PX ttl`` takes a free lease; the holder renews it with a
compare-and-expire script well before it runs out, so a replica that dies or
stalls loses it within ``ttl`` and another takes over. Every check of
:meth:`Lease.held` is against Redis's own clock through the renewal, never a
local guess, so two replicas never both believe they hold it for longer than
one renewal interval.
"""

from __future__ import annotations

import logging
import secrets

from redis.exceptions import RedisError

from gpuslice_common.ledger import RedisClient

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
        self.held = False
        self._renew = redis.register_script(_RENEW)
        self._release = redis.register_script(_RELEASE)

    async def acquire(self) -> bool:
        """Take the lease if it is free, or renew it if it is ours; True while held.

        A Redis that cannot be reached means the lease is not held.
        """
        try:
            if self.held and await self._renew(keys=[self.key], args=[self.token, self.ttl_ms]):
                return True
            taken = await self.redis.set(self.key, self.token, nx=True, px=self.ttl_ms)
        except RedisError as exc:
            if self.held:
                log.warning("lost the lease %s: %s", self.key, exc)
            self.held = False
            return False
        if taken and not self.held:
            log.info("took the lease %s", self.key)
        self.held = bool(taken)
        return self.held

    async def release(self) -> None:
        """Give the lease up (if still ours), so another replica need not wait for it."""
        if not self.held:
            return
        self.held = False
        try:
            await self._release(keys=[self.key], args=[self.token])
        except RedisError as exc:
            log.warning("could not give the lease %s back: %s", self.key, exc)
