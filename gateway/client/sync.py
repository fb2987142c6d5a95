"""Blocking wrappers of the SDK for code without an event loop: one loop on a private thread."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

from gateway.client.api import FencedJob, Generation, Scheduler
from gateway.client.jobdata import CheckpointValue, Completion, OutputData, OutputUploaded
from gateway.client.proxying import FencedStep, fenced_step
from gateway.core.errors import (
    FencegateError,
)
from gateway.core.records import EffectResult

__all__ = ["SyncFencedJob", "SyncScheduler"]

T = TypeVar("T")


class _LoopThread:
    """A private event loop in a daemon thread, for the synchronous wrappers."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="fencegate-sdk", daemon=True
        )
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        self.loop.close()


class SyncScheduler:
    """:class:`Scheduler` for code without an event loop."""

    def __init__(self, base_url: str, **kwargs: Any) -> None:
        self._loop = _LoopThread()
        self._sched = Scheduler(base_url, **kwargs)

    def register(
        self, job_id: str, generation: int | None = None, lease_ms: int | None = None
    ) -> Generation:
        return self._loop.run(self._sched.register(job_id, generation, lease_ms))

    def cancel(self, job_id: str) -> dict[str, Any]:
        return self._loop.run(self._sched.cancel(job_id))

    def job(self, job_id: str) -> dict[str, Any]:
        return self._loop.run(self._sched.job(job_id))

    def close(self) -> None:
        self._loop.run(self._sched.aclose())
        self._loop.close()

    def __enter__(self) -> SyncScheduler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SyncFencedJob:
    """:class:`FencedJob` for code without an event loop.

    Heartbeats run in a background thread. A thread cannot be cancelled, so a
    superseded job is reported instead: :attr:`superseded` is set, every later
    :meth:`effect` raises, and :meth:`check` raises — call it between steps.
    """

    def __init__(self, base_url: str, job_id: str, token: str | int, **kwargs: Any) -> None:
        self._loop = _LoopThread()
        self._job = FencedJob(base_url, job_id, token, **kwargs)
        self._loop.run(self._start())

    async def _start(self) -> None:
        self._job.start_heartbeats()

    @property
    def superseded(self) -> FencegateError | None:
        return self._job.superseded

    @property
    def job_id(self) -> str:
        return self._job.job_id

    @property
    def token(self) -> str:
        return self._job.token

    @property
    def worker_id(self) -> str | None:
        return self._job.worker_id

    @contextmanager
    def step(self, name: str) -> Iterator[FencedStep]:
        """Inside the block, a proxied call made through one of the SDK's transports
        (:mod:`gateway.client.proxying`) is step ``name`` of this job."""
        with fenced_step(self, name) as current:
            yield current

    def check(self) -> None:
        if self._job.superseded is not None:
            raise self._job.superseded

    def effect(
        self, step: str, *, adapter: str, operation: str, payload: Mapping[str, Any]
    ) -> EffectResult:
        self.check()
        return self._loop.run(
            self._job.effect(step, adapter=adapter, operation=operation, payload=payload)
        )

    def heartbeat(self) -> dict[str, Any]:
        return self._loop.run(self._job.heartbeat())

    def checkpoint(self, name: str, value: Any) -> CheckpointValue:
        self.check()
        return self._loop.run(self._job.checkpoint(name, value))

    def load_checkpoint(self, name: str) -> CheckpointValue | None:
        return self._loop.run(self._job.load_checkpoint(name))

    def put_output(
        self, name: str, data: OutputData, *, content_type: str = "application/octet-stream"
    ) -> OutputUploaded:
        self.check()
        return self._loop.run(self._job.put_output(name, data, content_type=content_type))

    def complete(self, *, result: Any = None, outputs: Sequence[str] = ()) -> Completion:
        self.check()
        return self._loop.run(self._job.complete(result=result, outputs=outputs))

    def close(self) -> None:
        async def stop() -> None:
            await self._job.__aexit__(None, None, None)

        self._loop.run(stop())
        self._loop.close()

    def __enter__(self) -> SyncFencedJob:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
