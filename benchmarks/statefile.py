"""Cost of the slot marks with all 16,384 slots: the state file's periodic write and the
check of the marks against Redis's markers (``python -m benchmarks.statefile [DIR]``)."""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import redis.asyncio as aioredis

from gateway.store import durability, statefile
from gateway.store.embedded import EmbeddedRedis
from gateway.store.keys import SLOTS


def timed(fn: Callable[[], object], n: int) -> str:
    wall: list[float] = []
    cpu = time.process_time()
    for _ in range(n):
        t = time.perf_counter()
        fn()
        wall.append((time.perf_counter() - t) * 1000)
    cpu_ms = (time.process_time() - cpu) / n * 1000
    return (
        f"wall median {statistics.median(wall):.2f} ms, max {max(wall):.2f} ms; CPU {cpu_ms:.2f} ms"
    )


def main() -> None:
    tmp = Path(tempfile.mkdtemp(dir=sys.argv[1] if len(sys.argv) > 1 else None))
    path = tmp / "fencegate.state"
    base = time.time_ns() // 1000
    marks = {s: base + s for s in range(SLOTS)}
    statefile.update(path, slots=marks, epoch=1, initialised=True)
    print(f"state file with {SLOTS} slot marks: {path.stat().st_size} bytes")
    n = [0]

    def all_rose() -> None:
        n[0] += 1
        statefile.update(path, slots={s: v + n[0] for s, v in marks.items()})

    def one_rose() -> None:
        n[0] += 1
        statefile.update(path, slots={7: base + 10**6 + n[0]})

    print("write, every slot rose (lock, read, merge, write, fsync, rename):", timed(all_rose, 50))
    print("write, one slot rose:", timed(one_rose, 50))
    snapshot, other = dict(marks), dict(marks)
    print(
        "dirty check (copy and compare 16,384 marks):", timed(lambda: dict(snapshot) == other, 200)
    )
    print("read into a dict (start, periodic check):", timed(lambda: statefile.read(path), 50))

    async def check() -> None:
        with EmbeddedRedis(tmp / "redis", use_socket=False) as server:
            client = aioredis.Redis.from_url(server.url, decode_responses=True)
            await durability.initialize(client, tmp / "other.state", auto=True)
            seen = dict.fromkeys(range(SLOTS), 1)
            wall = []
            for _ in range(20):
                t = time.perf_counter()
                assert await durability.marks_check(client, None, seen)
                wall.append((time.perf_counter() - t) * 1000)
            print(
                f"marks check of {SLOTS} slots against Redis (MGET by 2048): "
                f"wall median {statistics.median(wall):.1f} ms, max {max(wall):.1f} ms"
            )
            await client.aclose()

    asyncio.run(check())


if __name__ == "__main__":
    main()
