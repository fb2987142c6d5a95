"""Quotas are charged after the verdict (gateway.fencing.quotas through the effect service's
admission hook): only admitted and queued calls spend the effects quota; replays and "in
progress" answers are never charged nor refused; rejections have their own counter and cap.
Real Redis, the real app over HTTP."""

from __future__ import annotations

import asyncio
import hashlib
import time
from typing import Any

import pytest

from gateway.http import appkeys as K
from gateway.store import quota_counters
from gateway.store.quota_counters import QuotaCounters
from gateway.store.scripts import lua_source
from tests.support.calls import put_checkpoint
from tests.support.wire import WireProxy


async def test_a_zombie_flood_cannot_spend_the_live_workers_quota(make_gateway: Any) -> None:
    gw = await make_gateway(quotas={"effects_per_window": 4})
    assert (await gw.register("j", generation=1)).status == 201
    assert (await gw.effect("j", "notify", 1)).status == 200  # generation 1 delivers notify
    assert (await gw.register("j", generation=2)).status == 201
    for _ in range(3):  # the zombie: generation 1 goes on calling
        stale = await gw.effect("j", "other", 1, worker_id="zombie")
        assert stale.status == 409, await stale.text()
        assert (await stale.json())["code"] == "stale_generation"
    replay = await gw.effect("j", "notify", 2)
    assert replay.status == 200, await replay.text()
    assert (await replay.json())["replayed"] is True
    following = await gw.effect("j", "next", 2)
    assert following.status == 200, await following.text()


async def test_a_replay_is_never_refused_by_a_quota(make_gateway: Any) -> None:
    gw = await make_gateway(quotas={"effects_per_window": 2})
    assert (await gw.register("j", generation=1)).status == 201
    assert (await gw.effect("j", "s1", 1)).status == 200
    assert (await gw.effect("j", "s2", 1)).status == 200
    over = await gw.effect("j", "s3", 1)
    assert over.status == 429, await over.text()
    assert (await over.json())["quota"] == "effects_per_window"
    # nothing of s3 was stored or sent
    assert (await gw.client.get("/v1/jobs/j/effects/s3", headers=gw.headers)).status == 404
    for step in ("s1", "s2", "s1"):  # past the cap, replays are answered as before
        replay = await gw.effect("j", step, 1)
        assert replay.status == 200, await replay.text()
        assert (await replay.json())["replayed"] is True
    # a rejection past the cap is still the fence's answer, not the quota's
    mismatch = await gw.effect("j", "s1", 1, payload={"to": "someone-else@example.com"})
    assert mismatch.status == 422, await mismatch.text()


async def test_an_async_repeat_is_never_refused_by_the_payload_quota(
    make_gateway: Any,
) -> None:
    gw = await make_gateway(quotas={"payload_bytes": 30_000})
    gw.app[K.SERVICE].relay.stop()  # the steps stay queued ('pending')
    assert (await gw.register("j", generation=1)).status == 201
    blob = {"blob": "x" * 20_000}
    async_ = {"Prefer": "respond-async"}
    first = await gw.effect("j", "p1", 1, adapter="dead", payload=blob, headers=async_)
    assert first.status == 202, await first.text()
    over = await gw.effect("j", "p2", 1, adapter="dead", payload=blob, headers=async_)
    assert over.status == 429 and (await over.json())["quota"] == "payload_bytes"
    repeat = await gw.effect("j", "p1", 1, adapter="dead", payload=blob, headers=async_)
    assert repeat.status == 202, await repeat.text()


async def test_rejections_past_their_cap_are_answered_and_counted_but_not_audited(
    make_gateway: Any,
) -> None:
    gw = await make_gateway(quotas={"effects_per_window": 10, "rejections_per_window": 2})
    assert (await gw.register("j", generation=2)).status == 201
    for _ in range(5):
        stale = await gw.effect("j", "s", 1, worker_id="zombie")
        assert stale.status == 409 and (await stale.json())["code"] == "stale_generation"
    audited = [e for e in await gw.audit() if e["reason"] == "stale_generation"]
    assert len(audited) == 2
    metrics = (await (await gw.client.get("/metrics")).text()).splitlines()
    counted = {
        line.split("{")[1].split("}")[0]: float(line.rsplit(" ", 1)[1])
        for line in metrics
        if line.startswith("fencegate_quota_rejections_total{")
    }
    assert counted == {'audited="true",tenant="default"': 2.0,
                       'audited="false",tenant="default"': 3.0}  # fmt: skip
    # the live worker's effects quota is untouched by the flood
    for step in ("a", "b", "c"):
        assert (await gw.effect("j", step, 2)).status == 200


async def test_the_rejections_cap_is_exact_for_concurrent_calls_through_two_gateways(
    make_gateway: Any, redis_sync: Any
) -> None:
    """On a standalone Redis each fenced script counts its rejection in the same atomic step
    as its decision: however many calls race through however many gateways, exactly the cap's
    worth are audited, and every other one is answered 409 all the same (a process deciding
    from its own view of the count lets every call in flight through before a count comes
    back)."""
    cap = 5
    a = await make_gateway(quotas={"rejections_per_window": cap})
    b = await make_gateway(quotas={"rejections_per_window": cap})
    assert (await a.register("j", generation=2)).status == 201

    async def stale(gw: Any, n: int) -> int:
        if n % 4 == 3:  # a heartbeat's rejection shares the cap
            resp = await gw.heartbeat("j", 1)
        else:
            resp = await gw.effect("j", f"s{n}", 1, worker_id="zombie")
        assert (resp.status, (await resp.json())["code"]) == (409, "stale_generation")
        return resp.status

    await asyncio.gather(*(stale(gw, n) for n in range(24) for gw in (a, b)))
    chain = [f for _, f in redis_sync.xrange("fg:{default/j}:audit")]
    assert [e["reason"] for e in chain if "reason" in e] == ["stale_generation"] * cap
    feed = [f for _, f in redis_sync.xrange("fg:audit:default")]
    assert len([e for e in feed if e["reason"] == "stale_generation"]) == cap
    audited = 0.0
    for gw in (a, b):
        metrics = (await (await gw.client.get("/metrics")).text()).splitlines()
        audited += sum(
            float(line.rsplit(" ", 1)[1])
            for line in metrics
            if line.startswith('fencegate_quota_rejections_total{audited="true"')
        )
    assert audited == cap


async def test_with_no_quota_configured_no_admission_hook_is_built(make_gateway: Any) -> None:
    gw = await make_gateway(quotas={"payload_bytes": 0, "rejections_per_window": 0})
    assert gw.app[K.SERVICE].admission is None
    assert (await gw.register("j", generation=1)).status == 201
    assert (await gw.effect("j", "s", 1)).status == 200


async def test_rejections_are_capped_by_default_and_past_the_cap_summarised(
    make_gateway: Any, redis_sync: Any
) -> None:
    """The audit entries a caller can make are bounded: the rejections cap is on by default
    (10,000 per tenant per hour); past it the feed gets one summary entry a second
    (``quota_exceeded``, ``quota = rejections_per_window``), not one entry per call."""
    default = await make_gateway()
    assert default.settings.quotas.rejections_per_window == 10_000
    assert default.settings.quotas.window_seconds == 3600
    gw = await make_gateway(quotas={"rejections_per_window": 2})
    assert (await gw.register("j", generation=2)).status == 201
    for _ in range(6):
        stale = await gw.effect("j", "s", 1, worker_id="zombie")
        assert stale.status == 409
    feed = [fields for _, fields in redis_sync.xrange("fg:audit:default")]
    assert len([e for e in feed if e["reason"] == "stale_generation"]) == 2
    summaries = [e for e in feed if e["reason"] == "quota_exceeded"]
    assert 1 <= len(summaries) <= 4  # one a second at most (the loop may cross a second)
    assert all(e.get("quota") == "rejections_per_window" for e in summaries), summaries


async def test_every_fenced_call_s_rejections_share_the_cap(
    make_gateway: Any, redis_sync: Any, tmp_path: Any
) -> None:
    """A stale worker's heartbeats, checkpoints, completions and output uploads are capped
    like its effect calls: past ``quotas.rejections_per_window`` each is still answered 409
    ``stale_generation``, but no longer written to the job's audit chain (the feed gets the
    summary), so a zombie cannot grow the stream a chain check reads without bound."""
    gw = await make_gateway(
        quotas={"rejections_per_window": 3},
        outputs={"store": "file", "path": str(tmp_path / "out"), "sweep_interval_seconds": 0},
    )
    assert (await gw.register("j", generation=2)).status == 201
    stale = {**gw.headers, "Fencing-Token": "1", "Worker-Id": "zombie"}
    client = gw.client
    calls = [
        lambda: client.post("/v1/jobs/j/fence", headers=stale),
        lambda: client.put("/v1/jobs/j/checkpoints/c", json={"at": 1}, headers=stale),
        lambda: client.post("/v1/jobs/j/complete", json={"result": None}, headers=stale),
        lambda: client.put(
            "/v1/jobs/j/outputs/o", data=b"x", headers={**stale, "Content-Type": "text/plain"}
        ),
    ]
    window = int(time.time() // 3600)
    counter = f"fg:quota:{{default}}:rj:{window}"
    rejected = 0
    for _ in range(4):
        for call in calls:
            resp = await call()
            body = await resp.json()
            assert (resp.status, body["code"]) == (409, "stale_generation"), body
            rejected += 1
            for _ in range(200):  # the charge is not waited for by the call: let it land
                if int(redis_sync.get(counter) or 0) == rejected:
                    break
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.01)  # and its reply reach the gateway's view
    assert int(redis_sync.get(counter)) == 16
    chain = [f for _, f in redis_sync.xrange("fg:{default/j}:audit")]
    assert [e["reason"] for e in chain if "reason" in e] == ["stale_generation"] * 3
    feed = [f for _, f in redis_sync.xrange("fg:audit:default")]
    summaries = [e for e in feed if e["reason"] == "quota_exceeded"]
    assert summaries and all(e["quota"] == "rejections_per_window" for e in summaries)


async def test_the_effects_window_counter_always_expires(
    make_gateway: Any, redis_sync: Any
) -> None:
    """Its TTL is sent with the window's first charge, not with every charge; a counter created
    again mid-window (a flushed Redis) gets it again."""
    gw = await make_gateway(quotas={"effects_per_window": 100})
    assert (await gw.register("j", generation=1)).status == 201

    async def ttl_once_charged(charged: int) -> int:
        for _ in range(100):  # the charge (INCR, then EXPIRE) is not waited for by the call
            keys = redis_sync.keys("fg:quota:{default}:fx:*")
            counted = bool(keys) and int(redis_sync.get(keys[0]) or 0) >= charged
            if counted and (ttl := redis_sync.ttl(keys[0])) > 0:
                return int(ttl)
            await asyncio.sleep(0.02)
        raise AssertionError(f"no counter of {charged} with a TTL: {keys}")

    for charged, step in enumerate(("s1", "s2", "s3"), start=1):
        assert (await gw.effect("j", step, 1)).status == 200
        assert await ttl_once_charged(charged) <= 3600 + 60
    [key] = redis_sync.keys("fg:quota:{default}:fx:*")
    redis_sync.delete(key)
    assert (await gw.effect("j", "s4", 1)).status == 200
    assert await ttl_once_charged(1) <= 3600 + 60


async def test_a_lost_reply_to_the_admit_that_charges_a_payload_counts_once(
    make_gateway: Any, wire: WireProxy, redis_sync: Any
) -> None:
    """On a standalone Redis the admit charges an async payload itself. Redis ran it, and its
    reply was lost with the connection, once, then on the first send and both re-sends of the
    batch: the admit is sent again (with its request id: it answers what it answered), the
    call is 202, and the tenant's held bytes are exactly what its held payloads are charged."""
    gw = await make_gateway(redis={"url": wire.url}, quotas={"payload_bytes": 100_000})
    gw.app[K.SERVICE].relay.stop()  # the payloads stay held
    assert (await gw.register("j", generation=1)).status == 201
    async_ = {"Prefer": "respond-async"}
    blob = {"blob": "x" * 2_000}
    admit = hashlib.sha1(lua_source("admit-8").encode(), usedforsecurity=False).hexdigest()

    def held_bytes_match(steps: int) -> bool:
        held = redis_sync.hgetall("fg:quota:{default}:held")
        counted = int(redis_sync.get("fg:quota:{default}:held_bytes"))
        return len(held) == steps and counted == sum(map(int, held.values()))

    # a first call: the script in Redis's cache (a NOSCRIPT reply is not the one to lose)
    assert (
        await gw.effect("j", "p0", 1, adapter="dead", payload=blob, headers=async_)
    ).status == 202
    assert held_bytes_match(1)
    for step, times in (("p1", 1), ("p2", 3)):
        lost = [wire.on_reply_to(admit.encode(), "lose", skip=0) for _ in range(times)]
        resp = await gw.effect("j", step, 1, adapter="dead", payload=blob, headers=async_)
        assert resp.status == 202, await resp.text()
        assert all(rule.fired.is_set() for rule in lost), step
        assert redis_sync.hget(f"fg:{{default/j}}:fx:{step}", "state") == "pending"
        assert held_bytes_match(int(step[1:]) + 1), step
    assert not redis_sync.exists("fg:quota:{default}:held_pending")  # nothing reserved aside


async def test_a_reservation_whose_every_reply_was_lost_is_given_back_once_abandoned(
    make_gateway: Any, wire: WireProxy, redis_sync: Any
) -> None:
    """A checkpoint's reservation (awaited before the write) ran, and its reply was lost on
    the first send and on both re-sends: the call answers 503, the reservation is counted
    once and stays open (no settlement knows it); the reconciliation gives it back once it
    is older than ``ABANDONED_AFTER_MS`` on Redis's clock."""
    gw = await make_gateway(redis={"url": wire.url}, quotas={"checkpoint_bytes": 100_000})
    assert (await gw.register("j", generation=1)).status == 201
    blob = {"blob": "x" * 2_000}
    assert (await put_checkpoint(gw, "c0", blob, 1, job="j")).status in (200, 201)
    for _ in range(250):  # its settlement is not waited for by the call
        if not redis_sync.hlen("fg:quota:{default}:ckpt_pending"):
            break
        await asyncio.sleep(0.02)
    baseline = int(redis_sync.get("fg:quota:{default}:ckpt_bytes"))
    lost = [wire.on_reply_to(quota_counters.RESERVE.sha.encode(), "lose", skip=0) for _ in range(3)]
    resp = await put_checkpoint(gw, "c1", blob, 1, job="j")
    assert resp.status == 503, await resp.text()
    assert all(rule.fired.is_set() for rule in lost)
    pending = redis_sync.hgetall("fg:quota:{default}:ckpt_pending")
    [(reservation, charge)] = pending.items()
    assert int(redis_sync.get("fg:quota:{default}:ckpt_bytes")) == baseline + int(charge)
    quotas = gw.app[K.QUOTAS]
    assert await quotas.reconcile_checkpoints("default") == 0  # open, and young: kept
    made = gw.app[K.STORE].redis_clock_ms() - quota_counters.ABANDONED_AFTER_MS - 1000
    redis_sync.hdel("fg:quota:{default}:ckpt_pending", reservation)
    redis_sync.hset("fg:quota:{default}:ckpt_pending", f"{made:x}.x", charge)
    await asyncio.sleep(1.05)  # a tenant is reconciled at most once a second
    assert await quotas.reconcile_checkpoints("default") == int(charge)
    assert int(redis_sync.get("fg:quota:{default}:ckpt_bytes")) == baseline
    assert redis_sync.hgetall("fg:quota:{default}:ckpt_pending") == {}


async def test_a_flood_of_calls_refused_at_the_payload_cap_stores_nothing(
    make_gateway: Any, redis_sync: Any
) -> None:
    """At its payload cap a tenant's async calls are refused (429): the reservation sent in
    each admit's pipeline was refused and wrote nothing, so nothing settles it and no re-send
    memory is kept for it: after 50 refusals there is no new key but the tenant's audit feed."""
    gw = await make_gateway(quotas={"payload_bytes": 30_000})
    gw.app[K.SERVICE].relay.stop()
    assert (await gw.register("j", generation=1)).status == 201
    async_ = {"Prefer": "respond-async"}
    blob = {"blob": "x" * 20_000}
    assert (
        await gw.effect("j", "p0", 1, adapter="dead", payload=blob, headers=async_)
    ).status == 202
    for _ in range(250):
        if not redis_sync.hlen("fg:quota:{default}:held_pending"):
            break
        await asyncio.sleep(0.02)
    before = sorted(redis_sync.keys("*"))
    refused = await asyncio.gather(
        *(gw.effect("j", f"q{i}", 1, adapter="dead", payload=blob, headers=async_)
          for i in range(50))
    )  # fmt: skip
    assert [r.status for r in refused] == [429] * 50
    await asyncio.sleep(0.1)  # anything queued behind the answers has landed
    # what running gateways write whatever happens (the attention turn, witness counters) aside
    new = [
        k
        for k in sorted(redis_sync.keys("*"))
        if k not in before and k != "fg:nd:turn" and not k.startswith("fg:witness:")
    ]
    assert new in ([], ["fg:audit:default"]), new  # the quota_exceeded entries (1 a second)


async def test_a_tenant_whose_payloads_were_delivered_is_not_refused_for_a_recent_reconciliation(
    make_gateway: Any, redis_sync: Any
) -> None:
    """Delivered payloads stay charged until a reconciliation gives them back, and one runs at
    most once a second per tenant: a call at the cap within that second waits for the next
    run instead of being refused (it was 429 while nothing was held)."""
    gw = await make_gateway(quotas={"payload_bytes": 30_000}, fencing={"relay_sweep_seconds": 0.1})
    assert (await gw.register("j", generation=1)).status == 201
    async_ = {"Prefer": "respond-async"}
    blob = {"blob": "x" * 20_000}

    async def delivered(step: str) -> None:
        for _ in range(300):
            if redis_sync.hget(f"fg:{{default/j}}:fx:{step}", "state") == "succeeded":
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"{step} was not delivered")

    for step in ("p1", "p2", "p3"):  # each over the cap with the one before still charged
        resp = await gw.effect("j", step, 1, adapter="hook", payload=blob, headers=async_)
        assert resp.status == 202, (step, await resp.text())
        await delivered(step)
    held = redis_sync.hgetall("fg:quota:{default}:held")
    assert list(held) == ['["j","p3"]']  # the delivered ones given back


async def test_a_call_over_the_cap_is_admitted_when_another_process_made_the_room(
    make_gateway: Any, redis_sync: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two gateway processes reconcile the same delivered payloads: the other one's drop lands
    first, so this one frees nothing. The call it refused is admitted all the same, the
    script checking the cap again (it was refused 429: 77 of 3,860 calls with two gateways)."""
    gw = await make_gateway(quotas={"payload_bytes": 30_000})
    gw.app[K.SERVICE].relay.stop()
    assert (await gw.register("j", generation=1)).status == 201
    redis_sync.hset("fg:quota:{default}:held", '["j","gone"]', "25000")  # delivered, charged
    redis_sync.set("fg:quota:{default}:held_bytes", "25000")
    drop_gone = QuotaCounters.drop_gone

    async def the_other_process_first(self: QuotaCounters, tenant: str, pool: Any) -> int:
        redis_sync.hdel("fg:quota:{default}:held", '["j","gone"]')  # its drop
        redis_sync.decrby("fg:quota:{default}:held_bytes", 25000)
        freed = await drop_gone(self, tenant, pool)
        assert freed == 0  # nothing left for this one
        return freed

    monkeypatch.setattr(QuotaCounters, "drop_gone", the_other_process_first)
    blob = {"blob": "x" * 10_000}
    resp = await gw.effect(
        "j", "p1", 1, adapter="dead", payload=blob, headers={"Prefer": "respond-async"}
    )
    assert resp.status == 202, await resp.text()
    assert list(redis_sync.hgetall("fg:quota:{default}:held")) == ['["j","p1"]']
