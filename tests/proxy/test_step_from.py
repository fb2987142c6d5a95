"""``step_from``: the step of a proxied request that sends no ``Fencegate-Step`` — the
client's own ``Idempotency-Key``, or a string of its JSON body — only where configured."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.runtime.settings import ConfigError
from tests.conftest import Gateway
from tests.support.proxying import KEYS, Receiver, auth, fenced, register, upstreams


def unstepped(job: str, token: int, **extra: str) -> dict[str, str]:
    h = fenced(job, "unused", token, **extra)
    del h["Fencegate-Step"]
    return h


async def effect(g: Gateway, job: str, step: str) -> Any:
    resp = await g.client.get(
        f"/v1/jobs/{job}/effects/{step}", headers={"Authorization": f"Bearer {KEYS['audit']}"}
    )
    return resp.status, await resp.json()


async def test_a_trusted_idempotency_key_is_the_step(
    make_gateway: Any, receiver: Receiver, secrets: None
) -> None:
    g: Gateway = await make_gateway(
        auth=auth(), upstreams=upstreams(receiver.url, step_from="idempotency_key")
    )
    gen = await register(g, "r")
    h = unstepped("r", gen, **{"Idempotency-Key": "order-42"})
    first = await g.client.post("/proxy/pay/v1/charges", data=b"x", headers=h)
    assert first.status == 200, await first.text()
    assert first.headers["Fencegate-Outcome"] == "forwarded"
    again = await g.client.post("/proxy/pay/v1/charges", data=b"x", headers=h)
    assert again.headers["Fencegate-Outcome"] == "replayed"
    assert [s.headers["Idempotency-Key"] for s in receiver.seen] == ["acme/r:order-42"]
    status, record = await effect(g, "r", "order-42")
    assert (status, record["state"], record["result"]["client_key"]) == (
        200, "succeeded", "order-42"
    )  # fmt: skip
    # a Fencegate-Step still names the step when it is sent
    named = await g.client.post(
        "/proxy/pay/v1/charges", data=b"x", headers={**h, "Fencegate-Step": "other"}
    )
    assert named.headers["Fencegate-Outcome"] == "forwarded"
    assert receiver.seen[-1].headers["Idempotency-Key"] == "acme/r:other"


@pytest.mark.parametrize("key", [None, "has space", "../escape", "x" * 129, "-lead"])
async def test_a_missing_key_or_one_that_is_no_step_name_is_400(
    make_gateway: Any, receiver: Receiver, secrets: None, key: str | None
) -> None:
    g: Gateway = await make_gateway(
        auth=auth(), upstreams=upstreams(receiver.url, step_from="idempotency_key")
    )
    gen = await register(g, "r")
    h = unstepped("r", gen) if key is None else unstepped("r", gen, **{"Idempotency-Key": key})
    resp = await g.client.post("/proxy/pay/v1/charges", data=b"x", headers=h)
    assert resp.status == 400, await resp.text()
    body = await resp.json()
    assert body["code"] == "invalid_request"
    assert ("Idempotency-Key" if key is None else "must match") in body["detail"]
    assert resp.headers["X-Should-Retry"] == "false"
    assert receiver.seen == []


async def test_without_step_from_an_idempotency_key_is_not_a_step(
    gw: Gateway, receiver: Receiver
) -> None:
    gen = await register(gw, "r")
    h = unstepped("r", gen, **{"Idempotency-Key": "order-42"})
    resp = await gw.client.post("/proxy/pay/v1/charges", data=b"x", headers=h)
    assert resp.status == 400
    assert "Fencegate-Step" in (await resp.json())["detail"]
    assert receiver.seen == []


async def test_a_step_from_the_json_body(
    make_gateway: Any, receiver: Receiver, secrets: None
) -> None:
    g: Gateway = await make_gateway(
        auth=auth(), upstreams=upstreams(receiver.url, step_from="json:/meta/order~1id")
    )
    gen = await register(g, "r")
    h = unstepped("r", gen, **{"Content-Type": "application/json"})
    body = '{"amount": 5, "meta": {"order/id": "ord_7"}}'
    first = await g.client.post("/proxy/pay/v1/charges", data=body, headers=h)
    assert first.status == 200, await first.text()
    again = await g.client.post(
        "/proxy/pay/v1/charges", data='{"meta":{"order/id":"ord_7"},"amount":5}', headers=h
    )
    assert again.headers["Fencegate-Outcome"] == "replayed"
    assert [s.headers["Idempotency-Key"] for s in receiver.seen] == ["acme/r:ord_7"]
    assert (await effect(g, "r", "ord_7"))[1]["state"] == "succeeded"
    for refused in (
        '{"meta": {"order/id": 7}}',  # not a string
        '{"meta": {"order/id": "no spaces"}}',  # not a step name
        '{"meta": {}}',  # absent
        "not json",
        "",
    ):
        resp = await g.client.post("/proxy/pay/v1/charges", data=refused, headers=h)
        assert resp.status == 400, refused
        assert (await resp.json())["code"] == "invalid_request"
    assert len(receiver.seen) == 1


@pytest.mark.parametrize("value", ["header", "json:", "json:order", "json:/a~2b"])
async def test_a_wrong_step_from_refuses_to_start(
    make_gateway: Any, receiver: Receiver, secrets: None, value: str
) -> None:
    with pytest.raises(ConfigError, match=r"upstreams\.pay\.step_from"):
        await make_gateway(auth=auth(), upstreams=upstreams(receiver.url, step_from=value))
