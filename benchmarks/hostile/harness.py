"""The hostile-tenant harness: a real ``fencegate serve``, two tenants, the meters and the
pass criterion; one :class:`~benchmarks.hostile.surfaces.Surface` at a time attacks it.

Tenant ``a`` attacks from ``127.0.0.2`` (its own peer address: per-peer limits see it as
another host), tenant ``b`` calls from ``127.0.0.1``; each has an ``admin`` key (every API
role) and an ``auditor`` key (the console). A webhook receiver in this process answers both
(A's requests held as long as the surface says: a slow downstream). While the surface's
attack runs, four B loops make the surface's calls, each request with a client timeout of
``B_TIMEOUT`` seconds. Measured per surface: B's p50/p99/max and failures, A's answers by
status, every answer >= 500 that is not the surface's documented refusal of A (a cap answers
A with 507 or 503 by design: counted apart, by code), the peak of Redis ``used_memory``, of
the disk used under the data and outputs directories and of the gateway's RSS; afterwards
everything B was told was done is checked to be recorded (``lost``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import redis.asyncio as aioredis
from aiohttp import web

from gateway.store.embedded import free_port, socket_of

B_TIMEOUT = 3.0  # B's client timeout per request (seconds): the functional limit of its p99
MAX_LEAD = 15.0  # the longest A may take to reach its cap before B is timed anyway
A_ADDR = "127.0.0.2"  # tenant A's own peer address on loopback
KEYS = {
    ("a", "admin"): "hostile-a-admin-key",
    ("a", "auditor"): "hostile-a-auditor-key",
    ("b", "admin"): "hostile-b-admin-key",
    ("b", "auditor"): "hostile-b-auditor-key",
}
S3_ENV = {"FG_HOSTILE_S3_KEY_ID": "testing", "FG_HOSTILE_S3_SECRET": "testing"}

Config = dict[str, Any]


def base_config(tmp: Path, hook: str) -> Config:
    """What every surface starts from; a surface's own dict is merged over it."""
    return {
        "server": {"request_log": "problems"},
        "redis": {"data_dir": str(tmp / "data")},
        "connections": {"max": 4096, "idle_timeout_seconds": 5, "body_timeout_seconds": 3},
        "bulkheads": {"connections_per_pool": 8, "pool_wait_seconds": 1},
        "outputs": {"path": str(tmp / "outputs"), "sweep_interval_seconds": 0},
        "adapters": {"hook": {"type": "webhook", "url": hook, "timeout_seconds": 8}},
    }


def merge(into: Config, more: Config) -> Config:
    """``more`` merged into a copy of ``into``, table by table."""
    out = dict(into)
    for key, value in more.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def flat(config: Config, prefix: str = "") -> dict[str, Any]:
    """Dotted key → value (two surfaces may share a serve when no key differs)."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def known(config: Config, model: Any = None, prefix: str = "") -> tuple[Config, list[str]]:
    """``config`` without the keys this tree's settings do not have, and those keys: a run
    against an older tree reports what it could not configure instead of failing to start."""
    from pydantic import BaseModel

    from gateway.runtime.settings import Settings, TenantQuota

    fields = (model or Settings).model_fields
    out: Config = {}
    dropped: list[str] = []
    for key, value in config.items():
        if key not in fields:
            dropped.append(prefix + key)
            continue
        kind = fields[key].annotation
        if isinstance(value, dict) and isinstance(kind, type) and issubclass(kind, BaseModel):
            out[key], more = known(value, kind, f"{prefix}{key}.")
            dropped += more
        elif prefix == "quotas." and key == "tenants":
            out[key] = {}
            for tenant, own in value.items():
                out[key][tenant], more = known(own, TenantQuota, f"quotas.tenants.{tenant}.")
                dropped += more
        else:
            out[key] = value
    return out, dropped


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML for {value!r}")


def to_toml(config: Config, prefix: str = "") -> str:
    scalars = {k: v for k, v in config.items() if not isinstance(v, dict)}
    lines = [f"[{prefix[:-1]}]"] if prefix and scalars else []
    lines += [f"{k} = {_toml_value(v)}" for k, v in scalars.items()]
    for key, value in config.items():
        if isinstance(value, dict):
            lines.append(to_toml(value, f"{prefix}{key}."))
    return "\n".join(lines)


def keys_toml() -> str:
    return "".join(
        f'\n[[auth.keys]]\nrole = "{role}"\ntenant = "{tenant}"\nname = "{tenant}-{role}"\n'
        f'sha256 = "{hashlib.sha256(key.encode()).hexdigest()}"\n'
        for (tenant, role), key in KEYS.items()
    )


def auth(tenant: str, role: str = "admin", **extra: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[(tenant, role)]}", **extra}


def pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Receiver:
    """The webhook downstream: counts each tenant's deliveries by key, holds A's."""

    def __init__(self) -> None:
        self.keys: dict[str, set[str]] = {"a": set(), "b": set()}
        self.hold_a = 0.0

    async def handle(self, request: web.Request) -> web.Response:
        await request.read()
        key = request.headers.get("Idempotency-Key", "")
        tenant = "a" if key.startswith("a/") else "b"
        self.keys[tenant].add(key)
        if tenant == "a" and self.hold_a:
            await asyncio.sleep(self.hold_a)
        return web.json_response({"ok": True})


def _tree_bytes(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
    return total


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                stat = (entry / "stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry.name))
    return out


def _rss(pid: int) -> int:
    """RSS of the gateway's processes (its workers too), not of the embedded Redis (that one
    is metered by ``used_memory``)."""
    total = 0
    for p in [pid, *_children(pid)]:
        with contextlib.suppress(OSError):
            if b"redis-server" in Path(f"/proc/{p}/cmdline").read_bytes():
                continue
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
    return total


@dataclass
class Tally:
    """What one surface's run saw."""

    a_statuses: Counter[int] = field(default_factory=Counter)
    a_codes: Counter[str] = field(default_factory=Counter)  # A's refusals by problem code
    a_cap_refusals: Counter[str] = field(default_factory=Counter)  # documented 5xx to A
    five: list[str] = field(default_factory=list)  # answers >= 500 nobody documented
    b_latency: list[float] = field(default_factory=list)
    b_failures: list[str] = field(default_factory=list)
    b_by_call: Counter[str] = field(default_factory=Counter)
    b_kind_latency: dict[str, list[float]] = field(default_factory=dict)
    notes: Counter[str] = field(default_factory=Counter)  # attack's own counters
    peak: dict[str, int] = field(default_factory=lambda: {"redis": 0, "disk": 0, "rss": 0})


class Gateway:
    """One ``fencegate serve`` on loopback with a merged config (a subprocess)."""

    def __init__(self, tmp: Path, config: Config) -> None:
        self.tmp, self.config = tmp, config
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.data_dir = Path(config["redis"]["data_dir"])
        self.outputs_dir = Path(config["outputs"].get("path") or "")
        self.log = tmp / "serve.log"

    def start(self) -> None:
        cfg = self.tmp / "hostile.toml"
        cfg.write_text(to_toml(self.config) + "\n" + keys_toml())
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gateway", "serve", "--port", str(self.port),
                 "--config", str(cfg)],
                stdout=log, stderr=subprocess.STDOUT, cwd=self.tmp,
                env={**os.environ, **S3_ENV, "PYTHONUNBUFFERED": "1"},
            )  # fmt: skip

    async def ready(self, http: aiohttp.ClientSession) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(aiohttp.ClientError):
                async with http.get(f"{self.base}/readyz") as r:
                    if r.status == 200:
                        return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("gateway did not start: " + self.log.read_text()[-3000:])
            await asyncio.sleep(0.1)

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(30)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def non_json_log_lines(self) -> int:
        bad = 0
        for line in self.log.read_text().splitlines():
            try:
                json.loads(line)
            except ValueError:
                bad += 1
        return bad


@dataclass
class Run:
    """One surface against one gateway: the sessions, the tally, the stop signal."""

    gw: Gateway
    receiver: Receiver
    a: aiohttp.ClientSession  # tenant A's session, from A_ADDR
    b: aiohttp.ClientSession
    tally: Tally
    stop: asyncio.Event
    a_cap_codes: frozenset[str]
    surface: str
    extra: dict[str, Any] = field(default_factory=dict)  # what a surface shares with B
    b_effects: list[tuple[str, str]] = field(default_factory=list)  # (job, step) answered done
    b_async: list[tuple[str, str]] = field(default_factory=list)  # (job, step) answered 202
    b_checks: list[Callable[[], Awaitable[list[str]]]] = field(default_factory=list)
    seq: Counter[str] = field(default_factory=Counter)

    @property
    def base(self) -> str:
        return self.gw.base

    def next(self, what: str) -> int:
        self.seq[what] += 1
        return self.seq[what]

    async def _problem_code(self, resp: aiohttp.ClientResponse, body: bytes) -> str:
        with contextlib.suppress(ValueError):
            return str(json.loads(body).get("code", ""))
        return ""

    async def a_call(
        self, method: str, path: str, session: aiohttp.ClientSession | None = None, **kw: Any
    ) -> tuple[int, bytes]:
        """One of A's requests: its status is tallied; a failure to connect is not an answer."""
        try:
            async with (session or self.a).request(method, self.base + path, **kw) as resp:
                body = await resp.read()
                self.note_a(resp.status, await self._problem_code(resp, body), body)
                return resp.status, body
        except (aiohttp.ClientError, TimeoutError) as exc:
            self.tally.notes[f"a_{type(exc).__name__}"] += 1
            return 0, b""

    def note_a(self, status: int, code: str, body: bytes = b"") -> None:
        self.tally.a_statuses[status] += 1
        if code and status >= 400:
            self.tally.a_codes[f"{status} {code}"] += 1
        if status >= 500:
            if code in self.a_cap_codes:
                self.tally.a_cap_refusals[f"{status} {code}"] += 1
            else:
                self.tally.five.append(f"a {status} {code} {body[:160]!r}")

    async def b_call(
        self,
        name: str,
        method: str,
        path: str,
        expect: Iterable[int],
        session: aiohttp.ClientSession | None = None,
        **kw: Any,
    ) -> tuple[int, bytes]:
        """One of B's requests, timed, within B's client timeout; anything but ``expect`` is
        a failure of B (and an answer >= 500 is counted with the flood's 5xx)."""
        started = time.monotonic()
        status, body = 0, b""
        try:
            async with asyncio.timeout(B_TIMEOUT):
                async with (session or self.b).request(method, self.base + path, **kw) as resp:
                    status, body = resp.status, await resp.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            self.tally.b_failures.append(f"{name} {type(exc).__name__}")
        else:
            if status not in set(expect):
                self.tally.b_failures.append(f"{name} {status} {body[:160]!r}")
            if status >= 500:
                self.tally.five.append(f"b {name} {status} {body[:160]!r}")
        self.tally.b_latency.append(time.monotonic() - started)
        self.tally.b_kind_latency.setdefault(name, []).append(time.monotonic() - started)
        self.tally.b_by_call[name] += 1
        return status, body

    async def b_effect(self, job: str, step: str = "s", **headers: str) -> None:
        """B registers ``job`` and makes a synchronous effect call (recorded on success)."""
        await self.b_call(
            "register", "POST", f"/v1/jobs/{job}/generations", (201,),
            json={"generation": 1}, headers=auth("b"),
        )  # fmt: skip
        status, _ = await self.b_call(
            "effect", "POST", f"/v1/jobs/{job}/effects/{step}", (200,),
            json={"adapter": "hook", "operation": "send", "payload": {"job": job}},
            headers=auth("b", **{"Fencing-Token": "1", **headers}),
        )  # fmt: skip
        if status == 200:
            self.b_effects.append((job, step))

    async def lost(self) -> list[str]:
        """Everything B was answered as done that is not recorded (or not delivered)."""
        out = []
        for job, step in self.b_effects:
            key = f"b/{job}:{step}"
            if key not in self.receiver.keys["b"]:
                out.append(f"{key} not delivered")
            async with self.b.get(
                f"{self.base}/v1/jobs/{job}/effects/{step}", headers=auth("b")
            ) as r:
                record = await r.json() if r.status == 200 else {}
                if record.get("state") != "succeeded":
                    out.append(f"{key} recorded as {r.status} {record.get('state')}")
        deadline = time.monotonic() + 30  # the relay delivers B's queued steps
        for job, step in self.b_async:
            while True:
                async with self.b.get(
                    f"{self.base}/v1/jobs/{job}/effects/{step}", headers=auth("b")
                ) as r:
                    record = await r.json() if r.status == 200 else {}
                if record.get("state") == "succeeded":
                    break
                if time.monotonic() > deadline:
                    out.append(f"b/{job}:{step} (async) still {record.get('state')}")
                    break
                await asyncio.sleep(0.2)
        for check in self.b_checks:
            out += await check()
        return out


async def meter(run: Run, rds: aioredis.Redis) -> None:
    """Peaks of Redis memory, disk used under the data and outputs dirs, and gateway RSS."""
    peak, gw = run.tally.peak, run.gw
    assert gw.proc is not None
    while not run.stop.is_set():
        with contextlib.suppress(Exception):
            info = await rds.info("memory")
            peak["redis"] = max(peak["redis"], int(info["used_memory"]))
        dirs = [gw.data_dir, gw.outputs_dir] if gw.outputs_dir.parts else [gw.data_dir]
        disk = sum([await asyncio.to_thread(_tree_bytes, d) for d in dirs])
        peak["disk"] = max(peak["disk"], disk)
        peak["rss"] = max(peak["rss"], await asyncio.to_thread(_rss, gw.proc.pid))
        await asyncio.sleep(0.25)


def summary(run: Run, seconds: float, lost: list[str], non_json: int) -> dict[str, Any]:
    t = run.tally
    b = t.b_latency
    return {
        "surface": run.surface,
        "seconds": seconds,
        "b_calls": len(b),
        "b_calls_by_kind": dict(t.b_by_call),
        "b_failures": len(t.b_failures),
        "b_failure_samples": t.b_failures[:5],
        "b_p50_ms": round(pct(b, 0.5) * 1000, 1),
        "b_p99_ms": round(pct(b, 0.99) * 1000, 1),
        "b_max_ms": round(max(b, default=0) * 1000, 1),
        "b_timeout_ms": B_TIMEOUT * 1000,
        "b_p99_ms_by_kind": {k: round(pct(v, 0.99) * 1000, 1) for k, v in t.b_kind_latency.items()},
        "a_statuses": {str(k): v for k, v in sorted(t.a_statuses.items())},
        "a_codes": dict(t.a_codes),
        "a_cap_refusals": dict(t.a_cap_refusals),
        "a_notes": dict(t.notes),
        "five_xx": len(t.five),
        "five_xx_samples": t.five[:5],
        "lost": len(lost),
        "lost_samples": lost[:5],
        "redis_peak_used_memory_mb": round(t.peak["redis"] / 2**20, 1),
        "disk_peak_mb": round(t.peak["disk"] / 2**20, 1),
        "rss_peak_mb": round(t.peak["rss"] / 2**20, 1),
        "non_json_log_lines": non_json,
    }


def passed(s: dict[str, Any]) -> bool:
    """The pass criterion of a surface."""
    return (
        s["b_calls"] > 0
        and s["b_failures"] == 0
        and s["five_xx"] == 0
        and s["lost"] == 0
        and s["b_max_ms"] <= s["b_timeout_ms"] + 500  # (a timed-out call is a failure too)
        and s["b_p99_ms"] <= s["b_timeout_ms"]
        and s["non_json_log_lines"] == 0
    )


Attack = Callable[[Run], Awaitable[None]]
BLoop = Callable[[Run, int], Awaitable[None]]


async def run_group(
    surfaces: list[Any], seconds: float, lead: float, workdir: Path
) -> list[dict[str, Any]]:
    """One serve with the merged config of ``surfaces``, each attacked in turn."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    receiver = Receiver()
    app = web.Application()
    app.router.add_post("/hook", receiver.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    hook_port = free_port()
    await web.TCPSite(runner, "127.0.0.1", hook_port).start()
    tmp = Path(workdir)
    try:
        for s in surfaces:
            await s.prepare(tmp)
    except BaseException:
        for s in surfaces:
            s.cleanup()
        await runner.cleanup()
        raise
    config = base_config(tmp, f"http://127.0.0.1:{hook_port}/hook")
    seen: dict[str, Any] = {}
    for s in surfaces:
        own = s.config(tmp)
        clash = {k for k, v in flat(own).items() if k in seen and seen[k] != v}
        if clash:
            raise ValueError(f"{s.name} cannot share a serve: {sorted(clash)} differ")
        seen.update(flat(own))
        config = merge(config, own)
    config, unknown = known(config)
    gw = Gateway(tmp, config)
    out = []
    try:
        gw.start()
        timeout = aiohttp.ClientTimeout(total=30)
        a_conn = aiohttp.TCPConnector(limit=0, local_addr=(A_ADDR, 0))
        async with (
            aiohttp.ClientSession(connector=a_conn, timeout=timeout) as a,
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as b,
        ):
            await gw.ready(b)
            rds = aioredis.Redis(unix_socket_path=str(socket_of(gw.data_dir)))
            try:
                for s in surfaces:
                    out.append(await _one(s, gw, receiver, a, b, rds, seconds, lead))
            finally:
                await rds.aclose()
    finally:
        gw.stop()
        for s in surfaces:
            s.cleanup()
        await runner.cleanup()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    non_json = gw.non_json_log_lines()
    for s in out:
        s["non_json_log_lines"] = non_json
        s["config_keys_unknown"] = unknown
        s["passed"] = passed(s)
    return out


async def _one(
    surface: Any,
    gw: Gateway,
    receiver: Receiver,
    a: aiohttp.ClientSession,
    b: aiohttp.ClientSession,
    rds: aioredis.Redis,
    seconds: float,
    lead: float,
) -> dict[str, Any]:
    started = time.monotonic()
    run = Run(
        gw=gw, receiver=receiver, a=a, b=b, tally=Tally(), stop=asyncio.Event(),
        a_cap_codes=frozenset(surface.a_cap_codes), surface=surface.name,
    )  # fmt: skip
    receiver.hold_a = surface.hold_a
    await surface.setup(run)
    tasks = [asyncio.create_task(meter(run, rds))]
    tasks += [asyncio.create_task(_forever(run, surface.attack)) for _ in range(surface.attackers)]
    tasks += [asyncio.create_task(h(run)) for h in surface.holders()]
    # B is timed once the attack has reached the cap that should hold it (or after MAX_LEAD)
    await asyncio.sleep(lead)
    while not surface.armed(run) and time.monotonic() - started < MAX_LEAD:  # noqa: ASYNC110
        await asyncio.sleep(0.1)  # (the tally is plain counters: polled)
    armed_after = time.monotonic() - started
    b_tasks = [asyncio.create_task(_b_loop(run, surface.b_iteration, i)) for i in range(4)]
    await asyncio.sleep(seconds)
    run.stop.set()
    await asyncio.gather(*b_tasks, return_exceptions=True)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await surface.teardown(run)
    receiver.hold_a = 0.0
    lost = await run.lost()
    out = summary(run, seconds, lost, 0)
    out["wall_seconds"] = round(time.monotonic() - started, 1)  # setup and checks included
    out["armed"], out["armed_after_seconds"] = surface.armed(run), round(armed_after, 1)
    return out


async def _forever(run: Run, attack: Attack) -> None:
    while not run.stop.is_set():
        await attack(run)


async def _b_loop(run: Run, iteration: BLoop, worker: int) -> None:
    while not run.stop.is_set():
        await iteration(run, run.next("b"))
        await asyncio.sleep(0.02)


def tmpdir(prefix: str) -> Path:
    import tempfile

    return Path(tempfile.mkdtemp(prefix=prefix))


def remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
