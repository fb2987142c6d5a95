"""Review of issue 16 as a zombie and a hostile tenant would attack it: real Redis (with
the in-process wire proxy where a reply must be late or lost), real `fencegate serve`
processes where one must die mid-upload, the file store and a real S3 server (moto).

Each test states one property the outputs feature promises; it fails if the hole exists.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gateway.fencing.outputs_sweep import sweep
from gateway.http import appkeys as K
from gateway.http.outputs import OUTPUTS
from gateway.store.embedded import EmbeddedRedis, free_port
from tests.integration.conftest import JOB, Objects, put, register, sha, write_config
from tests.wire import WireProxy


@pytest.fixture
async def proxy(redis_server: EmbeddedRedis, redis_url: str) -> AsyncIterator[WireProxy]:
    p = WireProxy(redis_server.port)
    await p.start()
    yield p
    await p.close()


async def complete(gw: Any, token: int, outputs: list[str], result: Any = None) -> Any:
    return await gw.client.post(
        f"/v1/jobs/{JOB}/complete",
        json={"outputs": outputs, "result": result},
        headers={**gw.headers, "Fencing-Token": str(token)},
    )


# -- a promoted object is never overwritten ---------------------------------------------


async def test_a_late_stage_reply_cannot_let_an_old_upload_overwrite_the_promoted_object(
    make_gateway: Any, objects: Objects, proxy: WireProxy
) -> None:
    """The stage's reply is late (Redis slow, 1.5 s, under the client's timeout). The
    upload's claim in Redis runs from the stage; the gateway's own cut-off must not run
    from the late reply, or the old upload keeps writing after its claim ended: a retry
    by the same generation stages, uploads, records and completes, and then the old
    upload's bytes land on the key the completion promoted."""
    gw = await make_gateway(
        redis={"url": proxy.url},
        outputs={**objects.section, "sweep_interval_seconds": 0, "upload_timeout_seconds": 2},
    )
    gen = await register(gw)
    held = proxy.on_reply_to(b"/g1/slow", "hold", 1.5)
    old, new = b"old upload " * 1000, b"the retry, recorded and promoted"

    async def slow_body() -> AsyncIterator[bytes]:
        for i in range(0, len(old), 1000):
            yield old[i : i + 1000]
            await asyncio.sleep(0.3)  # 11 chunks: about 3.3 s

    first = asyncio.create_task(put(gw, gen, slow_body(), name="slow"))
    await asyncio.wait_for(held.fired.wait(), 5)  # the stage ran; its reply is held
    await asyncio.sleep(2.3)  # the claim's deadline (stage + 2 s) has passed in Redis
    retry = await put(gw, gen, new, name="slow")
    assert retry.status == 201, await retry.text()
    done = await complete(gw, gen, ["slow"])
    assert done.status == 200, await done.text()
    assert (await done.json())["outputs"]["slow"]["sha256"] == sha(new)
    await first  # the old upload ends (refused or cut): what it answers does not matter

    key = f"default/{JOB}/g1/slow"
    assert objects.read(key) == new, "the promoted object was overwritten by the old upload"
    resp = await gw.client.get(f"/v1/jobs/{JOB}/outputs/slow")
    assert resp.status == 200, await resp.text()
    assert await resp.read() == new


# -- every orphan is either swept or counted ---------------------------------------------


def _serve(tmp_path: Path, redis_url: str, objects: Objects, max_bytes: int) -> tuple[Any, str]:
    port = free_port()
    cfg = write_config(tmp_path, redis_url, objects)
    cfg.write_text(cfg.read_text() + f"max_bytes = {max_bytes}\n")
    with (tmp_path / "serve.log").open("w") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", "serve", "--config", str(cfg), "--port", str(port)],
            stdout=subprocess.DEVNULL, stderr=log, env=dict(os.environ),
        )  # fmt: skip
    return proc, f"http://127.0.0.1:{port}"


async def _healthy(s: aiohttp.ClientSession, url: str) -> None:
    for _ in range(300):
        try:
            async with s.get(url + "/healthz") as r:
                if r.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.05)
    raise AssertionError("fencegate serve did not come up")


def _partials(objects: Objects) -> list[str]:
    """What the store holds besides complete objects: staging files of the local store,
    multipart uploads of S3 that were never completed nor aborted."""
    if objects.root is not None:
        return [str(p.relative_to(objects.root)) for p in objects.root.rglob("*") if p.is_file()]
    assert objects.moto is not None
    up = objects.moto.client().list_multipart_uploads(Bucket=objects.bucket)
    return [u["Key"][len(objects.prefix) :] for u in up.get("Uploads", [])]


async def test_a_gateway_killed_mid_upload_leaves_nothing_unswept_and_uncounted(
    ogw: Any, objects: Objects, redis_url: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """A `fencegate serve` SIGKILLed while a body streams to the store (the put is neither
    finished nor abandoned): whatever the store keeps of it must be found by the sweeper —
    deleted once its generation is stale, or counted — never left invisible.

    S3: the parts of the unfinished multipart upload stay in the bucket (billed) and no
    listing obstore offers shows them; docs/outputs.md asks for a bucket lifecycle rule
    (AbortIncompleteMultipartUpload). Open: strict xfail until the sweeper can see them."""
    if objects.kind == "s3":
        request.applymarker(
            pytest.mark.xfail(strict=True, reason="unfinished S3 multipart uploads: not listed")
        )
    gen = await register(ogw)
    chunk = b"x" * (1024 * 1024)
    proc, url = _serve(tmp_path, redis_url, objects, 64 * 1024 * 1024)
    release = asyncio.Event()

    async def body() -> AsyncIterator[bytes]:
        for _ in range(12):  # 12 MiB: past obstore's part size, so S3 gets parts
            yield chunk
        await release.wait()  # never: the gateway dies first

    try:
        async with aiohttp.ClientSession() as s:
            await _healthy(s, url)
            upload = asyncio.create_task(
                s.put(
                    f"{url}/v1/jobs/{JOB}/outputs/report",
                    data=body(),
                    headers={"Fencing-Token": str(gen)},
                )
            )
            for _ in range(400):  # the put is under way in the store
                if _partials(objects):
                    break
                await asyncio.sleep(0.05)
            assert _partials(objects), "the upload never reached the store"
            proc.send_signal(signal.SIGKILL)
            assert proc.wait(10) == -9
            with pytest.raises(aiohttp.ClientError):
                await upload
    finally:
        release.set()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert await register(ogw) == 2  # the takeover: g1 can never be promoted
    service = ogw.app[OUTPUTS]
    report = await sweep(service, grace_seconds=0, metrics=ogw.app[K.METRICS])
    counted = [o.key for o in report.orphans]
    left = _partials(objects)
    assert all(any(k.startswith(c) for c in counted) for k in left), (
        f"left in the store, neither swept nor counted: {left} (counted: {counted})"
    )
    assert left == [] and [o.reason for o in report.deleted] == ["stale"]
