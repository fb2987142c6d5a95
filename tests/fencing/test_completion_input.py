"""Bad input to checkpoints and completion: a 4xx problem document, and nothing in Redis
changed — not a checkpoint, not the job, not an audit entry."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import redis

from tests.conftest import Gateway
from tests.support.calls import code, complete, put_checkpoint

WORKER = {"Fencing-Token": "1"}


def snapshot(r: redis.Redis) -> dict[str, Any]:
    """Every key with its contents (left out: the readiness probe's key, the data dirs'
    witness counters, which each gateway raises every second on its own, and the quota
    counters, which an accepted write settles after its answer; bad input never reaches
    them)."""
    out: dict[str, Any] = {}
    for key in sorted(r.keys("*")):
        kind = r.type(key)
        if key == "fg:readyz:probe" or key.startswith(("fg:witness:", "fg:quota:")):
            continue  # written on their own: the witness tick, an earlier write's quota settle
        if kind == "hash":
            out[key] = r.hgetall(key)
        elif kind == "string":
            out[key] = r.get(key)
        elif kind == "stream":
            out[key] = r.xrange(key)
        elif kind == "set":
            out[key] = sorted(r.smembers(key))
        elif kind == "zset":
            out[key] = r.zrange(key, 0, -1, withscores=True)
        else:
            out[key] = kind
    return out


async def raw_put(gw: Gateway, name: str, data: Any, headers: dict[str, str] | None = None) -> Any:
    h = {"Content-Type": "application/json", **WORKER, **(headers or {})}
    return await gw.client.put(f"/v1/jobs/r/checkpoints/{name}", data=data, headers=h)


async def raw_complete(gw: Gateway, data: Any, headers: dict[str, str] | None = None) -> Any:
    h = {"Content-Type": "application/json", **WORKER, **(headers or {})}
    return await gw.client.post("/v1/jobs/r/complete", data=data, headers=h)


async def chunks(total: int) -> AsyncIterator[bytes]:
    yield b'"'
    for _ in range(total // 1024):
        yield b"x" * 1024
    yield b'"'


async def test_bad_checkpoints_are_refused_and_change_nothing(
    make_gateway: Any, redis_sync: Any
) -> None:
    gw: Gateway = await make_gateway(checkpoints={"max_bytes": 1000})
    await gw.register("r", generation=1)
    assert (await put_checkpoint(gw, "c", {"kept": True}, 1)).status == 200
    before = snapshot(redis_sync)
    exactly = "x" * 998  # 1000 bytes with its quotes
    cases: list[tuple[Any, tuple[int, str]]] = [
        (lambda: raw_put(gw, "c", '"' + "x" * 999 + '"'), (413, "payload_too_large")),
        (lambda: raw_put(gw, "c", chunks(4096)), (413, "payload_too_large")),  # no Content-Length
        (lambda: raw_put(gw, "c", b"{nope"), (400, "invalid_request")),
        (lambda: raw_put(gw, "c", b""), (400, "invalid_request")),
        (lambda: raw_put(gw, "c", b"NaN"), (400, "invalid_request")),
        (lambda: raw_put(gw, "c", b"1e999"), (400, "invalid_request")),
        (lambda: raw_put(gw, "c", b'"\\ud800"'), (400, "invalid_request")),
        (lambda: raw_put(gw, "c", b"[" * 40 + b"]" * 40), (400, "invalid_request")),
        (
            lambda: raw_put(gw, "c", b"1", {"Content-Type": "text/plain"}),
            (415, "unsupported_media_type"),
        ),
        (lambda: raw_put(gw, "c", b"1", {"Fencing-Token": ""}), (400, "invalid_request")),
        (lambda: raw_put(gw, "c", b"1", {"Fencing-Token": "01"}), (400, "invalid_request")),
        (lambda: raw_put(gw, "c", b"1", {"Worker-Id": "a b"}), (400, "invalid_request")),
        (lambda: raw_put(gw, "x" * 129, b"1"), (400, "invalid_request")),
        (lambda: raw_put(gw, ".hidden", b"1"), (400, "invalid_request")),
        (lambda: raw_put(gw, "a%20b", b"1"), (400, "invalid_request")),
        (
            lambda: raw_put(gw, "%2e%2e", b"1"),
            (404, "not_found"),
        ),  # the client makes it ..: no route
        (lambda: raw_put(gw, "a%00b", b"1"), (400, "invalid_request")),
        (lambda: raw_put(gw, "a:b", b"1"), (400, "invalid_request")),
    ]
    for call, expected in cases:
        resp = await call()
        assert await code(resp) == expected, (expected, await resp.text())
        assert resp.headers["Content-Type"].startswith("application/problem+json")
    assert snapshot(redis_sync) == before
    assert (await raw_put(gw, "c", '"' + exactly + '"')).status == 200  # the limit is inclusive


async def test_bad_completions_are_refused_and_change_nothing(gw: Gateway, redis_sync: Any) -> None:
    await gw.register("r", generation=1)
    before = snapshot(redis_sync)
    limit = gw.settings.server.max_body_bytes
    cases: list[tuple[Any, tuple[int, str]]] = [
        (lambda: raw_complete(gw, b'{"outputs": "report.pdf"}'), (400, "invalid_request")),
        (lambda: raw_complete(gw, b'{"outputs": [1]}'), (400, "invalid_request")),
        (lambda: raw_complete(gw, b'{"outputs": ["../etc/passwd"]}'), (400, "invalid_request")),
        (lambda: raw_complete(gw, b'{"outputs": ["/abs"]}'), (400, "invalid_request")),
        (lambda: raw_complete(gw, b'{"outputs": ["a\\u0000b"]}'), (400, "invalid_request")),
        (lambda: raw_complete(gw, b'{"outputs": ["%2e%2e"]}'), (400, "invalid_request")),
        (lambda: raw_complete(gw, b'{"outputs": ["a", "a"]}'), (400, "invalid_request")),
        (
            lambda: raw_complete(gw, ('{"outputs": ["' + "x" * 129 + '"]}').encode()),
            (400, "invalid_request"),
        ),
        (
            lambda: raw_complete(
                gw, ('{"outputs": [' + ",".join(f'"o{i}"' for i in range(257)) + "]}")
            ),
            (400, "invalid_request"),
        ),
        (lambda: raw_complete(gw, b'{"result": 1, "extra": 2}'), (400, "invalid_request")),
        (lambda: raw_complete(gw, b'{"result": 1e999}'), (400, "invalid_request")),
        (lambda: raw_complete(gw, b"{nope"), (400, "invalid_request")),
        (lambda: raw_complete(gw, b"[]"), (400, "invalid_request")),
        (
            lambda: raw_complete(gw, b'{"result": "' + b"x" * limit + b'"}'),
            (413, "payload_too_large"),
        ),
        (
            lambda: raw_complete(gw, b"{}", {"Content-Type": "text/plain"}),
            (415, "unsupported_media_type"),
        ),
        (lambda: raw_complete(gw, b"{}", {"Fencing-Token": "x"}), (400, "invalid_request")),
    ]
    for call, expected in cases:
        resp = await call()
        assert await code(resp) == expected, (expected, await resp.text())
    assert snapshot(redis_sync) == before
    # an empty body is a completion without outputs or result
    assert (await complete(gw, 1)).status == 200
