"""The completion and checkpoints when the wire or Redis fails: a lost or late reply is
answered by the remembered verdict (decided once), a Redis killed with SIGKILL keeps every
acknowledged completion (AOF, appendfsync always), a wiped Redis fails closed."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

from aiohttp.test_utils import TestClient, TestServer

from gateway.http.app import create_app
from gateway.store.embedded import EmbeddedRedis
from gateway.store.keys import JobKeys
from tests.conftest import Gateway, Upstream, gateway_settings
from tests.support.calls import code, complete, lasting_keys, put_checkpoint
from tests.support.wire import WireProxy

JOB = JobKeys("default", "r")


async def test_a_lost_completion_reply_is_resent_and_replays_the_verdict(
    make_gateway: Any, wire: WireProxy, redis_sync: Any
) -> None:
    """The completion script ran, its reply was dropped with the connection; the client
    sends it again on a new connection with the same request id: the remembered reply,
    the completion decided once."""
    gw: Gateway = await make_gateway(redis={"url": wire.url})
    await gw.register("r", generation=1)
    lost = wire.on_reply_to(b"zz-lost-completion", "lose")
    resp = await complete(gw, 1, result={"marker": "zz-lost-completion"})
    assert lost.fired.is_set(), "the proxy never dropped the reply"
    body = await resp.json()
    assert resp.status == 200 and body["replayed"] is False, body
    stored = json.loads(redis_sync.hget(JOB.job, "completed"))
    assert stored["generation"] == 1 and stored["result"] == {"marker": "zz-lost-completion"}
    assert body["completed_at"].startswith("20")
    again = await complete(gw, 1, result={"marker": "zz-lost-completion"})
    assert again.status == 200 and (await again.json())["replayed"] is True
    assert await gw.audit(job="r") == []


async def test_a_late_completion_reply_is_asked_again_with_the_same_request_id(
    make_gateway: Any, wire: WireProxy, redis_sync: Any
) -> None:
    """The reply arrives after the Redis timeout: the call may have run. The service sends
    it once more with the same request id and gets the first run's verdict."""
    gw: Gateway = await make_gateway(redis={"url": wire.url, "timeout_seconds": 0.5})
    await gw.register("r", generation=1)
    held = wire.on_reply_to(b"zz-late-completion", "hold", seconds=1.2)
    resp = await complete(gw, 1, result="zz-late-completion")
    assert held.fired.is_set()
    body = await resp.json()
    assert resp.status == 200 and body["replayed"] is False, body
    assert json.loads(redis_sync.hget(JOB.job, "completed"))["result"] == "zz-late-completion"
    assert await code(await complete(gw, 1, result="other")) == (409, "job_completed")


async def test_a_lost_checkpoint_reply_writes_once(
    make_gateway: Any, wire: WireProxy, redis_sync: Any
) -> None:
    gw: Gateway = await make_gateway(redis={"url": wire.url})
    await gw.register("r", generation=1)
    lost = wire.on_reply_to(b"zz-lost-checkpoint", "lose")
    resp = await put_checkpoint(gw, "c", {"m": "zz-lost-checkpoint"}, 1)
    assert lost.fired.is_set() and resp.status == 200, await resp.text()
    stored = json.loads(redis_sync.hget(JOB.ckpt, "c"))
    assert stored["value"] == {"m": "zz-lost-checkpoint"} and stored["generation"] == 1


async def test_redis_kill_9_and_restart_loses_no_completion(
    own_redis: EmbeddedRedis, upstream: Upstream, tmp_path: Path
) -> None:
    settings = gateway_settings(own_redis.url, upstream.url, tmp_path, redis={"timeout_seconds": 1})
    app = create_app(
        settings, redis_url=own_redis.url, state_file=tmp_path / "state" / "fencegate.state"
    )
    async with TestClient(TestServer(app, host="127.0.0.1", port=0)) as client:
        gw = Gateway(client=client, app=app, settings=settings)
        await gw.register("r", generation=1)
        await gw.register("r", generation=2)
        assert (await put_checkpoint(gw, "c", [2], 2)).status == 200
        done = await complete(gw, 2, result={"ok": True})
        assert done.status == 200
        # kill -9 right after the acknowledgement: only the AOF carries it across
        assert own_redis.process is not None
        os.kill(own_redis.process.pid, signal.SIGKILL)
        own_redis.process.wait()
        assert await code(await complete(gw, 2, result={"ok": True})) == (503, "store_unavailable")
        own_redis.stop()
        own_redis.start()
        again = await complete(gw, 2, result={"ok": True})
        assert again.status == 200 and (await again.json())["replayed"] is True
        assert (await again.json())["completed_at"] == (await done.json())["completed_at"]
        assert await code(await complete(gw, 1, result={"ok": 1})) == (409, "stale_generation")
        assert await code(await complete(gw, 2, result={"ok": 2})) == (409, "job_completed")
        assert await code(await put_checkpoint(gw, "c", [3], 2)) == (409, "job_completed")
        view = await (await client.get("/v1/jobs/r")).json()
        assert view["completion"]["generation"] == 2 and view["checkpoints"]["c"]["generation"] == 2


async def test_a_wiped_redis_fails_closed_for_checkpoints_and_completion(
    gw: Gateway, redis_sync: Any
) -> None:
    await gw.register("r", generation=1)
    redis_sync.flushall()
    assert await code(await put_checkpoint(gw, "c", 1, 1)) == (503, "store_unavailable")
    assert await code(await complete(gw, 1)) == (503, "store_unavailable")
    assert lasting_keys(redis_sync) == [], "a refused call must write nothing that lasts"


async def test_a_completion_redis_never_answers_is_503_and_sending_it_again_replays(
    make_gateway: Any, wire: WireProxy, redis_sync: Any
) -> None:
    """Both the call and its re-send (same request id) get no answer in time: 503, "it may
    have been recorded". The script did run: the same completion sent again replays it, and
    another body is refused."""
    # a timeout wide enough that the re-send gets a connection on a loaded CI machine
    gw: Gateway = await make_gateway(redis={"url": wire.url, "timeout_seconds": 1.0})
    await gw.register("r", generation=1)
    first = wire.on_reply_to(b"zz-unanswered", "hold", seconds=3.0)
    second = wire.on_reply_to(b"zz-unanswered", "hold", seconds=3.0)
    resp = await complete(gw, 1, result="zz-unanswered")
    assert await code(resp) == (503, "store_unavailable")
    assert "may have been recorded" in (await resp.json())["detail"]
    assert first.fired.is_set() and second.fired.is_set()
    assert json.loads(redis_sync.hget(JOB.job, "completed"))["result"] == "zz-unanswered"
    again = await complete(gw, 1, result="zz-unanswered")
    assert again.status == 200 and (await again.json())["replayed"] is True
    assert await code(await complete(gw, 1, result="other")) == (409, "job_completed")
