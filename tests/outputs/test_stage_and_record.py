"""Attempt-scoped outputs: fenced stage and record around a streamed write.

Real Redis, a real gateway on loopback, and a real object store: the local filesystem
and a real S3-compatible HTTP server (moto in server mode, a separate process). Every
test that can runs against both (``objects`` is parametrised). What a test asserts about
the store it reads back without the gateway: the directory itself, or the S3 server's
own ListObjectsV2/GetObject over plain HTTP.
"""

from __future__ import annotations

import asyncio
import gzip
import os
import stat
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis
from yarl import URL

from gateway.fencing.outputs_sweep import sweep
from gateway.http import appkeys as K
from gateway.http.outputs import OUTPUTS
from gateway.store.keys import JobKeys
from tests.conftest import Upstream, gateway_settings, start_gateway
from tests.support.outputs import JOB, Objects, metric, put, register, sha, write_config
from tests.support.processes import DurableRedis
from tests.support.wire import WireProxy

# -- the happy path and reads --------------------------------------------------------


async def test_upload_is_streamed_hashed_and_recorded(ogw: Any, objects: Objects) -> None:
    gen = await register(ogw)
    body = b"%PDF-1.7 report of generation one\n" * 4000

    async def chunks() -> AsyncIterator[bytes]:  # chunked transfer: no Content-Length
        for i in range(0, len(body), 10_000):
            yield body[i : i + 10_000]

    resp = await put(ogw, gen, chunks(), **{"Content-Type": "application/pdf"})
    assert resp.status == 201, await resp.text()
    out = await resp.json()
    key = f"default/{JOB}/g1/report"
    assert out["state"] == "recorded" and out["key"] == key and out["generation"] == 1
    assert out["size"] == len(body) and out["sha256"] == sha(body)
    assert out["content_type"] == "application/pdf"
    assert objects.stored() == {key: len(body)}
    assert objects.read(key) == body

    # nothing is promoted before a completion
    resp = await ogw.client.get(f"/v1/jobs/{JOB}/outputs/report")
    assert resp.status == 404 and (await resp.json())["code"] == "not_found"
    # an auditor (open mode: admin) reads the staged object of a given generation
    resp = await ogw.client.get(f"/v1/jobs/{JOB}/outputs/report", params={"generation": "1"})
    assert resp.status == 200 and await resp.read() == body
    assert resp.headers["Content-Type"] == "application/pdf"
    assert resp.headers["Fencegate-Output-State"] == "recorded"
    assert resp.headers["X-Content-Type-Options"] == "nosniff"


async def test_same_generation_retry_overwrites_its_own_staged_object(
    ogw: Any, objects: Objects, redis_sync: redis.Redis
) -> None:
    gen = await register(ogw)
    assert (await put(ogw, gen, b"first draft")).status == 201
    resp = await put(ogw, gen, b"second draft, longer")
    assert resp.status == 201
    assert (await resp.json())["sha256"] == sha(b"second draft, longer")
    key = f"default/{JOB}/g1/report"
    assert objects.read(key) == b"second draft, longer"
    assert list(redis_sync.hkeys(f"fg:{{default/{JOB}}}:outputs")) == ["1/report"]


# -- the zombie ----------------------------------------------------------------------


async def test_zombie_upload_after_takeover_is_refused_before_any_byte(
    ogw: Any, objects: Objects
) -> None:
    a = await register(ogw)
    b = await register(ogw)
    assert (a, b) == (1, 2)
    resp = await put(ogw, a, b"zombie bytes" * 1000, **{"Worker-Id": "worker-a"})
    assert resp.status == 409
    problem = await resp.json()
    assert problem["code"] == "stale_generation"
    assert (problem["presented"], problem["current"]) == (1, 2)
    assert not [k for k in objects.stored() if "/g1/" in k]  # the store never saw a byte
    audit = await ogw.audit(job=JOB)
    seen = [(e["step"], e["reason"], e["presented"], e["current"], e["worker_id"]) for e in audit]
    assert seen == [("output:report", "stale_generation", 1, 2, "worker-a")]


async def test_fence_moving_during_the_upload_refuses_the_record_and_leaves_an_orphan(
    ogw: Any, objects: Objects, redis_sync: redis.Redis
) -> None:
    a = await register(ogw)
    release = asyncio.Event()

    async def slow() -> AsyncIterator[bytes]:
        yield b"a" * 50_000
        await release.wait()
        yield b"b" * 50_000

    upload = asyncio.create_task(put(ogw, a, slow()))
    outputs_key = f"fg:{{default/{JOB}}}:outputs"
    for _ in range(200):  # the stage decision is taken (and the bytes are streaming)
        if redis_sync.hexists(outputs_key, "1/report"):
            break
        await asyncio.sleep(0.01)
    assert await register(ogw) == 2  # B takes over while A's bytes are in flight
    release.set()
    resp = await upload
    assert resp.status == 409 and (await resp.json())["code"] == "stale_generation"
    key = f"default/{JOB}/g1/report"
    assert objects.stored() == {key: 100_000}  # written, never recorded: an orphan
    assert '"state":"staged"' in redis_sync.hget(outputs_key, "1/report")

    service = ogw.app[OUTPUTS]
    metrics = ogw.app[K.METRICS]
    kept = await sweep(service, grace_seconds=3600, metrics=metrics)
    assert [(o.key, o.reason, o.deletable) for o in kept.orphans] == [(key, "stale", False)]
    assert objects.stored() == {key: 100_000}  # within the grace: counted, not deleted
    assert await metric(ogw, 'fencegate_output_orphans{reason="stale"}') == 1
    assert await metric(ogw, 'fencegate_output_orphan_bytes{reason="stale"}') == 100_000

    swept = await sweep(service, grace_seconds=0, metrics=metrics)
    assert [o.key for o in swept.deleted] == [key]
    assert objects.stored() == {}
    assert await metric(ogw, 'fencegate_output_orphans{reason="stale"}') == 0
    assert await metric(ogw, 'fencegate_output_orphans_deleted_total{reason="stale"}') == 1
    assert await metric(ogw, "fencegate_output_orphan_age_seconds_count") == 1
    again = await sweep(service, grace_seconds=0, metrics=metrics)  # idempotent
    assert again.orphans == [] and again.deleted == []


async def test_one_upload_per_output_and_generation_at_a_time(ogw: Any, objects: Objects) -> None:
    gen = await register(ogw)
    release = asyncio.Event()

    async def slow() -> AsyncIterator[bytes]:
        yield b"x" * 1000
        await release.wait()

    first = asyncio.create_task(put(ogw, gen, slow()))
    await asyncio.sleep(0.2)
    second = await put(ogw, gen, b"racing retry")
    assert second.status == 409
    assert (await second.json())["code"] == "output_in_progress"
    assert int(second.headers["Retry-After"]) >= 1
    release.set()
    assert (await first).status == 201
    assert objects.read(f"default/{JOB}/g1/report") == b"x" * 1000
    # a failed upload frees its claim at once: an oversize body, then a retry that works
    too_big = await put(ogw, gen, b"y" * (1024 * 1024 + 1))
    assert too_big.status == 413
    assert (await put(ogw, gen, b"retry after 413")).status == 201


async def test_cancelled_job_refuses_uploads_and_its_objects_are_swept(
    ogw: Any, objects: Objects
) -> None:
    gen = await register(ogw)
    assert (await put(ogw, gen, b"before the cancel")).status == 201
    assert (await ogw.client.post(f"/v1/jobs/{JOB}/cancel")).status == 200
    resp = await put(ogw, gen, b"after the cancel")
    assert resp.status == 409 and (await resp.json())["code"] == "job_cancelled"
    report = await sweep(ogw.app[OUTPUTS], grace_seconds=0)
    assert [(o.reason, o.key) for o in report.deleted] == [
        ("cancelled", f"default/{JOB}/g1/report")
    ]
    assert objects.stored() == {}


async def test_upload_fails_closed_on_a_wiped_redis(
    ogw: Any, objects: Objects, redis_sync: redis.Redis
) -> None:
    gen = await register(ogw)
    redis_sync.flushall()  # the durability markers are gone: the stage decides nothing
    resp = await put(ogw, gen, b"no fence to check")
    assert resp.status == 503 and (await resp.json())["code"] == "store_unavailable"
    assert objects.stored() == {}  # not one byte went out


async def test_sweeper_fails_closed_on_a_wiped_redis(
    ogw: Any, objects: Objects, redis_sync: redis.Redis
) -> None:
    a = await register(ogw)
    assert (await put(ogw, a, b"stale soon")).status == 201
    await register(ogw)
    redis_sync.flushall()  # fences and markers gone: nothing can be decided
    with pytest.raises(Exception, match="durability marker"):
        await sweep(ogw.app[OUTPUTS], grace_seconds=0)
    assert list(objects.stored()) == [f"default/{JOB}/g1/report"]


async def test_cli_sweep_dry_run_then_for_real(
    ogw: Any, objects: Objects, redis_url: str, tmp_path: Path
) -> None:
    a = await register(ogw)
    assert (await put(ogw, a, b"stale after the takeover")).status == 201
    await register(ogw)
    cfg = write_config(tmp_path, redis_url, objects)
    key = f"default/{JOB}/g1/report"

    async def run(*extra: str) -> str:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gateway", "outputs", "sweep", "--config", str(cfg),
            "--grace", "0", *extra, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env=dict(os.environ),
        )  # fmt: skip
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, err.decode()
        return out.decode()

    dry = await run("--dry-run")
    assert "WOULD DELETE  stale" in dry and key in dry, dry
    assert "orphans: 1 (stale 1 (24 B)); would delete 1" in dry, dry
    assert list(objects.stored()) == [key]
    real = await run()
    assert "DELETED" in real and key in real, real
    assert objects.stored() == {}
    assert "orphans: 0 (none)" in await run()


# -- bad input -------------------------------------------------------------------------

BAD_NAMES = [
    "..",
    "%2e%2e",
    "%2E%2E%2Fescape",
    "..%2Fescape",
    "%2Fetc%2Fpasswd",
    "a%00b",
    "a%5Cb",
    "%5C..%5Cx",
    ".hidden",
    "x" * 129,
    "a..b",
]


@pytest.mark.parametrize("raw", BAD_NAMES)
async def test_bad_output_names_are_refused_and_write_nothing(
    ogw: Any, objects: Objects, raw: str, redis_sync: redis.Redis
) -> None:
    gen = await register(ogw)
    base = str(ogw.client.make_url(f"/v1/jobs/{JOB}/outputs/"))
    url = URL(base + raw, encoded=True)
    headers = {"Fencing-Token": str(gen)}
    async with ogw.client.session.put(url, data=b"evil", headers=headers) as resp:
        assert resp.status in (400, 404), (raw, resp.status)
        assert resp.headers["Content-Type"].startswith("application/problem+json")
    assert objects.stored() == {}
    assert not redis_sync.exists(f"fg:{{default/{JOB}}}:outputs")


async def test_bad_name_reaching_the_view_is_a_400(ogw: Any, objects: Objects) -> None:
    gen = await register(ogw)
    for raw in ("%2e%2e", "..%2Fescape", "a%00b", "x" * 129):
        url = URL(str(ogw.client.make_url(f"/v1/jobs/{JOB}/outputs/")) + raw, encoded=True)
        async with ogw.client.session.put(
            url, data=b"evil", headers={"Fencing-Token": str(gen)}
        ) as resp:
            assert resp.status == 400, raw
            assert (await resp.json())["code"] == "invalid_request"


async def test_declared_oversize_body_is_refused_before_the_stage(
    ogw: Any, objects: Objects, redis_sync: redis.Redis
) -> None:
    gen = await register(ogw)
    resp = await put(ogw, gen, b"z" * (1024 * 1024 + 1))  # Content-Length says too much
    assert resp.status == 413
    assert (await resp.json())["code"] == "payload_too_large"
    assert objects.stored() == {}
    assert not redis_sync.exists(f"fg:{{default/{JOB}}}:outputs")


async def test_oversize_chunked_body_is_cut_while_streaming(ogw: Any, objects: Objects) -> None:
    gen = await register(ogw)
    sent = 0

    async def endless() -> AsyncIterator[bytes]:
        nonlocal sent
        for _ in range(64):  # 16 MiB offered, 1 MiB allowed
            sent += 256 * 1024
            yield b"q" * (256 * 1024)

    try:
        resp = await put(ogw, gen, endless())
        assert resp.status == 413
    except aiohttp.ClientError:
        pass  # the gateway closed the connection while the client was still writing
    assert objects.stored() == {}
    assert (await put(ogw, gen, b"fits")).status == 201


async def _raw_put(
    gw: Any, head_length: int, body: bytes, token: int, *, after: asyncio.Event | None = None
) -> bytes:
    """A PUT written by hand: the Content-Length header says ``head_length``, ``body`` is
    what is sent; then the client closes its side (a short body, a client going away):
    0.2 s later, or once ``after`` is set (a reply held on the wire: it goes while held)."""
    host, port = gw.client.host, gw.client.port
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(
        (
            f"PUT /v1/jobs/{JOB}/outputs/report HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Fencing-Token: {token}\r\nContent-Type: text/plain\r\n"
            f"Content-Length: {head_length}\r\n\r\n"
        ).encode()
        + body
    )
    await writer.drain()
    if after is None:
        await asyncio.sleep(0.2)
    else:
        await asyncio.wait_for(after.wait(), 10)
    writer.write_eof()
    try:
        answer = await asyncio.wait_for(reader.read(), 5)
    except (ConnectionError, TimeoutError):
        answer = b""
    writer.close()
    return answer


async def test_short_body_or_disconnect_mid_upload_records_nothing(
    ogw: Any, objects: Objects, redis_sync: redis.Redis
) -> None:
    gen = await register(ogw)
    await _raw_put(ogw, 500_000, b"only part of it" * 100, gen)
    outputs_key = f"fg:{{default/{JOB}}}:outputs"
    for _ in range(750):  # the gateway notices, abandons the put and frees the claim (15 s)
        entry = redis_sync.hget(outputs_key, "1/report")
        if entry is not None and '"deadline":0' in entry:
            break
        await asyncio.sleep(0.02)
    assert '"state":"staged"' in entry and '"deadline":0' in entry
    # the abandoned put leaves no object at all: the gateway removes its staging file before
    # it frees the claim, and a put the client's hang-up cancelled may still be unwinding in
    # obstore's runtime then (its own cleanup follows within moments)
    for _ in range(100):
        if objects.stored() == {}:
            break
        await asyncio.sleep(0.02)
    assert objects.stored() == {}
    resp = await ogw.client.get(f"/v1/jobs/{JOB}/outputs/report")
    assert resp.status == 404
    assert (await put(ogw, gen, b"the retry")).status == 201


@pytest.mark.parametrize("held", ["reserve", "stage"])
async def test_a_client_gone_while_a_reply_is_in_flight_leaves_no_claim_and_no_charge(
    make_gateway: Any, objects: Objects, wire: WireProxy, redis_sync: redis.Redis, held: str
) -> None:
    """The client hangs up while the byte reservation's or the stage's reply is on its way:
    the request is cancelled after that script ran in Redis. The reservation is given back,
    a claim is ended at once (not left to the hour-long deadline), no object is left, and
    the worker's retry is stored."""
    gw = await make_gateway(
        redis={"url": wire.url},
        outputs={**objects.section, "sweep_interval_seconds": 0, "max_bytes": 1024 * 1024},
    )
    gen = await register(gw)
    # a first output puts both scripts in Redis's cache (each is sent by its digest then);
    # both carry the object key: the reservation goes first, then the stage
    assert (await put(gw, gen, b"warm", name="warm")).status == 201
    rule = wire.on_reply_to(
        f"{JOB}/g{gen}/report".encode(), "hold", seconds=1.0, skip=int(held == "stage")
    )
    # the client hangs up while that reply is held (under load the stage can come later
    # than any fixed wait)
    await _raw_put(gw, 500_000, b"only part of it" * 100, gen, after=rule.fired)
    assert rule.fired.is_set()
    outputs_key = f"fg:{{default/{JOB}}}:outputs"
    charged = "fg:quota:{default}:out_bytes"
    entry = None
    for _ in range(250):
        entry = redis_sync.hget(outputs_key, f"{gen}/report")
        freed = entry is None if held == "reserve" else '"deadline":0' in (entry or "")
        if freed and int(redis_sync.get(charged) or 0) == len(b"warm"):
            break
        await asyncio.sleep(0.02)
    if held == "reserve":
        assert entry is None
    else:
        assert entry is not None and '"state":"staged"' in entry and '"deadline":0' in entry
    assert int(redis_sync.get(charged) or 0) == len(b"warm")
    assert list(objects.stored()) == [f"default/{JOB}/g{gen}/warm"]
    assert (await put(gw, gen, b"the retry")).status == 201
    assert int(redis_sync.get(charged) or 0) == len(b"warm") + len(b"the retry")


async def test_content_type_must_be_a_media_type(ogw: Any, objects: Objects) -> None:
    gen = await register(ogw)
    resp = await put(ogw, gen, b"x", **{"Content-Type": "not a media type"})
    assert resp.status == 400
    assert objects.stored() == {}


async def test_an_encoded_upload_is_refused_before_the_stage(
    ogw: Any, objects: Objects, redis_sync: redis.Redis
) -> None:
    gen = await register(ogw)
    packed = gzip.compress(b"a report\n" * 100)
    for coding in ("gzip", "deflate", "br", "identity, gzip"):
        resp = await put(ogw, gen, packed, **{"Content-Encoding": coding})
        assert resp.status == 415, coding
        assert (await resp.json())["code"] == "unsupported_media_type"
    assert objects.stored() == {}
    assert not redis_sync.exists(f"fg:{{default/{JOB}}}:outputs")
    # a compressed file is uploaded as what it is, and stored byte for byte
    resp = await put(ogw, gen, packed, **{"Content-Type": "application/gzip"})
    assert resp.status == 201, await resp.text()
    assert objects.read(f"default/{JOB}/g1/report") == packed


# -- pre-signed uploads -----------------------------------------------------------------


async def test_presigned_upload_through_real_http(ogw: Any, objects: Objects) -> None:
    gen = await register(ogw)
    resp = await ogw.client.post(
        f"/v1/jobs/{JOB}/outputs/report/upload-url",
        json={"content_type": "text/csv"},
        headers={"Fencing-Token": str(gen)},
    )
    if objects.kind == "file":
        assert resp.status == 501
        assert (await resp.json())["code"] == "upload_url_unsupported"
        return
    assert resp.status == 201, await resp.text()
    signed = await resp.json()
    staged = f"default/{JOB}/g1/.signed/"
    assert signed["key"].startswith(staged) and signed["key"].endswith("/report")
    assert signed["method"] == "PUT"
    body = b"a,b\n1,2\n" * 1000
    async with (
        aiohttp.ClientSession() as direct,
        direct.put(
            URL(signed["url"], encoded=True), data=body, headers={"Content-Type": "text/csv"}
        ) as up,
    ):
        assert up.status == 200, await up.text()
    assert objects.read(signed["key"]) == body  # the URL's own key, not the output's
    assert f"default/{JOB}/g1/report" not in objects.stored()
    service = ogw.app[OUTPUTS]
    assert await service.ensure_recorded("default", JOB, gen, ["report", "absent"]) == ["report"]
    assert objects.read(f"default/{JOB}/g1/report") == body  # copied there
    assert signed["key"] not in objects.stored()  # and the staged object deleted
    entry = await service.entry(JobKeys("default", JOB), gen, "report")
    assert entry is not None and entry.state == "recorded"
    assert (entry.size, entry.sha256, entry.content_type) == (len(body), sha(body), "text/csv")
    # a zombie's URL request after the takeover is refused like its PUT
    await register(ogw)
    resp = await ogw.client.post(
        f"/v1/jobs/{JOB}/outputs/report/upload-url", headers={"Fencing-Token": str(gen)}
    )
    assert resp.status == 409 and (await resp.json())["code"] == "stale_generation"


async def test_file_store_keeps_outputs_private_whatever_the_umask(
    make_gateway: Any, tmp_path: Path
) -> None:
    root = tmp_path / "outputs"
    root.mkdir(mode=0o755)
    os.chmod(root, 0o755)
    old = os.umask(0o022)  # the usual umask: files 0644, folders 0755 unless narrowed
    try:
        gw = await make_gateway(outputs={"store": "file", "path": str(root)})
        gen = await register(gw)
        resp = await put(gw, gen, b"name,salary\nada,1\n", name="payroll.csv")
        assert resp.status == 201, await resp.text()
    finally:
        os.umask(old)
    obj = root / "default" / JOB / f"g{gen}" / "payroll.csv"
    assert stat.S_IMODE(obj.stat().st_mode) == 0o600
    folder = obj.parent
    while True:
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
        if folder == root:
            break
        folder = folder.parent


async def test_an_upload_abandoned_while_redis_is_down_frees_its_claim_once_it_is_back(
    durable: DurableRedis, upstream: Upstream, objects: Objects, tmp_path: Path
) -> None:
    """The client hangs up mid-upload while Redis is down (stopped; its AOF keeps every
    write), so the gateway's abandon cannot be sent. The claim is still freed as soon as
    Redis is back, not at the upload's deadline (an hour by default): the worker's retry is
    not told ``output_in_progress`` for an hour by a claim nobody holds."""
    clients: list[Any] = []
    settings = gateway_settings(
        durable.url, upstream.url, tmp_path,
        outputs={**objects.section, "sweep_interval_seconds": 0}, redis={"timeout_seconds": 1},
    )  # fmt: skip
    gw = await start_gateway(settings, tmp_path, clients)
    r = durable.client()
    try:
        gen = await register(gw)
        _, writer = await asyncio.open_connection(gw.client.host, gw.client.port)
        writer.write(
            f"PUT /v1/jobs/{JOB}/outputs/report HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Fencing-Token: {gen}\r\nContent-Type: text/plain\r\nContent-Length: 500000\r\n\r\n"
            .encode() + b"part of it" * 100
        )  # fmt: skip
        await writer.drain()
        outputs_key = f"fg:{{default/{JOB}}}:outputs"
        for _ in range(500):  # staged: the claim runs
            entry = r.hget(outputs_key, "1/report")
            if entry is not None and '"deadline":0' not in entry:
                break
            await asyncio.sleep(0.02)
        assert entry is not None and '"state":"staged"' in entry, entry
        durable.server.stop()
        writer.close()  # the client goes away; the abandon cannot reach Redis
        await asyncio.sleep(2)
        durable.server.start()
        r = durable.client()
        for _ in range(1000):  # freed within moments of Redis being back (retries back off)
            entry = r.hget(outputs_key, "1/report")
            if entry is not None and '"deadline":0' in entry:
                break
            await asyncio.sleep(0.02)
        assert entry is not None and '"deadline":0' in entry, entry
        assert (await put(gw, gen, b"the retry")).status == 201
    finally:
        r.close()
        for c in clients:
            await c.close()
