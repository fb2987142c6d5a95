"""Two tenants on one gateway, against real peers: effects never cross tenants.

Tenants ``a`` and ``b`` (one admin key each) share a Stripe-compatible server, a
Jira-compatible server, an aiosmtpd sink and a webhook receiver. Each way one tenant's
call could reach or collide with another's is here, refused or keyed apart (a downstream
key of ``<job>:<step>`` for every tenant fails them).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from adapters.jira import key_label
from adapters.registry import validate_configs
from adapters.smtp import message_id_for
from gateway.fencing.tenancy import resolve_tenancy
from gateway.runtime.settings import ConfigError, load_settings
from tests.conftest import Gateway, Upstream, key_digest
from tests.support.peers import JiraPeer, Sink, StripePeer

KEYS = {"a": "ad-tenant-a-0123456789abcdef", "b": "ad-tenant-b-0123456789abcdef"}
CHARGE = {"amount": 1999, "currency": "eur", "description": "order", "metadata": {"o": "1"}}
ISSUE = {"summary": "Refund order 7", "description": "Customer asked twice."}
MAIL = {"to": ["c@example.com"], "subject": "Receipt", "text": "Thanks."}


def auth() -> dict[str, Any]:
    return {
        "keys": [
            {"role": "admin", "sha256": key_digest(key), "tenant": tenant}
            for tenant, key in KEYS.items()
        ]
    }


def bearer(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


@dataclasses.dataclass
class Two:
    a: Gateway
    b: Gateway


def adapters(stripe: StripePeer, jira: JiraPeer, sink: Sink, upstream: Upstream) -> Any:
    return {
        "payments": {
            "type": "stripe",
            "base_url": stripe.url,
            "api_key_env": "TEST_STRIPE_KEY",
            "timeout_seconds": 2,
        },
        "connect": {  # tenant a's only: may route money on behalf of a connected account
            "type": "stripe",
            "base_url": stripe.url,
            "api_key_env": "TEST_STRIPE_KEY",
            "tenants": ["a"],
            "allow_fields": {"create_payment_intent": ["on_behalf_of"]},
        },
        "tickets": {
            "type": "jira",
            "base_url": jira.url,
            "project": "OPS",
            "user_env": "TEST_JIRA_USER",
            "api_key_env": "TEST_JIRA_TOKEN",
            "timeout_seconds": 2,
            "tenants": "*",
        },
        "email": {
            "type": "smtp",
            "host": "127.0.0.1",
            "port": sink.port,
            "sender": "jobs@example.com",
            "timeout_seconds": 2,
            "allowed_sender_domains": ["a.example"],
        },
        "a-hook": {"type": "webhook", "url": upstream.url, "tenants": ["a"]},
    }


@pytest.fixture
async def two(
    make_gateway: Any,
    stripe: StripePeer,
    jira: JiraPeer,
    sink: Sink,
    upstream: Upstream,
    monkeypatch: pytest.MonkeyPatch,
) -> Two:
    monkeypatch.setenv("TEST_STRIPE_KEY", stripe.api_key)
    monkeypatch.setenv("TEST_JIRA_USER", jira.user)
    monkeypatch.setenv("TEST_JIRA_TOKEN", jira.token)
    a: Gateway = await make_gateway(
        auth=auth(), headers=bearer("a"), adapters=adapters(stripe, jira, sink, upstream)
    )
    return Two(a, dataclasses.replace(a, headers=bearer("b")))


async def call(
    g: Gateway, job: str, step: str, adapter: str, operation: str, payload: Any
) -> tuple[int, dict[str, Any]]:
    await g.register(job, generation=1)
    resp = await g.effect(job, step, 1, adapter=adapter, operation=operation, payload=payload)
    return resp.status, await resp.json(content_type=None)


async def charge(g: Gateway, job: str, payload: Any = None, adapter: str = "payments") -> Any:
    return await call(g, job, "charge", adapter, "create_payment_intent", payload or CHARGE)


# -- stripe --------------------------------------------------------------------


async def test_b_charging_its_own_order_never_gets_a_payment_intent(
    two: Two, stripe: StripePeer
) -> None:
    status_a, body_a = await charge(two.a, "order-1001")
    status_b, body_b = await charge(two.b, "order-1001")  # same job id, same parameters
    assert (status_a, status_b) == (200, 200), (body_a, body_b)
    assert body_b["replayed"] is False
    assert body_a["result"]["id"] != body_b["result"]["id"]  # B got its own PaymentIntent
    assert len(stripe.created()) == 2
    assert [idem for _, idem, _ in stripe.requests] == [
        "a/order-1001:charge",
        "b/order-1001:charge",
    ]
    assert [pi["metadata"]["fencegate_tenant"] for pi in stripe.created()] == ["a", "b"]
    assert body_b["idempotency_key"] == "b/order-1001:charge"


async def test_b_cannot_preempt_a_key(two: Two, stripe: StripePeer) -> None:
    status, _ = await charge(two.b, "order-1002", {**CHARGE, "amount": 500})
    assert status == 200
    status, body = await charge(two.a, "order-1002")  # A comes second, other parameters
    assert status == 200, body  # on the base: 424, Stripe's idempotency_error
    assert body["result"]["amount"] == 1999
    assert sorted(pi["amount"] for pi in stripe.created()) == [500, 1999]


async def test_b_cannot_refund_a_payment_intent(two: Two, stripe: StripePeer) -> None:
    _, body = await charge(two.a, "order-1003")
    pi = body["result"]["id"]
    refund = {"payment_intent": pi, "amount": 500}
    status, body = await call(two.b, "refund-1", "refund", "payments", "create_refund", refund)
    assert status == 424, body
    assert body["error"]["code"] == "foreign_object"
    assert stripe.created("refund") == []
    assert [path for path, _, _ in stripe.requests] == ["/v1/payment_intents"]  # no refund sent
    # the refusal is recorded with the step and replayed, never re-checked into a send
    view = await (
        await two.b.client.get("/v1/jobs/refund-1/effects/refund", headers=two.b.headers)
    ).json()
    assert view["state"] == "failed"
    # A refunds its own payment
    status, body = await call(two.a, "refund-1", "refund", "payments", "create_refund", refund)
    assert status == 200, body
    assert len(stripe.created("refund")) == 1


@pytest.mark.parametrize(
    ("operation", "extra"),
    [
        ("create_payment_intent", {"transfer_data": {"destination": "acct_evil"}}),
        ("create_payment_intent", {"on_behalf_of": "acct_evil"}),
        ("create_payment_intent", {"application_fee_amount": 1900}),
        ("create_payment_intent", {"expand": ["customer"]}),
        ("create_payment_intent", {"transfer_group": "g"}),
        ("create_refund", {"charge": "ch_1"}),
        ("create_refund", {"reverse_transfer": True}),
    ],
)
async def test_forbidden_stripe_parameters_never_reach_the_peer(
    two: Two, stripe: StripePeer, operation: str, extra: dict[str, Any]
) -> None:
    base = CHARGE if operation == "create_payment_intent" else {"payment_intent": "pi_1"}
    status, body = await call(two.a, "j", "s", "payments", operation, {**base, **extra})
    assert (status, body["code"]) == (400, "invalid_request"), body
    assert repr(next(iter(extra))) in body["detail"] and "allow_fields" in body["detail"]
    assert stripe.requests == []


async def test_allow_fields_enables_a_field_for_its_tenant_only(
    two: Two, stripe: StripePeer
) -> None:
    payload = {**CHARGE, "on_behalf_of": "acct_a"}
    status, body = await charge(two.a, "order-7", payload, adapter="connect")
    assert status == 200, body
    assert stripe.requests[0][2]["on_behalf_of"] == "acct_a"
    status, body = await charge(two.b, "order-7", payload, adapter="connect")
    assert (status, body["code"]) == (422, "unknown_adapter")
    assert len(stripe.requests) == 1


# -- jira ----------------------------------------------------------------------


async def test_b_unknown_jira_step_never_resolved_to_a_ticket(two: Two, jira: JiraPeer) -> None:
    status, body = await call(two.a, "t", "ticket", "tickets", "create_issue", ISSUE)
    assert (status, body["result"]["key"]) == (200, "OPS-1")
    jira.mode = "500"  # B's attempt is refused before anything is created: unknown
    status, body = await call(two.b, "t", "ticket", "tickets", "create_issue", ISSUE)
    assert (status, body["code"]) == (504, "outcome_unknown")
    jira.mode = "ok"  # the lookup must not find A's ticket for B's step
    status, body = await call(two.b, "t", "ticket", "tickets", "create_issue", ISSUE)
    assert status == 200, body
    assert body["replayed"] is False and body["result"]["key"] == "OPS-2"
    assert len(jira.issues) == 2
    labels = {k: i["fields"]["labels"] for k, i in jira.issues.items()}
    assert key_label("a/t:ticket") in labels["OPS-1"] and "fencegate-tenant-a" in labels["OPS-1"]
    assert key_label("b/t:ticket") in labels["OPS-2"] and "fencegate-tenant-b" in labels["OPS-2"]


async def test_comment_outside_the_configured_project_is_refused(two: Two, jira: JiraPeer) -> None:
    jira.issues["SEC-1"] = {"id": "1", "key": "SEC-1", "fields": {"labels": []}}
    comment = {"issue_key": "SEC-1", "body": "leaked"}
    status, body = await call(two.a, "c", "comment", "tickets", "add_comment", comment)
    assert (status, body["code"]) == (400, "invalid_request"), body
    assert "outside this adapter's project 'OPS'" in body["detail"]
    assert jira.comments == {}


async def test_b_cannot_comment_on_a_ticket(two: Two, jira: JiraPeer) -> None:
    await call(two.a, "t", "ticket", "tickets", "create_issue", ISSUE)
    comment = {"issue_key": "OPS-1", "body": "refunded"}
    status, body = await call(two.b, "c", "comment", "tickets", "add_comment", comment)
    assert (status, body["error"]["code"]) == (424, "foreign_object"), body
    assert jira.comments == {}
    status, body = await call(two.a, "c", "comment", "tickets", "add_comment", comment)
    assert status == 200, body
    assert len(jira.comments["OPS-1"]) == 1


async def test_worker_cannot_forge_fencegate_labels(two: Two, jira: JiraPeer) -> None:
    forged = {**ISSUE, "labels": [key_label("a/t:ticket")]}  # would answer A's lookup
    status, body = await call(two.b, "x", "ticket", "tickets", "create_issue", forged)
    assert (status, body["code"]) == (400, "invalid_request"), body
    forged = {**ISSUE, "labels": ["fencegate-tenant-a"]}  # would pass A's ownership check
    status, body = await call(two.b, "x", "ticket2", "tickets", "create_issue", forged)
    assert (status, body["code"]) == (400, "invalid_request"), body
    assert jira.issues == {}


# -- smtp and webhook ----------------------------------------------------------


async def test_smtp_message_ids_differ_per_tenant(two: Two, sink: Sink) -> None:
    for g in (two.a, two.b):
        status, body = await call(g, "r", "notify", "email", "send", MAIL)
        assert status == 200, body
    ids = [m["Message-ID"] for m in sink.messages]
    assert ids == [
        message_id_for("a/r:notify", "fencegate.local"),
        message_id_for("b/r:notify", "fencegate.local"),
    ]
    assert [m["X-Fencegate-Key"] for m in sink.messages] == ["a/r:notify", "b/r:notify"]


async def test_smtp_sender_only_from_allowed_domains(two: Two, sink: Sink) -> None:
    mail = {**MAIL, "from": "billing@a.example"}
    status, body = await call(two.a, "r", "notify", "email", "send", mail)
    assert status == 200, body
    assert sink.messages[0]["From"] == "billing@a.example"
    assert sink.envelopes[0].mail_from == "billing@a.example"
    mail = {**MAIL, "from": "ceo@bank.example"}
    status, body = await call(two.a, "r", "notify2", "email", "send", mail)
    assert (status, body["code"]) == (400, "invalid_request"), body
    assert "sender domains" in body["detail"]
    assert len(sink.messages) == 1


async def test_webhook_keys_differ_per_tenant(two: Two, upstream: Upstream) -> None:
    for g in (two.a, two.b):
        status, body = await call(g, "r", "s", "hook", "notify", {"n": 1})
        assert status == 200, body
    assert [r.headers["Idempotency-Key"] for r in upstream.received] == ["a/r:s", "b/r:s"]


async def test_adapter_of_another_tenant_is_unknown_adapter(two: Two, upstream: Upstream) -> None:
    status, other = await call(two.b, "r", "s", "a-hook", "notify", {})
    assert (status, other["code"]) == (422, "unknown_adapter")
    _, missing = await call(two.b, "r", "s2", "no-such", "notify", {})
    assert other["detail"].replace("a-hook", "X") == missing["detail"].replace("no-such", "X")
    assert upstream.received == []
    status, body = await call(two.a, "r", "s", "a-hook", "notify", {})
    assert status == 200, body
    assert upstream.received[0].headers["Idempotency-Key"] == "a/r:s"


# -- configuration -------------------------------------------------------------


async def test_shared_adapter_without_tenant_keys_refuses_to_start(
    make_gateway: Any, upstream: Upstream
) -> None:
    shared = {"type": "webhook", "url": upstream.url, "tenant_in_key": False}
    with pytest.raises(ConfigError, match=r"adapters\.shared\.tenant_in_key = false.*same key"):
        await make_gateway(auth=auth(), adapters={"shared": shared})


async def test_adapter_naming_a_tenant_without_keys_refuses_to_start(
    make_gateway: Any, upstream: Upstream
) -> None:
    hook = {"type": "webhook", "url": upstream.url, "tenants": ["a", "c"]}
    with pytest.raises(ConfigError, match=r"adapters\.x\.tenants names 'c'"):
        await make_gateway(auth=auth(), adapters={"x": hook})


async def test_single_tenant_keeps_job_step_keys(
    make_gateway: Any, stripe: StripePeer, upstream: Upstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Invariant 4 (docs/contract.md) with one tenant: ``<job>:<step>``, no tenant marks."""
    monkeypatch.setenv("TEST_STRIPE_KEY", stripe.api_key)
    one = {"keys": [{"role": "admin", "sha256": key_digest(KEYS["a"]), "tenant": "a"}]}
    pay = {"type": "stripe", "base_url": stripe.url, "api_key_env": "TEST_STRIPE_KEY"}
    g: Gateway = await make_gateway(auth=one, headers=bearer("a"), adapters={"payments": pay})
    status, body = await charge(g, "r")
    assert status == 200 and body["idempotency_key"] == "r:charge", body
    assert "fencegate_tenant" not in stripe.created()[0]["metadata"]
    status, _ = await call(g, "r", "s", "hook", "notify", {})
    assert upstream.received[0].headers["Idempotency-Key"] == "r:s"
    # a refund needs no ownership check with one tenant (as before)
    refund = {"payment_intent": body["result"]["id"]}
    status, body = await call(g, "r", "refund", "payments", "create_refund", refund)
    assert status == 200, body


def test_example_config_shows_tenancy(tmp_path: Path) -> None:
    """The commented adapter sections of the shipped example are a valid tenancy config."""
    text = (Path(__file__).parents[2] / "config" / "fencegate.example.toml").read_text()
    block = text[text.index("# [adapters.payments]") :]
    path = tmp_path / "example.toml"
    path.write_text("\n".join(line[2:] for line in block.splitlines() if line.startswith("# ")))
    keys = [{"role": "admin", "sha256": key_digest(t), "tenant": t} for t in ("acme", "globex")]
    settings = load_settings(path, auth={"keys": keys})
    validate_configs(settings.adapters)
    tenancy = resolve_tenancy(settings)
    assert tenancy.allowed["payments"] == frozenset({"acme"})
    assert tenancy.allowed["tickets"] is None
    assert tenancy.keyed == frozenset({"payments", "tickets", "email"})
