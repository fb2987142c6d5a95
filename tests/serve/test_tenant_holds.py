"""One tenant cannot hold every connection with long-lived requests:
console SSE streams per login and per tenant, uploads per tenant, a minimum upload rate,
and a tenant's share of the connection cap (a real `fencegate serve`, raw sockets). Over a
cap: 429 too_many_held with Retry-After; the other tenant's calls keep working."""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp

from gateway.http.outputs import OUTPUTS
from tests.conftest import Gateway, key_digest
from tests.support.processes import Serve, write_config

ACME_W, ACME_S, ACME_A = "acme-worker", "acme-scheduler", "acme-auditor"
GLOBEX_W, GLOBEX_S, GLOBEX_A = "globex-worker", "globex-scheduler", "globex-auditor"
KEYS = {
    "keys": [
        {"role": role, "sha256": key_digest(key), "tenant": key.split("-")[0]}
        for key, role in (
            (ACME_W, "worker"), (ACME_S, "scheduler"), (ACME_A, "auditor"),
            (GLOBEX_W, "worker"), (GLOBEX_S, "scheduler"), (GLOBEX_A, "auditor"),
        )
    ]
}  # fmt: skip


def bearer(key: str, **more: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", **more}


async def login(gw: Gateway, key: str) -> aiohttp.ClientSession:
    base = str(gw.client.make_url("")).rstrip("/")
    session = aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True))
    async with session.post(
        base + "/console/login",
        data={"key": key, "next": "/console/rejections"},
        headers={"Origin": base},
        allow_redirects=False,
    ) as resp:
        assert resp.status == 303, await resp.text()
    return session


async def test_live_streams_are_capped_per_login_and_per_tenant(make_gateway: Any) -> None:
    gw: Gateway = await make_gateway(
        auth=KEYS, console={"sse_per_session": 2, "sse_per_tenant": 3, "sse_ping_seconds": 0.3}
    )
    url = str(gw.client.make_url("/console/rejections/stream"))
    first, second, other = [await login(gw, k) for k in (ACME_A, ACME_A, GLOBEX_A)]
    held: list[aiohttp.ClientResponse] = []
    try:
        for _ in range(2):
            held.append(resp := await first.get(url))
            assert resp.status == 200
        refused = await first.get(url)  # a third tab of the same login
        assert refused.status == 429 and int(refused.headers["Retry-After"]) >= 1
        assert "console.sse_per_session" in await refused.text()
        held.append(resp := await second.get(url))  # another acme login: the tenant's third
        assert resp.status == 200
        refused = await second.get(url)
        assert refused.status == 429 and "console.sse_per_tenant" in await refused.text()
        for _ in range(2):  # globex is not affected by acme's streams
            held.append(resp := await other.get(url))
            assert resp.status == 200
        held.pop(0).close()  # a closed tab gives its place back (noticed by the ping)
        async with asyncio.timeout(5):
            while (again := await first.get(url)).status == 429:  # noqa: ASYNC110 - retries
                await asyncio.sleep(0.2)
        held.append(again)
        assert again.status == 200
    finally:
        for resp in held:
            resp.close()
        for s in (first, second, other):
            await s.close()


async def _trickle(gw: Gateway, name: str, key: str, stop: asyncio.Event) -> Any:
    async def body() -> AsyncIterator[bytes]:
        yield b"x"
        await stop.wait()
        yield b"y"

    return await gw.client.put(
        f"/v1/jobs/r-{key}/outputs/{name}", data=body(),
        headers=bearer(key, **{"Fencing-Token": "1"}),
    )  # fmt: skip


async def test_uploads_are_capped_per_tenant(make_gateway: Any, tmp_path: Path) -> None:
    gw: Gateway = await make_gateway(
        auth=KEYS,
        outputs={"path": str(tmp_path / "out"), "uploads_per_tenant": 2},
        connections={"body_timeout_seconds": 30},
    )
    for sched, worker in ((ACME_S, ACME_W), (GLOBEX_S, GLOBEX_W)):
        resp = await gw.client.post(
            f"/v1/jobs/r-{worker}/generations", json={"generation": 1}, headers=bearer(sched)
        )
        assert resp.status == 201
    stop = asyncio.Event()
    slow = [asyncio.create_task(_trickle(gw, f"o{i}", ACME_W, stop)) for i in range(2)]
    service = gw.app[OUTPUTS]
    async with asyncio.timeout(5):
        while service.uploads.get("acme", 0) < 2:  # noqa: ASYNC110 - the server's own count
            await asyncio.sleep(0.02)
    third = await gw.client.put(
        f"/v1/jobs/r-{ACME_W}/outputs/o3",
        data=b"z",
        headers=bearer(ACME_W, **{"Fencing-Token": "1"}),
    )
    problem = await third.json()
    assert (third.status, problem.get("code")) == (429, "too_many_held"), problem
    assert problem["limit"] == "outputs.uploads_per_tenant" and third.headers["Retry-After"]
    globex = await gw.client.put(
        f"/v1/jobs/r-{GLOBEX_W}/outputs/g", data=b"fine",
        headers=bearer(GLOBEX_W, **{"Fencing-Token": "1"}),
    )  # fmt: skip
    assert globex.status == 201, await globex.text()
    stop.set()
    assert [r.status for r in await asyncio.gather(*slow)] == [201, 201]
    assert service.uploads == {}


async def test_an_upload_slower_than_the_floor_is_cut_and_its_claim_freed(
    make_gateway: Any, tmp_path: Path
) -> None:
    gw: Gateway = await make_gateway(
        outputs={
            "path": str(tmp_path / "out"),
            "min_upload_bytes_per_second": 100,
            "min_upload_window_seconds": 1,
        },
        connections={"body_timeout_seconds": 30},  # the trickle stays inside the idle limit
    )
    assert (await gw.register("r", generation=1)).status == 201

    async def trickle() -> AsyncIterator[bytes]:
        for _ in range(40):  # one byte every 0.25 s: 4 bytes/s
            yield b"x"
            await asyncio.sleep(0.25)

    started = time.monotonic()
    resp = await gw.client.put(
        "/v1/jobs/r/outputs/o", data=trickle(), headers={"Fencing-Token": "1"}
    )
    problem = await resp.json()
    assert (resp.status, problem.get("code")) == (408, "request_timeout"), problem
    assert "min_upload_bytes_per_second" in problem["detail"]
    assert time.monotonic() - started < 8  # cut after a window or two, not at the 10 s end
    again = await gw.client.put(
        "/v1/jobs/r/outputs/o", data=b"fast", headers={"Fencing-Token": "1"}
    )
    assert again.status == 201, await again.text()  # the cut upload's claim is freed


def _send_head(s: Serve, method: str, path: str, key: str, extra: str = "") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", s.port), timeout=5)
    sock.sendall(
        f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n"
        f"{extra}\r\n".encode()
    )
    return sock


def _response(sock: socket.socket) -> tuple[int, bytes, bytes]:
    """Status, head and body of one response (read by Content-Length)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return 0, data, b""
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"(?i)content-length: *(\d+)", head)[1])  # type: ignore[index]
    while len(body) < length and (chunk := sock.recv(65536)):
        body += chunk
    return int(head.split()[1]), head, body


def test_a_tenant_gets_its_share_of_the_connection_cap(tmp_path: Path, serves: list[Serve]) -> None:
    auth = "".join(
        f'[[auth.keys]]\nrole = "{k["role"]}"\nsha256 = "{k["sha256"]}"\ntenant = "{k["tenant"]}"\n'
        for k in KEYS["keys"]
    )
    cfg = write_config(
        tmp_path,
        "[connections]\nmax = 16\nmax_per_tenant = 4\nbody_timeout_seconds = 30\n"
        "idle_timeout_seconds = 30\n"
        f'[outputs]\npath = "{tmp_path / "out"}"\nuploads_per_tenant = 0\n'
        "min_upload_bytes_per_second = 0\n" + auth,
    )
    s = Serve(tmp_path, cfg)
    serves.append(s)
    s.wait_ready()
    assert s.call("POST", "/v1/jobs/r/generations", {"generation": 1}, bearer(ACME_S))[0] == 201
    # acme holds four connections with uploads that never end (one byte so far)
    held = [
        _send_head(s, "PUT", f"/v1/jobs/r/outputs/o{i}", ACME_W,
                   "Fencing-Token: 1\r\nContent-Length: 1000000\r\n")
        for i in range(4)
    ]  # fmt: skip
    for sock in held:
        sock.sendall(b"x")
    time.sleep(0.5)
    with _send_head(s, "GET", "/v1/jobs/r", ACME_S) as fifth:
        status, head, body = _response(fifth)
        assert status == 429 and b"too_many_held" in body, (head, body)
        assert re.search(rb"(?i)retry-after: *\d", head) and b"connections.max_per_tenant" in body
        assert fifth.recv(1) == b""  # closed
    for i in range(3):  # globex is served meanwhile
        assert s.call("POST", f"/v1/jobs/g{i}/generations", {}, bearer(GLOBEX_S))[0] == 201
    for sock in held:
        sock.close()
    # keep-alive connections: at the share, acme's own idle one is closed for the new one
    idle = []
    for _ in range(6):
        sock = _send_head(s, "GET", "/v1/jobs/r", ACME_S)
        assert _response(sock)[0] == 200
        idle.append(sock)
    time.sleep(0.3)
    alive = []
    for sock in idle:
        with contextlib.suppress(OSError):
            sock.sendall(
                b"GET /v1/jobs/r HTTP/1.1\r\nHost: x\r\n"
                b"Authorization: Bearer acme-scheduler\r\n\r\n"
            )
            alive.append(_response(sock)[0] == 200)
            continue
        alive.append(False)
    assert alive == [False, False, True, True, True, True], alive
    for sock in idle:
        sock.close()
