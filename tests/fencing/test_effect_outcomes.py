"""Every row of the effect outcome table (docs/contract.md), against a real Redis and upstream."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.conftest import Gateway, Upstream
from tests.support.calls import problem


async def test_seed_acceptance_zombie_is_fenced(gw: Gateway, upstream: Upstream) -> None:
    """A registers 1 and pauses; B registers 2; A's call is stale and audited; B's goes out once."""
    assert (await gw.register("r", generation=1, lease_ms=60_000)).status == 201
    assert (await gw.register("r", generation=2, lease_ms=60_000)).status == 201

    zombie = await gw.effect("r", "notify", 1, worker_id="worker-a")
    body = await problem(zombie, 409, "stale_generation")
    assert (body["presented"], body["current"]) == (1, 2)

    ok = await gw.effect("r", "notify", 2, worker_id="worker-b")
    assert ok.status == 200
    out = await ok.json()
    assert out["state"] == "succeeded" and out["replayed"] is False
    assert out["idempotency_key"] == "r:notify" and out["generation"] == 2

    assert len(upstream.received) == 1
    assert upstream.received[0].headers["Idempotency-Key"] == "r:notify"
    assert upstream.received[0].headers["Fencing-Token"] == "2"

    [entry] = await gw.audit()
    assert entry["reason"] == "stale_generation"
    assert (entry["presented"], entry["current"]) == (1, 2)
    assert entry["job_id"] == "r" and entry["step"] == "notify" and entry["worker_id"] == "worker-a"


async def test_replay_returns_recorded_result_and_header(gw: Gateway, upstream: Upstream) -> None:
    await gw.register("r", generation=3)
    first = await gw.effect("r", "notify", 3)
    again = await gw.effect("r", "notify", 3)
    assert again.status == 200
    assert again.headers["Idempotent-Replayed"] == "true"
    assert "Idempotent-Replayed" not in first.headers
    a, b = await first.json(), await again.json()
    assert b["replayed"] is True and b["result"] == a["result"]
    assert len(upstream.received) == 1


async def test_takeover_replays_effect_of_previous_generation(
    gw: Gateway, upstream: Upstream
) -> None:
    """The key is <job>:<step> for every generation: g+1 gets g's outcome, no second send."""
    await gw.register("r", generation=1)
    assert (await gw.effect("r", "notify", 1)).status == 200
    await gw.register("r", generation=2)
    resp = await gw.effect("r", "notify", 2)
    assert resp.status == 200 and (await resp.json())["replayed"] is True
    assert len(upstream.received) == 1


async def test_unregistered_generation(gw: Gateway, upstream: Upstream) -> None:
    await gw.register("r", generation=1)
    body = await problem(await gw.effect("r", "notify", 2), 409, "unregistered_generation")
    assert (body["presented"], body["current"]) == (2, 1)
    body = await problem(
        await gw.effect("never-registered", "s", 1), 409, "unregistered_generation"
    )
    assert body["current"] == 0
    assert upstream.received == []
    assert [e["reason"] for e in await gw.audit()] == ["unregistered_generation"] * 2


async def test_lease_expired(gw: Gateway, upstream: Upstream, redis_sync: Any) -> None:
    await gw.register("r", generation=1, lease_ms=1000)
    # Age the lease in Redis rather than sleeping: the scripts use Redis TIME.
    redis_sync.hset("fg:{default/r}:job", "lease_exp", "1")
    body = await problem(await gw.effect("r", "notify", 1), 409, "lease_expired")
    assert (body["presented"], body["current"]) == (1, 1)
    await problem(await gw.heartbeat("r", 1), 409, "lease_expired")
    assert upstream.received == []
    # a takeover registers the next generation and works again
    assert (await gw.register("r", lease_ms=1000)).status == 201
    assert (await gw.effect("r", "notify", 2)).status == 200


async def test_lease_really_runs_out(gw: Gateway) -> None:
    await gw.register("r", generation=1, lease_ms=1000)
    assert (await gw.heartbeat("r", 1)).status == 200
    await asyncio.sleep(1.1)
    await problem(await gw.heartbeat("r", 1), 409, "lease_expired")


async def test_heartbeat_extends_lease(gw: Gateway) -> None:
    reg = await (await gw.register("r", generation=1, lease_ms=1000)).json()
    await asyncio.sleep(0.05)
    hb = await gw.heartbeat("r", 1)
    out = await hb.json()
    assert hb.status == 200 and out["current"] is True and out["generation"] == 1
    assert out["lease_expires_at"] > reg["lease_expires_at"]


async def test_job_cancelled(gw: Gateway, upstream: Upstream) -> None:
    await gw.register("r", generation=1)
    resp = await gw.client.post("/v1/jobs/r/cancel")
    assert resp.status == 200 and (await resp.json())["cancelled"] is True
    body = await problem(await gw.effect("r", "notify", 1), 409, "job_cancelled")
    assert body["presented"] == 1
    await problem(await gw.register("r", generation=2), 409, "job_cancelled")
    await problem(await gw.heartbeat("r", 1), 409, "job_cancelled")
    assert upstream.received == []
    reasons = [e["reason"] for e in await gw.audit()]
    assert reasons == ["job_cancelled"] * 3


async def test_generation_regression_and_idempotent_registration(gw: Gateway) -> None:
    assert (await gw.register("r", generation=5)).status == 201
    again = await gw.register("r", generation=5)
    assert again.status == 200 and (await again.json())["generation"] == 5
    body = await problem(await gw.register("r", generation=4), 409, "generation_regression")
    assert (body["presented"], body["current"]) == (4, 5)
    alloc = await gw.register("r")
    assert alloc.status == 201 and (await alloc.json())["generation"] == 6
    assert (await (await gw.register("fresh")).json())["generation"] == 1


async def test_intent_mismatch(gw: Gateway, upstream: Upstream) -> None:
    await gw.register("r", generation=1)
    assert (await gw.effect("r", "charge", 1, payload={"amount": 100})).status == 200
    body = await problem(
        await gw.effect("r", "charge", 1, payload={"amount": 999}), 422, "intent_mismatch"
    )
    assert len(body["pinned_intent_sha256"]) == 64
    await problem(
        await gw.effect("r", "charge", 1, operation="other", payload={"amount": 100}),
        422,
        "intent_mismatch",
    )
    assert len(upstream.received) == 1
    assert [e["reason"] for e in await gw.audit()] == ["intent_mismatch"] * 2


async def test_effect_in_progress(gw: Gateway, upstream: Upstream) -> None:
    await gw.register("r", generation=1)
    upstream.hold()
    first = asyncio.create_task(gw.effect("r", "notify", 1))
    await upstream.arrived.wait()
    second = await gw.effect("r", "notify", 1)
    body = await problem(second, 409, "effect_in_progress")
    assert int(second.headers["Retry-After"]) >= 1
    assert body["retry_after"] >= 1
    upstream.gate.set()
    assert (await first).status == 200
    assert len(upstream.received) == 1


async def test_unknown_adapter(gw: Gateway) -> None:
    await gw.register("r", generation=1)
    await problem(await gw.effect("r", "notify", 1, adapter="nope"), 422, "unknown_adapter")
    resp = await gw.client.get("/v1/jobs/r/effects/notify")
    assert resp.status == 404


async def test_effect_failed_is_recorded_and_replayed(gw: Gateway, upstream: Upstream) -> None:
    await gw.register("r", generation=1)
    upstream.behaviour = 400
    body = await problem(await gw.effect("r", "notify", 1), 424, "effect_failed")
    assert body["error"]["status"] == 400
    upstream.behaviour = "ok"
    again = await gw.effect("r", "notify", 1)
    replay = await problem(again, 424, "effect_failed")
    assert replay["replayed"] is True and replay["error"] == body["error"]
    assert again.headers["Idempotent-Replayed"] == "true"
    assert len(upstream.received) == 1


async def test_adapter_unavailable_then_retry_succeeds(gw: Gateway, upstream: Upstream) -> None:
    await gw.register("r", generation=1)
    await problem(await gw.effect("r", "notify", 1, adapter="dead"), 502, "adapter_unavailable")
    view = await (await gw.client.get("/v1/jobs/r/effects/notify")).json()
    assert view["state"] == "released"
    # released: the step may be dispatched again (and re-pinned to another adapter)
    ok = await gw.effect("r", "notify", 1)
    assert ok.status == 200 and (await ok.json())["replayed"] is False
    assert len(upstream.received) == 1


async def test_429_from_upstream_is_not_delivered(gw: Gateway, upstream: Upstream) -> None:
    """429 (rate limited: not forwarded, not processed) releases the step. A 503 does not:
    a proxy may answer it after forwarding (tests/proxy/test_ambiguous_statuses.py)."""
    await gw.register("r", generation=1)
    upstream.behaviour = 429
    await problem(await gw.effect("r", "notify", 1), 502, "adapter_unavailable")
    upstream.behaviour = "ok"
    assert (await gw.effect("r", "notify", 1)).status == 200
    assert len(upstream.received) == 2


@pytest.mark.parametrize("behaviour", ["hang", "drop", 500])
async def test_outcome_unknown_is_never_resent(
    gw: Gateway, upstream: Upstream, behaviour: Any
) -> None:
    await gw.register("r", generation=1)
    upstream.behaviour = behaviour
    body = await problem(await gw.effect("r", "notify", 1), 504, "outcome_unknown")
    assert body["state"] == "unknown"
    upstream.behaviour = "ok"
    await problem(await gw.effect("r", "notify", 1), 409, "outcome_unknown")
    await gw.register("r", generation=2)
    await problem(await gw.effect("r", "notify", 2), 409, "outcome_unknown")
    assert len(upstream.received) == 1
    view = await (await gw.client.get("/v1/jobs/r/effects/notify")).json()
    assert view["state"] == "unknown"


async def test_unknown_outcome_resent_when_downstream_dedupes(
    make_gateway: Any, upstream: Upstream
) -> None:
    gw: Gateway = await make_gateway(
        adapters={
            "hook": {
                "type": "webhook",
                "url": upstream.url,
                "timeout_seconds": 1,
                "dedupes_by_key": True,
            }
        }
    )
    await gw.register("r", generation=1)
    upstream.behaviour = 500
    await problem(await gw.effect("r", "notify", 1), 504, "outcome_unknown")
    upstream.behaviour = "ok"
    ok = await gw.effect("r", "notify", 1)
    assert ok.status == 200
    keys = {r.headers["Idempotency-Key"] for r in upstream.received}
    assert keys == {"r:notify"} and len(upstream.received) == 2


async def test_dispatch_started_before_takeover_is_recorded(
    gw: Gateway, upstream: Upstream
) -> None:
    """g dispatches, g+1 registers meanwhile: the effect happened and g+1 replays it."""
    await gw.register("r", generation=1)
    upstream.hold()
    inflight = asyncio.create_task(gw.effect("r", "notify", 1))
    await upstream.arrived.wait()
    assert (await gw.register("r", generation=2)).status == 201
    upstream.gate.set()
    assert (await inflight).status == 200
    replay = await gw.effect("r", "notify", 2)
    assert replay.status == 200 and (await replay.json())["replayed"] is True
    assert len(upstream.received) == 1


async def test_job_view_and_effect_view(gw: Gateway) -> None:
    await gw.register("r", generation=1, lease_ms=5000)
    await gw.effect("r", "a", 1, worker_id="w1")
    await gw.effect("r", "b", 1, adapter="dead")
    job = await (await gw.client.get("/v1/jobs/r")).json()
    assert job["fence"] == 1 and job["cancelled"] is False and job["lease_ms"] == 5000
    assert job["lease_expires_at"].endswith("Z")
    assert {s: e["state"] for s, e in job["effects"].items()} == {"a": "succeeded", "b": "released"}
    a = job["effects"]["a"]
    assert a["worker_id"] == "w1" and a["idempotency_key"] == "r:a" and a["attempts"] == 1
    assert (await gw.client.get("/v1/jobs/unknown-job")).status == 404


async def test_audit_pagination_newest_first(gw: Gateway) -> None:
    await gw.register("r", generation=2)
    await gw.register("q", generation=2)
    for i in range(5):
        await gw.effect("r", f"s{i}", 1)
    await gw.effect("q", "x", 1)
    page1 = await (await gw.client.get("/v1/audit/rejections", params={"limit": "4"})).json()
    assert len(page1["items"]) == 4 and page1["next_cursor"]
    page2 = await (
        await gw.client.get(
            "/v1/audit/rejections", params={"limit": "4", "cursor": page1["next_cursor"]}
        )
    ).json()
    assert len(page2["items"]) == 2 and page2["next_cursor"] is None
    steps = [e["step"] for e in page1["items"] + page2["items"]]
    assert steps == ["x", "s4", "s3", "s2", "s1", "s0"]
    only_r = await gw.audit(job="r")
    assert [e["step"] for e in only_r] == ["s4", "s3", "s2", "s1", "s0"]


async def test_implicit_registration_mode(make_gateway: Any, upstream: Upstream) -> None:
    gw: Gateway = await make_gateway(fencing={"registration": "implicit"})
    assert (await gw.effect("r", "a", 3)).status == 200  # highest seen: 3
    body = await problem(await gw.effect("r", "b", 2), 409, "stale_generation")
    assert (body["presented"], body["current"]) == (2, 3)
    assert (await gw.effect("r", "b", 4)).status == 200
    assert (await gw.heartbeat("r", 4)).status == 200
    await problem(await gw.heartbeat("r", 3), 409, "stale_generation")
    assert len(upstream.received) == 2


async def test_metrics_count_effects_and_rejections(gw: Gateway) -> None:
    await gw.register("r", generation=2)
    await gw.effect("r", "a", 2)
    await gw.effect("r", "a", 2)
    await gw.effect("r", "a", 1)
    text = await (await gw.client.get("/metrics")).text()
    assert 'fencegate_effects_total{adapter="hook",outcome="succeeded"} 1.0' in text
    assert 'fencegate_effects_total{adapter="hook",outcome="replayed"} 1.0' in text
    assert 'fencegate_rejections_total{reason="stale_generation"} 1.0' in text
    assert "fencegate_dispatch_seconds_bucket" in text


@pytest.mark.parametrize(
    ("raw", "value"),
    [
        # beyond 64 bits: the stdlib parses it. 2**70 + 1, not 2**70, which a float holds
        # exactly: the old case passed while orjson turned such integers into floats
        (b"1180591620717411303425", 2**70 + 1),
        (b"1e16", 1e16),
        (b'"caf\\u00e9 \xe2\x82\xac"', "café €"),
    ],
)
async def test_payloads_mean_the_same_whichever_json_parser_reads_them(
    gw: Gateway, upstream: Upstream, raw: bytes, value: Any
) -> None:
    """Bodies are parsed by orjson, and by the stdlib where orjson refuses; the meaning (what
    reaches the downstream, what the intent pin hashes) is the stdlib's either way."""
    assert (await gw.register("parse", generation=1)).status == 201
    body = b'{"adapter": "hook", "operation": "send", "payload": {"v": ' + raw + b"}}"
    headers = {"Fencing-Token": "1", "Content-Type": "application/json"}
    for replayed in (False, True):  # the same bytes again pin to the same intent: a replay
        resp = await gw.client.post("/v1/jobs/parse/effects/s", data=body, headers=headers)
        assert resp.status == 200, await resp.text()
        assert (await resp.json())["replayed"] is replayed
    assert len(upstream.received) == 1
    assert upstream.received[0].json()["v"] == value


async def test_an_allocation_resent_with_its_idempotency_key_gets_the_same_generation(
    gw: Gateway,
) -> None:
    """A scheduler whose allocation timed out retries it: with the same `Idempotency-Key` the
    retry answers the generation the first allocated, so no generation nobody holds is made."""
    first = await gw.client.post(
        "/v1/jobs/alloc/generations", json={}, headers={"Idempotency-Key": "takeover-7"}
    )
    again = await gw.client.post(
        "/v1/jobs/alloc/generations", json={}, headers={"Idempotency-Key": "takeover-7"}
    )
    assert first.status == again.status == 201
    assert (await first.json())["generation"] == (await again.json())["generation"] == 1
    fresh = await gw.client.post(
        "/v1/jobs/alloc/generations", json={}, headers={"Idempotency-Key": "takeover-8"}
    )
    assert (await fresh.json())["generation"] == 2
    view = await (await gw.client.get("/v1/jobs/alloc")).json()
    assert view["fence"] == 2
    bad = await gw.client.post(
        "/v1/jobs/alloc/generations", json={}, headers={"Idempotency-Key": "has space"}
    )
    assert bad.status == 400 and (await bad.json())["code"] == "invalid_request"
    assert (await (await gw.client.get("/v1/jobs/alloc")).json())["fence"] == 2
