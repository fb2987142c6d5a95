"""Pre-signed uploads write a staging key of their own; the completion copies the object to
the output's key. The URL's holder (a zombie, a leaked URL) PUTs again before, during and
after the completion; the completion is killed half-way or sent twice. S3 only (moto): the
file store signs no URLs."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest
import redis

from gateway.fencing.outputs_sweep import sweep
from gateway.http.outputs import OUTPUTS
from gateway.objects import ObjectStore
from gateway.store.keys import JobKeys
from tests.support.outputs import JOB, Objects, complete, register, sha

pytestmark = pytest.mark.parametrize("objects", ["s3"], indirect=True)

OFFICIAL = b"the official bytes"


async def signed(gw: Any, gen: int, name: str = "report") -> dict[str, Any]:
    resp = await gw.client.post(
        f"/v1/jobs/{JOB}/outputs/{name}/upload-url", headers={"Fencing-Token": str(gen)}
    )
    assert resp.status == 201, await resp.text()
    body: dict[str, Any] = await resp.json()
    return body


async def direct_put(url: str, data: bytes) -> int:
    async with aiohttp.ClientSession() as s, s.put(url, data=data) as r:
        return r.status


def entry(redis_sync: redis.Redis, gen: int, name: str = "report") -> dict[str, Any]:
    raw = redis_sync.hget(JobKeys("default", JOB).outputs, f"{gen}/{name}")
    assert raw is not None
    found: dict[str, Any] = json.loads(raw)
    return found


async def test_a_put_through_the_url_during_the_copy_never_changes_what_is_recorded(
    ogw: Any, objects: Objects, redis_sync: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The holder PUTs other bytes right after the completion opened the staged object: the
    output's key gets the bytes that were read and hashed, and the record (size, sha256,
    etag) describes exactly them; the read serves them."""
    gen = await register(ogw)
    issued = await signed(ogw, gen)
    assert await direct_put(issued["url"], OFFICIAL) == 200
    opened = ObjectStore.open

    async def open_then_zombie(self: ObjectStore, key: str, *, if_match: str = "") -> Any:
        got = await opened(self, key, if_match=if_match)
        if "/.signed/" in key:
            assert await direct_put(issued["url"], b"the zombie's bytes, written mid-copy") == 200
        return got

    monkeypatch.setattr(ObjectStore, "open", open_then_zombie)
    done = await complete(ogw, gen, ["report"])
    assert done.status == 200, await done.text()
    monkeypatch.setattr(ObjectStore, "open", opened)
    promoted = (await done.json())["outputs"]["report"]
    assert (promoted["size"], promoted["sha256"]) == (len(OFFICIAL), sha(OFFICIAL))
    assert objects.read(f"default/{JOB}/g1/report") == OFFICIAL
    head = await ogw.app[OUTPUTS].objects.head(f"default/{JOB}/g1/report")
    assert entry(redis_sync, gen)["etag"] == head.etag  # the etag of what the copy wrote
    read = await ogw.client.get(f"/v1/jobs/{JOB}/outputs/report")
    assert read.status == 200 and await read.read() == OFFICIAL


async def test_a_put_through_the_url_after_the_completion_is_swept_and_never_served(
    ogw: Any, objects: Objects
) -> None:
    gen = await register(ogw)
    issued = await signed(ogw, gen)
    assert await direct_put(issued["url"], OFFICIAL) == 200
    assert (await complete(ogw, gen, ["report"])).status == 200
    assert objects.stored() == {f"default/{JOB}/g1/report": len(OFFICIAL)}  # staged deleted
    assert await direct_put(issued["url"], b"late") == 200  # still valid: its own key again
    read = await ogw.client.get(f"/v1/jobs/{JOB}/outputs/report")
    assert read.status == 200 and await read.read() == OFFICIAL
    report = await sweep(ogw.app[OUTPUTS], grace_seconds=0)
    assert [(o.key, o.reason) for o in report.deleted] == [(issued["key"], "completed")]
    assert objects.stored() == {f"default/{JOB}/g1/report": len(OFFICIAL)}


async def test_a_completion_killed_between_the_copy_and_the_record_is_finished_by_its_resend(
    make_gateway: Any, objects: Objects, redis_sync: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gateway dies after writing the output's key, before the record: the copy's claim
    holds the output (409 output_in_progress) until it runs out; the completion sent again
    then copies again, records once and deletes the staged object."""
    gw = await make_gateway(outputs={**objects.section, "upload_timeout_seconds": 3})
    service = gw.app[OUTPUTS]
    gen = await register(gw)
    issued = await signed(gw, gen)
    assert await direct_put(issued["url"], OFFICIAL) == 200

    class Killed(Exception):
        pass

    def die(point: str) -> None:
        if point == "after_presigned_copy":
            raise Killed(point)

    monkeypatch.setattr(service, "crash_point", die)
    with pytest.raises(Killed):  # in process: the request dies where the process would
        await service.ensure_recorded("default", JOB, gen, ["report"])
    monkeypatch.undo()
    assert objects.read(f"default/{JOB}/g1/report") == OFFICIAL  # written, not recorded
    assert entry(redis_sync, gen)["state"] == "staged" and entry(redis_sync, gen)["copy"]
    busy = await complete(gw, gen, ["report"])
    assert (busy.status, (await busy.json())["code"]) == (409, "output_in_progress")
    report = await sweep(service, grace_seconds=0)  # neither the copy nor the staged: swept
    assert report.deleted == []
    await asyncio.sleep(3.2)  # the claim ran out (upload_timeout_seconds)
    done = await complete(gw, gen, ["report"])
    assert done.status == 200, await done.text()
    assert objects.stored() == {f"default/{JOB}/g1/report": len(OFFICIAL)}
    recorded = entry(redis_sync, gen)
    assert (recorded["state"], recorded["sha256"], recorded.get("copy")) == (
        "recorded",
        sha(OFFICIAL),
        None,
    )
    read = await gw.client.get(f"/v1/jobs/{JOB}/outputs/report")
    assert read.status == 200 and await read.read() == OFFICIAL


async def test_completions_sent_twice_at_once_copy_and_record_once(
    ogw: Any, objects: Objects, redis_sync: redis.Redis
) -> None:
    """A completion re-sent while the first still copies (its reply late): one copy runs,
    the other is told output_in_progress (or replays the completion); the output is
    recorded once and served."""
    gen = await register(ogw)
    issued = await signed(ogw, gen)
    body = b"z" * (3 * 1024 * 1024 // 4)
    assert await direct_put(issued["url"], body) == 200
    first, second = await asyncio.gather(
        complete(ogw, gen, ["report"]), complete(ogw, gen, ["report"])
    )
    statuses = sorted([first.status, second.status])
    assert statuses in ([200, 200], [200, 409]), statuses
    again = await complete(ogw, gen, ["report"])  # the re-send after it all: a replay
    assert again.status == 200
    assert entry(redis_sync, gen)["sha256"] == sha(body)
    assert objects.stored() == {f"default/{JOB}/g1/report": len(body)}
    read = await ogw.client.get(f"/v1/jobs/{JOB}/outputs/report")
    assert read.status == 200 and await read.read() == body


async def test_a_put_through_the_gateway_waits_for_the_copy_of_the_same_output(
    ogw: Any, objects: Objects, redis_sync: redis.Redis
) -> None:
    """While a completion copies a pre-signed upload, a put of the same output by the same
    generation is 409 output_in_progress: two writers of the output's key at once could leave
    bytes its record does not describe."""
    gen = await register(ogw)
    issued = await signed(ogw, gen)
    assert await direct_put(issued["url"], OFFICIAL) == 200
    service = ogw.app[OUTPUTS]
    keys = JobKeys("default", JOB)
    upload = issued["key"].split("/")[-2]
    claimed = await service.record_upload(
        keys, gen, "report", upload, "", size=60_000, copy="c1", copy_op="copy"
    )
    assert claimed is not None and claimed.copy == "c1"
    resp = await ogw.client.put(
        f"/v1/jobs/{JOB}/outputs/report", data=b"other", headers={"Fencing-Token": str(gen)}
    )
    assert (resp.status, (await resp.json())["code"]) == (409, "output_in_progress")
    assert await service.record_upload(
        keys, gen, "report", claimed.upload, "", copy="c1", copy_op="uncopy"
    )
    done = await complete(ogw, gen, ["report"])
    assert done.status == 200, await done.text()
