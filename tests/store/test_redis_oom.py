"""Redis out of memory: with ``maxmemory`` reached under ``noeviction``, every call
answers 503 ``store_unavailable`` (never 500) — also when the OOM is raised inside a script —
and ``/readyz`` is not ready until Redis takes writes again. A real redis-server."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from aiohttp.test_utils import TestClient, TestServer

from gateway.http.app import create_app
from gateway.store.embedded import EmbeddedRedis
from tests.conftest import Upstream, gateway_settings


@pytest.fixture
def small_redis(tmp_path: Path) -> Iterator[EmbeddedRedis]:
    server = EmbeddedRedis(tmp_path / "oom-redis", use_socket=False)
    server.start()
    yield server
    server.stop()


def _fill_until_oom(client: redis.Redis) -> int:
    used = int(client.info("memory")["used_memory"])
    client.config_set("maxmemory", str(used + 2 * 1024 * 1024))
    n = 0
    while True:
        try:
            client.set(f"fg:filler:{n}", "x" * 4096)
        except redis.exceptions.OutOfMemoryError:
            break
        n += 1
    # well past the limit, so client buffers coming and going do not let a write slip in
    client.config_set("maxmemory", str(int(client.info("memory")["used_memory"]) // 2))
    return n


async def test_redis_oom_answers_503_everywhere_and_readyz_is_not_ready(
    small_redis: EmbeddedRedis, upstream: Upstream, tmp_path: Path
) -> None:
    settings = gateway_settings(small_redis.url, upstream.url, tmp_path)
    app = create_app(settings, redis_url=small_redis.url, state_file=tmp_path / "fg.state")
    client: TestClient[Any, Any] = TestClient(TestServer(app, host="127.0.0.1", port=0))
    await client.start_server()
    admin = redis.Redis.from_url(small_redis.url)
    try:
        assert (await client.post("/v1/jobs/r/generations", json={"generation": 1})).status == 201
        assert (await client.get("/readyz")).status == 200
        filled = _fill_until_oom(admin)
        body = {"adapter": "hook", "operation": "send", "payload": {"n": 1}}
        calls = [
            ("POST", "/v1/jobs/r/effects/s1", body, {"Fencing-Token": "1"}),  # OOM in admit
            ("POST", "/v1/jobs/new/effects/s1", body, {"Fencing-Token": "1"}),  # reject+audit
            (
                "POST",
                "/v1/jobs/r/effects/s2",
                body,
                {"Fencing-Token": "1", "Prefer": "respond-async"},
            ),
            ("POST", "/v1/jobs/r/generations", {}, {}),
            ("POST", "/v1/jobs/r/cancel", None, {}),
        ]
        for method, path, payload, headers in calls:
            resp = await client.request(method, path, json=payload, headers=headers)
            problem = await resp.json()
            assert resp.status == 503, (path, resp.status, problem)
            assert problem["code"] == "store_unavailable"
        assert upstream.received == []  # nothing was sent
        # a heartbeat without a lease writes nothing: it may still answer
        beat = await client.post("/v1/jobs/r/fence", headers={"Fencing-Token": "1"})
        assert beat.status in (200, 503)
        ready = await client.get("/readyz")
        assert ready.status == 503
        why = await ready.json()
        assert why["checks"]["writable"] is False and why["cause"] == "out_of_memory"
        # memory back: ready again, and the same calls work
        admin.delete(*[f"fg:filler:{i}" for i in range(filled)])
        admin.config_set("maxmemory", "0")
        assert (await client.get("/readyz")).status == 200
        resp = await client.post("/v1/jobs/r/effects/s1", json=body, headers={"Fencing-Token": "1"})
        assert resp.status == 200, await resp.text()
    finally:
        admin.config_set("maxmemory", "0")
        admin.close()
        await client.close()
