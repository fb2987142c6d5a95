"""What calls leave in Redis. Every key a rejected call creates must expire,
except the per-slot markers (written by init, bounded: 16384) and the tenant's audit feed
(one key per tenant, trimmed by age on every add); an async payload is dropped once its
outcome is recorded."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from tests.conftest import Gateway

_BOUNDED = ("fg:marker", "fg:audit:")  # pre-existing or one per tenant, trimmed by age


def _new_keys(redis_sync: Any, before: set[str]) -> dict[str, int]:
    """Keys created since ``before`` (not the data dir's witness counter: the gateway's own
    background tick writes it, whatever the calls do; it expires, see base.WITNESS_TTL)."""
    return {
        k: redis_sync.ttl(k)
        for k in redis_sync.scan_iter("*")
        if k not in before and not k.startswith("fg:witness:")
    }


async def test_rejected_call_for_unknown_job_creates_nothing_without_ttl(
    gw: Gateway, redis_sync: Any
) -> None:
    before = set(redis_sync.scan_iter("*"))
    for i in range(3):
        resp = await gw.effect(f"ghost-{i}", "s", 7)
        assert resp.status == 409 and (await resp.json())["code"] == "unregistered_generation"
    created = _new_keys(redis_sync, before)
    lasting = sorted(k for k, ttl in created.items() if ttl == -1 and not k.startswith(_BOUNDED))
    assert lasting == [], f"keys without a TTL after rejected calls: {created}"


async def test_rejected_call_keys_are_the_known_ones(gw: Gateway, redis_sync: Any) -> None:
    """The exact keys a rejected call writes today (the report lists them)."""
    before = set(redis_sync.scan_iter("*"))
    resp = await gw.effect("ghost", "s", 7)
    assert resp.status == 409
    deadline = time.monotonic() + 5  # the rejections counter is charged after the answer
    while not any(k.startswith("fg:quota:{default}:rj:") for k in redis_sync.scan_iter("fg:q*")):
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
    created = _new_keys(redis_sync, before)
    print("rejected call created:", created)
    assert created["fg:{default/ghost}:job"] > 0  # audit_head, audit_last: retention (main)
    assert created["fg:{default/ghost}:audit"] > 0  # the job's audit stream: retention
    assert created["fg:audit:default"] == -1  # the tenant feed, trimmed by age on each add
    assert any(k.startswith("fg:{default/ghost}:req:") and t > 0 for k, t in created.items())
    # the tenant's rejections counter (quotas.rejections_per_window, on by default): the window
    assert any(k.startswith("fg:quota:{default}:rj:") and 0 < t <= 3660 for k, t in created.items())
    assert len(created) == 5, created
    assert set(redis_sync.hgetall("fg:{default/ghost}:job")) == {"audit_head", "audit_last"}


async def test_async_payload_is_dropped_once_the_outcome_is_recorded(
    gw: Gateway, redis_sync: Any
) -> None:
    await gw.register("r", generation=1)
    big = {"blob": "x" * 50_000}
    resp = await gw.effect("r", "s", 1, payload=big, headers={"Prefer": "respond-async"})
    assert resp.status == 202, await resp.text()
    key = "fg:{default/r}:fx:s"
    deadline = time.monotonic() + 10
    while redis_sync.hget(key, "state") != "succeeded":
        assert time.monotonic() < deadline, redis_sync.hgetall(key)
        await asyncio.sleep(0.05)
    fields = redis_sync.hgetall(key)
    assert "payload" not in fields and "payload_sha" not in fields
    assert redis_sync.memory_usage(key) < 5_000
