"""A proxied response over ``max_response_bytes``: streamed to the client while it is hashed,
recorded by digest and size, consistent whether the client reads it all, hangs up mid-stream,
or the upstream breaks off."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from tests.conftest import Gateway
from tests.support.processes import Serve, write_config
from tests.support.proxying import KEYS, auth, fenced, register

CHUNK = bytes(range(256)) * 256  # 64 KiB
CHUNKS = 16  # a 1 MiB body, against a 1 KiB cap
BODY = CHUNK * CHUNKS


@dataclass
class BigUpstream:
    """Answers a 1 MiB body: the first chunk, then (once ``go`` is set) the rest, or
    (``broken``) a closed connection instead."""

    url: str = ""
    calls: int = 0
    broken: bool = False
    chunks: int = CHUNKS
    go: asyncio.Event = field(default_factory=asyncio.Event)
    finished: asyncio.Event = field(default_factory=asyncio.Event)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        self.calls += 1
        resp = web.StreamResponse(
            status=201, headers={"Content-Type": "application/octet-stream", "Request-Id": "big"}
        )
        await resp.prepare(request)
        await resp.write(CHUNK)
        await self.go.wait()
        if self.broken:
            assert request.transport is not None
            request.transport.close()
            return resp
        for _ in range(self.chunks - 1):
            await resp.write(CHUNK)
        await resp.write_eof()
        self.finished.set()
        return resp


@pytest.fixture
async def big() -> AsyncIterator[BigUpstream]:
    up = BigUpstream()
    app = web.Application()
    app.router.add_route("*", "/file", up.handle)
    server = TestServer(app, host="127.0.0.1", port=0)
    await server.start_server()
    up.url = str(server.make_url("")).rstrip("/")
    yield up
    up.go.set()
    await server.close()


@pytest.fixture
async def big_gw(make_gateway: Any, big: BigUpstream, secrets: None) -> Gateway:
    g: Gateway = await make_gateway(
        auth=auth(),
        upstreams={
            "big": {
                "base_url": big.url,
                "tenants": ["acme"],
                "routes": ["POST /file", "GET /file"],
                "credentials_env": {"acme": "PAY_ACME"},
                "allow_private": True,
                "max_response_bytes": 1024,
            }
        },
    )
    return g


async def record(g: Gateway, step: str, until: str) -> dict[str, Any]:
    """The step's record, once its state is ``until`` (the dispatch outlives the client)."""
    for _ in range(200):
        resp = await g.client.get(
            f"/v1/jobs/r/effects/{step}", headers={"Authorization": f"Bearer {KEYS['audit']}"}
        )
        doc: dict[str, Any] = await resp.json()
        if doc.get("state") == until:
            return doc
        await asyncio.sleep(0.05)
    raise AssertionError(f"the step is {doc.get('state')}, not {until}: {doc}")


async def test_a_body_over_the_cap_is_streamed_whole_and_recorded_by_digest(
    big_gw: Gateway, big: BigUpstream
) -> None:
    big.go.set()
    gen = await register(big_gw, "r")
    resp = await big_gw.client.post("/proxy/big/file", data=b"x", headers=fenced("r", "s", gen))
    assert resp.status == 201
    assert (resp.headers["Fencegate-Outcome"], resp.headers["Request-Id"]) == ("forwarded", "big")
    assert resp.headers["Fencegate-Generation"] == str(gen) and resp.headers["X-Request-Id"]
    assert await resp.read() == BODY
    doc = await record(big_gw, "s", "succeeded")
    result = doc["result"]
    assert (result["size"], result["sha256"]) == (len(BODY), hashlib.sha256(BODY).hexdigest())
    assert result["omitted"] is True and result["streamed"] is True and "body" not in result
    again = await big_gw.client.post("/proxy/big/file", data=b"x", headers=fenced("r", "s", gen))
    assert (again.status, (await again.json())["code"]) == (502, "replay_unavailable")
    assert big.calls == 1


async def test_a_client_hanging_up_mid_stream_leaves_the_whole_bodys_record(
    big_gw: Gateway, big: BigUpstream
) -> None:
    gen = await register(big_gw, "r")
    reader, writer = await asyncio.open_connection("127.0.0.1", big_gw.client.port)
    headers = fenced("r", "s", gen)
    lines = ["POST /proxy/big/file HTTP/1.1", "Host: 127.0.0.1", "Content-Length: 1",
             "Content-Type: application/octet-stream",
             *(f"{k}: {v}" for k, v in headers.items())]  # fmt: skip
    writer.write(("\r\n".join(lines) + "\r\n\r\nx").encode())
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    assert head.startswith(b"HTTP/1.1 201") and b"Fencegate-Outcome: forwarded" in head
    assert await asyncio.wait_for(reader.read(1024), 10)  # the stream has begun
    writer.close()  # the client hangs up with the body mid-way
    await writer.wait_closed()
    big.go.set()  # the upstream sends the rest
    await asyncio.wait_for(big.finished.wait(), 10)
    doc = await record(big_gw, "s", "succeeded")  # the effect happened: recorded as it was
    result = doc["result"]
    assert (result["status"], result["size"]) == (201, len(BODY))
    assert result["sha256"] == hashlib.sha256(BODY).hexdigest()
    again = await big_gw.client.post("/proxy/big/file", data=b"x", headers=headers)
    body = await again.json()
    assert (again.status, body["code"], body["size"]) == (502, "replay_unavailable", len(BODY))
    assert big.calls == 1  # never a second send


async def test_a_client_that_stops_reading_never_slows_the_upstream_or_its_record(
    make_gateway: Any, big: BigUpstream, secrets: None
) -> None:
    """A client that takes nothing more (and keeps its connection) falls behind: it is cut
    off, and the upstream's body is read at the upstream's pace, well within its timeout."""
    big.chunks = 512  # 32 MiB: more than the sockets between them hold
    g: Gateway = await make_gateway(
        auth=auth(),
        upstreams={"big": {
            "base_url": big.url, "tenants": ["acme"], "routes": ["POST /file"],
            "credentials_env": {"acme": "PAY_ACME"}, "allow_private": True,
            "max_response_bytes": 1024, "timeout_seconds": 5,
        }},
    )  # fmt: skip
    gen = await register(g, "r")
    reader, writer = await asyncio.open_connection("127.0.0.1", g.client.port, limit=1024)
    lines = ["POST /proxy/big/file HTTP/1.1", "Host: 127.0.0.1", "Content-Length: 1",
             "Content-Type: application/octet-stream",
             *(f"{k}: {v}" for k, v in fenced("r", "s", gen).items())]  # fmt: skip
    writer.write(("\r\n".join(lines) + "\r\n\r\nx").encode())
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    assert head.startswith(b"HTTP/1.1 201")
    big.go.set()  # the upstream sends 32 MiB; the client reads nothing more
    await asyncio.wait_for(big.finished.wait(), 4)  # at its own pace, not the client's
    doc = await record(g, "s", "succeeded")
    assert doc["result"]["size"] == 512 * len(CHUNK)
    got = len(head)
    while chunk := await asyncio.wait_for(reader.read(1 << 20), 10):
        got += len(chunk)  # what reached the client before it was cut off
    assert got < 512 * len(CHUNK)
    writer.close()
    assert big.calls == 1


async def test_an_upstream_breaking_off_mid_stream_is_unknown_and_the_client_sees_it_cut(
    big_gw: Gateway, big: BigUpstream
) -> None:
    big.broken = True
    gen = await register(big_gw, "r")
    url = big_gw.client.make_url("/proxy/big/file")
    async with (
        aiohttp.ClientSession() as http,
        http.post(url, data=b"x", headers=fenced("r", "s", gen)) as resp,
    ):
        assert resp.status == 201  # the stream had begun
        big.go.set()
        with pytest.raises(aiohttp.ClientPayloadError):  # never a complete, short body
            await resp.read()
    await record(big_gw, "s", "unknown")  # sent, and no complete answer: an operator resolves it
    again = await big_gw.client.post("/proxy/big/file", data=b"x", headers=fenced("r", "s", gen))
    assert (again.status, (await again.json())["code"]) == (409, "outcome_unknown")
    assert big.calls == 1


async def test_a_read_over_the_cap_is_streamed_too(big_gw: Gateway, big: BigUpstream) -> None:
    big.go.set()
    resp = await big_gw.client.get(
        "/proxy/big/file", headers={"Authorization": f"Bearer {KEYS['acme']}"}
    )
    assert resp.status == 201 and await resp.read() == BODY
    assert "Fencegate-Generation" not in resp.headers  # a read: nothing fenced or recorded
    assert resp.headers["Fencegate-Outcome"] == "forwarded"


async def test_through_fencegate_serve_a_hang_up_mid_stream_leaves_the_record_and_its_line(
    big: BigUpstream, tmp_path: Path, serves: list[Serve]
) -> None:
    """The same hang-up against a real ``fencegate serve`` (open mode), where aiohttp does
    not cancel the handler of a client that left: the handler ends the stream on a closed
    connection without an error, and the request has its log line."""
    extra = f"""
[upstreams.big]
base_url = "{big.url}"
routes = ["POST /file"]
allow_private = true
max_response_bytes = 1024
"""
    s = Serve(tmp_path, write_config(tmp_path, extra))
    serves.append(s)
    await asyncio.to_thread(s.wait_ready)
    async with aiohttp.ClientSession() as http:
        async with http.post(s.url("/v1/jobs/r/generations"), json={}) as resp:
            assert resp.status == 201, await resp.text()
        reader, writer = await asyncio.open_connection("127.0.0.1", s.port)
        lines = ["POST /proxy/big/file HTTP/1.1", "Host: 127.0.0.1", "Content-Length: 1",
                 "Content-Type: application/octet-stream", "Fencing-Token: 1",
                 "Fencegate-Job: r", "Fencegate-Step: s"]  # fmt: skip
        writer.write(("\r\n".join(lines) + "\r\n\r\nx").encode())
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 201")
        assert await asyncio.wait_for(reader.read(1024), 10)
        writer.close()
        await writer.wait_closed()
        big.go.set()
        await asyncio.wait_for(big.finished.wait(), 10)
        for _ in range(200):
            async with http.get(s.url("/v1/jobs/r/effects/s")) as resp:
                doc = await resp.json()
            if doc.get("state") == "succeeded":
                break
            await asyncio.sleep(0.05)
        assert (doc["state"], doc["result"]["size"]) == ("succeeded", len(BODY))
        assert doc["result"]["sha256"] == hashlib.sha256(BODY).hexdigest()
    for _ in range(100):  # the handler's line follows the record
        log = s.log_path.read_text()
        if "path=/proxy/big/file" in log or '"path": "/proxy/big/file"' in log:
            break
        await asyncio.sleep(0.05)
    line = next(ln for ln in log.splitlines() if "/proxy/big/file" in ln)
    assert "201" in line and "streamed" in line, line
    assert "Traceback" not in log and "unhandled_error" not in log
    assert big.calls == 1
