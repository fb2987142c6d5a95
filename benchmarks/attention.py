"""Cost of the "needs a decision" index (issue 17): ``python -m benchmarks.attention [N]``.

1. The hot path: a synchronous admit then its record (the two scripts every accepted call
   runs), N pairs at 64 concurrent, with the scripts as shipped against the same scripts
   with the prelude's ``index()`` emptied (the baseline: no index writes). Same process, same
   Redis, rounds alternated; the ratios are what count (the machine is shared): pairs per
   second, and the Redis server's own CPU per pair (INFO cpu), the steadier of the two.
2. The reconciler: one pass over the 16,384 slot indexes with nothing due, and with 1,000
   unknown steps in 1,000 jobs.
3. The listing: the first page of 100 of those 1,000.
"""

from __future__ import annotations

import asyncio
import hashlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

from gateway.store.embedded import EmbeddedRedis
from gateway.store.keys import JobKeys
from gateway.store.store import Store, connect

NO_INDEX = "local function index(key, member, state, score)\n  do return end\n"


def baseline(store: Store) -> None:
    """The same scripts with index() doing nothing."""
    for name, src in list(store.link._sources.items()):
        marker = "local function index(key, member, state, score)\n"
        if marker not in src:  # a script that changes no step's state (includes/index)
            continue
        src = src.replace(marker, NO_INDEX)
        store.link._sources[name] = src
        store.link._shas[name] = hashlib.sha1(src.encode(), usedforsecurity=False).hexdigest()


async def pairs(store: Store, keys: JobKeys, tag: str, n: int) -> float:
    it = iter(range(n))

    async def one() -> None:
        for i in it:
            v = await store.admit(
                keys, f"{tag}{i}", generation=1, intent_sha256="0" * 64, adapter="hook",
                operation="send", worker_id="", resolvable=False,
            )  # fmt: skip
            await store.record(keys, f"{tag}{i}", v.dispatch_id, "succeeded")  # type: ignore[union-attr]

    t = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(64)))
    return n / (time.perf_counter() - t)


async def redis_cpu(store: Store) -> float:
    """Seconds of CPU the Redis server used so far (user + system)."""
    info = await store.link.client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


async def main(n: int) -> None:
    tmp = tempfile.TemporaryDirectory(prefix="fencegate-bench-attention-")
    with tmp, EmbeddedRedis(Path(tmp.name), use_socket=False) as server:
        url = server.url
        stores: dict[str, Store] = {}
        for name in ("index", "baseline"):
            client = connect(url, timeout=5, max_connections=64)
            s = Store(
                client, registration="required", dispatch_timeout_ms=30_000,
                retention_seconds=3600,
            )  # fmt: skip
            if name == "baseline":
                baseline(s)
            await s.load_scripts()
            stores[name] = s
        await stores["index"].initialize(auto=True)
        keys = JobKeys("bench", "hot")
        await stores["index"].register(keys, 1, None)
        for fsync in ("always", "no"):
            await stores["index"].link.client.config_set("appendfsync", fsync)
            rates: dict[str, list[float]] = {"index": [], "baseline": []}
            cpu: dict[str, list[float]] = {"index": [], "baseline": []}
            for r in range(6):
                for name in ("baseline", "index") if r % 2 else ("index", "baseline"):
                    before = await redis_cpu(stores[name])
                    rates[name].append(await pairs(stores[name], keys, f"{name}{fsync}{r}-", n))
                    cpu[name].append((await redis_cpu(stores[name]) - before) / n * 1e6)
            rate = {k: statistics.median(v) for k, v in rates.items()}
            us = {k: statistics.median(v) for k, v in cpu.items()}
            print(
                f"appendfsync {fsync}: pairs/s with the index {rate['index']:,.0f}, without "
                f"{rate['baseline']:,.0f} (ratio {rate['index'] / rate['baseline']:.3f}); Redis "
                f"CPU per pair {us['index']:.1f} us vs {us['baseline']:.1f} us (ratio "
                f"{us['index'] / us['baseline']:.3f})"
            )
        s = stores["index"]
        t, c = time.perf_counter(), time.process_time()
        stats = await s.reconcile_attention()
        print(f"reconcile, nothing due: {(time.perf_counter() - t) * 1000:.0f} ms wall, "
              f"{(time.process_time() - c) * 1000:.0f} ms CPU {stats}")  # fmt: skip
        for j in range(1000):
            k = JobKeys("bench", f"j{j}")
            await s.register(k, 1, None)
            v = await s.admit(
                k, "s", generation=1, intent_sha256="0" * 64, adapter="hook",
                operation="send", worker_id="", resolvable=False,
            )  # fmt: skip
            await s.record(k, "s", v.dispatch_id, "unknown")  # type: ignore[union-attr]
        await s.link.client.delete("fg:nd:t:bench")  # every hint lost: the reconciler's worst
        t, c = time.perf_counter(), time.process_time()
        stats = await s.reconcile_attention()
        print(f"reconcile, 1,000 due: {(time.perf_counter() - t) * 1000:.0f} ms wall, "
              f"{(time.process_time() - c) * 1000:.0f} ms CPU {stats}")  # fmt: skip
        t = time.perf_counter()
        page = await s.attention("bench", limit=100)
        print(f"first page of 100: {(time.perf_counter() - t) * 1000:.1f} ms ({len(page)})")
        for st in stores.values():
            await st.aclose()
            await st.link.client.aclose()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 3000))
