"""Chaos harness: real processes, real faults, a recorded history, and checks C1-C5.

    python -m tests.chaos.harness [--long] [--seed N]        (make chaos: --long)

Parts, all on loopback:
- a durable redis-server we kill -9, restart, and restart empty;
- a TCP fault proxy between the gateway and Redis (pass, delay, blackhole, reset);
- ``fencegate serve`` processes, some started with a crash point (SIGKILL before admit,
  after admit, after the downstream call, after recording) and restarted;
- a downstream that deduplicates by Idempotency-Key (``dedup``) and one that does not
  (``plain``), both recording every request and every applied effect;
- worker processes that are really SIGSTOPped mid-request and resumed after a takeover.

Every call is recorded (invoke time, completion, status, code). The checks:
C1 no effect of generation g is applied when register(g' > g) was acknowledged before the
   call was made; C2 per key at most one applied effect, exactly one for acknowledged calls;
C3 every acknowledged outcome is still replayable at the end; C4 stale 409 responses equal
stale audit entries; C5 no 500, no crash that was not injected. Empty-Redis restarts must
fail closed with 0 dispatches. On failure the history and seed are written out for replay.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import redis
from aiohttp import web

from gateway.embedded import EmbeddedRedis, free_port

CRASH_POINTS = ("before_admit", "after_admit", "after_dispatch", "after_record")
DISPATCH_TIMEOUT = 1.0


@dataclass
class Op:
    kind: str  # register | effect
    job: str
    gen: int
    step: str = ""
    adapter: str = ""
    worker: str = ""
    invoked: float = 0.0
    completed: float = 0.0
    status: int = 0  # 0: no HTTP answer (connection lost: outcome indeterminate)
    code: str = ""
    replayed: bool = False
    result: Any = None


@dataclass
class Figures:
    zombie_scenarios: int = 0
    sigstop_scenarios: int = 0
    gateway_kills: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CRASH_POINTS, 0))
    redis_kills: int = 0
    empty_restarts: int = 0
    empty_restart_dispatches: int = 0
    empty_restart_refusals: int = 0
    proxy_faults: int = 0
    unknown_resolved: int = 0
    unknown_left: int = 0
    recovery_s: list[float] = field(default_factory=list)
    fault_latencies_ms: list[float] = field(default_factory=list)


class Downstream:
    """Records every request; ``/dedup`` applies an effect once per key, ``/plain`` every time."""

    def __init__(self) -> None:
        self.deliveries: dict[str, int] = {}
        self.applied: dict[str, list[tuple[int, float]]] = {}  # key -> [(generation, at)]
        self.port = free_port()
        self._responses: dict[str, dict[str, Any]] = {}

    async def handle(self, request: web.Request) -> web.Response:
        await request.read()
        key = request.match_info["kind"] + "|" + request.headers["Idempotency-Key"]
        gen = int(request.headers["Fencing-Token"])
        self.deliveries[key] = self.deliveries.get(key, 0) + 1
        if request.match_info["kind"] == "dedup" and key in self._responses:
            return web.json_response(self._responses[key])
        self.applied.setdefault(key, []).append((gen, time.monotonic()))
        body = {"effect": len(self.applied[key]), "key": key}
        self._responses[key] = body
        return web.json_response(body)

    async def start(self) -> web.AppRunner:
        app = web.Application()
        app.router.add_post("/{kind}", self.handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", self.port).start()
        return runner


class FaultProxy:
    """TCP proxy gateway -> Redis with modes: pass, delay, blackhole, reset."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self.mode = "pass"
        self.delay = 0.05
        self._conns: set[asyncio.StreamWriter] = set()

    async def start(self) -> asyncio.Server:
        return await asyncio.start_server(self._client, "127.0.0.1", self.port)

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.mode == "reset":
            writer.close()
            return
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        self._conns.update((writer, up_w))

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    while self.mode == "blackhole":
                        await asyncio.sleep(0.05)
                    if self.mode == "delay":
                        await asyncio.sleep(self.delay)
                    dst.write(data)
                    await dst.drain()
            except (OSError, ConnectionError):
                pass
            finally:
                dst.close()

        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(pipe(reader, up_w), pipe(up_r, writer))
        self._conns.difference_update((writer, up_w))

    def reset_all(self) -> None:
        for w in list(self._conns):
            with contextlib.suppress(Exception):
                w.transport.abort()
        self._conns.clear()


class Gateway:
    """One `fencegate serve` at a time on a fixed port; restartable, optionally crash-armed."""

    def __init__(self, workdir: Path, redis_url: str, downstream_port: int) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cfg = workdir / "chaos.toml"
        self.cfg.write_text(
            f"""
[redis]
url = "{redis_url}"
data_dir = "{workdir / "state"}"
auto_init = true
timeout_seconds = 0.5
[fencing]
dispatch_timeout_seconds = {DISPATCH_TIMEOUT}
[server]
shutdown_grace_seconds = 2
[adapters.dedup]
type = "webhook"
url = "http://127.0.0.1:{downstream_port}/dedup"
dedupes_by_key = true
timeout_seconds = 0.5
[adapters.plain]
type = "webhook"
url = "http://127.0.0.1:{downstream_port}/plain"
timeout_seconds = 0.5
"""
        )
        self.log = (workdir / "gateway.log").open("a")
        self.proc: subprocess.Popen[bytes] | None = None
        self.injected_kills = 0

    def start(self, crash_at: str | None = None) -> None:
        args = [
            sys.executable,
            "-m",
            "gateway",
            "serve",
            "--config",
            str(self.cfg),
            "--port",
            str(self.port),
        ]
        if crash_at:
            args += ["--chaos-crash-at", crash_at]
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=self.log)

    async def wait_up(self, within: float = 20) -> None:
        deadline = time.monotonic() + within
        async with aiohttp.ClientSession() as s:
            while time.monotonic() < deadline:
                assert self.proc is not None and self.proc.poll() is None, "gateway died at start"
                try:
                    async with s.get(self.url + "/healthz") as r:
                        if r.status == 200:
                            return
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.05)
        raise TimeoutError("gateway did not come up")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(20)

    def close(self) -> None:
        self.stop()
        self.log.close()


WORKER = r"""
import asyncio, json, sys, time, aiohttp
async def main():
    async with aiohttp.ClientSession() as s:
        print("ready", flush=True)
        for line in sys.stdin:
            req = json.loads(line)
            t = time.monotonic()
            try:
                headers = {"Fencing-Token": str(req["gen"])}
                async with s.post(req["url"], json=req["body"], headers=headers) as r:
                    b = await r.json(content_type=None)
                    out = {"status": r.status, "code": b.get("code", ""),
                           "replayed": b.get("replayed", False), "result": b.get("result")}
            except aiohttp.ClientError:
                out = {"status": 0, "code": "", "replayed": False, "result": None}
            print(json.dumps(out), flush=True)
asyncio.run(main())
"""


class Chaos:
    def __init__(self, workdir: Path, seed: int, long: bool) -> None:
        self.workdir = workdir
        self.rng = random.Random(seed)
        self.seed = seed
        self.long = long
        self.history: list[Op] = []
        self.figures = Figures()
        self.redis = EmbeddedRedis(workdir / "redis", use_socket=False)

    # -- calls ------------------------------------------------------------------

    async def register(self, http: aiohttp.ClientSession, job: str, gen: int) -> Op:
        op = Op("register", job, gen, invoked=time.monotonic())
        self.history.append(op)
        try:
            async with http.post(
                f"{self.gw.url}/v1/jobs/{job}/generations", json={"generation": gen}
            ) as r:
                body = await r.json(content_type=None)
                op.status, op.code = r.status, body.get("code", "")
        except aiohttp.ClientError:
            op.status = 0
        op.completed = time.monotonic()
        return op

    async def effect(
        self, http: aiohttp.ClientSession, job: str, step: str, gen: int, adapter: str, worker: str
    ) -> Op:
        op = Op("effect", job, gen, step, adapter, worker, invoked=time.monotonic())
        self.history.append(op)
        body = {"adapter": adapter, "operation": "notify", "payload": {"job": job, "step": step}}
        try:
            async with http.post(
                f"{self.gw.url}/v1/jobs/{job}/effects/{step}",
                json=body,
                headers={"Fencing-Token": str(gen)},
            ) as r:
                out = await r.json(content_type=None)
                op.status, op.code = r.status, out.get("code", "")
                op.replayed, op.result = out.get("replayed", False), out.get("result")
        except (aiohttp.ClientError, TimeoutError):
            op.status = 0
        op.completed = time.monotonic()
        return op

    # -- scenarios ----------------------------------------------------------------

    async def zombie(self, http: aiohttp.ClientSession, i: int) -> None:
        """A holds g1 and wakes late; the scheduler registers g2 at some moment; B works as g2."""
        job, adapter = f"z{i}", self.rng.choice(["dedup", "plain"])
        # half the time the zombie goes for a step B has not reached: the dangerous case,
        # where nothing but the fence stands between it and a second, stale effect
        step_a = self.rng.choice(["notify", "late"])
        await self.register(http, job, 1)
        delay_a, delay_reg = self.rng.random() * 0.03, self.rng.random() * 0.02

        async def worker_a() -> None:
            await asyncio.sleep(delay_a)
            await self.effect(http, job, step_a, 1, adapter, "A")

        async def takeover_b() -> None:
            await asyncio.sleep(delay_reg)
            if (await self.register(http, job, 2)).status == 201:
                await self.effect(http, job, "notify", 2, adapter, "B")

        await asyncio.gather(worker_a(), takeover_b())
        self.figures.zombie_scenarios += 1

    async def sigstop(self, http: aiohttp.ClientSession, i: int) -> None:
        """A real worker process is frozen mid-request, the job is taken over, A resumes."""
        job = f"s{i}"
        await self.register(http, job, 1)
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            WORKER,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        assert proc.stdin and proc.stdout
        await proc.stdout.readline()  # ready
        step = self.rng.choice(["notify", "late"])
        op = Op("effect", job, 1, step, "plain", "A")
        payload = {"job": job, "step": step}
        req = {
            "url": f"{self.gw.url}/v1/jobs/{job}/effects/{step}",
            "gen": 1,
            "body": {"adapter": "plain", "operation": "notify", "payload": payload},
        }
        line = (json.dumps(req) + "\n").encode()
        mid_request = self.rng.random() < 0.5
        if mid_request:  # frozen somewhere in the middle of sending its call
            op.invoked = time.monotonic()
            self.history.append(op)
            proc.stdin.write(line)
            await proc.stdin.drain()
            await asyncio.sleep(self.rng.random() * 0.004)
        proc.send_signal(signal.SIGSTOP)
        if (await self.register(http, job, 2)).status == 201:
            await self.effect(http, job, "notify", 2, "plain", "B")
        proc.send_signal(signal.SIGCONT)
        if not mid_request:  # frozen before its call: it wakes up and acts as a pure zombie
            op.invoked = time.monotonic()
            self.history.append(op)
            proc.stdin.write(line)
            await proc.stdin.drain()
        out = json.loads(await asyncio.wait_for(proc.stdout.readline(), 30))
        op.status, op.code, op.replayed, op.result = (
            out["status"],
            out["code"],
            out["replayed"],
            out["result"],
        )
        op.completed = time.monotonic()
        proc.stdin.close()
        await proc.wait()
        self.figures.sigstop_scenarios += 1

    async def gateway_kill(self, http: aiohttp.ClientSession, point: str, i: int) -> None:
        """The gateway is SIGKILLed at a point of a dispatch; a new one finishes the step."""
        job, adapter = f"k{point}{i}", self.rng.choice(["dedup", "plain"])
        await self.register(http, job, 1)
        self.gw.stop()
        self.gw.start(crash_at=point)
        await self.gw.wait_up()
        await self.effect(http, job, "notify", 1, adapter, "A")
        assert self.gw.proc is not None
        self.gw.proc.wait(10)  # the crash hook fired: SIGKILL
        self.figures.gateway_kills[point] += 1
        self.gw.start()
        await self.gw.wait_up()
        for _ in range(40):  # the worker retries the same step until it has an answer
            op = await self.effect(http, job, "notify", 1, adapter, "A")
            if op.status == 409 and op.code == "effect_in_progress":
                await asyncio.sleep(0.1)
                continue
            if op.status == 409 and op.code == "outcome_unknown":
                self.figures.unknown_left += 1
            elif op.status == 200 and point in ("after_admit", "after_dispatch"):
                self.figures.unknown_resolved += 1
            break

    async def redis_kill(self, http: aiohttp.ClientSession, i: int) -> None:
        """kill -9 Redis while a job is in use; restart it from the AOF; measure recovery."""
        job = f"r{i}"
        await self.register(http, job, 1)
        await self.effect(http, job, "a", 1, "dedup", "A")
        assert self.redis.process is not None
        os.kill(self.redis.process.pid, signal.SIGKILL)
        self.redis.process.wait()
        down = await self.effect(http, job, "b", 1, "dedup", "A")
        assert down.status in (503, 0), down
        self.redis.stop()
        started = time.monotonic()
        self.redis.start()
        while (await self.effect(http, job, "b", 1, "dedup", "A")).status != 200:
            await asyncio.sleep(0.02)
        self.figures.recovery_s.append(time.monotonic() - started)
        self.figures.redis_kills += 1

    async def proxy_fault(self, http: aiohttp.ClientSession, i: int) -> None:
        """Delay, blackhole or reset the gateway's Redis connections around live calls."""
        job, mode = f"p{i}", self.rng.choice(["delay", "blackhole", "reset"])
        await self.register(http, job, 1)
        self.proxy.mode = mode
        if mode == "reset":
            self.proxy.reset_all()
        op = await self.effect(http, job, "a", 1, "dedup", "A")
        self.figures.fault_latencies_ms.append((op.completed - op.invoked) * 1000)
        self.proxy.mode = "pass"
        for _ in range(60):
            op = await self.effect(http, job, "a", 1, "dedup", "A")
            if op.status == 200:
                break
            await asyncio.sleep(0.1)
        self.figures.proxy_faults += 1

    async def empty_restart(self, http: aiohttp.ClientSession, i: int) -> None:
        """Redis comes back empty: every call fails closed, nothing is dispatched."""
        job = f"e{i}"
        await self.register(http, job, 3)
        before = sum(self.down.deliveries.values())
        self.redis.stop()
        for f in (self.workdir / "redis").iterdir():
            if f.name.startswith("appendonly") or f.suffix in (".aof", ".rdb"):
                shutil.rmtree(f) if f.is_dir() else f.unlink()
        self.redis.start()
        for gen in (1, 3, 4):
            op = await self.effect(http, job, "x", gen, "plain", "Z")
            self.figures.empty_restart_refusals += op.status == 503
        reg = await self.register(http, job, 1)
        self.figures.empty_restart_refusals += reg.status == 503
        self.figures.empty_restart_dispatches += sum(self.down.deliveries.values()) - before
        # the gateway's own data dir: its state file must learn the new epoch, and the
        # default (.fencegate under the working directory) is the developer's `make run` state
        env = {**os.environ, "FENCEGATE_REDIS__DATA_DIR": str(self.workdir / "state")}
        init = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gateway", "init", "--redis-url", self.redis.url,
            "--confirm-data-loss", stdout=asyncio.subprocess.DEVNULL, env=env,
        )  # fmt: skip
        assert await init.wait() == 0
        self.figures.empty_restarts += 1

    # -- the run --------------------------------------------------------------------

    async def run(self) -> dict[str, Any]:
        self.redis.start()
        self.down = Downstream()
        runner = await self.down.start()
        self.proxy = FaultProxy(self.redis.port or 0)
        proxy_server = await self.proxy.start()
        self.gw = Gateway(self.workdir, f"redis://127.0.0.1:{self.proxy.port}/0", self.down.port)
        self.gw.start()
        await self.gw.wait_up()
        n = {
            "zombie": 200 if self.long else 30,
            "sigstop": 24 if self.long else 4,
            "kills": 10 if self.long else 2,  # per crash point
            "redis": 30 if self.long else 3,
            "proxy": 20 if self.long else 4,
            "empty": 5 if self.long else 2,
        }
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
                for start in range(0, n["zombie"], 25):
                    await asyncio.gather(
                        *(self.zombie(http, i) for i in range(start, min(start + 25, n["zombie"])))
                    )
                for i in range(n["sigstop"]):
                    await self.sigstop(http, i)
                for point in CRASH_POINTS:
                    for i in range(n["kills"]):
                        await self.gateway_kill(http, point, i)
                for i in range(n["proxy"]):
                    await self.proxy_fault(http, i)
                for i in range(n["redis"]):
                    await self.redis_kill(http, i)
                checks = await self.check(http)
                for i in range(n["empty"]):
                    await self.empty_restart(http, i)
            checks["empty Redis restarts fail closed with 0 dispatches"] = (
                self.figures.empty_restart_dispatches == 0
                and self.figures.empty_restart_refusals == 4 * n["empty"]
            )
        finally:
            self.gw.close()
            proxy_server.close()
            await runner.cleanup()
            self.redis.stop()
        return checks

    async def check(self, http: aiohttp.ClientSession) -> dict[str, bool]:
        effects = [op for op in self.history if op.kind == "effect"]
        acked_regs = [op for op in self.history if op.kind == "register" and op.status == 201]
        problems: list[str] = []
        # C1: an applied effect of generation g was never invoked after register(g' > g) was acked
        for key, applied in self.down.applied.items():
            _, idem = key.split("|")
            job, step = idem.split(":")
            for gen, _ in applied:
                calls = [
                    op for op in effects if op.job == job and op.step == step and op.gen == gen
                ]
                first_invoke = min(op.invoked for op in calls)
                newer = [
                    r
                    for r in acked_regs
                    if r.job == job and r.gen > gen and r.completed < first_invoke
                ]
                if newer:
                    problems.append(
                        f"C1 {key}: generation {gen} applied after register({newer[0].gen})"
                    )
        # C2: at most one applied effect per key; exactly one for acknowledged calls
        for key, applied in self.down.applied.items():
            if len(applied) > 1:
                problems.append(f"C2 {key}: {len(applied)} effects")
        for op in effects:
            if op.status == 200 and f"{op.adapter}|{op.job}:{op.step}" not in self.down.applied:
                problems.append(f"C2 {op.job}:{op.step}: acknowledged but never applied")
        # C3: every acknowledged outcome is still replayable
        redis_client = redis.Redis.from_url(self.redis.url, decode_responses=True)
        acked = {(op.job, op.step, op.adapter): op for op in effects if op.status == 200}
        for (job, step, adapter), op in acked.items():
            fence = int(redis_client.hget(f"fg:{{default/{job}}}:job", "fence") or 0)
            replay = await self.effect(http, job, step, fence, adapter, "checker")
            if not (replay.status == 200 and replay.result == op.result):
                problems.append(f"C3 {job}:{step}: replay {replay.status} {replay.code}")
        # C4: stale 409s == stale audit entries (the job streams are authoritative)
        stale_responses = sum(
            op.status == 409 and op.code == "stale_generation" for op in self.history
        )
        stale_audited = 0
        for stream in redis_client.scan_iter(match="fg:{default/*}:audit", count=1000):
            stale_audited += sum(
                f["reason"] == "stale_generation" for _, f in redis_client.xrange(stream)
            )
        redis_client.close()
        if stale_responses != stale_audited:
            problems.append(
                f"C4 stale 409s {stale_responses} != stale audit entries {stale_audited}"
            )
        # C5: no 500; the gateway never died except where a crash was injected
        server_errors = [op for op in self.history if op.status == 500]
        if server_errors:
            problems.append(f"C5 {len(server_errors)} responses were 500")
        if self.gw.proc is None or self.gw.proc.poll() is not None:
            problems.append("C5 the gateway died without an injected crash")
        self.problems = problems
        self.stale_responses = stale_responses
        c = {p.split()[0] for p in problems}
        return {
            "C1 no stale effect after a takeover was acknowledged": "C1" not in c,
            "C2 at most one effect per key (one for every acknowledged call)": "C2" not in c,
            "C3 every acknowledged outcome still replayable": "C3" not in c,
            "C4 stale 409s equal stale audit entries": "C4" not in c,
            "C5 no 500 and no uninjected crash": "C5" not in c,
        }

    def report(self, checks: dict[str, bool]) -> str:
        f = self.figures
        rec = sorted(f.recovery_s) or [0.0]
        lat = sorted(f.fault_latencies_ms) or [0.0]
        applied = sum(len(v) for v in self.down.applied.values())
        duplicates = sum(len(v) - 1 for v in self.down.applied.values() if len(v) > 1)
        kills = ", ".join(f"{k} {v}" for k, v in f.gateway_kills.items())
        stale_applied = sum(1 for p in self.problems if p.startswith("C1"))
        p99 = lat[int(0.99 * (len(lat) - 1))]
        rows = [
            ("zombie scenarios (of them real SIGSTOP/SIGCONT worker processes)",
             f"{f.zombie_scenarios + f.sigstop_scenarios} ({f.sigstop_scenarios})"),
            ("stale effects applied", str(stale_applied)),
            ("stale 409 responses = stale audit entries", str(self.stale_responses)),
            ("gateway SIGKILLs by crash point", kills),
            ("effects applied downstream / duplicates", f"{applied} / {duplicates}"),
            ("unknown outcomes resolved (dedup) / left unknown (plain, never re-sent)",
             f"{f.unknown_resolved} / {f.unknown_left}"),
            ("Redis kill -9 and restart (AOF always)", str(f.redis_kills)),
            ("recovery after Redis restart, p50 / max",
             f"{statistics.median(rec):.2f} s / {rec[-1]:.2f} s"),
            ("fault proxy episodes (delay, blackhole, reset); p99 latency during faults",
             f"{f.proxy_faults}; {p99:.0f} ms"),
            ("empty-Redis restarts failing closed / dispatches during them",
             f"{f.empty_restarts} / {f.empty_restart_dispatches}"),
        ]  # fmt: skip
        mode = "long" if self.long else "short"
        lines = [f"seed {self.seed}, {mode} run, {len(self.history)} calls recorded", ""]
        lines += ["| figure | value |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows), ""]
        lines += [f"[{'ok' if ok else 'FAILED'}] {name}" for name, ok in checks.items()]
        lines += [f"  {p}" for p in self.problems[:20]]
        return "\n".join(lines)

    def dump(self, path: Path) -> None:
        history = [asdict(op) for op in self.history]
        doc = {"seed": self.seed, "history": history, "problems": self.problems}
        path.write_text(json.dumps(doc, indent=1))


def run(seed: int, long: bool, keep: Path | None = None) -> tuple[bool, str]:
    with tempfile.TemporaryDirectory(prefix="fencegate-chaos-") as tmp:
        chaos = Chaos(Path(tmp), seed, long)
        checks = asyncio.run(chaos.run())
        report = chaos.report(checks)
        ok = all(checks.values())
        if not ok:
            out = keep or Path(tempfile.mkdtemp(prefix="fencegate-chaos-failed-"))
            chaos.dump(out / "history.json")
            shutil.copy(Path(tmp) / "gateway.log", out / "gateway.log")
            report += f"\nhistory, seed and logs kept in {out}"
        return ok, report


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--long", action="store_true")
    parser.add_argument("--seed", type=int, default=int(time.time()))
    args = parser.parse_args()
    ok, report = run(args.seed, args.long)
    print(report)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
