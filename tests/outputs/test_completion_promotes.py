"""Outputs and the fenced completion together: the seed's acceptance sequence
with real objects, reads of the promoted output, and a gateway SIGKILLed between the
object write and its record. File store and a real S3 server (``objects``)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis

from gateway.fencing.outputs_sweep import sweep
from gateway.http import appkeys as K
from gateway.http.outputs import OUTPUTS
from gateway.store.embedded import free_port
from tests.support.outputs import JOB, Objects, metric, put, register, sha, write_config

A_BYTES = b"%PDF A's render, written before A stalled\n" * 500
B_BYTES = b"%PDF B's render, the official one\n" * 700


async def complete(gw: Any, token: int, outputs: list[str], result: Any = None) -> Any:
    return await gw.client.post(
        f"/v1/jobs/{JOB}/complete",
        json={"outputs": outputs, "result": result},
        headers={"Fencing-Token": str(token)},
    )


async def code(resp: Any) -> tuple[int, str]:
    return resp.status, (await resp.json()).get("code", "")


async def test_the_seed_sequence_with_outputs(ogw: Any, objects: Objects) -> None:
    """A (gen 1) stages `report` and stalls; B (gen 2) stages and completes; A completes
    → 409, zero effect; GET returns B's bytes; A's object is an orphan: counted, then swept
    after the grace; B's promoted object is never overwritten."""
    a = await register(ogw)
    assert (await put(ogw, a, A_BYTES, **{"Content-Type": "application/pdf"})).status == 201
    b = await register(ogw)  # A's lease ran out; the scheduler hands the job to B
    assert (await put(ogw, b, B_BYTES, **{"Content-Type": "application/pdf"})).status == 201
    done = await complete(ogw, b, ["report"], {"pages": 7})
    assert done.status == 200, await done.text()

    late = await complete(ogw, a, ["report"], {"pages": 3})  # A wakes up
    assert await code(late) == (409, "stale_generation")

    resp = await ogw.client.get(f"/v1/jobs/{JOB}/outputs/report")
    assert resp.status == 200
    assert await resp.read() == B_BYTES
    assert resp.headers["Fencegate-Generation"] == "2"
    assert resp.headers["ETag"] == f'"{sha(B_BYTES)}"'
    assert resp.headers["Content-Type"] == "application/pdf"

    # after the completion nobody writes an output any more: the promoted one stays
    for token in (a, b):
        assert await code(await put(ogw, token, b"overwrite?")) == (409, "job_completed")
    a_key, b_key = f"default/{JOB}/g1/report", f"default/{JOB}/g2/report"
    assert objects.stored() == {a_key: len(A_BYTES), b_key: len(B_BYTES)}

    service, metrics = ogw.app[OUTPUTS], ogw.app[K.METRICS]
    first = await sweep(service, grace_seconds=3600, metrics=metrics)
    assert [(o.key, o.reason, o.deletable) for o in first.orphans] == [(a_key, "completed", False)]
    assert first.kept == 1 and first.deleted == []
    assert await metric(ogw, 'fencegate_output_orphans{reason="completed"}') == 1
    assert await metric(ogw, 'fencegate_output_orphan_bytes{reason="completed"}') == len(A_BYTES)

    swept = await sweep(service, grace_seconds=0, metrics=metrics)
    assert [(o.key, o.reason) for o in swept.deleted] == [(a_key, "completed")]
    assert objects.stored() == {b_key: len(B_BYTES)}
    assert await metric(ogw, 'fencegate_output_orphans{reason="completed"}') == 0
    assert await metric(ogw, 'fencegate_output_orphans_deleted_total{reason="completed"}') == 1
    resp = await ogw.client.get(f"/v1/jobs/{JOB}/outputs/report")
    assert await resp.read() == B_BYTES


async def test_zombie_uploading_after_the_takeover_never_reaches_the_store(
    ogw: Any, objects: Objects
) -> None:
    a = await register(ogw)
    b = await register(ogw)
    assert (await put(ogw, b, B_BYTES)).status == 201
    refused = await put(ogw, a, A_BYTES)
    assert await code(refused) == (409, "stale_generation")
    assert not [k for k in objects.stored() if "/g1/" in k]
    assert await code(await complete(ogw, a, ["report"])) == (409, "stale_generation")
    assert (await complete(ogw, b, ["report"])).status == 200


async def test_promoted_object_replaced_behind_the_gateway_is_not_served(
    ogw: Any, objects: Objects
) -> None:
    gen = await register(ogw)
    assert (await put(ogw, gen, B_BYTES)).status == 201
    assert (await complete(ogw, gen, ["report"])).status == 200
    objects.write(f"default/{JOB}/g1/report", b"tampered")  # not through the gateway
    resp = await ogw.client.get(f"/v1/jobs/{JOB}/outputs/report")
    assert resp.status == 500
    assert "replaced" in (await resp.json())["detail"]


@pytest.mark.parametrize("objects", ["s3"], indirect=True)  # only S3 signs URLs
async def test_redirect_reads_to_a_signed_url(make_gateway: Any, objects: Objects) -> None:
    gw = await make_gateway(outputs={**objects.section, "redirect_reads": True})
    gen = await register(gw)
    assert (await put(gw, gen, B_BYTES)).status == 201
    assert (await complete(gw, gen, ["report"])).status == 200
    resp = await gw.client.get(f"/v1/jobs/{JOB}/outputs/report", allow_redirects=False)
    assert resp.status == 307
    async with aiohttp.ClientSession() as direct, direct.get(resp.headers["Location"]) as got:
        assert got.status == 200 and await got.read() == B_BYTES


@pytest.mark.parametrize("objects", ["s3"], indirect=True)  # the file store: 501, test_outputs
async def test_a_presigned_upload_is_recorded_by_the_completion(ogw: Any, objects: Objects) -> None:
    gen = await register(ogw)
    resp = await ogw.client.post(
        f"/v1/jobs/{JOB}/outputs/report/upload-url", headers={"Fencing-Token": str(gen)}
    )
    url = (await resp.json())["url"]
    assert await code(await complete(ogw, gen, ["report"])) == (422, "output_not_staged")
    async with aiohttp.ClientSession() as direct, direct.put(url, data=B_BYTES) as up:
        assert up.status == 200
    done = await complete(ogw, gen, ["report"])
    assert done.status == 200, await done.text()
    promoted = (await done.json())["outputs"]["report"]
    assert (promoted["size"], promoted["sha256"]) == (len(B_BYTES), sha(B_BYTES))
    resp = await ogw.client.get(f"/v1/jobs/{JOB}/outputs/report")
    assert await resp.read() == B_BYTES


def _serve(tmp_path: Path, redis_url: str, objects: Objects, crash_at: str) -> tuple[Any, str]:
    port = free_port()
    cfg = write_config(tmp_path, redis_url, objects)
    with (tmp_path / "killed.log").open("w") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", "serve", "--config", str(cfg), "--port",
             str(port), "--chaos-crash-at", crash_at],
            stdout=subprocess.DEVNULL, stderr=log, env=dict(os.environ),
        )  # fmt: skip
    return proc, f"http://127.0.0.1:{port}"


async def test_gateway_killed_between_write_and_record_never_promotes(
    ogw: Any, objects: Objects, redis_url: str, tmp_path: Path, redis_sync: redis.Redis
) -> None:
    gen = await register(ogw)
    proc, url = _serve(tmp_path, redis_url, objects, "after_output_write")
    try:
        async with aiohttp.ClientSession() as s:
            for _ in range(200):
                try:
                    async with s.get(url + "/healthz") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientError:
                    await asyncio.sleep(0.05)
            with pytest.raises(aiohttp.ClientError):  # SIGKILL: no answer at all
                async with s.put(
                    f"{url}/v1/jobs/{JOB}/outputs/report", data=A_BYTES,
                    headers={"Fencing-Token": str(gen)},
                ) as r:  # fmt: skip
                    await r.read()
        assert proc.wait(10) == -9, (tmp_path / "killed.log").read_text()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    key = f"default/{JOB}/g1/report"
    assert objects.stored() == {key: len(A_BYTES)}  # written, never recorded
    entry = redis_sync.hget(f"fg:{{default/{JOB}}}:outputs", "1/report")
    assert entry is not None and '"state":"staged"' in entry
    assert await code(await complete(ogw, gen, ["report"])) == (422, "output_not_staged")

    service = ogw.app[OUTPUTS]
    now = await sweep(service, grace_seconds=0, now=None)
    # the generation is current and its upload claim is still open: kept for its retry
    assert now.orphans == [] and now.kept == 1
    later = await sweep(
        service, grace_seconds=0, now=_after(entry), metrics=ogw.app[K.METRICS]
    )  # past the upload's deadline: counted, not deleted (the generation may retry)
    assert [(o.reason, o.deletable) for o in later.orphans] == [("unrecorded", False)]
    assert objects.stored() == {key: len(A_BYTES)}
    assert await register(ogw) == 2  # the takeover: g1 can never be promoted now
    swept = await sweep(service, grace_seconds=0, metrics=ogw.app[K.METRICS])
    assert [(o.key, o.reason) for o in swept.deleted] == [(key, "stale")]
    assert objects.stored() == {}


def _after(entry: str) -> datetime:
    deadline = int(json.loads(entry)["deadline"])
    return datetime.fromtimestamp(deadline / 1000, UTC) + timedelta(seconds=1)
