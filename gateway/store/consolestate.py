"""What the console keeps in Redis so that every process and host agrees: logged-out
sessions and failed-login counters.

* A logout writes ``fg:con:rv:<session id>`` with a TTL of what was left of the cookie's
  life; every console request whose cookie verifies reads it (one ``EXISTS``), so a revoked
  cookie and its CSRF token stop working at once on every process of every host that shares
  this Redis.
* Failed logins are counted in fixed windows, per peer and for every peer together
  (``fg:con:lf:<peer>``, ``fg:con:lf``); a peer over its limit, or everyone over the total,
  waits for the window to end (the TTL of the counter is the ``Retry-After``).

Both are single-key commands (they run unchanged on Redis Cluster). Redis not answering is
``StoreUnavailable`` (:mod:`gateway.store.failures`): the caller fails closed (the console
answers 503).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.store.failures import redis_errors
from gateway.store.keys import console_failures, console_revoked

__all__ = ["ConsoleState", "Failures"]


@dataclass(frozen=True, slots=True)
class Failures:
    """The failed-login counts of the current window after one more failure."""

    peer: int
    total: int


class ConsoleState:
    """Revocations and login throttling for the console, on the gateway's Redis client."""

    def __init__(self, client: Any, *, window_seconds: int) -> None:
        self._client = client
        self.window = window_seconds

    async def revoke(self, session_id: str, ttl_seconds: int) -> None:
        if ttl_seconds > 0:
            with redis_errors():
                await self._client.set(console_revoked(session_id), "1", ex=ttl_seconds)

    async def revoked(self, session_id: str) -> bool:
        with redis_errors():
            return bool(await self._client.exists(console_revoked(session_id)))

    async def wait_seconds(self, peer: str, *, per_peer: int, total: int) -> int:
        """0 when ``peer`` may try a login now; else how long until its window ends."""
        pipe = self._client.pipeline(transaction=False)
        for key in (console_failures(peer), console_failures(None)):
            pipe.get(key)
            pipe.ttl(key)
        with redis_errors():
            peer_n, peer_ttl, all_n, all_ttl = await pipe.execute()
        wait = 0
        if per_peer and int(peer_n or 0) >= per_peer:
            wait = max(wait, int(peer_ttl), 1)
        if total and int(all_n or 0) >= total:
            wait = max(wait, int(all_ttl), 1)
        return wait

    async def failed(self, peer: str) -> Failures:
        """Count one failed login of ``peer`` (each counter starts its window at its first
        failure: SET NX EX, then INCR, which keeps the TTL)."""
        pipe = self._client.pipeline(transaction=False)
        keys = (console_failures(peer), console_failures(None))
        for key in keys:
            pipe.set(key, 0, ex=self.window, nx=True)
            pipe.incr(key)
            pipe.ttl(key)
        with redis_errors():
            _, peer_n, peer_ttl, _, all_n, all_ttl = await pipe.execute()
            for key, ttl in zip(keys, (peer_ttl, all_ttl), strict=True):
                if int(ttl) < 0:  # the counter expired between SET and INCR: give it its window
                    await self._client.expire(key, self.window)
        return Failures(int(peer_n), int(all_n))
