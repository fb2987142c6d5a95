"""Headers with a say: ``tenant_header_values`` (a risky header, e.g. ``Stripe-Account``, is
forwarded only with a value the caller's tenant may send) and ``intent_headers`` (the
values of chosen headers are part of the step's intent)."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.runtime.settings import ConfigError
from tests.conftest import Gateway
from tests.support.proxying import KEYS, Receiver, auth, fenced, register, upstreams


def guarded(base: str, **shared: Any) -> dict[str, Any]:
    ups = upstreams(base)
    ups["shared"].update(
        routes=["POST /hook", "GET /hook"],
        forward_headers=["Stripe-Account", "Stripe-Version"],
        tenant_header_values={"acme": {"stripe-account": ["acct_1", "acct_2"]}},
        **shared,
    )
    return ups


@pytest.fixture
async def ggw(make_gateway: Any, receiver: Receiver, secrets: None) -> Gateway:
    g: Gateway = await make_gateway(auth=auth(), upstreams=guarded(receiver.url))
    return g


async def test_a_risky_header_is_forwarded_only_with_a_value_of_the_callers_tenant(
    ggw: Gateway, receiver: Receiver
) -> None:
    acme = await register(ggw, "r")
    globex = await register(ggw, "r", "sched-globex")
    ok = await ggw.client.post(
        "/proxy/shared/hook", data=b"x",
        headers=fenced("r", "a", acme, **{"Stripe-Account": "acct_1"}),
    )  # fmt: skip
    assert ok.status == 200, await ok.text()
    assert receiver.seen[0].headers["Stripe-Account"] == "acct_1"
    refused = [
        ("acme", acme, "acct_9"),  # a value acme may not send
        ("acme", acme, "ACCT_1"),  # values are compared exactly
        ("globex", globex, "acct_1"),  # a tenant with no entry for the header
    ]
    for tenant, gen, value in refused:
        resp = await ggw.client.post(
            "/proxy/shared/hook", data=b"x",
            headers=fenced("r", "b", gen, tenant, **{"Stripe-Account": value}),
        )  # fmt: skip
        assert resp.status == 403, (tenant, value)
        body = await resp.json()
        assert body["code"] == "forbidden" and "Stripe-Account" in body["detail"]
        assert value not in body["detail"]
        assert resp.headers["X-Should-Retry"] == "false"
    read = await ggw.client.get(
        "/proxy/shared/hook",
        headers={"Authorization": f"Bearer {KEYS['globex']}", "Stripe-Account": "acct_1"},
    )
    assert read.status == 403  # a read may not reach another tenant's account either
    twice = await ggw.client.post(
        "/proxy/shared/hook", data=b"x",
        headers=[*fenced("r", "c", acme).items(), ("Stripe-Account", "acct_1"),
                 ("Stripe-Account", "acct_9")],
    )  # fmt: skip
    assert twice.status == 403  # every value of a repeated header is checked
    assert len(receiver.seen) == 1
    # without the header the call is forwarded, and other forwarded headers are not guarded
    plain = await ggw.client.post(
        "/proxy/shared/hook", data=b"x",
        headers=fenced("r", "d", globex, "globex", **{"Stripe-Version": "2024-06-20"}),
    )  # fmt: skip
    assert plain.status == 200
    assert "Stripe-Account" not in receiver.seen[1].headers


async def test_a_guarded_headers_value_is_part_of_the_intent(
    ggw: Gateway, receiver: Receiver
) -> None:
    gen = await register(ggw, "r")
    h = fenced("r", "a", gen, **{"Stripe-Account": "acct_1"})
    assert (await ggw.client.post("/proxy/shared/hook", data=b"x", headers=h)).status == 200
    other = await ggw.client.post(
        "/proxy/shared/hook", data=b"x", headers={**h, "Stripe-Account": "acct_2"}
    )
    assert other.status == 422
    assert (await other.json())["code"] == "intent_mismatch"
    same = await ggw.client.post("/proxy/shared/hook", data=b"x", headers=h)
    assert same.headers["Fencegate-Outcome"] == "replayed"
    assert len(receiver.seen) == 1


async def test_intent_headers_join_the_digest_by_name_in_any_case(
    make_gateway: Any, receiver: Receiver, secrets: None
) -> None:
    g: Gateway = await make_gateway(
        auth=auth(),
        upstreams=upstreams(
            receiver.url, forward_headers=["Stripe-Version", "X-Partner-Mode"],
            intent_headers=["stripe-version"],
        ),
    )  # fmt: skip
    gen = await register(g, "r")
    h = fenced("r", "charge", gen, **{"Stripe-Version": "2024-06-20", "X-Partner-Mode": "a"})
    assert (await g.client.post("/proxy/pay/v1/charges", data=b"x", headers=h)).status == 200
    # a header not chosen may change (an SDK's telemetry): the same request, replayed
    again = await g.client.post(
        "/proxy/pay/v1/charges", data=b"x",
        headers={**h, "X-Partner-Mode": "b", "STRIPE-VERSION": "2024-06-20"},
    )  # fmt: skip
    assert again.headers["Fencegate-Outcome"] == "replayed", await again.text()
    for changed in ({**h, "Stripe-Version": "2025-01-01"}, {**fenced("r", "charge", gen)}):
        resp = await g.client.post("/proxy/pay/v1/charges", data=b"x", headers=changed)
        assert resp.status == 422  # another value, or none: another request
        assert (await resp.json())["code"] == "intent_mismatch"
    assert len(receiver.seen) == 1


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"tenant_header_values": {"nobody": {"Stripe-Account": ["a"]}}}, "nobody"),
        ({"tenant_header_values": {"acme": {"X-Unlisted": ["a"]}}}, "not forwarded"),
        ({"tenant_header_values": {"acme": {"Stripe-Account": []}}}, "at least one value"),
        ({"tenant_header_values": {"acme": {"Stripe-Account": ["a\nb"]}}}, "Stripe-Account"),
        ({"tenant_header_values": {"acme": {"Stripe-Account": ["a"], "stripe-account": ["b"]}}},
         "twice"),
        ({"intent_headers": ["X-Unlisted"]}, "not forwarded"),
        ({"intent_headers": ["Bad Name"]}, "intent_headers"),
    ],
)  # fmt: skip
async def test_a_wrong_header_table_refuses_to_start(
    make_gateway: Any, receiver: Receiver, secrets: None, change: dict[str, Any], match: str
) -> None:
    ups = upstreams(receiver.url, forward_headers=["Stripe-Account"])
    ups["pay"].update(change)
    with pytest.raises(ConfigError, match=match):
        await make_gateway(auth=auth(), upstreams=ups)
