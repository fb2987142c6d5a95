"""Every slot's sorted set of one kind, read for its due entries: the relay's queues
(``fg:rq:{<s>}``, the sweep that finds a lost hint) and the "needs a decision" index
(``fg:nd:{<s>}``, the attention reconciler). Both are written per slot by the scripts, so a
reader visits all 16,384 keys.

On a standalone Redis a chunk of 256 keys is one call of ``due-in-slots-1n`` (a read-only
plain script answering only the keys with due entries, and at most :data:`BUDGET` entries a
call: the keys after the one that reached it are sent again); on a Cluster, where each key
is its own slot, one ``ZRANGEBYSCORE`` a key on the auto-pipeline, 1,024 at a time. A
command per key costs the gateway ~100 ms of CPU a pass (16,384 requests packed and replies
parsed), the script calls ~15 ms."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from gateway.store.batching import Batcher
from gateway.store.failures import redis_errors
from gateway.store.keys import SLOTS
from gateway.store.router import ClusterRouter
from gateway.store.scripts import PlainScript

__all__ = ["DUE", "due_in_slots", "pairs"]

DUE = PlainScript.load("due-in-slots-1n")
CHUNK = 1024  # commands in flight on a Cluster
KEYS_A_CALL = 256  # keys a script call reads on a standalone Redis (~0.4 ms of Redis's time)
# entries a script call reads at most, past which it stops after its key (Redis runs nothing
# else meanwhile): ~1 µs of Redis's time an entry, ~3 µs with 128-character names, so a call
# holding 10,000 entries blocked Redis 10-28 ms; 1,000 keeps a call within a few ms
BUDGET = 1_000

Due = list[tuple[int, list[tuple[str, float]]]]  # (slot, its due (member, score) in order)


def pairs(rows: Any) -> list[tuple[str, float]]:
    """A WITHSCORES reply as (member, score): RESP3 pairs or a flat RESP2 list."""
    if not rows:
        return []
    if isinstance(rows[0], list | tuple):
        return [(m, float(s)) for m, s in rows]
    return [(m, float(s)) for m, s in zip(rows[::2], rows[1::2], strict=True)]


async def due_in_slots(
    batcher: Batcher | ClusterRouter,
    key_of: Callable[[int], str],
    now: int,
    per_slot: int,
    wanted: Sequence[tuple[int, int]] | None = None,
) -> Due:
    """The due entries (score up to ``now``) of each slot's key ``key_of(slot)``, at most
    ``per_slot`` of each, from its offset: ``wanted`` is (slot, offset) pairs, every slot from
    0 when None. Slots without due entries are left out. ``StoreUnavailable`` when Redis did
    not answer."""
    todo = list(wanted) if wanted is not None else [(s, 0) for s in range(SLOTS)]
    if isinstance(batcher, ClusterRouter):
        return await _per_command(batcher, key_of, now, per_slot, todo)
    found: Due = []
    start = 0
    while start < len(todo):
        chunk = todo[start : start + KEYS_A_CALL]
        keys = [key_of(s) for s, _ in chunk]
        args = [str(now), str(per_slot), str(BUDGET)]
        if wanted is not None:  # else every offset is 0
            args += [str(off) for _, off in chunk]
        with redis_errors():
            reply = await batcher.evalsha(DUE.sha, DUE.source, keys, args)
        read = int(reply[0])
        for i in range(1, len(reply), 2):
            found.append((chunk[int(reply[i]) - 1][0], pairs(reply[i + 1])))
        start += read
    return found


async def _per_command(
    batcher: ClusterRouter,
    key_of: Callable[[int], str],
    now: int,
    per_slot: int,
    todo: list[tuple[int, int]],
) -> Due:
    found: Due = []
    query = ("-inf", now, "WITHSCORES", "LIMIT")
    for start in range(0, len(todo), CHUNK):
        chunk = todo[start : start + CHUNK]
        replies = await asyncio.gather(
            *(
                batcher.execute("ZRANGEBYSCORE", key_of(s), *query, off, per_slot)
                for s, off in chunk
            ),
            return_exceptions=True,
        )
        for (s, _), rows in zip(chunk, replies, strict=True):
            if isinstance(rows, BaseException):
                if isinstance(rows, asyncio.CancelledError):
                    raise rows
                with redis_errors():  # Redis not serving: StoreUnavailable; a bug as it is
                    raise rows
            if rows:
                found.append((s, pairs(rows)))
    return found
