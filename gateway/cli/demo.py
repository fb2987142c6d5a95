"""``fencegate demo``: the zombie-worker timeline, end to end, on this machine.

A gateway (embedded durable Redis), an SMTP sink, a webhook receiver, a SQLite
job table with an atomic claim, and two worker processes. Worker A claims job
``r`` and is frozen with SIGSTOP in the middle of its work (a stand-in for a GC
pause or a suspended VM) until its lease runs out; worker B claims the job,
registers generation 2 and does the work; A is resumed (SIGCONT) and tries to
send the same email. The demo prints the timeline and a table, and exits 0
only if every invariant held: one email and one webhook per key, A's calls
refused and audited with both generations, A's completion matched zero rows.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sqlite3
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from aiohttp import web

from gateway.client import FencedJob, Scheduler, StaleGeneration
from gateway.core.errors import FencegateError
from gateway.store.embedded import free_port

JOB = "r"
LEASE_MS = 1500
SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    job_id TEXT PRIMARY KEY, attempt INTEGER NOT NULL DEFAULT 0, owner TEXT,
    lease_until REAL NOT NULL DEFAULT 0, state TEXT NOT NULL DEFAULT 'queued');
"""

# -- the worker (runs in its own process) --------------------------------------


def claim(db: Path, job_id: str, worker: str) -> int | None:
    """Atomic claim: the attempt counter is the fencing token (zero rows: not ours)."""
    now = time.time()
    with sqlite3.connect(db, isolation_level=None) as conn:
        row = conn.execute(
            "UPDATE jobs SET attempt = attempt + 1, owner = ?, lease_until = ?, state = 'running' "
            "WHERE job_id = ? AND state != 'succeeded' AND (owner IS NULL OR lease_until < ?) "
            "RETURNING attempt",
            (worker, now + LEASE_MS / 1000, job_id, now),
        ).fetchone()
    return int(row[0]) if row else None


def complete(db: Path, job_id: str, attempt: int) -> int:
    """Commit only if the attempt is still current; returns the rows changed."""
    with sqlite3.connect(db, isolation_level=None) as conn:
        cur = conn.execute(
            "UPDATE jobs SET state = 'succeeded', owner = NULL WHERE job_id = ? AND attempt = ?",
            (job_id, attempt),
        )
        return cur.rowcount


def emit(worker: str, event: str, **fields: Any) -> None:
    print(json.dumps({"worker": worker, "event": event, **fields}), flush=True)


async def worker_main(worker: str, db: Path, url: str) -> int:
    attempt = claim(db, JOB, worker)
    if attempt is None:
        emit(worker, "nothing_to_claim")
        return 0
    async with Scheduler(url) as sched:
        await sched.register(JOB, generation=attempt, lease_ms=LEASE_MS)
    emit(worker, "claimed", generation=attempt)
    try:
        async with FencedJob(url, JOB, attempt, worker_id=worker, heartbeat_interval=0.3) as job:
            emit(worker, "rendering")
            # Blocking on purpose: like a GC pause, it stalls the heartbeats too.
            time.sleep(0.6)  # noqa: ASYNC251
            email = {
                "to": ["customer@example.com"],
                "subject": "Shipped",
                "text": "Order 1234 is on its way.",
            }
            for step, adapter, op, payload in (
                ("notify", "email", "send", email),
                ("crm", "crm", "order.shipped", {"order": 1234}),
            ):  # fmt: skip
                emit(worker, "effect", step=step, generation=attempt)
                res = await job.effect(step, adapter=adapter, operation=op, payload=payload)
                emit(worker, "effect_ok", step=step, replayed=res.replayed, generation=attempt)
    except (StaleGeneration, FencegateError) as err:
        emit(worker, "refused", code=err.code, presented=err.fields.get("presented"),
             current=err.fields.get("current"))  # fmt: skip
    rows = complete(db, JOB, attempt)
    emit(worker, "completed" if rows else "completion_rejected", rows=rows, generation=attempt)
    return 0


# -- the orchestrator ------------------------------------------------------------


class Sinks:
    """An SMTP sink and a webhook receiver on loopback that count what arrives."""

    def __init__(self) -> None:
        self.emails: list[tuple[str, str]] = []  # (message-id, fencegate key)
        self.hooks: list[tuple[str, str]] = []  # (idempotency key, fencing token)
        self.smtp_port = free_port()
        self.http_port = free_port()

    async def handle_DATA(
        self, server: Any, session: Any, envelope: Any
    ) -> str:  # aiosmtpd handler
        import email

        msg = email.message_from_bytes(envelope.content)
        self.emails.append((str(msg["Message-ID"]), str(msg["X-Fencegate-Key"])))
        return "250 queued"

    async def hook(self, request: web.Request) -> web.Response:
        await request.read()
        self.hooks.append((request.headers["Idempotency-Key"], request.headers["Fencing-Token"]))
        return web.json_response({"ok": True})


def _log(t0: float, text: str) -> None:
    print(f"  {time.monotonic() - t0:6.2f}s  {text}", flush=True)


async def _read_events(
    proc: asyncio.subprocess.Process, events: list[dict[str, Any]], t0: float
) -> None:
    assert proc.stdout is not None
    async for raw in proc.stdout:
        line = raw.decode().strip()
        if not line.startswith("{"):
            continue
        ev = json.loads(line)
        events.append(ev)
        detail = " ".join(f"{k}={v}" for k, v in ev.items() if k not in ("worker", "event"))
        _log(t0, f"worker {ev['worker']}: {ev['event']} {detail}")


async def _wait_for(
    events: list[dict[str, Any]], worker: str, event: str, within: float = 30
) -> None:
    deadline = time.monotonic() + within
    while not any(e["worker"] == worker and e["event"] == event for e in events):
        if time.monotonic() > deadline:
            raise TimeoutError(f"worker {worker} never reported {event}")
        await asyncio.sleep(0.01)


async def run_demo(workdir: Path) -> int:
    try:
        from aiosmtpd.controller import Controller
    except ImportError:
        print("fencegate demo needs aiosmtpd: pip install 'fencegate[demo]'", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    sinks = Sinks()
    smtp = Controller(sinks, hostname="127.0.0.1", port=sinks.smtp_port)
    smtp.start()
    app = web.Application()
    app.router.add_post("/crm", sinks.hook)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", sinks.http_port).start()

    db = workdir / "jobs.sqlite"
    with sqlite3.connect(db) as conn:
        conn.executescript(SCHEMA)
        conn.execute("INSERT INTO jobs (job_id) VALUES (?)", (JOB,))
    gw_port = free_port()
    cfg = workdir / "demo.toml"
    cfg.write_text(
        f"""
[redis]
data_dir = "{workdir / "redis"}"
[adapters.email]
type = "smtp"
host = "127.0.0.1"
port = {sinks.smtp_port}
sender = "jobs@example.com"
[adapters.crm]
type = "webhook"
url = "http://127.0.0.1:{sinks.http_port}/crm"
"""
    )
    url = f"http://127.0.0.1:{gw_port}"
    gateway = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway", "serve", "--config", str(cfg), "--port", str(gw_port),
        stdout=asyncio.subprocess.DEVNULL, stderr=(workdir / "gateway.log").open("w"),
    )  # fmt: skip
    events: list[dict[str, Any]] = []
    workers: dict[str, asyncio.subprocess.Process] = {}
    readers: list[asyncio.Task[None]] = []

    async def start_worker(name: str) -> asyncio.subprocess.Process:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gateway.cli.demo", "worker", name, str(db), url,
            stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        workers[name] = proc
        readers.append(asyncio.create_task(_read_events(proc, events, t0)))
        return proc

    try:
        async with Scheduler(url) as probe:
            for _ in range(300):
                try:
                    await probe._call("GET", "/readyz")
                    break
                except FencegateError:
                    await asyncio.sleep(0.05)
        print("timeline:")
        _log(t0, f"gateway up at {url} (embedded Redis, appendfsync always)")
        a = await start_worker("A")
        await _wait_for(events, "A", "rendering")
        a.send_signal(signal.SIGSTOP)
        _log(t0, f"worker A frozen (SIGSTOP) mid-work; its {LEASE_MS} ms lease runs out")
        await asyncio.sleep(LEASE_MS / 1000 + 0.5)
        b = await start_worker("B")
        await b.wait()
        await _wait_for(events, "B", "completed")
        a.send_signal(signal.SIGCONT)
        _log(t0, "worker A resumed (SIGCONT): it still thinks it owns the job")
        await asyncio.wait_for(a.wait(), 30)
        await asyncio.gather(*readers)
        async with Scheduler(url) as sched:
            audit = (await sched.audit(job_id=JOB))["items"]
            job = await sched.job(JOB)
    finally:
        for proc in workers.values():
            if proc.returncode is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
                await proc.wait()
        gateway.send_signal(signal.SIGTERM)
        await gateway.wait()
        await runner.cleanup()
        smtp.stop()

    return _report(events, sinks, audit, job, db)


def _report(
    events: list[dict[str, Any]],
    sinks: Sinks,
    audit: list[dict[str, Any]],
    job: dict[str, Any],
    db: Path,
) -> int:
    attempted = Counter(e["worker"] for e in events if e["event"] == "effect")
    refused = [e for e in events if e["event"] == "refused"]
    delivered = Counter(key for _, key in sinks.emails) + Counter(key for key, _ in sinks.hooks)
    with sqlite3.connect(db) as conn:
        state, attempt = conn.execute(
            "SELECT state, attempt FROM jobs WHERE job_id = ?", (JOB,)
        ).fetchone()
    print("\nresult:")
    print(f"  {'worker':<8}{'effects attempted':>18}{'refused':>9}  completion")
    for name in ("A", "B"):
        comp = next(
            (e for e in events if e["worker"] == name and e["event"].startswith("complet")), {}
        )
        n_ref = sum(1 for e in refused if e["worker"] == name)
        outcome = f"{comp.get('event', '-')} (rows={comp.get('rows', '-')})"
        print(f"  {name:<8}{attempted[name]:>18}{n_ref:>9}  {outcome}")
    print(f"\n  {'key':<12}{'delivered downstream':>22}")
    for key in ("r:notify", "r:crm"):
        print(f"  {key:<12}{delivered[key]:>22}")
    print("\n  audit log (rejections):")
    for e in audit:
        gens = f"presented={e['presented']} current={e['current']}"
        print(f"    {e['reason']:<18} step={e['step']} {gens} worker={e['worker_id']}")
    print(f"\n  job table: state={state} attempt={attempt}; gateway fence={job['fence']}")
    checks = {
        "exactly one email, keyed r:notify": delivered["r:notify"] == 1 and len(sinks.emails) == 1,
        "exactly one webhook, keyed r:crm": delivered["r:crm"] == 1 and len(sinks.hooks) == 1,
        "worker A refused with stale_generation 1 < 2": any(
            e["worker"] == "A"
            and e["code"] == "stale_generation"
            and (e["presented"], e["current"]) == (1, 2)
            for e in refused
        ),
        "the refusal is audited with both generations": any(
            e["reason"] == "stale_generation" and (e["presented"], e["current"]) == (1, 2)
            for e in audit
        ),
        "A's completion matched zero rows": any(
            e["worker"] == "A" and e["event"] == "completion_rejected" for e in events
        ),
        "B delivered under generation 2": {tok for _, tok in sinks.hooks} == {"2"},
        "job succeeded at attempt 2, fence 2": (state, attempt, job["fence"])
        == ("succeeded", 2, 2),
    }
    print("\ninvariants:")
    for name, ok in checks.items():
        print(f"  [{'ok' if ok else 'FAILED'}] {name}")
    return 0 if all(checks.values()) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fencegate demo")
    sub = parser.add_subparsers(dest="cmd")
    w = sub.add_parser("worker")
    w.add_argument("name")
    w.add_argument("db", type=Path)
    w.add_argument("url")
    args = parser.parse_args(argv)
    if args.cmd == "worker":
        return asyncio.run(worker_main(args.name, args.db, args.url))
    with tempfile.TemporaryDirectory(prefix="fencegate-demo-") as tmp:
        return asyncio.run(run_demo(Path(tmp)))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
