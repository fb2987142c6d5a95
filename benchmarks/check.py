"""The regression guard: a fresh short bench against the committed baseline of ratios.

    python -m benchmarks.check [--requests N] [--report-only]        (make bench-check)
    python -m benchmarks.check --baseline RUNS [--requests N]        (make bench-baseline)

Runs ``benchmarks.run --only guard`` (G2, P2, G3, P3, P3f on one stack, results in a
temporary folder) and compares what it guards — the gateway's server CPU per call over the
peer's in the same run, ``cpu G2/P2`` and ``cpu G3/P3f`` — with benchmarks/baseline.json.
Ratios, not req/s or µs: both sides see the same machine load, so a busier machine moves
them much less than the absolute figures. A guarded ratio above its baseline by more than
the baseline's tolerance fails (exit 1); lower passes and says the baseline could be renewed.
The other figures are printed, not guarded.

``--baseline RUNS`` runs the bench RUNS times on this commit, writes the medians, every run's
figures and their spread, and for each guarded ratio a tolerance of twice its largest spread
around its median (at least 5 %), so the tolerance is the measured noise, not a guess.
Without nginx and the Lua modules (``make bench-peer-deps``) there is nothing to compare:
``--report-only`` says so and exits 0, a check exits 2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.peer.plan import missing

BASELINE = Path(__file__).parent / "baseline.json"
GUARDED = ("cpu G2/P2", "cpu G3/P3f")
MIN_TOLERANCE = 0.05


def fresh(requests: int) -> dict[str, Any]:
    """One ``--only guard`` run: its record (latest.json)."""
    with tempfile.TemporaryDirectory(prefix="fencegate-check-") as tmp:
        env = {**os.environ, "BENCH_RESULTS": tmp}
        cmd = [sys.executable, "-m", "benchmarks.run", "--only", "guard",
               "--requests", str(requests), "--workers", "1"]  # fmt: skip
        run = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if run.returncode != 0:
            raise SystemExit(f"the bench failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
        record: dict[str, Any] = json.loads((Path(tmp) / "latest.json").read_text())
        return record


def load_average() -> float:
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (FileNotFoundError, ValueError):
        return math.nan


def compare(guard: dict[str, float], baseline: dict[str, Any]) -> tuple[list[str], bool]:
    """The comparison's lines, and whether every guarded ratio is within tolerance."""
    ok = True
    lines = [f"{'figure':<28} {'baseline':>9} {'now':>9} {'change':>8}  verdict"]
    for name, base in baseline["figures"].items():
        now = guard.get(name)
        if now is None:
            continue
        change = now / base - 1
        tol = float(baseline["tolerance"].get(name, 0))
        if name in GUARDED:
            if change > tol:
                verdict, ok = f"FAIL (above +{tol:.0%})", False
            elif change < -tol:
                verdict = f"better than -{tol:.0%}: renew the baseline (make bench-baseline)"
            else:
                verdict = f"ok (within +{tol:.0%})"
        else:
            verdict = "(not guarded)"
        lines.append(f"{name:<28} {base:>9} {now:>9} {change:>+8.1%}  {verdict}")
    return lines, ok


def write_baseline(runs: int, requests: int) -> None:
    seen = []
    for i in range(runs):
        load = load_average()
        record = fresh(requests)
        seen.append({"at": record["at"], "load_average_before": load, **record["guard"]})
        print(f"run {i + 1}/{runs} (load {load}): {json.dumps(record['guard'])}", flush=True)
    baseline = summarise(seen, requests)
    BASELINE.write_text(json.dumps(baseline, indent=1, ensure_ascii=False) + "\n")
    print(f"\nwrote {BASELINE}: tolerance {baseline['tolerance']}")


def summarise(runs: list[dict[str, Any]], requests: int) -> dict[str, Any]:
    """The baseline of these runs: medians, each figure's largest spread around its median, and
    each guarded ratio's tolerance (twice its spread, at least MIN_TOLERANCE)."""
    names = [k for k in runs[0] if k not in ("at", "load_average_before")]
    medians = {k: round(statistics.median(r[k] for r in runs), 3) for k in names}
    spread = {k: round(max(abs(r[k] / medians[k] - 1) for r in runs), 3) for k in names}
    tolerance = {k: max(MIN_TOLERANCE, math.ceil(2 * spread[k] * 100) / 100) for k in GUARDED}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return {
        "what": "benchmarks/check.py: the guarded ratios (cpu G2/P2, cpu G3/P3f: the gateway's "
        "server CPU per call over the peer's in the same run) fail beyond their tolerance",
        "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": commit.stdout.strip(),
        "requests": requests,
        "guarded": list(GUARDED),
        "tolerance": tolerance,
        "tolerance_rule": "per guarded ratio, twice its largest spread around its median over "
        f"the runs below, at least {MIN_TOLERANCE:.0%}",
        "figures": medians,
        "spread_around_median": spread,
        "runs": runs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--report-only", action="store_true", help="print, never fail")
    parser.add_argument("--baseline", type=int, metavar="RUNS", help="write the baseline")
    args = parser.parse_args()
    why = missing()
    if why:
        print(f"bench-check: no peer on this machine ({why}; make bench-peer-deps): skipped")
        raise SystemExit(0 if args.report_only else 2)
    if args.baseline:
        write_baseline(args.baseline, args.requests)
        return
    baseline = json.loads(BASELINE.read_text())
    record = fresh(args.requests)
    lines, ok = compare(record["guard"], baseline)
    print(
        f"bench-check: {args.requests} requests, load average {load_average()}, against the "
        f"baseline of {baseline['at']} ({baseline['commit']}); tolerance "
        + ", ".join(f"{k} +{v:.0%}" for k, v in baseline["tolerance"].items())
    )
    print("\n".join(lines))
    for check in record["peer"].get("parity", []):
        print(f"parity, {check['what']}: {check['identical']} of {check['calls']} identical")
    if not ok and not args.report_only:
        print("bench-check: FAILED (a guarded ratio is above its baseline beyond tolerance)")
        raise SystemExit(1)
    print("bench-check: " + ("ok" if ok else "above tolerance (report only, not failing)"))


if __name__ == "__main__":
    main()
