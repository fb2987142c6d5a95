"""fencegate for Procrastinate (PostgreSQL, ``FOR UPDATE SKIP LOCKED``): a task middleware
that registers each attempt of a job as its generation, runs the task inside a
:class:`~gateway.client.FencedJob`, and a job manager whose finish and retry of a job apply
only while the row is still the attempt that was fetched.

::

    fencing = ProcrastinateFencing("http://127.0.0.1:8080", api_key=CLAIM_KEY)
    app = fencing.install(procrastinate.App(connector=procrastinate.PsycopgConnector()))

    @app.task(pass_context=True, task_middleware=[fencing])
    async def send_receipt(context, order_id):
        job = fenced_job(context)  # this attempt's FencedJob
        await job.effect("receipt", adapter="email", operation="send", payload={...})
        return {"sent": True}  # the job's result: completed under the fence

The contract:

- **The job** is Procrastinate's job id (``procrastinate-<id>``: the row, the same for every
  attempt), or its ``lock`` / ``queueing_lock`` (``job_id="lock"``), or what
  ``job_id(context)`` answers. It must match fencegate's id pattern.
- **The generation** is ``attempts + 1``: Procrastinate's ``attempts`` counts the tries that
  ended (``finish_job`` and ``retry_job`` add one as the row leaves ``doing``), so the
  first run sees 0, and every fetch of the row sees a value above every earlier fetch's.
  With a job id that is not the row (a lock shared by several rows, each counting from 0)
  the generation is allocated instead (fence + 1), as ``generation="allocate"`` does. The
  key must be a worker key with ``claims = true``.
- **A superseded attempt** (409 ``generation_regression`` at its registration: a newer
  attempt registered first; ``stale_generation``, ``lease_expired``,
  ``unregistered_generation`` or ``job_cancelled`` on a heartbeat or a call) is cancelled
  at its next ``await``, its effects are refused, and it raises
  :class:`procrastinate.exceptions.JobAborted`, which Procrastinate does not retry.
- **Procrastinate's bookkeeping is fenced by the attempt**: :class:`FencedJobManager`
  (``install``) finishes or retries a job only while its row still holds the ``attempts``
  the worker fetched, in one statement that locks the row and then calls Procrastinate's
  own SQL. A resumed zombie's finish or retry finds the row moved on and changes nothing:
  no status over the newer attempt's, no retry of a job another worker holds.
- **A job that already completed** (409 ``job_completed`` at registration or on a call)
  runs nothing more and ends as succeeded: its result stands in fencegate.
- **The result** is the task's return value (JSON), completed under the fence before
  Procrastinate records the job as succeeded; a task that completed through
  ``fenced_job(context)`` itself is not completed again.

Limits: the middleware wraps async tasks only (Procrastinate refuses an async middleware on
a sync task). A body that blocks the event loop, catches the cancellation and goes on, or
never awaits again keeps running; only its effects, checkpoints, outputs and completion
are refused. Its own writes to the database are not fenced unless they carry the attempt.
Attach the middleware to the tasks it fences: as a worker-wide task middleware it fences
every async task, Procrastinate's built-in ones too.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
from collections.abc import Awaitable, Callable
from typing import Any, Literal

from procrastinate import App, JobContext, jobs, manager, sql, utils
from procrastinate.exceptions import JobAborted
from procrastinate.worker import Worker

from gateway.client import FencedJob, JobCancelled, JobCompleted, Scheduler
from gateway.client.jobdata import SUPERSEDED
from gateway.core.errors import GenerationRegression

__all__ = [
    "CONTEXT_KEY",
    "FencedJobManager",
    "NotFencedApp",
    "ProcrastinateFencing",
    "fenced_job",
]

log = logging.getLogger(__name__)

# where the attempt's FencedJob is, in the job context's additional_context
CONTEXT_KEY = "fencegate"


class NotFencedApp(RuntimeError):
    """A fenced task ran in an app whose job manager is not a :class:`FencedJobManager`."""


def _locked_to_attempt(query: str) -> str:
    """Procrastinate's ``SELECT procrastinate_…(%(job_id)s, …);`` run only on the row that
    still holds ``%(attempts)s``, locked first (one statement: one transaction)."""
    call = query.strip().rstrip(";")
    if not call.startswith("SELECT ") or " FROM " in call.upper():
        raise RuntimeError(f"unexpected Procrastinate query shape: {query!r}")
    return (
        "WITH mine AS MATERIALIZED (SELECT id FROM procrastinate_jobs "
        "WHERE id = %(job_id)s AND attempts = %(attempts)s FOR UPDATE) "
        f"SELECT mine.id, {call.removeprefix('SELECT ')} FROM mine"
    )


_FINISH = _locked_to_attempt(sql.queries["finish_job"])
_RETRY = _locked_to_attempt(sql.queries["retry_job"])


class FencedJobManager(manager.JobManager):
    """Procrastinate's job manager, whose :meth:`finish_job` and :meth:`retry_job` apply only
    while the job's row still holds the ``attempts`` of the :class:`~procrastinate.jobs.Job`
    they are given (the worker's fetch, or a listing such as ``get_stalled_jobs``). A row goes
    back to ``todo``, where it can be fetched again, only through Procrastinate's retry, which
    adds one to ``attempts``: a row that still holds the attempts has not been claimed since.
    Every other method is Procrastinate's own."""

    async def finish_job(self, job: jobs.Job, status: jobs.Status, delete_job: bool) -> None:
        assert job.id is not None
        rows = await self.connector.execute_query_all_async(
            query=_FINISH,
            job_id=job.id,
            attempts=job.attempts,
            status=status.value,
            delete_job=delete_job,
        )
        if not rows:
            log.warning(
                "fencegate: procrastinate job %s attempt %s moved on: not marked %s",
                job.id,
                job.attempts,
                status.value,
            )

    async def retry_job(
        self,
        job: jobs.Job,
        retry_at: datetime.datetime | None = None,
        priority: int | None = None,
        queue: str | None = None,
        lock: str | None = None,
    ) -> None:
        assert job.id is not None
        rows = await self.connector.execute_query_all_async(
            query=_RETRY,
            job_id=job.id,
            attempts=job.attempts,
            retry_at=retry_at or utils.utcnow(),
            new_priority=priority,
            new_queue_name=queue,
            new_lock=lock,
        )
        if not rows:
            log.warning(
                "fencegate: procrastinate job %s attempt %s moved on: not retried",
                job.id,
                job.attempts,
            )


def fenced_job(context: JobContext) -> FencedJob:
    """The running attempt's :class:`FencedJob` (inside a fenced task only)."""
    job = context.additional_context.get(CONTEXT_KEY)
    if not isinstance(job, FencedJob):
        raise RuntimeError(
            "no fenced job: the task needs pass_context=True and task_middleware=[fencing]"
        )
    return job


JobIdSource = Literal["id", "lock", "queueing_lock"]


class ProcrastinateFencing:
    """The gateway, key and policy of fenced Procrastinate tasks; the instance is their task
    middleware (``task_middleware=[fencing]``)."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        job_id: JobIdSource | Callable[[JobContext], str] = "id",
        generation: Literal["attempts", "allocate"] | None = None,
        lease_ms: int | None = None,
        heartbeat_interval: float = 5.0,
        timeout: float = 30.0,
    ) -> None:
        self.base_url = base_url
        self.api_key = api_key
        self.job_id = job_id
        # attempts count per row: they order the attempts of a job only when the job is the row
        self.generation = generation or ("attempts" if job_id == "id" else "allocate")
        self.lease_ms = lease_ms
        self.heartbeat_interval = heartbeat_interval
        self.timeout = timeout

    def install(self, app: App) -> App:
        """Fence the app's bookkeeping (its job manager becomes a :class:`FencedJobManager`);
        call it before the worker starts. Returns the app."""
        if not isinstance(app.job_manager, FencedJobManager):
            app.job_manager = FencedJobManager(connector=app.connector)
        return app

    def job_id_of(self, context: JobContext) -> str:
        """The fencegate job id of the context's job."""
        job = context.job
        if callable(self.job_id):
            return self.job_id(context)
        if self.job_id == "id":
            return f"procrastinate-{job.id}"
        key = job.lock if self.job_id == "lock" else job.queueing_lock
        if not key:
            raise ValueError(f"procrastinate job {job.id} has no {self.job_id} (the job id)")
        return key

    async def __call__(
        self,
        call_next: Callable[[], Awaitable[Any]],
        context: JobContext,
        worker: Worker,
    ) -> Any:
        if not isinstance(context.app.job_manager, FencedJobManager):
            raise NotFencedApp(
                "fenced Procrastinate tasks need a fenced job manager: fencing.install(app) "
                "before the worker starts"
            )
        job_id = self.job_id_of(context)
        attempt = f"procrastinate job {context.job.id} attempt {context.job.attempts}"
        generation = context.job.attempts + 1 if self.generation == "attempts" else None
        async with Scheduler(self.base_url, api_key=self.api_key, timeout=self.timeout) as fg:
            try:
                gen = await fg.register(job_id, generation, self.lease_ms)
            except JobCompleted:
                log.info("fencegate: %s: %s completed already, nothing to do", attempt, job_id)
                return None
            except (GenerationRegression, JobCancelled) as err:
                log.warning("fencegate: %s (%s): %s, not run", attempt, job_id, err.code)
                raise JobAborted(f"fencegate: {job_id} {err.code}") from err
        fenced = FencedJob(
            self.base_url,
            job_id,
            gen.token,
            api_key=self.api_key,
            worker_id=f"procrastinate-{socket.gethostname()[:64]}-{os.getpid()}",
            heartbeat_interval=self.heartbeat_interval,
            timeout=self.timeout,
        )
        try:
            async with fenced:
                context.additional_context[CONTEXT_KEY] = fenced
                result = await call_next()
                if fenced.completion is None:
                    await fenced.complete(result=result)
                return result
        except SUPERSEDED as err:
            if isinstance(err, JobCompleted):
                log.info("fencegate: %s: %s completed, stopped", attempt, job_id)
                return None
            log.warning(
                "fencegate: %s (%s) generation %s superseded (%s): stopped",
                attempt,
                job_id,
                gen.generation,
                err.code,
            )
            raise JobAborted(f"fencegate: {job_id} generation {gen.generation} {err.code}") from err
        finally:
            context.additional_context.pop(CONTEXT_KEY, None)
