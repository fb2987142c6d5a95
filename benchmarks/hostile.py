"""Hostile load, bounded and on loopback only: does tenant B keep being served while
tenant A attacks?

    python -m benchmarks.hostile [--seconds 20] [--idle 1200] [--slow-bodies 100]   (make hostile)

Starts ``fencegate serve`` (embedded durable Redis) with two tenants and a webhook
receiver in this process that answers tenant B at once and holds each of tenant A's
requests for 5 s (a slow downstream). For ``--seconds``, tenant A floods async effect
calls with ~200 KB payloads (each held in Redis for the relay), holds ``--idle`` idle
sockets open (re-opened when the gateway closes them) and ``--slow-bodies`` requests whose
body never arrives; meanwhile tenant B makes synchronous effect calls, 4 at a time, each
with a 3 s timeout. Prints one JSON summary: B's calls, failures and p50/p99 latency during
the flood, A's answers by status, every 5xx seen, and Redis's peak ``used_memory``.
Exit status 1 if B had a failure or anything answered 5xx.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import redis.asyncio as aioredis
from aiohttp import web

from gateway.store.embedded import free_port, socket_of

KEYS = {"a": "hostile-tenant-a-key", "b": "hostile-tenant-b-key"}


def _config(tmp: Path, hook: str, payload_cap: int) -> Path:
    keys = "".join(
        f'[[auth.keys]]\nrole = "admin"\ntenant = "{t}"\n'
        f'sha256 = "{hashlib.sha256(k.encode()).hexdigest()}"\n'
        for t, k in KEYS.items()
    )
    cfg = tmp / "hostile.toml"
    cfg.write_text(
        f"""
[server]
request_log = "problems"
[redis]
data_dir = "{tmp / "data"}"
[connections]
max = 4096
idle_timeout_seconds = 5
body_timeout_seconds = 3
[bulkheads]
connections_per_pool = 8
pool_wait_seconds = 1
[quotas]
payload_bytes = {payload_cap}
[adapters.hook]
type = "webhook"
url = "{hook}"
timeout_seconds = 8
{keys}"""
    )
    return cfg


class Receiver:
    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()

    async def handle(self, request: web.Request) -> web.Response:
        await request.read()
        tenant = "a" if "a-" in request.headers.get("Idempotency-Key", "") else "b"
        self.counts[tenant] += 1
        if tenant == "a":
            await asyncio.sleep(5)
        return web.json_response({"ok": True})


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _hostile(seconds: float, idle: int, slow_bodies: int, payload_cap: int) -> dict[str, Any]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    receiver = Receiver()
    app = web.Application()
    app.router.add_post("/hook", receiver.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    hook_port = free_port()
    await web.TCPSite(runner, "127.0.0.1", hook_port).start()
    tmp = Path(tempfile.mkdtemp(prefix="fg-hostile-"))
    port = free_port()
    log = (tmp / "serve.log").open("w+")
    proc = subprocess.Popen(  # noqa: ASYNC220 - once, at start
        [sys.executable, "-m", "gateway", "serve", "--port", str(port), "--config",
         str(_config(tmp, f"http://127.0.0.1:{hook_port}/hook", payload_cap))],
        stdout=log, stderr=subprocess.STDOUT, cwd=tmp,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    stop = asyncio.Event()
    statuses: dict[str, Counter[int]] = {"a": Counter(), "b": Counter()}
    five: list[str] = []
    b_latency: list[float] = []
    b_failures: list[str] = []
    peak_memory = 0
    held = [0]  # the most idle sockets held open at once
    sockets: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    try:
        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=15)
        ) as http:
            deadline = time.monotonic() + 30
            while True:
                with contextlib.suppress(aiohttp.ClientError):
                    async with http.get(f"{base}/readyz") as r:
                        if r.status == 200:
                            break
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("gateway did not start: " + (tmp / "serve.log").read_text())
                await asyncio.sleep(0.1)
            rds = aioredis.Redis(unix_socket_path=str(socket_of(tmp / "data")))

            def auth(t: str, **extra: str) -> dict[str, str]:
                return {"Authorization": f"Bearer {KEYS[t]}", **extra}

            async def register(t: str, job: str) -> None:
                async with http.post(
                    f"{base}/v1/jobs/{job}/generations", json={"generation": 1}, headers=auth(t)
                ) as r:
                    assert r.status in (200, 201), await r.text()

            async def effect(t: str, job: str, payload: Any, **headers: str) -> int:
                async with http.post(
                    f"{base}/v1/jobs/{job}/effects/s",
                    json={"adapter": "hook", "operation": "send", "payload": payload},
                    headers=auth(t, **{"Fencing-Token": "1", **headers}),
                ) as r:
                    await r.read()
                    statuses[t][r.status] += 1
                    if r.status >= 500:
                        five.append(f"{t} {r.status} {(await r.text())[:200]}")
                    return r.status

            big = {f"part{i}": "x" * 50_000 for i in range(4)}  # ~200 KB
            n = 0

            async def flood_async() -> None:
                nonlocal n
                while not stop.is_set():
                    n += 1
                    job = f"a-{n}"
                    with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                        await register("a", job)
                        await effect("a", job, big, Prefer="respond-async")

            async def hold_idle() -> None:
                while not stop.is_set():
                    while len(sockets) < idle and not stop.is_set():
                        with contextlib.suppress(OSError):
                            sockets.append(await asyncio.open_connection("127.0.0.1", port))
                    held[0] = max(held[0], len(sockets))
                    await asyncio.sleep(0.5)
                    for pair in list(sockets):  # re-open the ones the gateway closed
                        if pair[0].at_eof():
                            pair[1].close()
                            sockets.remove(pair)

            async def slow_body() -> None:
                head = (
                    "POST /v1/jobs/a-slow/generations HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                    f"Authorization: Bearer {KEYS['a']}\r\nContent-Type: application/json\r\n"
                    "Content-Length: 5000\r\n\r\n{"
                ).encode()
                while not stop.is_set():
                    with contextlib.suppress(OSError):
                        reader, writer = await asyncio.open_connection("127.0.0.1", port)
                        writer.write(head)
                        with contextlib.suppress(TimeoutError):
                            async with asyncio.timeout(10):
                                answer = await reader.read(12)
                                if answer.startswith(b"HTTP/1.1 5"):
                                    five.append(f"slow-body {answer!r}")
                        writer.close()

            b_n = 0

            async def tenant_b() -> None:
                nonlocal b_n
                while not stop.is_set():
                    b_n += 1
                    job = f"b-{b_n}"
                    started = time.monotonic()
                    try:
                        async with asyncio.timeout(3):
                            await register("b", job)
                            status = await effect("b", job, {"n": b_n})
                        if status != 200:
                            b_failures.append(f"status {status}")
                    except (TimeoutError, aiohttp.ClientError) as exc:
                        b_failures.append(type(exc).__name__)
                    b_latency.append(time.monotonic() - started)
                    await asyncio.sleep(0.02)

            async def watch_memory() -> None:
                nonlocal peak_memory
                while not stop.is_set():
                    with contextlib.suppress(Exception):
                        info = await rds.info("memory")
                        peak_memory = max(peak_memory, int(info["used_memory"]))
                    await asyncio.sleep(0.25)

            tasks = [asyncio.create_task(hold_idle()), asyncio.create_task(watch_memory())]
            tasks += [asyncio.create_task(flood_async()) for _ in range(8)]
            tasks += [asyncio.create_task(slow_body()) for _ in range(slow_bodies)]
            await asyncio.sleep(1.0)  # the attack is on before B starts measuring
            tasks += [asyncio.create_task(tenant_b()) for _ in range(4)]
            await asyncio.sleep(seconds)
            stop.set()
            for _, writer in sockets:
                writer.close()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await rds.aclose()
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(30)
        if proc.poll() is None:
            proc.kill()
        await runner.cleanup()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    log.seek(0)
    lines = log.read().splitlines()
    non_json = 0
    for line in lines:
        try:
            json.loads(line)
        except ValueError:
            non_json += 1
    log.close()
    return {
        "seconds": seconds,
        "b_calls": len(b_latency),
        "b_failures": len(b_failures),
        "b_failure_kinds": dict(Counter(b_failures)),
        "b_p50_ms": round(_pct(b_latency, 0.5) * 1000, 1),
        "b_p99_ms": round(_pct(b_latency, 0.99) * 1000, 1),
        "b_max_ms": round(max(b_latency, default=0) * 1000, 1),
        "a_statuses": {str(k): v for k, v in sorted(statuses["a"].items())},
        "a_idle_sockets_peak": held[0],
        "a_slow_bodies": slow_bodies,
        "five_xx": len(five),
        "five_xx_samples": five[:5],
        "redis_peak_used_memory_mb": round(peak_memory / 2**20, 1),
        "payload_cap_mb": round(payload_cap / 2**20, 1),
        "receiver_requests": dict(receiver.counts),
        "log_lines": len(lines),
        "non_json_log_lines": non_json,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks.hostile")
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--idle", type=int, default=1200)
    parser.add_argument("--slow-bodies", type=int, default=100)
    parser.add_argument("--payload-cap-mb", type=float, default=16)
    args = parser.parse_args(argv)
    summary = asyncio.run(
        _hostile(args.seconds, args.idle, args.slow_bodies, int(args.payload_cap_mb * 2**20))
    )
    print(json.dumps(summary))
    ok = (
        summary["b_failures"] == 0
        and summary["five_xx"] == 0
        and summary["b_calls"] > 0
        and summary["non_json_log_lines"] == 0
    )
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
