"""Benchmark: the gateway against its physical floor, measured side by side in one run.

    python -m benchmarks.run [--requests N] [--concurrency C]      (or: make bench)

Starts a durable redis-server (appendfsync always), an upstream HTTP receiver
process and a ``fencegate serve`` process, then measures from this process:

  (a) raw EVALSHA of the admit script (redis-py, same event loop, C tasks)
  (b) accepted effect calls end to end (webhook to the local upstream)
  (c) replays of those steps
  (d) stale rejections (zombie calls, audited)

and prints req/s, p50/p99 and the ratios to (a). Results are also written to
``benchmarks/results/latest.json`` and appended to ``history.jsonl``.
Nothing here is asserted: these are measurements, not tests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp

from gateway.embedded import EmbeddedRedis, free_port
from gateway.keys import JobKeys
from gateway.store import Store, connect
from gateway.tokens import MAX_GENERATION

RESULTS = Path(__file__).parent / "results"

UPSTREAM = """
import sys
from aiohttp import web
async def hook(request):
    await request.read()
    return web.json_response({"ok": True})
app = web.Application()
app.router.add_post("/hook", hook)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)
"""


async def measure(
    name: str, n: int, concurrency: int, call: Callable[[int], Awaitable[None]]
) -> dict[str, Any]:
    latencies: list[float] = []
    counter = iter(range(n))

    async def worker() -> None:
        for i in counter:
            t0 = time.perf_counter()
            await call(i)
            latencies.append(time.perf_counter() - t0)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    q = statistics.quantiles(latencies, n=1000)
    return {
        "name": name,
        "requests": n,
        "rps": round(n / elapsed, 1),
        "p50_ms": round(q[499] * 1000, 3),
        "p99_ms": round(q[989] * 1000, 3),
        "p999_ms": round(q[998] * 1000, 3),
    }


def wait_http(url: str, timeout: float = 20) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except Exception:
            time.sleep(0.05)
    raise RuntimeError(f"{url} did not come up")


class Stack:
    """redis-server, the upstream receiver and ``fencegate serve``, each its own process."""

    def __init__(self, workdir: Path) -> None:
        self.redis = EmbeddedRedis(workdir / "redis", use_socket=False)
        self.redis.start()
        up_port, self.gw_port = free_port(), free_port()
        cfg = workdir / "bench.toml"
        cfg.write_text(
            f"""
[redis]
url = "{self.redis.url}"
data_dir = "{workdir / "state"}"
max_connections = 128
[adapters.hook]
type = "webhook"
url = "http://127.0.0.1:{up_port}/hook"
"""
        )
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.log = (workdir / "gateway.log").open("w")
        self.procs = [
            subprocess.Popen([sys.executable, "-c", UPSTREAM, str(up_port)], env=env),
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "gateway",
                    "serve",
                    "--config",
                    str(cfg),
                    "--port",
                    str(self.gw_port),
                ],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=self.log,
            ),
        ]
        wait_http(f"http://127.0.0.1:{self.gw_port}/readyz")

    def stop(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            p.wait(20)
        self.log.close()
        self.redis.stop()


async def run(n: int, concurrency: int, stack: Stack) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    gw_port, redis_server = stack.gw_port, stack.redis
    base = f"http://127.0.0.1:{gw_port}"
    run_id = secrets.token_hex(3)
    jobs = [f"bench-{run_id}-{i}" for i in range(n)]
    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(base, connector=conn) as http:

        async def register(i: int) -> None:
            async with http.post(f"/v1/jobs/{jobs[i]}/generations", json={"generation": 1}) as r:
                assert r.status == 201, await r.text()

        await measure("register", n, concurrency, register)

        # (a) the floor: one EVALSHA of the admit script per call, no HTTP, no adapter
        client = connect(redis_server.url, timeout=5, max_connections=concurrency)
        store = Store(
            client, registration="required", dispatch_timeout_ms=30_000, retention_seconds=3600
        )
        await store.load_scripts()
        script = store._scripts["admit-5"]
        floor_jobs = [f"floor-{run_id}-{i}" for i in range(n)]
        for job in floor_jobs[:1]:
            await store.register(JobKeys("default", job), 1, None)

        async def admit_raw(i: int) -> None:
            k = JobKeys("default", floor_jobs[0])
            await client.evalsha(
                script.sha, 5, k.job, k.effect(f"s{i}"), k.audit, k.steps, k.marker,
                "1", "required", "0" * 64, "hook", "send", f"d{i}", "30000", "3600", "0",
                floor_jobs[0], f"s{i}", "", "default",
            )  # fmt: skip

        results.append(await measure("(a) raw EVALSHA admit", n, concurrency, admit_raw))
        await client.aclose()

        body = {
            "adapter": "hook",
            "operation": "send",
            "payload": {"to": ["a@example.com"], "subject": "hi"},
        }

        def effect_call(token: str, expect: int) -> Callable[[int], Awaitable[None]]:
            async def call(i: int) -> None:
                async with http.post(
                    f"/v1/jobs/{jobs[i]}/effects/notify",
                    json=body,
                    headers={"Fencing-Token": token},
                ) as r:
                    await r.read()
                    assert r.status == expect, r.status

            return call

        results.append(await measure("(b) effect, accepted", n, concurrency, effect_call("1", 200)))
        results.append(await measure("(c) effect, replayed", n, concurrency, effect_call("1", 200)))
        for job in jobs:
            async with http.post(f"/v1/jobs/{job}/generations", json={"generation": 2}) as r:
                assert r.status == 201
        results.append(
            await measure("(d) effect, stale 409", n, concurrency, effect_call("1", 409))
        )
    floor = results[0]["rps"]
    for r in results:
        r["ratio_to_a"] = round(r["rps"] / floor, 3)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--concurrency", type=int, default=64)
    args = parser.parse_args()
    assert args.requests < MAX_GENERATION
    with tempfile.TemporaryDirectory(prefix="fencegate-bench-") as tmp:
        stack = Stack(Path(tmp))
        try:
            results = asyncio.run(run(args.requests, args.concurrency, stack))
        finally:
            stack.stop()
    header = (
        f"{'measurement':<26}{'req/s':>10}{'p50 ms':>10}{'p99 ms':>10}{'p99.9 ms':>10}{'x (a)':>8}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        print(
            f"{r['name']:<26}{r['rps']:>10}{r['p50_ms']:>10}{r['p99_ms']:>10}{r['p999_ms']:>10}{r['ratio_to_a']:>8}"
        )
    record = {
        "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "requests": args.requests,
        "concurrency": args.concurrency,
        "results": results,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "latest.json").write_text(json.dumps(record, indent=2))
    with (RESULTS / "history.jsonl").open("a") as f:
        f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
