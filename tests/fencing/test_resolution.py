"""Operator resolution of unknown outcomes (POST …/effects/{step}/resolve)."""

from __future__ import annotations

from typing import Any

from tests.conftest import Gateway, Upstream, key_digest


async def unknown_step(gw: Gateway, upstream: Upstream) -> None:
    await gw.register("r", generation=1)
    upstream.behaviour = 500
    resp = await gw.effect("r", "notify", 1)
    assert resp.status == 504
    upstream.behaviour = "ok"


async def resolve(gw: Gateway, body: Any, headers: dict[str, str] | None = None) -> Any:
    return await gw.client.post(
        "/v1/jobs/r/effects/notify/resolve", json=body, headers=headers or {}
    )


async def test_resolved_as_delivered_is_replayed_and_never_resent(
    gw: Gateway, upstream: Upstream
) -> None:
    await unknown_step(gw, upstream)
    resp = await resolve(gw, {"outcome": "delivered", "result": {"checked": "in the CRM"}})
    view = await resp.json()
    assert (
        resp.status == 200
        and view["state"] == "succeeded"
        and view["result"] == {"checked": "in the CRM"}
    )
    replay = await gw.effect("r", "notify", 1)
    assert replay.status == 200 and (await replay.json())["replayed"] is True
    assert len(upstream.received) == 1
    [entry] = [e for e in await gw.audit() if e["reason"].startswith("operator_resolved")]
    assert entry["reason"] == "operator_resolved_delivered" and entry["step"] == "notify"


async def test_resolved_as_not_delivered_is_dispatched_again(
    gw: Gateway, upstream: Upstream
) -> None:
    await unknown_step(gw, upstream)
    assert (await resolve(gw, {"outcome": "not_delivered"})).status == 200
    again = await gw.effect("r", "notify", 1)
    assert again.status == 200 and (await again.json())["replayed"] is False
    assert len(upstream.received) == 2


async def test_only_unknown_outcomes_can_be_resolved(gw: Gateway, upstream: Upstream) -> None:
    await gw.register("r", generation=1)
    assert (await resolve(gw, {"outcome": "delivered"})).status == 404
    await gw.effect("r", "notify", 1)
    resp = await resolve(gw, {"outcome": "not_delivered"})
    body = await resp.json()
    assert (
        resp.status == 409 and body["code"] == "effect_not_unknown" and body["state"] == "succeeded"
    )
    bad = await resolve(gw, {"outcome": "maybe"})
    assert bad.status == 400
    bad = await resolve(gw, {"outcome": "not_delivered", "result": 1})
    assert bad.status == 400


async def test_resolve_needs_the_auditor_role(make_gateway: Any, upstream: Upstream) -> None:
    keys = [
        {"role": "worker", "sha256": key_digest("worker-key-123"), "tenant": "default"},
        {"role": "auditor", "sha256": key_digest("auditor-key-123"), "tenant": "default"},
        {"role": "admin", "sha256": key_digest("admin-key-1234"), "tenant": "default"},
    ]
    gw: Gateway = await make_gateway(
        auth={"keys": keys}, headers={"Authorization": "Bearer admin-key-1234"}
    )
    await unknown_step(gw, upstream)
    worker = await resolve(gw, {"outcome": "delivered"}, {"Authorization": "Bearer worker-key-123"})
    assert worker.status == 403
    auditor = await resolve(
        gw, {"outcome": "delivered"}, {"Authorization": "Bearer auditor-key-123"}
    )
    assert auditor.status == 200
