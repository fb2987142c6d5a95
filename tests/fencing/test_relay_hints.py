"""The relay's per-tenant hints on a standalone Redis: written by the scripts that write the
slot's queue, in the same atomic step (includes/relayq), so a tenant's hints are exactly its
queued steps with their scores: none lost in a crash after the admit, none left behind, and
another tenant's backlog in the same slot cannot hide one (the sweep reads a page a slot)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import redis

from gateway.core.intents import intent_digest
from gateway.http import appkeys as K
from gateway.store.keys import RELAY_TENANTS, JobKeys, key_slot, relay_hint
from tests.conftest import Gateway, Upstream


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
