"""The tenants' quota counters in Redis: what :mod:`gateway.fencing.quotas` counts, and how.

The keys (all in the tenant's slot, ``fg:quota:{<tenant>}``, so nothing crosses a slot on
Redis Cluster; :func:`gateway.store.keys.quota_prefix`):

* ``…:fx:<window>``, ``…:rj:<window>`` — effect calls and rejections of a fixed window
  (``INCR``; a TTL of the window plus a minute, sent with the first charge of the window);
* ``…:held`` (``[job, step]`` -> charge) and ``…:held_bytes`` — async payloads held for the
  relay;
* ``…:ckpt`` (job -> the charge of its checkpoints) and ``…:ckpt_bytes`` — checkpoints;
* ``…:held_pending``, ``…:ckpt_pending`` (reservation id -> bytes) — the reservations not
  settled yet: a re-sent reservation finds its own and counts nothing again, its settlement
  closes it, and one never settled is given back by the reconciliation once it is ten
  minutes old (the id starts with when it was made, on Redis's clock);
* ``…:req:<call id>`` — a settle's reply for a minute: the auto-pipeline re-sends a call
  whose connection dropped before its reply, and the re-send must not count again
  (``lua/plain/includes/once``).

(The output store's counters are :mod:`gateway.store.output_records`'.) Every call goes
through the store's auto-pipeline, pipelined with the tick's scripts: no round trip of its
own. Four plain scripts (``lua/plain/quota-*.lua``) are the only check-and-set of these
counters; their error replies are bugs (raised), Redis not serving is ``StoreUnavailable``
(:mod:`gateway.store.failures`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from typing import Any, Literal

from gateway.store.batching import Batcher
from gateway.store.failures import redis_errors
from gateway.store.keys import JobKeys, audit_feed, quota_prefix
from gateway.store.router import ClusterRouter
from gateway.store.scripts import PlainScript, new_request_id

__all__ = ["Pool", "QuotaCounters", "Window", "held_member"]

Pool = Literal["held", "ckpt"]  # payloads held for the relay, checkpoints
Window = Literal["fx", "rj"]  # effect calls, rejections

# the only check-and-set of these counters (lua/plain/: no prelude)
RESERVE = PlainScript.load("quota-reserve-2")
SETTLE = PlainScript.load("quota-settle-4")
SETTLE_CHECKPOINT = PlainScript.load("quota-settle-checkpoint-4")
DROP = PlainScript.load("quota-drop-2")
OVER_CAP = -1  # RESERVE's reply when the amount does not fit
# how long a settle call's reply is remembered (includes/once): a call the auto-pipeline
# sends again after a dropped connection arrives within its retries (seconds)
RESEND_MEMORY_MS = "60000"
# an open reservation older than this was never settled (a settle follows its reserve within
# a call): the reconciliation gives it back
ABANDONED_AFTER_MS = 600_000


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
        clock: Callable[[], int],
        folds: bool = False,
    ) -> None:
        # the admit charges an async payload itself (standalone Redis: the tenant's keys are
        # reachable from the job's script; not on a Cluster, where it is reserved before)
        self.folds = folds
        self._clock = clock  # Redis's clock, unix ms (the reservations' age)
        self._client = client
        self._batcher = batcher
        self._ttl = str(retention_seconds)
        self._retention_ms = retention_seconds * 1000
        self._window_ttl = str(window_ttl_seconds)

    def _eval(
        self, script: PlainScript, keys: Sequence[str], args: Sequence[Any]
    ) -> asyncio.Future[Any]:
        return self._batcher.evalsha(script.sha, script.source, keys, [str(a) for a in args])

    async def _int(self, script: PlainScript, keys: Sequence[str], args: Sequence[Any]) -> int:
        with redis_errors():
            return int(await self._eval(script, keys, args))

    # -- counters per window ---------------------------------------------------------

    @staticmethod
    def window_key(tenant: str, kind: Window, index: int) -> str:
        return f"{quota_prefix(tenant)}:{kind}:{index}"

    def rejections_flag(self, tenant: str, index: int, cap: int) -> str:
        """The window's rejections counter for a fenced script to count itself
        (``'<cap> <ttl> <key>'``: includes/reject's ``past_rejection_cap``); only where
        :attr:`folds` (a standalone Redis: the counter is not in the job's slot)."""
        return f"{cap} {self._window_ttl} {self.window_key(tenant, 'rj', index)}"

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

    async def reserve(self, tenant: str, pool: Pool, amount: int, cap: int) -> str:
        """Reserve ``amount`` bytes of ``pool``: the reservation's id, which its settlement
        closes; '' (nothing reserved) over ``cap``."""
        p = quota_prefix(tenant)
        reservation = f"{self._clock():x}.{new_request_id()}"
        keys = [f"{p}:{pool}_bytes", f"{p}:{pool}_pending"]
        reply = await self._int(RESERVE, keys, [amount, cap, self._ttl, reservation])
        return "" if reply == OVER_CAP else reservation

    def admit_args(
        self,
        keys: JobKeys,
        step: str,
        *,
        payload: tuple[int, int] | None,
        effects: tuple[int, int] | None,
    ) -> tuple[str, ...]:
        """What the admit needs to charge, in its own atomic step (:attr:`folds`), an async
        payload (``(charge, cap)``: admit-8's ARGV[20] to ARGV[25]) and an effect call of the
        window (``(window index, cap)``: ARGV[26] to ARGV[28]); '' for what is not charged."""
        p = quota_prefix(keys.tenant)
        held: tuple[str, ...] = ("",) * 6
        if payload is not None:
            charge, cap = payload
            member = held_member(keys.job_id, step)
            held = (f"{p}:held", f"{p}:held_bytes", member, str(charge), str(cap), self._ttl)
        window: tuple[str, ...] = ()
        if effects is not None:
            index, cap = effects
            window = (self.window_key(keys.tenant, "fx", index), str(cap), self._window_ttl)
        return (*held, *window)

    async def settle_payload(
        self, keys: JobKeys, step: str, charge: int, reservation: str, *, stored: bool
    ) -> None:
        """A payload reservation after the decision (a Cluster: reserved before the admit):
        ``stored`` (queued) the step holds ``charge``, else it is given back; the reservation
        is closed (``StoreUnavailable`` when Redis did not answer: it stays open until the
        reconciliation gives it back)."""
        p = quota_prefix(keys.tenant)
        memory = f"{p}:req:{new_request_id()}"
        args = [held_member(keys.job_id, step), charge, "1" if stored else "0", self._ttl]
        await self._int(
            SETTLE,
            [f"{p}:held", f"{p}:held_bytes", memory, f"{p}:held_pending"],
            [*args, RESEND_MEMORY_MS, reservation],
        )

    def settle_checkpoint(
        self, keys: JobKeys, reserved: int, stored: int, reservation: str
    ) -> asyncio.Future[Any]:
        """A checkpoint reservation (``reservation``: its id, '' for none) after the write
        stored ``stored`` bytes more (queued in this tick's pipeline, not waited for: a
        future whose failure is the caller's to log)."""
        p = quota_prefix(keys.tenant)
        args = [keys.job_id, reserved, stored, self._ttl, RESEND_MEMORY_MS, reservation]
        memory = f"{p}:req:{new_request_id()}"
        return self._eval(
            SETTLE_CHECKPOINT, [f"{p}:ckpt", f"{p}:ckpt_bytes", memory, f"{p}:ckpt_pending"], args
        )

    async def drop_gone(self, tenant: str, pool: Pool) -> int:
        """Give back the entries of ``pool`` whose thing left Redis (a held payload whose
        effect has no payload any more; a job whose checkpoints expired): the bytes freed.
        An entry changed meanwhile keeps its charge (``quota-drop-2``)."""
        p = quota_prefix(tenant)
        with redis_errors():
            held: dict[str, str] = await self._client.hgetall(f"{p}:{pool}")
            gone: list[str] = []
            items = list(held.items())
            for i in range(0, len(items), 1000):
                chunk = items[i : i + 1000]
                checks = [self._thing(tenant, pool, member) for member, _ in chunk]
                async with self._client.pipeline(transaction=False) as pipe:
                    for check in checks:
                        if pool == "held":
                            pipe.hget(check, "payload_sha")
                        else:
                            pipe.exists(check)
                    found = await pipe.execute()
                for (member, charge), check, there in zip(chunk, checks, found, strict=True):
                    if not there:  # checked again by the drop where it can (standalone)
                        gone += [member, charge, check if self.folds else ""]
        freed = 0
        for i in range(0, len(gone), 3000):
            keys = [f"{p}:{pool}", f"{p}:{pool}_bytes"]
            freed += await self._int(DROP, keys, [pool, *gone[i : i + 3000]])
        return freed + await self._drop_abandoned(tenant, pool)

    @staticmethod
    def _thing(tenant: str, pool: Pool, member: str) -> str:
        """The key whose presence says an entry's thing is still in Redis: a held payload's
        effect hash (with its payload_sha), a job's checkpoints."""
        if pool == "held":
            job, step = json.loads(member)
            return JobKeys(tenant, job).effect(step)
        return JobKeys(tenant, member).ckpt

    async def _drop_abandoned(self, tenant: str, pool: Pool) -> int:
        """Give back the open reservations of ``pool`` older than
        :data:`ABANDONED_AFTER_MS` on Redis's clock: their settlement never came (every reply
        of the reservation lost, the gateway gone between the two). Returns the bytes freed."""
        p = quota_prefix(tenant)
        with redis_errors():
            pending: dict[str, str] = await self._client.hgetall(f"{p}:{pool}_pending")
        before = self._clock() - ABANDONED_AFTER_MS
        old: list[str] = []
        for reservation, amount in pending.items():
            made, _, _ = reservation.partition(".")
            try:
                if int(made, 16) < before:
                    old += [reservation, amount, ""]
            except ValueError:
                old += [reservation, amount, ""]  # not an id this module makes
        freed = 0
        for i in range(0, len(old), 3000):
            keys = [f"{p}:{pool}_pending", f"{p}:{pool}_bytes"]
            freed += await self._int(DROP, keys, ["", *old[i : i + 3000]])
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
