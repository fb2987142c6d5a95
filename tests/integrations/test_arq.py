"""gateway.integrations.arq with real arq worker processes (examples/arq_worker.py), the test
session's redis-server as arq's broker, and a loopback receiver downstream. arq pins redis-py
below 6, so everything arq runs in .venv-arq (`make arq-venv`, a dependency of `make pytest`).

The seed's timeline, with arq's own redelivery: worker A starts the job (try 1) and is frozen
with SIGSTOP mid-task; arq's in-progress key (job timeout + 10 s) runs out, worker B picks the
job up as try 2, sends the receipt and finishes; A is resumed. The receiver got one receipt,
A's try was refused (audited with both generations), arq's result is B's, and A's end leaves
arq's records alone (no re-queue, no retry)."""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import redis

from gateway.http import appkeys as K
from gateway.store.keys import JobKeys
from tests.conftest import Gateway, Upstream
from tests.support.frameworks import (
    CLAIM_NAME,
    ROOT,
    WorkerProcs,
    fence,
    gateway_env,
    refusals,
    registrations,
    until,
)

ARQ_PYTHON = ROOT / ".venv-arq" / "bin" / "python"
JOB_TIMEOUT = 3  # seconds: arq's in-progress key lives 13 s


@pytest.fixture
async def arq_workers(gw: Gateway, redis_url: str, tmp_path: Path) -> AsyncIterator[WorkerProcs]:
    if not ARQ_PYTHON.exists():
        pytest.fail(f"{ARQ_PYTHON} is missing: run `make arq-venv` (make pytest does)")
    env = gateway_env(
        gw,
        ARQ_REDIS_URL=redis_url,
        ARQ_JOB_TIMEOUT=str(JOB_TIMEOUT),
        FENCEGATE_HEARTBEAT_SECONDS="1",
    )
    w = WorkerProcs(tmp_path, str(ARQ_PYTHON), str(ROOT / "examples" / "arq_worker.py"), env)
    yield w
    await asyncio.to_thread(w.stop)


async def arq_result(arq_workers: WorkerProcs) -> dict[str, Any]:
    return dict(json.loads(await asyncio.to_thread(arq_workers.command, "result", "order-1")))


async def completed(arq_workers: WorkerProcs) -> dict[str, Any] | None:
    got = await arq_result(arq_workers)
    return got if got["status"] == "complete" else None


@pytest.mark.slow  # about 16 s: arq's in-progress key outlives the job timeout by 10 s
async def test_a_try_frozen_past_arqs_redelivery_sends_nothing_and_records_nothing(
    gw: Gateway, arq_workers: WorkerProcs, upstream: Upstream, redis_sync: redis.Redis
) -> None:
    a = arq_workers.start("worker-a")
    await asyncio.to_thread(arq_workers.command, "enqueue", "order-1", "--work-seconds", "1.5")
    # A's try 1 registered generation 1 and is preparing the receipt: freeze it there
    await until("A registered try 1", lambda: fence(gw, "order-1"))
    os.kill(a.pid, signal.SIGSTOP)
    assert await fence(gw, "order-1") == 1 and upstream.received == []

    # arq hands B the job once A's in-progress key ran out; B runs the module's own command
    b = arq_workers.start(
        "worker-b", argv=["-m", "gateway.integrations.arq", "examples.arq_worker.WorkerSettings"]
    )
    done = await until("B finished the job", lambda: completed(arq_workers), seconds=60)
    result = {"order": "order-1", "sent_by_try": 2, "replayed": False}
    assert done == {"status": "complete", "job_try": 2, "success": True, "result": result}
    assert await fence(gw, "order-1") == 2
    assert [r.headers["Idempotency-Key"] for r in upstream.received] == ["order-1:receipt"]

    os.kill(a.pid, signal.SIGCONT)
    await until("A's try ended", lambda: "send_receipt failed" in arq_workers.log(a))
    assert (
        "order-1 try 1 superseded (stale_generation): nothing recorded in arq" in arq_workers.log(a)
    )

    # one receipt downstream, B's result in fencegate and in arq
    assert len(upstream.received) == 1
    assert upstream.received[0].json() == {
        "order": "order-1",
        "text": "Thank you for order order-1",
    }
    assert await arq_result(arq_workers) == done  # A wrote nothing over B's result
    job = await (await gw.client.get("/v1/jobs/order-1", headers=gw.headers)).json()
    assert (job["completion"]["generation"], job["completion"]["result"]) == (2, result)
    # A was refused with both generations (its heartbeat, and the check after arq's timeout);
    # both registrations were the claim key's
    assert await refusals(gw, "order-1") == {("stale_generation", 1, 2)}
    assert await registrations(gw, "order-1") == [("1", CLAIM_NAME), ("2", CLAIM_NAME)]
    # nothing left for arq to run again: no queue entry, no in-progress key, no third try
    assert redis_sync.zcard("arq:queue") == 0
    assert redis_sync.exists("arq:in-progress:order-1") == 0
    assert await fence(gw, "order-1") == 2
    assert b.poll() is None and "try=2" in arq_workers.log(b)


async def test_a_copy_that_starts_after_the_job_completed_runs_nothing_and_keeps_the_result(
    gw: Gateway, arq_workers: WorkerProcs, upstream: Upstream, redis_url: str
) -> None:
    await asyncio.to_thread(arq_workers.command, "enqueue", "order-1")
    raw = redis.Redis.from_url(redis_url)  # bytes: arq's job is a pickle
    job_bytes = raw.get("arq:job:order-1")
    assert job_bytes is not None
    arq_workers.start("worker-a")
    done = await until("the job completed", lambda: completed(arq_workers), seconds=60)
    assert (done["job_try"], done["result"]["sent_by_try"]) == (1, 1)
    # a copy of the job queued again (a lost acknowledgement, a second enqueue path)
    raw.set("arq:job:order-1", job_bytes)
    raw.zadd("arq:queue", {"order-1": int(time.time() * 1000)})
    await until(
        "the copy ran",
        lambda: raw.zcard("arq:queue") == 0 and not raw.exists("arq:job:order-1"),
    )
    raw.close()
    assert await arq_result(arq_workers) == done  # the result that stands, not the copy's
    assert len(upstream.received) == 1 and await fence(gw, "order-1") == 1
    assert await registrations(gw, "order-1") == [("1", CLAIM_NAME)]


async def test_a_try_whose_job_try_may_have_restarted_allocates_the_next_generation(
    gw: Gateway, arq_workers: WorkerProcs, upstream: Upstream, redis_url: str
) -> None:
    await asyncio.to_thread(arq_workers.command, "enqueue", "order-1")
    # enqueued two days ago: arq's try counter (kept 88,400 s) may have restarted at 1
    raw = redis.Redis.from_url(redis_url)  # bytes: arq's job is a pickle of a dict
    job_bytes = raw.get("arq:job:order-1")
    assert job_bytes is not None
    two_days_ago = int((time.time() - 2 * 86_400) * 1000)
    raw.set("arq:job:order-1", pickle.dumps({**pickle.loads(job_bytes), "et": two_days_ago}))
    raw.close()
    # fencegate holds generation 5 of the job from its earlier tries
    resp = await gw.client.post(
        "/v1/jobs/order-1/generations", json={"generation": 5}, headers=gw.headers
    )
    assert resp.status == 201
    arq_workers.env["FENCEGATE_LEASE_MS"] = "7000"
    arq_workers.start("worker-a")

    async def completion() -> dict[str, Any] | None:
        job = await (await gw.client.get("/v1/jobs/order-1", headers=gw.headers)).json()
        return job if job.get("completion") else None

    job = await until("fencegate has the completion", completion, seconds=30)
    assert (job["fence"], job["completion"]["generation"]) == (6, 6)  # allocated: fence + 1
    done = await until("arq has the result", lambda: completed(arq_workers))
    assert (done["job_try"], done["result"]["sent_by_try"]) == (1, 1)
    history = await gw.app[K.STORE].history(JobKeys("default", "order-1"))
    claimed = [e for e in history if e.get("event") == "registered" and e["generation"] == "6"]
    assert [(e["by"], e["lease_ms"]) for e in claimed] == [(CLAIM_NAME, "7000")]
    assert len(upstream.received) == 1
