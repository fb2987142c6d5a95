"""A Procrastinate app whose one task sends an order's receipt through fencegate.

    export FENCEGATE_URL=http://127.0.0.1:8080 FENCEGATE_KEY=<a worker key with claims = true>
    export PROCRASTINATE_DSN=postgresql://…
    python examples/procrastinate_worker.py schema              # once: Procrastinate's tables
    python examples/procrastinate_worker.py worker --name w1    # one or more worker processes
    python -m procrastinate --app examples.procrastinate_worker.app worker   # or Procrastinate's
    python examples/procrastinate_worker.py defer order-1001    # prints the job's id
    python examples/procrastinate_worker.py status 1            # the job's row and events, JSON

Each attempt of ``send_receipt`` registers ``attempts + 1`` as the generation of the job
``procrastinate-<id>`` (:mod:`gateway.integrations.procrastinate`). Stalled jobs are retried
the way Procrastinate documents it: a periodic task (``retry_stalled_jobs``,
``PROCRASTINATE_STALLED_CRON``, default every minute) retries the jobs of workers whose
heartbeat (every ``PROCRASTINATE_HEARTBEAT_SECONDS``) is older than
``PROCRASTINATE_STALLED_SECONDS``. An attempt that stalled that long while another worker
re-ran the job is refused when it wakes: the customer gets one receipt, the job's result is
the newer attempt's, and the stalled attempt's finish changes nothing in Procrastinate's
table. The receipt goes to the adapter ``FENCEGATE_ADAPTER`` (default ``hook``, a webhook)
under the key ``procrastinate-<id>:receipt``, the same for every attempt.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
from typing import Any

import procrastinate

from gateway.integrations.procrastinate import ProcrastinateFencing, fenced_job

STALLED_SECONDS = float(os.environ.get("PROCRASTINATE_STALLED_SECONDS", "30"))

fencing = ProcrastinateFencing(
    os.environ.get("FENCEGATE_URL", "http://127.0.0.1:8080"),
    api_key=os.environ.get("FENCEGATE_KEY"),
    heartbeat_interval=float(os.environ.get("FENCEGATE_HEARTBEAT_SECONDS", "5")),
)
app = fencing.install(
    procrastinate.App(
        connector=procrastinate.PsycopgConnector(
            conninfo=os.environ.get("PROCRASTINATE_DSN", "postgresql:///procrastinate")
        ),
        # for this file's worker command and Procrastinate's own CLI alike
        worker_defaults={
            "update_heartbeat_interval": float(
                os.environ.get("PROCRASTINATE_HEARTBEAT_SECONDS", "10")
            ),
            "fetch_job_polling_interval": 1.0,
        },
    )
)


@app.task(name="send_receipt", pass_context=True, task_middleware=[fencing])
async def send_receipt(
    context: procrastinate.JobContext, order_id: str, work_seconds: float = 0.0
) -> dict[str, Any]:
    """Prepare the receipt (``work_seconds`` of it), then send it once."""
    job = fenced_job(context)
    await asyncio.sleep(work_seconds)  # rendering, lookups: the time a stall can fall into
    sent = await job.effect(
        "receipt",
        adapter=os.environ.get("FENCEGATE_ADAPTER", "hook"),
        operation="order.receipt",
        payload={"order": order_id, "text": f"Thank you for order {order_id}"},
    )
    return {
        "order": order_id,
        "sent_by_attempt": context.job.attempts + 1,
        "worker": context.worker_name,
        "replayed": sent.replayed,
    }


@app.periodic(cron=os.environ.get("PROCRASTINATE_STALLED_CRON", "* * * * *"))
@app.task(name="retry_stalled_jobs", queueing_lock="retry_stalled_jobs", pass_context=True)
async def retry_stalled_jobs(context: procrastinate.JobContext, timestamp: int) -> None:
    """Procrastinate's documented recovery: retry the jobs of workers that stopped beating."""
    stalled = await app.job_manager.get_stalled_jobs(seconds_since_heartbeat=STALLED_SECONDS)
    for job in stalled:
        await app.job_manager.retry_job(job)


async def status(job_id: int) -> dict[str, Any]:
    async with app.open_async():
        rows = await app.connector.execute_query_all_async(
            "SELECT j.status, j.attempts, j.worker_id, "
            "array_agg(e.type::text ORDER BY e.id) AS events FROM procrastinate_jobs j "
            "JOIN procrastinate_events e ON e.job_id = j.id WHERE j.id = %(id)s GROUP BY j.id",
            id=job_id,
        )
    return dict(rows[0]) if rows else {}


async def defer(order_id: str, work_seconds: float) -> int:
    async with app.open_async():
        return await send_receipt.defer_async(order_id=order_id, work_seconds=work_seconds)


async def schema() -> None:
    async with app.open_async():
        await app.schema_manager.apply_schema_async()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("schema")
    sub.add_parser("worker").add_argument("--name", default="w1")
    enq = sub.add_parser("defer")
    enq.add_argument("order_id")
    enq.add_argument("--work-seconds", type=float, default=0.0)
    sub.add_parser("status").add_argument("job_id", type=int)
    args = parser.parse_args()
    if args.command == "worker":
        logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
        app.run_worker(name=args.name)
    elif args.command == "schema":
        asyncio.run(schema())
    elif args.command == "defer":
        print(asyncio.run(defer(args.order_id, args.work_seconds)))
    else:
        print(json.dumps(asyncio.run(status(args.job_id))))


if __name__ == "__main__":
    main()
