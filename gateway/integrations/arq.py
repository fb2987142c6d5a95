"""fencegate for arq: each try of a job registers its generation, runs inside a
:class:`~gateway.client.FencedJob`, and a superseded try changes nothing — neither downstream
nor in arq's own bookkeeping.

::

    fencing = ArqFencing("http://127.0.0.1:8080", api_key=CLAIM_KEY)

    @fencing.task
    async def send_receipt(ctx, order_id):
        job = ctx["fencegate"]  # the FencedJob of this try
        await job.effect("email", adapter="hook", operation="receipt", payload={...})
        return {"sent": True}  # the job's result: completed under the fence

    class WorkerSettings:
        functions = [send_receipt]

    run_worker(WorkerSettings)  # or: python -m gateway.integrations.arq module.WorkerSettings

The contract:

- **The job** is arq's job id (``ctx["job_id"]``), or ``job_id(ctx, *args, **kwargs)``.
- **The generation** is arq's ``job_try`` (an ``INCR`` at every start of the job) while it
  holds: arq keeps that counter for 88,400 s after the last try, so for a job enqueued less
  than :data:`JOB_TRY_HOLDS_SECONDS` ago it cannot have restarted at 1. Older jobs, or
  ``generation="allocate"``, take fence + 1 from fencegate. The key must be a worker key
  with ``claims = true``.
- **A try whose generation is not the newest** (409 ``generation_regression`` at its
  registration, ``stale_generation`` on a heartbeat or call, ``lease_expired``) is
  superseded: its body is cancelled at its next ``await``, its effects are refused, it
  raises the fencegate error, and :class:`FencedWorker` records nothing for it in arq (no
  result over the newer try's, no in-progress key of the newer try deleted, no re-queue).
  arq's own timeout cancelling a resumed try is checked the same way (one heartbeat).
- **A job that already completed** (409 ``job_completed`` at registration: a copy that
  starts after the result stands) runs nothing; :class:`FencedWorker` removes it from the
  queue without writing a result over the one arq may still hold.
- **A cancelled job** raises :class:`~gateway.client.JobCancelled`: arq records it as failed
  and does not retry it.
- **The result** is the body's return value (JSON), stored as the job's completion under the
  fence; a body that completed through ``ctx["fencegate"]`` itself is not completed again.

Limits: a body that blocks the event loop, or ignores cancellation, keeps running; only its
effects, checkpoints, outputs and completion are refused. Tasks wrapped here must run in a
:class:`FencedWorker` (a plain ``arq.worker.Worker`` would record a superseded try's
outcome over the newer try's): they refuse to run in any other worker.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import logging.config
import os
import socket
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal, TypeVar

from arq.logs import default_log_config
from arq.worker import Worker, get_kwargs

from gateway.client import (
    FencedJob,
    FencegateError,
    JobCompleted,
    Scheduler,
)
from gateway.client.jobdata import SUPERSEDED
from gateway.core.errors import GenerationRegression

__all__ = ["JOB_TRY_HOLDS_SECONDS", "ArqFencing", "FencedWorker", "NotInFencedWorker", "run_worker"]

log = logging.getLogger(__name__)

# arq expires its try counter (arq:retry:<id>) 88,400 s after a try's INCR; a job enqueued
# less than a day ago has had no such gap, so its job_try only ever rose
JOB_TRY_HOLDS_SECONDS = 86_400

R = TypeVar("R")
Task = Callable[..., Awaitable[Any]]


class NotInFencedWorker(RuntimeError):
    """A fenced task ran in a worker that is not a :class:`FencedWorker`."""


@dataclass
class _Run:
    """One run of one job in a :class:`FencedWorker` (the task's own context)."""

    superseded: FencegateError | None = None
    completed_before: bool = False  # the job's result stood before this try started


_RUN: contextvars.ContextVar[_Run] = contextvars.ContextVar("fencegate_arq_run")


class FencedWorker(Worker):
    """An arq worker whose superseded tries leave arq's records of the job alone: the newer
    try owns the result key, the in-progress key and the queue entry."""

    async def run_job(self, job_id: str, score: int) -> None:
        # each run_job is its own task: the run's state is visible to the task arq starts for
        # the body and to finish_job, and to no other job
        _RUN.set(_Run())
        await super().run_job(job_id, score)

    async def finish_job(
        self,
        job_id: str,
        finish: bool,
        result_data: bytes | None,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        run = _RUN.get(None)
        if run is not None and run.superseded is not None:
            return
        if run is not None and run.completed_before:
            result_data = None  # the job is over: no result of this try over the one that stands
        await super().finish_job(job_id, finish, result_data, *args, **kwargs)


def run_worker(settings_cls: Any, *, verbose: bool = False, **kwargs: Any) -> FencedWorker:
    """Run a :class:`FencedWorker` from an arq ``WorkerSettings`` class, logging as the
    ``arq`` command does (this module's lines with arq's)."""
    config = default_log_config(verbose)
    config["loggers"][__name__] = {"handlers": ["arq.standard"], "level": "INFO"}
    logging.config.dictConfig(config)
    worker = FencedWorker(**{**get_kwargs(settings_cls), **kwargs})
    worker.run()
    return worker


def _worker_id() -> str:
    return f"arq-{socket.gethostname()[:64]}-{os.getpid()}"


class ArqFencing:
    """The gateway, key and policy shared by the fenced tasks of one arq app."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        generation: Literal["job_try", "allocate"] = "job_try",
        lease_ms: int | None = None,
        heartbeat_interval: float = 5.0,
        job_id: Callable[..., str] | None = None,
        timeout: float = 30.0,
    ) -> None:
        self.base_url = base_url
        self.api_key = api_key
        self.generation = generation
        self.lease_ms = lease_ms
        self.heartbeat_interval = heartbeat_interval
        self.job_id = job_id
        self.timeout = timeout

    def task(self, func: Callable[..., Awaitable[R]]) -> Callable[..., Awaitable[R | None]]:
        """Wrap an arq task function (``async def f(ctx, *args, **kwargs)``)."""

        @functools.wraps(func)
        async def fenced(ctx: dict[str, Any], *args: Any, **kwargs: Any) -> R | None:
            run = _RUN.get(None)
            if run is None:
                raise NotInFencedWorker(
                    "fenced arq tasks run in gateway.integrations.arq.FencedWorker "
                    "(run_worker(WorkerSettings) or python -m gateway.integrations.arq)"
                )
            job_id = self.job_id(ctx, *args, **kwargs) if self.job_id else str(ctx["job_id"])
            token = await self._claim(run, ctx, job_id)
            if token is None:
                return None  # the job completed before this try: its result stands
            return await self._run(run, ctx, job_id, token, func, args, kwargs)

        return fenced

    def _generation(self, ctx: dict[str, Any]) -> int | None:
        if self.generation == "allocate":
            return None
        enqueued = ctx.get("enqueue_time")
        if not isinstance(enqueued, datetime):
            return None
        age = (datetime.now(UTC) - enqueued.astimezone(UTC)).total_seconds()
        return int(ctx["job_try"]) if age < JOB_TRY_HOLDS_SECONDS else None

    async def _claim(self, run: _Run, ctx: dict[str, Any], job_id: str) -> str | None:
        async with Scheduler(self.base_url, api_key=self.api_key, timeout=self.timeout) as claim:
            try:
                gen = await claim.register(job_id, self._generation(ctx), self.lease_ms)
            except JobCompleted:
                run.completed_before = True
                return None
            except GenerationRegression as err:
                run.superseded = err  # a newer try registered: this one is the zombie
                raise
        return gen.token

    async def _run(
        self,
        run: _Run,
        ctx: dict[str, Any],
        job_id: str,
        token: str,
        func: Callable[..., Awaitable[R]],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> R:
        try:
            async with FencedJob(
                self.base_url,
                job_id,
                token,
                api_key=self.api_key,
                worker_id=_worker_id(),
                heartbeat_interval=self.heartbeat_interval,
                timeout=self.timeout,
            ) as job:
                ctx["fencegate"] = job
                try:
                    result = await func(ctx, *args, **kwargs)
                except asyncio.CancelledError:
                    # arq's timeout or shutdown, or the heartbeat's supersession (which may
                    # also cancel this check): ask once
                    try:
                        await self._still_current(job)
                    finally:
                        run.superseded = job.superseded
                    raise
                if job.completion is None:
                    await job.complete(result=result)
                return result
        except SUPERSEDED as err:
            if not isinstance(err, JobCompleted):
                run.superseded = err
            raise
        finally:
            if run.superseded is not None:
                log.warning(
                    "fencegate: job %s try %s superseded (%s): nothing recorded in arq",
                    job_id,
                    ctx.get("job_try"),
                    run.superseded.code,
                )

    async def _still_current(self, job: FencedJob) -> None:
        if job.superseded is not None:
            return
        try:
            await asyncio.wait_for(job.heartbeat(), self.timeout)
        except SUPERSEDED as err:
            if not isinstance(err, JobCompleted):
                job.superseded = err
        except (FencegateError, TimeoutError):
            pass  # unknown: arq's own outcome stands


def main(argv: list[str] | None = None) -> None:
    """``python -m gateway.integrations.arq module.WorkerSettings``: arq's worker, fenced."""
    import importlib

    # run as ``-m`` this module is __main__; the app's tasks import gateway.integrations.arq,
    # whose FencedWorker and run state they look for: run that module's worker, not ours
    fenced = importlib.import_module("gateway.integrations.arq")
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        raise SystemExit("usage: python -m gateway.integrations.arq module.WorkerSettings")
    module, _, name = argv[0].rpartition(".")
    sys.path.insert(0, os.getcwd())  # as the arq command finds the settings' module
    fenced.run_worker(getattr(importlib.import_module(module), name))


if __name__ == "__main__":
    main()
