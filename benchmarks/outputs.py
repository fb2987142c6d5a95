"""Bench rows of attempt-scoped outputs (issue 16), run by ``benchmarks.run`` (make bench):

  O1  a 1 MiB output upload through the gateway (stage, streamed to the file store with
      sha256, record) followed by the fenced completion that promotes it: one job each
  L6  its floor: a bare aiohttp server that streams the same 1 MiB PUT to a file while
      hashing it, then answers a small JSON POST (the completion's round trip), same
      load generator, same pinning

Reported like the other rows (req/s where one "request" is upload + completion, p50/p99);
``benchmarks.run`` adds the ratio O1/L6. Measurements, not tests.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from benchmarks.loadgen import LeanClient

OUTPUT_BYTES = 1024 * 1024
PAYLOAD = bytes(range(256)) * (OUTPUT_BYTES // 256)

FLOOR = """
import asyncio, hashlib, os, sys
from aiohttp import web
root = sys.argv[2]
async def put(request):
    digest, n = hashlib.sha256(), 0
    path = os.path.join(root, request.match_info["job"])
    with open(path + ".tmp", "wb") as f:
        async for chunk in request.content.iter_chunked(256 * 1024):
            digest.update(chunk); n += len(chunk); f.write(chunk)
    os.replace(path + ".tmp", path)
    return web.json_response({"size": n, "sha256": digest.hexdigest()}, status=201)
async def done(request):
    await request.read()
    return web.json_response({"ok": True})
app = web.Application(client_max_size=4 * 1024 * 1024)
app.router.add_put("/v1/jobs/{job}/outputs/report", put)
app.router.add_post("/v1/jobs/{job}/complete", done)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)
"""

Measure = Callable[..., Awaitable[dict[str, Any]]]


def _start_floor(workdir: Path) -> tuple[subprocess.Popen[bytes], int]:
    from gateway.store.embedded import free_port

    port = free_port()
    root = workdir / "floor-outputs"
    root.mkdir(exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-c", FLOOR, str(port), str(root)])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=1)
        except urllib.error.HTTPError:
            return proc, port  # it answers (404): up
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("the L6 floor server did not come up")


def _put_head(job: str, token: str) -> bytes:
    return (
        f"PUT /v1/jobs/{job}/outputs/report HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Length: {OUTPUT_BYTES}\r\nContent-Type: application/pdf\r\n"
        f"Fencing-Token: {token}\r\n\r\n"
    ).encode()


def _calls(client: LeanClient, jobs: list[str]) -> Callable[[int], Awaitable[None]]:
    heads = [_put_head(j, "1") for j in jobs]
    completes = [
        LeanClient.build(
            "POST", f"/v1/jobs/{j}/complete", {"outputs": ["report"], "result": {"pages": 7}},
            {"Fencing-Token": "1"},
        )
        for j in jobs
    ]  # fmt: skip

    async def call(i: int) -> None:
        status, answer = await client.send(heads[i] + PAYLOAD)
        assert status == 201, (status, answer[:200])
        status, answer = await client.send(completes[i])
        assert status == 200, (status, answer[:200])

    return call


async def output_rows(
    gw_port: int,
    workdir: Path,
    run_id: str,
    n: int,
    measure: Measure,
    pids: list[int],
    pin: Callable[[int], None],
) -> list[dict[str, Any]]:
    """O1 against the running gateway, then L6 on its own server (``pin`` places it)."""
    count, concurrency = min(n, 300), 8
    jobs = [f"bench-{run_id}-out-{i}" for i in range(count)]
    gw = LeanClient("127.0.0.1", gw_port)
    rows: list[dict[str, Any]] = []
    try:
        register = [LeanClient.build("POST", f"/v1/jobs/{j}/generations", {}) for j in jobs]

        async def reg(i: int) -> None:
            status, answer = await gw.send(register[i])
            assert status == 201, (status, answer[:200])

        await measure("register outputs", count, concurrency, reg)
        warm = [f"bench-{run_id}-out-warm-{i}" for i in range(20)]
        for j in warm:
            await gw.send(LeanClient.build("POST", f"/v1/jobs/{j}/generations", {}))
        await measure("warm-up", len(warm), 4, _calls(gw, warm))
        rows.append(
            await measure("O1 output 1 MiB upload + completion", count, concurrency,
                          _calls(gw, jobs), pids)
        )  # fmt: skip
    finally:
        gw.close()
    rows.append(await _floor(workdir, jobs, count, concurrency, measure, pin))
    return rows


async def _floor(
    workdir: Path, jobs: list[str], count: int, concurrency: int, measure: Measure,
    pin: Callable[[int], None],
) -> dict[str, Any]:  # fmt: skip
    proc, port = await asyncio.to_thread(_start_floor, workdir)
    try:
        pin(proc.pid)
        client = LeanClient("127.0.0.1", port)
        try:
            await measure("warm-up", 20, 4, _calls(client, jobs[:20]))
            return await measure(
                "L6 bare aiohttp 1 MiB PUT to a file + JSON POST", count, concurrency,
                _calls(client, jobs), [proc.pid],
            )  # fmt: skip
        finally:
            client.close()
    finally:
        proc.terminate()
        proc.wait(10)
