"""``fencegate demo``: the zombie-worker timeline, end to end, on this machine.

A gateway (embedded durable Redis, outputs in a directory beside it), an SMTP sink, a
webhook receiver, a SQLite job table with an atomic claim, and two worker processes
(:mod:`gateway.cli.demo_worker`). Worker A claims job ``r``, checkpoints, renders its
report and uploads it to its own attempt-scoped location, and is frozen with SIGSTOP
(a stand-in for a GC pause or a suspended VM) until its lease runs out; worker B claims
the job, registers generation 2, resumes from A's checkpoint, renders, sends and
completes — its report is promoted. A is resumed (SIGCONT), tries to send the same email
and to complete: refused. The demo then reads the official report, lists A's orphan and
sweeps it (``fencegate outputs sweep``), prints the timeline and a table, and exits 0 only
if every invariant held (:mod:`gateway.cli.demo_report`).
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
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from gateway.cli.demo_report import OutputStory, report
from gateway.cli.demo_worker import JOB, LEASE_MS, OUTPUT, SCHEMA
from gateway.cli.demo_worker import run as run_worker
from gateway.cli.job_report import output_status
from gateway.client import Scheduler
from gateway.store.embedded import free_port

__all__ = ["Sinks", "_report", "main", "run_demo"]

_report = report  # the name tests and older callers know


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
[outputs]
# the demo sweeps once, visibly, after the story (fencegate outputs sweep)
sweep_interval_seconds = 0
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
        sys.executable,
        "-m",
        "gateway",
        "serve",
        "--config",
        str(cfg),
        "--port",
        str(gw_port),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=(workdir / "gateway.log").open("w"),
    )
    events: list[dict[str, Any]] = []
    workers: dict[str, asyncio.subprocess.Process] = {}
    readers: list[asyncio.Task[None]] = []

    async def start_worker(name: str) -> asyncio.subprocess.Process:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "gateway.cli.demo",
            "worker",
            name,
            str(db),
            url,
            stdout=asyncio.subprocess.PIPE,
        )
        workers[name] = proc
        readers.append(asyncio.create_task(_read_events(proc, events, t0)))
        return proc

    story = OutputStory()
    try:
        async with aiohttp.ClientSession() as probe:
            for _ in range(300):
                try:
                    async with probe.get(f"{url}/readyz") as ready:
                        if ready.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.05)
        print("timeline:")
        _log(t0, f"gateway up at {url} (embedded Redis, appendfsync always)")
        a = await start_worker("A")
        await _wait_for(events, "A", "rendered")
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
        story.orphans = [o for o in job["outputs"] if output_status(job, o) == "orphan"]
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"{url}/v1/jobs/{JOB}/outputs/{OUTPUT}") as resp,
        ):
            story.official = await resp.read() if resp.status == 200 else None
        _log(t0, f"official {OUTPUT} read back; orphans listed: {len(story.orphans)}")
        story.sweep, story.a_object_left = await _sweep(cfg, workdir)
        _log(t0, "orphan sweep ran (fencegate outputs sweep)")
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

    return report(events, sinks, audit, job, db, story)


async def _sweep(cfg: Path, workdir: Path) -> tuple[str, bool]:
    """One run of the orphan sweeper against the demo's gateway (its Redis socket), with
    no grace: the story is seconds long. Returns its output and whether A's object is
    still in the outputs directory afterwards."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "gateway",
        "outputs",
        "sweep",
        "--config",
        str(cfg),
        "--grace",
        "0",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    left = await asyncio.to_thread(lambda: any(workdir.rglob(f"g1/{OUTPUT}")))
    return out.decode(), left


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fencegate demo")
    sub = parser.add_subparsers(dest="cmd")
    w = sub.add_parser("worker")
    w.add_argument("name")
    w.add_argument("db", type=Path)
    w.add_argument("url")
    args = parser.parse_args(argv)
    if args.cmd == "worker":
        return asyncio.run(run_worker(args.name, args.db, args.url))
    with tempfile.TemporaryDirectory(prefix="fencegate-demo-") as tmp:
        return asyncio.run(run_demo(Path(tmp)))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
