"""``reads = "fenced"``: a proxied GET or HEAD is sent only for a generation that may act on
its job now; a stale, expired, cancelled or completed one is refused, audited, never sent —
and a read that passes pins, records and renews nothing."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.conftest import Gateway
from tests.support.proxying import KEYS, Receiver, auth, fenced, register, upstreams

AUDITOR = {"Authorization": f"Bearer {KEYS['audit']}"}
SCHEDULER = {"Authorization": f"Bearer {KEYS['sched']}"}


@pytest.fixture
async def fgw(make_gateway: Any, receiver: Receiver, secrets: None) -> Gateway:
    ups = upstreams(receiver.url, reads="fenced")
    ups["pay"]["routes"].append("HEAD /v1/charges/*")
    g: Gateway = await make_gateway(auth=auth(), upstreams=ups)
    return g


async def job(g: Gateway, job_id: str) -> dict[str, Any]:
    resp = await g.client.get(f"/v1/jobs/{job_id}", headers=SCHEDULER)
    assert resp.status == 200, await resp.text()
    body: dict[str, Any] = await resp.json()
    return body


async def rejections(g: Gateway) -> list[dict[str, Any]]:
    resp = await g.client.get("/v1/audit/rejections", headers=AUDITOR)
    items: list[dict[str, Any]] = (await resp.json())["items"]
    return items


async def test_a_current_generation_reads_and_nothing_is_pinned_recorded_or_renewed(
    fgw: Gateway, receiver: Receiver
) -> None:
    resp = await fgw.client.post(
        "/v1/jobs/r/generations", json={"lease_ms": 60_000}, headers=SCHEDULER
    )
    gen = (await resp.json())["generation"]
    before = await job(fgw, "r")
    for _ in range(2):
        read = await fgw.client.get("/proxy/pay/v1/charges/ch_1", headers=fenced("r", "s", gen))
        assert read.status == 200, await read.text()
        assert read.headers["Fencegate-Outcome"] == "forwarded"
    assert len(receiver.seen) == 2  # sent every time: a read is never replayed
    assert "Idempotency-Key" not in receiver.seen[0].headers
    after = await job(fgw, "r")
    assert after["effects"] == {}  # no step pinned or recorded
    assert after["lease_expires_at"] == before["lease_expires_at"]  # the lease not renewed
    assert after["fence"] == before["fence"] == gen
    assert await rejections(fgw) == []


async def test_a_stale_read_is_refused_audited_with_both_generations_and_never_sent(
    fgw: Gateway, receiver: Receiver
) -> None:
    old = await register(fgw, "r")
    new = await register(fgw, "r")
    h = fenced("r", "lookup", old, **{"Worker-Id": "w-a"})
    for method in ("GET", "HEAD"):
        resp = await fgw.client.request(method, "/proxy/pay/v1/charges/ch_1", headers=h)
        assert resp.status == 409
        assert resp.headers["Fencegate-Outcome"] == "refused"
        assert resp.headers["Stripe-Should-Retry"] == resp.headers["X-Should-Retry"] == "false"
    body = await (await fgw.client.get("/proxy/pay/v1/charges/ch_1", headers=h)).json()
    assert (body["code"], body["presented"], body["current"]) == ("stale_generation", old, new)
    assert receiver.seen == []
    items = await rejections(fgw)
    assert len(items) == 3
    entry = items[0]
    assert (entry["reason"], entry["presented"], entry["current"]) == (
        "stale_generation", old, new
    )  # fmt: skip
    assert (entry["step"], entry["worker_id"], entry["adapter"]) == ("lookup", "w-a", "proxy:pay")
    assert (await job(fgw, "r"))["effects"] == {}


async def test_a_cancelled_jobs_read_is_refused(fgw: Gateway, receiver: Receiver) -> None:
    gen = await register(fgw, "r")
    assert (await fgw.client.post("/v1/jobs/r/cancel", headers=SCHEDULER)).status == 200
    resp = await fgw.client.get("/proxy/pay/v1/charges/ch_1", headers=fenced("r", "s", gen))
    assert resp.status == 409
    assert (await resp.json())["code"] == "job_cancelled"
    assert resp.headers["X-Should-Retry"] == "false"
    assert receiver.seen == []


async def test_an_expired_leases_read_is_refused(fgw: Gateway, receiver: Receiver) -> None:
    resp = await fgw.client.post(
        "/v1/jobs/r/generations", json={"lease_ms": 1000}, headers=SCHEDULER
    )
    gen = (await resp.json())["generation"]
    await asyncio.sleep(1.1)  # past the lease (Redis TIME decides, in check-2)
    resp = await fgw.client.get("/proxy/pay/v1/charges/ch_1", headers=fenced("r", "s", gen))
    assert resp.status == 409
    body = await resp.json()
    assert (body["code"], body["presented"], body["current"]) == ("lease_expired", gen, gen)
    assert receiver.seen == []
    assert [i["reason"] for i in await rejections(fgw)] == ["lease_expired"]


async def test_a_fenced_read_names_its_job_and_token(fgw: Gateway, receiver: Receiver) -> None:
    gen = await register(fgw, "r")
    worker = {"Authorization": f"Bearer {KEYS['acme']}"}
    bare = await fgw.client.get("/proxy/pay/v1/charges/ch_1", headers=worker)
    assert bare.status == 400
    assert "Fencegate-Job" in (await bare.json())["detail"]
    no_token = await fgw.client.get(
        "/proxy/pay/v1/charges/ch_1", headers={**worker, "Fencegate-Job": "r"}
    )
    assert no_token.status == 400
    unregistered = await fgw.client.get(
        "/proxy/pay/v1/charges/ch_1", headers=fenced("r", "s", gen + 5)
    )
    assert (await unregistered.json())["code"] == "unregistered_generation"
    assert receiver.seen == []


async def test_in_implicit_mode_a_read_above_the_fence_passes_without_raising_it(
    make_gateway: Any, receiver: Receiver, secrets: None
) -> None:
    g: Gateway = await make_gateway(
        auth=auth(),
        upstreams=upstreams(receiver.url, reads="fenced"),
        fencing={"registration": "implicit"},
    )
    gen = await register(g, "r")
    read = await g.client.get("/proxy/pay/v1/charges/ch_1", headers=fenced("r", "s", gen + 1))
    assert read.status == 200, await read.text()
    assert (await job(g, "r"))["fence"] == gen  # a read registers nothing
    still = await g.client.get("/proxy/pay/v1/charges/ch_1", headers=fenced("r", "s", gen))
    assert still.status == 200  # so the fence holder is not fenced out by a read
    assert len(receiver.seen) == 2


async def test_reads_are_passed_through_by_default(gw: Gateway, receiver: Receiver) -> None:
    old = await register(gw, "r")
    await register(gw, "r")
    resp = await gw.client.get("/proxy/pay/v1/charges/ch_1", headers=fenced("r", "s", old))
    assert resp.status == 200  # reads = "pass": a stale token is not looked at
    assert len(receiver.seen) == 1
