"""The seed's acceptance sequence end to end with real outputs, through the SDK, against
the file store and a real S3-compatible server: A (gen 1) uploads its report and stalls;
B (gen 2) resumes, uploads and completes; A's completion is refused with zero effect;
the official report is B's; A's object is an orphan until the sweeper deletes it."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from yarl import URL

from gateway.client import FencedJob, JobCompleted, Scheduler, StaleGeneration
from gateway.fencing.outputs_sweep import sweep
from gateway.http.outputs import OUTPUTS
from gateway.store.keys import JobKeys
from tests.support.outputs import Objects, sha  # the outputs fixtures live there

JOB = "render-7"


def base(gw: Any) -> str:
    return str(gw.client.make_url("")).rstrip("/")


async def test_zombie_renders_and_completes_after_the_takeover_refused(
    ogw: Any,
    objects: Objects,
    redis_sync: Any,
    tmp_path: Path,
) -> None:
    url = base(ogw)
    a_report = b"A's report\n" * 100
    b_report = tmp_path / "b-report.pdf"
    b_report.write_bytes(b"B's report\n" * 200)
    async with Scheduler(url) as sched:
        a_gen = await sched.register(JOB, lease_ms=60_000)
        async with FencedJob(url, JOB, a_gen.token, worker_id="A", heartbeat_interval=None) as a:
            await a.checkpoint("progress", {"pages": 10})
            up = await a.put_output("report", a_report, content_type="application/pdf")
            assert (up.generation, up.size, up.sha256) == (1, len(a_report), sha(a_report))
            # A stalls past its lease; B takes over, resumes and finishes first
            b_gen = await sched.register(JOB, lease_ms=60_000)
            async with FencedJob(url, JOB, b_gen.token, worker_id="B") as b:
                resumed = await b.load_checkpoint("progress")
                assert resumed is not None and resumed.generation == 1
                up_b = await b.put_output("report", b_report, content_type="application/pdf")
                assert up_b.generation == 2
                done = await b.complete(result={"pages": 20}, outputs=["report"])
                assert done.outputs["report"]["key"] == f"default/{JOB}/g2/report"
            completed_before = redis_sync.hget(JobKeys("default", JOB).job, "completed")
            # A wakes up: its completion updates zero rows, its next upload never starts
            with pytest.raises(StaleGeneration) as exc:
                await a.complete(result={"pages": 10}, outputs=["report"])
            assert (exc.value.presented, exc.value.current) == (1, 2)
            with pytest.raises(JobCompleted):  # outputs: the completion is checked first
                await a.put_output("report", b"late", content_type="application/pdf")
        view = await sched.job(JOB)
    assert redis_sync.hget(JobKeys("default", JOB).job, "completed") == completed_before
    assert view["completion"]["generation"] == 2
    assert sorted((o["generation"], o["promoted"]) for o in view["outputs"]) == [
        (1, False),
        (2, True),
    ]
    official = await ogw.client.get(f"/v1/jobs/{JOB}/outputs/report")
    assert official.status == 200 and await official.read() == b_report.read_bytes()
    assert objects.read(f"default/{JOB}/g1/report") == a_report  # an orphan, not promoted
    audit = await ogw.audit(job=JOB)
    assert ("job:complete", "stale_generation", 1, 2, "A") in [
        (e["step"], e["reason"], e["presented"], e["current"], e["worker_id"]) for e in audit
    ]
    report = await sweep(ogw.app[OUTPUTS], grace_seconds=0)
    assert [o.key for o in report.deleted] == [f"default/{JOB}/g1/report"]
    assert set(objects.stored()) == {f"default/{JOB}/g2/report"}
    again = await ogw.client.get(f"/v1/jobs/{JOB}/outputs/report")
    assert await again.read() == b_report.read_bytes()


@pytest.mark.parametrize("objects", ["s3"], indirect=True)  # the file store signs no URLs
async def test_a_presigned_upload_is_recorded_and_promoted_by_the_completion(
    ogw: Any,
    objects: Objects,
) -> None:
    """The bytes bypass the gateway; the completion asks the store for the object, records
    it under the fence and promotes it, in that order."""
    resp = await ogw.register(JOB)
    gen = (await resp.json())["generation"]
    signed = await (
        await ogw.client.post(
            f"/v1/jobs/{JOB}/outputs/big/upload-url",
            json={"content_type": "text/csv"},
            headers={"Fencing-Token": str(gen)},
        )
    ).json()
    body = b"x,y\n" * 5000
    async with (
        aiohttp.ClientSession() as direct,
        direct.put(URL(signed["url"], encoded=True), data=body) as up,
    ):
        assert up.status == 200
    done = await ogw.client.post(
        f"/v1/jobs/{JOB}/complete",
        json={"outputs": ["big"], "result": None},
        headers={"Fencing-Token": str(gen)},
    )
    out = await done.json()
    assert done.status == 200, out
    assert (out["outputs"]["big"]["size"], out["outputs"]["big"]["sha256"]) == (
        len(body),
        sha(body),
    )
    read = await ogw.client.get(f"/v1/jobs/{JOB}/outputs/big")
    assert await read.read() == body
    entry = json.loads(
        await ogw.app[OUTPUTS].store.link.client.hget(JobKeys("default", JOB).outputs, "1/big")
    )
    assert entry["state"] == "recorded" and entry["presigned"] is True


@pytest.mark.parametrize("objects", ["file"], indirect=True)
async def test_sync_sdk_uploads_a_file_object_and_completes(
    ogw: Any, objects: Objects, tmp_path: Path
) -> None:
    from gateway.client import SyncFencedJob, SyncScheduler

    url = base(ogw)
    data = bytes(range(256)) * 4096  # 1 MiB, streamed from an open file
    path = tmp_path / "frames.bin"
    path.write_bytes(data)

    def worker() -> tuple[int, str, str]:
        with SyncScheduler(url) as sched:
            gen = sched.register(JOB)
            with (
                SyncFencedJob(url, JOB, gen.token, heartbeat_interval=None) as job,
                path.open("rb") as fh,
            ):
                up = job.put_output("frames", fh)
                done = job.complete(outputs=["frames"])
                return up.size, up.sha256, done.outputs["frames"]["sha256"]

    size, digest, promoted = await asyncio.to_thread(worker)
    assert (size, digest, promoted) == (len(data), sha(data), sha(data))
    assert objects.read(f"default/{JOB}/g1/frames") == data
