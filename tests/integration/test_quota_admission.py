"""Quotas are charged after the verdict (gateway.fencing.quotas through the effect service's
admission hook): only admitted and queued calls spend the effects quota; replays and "in
progress" answers are never charged nor refused; rejections have their own counter and cap.
Real Redis, the real app over HTTP."""

from __future__ import annotations

from typing import Any

from gateway.http import appkeys as K


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
    gw.app[K.SERVICE].stop_relay()  # the steps stay queued ('pending')
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


async def test_with_no_quota_configured_no_admission_hook_is_built(make_gateway: Any) -> None:
    gw = await make_gateway(quotas={"payload_bytes": 0})
    assert gw.app[K.SERVICE].admission is None
    assert (await gw.register("j", generation=1)).status == 201
    assert (await gw.effect("j", "s", 1)).status == 200
