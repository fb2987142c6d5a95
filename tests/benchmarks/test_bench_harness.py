"""The benchmark harness stays runnable: short runs of make bench, make bench-check and make
bench-soak.

Only the shape of what they report is checked — every row measured, every
derived figure present, files written where asked — and that the peer answers what the
gateway answers (the parity check), never the figures themselves (performance is measured,
not asserted: the guard's comparison is printed here, not failed on).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.peer.plan import missing

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
COMMITTED_HISTORY = ROOT / "benchmarks" / "results" / "history.jsonl"


PEER_ROWS = {"P2 peer replay", "P3 peer stale 409", "P3f peer stale 409 + feed copy"}


def run_module(results: Path, module: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "BENCH_RESULTS": str(results)}
    run = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run


def test_a_short_bench_measures_every_row(tmp_path: Path) -> None:
    before = COMMITTED_HISTORY.read_bytes() if COMMITTED_HISTORY.exists() else b""
    run = run_module(tmp_path, "benchmarks.run", "--requests", "300", "--workers", "1,2")
    record = json.loads((tmp_path / "latest.json").read_text())
    rows = {r["name"]: r for r in record["results"]}
    peer = missing() is None  # make bench-peer-deps installs it (make test does)
    expected = [
        "L1 raw EVALSHA admit",
        "L1 raw EVALSHA record",
        "L1 admit at 1 connection",
        "L1 raw EVALSHA checkpoint",
        "L2 bare aiohttp JSON server",
        "L2 at 1 connection",
        "L3 aiohttp low-level echo",
        "G1 effect, accepted",
        "G2 effect, replayed",
        "X1 proxied call, accepted",
        "X2 proxied call, replayed",
        "L4 minimal replay, low-level server",
        "L5 minimal replay, raw asyncio protocol",
        "G4 heartbeat",
        "G5 checkpoint write",
        "G3 effect, stale 409",
        "G1 at 1 connection",
        "O1 output 1 MiB upload + completion",
        "L6 bare aiohttp 1 MiB PUT to a file + JSON POST",
        "G1 effect, accepted (--workers 2)",
    ]
    if peer:
        expected.insert(expected.index("X1 proxied call, accepted"), "P2 peer replay")
        at = expected.index("G1 at 1 connection")
        expected[at:at] = ["P3 peer stale 409", "P3f peer stale 409 + feed copy"]
    assert list(rows) == expected
    for name, r in rows.items():
        assert r["rps"] > 0 and 0 < r["p50_ms"] <= r["p99_ms"] <= r["p999_ms"], name
        if name.startswith(("G", "O", "P", "X", "L2", "L3", "L4", "L5", "L6")):  # a server ran
            # CPU time comes in clock ticks (10 ms): a 300-request row may show none
            assert r["server_cpu_s_per_1000"] >= 0 and r["server_peak_rss_mb"] > 0, name
    assert rows["G1 effect, accepted (--workers 2)"]["gateway_workers"] == 2
    assert set(record["derived"]) >= {
        "G1/L2, G2/L2, G3/L2",
        "G2/L4 (the gateway's replay over the stripped one), L4/L2, L5/L2",
        "G1 p99/p50 at saturation",
        "X1/G1, X2/G2 (proxied over the adapter path), X1/L2, X2/L2",
        "G5/L1 (a fenced checkpoint end to end over its raw EVALSHA), G5/L2",
        "O1/L6 (1 MiB output upload + completion over the bare aiohttp file write)",
        "gateway latency minus a direct upstream call, 1 connection, p50 / p99 (ms)",
    }
    assert all(float(x) > 0 for x in record["derived"]["G1/L2, G2/L2, G3/L2"].split(", "))
    proxied = record["derived"]["X1/G1, X2/G2 (proxied over the adapter path), X1/L2, X2/L2"]
    assert all(float(x) > 0 for x in proxied.split(", "))
    if peer:  # the peer answered every compared call as the gateway did
        checks = record["peer"]["parity"]
        assert [c["what"] for c in checks] == sorted(PEER_ROWS)
        assert all(c["identical"] == c["calls"] == 100 for c in checks), checks
        assert {c["statuses"][0] for c in checks} == {200, 409}
        assert set(record["guard"]) >= {"cpu G2/P2", "cpu G3/P3f"}
    else:
        assert record["peer"]["skipped"] and not PEER_ROWS & set(rows)
    md = (tmp_path / "latest.md").read_text()
    assert "| G2 effect, replayed |" in md and md.strip() in run.stdout
    assert len((tmp_path / "history.jsonl").read_text().splitlines()) == 1
    after = COMMITTED_HISTORY.read_bytes() if COMMITTED_HISTORY.exists() else b""
    assert after == before  # BENCH_RESULTS kept the short run out of the committed history


@pytest.mark.skipif(missing() is not None, reason=f"no peer: {missing()} (make bench-peer-deps)")
def test_bench_check_compares_a_short_run_with_the_baseline(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = run_module(tmp_path, "benchmarks.check", "--report-only", "--requests", "200")
    with capsys.disabled():  # CI prints the comparison, and does not fail on its figures
        print("\n" + run.stdout)
    lines = run.stdout.splitlines()
    for figure in ("cpu G2/P2", "cpu G3/P3f"):
        (line,) = [x for x in lines if x.startswith(figure + " ")]
        # figure, baseline, now, change, verdict (ok, FAIL or better: the figures are not asserted)
        assert re.match(r"\S+ \S+\s+[\d.]+\s+[\d.]+\s+[+-][\d.]+%\s+(ok|FAIL|better)", line), line
    assert lines[-1].startswith("bench-check: ")
    parity = [x for x in lines if x.startswith("parity, ")]
    assert len(parity) == 3 and all(x.endswith("100 of 100 identical") for x in parity), parity


def test_a_short_soak_reports_growth_and_memory(tmp_path: Path) -> None:
    run_module(tmp_path, "benchmarks.soak", "--calls", "2000", "--jobs", "200")
    (line,) = (tmp_path / "soak-history.jsonl").read_text().splitlines()
    result = json.loads(line)
    assert result["calls"] == 2000 and result["jobs"] == 200
    assert len(result["rps_per_tenth"]) == 10 and min(result["rps_per_tenth"]) > 0
    assert result["last_over_first_tenth"] > 0
    # each job has its fence; step s0 of the sampled job has its record and stored result
    assert result["job_fence_hash_bytes"] > 0 and result["effect_record_bytes"] > 0
    assert result["stored_result_bytes"] > 0 and result["gateway_peak_rss_mb"] > 0
