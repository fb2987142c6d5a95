"""Per-tenant quotas: a guard around the fence's decision, not the fence.

:class:`Quotas` is the effect service's admission hook (:mod:`gateway.fencing.admission`),
built only when some cap is configured. Three caps per tenant (``[quotas]``, overridable per
tenant in ``[quotas.tenants.<name>]``), counted in per-tenant keys outside the deciding
scripts (which stay one slot per job; the quota keys live in the tenant's slot, so nothing
crosses a slot on Redis Cluster):

* **effects per window** — effect calls *admitted or queued* in a fixed window of
  ``window_seconds``: ``fg:quota:{<tenant>}:fx:<window>``. Charged after the verdict, so a
  replay, an "in progress" answer and a rejection never spend it. Before the decision the
  call is checked against what this process last saw of the counter (the reply of its own
  last charge; read from Redis once per tenant and window): used up, the script is told so
  (``closed``) and refuses only a call that would pin, queue or claim a step, which gets
  ``429`` with nothing stored or sent. A replay or "in progress" answer is never refused.
  Bound: the cap, plus per gateway process the calls it admits between the counter reaching
  the cap and its next charge reply (at most the admits it has in flight at once).
* **rejections per window** — calls the fence rejected (stale, lease expired, …):
  ``fg:quota:{<tenant>}:rj:<window>``, and the metric ``fencegate_quota_rejections`` (always,
  ``audited`` true/false). Past the cap a rejection is still answered as before (409/422,
  nothing written) but no longer audited one by one, so a zombie flood cannot grow the audit
  streams without bound; it never spends or closes the effects quota.
* **stored payload bytes** — async payloads held in Redis for the relay, each charged its
  size plus 1 KiB, reserved before the decision and settled after it:
  ``fg:quota:{<tenant>}:held`` (``[job, step]`` -> charge) and its sum
  ``fg:quota:{<tenant>}:held_bytes``. A reservation over the cap does not refuse the call:
  the script is told, and refuses only a call that would queue a new payload (an async
  repeat of a queued step is answered). A payload leaves Redis when its outcome is recorded
  (by the relay, or a synchronous call that takes the step over); the gateway does not hook
  every such place: when a tenant reaches its cap, the held entries whose payload is gone
  are given back (at most once a second per tenant), then the reservation is tried again.
* **stored checkpoint bytes** — every checkpoint of the tenant's jobs, each charged its stored
  record (value, envelope, name) plus :data:`CHECKPOINT_OVERHEAD`: ``fg:quota:{<tenant>}:ckpt``
  (job -> the charge of its checkpoints) and its sum ``fg:quota:{<tenant>}:ckpt_bytes``.
  Charged by the checkpoint writes (:meth:`Quotas.reserve_checkpoint`, then
  :meth:`Quotas.settle_checkpoint`), with or without the effect hook. The write's upper
  bound is reserved before the script runs; over the cap (after one reconciliation) the
  script is told (``closed``) and takes only a write that does not grow what the job
  stores — a replacement of a stored name by one no larger — and refuses the rest, nothing
  written. ``checkpoint-3`` answers the exact charge of the checkpoint and of the one of that
  name it replaced; the settlement turns the reservation into that difference (the job's
  script and the tenant's counter are two slots on Cluster: reserve before, settle after,
  through the auto-pipeline, never one script). A job's checkpoints leave Redis only when
  they expire with the retention (nothing else removes them, a completion keeps them): at
  the cap, the entries of jobs whose checkpoints are gone are given back (as for payloads).
  Bound: the counter is charged before the write, so it never counts less than what is
  stored; it counts more for a write whose reply never came (kept at its full reservation
  until the job's checkpoints expire) and for a process that died between a reservation and
  its settlement (that reservation, at most one checkpoint per write in flight).

The counters go through the store's auto-pipeline (:attr:`Store.batcher`): a charge is
queued with the reply's tick and not waited for. Over a cap: ``429 quota_exceeded`` with
``Retry-After`` (the window's end; for payloads, ``retry_after_seconds``), audited in the
tenant's audit feed (``reason = quota_exceeded``), at most one entry per tenant and cap per
second (a flood is summarised by a ``suppressed`` count in the next entry).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
import structlog
from redis.exceptions import RedisError

from gateway.core.errors import QuotaExceeded, Rejection, StoreUnavailable, TooManyCheckpoints
from gateway.core.records import (
    Admitted,
    AdmitVerdict,
    InProgress,
    OverQuota,
    Queued,
    Replay,
    Unknown,
)
from gateway.fencing.admission import OPEN, AdmitCall, Gate
from gateway.runtime.metrics import Metrics
from gateway.runtime.settings import QuotaSettings
from gateway.store.keys import JobKeys, audit_feed
from gateway.store.store import Store

__all__ = ["CHECKPOINT_OVERHEAD", "PAYLOAD_OVERHEAD", "Caps", "CheckpointHold", "Quotas"]

log = structlog.get_logger("fencegate.quotas")

PAYLOAD_OVERHEAD = 1024  # the effect hash fields, the queue entry, the hint around a payload
CHECKPOINT_OVERHEAD = 256  # a hash field's own cost in Redis, beyond its name and value

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
# KEYS[1] the checkpoint charges per job, KEYS[2] ckpt_bytes; ARGV[1] job, ARGV[2] reserved,
# ARGV[3] what the write stored (its charge minus the one it replaced; 0: nothing), ARGV[4]
# ttl. The reservation becomes what was stored; the job's entry holds its checkpoints' charge.
_SETTLE_CHECKPOINT = """
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


@dataclass(frozen=True, slots=True)
class Caps:
    """A tenant's caps; 0 is none."""

    effects: int
    rejections: int
    payload: int
    checkpoint: int


@dataclass(frozen=True, slots=True)
class CheckpointHold:
    """A checkpoint write's reservation: ``charge`` reserved (0: none), ``closed``: the
    tenant's checkpoint bytes are used up (the script takes only a write that does not grow)."""

    charge: int = 0
    closed: bool = False


_NO_HOLD = CheckpointHold()


class Quotas:
    """The admission hook that charges a tenant's quotas (see the module docstring)."""

    def __init__(
        self,
        store: Store,
        settings: QuotaSettings,
        metrics: Metrics,
        *,
        retention_seconds: int,
    ) -> None:
        self._client: aioredis.Redis = store.client
        self._batcher = store.batcher
        self._settings = settings
        self._metrics = metrics
        self._ttl = str(retention_seconds)
        self._window_ttl = str(settings.window_seconds + 60)
        self._scripts = {
            name: (hashlib.sha1(src.encode(), usedforsecurity=False).hexdigest(), src)
            for name, src in (
                ("reserve", _RESERVE),
                ("settle", _SETTLE),
                ("settle_checkpoint", _SETTLE_CHECKPOINT),
                ("drop", _DROP),
            )
        }
        # (tenant, 'fx' | 'rj') -> (window index, the counter as this process last saw it)
        self._seen: dict[tuple[str, str], tuple[int, int]] = {}
        self._reconciled: dict[tuple[str, str], float] = {}
        self._audited: dict[tuple[str, str], tuple[float, int]] = {}

    def caps(self, tenant: str) -> Caps:
        own = self._settings.tenants.get(tenant)
        s = self._settings
        if own is None:
            return Caps(
                s.effects_per_window, s.rejections_per_window, s.payload_bytes, s.checkpoint_bytes
            )
        return Caps(
            s.effects_per_window if own.effects_per_window is None else own.effects_per_window,
            s.rejections_per_window
            if own.rejections_per_window is None
            else own.rejections_per_window,
            s.payload_bytes if own.payload_bytes is None else own.payload_bytes,
            s.checkpoint_bytes if own.checkpoint_bytes is None else own.checkpoint_bytes,
        )

    async def _call(self, script: str, keys: list[str], args: list[Any]) -> int:
        sha, source = self._scripts[script]
        try:
            return int(await self._batcher.evalsha(sha, source, keys, [str(a) for a in args]))
        except (RedisError, OSError) as exc:
            raise StoreUnavailable(f"Redis did not answer the quota check: {exc}") from exc

    # -- the admission hook ----------------------------------------------------

    async def before(self, call: AdmitCall) -> Gate:
        caps = self.caps(call.keys.tenant)
        index, _ = self._window()
        closed = ""
        for kind, cap, letter in (("fx", caps.effects, "e"), ("rj", caps.rejections, "r")):
            if not cap:
                continue
            seen = self._seen.get((call.keys.tenant, kind))
            # this process's view (no round trip); read from Redis once per window
            count = (
                seen[1]
                if seen and seen[0] == index
                else await self._count(call.keys.tenant, kind, index)
            )
            if count >= cap:
                closed += letter
        charge = 0
        if call.payload_bytes and caps.payload and "e" not in closed:
            charge = await self._reserve_payload(call.keys.tenant, call.payload_bytes, caps.payload)
            if not charge:
                closed += "p"
        return Gate(closed, charge) if closed or charge else OPEN

    async def after(
        self, call: AdmitCall, gate: Gate, outcome: AdmitVerdict | BaseException
    ) -> None:
        keys, tenant = call.keys, call.keys.tenant
        charge = int(gate.hold or 0)
        if charge:
            stored = isinstance(outcome, Queued)
            if isinstance(outcome, StoreUnavailable):
                stored = bool(outcome.fields.get("may_have_been_queued"))
            await self._settle_payload(keys, call.step, charge, stored)
        if isinstance(outcome, Replay | InProgress | Unknown):
            return  # nothing was written for this call: never charged
        index, left = self._window()
        caps = self.caps(tenant)
        if isinstance(outcome, Admitted) or (isinstance(outcome, Queued) and not outcome.repeated):
            if caps.effects:
                self._charge(tenant, "fx", index)
        elif isinstance(outcome, Rejection):
            audited = "r" not in gate.closed
            self._metrics.quota_rejections.labels(tenant, "true" if audited else "false").inc()
            if caps.rejections:
                self._charge(tenant, "rj", index)
        elif isinstance(outcome, OverQuota):
            who = {"worker_id": call.worker_id, "adapter": call.adapter}
            await self.audit(keys, call.step, outcome.quota, **who)
            if outcome.quota == "payload_bytes":
                raise QuotaExceeded(
                    f"tenant {tenant!r} has {caps.payload} bytes of async payloads stored for "
                    "the relay; they are freed as the relay delivers them",
                    retry_after=self._settings.retry_after_seconds,
                    quota="payload_bytes",
                    limit=caps.payload,
                )
            raise QuotaExceeded(
                f"tenant {tenant!r} used its {caps.effects} effect calls of this "
                f"{self._settings.window_seconds} s window",
                retry_after=left,
                quota="effects_per_window",
                limit=caps.effects,
            )

    # -- counters per window -----------------------------------------------------

    def _window(self) -> tuple[int, int]:
        """(this window's index, seconds until it ends)."""
        size = self._settings.window_seconds
        now = time.time()
        return int(now // size), max(1, int(size - now % size + 0.999))

    def _key(self, tenant: str, kind: str, index: int) -> str:
        return f"{_prefix(tenant)}:{kind}:{index}"

    async def _count(self, tenant: str, kind: str, index: int) -> int:
        """The counter in Redis: the view of a window this process has not charged yet."""
        try:
            value = await self._batcher.execute("GET", self._key(tenant, kind, index))
        except (RedisError, OSError) as exc:
            raise StoreUnavailable(f"Redis did not answer the quota check: {exc}") from exc
        count = int(value or 0)
        current = self._seen.get((tenant, kind))
        if current is None or current[0] != index or current[1] < count:
            self._seen[(tenant, kind)] = (index, count)
        return count

    def _charge(self, tenant: str, kind: str, index: int) -> None:
        """Count one call: this process's view at once, Redis in the pipeline of this tick
        (not waited for; its reply raises the view to what every process charged)."""
        seen = self._seen.get((tenant, kind))
        mine = seen[1] if seen is not None and seen[0] == index else 0
        self._seen[(tenant, kind)] = (index, mine + 1)
        key = self._key(tenant, kind, index)

        def counted(future: asyncio.Future[Any]) -> None:
            if future.cancelled():
                return
            if (exc := future.exception()) is not None:
                log.warning("quota_charge_failed", key=key, error=str(exc))
                return
            current = self._seen.get((tenant, kind))
            if current is not None and current[0] == index and current[1] < int(future.result()):
                self._seen[(tenant, kind)] = (index, int(future.result()))

        def quiet(future: asyncio.Future[Any]) -> None:
            if not future.cancelled():
                future.exception()  # retrieved: a failed EXPIRE is the charge's failure too

        self._batcher.execute("INCR", key).add_done_callback(counted)
        self._batcher.execute("EXPIRE", key, self._window_ttl).add_done_callback(quiet)

    # -- stored payload bytes -------------------------------------------------

    async def _reserve_payload(self, tenant: str, size: int, cap: int) -> int:
        """Reserve a payload's charge; 0 when it does not fit (after one reconciliation)."""
        charge = size + PAYLOAD_OVERHEAD
        counter = f"{_prefix(tenant)}:held_bytes"
        for attempt in (0, 1):
            if await self._call("reserve", [counter], [charge, cap, self._ttl]) >= 0:
                return charge
            if attempt == 0 and not await self.reconcile(tenant):
                break
        return 0

    async def _settle_payload(self, keys: JobKeys, step: str, charge: int, stored: bool) -> None:
        p = _prefix(keys.tenant)
        args = [_member(keys, step), charge, "1" if stored else "0", self._ttl]
        try:
            await self._call("settle", [f"{p}:held", f"{p}:held_bytes"], args)
        except StoreUnavailable:
            log.warning("quota_settle_failed", job_id=keys.job_id, step=step)

    async def reconcile(self, tenant: str) -> int:
        """Give back the charges of held payloads that left Redis; returns bytes freed (at
        most once a second per tenant: 0 when skipped)."""

        def gone(pipe: Any, member: str) -> None:
            job, step = json.loads(member)
            pipe.hget(JobKeys(tenant, job).effect(step), "payload_sha")

        return await self._reconcile(tenant, "held", gone)

    async def _reconcile(self, tenant: str, kind: str, ask: Any) -> int:
        """Drop the entries of ``fg:quota:{<tenant>}:<kind>`` whose stored thing is gone:
        ``ask(pipe, member)`` queues one read that answers None (or 0) when it is. Bytes
        freed; at most once a second per tenant and kind (0 when skipped)."""
        now = time.monotonic()
        if now - self._reconciled.get((tenant, kind), 0.0) < 1.0:
            return 0
        self._reconciled[(tenant, kind)] = now
        p = _prefix(tenant)
        try:
            held: dict[str, str] = await self._client.hgetall(f"{p}:{kind}")  # type: ignore[assignment]
            gone: list[str] = []
            items = list(held.items())
            for i in range(0, len(items), 1000):
                chunk = items[i : i + 1000]
                async with self._client.pipeline(transaction=False) as pipe:
                    for member, _ in chunk:
                        ask(pipe, member)
                    found = await pipe.execute()
                for (member, charge), there in zip(chunk, found, strict=True):
                    if not there:
                        gone += [member, charge]
            if not gone:
                return 0
            freed = 0
            for i in range(0, len(gone), 2000):
                keys = [f"{p}:{kind}", f"{p}:{kind}_bytes"]
                freed += await self._call("drop", keys, gone[i : i + 2000])
            return freed
        except (RedisError, OSError):
            log.warning("quota_reconcile_failed", tenant=tenant, kind=kind)
            return 0

    # -- stored checkpoint bytes ----------------------------------------------

    async def reserve_checkpoint(self, tenant: str, bound: int) -> CheckpointHold:
        """Reserve a checkpoint write's upper bound (its stored bytes at most, without the
        overhead); closed when it does not fit (after one reconciliation)."""
        cap = self.caps(tenant).checkpoint
        if not cap:
            return _NO_HOLD
        charge = bound + CHECKPOINT_OVERHEAD
        counter = f"{_prefix(tenant)}:ckpt_bytes"
        for attempt in (0, 1):
            if await self._call("reserve", [counter], [charge, cap, self._ttl]) >= 0:
                return CheckpointHold(charge)
            if attempt == 0 and not await self.reconcile_checkpoints(tenant):
                break
        return CheckpointHold(closed=True)

    def settle_checkpoint(self, keys: JobKeys, hold: CheckpointHold, stored: int) -> None:
        """The write stored ``stored`` bytes more (its charge minus the one it replaced; 0:
        nothing written; the reservation for a write whose reply never came). Queued in this
        tick's pipeline, not waited for: it only lowers the counter, never raises it."""
        if not hold.charge and not hold.closed:
            return  # the tenant has no checkpoint cap: nothing is counted
        p = _prefix(keys.tenant)
        sha, source = self._scripts["settle_checkpoint"]
        args = [keys.job_id, str(hold.charge), str(stored), self._ttl]
        future = self._batcher.evalsha(sha, source, [f"{p}:ckpt", f"{p}:ckpt_bytes"], args)

        def settled(future: asyncio.Future[Any]) -> None:
            if not future.cancelled() and future.exception() is not None:
                log.warning("quota_settle_failed", job_id=keys.job_id, kind="checkpoint")

        future.add_done_callback(settled)

    async def reconcile_checkpoints(self, tenant: str) -> int:
        """Give back the charges of jobs whose checkpoints expired; returns bytes freed (at
        most once a second per tenant: 0 when skipped)."""

        def gone(pipe: Any, job: str) -> None:
            pipe.exists(JobKeys(tenant, job).ckpt)

        return await self._reconcile(tenant, "ckpt", gone)

    async def checkpoint_refused(
        self, keys: JobKeys, name: str, quota: str, *, worker_id: str, limit: int
    ) -> QuotaExceeded | TooManyCheckpoints:
        """Audit a refused checkpoint write; the problem to raise (``limit``: the job's
        checkpoint names, for ``checkpoints_per_job``)."""
        await self.audit(keys, f"checkpoint:{name}", quota, worker_id=worker_id)
        if quota == "checkpoints_per_job":
            return TooManyCheckpoints(
                f"job {keys.job_id!r} holds {limit} checkpoints (checkpoints.max_per_job); "
                "write one of them again instead of a new name",
                limit=limit,
            )
        cap = self.caps(keys.tenant).checkpoint
        return QuotaExceeded(
            f"tenant {keys.tenant!r} has {cap} bytes of checkpoints stored; they are freed "
            "when their jobs' checkpoints expire (fencing.retention_seconds after a job's "
            "last checkpoint). A checkpoint written again no larger is still taken",
            retry_after=self._settings.retry_after_seconds,
            quota="checkpoint_bytes",
            limit=cap,
        )

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
