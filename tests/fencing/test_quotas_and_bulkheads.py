"""Per-tenant quotas (429 quota_exceeded, audited) and bulkheads
(one bounded HTTP pool per adapter and tenant; a send that never left is ``released``).
Real Redis, real loopback receivers, two tenants with their own keys."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from gateway.runtime.settings import Settings
from tests.conftest import Gateway, key_digest

KEYS = {"a": "tenant-a-admin-key", "b": "tenant-b-admin-key"}
AUTH = {
    "keys": [
        {"role": "admin", "sha256": key_digest(KEYS["a"]), "tenant": "a"},
        {"role": "admin", "sha256": key_digest(KEYS["b"]), "tenant": "b"},
    ]
}


def bearer(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


async def tenant_gateways(make_gateway: Any, **sections: Any) -> tuple[Gateway, Gateway]:
    a: Gateway = await make_gateway(headers=bearer("a"), auth=AUTH, **sections)
    b = Gateway(client=a.client, app=a.app, settings=a.settings, headers=bearer("b"))
    return a, b


# -- quotas -------------------------------------------------------------------


async def test_effects_quota_per_tenant_429_with_retry_after_and_audited(
    make_gateway: Any,
) -> None:
    a, b = await tenant_gateways(
        make_gateway,
        quotas={"effects_per_window": 100, "tenants": {"a": {"effects_per_window": 3}}},
    )
    for g in (a, b):
        assert (await g.register("j", generation=1)).status == 201
    assert (await a.effect("j", "s1", 1)).status == 200
    assert (await a.effect("j", "s2", 1)).status == 200
    assert (await a.effect("j", "s1", 1)).status == 200  # a replay is given back
    assert (await a.effect("j", "s3", 1)).status == 200
    over = await a.effect("j", "s4", 1, worker_id="w-a")
    problem = await over.json()
    assert over.status == 429 and problem["code"] == "quota_exceeded", problem
    assert problem["quota"] == "effects_per_window"
    assert 1 <= int(over.headers["Retry-After"]) <= 3600
    # nothing of s4 was stored
    assert (await a.client.get("/v1/jobs/j/effects/s4", headers=a.headers)).status == 404
    # audited in tenant a's feed, not b's
    entries = await a.audit()
    assert entries[0]["reason"] == "quota_exceeded" and entries[0]["step"] == "s4"
    assert entries[0]["worker_id"] == "w-a"
    assert await b.audit() == []
    # tenant b has its own count
    for step in ("s1", "s2", "s3", "s4", "s5"):
        assert (await b.effect("j", step, 1)).status == 200


async def test_payload_bytes_quota_bounds_what_a_tenant_stores_for_the_relay(
    make_gateway: Any, redis_sync: Any
) -> None:
    a, b = await tenant_gateways(
        make_gateway, quotas={"payload_bytes": 50_000}, fencing={"relay_sweep_seconds": 0.2}
    )
    blob = {"blob": "x" * 20_000}
    async_ = {"Prefer": "respond-async"}
    for g in (a, b):
        assert (await g.register("held", generation=1)).status == 201
        assert (await g.register("next", generation=1)).status == 201
    # the 'dead' adapter refuses connections: released, re-queued, payload kept
    for step in ("p1", "p2"):
        resp = await a.effect("held", step, 1, adapter="dead", payload=blob, headers=async_)
        assert resp.status == 202, await resp.text()
    over = await a.effect("held", "p3", 1, adapter="dead", payload=blob, headers=async_)
    problem = await over.json()
    assert over.status == 429 and problem["quota"] == "payload_bytes", problem
    assert over.headers["Retry-After"] == "5"
    assert redis_sync.hget("fg:{a/held}:fx:p3", "payload") is None
    assert any(e["reason"] == "quota_exceeded" for e in await a.audit())
    # tenant b stores its own
    resp = await b.effect("held", "p1", 1, adapter="dead", payload=blob, headers=async_)
    assert resp.status == 202
    # a's held payloads leave Redis (the job is cancelled: the relay drops them) -> room again
    assert (await a.client.post("/v1/jobs/held/cancel", headers=a.headers)).status == 200
    deadline = time.monotonic() + 15
    while True:
        resp = await a.effect("next", "p1", 1, adapter="hook", payload=blob, headers=async_)
        if resp.status == 202:
            break
        assert resp.status == 429 and time.monotonic() < deadline, await resp.text()
        await asyncio.sleep(0.3)


# -- bulkheads ----------------------------------------------------------------


class Receiver:
    """Hangs tenant a's requests (its job ids start with 'a-'), answers the rest at once."""

    def __init__(self) -> None:
        self.hanging = 0
        self.release = asyncio.Event()
        self.url = ""

    async def handle(self, request: web.Request) -> web.Response:
        await request.read()
        if "a-" in request.headers.get("Idempotency-Key", ""):  # "a-1:s" or "a/a-1:s"
            self.hanging += 1
            await self.release.wait()
        return web.json_response({"ok": True})


@pytest.fixture
async def hanging_receiver() -> AsyncIterator[Receiver]:
    rec = Receiver()
    app = web.Application()
    app.router.add_post("/hook", rec.handle)
    server = TestServer(app, host="127.0.0.1", port=0)
    await server.start_server()
    rec.url = str(server.make_url("/hook"))
    yield rec
    rec.release.set()
    await server.close()


async def test_slow_downstream_of_one_tenant_does_not_starve_another(
    make_gateway: Any, hanging_receiver: Receiver
) -> None:
    sections: dict[str, Any] = {
        # the shared pool of the base was redis.max_connections * 4 = 4 connections
        "redis": {"max_connections": 1},
        "adapters": {
            "slow": {"type": "webhook", "url": hanging_receiver.url, "timeout_seconds": 3}
        },
    }
    if "bulkheads" in Settings.model_fields:
        sections["bulkheads"] = {"connections_per_pool": 4, "pool_wait_seconds": 0.5}
    a, b = await tenant_gateways(make_gateway, **sections)
    for i in range(6):
        assert (await a.register(f"a-{i}", generation=1)).status == 201
    assert (await b.register("b-0", generation=1)).status == 201
    flood = [asyncio.create_task(a.effect(f"a-{i}", "s", 1, adapter="slow")) for i in range(6)]
    deadline = time.monotonic() + 5
    while hanging_receiver.hanging < 4:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)
    started = time.monotonic()
    resp = await b.effect("b-0", "s", 1, adapter="slow")
    assert resp.status == 200, await resp.text()
    assert time.monotonic() - started < 1.0, "tenant b waited behind tenant a's pool"
    # the two of a's sends that found no connection never left: released, not unknown
    answers = [await t for t in flood]
    statuses = sorted([r.status for r in answers])
    assert statuses == [502, 502, 504, 504, 504, 504], statuses
    for resp in answers:
        if resp.status == 502:
            problem = await resp.json()
            assert problem["code"] == "adapter_unavailable" and problem["state"] == "released"
    assert hanging_receiver.hanging == 4
