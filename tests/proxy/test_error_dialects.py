"""``error_dialect = "openai"``: fencegate's own refusals as OpenAI-style SDKs parse them
(``{"error": {"message", "type", "param", "code"}}``), with ``x-should-retry``."""

from __future__ import annotations

import asyncio
from typing import Any

from tests.conftest import Gateway
from tests.support.proxying import Receiver, auth, fenced, register, upstreams


async def test_refusals_in_the_openai_dialect(
    make_gateway: Any, receiver: Receiver, secrets: None
) -> None:
    g: Gateway = await make_gateway(
        auth=auth(),
        upstreams=upstreams(receiver.url, error_dialect="openai", in_flight_wait_seconds=0),
    )
    old = await register(g, "r")
    new = await register(g, "r")
    stale = await g.client.post("/proxy/pay/v1/charges", data=b"x", headers=fenced("r", "s", old))
    assert stale.status == 409
    assert stale.headers["Content-Type"].startswith("application/json")
    assert stale.headers["x-should-retry"] == "false"
    assert stale.headers["Fencegate-Outcome"] == "refused"
    error = (await stale.json())["error"]
    assert {k: error[k] for k in ("type", "param", "code")} == {
        "type": "invalid_request_error", "param": None, "code": "stale_generation"
    }  # fmt: skip
    assert "below the job's fence" in error["message"]
    assert (error["fencegate"]["presented"], error["fencegate"]["current"]) == (old, new)

    h = fenced("r", "s", new)
    assert (await g.client.post("/proxy/pay/v1/charges", data=b"a", headers=h)).status == 200
    mismatch = await g.client.post("/proxy/pay/v1/charges", data=b"b", headers=h)
    assert mismatch.status == 422  # the gateway's status: the SDK's UnprocessableEntityError
    assert (await mismatch.json())["error"]["code"] == "intent_mismatch"
    assert mismatch.headers["x-should-retry"] == "false"

    receiver.hold()  # a duplicate while the first is in flight: transient
    first = asyncio.create_task(
        g.client.post("/proxy/pay/v1/charges", data=b"x", headers=fenced("r", "t", new))
    )
    await asyncio.wait_for(receiver.arrived.wait(), 5)
    busy = await g.client.post("/proxy/pay/v1/charges", data=b"x", headers=fenced("r", "t", new))
    receiver.gate.set()
    assert (await first).status == 200
    assert busy.status == 409
    assert busy.headers["x-should-retry"] == "true" and "Retry-After" in busy.headers
    assert (await busy.json())["error"]["code"] == "effect_in_progress"

    receiver.statuses = [503]
    unknown = await g.client.post("/proxy/pay/v1/charges", data=b"x", headers=fenced("r", "u", new))
    assert unknown.status == 504
    assert (await unknown.json())["error"]["type"] == "server_error"
    assert unknown.headers["x-should-retry"] == "false"  # the upstream does not dedupe
