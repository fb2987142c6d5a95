"""gateway.integrations.celery with real `celery worker` processes (examples/celery_worker.py,
the solo pool), the test session's redis-server as broker and result backend, and a loopback
receiver downstream.

The seed's timeline, with Celery's own redelivery: late acknowledgement and a 3 s
visibility_timeout. Worker A starts the task (generation 1, allocated) and is frozen with
SIGSTOP mid-task; the unacknowledged task passes its visibility timeout and worker B restores
and runs it (generation 2), sends the receipt and stores its result; A is resumed. The
receiver got one receipt, A's run was refused (audited with both generations) and ended as
ignored, Celery's result is B's, and nothing is left to run again."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from gateway.http import appkeys as K
from gateway.integrations.celery import FencedTask
from gateway.store.keys import JobKeys
from tests.conftest import Gateway, Upstream
from tests.support.frameworks import (
    CLAIM_KEY,
    CLAIM_NAME,
    ROOT,
    WorkerProcs,
    fence,
    gateway_env,
    refusals,
    registrations,
    until,
)


@pytest.fixture
async def celery_workers(gw: Gateway, redis_url: str, tmp_path: Path) -> AsyncIterator[WorkerProcs]:
    env = gateway_env(
        gw,
        CELERY_REDIS_URL=redis_url,
        CELERY_VISIBILITY_TIMEOUT="3",
        FENCEGATE_HEARTBEAT_SECONDS="1",
    )
    w = WorkerProcs(tmp_path, sys.executable, str(ROOT / "examples" / "celery_worker.py"), env)
    yield w
    await asyncio.to_thread(w.stop)


async def celery_result(celery_workers: WorkerProcs) -> dict[str, Any]:
    return dict(json.loads(await asyncio.to_thread(celery_workers.command, "result", "order-3")))


async def succeeded(celery_workers: WorkerProcs) -> dict[str, Any] | None:
    got = await celery_result(celery_workers)
    return got if got["state"] == "SUCCESS" else None


async def test_a_run_frozen_past_the_visibility_timeout_sends_nothing_and_is_ignored(
    gw: Gateway, celery_workers: WorkerProcs, upstream: Upstream, redis_sync: redis.Redis
) -> None:
    a = celery_workers.start("worker-a", "--name", "a")
    await asyncio.to_thread(celery_workers.command, "enqueue", "order-3", "--work-seconds", "1.5")
    # A's run registered generation 1 and is preparing the receipt: freeze it there
    await until("A registered its run", lambda: fence(gw, "order-3"))
    os.kill(a.pid, signal.SIGSTOP)
    assert await fence(gw, "order-3") == 1 and upstream.received == []

    b = celery_workers.start(
        "worker-b", "--name", "b"
    )  # restores the task past its visibility timeout
    done = await until("B finished the task", lambda: succeeded(celery_workers), seconds=60)
    result = done["result"]
    assert result["order"] == "order-3" and result["worker"].startswith("b@")
    assert result["replayed"] is False
    assert await fence(gw, "order-3") == 2
    assert [r.headers["Idempotency-Key"] for r in upstream.received] == ["order-3:receipt"]

    os.kill(a.pid, signal.SIGCONT)
    await until("A's run ended", lambda: "send_receipt[order-3] ignored" in celery_workers.log(a))

    # one receipt downstream; B's result in fencegate and in Celery
    assert len(upstream.received) == 1
    assert await celery_result(celery_workers) == done  # A stored nothing over B's result
    job = await (await gw.client.get("/v1/jobs/order-3", headers=gw.headers)).json()
    assert (job["completion"]["generation"], job["completion"]["result"]) == (2, result)
    # A was refused with both generations; both registrations were the claim key's
    assert await refusals(gw, "order-3") == {("stale_generation", 1, 2)}
    assert await registrations(gw, "order-3") == [("1", CLAIM_NAME), ("2", CLAIM_NAME)]
    # nothing left to run again: the queue and the unacknowledged set are empty, no third run
    assert redis_sync.llen("celery") == 0
    assert redis_sync.hlen("unacked") == 0
    assert await fence(gw, "order-3") == 2
    assert b.poll() is None and a.poll() is None


async def test_a_business_key_from_the_arguments_is_the_job_of_every_task_id(
    gw: Gateway, upstream: Upstream
) -> None:
    class OrderFenced(FencedTask):
        fencegate_url = str(gw.client.make_url("")).rstrip("/")
        fencegate_api_key = CLAIM_KEY
        fencegate_lease_ms = 7_000

        def fencegate_job_id(self, order_id: str) -> str:
            return f"order-{order_id}"

    app = Celery("orders")  # apply() runs the task in this process: no broker

    @app.task(base=OrderFenced, bind=True, name="receipt_by_order")
    def receipt(self: OrderFenced, order_id: str) -> dict[str, str]:
        self.fenced.effect(
            "receipt", adapter="hook", operation="order.receipt", payload={"order": order_id}
        )
        return {"order": order_id, "task": str(self.request.id)}

    # the same order enqueued twice (a retried enqueue, a second path): two task ids
    first = await asyncio.to_thread(receipt.apply, args=("42",), task_id="t-1")
    second = await asyncio.to_thread(receipt.apply, args=("42",), task_id="t-2")
    assert (first.state, first.result) == ("SUCCESS", {"order": "42", "task": "t-1"})
    assert second.state == "IGNORED"  # job_completed: the order's receipt was sent
    assert [r.headers["Idempotency-Key"] for r in upstream.received] == ["order-42:receipt"]
    job = await (await gw.client.get("/v1/jobs/order-42", headers=gw.headers)).json()
    assert (job["completion"]["generation"], job["completion"]["result"]) == (1, first.result)
    history = await gw.app[K.STORE].history(JobKeys("default", "order-42"))
    registered = [e for e in history if e.get("event") == "registered"]
    assert [(e["generation"], e["by"], e["lease_ms"]) for e in registered] == [
        ("1", CLAIM_NAME, "7000")  # fencegate_lease_ms
    ]
    for task_id in ("t-1", "t-2"):  # the task ids are no jobs of fencegate's
        assert (await gw.client.get(f"/v1/jobs/{task_id}", headers=gw.headers)).status == 404
