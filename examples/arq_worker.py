"""An arq app whose one task sends an order's receipt through fencegate.

    export FENCEGATE_URL=http://127.0.0.1:8080 FENCEGATE_KEY=<a worker key with claims = true>
    export ARQ_REDIS_URL=redis://127.0.0.1:6379
    python examples/arq_worker.py worker              # one or more worker processes
    python examples/arq_worker.py enqueue order-1001  # the job id is the order
    python examples/arq_worker.py result order-1001   # arq's status and result, as JSON

Each try of ``send_receipt`` registers arq's ``job_try`` as the job's generation
(:mod:`gateway.integrations.arq`), so a try that stalled past arq's in-progress timeout
(``job_timeout + 10`` s) while another worker re-ran the job is refused when it wakes: the
customer gets one receipt, and the job's result is the newer try's. The receipt goes to the
adapter ``FENCEGATE_ADAPTER`` (default ``hook``, a webhook) under the key
``<order>:receipt``, the same for every try.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from typing import Any, ClassVar

from arq import create_pool
from arq.connections import RedisSettings
from arq.jobs import Job
from arq.worker import func

from gateway.integrations.arq import ArqFencing, run_worker

LEASE_MS = os.environ.get("FENCEGATE_LEASE_MS")  # each generation's lease; heartbeats renew it

fencing = ArqFencing(
    os.environ.get("FENCEGATE_URL", "http://127.0.0.1:8080"),
    api_key=os.environ.get("FENCEGATE_KEY"),
    heartbeat_interval=float(os.environ.get("FENCEGATE_HEARTBEAT_SECONDS", "5")),
    lease_ms=int(LEASE_MS) if LEASE_MS else None,  # unset: fencegate's default lease
)


@fencing.task
async def send_receipt(ctx: dict[str, Any], order_id: str, work_seconds: float = 0.0) -> Any:
    """Prepare the receipt (``work_seconds`` of it), then send it once."""
    job = ctx["fencegate"]
    await asyncio.sleep(work_seconds)  # rendering, lookups: the time a stall can fall into
    sent = await job.effect(
        "receipt",
        adapter=os.environ.get("FENCEGATE_ADAPTER", "hook"),
        operation="order.receipt",
        payload={"order": order_id, "text": f"Thank you for order {order_id}"},
    )
    return {"order": order_id, "sent_by_try": ctx["job_try"], "replayed": sent.replayed}


def redis_settings() -> RedisSettings:
    return RedisSettings.from_dsn(os.environ.get("ARQ_REDIS_URL", "redis://127.0.0.1:6379"))


class WorkerSettings:
    functions: ClassVar = [
        func(send_receipt, timeout=float(os.environ.get("ARQ_JOB_TIMEOUT", "60")))
    ]
    redis_settings = redis_settings()
    poll_delay = 0.2


async def enqueue(order_id: str, work_seconds: float) -> None:
    pool = await create_pool(redis_settings())
    await pool.enqueue_job("send_receipt", order_id, work_seconds, _job_id=order_id)
    await pool.aclose()


async def result(order_id: str) -> dict[str, Any]:
    """What arq holds for the job: its status and, once finished, its result record."""
    pool = await create_pool(redis_settings())
    job = Job(order_id, pool)
    status, info = await job.status(), await job.result_info()
    await pool.aclose()
    if info is None:
        return {"status": status.value}
    return {
        "status": status.value,
        "job_try": info.job_try,
        "success": info.success,
        "result": info.result if info.success else repr(info.result),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("worker")
    enq = sub.add_parser("enqueue")
    enq.add_argument("order_id")
    enq.add_argument("--work-seconds", type=float, default=0.0)
    sub.add_parser("result").add_argument("order_id")
    args = parser.parse_args()
    if args.command == "worker":
        run_worker(WorkerSettings)
    elif args.command == "enqueue":
        asyncio.run(enqueue(args.order_id, args.work_seconds))
    else:
        print(json.dumps(asyncio.run(result(args.order_id))))


if __name__ == "__main__":
    main()
