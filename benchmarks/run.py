"""Benchmark: the gateway against its physical floors, side by side in one run.

    python -m benchmarks.run [--requests N] [--concurrency C] [--workers 1,2]   (make bench)

Starts a durable redis-server (appendfsync always), an upstream HTTP receiver
(a bare aiohttp JSON server) and ``fencegate serve`` (each its own process), and
measures from a load generator in this process:

  L1  raw redis-py EVALSHA of the admit script, of the record script, and of the
      checkpoint script
  L2  the bare aiohttp JSON server itself (the upstream), same load generator
  G1  accepted effect calls end to end (admit + webhook POST to the upstream + record)
  G2  replays          G3  stale rejections (zombie calls, audited)    G4  heartbeats
  G5  fenced checkpoint writes (PUT …/checkpoints/{name}: one Lua script, no upstream)
  X1  proxied calls accepted end to end (POST /proxy/bench/hook: route, intent digest, admit,
      the POST forwarded to the same upstream, the response recorded)   X2  their replays;
      reported over the adapter path (X1/G1, X2/G2) and over the bare upstream (X1/L2, X2/L2)
  O1  a 1 MiB output upload + the completion promoting it, against L6, the same on a bare
      aiohttp server writing a file (benchmarks/outputs.py)
  P2  replays, P3 stale rejections and P3f stale rejections with the tenant feed copy, on the
      peer (benchmarks/peer: nginx + Lua running the gateway's own admit script), after a
      parity check that both answer the same bytes; skipped, and said so, without nginx

``--only guard`` measures what the regression guard compares (G2, P2, G3, P3, P3f:
benchmarks/check.py) and nothing else, in three rounds that alternate gateway and peer.

and reports req/s, p50/p99/p99.9, the gateway's CPU seconds per 1,000 calls and
peak RSS, the ratios G*/L2, and at one connection the gateway's latency minus a
direct upstream call. Pinning (Linux, >= 2 cores): the load generator runs on
the last core, every server process on the others (os.sched_setaffinity).
Writes benchmarks/results/latest.json and latest.md and appends history.jsonl.
Nothing here is asserted: these are measurements, not tests.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from benchmarks.loadgen import LeanClient
from benchmarks.outputs import output_rows
from benchmarks.peer import parity
from benchmarks.peer.plan import Peer, missing, plan_for
from gateway.runtime.settings import load_settings
from gateway.store.embedded import EmbeddedRedis, free_port
from gateway.store.keys import JobKeys, audit_feed
from gateway.store.scripts import fenced_args
from gateway.store.store import Store, connect

T = TypeVar("T")
# BENCH_RESULTS: somewhere else than the committed history (the tests' short runs)
RESULTS = Path(os.environ.get("BENCH_RESULTS") or Path(__file__).parent / "results")
UPSTREAM = """
import asyncio, sys
from aiohttp import web
try:
    import uvloop
    loop = uvloop.new_event_loop()
except ImportError:
    loop = asyncio.new_event_loop()
async def hook(request):
    await request.read()
    return web.json_response({"ok": True})
app = web.Application()
app.router.add_post("/hook", hook)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None, loop=loop)
"""


def run_loop(main: Awaitable[T]) -> T:
    """The load generator's event loop: uvloop when installed, as the servers use.

    With asyncio's own loop the load generator saturated its core before the
    bare aiohttp server did (column "load generator busy"), which made the L2
    floor look lower than the server's real capacity.
    """
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)  # type: ignore[arg-type]
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)  # type: ignore[arg-type]


CORES = os.cpu_count() or 1
PIN = sys.platform.startswith("linux") and CORES >= 2
SERVER_CORES = set(range(CORES - 1)) if PIN else set()
LOAD_CORE = {CORES - 1} if PIN else set()
SHARED = os.environ.get("BENCH_PLACEMENT") == "shared"  # the older layout, for comparison


def pin(pid: int, cores: set[int]) -> None:
    if cores:
        os.sched_setaffinity(pid, cores)


def core_ticks() -> dict[int, tuple[int, int]]:
    """Per core: (busy, total) jiffies from /proc/stat."""
    out: dict[int, tuple[int, int]] = {}
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except FileNotFoundError:
        return out
    for line in lines:
        name, *fields = line.split()
        if name.startswith("cpu") and name != "cpu":
            values = [int(v) for v in fields[:8]]
            idle = values[3] + values[4]  # idle + iowait
            out[int(name[3:])] = (sum(values) - idle, sum(values))
    return out


def core_busy(before: dict[int, tuple[int, int]], cores: set[int]) -> float | None:
    after = core_ticks()
    busy = total = 0
    for c in cores:
        if c in before and c in after:
            busy += after[c][0] - before[c][0]
            total += after[c][1] - before[c][1]
    return round(busy / total, 2) if total else None


def cpu_seconds(pids: list[int]) -> float:
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
        except (FileNotFoundError, IndexError):
            pass
    return total / ticks


def cpu_ns(pids: list[int]) -> int:
    """CPU time of every thread of ``pids`` in ns (/proc/<pid>/task/*/schedstat): precise
    where utime/stime count 10 ms ticks (a 2,000-call row of a 50 µs server is 10 ticks)."""
    total = 0
    for pid in pids:
        for stat in Path(f"/proc/{pid}/task").glob("*/schedstat"):
            with contextlib.suppress(FileNotFoundError, IndexError, ValueError):
                total += int(stat.read_text().split()[0])
    return total


def peak_rss_mb(pids: list[int]) -> float:
    peak = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    peak += int(line.split()[1])
        except FileNotFoundError:
            pass
    return round(peak / 1024, 1)


def children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    return [int(x) for x in out.stdout.split()]


def wait_http(url: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except Exception:
            time.sleep(0.05)
    raise RuntimeError(f"{url} did not come up")


class Stack:
    """redis-server, the upstream and ``fencegate serve --workers N``, pinned to server cores."""

    def __init__(self, workdir: Path, workers: int, *, ceilings: bool = True) -> None:
        self.workdir = workdir
        self.redis = EmbeddedRedis(workdir / f"redis-{workers}", use_socket=False)
        self.redis.start()
        self.up_port, self.gw_port = free_port(), free_port()
        cfg = self.config = workdir / f"bench-{workers}.toml"
        cfg.write_text(
            f"""
[redis]
url = "{self.redis.url}"
data_dir = "{workdir / f"state-{workers}"}"
auto_init = true
max_connections = 128
[connections]
# the load generator's connections sit idle while the floors are measured (longer than
# the 15 s default on a busy machine): the gateway must not close them meanwhile
idle_timeout_seconds = 600
[adapters.hook]
type = "webhook"
url = "http://127.0.0.1:{self.up_port}/hook"
[upstreams.bench]
# rows X1 and X2: the same upstream as G1 and L2, reached through the reverse proxy
base_url = "http://127.0.0.1:{self.up_port}"
routes = ["POST /hook"]
allow_private = true
"""
        )
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.log = (workdir / f"gateway-{workers}.log").open("w")
        self.upstream = subprocess.Popen(
            [sys.executable, "-c", UPSTREAM, str(self.up_port)], env=env
        )
        self.gateway = subprocess.Popen(
            [sys.executable, "-m", "gateway", "serve", "--config", str(cfg),
             "--port", str(self.gw_port), "--workers", str(workers)],
            env=env, stdout=subprocess.DEVNULL, stderr=self.log,
        )  # fmt: skip
        # the ceiling servers (benchmarks/ceiling.py): rows L3, L4 and L5
        self.ceiling: dict[str, tuple[int, subprocess.Popen[bytes]]] = {}
        for mode in ("echo", "replay", "raw") if ceilings else ():
            port = free_port()
            proc = subprocess.Popen(
                [sys.executable, "-m", "benchmarks.ceiling", self.redis.url, str(port), mode],
                env=env, stdout=subprocess.PIPE,
            )  # fmt: skip
            self.ceiling[mode] = (port, proc)
        for _, proc in self.ceiling.values():
            assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
        self.peer: Peer | None = None  # started by start_peer, once the gateway answers
        wait_http(f"http://127.0.0.1:{self.gw_port}/readyz")
        self.gateway_pids = [self.gateway.pid, *(children(self.gateway.pid) if workers > 1 else [])]
        self.place("floors")

    def place(self, phase: str) -> None:
        """Pin each server so the one being measured has the server core(s) to itself.

        floors: Redis and the upstream on the server cores (L1 and L2 measure them
        alone there; the gateway is idle). gateway: the gateway alone on the
        server cores; Redis and the upstream move to the load generator's core,
        as in production, where neither shares the gateway's cores (column
        "load core busy" shows whether that core became the limit).
        """
        helpers = [self.upstream.pid, self.redis.process.pid if self.redis.process else 0]
        peer = [self.peer.process.pid] if self.peer else []
        for pid in [*self.gateway_pids, *(p.pid for _, p in self.ceiling.values()), *peer]:
            pin(pid, SERVER_CORES)
        for pid in helpers:
            if pid:
                pin(pid, SERVER_CORES if phase == "floors" or SHARED else LOAD_CORE)

    async def start_peer(self) -> str | None:
        """Start the peer (benchmarks/peer) on this stack's Redis; why not, if it cannot run."""
        why = missing() or (None if os.environ.get("BENCH_PEER", "1") != "0" else "BENCH_PEER=0")
        if why:
            return why
        retention = load_settings(self.config).fencing.retention_seconds
        plan = await plan_for(self.redis.url, self.gw_port, retention)
        self.peer = Peer(self.workdir, plan, free_port(), free_port())
        return None

    def stop(self) -> None:
        if self.peer:
            self.peer.stop()
        procs = [self.gateway, self.upstream, *(p for _, p in self.ceiling.values())]
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(30)
        self.log.close()
        self.redis.stop()


async def measure(
    name: str,
    n: int,
    concurrency: int,
    call: Callable[[int], Awaitable[None]],
    pids: list[int] | None = None,
) -> dict[str, Any]:
    latencies: list[float] = []
    counter = iter(range(n))

    async def worker() -> None:
        for i in counter:
            t0 = time.perf_counter()
            await call(i)
            latencies.append(time.perf_counter() - t0)

    cpu0 = cpu_seconds(pids or [])
    ns0 = cpu_ns(pids or [])
    cores0 = core_ticks()
    own0 = time.process_time()
    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    own = time.process_time() - own0
    q = statistics.quantiles(latencies, n=1000)
    row: dict[str, Any] = {
        "name": name,
        "concurrency": concurrency,
        "requests": n,
        "rps": round(n / elapsed, 1),
        "p50_ms": round(q[499] * 1000, 3),
        "p99_ms": round(q[989] * 1000, 3),
        "p999_ms": round(q[998] * 1000, 3),
        # busy share of its core: near 1.0 means the load generator, not the server, is the limit
        "loadgen_busy": round(own / elapsed, 2),
        "server_core_busy": core_busy(cores0, SERVER_CORES),
        "load_core_busy": core_busy(cores0, LOAD_CORE),
    }
    if pids:
        row["server_cpu_s_per_1000"] = round((cpu_seconds(pids) - cpu0) / n * 1000, 3)
        row["server_cpu_us_per_call"] = round((cpu_ns(pids) - ns0) / n / 1000, 1)
        row["server_peak_rss_mb"] = peak_rss_mb(pids)
    return row


async def run_stack(
    stack: Stack,
    n: int,
    concurrency: int,
    only: str = "all",
    peer_info: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """The rows of one stack: ``only`` "all", "g1" (a second --workers count) or "guard" (G2,
    P2, G3, P3, P3f). ``peer_info`` gets the peer's parity checks, or why it was skipped."""
    rows: list[dict[str, Any]] = []
    pids = stack.gateway_pids
    run_id = secrets.token_hex(3)
    jobs = [f"bench-{run_id}-{i}" for i in range(n)]
    body = {
        "adapter": "hook",
        "operation": "send",
        "payload": {"to": ["a@example.com"], "subject": "hi"},
    }
    gw = LeanClient("127.0.0.1", stack.gw_port)
    build = LeanClient.build
    info = peer_info if peer_info is not None else {}

    def calls(
        raws: list[bytes], expect: int, client: LeanClient = gw
    ) -> Callable[[int], Awaitable[None]]:  # requests built before the clock starts
        async def call(i: int) -> None:
            status, answer = await client.send(raws[i])
            assert status == expect, (status, answer[:200])

        return call

    def register(gen: int) -> Callable[[int], Awaitable[None]]:
        raws = [build("POST", f"/v1/jobs/{j}/generations", {"generation": gen}) for j in jobs]
        return calls(raws, 201)

    def effect_raws(token: str, step: str = "notify") -> list[bytes]:
        headers = {"Fencing-Token": token}
        return [build("POST", f"/v1/jobs/{j}/effects/{step}", body, headers) for j in jobs]

    def effect(token: str, expect: int, step: str = "notify") -> Callable[[int], Awaitable[None]]:
        return calls(effect_raws(token, step), expect)

    def proxied(token: str, step: str) -> Callable[[int], Awaitable[None]]:
        """The G1 call's payload POSTed through the proxy as step ``step`` of each job."""
        raws = [
            build("POST", "/proxy/bench/hook", body["payload"],
                  {"Fencing-Token": token, "Fencegate-Job": j, "Fencegate-Step": step})
            for j in jobs
        ]  # fmt: skip
        return calls(raws, 200)

    async def peer_rows(
        token: str, expect: int, rows_of: tuple[tuple[str, str], ...], first: bool = True
    ) -> None:
        """Parity first (the same calls to the gateway and the peer), then each peer row; a
        later round (``first`` False) only measures."""
        peer = stack.peer
        if peer is None:
            return
        raws = effect_raws(token)
        same = [
            ("POST", f"/v1/jobs/{j}/effects/notify",
             {"Content-Type": "application/json", "Fencing-Token": token},
             json.dumps(body).encode())
            for j in jobs[: min(n, 100)]
        ]  # fmt: skip
        gateway_url = f"http://127.0.0.1:{stack.gw_port}"
        for name, port_of in rows_of:
            port = peer.port if port_of == "port" else peer.feed_port
            if first:
                check = await parity.compare(gateway_url, f"http://127.0.0.1:{port}", same, name)
                info.setdefault("parity", []).append(check)
            lean = LeanClient("127.0.0.1", port)
            try:  # the warm-up opens its Redis connections
                await measure("warm-up", n // 5 if first else 64, concurrency,
                              calls(raws, expect, lean))  # fmt: skip
                rows.append(await measure(name, n, concurrency, calls(raws, expect, lean),
                                          [peer.process.pid]))  # fmt: skip
            finally:
                lean.close()

    heartbeat = calls(
        [build("POST", f"/v1/jobs/{j}/fence", None, {"Fencing-Token": "1"}) for j in jobs], 200
    )
    try:
        if only != "g1":
            why = await stack.start_peer()
            info["skipped"] = why
            if why:
                print(f"the peer rows (P2, P3, P3f) are skipped: {why}", file=sys.stderr)
        await measure("register", n, concurrency, register(1))
        # warm-up, not measured: the gateway opens its upstream and Redis connections
        # (64 at once on the first wave) and the allocator settles
        await measure("warm-up", n // 5, concurrency, effect("1", 200, "warm-up"))
        if only == "all":
            stack.place("floors")
            rows += await floors(stack, n, concurrency)
        stack.place("gateway")
        accepted = await measure("G1 effect, accepted", n, concurrency, effect("1", 200), pids)
        if only == "g1":
            return [accepted]
        if only == "all":
            rows.append(accepted)
        # the guard's rounds alternate the gateway and the peer: a load swing on a shared
        # machine then falls on both sides of a round's ratio
        rounds = GUARD_ROUNDS if only == "guard" else 1
        for r in range(rounds):
            rows.append(
                await measure("G2 effect, replayed", n, concurrency, effect("1", 200), pids)
            )
            await peer_rows("1", 200, (("P2 peer replay", "port"),), first=r == 0)
        if only == "all":
            # the proxy's own upstream pool opens its connections: not measured
            await measure("warm-up", n // 5, concurrency, proxied("1", "proxied-warm-up"))
            rows.append(
                await measure("X1 proxied call, accepted", n, concurrency, proxied("1", "proxied"),
                              pids)
            )  # fmt: skip
            rows.append(
                await measure("X2 proxied call, replayed", n, concurrency, proxied("1", "proxied"),
                              pids)
            )  # fmt: skip
            # the same replays, same pinning, stripped (benchmarks/ceiling.py): on aiohttp's
            # low-level server (L4), and on a bare asyncio protocol (L5)
            raws = effect_raws("1")
            for mode, name in (("replay", "L4 minimal replay, low-level server"),
                               ("raw", "L5 minimal replay, raw asyncio protocol")):  # fmt: skip
                port, proc = stack.ceiling[mode]
                lean = LeanClient("127.0.0.1", port)
                try:  # the warm-up opens its Redis connections
                    await measure("warm-up", n // 5, concurrency, calls(raws, 200, lean))
                    rows.append(
                        await measure(name, n, concurrency, calls(raws, 200, lean), [proc.pid])
                    )
                finally:
                    lean.close()
            rows.append(await measure("G4 heartbeat", n, concurrency, heartbeat, pids))
            checkpoints = [
                build("PUT", f"/v1/jobs/{j}/checkpoints/progress", {"page": i, "of": n},
                      {"Fencing-Token": "1"})
                for i, j in enumerate(jobs)
            ]  # fmt: skip
            rows.append(
                await measure("G5 checkpoint write", n, concurrency, calls(checkpoints, 200), pids)
            )
        await measure("register g2", n, concurrency, register(2))
        for r in range(rounds):
            rows.append(
                await measure("G3 effect, stale 409", n, concurrency, effect("1", 409), pids)
            )
            await peer_rows(
                "1", 409,
                (("P3 peer stale 409", "port"), ("P3f peer stale 409 + feed copy", "feed")),
                first=r == 0,
            )  # fmt: skip
        if only == "guard":
            return rows
        # one connection: the gateway's own latency over a direct upstream call
        await measure("register g3", n, concurrency, register(3))
        one = min(n, 2000)
        rows.append(await measure("G1 at 1 connection", one, 1, effect("3", 200, "single"), pids))
        rows += await output_rows(
            stack.gw_port, stack.workdir, run_id, n, measure, pids,
            lambda pid: pin(pid, SERVER_CORES),
        )  # fmt: skip
    finally:
        gw.close()
    return rows


async def floors(stack: Stack, n: int, concurrency: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    client = connect(stack.redis.url, timeout=5, max_connections=concurrency)
    store = Store(
        client, registration="required", dispatch_timeout_ms=30_000, retention_seconds=3600
    )
    await store.load_scripts()
    await store.initialize(auto=False, confirm_data_loss=False)
    keys = JobKeys("default", f"floor-{secrets.token_hex(3)}")
    await store.register(keys, 1, None)
    shas = store.link.script_shas
    admit_sha, record_sha, checkpoint_sha = shas["admit-8"], shas["record-4"], shas["checkpoint-3"]

    def trailer(rid: str) -> tuple[list[str], list[str]]:
        """The prelude's trailer every script call carries (see gateway/store/lua/_prelude.lua)."""
        return [keys.req(rid), keys.marker], [rid, "60000", "0", "", audit_feed(keys.tenant)]

    async def admit_raw(i: int, prefix: str = "s") -> None:  # a new step each: a real write
        tk, ta = trailer(f"a{prefix}{i}")
        await client.evalsha(
            admit_sha, 8, keys.job, keys.effect(f"{prefix}{i}"), keys.audit, keys.steps,
            keys.relayq, keys.attention, *tk,
            *fenced_args(keys, 1, "required", "", "3600", "", ""),
            f"{prefix}{i}", "0" * 64, "hook", "send", f"a{prefix}{i}", "30000", "0", "",
            keys.member(f"{prefix}{i}"), "", "", *ta,
        )  # fmt: skip

    async def record_raw(i: int) -> None:
        tk, ta = trailer(f"r{i}")
        await client.evalsha(
            record_sha, 5, keys.effect(f"s{i}"), keys.relayq, keys.attention, *tk, f"as{i}",
            "succeeded", '{"ok":true}', "", "3600", keys.member(f"s{i}"), "0", *ta,
        )  # fmt: skip

    rows.append(await measure("L1 raw EVALSHA admit", n, concurrency, admit_raw))
    rows.append(await measure("L1 raw EVALSHA record", n, concurrency, record_raw))
    # one at a time: the round trip of a durable write (appendfsync always: one fsync each)
    one = min(n, 2000)
    rows.append(await measure("L1 admit at 1 connection", one, 1, lambda i: admit_raw(i, "one")))

    async def checkpoint_raw(i: int) -> None:  # the G5 row's script, without the gateway
        tk, ta = trailer(f"c{i}")
        await client.evalsha(
            checkpoint_sha, 5, keys.job, keys.ckpt, keys.audit, *tk,
            *fenced_args(keys, 1, "required", "", "3600", "", ""),
            "progress", f'{{"of":{n},"page":{i}}}', "null", "100", "", "256", *ta,
        )  # fmt: skip

    rows.append(await measure("L1 raw EVALSHA checkpoint", n, concurrency, checkpoint_raw))
    await store.aclose()
    await client.aclose()
    up = LeanClient("127.0.0.1", stack.up_port)
    raw = LeanClient.build("POST", "/hook", {"to": ["a@example.com"], "subject": "hi"})

    async def direct(i: int) -> None:
        status, _ = await up.send(raw)
        assert status == 200, status

    up_pid = [stack.upstream.pid]
    try:
        rows.append(await measure("L2 bare aiohttp JSON server", n, concurrency, direct, up_pid))
        rows.append(await measure("L2 at 1 connection", min(n, 2000), 1, direct, up_pid))
    finally:
        up.close()
    port, proc = stack.ceiling["echo"]
    echo = LeanClient("127.0.0.1", port)

    async def low_level(i: int) -> None:
        status, _ = await echo.send(raw)
        assert status == 200, status

    try:
        rows.append(
            await measure("L3 aiohttp low-level echo", n, concurrency, low_level, [proc.pid])
        )
    finally:
        echo.close()
    return rows


def markdown(record: dict[str, Any]) -> str:
    rows = record["results"]
    lines = [
        f"{record['at']}, {record['machine']['cpus']} cores, Python {record['machine']['python']}, "
        f"{record['requests']} requests at {record['concurrency']} connections, "
        f"{record['pinning']}",
        "",
        "| measurement | req/s | p50 ms | p99 ms | p99.9 ms | server CPU s / 1000 "
        "| server CPU µs / call | peak RSS MB | load generator busy | server core busy "
        "| load core busy | x L2 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['name']} | {r['rps']:,.0f} | {r['p50_ms']} | {r['p99_ms']} | {r['p999_ms']} | "
            f"{r.get('server_cpu_s_per_1000', '')} | {r.get('server_cpu_us_per_call', '')} | "
            f"{r.get('server_peak_rss_mb', '')} | "
            f"{r.get('loadgen_busy', '')} | {r.get('server_core_busy', '')} | "
            f"{r.get('load_core_busy', '')} | {r.get('ratio_to_l2', '')} |"
        )
    lines += ["", *(f"- {k}: {v}" for k, v in record["derived"].items())]
    peer = record.get("peer", {})
    if peer.get("skipped"):
        lines.append(f"- the peer (P2, P3, P3f): skipped: {peer['skipped']}")
    for check in peer.get("parity", []):
        lines.append(
            f"- parity, {check['what']}: {check['identical']} of {check['calls']} answers "
            f"identical to the gateway's (status {check['statuses']}; "
            f"{check['compared']}, except {', '.join(check['excluded_headers'])})"
        )
    return "\n".join(lines)


def all_derived(by: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The ratios of a full run (rows L1 to L6 and G1 to G5)."""
    l2 = by["L2 bare aiohttp JSON server"]["rps"]
    for r in by.values():
        if r["name"].startswith(("G", "L3", "L4", "L5", "P", "X")):
            r["ratio_to_l2"] = round(r["rps"] / l2, 3)
    g1_one, l2_one = by["G1 at 1 connection"], by["L2 at 1 connection"]
    l1_one = by["L1 admit at 1 connection"]
    g1 = by["G1 effect, accepted"]
    l4 = by["L4 minimal replay, low-level server"]
    derived = {
        "G1/L2, G2/L2, G3/L2": ", ".join(
            str(by[k]["ratio_to_l2"])
            for k in ("G1 effect, accepted", "G2 effect, replayed", "G3 effect, stale 409")
        ),
        "G1/L1, G2/L1 (end to end over a raw admit EVALSHA)": (
            f"{g1['rps'] / by['L1 raw EVALSHA admit']['rps']:.3f}, "
            f"{by['G2 effect, replayed']['rps'] / by['L1 raw EVALSHA admit']['rps']:.3f}"
        ),
        # the stack's own ceiling: a stripped replay on aiohttp's low-level server (L4)
        "G2/L4 (the gateway's replay over the stripped one), L4/L2, L5/L2": (
            f"{by['G2 effect, replayed']['rps'] / l4['rps']:.3f}, {l4['ratio_to_l2']}, "
            f"{by['L5 minimal replay, raw asyncio protocol']['ratio_to_l2']}"
        ),
        "G1 p99/p50 at saturation": round(g1["p99_ms"] / g1["p50_ms"], 2),
        # the reverse proxy over the adapter path and over the bare upstream, same run
        "X1/G1, X2/G2 (proxied over the adapter path), X1/L2, X2/L2": (
            f"{by['X1 proxied call, accepted']['rps'] / g1['rps']:.3f}, "
            f"{by['X2 proxied call, replayed']['rps'] / by['G2 effect, replayed']['rps']:.3f}, "
            f"{by['X1 proxied call, accepted']['ratio_to_l2']}, "
            f"{by['X2 proxied call, replayed']['ratio_to_l2']}"
        ),
        "G5/L1 (a fenced checkpoint end to end over its raw EVALSHA), G5/L2": (
            f"{by['G5 checkpoint write']['rps'] / by['L1 raw EVALSHA checkpoint']['rps']:.3f}, "
            f"{by['G5 checkpoint write']['ratio_to_l2']}"
        ),
        "O1/L6 (1 MiB output upload + completion over the bare aiohttp file write)": round(
            by["O1 output 1 MiB upload + completion"]["rps"]
            / by["L6 bare aiohttp 1 MiB PUT to a file + JSON POST"]["rps"], 3
        ),
        "gateway latency minus a direct upstream call, 1 connection, p50 / p99 (ms)": (
            f"{g1_one['p50_ms'] - l2_one['p50_ms']:.3f} / {g1_one['p99_ms'] - l2_one['p99_ms']:.3f}"
        ),
        # an accepted call makes two durable writes (admit, record): their fsyncs are Redis's
        "the same minus two durable Redis writes (L1 admit at 1 connection), p50 / p99 (ms)": (
            f"{g1_one['p50_ms'] - l2_one['p50_ms'] - 2 * l1_one['p50_ms']:.3f} / "
            f"{g1_one['p99_ms'] - l2_one['p99_ms'] - 2 * l1_one['p99_ms']:.3f}"
        ),
    }  # fmt: skip
    return derived


GUARD_ROWS = {"G2": "G2 effect, replayed", "P2": "P2 peer replay", "G3": "G3 effect, stale 409",
              "P3": "P3 peer stale 409", "P3f": "P3f peer stale 409 + feed copy"}  # fmt: skip


GUARD_ROUNDS = 3


def guard_figures(rows: list[dict[str, Any]]) -> dict[str, float]:
    """What the regression guard compares (benchmarks/check.py): the gateway's server CPU per
    call over the peer's, and the peer's req/s over the gateway's, in the same round; the
    median over the rounds. Empty without the peer."""
    of = {k: [r for r in rows if r["name"] == name] for k, name in GUARD_ROWS.items()}
    if not all(of.values()):
        return {}
    out = {}
    for g, p in (("G2", "P2"), ("G3", "P3"), ("G3", "P3f")):
        pairs = list(zip(of[g], of[p], strict=True))
        cpu = [a["server_cpu_us_per_call"] / b["server_cpu_us_per_call"] for a, b in pairs]
        out[f"cpu {g}/{p}"] = round(statistics.median(cpu), 3)
        out[f"req/s {p}/{g}"] = round(statistics.median(b["rps"] / a["rps"] for a, b in pairs), 3)
    for k in ("G2", "G3", "P2", "P3f"):
        cpu_us = statistics.median(r["server_cpu_us_per_call"] for r in of[k])
        out[f"cpu µs per call {k}"] = round(cpu_us, 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--workers", default="1,2", help="G1 is also measured at each of these")
    parser.add_argument("--only", choices=("all", "guard"), default="all",
                        help="guard: only the rows benchmarks/check.py compares")  # fmt: skip
    args = parser.parse_args()
    pin(0, LOAD_CORE)
    worker_counts = [int(w) for w in args.workers.split(",")]
    if args.only == "guard":
        worker_counts = worker_counts[:1]
    rows: list[dict[str, Any]] = []
    peer: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="fencegate-bench-") as tmp:
        for workers in worker_counts:
            stack = Stack(Path(tmp), workers, ceilings=args.only == "all")
            only = "g1" if rows else args.only
            try:
                got = run_loop(run_stack(stack, args.requests, args.concurrency, only, peer))
            finally:
                stack.stop()
            for r in got:
                r["gateway_workers"] = workers
                if workers > 1:
                    r["name"] += f" (--workers {workers})"
            rows += got
    by = {r["name"]: r for r in rows}
    guard = guard_figures(rows)
    derived: dict[str, Any] = {}
    if guard:
        derived["server CPU per call G2/P2, G3/P3, G3/P3f (the gateway over the peer)"] = ", ".join(
            str(guard[f"cpu {k}"]) for k in ("G2/P2", "G3/P3", "G3/P3f")
        )
        derived["req/s P2/G2, P3/G3, P3f/G3"] = ", ".join(
            str(guard[f"req/s {k}"]) for k in ("P2/G2", "P3/G3", "P3f/G3")
        )
    if args.only == "all":
        derived.update(all_derived(by))
    record = {
        "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpus": CORES, "python": platform.python_version(),
                    "platform": platform.platform()},
        "pinning": (
            f"load generator on cores {sorted(LOAD_CORE)}; L1/L2: Redis / upstream on "
            f"{sorted(SERVER_CORES)}; G: gateway on {sorted(SERVER_CORES)}, Redis and upstream on "
            f"{sorted(SERVER_CORES if SHARED else LOAD_CORE)}"
        ) if PIN else "not pinned (needs Linux and >= 2 cores)",
        "requests": args.requests,
        "concurrency": args.concurrency,
        "only": args.only,
        "results": rows,
        "derived": derived,
        "guard": guard,
        "peer": peer,
    }  # fmt: skip
    RESULTS.mkdir(exist_ok=True)
    previous = None
    history = RESULTS / "history.jsonl"
    if history.exists() and history.read_text().strip():
        previous = json.loads(history.read_text().strip().splitlines()[-1])
    (RESULTS / "latest.json").write_text(json.dumps(record, indent=2))
    md = markdown(record)
    (RESULTS / "latest.md").write_text(md + "\n")
    with history.open("a") as f:
        f.write(json.dumps(record) + "\n")
    print(md)
    if previous:
        prev = {r["name"]: r["rps"] for r in previous.get("results", [])}
        print("\nchange against the previous run (req/s):")
        for r in rows:
            if r["name"] in prev and prev[r["name"]]:
                print(f"  {r['name']:<40} {r['rps'] / prev[r['name']] - 1:+.1%}")
    unequal = [c for c in peer.get("parity", []) if c["identical"] != c["calls"]]
    if unequal:  # the peer no longer answers what the gateway answers: its rows mean nothing
        print(f"\nPARITY FAILED: {json.dumps(unequal, indent=1)}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
