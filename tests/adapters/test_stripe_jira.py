"""stripe and jira adapters against Stripe- and Jira-compatible servers on loopback."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from adapters.jira import key_label
from gateway.runtime.settings import ConfigError
from gateway.store.embedded import free_port
from tests.conftest import Gateway
from tests.support.peers import JiraPeer, StripePeer


@pytest.fixture
async def pgw(
    make_gateway: Any, stripe: StripePeer, jira: JiraPeer, monkeypatch: pytest.MonkeyPatch
) -> Gateway:
    monkeypatch.setenv("TEST_STRIPE_KEY", stripe.api_key)
    monkeypatch.setenv("TEST_JIRA_USER", jira.user)
    monkeypatch.setenv("TEST_JIRA_TOKEN", jira.token)
    gw: Gateway = await make_gateway(
        adapters={
            "payments": {
                "type": "stripe",
                "base_url": stripe.url,
                "api_key_env": "TEST_STRIPE_KEY",
                "timeout_seconds": 1,
            },
            "tickets": {
                "type": "jira",
                "base_url": jira.url,
                "project": "OPS",
                "user_env": "TEST_JIRA_USER",
                "api_key_env": "TEST_JIRA_TOKEN",
                "timeout_seconds": 1,
            },
            "deadpay": {
                "type": "stripe",
                "base_url": f"http://127.0.0.1:{free_port()}",
                "api_key_env": "TEST_STRIPE_KEY",
            },
        }
    )
    await gw.register("r", generation=1)
    return gw


CHARGE = {
    "amount": 1999,
    "currency": "eur",
    "customer": "cus_1",
    "description": "order 7",
    "metadata": {"order": "7"},
}
ISSUE = {"summary": "Refund order 7", "description": "Customer asked twice.", "labels": ["billing"]}


async def charge(
    gw: Gateway,
    token: int = 1,
    payload: Any = None,
    step: str = "charge",
    adapter: str = "payments",
) -> Any:
    return await gw.effect(
        "r",
        step,
        token,
        adapter=adapter,
        operation="create_payment_intent",
        payload=payload or CHARGE,
    )


async def ticket(gw: Gateway, token: int = 1, payload: Any = None, step: str = "ticket") -> Any:
    return await gw.effect(
        "r", step, token, adapter="tickets", operation="create_issue", payload=payload or ISSUE
    )


async def code(resp: Any) -> tuple[int, str]:
    body = await resp.json(content_type=None)
    return resp.status, body.get("code") or ("replayed" if body.get("replayed") else "sent")


# -- stripe --------------------------------------------------------------------


async def test_stripe_key_travels_as_header_and_metadata(pgw: Gateway, stripe: StripePeer) -> None:
    resp = await charge(pgw)
    body = await resp.json()
    assert resp.status == 200, body
    [(path, idem, form)] = stripe.requests
    assert (path, idem) == ("/v1/payment_intents", "r:charge")
    assert (
        form["metadata[fencegate_key]"] == "r:charge"
        and form["metadata[fencegate_generation]"] == "1"
    )
    assert form["metadata[order]"] == "7" and form["amount"] == "1999" and form["currency"] == "eur"
    [pi] = stripe.created()
    assert (
        body["result"]["id"] == pi["id"]
        and body["result"]["metadata"]["fencegate_key"] == "r:charge"
    )
    assert await code(await charge(pgw)) == (200, "replayed")
    assert len(stripe.requests) == 1  # a replay never reaches Stripe


async def test_stripe_zombie_never_reaches_stripe(pgw: Gateway, stripe: StripePeer) -> None:
    await pgw.register("r", generation=2)
    assert await code(await charge(pgw, token=1)) == (409, "stale_generation")
    assert stripe.requests == []


@pytest.mark.parametrize(
    ("payload", "mode", "expected", "state"),
    [
        ({**CHARGE, "amount": 402}, "ok", (424, "effect_failed"), "failed"),  # card_error
        ({k: v for k, v in CHARGE.items() if k != "currency"}, "skip", None, None),
        (CHARGE, "429", (502, "adapter_unavailable"), "released"),
        (CHARGE, "500", (504, "outcome_unknown"), "unknown"),
        (CHARGE, "drop_after_create", (504, "outcome_unknown"), "unknown"),
    ],
)
async def test_stripe_classification(
    pgw: Gateway, stripe: StripePeer, payload: Any, mode: str, expected: Any, state: Any
) -> None:
    if mode == "skip":  # a payload that does not fit the operation: 400, never sent
        assert await code(await charge(pgw, payload=payload)) == (400, "invalid_request")
        assert stripe.requests == []
        return
    stripe.mode = mode
    assert await code(await charge(pgw, payload=payload)) == expected
    assert (await (await pgw.client.get("/v1/jobs/r/effects/charge")).json())["state"] == state
    if state == "failed":
        assert (await (await charge(pgw, payload=payload)).json())["error"]["error"][
            "type"
        ] == "card_error"


async def test_stripe_connection_refused_is_not_delivered(pgw: Gateway) -> None:
    assert await code(await charge(pgw, adapter="deadpay")) == (502, "adapter_unavailable")


async def test_stripe_unknown_resolved_by_lookup_without_second_charge(
    pgw: Gateway, stripe: StripePeer
) -> None:
    stripe.mode = "drop_after_create"  # Stripe created it; the response was lost
    assert await code(await charge(pgw)) == (504, "outcome_unknown")
    stripe.mode = "ok"
    resp = await charge(pgw)
    body = await resp.json()
    assert resp.status == 200 and body["replayed"] is True, body
    assert len(stripe.created()) == 1 and body["result"]["id"] == stripe.created()[0]["id"]
    assert len(stripe.requests) == 1  # resolved by the Search API, not by sending again
    view = await (await pgw.client.get("/v1/jobs/r/effects/charge")).json()
    assert view["state"] == "succeeded"


async def test_stripe_unknown_with_search_lag_resends_under_same_key(
    pgw: Gateway, stripe: StripePeer
) -> None:
    stripe.mode = "drop_after_create"
    assert await code(await charge(pgw)) == (504, "outcome_unknown")
    stripe.mode = "search_lag"  # search cannot see it yet: the key must protect us
    resp = await charge(pgw)
    assert resp.status == 200, await resp.text()
    assert len(stripe.created()) == 1
    assert [idem for _, idem, _ in stripe.requests] == ["r:charge", "r:charge"]


async def test_stripe_5xx_then_resend_creates_once(pgw: Gateway, stripe: StripePeer) -> None:
    stripe.mode = "500"
    assert await code(await charge(pgw)) == (504, "outcome_unknown")
    stripe.mode = "ok"
    assert (await charge(pgw)).status == 200
    assert len(stripe.created()) == 1


async def test_stripe_refund_and_its_lookup(pgw: Gateway, stripe: StripePeer) -> None:
    pi = (await (await charge(pgw)).json())["result"]["id"]
    stripe.mode = "drop_after_create"
    refund = {"payment_intent": pi, "amount": 500}
    resp = await pgw.effect(
        "r", "refund", 1, adapter="payments", operation="create_refund", payload=refund
    )
    assert await code(resp) == (504, "outcome_unknown")
    stripe.mode = "ok"
    resp = await pgw.effect(
        "r", "refund", 1, adapter="payments", operation="create_refund", payload=refund
    )
    assert await code(resp) == (200, "replayed")
    assert len(stripe.created("refund")) == 1


async def test_stripe_racing_generations_one_payment_intent(
    pgw: Gateway, stripe: StripePeer
) -> None:
    async def takeover() -> None:
        await asyncio.sleep(0.002)
        await pgw.register("r", generation=2)

    results = await asyncio.gather(*(charge(pgw, token=t) for t in (1, 2) * 10), takeover())
    assert any(r.status == 200 for r in results[:-1])
    assert len(stripe.created()) == 1


async def test_stripe_missing_secret_fails_the_start(make_gateway: Any, stripe: StripePeer) -> None:
    with pytest.raises(ConfigError, match="NO_SUCH_STRIPE_KEY"):
        await make_gateway(
            adapters={
                "payments": {
                    "type": "stripe",
                    "base_url": stripe.url,
                    "api_key_env": "NO_SUCH_STRIPE_KEY",
                }
            }
        )


# -- jira ----------------------------------------------------------------------


async def test_jira_issue_carries_the_key_label(pgw: Gateway, jira: JiraPeer) -> None:
    resp = await ticket(pgw)
    body = await resp.json()
    assert resp.status == 200, body
    [issue] = jira.issues.values()
    assert (
        key_label("r:ticket") in issue["fields"]["labels"]
        and "billing" in issue["fields"]["labels"]
    )
    assert "[fencegate r:ticket generation 1" in issue["fields"]["description"]
    assert body["result"]["key"] == "OPS-1"
    assert await code(await ticket(pgw)) == (200, "replayed")
    assert len(jira.issues) == 1


async def test_jira_zombie_never_files_a_ticket(pgw: Gateway, jira: JiraPeer) -> None:
    await pgw.register("r", generation=2)
    assert await code(await ticket(pgw, token=1)) == (409, "stale_generation")
    assert jira.issues == {}


@pytest.mark.parametrize(
    ("mode", "payload", "expected"),
    [
        ("ok", {**ISSUE, "summary": ""}, (400, "invalid_request")),  # never sent
        ("503", ISSUE, (504, "outcome_unknown")),  # a proxy may answer 503 after forwarding
        ("500", ISSUE, (504, "outcome_unknown")),
        ("drop_after_create", ISSUE, (504, "outcome_unknown")),
    ],
)
async def test_jira_classification(
    pgw: Gateway, jira: JiraPeer, mode: str, payload: Any, expected: Any
) -> None:
    jira.mode = mode
    assert await code(await ticket(pgw, payload=payload)) == expected


async def test_jira_404_comment_is_failed(pgw: Gateway, jira: JiraPeer) -> None:
    resp = await pgw.effect(
        "r",
        "c",
        1,
        adapter="tickets",
        operation="add_comment",
        payload={"issue_key": "OPS-99", "body": "hi"},
    )
    assert await code(resp) == (424, "effect_failed")


async def test_jira_unknown_resolved_by_jql_without_second_ticket(
    pgw: Gateway, jira: JiraPeer
) -> None:
    jira.mode = "drop_after_create"
    assert await code(await ticket(pgw)) == (504, "outcome_unknown")
    jira.mode = "ok"
    resp = await ticket(pgw)
    body = await resp.json()
    assert resp.status == 200 and body["replayed"] is True and body["result"]["key"] == "OPS-1", (
        body
    )
    assert len(jira.issues) == 1


async def test_jira_unknown_that_never_happened_is_dispatched_again(
    pgw: Gateway, jira: JiraPeer
) -> None:
    jira.mode = "500"  # refused before creating: lookup finds nothing, so it is safe to send
    assert await code(await ticket(pgw)) == (504, "outcome_unknown")
    jira.mode = "ok"
    assert await code(await ticket(pgw)) == (200, "sent")
    assert len(jira.issues) == 1


async def test_jira_comment_reconciled_by_marker(pgw: Gateway, jira: JiraPeer) -> None:
    assert (await ticket(pgw)).status == 200
    jira.mode = "drop_after_create"
    comment = {"issue_key": "OPS-1", "body": "Refunded."}
    resp = await pgw.effect(
        "r", "comment", 1, adapter="tickets", operation="add_comment", payload=comment
    )
    assert await code(resp) == (504, "outcome_unknown")
    jira.mode = "ok"
    resp = await pgw.effect(
        "r", "comment", 1, adapter="tickets", operation="add_comment", payload=comment
    )
    assert await code(resp) == (200, "replayed")
    assert len(jira.comments["OPS-1"]) == 1


async def test_jira_racing_generations_one_ticket(pgw: Gateway, jira: JiraPeer) -> None:
    async def takeover() -> None:
        await asyncio.sleep(0.002)
        await pgw.register("r", generation=2)

    results = await asyncio.gather(*(ticket(pgw, token=t) for t in (1, 2) * 10), takeover())
    assert any(r.status == 200 for r in results[:-1])
    assert len(jira.issues) == 1
