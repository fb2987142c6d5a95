"""Signed generations (docs/security.md): forged, expired, unsigned, other-job, other-tenant."""

from __future__ import annotations

import time
from typing import Any

import pytest

from gateway.client import FencedJob, Scheduler, mint_token
from gateway.core.tokens import sign_token
from tests.conftest import Gateway, Upstream, key_digest

SIGNING_KEY = "k" * 40
OLD_KEY = "o" * 40
KEYS = {
    "acme-worker": "wk-acme-aaaaaaaa",
    "acme-sched": "sc-acme-aaaaaaaa",
    "other-worker": "wk-other-bbbbbbb",
    "acme-claimer": "wc-acme-cccccccc",
}


@pytest.fixture(params=["required", "implicit"])
async def sgw(
    request: pytest.FixtureRequest, make_gateway: Any, monkeypatch: pytest.MonkeyPatch
) -> Gateway:
    monkeypatch.setenv("TEST_SIGNING_KEYS", f"{SIGNING_KEY},{OLD_KEY}")
    keys = [
        {"role": "worker", "sha256": key_digest(KEYS["acme-worker"]), "tenant": "acme"},
        {"role": "admin", "sha256": key_digest(KEYS["acme-sched"]), "tenant": "acme"},
        {"role": "worker", "sha256": key_digest(KEYS["other-worker"]), "tenant": "other"},
        {
            "role": "worker",
            "claims": True,
            "sha256": key_digest(KEYS["acme-claimer"]),
            "tenant": "acme",
        },
    ]
    gw: Gateway = await make_gateway(
        auth={"token_signing_key_env": "TEST_SIGNING_KEYS", "keys": keys},
        fencing={"registration": request.param},
    )
    return gw


def auth(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[name]}"}


async def call(
    gw: Gateway, token: str, *, job: str = "r", who: str = "acme-worker"
) -> tuple[int, str]:
    resp = await gw.client.post(
        f"/v1/jobs/{job}/effects/s",
        json={"adapter": "hook", "operation": "x", "payload": {}},
        headers={**auth(who), "Fencing-Token": token},
    )
    body = await resp.json(content_type=None)
    return resp.status, body.get("code", "ok")


async def test_registration_returns_a_signed_token_that_works(
    sgw: Gateway, upstream: Upstream
) -> None:
    resp = await sgw.client.post(
        "/v1/jobs/r/generations", json={"generation": 3}, headers=auth("acme-sched")
    )
    token = (await resp.json())["token"]
    assert token.startswith("v1.3.") and len(token.split(".")) == 4
    assert await call(sgw, token) == (200, "ok")
    assert len(upstream.received) == 1


async def test_hostile_tokens_are_rejected_and_audited(sgw: Gateway, upstream: Upstream) -> None:
    r = await sgw.client.post(
        "/v1/jobs/r/generations", json={"generation": 3}, headers=auth("acme-sched")
    )
    honest = (await r.json())["token"]
    exp = int(time.time()) + 3600
    _, _, texp, sig = honest.split(".")
    hostile = {
        "unsigned": "3",
        "inflated unsigned": "99",
        "inflated, resigned with a wrong key": sign_token(b"x" * 40, "acme", "r", 99, exp),
        "forged signature": f"v1.3.{texp}.{'A' * 43}",
        "generation edited": f"v1.4.{texp}.{sig}",
        "expiry edited": f"v1.3.{int(texp) + 10}.{sig}",
        "expired": sign_token(SIGNING_KEY.encode(), "acme", "r", 3, int(time.time()) - 1),
        "other job": sign_token(SIGNING_KEY.encode(), "acme", "q", 3, exp),
        "other tenant": sign_token(SIGNING_KEY.encode(), "other", "r", 3, exp),
        "garbage": "v1.3",
    }
    for name, token in hostile.items():
        assert await call(sgw, token) == (400, "bad_token"), name
    # the honest worker of the current generation is never locked out by them
    assert await call(sgw, honest) == (200, "ok")
    # another tenant's worker cannot use acme's token on its own job r
    assert await call(sgw, honest, who="other-worker") == (400, "bad_token")
    audit = await (await sgw.client.get("/v1/audit/rejections", headers=auth("acme-sched"))).json()
    reasons = [e["reason"] for e in audit["items"]]
    assert reasons.count("bad_token") == len(hostile)
    entry = audit["items"][-1]
    assert entry["current"] == 3 and entry["step"] == "s"
    assert len(upstream.received) == 1


async def test_rotation_old_key_still_verifies(sgw: Gateway) -> None:
    await sgw.client.post(
        "/v1/jobs/r/generations", json={"generation": 2}, headers=auth("acme-sched")
    )
    old = sign_token(OLD_KEY.encode(), "acme", "r", 2, int(time.time()) + 60)
    assert await call(sgw, old) == (200, "ok")


async def test_heartbeat_verifies_tokens_too(sgw: Gateway) -> None:
    await sgw.client.post(
        "/v1/jobs/r/generations", json={"generation": 2}, headers=auth("acme-sched")
    )
    resp = await sgw.client.post(
        "/v1/jobs/r/fence", headers={**auth("acme-worker"), "Fencing-Token": "2"}
    )
    assert resp.status == 400 and (await resp.json())["code"] == "bad_token"


async def test_sdk_mints_tokens_for_an_external_scheduler(sgw: Gateway, upstream: Upstream) -> None:
    url = str(sgw.client.make_url("")).rstrip("/")
    async with Scheduler(url, api_key=KEYS["acme-sched"]) as sched:
        await sched.register("r", generation=7)
    token = mint_token(SIGNING_KEY, "acme", "r", 7, ttl_seconds=60)
    async with FencedJob(url, "r", token, api_key=KEYS["acme-worker"]) as job:
        res = await job.effect("s", adapter="hook", operation="x", payload={})
    assert res.state == "succeeded" and len(upstream.received) == 1


async def test_weak_signing_key_fails_the_start(
    make_gateway: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gateway.runtime.settings import ConfigError

    monkeypatch.setenv("TEST_WEAK_KEY", "short")
    with pytest.raises(ConfigError, match="at least 32 bytes"):
        await make_gateway(auth={"token_signing_key_env": "TEST_WEAK_KEY"})


async def test_a_claim_gets_a_signed_token_bound_to_its_tenant_and_job(
    sgw: Gateway, upstream: Upstream
) -> None:
    resp = await sgw.client.post("/v1/jobs/r/generations", json={}, headers=auth("acme-claimer"))
    assert resp.status == 201
    token = (await resp.json())["token"]
    assert token.startswith("v1.1.")  # signed, generation 1 (allocated)
    assert await call(sgw, token, who="acme-claimer") == (200, "ok")
    # the same token names acme's job r only: another job, another tenant's r are bad tokens
    assert await call(sgw, token, job="q", who="acme-claimer") == (400, "bad_token")
    assert await call(sgw, token, who="other-worker") == (400, "bad_token")
    assert len(upstream.received) == 1
