"""The relay's per-tenant hints on a standalone Redis: written by the scripts that write the
slot's queue, in the same atomic step (includes/relayq), so a tenant's hints are exactly its
queued steps with their scores: none lost in a crash after the admit, none left behind, and
another tenant's backlog in the same slot cannot hide one (the sweep reads a page a slot).
And under the races the scripts do not see: a claim whose reply was lost and was given up
(void-5), a claim that found the step held by another relay while that relay queued it again,
and the sweep writing a hint it read before a claim."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import redis

from gateway.core.errors import StoreUnavailable
from gateway.core.intents import intent_digest
from gateway.http import appkeys as K
from gateway.store import relayq
from gateway.store.keys import RELAY_TENANTS, JobKeys, key_slot, relay_hint
from tests.conftest import Gateway, Upstream
from tests.support.wire import WireProxy


async def _admit_async(
    store: Any, keys: JobKeys, step: str, payload: dict[str, Any], adapter: str = "hook"
) -> str:
    """The admit alone, as a gateway that dies right after it leaves it: no hint from Python."""
    verdict = await store.admit(
        keys, step, generation=1, intent_sha256=intent_digest(adapter, "send", payload),
        adapter=adapter, operation="send", worker_id="w", resolvable=False,
        payload_json=json.dumps(payload),
    )  # fmt: skip
    return str(verdict.state)


def _jobs_in_slot(tenant: str, slot: int, n: int) -> list[str]:
    found: list[str] = []
    i = 0
    while len(found) < n:
        job = f"j{i}"
        if key_slot(f"{tenant}/{job}") == slot:
            found.append(job)
        i += 1
    return found


def _snapshot(r: redis.Redis, keys: JobKeys) -> tuple[dict[str, float], dict[str, float]]:
    """The slot's queue entries of the tenant and the tenant's hints, read atomically."""
    pipe = r.pipeline(transaction=True)
    pipe.zrange(keys.relayq, 0, -1, withscores=True)
    pipe.zrange(relay_hint(keys.tenant), 0, -1, withscores=True)
    queue, hints = pipe.execute()
    mine = {m: sc for m, sc in queue if json.loads(m)[0] == keys.tenant}
    return mine, dict(hints)


async def _until_state(r: redis.Redis, keys: JobKeys, step: str, want: str) -> None:
    for _ in range(500):
        if r.hget(keys.effect(step), "state") == want:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{keys.job_id}:{step} never reached {want}")


async def test_a_tenants_hints_follow_its_queued_steps_through_claim_retry_and_outcome(
    make_gateway: Any, redis_sync: redis.Redis, upstream: Upstream
) -> None:
    """At every stage the tenant's hints are its queue entries, member and score: queued by
    the admit, re-scored by the claim (its deadline), queued again by an attempt known not
    delivered, gone with the outcome."""
    # the sweep runs once, at start: nothing here comes from it
    gw: Gateway = await make_gateway(fencing={"relay_sweep_seconds": 3600})
    store = gw.app[K.STORE]
    keys = JobKeys("default", "h")
    await gw.register("h", generation=1)
    hold = upstream.hold()
    assert await _admit_async(store, keys, "s", {"n": 1}) == "pending"
    queue, hints = _snapshot(redis_sync, keys)
    assert list(queue) == [keys.member("s")] and hints == queue
    assert "default" in redis_sync.smembers(RELAY_TENANTS)
    await asyncio.wait_for(upstream.arrived.wait(), 10)  # claimed: dispatching
    claimed, hints = _snapshot(redis_sync, keys)
    assert claimed[keys.member("s")] > queue[keys.member("s")]  # scored by its deadline
    assert hints == claimed
    hold.set()
    await _until_state(redis_sync, keys, "s", "succeeded")
    assert _snapshot(redis_sync, keys) == ({}, {})
    # `dead`: connection refused, known not delivered: released and queued again, each time
    assert await _admit_async(store, keys, "r", {"n": 2}, adapter="dead") == "pending"
    await _until_state(redis_sync, keys, "r", "released")
    for _ in range(50):  # across claims and retries, at any instant
        queue, hints = _snapshot(redis_sync, keys)
        assert list(queue) == [keys.member("r")] and hints == queue
        await asyncio.sleep(0.05)
    # cancelled: the next claim releases it and takes it out of the queue, hint and all
    assert (await gw.client.post("/v1/jobs/h/cancel")).status == 200
    for _ in range(200):
        if _snapshot(redis_sync, keys) == ({}, {}):
            break
        await asyncio.sleep(0.02)
    assert _snapshot(redis_sync, keys) == ({}, {})


async def test_a_step_queued_behind_another_tenants_backlog_in_its_slot_is_not_hidden(
    make_gateway: Any, redis_sync: redis.Redis, upstream: Upstream
) -> None:
    """The attack the sweep's page lost to: tenant `a` keeps 150 due steps (hinted; a
    downstream that does not answer) in the slot of tenant `default`'s job, whose gateway died
    after its admit. The sweep reads the first 100 due entries of a slot, every 0.5 s here:
    all `a`'s. The step is hinted by its admit: it is sent while `a`'s backlog waits."""
    gw: Gateway = await make_gateway(
        fencing={"relay_sweep_seconds": 0.5},
        adapters={"hook": {"type": "webhook", "url": upstream.url, "timeout_seconds": 60}},
    )
    store = gw.app[K.STORE]
    victim = JobKeys("default", "v")
    await gw.register("v", generation=1)
    gate = upstream.hold()  # `a`'s first 16 sends wait (the relay takes 16 of a tenant at once)
    try:
        backlog = _jobs_in_slot("a", victim.slot, 150)
        for job in backlog:
            await store.register(JobKeys("a", job), 1, None)
        for job in backlog:  # admitted and hinted: their gateway lived
            assert await _admit_async(store, JobKeys("a", job), "s", {"job": job}) == "pending"
            await store.relay_hint(JobKeys("a", job), "s", int(time.time() * 1000))
        assert await _admit_async(store, victim, "s", {"to": "victim"}) == "pending"
        started = time.monotonic()
        for _ in range(500):
            if any(r.headers["Idempotency-Key"] == "v:s" for r in upstream.received):
                break
            await asyncio.sleep(0.02)
        waited = time.monotonic() - started
        assert any(r.headers["Idempotency-Key"] == "v:s" for r in upstream.received), (
            f"the victim's step was not sent in {waited:.1f} s"
        )
        assert len(upstream.received) == 17  # `a`'s 16 held, and the victim's
    finally:
        gate.set()


def _sent(upstream: Upstream, key: str) -> int:
    return sum(1 for r in upstream.received if r.headers.get("Idempotency-Key") == key)


async def test_a_relay_claim_given_up_after_its_reply_was_lost_is_claimed_again_at_once(
    make_gateway: Any, redis_sync: redis.Redis, upstream: Upstream
) -> None:
    """The claim ran (the step dispatching, queued at its deadline, the hint with it) and its
    reply was lost three times: the relay gives it up (void-5: released, nothing was sent).
    The step is relayed again at once, not only at the lost claim's deadline (30 s)."""
    gw: Gateway = await make_gateway(fencing={"relay_sweep_seconds": 3600})
    store = gw.app[K.STORE]
    real = store.relay_claim
    lost: list[str] = []

    async def lossy(keys: JobKeys, step: str, *args: Any, **kw: Any) -> Any:
        got = await real(keys, step, *args, **kw)
        if len(lost) < 3:  # the first send and its two re-sends: no reply
            lost.append(step)
            exc = StoreUnavailable("the reply was lost")
            exc.maybe_applied = True
            raise exc
        return got

    store.relay_claim = lossy
    keys = JobKeys("default", "v")
    await gw.register("v", generation=1)
    assert await _admit_async(store, keys, "s", {"n": 1}) == "pending"
    started = time.monotonic()
    for _ in range(400):
        if _sent(upstream, "v:s"):
            break
        await asyncio.sleep(0.02)
    assert len(lost) == 3
    assert _sent(upstream, "v:s") == 1, (
        f"not sent in {time.monotonic() - started:.1f} s after its claim was given up; "
        f"queue and hints: {_snapshot(redis_sync, keys)}, "
        f"state {redis_sync.hget(keys.effect('s'), 'state')}"
    )


async def test_a_claim_that_found_the_step_held_leaves_the_hint_of_its_retry_alone(
    make_gateway: Any, redis_sync: redis.Redis
) -> None:
    """A relay read the step's hint, another claimed it first: its claim answers 'held until
    the deadline' (30 s). Before it writes anything more, the holder's send is refused (known
    not delivered) and the step is queued again for a retry in 1 s, hint and all. The late
    relay must not move the hint to the old deadline: the hint stays the queue entry, and the
    retry is attempted within a few seconds."""
    gw: Gateway = await make_gateway(fencing={"relay_sweep_seconds": 3600})
    store = gw.app[K.STORE]
    relay = gw.app[K.SERVICE].relay
    recording, go, late_claimed, late_write = (asyncio.Event() for _ in range(4))
    real_claim, real_record = store.relay_claim, store.record
    records: list[str] = []
    late: asyncio.Task[bool] | None = None

    async def slow_claim(*args: Any, **kw: Any) -> Any:
        got = await real_claim(*args, **kw)
        if asyncio.current_task() is late:  # what it does next waits for the re-queue
            late_claimed.set()
            await late_write.wait()
        return got

    async def slow_record(*args: Any, **kw: Any) -> Any:
        records.append(args[3])
        recording.set()
        await go.wait()
        return await real_record(*args, **kw)

    store.relay_claim, store.record = slow_claim, slow_record
    keys = JobKeys("default", "h")
    await gw.register("h", generation=1)
    assert await _admit_async(store, keys, "s", {"n": 1}, adapter="dead") == "pending"
    await asyncio.wait_for(recording.wait(), 10)  # claimed, refused: its record waits
    late = asyncio.create_task(relay._relay_step(keys, "s"))  # the other relay: held
    await asyncio.wait_for(late_claimed.wait(), 10)
    go.set()
    for _ in range(500):
        if redis_sync.hget(keys.effect("s"), "state") == "released":
            break
        await asyncio.sleep(0.01)
    assert redis_sync.hget(keys.effect("s"), "state") == "released"
    late_write.set()
    assert await late
    queue, hints = _snapshot(redis_sync, keys)
    for _ in range(300):
        if len(records) >= 2:
            break
        await asyncio.sleep(0.02)
    assert hints == queue, "the late relay moved the hint away from the queue entry"
    assert len(records) >= 2, "the retry was not attempted"


async def test_the_sweep_does_not_move_the_hint_of_a_step_claimed_after_it_read_the_queue(
    make_gateway: Any, redis_sync: redis.Redis, upstream: Upstream, monkeypatch: Any
) -> None:
    """The sweep read a due queue entry; before it wrote the hint, the relay claimed the step
    (entry and hint scored by the claim's deadline). The sweep must not write the hint back
    at the score it read: the hint stays the queue entry (else the relay claims the held step
    again, and the hint is off until the claim's deadline)."""
    gw: Gateway = await make_gateway(fencing={"relay_sweep_seconds": 3600})
    store = gw.app[K.STORE]
    real_due = relayq.due_in_slots

    async def due_then_claimed(*args: Any, **kw: Any) -> Any:
        found = await real_due(*args, **kw)
        await asyncio.wait_for(upstream.arrived.wait(), 10)  # claimed meanwhile
        return found

    gate = upstream.hold()
    try:
        keys = JobKeys("default", "w")
        await gw.register("w", generation=1)
        gw.app[K.SERVICE].relay.stop()  # this test claims the step, after the sweep's read
        assert await _admit_async(store, keys, "s", {"n": 1}) == "pending"
        monkeypatch.setattr(relayq, "due_in_slots", due_then_claimed)
        sweep = asyncio.create_task(store.sweep(int(time.time() * 1000) + 10))
        await asyncio.sleep(0.3)  # the sweep has read the queue: now the claim
        claim = await store.relay_claim(keys, "s")
        assert not isinstance(claim, int | str)
        upstream.arrived.set()
        assert await sweep >= 1
        queue, hints = _snapshot(redis_sync, keys)
        assert queue[keys.member("s")] == claim.deadline_ms
        assert hints == queue, "the sweep moved the hint back to the score it read"
    finally:
        gate.set()


async def test_the_sweep_restores_a_hint_removed_by_hand_at_its_queue_entrys_score(
    make_gateway: Any, redis_sync: redis.Redis
) -> None:
    """On a standalone Redis the sweep's only find: a queued step whose hint was removed by
    hand is hinted again, at its queue entry's score; a hinted step's hint is left as it is."""
    gw: Gateway = await make_gateway(fencing={"relay_sweep_seconds": 3600})
    store = gw.app[K.STORE]
    gw.app[K.SERVICE].relay.stop()
    keys = JobKeys("default", "x")
    await gw.register("x", generation=1)
    assert await _admit_async(store, keys, "s", {"n": 1}) == "pending"
    assert await _admit_async(store, keys, "t", {"n": 2}) == "pending"
    before = _snapshot(redis_sync, keys)
    redis_sync.zrem(relay_hint("default"), keys.member("s"))
    assert await store.sweep(int(time.time() * 1000) + 10) == 2
    assert _snapshot(redis_sync, keys) == before


async def test_a_relay_claim_whose_reply_the_wire_lost_is_relayed_again_within_seconds(
    make_gateway: Any, upstream: Upstream, wire: WireProxy
) -> None:
    """The same on a real wire: the claim's reply is lost and Redis refuses connections for
    a second (the claim's re-sends fail, its void waits for Redis): once Redis answers, the
    void releases the step and the step is sent, not only at the lost claim's deadline."""
    gw: Gateway = await make_gateway(redis={"url": wire.url}, fencing={"relay_sweep_seconds": 3600})
    await gw.register("q", generation=1)
    sha = gw.app[K.STORE].link.script_shas["relay-6"].encode()
    lost = wire.on_reply_to(sha, "lose_and_refuse", seconds=1.0)
    resp = await gw.effect("q", "s", 1, headers={"Prefer": "respond-async"})
    assert resp.status == 202, await resp.text()
    for _ in range(300):
        if _sent(upstream, "q:s"):
            break
        await asyncio.sleep(0.02)
    assert lost.fired.is_set()
    assert _sent(upstream, "q:s") == 1, "not sent within 6 s of its lost claim"
