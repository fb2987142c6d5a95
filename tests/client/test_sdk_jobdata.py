"""The SDK's checkpoints and completion against the real gateway: typed errors, the
zombie's completion raising StaleGeneration, heartbeats that end with the job."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from gateway.client import (
    FencedJob,
    JobCompleted,
    OutputNotStaged,
    Scheduler,
    StaleGeneration,
    SyncFencedJob,
    SyncScheduler,
)
from gateway.store.keys import JobKeys
from tests.conftest import Gateway
from tests.support.calls import record_output


def base(gw: Gateway) -> str:
    return str(gw.client.make_url("")).rstrip("/")


async def test_resume_from_the_previous_generations_checkpoint_and_complete(
    gw: Gateway, redis_sync: Any
) -> None:
    url = base(gw)
    async with Scheduler(url) as sched:
        a_gen = await sched.register("r", lease_ms=60_000)
        async with FencedJob(url, "r", a_gen.token, worker_id="A", heartbeat_interval=None) as a:
            assert await a.load_checkpoint("progress") is None
            saved = await a.checkpoint("progress", {"page": 3, "n": 2**64 + 1})
            assert (saved.generation, saved.worker_id) == (1, "A")
            b_gen = await sched.register("r", lease_ms=60_000)
            async with FencedJob(url, "r", b_gen.token, worker_id="B") as b:
                resumed = await b.load_checkpoint("progress")
                assert resumed is not None and resumed.generation == 1
                assert resumed.value == {"page": 3, "n": 2**64 + 1}
                record_output(redis_sync, 2, "report.pdf", b"B")
                done = await b.complete(result={"pages": 9}, outputs=["report.pdf"])
                assert (done.generation, done.replayed) == (2, False)
                assert done.outputs["report.pdf"]["key"] == "default/r/g2/report.pdf"
                assert b.completion == done
                again = await b.complete(result={"pages": 9}, outputs=["report.pdf"])
                assert again.replayed is True
                with pytest.raises(JobCompleted):
                    await b.checkpoint("progress", {"page": 10})
            # the zombie: the same typed error as for an effect, nothing changed
            with pytest.raises(StaleGeneration) as exc:
                await a.complete(result={"pages": 3})
            assert (exc.value.presented, exc.value.current) == (1, 2)
            assert isinstance(a.superseded, StaleGeneration)
            with pytest.raises(StaleGeneration):
                await a.checkpoint("progress", {"page": 4})
        view = await sched.job("r")
    assert view["completion"]["generation"] == 2
    stored = json.loads(redis_sync.hget(JobKeys("default", "r").job, "completed"))
    assert stored["result"] == {"pages": 9}


async def test_completing_stops_the_heartbeat_without_cancelling_the_work(gw: Gateway) -> None:
    url = base(gw)
    async with Scheduler(url) as sched:
        gen = await sched.register("r", lease_ms=60_000)
    async with FencedJob(url, "r", gen.token, heartbeat_interval=0.05) as job:
        with pytest.raises(OutputNotStaged) as exc:
            await job.complete(result=1, outputs=["x"])
        assert exc.value.missing == ["x"] and job.superseded is None
        await job.complete(result=1)
        await asyncio.sleep(0.3)  # several beats' worth: none of them may cancel this task
        assert job.superseded is None
        with pytest.raises(JobCompleted):
            await job.complete(result=2)  # another body after the completion


async def test_sync_wrappers_checkpoint_and_complete(gw: Gateway) -> None:
    url = base(gw)

    def worker() -> tuple[Any, int, str]:
        with SyncScheduler(url) as sched:
            gen = sched.register("r", lease_ms=60_000)
            with SyncFencedJob(url, "r", gen.token, heartbeat_interval=None) as job:
                job.checkpoint("c", [1, 2])
                loaded = job.load_checkpoint("c")
                assert loaded is not None
                done = job.complete(result="ok")
                try:
                    job.checkpoint("c", [3])
                except JobCompleted as err:
                    return loaded.value, done.generation, err.code
        return None, 0, "not refused"

    assert await asyncio.to_thread(worker) == ([1, 2], 1, "job_completed")
