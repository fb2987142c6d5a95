"""gateway.integrations.procrastinate with real Procrastinate worker processes
(examples/procrastinate_worker.py), Debian's PostgreSQL on loopback (a data dir of this
module's own) and a loopback receiver downstream.

The seed's timeline, with Procrastinate's own recovery of stalled jobs: worker A starts the
job (attempts 0: generation 1) and is frozen with SIGSTOP mid-task; its worker heartbeat goes
quiet, worker B's periodic ``retry_stalled_jobs`` task (Procrastinate's documented recipe:
``get_stalled_jobs`` by heartbeat, ``retry_job``) puts the job back, B runs it (attempts 1:
generation 2), sends the receipt and finishes; A is resumed. The receiver got one receipt,
A was refused (audited with both generations), A's finish changed nothing in Procrastinate's
table (the row and its events are B's), and nothing runs the job a third time."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import procrastinate
import psycopg
import pytest
from procrastinate.jobs import Status
from psycopg.rows import dict_row

from gateway.integrations.procrastinate import FencedJobManager, ProcrastinateFencing, fenced_job
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
from tests.support.postgres import PostgresServer

EXAMPLE = str(ROOT / "examples" / "procrastinate_worker.py")


@pytest.fixture
def procrastinate_dsn(postgres: PostgresServer) -> str:
    """A database with Procrastinate's schema and no jobs."""
    with psycopg.connect(postgres.dsn, autocommit=True) as conn:
        conn.execute("DROP SCHEMA public CASCADE")
        conn.execute("CREATE SCHEMA public")
        conn.execute(procrastinate.schema.SchemaManager.get_schema())
    return postgres.dsn


@pytest.fixture
async def procrastinate_workers(
    gw: Gateway, procrastinate_dsn: str, tmp_path: Path
) -> AsyncIterator[WorkerProcs]:
    env = gateway_env(
        gw,
        PROCRASTINATE_DSN=procrastinate_dsn,
        PROCRASTINATE_HEARTBEAT_SECONDS="0.5",
        PROCRASTINATE_STALLED_SECONDS="2.5",  # 5 heartbeats: a worker lagging under load lives
        PROCRASTINATE_STALLED_CRON="* * * * * */1",  # every second (croniter's 6th field)
        FENCEGATE_HEARTBEAT_SECONDS="1",
    )
    w = WorkerProcs(tmp_path, sys.executable, EXAMPLE, env)
    yield w
    await asyncio.to_thread(w.stop)


def job_row(procrastinate_dsn: str, job_id: int) -> dict[str, Any]:
    with psycopg.connect(procrastinate_dsn, row_factory=dict_row) as conn:
        row = conn.execute(
            "SELECT status::text, attempts, worker_id FROM procrastinate_jobs WHERE id = %s",
            (job_id,),
        ).fetchone()
        events = conn.execute(
            "SELECT type::text FROM procrastinate_events WHERE job_id = %s ORDER BY id",
            (job_id,),
        ).fetchall()
    assert row is not None
    return {**row, "events": [e["type"] for e in events]}


def receipt_jobs(procrastinate_dsn: str) -> int:
    with psycopg.connect(procrastinate_dsn) as conn:
        got = conn.execute(
            "SELECT count(*) FROM procrastinate_jobs WHERE task_name = 'send_receipt'"
        ).fetchone()
    assert got is not None
    return int(got[0])


async def test_an_attempt_frozen_until_procrastinate_retries_it_sends_nothing_and_finishes_nothing(
    gw: Gateway, procrastinate_workers: WorkerProcs, upstream: Upstream, procrastinate_dsn: str
) -> None:
    # deferred before A starts: A's work begins well after the defer command has returned
    out = await asyncio.to_thread(
        procrastinate_workers.command, "defer", "order-5", "--work-seconds", "1.5"
    )
    job_id = int(out.strip())
    a = procrastinate_workers.start("worker-a", "--name", "a")
    name = f"procrastinate-{job_id}"
    # A's attempt registered generation 1 and is preparing the receipt: freeze it there
    await until("A registered its attempt", lambda: fence(gw, name))
    os.kill(a.pid, signal.SIGSTOP)
    a_worker = job_row(procrastinate_dsn, job_id)["worker_id"]
    assert await fence(gw, name) == 1 and upstream.received == []

    # B's periodic retry_stalled_jobs puts the job back once A's heartbeat is 2.5 s old; B is
    # Procrastinate's own worker command
    procrastinate_workers.start(
        "worker-b",
        argv=["-m", "procrastinate", "--app", "examples.procrastinate_worker.app", "worker",
              "--name", "b"],
    )  # fmt: skip
    await until(
        "B finished the job", lambda: job_row(procrastinate_dsn, job_id)["status"] == "succeeded"
    )
    assert await fence(gw, name) == 2
    assert [r.headers["Idempotency-Key"] for r in upstream.received] == [f"{name}:receipt"]

    os.kill(a.pid, signal.SIGCONT)
    await until(
        "A's attempt ended",
        lambda: f"job {job_id} attempt 0 moved on" in procrastinate_workers.log(a),
    )
    assert (
        f"({name}) generation 1 superseded (stale_generation): stopped"
        in procrastinate_workers.log(a)
    )

    # one receipt downstream; fencegate's completion is B's
    assert len(upstream.received) == 1
    job = await (await gw.client.get(f"/v1/jobs/{name}", headers=gw.headers)).json()
    result = {"order": "order-5", "sent_by_attempt": 2, "worker": "b", "replayed": False}
    assert (job["completion"]["generation"], job["completion"]["result"]) == (2, result)
    # A refused with both generations; both registrations were the claim key's
    assert await refusals(gw, name) == {("stale_generation", 1, 2)}
    assert await registrations(gw, name) == [
        ("1", CLAIM_NAME),
        ("2", CLAIM_NAME),
    ]
    # Procrastinate's row and events are B's: A recorded no status over them, retried nothing
    row = job_row(procrastinate_dsn, job_id)
    assert row["events"] == [
        "deferred", "started", "scheduled", "deferred_for_retry", "started", "succeeded",
    ]  # fmt: skip
    assert (row["status"], row["attempts"]) == ("succeeded", 2)
    assert row["worker_id"] not in (None, a_worker)
    assert receipt_jobs(procrastinate_dsn) == 1 and await fence(gw, name) == 2
    assert a.poll() is None


async def test_a_stale_attempts_finish_and_retry_leave_the_newer_attempts_row_alone(
    procrastinate_dsn: str,
) -> None:
    app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=procrastinate_dsn))
    app.job_manager = FencedJobManager(connector=app.connector)

    @app.task(name="noop")
    async def noop() -> None:
        pass

    async with app.open_async():
        jm = app.job_manager
        job_id = await noop.defer_async()
        a = await jm.fetch_job(queues=None, worker_id=await jm.register_worker())
        assert a is not None and (a.id, a.attempts) == (job_id, 0)
        await jm.retry_job(a)  # the stalled-job recovery puts it back
        b = await jm.fetch_job(queues=None, worker_id=await jm.register_worker())
        assert b is not None and (b.id, b.attempts) == (job_id, 1)
        # A, resumed, finishes or retries with the attempt it fetched: nothing changes
        await jm.finish_job(a, Status.ABORTED, delete_job=False)
        await jm.finish_job(a, Status.SUCCEEDED, delete_job=True)
        await jm.retry_job(a)
        row = job_row(procrastinate_dsn, job_id)
        assert (row["status"], row["attempts"], row["worker_id"]) == ("doing", 1, b.worker_id)
        # B's finish is Procrastinate's own, and so is a current attempt's finish that deletes
        await jm.finish_job(b, Status.SUCCEEDED, delete_job=False)
        other = await noop.defer_async()
        c = await jm.fetch_job(queues=None, worker_id=await jm.register_worker())
        assert c is not None and c.id == other
        await jm.finish_job(c, Status.SUCCEEDED, delete_job=True)
    with psycopg.connect(procrastinate_dsn) as conn:
        gone = conn.execute("SELECT count(*) FROM procrastinate_jobs WHERE id = %s", (other,))
        assert gone.fetchone() == (0,)
    row = job_row(procrastinate_dsn, job_id)
    assert (row["status"], row["attempts"]) == ("succeeded", 2)
    assert row["events"] == [
        "deferred", "started", "scheduled", "deferred_for_retry", "started", "succeeded",
    ]  # fmt: skip


def receipts_app(gw: Gateway, procrastinate_dsn: str, *, install: bool = True) -> tuple[Any, Any]:
    """An app of one fenced receipt task whose job id is the job's lock (the order)."""
    base = str(gw.client.make_url("")).rstrip("/")
    fencing = ProcrastinateFencing(base, api_key=CLAIM_KEY, job_id="lock")
    app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=procrastinate_dsn))
    if install:
        fencing.install(app)

    @app.task(name="receipt", pass_context=True, task_middleware=[fencing])
    async def receipt(context: procrastinate.JobContext, order_id: str) -> dict[str, Any]:
        await fenced_job(context).effect(
            "receipt", adapter="hook", operation="order.receipt", payload={"order": order_id}
        )
        return {"order": order_id, "row": context.job.id}

    return app, receipt


# a worker that ends once the queue is empty; no LISTEN connection (a worker that ends at
# once may cancel its listener mid-connect, and the half-made connection is left to the GC)
ONE_SHOT: Any = {"wait": False, "install_signal_handlers": False, "listen_notify": False}


def statuses(procrastinate_dsn: str) -> list[tuple[str, int]]:
    with psycopg.connect(procrastinate_dsn) as conn:
        cur = conn.execute("SELECT status::text, attempts FROM procrastinate_jobs ORDER BY id")
        return [(str(r[0]), int(r[1])) for r in cur.fetchall()]


async def test_a_second_row_of_a_completed_order_runs_nothing_and_succeeds(
    gw: Gateway, procrastinate_dsn: str, upstream: Upstream
) -> None:
    app, receipt = receipts_app(gw, procrastinate_dsn)
    async with app.open_async():
        # the same order deferred twice (two rows, one lock): one fencegate job, allocated
        first = await receipt.configure(lock="order-9").defer_async(order_id="order-9")
        await receipt.configure(lock="order-9").defer_async(order_id="order-9")
        await app.run_worker_async(**ONE_SHOT)
    assert statuses(procrastinate_dsn) == [("succeeded", 1), ("succeeded", 1)]
    assert [r.headers["Idempotency-Key"] for r in upstream.received] == ["order-9:receipt"]
    job = await (await gw.client.get("/v1/jobs/order-9", headers=gw.headers)).json()
    assert job["completion"]["result"] == {"order": "order-9", "row": first}
    assert await registrations(gw, "order-9") == [("1", CLAIM_NAME)]


async def test_a_fenced_task_in_an_app_without_the_fenced_manager_runs_nothing(
    gw: Gateway, procrastinate_dsn: str, upstream: Upstream
) -> None:
    app, receipt = receipts_app(gw, procrastinate_dsn, install=False)
    async with app.open_async():
        await receipt.configure(lock="order-4").defer_async(order_id="order-4")
        await app.run_worker_async(**ONE_SHOT)
    assert statuses(procrastinate_dsn) == [("failed", 1)]  # NotFencedApp, before any registration
    assert upstream.received == [] and await fence(gw, "order-4") == 0
