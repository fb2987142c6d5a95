"""Outputs as a zombie and a hostile tenant would attack them: real Redis (with the wire
proxy, :mod:`tests.support.wire`, where a reply must be late or lost), real `fencegate serve`
processes where one must die mid-upload, the file store and a real S3 server (moto).

Each test states one property the outputs feature promises; it fails where the promise is broken.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from yarl import URL

from gateway.client import FencedJob, JobCompleted, Scheduler, StaleGeneration
from gateway.fencing.output_ledger import URL_SKEW_MS
from gateway.fencing.outputs_sweep import sweep
from gateway.http import appkeys as K
from gateway.http.outputs import OUTPUTS
from gateway.store.embedded import free_port
from tests.conftest import key_digest
from tests.support.outputs import JOB, Objects, complete, put, register, sha, write_config
from tests.support.wire import WireProxy

# -- a promoted object is never overwritten ---------------------------------------------


async def test_a_late_stage_reply_cannot_let_an_old_upload_overwrite_the_promoted_object(
    make_gateway: Any, objects: Objects, wire: WireProxy
) -> None:
    """The stage's reply is late (Redis slow, 1.5 s, under the client's timeout). The
    upload's claim in Redis runs from the stage; the gateway's own cut-off must not run
    from the late reply, or the old upload keeps writing after its claim ended: a retry
    by the same generation stages, uploads, records and completes, and then the old
    upload's bytes land on the key the completion promoted."""
    gw = await make_gateway(
        redis={"url": wire.url},
        outputs={**objects.section, "sweep_interval_seconds": 0, "upload_timeout_seconds": 2},
    )
    gen = await register(gw)
    held = wire.on_reply_to(b"/g1/slow", "hold", 1.5)
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


def _serve(
    tmp_path: Path, redis_url: str, objects: Objects, max_bytes: int, extra: str = ""
) -> tuple[Any, str]:
    """A `fencegate serve` process on the same Redis and object store."""
    port = free_port()
    cfg = write_config(tmp_path, redis_url, objects)
    cfg.write_text(cfg.read_text() + f"max_bytes = {max_bytes}\n{extra}")
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


async def _presigned_url(gw: Any, gen: int, name: str = "report") -> str:
    resp = await gw.client.post(
        f"/v1/jobs/{JOB}/outputs/{name}/upload-url", headers={"Fencing-Token": str(gen)}
    )
    assert resp.status == 201, await resp.text()
    return str((await resp.json())["url"])


async def _direct_put(url: str, data: bytes) -> int:
    async with aiohttp.ClientSession() as s, s.put(url, data=data) as r:
        return r.status


@pytest.mark.parametrize("objects", ["s3"], indirect=True)  # only S3 signs URLs
async def test_a_presigned_upload_never_recorded_is_counted_once_its_url_expired(
    make_gateway: Any, objects: Objects
) -> None:
    """The worker PUTs through its signed URL and dies before completing; nobody takes
    over. Past the URL's expiry no upload is in flight any more: the object is an orphan
    of the current generation — counted (`unrecorded`, not deleted: a completion may
    still record it), never silently kept."""
    gw = await make_gateway(
        outputs={**objects.section, "sweep_interval_seconds": 0, "upload_timeout_seconds": 1}
    )
    gen = await register(gw)
    assert await _direct_put(await _presigned_url(gw, gen), b"never recorded") == 200
    report = await sweep(gw.app[OUTPUTS], grace_seconds=0, metrics=gw.app[K.METRICS])
    assert (report.orphans, report.kept) == ([], 1)  # its URL may still write: kept
    await asyncio.sleep(1.5 + URL_SKEW_MS / 1000)  # the URL expired (and the clocks' margin)
    report = await sweep(gw.app[OUTPUTS], grace_seconds=0, metrics=gw.app[K.METRICS])
    assert [(o.reason, o.deletable) for o in report.orphans] == [("unrecorded", False)], report
    (staged,) = objects.stored()  # the URL's own key, never the output's
    assert staged.startswith(f"default/{JOB}/g1/.signed/") and staged.endswith("/report")
    assert objects.stored()[staged] == len(b"never recorded")


@pytest.mark.parametrize("objects", ["s3"], indirect=True)
async def test_a_presigned_url_cannot_overwrite_the_promoted_object(
    ogw: Any, objects: Objects
) -> None:
    gen = await register(ogw)
    url = await _presigned_url(ogw, gen)
    assert await _direct_put(url, b"the official bytes") == 200
    assert (await complete(ogw, gen, ["report"])).status == 200
    await _direct_put(url, b"rewritten after the completion")  # the URL is still valid
    assert objects.read(f"default/{JOB}/g1/report") == b"the official bytes"


@pytest.mark.parametrize("objects", ["s3"], indirect=True)
async def test_a_stale_generations_signed_url_never_yields_the_official_output(
    ogw: Any, objects: Objects
) -> None:
    """A (gen 1) gets a signed URL, stalls; B (gen 2) takes over, uploads and completes; A
    wakes up and PUTs through its still valid URL (its own staging key), then completes:
    refused; the official output is B's; A's object is a `completed` orphan and swept."""
    a = await register(ogw)
    url_a = await _presigned_url(ogw, a)
    b = await register(ogw)
    assert (await put(ogw, b, b"B's report")).status == 201
    assert (await complete(ogw, b, ["report"])).status == 200
    assert await _direct_put(url_a, b"A's late report") == 200  # the store cannot refuse it
    late = await complete(ogw, a, ["report"])
    assert late.status == 409 and (await late.json())["code"] == "stale_generation"
    got = await ogw.client.get(f"/v1/jobs/{JOB}/outputs/report")
    assert got.status == 200 and await got.read() == b"B's report"
    report = await sweep(ogw.app[OUTPUTS], grace_seconds=0)
    (deleted,) = report.deleted  # the URL's staging object, while the URL is still valid
    assert deleted.key.startswith(f"default/{JOB}/g1/.signed/") and deleted.reason == "completed"
    assert objects.stored() == {f"default/{JOB}/g2/report": len(b"B's report")}


# -- the sweeper racing completions --------------------------------------------------------


async def test_sweepers_racing_completions_never_delete_a_promoted_object(
    ogw: Any, objects: Objects
) -> None:
    """Three sweepers (grace 0) loop while eight jobs' B generations complete: whatever a
    sweeper read before a completion, it never deletes what the completion promoted."""
    jobs = [f"race-{i}" for i in range(8)]
    for job in jobs:
        a = await register(ogw, job)
        assert (await put(ogw, a, b"A " + job.encode(), job=job)).status == 201
        b = await register(ogw, job)
        assert (await put(ogw, b, b"B " + job.encode(), job=job)).status == 201
    service = ogw.app[OUTPUTS]
    stop = asyncio.Event()

    async def sweeper() -> int:
        n = 0
        while not stop.is_set():
            await sweep(service, grace_seconds=0)
            n += 1
        return n

    async def completing(job: str) -> None:
        resp = await ogw.client.post(
            f"/v1/jobs/{job}/complete", json={"outputs": ["report"]},
            headers={"Fencing-Token": "2"},
        )  # fmt: skip
        assert resp.status == 200, await resp.text()

    sweepers = [asyncio.create_task(sweeper()) for _ in range(3)]
    await asyncio.sleep(0.05)
    await asyncio.gather(*(completing(job) for job in jobs))
    stop.set()
    assert all(n > 0 for n in await asyncio.gather(*sweepers))
    await sweep(service, grace_seconds=0)
    for job in jobs:
        got = await ogw.client.get(f"/v1/jobs/{job}/outputs/report")
        assert got.status == 200, await got.text()
        assert await got.read() == b"B " + job.encode()
    assert sorted(objects.stored()) == sorted(f"default/{job}/g2/report" for job in jobs)


# -- after the completion ------------------------------------------------------------------


@pytest.mark.parametrize("registration", ["required", "implicit"])
async def test_after_completion_no_generation_stages_or_replaces_an_output(
    make_gateway: Any, objects: Objects, redis_sync: Any, registration: str
) -> None:
    gw = await make_gateway(
        outputs={**objects.section, "sweep_interval_seconds": 0},
        fencing={"registration": registration},
    )
    await register(gw)
    assert await register(gw) == 2
    assert (await put(gw, 2, b"official")).status == 201
    done = await complete(gw, 2, ["report"], {"n": 1})
    assert done.status == 200
    job_key = f"fg:{{default/{JOB}}}:job"
    before = redis_sync.hmget(job_key, "fence", "completed", "lease_exp", "cancelled")
    for gen in (1, 2, 3):
        for name in ("report", "other"):
            resp = await put(gw, gen, b"after the completion", name=name)
            assert resp.status == 409, (gen, name, await resp.text())
            assert (await resp.json())["code"] in ("job_completed", "stale_generation")
            if objects.kind == "s3":
                signed = await gw.client.post(
                    f"/v1/jobs/{JOB}/outputs/{name}/upload-url",
                    headers={"Fencing-Token": str(gen)},
                )
                assert signed.status == 409, await signed.text()
    after = redis_sync.hmget(job_key, "fence", "completed", "lease_exp", "cancelled")
    assert after == before  # no fence raised, the completion untouched
    assert objects.stored() == {f"default/{JOB}/g2/report": len(b"official")}
    again = await complete(gw, 2, ["report"], {"n": 1})
    assert again.status == 200 and again.headers["Idempotent-Replayed"] == "true"
    view = await (await gw.client.get(f"/v1/jobs/{JOB}")).json()
    assert view["completion"]["generation"] == 2
    assert view["completion"]["outputs"]["report"]["sha256"] == sha(b"official")
    assert [(o["generation"], o["promoted"]) for o in view["outputs"]] == [(2, True)]
    got = await gw.client.get(f"/v1/jobs/{JOB}/outputs/report")
    assert await got.read() == b"official"


# -- the hostile tenant ----------------------------------------------------------------------

TENANT_KEYS = {"a": "ad-tenant-a-0123456789abcdef", "b": "ad-tenant-b-0123456789abcdef"}


def _bearer(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TENANT_KEYS[tenant]}"}


async def test_tenant_b_cannot_read_replace_or_sweep_tenant_as_outputs_and_checkpoints(
    make_gateway: Any, objects: Objects
) -> None:
    """Tenant B uses A's job id, every generation, crafted names and job ids: it reads
    nothing of A's, writes nothing under A's prefix, and its completion promotes only its
    own bytes; the sweep of B's orphans leaves A's promoted object alone."""
    keys = [
        {"role": "admin", "sha256": key_digest(key), "tenant": tenant}
        for tenant, key in TENANT_KEYS.items()
    ]
    gw = await make_gateway(
        outputs={**objects.section, "sweep_interval_seconds": 0}, auth={"keys": keys}
    )
    c = gw.client

    async def call(tenant: str, method: str, path: str, **kw: Any) -> aiohttp.ClientResponse:
        headers = {**_bearer(tenant), **kw.pop("headers", {})}
        url = URL(str(c.make_url("")).rstrip("/") + path, encoded=True)  # as crafted, no dot
        async with aiohttp.ClientSession() as s:  # segment removed by the client
            resp = await s.request(method, url, headers=headers, **kw)
            await resp.read()
        return resp

    job = f"/v1/jobs/{JOB}"
    assert (await call("a", "POST", f"{job}/generations", json={})).status == 201
    put_a = await call(
        "a", "PUT", f"{job}/outputs/report", data=b"A's", headers={"Fencing-Token": "1"}
    )
    assert put_a.status == 201
    ck = await call("a", "PUT", f"{job}/checkpoints/progress", json={"p": 1},
                    headers={"Fencing-Token": "1"})  # fmt: skip
    assert ck.status == 200
    done = await call("a", "POST", f"{job}/complete", json={"outputs": ["report"]},
                      headers={"Fencing-Token": "1"})  # fmt: skip
    assert done.status == 200

    # B reads A's job: nothing there in B's namespace
    for path in (f"{job}/outputs/report", f"{job}/outputs/report?generation=1",
                 f"{job}/checkpoints/progress"):  # fmt: skip
        assert (await call("b", "GET", path)).status == 404, path
    view = await (await call("b", "GET", job)).json()
    assert view.get("completion") is None and view.get("outputs", []) == []
    # B works on "the same" job: its own generation 1, its own key, its own completion
    assert (await call("b", "POST", f"{job}/generations", json={})).status == 201
    for g in ("1", "2"):
        await call("b", "PUT", f"{job}/outputs/report", data=b"B's", headers={"Fencing-Token": g})
    done_b = await call("b", "POST", f"{job}/complete", json={"outputs": ["report"]},
                        headers={"Fencing-Token": "1"})  # fmt: skip
    assert done_b.status == 200, await done_b.text()
    assert (await done_b.json())["outputs"]["report"]["key"] == f"b/{JOB}/g1/report"
    # crafted names and job ids: refused before anything is decided, or B's own namespace
    crafted = [
        f"{job}/outputs/..", f"{job}/outputs/%2e%2e", f"{job}/outputs/..%2Freport",
        f"{job}/outputs/%2E%2E%2F%2E%2E%2Fa%2F{JOB}%2Fg1%2Freport", f"{job}/outputs/report%00",
        f"{job}/outputs/r%C3%A9port", f"{job}/outputs/rep%CE%BFrt", f"{job}/outputs/%EF%BD%92eport",
        f"{job}/outputs/" + "r" * 129, f"{job}/outputs/report%5C..%5C..",
        f"/v1/jobs/..%2Fa%2F{JOB}/outputs/report", f"/v1/jobs/{JOB}%2Fg1/outputs/report",
        f"/v1/jobs/a%2F{JOB}/outputs/report", f"/v1/jobs/{JOB}%00/outputs/report",
    ]  # fmt: skip
    for path in crafted:
        for method in ("PUT", "GET"):
            resp = await call(
                "b", method, path, data=b"B's attack" if method == "PUT" else None,
                headers={"Fencing-Token": "1"},
            )  # fmt: skip
            assert resp.status == 400, (method, path, resp.status)
    report = await sweep(gw.app[OUTPUTS], grace_seconds=0)
    assert all(o.key.startswith("b/") for o in report.deleted), report
    stored = objects.stored()
    assert stored[f"a/{JOB}/g1/report"] == 3
    assert all(k.startswith((f"a/{JOB}/g1/", f"b/{JOB}/g1/")) for k in stored), stored
    if objects.root is not None:  # nothing written outside the store's directory
        assert sorted(p.name for p in objects.root.parent.iterdir()) == ["objects", "state"]
    got = await call("a", "GET", f"{job}/outputs/report")
    assert got.status == 200 and await got.read() == b"A's"
    ck_a = await (await call("a", "GET", f"{job}/checkpoints/progress")).json()
    assert (ck_a["value"], ck_a["generation"]) == ({"p": 1}, 1)


@pytest.mark.parametrize("objects", ["s3"], indirect=True)
async def test_a_redirected_read_never_sends_a_reader_to_replaced_bytes(
    make_gateway: Any, objects: Objects
) -> None:
    """With `redirect_reads` the gateway answers 307 to a signed GET URL. The promoted object
    was replaced after the completion (a signed PUT URL still valid, or anyone with bucket
    access): a streamed read refuses it (500, `output_replaced`); the redirect must not
    send the reader to the other bytes either."""
    gw = await make_gateway(
        outputs={**objects.section, "sweep_interval_seconds": 0, "redirect_reads": True}
    )
    gen = await register(gw)
    url = await _presigned_url(gw, gen)
    assert await _direct_put(url, b"the official bytes") == 200
    assert (await complete(gw, gen, ["report"])).status == 200
    assert await _direct_put(url, b"rewritten after the completion") == 200
    resp = await gw.client.get(f"/v1/jobs/{JOB}/outputs/report", allow_redirects=False)
    if resp.status == 307:
        async with aiohttp.ClientSession() as s, s.get(resp.headers["Location"]) as got:
            served = await got.read()
        assert served == b"the official bytes", "redirected to bytes the completion never saw"
    else:
        assert resp.status == 500 and "replaced" in (await resp.json())["detail"]


# -- lost and late replies ---------------------------------------------------------------------


async def test_an_unanswered_stage_does_not_lock_the_output_for_the_upload_timeout(
    make_gateway: Any, objects: Objects, wire: WireProxy
) -> None:
    """The stage script ran but its reply never came in time (503, nothing was written to
    the store). The worker sends the upload again once Redis answers: it must be able to
    upload, not be told `output_in_progress` for `upload_timeout_seconds` (an hour by
    default) by a claim nobody holds."""
    gw = await make_gateway(
        redis={"url": wire.url, "timeout_seconds": 0.4},
        outputs={**objects.section, "sweep_interval_seconds": 0},
    )
    for _ in range(25):  # a loaded host may take over 0.4 s to connect through the proxy
        resp = await gw.register(JOB)
        if resp.status == 201:
            break
        assert resp.status == 503, await resp.text()
        await asyncio.sleep(0.2)
    gen = int((await resp.json())["generation"])  # 1, or more if a 503 register had run
    wire.on_reply_to(f"/g{gen}/report".encode(), "hold", seconds=1.5)
    first = await put(gw, gen, b"the first try")
    assert first.status == 503, await first.text()
    assert objects.stored() == {}
    await asyncio.sleep(1.6)  # Redis answers again
    again = await put(gw, gen, b"the second try")
    assert again.status == 201, await again.text()
    assert (await complete(gw, gen, ["report"])).status == 200


async def test_a_zombies_checkpoint_resent_after_the_fence_moved_is_refused(
    make_gateway: Any, wire: WireProxy, redis_url: str
) -> None:
    """A (gen 1) writes a checkpoint; Redis's reply is late past the timeout (503: it may
    have been written). B takes over and writes its own. A sends its checkpoint again:
    refused (stale, audited), B's value stands, and B's reader sees B's generation."""
    # margins wide enough for a loaded 2-core CI machine: the hold outlasts the timeout by far,
    # and the re-send comes well after the held reply was let go
    zombie = await make_gateway(redis={"url": wire.url, "timeout_seconds": 1.0})
    direct = await make_gateway()
    await register(direct)
    held = wire.on_reply_to(b"zz-a-progress", "hold", seconds=2.5)
    path = f"/v1/jobs/{JOB}/checkpoints/progress"
    headers = {"Fencing-Token": "1", "Content-Type": "application/json"}
    first = await zombie.client.put(path, data=b'{"page":"zz-a-progress"}', headers=headers)
    assert first.status in (200, 503), await first.text()
    assert await register(direct) == 2
    b = await direct.client.put(
        path, data=b'{"page":"B"}', headers={**headers, "Fencing-Token": "2"}
    )
    assert b.status == 200
    assert held.fired.is_set()
    await asyncio.sleep(3.0)
    again = await zombie.client.put(path, data=b'{"page":"zz-a-progress"}', headers=headers)
    assert again.status == 409 and (await again.json())["code"] == "stale_generation"
    got = await (await direct.client.get(path)).json()
    assert (got["value"], got["generation"]) == ({"page": "B"}, 2)
    audit = await direct.audit(job=JOB)
    assert [(e["step"], e["reason"]) for e in audit] == [
        ("checkpoint:progress", "stale_generation")
    ]


# -- the same generation re-uploading, and the SDK ---------------------------------------------


async def test_a_re_upload_after_the_record_is_what_the_completion_promotes(
    ogw: Any, objects: Objects
) -> None:
    """B records X, then re-uploads the same output (Y) slowly. A completion while Y streams
    must not promote X (its bytes are being replaced on the same key): 422. Once Y is
    recorded, the completion promotes Y's sha, and the bytes served are Y's."""
    gen = await register(ogw)
    x, y = b"X, the first render", b"Y, the second render" * 100
    assert (await put(ogw, gen, x)).status == 201
    release = asyncio.Event()

    async def slow() -> AsyncIterator[bytes]:
        yield y[:1000]
        await release.wait()
        yield y[1000:]

    second = asyncio.create_task(put(ogw, gen, slow()))
    await asyncio.sleep(0.3)  # staged, streaming
    during = await complete(ogw, gen, ["report"])
    assert during.status == 422 and (await during.json())["code"] == "output_not_staged"
    release.set()
    assert (await second).status == 201
    done = await complete(ogw, gen, ["report"])
    assert done.status == 200
    assert (await done.json())["outputs"]["report"]["sha256"] == sha(y)
    got = await ogw.client.get(f"/v1/jobs/{JOB}/outputs/report")
    assert got.status == 200 and await got.read() == y
    assert objects.read(f"default/{JOB}/g1/report") == y


async def test_the_sdks_stale_completion_raises_and_deletes_nothing(
    ogw: Any, objects: Objects
) -> None:
    """Through the SDK: A uploads its report and stalls; B takes over, uploads and
    completes; A's complete() raises StaleGeneration (A superseded). The SDK removed
    nothing: A's draft stays in the store (the sweeper's to delete), B's is served."""
    url = str(ogw.client.make_url("")).rstrip("/")
    async with Scheduler(url) as sched:
        a_gen = await sched.register(JOB)
        async with FencedJob(url, JOB, a_gen.token, worker_id="A", heartbeat_interval=None) as a:
            await a.put_output("report", b"A's draft")
            b_gen = await sched.register(JOB)
            async with FencedJob(url, JOB, b_gen.token, worker_id="B") as b:
                await b.put_output("report", b"B's report")
                await b.complete(outputs=["report"], result={"by": "B"})
                with pytest.raises(JobCompleted):
                    await b.put_output("report", b"B again")  # after completion: refused
            with pytest.raises(StaleGeneration) as err:
                await a.complete(outputs=["report"], result={"by": "A"})
            assert (err.value.presented, err.value.current) == (1, 2)
            assert isinstance(a.superseded, StaleGeneration)
    assert objects.stored() == {
        f"default/{JOB}/g1/report": len(b"A's draft"),
        f"default/{JOB}/g2/report": len(b"B's report"),
    }
    got = await ogw.client.get(f"/v1/jobs/{JOB}/outputs/report")
    assert await got.read() == b"B's report"


async def test_a_gateway_frozen_mid_upload_cannot_overwrite_the_promoted_object(
    ogw: Any, objects: Objects, redis_url: str, tmp_path: Path
) -> None:
    """A `fencegate serve` is frozen (SIGSTOP) while it streams gen 1's `report`, past the
    upload's claim. The worker retries through another gateway: staged, recorded,
    completed. Then the frozen gateway resumes and the rest of the old body arrives: its
    put must be cut (its deadline passed), never land on the promoted key."""
    gen = await register(ogw)
    proc, url = _serve(tmp_path, redis_url, objects, 1024 * 1024, "upload_timeout_seconds = 3\n")
    resume = asyncio.Event()
    old, new = b"old " * 2000, b"the retry, promoted"

    async def body() -> AsyncIterator[bytes]:
        yield old[:4000]
        await resume.wait()
        yield old[4000:]

    try:
        async with aiohttp.ClientSession() as s:
            await _healthy(s, url)
            first = asyncio.create_task(
                s.put(f"{url}/v1/jobs/{JOB}/outputs/report", data=body(),
                      headers={"Fencing-Token": str(gen)})
            )  # fmt: skip
            await asyncio.sleep(0.5)  # staged, the first bytes in the store's put
            proc.send_signal(signal.SIGSTOP)
            await asyncio.sleep(3.5)  # the claim's deadline passes while it is frozen
            retry = await put(ogw, gen, new)
            assert retry.status == 201, await retry.text()
            assert (await complete(ogw, gen, ["report"])).status == 200
            proc.send_signal(signal.SIGCONT)
            resume.set()
            with contextlib.suppress(aiohttp.ClientError):
                resp = await first
                await resp.read()
            await asyncio.sleep(0.5)
    finally:
        resume.set()
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.terminate()
            proc.wait(10)
    assert objects.read(f"default/{JOB}/g1/report") == new
    got = await ogw.client.get(f"/v1/jobs/{JOB}/outputs/report")
    assert got.status == 200 and await got.read() == new
