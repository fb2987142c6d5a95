"""Outputs inside the tenant's quotas: the bytes and objects a tenant
has in the output store (``quotas.output_bytes``, ``quotas.output_objects``), reserved at
the upload, settled to the object's size, given back when the object leaves the store.

Real Redis, real gateways on loopback (and a `fencegate serve` process), two tenants with
their own keys, the file store and a real S3 server (moto). What a test asserts about the
store it reads back without the gateway.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis

from gateway.fencing.output_ledger import RESERVATION_GRACE_MS, new_upload_id
from gateway.fencing.outputs_sweep import sweep
from gateway.http import appkeys as K
from gateway.http.outputs import OUTPUTS
from gateway.store.embedded import free_port
from gateway.store.keys import JobKeys
from tests.conftest import Gateway, key_digest
from tests.support.outputs import JOB, Objects, metric, write_config

KEYS = {
    ("acme", "worker"): "acme-worker-key",
    ("acme", "admin"): "acme-admin-key",
    ("globex", "worker"): "globex-worker-key",
    ("globex", "admin"): "globex-admin-key",
}
AUTH = {
    "keys": [
        {"role": role, "sha256": key_digest(key), "tenant": tenant}
        for (tenant, role), key in KEYS.items()
    ]
}
KB100 = b"o" * 100_000


def bearer(tenant: str, role: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[(tenant, role)]}"}


class Tenant:
    """One tenant's calls: its admin registers and reads the audit feed, its worker uploads."""

    def __init__(self, gateway: Gateway, name: str) -> None:
        self.gw = gateway
        self.client = gateway.client
        self.name = name
        self.admin = bearer(name, "admin")
        self.worker = bearer(name, "worker")

    async def register(self, job: str = JOB) -> int:
        resp = await self.client.post(f"/v1/jobs/{job}/generations", json={}, headers=self.admin)
        assert resp.status == 201, await resp.text()
        return int((await resp.json())["generation"])

    async def put(
        self, gen: int, name: str, data: Any = KB100, *, job: str = JOB, ctype: str = "text/plain"
    ) -> aiohttp.ClientResponse:
        headers = {**self.worker, "Fencing-Token": str(gen), "Content-Type": ctype}
        if isinstance(data, bytes) and len(data) > 512 * 1024:
            data = io.BytesIO(data)
        resp: aiohttp.ClientResponse = await self.client.put(
            f"/v1/jobs/{job}/outputs/{name}", data=data, headers=headers
        )
        return resp

    async def upload_url(self, gen: int, name: str) -> aiohttp.ClientResponse:
        resp: aiohttp.ClientResponse = await self.client.post(
            f"/v1/jobs/{JOB}/outputs/{name}/upload-url",
            headers={**self.worker, "Fencing-Token": str(gen)},
        )
        return resp

    async def complete(self, gen: int, outputs: list[str]) -> aiohttp.ClientResponse:
        resp: aiohttp.ClientResponse = await self.client.post(
            f"/v1/jobs/{JOB}/complete",
            json={"outputs": outputs, "result": None},
            headers={**self.worker, "Fencing-Token": str(gen)},
        )
        return resp

    async def audit(self) -> list[dict[str, Any]]:
        resp = await self.client.get("/v1/audit/rejections", headers=self.admin)
        assert resp.status == 200, await resp.text()
        items: list[dict[str, Any]] = (await resp.json())["items"]
        return items


async def tenants(
    make_gateway: Any, objects: Objects, acme: dict[str, int], **outputs: Any
) -> tuple[Tenant, Tenant]:
    gateway: Gateway = await make_gateway(
        auth=AUTH,
        outputs={**objects.section, "sweep_interval_seconds": 0, "max_bytes": 1024 * 1024,
                 **outputs},
        quotas={"tenants": {"acme": acme}},
    )  # fmt: skip
    return Tenant(gateway, "acme"), Tenant(gateway, "globex")


async def refused(resp: aiohttp.ClientResponse, quota: str) -> dict[str, Any]:
    """``resp`` is the 429 of ``quota``, with its Retry-After."""
    body: dict[str, Any] = await resp.json()
    assert (resp.status, body.get("code"), body.get("quota")) == (429, "quota_exceeded", quota)
    assert resp.headers["Retry-After"] == "5"  # quotas.retry_after_seconds
    return body


def charged(redis_sync: redis.Redis, tenant: str) -> tuple[int, int]:
    """(bytes, objects) the ledger charges ``tenant`` with, read straight from Redis."""
    p = "fg:quota:{" + tenant + "}"
    objects = int(redis_sync.hlen(f"{p}:out")) + int(redis_sync.hlen(f"{p}:out_up"))
    return int(redis_sync.get(f"{p}:out_bytes") or 0), objects


async def claim_ended(redis_sync: redis.Redis, tenant: str, gen: int, name: str) -> None:
    """Wait until the gateway abandoned the upload of ``name`` (its claim's deadline is 0)."""
    outputs_key = f"fg:{{{tenant}/{JOB}}}:outputs"
    for _ in range(750):
        entry = redis_sync.hget(outputs_key, f"{gen}/{name}")
        if entry is not None and '"deadline":0' in entry:
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the abandoned upload's claim was never ended")


async def short_put(tenant: Tenant, gen: int, name: str, declared: int, sent: bytes) -> None:
    """A PUT written by hand whose body stops short of its Content-Length: the client
    goes away mid-upload."""
    reader, writer = await asyncio.open_connection(tenant.client.host, tenant.client.port)
    writer.write(
        (
            f"PUT /v1/jobs/{JOB}/outputs/{name} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Authorization: {tenant.worker['Authorization']}\r\n"
            f"Fencing-Token: {gen}\r\nContent-Type: text/plain\r\n"
            f"Content-Length: {declared}\r\n\r\n"
        ).encode()
        + sent
    )
    await writer.drain()
    await asyncio.sleep(0.2)
    writer.write_eof()
    with contextlib.suppress(ConnectionError, TimeoutError):
        await asyncio.wait_for(reader.read(), 5)
    writer.close()


# -- the cap -----------------------------------------------------------------------------


async def test_output_bytes_cap_refuses_one_tenant_with_429_and_not_the_other(
    make_gateway: Any, objects: Objects, redis_sync: redis.Redis
) -> None:
    acme, globex = await tenants(make_gateway, objects, {"output_bytes": 300_000})
    gen = await acme.register()
    for name in ("a", "b", "c"):
        assert (await acme.put(gen, name)).status == 201
    over = await acme.put(gen, "d")
    body = await refused(over, "output_bytes")
    assert body["limit"] == 300_000
    assert f"acme/{JOB}/g1/d" not in objects.stored()  # nothing stored
    assert charged(redis_sync, "acme") == (300_000, 3)

    async def chunks() -> AsyncIterator[bytes]:  # chunked: refused while it streams
        for _ in range(10):
            yield b"z" * 10_000

    assert (await acme.put(gen, "e", chunks())).status == 429
    assert f"acme/{JOB}/g1/e" not in objects.stored()
    assert charged(redis_sync, "acme") == (300_000, 3)

    # the other tenant is untouched (default caps: 1 GiB, 10,000 objects)
    ggen = await globex.register()
    assert (await globex.put(ggen, "a", b"g" * 600_000)).status == 201
    assert charged(redis_sync, "globex") == (600_000, 1)

    audit = [e for e in await acme.audit() if e["reason"] == "quota_exceeded"]
    steps = {e["step"] for e in audit}  # one a second: e's comes only if a second passed
    assert "output:d" in steps and steps <= {"output:d", "output:e"}, audit
    assert not [e for e in await globex.audit() if e["reason"] == "quota_exceeded"]
    assert await metric(acme.gw, 'fencegate_outputs_total{outcome="quota_exceeded"}') == 2


async def test_a_chunked_upload_takes_what_the_tenant_has_left(
    make_gateway: Any, objects: Objects, redis_sync: redis.Redis
) -> None:
    acme, _ = await tenants(make_gateway, objects, {"output_bytes": 150_000})
    gen = await acme.register()
    assert (await acme.put(gen, "a")).status == 201

    async def chunks(n: int) -> AsyncIterator[bytes]:
        for _ in range(n):
            yield b"c" * 10_000

    # 50,000 bytes are left: a chunked body of 40,000 fits though it reserves step by step
    resp = await acme.put(gen, "b", chunks(4))
    assert resp.status == 201, await resp.text()
    assert charged(redis_sync, "acme") == (140_000, 2)
    assert (await acme.put(gen, "c", chunks(2))).status == 429  # 20,000 > 10,000 left
    assert charged(redis_sync, "acme") == (140_000, 2)


async def test_output_objects_cap_counts_objects_not_uploads(
    make_gateway: Any, objects: Objects, redis_sync: redis.Redis
) -> None:
    acme, _ = await tenants(make_gateway, objects, {"output_objects": 2})
    gen = await acme.register()
    assert (await acme.put(gen, "a", b"1")).status == 201
    assert (await acme.put(gen, "b", b"2")).status == 201
    await refused(await acme.put(gen, "c", b"3"), "output_objects")
    # uploading an object already stored again adds no object
    assert (await acme.put(gen, "a", b"one, again")).status == 201
    assert charged(redis_sync, "acme") == (len(b"one, again") + 1, 2)
    assert sorted(k for k in objects.stored() if k.startswith("acme/")) == [
        f"acme/{JOB}/g1/a",
        f"acme/{JOB}/g1/b",
    ]


# -- the zombie ----------------------------------------------------------------------------


async def test_a_re_sent_upload_of_the_same_name_is_charged_once(
    make_gateway: Any, objects: Objects, redis_sync: redis.Redis
) -> None:
    acme, _ = await tenants(make_gateway, objects, {"output_bytes": 250_000})
    gen = await acme.register()
    for _ in range(3):  # a worker whose replies were lost sends it again, and again
        assert (await acme.put(gen, "report")).status == 201
    assert charged(redis_sync, "acme") == (100_000, 1)
    assert (await acme.put(gen, "other")).status == 201
    await refused(await acme.put(gen, "third"), "output_bytes")  # the cap is real

    # a stale generation is refused by the fence and charged nothing
    assert await acme.register() == 2
    zombie = await acme.put(gen, "late")
    assert (zombie.status, (await zombie.json())["code"]) == (409, "stale_generation")
    assert charged(redis_sync, "acme") == (200_000, 2)


# -- given back ------------------------------------------------------------------------------


async def test_bytes_are_given_back_after_a_failed_upload_and_the_sweep(
    make_gateway: Any, objects: Objects, redis_sync: redis.Redis
) -> None:
    acme, _ = await tenants(make_gateway, objects, {"output_bytes": 250_000})
    gen = await acme.register()
    assert (await acme.put(gen, "a")).status == 201
    assert (await acme.put(gen, "b")).status == 201
    # an upload whose client goes away half-way reserves its Content-Length, then gives it
    # back: nothing of it is stored
    await short_put(acme, gen, "c", 50_000, b"partial" * 100)
    await claim_ended(redis_sync, "acme", gen, "c")
    for _ in range(100):
        if charged(redis_sync, "acme") == (200_000, 2):
            break
        await asyncio.sleep(0.02)
    assert charged(redis_sync, "acme") == (200_000, 2)
    assert (await acme.put(gen, "d", b"d" * 50_000)).status == 201  # fits: 250,000
    assert (await acme.put(gen, "e", b"e")).status == 429

    # the takeover makes generation 1's objects stale; the sweep deletes them and gives
    # their bytes back
    gen = await acme.register()
    assert (await acme.put(gen, "a")).status == 429
    service = acme.gw.app[OUTPUTS]
    report = await sweep(service, grace_seconds=0, metrics=acme.gw.app[K.METRICS])
    assert sorted(o.key.rsplit("/", 1)[1] for o in report.deleted) == ["a", "b", "d"]
    assert charged(redis_sync, "acme") == (0, 0)
    assert (await acme.put(gen, "a", b"a" * 200_000)).status == 201
    assert charged(redis_sync, "acme") == (200_000, 1)


async def test_objects_deleted_behind_the_gateway_are_given_back_at_the_cap(
    make_gateway: Any, objects: Objects, redis_sync: redis.Redis
) -> None:
    acme, _ = await tenants(make_gateway, objects, {"output_bytes": 200_000})
    gen = await acme.register()
    assert (await acme.put(gen, "a")).status == 201
    assert (await acme.put(gen, "b")).status == 201
    # an operator (or a lifecycle rule) removes an object without the gateway
    key = f"acme/{JOB}/g1/a"
    if objects.root is not None:
        (objects.root / key).unlink()
    else:
        assert objects.moto is not None
        objects.moto.client().delete_object(Bucket=objects.bucket, Key=objects.prefix + key)
    assert charged(redis_sync, "acme") == (200_000, 2)  # not seen until the cap is reached
    resp = await acme.put(gen, "c")  # at the cap: reconciled, then it fits
    assert resp.status == 201, await resp.text()
    assert charged(redis_sync, "acme") == (200_000, 2)


async def test_a_reservation_whose_stage_is_on_its_way_is_not_given_back(
    make_gateway: Any, objects: Objects, redis_sync: redis.Redis
) -> None:
    """An upload reserves its bytes, then stages (the outputs-hash entry a reconciliation
    checks a reservation against). A reconciliation run by another upload at the cap in
    between must not take the fresh reservation for one whose upload ended: that let a third
    100 kB upload under a 250 kB cap. A reservation without a stage that is older than the
    grace is given back."""
    acme, _ = await tenants(make_gateway, objects, {"output_bytes": 250_000})
    ledger = acme.gw.app[OUTPUTS].ledger
    key = f"acme/{JOB}/g1/fresh"
    now_ms = acme.gw.app[K.STORE].redis_clock_ms()
    fresh = new_upload_id(now_ms)
    old = new_upload_id(now_ms - RESERVATION_GRACE_MS - 1000)
    for upload in (fresh, old):
        assert await ledger.reserve("acme", key, upload, 100_000, 250_000, 0) > 0
    assert charged(redis_sync, "acme") == (200_000, 2)
    assert await ledger.reconcile("acme") == 1  # the old one only
    assert charged(redis_sync, "acme") == (100_000, 1)
    assert redis_sync.hkeys("fg:quota:{acme}:out_up") == [f"{key} {fresh}"]


async def test_a_reservation_whose_upload_was_just_recorded_is_not_given_back(
    make_gateway: Any, objects: Objects, redis_sync: redis.Redis
) -> None:
    """An upload writes its object, records it, then settles its reservation. A
    reconciliation run by another upload at the cap in between, whose listing came before the
    object was written, gave the reservation back without charging the object: a third 100 kB
    upload fitted under a 250 kB cap until the settlement (two gateway processes, CI). A
    recorded upload's reservation older than the grace (its settlement lost) is given back."""
    acme, _ = await tenants(make_gateway, objects, {"output_bytes": 250_000})
    ledger = acme.gw.app[OUTPUTS].ledger
    now_ms = acme.gw.app[K.STORE].redis_clock_ms()
    outputs = JobKeys("acme", JOB).outputs
    for name, recorded_ms in (("now", now_ms), ("lost", now_ms - RESERVATION_GRACE_MS - 1000)):
        key = f"acme/{JOB}/g1/{name}"
        upload = new_upload_id(recorded_ms - 1000)
        assert await ledger.reserve("acme", key, upload, 100_000, 250_000, 0) > 0
        entry = {"state": "recorded", "key": key, "size": 100_000, "upload": upload}
        entry |= {"staged_ms": recorded_ms - 500, "recorded_ms": recorded_ms, "deadline": 0}
        redis_sync.hset(outputs, f"1/{name}", json.dumps(entry))  # its object: not listed yet
    assert charged(redis_sync, "acme") == (200_000, 2)
    assert await ledger.reconcile("acme") == 1  # the lost settlement's only
    assert charged(redis_sync, "acme") == (100_000, 1)
    assert [f.split(" ")[0] for f in redis_sync.hkeys("fg:quota:{acme}:out_up")] == [
        f"acme/{JOB}/g1/now"
    ]


# -- pre-signed uploads ----------------------------------------------------------------------


@pytest.mark.parametrize("objects", ["s3"], indirect=True)  # only S3 signs URLs
async def test_a_presigned_upload_reserves_max_bytes_and_settles_at_completion(
    make_gateway: Any, objects: Objects, redis_sync: redis.Redis
) -> None:
    limit = 1024 * 1024
    acme, _ = await tenants(make_gateway, objects, {"output_bytes": limit + limit // 2})
    gen = await acme.register()
    issued = await acme.upload_url(gen, "a")
    assert issued.status == 201
    assert charged(redis_sync, "acme") == (limit, 1)  # the URL's bound, reserved
    # a new URL for the same output writes a staging key of its own, and the first one may
    # still write its own: nothing is taken over
    await refused(await acme.upload_url(gen, "a"), "output_bytes")
    await refused(await acme.upload_url(gen, "b"), "output_bytes")
    url = (await issued.json())["url"]
    async with aiohttp.ClientSession() as direct, direct.put(url, data=b"p" * 1000) as up:
        assert up.status == 200
    done = await acme.complete(gen, ["a"])
    assert done.status == 200, await done.text()
    # copied to the output's key (charged at its size), the staged object deleted and its
    # URL's reservation given back
    assert charged(redis_sync, "acme") == (1000, 1)
    assert objects.stored() == {f"acme/{JOB}/g1/a": 1000}


@pytest.mark.parametrize("objects", ["s3"], indirect=True)
async def test_an_oversized_presigned_upload_is_deleted_and_given_back(
    make_gateway: Any, objects: Objects, redis_sync: redis.Redis
) -> None:
    acme, _ = await tenants(make_gateway, objects, {"output_bytes": 4 * 1024 * 1024})
    gen = await acme.register()
    url = (await (await acme.upload_url(gen, "a")).json())["url"]
    assert charged(redis_sync, "acme") == (1024 * 1024, 1)
    big = b"x" * (1024 * 1024 + 1)
    async with aiohttp.ClientSession() as direct, direct.put(url, data=io.BytesIO(big)) as up:
        assert up.status == 200  # the store takes it; the completion refuses it
    assert (await acme.complete(gen, ["a"])).status == 413
    assert f"acme/{JOB}/g1/a" not in objects.stored()
    assert charged(redis_sync, "acme") == (0, 0)


# -- several gateways ------------------------------------------------------------------------


def _serve(tmp_path: Path, redis_url: str, objects: Objects, extra: str) -> tuple[Any, str]:
    """A `fencegate serve` process on the same Redis and object store (tenant default)."""
    port = free_port()
    cfg = write_config(tmp_path, redis_url, objects)
    cfg.write_text(cfg.read_text() + extra)
    with (tmp_path / "serve.log").open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", "serve", "--config", str(cfg), "--port", str(port)],
            stdout=subprocess.DEVNULL, stderr=log, env=dict(os.environ),
        )  # fmt: skip
    return proc, f"http://127.0.0.1:{port}"


async def test_two_gateway_processes_share_one_cap(
    make_gateway: Any, objects: Objects, redis_url: str, redis_sync: redis.Redis, tmp_path: Path
) -> None:
    gw = await make_gateway(
        outputs={**objects.section, "sweep_interval_seconds": 0},
        quotas={"output_bytes": 250_000},
    )
    resp = await gw.register(JOB)
    gen = int((await resp.json())["generation"])
    proc, url = _serve(tmp_path, redis_url, objects, "[quotas]\noutput_bytes = 250000\n")
    try:
        async with aiohttp.ClientSession() as s:
            for _ in range(300):
                try:
                    async with s.get(url + "/healthz") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.05)

            async def there(name: str) -> int:
                h = {"Fencing-Token": str(gen)}
                async with s.put(f"{url}/v1/jobs/{JOB}/outputs/{name}", data=KB100, headers=h) as r:
                    return r.status

            async def here(name: str) -> int:
                h = {"Fencing-Token": str(gen)}
                r = await gw.client.put(f"/v1/jobs/{JOB}/outputs/{name}", data=KB100, headers=h)
                return r.status

            answers = await asyncio.gather(
                *(there(f"p{i}") for i in range(3)), *(here(f"q{i}") for i in range(3))
            )
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert sorted(answers) == [201, 201, 429, 429, 429, 429]
    assert charged(redis_sync, "default") == (200_000, 2)
    assert len([k for k in objects.stored() if k.startswith("default/")]) == 2


async def test_a_gateway_killed_mid_upload_holds_one_reservation_until_its_deadline(
    make_gateway: Any, objects: Objects, redis_url: str, redis_sync: redis.Redis, tmp_path: Path
) -> None:
    """A `fencegate serve` SIGKILLed between the reservation and the settlement: what it
    reserved (the upload's Content-Length) stays charged, no more, and is given back by
    the reconciliation once the upload's deadline has passed."""
    gw = await make_gateway(
        outputs={**objects.section, "sweep_interval_seconds": 0},
        quotas={"output_bytes": 600_000},
    )
    gen = int((await (await gw.register(JOB)).json())["generation"])
    extra = "upload_timeout_seconds = 3\n[quotas]\noutput_bytes = 600000\n"
    proc, url = _serve(tmp_path, redis_url, objects, extra)
    try:
        async with aiohttp.ClientSession() as s:
            for _ in range(300):
                try:
                    async with s.get(url + "/healthz") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.05)
            host, port = url.removeprefix("http://").split(":")
            _, writer = await asyncio.open_connection(host, int(port))
            writer.write(
                (
                    f"PUT /v1/jobs/{JOB}/outputs/big HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                    f"Fencing-Token: {gen}\r\nContent-Length: 500000\r\n\r\n"
                ).encode()
                + b"k" * 100_000
            )
            await writer.drain()
            outputs_key = f"fg:{{default/{JOB}}}:outputs"
            for _ in range(200):  # reserved and staged: the bytes are streaming
                if redis_sync.hexists(outputs_key, f"{gen}/big"):
                    break
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.2)
            proc.send_signal(signal.SIGKILL)
            assert proc.wait(10) == -9
            writer.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert charged(redis_sync, "default") == (500_000, 1)  # the bound: its Content-Length
    h = {"Fencing-Token": str(gen)}
    first = await gw.client.put(f"/v1/jobs/{JOB}/outputs/next", data=KB100 * 2, headers=h)
    assert first.status == 429  # its upload's claim is still running: kept
    await asyncio.sleep(3.2)  # the killed upload's deadline passes
    again = await gw.client.put(f"/v1/jobs/{JOB}/outputs/next", data=KB100 * 2, headers=h)
    assert again.status == 201, await again.text()
    assert charged(redis_sync, "default") == (200_000, 1)
