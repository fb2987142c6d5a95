"""Stress of the async relay's hints on a standalone Redis with real `fencegate serve`.

Two gateways on one Redis (G1 `--workers 2`, G2 one process), relay_sweep_seconds 3600 (only
the hints carry the steps), dispatch timeout 3 s. Tenants a and b submit `Prefer:
respond-async` steps through both gateways while faults run: SIGKILL of a G1 worker, SIGSTOP
of G2 past the dispatch timeout, a Redis restart (AOF, fsync always), a takeover (generation
2) of some of a's jobs. A checker reads, every 20 ms in one MULTI, each tenant's hint set and
the queues of its jobs' slots and records any difference. At the end: every accepted step's
state, the upstream's receipts per key (duplicates), stale-generation sends, time to relay.

    python -m tests.chaos.relay_hints --code . [--steps 400]   (make chaos runs it)

Exits 1 when a step was sent twice, a stale generation's step was sent after its takeover,
an accepted step was stranded or a hint differed from its queue entry (``--code2``, an older
gateway beside: its hints may differ, so the hint check is not held then).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import redis.asyncio as aredis
from aiohttp import web

from gateway.store.embedded import find_redis_server, free_port
from gateway.store.keys import JobKeys, key_slot, relay_hint

KEYS = {"a": ("ka-worker-0123456789abcdef", "ka-sched-0123456789abcdef"),
        "b": ("kb-worker-0123456789abcdef", "kb-sched-0123456789abcdef")}  # fmt: skip


class Upstream:
    def __init__(self) -> None:
        self.got: list[tuple[str, int, float]] = []  # (key, generation, time)
        self.delay = 0.05

    async def handle(self, request: web.Request) -> web.Response:
        await request.read()
        key = request.headers["Idempotency-Key"]
        gen = int(request.headers.get("Fencing-Token", "0"))
        self.got.append((key, gen, time.time()))
        if request.path == "/slow":
            await asyncio.sleep(1.9)
            return web.json_response({"ok": True})
        await asyncio.sleep(random.random() * self.delay)
        return web.json_response({"ok": True})


def start_redis(port: int, data: Path) -> subprocess.Popen[bytes]:
    data.mkdir(parents=True, exist_ok=True)
    p = subprocess.Popen(
        [find_redis_server(), "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data),
         "--appendonly", "yes", "--appendfsync", "always", "--save", "", "--daemonize", "no",
         "--logfile", str(data / "redis.log")],
    )  # fmt: skip
    return p


def config(tmp: Path, rport: int, uport: int) -> Path:
    keys = ""
    for tenant in KEYS:
        keys += f"""
[[auth.keys]]
role = "worker"
tenant = "{tenant}"
key_env = "K_{tenant.upper()}_W"
[[auth.keys]]
role = "scheduler"
tenant = "{tenant}"
key_env = "K_{tenant.upper()}_S"
"""
    cfg = tmp / "fencegate.toml"
    cfg.write_text(
        f"""
[server]
host = "127.0.0.1"
[redis]
url = "redis://127.0.0.1:{rport}/0"
data_dir = "{tmp / "state"}"
auto_init = true
[fencing]
relay_sweep_seconds = 3600
dispatch_timeout_seconds = 3
[adapters.hook]
type = "webhook"
url = "http://127.0.0.1:{uport}/hook"
timeout_seconds = 2
[adapters.slow]
type = "webhook"
url = "http://127.0.0.1:{uport}/slow"
timeout_seconds = 2.5
{keys}
"""
    )
    return cfg


def serve(code: str, cfg: Path, port: int, tmp: Path, *args: str) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONPATH=code)
    for tenant, (w, s) in KEYS.items():
        env[f"K_{tenant.upper()}_W"] = w
        env[f"K_{tenant.upper()}_S"] = s
    log = (tmp / f"serve-{port}.log").open("wb")
    return subprocess.Popen(
        [sys.executable, "-m", "gateway", "serve", "--config", str(cfg), "--port", str(port),
         *args],
        stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp,
    )  # fmt: skip


def children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    return [int(x) for x in out.stdout.split()]


ASYNC_1 = {"Prefer": "respond-async", "Fencing-Token": "1"}


async def ready(http: aiohttp.ClientSession, port: int, within: float = 60) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < within:
        try:
            async with http.get(f"http://127.0.0.1:{port}/readyz") as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except (TimeoutError, aiohttp.ClientError, OSError):
            pass
        await asyncio.sleep(0.05)
    raise RuntimeError(f"gateway on {port} not ready")


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--code", required=True)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--jobs", type=int, default=12)
    ap.add_argument("--no-faults", action="store_true")
    ap.add_argument("--code2", help="G2's tree (an older version: a mixed deployment)")
    ap.add_argument("--upstream-delay", type=float, default=0.05)
    ap.add_argument("--burst", type=int, default=150)
    ap.add_argument("--crash-at", default="", help="a third gateway G3 SIGKILLs itself there")
    ap.add_argument("--hostile", type=int, default=0, help="a's slow steps in b's slots first")
    opts = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="fg-stress-"))
    rport, uport, p1, p2 = free_port(), free_port(), free_port(), free_port()
    up = Upstream()
    up.delay = opts.upstream_delay
    app = web.Application()
    app.router.add_post("/hook", up.handle)
    app.router.add_post("/slow", up.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", uport).start()
    rproc = start_redis(rport, tmp / "redis")
    procs: list[subprocess.Popen[bytes]] = []
    report: dict[str, Any] = {"tmp": str(tmp)}
    r = aredis.Redis(port=rport, decode_responses=True, socket_timeout=2)
    for _ in range(100):
        try:
            await r.ping()
            break
        except Exception:
            await asyncio.sleep(0.05)
    cfg = config(tmp, rport, uport)
    g1 = serve(opts.code, cfg, p1, tmp, "--workers", "2")
    g2 = serve(opts.code2 or opts.code, cfg, p2, tmp)
    procs += [g1, g2]
    p3 = free_port()
    g3 = None
    if opts.crash_at:
        g3 = serve(opts.code, cfg, p3, tmp, "--chaos-crash-at", opts.crash_at,
                   "--chaos-crash-rate", "0.05")  # fmt: skip
        procs.append(g3)
    timeout = aiohttp.ClientTimeout(total=6)
    http = aiohttp.ClientSession(timeout=timeout)
    try:
        await ready(http, p1)
        await ready(http, p2)
        if g3:
            await ready(http, p3)
        jobs = {t: [f"{t}job{i}" for i in range(opts.jobs)] for t in KEYS}
        gens: dict[tuple[str, str], int] = {}

        async def call(tenant: str, role: int, method: str, path: str, body: Any = None,
                       headers: dict[str, str] | None = None, port: int | None = None
                       ) -> tuple[int, Any]:  # fmt: skip
            h = {"Authorization": f"Bearer {KEYS[tenant][role]}", **(headers or {})}
            alive = [p1, p2] + ([p3] if g3 and g3.poll() is None else [])
            port = port or random.choice(alive)
            async with http.request(method, f"http://127.0.0.1:{port}{path}", json=body,
                                    headers=h) as resp:  # fmt: skip
                try:
                    doc = await resp.json(content_type=None)
                except Exception:
                    doc = None
                return resp.status, doc

        async def register(tenant: str, job: str, gen: int) -> None:
            for _ in range(200):
                try:
                    st, doc = await call(tenant, 1, "POST", f"/v1/jobs/{job}/generations",
                                         {"generation": gen, "lease_ms": 600000})  # fmt: skip
                    if st in (200, 201):
                        gens[(tenant, job)] = gen
                        return
                except (TimeoutError, aiohttp.ClientError, OSError):
                    pass
                await asyncio.sleep(0.1)
            raise RuntimeError(f"register {tenant}/{job} failed: {st} {doc}")

        for t, js in jobs.items():
            for j in js:
                await register(t, j, 1)

        accepted: dict[tuple[str, str, str], tuple[float, int]] = {}
        crashed: dict[tuple[str, str, str], tuple[float, int]] = {}
        refused: Counter[str] = Counter()
        mismatches: list[dict[str, Any]] = []
        checks = 0
        stop = asyncio.Event()

        async def checker() -> None:
            nonlocal checks
            slots = {t: sorted({JobKeys(t, j).relayq for j in js + extra.get(t, [])})
                     for t, js in jobs.items()}  # fmt: skip
            while not stop.is_set():
                for t in KEYS:
                    try:
                        async with r.pipeline(transaction=True) as pipe:
                            pipe.zrange(relay_hint(t), 0, -1, withscores=True)
                            for q in slots[t]:
                                pipe.zrange(q, 0, -1, withscores=True)
                            got = await pipe.execute()
                    except Exception:
                        continue
                    checks += 1
                    hints = dict(got[0])
                    queue = {}
                    for rows in got[1:]:
                        for m, sc in rows:
                            if json.loads(m)[0] == t:
                                queue[m] = sc
                    if hints != queue:
                        diff = {
                            "t": time.time(),
                            "missing": [m for m in queue if m not in hints],
                            "extra": [m for m in hints if m not in queue],
                            "score": [(m, queue[m], hints[m]) for m in queue
                                      if m in hints and hints[m] != queue[m]],
                        }  # fmt: skip
                        mismatches.append(diff)
                await asyncio.sleep(0.02)

        async def submit(tenant: str, job: str, step: str) -> None:
            gen = gens[(tenant, job)]
            body = {"adapter": "hook", "operation": "send", "payload": {"s": step}}
            headers = {"Prefer": "respond-async", "Fencing-Token": str(gen)}
            for _ in range(100):
                port = random.choice([p1, p2] + ([p3] if g3 and g3.poll() is None else []))
                try:
                    st, doc = await call(tenant, 0, "POST", f"/v1/jobs/{job}/effects/{step}",
                                         body, headers, port)  # fmt: skip
                except (TimeoutError, aiohttp.ClientError, OSError):
                    if port == p3 and g3 is not None:
                        await asyncio.sleep(0.3)
                        if g3.poll() is not None:  # the crash: this call is not sent again
                            crashed[(tenant, job, step)] = (time.time(), gen)
                            return
                    await asyncio.sleep(0.2)
                    continue
                if st in (200, 202):
                    accepted.setdefault((tenant, job, step), (time.time(), gen))
                    return
                if st >= 500 or st == 429:
                    refused[f"{st} {doc and doc.get('code')} (retried)"] += 1
                    await asyncio.sleep(0.2)
                    continue
                refused[f"{st} {doc and doc.get('code')}"] += 1
                return

        events: list[tuple[float, str]] = []
        takeover: dict[tuple[str, str], float] = {}

        async def faults() -> None:
            nonlocal rproc
            await asyncio.sleep(2)
            kids = children(g1.pid)
            if kids:
                os.kill(kids[0], signal.SIGKILL)
                events.append((time.time(), f"SIGKILL G1 worker {kids[0]}"))
            await asyncio.sleep(2)
            os.kill(g2.pid, signal.SIGSTOP)
            events.append((time.time(), "SIGSTOP G2"))
            await asyncio.sleep(5)
            os.kill(g2.pid, signal.SIGCONT)
            events.append((time.time(), "SIGCONT G2"))
            await asyncio.sleep(2)
            rproc.send_signal(signal.SIGTERM)
            rproc.wait(20)
            events.append((time.time(), "redis stopped"))
            await asyncio.sleep(1.5)
            rproc = start_redis(rport, tmp / "redis")
            events.append((time.time(), "redis started"))
            await asyncio.sleep(2)
            # a burst of gen-1 steps on the jobs taken over: a backlog at the takeover
            burst = [asyncio.create_task(submit("a", jobs["a"][i % 4], f"burst{i}"))
                     for i in range(opts.burst)]  # fmt: skip
            await asyncio.sleep(0.5)
            for job in jobs["a"][:4]:
                await register("a", job, 2)
                takeover[("a", job)] = time.time()
            events.append((time.time(), "takeover of a's first 4 jobs"))
            await asyncio.gather(*burst)

        if opts.hostile:
            b_slots = {JobKeys("b", j).slot for j in jobs["b"]}
            ajobs: list[str] = []
            i = 0
            while len(ajobs) < 3 * len(b_slots):
                if key_slot(f"a/x{i}") in b_slots:
                    ajobs.append(f"x{i}")
                i += 1
            for j in ajobs:
                await register("a", j, 1)
            hsem = asyncio.Semaphore(48)

            async def slow(k: int) -> None:
                async with hsem:
                    job = ajobs[k % len(ajobs)]
                    for _ in range(20):
                        try:
                            body = {"adapter": "slow", "operation": "send", "payload": {"k": k}}
                            st, _ = await call(
                                "a", 0, "POST", f"/v1/jobs/{job}/effects/h{k}", body, ASYNC_1
                            )
                        except (TimeoutError, aiohttp.ClientError, OSError):
                            continue
                        if st in (200, 202):
                            return
                        await asyncio.sleep(0.1)

            await asyncio.gather(*(slow(k) for k in range(opts.hostile)))
            events.append((time.time(), f"a queued {opts.hostile} slow steps in b's slots"))
            report["a_backlog_at_start"] = await r.zcard(relay_hint("a"))
        extra = {"a": ajobs} if opts.hostile else {}
        ck = asyncio.create_task(checker())
        ft = None if opts.no_faults else asyncio.create_task(faults())
        t0 = time.time()
        sem = asyncio.Semaphore(24)
        n = 0

        async def one(i: int) -> None:
            tenant = "a" if i % 2 == 0 else "b"
            job = random.choice(jobs[tenant])
            async with sem:
                await submit(tenant, job, f"s{i}")

        tasks = []
        per_second = opts.steps / 16
        while n < opts.steps:
            tasks.append(asyncio.create_task(one(n)))
            n += 1
            await asyncio.sleep(1 / per_second)
        await asyncio.gather(*tasks)
        if ft:
            await ft
        report["submitted_seconds"] = round(time.time() - t0, 1)
        # every accepted step reaches a final state
        final = {"succeeded", "failed", "unknown"}
        t_end = time.time()
        states: dict[tuple[str, str, str], Any] = {}
        while time.time() - t_end < 40:
            states = {}
            pipe = r.pipeline(transaction=False)
            for t, j, s in accepted:
                pipe.hmget(JobKeys(t, j).effect(s), "state", "relay", "error")
            for t, j, s in crashed:
                pipe.hmget(JobKeys(t, j).effect(s), "state", "relay", "error")
            try:
                rows = await pipe.execute()
            except Exception:
                await asyncio.sleep(0.2)
                continue
            for k, (st, relay, err) in zip([*accepted, *crashed], rows, strict=True):
                states[k] = (st, relay, err)
            open_ = [k for k, (st, relay, _) in states.items()
                     if not (st in final or (st == "released" and relay != "1"))]  # fmt: skip
            if not open_:
                break
            await asyncio.sleep(0.2)
        report["settle_seconds"] = round(time.time() - t_end, 1)
        stop.set()
        await ck
        # every gateway process serves again: both ports answer an async call
        serves_after = {}
        for port in (p1, p2):
            try:
                body = {"adapter": "hook", "operation": "send", "payload": {}}
                path = f"/v1/jobs/{jobs['b'][0]}/effects/final{port}"
                st, _ = await call("b", 0, "POST", path, body, ASYNC_1, port)
                serves_after[port] = st
            except Exception as exc:
                serves_after[port] = repr(exc)
        report["serves_after"] = serves_after
        by_key = Counter(k for k, _, _ in up.got)
        first: dict[str, float] = {}
        for k, _, t in up.got:
            first.setdefault(k, t)
        dup = {k: c for k, c in by_key.items() if c > 1}
        stale = []
        for k, gen, t in up.got:
            tj = k.split(":", 1)[0]
            tenant, job = tj.split("/", 1) if "/" in tj else ("?", tj)
            at = takeover.get((tenant, job))
            if at and gen < 2 and t > at + 3.5:
                stale.append((k, gen, round(t - at, 2)))

        def why(v: Any) -> str:
            return str(json.loads(v[2] or "{}").get("reason", ""))[:40]

        st_count = Counter(
            v[0] if v[0] != "released" else f"released:{why(v)}" for v in states.values()
        )
        stranded = [(k, v) for k, v in states.items()
                    if not (v[0] in final or (v[0] == "released" and v[1] != "1"))]  # fmt: skip
        lat = sorted(
            first[f"{t}/{j}:{s}"] - at for (t, j, s), (at, _) in accepted.items()
            if f"{t}/{j}:{s}" in first
        )  # fmt: skip
        lat_b = sorted(
            first[f"{t}/{j}:{s}"] - at for (t, j, s), (at, _) in accepted.items()
            if t == "b" and f"{t}/{j}:{s}" in first
        )  # fmt: skip
        report["b_latency_s"] = {
            "n": len(lat_b),
            "p50": round(lat_b[len(lat_b) // 2], 3) if lat_b else None,
            "p99": round(lat_b[int(len(lat_b) * 0.99)], 3) if lat_b else None,
            "max": round(lat_b[-1], 3) if lat_b else None,
        }
        report["crashed_calls"] = {
            f"{t}/{j}:{s}": {
                "state": states.get((t, j, s), ("?",))[0],
                "sent_after_s": round(first[f"{t}/{j}:{s}"] - at, 3)
                if f"{t}/{j}:{s}" in first else None,
            }
            for (t, j, s), (at, _) in crashed.items()
        }  # fmt: skip
        report["g3_exit"] = g3.poll() if g3 else None
        report.update(
            accepted=len(accepted),
            refused=dict(refused),
            states=dict(st_count),
            stranded=stranded[:10],
            stranded_n=len(stranded),
            sent_keys=len(by_key),
            sends=len(up.got),
            duplicates=dup,
            stale_sends=stale,
            relay_latency_s={
                "p50": round(lat[len(lat) // 2], 3) if lat else None,
                "p99": round(lat[int(len(lat) * 0.99)], 3) if lat else None,
                "max": round(lat[-1], 3) if lat else None,
            },
            slow_over_4s=sum(1 for x in lat if x > 4),
            hint_checks=checks,
            hint_mismatches=len(mismatches),
            mismatch_samples=mismatches[:5],
            events=[(round(t - t0, 2), e) for t, e in events],
        )
        if mismatches:
            report["mismatch_times"] = sorted({round(m["t"] - t0, 1) for m in mismatches})[:40]
    finally:
        await http.close()
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGCONT)
                p.terminate()
        for p in procs:
            try:
                p.wait(25)
            except subprocess.TimeoutExpired:
                p.kill()
        rproc.terminate()
        rproc.wait(20)
        await runner.cleanup()
        await r.aclose()
    print(json.dumps(report, indent=1, default=str))
    broken = report.get("duplicates") or report.get("stale_sends") or report.get("stranded_n")
    if broken or (report.get("hint_mismatches") and not opts.code2):
        sys.exit(1)


if __name__ == "__main__":
    asyncio.run(main())
