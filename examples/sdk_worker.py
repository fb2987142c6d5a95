"""A worker that uses the fencegate SDK with a SQLite job table.

    python examples/sdk_worker.py --gateway http://127.0.0.1:8080 --db jobs.sqlite \
        --worker w1 [--enqueue r]

The pattern, as in the seed articles:

1. Claim a job atomically: ``UPDATE … SET attempt = attempt + 1 … RETURNING attempt``.
   The attempt number is the fencing token.
2. Register that generation with fencegate at claim time, so an older worker
   still running the job is refused at once.
3. Do the work; route every side effect through fencegate under ``FencedJob``
   (which heartbeats, and cancels this work if the job is taken over). Progress
   goes to a fenced checkpoint, so the next attempt resumes where this one got to.
4. Complete the job in fencegate (one conditional write: a superseded attempt's
   completion changes nothing), then commit with a conditional
   ``UPDATE … WHERE attempt = ?``: zero rows means the job moved on, and the result
   is discarded.
"""

from __future__ import annotations

import argparse
import asyncio
import sqlite3
import time

from gateway.client import (
    FencedJob,
    JobCancelled,
    JobCompleted,
    LeaseExpired,
    Scheduler,
    StaleGeneration,
)

LEASE_SECONDS = 30
SCHEMA = """CREATE TABLE IF NOT EXISTS jobs (
  job_id TEXT PRIMARY KEY, attempt INTEGER NOT NULL DEFAULT 0, owner TEXT,
  lease_until REAL NOT NULL DEFAULT 0, state TEXT NOT NULL DEFAULT 'queued')"""


def claim(db: sqlite3.Connection, worker: str) -> tuple[str, int] | None:
    now = time.time()
    row = db.execute(
        "UPDATE jobs SET attempt = attempt + 1, owner = ?, lease_until = ?, state = 'running' "
        "WHERE job_id = (SELECT job_id FROM jobs WHERE state != 'succeeded' "
        "                AND (owner IS NULL OR lease_until < ?) LIMIT 1) "
        "RETURNING job_id, attempt",
        (worker, now + LEASE_SECONDS, now),
    ).fetchone()
    return (row[0], row[1]) if row else None


def commit(db: sqlite3.Connection, job_id: str, attempt: int) -> bool:
    cur = db.execute(
        "UPDATE jobs SET state = 'succeeded', owner = NULL WHERE job_id = ? AND attempt = ?",
        (job_id, attempt),
    )
    return cur.rowcount == 1


async def run_once(gateway: str, db: sqlite3.Connection, worker: str, api_key: str | None) -> str:
    claimed = claim(db, worker)
    if claimed is None:
        return "idle"
    job_id, attempt = claimed
    async with Scheduler(gateway, api_key=api_key) as sched:
        await sched.register(job_id, generation=attempt, lease_ms=LEASE_SECONDS * 1000)
    try:
        async with FencedJob(gateway, job_id, attempt, api_key=api_key, worker_id=worker) as job:
            progress = await job.load_checkpoint("progress")  # an earlier attempt's, if any
            if progress is None or not progress.value.get("notified"):
                await job.effect(
                    "notify",
                    adapter="hook",
                    operation="order.shipped",
                    payload={"job": job_id, "message": "your order shipped"},
                )
                await job.checkpoint("progress", {"notified": True})
            await job.complete(result={"notified": True})
    except (StaleGeneration, JobCancelled, LeaseExpired, JobCompleted) as err:
        return f"superseded ({err.code}): stopped"
    return "done" if commit(db, job_id, attempt) else "lost the job before commit: discarded"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gateway", default="http://127.0.0.1:8080")
    parser.add_argument("--db", default="jobs.sqlite")
    parser.add_argument("--worker", default="worker-1")
    parser.add_argument("--api-key")
    parser.add_argument("--enqueue", action="append", default=[], help="add a job id first")
    args = parser.parse_args()
    db = sqlite3.connect(args.db, isolation_level=None)
    db.execute(SCHEMA)
    for job_id in args.enqueue:
        db.execute("INSERT OR IGNORE INTO jobs (job_id) VALUES (?)", (job_id,))
    while (outcome := asyncio.run(run_once(args.gateway, db, args.worker, args.api_key))) != "idle":
        print(outcome, flush=True)


if __name__ == "__main__":
    main()
