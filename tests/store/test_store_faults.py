"""Redis faults: unreachable, script cache lost, restarted, wiped. Nothing is ever dispatched
on a store the gateway cannot trust (I7), and calls recover when Redis does."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import redis
from aiohttp.test_utils import TestClient, TestServer
from structlog.testing import capture_logs

from gateway.http import appkeys as K
from gateway.http.app import create_app
from gateway.store.embedded import EmbeddedRedis, free_port
from gateway.store.keys import ATTENTION_TURN, QUARANTINE, JobKeys
from gateway.store.store import Store, connect
from tests.conftest import Gateway, Upstream, gateway_settings
from tests.support.calls import lasting_keys
from tests.support.wire import WireProxy


async def problem_code(resp: Any) -> tuple[int, str]:
    body = await resp.json(content_type=None)
    return resp.status, body.get("code", "")


async def test_redis_unreachable_fails_closed(make_gateway: Any, upstream: Upstream) -> None:
    gw: Gateway = await make_gateway(
        redis={"url": f"redis://127.0.0.1:{free_port()}/0", "timeout_seconds": 0.5}
    )
    assert await problem_code(await gw.effect("r", "s", 1)) == (503, "store_unavailable")
    assert await problem_code(await gw.register("r", generation=1)) == (503, "store_unavailable")
    assert await problem_code(await gw.heartbeat("r", 1)) == (503, "store_unavailable")
    ready = await gw.client.get("/readyz")
    body = await ready.json()
    assert ready.status == 503 and body["checks"]["redis"] is False
    assert body["cause"] == "redis_unreachable" and "unreachable" in body["detail"]
    assert (await gw.client.get("/healthz")).status == 200
    assert upstream.received == []


async def test_script_flush_does_not_break_calls(
    gw: Gateway, upstream: Upstream, redis_sync: Any
) -> None:
    await gw.register("r", generation=1)
    redis_sync.script_flush()
    assert (await gw.effect("r", "a", 1)).status == 200
    redis_sync.script_flush()
    assert (await gw.effect("r", "a", 1)).status == 200  # replay
    redis_sync.script_flush()
    assert (await gw.register("r", generation=2)).status == 201
    assert len(upstream.received) == 1
    assert (await gw.client.get("/readyz")).status == 200


async def test_wiped_redis_fails_closed_until_confirmed_init(
    gw: Gateway, upstream: Upstream, redis_sync: Any, tmp_path: Path
) -> None:
    await gw.register("r", generation=5)
    assert (await gw.effect("r", "a", 5)).status == 200
    redis_sync.flushall()  # scripts stay cached: only the markers can tell
    # a zombie (implicit mode would admit it) and a replay that would duplicate
    with capture_logs() as logs:
        assert await problem_code(await gw.effect("r", "a", 5)) == (503, "store_unavailable")
        assert await problem_code(await gw.register("r", generation=1)) == (
            503,
            "store_unavailable",
        )
        assert await problem_code(await gw.heartbeat("r", 5)) == (503, "store_unavailable")
    # why, once (not once per refused call): the slot, the global marker gone, a wiped Redis
    missing = [e for e in logs if e["event"] == "redis_marker_missing"]
    assert len(missing) == 1, missing
    assert missing[0]["slot"] == JobKeys("default", "r").slot
    assert missing[0]["global_marker_present"] is False and missing[0]["state"] == "wiped"
    assert lasting_keys(redis_sync) == [], "a refused call must write nothing"
    # what running gateways write on their own, whatever Redis holds, leaves it wiped
    redis_sync.set(ATTENTION_TURN, "x", px=15_000)
    redis_sync.set("fg:quota:{default}:held_bytes", "0")
    ready = await gw.client.get("/readyz")
    body = await ready.json()
    assert ready.status == 503 and body["checks"]["marker"] is False
    assert (body["cause"], body["marker"]) == ("marker_missing", "wiped")
    assert len(upstream.received) == 1

    client = connect(gw.settings.redis.url, timeout=2, max_connections=2)
    store = Store(
        client,
        registration="required",
        dispatch_timeout_ms=1000,
        retention_seconds=60,
        state_file=tmp_path / "state" / "fencegate.state",
    )
    assert await store.initialize(auto=True) == "refused"
    assert await store.initialize(auto=False) == "refused"
    assert await store.initialize(auto=False, confirm_data_loss=True) == "written"
    await client.aclose()
    assert (await gw.client.get("/readyz")).status == 200
    assert (await gw.register("r", generation=6)).status == 201


async def test_a_flush_between_the_witness_reading_the_marker_and_raising_leaves_redis_wiped(
    make_gateway: Any, wire: WireProxy, redis_sync: Any
) -> None:
    """The witness raises its counter only next to the marker it read: Redis flushed after
    that read gets no witness key, so it stays empty and reads as wiped, not quarantined."""
    gw: Gateway = await make_gateway(redis={"url": wire.url, "marks_interval_seconds": 3600})
    store: Store = gw.app[K.STORE]
    assert (await gw.register("r", generation=1)).status == 201
    assert await store.witness() is True
    held = wire.on_reply_to(b"GET\r\n$9\r\nfg:marker\r\n", "hold", 0.5)
    tick = asyncio.create_task(store.witness())
    await asyncio.wait_for(held.fired.wait(), 5)  # Redis answered the read; the reply waits
    redis_sync.flushall()
    assert await tick is True
    assert lasting_keys(redis_sync) == []
    body = await (await gw.client.get("/readyz")).json()
    assert (body["cause"], body["marker"]) == ("marker_missing", "wiped")


async def test_a_new_redis_that_running_gateways_wrote_to_is_still_new(
    redis_sync: Any, redis_url: str, tmp_path: Path
) -> None:
    """Gateways started before `fencegate init` write their own keys (the attention turn,
    quota counters): `init` on that Redis, from a data dir that never initialised one, still
    writes the marker; a job's data or a quarantine record makes it refuse."""
    redis_sync.set(ATTENTION_TURN, "x", px=15_000)
    redis_sync.set("fg:quota:{default}:held_bytes", "0")
    client = connect(redis_url, timeout=2, max_connections=2)
    try:
        for n, planted in enumerate((JobKeys("default", "r").job, QUARANTINE, None)):
            if planted is not None:
                redis_sync.set(planted, "1")
            store = Store(client, state_file=tmp_path / f"new{n}" / "fencegate.state",
                          registration="required", dispatch_timeout_ms=1000,
                          retention_seconds=60)  # fmt: skip
            wanted = "refused" if planted is not None else "written"
            assert await store.initialize(auto=True) == wanted, planted
            if planted is not None:
                redis_sync.delete(planted)
    finally:
        await client.aclose()


async def test_partial_loss_of_one_slot_fails_closed_for_that_job_only(
    gw: Gateway, redis_sync: Any
) -> None:
    from gateway.store.keys import JobKeys

    await gw.register("a", generation=1)
    await gw.register("b", generation=1)
    redis_sync.delete(JobKeys("default", "a").marker)
    assert await problem_code(await gw.effect("a", "s", 1)) == (503, "store_unavailable")
    assert (await gw.effect("b", "s", 1)).status == 200


async def test_redis_restart_keeps_fences_and_calls_recover(
    own_redis: EmbeddedRedis, upstream: Upstream, tmp_path: Path
) -> None:
    settings = gateway_settings(own_redis.url, upstream.url, tmp_path, redis={"timeout_seconds": 1})
    app = create_app(
        settings, redis_url=own_redis.url, state_file=tmp_path / "state" / "fencegate.state"
    )
    async with TestClient(TestServer(app, host="127.0.0.1", port=0)) as client:
        gw = Gateway(client=client, app=app, settings=settings)
        await gw.register("r", generation=7)
        assert (await gw.effect("r", "a", 7)).status == 200
        # kill -9: only the AOF (appendfsync always) carries the data across
        assert own_redis.process is not None
        os.kill(own_redis.process.pid, signal.SIGKILL)
        own_redis.process.wait()
        assert await problem_code(await gw.effect("r", "b", 7)) == (503, "store_unavailable")
        own_redis.stop()
        own_redis.start()
        # first call after the restart: reconnect, NOSCRIPT, reload — all inside one request
        stale = await gw.effect("r", "b", 6)
        assert await problem_code(stale) == (409, "stale_generation")
        replay = await gw.effect("r", "a", 7)
        assert replay.status == 200 and (await replay.json())["replayed"] is True
        assert (await gw.effect("r", "b", 7)).status == 200
        assert len(upstream.received) == 2


def test_fence_survives_restart_on_disk(tmp_path: Path) -> None:
    """The fence key has no TTL and is in the AOF after a clean shutdown and restart."""
    data = tmp_path / "d"
    with EmbeddedRedis(data) as server:
        c = redis.Redis.from_url(server.url, decode_responses=True)
        c.hset("fg:{default/r}:job", "fence", "9")
        assert c.ttl("fg:{default/r}:job") == -1
        c.close()
    with EmbeddedRedis(data) as server:
        c = redis.Redis.from_url(server.url, decode_responses=True)
        assert c.hget("fg:{default/r}:job", "fence") == "9"
        assert c.config_get("appendfsync")["appendfsync"] == "always"
        assert c.config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"
        c.close()


async def test_shutdown_lets_inflight_dispatch_finish_and_record(
    make_gateway: Any, upstream: Upstream, redis_sync: Any
) -> None:
    gw: Gateway = await make_gateway(server={"shutdown_grace_seconds": 5})
    await gw.register("r", generation=1)
    upstream.delay = 0.3
    call = asyncio.create_task(gw.effect("r", "s", 1))
    await upstream.arrived.wait()
    await gw.app.shutdown()
    await gw.app.cleanup()
    assert redis_sync.hget("fg:{default/r}:fx:s", "state") == "succeeded"
    call.cancel()


async def test_shutdown_bound_records_the_rest_as_unknown(
    make_gateway: Any, upstream: Upstream, redis_sync: Any
) -> None:
    gw: Gateway = await make_gateway(server={"shutdown_grace_seconds": 0.2})
    await gw.register("r", generation=1)
    upstream.behaviour = "hang"
    call = asyncio.create_task(gw.effect("r", "s", 1))
    await upstream.arrived.wait()
    await gw.app.shutdown()
    await gw.app.cleanup()
    effect = redis_sync.hgetall("fg:{default/r}:fx:s")
    assert effect["state"] == "unknown" and "shut down" in effect["error"]
    call.cancel()


async def test_redis_restored_from_older_snapshot_is_quarantined(
    make_gateway: Any, upstream: Upstream, redis_sync: Any, tmp_path: Path
) -> None:
    gw: Gateway = await make_gateway()
    await gw.register("r", generation=5)
    assert (await gw.effect("r", "a", 5)).status == 200
    seen = int(redis_sync.get("fg:epoch"))
    # the "restored snapshot": taken before generation 5 and the effect; its epoch is older
    redis_sync.delete("fg:{default/r}:job", "fg:{default/r}:fx:a")
    redis_sync.set("fg:epoch", seen - 1)
    again: Gateway = await make_gateway()  # a gateway (re)starts on it, same data dir
    assert (await again.client.get("/readyz")).status == 503
    assert (await again.effect("r", "a", 5)).status == 503  # no duplicate of the effect
    assert (await again.register("r", generation=1)).status == 503
    assert len(upstream.received) == 1
    client = connect(again.settings.redis.url, timeout=2, max_connections=2)
    store = Store(client, registration="required", dispatch_timeout_ms=1000, retention_seconds=60,
                  state_file=tmp_path / "state" / "fencegate.state")  # fmt: skip
    assert await store.initialize(auto=False) == "refused"  # quarantined: markers gone
    assert await store.initialize(auto=False, confirm_data_loss=True) == "written"
    await client.aclose()
    assert (await again.register("r", generation=6)).status == 201


async def test_periodic_epoch_check_catches_a_restore_while_running(
    make_gateway: Any, upstream: Upstream, redis_sync: Any
) -> None:
    gw: Gateway = await make_gateway(redis={"epoch_interval_seconds": 0.05})
    await gw.register("r", generation=1)
    await asyncio.sleep(0.2)
    redis_sync.set("fg:epoch", 0)  # Redis went back in time under a running gateway
    for _ in range(100):
        if (await gw.effect("r", "a", 1)).status == 503:
            break
        await asyncio.sleep(0.02)
    else:
        raise AssertionError("the restore was not detected")


async def test_retention_expires_records_and_audit_but_never_fences(
    make_gateway: Any, redis_sync: Any
) -> None:
    gw: Gateway = await make_gateway(fencing={"retention_seconds": 120})
    await gw.register("r", generation=2)
    await gw.effect("r", "a", 2)
    await gw.effect("r", "b", 1)  # a stale call: audited
    assert redis_sync.ttl("fg:{default/r}:job") == -1  # the fence never expires
    for key in ("fg:{default/r}:fx:a", "fg:{default/r}:steps", "fg:{default/r}:audit"):
        assert 0 < redis_sync.ttl(key) <= 120, key
    # when the retention has passed (simulated by expiring the keys now), the fence still holds
    for key in ("fg:{default/r}:fx:a", "fg:{default/r}:steps", "fg:{default/r}:audit"):
        redis_sync.pexpire(key, 1)
    await asyncio.sleep(0.05)
    assert redis_sync.hget("fg:{default/r}:job", "fence") == "2"
    stale = await gw.effect("r", "c", 1)
    assert stale.status == 409 and (await stale.json())["code"] == "stale_generation"


async def test_an_error_inside_a_quota_script_is_a_bug_not_a_503(
    make_gateway: Any, redis_sync: redis.Redis
) -> None:
    """A script's own error reply (here WRONGTYPE: the tenant's checkpoint counter is not a
    number) is a bug of the gateway or of whoever wrote that key: 500, logged with the error,
    never 503 ``store_unavailable`` that a worker would retry forever; nothing is written."""
    gw: Gateway = await make_gateway(quotas={"checkpoint_bytes": 1_000_000})
    await gw.register("r", generation=1)
    redis_sync.hset("fg:quota:{default}:ckpt_bytes", "not", "a counter")
    headers = {**gw.headers, "Fencing-Token": "1", "Content-Type": "application/json"}
    with capture_logs() as logs:
        resp = await gw.client.put("/v1/jobs/r/checkpoints/c", data='{"n": 1}', headers=headers)
    assert await problem_code(resp) == (500, "internal_error")
    unhandled = [e for e in logs if e["event"] == "unhandled_error"]
    assert [e["path"] for e in unhandled] == ["/v1/jobs/r/checkpoints/c"], logs
    assert redis_sync.hget("fg:{default/r}:ckpt", "c") is None
    # the key repaired, the same write is taken
    redis_sync.delete("fg:quota:{default}:ckpt_bytes")
    again = await gw.client.put("/v1/jobs/r/checkpoints/c", data='{"n": 1}', headers=headers)
    assert again.status == 200, await again.text()
