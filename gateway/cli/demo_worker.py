"""The worker of ``fencegate demo`` (one process per worker, started by the demo).

It claims the job in the SQLite job table (the attempt counter is its fencing token),
registers that generation, resumes from the job's last checkpoint if there is one,
renders its report and uploads it to its own attempt-scoped location, checkpoints,
sends the email and the webhook, and completes — in the gateway (the fenced completion
that promotes its report) and in the job table (``UPDATE … WHERE attempt = ?``). Every
step prints one JSON line for the demo's timeline.
"""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path
from typing import Any

from gateway.client import FencedJob, Scheduler
from gateway.core.errors import FencegateError

__all__ = ["JOB", "LEASE_MS", "OUTPUT", "SCHEMA", "claim", "complete", "report_bytes", "run"]

JOB = "r"
LEASE_MS = 1500
OUTPUT = "report.txt"
SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    job_id TEXT PRIMARY KEY, attempt INTEGER NOT NULL DEFAULT 0, owner TEXT,
    lease_until REAL NOT NULL DEFAULT 0, state TEXT NOT NULL DEFAULT 'queued');
"""


def claim(db: Path, job_id: str, worker: str) -> int | None:
    """Atomic claim: the attempt counter is the fencing token (zero rows: not ours)."""
    now = time.time()
    with sqlite3.connect(db, isolation_level=None) as conn:
        row = conn.execute(
            "UPDATE jobs SET attempt = attempt + 1, owner = ?, lease_until = ?, state = 'running' "
            "WHERE job_id = ? AND state != 'succeeded' AND (owner IS NULL OR lease_until < ?) "
            "RETURNING attempt",
            (worker, now + LEASE_MS / 1000, job_id, now),
        ).fetchone()
    return int(row[0]) if row else None


def complete(db: Path, job_id: str, attempt: int) -> int:
    """Commit only if the attempt is still current; returns the rows changed."""
    with sqlite3.connect(db, isolation_level=None) as conn:
        cur = conn.execute(
            "UPDATE jobs SET state = 'succeeded', owner = NULL WHERE job_id = ? AND attempt = ?",
            (job_id, attempt),
        )
        return cur.rowcount


def report_bytes(worker: str, generation: int) -> bytes:
    text = f"Order 1234 shipping report, rendered by worker {worker} (generation {generation})"
    return text.encode() + b"\n"


def emit(worker: str, event: str, **fields: Any) -> None:
    print(json.dumps({"worker": worker, "event": event, **fields}), flush=True)


def _refused(worker: str, event: str, err: FencegateError) -> None:
    emit(
        worker,
        event,
        code=err.code,
        presented=err.fields.get("presented"),
        current=err.fields.get("current"),
    )


async def run(worker: str, db: Path, url: str) -> int:
    attempt = claim(db, JOB, worker)
    if attempt is None:
        emit(worker, "nothing_to_claim")
        return 0
    async with Scheduler(url) as sched:
        await sched.register(JOB, generation=attempt, lease_ms=LEASE_MS)
    emit(worker, "claimed", generation=attempt)
    result = {"report": OUTPUT, "worker": worker}
    completed = False
    try:
        async with FencedJob(url, JOB, attempt, worker_id=worker, heartbeat_interval=0.3) as job:
            last = await job.load_checkpoint("progress")
            if last is not None:
                emit(worker, "resumed", from_generation=last.generation, stage=last.value["stage"])
            emit(worker, "rendering")
            up = await job.put_output(
                OUTPUT, report_bytes(worker, attempt), content_type="text/plain"
            )
            emit(worker, "output_staged", generation=up.generation, sha256=up.sha256[:12])
            await job.checkpoint("progress", {"stage": "rendered", "output": OUTPUT})
            emit(worker, "rendered")
            # Blocking on purpose: like a GC pause, it stalls the heartbeats too.
            time.sleep(0.6)  # noqa: ASYNC251
            email = {
                "to": ["customer@example.com"],
                "subject": "Shipped",
                "text": "Order 1234 is on its way.",
            }
            for step, adapter, op, payload in (
                ("notify", "email", "send", email),
                ("crm", "crm", "order.shipped", {"order": 1234}),
            ):
                emit(worker, "effect", step=step, generation=attempt)
                res = await job.effect(step, adapter=adapter, operation=op, payload=payload)
                emit(worker, "effect_ok", step=step, replayed=res.replayed, generation=attempt)
            done = await job.complete(result=result, outputs=[OUTPUT])
            completed = True
            emit(worker, "gateway_completed", generation=done.generation)
    except FencegateError as err:
        _refused(worker, "refused", err)
    if not completed:
        # the zombie still believes it owns the job: it tries to commit its result anyway
        async with FencedJob(url, JOB, attempt, worker_id=worker, heartbeat_interval=None) as job:
            try:
                await job.complete(result=result, outputs=[OUTPUT])
                emit(worker, "gateway_completed", generation=attempt)
            except FencegateError as err:
                _refused(worker, "gateway_completion_refused", err)
    rows = complete(db, JOB, attempt)
    emit(worker, "completed" if rows else "completion_rejected", rows=rows, generation=attempt)
    return 0
