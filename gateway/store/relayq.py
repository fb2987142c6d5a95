"""The async relay's queue in Redis: per-slot queues (the truth), per-tenant hints, the sweep
that finds a lost hint, and the claim (``relay-6``).

On a standalone Redis the scripts that write a slot's queue write the tenant's hint in the
same atomic step (``includes/relayq``): a tenant's hints are exactly its queued steps, so no
hint is lost in a crash and none is removed after its step was queued again. On a Cluster the
hint is another slot's key: the gateway writes it after the script (:meth:`RelayQueue.queued`,
:meth:`RelayQueue.left`), and the sweep finds one lost in a crash."""

from __future__ import annotations

import json

import structlog

from gateway.core.errors import StoreUnavailable
from gateway.core.records import RelayClaim
from gateway.store import scripts
from gateway.store.attention import AttentionIndex
from gateway.store.failures import redis_errors
from gateway.store.keys import (
    RELAY_TENANTS,
    JobKeys,
    relay_hint,
    relay_queue,
)
from gateway.store.link import RedisLink
from gateway.store.replies import RelayReply
from gateway.store.slotscan import due_in_slots

log = structlog.get_logger("fencegate.store")

REHINT = scripts.PlainScript.load("relay-rehint-3")


class RelayQueue:
    """The async relay's queue, on the store's link.

    The truth is the queue of each slot (fg:rq:{s}), written by the scripts atomically with
    the step. The relay reads per-tenant hints: written with it (a standalone Redis), or
    after the script (a Cluster), where a hint lost in a crash is found again by
    :meth:`sweep`, which reads every slot's queue."""

    def __init__(
        self,
        link: RedisLink,
        attention: AttentionIndex,
        *,
        dispatch_timeout_ms: int,
        retention_seconds: int,
    ) -> None:
        self._link = link
        self._client = link.client
        self._attention = attention
        self._dispatch_timeout_ms = str(dispatch_timeout_ms)
        self._retention = str(retention_seconds)

    async def queued(self, keys: JobKeys, step: str, due_ms: int) -> None:
        """A script queued the step, or queued it again, due at ``due_ms``: its hint, unless
        the script wrote it (a standalone Redis)."""
        if not self._link.hints_in_script:
            await self.relay_hint(keys, step, due_ms)

    async def left(self, keys: JobKeys, step: str) -> None:
        """A script's verdict took the step out of the queue: its hint goes, unless the script
        removed it (a standalone Redis, where a removal after the script could remove the
        hint of the step queued again meanwhile)."""
        if not self._link.hints_in_script:
            await self.relay_unhint(keys, step)

    async def relay_hint(self, keys: JobKeys, step: str, due_ms: int) -> None:
        """Point the relay at a queued step (best effort: the sweep finds a lost one). A hint
        that outlives its step costs one claim, which drops it (``relay-6``: 'unqueued')."""
        member = keys.member(step)
        try:
            async with self._client.pipeline(transaction=False) as pipe:
                pipe.zadd(relay_hint(keys.tenant), {member: due_ms})
                pipe.sadd(RELAY_TENANTS, keys.tenant)
                await self._link.guard(pipe.execute)
        except StoreUnavailable:
            log.warning("relay_hint_failed", job_id=keys.job_id, step=step)

    async def relay_unhint(self, keys: JobKeys, step: str) -> None:
        try:
            await self._link.guard(
                lambda: self._client.zrem(relay_hint(keys.tenant), keys.member(step))
            )
        except StoreUnavailable:
            log.warning("relay_unhint_failed", job_id=keys.job_id, step=step)

    async def relay_due(self, now_ms: int, per_tenant: int) -> list[tuple[JobKeys, str, int]]:
        """Due hints, fair across tenants: up to ``per_tenant`` of each, interleaved."""

        async def read() -> list[list[tuple[str, float]]]:
            tenants: list[str] = sorted(await self._client.smembers(RELAY_TENANTS))  # type: ignore[arg-type]
            if not tenants:
                return []
            async with self._client.pipeline(transaction=False) as pipe:
                for tenant in tenants:
                    pipe.zrangebyscore(
                        relay_hint(tenant),
                        "-inf",
                        now_ms,
                        start=0,
                        num=per_tenant,
                        withscores=True,
                    )
                return await pipe.execute()

        per = await self._link.guard(read)
        due: list[tuple[JobKeys, str, int]] = []
        for i in range(max((len(rows) for rows in per), default=0)):
            for rows in per:
                if i < len(rows):
                    member, score = rows[i]
                    tenant, job_id, step = json.loads(member)
                    due.append((JobKeys(tenant, job_id), step, int(score)))
        return due

    async def sweep(self, now_ms: int, per_slot: int = 100) -> int:
        """Hint every due entry of every slot's queue (a hint lost in a crash); returns how
        many due entries were found (:func:`gateway.store.slotscan.due_in_slots`)."""
        found = 0
        for slot, rows in await due_in_slots(self._link.batcher, relay_queue, now_ms, per_slot):
            await self.rehint(slot, rows)
            found += len(rows)
        return found

    async def rehint(self, slot: int, rows: list[tuple[str, float]]) -> None:
        """Hint the queue entries ``rows`` (member, score) the sweep read in ``slot``. On a
        standalone Redis only a step still queued and without a hint is hinted, at its entry's
        score as it is then, in one atomic step a tenant (``relay-rehint-3``): a step claimed,
        re-queued or gone since the read keeps the hint its scripts wrote."""
        if not self._link.hints_in_script:
            for member, score in rows:
                tenant, job_id, step = json.loads(member)
                await self.relay_hint(JobKeys(tenant, job_id), step, int(score))
            return
        by_tenant: dict[str, list[str]] = {}
        for member, _ in rows:
            by_tenant.setdefault(json.loads(member)[0], []).append(member)
        for tenant, members in by_tenant.items():
            keys = [relay_queue(slot), relay_hint(tenant), RELAY_TENANTS]
            with redis_errors():
                await self._link.batcher.evalsha(
                    REHINT.sha, REHINT.source, keys, [tenant, *members]
                )

    async def relay_claim(
        self,
        keys: JobKeys,
        step: str,
        dispatch_id: str | None = None,
        run_before_ms: int | None = None,
    ) -> RelayClaim | int | str:
        """Claim a queued step: the claim; a deadline (ms) to look again at; or why there is
        nothing to send (the step has left the queue). ``run_before_ms``: as for
        :meth:`Store.admit` (a re-send passes the first send's bound; a send whose reply did
        not come raises ``StoreUnavailable`` carrying it, for the void)."""
        dispatch_id = dispatch_id or scripts.new_dispatch_id()
        reply = await self._link.run_bounded(
            "relay-6",
            keys,
            (
                keys.effect(step),
                keys.job,
                keys.audit,
                keys.relayq,
                keys.attention,
                *self._link.relay_hint_keys(keys.tenant),
            ),
            (
                dispatch_id,
                self._dispatch_timeout_ms,
                self._retention,
                keys.member(step),
                keys.job_id,
                step,
                keys.tenant,
            ),
            dispatch_id,
            run_before_ms,
        )
        code = int(reply[0])
        if code == RelayReply.CLAIMED:
            _, dispatch_id, gen, adapter, operation, payload, deadline = reply
            if payload == "":  # a re-send's remembered answer: the payload is read again
                with redis_errors():
                    holder, payload = await self._link.client.hmget(
                        keys.effect(step), "dispatch_id", "payload"
                    )
                if holder != dispatch_id or payload is None:
                    return int(deadline)  # the claim no longer holds it: look again then
            return RelayClaim(
                dispatch_id, int(gen), adapter, operation, json.loads(payload), int(deadline)
            )
        if code == RelayReply.HELD:
            return int(reply[1])
        if reply[2]:
            await self._link.copy_to_feed(keys, str(reply[2]))
        if reply[1] == "unknown":
            await self._attention.hint(keys, step)
        return str(reply[1])
