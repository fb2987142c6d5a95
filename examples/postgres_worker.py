"""A worker on a PostgreSQL job table, fenced by fencegate.

    export FENCEGATE_URL=http://127.0.0.1:8080 FENCEGATE_KEY=<a worker key with claims = true>
    python examples/postgres_worker.py --dsn postgresql://… enqueue order-7
    python examples/postgres_worker.py --dsn postgresql://… --worker w1 work [--once] [--wait 30]

Each claim takes a row with ``FOR UPDATE SKIP LOCKED``, adds one to its ``attempt`` and
registers that attempt as the job's generation (:mod:`gateway.integrations.postgres`) before
the claim commits. The receipt goes through fencegate under ``<job>:receipt``; the job
completes in fencegate, then the row commits only ``WHERE attempt = <mine>``. A worker frozen
past its lease (``--lease-seconds``) wakes to find another attempt registered: its receipt is
refused, its commit changes nothing, and it says so.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os

import psycopg

from gateway.client import JobCancelled, JobCompleted, LeaseExpired, StaleGeneration
from gateway.integrations.postgres import JobTable, PostgresJobs


async def work_one(jobs: PostgresJobs, worker: str) -> str:
    claim = await jobs.claim(worker=worker)
    if claim is None:
        return "idle"
    print(f"claimed {claim.job_id} attempt {claim.attempt}", flush=True)
    try:
        async with jobs.hold(claim) as job:
            async with await psycopg.AsyncConnection.connect(jobs.conninfo) as conn:
                cur = await conn.execute(
                    "SELECT payload FROM jobs WHERE job_id = %s", (claim.job_id,)
                )
                row = await cur.fetchone()
            payload = (row[0] if row else None) or {}
            await asyncio.sleep(float(payload.get("work_seconds", 0)))  # rendering the receipt
            await job.effect(
                "receipt",
                adapter=os.environ.get("FENCEGATE_ADAPTER", "hook"),
                operation="order.receipt",
                payload={"order": claim.job_id, "text": f"Thank you for order {claim.job_id}"},
            )
            result = {"order": claim.job_id, "sent_by_attempt": claim.attempt}
            committed = await jobs.complete(job, claim, result=result)
    except (StaleGeneration, LeaseExpired, JobCancelled, JobCompleted) as err:
        return f"superseded {claim.job_id} attempt {claim.attempt} ({err.code}): stopped"
    if not committed:
        return f"done {claim.job_id} attempt {claim.attempt}: the row moved on, not committed"
    return f"done {claim.job_id} attempt {claim.attempt}"


async def work(jobs: PostgresJobs, worker: str, *, once: bool, wait: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait
    while True:
        outcome = await work_one(jobs, worker)
        if outcome != "idle":
            print(outcome, flush=True)
            if once:
                return
        elif loop.time() >= deadline:
            return
        else:
            await asyncio.sleep(0.1)


async def enqueue(dsn: str, job_id: str, work_seconds: float) -> None:
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        await conn.execute(JobTable().create())
        await conn.execute(
            "INSERT INTO jobs (job_id, payload) VALUES (%s, %s) ON CONFLICT DO NOTHING",
            (job_id, json.dumps({"work_seconds": work_seconds})),
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--worker", default=f"pg-{os.getpid()}")
    parser.add_argument("--lease-seconds", type=float, default=30.0)
    sub = parser.add_subparsers(dest="command", required=True)
    enq = sub.add_parser("enqueue")
    enq.add_argument("job_id")
    enq.add_argument("--work-seconds", type=float, default=0.0)
    run = sub.add_parser("work")
    run.add_argument("--once", action="store_true", help="stop after one job")
    run.add_argument("--wait", type=float, default=0.0, help="seconds to wait for a job")
    args = parser.parse_args()
    if args.command == "enqueue":
        asyncio.run(enqueue(args.dsn, args.job_id, args.work_seconds))
        return
    jobs = PostgresJobs(
        args.dsn,
        os.environ.get("FENCEGATE_URL", "http://127.0.0.1:8080"),
        api_key=os.environ.get("FENCEGATE_KEY"),
        lease_seconds=args.lease_seconds,
    )
    asyncio.run(work(jobs, args.worker, once=args.once, wait=args.wait))


if __name__ == "__main__":
    main()
