"""JSON numbers are carried exactly or refused, never changed.

orjson turns integers beyond 64 bits into floats without an error: left to it, a payload
with such an integer would reach the downstream changed, and two different big integers
would get the same intent digest. The gateway's number model (README "JSON numbers"): an integer (no
fraction, no exponent) is carried exactly at any size; a number with a fraction or an
exponent is an IEEE 754 double; a number without a finite double (``1e999``), one that
underflows to zero (``1e-400``) and the non-JSON ``NaN`` / ``Infinity`` are refused
with ``400 invalid_request`` naming the field.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from tests.conftest import Gateway, Upstream
from tests.support.calls import problem
from tests.support.docs import docs_text

HEADERS = {"Fencing-Token": "1", "Content-Type": "application/json"}

BIG = [
    2**63 + 1,  # beyond int64: orjson still reads it exactly (uint64)
    2**64,  # beyond uint64, yet a float holds it exactly: alone it would not catch a float
    2**70 + 1,  # beyond uint64, no float holds it
    -(2**63) - 1,  # below int64
    -(2**70 + 1),
    10**40 + 7,
]


def effect_body(raw_value: bytes) -> bytes:
    return b'{"adapter": "hook", "operation": "send", "payload": {"v": ' + raw_value + b"}}"


async def post_raw(
    gw: Gateway, step: str, body: bytes, headers: dict[str, str] | None = None
) -> Any:
    return await gw.client.post(
        f"/v1/jobs/n/effects/{step}", data=body, headers={**HEADERS, **(headers or {})}
    )


@pytest.mark.parametrize("value", BIG, ids=str)
async def test_big_integers_reach_the_downstream_exactly(
    gw: Gateway, upstream: Upstream, value: int
) -> None:
    assert (await gw.register("n", generation=1)).status == 201
    resp = await post_raw(gw, "s", effect_body(str(value).encode()))
    assert resp.status == 200, await resp.text()
    [received] = upstream.received
    assert received.body == b'{"v":' + str(value).encode() + b"}"  # the digits, not a float
    assert type(received.json()["v"]) is int and received.json()["v"] == value


async def test_big_integers_reach_the_downstream_exactly_through_the_relay(
    gw: Gateway, upstream: Upstream
) -> None:
    value = 2**70 + 1
    assert (await gw.register("n", generation=1)).status == 201
    resp = await post_raw(gw, "s", effect_body(str(value).encode()), {"Prefer": "respond-async"})
    assert resp.status == 202, await resp.text()
    await asyncio.wait_for(upstream.arrived.wait(), 10)
    assert upstream.received[0].body == b'{"v":' + str(value).encode() + b"}"


@pytest.mark.parametrize(
    ("first", "second"),
    [(2**70 + 1, 2**70 + 2), (2**64 + 1, 2**64), (-(2**70) - 1, -(2**70) - 2)],
    ids=str,
)
async def test_distinct_big_integers_pin_distinct_intents(
    gw: Gateway, upstream: Upstream, first: int, second: int
) -> None:
    """Two integers that round to the same float are two intents: the second is refused as a
    mismatch (it used to be answered as a replay of the first)."""
    assert (await gw.register("n", generation=1)).status == 201
    assert (await post_raw(gw, "s", effect_body(str(first).encode()))).status == 200
    body = await problem(await post_raw(gw, "s", effect_body(str(second).encode())), 422,
                         "intent_mismatch")  # fmt: skip
    assert body["pinned_intent_sha256"]
    assert len(upstream.received) == 1


@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        (b"1e999", "1e999"),
        (b"-1e999", "-1e999"),
        (b"1E+400", "1E+400"),
        (b"1e-400", "1e-400"),
        (b"NaN", "NaN"),
        (b"Infinity", "Infinity"),
        (b"-Infinity", "-Infinity"),
    ],
)
async def test_numbers_the_gateway_cannot_carry_are_refused_naming_the_field(
    gw: Gateway, upstream: Upstream, raw: bytes, shown: str
) -> None:
    assert (await gw.register("n", generation=1)).status == 201
    body = b'{"adapter": "hook", "operation": "send", "payload": {"a": [1, {"b": ' + raw + b"}]}}"
    out = await problem(await post_raw(gw, "s", body), 400, "invalid_request")
    assert out["detail"].startswith(f"payload.a.1.b: the number {shown} "), out["detail"]
    assert upstream.received == []
    assert (await gw.client.get("/v1/jobs/n/effects/s")).status == 404  # nothing pinned


@pytest.mark.parametrize(
    ("payload", "digest"),
    [
        (
            {"to": "a@example.com"},
            "f29dab5c03bb355b6c36b73445dfaf7006a06f993c7a0d0882ac4dff403ba02d",
        ),
        (
            {"n": 1, "x": 0.1, "e": 1e16, "neg": -3, "z": -0.0},
            "7140236a94162275f75c67ea72a9722775e7509a3b3b9445922b78ee95dc1e0f",
        ),
        (
            {"i64": 2**63 - 1, "u64": 2**64 - 1, "big": 2**60},
            "eeb7a616185f2ea478f4b31138d652a9b2ca7d34dbe42c9eec3ce9859daf9563",
        ),
        (
            {"s": "café €", "l": [True, False, None, 1.5e-7]},
            "354750ed5617e274eaa7400c7029ed28986b16fc0943a2a1e338569acc1ccb1c",
        ),
    ],
    ids=["email", "floats", "u64", "text"],
)
async def test_intent_digests_of_ordinary_payloads_are_unchanged(
    gw: Gateway, payload: Any, digest: str
) -> None:
    """A stored intent's digest never changes: everything accepted before hashes as before
    (stdlib canonical JSON): these digests are the form every pinned intent was stored in."""
    assert (await gw.register("n", generation=1)).status == 201
    body = {"adapter": "hook", "operation": "send", "payload": payload}
    resp = await gw.client.post("/v1/jobs/n/effects/s", json=body, headers=HEADERS)
    assert resp.status == 200, await resp.text()
    record = await (await gw.client.get("/v1/jobs/n/effects/s")).json()
    assert record["intent_sha256"] == digest


# -- stored results: what a downstream answered comes back exactly on every replay ----------


@pytest.fixture
async def answering() -> AsyncIterator[dict[str, Any]]:
    """A loopback receiver that answers with the raw bytes in ``state["answer"]``."""
    state: dict[str, Any] = {"answer": b"{}", "received": 0}

    async def handle(request: web.Request) -> web.Response:
        await request.read()
        state["received"] += 1
        return web.Response(body=state["answer"], content_type="application/json")

    app = web.Application()
    app.router.add_post("/hook", handle)
    server = TestServer(app, host="127.0.0.1", port=0)
    await server.start_server()
    state["url"] = str(server.make_url("/hook"))
    yield state
    await server.close()


async def test_big_integers_in_a_stored_result_replay_exactly(
    make_gateway: Any, answering: dict[str, Any]
) -> None:
    value = 2**70 + 1
    answering["answer"] = b'{"id": ' + str(value).encode() + b', "neg": -18446744073709551617}'
    gw: Gateway = await make_gateway(
        adapters={"hook": {"type": "webhook", "url": answering["url"]}}
    )
    assert (await gw.register("n", generation=1)).status == 201
    for replayed in (False, True):
        resp = await post_raw(gw, "s", effect_body(b"1"))
        assert resp.status == 200, await resp.text()
        raw = await resp.read()
        assert str(value).encode() in raw and b"-18446744073709551617" in raw
        out = json.loads(raw)
        assert out["replayed"] is replayed
        assert out["result"]["body"] == {"id": value, "neg": -(2**64) - 1}
    record = json.loads(await (await gw.client.get("/v1/jobs/n/effects/s")).read())
    assert record["result"]["body"]["id"] == value
    assert answering["received"] == 1


async def test_a_downstream_answer_with_numbers_json_cannot_carry_is_stored_as_text(
    make_gateway: Any, answering: dict[str, Any]
) -> None:
    """``{"v": 1e999}`` has no finite double: kept as the text it was, not turned into null."""
    answering["answer"] = b'{"v": 1e999, "w": NaN}'
    gw: Gateway = await make_gateway(
        adapters={"hook": {"type": "webhook", "url": answering["url"]}}
    )
    assert (await gw.register("n", generation=1)).status == 201
    for _ in range(2):
        resp = await post_raw(gw, "s", effect_body(b"1"))
        assert resp.status == 200, await resp.text()
        assert (await resp.json())["result"]["body"] == '{"v": 1e999, "w": NaN}'


async def test_an_operator_result_with_a_big_integer_is_kept_exactly(
    gw: Gateway, upstream: Upstream
) -> None:
    assert (await gw.register("n", generation=1)).status == 201
    upstream.behaviour = "drop"  # the connection is lost after the request was sent
    await problem(await post_raw(gw, "s", effect_body(b"1")), 504, "outcome_unknown")
    value = 2**70 + 1
    resp = await gw.client.post(
        "/v1/jobs/n/effects/s/resolve",
        data=b'{"outcome": "delivered", "result": {"charge": ' + str(value).encode() + b"}}",
        headers={"Content-Type": "application/json"},
    )
    assert resp.status == 200, await resp.text()
    record = json.loads(await (await gw.client.get("/v1/jobs/n/effects/s")).read())
    assert record["result"] == {"charge": value}


def test_the_readme_says_what_these_tests_check() -> None:

    readme = docs_text()
    section = " ".join(readme.split("### JSON numbers", 1)[1].split("\n### ", 1)[0].split())
    for claim in (
        "**An integer (no fraction, no exponent) is carried exactly, at any size**",
        "`1180591620717411303425` (2^70+1) reaches a webhook as those digits",
        "(`422 intent_mismatch`, not a replay)",
        "(`payload.a.1.b: the number 1e999 has no finite IEEE 754 double (it overflows); …`)",
        "(`1e999`, `-1e999`), a non-zero number that becomes 0 (`1e-400`), `NaN` and `Infinity`",
        "A downstream answer with such numbers is stored, and replayed, as its text.",
        "a digest of a stored intent never changes",
    ):
        assert claim in section, claim
    assert str(2**70 + 1) == "1180591620717411303425"
