"""The rejections cap counted by the fenced scripts themselves (a standalone Redis,
``includes/reject``'s ``past_rejection_cap``): exactly the cap's worth audited per tenant and
window for any mix of fenced calls (effects, heartbeats, checkpoints, completions, forged
signed tokens) through two gateways, another tenant untouched; a lost reply re-sent never
audits twice; each window audits again and its counter expires; counters deleted mid-flood
never turn an answer into a 5xx."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest

from gateway.core.tokens import sign_token
from tests.conftest import Gateway, key_digest

SIGNING_KEY = "k" * 40
KEYS = {"a": "tenant-a-admin-key", "b": "tenant-b-admin-key"}


def bearer(t: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[t]}"}


def auth_section(signed: bool) -> dict[str, Any]:
    sec: dict[str, Any] = {
        "keys": [
            {"role": "admin", "sha256": key_digest(KEYS["a"]), "tenant": "a"},
            {"role": "admin", "sha256": key_digest(KEYS["b"]), "tenant": "b"},
        ]
    }
    if signed:
        sec["token_signing_key_env"] = "TEST_SIGNING_KEYS"
    return sec


def tok(tenant: str, job: str, gen: int, signed: bool) -> str:
    if not signed:
        return str(gen)
    return sign_token(SIGNING_KEY.encode(), tenant, job, gen, int(time.time()) + 3600)


def audited_counts(r: Any, tenant: str, jobs: list[str]) -> tuple[int, int]:
    feed = [f for _, f in r.xrange(f"fg:audit:{tenant}")]
    nfeed = len([e for e in feed if e.get("reason") and e["reason"] != "quota_exceeded"])
    nchain = 0
    for j in jobs:
        chain = [f for _, f in r.xrange(f"fg:{{{tenant}/{j}}}:audit")]
        nchain += len([e for e in chain if e.get("reason") and e["reason"] != "quota_exceeded"])
    return nfeed, nchain


async def metrics(gws: list[Gateway], tenant: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for gw in gws:
        for line in (await (await gw.client.get("/metrics")).text()).splitlines():
            if (
                line.startswith("fencegate_quota_rejections_total{")
                and f'tenant="{tenant}"' in line
            ):
                k = "true" if 'audited="true"' in line else "false"
                out[k] = out.get(k, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


async def stale_call(gw: Gateway, tenant: str, job: str, n: int, signed: bool) -> tuple[int, str]:
    t = tok(tenant, job, 1, signed)
    h = {**bearer(tenant), "Fencing-Token": t, "Worker-Id": "zombie"}
    kind = n % 5
    if kind == 0:
        body = {"adapter": "hook", "operation": "send", "payload": {"n": n}}
        resp = await gw.client.post(f"/v1/jobs/{job}/effects/s{n}", json=body, headers=h)
    elif kind == 1:
        resp = await gw.client.post(f"/v1/jobs/{job}/fence", headers=h)
    elif kind == 2:
        resp = await gw.client.put(
            f"/v1/jobs/{job}/checkpoints/c{n}",
            data=json.dumps({"n": n}),
            headers={**h, "Content-Type": "application/json"},
        )
    elif kind == 3:
        resp = await gw.client.post(
            f"/v1/jobs/{job}/complete", json={"outputs": [], "result": None}, headers=h
        )
    else:  # a bad token (forged when signed, else junk)
        h["Fencing-Token"] = f"v1.1.{int(time.time()) + 3600}.{'A' * 43}" if signed else "x"
        body = {"adapter": "hook", "operation": "send", "payload": {"n": n}}
        resp = await gw.client.post(f"/v1/jobs/{job}/effects/s{n}", json=body, headers=h)
    data = await resp.json(content_type=None)
    return resp.status, data.get("code", "ok")


@pytest.mark.parametrize("signed", [True, False])
async def test_a_mixed_flood_through_two_gateways_audits_exactly_the_cap_of_its_tenant_only(
    make_gateway: Any, redis_sync: Any, monkeypatch: pytest.MonkeyPatch, signed: bool
) -> None:
    monkeypatch.setenv("TEST_SIGNING_KEYS", SIGNING_KEY)
    cap = 7
    quotas = {"rejections_per_window": 1000, "tenants": {"a": {"rejections_per_window": cap}}}
    a = await make_gateway(headers=bearer("a"), auth=auth_section(signed), quotas=quotas)
    b = await make_gateway(headers=bearer("a"), auth=auth_section(signed), quotas=quotas)
    jobs = ["j1", "j2", "j3"]
    for j in [*jobs, "k"]:
        for t in ("a", "b"):
            r = await a.client.post(
                f"/v1/jobs/{j}/generations", json={"generation": 2}, headers=bearer(t)
            )
            assert r.status == 201, await r.text()
    calls = [(gw, j, n) for n in range(40) for j in jobs for gw in (a, b)]
    res = await asyncio.gather(*(stale_call(gw, "a", j, n, signed) for gw, j, n in calls))
    bad = [x for x in res if x[0] not in (409, 400)]
    assert not bad, bad
    # tenant b, after a's flood: all audited
    resb = [await stale_call(a if n % 2 else b, "b", "k", n, signed) for n in range(10)]
    assert all(s in (409, 400) for s, _ in resb), resb
    for _ in range(100):  # the summaries are written by tasks the calls do not wait for
        if any(f.get("reason") == "quota_exceeded" for _, f in redis_sync.xrange("fg:audit:a")):
            break
        await asyncio.sleep(0.02)
    nfeed, nchain = audited_counts(redis_sync, "a", jobs)
    ma = await metrics([a, b], "a")
    mb = await metrics([a, b], "b")
    nfeed_b, nchain_b = audited_counts(redis_sync, "b", ["k"])
    summaries = [
        f for _, f in redis_sync.xrange("fg:audit:a") if f.get("reason") == "quota_exceeded"
    ]
    assert (nfeed, nchain) == (cap, cap)
    made = len([x for x in res if x[1] != "invalid_token" and (signed or x[0] == 409)])
    assert ma == {"true": cap, "false": made - cap}
    nb = 10 if signed else 8
    assert (nfeed_b, nchain_b) == (nb, nb)
    assert mb.get("true") == nb and not mb.get("false")
    assert summaries and all(s.get("quota") == "rejections_per_window" for s in summaries)


@pytest.mark.parametrize("skip", [0, 1, 3, 4, 5, 6])
async def test_a_rejection_whose_reply_was_lost_is_never_audited_twice(
    make_gateway: Any, redis_sync: Any, wire: Any, skip: int
) -> None:
    cap = 4
    gw = await make_gateway(redis={"url": wire.url}, quotas={"rejections_per_window": cap})
    assert (await gw.register("j", generation=2)).status == 201
    rules = [wire.on_reply_to(b"EVALSHA", "lose", skip=skip + i * 2) for i in range(3)]
    res = []
    for n in range(12):
        if n % 3 == 0:
            r = await gw.heartbeat("j", 1)
        elif n % 3 == 1:
            r = await gw.effect("j", f"s{n}", 1, worker_id="z")
        else:
            r = await gw.client.put(
                f"/v1/jobs/j/checkpoints/c{n}", data="1",
                headers={"Fencing-Token": "1", "Content-Type": "application/json"},
            )  # fmt: skip
        res.append((r.status, (await r.json())["code"]))
    chain = [f for _, f in redis_sync.xrange("fg:{default/j}:audit") if "reason" in f]
    feed = [f for _, f in redis_sync.xrange("fg:audit:default")]
    m = await metrics([gw], "default")
    assert any(rule.fired.is_set() for rule in rules)  # replies were lost (how many: batching)
    assert all(x == (409, "stale_generation") for x in res), res
    assert len(chain) == cap
    assert len([e for e in feed if e["reason"] != "quota_exceeded"]) == cap
    assert m == {"true": cap, "false": 12 - cap}


async def test_each_window_audits_up_to_the_cap_and_its_counter_expires(
    make_gateway: Any, redis_sync: Any
) -> None:
    cap = 2
    gw = await make_gateway(quotas={"rejections_per_window": cap, "window_seconds": 2})
    assert (await gw.register("j", generation=2)).status == 201
    total = 0
    for w in range(3):
        now = time.time()
        await asyncio.sleep(2 - now % 2 + 0.05)
        for n in range(5):
            r = await (gw.heartbeat("j", 1) if n % 2 else gw.effect("j", f"w{w}{n}", 1))
            assert r.status == 409
        total += cap
        chain = [f for _, f in redis_sync.xrange("fg:{default/j}:audit") if "reason" in f]
        assert len(chain) == total
        for k in redis_sync.keys("fg:quota:*:rj:*"):
            assert 0 < redis_sync.ttl(k) <= 62


async def test_counters_deleted_mid_flood_never_fail_a_call(
    make_gateway: Any, redis_sync: Any
) -> None:
    cap = 3
    a = await make_gateway(quotas={"rejections_per_window": cap})
    b = await make_gateway(quotas={"rejections_per_window": cap})
    assert (await a.register("j", generation=2)).status == 201

    async def flood(gw: Gateway, k: int) -> list[int]:
        out = []
        for n in range(15):
            r = await (gw.heartbeat("j", 1) if n % 2 else gw.effect("j", f"f{k}{n}", 1))
            out.append(r.status)
        return out

    async def flusher() -> None:
        for _ in range(10):
            await asyncio.sleep(0.02)
            for key in redis_sync.keys("fg:quota:*"):
                redis_sync.delete(key)

    res = await asyncio.gather(flood(a, 0), flood(b, 1), flood(a, 2), flusher())
    assert all(s == 409 for r in res[:3] for s in r)
    r = await a.heartbeat("j", 1)
    assert r.status == 409
