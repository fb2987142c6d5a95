"""Per-tenant quotas: a guard in front of the fence, not the fence.

Two caps per tenant (``[quotas]``, overridable per tenant in ``[quotas.tenants.<name>]``),
counted in per-tenant keys outside the deciding scripts (which stay one slot per job):

* **effects per window** — effect calls that reach a decision (admitted, queued or
  rejected; replays and "in progress" answers are given back) in a fixed window of
  ``window_seconds``: ``fg:quota:{<tenant>}:fx:<window>``, expiring with the window.
* **stored payload bytes** — async payloads held in Redis for the relay, each charged its
  size plus 1 KiB: ``fg:quota:{<tenant>}:held`` (``[job, step]`` -> charge) and its sum
  ``fg:quota:{<tenant>}:held_bytes``. A payload leaves Redis when its outcome is recorded
  (by the relay, or a synchronous call that takes the step over); the gateway does not
  hook every such place: when a tenant reaches its cap, the held entries whose payload is
  gone are given back (at most once a second per tenant), then the call is tried again.

Over a cap: ``429 quota_exceeded`` with ``Retry-After`` (the window's end; for payloads,
``retry_after_seconds``), nothing stored, nothing sent; audited in the tenant's audit feed
(``reason = quota_exceeded``), at most one entry per tenant and cap per second (a flood
is summarised by a ``suppressed`` count in the next entry).
"""

from __future__ import annotations

import json
import time
from typing import Any

import redis.asyncio as aioredis
import structlog
from redis.exceptions import RedisError

from gateway.core.errors import QuotaExceeded, Rejection, StoreUnavailable
from gateway.core.records import AdmitVerdict, InProgress, Queued, Replay, Unknown
from gateway.fencing.service import EffectService
from gateway.runtime.settings import QuotaSettings
from gateway.store.keys import JobKeys, audit_feed

__all__ = ["PAYLOAD_OVERHEAD", "QuotaedService", "Quotas"]

log = structlog.get_logger("fencegate.quotas")

PAYLOAD_OVERHEAD = 1024  # the effect hash fields, the queue entry, the hint around a payload

# KEYS[1] counter; ARGV[1] amount, ARGV[2] cap (0: none), ARGV[3] ttl seconds
_RESERVE = """
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
_SETTLE = """
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
# KEYS[1] held hash, KEYS[2] held_bytes; ARGV: member, charge pairs whose payload is gone
_DROP = """
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


def _member(keys: JobKeys, step: str) -> str:
    """A held payload's field: [job, step] (the tenant is in the key)."""
    return json.dumps([keys.job_id, step], separators=(",", ":"))


def _prefix(tenant: str) -> str:
    return "fg:quota:{" + tenant + "}"


class Quotas:
    def __init__(
        self, client: aioredis.Redis, settings: QuotaSettings, *, retention_seconds: int
    ) -> None:
        self._client = client
        self._settings = settings
        self._ttl = str(retention_seconds)
        self._reserve = client.register_script(_RESERVE)
        self._settle = client.register_script(_SETTLE)
        self._drop = client.register_script(_DROP)
        self._reconciled: dict[str, float] = {}
        self._audited: dict[tuple[str, str], tuple[float, int]] = {}

    def caps(self, tenant: str) -> tuple[int, int]:
        """(effects per window, payload bytes) of a tenant; 0 is no cap."""
        own = self._settings.tenants.get(tenant)
        effects, payload = self._settings.effects_per_window, self._settings.payload_bytes
        if own is not None:
            effects = effects if own.effects_per_window is None else own.effects_per_window
            payload = payload if own.payload_bytes is None else own.payload_bytes
        return effects, payload

    async def _call(self, script: Any, keys: list[str], args: list[Any]) -> int:
        try:
            return int(await script(keys=keys, args=args))
        except (RedisError, OSError) as exc:
            raise StoreUnavailable(f"Redis did not answer the quota check: {exc}") from exc

    # -- effects per window ---------------------------------------------------

    def _window(self) -> tuple[int, int]:
        """(this window's index, seconds until it ends)."""
        size = self._settings.window_seconds
        now = time.time()
        return int(now // size), max(1, int(size - now % size + 0.999))

    async def take_effect(self, keys: JobKeys, step: str, **who: str) -> str | None:
        """Count one effect call; raise QuotaExceeded over the cap. Returns the key to give
        the call back to (``give_back``), None when there is no cap."""
        cap, _ = self.caps(keys.tenant)
        if not cap:
            return None
        index, left = self._window()
        key = f"{_prefix(keys.tenant)}:fx:{index}"
        ttl = str(self._settings.window_seconds + 60)
        if await self._call(self._reserve, [key], [1, cap, ttl]) < 0:
            await self.audit(keys, step, "effects_per_window", **who)
            raise QuotaExceeded(
                f"tenant {keys.tenant!r} used its {cap} effect calls of this "
                f"{self._settings.window_seconds} s window",
                retry_after=left,
                quota="effects_per_window",
                limit=cap,
            )
        return key

    async def give_back(self, key: str | None) -> None:
        if key is not None:
            try:
                await self._client.incrby(key, -1)
            except (RedisError, OSError):
                log.warning("quota_give_back_failed", key=key)

    # -- stored payload bytes -------------------------------------------------

    async def reserve_payload(self, keys: JobKeys, step: str, size: int, **who: str) -> int:
        """Reserve a payload's charge; 0 when there is no cap (nothing to settle)."""
        _, cap = self.caps(keys.tenant)
        if not cap:
            return 0
        charge = size + PAYLOAD_OVERHEAD
        counter = f"{_prefix(keys.tenant)}:held_bytes"
        for attempt in (0, 1):
            if await self._call(self._reserve, [counter], [charge, cap, self._ttl]) >= 0:
                return charge
            if attempt == 0 and not await self.reconcile(keys.tenant):
                break
        await self.audit(keys, step, "payload_bytes", **who)
        raise QuotaExceeded(
            f"tenant {keys.tenant!r} has {cap} bytes of async payloads stored for the relay; "
            "they are freed as the relay delivers them",
            retry_after=self._settings.retry_after_seconds,
            quota="payload_bytes",
            limit=cap,
        )

    async def settle_payload(self, keys: JobKeys, step: str, charge: int, stored: bool) -> None:
        if not charge:
            return
        p = _prefix(keys.tenant)
        args = [_member(keys, step), charge, "1" if stored else "0", self._ttl]
        try:
            await self._call(self._settle, [f"{p}:held", f"{p}:held_bytes"], args)
        except StoreUnavailable:
            log.warning("quota_settle_failed", job_id=keys.job_id, step=step)

    async def reconcile(self, tenant: str) -> int:
        """Give back the charges of held payloads that left Redis; returns bytes freed (at
        most once a second per tenant: 0 when skipped)."""
        now = time.monotonic()
        if now - self._reconciled.get(tenant, 0.0) < 1.0:
            return 0
        self._reconciled[tenant] = now
        p = _prefix(tenant)
        try:
            held: dict[str, str] = await self._client.hgetall(f"{p}:held")  # type: ignore[assignment]
            gone: list[str] = []
            items = list(held.items())
            for i in range(0, len(items), 1000):
                chunk = items[i : i + 1000]
                async with self._client.pipeline(transaction=False) as pipe:
                    for member, _ in chunk:
                        job, step = json.loads(member)
                        pipe.hget(JobKeys(tenant, job).effect(step), "payload_sha")
                    found = await pipe.execute()
                for (member, charge), sha in zip(chunk, found, strict=True):
                    if sha is None:
                        gone += [member, charge]
            if not gone:
                return 0
            freed = 0
            for i in range(0, len(gone), 2000):
                keys = [f"{p}:held", f"{p}:held_bytes"]
                freed += await self._call(self._drop, keys, gone[i : i + 2000])
            return freed
        except (RedisError, OSError):
            log.warning("quota_reconcile_failed", tenant=tenant)
            return 0

    # -- audit -----------------------------------------------------------------

    async def audit(self, keys: JobKeys, step: str, quota: str, **who: str) -> None:
        """One entry per tenant and quota per second in the tenant's audit feed."""
        now = time.monotonic()
        last, suppressed = self._audited.get((keys.tenant, quota), (0.0, 0))
        if now - last < 1.0:
            self._audited[(keys.tenant, quota)] = (last, suppressed + 1)
            return
        self._audited[(keys.tenant, quota)] = (now, 0)
        at = int(time.time() * 1000)
        fields: dict[Any, Any] = {
            "at": str(at), "tenant": keys.tenant, "job_id": keys.job_id, "job_audit_id": "",
            "step": step, "reason": "quota_exceeded", "presented": "", "current": "",
            "worker_id": who.get("worker_id", ""), "adapter": who.get("adapter", ""),
            "quota": quota, "suppressed": str(suppressed),
        }  # fmt: skip
        retention_ms = int(self._ttl) * 1000
        try:
            await self._client.xadd(
                audit_feed(keys.tenant), fields, minid=f"{at - retention_ms}-0", approximate=True
            )
        except (RedisError, OSError):
            log.warning("quota_audit_failed", tenant=keys.tenant)
        log.warning(
            "quota_exceeded", tenant=keys.tenant, quota=quota, suppressed_since_last=suppressed
        )


class QuotaedService(EffectService):
    """The effect service with the tenant's quotas checked before each admit."""

    def __init__(self, *args: Any, quotas: Quotas, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.quotas = quotas

    async def _admit(
        self, keys: JobKeys, step: str, *, payload_json: str, **kwargs: Any
    ) -> AdmitVerdict:
        who = {
            "worker_id": str(kwargs.get("worker_id") or ""),
            "adapter": kwargs.get("adapter", ""),
        }
        counted = await self.quotas.take_effect(keys, step, **who)
        charge = 0
        if payload_json:
            try:
                charge = await self.quotas.reserve_payload(keys, step, len(payload_json), **who)
            except QuotaExceeded:
                await self.quotas.give_back(counted)
                raise
        try:
            verdict = await super()._admit(keys, step, payload_json=payload_json, **kwargs)
        except Rejection:
            await self.quotas.settle_payload(keys, step, charge, stored=False)
            raise  # a rejection is written (audit): it counts
        except StoreUnavailable as exc:
            maybe = bool(exc.fields.get("may_have_been_queued"))
            await self.quotas.settle_payload(keys, step, charge, stored=maybe)
            raise
        except BaseException:
            await self.quotas.settle_payload(keys, step, charge, stored=False)
            raise
        await self.quotas.settle_payload(keys, step, charge, stored=isinstance(verdict, Queued))
        if isinstance(verdict, Replay | InProgress | Unknown):
            await self.quotas.give_back(counted)  # nothing was written for this call
        return verdict
