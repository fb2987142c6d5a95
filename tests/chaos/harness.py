"""Chaos harness: real processes, real faults, a recorded history, and checks C1-C5, R1-R3.

    python -m tests.chaos.harness [--long] [--seed N] [--keep DIR]     (make chaos: --long)

Parts, all on loopback:
- a durable redis-server we kill -9, restart, and restart empty;
- a TCP fault proxy between the gateway and Redis and one between the gateway and the
  downstreams (:mod:`tests.support.wire`): whole-proxy delay, blackhole, reset, and faults
  armed in the middle of real traffic: drop the connection after the request arrived (the
  other side acted, the reply is lost), hold the reply (then deliver or drop), hold the
  request (then deliver, even after the gateway gave up, or drop), reset; the downstream
  proxy also refuses connections for a while;
- ``fencegate serve`` processes, some started with a crash point (SIGKILL before admit,
  after admit, after the downstream call, after recording) and restarted;
- a downstream that deduplicates by Idempotency-Key (``dedup``) and one that does not
  (``plain``), both recording every request (payload, Fencing-Token) and every applied
  effect, and able to refuse a job's requests with 503 for a while;
- worker processes that are really SIGSTOPped mid-request and resumed after a takeover;
- the wire phase: jobs whose workers send a share of their calls with
  ``Prefer: respond-async``, takeovers while the relay retries a refused step, stale
  workers sending async calls after takeovers, an operator who resolves unknown steps
  (truthfully: by asking the downstream once the wire is quiet), and stale async calls
  after those resolutions.

Every payload carries its generation and a per-generation value, so a send can be traced
to the call that asked for it. Every call has its own Worker-Id, so an audit entry can be
traced to its call. The checks:
C1 no effect of generation g is applied when register(g' > g) was acknowledged before the
   call was made; C2 per key at most one applied effect at either downstream (at the
   plain one more only for a key an operator resolved) and one intent per key at the
   deduplicating one, exactly one for acknowledged calls, and the acknowledged intent is
   the applied one; C3 every acknowledged outcome is still replayable at the end; C4 every
   stale 409 has exactly one stale audit entry and no call has more than one; C5 no 500, no
   crash that was not injected; R1 every send carries an intent that a call of the same
   generation presented, and every applied payload is that of the generation the record
   says dispatched it; R2 no superseded send: no send of generation g later than
   DISPATCH_TIMEOUT (+ slack) after register(g' > g) was acknowledged (every dispatch,
   the relay's included, must send before its deadline, taken before its admit or claim);
   R3 no step is left pending or dispatching once the traffic stopped. Empty-Redis
   restarts must fail closed with 0 dispatches. Liveness (:mod:`tests.chaos.liveness`, every
   run, two gateways): L1 every gateway serves again within a bound after each fault heals,
   L2 no quarantine without a real data loss, L3 every step final or listed for a decision.
   On failure the report, history and seed are written out for replay.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
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
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import redis.asyncio as aioredis
from aiohttp import web

from gateway.store.embedded import EmbeddedRedis, free_port
from tests.chaos.liveness import Hop, Liveness
from tests.support.wire import WIRE_MODES, Fault, WireProxy

CRASH_POINTS = ("before_admit", "after_admit", "after_dispatch", "after_record")
DISPATCH_TIMEOUT = 1.0
# a send observed this long after its deadline could have passed is superseded (R2); the
# slack covers the proxy seeing the bytes a moment after the gateway's deadline check
SEND_SLACK = 0.15
ADAPTERS = ("dedup", "plain")
# the periodic checks (marks against Redis's markers, the epoch) under traffic: every second
EPOCH_INTERVAL = 1.0
ASYNC_SHARE = 0.4


@dataclass
class Op:
    kind: str  # register | effect | resolve
    job: str
    gen: int
    step: str = ""
    adapter: str = ""
    worker: str = ""  # the call's own Worker-Id
    invoked: float = 0.0
    completed: float = 0.0
    status: int = 0  # 0: no HTTP answer (connection lost: outcome indeterminate)
    code: str = ""
    replayed: bool = False
    result: Any = None
    pgen: int = 0  # the generation whose payload the call carries (its own, except replays)
    is_async: bool = False


@dataclass
class Figures:
    zombie_scenarios: int = 0
    sigstop_scenarios: int = 0
    gateway_kills: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CRASH_POINTS, 0))
    redis_kills: int = 0
    empty_restarts: int = 0
    empty_restart_dispatches: int = 0
    empty_restart_refusals: int = 0
    restores: int = 0
    restore_calls: int = 0
    restore_refusals: int = 0
    restore_dispatches: int = 0
    restore_quarantined: int = 0
    proxy_faults: int = 0
    unknown_resolved: int = 0
    unknown_left: int = 0
    recovery_s: list[float] = field(default_factory=list)
    fault_latencies_ms: list[float] = field(default_factory=list)
    # the wire phase
    mixed_jobs: int = 0
    relay_scenarios: int = 0
    takeovers: int = 0
    takeovers_in_relay_retries: int = 0
    stale_async_calls: int = 0
    stale_async_refused: int = 0
    operator_delivered: int = 0
    operator_not_delivered: int = 0
    operator_failed: int = 0
    left_unknown: list[str] = field(default_factory=list)
    dup_after_resolution: int = 0
    audited_unanswered: int = 0
    relay_superseded_audited: int = 0
    wire_phase_s: float = 0.0
    window_sends: int = 0
    superseded_sends: int = 0
    foreign_intent_sends: int = 0


@dataclass
class Delivery:
    kind: str  # dedup | plain
    key: str  # kind|job:step
    token: int
    payload: Any
    at: float
    applied: bool = False
    refused: bool = False
    response: Any = None


class Downstream:
    """Records every request; ``/dedup`` applies an effect once per key, ``/plain`` every time;
    a job in ``refusing`` gets 503 (the receiver declined: not delivered) until its time."""

    def __init__(self) -> None:
        self.deliveries: list[Delivery] = []
        self.applied: dict[str, list[Delivery]] = {}  # key -> applied effects, in order
        self.refusing: dict[str, float] = {}  # job -> refuse until (monotonic)
        self.refused: Counter[str] = Counter()  # key -> 503s answered
        self.port = free_port()
        self._responses: dict[str, dict[str, Any]] = {}

    async def handle(self, request: web.Request) -> web.Response:
        raw = await request.read()
        kind, idem = request.match_info["kind"], request.headers["Idempotency-Key"]
        key = f"{kind}|{idem}"
        now = time.monotonic()
        try:
            payload = json.loads(raw)
        except ValueError:
            payload = raw.decode("utf-8", "replace")
        d = Delivery(kind, key, int(request.headers["Fencing-Token"]), payload, now)
        self.deliveries.append(d)
        if self.refusing.get(idem.split(":")[0], 0.0) > now:
            d.refused = True
            self.refused[key] += 1
            return web.json_response({"refused": True}, status=503)
        if kind == "dedup" and key in self._responses:
            d.response = self._responses[key]
            return web.json_response(d.response)
        d.applied = True
        self.applied.setdefault(key, []).append(d)
        d.response = {"effect": len(self.applied[key]), "key": key}
        self._responses[key] = d.response
        return web.json_response(d.response)

    async def start(self) -> web.AppRunner:
        app = web.Application()
        app.router.add_post("/{kind}", self.handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", self.port).start()
        return runner


def script_shas() -> dict[str, bytes]:
    """SHA-1 of each deciding script exactly as the gateway sends it (EVALSHA), by name without
    its key count ("admit", "relay", ...): the Redis proxy arms faults on one script's calls."""
    from gateway.store import scripts as store

    out: dict[str, bytes] = {}
    for name in store.SCRIPT_NAMES:
        src = store.lua_source(name)
        sha = hashlib.sha1(src.encode(), usedforsecurity=False).hexdigest()
        out[name.rsplit("-", 1)[0]] = sha.encode()
    return out


class Gateway:
    """One `fencegate serve` at a time on a fixed port; restartable, optionally crash-armed."""

    def __init__(
        self,
        workdir: Path,
        redis_url: str,
        downstream_port: int,
        *,
        workers: int = 1,
        epoch_interval: float = EPOCH_INTERVAL,
    ) -> None:
        self.port = free_port()
        self.workers = workers
        self.url = f"http://127.0.0.1:{self.port}"
        self.cfg = workdir / "chaos.toml"
        self.cfg.write_text(
            f"""
[redis]
url = "{redis_url}"
data_dir = "{workdir / "state"}"
auto_init = true
timeout_seconds = 0.5
epoch_interval_seconds = {epoch_interval}
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
        if self.workers > 1:
            args += ["--workers", str(self.workers)]
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
                headers = {"Fencing-Token": str(req["gen"]), "Worker-Id": req["wid"]}
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
        self.calls = 0
        self.fence: dict[str, int] = {}  # job -> highest acknowledged registration
        self.async_steps: set[tuple[str, str]] = set()  # (job, step) that got a 202
        self.operator_keys: set[str] = set()  # kind|job:step an operator resolved
        self.wire_jobs: list[str] = []
        self.records: dict[str, dict[str, Any]] = {}  # job -> step -> record, at the end
        self.problems: list[str] = []
        self.stale_responses = 0
        self.live: Liveness | None = None

    def start_liveness(self, gateways: list[Gateway]) -> Liveness:
        """Probe streams on every gateway (L1-L3, :mod:`tests.chaos.liveness`)."""
        logs = [g.cfg.parent / "gateway.log" for g in gateways]
        self.live = Liveness([g.url for g in gateways], logs)
        self.live.start()
        return self.live

    async def finish_liveness(self, http: aiohttp.ClientSession, checks: dict[str, bool]) -> None:
        """A quiet spell, the probes stopped, L1-L3 added to ``checks`` and the problems."""
        assert self.live is not None
        await self.live.quiet_spell()
        await self.live.stop()
        url = self.live.urls[0]
        jobs = {op.job: url for op in self.history if op.kind == "effect"}
        checks.update(await self.live.check(http, jobs))
        self.problems += self.live.problems

    def payload(self, job: str, step: str, gen: int) -> dict[str, Any]:
        """Each generation's own payload for a step: its generation and a value of its own."""
        digest = hashlib.sha256(f"{self.seed}/{job}/{step}/{gen}".encode()).hexdigest()
        return {"job": job, "step": step, "gen": gen, "value": int(digest[:8], 16) % 100_000}

    def wid(self, worker: str) -> str:
        self.calls += 1
        return f"{worker}-{self.calls}"

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
        except (aiohttp.ClientError, TimeoutError):
            op.status = 0
        op.completed = time.monotonic()
        if op.status in (200, 201):
            self.fence[job] = max(self.fence.get(job, 0), gen)
        return op

    async def effect(
        self,
        http: aiohttp.ClientSession,
        job: str,
        step: str,
        gen: int,
        adapter: str,
        worker: str,
        *,
        pgen: int = 0,
        is_async: bool = False,
    ) -> Op:
        pgen = pgen or gen
        op = Op("effect", job, gen, step, adapter, self.wid(worker), invoked=time.monotonic())
        op.pgen, op.is_async = pgen, is_async
        self.history.append(op)
        body = {"adapter": adapter, "operation": "notify", "payload": self.payload(job, step, pgen)}
        headers = {"Fencing-Token": str(gen), "Worker-Id": op.worker}
        if is_async:
            headers["Prefer"] = "respond-async"
        try:
            async with http.post(
                f"{self.gw.url}/v1/jobs/{job}/effects/{step}", json=body, headers=headers
            ) as r:
                out = await r.json(content_type=None)
                op.status, op.code = r.status, out.get("code", "")
                op.replayed, op.result = out.get("replayed", False), out.get("result")
        except (aiohttp.ClientError, TimeoutError):
            op.status = 0
        op.completed = time.monotonic()
        if op.status == 202:
            self.async_steps.add((job, step))
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
        op = Op("effect", job, 1, step, "plain", self.wid("A"), pgen=1)
        payload = self.payload(job, step, 1)
        req = {
            "url": f"{self.gw.url}/v1/jobs/{job}/effects/{step}",
            "gen": 1,
            "wid": op.worker,
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
        window = self.fault_begins("gateway_kill")
        self.gw.stop()
        self.gw.start(crash_at=point)
        await self.gw.wait_up()
        await self.effect(http, job, "notify", 1, adapter, "A")
        assert self.gw.proc is not None
        self.gw.proc.wait(10)  # the crash hook fired: SIGKILL
        self.figures.gateway_kills[point] += 1
        self.gw.start()
        await self.gw.wait_up()
        self.fault_healed(window)
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
        window = self.fault_begins("redis_kill")
        os.kill(self.redis.process.pid, signal.SIGKILL)
        self.redis.process.wait()
        down = await self.effect(http, job, "b", 1, "dedup", "A")
        assert down.status in (503, 0), down
        self.redis.stop()
        started = time.monotonic()
        self.redis.start()
        self.fault_healed(window)
        while (await self.effect(http, job, "b", 1, "dedup", "A")).status != 200:
            await asyncio.sleep(0.02)
        self.figures.recovery_s.append(time.monotonic() - started)
        self.figures.redis_kills += 1

    async def proxy_fault(self, http: aiohttp.ClientSession, i: int) -> None:
        """Delay, blackhole or reset the gateway's Redis connections around live calls."""
        job, mode = f"p{i}", self.rng.choice(["delay", "blackhole", "reset"])
        await self.register(http, job, 1)
        window = self.fault_begins("proxy_fault")
        self.proxy.mode = mode
        if mode == "reset":
            self.proxy.reset_all()
        op = await self.effect(http, job, "a", 1, "dedup", "A")
        self.figures.fault_latencies_ms.append((op.completed - op.invoked) * 1000)
        self.proxy.mode = "pass"
        self.fault_healed(window)
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
        before = len(self.down.deliveries)
        window = self.fault_begins("empty_restart")
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
        self.figures.empty_restart_dispatches += len(self.down.deliveries) - before
        # the gateway's own data dir: its state file must learn the new epoch, and the
        # default (.fencegate under the working directory) is the developer's `make run` state
        env = {**os.environ, "FENCEGATE_REDIS__DATA_DIR": str(self.workdir / "state")}
        init = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gateway", "init", "--redis-url", self.redis.url,
            "--confirm-data-loss", stdout=asyncio.subprocess.DEVNULL, env=env,
        )  # fmt: skip
        assert await init.wait() == 0
        self.fault_healed(window)
        self.figures.empty_restarts += 1

    async def restore(self, http: aiohttp.ClientSession, gateways: list[Any], i: int) -> None:
        """A real AOF backup taken mid-run is put back: Redis loses generation 2 of a job and
        the step it delivered. Through every gateway (the second has its own data dir and
        never saw those writes) generation 1 is refused and nothing is sent; Redis is
        quarantined (the right answer: L2 counts it as a true quarantine); then the operator
        runs `init --confirm-data-loss`, the scheduler registers generation 3, and every
        gateway serves again (L1 measures how fast from the heal)."""
        job = f"rb{i}"
        assert (await self.register(http, job, 1)).status == 201
        data = self.workdir / "redis"
        backup = self.workdir / f"backup-{i}"
        backup.mkdir()
        for f in data.iterdir():  # every acknowledged write is in it: appendfsync always
            if f.name.startswith("appendonly"):
                (shutil.copytree if f.is_dir() else shutil.copy2)(f, backup / f.name)
        assert (await self.register(http, job, 2)).status == 201
        for gw in gateways:  # both see the slot's counter after generation 2's writes
            self.gw = gw
            op = await self.effect(http, job, f"s{gateways.index(gw)}", 2, "plain", "R")
            assert op.status == 200, op
        await asyncio.sleep(1.5)  # the witness ticks past those writes (marks interval 1 s)
        window = self.live.begin("restore", loses_writes=True) if self.live else None
        self.redis.stop()
        for f in data.iterdir():
            if f.name.startswith("appendonly"):
                shutil.rmtree(f) if f.is_dir() else f.unlink()
        for f in backup.iterdir():
            (shutil.copytree if f.is_dir() else shutil.copy2)(f, data / f.name)
        self.redis.start()
        before = len(self.down.deliveries)
        for gw in gateways:  # the zombie of generation 1, on every gateway, every step
            self.gw = gw
            for step in ("s0", "s1", "new"):
                for _ in range(3):  # the first calls may meet connections the restart cut
                    op = await self.effect(http, job, step, 1, "plain", "Z")
                    if op.status == 503:
                        break
                self.figures.restore_refusals += op.status == 503
                self.figures.restore_calls += 1
        self.figures.restore_dispatches += len(self.down.deliveries) - before
        deadline = time.monotonic() + 10
        while not await self.quarantined():
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        self.figures.restore_quarantined += await self.quarantined()
        env = {**os.environ, "FENCEGATE_REDIS__DATA_DIR": str(self.workdir / "state")}
        init = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gateway", "init", "--redis-url", self.redis.url,
            "--confirm-data-loss", stdout=asyncio.subprocess.DEVNULL, env=env,
        )  # fmt: skip
        assert await init.wait() == 0
        self.gw = gateways[0]
        for _ in range(50):
            if (await self.register(http, job, 3)).status == 201:
                break
            await asyncio.sleep(0.1)
        if window is not None:
            self.live.heal(window)  # type: ignore[union-attr]
        self.figures.restores += 1

    async def quarantined(self) -> bool:
        client = aioredis.Redis.from_url(self.redis.url)
        try:
            return bool(await client.exists("fg:quarantine")) and not await client.exists(
                "fg:marker"
            )
        finally:
            await client.aclose()

    # -- the wire phase: async calls, the relay, takeovers, wire faults, operators ------

    async def job_view(self, http: aiohttp.ClientSession, job: str) -> dict[str, Any]:
        """GET /v1/jobs/{job} (fence and effect records); {} when there is no answer."""
        try:
            async with http.get(f"{self.gw.url}/v1/jobs/{job}") as r:
                if r.status != 200:
                    return {}
                body: dict[str, Any] = await r.json(content_type=None)
                return body
        except (aiohttp.ClientError, TimeoutError):
            return {}

    async def audit(self, http: aiohttp.ClientSession, job: str) -> list[dict[str, Any]]:
        """The job's audit entries (its own stream), all pages."""
        entries: list[dict[str, Any]] = []
        cursor = ""
        for _ in range(100):
            url = f"{self.gw.url}/v1/audit/rejections?job={job}&limit=1000"
            async with http.get(url + (f"&cursor={cursor}" if cursor else "")) as r:
                assert r.status == 200, f"audit listing of {job}: {r.status}"
                page = await r.json(content_type=None)
            entries += page["items"]
            cursor = page.get("next_cursor") or ""
            if not cursor:
                break
        return entries

    async def effect_retrying(
        self,
        http: aiohttp.ClientSession,
        job: str,
        step: str,
        gen: int,
        adapter: str,
        worker: str,
        *,
        is_async: bool = False,
        tries: int = 4,
    ) -> Op:
        """A worker retries what the SDK says is safe to retry (and a lost answer)."""
        for attempt in range(tries):
            op = await self.effect(http, job, step, gen, adapter, worker, is_async=is_async)
            busy = op.status == 409 and op.code == "effect_in_progress"
            if not (busy or op.status in (0, 502, 503, 504)):
                break
            await asyncio.sleep(0.15 + 0.15 * attempt)
        return op

    async def takeover(self, http: aiohttp.ClientSession, job: str, gen: int) -> Op:
        """register(gen); counted as 'during relay retries' when an async step of the job that
        the downstream refused (503) was still pending, dispatching or released right before
        (a refusal by connection is not seen by the downstream: not counted)."""
        effects = (await self.job_view(http, job)).get("effects") or {}
        retrying = any(
            rec.get("state") in ("pending", "dispatching", "released")
            and (job, step) in self.async_steps
            and self.down.refused[f"{rec.get('adapter')}|{job}:{step}"] > 0
            for step, rec in effects.items()
        )
        op = await self.register(http, job, gen)
        if op.status == 201:
            self.figures.takeovers += 1
            self.figures.takeovers_in_relay_retries += retrying
        return op

    async def stale_async(
        self, http: aiohttp.ClientSession, job: str, gen: int, step: str, adapter: str, wait: float
    ) -> None:
        """A superseded worker wakes up and sends an async call."""
        await asyncio.sleep(wait)
        op = await self.effect(http, job, step, gen, adapter, f"zombie{gen}", is_async=True)
        self.figures.stale_async_calls += 1
        self.figures.stale_async_refused += op.status == 409

    async def work(
        self,
        http: aiohttp.ClientSession,
        job: str,
        gen: int,
        steps: list[str],
        adapter: str,
        rng: random.Random,
    ) -> None:
        for step in steps:
            await asyncio.sleep(rng.uniform(0.0, 0.08))
            is_async = rng.random() < ASYNC_SHARE
            op = await self.effect_retrying(
                http, job, step, gen, adapter, f"w{gen}", is_async=is_async
            )
            if op.status == 409 and op.code in ("stale_generation", "lease_expired"):
                return  # superseded: the worker stops

    async def job_life(self, http: aiohttp.ClientSession, i: int, rng: random.Random) -> None:
        """One job under the wire faults: 2-3 generations, each a worker of 1-2 steps, sync
        and async calls, takeovers at random moments, stale async calls after them."""
        job, adapter = f"m{i}", rng.choice(ADAPTERS)
        self.wire_jobs.append(job)
        steps = ["s1", "s2"][: rng.choice((1, 2))]
        await self.register(http, job, 1)
        tasks = [asyncio.create_task(self.work(http, job, 1, steps, adapter, rng))]
        for gen in range(2, rng.choice((2, 2, 3)) + 1):
            await asyncio.sleep(rng.uniform(0.0, 0.25))
            if (await self.takeover(http, job, gen)).status != 201:
                break
            tasks.append(asyncio.create_task(self.work(http, job, gen, steps, adapter, rng)))
            if rng.random() < 0.5:
                step, wait = rng.choice(steps), rng.uniform(0.0, 0.3)
                tasks.append(
                    asyncio.create_task(self.stale_async(http, job, gen - 1, step, adapter, wait))
                )
        await asyncio.gather(*tasks)
        self.figures.mixed_jobs += 1

    async def relay_takeover(self, http: aiohttp.ClientSession, i: int, rng: random.Random) -> None:
        """An async step whose downstream refuses (503) for a while: the relay retries it; the
        job is taken over meanwhile; the new generation re-pins the step (sync or async) or
        works elsewhere; the stale worker sends async calls; sometimes a second takeover."""
        job, step, adapter = f"q{i}", "pay", rng.choice(ADAPTERS)
        self.wire_jobs.append(job)
        key = f"{adapter}|{job}:{step}"
        await self.register(http, job, 1)
        self.down.refusing[job] = time.monotonic() + 60  # until the relay has tried once
        await self.effect_retrying(http, job, step, 1, adapter, "qa1", is_async=True)
        for _ in range(120):  # the relay's first attempt was refused (within 6 s)
            if self.down.refused[key]:
                break
            await asyncio.sleep(0.05)
        self.down.refusing[job] = time.monotonic() + rng.uniform(1.5, 3.5)
        await asyncio.sleep(rng.uniform(0.0, 1.0))
        gen = 1
        if (await self.takeover(http, job, 2)).status == 201:
            gen = 2
            b = rng.choice(("sync", "async", "other", "none"))
            if b in ("sync", "async"):  # re-pins the released step to its own intent
                await self.effect(http, job, step, 2, adapter, "qb2", is_async=b == "async")
            elif b == "other":
                await self.effect(http, job, "other", 2, adapter, "qb2", is_async=True)
            if rng.random() < 0.6:
                await self.stale_async(http, job, 1, step, adapter, rng.uniform(0.0, 0.5))
            if rng.random() < 0.3:
                await asyncio.sleep(rng.uniform(0.0, 0.8))
                if (await self.takeover(http, job, 3)).status == 201:
                    gen = 3
                    is_async = rng.random() < 0.5
                    await self.effect(http, job, step, 3, adapter, "qc3", is_async=is_async)
        # the refusals end; the current generation finishes the step (or learns its outcome)
        left = self.down.refusing[job] - time.monotonic()
        await asyncio.sleep(max(0.0, left) + rng.uniform(0.2, 1.5))
        await self.effect_retrying(http, job, step, gen, adapter, f"q{gen}")
        self.figures.relay_scenarios += 1

    async def injector(self, stop: asyncio.Event, rng: random.Random) -> None:
        """Arms one wire fault at a time, on Redis (one script's calls, or any) or downstream."""
        # the scripts of the effect path, weighted by how much they decide
        weights = {"admit": 3, "relay": 2, "record": 2, "register": 1}
        targets = [
            (n, self.shas[n]) for n, w in weights.items() if n in self.shas for _ in range(w)
        ]
        targets.append(("any", b"EVALSHA"))
        while not stop.is_set():
            await asyncio.sleep(rng.uniform(0.02, 0.12))
            mode, then = rng.choice(WIRE_MODES), rng.choice(("deliver", "drop"))
            hold = rng.uniform(0.05, 0.9)  # either side of redis.timeout_seconds (0.5)
            if rng.random() < 0.55:
                label, match = rng.choice(targets)
                self.proxy.arm(Fault(mode, match, f"redis:{label}", hold, then))
            else:
                self.dproxy.arm(Fault(mode, b"POST /", "downstream", hold, then))

    async def closer(self, stop: asyncio.Event, rng: random.Random) -> None:
        """The downstreams refuse connections for a while, now and then."""
        while not stop.is_set():
            await asyncio.sleep(rng.uniform(1.0, 3.0))
            if not stop.is_set():
                await self.dproxy.refuse_for(rng.uniform(0.3, 1.5))

    async def settle(self, http: aiohttp.ClientSession, within: float) -> None:
        """Faults off; wait for held bytes, pending steps and the relay's retries."""
        self.proxy.disarm()
        self.dproxy.disarm()
        self.down.refusing.clear()
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            pending = 0
            for job in self.wire_jobs:
                effects = (await self.job_view(http, job)).get("effects") or {}
                pending += sum(r.get("state") == "pending" for r in effects.values())
            if not pending and not self.proxy.held and not self.dproxy.held:
                break
            await asyncio.sleep(0.25)
        await asyncio.sleep(DISPATCH_TIMEOUT + 0.5)  # dispatches in flight, a relay retry

    async def operator(self, http: aiohttp.ClientSession) -> list[tuple[str, str, str]]:
        """Resolve every unknown step (or one left dispatching) truthfully: the operator asks
        the downstream whether the effect was applied. Returns the steps resolved not
        delivered. Redis faults on the resolve script stay armed meanwhile."""
        released = []
        for job in self.wire_jobs:
            effects = (await self.job_view(http, job)).get("effects") or {}
            for step, rec in effects.items():
                if rec.get("state") not in ("unknown", "dispatching"):
                    continue
                key = f"{rec['adapter']}|{job}:{step}"
                applied = self.down.applied.get(key)
                body: dict[str, Any] = {"outcome": "not_delivered"}
                if applied:
                    body = {
                        "outcome": "delivered",
                        "result": {"status": 200, "body": applied[-1].response},
                    }
                if self.rng.random() < 0.3 and "resolve" in self.shas:
                    mode = self.rng.choice(WIRE_MODES)
                    self.proxy.arm(Fault(mode, self.shas["resolve"], "redis:resolve", 0.3))
                op = Op("resolve", job, 0, step, rec["adapter"], "operator")
                self.history.append(op)
                for _ in range(5):
                    op.invoked = time.monotonic()
                    try:
                        url = f"{self.gw.url}/v1/jobs/{job}/effects/{step}/resolve"
                        async with http.post(url, json=body) as r:
                            out = await r.json(content_type=None)
                            op.status, op.code = r.status, out.get("code", "")
                    except (aiohttp.ClientError, TimeoutError):
                        op.status = 0
                    op.completed = time.monotonic()
                    if op.status not in (0, 503, 504):
                        break
                    await asyncio.sleep(0.2)
                self.proxy.disarm()
                if op.status == 200:
                    self.operator_keys.add(key)
                    if applied:
                        self.figures.operator_delivered += 1
                    else:
                        self.figures.operator_not_delivered += 1
                        released.append((job, step, rec["adapter"]))
                elif not (op.status == 409 and rec.get("state") == "dispatching"):
                    self.figures.operator_failed += 1
        return released

    def fault_begins(self, kind: str) -> Any:
        return self.live.begin(kind) if self.live is not None else None

    def fault_healed(self, window: Any) -> None:
        if self.live is not None and window is not None:
            self.live.heal(window)

    async def wire_phase(self, http: aiohttp.ClientSession, n_mixed: int, n_relay: int) -> None:
        window = self.fault_begins("wire_phase")
        stop = asyncio.Event()
        background = [
            asyncio.create_task(self.injector(stop, random.Random(self.rng.random()))),
            asyncio.create_task(self.closer(stop, random.Random(self.rng.random()))),
        ]
        relay = [
            self.relay_takeover(http, i, random.Random(self.rng.random())) for i in range(n_relay)
        ]
        mixed = [self.job_life(http, i, random.Random(self.rng.random())) for i in range(n_mixed)]

        async def batches(coros: list[Any], size: int) -> None:
            for start in range(0, len(coros), size):
                await asyncio.gather(*coros[start : start + size])

        try:
            await asyncio.gather(batches(relay, 8), batches(mixed, 12))
        finally:
            stop.set()
            await asyncio.gather(*background)
        self.proxy.disarm()
        self.dproxy.disarm()
        self.fault_healed(window)
        await self.settle(http, 15)
        # operators resolve what is unknown; stale workers then send async calls on those
        # steps, and the current generation redoes some of them
        released = await self.operator(http)
        late = []
        for job, step, adapter in released:
            fence = self.fence.get(job, 1)
            if fence > 1 and self.rng.random() < 0.6:
                late.append(self.stale_async(http, job, fence - 1, step, adapter, 0.0))
            if self.rng.random() < 0.5:
                late.append(self.effect_retrying(http, job, step, fence, adapter, f"redo{fence}"))
        await asyncio.gather(*late)
        await self.settle(http, 10)
        await self.operator(http)
        await self.settle(http, 5)
        for job in self.wire_jobs:
            effects = (await self.job_view(http, job)).get("effects") or {}
            for step, rec in effects.items():
                if rec.get("state") == "unknown":
                    self.figures.left_unknown.append(f"{job}:{step}")

    # -- the run --------------------------------------------------------------------

    async def run(self) -> dict[str, Any]:
        self.redis.start()
        self.down = Downstream()
        runner = await self.down.start()
        self.shas = script_shas()
        self.proxy = await WireProxy(self.redis.port or 0).start()
        self.dproxy = await WireProxy(self.down.port, log_http=True).start()
        url = f"redis://127.0.0.1:{self.proxy.port}/0"
        self.gw = g1 = Gateway(self.workdir, url, self.dproxy.port)
        self.gw.start()
        await self.gw.wait_up()
        # a second gateway with a data dir of its own (another host; the long run's is `serve
        # --workers 2`, the short one's a single process: the replica run has the workers in
        # make test): the wire and zombie phases' calls hop between the two; g1 alone meets the
        # crash points
        (self.workdir / "g2").mkdir()
        g2 = Gateway(self.workdir / "g2", url, self.dproxy.port, workers=2 if self.long else 1)
        g2.start()
        await g2.wait_up(60)  # a supervisor and two workers on a loaded machine
        self.start_liveness([g1, g2])
        n = {
            "zombie": 200 if self.long else 30,
            "sigstop": 24 if self.long else 4,
            "kills": 10 if self.long else 2,  # per crash point
            "redis": 30 if self.long else 3,
            "proxy": 20 if self.long else 4,
            "empty": 5 if self.long else 2,
            "restore": 3 if self.long else 1,
            "mixed": 240 if self.long else 36,
            "relay": 48 if self.long else 8,
        }
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
                started = time.monotonic()
                self.gw = Hop([g1, g2], self.rng)  # type: ignore[assignment]
                await self.wire_phase(http, n["mixed"], n["relay"])
                self.figures.wire_phase_s = time.monotonic() - started
                for start in range(0, n["zombie"], 25):
                    await asyncio.gather(
                        *(self.zombie(http, i) for i in range(start, min(start + 25, n["zombie"])))
                    )
                self.gw = g1
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
                for i in range(n["restore"]):
                    await self.restore(http, [g1, g2], i)
                    await asyncio.sleep(3)  # probes after the heal: time to recover
                self.gw = g1
                await self.finish_liveness(http, checks)
            checks["empty Redis restarts fail closed with 0 dispatches"] = (
                self.figures.empty_restart_dispatches == 0
                and self.figures.empty_restart_refusals == 4 * n["empty"]
            )
            checks["restored backups: every gateway refuses the old generation, 0 sent"] = (
                self.figures.restore_dispatches == 0
                and self.figures.restore_refusals == self.figures.restore_calls
            )
            checks["restored backups are quarantined (a true quarantine)"] = (
                self.figures.restore_quarantined == n["restore"]
            )
        finally:
            if self.live is not None and self.live._tasks:
                await self.live.stop()
            g2.close()
            g1.close()
            self.proxy.close()
            self.dproxy.close()
            await runner.cleanup()
            self.redis.stop()
        return checks

    async def check(self, http: aiohttp.ClientSession) -> dict[str, bool]:
        effects = [op for op in self.history if op.kind == "effect"]
        acked_regs = [
            op for op in self.history if op.kind == "register" and op.status in (200, 201)
        ]
        problems: list[str] = []
        jobs = {d.key.split("|")[1].split(":")[0] for d in self.down.deliveries}
        jobs |= {op.job for op in effects if op.status == 200}
        for job in sorted(jobs):
            view = await self.job_view(http, job)
            self.records[job] = view.get("effects") or {}
            self.fence[job] = max(self.fence.get(job, 0), int(view.get("fence") or 0))
        # C1: an applied effect of generation g was never invoked after register(g' > g) was acked
        for key, applied in self.down.applied.items():
            job, step = key.split("|")[1].split(":")
            for d in applied:
                calls = [
                    op for op in effects if op.job == job and op.step == step and op.gen == d.token
                ]
                if not calls:
                    continue  # a send that no call of its generation made: R1 reports it
                first_invoke = min(op.invoked for op in calls)
                newer = [
                    r
                    for r in acked_regs
                    if r.job == job and r.gen > d.token and r.completed < first_invoke
                ]
                if newer:
                    problems.append(
                        f"C1 {key}: generation {d.token} applied after register({newer[0].gen})"
                    )
        # C2: at most one applied effect per key (at the plain downstream more only where an
        # operator resolved the key), one intent per key at the deduplicating downstream;
        # exactly one for acknowledged calls, and it is the acknowledged intent
        for key, applied in self.down.applied.items():
            if len(applied) > 1:
                if key in self.operator_keys:
                    self.figures.dup_after_resolution += len(applied) - 1
                else:
                    tokens = [d.token for d in applied]
                    problems.append(f"C2 {key}: {len(applied)} effects (tokens {tokens})")
        intents: dict[str, set[str]] = {}
        for d in self.down.deliveries:
            if d.kind == "dedup" and not d.refused:
                intents.setdefault(d.key, set()).add(json.dumps(d.payload, sort_keys=True))
        for key, seen in intents.items():
            if len(seen) > 1:
                problems.append(f"C2 {key}: {len(seen)} different intents under one key (dedup)")
        for op in effects:
            if op.status != 200:
                continue
            applied = self.down.applied.get(f"{op.adapter}|{op.job}:{op.step}")
            if not applied:
                problems.append(f"C2 {op.job}:{op.step}: acknowledged but never applied")
            elif all(d.payload != self.payload(op.job, op.step, op.pgen) for d in applied):
                gens = [d.payload.get("gen") for d in applied if isinstance(d.payload, dict)]
                problems.append(
                    f"C2 {op.job}:{op.step}: generation {op.pgen}'s intent acknowledged "
                    f"(200), generation(s) {gens}'s applied"
                )
        # C3: every acknowledged outcome is still replayable (same intent, the current token)
        acked = {(op.job, op.step, op.adapter): op for op in effects if op.status == 200}
        for (job, step, adapter), op in acked.items():
            fence = self.fence.get(job, op.gen)
            replay = await self.effect(http, job, step, fence, adapter, "checker", pgen=op.pgen)
            if not (replay.status == 200 and replay.result == op.result):
                problems.append(f"C3 {job}:{step}: replay {replay.status} {replay.code}")
        # C4: each stale 409 has exactly one stale audit entry (found by the call's Worker-Id)
        stale_by_call: Counter[str] = Counter()
        resolutions: Counter[tuple[str, str]] = Counter()  # (job, step) -> audited resolutions
        for job in sorted({op.job for op in effects}):
            for entry in await self.audit(http, job):
                if entry.get("reason") == "stale_generation":
                    stale_by_call[entry.get("worker_id") or ""] += 1
                elif str(entry.get("reason")).startswith("operator_resolved"):
                    resolutions[(job, entry.get("step") or "")] += 1
        self.stale_responses = 0
        for op in effects:
            audited = stale_by_call.pop(op.worker, 0)
            if op.status == 409 and op.code == "stale_generation":
                self.stale_responses += 1
                if audited != 1:
                    problems.append(
                        f"C4 {op.job}:{op.step} call {op.worker}: one stale 409, "
                        f"{audited} stale audit entries"
                    )
            elif audited and op.status == 202 and audited == 1:
                self.figures.relay_superseded_audited += 1  # the relay found it superseded
            elif audited:
                if op.status in (0, 503, 504):  # the verdict was lost on the wire
                    self.figures.audited_unanswered += 1
                if audited > 1 or op.status not in (0, 503, 504):
                    problems.append(
                        f"C4 {op.job}:{op.step} call {op.worker}: answered {op.status} "
                        f"{op.code}, {audited} stale audit entries"
                    )
        if sum(stale_by_call.values()):
            problems.append(f"C4 stale audit entries of no call: {dict(stale_by_call)}")
        # C5: no 500; the gateway never died except where a crash was injected
        server_errors = [op for op in self.history if op.status == 500]
        if server_errors:
            problems.append(f"C5 {len(server_errors)} responses were 500")
        if self.gw.proc is None or self.gw.proc.poll() is not None:
            problems.append("C5 the gateway died without an injected crash")
        # R1: every send carries the intent a call of its generation presented; every applied
        # payload is that of the generation the record says dispatched it
        presented = {(op.adapter, op.job, op.step, op.gen, op.pgen) for op in effects}
        for d in self.down.deliveries:
            job, step = d.key.split("|")[1].split(":")
            pgen = d.payload.get("gen") if isinstance(d.payload, dict) else None
            intact = isinstance(pgen, int) and d.payload == self.payload(job, step, pgen)
            if not intact or (d.kind, job, step, d.token, pgen) not in presented:
                self.figures.foreign_intent_sends += 1
                problems.append(
                    f"R1 {d.key}: sent with Fencing-Token {d.token} and generation {pgen}'s "
                    f"payload, which no call of generation {d.token} presented"
                    + (" (applied)" if d.applied else "")
                )
        for key, applied in self.down.applied.items():
            job, step = key.split("|")[1].split(":")
            rec = self.records.get(job, {}).get(step)
            pgen = applied[-1].payload.get("gen") if isinstance(applied[-1].payload, dict) else None
            if rec is None or rec.get("generation") != pgen:
                state = rec and f"{rec.get('state')} under generation {rec.get('generation')}"
                problems.append(f"R1 {key}: generation {pgen}'s payload applied, record: {state}")
        # R2: no superseded send (a send of g after register(g' > g) was acknowledged, later
        # than any deadline of a dispatch admitted or claimed before that registration)
        regs: dict[str, list[Op]] = {}
        for r in acked_regs:
            regs.setdefault(r.job, []).append(r)
        for s in self.dproxy.sends:
            job = s.key.split(":")[0]
            newer = [r for r in regs.get(job, []) if r.gen > s.token]
            if not newer:
                continue
            first = min(newer, key=lambda r: r.completed)
            lag = s.at - first.completed
            if lag > DISPATCH_TIMEOUT + SEND_SLACK:
                self.figures.superseded_sends += 1
                problems.append(
                    f"R2 {s.path}|{s.key}: sent with Fencing-Token {s.token} {lag:.2f} s after "
                    f"register({first.gen}) was acknowledged"
                )
            elif lag > 0:
                self.figures.window_sends += 1
        # R4: an operator's resolution is answered as it was recorded: each audited resolution
        # was answered 200 (a re-sent resolve must not answer 409 for its own write)
        resolves = [op for op in self.history if op.kind == "resolve"]
        answered = Counter((op.job, op.step) for op in resolves if op.status == 200)
        for (job, step), n in sorted(resolutions.items()):
            if n != answered[(job, step)]:
                mine = [o for o in resolves if (o.job, o.step) == (job, step)]
                got = [f"{o.status} {o.code}".strip() for o in mine]
                problems.append(
                    f"R4 {job}:{step}: {n} resolutions audited, {answered[(job, step)]} answered "
                    f"200 (answers: {', '.join(got)})"
                )
        # R3: nothing is left pending or dispatching once the traffic stopped
        for job in self.wire_jobs:
            effects_now = (await self.job_view(http, job)).get("effects") or {}
            for step, rec in effects_now.items():
                if rec.get("state") in ("pending", "dispatching"):
                    problems.append(f"R3 {job}:{step}: left {rec.get('state')}")
        self.problems = problems
        c = {p.split()[0] for p in problems}
        return {
            "C1 no stale effect after a takeover was acknowledged": "C1" not in c,
            "C2 at most one effect per key (one for every acknowledged call, its intent)": "C2"
            not in c,
            "C3 every acknowledged outcome still replayable": "C3" not in c,
            "C4 one stale audit entry per stale 409, none more per call": "C4" not in c,
            "C5 no 500 and no uninjected crash": "C5" not in c,
            "R1 every send is an intent its generation presented; applied = record's": "R1"
            not in c,
            "R2 no superseded send (below a fence acknowledged before the send)": "R2" not in c,
            "R3 no step left pending or dispatching": "R3" not in c,
            "R4 every audited operator resolution was answered 200": "R4" not in c,
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
        wire_ops = [
            op for op in self.history if op.kind == "effect" and op.job in set(self.wire_jobs)
        ]
        accepted = sum(op.status == 202 for op in wire_ops)
        async_calls = sum(op.is_async for op in wire_ops)
        redis_scripts = Counter(h.label.split(":")[1] for h in self.proxy.hits)
        # relay latency: the first 202 of a step to the first send of its key after it
        first_sends: dict[str, list[float]] = {}
        for snd in self.dproxy.sends:
            first_sends.setdefault(snd.key, []).append(snd.at)
        accepted_at: dict[str, float] = {}
        for op in self.history:
            if op.kind == "effect" and op.status == 202:
                accepted_at.setdefault(f"{op.job}:{op.step}", op.completed)
        latencies = sorted(
            min(later) - at
            for key, at in accepted_at.items()
            if (later := [t for t in first_sends.get(key, []) if t >= at])
        ) or [0.0]
        p50, p90 = statistics.median(latencies), latencies[int(0.9 * (len(latencies) - 1))]
        never = sum(
            not any(t >= at for t in first_sends.get(k, [])) for k, at in accepted_at.items()
        )

        def fmt(counts: dict[str, int]) -> str:
            return ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "none"

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
            ("restored AOF backups / calls of the old generation refused / sent / quarantined",
             f"{f.restores} / {f.restore_refusals} of {f.restore_calls} / "
             f"{f.restore_dispatches} / {f.restore_quarantined}"),
            ("wire phase: jobs (mixed / relay takeover) / effect calls / duration",
             f"{f.mixed_jobs} / {f.relay_scenarios} / {len(wire_ops)} / {f.wire_phase_s:.0f} s"),
            ("async calls sent / accepted (202) / async steps",
             f"{async_calls} / {accepted} / {len(self.async_steps)}"),
            ("relay: 202 to the first send, p50 / p90 / max; accepted steps never sent",
             f"{p50:.2f} s / {p90:.2f} s / {latencies[-1]:.2f} s; {never}"),
            ("wire faults hit, gateway-Redis", fmt(self.proxy.hit_counts())),
            ("wire faults hit, gateway-Redis, by script", fmt(redis_scripts)),
            ("wire faults hit, gateway-downstream", fmt(self.dproxy.hit_counts())),
            ("downstream connection-refused episodes / 503 refusals",
             f"{self.dproxy.refusals} / {sum(self.down.refused.values())}"),
            ("takeovers / of them during relay retries",
             f"{f.takeovers} / {f.takeovers_in_relay_retries}"),
            ("stale async calls after takeovers / refused 409",
             f"{f.stale_async_calls} / {f.stale_async_refused}"),
            ("superseded sends (must be 0)", str(f.superseded_sends)),
            ("sends below a newer fence within the dispatch deadline (allowed)",
             str(f.window_sends)),
            ("sends of an intent no call of that generation presented (must be 0)",
             str(f.foreign_intent_sends)),
            ("unknown steps resolved by the operator: delivered / not delivered / failed",
             f"{f.operator_delivered} / {f.operator_not_delivered} / {f.operator_failed}"),
            ("unknown steps left (reported)",
             f"{len(f.left_unknown)} {' '.join(f.left_unknown[:10])}".strip()),
            ("second effects at plain after an operator's resolution", str(f.dup_after_resolution)),
            ("stale rejections audited whose answer was lost (503/504/none)",
             str(f.audited_unanswered)),
            ("accepted async calls later audited stale (the relay found them superseded)",
             str(f.relay_superseded_audited)),
            *(self.live.rows() if self.live is not None else []),
        ]  # fmt: skip
        mode = "long" if self.long else "short"
        lines = [f"seed {self.seed}, {mode} run, {len(self.history)} calls recorded", ""]
        lines += ["| figure | value |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows), ""]
        lines += [f"[{'ok' if ok else 'FAILED'}] {name}" for name, ok in checks.items()]
        lines += [f"  {p}" for p in self.problems[:30]]
        if len(self.problems) > 30:
            lines.append(f"  ... {len(self.problems) - 30} more in history.json")
        return "\n".join(lines)

    def dump(self, path: Path) -> None:
        doc = {
            "seed": self.seed,
            "problems": self.problems,
            "history": [asdict(op) for op in self.history],
            "deliveries": [asdict(d) for d in self.down.deliveries],
            "sends": [asdict(s) for s in self.dproxy.sends],
            "liveness": {
                "windows": [asdict(w) for w in self.live.windows] if self.live else [],
                "calls": [asdict(c) for c in self.live.calls] if self.live else [],
            },
            "wire_faults": {
                "redis": [asdict(h) | {"match": h.match.decode()} for h in self.proxy.hits],
                "downstream": [asdict(h) | {"match": h.match.decode()} for h in self.dproxy.hits],
            },
        }
        path.write_text(json.dumps(doc, indent=1, default=str))


def run(seed: int, long: bool, keep: Path | None = None) -> tuple[bool, str]:
    with tempfile.TemporaryDirectory(prefix="fencegate-chaos-") as tmp:
        chaos = Chaos(Path(tmp), seed, long)
        checks = asyncio.run(chaos.run())
        report = chaos.report(checks)
        ok = all(checks.values())
        if not ok:
            out = keep or Path(tempfile.mkdtemp(prefix="fencegate-chaos-failed-"))
            out.mkdir(parents=True, exist_ok=True)
            chaos.dump(out / "history.json")
            shutil.copy(Path(tmp) / "gateway.log", out / "gateway.log")
            shutil.copy(Path(tmp) / "g2" / "gateway.log", out / "g2-gateway.log")
            report += f"\nreport, history, seed and logs kept in {out}"
            (out / "report.txt").write_text(report + "\n")
        return ok, report


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--long", action="store_true")
    parser.add_argument("--seed", type=int, default=int(time.time()))
    parser.add_argument("--keep", type=Path, help="where a failing run keeps its report")
    args = parser.parse_args()
    ok, report = run(args.seed, args.long, args.keep)
    print(report)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
