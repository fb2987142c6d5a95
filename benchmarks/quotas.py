"""Benchmark: what the quotas cost per effect call, on and off, in one run.

    python -m benchmarks.quotas [--requests N]

Starts a durable redis-server (appendfsync always), the upstream of ``benchmarks.run`` and two
``fencegate serve`` processes on that Redis: one with no quota configured (``payload_bytes =
0``: no admission hook), one with ``effects_per_window`` and ``rejections_per_window`` set (far
above what the run uses) and the default ``payload_bytes``. Each row is measured on both,
paired (call i on "off", then on "on", one at a time): accepted calls (admit + webhook +
record), replays, async accepted calls (queued for the relay, with a payload reservation),
stale rejections (audited).
Reports p50 / p99 in µs and the on/off ratio of each. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from benchmarks.loadgen import LeanClient
from benchmarks.run import UPSTREAM, measure, run_loop, wait_http
from gateway.runtime.settings import QuotaSettings
from gateway.store.embedded import EmbeddedRedis, free_port

QUOTAS = {
    "off": "[quotas]\npayload_bytes = 0\n",
    "on": "[quotas]\neffects_per_window = 1000000000\n"
    # (a tree before rejections_per_window existed measures without it)
    + ("rejections_per_window = 1000000000\n" if "rejections_per_window" in
       QuotaSettings.model_fields else ""),
}  # fmt: skip


def gateway(workdir: Path, name: str, redis_url: str, upstream: int) -> tuple[Any, int]:
    port = free_port()
    cfg = workdir / f"{name}.toml"
    cfg.write_text(
        f"""
[redis]
url = "{redis_url}"
data_dir = "{workdir / f"state-{name}"}"
auto_init = true
[connections]
idle_timeout_seconds = 600
[adapters.hook]
type = "webhook"
url = "http://127.0.0.1:{upstream}/hook"
{QUOTAS[name]}"""
    )
    log = (workdir / f"{name}.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway", "serve", "--config", str(cfg), "--port", str(port)],
        env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.DEVNULL, stderr=log,
    )  # fmt: skip
    wait_http(f"http://127.0.0.1:{port}/readyz")
    return proc, port


async def rows(ports: dict[str, int], n: int, concurrency: int) -> list[dict[str, Any]]:
    body = {"adapter": "hook", "operation": "send", "payload": {"to": ["a@example.com"]}}
    build = LeanClient.build
    out: list[dict[str, Any]] = []
    clients = {name: LeanClient("127.0.0.1", port) for name, port in ports.items()}
    run_id = secrets.token_hex(3)

    def calls(name: str, raws: list[bytes], expect: int) -> Callable[[int], Awaitable[None]]:
        async def call(i: int) -> None:
            status, answer = await clients[name].send(raws[i])
            assert status == expect, (status, answer[:200])

        return call

    def jobs(name: str) -> list[str]:
        return [f"q-{run_id}-{name}-{i}" for i in range(n)]

    def effect(name: str, token: str, step: str, expect: int, **h: str) -> Any:
        headers = {"Fencing-Token": token, **h}
        raws = [build("POST", f"/v1/jobs/{j}/effects/{step}", body, headers) for j in jobs(name)]
        return calls(name, raws, expect)

    def register(name: str, gen: int) -> Any:
        raws = [build("POST", f"/v1/jobs/{j}/generations", {"generation": gen}) for j in jobs(name)]
        return calls(name, raws, 201)

    try:
        for name in ports:
            await measure("register", n, concurrency, register(name, 1))
            await measure("warm-up", n // 5, concurrency, effect(name, "1", "warm-up", 200))
        plan = [
            ("accepted", lambda name: effect(name, "1", "notify", 200)),
            ("replayed", lambda name: effect(name, "1", "notify", 200)),
            ("async accepted", lambda name: effect(name, "1", "later", 202,
                                                   Prefer="respond-async")),
            ("stale 409", None),
        ]  # fmt: skip
        for row, make in plan:
            if make is None:
                for name in ports:
                    await measure("register g2", n, concurrency, register(name, 2))
                make = lambda name: effect(name, "1", "notify", 409)  # noqa: E731
            out += await paired(row, n, {name: make(name) for name in ports})
    finally:
        for c in clients.values():
            c.close()
    return out


async def paired(
    row: str, n: int, calls: dict[str, Callable[[int], Awaitable[None]]]
) -> list[dict[str, Any]]:
    """Call i on each gateway in turn, one at a time: both see the same moment's machine (the
    host is shared; a load swing between two separate runs is larger than what is measured)."""
    took: dict[str, list[float]] = {name: [] for name in calls}
    for i in range(n):
        for name, call in calls.items():
            t0 = time.perf_counter()
            await call(i)
            took[name].append(time.perf_counter() - t0)
    out = []
    for name, latencies in took.items():
        q = statistics.quantiles(latencies, n=100)
        out.append({"name": f"{row} (quotas {name})", "requests": n,
                    "p50_ms": q[49] * 1000, "p99_ms": q[98] * 1000})  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=2000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fencegate-bench-quotas-") as tmp:
        work = Path(tmp)
        redis = EmbeddedRedis(work / "redis", use_socket=False)
        redis.start()
        up_port = free_port()
        upstream = subprocess.Popen([sys.executable, "-c", UPSTREAM, str(up_port)])
        procs = []
        try:
            ports = {}
            for name in QUOTAS:
                proc, ports[name] = gateway(work, name, redis.url, up_port)
                procs.append(proc)
            got = run_loop(rows(ports, args.requests, 1))
        finally:
            for p in [*procs, upstream]:
                p.terminate()
                p.wait(30)
            redis.stop()
    by = {r["name"]: r for r in got}
    print(f"requests={args.requests} per row and gateway, one at a time, paired")
    print("| row | off p50 / p99 µs | on p50 / p99 µs | on/off p50 |")
    print("|---|---|---|---|")
    for row in ("accepted", "replayed", "async accepted", "stale 409"):
        off, on = by[f"{row} (quotas off)"], by[f"{row} (quotas on)"]
        print(
            f"| {row} | {off['p50_ms'] * 1000:.0f} / {off['p99_ms'] * 1000:.0f} "
            f"| {on['p50_ms'] * 1000:.0f} / {on['p99_ms'] * 1000:.0f} "
            f"| {on['p50_ms'] / off['p50_ms']:.2f} |"
        )


if __name__ == "__main__":
    main()
