"""Soak: many effect calls over many jobs; does the cost per call grow with what is stored?

    python -m benchmarks.soak [--calls 1000000] [--jobs 100000]        (make bench-soak)

Registers ``--jobs`` jobs, then performs ``--calls`` accepted effect calls spread over them
(calls/jobs steps per job, each a new effect record), at 64 connections, against the same
pinned stack as ``benchmarks.run``. Reports req/s in the first and the last tenth of the run,
the gateway's peak RSS, Redis memory per call, and ``MEMORY USAGE`` of one job's fence hash,
one effect record and one steps set. Measurements only; nothing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import redis

from benchmarks.run import LOAD_CORE, RESULTS, Stack, peak_rss_mb, pin


async def soak(stack: Stack, calls: int, jobs: int, concurrency: int) -> dict[str, Any]:
    run = f"soak{int(time.time())}"
    body = {"adapter": "hook", "operation": "send", "payload": {"to": ["a@example.com"]}}
    conn = aiohttp.TCPConnector(limit=concurrency)
    tenths: list[float] = []
    async with aiohttp.ClientSession(f"http://127.0.0.1:{stack.gw_port}", connector=conn) as gw:
        ids = iter(range(jobs))

        async def register() -> None:
            for j in ids:
                async with gw.post(f"/v1/jobs/{run}-{j}/generations", json={"generation": 1}) as r:
                    assert r.status == 201

        await asyncio.gather(*(register() for _ in range(concurrency)))
        r0 = redis.Redis.from_url(stack.redis.url)
        mem_before = r0.info("memory")["used_memory"]
        tenth = max(1, calls // 10)
        for start in range(0, calls, tenth):
            batch = iter(range(start, min(start + tenth, calls)))

            async def worker(batch: Any = batch) -> None:
                for i in batch:
                    url = f"/v1/jobs/{run}-{i % jobs}/effects/s{i // jobs}"
                    async with gw.post(url, json=body, headers={"Fencing-Token": "1"}) as r:
                        await r.read()
                        assert r.status == 200, r.status

            t0 = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(concurrency)))
            tenths.append(round(tenth / (time.perf_counter() - t0), 1))
        mem_after = r0.info("memory")["used_memory"]
        sample = f"fg:{{default/{run}-0}}"
        usage = {
            "job_fence_hash_bytes": r0.memory_usage(f"{sample}:job"),
            "effect_record_bytes": r0.memory_usage(f"{sample}:fx:s0"),
            "steps_set_bytes": r0.memory_usage(f"{sample}:steps"),
            "stored_result_bytes": len(r0.hget(f"{sample}:fx:s0", "result") or b""),
        }
        r0.close()
    return {
        "calls": calls,
        "jobs": jobs,
        "rps_per_tenth": tenths,
        "last_over_first_tenth": round(tenths[-1] / tenths[0], 3),
        "redis_bytes_per_call": round((mem_after - mem_before) / calls, 1),
        **usage,
        "gateway_peak_rss_mb": peak_rss_mb(stack.gateway_pids),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=1_000_000)
    parser.add_argument("--jobs", type=int, default=100_000)
    parser.add_argument("--concurrency", type=int, default=64)
    args = parser.parse_args()
    pin(0, LOAD_CORE)
    with tempfile.TemporaryDirectory(prefix="fencegate-soak-") as tmp:
        stack = Stack(Path(tmp), 1)
        try:
            result = asyncio.run(soak(stack, args.calls, args.jobs, args.concurrency))
        finally:
            stack.stop()
    result["at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    RESULTS.mkdir(exist_ok=True)
    with (RESULTS / "soak-history.jsonl").open("a") as f:
        f.write(json.dumps(result) + "\n")
    for k, v in result.items():
        print(f"{k:<24} {v}")


if __name__ == "__main__":
    main()
