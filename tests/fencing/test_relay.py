"""Async effects (Prefer: respond-async): recorded under the fence, performed by a relay."""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter
from typing import Any

from gateway.core.intents import intent_digest
from gateway.fencing.relay import Relay
from gateway.http import appkeys as K
from gateway.store.keys import MARKER, JobKeys
from tests.conftest import Gateway, Upstream

ASYNC = {"Prefer": "respond-async"}


async def wait_state(gw: Gateway, step: str, want: str, job: str = "r") -> dict[str, Any]:
    for _ in range(300):
        resp = await gw.client.get(f"/v1/jobs/{job}/effects/{step}")
        if resp.status == 200:
            view = await resp.json()
            if view["state"] == want:
                return dict(view)
        await asyncio.sleep(0.02)
    raise AssertionError(f"{job}:{step} never reached {want}")


async def test_accepted_then_performed_by_the_relay(gw: Gateway, upstream: Upstream) -> None:
    await gw.register("r", generation=1)
    resp = await gw.effect("r", "notify", 1, headers=ASYNC)
    body = await resp.json()
    assert resp.status == 202, body
    assert resp.headers["Location"] == "/v1/jobs/r/effects/notify" == body["location"]
    assert resp.headers["Preference-Applied"] == "respond-async"
    assert body["state"] in ("pending", "dispatching") and body["idempotency_key"] == "r:notify"
    view = await wait_state(gw, "notify", "succeeded")
    assert view["result"]["status"] == 200
    assert [r.headers["Idempotency-Key"] for r in upstream.received] == ["r:notify"]
    # a later synchronous call replays it
    replay = await gw.effect("r", "notify", 1)
    assert replay.status == 200 and (await replay.json())["replayed"] is True


async def test_stale_async_call_is_refused_and_never_relayed(
    gw: Gateway, upstream: Upstream, redis_sync: Any
) -> None:
    await gw.register("r", generation=2)
    resp = await gw.effect("r", "notify", 1, headers=ASYNC)
    assert resp.status == 409 and (await resp.json())["code"] == "stale_generation"
    # a rejected call never touches the relay's queues (they are written by the admit itself)
    assert redis_sync.keys("fg:rq:*") == [] and redis_sync.keys("fg:relay:*") == []
    await asyncio.sleep(0.3)
    assert upstream.received == []
    assert (await gw.client.get("/v1/jobs/r/effects/notify")).status == 404


async def test_async_repeats_are_accepted_once_dispatched_once(
    gw: Gateway, upstream: Upstream
) -> None:
    await gw.register("r", generation=1)
    upstream.hold()
    first = await gw.effect("r", "notify", 1, headers=ASYNC)
    await upstream.arrived.wait()
    again = await gw.effect("r", "notify", 1, headers=ASYNC)
    assert (first.status, again.status) == (202, 202)
    assert (await again.json())["state"] == "dispatching"
    sync = await gw.effect("r", "notify", 1)  # a synchronous caller waits for the relay's dispatch
    assert sync.status == 409 and (await sync.json())["code"] == "effect_in_progress"
    upstream.gate.set()
    await wait_state(gw, "notify", "succeeded")
    assert len(upstream.received) == 1


async def test_released_step_is_retried_by_the_relay(gw: Gateway, upstream: Upstream) -> None:
    await gw.register("r", generation=1)
    upstream.behaviour = 429  # not processed (a 503 would be unknown: a proxy may answer it)
    assert (await gw.effect("r", "notify", 1, headers=ASYNC)).status == 202
    await upstream.arrived.wait()
    await wait_state(gw, "notify", "released")
    upstream.behaviour = "ok"
    await wait_state(gw, "notify", "succeeded")
    assert len(upstream.received) == 2 and {
        r.headers["Idempotency-Key"] for r in upstream.received
    } == {"r:notify"}


async def test_relays_in_two_gateways_never_dispatch_a_step_twice(
    make_gateway: Any, upstream: Upstream
) -> None:
    a: Gateway = await make_gateway()
    b: Gateway = await make_gateway()
    upstream.delay = 0.01
    jobs = [f"j{i}" for i in range(60)]
    for job in jobs:
        await a.register(job, generation=1)
    calls = [
        (a if i % 2 else b).effect(job, "notify", 1, headers=ASYNC) for i, job in enumerate(jobs)
    ]
    assert {r.status for r in await asyncio.gather(*calls)} == {202}
    for job in jobs:
        await wait_state(a, "notify", "succeeded", job=job)
    per_key = Counter(r.headers["Idempotency-Key"] for r in upstream.received)
    assert set(per_key.values()) == {1} and len(per_key) == 60


async def test_a_stopped_relay_always_stops(gw: Gateway) -> None:
    """Shutdown stops the relay loop (Relay.stop + cancel, as the app's cleanup does) and
    waits for it; it must stop every time, wherever the loop is. Cancellation alone did not
    (a cancel landing as the idle wait timed out became a TimeoutError the loop swallowed;
    one landing in redis-py's pool wait was held there): the app's cleanup hung, ~1 in 6
    test runs, until the loop also checked a stop flag."""
    dispatcher = gw.app[K.SERVICE].dispatcher
    rng = random.Random(20261130)
    for _ in range(300):
        loop = Relay(gw.app[K.STORE], dispatcher, gw.app[K.METRICS])
        relay = asyncio.create_task(loop.run(interval=0.001))
        await asyncio.sleep(rng.uniform(0, 0.004))
        loop.stop()
        relay.cancel()
        done, _ = await asyncio.wait({relay}, timeout=4)
        assert relay in done, "the relay did not stop"


async def test_a_queued_step_whose_hint_was_lost_is_found_by_the_sweep(
    make_gateway: Any, upstream: Upstream
) -> None:
    """The admit queues the step in its slot's queue, atomically; on a Cluster the tenant's
    hint is written after it, and a gateway that dies in between leaves a step with no hint
    (here the script writes it: removed by hand, as a hint of an older gateway lost so). The
    relay's sweep of every slot's queue finds it."""
    gw: Gateway = await make_gateway(fencing={"relay_sweep_seconds": 0.3})
    store = gw.app[K.STORE]
    keys = JobKeys("default", "early")
    await gw.register("early", generation=1)
    payload = {"to": "a@example.com"}
    verdict = await store.admit(
        keys, "notify", generation=1, intent_sha256=intent_digest("hook", "send", payload),
        adapter="hook", operation="send", worker_id="", resolvable=False,
        payload_json=json.dumps(payload),
    )  # fmt: skip
    assert verdict.state == "pending"
    await store.relay_unhint(keys, "notify")  # before the relay polls: it sleeps 0.25 s
    view = await wait_state(gw, "notify", "succeeded", job="early")
    assert view["attempts"] == 1
    assert [r.headers["Idempotency-Key"] for r in upstream.received] == ["early:notify"]


async def test_a_step_whose_claim_gets_no_verdict_is_not_picked_again_at_once(
    gw: Gateway,
) -> None:
    """A hint stays due while its claim gets no verdict (its slot unavailable, or behind what
    this gateway saw): the relay waits before picking it again (doubling, up to 5 s) instead of
    re-claiming it on every turn of its loop."""
    await gw.register("r", generation=1)
    resp = await gw.effect("r", "notify", 1, adapter="dead", headers={"Prefer": "respond-async"})
    assert resp.status == 202
    await wait_state(gw, "notify", "released")  # tried once; due again in 1 s
    store = gw.app[K.STORE]
    store.link.slot_seen[JobKeys("default", "r").slot] = 2**62  # every script there: "behind"
    # the relay's next claim meets the slot "behind": the gateway quarantines Redis (its
    # markers deleted, ~4,100 commands at once); from then on every claim gets no verdict
    for _ in range(100):
        if not await store.link.client.exists(MARKER):
            break
        await asyncio.sleep(0.1)
    else:
        raise AssertionError("the claim never met the slot behind what the gateway saw")
    await asyncio.sleep(1.0)  # the quarantine's own deletes go out
    before = store.batcher.commands
    await asyncio.sleep(2.0)
    sent = store.batcher.commands - before
    # a claim per backoff step (0.25, 0.5, 1 s) and the loop's idle polls; not one per turn
    assert sent < 100, f"{sent} Redis commands in 2 s for one step that cannot be claimed"


async def test_a_completed_jobs_queued_step_is_released_not_retried_forever(
    gw: Gateway, upstream: Upstream, redis_sync: Any
) -> None:
    """An async step the downstream refused is retried by the relay; once the job completes it
    takes no new dispatch: the next claim releases the step (audited `job_completed`) and the
    relay stops sending it."""
    await gw.register("r", generation=1)
    upstream.behaviour = 429  # refused: not processed, released and retried
    assert (await gw.effect("r", "notify", 1, headers=ASYNC)).status == 202
    await upstream.arrived.wait()
    await wait_state(gw, "notify", "released")
    done = await gw.client.post(
        "/v1/jobs/r/complete", json={"result": {"ok": True}}, headers={"Fencing-Token": "1"}
    )
    assert done.status in (200, 201), await done.text()
    keys = JobKeys("default", "r")
    for _ in range(250):  # the relay's next turn (retry delay ~1 s)
        if redis_sync.zscore(keys.relayq, keys.member("notify")) is None:
            break
        await asyncio.sleep(0.02)
    else:
        raise AssertionError("the completed job's step stayed queued")
    sent = len(upstream.received)
    upstream.behaviour = "ok"
    await asyncio.sleep(2.5)  # two more retry turns, had it stayed queued
    assert len(upstream.received) == sent, "the relay sent a step of a completed job"
    view = await (await gw.client.get("/v1/jobs/r/effects/notify")).json()
    assert view["state"] == "released"
    reasons = [e.get("reason") for e in await gw.audit(job_id="r")]
    assert "job_completed" in reasons
