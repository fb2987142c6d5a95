"""`fencegate demo`, `fencegate job`, `fencegate audit` as real processes."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Any

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
    assert "worker B: resumed from_generation=1 stage=rendered" in text
    assert "worker A: gateway_completion_refused code=stale_generation presented=1 current=2" in (
        text
    )
    assert "stale_generation   step=job:complete presented=1 current=2 worker=A" in text
    assert (
        "official report.txt: 'Order 1234 shipping report, rendered by worker B (generation 2)'"
        in (text)
    )
    assert "orphan   report.txt: default/r/g1/report.txt (generation 1)" in text
    assert text.count("[ok]") == 14 and "FAILED" not in text


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


async def test_job_command_shows_checkpoints_staged_and_promoted_outputs(
    gw: Gateway, redis_sync: Any
) -> None:
    from tests.support.calls import complete, put_checkpoint, record_output

    url = str(gw.client.make_url("")).rstrip("/")
    await gw.register("r", generation=1)
    record_output(redis_sync, 1, "report.pdf", b"A's draft")
    await gw.register("r", generation=2)
    assert (await put_checkpoint(gw, "progress", {"page": 7}, 2, worker="B")).status == 200
    record_output(redis_sync, 2, "report.pdf", b"B's report")
    assert (await complete(gw, 2, result={"pages": 7}, outputs=["report.pdf"])).status == 200
    code, out, _ = await run_cli("job", "r", "--url", url)
    assert code == 0, out
    assert "completed by generation 2 at 20" in out and 'result: {"pages":7}' in out
    lines = out.splitlines()
    promoted = lines[lines.index("promoted outputs:") + 3].split()
    assert promoted[:3] == ["report.pdf", "2", "10"] and promoted[-1] == "default/r/g2/report.pdf"
    ckpt = lines[lines.index("checkpoints:") + 3].split()
    assert ckpt[:3] == ["progress", "2", "B"]
    start = lines.index("staged outputs (attempt-scoped):") + 3
    staged = [line.split() for line in lines[start : start + 2]]
    assert [row[:4] for row in staged] == [
        ["report.pdf", "1", "recorded", "orphan"],
        ["report.pdf", "2", "recorded", "promoted"],
    ]
