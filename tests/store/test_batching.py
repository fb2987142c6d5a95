"""The auto-pipeline (gateway.store.batching) against a real redis-server: one write per tick, and
per-command semantics — own reply, own error, NOSCRIPT, cancelled callers, dropped connections,
timeouts — exactly as if each command had been sent alone."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.store.batching import MAX_BATCH, Batcher
from gateway.store.store import connect

ECHO = "redis.call('INCR', KEYS[2]) return {KEYS[1], ARGV[1]}"
MAYBE_FAIL = (
    "if ARGV[1] == 'fail' then return redis.error_reply('ERR boom ' .. KEYS[1]) end " + ECHO
)
# Busy for ARGV[2] ms (Redis TIME), counting runs in KEYS[2].
SLOW = """
redis.call('INCR', KEYS[2])
local t = redis.call('TIME')
local start = t[1] * 1000 + math.floor(t[2] / 1000)
while true do
  t = redis.call('TIME')
  if t[1] * 1000 + math.floor(t[2] / 1000) - start >= tonumber(ARGV[2]) then break end
end
return {KEYS[1], ARGV[1]}
"""


def sha(source: str) -> str:
    return hashlib.sha1(source.encode()).hexdigest()


@contextlib.asynccontextmanager
async def batcher_on(
    url: str, *, max_connections: int, redis_timeout: float = 5
) -> AsyncIterator[Batcher]:
    client = connect(url, timeout=redis_timeout, max_connections=max_connections)
    batcher = Batcher(client)
    try:
        yield batcher
    finally:
        await batcher.aclose()
        await client.aclose()


@pytest.fixture
def counter() -> str:
    return f"batch-test:{uuid.uuid4().hex}"


async def test_one_tick_is_one_write_and_every_caller_gets_its_own_reply(
    redis_url: str, redis_sync: redis.Redis, counter: str
) -> None:
    redis_sync.script_load(ECHO)
    async with batcher_on(redis_url, max_connections=4) as batcher:
        n = 600  # more than MAX_BATCH: split into several writes in the same tick
        futures = [
            batcher.evalsha(sha(ECHO), ECHO, [f"k{i}", counter], [f"v{i}"]) for i in range(n)
        ]
        replies = await asyncio.gather(*futures)
        assert replies == [[f"k{i}", f"v{i}"] for i in range(n)]
        assert batcher.commands == n
        assert batcher.batches == -(-n // MAX_BATCH)  # ceil: 3 writes for 600 commands
        assert int(redis_sync.get(counter)) == n  # each ran exactly once
        # one more call alone: its own batch, in the next tick, no waiting
        assert await batcher.evalsha(sha(ECHO), ECHO, ["x", counter], ["y"]) == ["x", "y"]
        assert batcher.batches == -(-n // MAX_BATCH) + 1


async def test_an_error_reply_belongs_to_its_own_command_only(
    redis_url: str, redis_sync: redis.Redis, counter: str
) -> None:
    async with batcher_on(redis_url, max_connections=2) as batcher:
        futures = [
            batcher.evalsha(
                sha(MAYBE_FAIL), MAYBE_FAIL, [f"k{i}", counter], ["fail" if i % 3 == 0 else "ok"]
            )
            for i in range(30)
        ]
        futures.append(batcher.execute("SET", f"{counter}:plain", "v"))
        got = await asyncio.gather(*futures, return_exceptions=True)
        for i, reply in enumerate(got[:30]):
            if i % 3 == 0:
                assert isinstance(reply, ResponseError) and f"boom k{i}" in str(reply)
            else:
                assert reply == [f"k{i}", "ok"]
        assert got[30] == "OK" and redis_sync.get(f"{counter}:plain") == "v"
        assert int(redis_sync.get(counter)) == 20  # the failing ones changed nothing


async def test_noscript_is_answered_by_eval_and_loads_the_script_again(
    redis_url: str, redis_sync: redis.Redis, counter: str
) -> None:
    source = ECHO + f" -- {uuid.uuid4().hex}"  # a script Redis has never seen
    async with batcher_on(redis_url, max_connections=2) as batcher:
        futures = [
            batcher.evalsha(sha(source), source, [f"k{i}", counter], ["v"]) for i in range(40)
        ]
        futures += [batcher.execute("PING")]
        got = await asyncio.gather(*futures)
        assert got[:40] == [[f"k{i}", "v"] for i in range(40)] and got[40] in ("PONG", True)
        assert int(redis_sync.get(counter)) == 40
        assert redis_sync.script_exists(sha(source)) == [True]


async def test_cancelled_callers_do_not_desynchronise_the_connection(
    redis_url: str, redis_sync: redis.Redis, counter: str
) -> None:
    redis_sync.script_load(SLOW)
    async with batcher_on(
        redis_url, max_connections=1
    ) as batcher:  # one connection: any skew shows

        async def call(i: int) -> Any:
            return await batcher.evalsha(sha(SLOW), SLOW, [f"k{i}", counter], [f"v{i}", "5"])

        tasks = [asyncio.create_task(call(i)) for i in range(20)]
        await asyncio.sleep(0.02)  # the batch is sent and Redis is busy with it
        for t in tasks[::2]:
            t.cancel()
        done = await asyncio.gather(*tasks, return_exceptions=True)
        assert all(isinstance(d, asyncio.CancelledError) for d in done[::2])
        assert done[1::2] == [[f"k{i}", f"v{i}"] for i in range(1, 20, 2)]
        # the same single connection answers the next batch in step
        after = await asyncio.gather(*(call(100 + i) for i in range(10)))
        assert after == [[f"k{100 + i}", f"v{100 + i}"] for i in range(10)]
        assert int(redis_sync.get(counter)) == 30  # cancelled callers' commands still ran once


async def test_a_dropped_connection_resends_only_the_commands_without_a_reply(
    redis_url: str, redis_sync: redis.Redis, counter: str
) -> None:
    redis_sync.script_load(ECHO)
    killer = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        async with batcher_on(redis_url, max_connections=1) as batcher:
            await batcher.execute("CLIENT", "SETNAME", "victim")
            assert await batcher.evalsha(sha(ECHO), ECHO, ["a", counter], ["1"]) == ["a", "1"]
            killer.execute_command("CLIENT", "PAUSE", "300", "WRITE")  # scripts wait, KILL not
            pending = batcher.evalsha(sha(ECHO), ECHO, ["b", counter], ["2"])
            await asyncio.sleep(0.05)  # sent, held by the pause
            (victim,) = [c for c in killer.client_list() if c["name"] == "victim"]
            assert killer.client_kill_filter(_id=victim["id"]) == 1  # the reply can never come
            assert await pending == ["b", "2"]  # re-sent on a new connection, answered
            assert int(redis_sync.get(counter)) == 2  # "a" was not re-sent; "b" ran once
    finally:
        killer.execute_command("CLIENT", "UNPAUSE")
        killer.close()


async def test_a_timeout_fails_the_batch_without_resending_and_the_next_batch_works(
    redis_url: str, redis_sync: redis.Redis, counter: str
) -> None:
    redis_sync.script_load(SLOW)
    async with batcher_on(redis_url, max_connections=1, redis_timeout=0.2) as batcher:
        futures = [
            batcher.evalsha(sha(SLOW), SLOW, [f"k{i}", counter], ["v", "150"]) for i in range(3)
        ]
        got = await asyncio.gather(*futures, return_exceptions=True)
        assert any(isinstance(g, RedisTimeoutError) for g in got)
        await asyncio.sleep(0.5)  # let Redis finish what it was given
        assert int(redis_sync.get(counter)) == 3  # what was sent ran once; nothing re-sent
        assert await batcher.evalsha(sha(ECHO), ECHO, ["z", counter], ["ok"]) == ["z", "ok"]


async def test_concurrent_effect_calls_share_pipelined_writes(gw: Any) -> None:
    """Through the gateway: 50 simultaneous calls need far fewer writes than commands."""
    for i in range(50):
        assert (await gw.register(f"bt{i}", generation=1)).status == 201
    metrics = (await (await gw.client.get("/metrics")).text()).splitlines()

    def value(name: str) -> float:
        return float(next(m.split()[1] for m in metrics if m.startswith(name + " ")))

    batches0, commands0 = (
        value("fencegate_redis_batches_total"),
        value("fencegate_redis_commands_total"),
    )
    responses = await asyncio.gather(*(gw.effect(f"bt{i}", "s", 1) for i in range(50)))
    assert [r.status for r in responses] == [200] * 50
    metrics = (await (await gw.client.get("/metrics")).text()).splitlines()
    batches = value("fencegate_redis_batches_total") - batches0
    commands = value("fencegate_redis_commands_total") - commands0
    assert commands >= 100  # an admit and a record each
    assert batches <= commands / 4, (batches, commands)
