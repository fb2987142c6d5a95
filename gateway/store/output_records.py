"""The outputs' records in Redis: the jobs' outputs hashes as the outputs read them, and the
output ledger's counters (what each tenant has in the output store).

The fenced decisions on outputs (stage, record) are scripts of the store itself
(:meth:`gateway.store.store.Store.output_stage`, :meth:`~gateway.store.store.Store.output_record`);
this module holds what :mod:`gateway.fencing.outputs`, :mod:`gateway.fencing.output_ledger` and
the sweeper (:mod:`gateway.fencing.outputs_sweep`) read and count:

* a job's outputs hash ``fg:{t/j}:outputs`` (``<generation>/<name>`` -> the entry's JSON) and
  what its job hash says of the fence (``fence``, ``cancelled``, ``completed``);
* the ledger, per tenant: ``fg:quota:{<tenant>}:out`` (object key -> bytes stored there),
  ``…:out_up`` (``"<object key> <upload id>"`` -> bytes reserved while that upload runs) and
  ``…:out_bytes`` (their sum), changed only by the three scripts below.

Every call maps Redis's errors in one place (:mod:`gateway.store.failures`): Redis not serving
is ``StoreUnavailable``; an error reply (a script's own) is a bug and raised as it is.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

from gateway.store.batching import Batcher
from gateway.store.failures import redis_errors
from gateway.store.keys import MARKER, JobKeys, quota_prefix
from gateway.store.router import ClusterRouter

__all__ = ["FenceState", "JobOutputs", "LedgerReply", "OutputRecords"]

# -- the ledger's scripts ----------------------------------------------------------------
# Every ledger script: KEYS[1] out (object key -> bytes stored), KEYS[2] out_up ("<key>
# <upload>" -> bytes reserved), KEYS[3] out_bytes (their sum). Each ends with _TAIL:
# ``change`` applied to the sum, no key left once nothing is charged; returns ``change``.
_TAIL = """
if change ~= 0 then redis.call('INCRBY', KEYS[3], change) end
if redis.call('HLEN', KEYS[1]) + redis.call('HLEN', KEYS[2]) == 0 then
  redis.call('DEL', KEYS[3])
end
return change
"""
# ARGV[1] object key, ARGV[2] upload id, ARGV[3] bytes, ARGV[4] byte cap, ARGV[5] object
# cap (0: none), ARGV[6] the reservation this one takes over ('"<key> <upload>"', '': none;
# a new URL for the output replacing the last one). -1: over the byte cap, -2: over the
# object cap (nothing changed); else the tenant's bytes with this reservation.
RESERVE = """
local field = ARGV[1] .. ' ' .. ARGV[2]
local amount = tonumber(ARGV[3])
local taken, old = 0, 0
if ARGV[6] ~= '' and redis.call('HEXISTS', KEYS[2], ARGV[6]) == 1 then
  taken, old = 1, tonumber(redis.call('HGET', KEYS[2], ARGV[6]))
end
local objects = tonumber(ARGV[5])
if objects > 0 and redis.call('HEXISTS', KEYS[2], field) == 0 then
  local n = redis.call('HLEN', KEYS[1]) + redis.call('HLEN', KEYS[2]) + 1 - taken
  if n - redis.call('HEXISTS', KEYS[1], ARGV[1]) > objects then return -2 end
end
local total = tonumber(redis.call('GET', KEYS[3]) or '0') + amount - old
local cap = tonumber(ARGV[4])
if cap > 0 and amount > old and total > cap then return -1 end
if taken == 1 then redis.call('HDEL', KEYS[2], ARGV[6]) end
redis.call('HINCRBY', KEYS[2], field, amount)
redis.call('INCRBY', KEYS[3], amount - old)
return total
"""
# ARGV[1] object key, ARGV[2] upload id, ARGV[3] the object's size ('': nothing stored).
# The upload's reservation is given back; stored, the key holds its size (what it held
# before is given back: the object was replaced).
SETTLE = (
    """
local field = ARGV[1] .. ' ' .. ARGV[2]
local change = -tonumber(redis.call('HGET', KEYS[2], field) or '0')
redis.call('HDEL', KEYS[2], field)
if ARGV[3] ~= '' then
  change = change + tonumber(ARGV[3]) - tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0')
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
end
"""
    + _TAIL
)
# ARGV: triples (op, field, value): 'o' drop out's field if it holds value; 'u' drop out_up's
# field if it holds value; 's' charge the object key field at value if it is not charged;
# 'O' drop out's field, 'U' drop out_up's field, whatever they hold (deleted objects).
FIX = (
    """
local change = 0
for i = 1, #ARGV, 3 do
  local op, field, value = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  local h = (op == 'o' or op == 'O' or op == 's') and KEYS[1] or KEYS[2]
  local held = redis.call('HGET', h, field)
  if op == 's' then
    if not held then
      redis.call('HSET', h, field, value)
      change = change + tonumber(value)
    end
  elseif held and (op == 'O' or op == 'U' or held == value) then
    redis.call('HDEL', h, field)
    change = change - tonumber(held)
  end
end
"""
    + _TAIL
)
_SHAS = {
    source: hashlib.sha1(source.encode(), usedforsecurity=False).hexdigest()
    for source in (RESERVE, SETTLE, FIX)
}


class LedgerReply(IntEnum):
    """:data:`RESERVE`'s refusals (any other reply: the tenant's bytes with the reservation)."""

    OVER_BYTES = -1
    OVER_OBJECTS = -2


@dataclass(frozen=True, slots=True)
class FenceState:
    """What a job hash says of the fence: its value (None: no fence), cancelled, completed
    (the completion's JSON, '' when not completed)."""

    fence: int | None
    cancelled: bool
    completed: str


@dataclass(frozen=True, slots=True)
class JobOutputs:
    """One job as the sweeper reads it, in one round trip: whether its slot's durability
    marker is there, its fence, and its outputs hash (field -> the entry's JSON)."""

    marker: bool
    fence: FenceState
    entries: dict[str, str]


def _fence(fence: str | None, cancelled: str | None, completed: str | None) -> FenceState:
    return FenceState(None if fence is None else int(fence), cancelled == "1", completed or "")


class OutputRecords:
    """The outputs hashes and the output ledger (module docstring), on the gateway's client
    (reads) and auto-pipeline (the ledger's scripts)."""

    def __init__(self, client: Any, batcher: Batcher | ClusterRouter) -> None:
        self._client = client
        self._batcher = batcher

    # -- a job's outputs -------------------------------------------------------------

    async def entries(self, keys: JobKeys) -> dict[str, str]:
        """The job's outputs hash (``<generation>/<name>`` -> the entry's JSON)."""
        with redis_errors():
            raw: dict[str, str] = await self._client.hgetall(keys.outputs)
        return raw

    async def entry(self, keys: JobKeys, field: str) -> str | None:
        """One entry's JSON (``field``: ``<generation>/<name>``); None: there is none."""
        with redis_errors():
            raw: str | None = await self._client.hget(keys.outputs, field)
        return raw

    async def entries_of(self, tenant: str, asked: Sequence[tuple[str, str]]) -> list[str | None]:
        """The entries ``(job, field)`` of the tenant's jobs, in one round trip."""
        with redis_errors():
            async with self._client.pipeline(transaction=False) as pipe:
                for job, field in asked:
                    pipe.hget(JobKeys(tenant, job).outputs, field)
                found: list[str | None] = await pipe.execute()
        return found

    async def fence(self, keys: JobKeys) -> FenceState:
        """The job's fence, cancel flag and completion."""
        with redis_errors():
            fence, cancelled, completed = await self._client.hmget(
                keys.job, "fence", "cancelled", "completed"
            )
        return _fence(fence, cancelled, completed)

    async def completion(self, keys: JobKeys) -> str | None:
        """The job's completion (its JSON); None before it completed."""
        with redis_errors():
            raw: str | None = await self._client.hget(keys.job, "completed")
        return raw

    async def job(self, keys: JobKeys) -> JobOutputs:
        """The job as the sweeper judges its objects (:class:`JobOutputs`)."""
        with redis_errors():
            pipe = self._client.pipeline(transaction=False)
            pipe.exists(keys.marker)
            pipe.hmget(keys.job, "fence", "cancelled", "completed")
            pipe.hgetall(keys.outputs)
            marker, (fence, cancelled, completed), raw = await pipe.execute()
        return JobOutputs(bool(marker), _fence(fence, cancelled, completed), dict(raw))

    async def initialised(self) -> bool:
        """Whether Redis holds fencegate's durability marker (``fencegate init`` ran)."""
        with redis_errors():
            return bool(await self._client.exists(MARKER))

    # -- the output ledger -----------------------------------------------------------

    @staticmethod
    def ledger_keys(tenant: str) -> list[str]:
        p = quota_prefix(tenant)
        return [f"{p}:out", f"{p}:out_up", f"{p}:out_bytes"]

    async def _ledger(self, source: str, tenant: str, args: Sequence[Any]) -> int:
        with redis_errors():
            reply = await self._batcher.evalsha(
                _SHAS[source], source, self.ledger_keys(tenant), [str(a) for a in args]
            )
        return int(reply)

    async def reserve(
        self,
        tenant: str,
        *,
        key: str,
        upload: str,
        amount: int,
        byte_cap: int,
        object_cap: int,
        replaces: str,
    ) -> int:
        """:data:`RESERVE`: a :class:`LedgerReply` refusal, else the tenant's bytes with it."""
        return await self._ledger(
            RESERVE,
            tenant,
            (
                key,
                upload,
                amount,
                byte_cap,
                object_cap,
                f"{key} {replaces}" if replaces else "",
            ),
        )

    async def settle(self, tenant: str, *, key: str, upload: str, size: int | None) -> None:
        """:data:`SETTLE`: ``upload`` ended with ``size`` bytes at ``key`` (None: nothing)."""
        await self._ledger(SETTLE, tenant, (key, upload, "" if size is None else size))

    async def fix(self, tenant: str, ops: Sequence[str]) -> int:
        """:data:`FIX`: the ``(op, field, value)`` triples, flat; the bytes' change."""
        return await self._ledger(FIX, tenant, ops)

    async def charges(self, tenant: str) -> tuple[dict[str, str], dict[str, str]]:
        """The ledger's two hashes: (object key -> bytes, ``"<key> <upload>"`` -> reserved)."""
        out_key, up_key, _ = self.ledger_keys(tenant)
        with redis_errors():
            async with self._client.pipeline(transaction=False) as pipe:
                pipe.hgetall(out_key)
                pipe.hgetall(up_key)
                charged, reserved = await pipe.execute()
        return dict(charged), dict(reserved)
