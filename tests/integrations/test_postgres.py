"""gateway.integrations.postgres with two real worker processes (examples/postgres_worker.py),
Debian's PostgreSQL on loopback (a data dir of this module's own) and a loopback receiver.

The seed's timeline, with the table's own lease: worker A claims the job (attempt 1) and is
frozen with SIGSTOP mid-task; its lease runs out, worker B claims the row as attempt 2, sends
the receipt, completes and commits; A is resumed. The receiver got one receipt, A was
refused (audited with both generations), A's commit changed nothing, the row and the job's
completion are B's."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from gateway.core.errors import GenerationRegression
from gateway.integrations.postgres import JobTable, PostgresJobs
from tests.conftest import Gateway, Upstream
from tests.support.frameworks import (
    CLAIM_KEY,
    CLAIM_NAME,
    ROOT,
    fence,
    gateway_env,
    refusals,
    registrations,
)
from tests.support.postgres import PostgresServer

EXAMPLE = str(ROOT / "examples" / "postgres_worker.py")


@pytest.fixture
def empty_dsn(postgres: PostgresServer) -> str:
    """A database without the jobs table (each test creates it through JobTable)."""
    with psycopg.connect(postgres.dsn, autocommit=True) as conn:
        conn.execute("DROP TABLE IF EXISTS jobs")
    return postgres.dsn


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for p in started:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGCONT)
            p.kill()
            p.wait()


async def finished(proc: subprocess.Popen[str]) -> str:
    out, _ = await asyncio.to_thread(proc.communicate, timeout=60)
    return out


async def test_a_worker_frozen_past_its_lease_sends_nothing_and_commits_nothing(
    gw: Gateway, empty_dsn: str, upstream: Upstream, procs: list[subprocess.Popen[str]]
) -> None:
    env = gateway_env(gw)

    def worker(name: str) -> subprocess.Popen[str]:
        cmd = [
            sys.executable,
            EXAMPLE,
            "--dsn",
            empty_dsn,
            "--worker",
            name,
            "--lease-seconds",
            "2",
        ]
        p = subprocess.Popen(
            [*cmd, "work", "--once", "--wait", "30"],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        procs.append(p)
        return p

    enqueue = [
        sys.executable,
        EXAMPLE,
        "--dsn",
        empty_dsn,
        "enqueue",
        "order-7",
        "--work-seconds",
        "2",
    ]
    await asyncio.to_thread(subprocess.run, enqueue, cwd=ROOT, env=env, check=True, timeout=60)

    a = worker("worker-a")
    # A's claim of attempt 1 committed (it registers the attempt before the commit: frozen
    # between the two, A would hold the row locked and B's SKIP LOCKED never see it): freeze
    # A mid-task
    for _ in range(2000):
        if row(empty_dsn, "order-7") == (1, "running", "worker-a"):
            break
        await asyncio.sleep(0.02)
    os.kill(a.pid, signal.SIGSTOP)
    assert await fence(gw, "order-7") == 1 and upstream.received == []

    b = worker("worker-b")  # claims the row once A's lease ran out
    out_b = await finished(b)
    assert b.returncode == 0, out_b
    assert out_b.splitlines() == ["claimed order-7 attempt 2", "done order-7 attempt 2"]
    assert [r.headers["Idempotency-Key"] for r in upstream.received] == ["order-7:receipt"]

    os.kill(a.pid, signal.SIGCONT)
    out_a = await finished(a)
    assert a.returncode == 0, out_a
    assert out_a.splitlines() == [
        "claimed order-7 attempt 1",
        "superseded order-7 attempt 1 (stale_generation): stopped",
    ]

    # one receipt; the row and the completion are B's
    assert len(upstream.received) == 1
    assert row(empty_dsn, "order-7") == (2, "succeeded", None)
    job = await (await gw.client.get("/v1/jobs/order-7", headers=gw.headers)).json()
    assert job["completion"]["generation"] == 2
    assert job["completion"]["result"] == {"order": "order-7", "sent_by_attempt": 2}
    # A refused with both generations (its heartbeat or its receipt, whichever came first)
    assert await refusals(gw, "order-7") == {("stale_generation", 1, 2)}
    assert await registrations(gw, "order-7") == [("1", CLAIM_NAME), ("2", CLAIM_NAME)]


async def queue_row(empty_dsn: str, job_id: str) -> None:
    async with await psycopg.AsyncConnection.connect(empty_dsn) as conn:
        await conn.execute(JobTable().create())
        await conn.execute("INSERT INTO jobs (job_id) VALUES (%s)", (job_id,))


def row(empty_dsn: str, job_id: str) -> tuple[Any, ...] | None:
    with psycopg.connect(empty_dsn) as conn:
        cur = conn.execute("SELECT attempt, state, owner FROM jobs WHERE job_id = %s", (job_id,))
        return cur.fetchone()


def pg_jobs(gw: Gateway, empty_dsn: str) -> PostgresJobs:
    return PostgresJobs(
        empty_dsn, str(gw.client.make_url("")).rstrip("/"), api_key=CLAIM_KEY, lease_seconds=5
    )


async def test_a_claim_behind_the_fence_is_rolled_back(gw: Gateway, empty_dsn: str) -> None:
    await queue_row(empty_dsn, "order-9")
    # fencegate is ahead of the table (the table was restored from an older backup)
    resp = await gw.client.post(
        "/v1/jobs/order-9/generations", json={"generation": 5}, headers=gw.headers
    )
    assert resp.status == 201
    with pytest.raises(GenerationRegression):
        await pg_jobs(gw, empty_dsn).claim(worker="w1")
    assert row(empty_dsn, "order-9") == (0, "queued", None)  # nothing claimed
    assert await fence(gw, "order-9") == 5


async def test_a_row_fencegate_completed_is_marked_done_not_handed_out(
    gw: Gateway, empty_dsn: str, upstream: Upstream
) -> None:
    jobs = pg_jobs(gw, empty_dsn)
    await queue_row(empty_dsn, "order-8")
    claim = await jobs.claim(worker="w1")
    assert claim is not None and (claim.job_id, claim.attempt) == ("order-8", 1)
    async with jobs.hold(claim) as job:
        await job.complete(result={"done": True})  # the table's commit never happens
    # the lease runs out: the next claim finds the job completed in fencegate
    with psycopg.connect(empty_dsn) as conn:
        conn.execute("UPDATE jobs SET lease_until = now() - interval '1 second'")
    assert await jobs.claim(worker="w2") is None
    assert row(empty_dsn, "order-8") == (2, "succeeded", None)
    assert await fence(gw, "order-8") == 1 and upstream.received == []


async def test_a_held_claim_outlives_its_lease_in_the_table_and_in_fencegate(
    gw: Gateway, empty_dsn: str, upstream: Upstream
) -> None:
    base = str(gw.client.make_url("")).rstrip("/")
    jobs = PostgresJobs(empty_dsn, base, api_key=CLAIM_KEY, lease_seconds=2.5)
    await queue_row(empty_dsn, "order-6")
    claim = await jobs.claim(worker="w1")
    assert claim is not None and claim.attempt == 1
    async with jobs.hold(claim) as job:
        await asyncio.sleep(5.5)  # over two leases: hold() renewed the row and the generation
        assert await jobs.claim(worker="w2") is None  # the row's lease still runs
        await job.effect("receipt", adapter="hook", operation="order.receipt", payload={})
        assert await jobs.complete(job, claim, result={"held": True})
    assert row(empty_dsn, "order-6") == (1, "succeeded", None)
    assert len(upstream.received) == 1 and await fence(gw, "order-6") == 1
