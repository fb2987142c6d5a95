"""Calls and checks the tests of several folders share: a problem document, the whole of Redis
before and after a call that must change nothing, the completion and checkpoint calls, an
output recorded as the object-store side records it."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import redis

from gateway.store.keys import ATTENTION_TURN, JobKeys
from tests.conftest import Gateway, Upstream

PROBLEM = "application/problem+json"
EFFECT = {"adapter": "hook", "operation": "send", "payload": {"to": "x"}}


async def problem(resp: Any, status: int, code: str) -> dict[str, Any]:
    body = await resp.json(content_type=None)
    assert resp.status == status, body
    assert resp.content_type == PROBLEM
    assert body["code"] == code
    assert body["status"] == status
    for k in ("type", "title", "detail"):
        assert body[k]
    return dict(body)


async def code(resp: Any) -> tuple[int, str]:
    body = await resp.json(content_type=None)
    return resp.status, body.get("code", "") if isinstance(body, dict) else ""


def snapshot(redis_sync: Any) -> dict[str, Any]:
    """Every fencegate key and value (the 16384 slot markers by count, via DBSIZE), but the
    data dirs' witness counters: each gateway raises its own every second, on its own."""
    keys = [k for k in redis_sync.keys("*") if not k.startswith("fg:witness:")]
    out: dict[str, Any] = {"dbsize": len(keys)}
    for key in sorted(k for k in keys if not k.startswith("fg:marker:")):
        kind = redis_sync.type(key)
        if kind == "hash":
            out[key] = redis_sync.hgetall(key)
        elif kind == "stream":
            out[key] = redis_sync.xrange(key)
        elif kind == "set":
            out[key] = sorted(redis_sync.smembers(key))
        elif kind == "zset":  # relay queues, the "needs a decision" index
            out[key] = redis_sync.zrange(key, 0, -1, withscores=True)
        else:
            out[key] = redis_sync.get(key)
    return out


def lasting_keys(redis_sync: Any) -> list[str]:
    """The keys in Redis but those that come and go on their own: what running gateways
    write whatever Redis holds (the attention reconciler's turn, the witness counters) and
    the quota calls' re-send memories (``fg:quota:{<t>}:req:<id>``, a minute; kept by a
    call that reserved and gave back)."""
    return sorted(
        k
        for k in redis_sync.keys("*")
        if k != ATTENTION_TURN
        and not k.startswith("fg:witness:")
        and not (k.startswith("fg:quota:{") and ":req:" in k and 0 < redis_sync.pttl(k) <= 60_000)
    )


async def assert_untouched(
    gw: Gateway, upstream: Upstream, redis_sync: Any, call: Any, status: int, code: str
) -> None:
    before = snapshot(redis_sync)
    resp = await call
    body = await resp.json(content_type=None)
    assert resp.status == status, body
    assert resp.content_type == "application/problem+json"
    assert body["code"] == code, body
    assert snapshot(redis_sync) == before
    assert upstream.received == []


async def complete(
    gw: Gateway,
    token: Any,
    *,
    result: Any = None,
    outputs: list[str] | None = None,
    job: str = "r",
    worker: str | None = None,
) -> Any:
    headers = {**gw.headers, "Fencing-Token": str(token)}
    if worker:
        headers["Worker-Id"] = worker
    body = {"outputs": outputs or [], "result": result}
    return await gw.client.post(f"/v1/jobs/{job}/complete", json=body, headers=headers)


async def put_checkpoint(
    gw: Gateway, name: str, value: Any, token: Any, *, job: str = "r", worker: str | None = None
) -> Any:
    headers = {**gw.headers, "Fencing-Token": str(token), "Content-Type": "application/json"}
    if worker:
        headers["Worker-Id"] = worker
    return await gw.client.put(
        f"/v1/jobs/{job}/checkpoints/{name}", data=json.dumps(value), headers=headers
    )


def record_output(
    r: redis.Redis, gen: int, name: str, data: bytes, *, state: str = "recorded", job: str = "r"
) -> dict[str, Any]:
    """An output as the object-store side records it (the shared data model: field
    ``<generation>/<name>`` of ``fg:{t/j}:outputs``)."""
    rec = {
        "state": state,
        "key": f"default/{job}/g{gen}/{name}",
        "size": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
        "content_type": "application/pdf",
        "staged_ms": 1,
        "recorded_ms": 2 if state == "recorded" else 0,
        "presigned": False,
    }
    r.hset(JobKeys("default", job).outputs, f"{gen}/{name}", json.dumps(rec))
    return rec
