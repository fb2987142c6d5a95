"""Every slot's due entries (``gateway.store.slotscan``) on a standalone Redis: the script
reading a chunk of slots a call answers what a ``ZRANGEBYSCORE`` per slot answers — only the
slots with due entries, at most ``per_slot`` of each, from each slot's offset — however the
per-call entry budget cuts the chunks."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import pytest
import redis

from gateway.store import slotscan
from gateway.store.batching import Batcher
from gateway.store.keys import SLOTS, relay_queue
from gateway.store.slotscan import due_in_slots
from gateway.store.store import connect

NOW = 1_000_000


def fill(r: redis.Redis, seed: int) -> None:
    """Entries in slots across every chunk (the first, a chunk's edges, the last), some due
    (score <= NOW), some not."""
    rng = random.Random(seed)
    slots = {0, 1, 255, 256, 257, 4095, 9000, SLOTS - 2, SLOTS - 1}
    slots |= {rng.randrange(SLOTS) for _ in range(40)}
    for s in slots:
        members = {f'["t","j{s}","s{i}"]': rng.choice((NOW - rng.randrange(5000), NOW + 1 + i))
                   for i in range(rng.randrange(1, 9))}  # fmt: skip
        r.zadd(relay_queue(s), members)


def expected(r: redis.Redis, per_slot: int, offsets: dict[int, int] | None = None) -> list:
    found = []
    for s in range(SLOTS) if offsets is None else sorted(offsets):
        off = 0 if offsets is None else offsets[s]
        rows = r.zrangebyscore(relay_queue(s), "-inf", NOW, start=off, num=per_slot,
                               withscores=True)  # fmt: skip
        if rows:
            found.append((s, [(m, float(sc)) for m, sc in rows]))
    return found


async def scan(url: str, per_slot: int, wanted: list[tuple[int, int]] | None = None) -> list:
    client = connect(url, timeout=5, max_connections=4)
    batcher = Batcher(client)
    try:
        return await due_in_slots(batcher, relay_queue, NOW, per_slot, wanted)
    finally:
        await batcher.aclose()
        await client.aclose()


@pytest.mark.parametrize("budget", [10_000, 7, 1])
async def test_every_slots_due_entries_whatever_the_budget(
    redis_url: str, redis_sync: redis.Redis, monkeypatch: pytest.MonkeyPatch, budget: int
) -> None:
    fill(redis_sync, seed=budget)
    monkeypatch.setattr(slotscan, "BUDGET", budget)  # a call stops early; the rest sent again
    for per_slot in (100, 3):
        want = expected(redis_sync, per_slot)
        assert want and sum(len(rows) for _, rows in want) > 20
        assert await scan(redis_url, per_slot) == want


async def test_slots_read_from_their_offsets(redis_url: str, redis_sync: redis.Redis) -> None:
    fill(redis_sync, seed=3)
    slots = [s for s, _ in expected(redis_sync, 100)]
    empty = next(s for s in range(SLOTS) if not redis_sync.exists(relay_queue(s)))
    offsets = {s: i % 3 for i, s in enumerate(slots)}
    got = await scan(redis_url, 2, [*offsets.items(), (empty, 0)])
    assert got == expected(redis_sync, 2, offsets)


class CountingBatcher(Batcher):
    """A batcher that notes how many entries each script call answered."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.entries: list[int] = []

    def evalsha(self, sha: str, source: str, keys: Sequence[str], args: Sequence[str]) -> Any:
        future = super().evalsha(sha, source, keys, args)
        future.add_done_callback(
            lambda f: self.entries.append(sum(len(rows) // 2 for rows in f.result()[2::2]))
        )
        return future


@pytest.mark.parametrize(("per_slot", "slots"), [(100, 300), (1000, 30)])
async def test_one_script_call_reads_a_thousand_entries_and_one_slot_at_most(
    redis_url: str, redis_sync: redis.Redis, per_slot: int, slots: int
) -> None:
    """Redis runs nothing else during a call, ~1-3 µs an entry: a call stops once it holds
    1,000 entries (after the slot that reached them), the rest sent again. At 10,000 entries a
    call, slots full of due entries with long names blocked Redis 10-28 ms a call."""
    name = "n" * 120
    for s in range(slots):  # neighbours: the same chunk of 256 slots
        members = {
            f'["t","{name}{s:04}","{name}{i:05}"]': NOW - per_slot + i for i in range(per_slot)
        }
        redis_sync.zadd(relay_queue(s), members)
    client = connect(redis_url, timeout=5, max_connections=4)
    batcher = CountingBatcher(client)
    try:
        got = await due_in_slots(batcher, relay_queue, NOW, per_slot)
    finally:
        await batcher.aclose()
        await client.aclose()
    assert got == expected(redis_sync, per_slot)
    assert sum(len(rows) for _, rows in got) == slots * per_slot
    assert batcher.entries and max(batcher.entries) <= 1000 + per_slot - 1
