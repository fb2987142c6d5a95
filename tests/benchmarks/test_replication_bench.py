"""benchmarks/replication.py runs (small): both rows, both settings, sane numbers. Its
figures are reported in docs/performance.md, never asserted."""

from __future__ import annotations

from benchmarks.replication import markdown, run


async def test_the_replication_benchmark_runs_and_reports_both_settings() -> None:
    record = await run(200, 1)
    rows = {row["connections"]: row for row in record["results"]}
    assert sorted(rows) == [1, 64]
    for row in rows.values():
        for r in ("r0", "r1"):
            assert row[r]["rps"] > 0 and 0 < row[r]["p50_ms"] <= row[r]["p99_ms"]
        assert row["throughput_ratio"] > 0
    table = markdown(record)
    assert table.count("\n") == 3 and "| 64 |" in table
