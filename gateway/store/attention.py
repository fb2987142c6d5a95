"""What needs a human decision, per tenant, without a SCAN: the attention index (the
console's and the API's "needs a decision"; its Redis keys are ``fg:nd:*``).

A step needs a decision when its outcome is ``unknown``, or when it is still ``dispatching``
past its deadline (the holder died or stalled; it turns ``unknown`` only when next touched,
and ``resolve`` accepts it already).

* **The truth is per slot** (``fg:nd:{<s>}``, :func:`gateway.store.keys.attention_index`): a
  sorted set of ``[tenant, job, step]`` written by every script that changes a step's state,
  atomically with the change (``index()`` in the Lua prelude): an unknown step scored by when
  it became unknown, a dispatching one by its deadline. A script touches only its job's slot
  (Redis Cluster), so a tenant-wide key cannot be written there.
* **The hint is per tenant** (``fg:nd:t:<t>``): the entries that need a decision *now*,
  written by the store right after a verdict that made a step ``unknown`` (best effort, like
  the relay's hints). A dispatch passing its deadline is no verdict: nothing runs then, so
  the reconciler hints it.
* **The reconciler** (:meth:`AttentionIndex.reconcile`, every
  ``fencing.attention_reconcile_seconds`` in one gateway of the deployment: the first to
  take the interval's turn, :meth:`AttentionIndex.take_turn`) reads every slot's due entries
  (:mod:`gateway.store.slotscan`), hints them per tenant, repairs an entry whose
  step record disagrees (``reindex-2``: the record expired with its retention, or a slot lost
  writes), and drops hints no slot holds any more. A crash between a verdict and its hint is
  repaired there.
* **Reading** (:meth:`AttentionIndex.listing`) takes the tenant's due hints in score order, reads
  the fields it shows of each step's record (``HMGET`` of :data:`FIELDS`: never a stored
  payload or result) and shows only what the record confirms: a hint is never believed on
  its own, so a stale hint costs a read, never a wrong row; stale ones are dropped after the
  slot's truth confirms they are gone.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol, TypeVar

import redis.asyncio as aioredis
import structlog

from gateway.core.errors import StoreUnavailable
from gateway.core.records import EffectRecord
from gateway.store.batching import Batcher
from gateway.store.keys import (
    ATTENTION_TENANTS,
    ATTENTION_TURN,
    JobKeys,
    attention_hint,
    attention_index,
    key_slot,
)
from gateway.store.router import ClusterRouter
from gateway.store.slotscan import due_in_slots, pairs

T = TypeVar("T")

__all__ = [
    "FIELDS",
    "AttentionIndex",
    "as_hash",
    "attention_due",
    "decode_cursor",
    "effect_key",
    "encode_cursor",
    "fields_of",
    "member_parts",
]

log = structlog.get_logger("fencegate.attention")

_PAGE = 200  # hints read per round while listing
# what a listed item shows of a step's record: never its stored payload or result
FIELDS = (
    "state",
    "updated_at",
    "deadline",
    "generation",
    "adapter",
    "operation",
    "attempts",
    "worker_id",
    "error",
    "created_at",
)
_PER_SLOT = 1000  # due entries read per slot and round while reconciling


def encode_cursor(score: int, member: str) -> str:
    raw = json.dumps([score, member], separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[int, str]:
    """The (score, member) an ``after`` cursor names; ValueError when it is not one."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        score, member = json.loads(raw)
    except (ValueError, TypeError, binascii.Error) as exc:
        raise ValueError("not a cursor returned by this listing") from exc
    if not isinstance(score, int) or not isinstance(member, str) or isinstance(score, bool):
        raise ValueError("not a cursor returned by this listing")
    return score, member


def member_parts(member: str) -> tuple[str, str, str] | None:
    """An index member's ``(tenant, job_id, step)``; None when it is not one."""
    try:
        tenant, job_id, step = json.loads(member)
    except (ValueError, TypeError):
        return None
    if not all(isinstance(x, str) for x in (tenant, job_id, step)):
        return None
    return tenant, job_id, step


def attention_due(h: dict[str, str], now_ms: int) -> tuple[str, int] | None:
    """(state, since_ms) when the record says the step needs a decision now."""
    state = h.get("state")
    if state == "unknown":
        return state, int(h.get("updated_at") or 0)
    if state == "dispatching":
        deadline = int(h.get("deadline") or 0)
        if deadline <= now_ms:
            return state, deadline
    return None


class ScriptRunner(Protocol):
    """What the index needs of the store's link (:class:`gateway.store.link.RedisLink`)."""

    @property
    def client(self) -> aioredis.Redis: ...

    @property
    def batcher(self) -> Batcher | ClusterRouter: ...

    @property
    def retention_ms(self) -> int: ...

    async def guard(self, call: Callable[[], Awaitable[T]]) -> T: ...

    async def run_script(
        self,
        name: str,
        job: JobKeys,
        keys: Sequence[str],
        args: Sequence[str],
        request_id: str | None = None,
    ) -> list[Any]: ...


class AttentionIndex:
    """The store's side of the index: hints, listing, the reconciler, the overview."""

    def __init__(self, link: ScriptRunner) -> None:
        self._link = link

    async def pipelined(self, commands: Sequence[Sequence[Any]]) -> list[Any]:
        """Commands on one pipeline (not a transaction: their keys live in many slots); their
        replies in order. ``StoreUnavailable`` when Redis does not serve."""
        if not commands:
            return []

        async def run() -> list[Any]:
            async with self._link.client.pipeline(transaction=False) as pipe:
                for command in commands:
                    pipe.execute_command(*command)
                replies: list[Any] = await pipe.execute()
                return replies

        return await self._link.guard(run)

    @property
    def retention_ms(self) -> int:
        return self._link.retention_ms

    async def execute(self, *command: Any) -> Any:
        """One command's reply. ``StoreUnavailable`` when Redis does not serve."""

        async def run() -> Any:
            return await self._link.client.execute_command(*command)  # type: ignore[no-untyped-call]

        return await self._link.guard(run)

    # -- hints, after a verdict -----------------------------------------------------------

    async def hint(self, keys: JobKeys, step: str, score_ms: int | None = None) -> None:
        """The step needs a decision (best effort: the reconciler finds a lost hint)."""
        score = int(time.time() * 1000) if score_ms is None else score_ms
        try:
            await self.pipelined(
                [
                    ("ZADD", attention_hint(keys.tenant), score, keys.member(step)),
                    ("SADD", ATTENTION_TENANTS, keys.tenant),
                ]
            )
        except StoreUnavailable:
            log.warning("attention_hint_failed", job_id=keys.job_id, step=step)

    async def unhint(self, keys: JobKeys, step: str) -> None:
        try:
            await self.execute("ZREM", attention_hint(keys.tenant), keys.member(step))
        except StoreUnavailable:
            log.warning("attention_unhint_failed", job_id=keys.job_id, step=step)

    # -- listing --------------------------------------------------------------------------

    async def listing(
        self, tenant: str, *, limit: int, after: str | None = None, now_ms: int | None = None
    ) -> list[dict[str, Any]]:
        """The tenant's steps that need a decision, oldest first (unknown: since it became
        unknown; dispatching: since its deadline). Each item carries ``cursor``: pass the last
        one as ``after`` for the next page. ValueError for a malformed ``after``."""
        now = int(time.time() * 1000) if now_ms is None else now_ms
        score, last = decode_cursor(after) if after else (None, "")
        key = attention_hint(tenant)
        items: list[dict[str, Any]] = []
        stale: list[tuple[JobKeys, str]] = []
        ties = score is not None  # first the rest of the cursor's own score, then past it
        while len(items) < limit:
            if score is None:
                query: tuple[Any, ...] = ("-inf", now, "WITHSCORES", "LIMIT", 0, _PAGE)
            elif ties:
                if score > now:
                    break
                query = (score, score, "WITHSCORES")
            else:
                query = (f"({score}", now, "WITHSCORES", "LIMIT", 0, _PAGE)
            raw = pairs(await self.execute("ZRANGEBYSCORE", key, *query))
            rows = [(m, int(s)) for m, s in raw if not ties or m > last]
            replies = await self.pipelined([("HMGET", effect_key(m), *FIELDS) for m, _ in rows])
            for (member, s), reply in zip(rows, replies, strict=True):
                score, last = s, member
                parts = member_parts(member)
                if parts is None or parts[0] != tenant:
                    continue  # never another tenant's step, whatever the hint holds
                keys, h = JobKeys(parts[0], parts[1]), fields_of(reply)
                found = attention_due(h, now) if h else None
                if found is not None:
                    items.append(_item(keys, parts[2], h, found, now, encode_cursor(s, member)))
                elif h.get("state") != "dispatching":  # a live dispatch may still overrun
                    stale.append((keys, parts[2]))
                if len(items) >= limit:
                    break
            if ties:
                ties = False  # the cursor's own score is done: go on past it
            elif len(raw) < _PAGE:
                break  # the whole due range is read
            else:
                ties = True  # the page may have cut through the members of its last score
        if stale:
            await self._drop_stale(tenant, stale)
        return items

    async def _drop_stale(self, tenant: str, stale: list[tuple[JobKeys, str]]) -> None:
        """Drop hints whose step no longer needs a decision, once the slot's truth agrees."""
        try:
            scores = await self.pipelined([("ZSCORE", k.attention, k.member(s)) for k, s in stale])
            gone = [k.member(s) for (k, s), sc in zip(stale, scores, strict=True) if sc is None]
            if gone:
                await self.execute("ZREM", attention_hint(tenant), *gone)
        except StoreUnavailable:
            pass  # the reconciler drops them

    # -- the reconciler -------------------------------------------------------------------

    async def take_turn(self, every_ms: int) -> bool:
        """Whether this gateway reconciles this interval: the first of all gateways to ask
        (``SET NX PX``) does; a pass is 16,384 reads, once per interval for the deployment."""
        token = f"{os.getpid()}-{time.monotonic_ns()}"
        taken = await self.execute("SET", ATTENTION_TURN, token, "NX", "PX", max(1, every_ms - 100))
        return bool(taken)

    async def reconcile(self, now_ms: int | None = None) -> dict[str, int]:
        """Rebuild every tenant's hints from the slots' indexes (see the module doc)."""
        now = int(time.time() * 1000) if now_ms is None else now_ms
        due = await self._due_everywhere(now)
        stats = {"due": len(due), "repaired": 0, "hinted": 0, "dropped": 0}
        # the records must confirm the truth: an entry its record contradicts is repaired
        fields = await self.pipelined(
            [("HMGET", effect_key(m), "state", "deadline") for m, _ in due]
        )
        per: dict[str, dict[str, int]] = defaultdict(dict)
        for (member, score), (state, deadline) in zip(due, fields, strict=True):
            parts = member_parts(member)
            if parts is None:
                continue
            ok = state == "unknown" or (state == "dispatching" and int(deadline or 0) == score)
            if not ok:
                stats["repaired"] += 1
                if await self._reindex(parts, member) != "unknown":
                    continue
            per[parts[0]][member] = int(score)
        for tenant, members in per.items():
            flat = [x for member, score in members.items() for x in (score, member)]
            await self.pipelined(
                [("ZADD", attention_hint(tenant), *flat), ("SADD", ATTENTION_TENANTS, tenant)]
            )
            stats["hinted"] += len(members)
        stats["dropped"] = await self._drop_unknown_to_slots(per, now)
        return stats

    async def _due_everywhere(self, now: int) -> list[tuple[str, float]]:
        """Every slot's due entries (:func:`gateway.store.slotscan.due_in_slots`); a slot with
        more than a page is read on until it is done."""
        found: list[tuple[str, float]] = []
        wanted: list[tuple[int, int]] | None = None  # every slot from 0, at first
        while wanted is None or wanted:
            due = await due_in_slots(self._link.batcher, attention_index, now, _PER_SLOT, wanted)
            offsets = dict(wanted or ())
            wanted = []
            for slot, rows in due:
                found += rows
                if len(rows) == _PER_SLOT:
                    wanted.append((slot, offsets.get(slot, 0) + _PER_SLOT))
        return found

    async def _reindex(self, parts: tuple[str, str, str], member: str) -> str:
        tenant, job_id, step = parts
        keys = JobKeys(tenant, job_id)
        index = (keys.effect(step), keys.attention)
        reply = await self._link.run_script("reindex-2", keys, index, (member,))
        log.warning("attention_index_repaired", job_id=job_id, step=step, state=reply[1])
        return str(reply[1])

    async def _drop_unknown_to_slots(self, per: dict[str, dict[str, int]], now: int) -> int:
        """Drop every hint the slots do not hold as due. The truth is read again for each
        candidate first: an entry indexed and hinted since the sweep read its slot stays."""
        tenants: list[str] = sorted(await self.execute("SMEMBERS", ATTENTION_TENANTS))
        dropped = 0
        for tenant in tenants:
            rows: list[str] = await self.execute(
                "ZRANGEBYSCORE", attention_hint(tenant), "-inf", "+inf"
            )
            extra = [m for m in rows if m not in per.get(tenant, {})]
            if not extra:
                continue
            scores = await self.pipelined([("ZSCORE", _slot_index(m), m) for m in extra])
            gone = [m for m, sc in zip(extra, scores, strict=True) if sc is None or float(sc) > now]
            if gone:
                await self.execute("ZREM", attention_hint(tenant), *gone)
                dropped += len(gone)
        return dropped


def as_hash(reply: Any) -> dict[str, str]:
    """A hash reply (HGETALL, stream fields): a dict (RESP3) or a flat list (RESP2)."""
    if isinstance(reply, dict):
        return reply
    return dict(zip(reply[::2], reply[1::2], strict=True)) if reply else {}


def fields_of(reply: list[str | None]) -> dict[str, str]:
    """An HMGET reply of :data:`FIELDS` as a hash (the fields the record lacks left out;
    empty when there is no record)."""
    return {k: v for k, v in zip(FIELDS, reply, strict=True) if v is not None}


def effect_key(member: str) -> str:
    """The key of the step record an index member names."""
    tenant, job_id, step = member_parts(member) or ("", "", "")
    return JobKeys(tenant, job_id).effect(step)


def _slot_index(member: str) -> str:
    tenant, job_id, _ = member_parts(member) or ("", "", "")
    return attention_index(key_slot(tenant + "/" + job_id))


def _item(
    keys: JobKeys, step: str, h: dict[str, str], found: tuple[str, int], now: int, cursor: str
) -> dict[str, Any]:
    state, since = found
    record = EffectRecord.from_hash(h)
    deadline = int(h.get("deadline") or 0)
    return {
        "job_id": keys.job_id,
        "step": step,
        "state": state,
        "since_ms": since,
        "age_ms": max(0, now - since),
        "deadline_ms": deadline or None,
        "generation": record.generation,
        "adapter": record.adapter,
        "operation": record.operation,
        "attempts": record.attempts,
        "worker_id": record.worker_id,
        "last_error": record.error,
        "updated_at_ms": record.updated_at_ms,
        "cursor": cursor,
    }
