"""Bad input gets a clear 4xx problem, changes nothing in Redis and reaches no adapter."""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import Gateway, Upstream
from tests.support.calls import EFFECT, assert_untouched

LONG = "j" * 129


def json_nest(depth: int) -> Any:
    node: Any = "leaf"
    for _ in range(depth):
        node = {"n": node}
    return node


MAX_SAFE = 2**53 - 1


@pytest.mark.parametrize(
    "token",
    [
        "abc",
        "0",
        "-1",
        "1.5",
        str(MAX_SAFE + 1),
        "",
        "1 2",
        "01",
        "+1",
        "1e3",
        "0x10",
        "\uff11",  # FULLWIDTH DIGIT ONE: int() would accept it, the gateway must not
        "1_0",
        "99999999999999999999",
    ],
)
async def test_bad_tokens(primed: Gateway, upstream: Upstream, redis_sync: Any, token: str) -> None:
    call = primed.client.post("/v1/jobs/r/effects/s", json=EFFECT, headers={"Fencing-Token": token})
    await assert_untouched(primed, upstream, redis_sync, call, 400, "invalid_request")


async def test_missing_token(primed: Gateway, upstream: Upstream, redis_sync: Any) -> None:
    await assert_untouched(
        primed,
        upstream,
        redis_sync,
        primed.client.post("/v1/jobs/r/effects/s", json=EFFECT),
        400,
        "invalid_request",
    )
    await assert_untouched(
        primed, upstream, redis_sync, primed.client.post("/v1/jobs/r/fence"), 400, "invalid_request"
    )


@pytest.mark.parametrize(
    "path",
    [
        "/v1/jobs/a:b/effects/s",
        f"/v1/jobs/{LONG}/effects/s",
        "/v1/jobs/r/effects/a:b",
        f"/v1/jobs/r/effects/{'s' * 129}",
        "/v1/jobs/.hidden/effects/s",
        "/v1/jobs/-x/effects/s",
        "/v1/jobs/%C3%A9t%C3%A9/effects/s",
        "/v1/jobs/a%20b/effects/s",
    ],
)
async def test_bad_ids(primed: Gateway, upstream: Upstream, redis_sync: Any, path: str) -> None:
    call = primed.client.post(path, json=EFFECT, headers={"Fencing-Token": "1"})
    await assert_untouched(primed, upstream, redis_sync, call, 400, "invalid_request")


async def test_id_of_exactly_128_chars_is_fine(gw: Gateway) -> None:
    job = "j" * 128
    assert (await gw.register(job, generation=1)).status == 201
    assert (await gw.effect(job, "s" * 128, 1)).status == 200


@pytest.mark.parametrize(
    "body",
    [
        b"{not json",
        b"[]",
        b'"text"',
        b"null",
        b'{"adapter": "hook", "operation": "send"}',
        b'{"adapter": "hook", "operation": "send", "payload": [1]}',
        b'{"adapter": "hook", "operation": "send", "payload": {}, "url": "http://evil"}',
        b'{"adapter": "hook", "operation": "", "payload": {}}',
        b'{"adapter": "ho:ok", "operation": "send", "payload": {}}',
        b'{"adapter": "hook", "operation": "send", "payload": {"x": NaN}}',
        b'{"adapter": "hook", "operation": "send", "payload": {"x": "\\ud800"}}',
        b'{"adapter": "hook", "operation": "bad op", "payload": {}}',
        b"",
        b"[" * 100_000 + b"]" * 100_000,
    ],
)
async def test_bad_effect_bodies(
    primed: Gateway, upstream: Upstream, redis_sync: Any, body: bytes
) -> None:
    call = primed.client.post(
        "/v1/jobs/r/effects/s",
        data=body,
        headers={"Fencing-Token": "1", "Content-Type": "application/json"},
    )
    await assert_untouched(primed, upstream, redis_sync, call, 400, "invalid_request")


async def test_unknown_adapter_changes_nothing(
    primed: Gateway, upstream: Upstream, redis_sync: Any
) -> None:
    call = primed.effect("r", "s", 1, adapter="nope")
    await assert_untouched(primed, upstream, redis_sync, call, 422, "unknown_adapter")


async def test_body_over_limit(make_gateway: Any, upstream: Upstream, redis_sync: Any) -> None:
    gw: Gateway = await make_gateway(server={"max_body_bytes": 2048})
    await gw.register("r", generation=1)
    upstream.received.clear()
    big = {**EFFECT, "payload": {"blob": "x" * 4096}}
    call = gw.client.post("/v1/jobs/r/effects/s", json=big, headers={"Fencing-Token": "1"})
    await assert_untouched(gw, upstream, redis_sync, call, 413, "payload_too_large")


@pytest.mark.parametrize(
    "body",
    [
        {"generation": "5"},
        {"generation": 1.5},
        {"generation": 5.0},
        {"generation": 0},
        {"generation": -3},
        {"generation": True},
        {"generation": MAX_SAFE + 1},
        {"lease_ms": 999},
        {"lease_ms": 86_400_001},
        {"lease_ms": "1000"},
        {"gen": 5},
    ],
)
async def test_bad_registrations(
    primed: Gateway, upstream: Upstream, redis_sync: Any, body: Any
) -> None:
    call = primed.client.post("/v1/jobs/r/generations", json=body)
    await assert_untouched(primed, upstream, redis_sync, call, 400, "invalid_request")


async def test_max_generation_is_accepted(gw: Gateway) -> None:
    resp = await gw.register("r", generation=MAX_SAFE)
    assert resp.status == 201 and (await resp.json())["generation"] == MAX_SAFE
    assert (await gw.effect("r", "s", MAX_SAFE)).status == 200
    assert (await (await gw.client.get("/v1/jobs/r")).json())["fence"] == MAX_SAFE
    # found by schemathesis: allocating past the largest generation was a 500
    resp = await gw.register("r")
    assert resp.status == 409 and (await resp.json())["code"] == "generation_exhausted"


@pytest.mark.parametrize(
    "query", [{"limit": "0"}, {"limit": "1001"}, {"limit": "x"}, {"cursor": "nope"}, {"job": "a:b"}]
)
async def test_bad_audit_queries(
    primed: Gateway, upstream: Upstream, redis_sync: Any, query: dict[str, str]
) -> None:
    call = primed.client.get("/v1/audit/rejections", params=query)
    await assert_untouched(primed, upstream, redis_sync, call, 400, "invalid_request")


async def test_bad_worker_id(primed: Gateway, upstream: Upstream, redis_sync: Any) -> None:
    call = primed.effect("r", "s", 1, headers={"Worker-Id": "x" * 129})
    await assert_untouched(primed, upstream, redis_sync, call, 400, "invalid_request")


async def test_unknown_route_and_method_are_problems(gw: Gateway) -> None:
    resp = await gw.client.get("/v1/nope")
    assert resp.status == 404 and (await resp.json(content_type=None))["code"] == "not_found"
    resp = await gw.client.delete("/v1/jobs/r")
    assert (
        resp.status == 405 and (await resp.json(content_type=None))["code"] == "method_not_allowed"
    )


@pytest.mark.parametrize(
    "payload",
    [
        {"deep": json_nest(40)},
        {"many": list(range(20_000))},
        {"long": "x" * 70_000},
        {"k" * 70_000: 1},
    ],
)
async def test_json_shape_limits(
    make_gateway: Any, upstream: Upstream, redis_sync: Any, payload: Any
) -> None:
    gw: Gateway = await make_gateway(server={"max_body_bytes": 1_000_000})
    await gw.register("r", generation=1)
    call = gw.client.post(
        "/v1/jobs/r/effects/s", json={**EFFECT, "payload": payload}, headers={"Fencing-Token": "1"}
    )
    await assert_untouched(gw, upstream, redis_sync, call, 400, "invalid_request")
