"""Redis's own work per decision: ``python -m benchmarks.redis_cost [--calls N]``.

One durable redis-server (``appendfsync always``, as the gateway's embedded one) and the
gateway's :class:`~gateway.store.store.Store` (no HTTP, no anchoring: the decision's Redis
work only), four decisions, each on its own fresh jobs:

  replay     an admit of a step already recorded ``succeeded``
  stale      an admit by a generation below the fence: the audited rejection, with the copy
             to the tenant feed the store writes for it
  accepted   an admit of a new step, then its record (two scripts)
  heartbeat  a heartbeat renewing a lease

For each it prints, per decision:

* **Redis µs**: ``INFO commandstats`` deltas around N decisions at 64 concurrent — the
  scripts' ``usec`` (which includes the commands they run) plus, for each command sent on its
  own (outside a script, e.g. a feed copy), its calls times its ``usec_per_call``;
* **Redis CPU µs**: ``INFO cpu`` (user + sys) delta over the same decisions (it includes the
  fsync of ``appendfsync always`` and the protocol work, which commandstats leaves out);
* **commands**: exactly, from ``MONITOR`` around one decision: the scripts called, the
  commands run inside them (per script, by name) and the commands sent on their own.

Nothing is asserted: a measurement. The machine's load moves the µs; the command counts are
exact.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import re
import secrets
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import redis

from gateway.core.errors import StaleGeneration
from gateway.store.embedded import EmbeddedRedis
from gateway.store.keys import JobKeys
from gateway.store.store import Admitted, Store, connect

CONCURRENCY = 64
SCRIPTS = ("evalsha", "eval")
HARNESS = {"info", "config", "monitor", "echo", "ping", "client", "script", "hello"}
INTENT = "0" * 64


def admit(store: Store, keys: JobKeys, step: str, generation: int) -> Awaitable[Any]:
    return store.admit(
        keys,
        step,
        generation=generation,
        intent_sha256=INTENT,
        adapter="hook",
        operation="send",
        worker_id="w",
        resolvable=False,
    )


class Scenario:
    """One decision: ``prepare(i)`` sets up the i-th call's job, ``call(i)`` is the decision."""

    def __init__(self, store: Store, name: str, tag: str) -> None:
        self.store = store
        self.name = name
        self.tag = tag

    def keys(self, i: int) -> JobKeys:
        return JobKeys("bench", f"{self.tag}-{self.name}-{i}")

    async def prepare(self, i: int) -> None:
        store, keys = self.store, self.keys(i)
        if self.name == "stale":
            await store.register(keys, 2, None)
            return
        await store.register(keys, 1, 60_000 if self.name == "heartbeat" else None)
        if self.name == "replay":
            verdict = await admit(store, keys, "s", 1)
            assert isinstance(verdict, Admitted)
            await store.record(keys, "s", verdict.dispatch_id, "succeeded", result={"ok": True})

    async def call(self, i: int) -> None:
        store, keys = self.store, self.keys(i)
        if self.name == "replay":
            await admit(store, keys, "s", 1)
        elif self.name == "stale":
            with contextlib.suppress(StaleGeneration):
                await admit(store, keys, "s", 1)
                raise AssertionError("not rejected")
        elif self.name == "accepted":
            verdict = await admit(store, keys, "s", 1)
            assert isinstance(verdict, Admitted)
            await store.record(keys, "s", verdict.dispatch_id, "succeeded", result={"ok": True})
        else:
            await store.heartbeat(keys, 1, "w")


async def each(n: int, call: Callable[[int], Awaitable[None]]) -> None:
    it = iter(range(n))

    async def worker() -> None:
        for i in it:
            await call(i)

    await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))


def stats(client: redis.Redis) -> tuple[dict[str, tuple[int, int]], float]:
    """(command -> (calls, usec)), Redis CPU seconds so far."""
    info: dict[str, Any] = client.info("commandstats")  # type: ignore[assignment]
    cpu: dict[str, Any] = client.info("cpu")  # type: ignore[assignment]
    commands = {k[8:]: (int(v["calls"]), int(v["usec"])) for k, v in info.items()}
    return commands, float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])


_LINE = re.compile(r'^[\d.]+ \[\d+ ([^\]]+)\] "([^"]+)"')


class Monitor:
    """The commands Redis runs between :meth:`start` and :meth:`stop` (``MONITOR``): each as
    (top-level or inside a script, its name)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.lines: list[tuple[bool, str]] = []
        self._ready = threading.Event()
        self._done = threading.Event()
        self._end = f"fg-cost-end-{secrets.token_hex(4)}"

    def start(self) -> None:
        threading.Thread(target=self._run, daemon=True).start()
        self._ready.wait(10)

    def _run(self) -> None:
        client = redis.Redis.from_url(self.url, decode_responses=True)
        with client.monitor() as m:
            self._ready.set()
            for event in m.listen():
                command = str(event["command"])
                if self._end in command:
                    break
                lua = event.get("client_type") == "lua" or "lua" in str(event.get("client_address"))
                self.lines.append((lua, command.split(" ", 1)[0].lower()))
        self._done.set()

    def stop(self) -> list[tuple[bool, str]]:
        redis.Redis.from_url(self.url).echo(self._end)
        self._done.wait(10)
        return self.lines


def describe(lines: list[tuple[bool, str]]) -> tuple[list[str], list[str]]:
    """Per script (in order): its command count and names; the commands sent on their own."""
    scripts: list[str] = []
    alone: list[str] = []
    inner: collections.Counter[str] = collections.Counter()
    current = None

    def close() -> None:
        if current is not None:
            names = ", ".join(f"{c} {n}" if n > 1 else c for c, n in sorted(inner.items()))
            scripts.append(f"{sum(inner.values())} ({names})")

    for lua, name in lines:
        if name in HARNESS:
            continue
        if not lua and name in SCRIPTS:
            close()
            inner.clear()
            current = name
        elif lua:
            inner[name.upper()] += 1
        else:
            alone.append(name.upper())
    close()
    return scripts, alone


async def measure(url: str, name: str, n: int) -> dict[str, Any]:
    client = connect(url, timeout=10, max_connections=CONCURRENCY)
    store = Store(
        client, registration="required", dispatch_timeout_ms=30_000, retention_seconds=3600
    )
    await store.load_scripts()
    await store.initialize(auto=True)
    sync = redis.Redis.from_url(url, decode_responses=True)
    scenario = Scenario(store, name, secrets.token_hex(3))
    warm = 200
    await each(n + warm + 1, scenario.prepare)
    await each(warm, scenario.call)  # the warm-up: the calls 0 .. warm-1
    monitor = Monitor(url)
    monitor.start()
    await scenario.call(warm)
    scripts, alone = describe(monitor.stop())

    async def measured(i: int) -> None:
        await scenario.call(warm + 1 + i)

    # no other client may run commands meanwhile: the anchorer is not running here
    before, cpu0 = stats(sync)
    t0 = time.perf_counter()
    await each(n, measured)
    wall = time.perf_counter() - t0
    after, cpu1 = stats(sync)
    delta = {
        c: (calls - before.get(c, (0, 0))[0], usec - before.get(c, (0, 0))[1])
        for c, (calls, usec) in after.items()
        if c not in HARNESS
    }
    script_usec = sum(delta.get(c, (0, 0))[1] for c in SCRIPTS)
    per_call = {c: usec / calls for c, (calls, usec) in delta.items() if calls}
    alone_usec = sum(per_call.get(c.lower(), 0.0) * n for c in alone)
    await store.aclose()
    await client.aclose()
    sync.close()
    return {
        "decision": name,
        "redis_us": round((script_usec + alone_usec) / n, 1),
        "script_us": round(script_usec / n, 1),
        "redis_cpu_us": round((cpu1 - cpu0) * 1e6 / n, 1),
        "scripts": scripts,
        "alone": alone,
        "decisions_per_s": round(n / wall),
        "usec_per_command": {c: round(delta[c][1] / n, 2) for c in delta if delta[c][0]},
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--only", default="replay,stale,accepted,heartbeat")
    parser.add_argument("--verbose", action="store_true", help="µs per decision by command")
    parser.add_argument("--url", help="a running Redis instead of a fresh embedded one (an A/B of "
                        "two trees on one server: alternate their runs)")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="one JSON line per decision")
    args = parser.parse_args()
    names = args.only.split(",")
    if args.url:
        rows = [asyncio.run(measure(args.url, name, args.calls)) for name in names]
    else:
        with tempfile.TemporaryDirectory(prefix="fencegate-redis-cost-") as tmp:
            server = EmbeddedRedis(tmp, use_socket=False)
            server.start()
            try:
                rows = [asyncio.run(measure(server.url, name, args.calls)) for name in names]
            finally:
                server.stop()
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return
    print(
        f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}, {args.calls} calls "
        f"each at {CONCURRENCY} concurrent, durable redis-server (appendfsync always)"
    )
    print()
    print(
        "| decision | Redis µs (commandstats) | of which scripts | Redis CPU µs | "
        "commands per script | sent on their own |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['decision']} | {r['redis_us']} | {r['script_us']} | {r['redis_cpu_us']} | "
            f"{' + '.join(r['scripts'])} | {', '.join(r['alone']) or '—'} |"
        )
    if args.verbose:
        for r in rows:
            print(f"{r['decision']}: µs per decision by command {r['usec_per_command']}")


if __name__ == "__main__":
    main()
