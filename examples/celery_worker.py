"""A Celery app whose one task sends an order's receipt through fencegate.

    export FENCEGATE_URL=http://127.0.0.1:8080 FENCEGATE_KEY=<a worker key with claims = true>
    export CELERY_REDIS_URL=redis://127.0.0.1:6379
    python examples/celery_worker.py worker --name w1   # one or more worker processes
    python examples/celery_worker.py enqueue order-1001 # the task id is the order
    python examples/celery_worker.py result order-1001  # Celery's state and result, as JSON

Late acknowledgement and the Redis broker's ``visibility_timeout``
(``CELERY_VISIBILITY_TIMEOUT``, seconds) are what hand a stalled run's task to another
worker; each run allocates the job's next generation (:mod:`gateway.integrations.celery`),
so the stalled run, when it wakes, is refused and ends as ignored: the customer gets one
receipt, and the job's result is the newer run's. The receipt goes to the adapter
``FENCEGATE_ADAPTER`` (default ``hook``, a webhook) under the key ``<order>:receipt``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

from celery import Celery
from celery.result import AsyncResult

from gateway.integrations.celery import FencedTask

REDIS = os.environ.get("CELERY_REDIS_URL", "redis://127.0.0.1:6379")
app = Celery("receipts", broker=REDIS, backend=REDIS)
app.conf.update(
    task_acks_late=True,  # a task is acknowledged when it ends: a stalled run is redelivered
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    broker_transport_options={
        "visibility_timeout": float(os.environ.get("CELERY_VISIBILITY_TIMEOUT", "3600")),
        # how often a worker looks for unacknowledged tasks past the visibility timeout
        "unacked_restore_interval": 0.5,
        "unacked_restore_throttle": 1,
    },
    result_expires=3600,
)


class Fenced(FencedTask):
    fencegate_url = os.environ.get("FENCEGATE_URL", "http://127.0.0.1:8080")
    fencegate_api_key = os.environ.get("FENCEGATE_KEY")
    fencegate_heartbeat_seconds = float(os.environ.get("FENCEGATE_HEARTBEAT_SECONDS", "5"))


@app.task(base=Fenced, bind=True, name="send_receipt")
def send_receipt(self: Fenced, order_id: str, work_seconds: float = 0.0) -> dict[str, Any]:
    """Prepare the receipt (``work_seconds`` of it), then send it once."""
    time.sleep(work_seconds)  # rendering, lookups: the time a stall can fall into
    sent = self.fenced.effect(
        "receipt",
        adapter=os.environ.get("FENCEGATE_ADAPTER", "hook"),
        operation="order.receipt",
        payload={"order": order_id, "text": f"Thank you for order {order_id}"},
    )
    return {"order": order_id, "worker": self.request.hostname, "replayed": sent.replayed}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("worker").add_argument("--name", default="w1")
    enq = sub.add_parser("enqueue")
    enq.add_argument("order_id")
    enq.add_argument("--work-seconds", type=float, default=0.0)
    sub.add_parser("result").add_argument("order_id")
    args = parser.parse_args()
    if args.command == "worker":
        # the solo pool runs the task in the worker process itself (one at a time)
        app.worker_main(
            ["worker", "--pool=solo", "--loglevel=INFO", "--without-gossip",
             "--without-mingle", "--without-heartbeat", "-n", f"{args.name}@%h"]
        )  # fmt: skip
    elif args.command == "enqueue":
        send_receipt.apply_async((args.order_id, args.work_seconds), task_id=args.order_id)
    else:
        res = AsyncResult(args.order_id, app=app)
        out = {"state": res.state, "result": res.result if res.successful() else None}
        print(json.dumps(out))


if __name__ == "__main__":
    main()
