"""Soak: many effect calls over many jobs; does the cost per call grow with what is stored?

    python -m benchmarks.soak [--calls 1000000] [--jobs 100000]        (make bench-soak)

Registers ``--jobs`` jobs, then performs ``--calls`` accepted effect calls spread over them
(calls/jobs steps per job, each a new effect record), at 64 connections, against the same
pinned stack as ``benchmarks.run`` (the gateway alone on the server core). Reports req/s in
the first and the last tenth of the run, the gateway's peak RSS, Redis memory per call, and
``MEMORY USAGE`` of one job's fence hash, one effect record and one steps set.
Measurements only; nothing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import redis

from benchmarks.loadgen import LeanClient
from benchmarks.run import LOAD_CORE, RESULTS, Stack, peak_rss_mb, pin, run_loop


async def soak(stack: Stack, calls: int, jobs: int, concurrency: int) -> dict[str, Any]:
    run = f"soak{int(time.time())}"
    body = {"adapter": "hook", "operation": "send", "payload": {"to": ["a@example.com"]}}
    tenths: list[float] = []
    gw = LeanClient("127.0.0.1", stack.gw_port)
    token = {"Fencing-Token": "1"}

    async def each(raws: Iterator[bytes], expect: int) -> None:
        async def worker() -> None:
            for raw in raws:
                status, answer = await gw.send(raw)
                assert status == expect, (status, answer[:200])

        await asyncio.gather(*(worker() for _ in range(concurrency)))

    try:
        await each(
            (LeanClient.build("POST", f"/v1/jobs/{run}-{j}/generations", {"generation": 1})
             for j in range(jobs)),
            201,
        )  # fmt: skip
        r0 = redis.Redis.from_url(stack.redis.url)
        mem_before = r0.info("memory")["used_memory"]
        tenth = max(1, calls // 10)
        for start in range(0, calls, tenth):
            raws = (
                LeanClient.build("POST", f"/v1/jobs/{run}-{i % jobs}/effects/s{i // jobs}", body,
                                 token)
                for i in range(start, min(start + tenth, calls))
            )  # fmt: skip
            t0 = time.perf_counter()
            await each(raws, 200)
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
    finally:
        gw.close()
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
        stack.place("gateway")
        try:
            result = run_loop(soak(stack, args.calls, args.jobs, args.concurrency))
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
