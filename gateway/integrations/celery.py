"""fencegate for Celery: a task base class whose every run allocates the job's next
generation, runs the body with a :class:`~gateway.client.SyncFencedJob`, and ends a
superseded run as ignored (``celery.exceptions.Ignore``): no retry, no result stored.

::

    class Fenced(FencedTask):
        fencegate_url = "http://127.0.0.1:8080"
        fencegate_api_key = CLAIM_KEY

    @app.task(base=Fenced, bind=True)
    def send_receipt(self, order_id):
        self.fenced.effect("receipt", adapter="email", operation="send", payload={...})
        return {"sent": True}  # the job's result: completed under the fence

The contract:

- **The job** is the task id (``apply_async(task_id=…)`` makes it a business key), or what
  :meth:`FencedTask.fencegate_job_id` answers for the task's arguments.
- **The generation** is allocated (fence + 1) at every run: Celery has no per-delivery
  counter (``request.retries`` counts only explicit retries; a redelivery after the
  broker's ``visibility_timeout`` or a lost worker has the same task id and count). The
  run that registers last holds the job; every earlier run is stale from then on.
- **A superseded run** (its heartbeat or a call answered ``stale_generation``,
  ``lease_expired``, ``unregistered_generation``) raises ``Ignore`` at its next fenced
  call: the task ends as ignored, stores no result over the newer run's and is not retried.
  A run that starts after the job completed (409 ``job_completed``) or was cancelled does
  nothing and is ignored too.
- **The result** is the body's return value (JSON), stored as the job's completion under
  the fence before Celery stores it; do not complete the job inside the body.

Limits: a thread cannot be cancelled, so a superseded body runs on until its next fenced
call (or :meth:`SyncFencedJob.check`, which the body may call between steps); only its
effects, checkpoints, outputs and completion are refused. Late acknowledgement
(``acks_late``) with the broker's ``visibility_timeout`` is what redelivers a stalled run's
task; a body longer than that timeout is run twice by Celery itself (the fence then keeps
its effects once).
"""

from __future__ import annotations

import os
import socket
from typing import Any, ClassVar

from celery import Task
from celery.exceptions import Ignore

from gateway.client import JobCancelled, JobCompleted, SyncFencedJob, SyncScheduler
from gateway.client.jobdata import SUPERSEDED

__all__ = ["FencedTask"]


class FencedTask(Task):
    """A Celery task base class that fences every run (set the two ``fencegate_*``)."""

    abstract = True
    fencegate_url: ClassVar[str] = "http://127.0.0.1:8080"
    fencegate_api_key: ClassVar[str | None] = None  # a worker key with claims = true
    fencegate_lease_ms: ClassVar[int | None] = None
    fencegate_heartbeat_seconds: ClassVar[float] = 5.0

    def fencegate_job_id(self, *args: Any, **kwargs: Any) -> str:
        """The job id of a run: the task id (override for a business key)."""
        return str(self.request.id)

    @property
    def fenced(self) -> SyncFencedJob:
        """This run's fenced job (inside the task body only)."""
        job = getattr(self.request, "fencegate", None)
        if not isinstance(job, SyncFencedJob):
            raise RuntimeError("the fenced job exists only while the task body runs")
        return job

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        job_id = self.fencegate_job_id(*args, **kwargs)
        with SyncScheduler(self.fencegate_url, api_key=self.fencegate_api_key) as claim:
            try:
                gen = claim.register(job_id, None, self.fencegate_lease_ms)
            except (JobCompleted, JobCancelled) as err:
                raise Ignore(f"fencegate: {job_id} {err.code}: nothing to do") from err
        job = SyncFencedJob(
            self.fencegate_url,
            job_id,
            gen.token,
            api_key=self.fencegate_api_key,
            worker_id=f"celery-{socket.gethostname()[:64]}-{os.getpid()}",
            heartbeat_interval=self.fencegate_heartbeat_seconds,
        )
        try:
            self.request.fencegate = job
            result = super().__call__(*args, **kwargs)
            job.complete(result=result)
            return result
        except SUPERSEDED as err:
            if isinstance(err, JobCompleted):
                raise  # completed by this run already: the body completed it itself
            raise Ignore(
                f"fencegate: {job_id} generation {gen.generation} superseded ({err.code})"
            ) from err
        finally:
            self.request.fencegate = None
            job.close()
