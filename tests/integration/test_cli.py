"""`fencegate demo`, `fencegate job`, `fencegate audit` as real processes."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

from gateway.cli.demo import Sinks, _report
from tests.conftest import Gateway


def test_demo_runs_the_seed_timeline_and_every_invariant_holds() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "gateway", "demo"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    assert "worker A frozen (SIGSTOP)" in text and "worker A resumed (SIGCONT)" in text
    assert "worker A: refused code=stale_generation presented=1 current=2" in text
    lines = [line.split() for line in text.splitlines()]
    assert ["A", "1", "1", "completion_rejected", "(rows=0)"] in lines
    assert ["B", "2", "0", "completed", "(rows=1)"] in lines
    assert ["r:notify", "1"] in lines and ["r:crm", "1"] in lines
    assert "stale_generation   step=notify presented=1 current=2 worker=A" in text
    assert text.count("[ok]") == 7 and "FAILED" not in text


def test_demo_report_fails_on_a_duplicate(tmp_path: Path) -> None:
    import sqlite3

    db = tmp_path / "jobs.sqlite"
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE jobs (job_id TEXT, attempt INT, state TEXT)")
        conn.execute("INSERT INTO jobs VALUES ('r', 2, 'succeeded')")
    sinks = Sinks()
    sinks.emails = [("<m>", "r:notify"), ("<m>", "r:notify")]  # the zombie's email got out too
    sinks.hooks = [("r:crm", "2")]
    events = [
        {
            "worker": "A",
            "event": "refused",
            "code": "stale_generation",
            "presented": 1,
            "current": 2,
        },
        {"worker": "A", "event": "completion_rejected", "rows": 0},
    ]
    audit = [
        {
            "reason": "stale_generation",
            "presented": 1,
            "current": 2,
            "step": "notify",
            "worker_id": "A",
        }
    ]
    assert _report(events, sinks, audit, {"fence": 2}, db) == 1


async def run_cli(*args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "gateway",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_job_and_audit_commands(gw: Gateway) -> None:
    url = str(gw.client.make_url("")).rstrip("/")
    await gw.register("r", generation=2, lease_ms=60_000)
    await gw.effect("r", "notify", 2)
    await gw.effect("r", "notify", 1, worker_id="zombie")
    code, out, _ = await run_cli("job", "r", "--url", url)
    assert code == 0
    assert "job r: fence=2 cancelled=False" in out
    assert out.splitlines()[-1].split()[:6] == ["notify", "succeeded", "2", "hook", "send", "1"]
    code, out, _ = await run_cli("audit", "--url", url, "--job", "r")
    assert code == 0
    row = out.splitlines()[-1].split()
    assert row[1:] == ["r", "notify", "stale_generation", "1", "2", "zombie"]
    code, _, err = await run_cli("job", "unknown", "--url", url)
    assert code == 1 and "not_found" in err


async def test_audit_follow_prints_new_rejections(gw: Gateway) -> None:
    url = str(gw.client.make_url("")).rstrip("/")
    await gw.register("r", generation=2)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway", "audit", "--url", url, "--follow", "--interval", "0.1",
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None
    try:
        header = await asyncio.wait_for(proc.stdout.readline(), 30)
        assert b"reason" in header
        await proc.stdout.readline()  # the rule under the header
        await gw.effect("r", "late", 1, worker_id="zombie")
        line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode().split()
        assert line[1:] == ["r", "late", "stale_generation", "1", "2", "zombie"]
    finally:
        proc.terminate()
        await proc.wait()
