"""Outputs a tenant cannot make larger or more dangerous than configured: a presigned upload
is bounded by ``outputs.max_bytes`` like a streamed one, and a redirected read never sends a
browser to a page from the object store's origin. S3 only: the file store signs no URLs (a
real S3 server, moto)."""

from __future__ import annotations

import io
from typing import Any

import aiohttp
import pytest

from tests.support.outputs import JOB, Objects, complete, put, register

pytestmark = pytest.mark.parametrize("objects", ["s3"], indirect=True)

PAGE = b"<!doctype html><script>fetch('/steal?c=' + document.cookie)</script>"


async def test_a_presigned_upload_over_max_bytes_is_refused_deleted_and_not_promoted(
    ogw: Any, objects: Objects
) -> None:
    gen = await register(ogw)
    resp = await ogw.client.post(
        f"/v1/jobs/{JOB}/outputs/report/upload-url", headers={"Fencing-Token": str(gen)}
    )
    assert resp.status == 201
    issued = await resp.json()
    limit = ogw.settings.outputs.max_bytes  # 1 MiB in this fixture
    big = b"x" * (limit + 1)
    async with (
        aiohttp.ClientSession() as direct,
        direct.put(issued["url"], data=io.BytesIO(big)) as up,
    ):
        assert up.status == 200  # the store takes it: a signed URL carries no length bound
    key = issued["key"]  # the URL's staging key
    assert objects.stored()[key] == limit + 1

    done = await complete(ogw, gen, ["report"])
    body = await done.json()
    assert (done.status, body.get("code")) == (413, "payload_too_large"), body
    assert objects.stored() == {}  # deleted, nothing copied
    listed = await ogw.client.get(f"/v1/jobs/{JOB}")
    assert [o["state"] for o in (await listed.json())["outputs"]] == ["staged"]  # not recorded
    read = await ogw.client.get(f"/v1/jobs/{JOB}/outputs/report")
    assert read.status == 404  # nothing promoted

    # the claim ended: the same generation uploads a bounded object and completes
    assert (await put(ogw, gen, b"small enough")).status == 201
    again = await complete(ogw, gen, ["report"])
    assert again.status == 200, await again.text()
    assert issued["max_bytes"] == limit  # the upload URL says the bound


async def test_redirected_reads_send_only_inert_types_to_the_store(
    make_gateway: Any, objects: Objects
) -> None:
    gw = await make_gateway(outputs={**objects.section, "redirect_reads": True})
    gen = await register(gw)
    assert (
        await put(gw, gen, PAGE, name="page.html", **{"Content-Type": "text/html"})
    ).status == 201
    png = b"\x89PNG\r\n\x1a\n" + b"\0" * 64
    assert (
        await put(gw, gen, png, name="chart.png", **{"Content-Type": "image/png"})
    ).status == 201
    assert (await complete(gw, gen, ["page.html", "chart.png"])).status == 200

    page = await gw.client.get(f"/v1/jobs/{JOB}/outputs/page.html", allow_redirects=False)
    assert page.status == 200, "an HTML output was redirected to the store's origin"
    assert await page.read() == PAGE
    assert page.headers["Content-Disposition"] == 'attachment; filename="page.html"'
    assert page.headers["X-Content-Type-Options"] == "nosniff"
    csp = page.headers["Content-Security-Policy"]
    assert "sandbox" in csp and "default-src 'none'" in csp

    chart = await gw.client.get(f"/v1/jobs/{JOB}/outputs/chart.png", allow_redirects=False)
    assert chart.status == 307  # an image is still read from the store directly
    async with aiohttp.ClientSession() as direct, direct.get(chart.headers["Location"]) as got:
        assert got.status == 200 and await got.read() == png
