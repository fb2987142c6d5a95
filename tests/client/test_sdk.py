"""The SDK against the real gateway: typed errors, retries, heartbeat-driven cancellation."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from gateway.client import (
    AdapterUnavailable,
    EffectFailed,
    EffectInProgress,
    FencedJob,
    GatewayUnreachable,
    IntentMismatch,
    InvalidRequest,
    JobCancelled,
    LeaseExpired,
    OutcomeUnknown,
    Scheduler,
    StaleGeneration,
    StoreUnavailable,
    SyncFencedJob,
    SyncScheduler,
    UnknownAdapter,
    UnregisteredGeneration,
)
from gateway.store.embedded import free_port
from tests.conftest import Gateway, Upstream


def base(gw: Gateway) -> str:
    return str(gw.client.make_url("")).rstrip("/")


async def test_register_and_effect_round_trip(gw: Gateway, upstream: Upstream) -> None:
    async with Scheduler(base(gw)) as sched:
        gen = await sched.register("r", lease_ms=60_000)
        assert (gen.generation, gen.token, gen.created) == (1, "1", True)
        again = await sched.register("r", generation=1)
        assert again.created is False
    async with FencedJob(base(gw), "r", gen.token, worker_id="w1") as job:
        res = await job.effect("notify", adapter="hook", operation="send", payload={"to": "a"})
        assert (res.state, res.replayed, res.idempotency_key) == ("succeeded", False, "r:notify")
        assert (
            await job.effect("notify", adapter="hook", operation="send", payload={"to": "a"})
        ).replayed
    async with Scheduler(base(gw)) as sched:
        view = await sched.job("r")
        assert view["effects"]["notify"]["worker_id"] == "w1"
    assert len(upstream.received) == 1


async def test_every_exception_type(gw: Gateway, upstream: Upstream, redis_sync: Any) -> None:
    url = base(gw)
    async with Scheduler(url) as sched:
        await sched.register("r", generation=2)
        async with FencedJob(url, "r", 1, heartbeat_interval=None) as zombie:
            with pytest.raises(StaleGeneration) as stale:
                await zombie.effect("s", adapter="hook", operation="x", payload={})
        assert (stale.value.presented, stale.value.current) == (1, 2)
        async with FencedJob(url, "r", 3, heartbeat_interval=None) as inflated:
            with pytest.raises(UnregisteredGeneration):
                await inflated.effect("s", adapter="hook", operation="x", payload={})
        job = FencedJob(url, "r", 2, retries=0)
        await job.effect("s", adapter="hook", operation="x", payload={"a": 1})
        with pytest.raises(IntentMismatch) as mismatch:
            await job.effect("s", adapter="hook", operation="x", payload={"a": 2})
        assert len(mismatch.value.pinned_intent_sha256) == 64
        with pytest.raises(UnknownAdapter):
            await job.effect("t", adapter="nope", operation="x", payload={})
        with pytest.raises(AdapterUnavailable):
            await job.effect("t", adapter="dead", operation="x", payload={})
        upstream.behaviour = 400
        with pytest.raises(EffectFailed) as failed:
            await job.effect("u", adapter="hook", operation="x", payload={})
        assert failed.value.error["status"] == 400
        upstream.behaviour = 500
        with pytest.raises(OutcomeUnknown) as unknown:
            await job.effect("v", adapter="hook", operation="x", payload={})
        assert unknown.value.http_status == 504
        with pytest.raises(OutcomeUnknown) as unknown_again:
            await job.effect("v", adapter="hook", operation="x", payload={})
        assert unknown_again.value.http_status == 409
        upstream.behaviour = "ok"
        upstream.hold()
        inflight = asyncio.create_task(job.effect("w", adapter="hook", operation="x", payload={}))
        await upstream.arrived.wait()
        await asyncio.sleep(0.05)
        with pytest.raises(EffectInProgress) as busy:
            await job.effect("w", adapter="hook", operation="x", payload={})
        assert busy.value.retry_after >= 1
        upstream.gate.set()
        await inflight
        async with FencedJob(url, "a:b", 1, heartbeat_interval=None) as bad:
            with pytest.raises(InvalidRequest):
                await bad.effect("s", adapter="hook", operation="x", payload={})
        redis_sync.hset("fg:{default/r}:job", "lease_exp", "1")
        with pytest.raises(LeaseExpired):
            await job.heartbeat()
        await sched.cancel("r")
        with pytest.raises(JobCancelled):
            await job.heartbeat()
        await job.aclose()


async def test_store_unavailable_and_gateway_unreachable(make_gateway: Any) -> None:
    gw: Gateway = await make_gateway(
        redis={"url": f"redis://127.0.0.1:{free_port()}/0", "timeout_seconds": 0.3}
    )
    async with Scheduler(base(gw)) as sched:
        with pytest.raises(StoreUnavailable):
            await sched.register("r")
    async with Scheduler(f"http://127.0.0.1:{free_port()}") as nowhere:
        with pytest.raises(GatewayUnreachable):
            await nowhere.register("r")


async def test_retries_effect_in_progress_until_replay(gw: Gateway, upstream: Upstream) -> None:
    async with Scheduler(base(gw)) as sched:
        await sched.register("r", generation=1)
    upstream.hold()
    first = FencedJob(base(gw), "r", 1)
    second = FencedJob(base(gw), "r", 1, retries=10, backoff=0.05)
    inflight = asyncio.create_task(first.effect("s", adapter="hook", operation="x", payload={}))
    await upstream.arrived.wait()
    asyncio.get_running_loop().call_later(0.3, upstream.gate.set)
    res = await second.effect("s", adapter="hook", operation="x", payload={})
    assert res.replayed is True
    assert (await inflight).replayed is False
    assert len(upstream.received) == 1
    await first.aclose()
    await second.aclose()


async def test_retries_adapter_unavailable_then_succeeds(gw: Gateway, upstream: Upstream) -> None:
    async with Scheduler(base(gw)) as sched:
        await sched.register("r", generation=1)
    upstream.behaviour = 429  # not processed (a 503 would be unknown: a proxy may answer it)

    async def recover() -> None:
        await upstream.arrived.wait()
        upstream.behaviour = "ok"

    task = asyncio.create_task(recover())
    async with FencedJob(base(gw), "r", 1, retries=5, backoff=0.02) as job:
        res = await job.effect("s", adapter="hook", operation="x", payload={"n": 1})
    await task
    assert res.state == "succeeded" and res.replayed is False
    assert len(upstream.received) == 2  # one 429 (released), one delivery, same key
    assert {r.headers["Idempotency-Key"] for r in upstream.received} == {"r:s"}


async def test_no_retry_for_other_errors(gw: Gateway, upstream: Upstream) -> None:
    async with Scheduler(base(gw)) as sched:
        await sched.register("r", generation=1)
    upstream.behaviour = 400
    async with FencedJob(base(gw), "r", 1, retries=5) as job:
        with pytest.raises(EffectFailed):
            await job.effect("s", adapter="hook", operation="x", payload={})
    assert len(upstream.received) == 1


async def test_takeover_cancels_running_work_within_one_heartbeat(gw: Gateway) -> None:
    interval = 0.2
    async with Scheduler(base(gw)) as sched:
        old = await sched.register("r", lease_ms=60_000)
        started = asyncio.Event()
        cancelled_at: list[float] = []

        async def work() -> None:
            async with FencedJob(base(gw), "r", old.token, heartbeat_interval=interval):
                started.set()
                try:
                    await asyncio.sleep(3600)  # a long job
                except asyncio.CancelledError:
                    cancelled_at.append(time.monotonic())
                    raise

        task = asyncio.create_task(work())
        await started.wait()
        await asyncio.sleep(interval * 1.5)  # a few healthy beats first
        assert not task.done()
        await sched.register("r")  # takeover: generation 2
        with pytest.raises(StaleGeneration) as exc:
            await asyncio.wait_for(task, 5)
        assert (exc.value.presented, exc.value.current) == (1, 2)
        assert cancelled_at
        # within one heartbeat: the first beat after the takeover is refused and ends the work,
        # no second stale beat is sent (counted, not timed: a loaded host stretches seconds)
        await asyncio.sleep(interval * 3)
        stale = [e for e in (await sched.audit(job_id="r"))["items"] if e["presented"] == 1]
        assert len(stale) == 1, stale


async def test_sync_wrappers(gw: Gateway, upstream: Upstream) -> None:
    url = base(gw)

    def worker() -> tuple[str, str]:
        with SyncScheduler(url) as sched:
            gen = sched.register("r", lease_ms=60_000)
            with SyncFencedJob(url, "r", gen.token, heartbeat_interval=0.1) as job:
                first = job.effect("s", adapter="hook", operation="x", payload={})
                sched.register("r")  # someone takes over
                deadline = time.monotonic() + 5
                while job.superseded is None and time.monotonic() < deadline:
                    time.sleep(0.02)
                try:
                    job.check()
                except StaleGeneration as err:
                    return first.state, err.code
        return first.state, "not superseded"

    assert await asyncio.to_thread(worker) == ("succeeded", "stale_generation")
    assert len(upstream.received) == 1


async def test_no_heartbeat_of_a_completing_job_is_refused_after_its_completion(
    gw: Gateway,
) -> None:
    """The completion waits for the heartbeat on its way (and starts no other): a beat the
    gateway handled after the completion would be refused as ``job_completed`` and audited
    against the very generation that completed. Real concurrency: beats every 2 ms."""
    async with Scheduler(base(gw)) as sched:
        for i in range(25):
            job = f"done-{i}"
            reg = await sched.register(job, lease_ms=60_000)
            async with FencedJob(base(gw), job, reg.token, heartbeat_interval=0.002) as fj:
                await asyncio.sleep(0.01 + 0.001 * (i % 7))  # land among the beats
                await fj.complete(result={"i": i})
            audit = await gw.audit(job=job)
            assert [e["reason"] for e in audit if e.get("reason")] == [], audit
