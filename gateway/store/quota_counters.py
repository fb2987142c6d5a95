"""The tenants' quota counters in Redis: what :mod:`gateway.fencing.quotas` counts, and how.

The keys (all in the tenant's slot, ``fg:quota:{<tenant>}``, so nothing crosses a slot on
Redis Cluster; :func:`gateway.store.keys.quota_prefix`):

* ``…:fx:<window>``, ``…:rj:<window>`` — effect calls and rejections of a fixed window
  (``INCR``; a TTL of the window plus a minute, sent with the first charge of the window);
* ``…:held`` (``[job, step]`` -> charge) and ``…:held_bytes`` — async payloads held for the
  relay;
* ``…:ckpt`` (job -> the charge of its checkpoints) and ``…:ckpt_bytes`` — checkpoints.

(The output store's counters are :mod:`gateway.store.output_records`'.) Every call goes
through the store's auto-pipeline, pipelined with the tick's scripts: no round trip of its
own. The four scripts below are the only check-and-set of these counters; their error
replies are bugs (raised), Redis not serving is ``StoreUnavailable``
(:mod:`gateway.store.failures`).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Sequence
from typing import Any, Literal

from gateway.store.batching import Batcher
from gateway.store.failures import redis_errors
from gateway.store.keys import JobKeys, audit_feed, quota_prefix
from gateway.store.router import ClusterRouter

__all__ = ["Pool", "QuotaCounters", "Window", "held_member"]

Pool = Literal["held", "ckpt"]  # payloads held for the relay, checkpoints
Window = Literal["fx", "rj"]  # effect calls, rejections

# KEYS[1] counter; ARGV[1] amount, ARGV[2] cap (0: none), ARGV[3] ttl seconds.
# -1: over the cap (nothing changed); else the counter with this amount.
RESERVE = """
local total = redis.call('INCRBY', KEYS[1], ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[3])
local cap = tonumber(ARGV[2])
if cap > 0 and total > cap then
  redis.call('INCRBY', KEYS[1], -tonumber(ARGV[1]))
  return -1
end
return total
"""
# KEYS[1] held hash, KEYS[2] held_bytes; ARGV[1] member, ARGV[2] charge, ARGV[3] '1': stored,
# ARGV[4] ttl. Stored: the member now holds this charge (an earlier charge of it is given
# back); not stored: the reservation is given back.
SETTLE = """
if ARGV[3] == '1' then
  local old = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0')
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
  if old > 0 then redis.call('INCRBY', KEYS[2], -old) end
else
  redis.call('INCRBY', KEYS[2], -tonumber(ARGV[2]))
end
redis.call('EXPIRE', KEYS[1], ARGV[4])
redis.call('EXPIRE', KEYS[2], ARGV[4])
return 1
"""
# KEYS[1] the checkpoint charges per job, KEYS[2] ckpt_bytes; ARGV[1] job, ARGV[2] reserved,
# ARGV[3] what the write stored (its charge minus the one it replaced; 0: nothing), ARGV[4]
# ttl. The reservation becomes what was stored; the job's entry holds its checkpoints' charge.
SETTLE_CHECKPOINT = """
local stored = tonumber(ARGV[3])
local change = stored - tonumber(ARGV[2])
if change ~= 0 and redis.call('INCRBY', KEYS[2], change) <= 0 then
  redis.call('DEL', KEYS[2])  -- nothing stored, nothing reserved: no key left behind
end
if stored ~= 0 and redis.call('HINCRBY', KEYS[1], ARGV[1], stored) <= 0 then
  redis.call('HDEL', KEYS[1], ARGV[1])
end
redis.call('EXPIRE', KEYS[1], ARGV[4])
redis.call('EXPIRE', KEYS[2], ARGV[4])
return 1
"""
# KEYS[1] held hash, KEYS[2] held_bytes; ARGV: member, charge pairs whose thing is gone.
# Each is dropped only while it still holds that charge; returns the bytes given back.
DROP = """
local freed = 0
for i = 1, #ARGV, 2 do
  if redis.call('HGET', KEYS[1], ARGV[i]) == ARGV[i + 1] then
    redis.call('HDEL', KEYS[1], ARGV[i])
    freed = freed + tonumber(ARGV[i + 1])
  end
end
if freed > 0 then redis.call('INCRBY', KEYS[2], -freed) end
return freed
"""
OVER_CAP = -1  # RESERVE's reply when the amount does not fit


def _sha(source: str) -> str:
    return hashlib.sha1(source.encode(), usedforsecurity=False).hexdigest()


_SHAS = {source: _sha(source) for source in (RESERVE, SETTLE, SETTLE_CHECKPOINT, DROP)}


def held_member(job_id: str, step: str) -> str:
    """A held payload's field: ``[job, step]`` (the tenant is in the key)."""
    return json.dumps([job_id, step], separators=(",", ":"))


class QuotaCounters:
    """The quota counters of every tenant (module docstring), through ``batcher``; ``client``
    for the reconciliation's reads (a hash read whole, then its entries checked)."""

    def __init__(
        self,
        client: Any,
        batcher: Batcher | ClusterRouter,
        *,
        retention_seconds: int,
        window_ttl_seconds: int,
    ) -> None:
        self._client = client
        self._batcher = batcher
        self._ttl = str(retention_seconds)
        self._retention_ms = retention_seconds * 1000
        self._window_ttl = str(window_ttl_seconds)

    def _eval(self, source: str, keys: Sequence[str], args: Sequence[Any]) -> asyncio.Future[Any]:
        return self._batcher.evalsha(_SHAS[source], source, keys, [str(a) for a in args])

    async def _int(self, source: str, keys: Sequence[str], args: Sequence[Any]) -> int:
        with redis_errors():
            return int(await self._eval(source, keys, args))

    # -- counters per window ---------------------------------------------------------

    @staticmethod
    def window_key(tenant: str, kind: Window, index: int) -> str:
        return f"{quota_prefix(tenant)}:{kind}:{index}"

    async def count(self, tenant: str, kind: Window, index: int) -> int:
        """The window's counter as Redis holds it now (0: none)."""
        with redis_errors():
            value = await self._batcher.execute("GET", self.window_key(tenant, kind, index))
        return int(value or 0)

    def charge(self, tenant: str, kind: Window, index: int) -> asyncio.Future[Any]:
        """Count one call in the window (queued in this tick's pipeline, not waited for): a
        future of the counter after it (its failure is the caller's to log)."""
        return self._batcher.execute("INCR", self.window_key(tenant, kind, index))

    def expire(self, tenant: str, kind: Window, index: int) -> asyncio.Future[Any]:
        """The window counter's TTL (the window plus a minute), queued like :meth:`charge`."""
        return self._batcher.execute(
            "EXPIRE", self.window_key(tenant, kind, index), self._window_ttl
        )

    # -- stored bytes: payloads held for the relay, checkpoints ----------------------

    async def reserve(self, tenant: str, pool: Pool, amount: int, cap: int) -> bool:
        """Reserve ``amount`` bytes of ``pool``; False (nothing reserved) over ``cap``."""
        counter = f"{quota_prefix(tenant)}:{pool}_bytes"
        return await self._int(RESERVE, [counter], [amount, cap, self._ttl]) != OVER_CAP

    async def settle_payload(self, keys: JobKeys, step: str, charge: int, *, stored: bool) -> None:
        """A payload reservation after the decision: ``stored`` (queued) the step holds
        ``charge``, else it is given back."""
        p = quota_prefix(keys.tenant)
        args = [held_member(keys.job_id, step), charge, "1" if stored else "0", self._ttl]
        await self._int(SETTLE, [f"{p}:held", f"{p}:held_bytes"], args)

    def settle_checkpoint(self, keys: JobKeys, reserved: int, stored: int) -> asyncio.Future[Any]:
        """A checkpoint reservation after the write stored ``stored`` bytes more (queued in
        this tick's pipeline, not waited for: a future whose failure is the caller's to log)."""
        p = quota_prefix(keys.tenant)
        args = [keys.job_id, reserved, stored, self._ttl]
        return self._eval(SETTLE_CHECKPOINT, [f"{p}:ckpt", f"{p}:ckpt_bytes"], args)

    async def drop_gone(self, tenant: str, pool: Pool) -> int:
        """Give back the entries of ``pool`` whose thing left Redis (a held payload whose
        effect has no payload any more; a job whose checkpoints expired): the bytes freed.
        An entry changed meanwhile keeps its charge (:data:`DROP`)."""
        p = quota_prefix(tenant)
        with redis_errors():
            held: dict[str, str] = await self._client.hgetall(f"{p}:{pool}")
            gone: list[str] = []
            items = list(held.items())
            for i in range(0, len(items), 1000):
                chunk = items[i : i + 1000]
                async with self._client.pipeline(transaction=False) as pipe:
                    for member, _ in chunk:
                        if pool == "held":
                            job, step = json.loads(member)
                            pipe.hget(JobKeys(tenant, job).effect(step), "payload_sha")
                        else:
                            pipe.exists(JobKeys(tenant, member).ckpt)
                    found = await pipe.execute()
                for (member, charge), there in zip(chunk, found, strict=True):
                    if not there:
                        gone += [member, charge]
        freed = 0
        for i in range(0, len(gone), 2000):
            freed += await self._int(DROP, [f"{p}:{pool}", f"{p}:{pool}_bytes"], gone[i : i + 2000])
        return freed

    # -- the tenant's audit feed -------------------------------------------------------

    async def note(self, tenant: str, fields: dict[str, str], *, at_ms: int) -> None:
        """A quota entry in the tenant's audit feed (trimmed by the retention)."""
        with redis_errors():
            await self._client.xadd(
                audit_feed(tenant),
                fields,
                minid=f"{at_ms - self._retention_ms}-0",
                approximate=True,
            )
