"""The real, unmodified stripe package driving the Stripe peer (tests/support/peers.py) through the
proxy: its retries, its random Idempotency-Key, its error types, against the fence."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from gateway.http import appkeys as K
from tests.conftest import Gateway, key_digest
from tests.support.peers import StripePeer, serving

stripe = pytest.importorskip("stripe")  # the proxy-test extra

WORKER = "fg-worker-acme"
SCHEDULER = "fg-scheduler-acme"
ROUTE = "/proxy/{tail}"


@pytest.fixture
async def peer() -> AsyncIterator[StripePeer]:
    async with serving(StripePeer()) as p:
        yield p


@pytest.fixture
async def stripe_gw(
    make_gateway: Any, peer: StripePeer, monkeypatch: pytest.MonkeyPatch
) -> Gateway:
    monkeypatch.setenv("ACME_STRIPE_KEY", peer.api_key)
    g: Gateway = await make_gateway(
        auth={
            "keys": [
                {"role": "worker", "sha256": key_digest(WORKER), "tenant": "acme"},
                {"role": "scheduler", "sha256": key_digest(SCHEDULER), "tenant": "acme"},
            ]
        },
        upstreams={
            "stripe": {
                "base_url": peer.url,
                "tenants": ["acme"],
                "routes": [
                    "POST /v1/payment_intents",
                    "POST /v1/refunds",
                    "GET /v1/payment_intents/*",
                ],
                "credentials_env": {"acme": "ACME_STRIPE_KEY"},
                "dedupes_by_key": True,
                "error_dialect": "stripe",
                "allow_private": True,
            }
        },
    )
    return g


async def register(g: Gateway, job: str) -> int:
    resp = await g.client.post(
        f"/v1/jobs/{job}/generations", json={}, headers={"Authorization": f"Bearer {SCHEDULER}"}
    )
    assert resp.status in (200, 201), await resp.text()
    return int((await resp.json())["generation"])


def client(g: Gateway) -> Any:
    """stripe-python as shipped: only its base address and API key point at fencegate."""
    return stripe.StripeClient(
        WORKER,
        base_addresses={"api": str(g.client.make_url("/proxy/stripe")).rstrip("/")},
        max_network_retries=2,
    )


def fence(job: str, step: str, token: int) -> dict[str, Any]:
    return {"headers": {"Fencing-Token": str(token), "Fencegate-Job": job, "Fencegate-Step": step}}


def attempts(g: Gateway) -> float:
    """Requests the proxy route has answered (every SDK attempt is one)."""
    value = g.app[K.METRICS].registry.get_sample_value(
        "fencegate_request_seconds_count", {"route": ROUTE}
    )
    return value or 0.0


async def create(g: Gateway, job: str, step: str, token: int, amount: int = 2000) -> Any:
    params = {"amount": amount, "currency": "eur"}
    return await asyncio.to_thread(
        client(g).v1.payment_intents.create, params=params, options=fence(job, step, token)
    )


async def test_a_payment_intent_is_created_once_across_sdk_retries_after_a_lost_response(
    stripe_gw: Gateway, peer: StripePeer
) -> None:
    gen = await register(stripe_gw, "order-7")
    peer.mode = "drop_once_after_create"  # the peer creates it, then the answer is lost
    intent = await create(stripe_gw, "order-7", "charge", gen)
    assert intent.id == "pi_1" and intent.amount == 2000
    assert len(peer.created()) == 1
    # the SDK's first attempt was answered 504 "retry", its retry re-sent under the same key
    assert attempts(stripe_gw) == 2
    assert [key for _, key, _ in peer.requests] == ["acme/order-7:charge"] * 2
    again = await create(stripe_gw, "order-7", "charge", gen)  # a later call of the step: a replay
    assert again.id == "pi_1"
    assert len(peer.requests) == 2


async def test_the_zombies_create_is_refused_with_one_attempt_and_the_sdks_own_error(
    stripe_gw: Gateway, peer: StripePeer
) -> None:
    zombie = await register(stripe_gw, "order-7")
    await register(stripe_gw, "order-7")  # taken over
    with pytest.raises(stripe.APIError) as caught:
        await create(stripe_gw, "order-7", "charge", zombie)
    err = caught.value
    assert err.http_status == 409
    assert err.error.code == "stale_generation"
    assert err.headers["Stripe-Should-Retry"] == "false"
    assert attempts(stripe_gw) == 1  # the SDK (max_network_retries=2) did not retry
    assert peer.requests == []


async def test_another_request_on_the_step_raises_idempotency_error(
    stripe_gw: Gateway, peer: StripePeer
) -> None:
    gen = await register(stripe_gw, "order-7")
    await create(stripe_gw, "order-7", "charge", gen, amount=2000)
    with pytest.raises(stripe.IdempotencyError):
        await create(stripe_gw, "order-7", "charge", gen, amount=2500)
    assert attempts(stripe_gw) == 2
    assert len(peer.requests) == 1


async def test_a_refund_is_fenced_the_same_way(stripe_gw: Gateway, peer: StripePeer) -> None:
    gen = await register(stripe_gw, "order-7")
    intent = await create(stripe_gw, "order-7", "charge", gen)
    refund = await asyncio.to_thread(
        client(stripe_gw).v1.refunds.create,
        params={"payment_intent": intent.id, "amount": 500},
        options=fence("order-7", "refund", gen),
    )
    assert refund.object == "refund" and refund.payment_intent == intent.id
    await register(stripe_gw, "order-7")
    with pytest.raises(stripe.APIError) as caught:
        await asyncio.to_thread(
            client(stripe_gw).v1.refunds.create,
            params={"payment_intent": intent.id, "amount": 500},
            options=fence("order-7", "refund-2", gen),
        )
    assert caught.value.error.code == "stale_generation"
    assert [(path, key) for path, key, _ in peer.requests] == [
        ("/v1/payment_intents", "acme/order-7:charge"),
        ("/v1/refunds", "acme/order-7:refund"),
    ]


async def test_a_card_decline_is_the_sdks_card_error_and_is_replayed(
    stripe_gw: Gateway, peer: StripePeer
) -> None:
    gen = await register(stripe_gw, "order-7")
    for _ in range(2):
        with pytest.raises(stripe.CardError) as caught:
            await create(stripe_gw, "order-7", "charge", gen, amount=402)
        assert caught.value.code == "card_declined"
    assert caught.value.headers["Fencegate-Outcome"] == "replayed"
    assert len(peer.requests) == 1


async def test_a_retrieve_is_a_read_passed_through_with_the_tenants_key(
    stripe_gw: Gateway, peer: StripePeer
) -> None:
    gen = await register(stripe_gw, "order-7")
    intent = await create(stripe_gw, "order-7", "charge", gen)
    await register(stripe_gw, "order-7")  # reads are not fenced: a zombie may still read
    found = await asyncio.to_thread(client(stripe_gw).v1.payment_intents.retrieve, intent.id)
    assert (found.id, found.amount) == (intent.id, 2000)
    with pytest.raises(stripe.InvalidRequestError):  # the peer's 404, as it answered
        await asyncio.to_thread(client(stripe_gw).v1.payment_intents.retrieve, "pi_nope")


async def test_the_sdks_stripe_http_client_fences_unchanged_calls_by_the_current_step(
    stripe_gw: Gateway, peer: StripePeer
) -> None:
    """gateway.client.stripe_client: the StripeClient keeps its own key and its calls; only
    its http_client is fencegate's, and the step comes from ``with job.step()``."""
    from gateway.client import SyncFencedJob
    from gateway.client.stripe_client import stripe_http_client

    gateway_url = str(stripe_gw.client.make_url("/")).rstrip("/")
    gen = await register(stripe_gw, "order-7")
    job = SyncFencedJob(gateway_url, "order-7", gen, api_key=WORKER, heartbeat_interval=None)
    sdk = stripe.StripeClient(
        "sk_live_in_the_code",  # the worker's own Stripe key: never sent anywhere
        http_client=stripe_http_client(gateway_url, api_key=WORKER),
        max_network_retries=2,
    )

    def charge(amount: int) -> Any:
        with job.step("charge"):
            return sdk.v1.payment_intents.create(params={"amount": amount, "currency": "eur"})

    try:
        intent = await asyncio.to_thread(charge, 2000)
        again = await asyncio.to_thread(charge, 2000)  # a retry of the step: replayed
        assert again.id == intent.id == "pi_1"
        with pytest.raises(stripe.IdempotencyError):
            await asyncio.to_thread(charge, 2500)
        await register(stripe_gw, "order-7")  # taken over: the zombie's next step is refused
        with pytest.raises(stripe.APIError) as caught:
            await asyncio.to_thread(charge, 2000)
        assert caught.value.error.code == "stale_generation"
    finally:
        job.close()
    assert [(path, key) for path, key, _ in peer.requests] == [
        ("/v1/payment_intents", "acme/order-7:charge")
    ]
    assert len(peer.created()) == 1
