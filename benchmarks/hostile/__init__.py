"""Hostile tenants, one surface at a time, bounded and on loopback only: does tenant B keep
being served while tenant A tries to exhaust what it can store or hold?

    python -m benchmarks.hostile --surface <name>|all [--seconds 10] [--shared]
    make hostile HOSTILE_ARGS="--surface all --seconds 10"

Surfaces (``benchmarks.hostile.surfaces``): effects, payloads, checkpoints, outputs,
outputs-objects, presigned, audit, console, uploads, keepalive, exports. Each runs its attack
against a real ``fencegate serve`` (embedded durable Redis; presigned uploads against a moto
S3 server) for ``--seconds`` while B's calls are timed (``benchmarks.hostile.harness``).
Each surface gets its own serve; ``--shared`` runs the surfaces of one group on one serve,
one after the other (the short version in tests/serve/test_hostile_tenants.py).

Prints one JSON line per surface as it ends, a Markdown table of them on stderr, and last
one JSON line ``{"surfaces": [...], "passed": ...}``. Exit status 1 if a surface did not pass:
B had a failure or a call past its client timeout, an answer >= 500 that is not a cap's
documented refusal of A, or something B was told is done is not recorded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from typing import Any

from benchmarks.hostile import surfaces as surfaces_module
from benchmarks.hostile.harness import remove, run_group, tmpdir
from benchmarks.hostile.surfaces import SURFACES, Exports, OutputBytes, Payloads, Surface

__all__ = ["main"]

# the order of a shared serve: a surface whose cap would hold A on a later surface's attack
# (effects_per_window, the disk floor) comes last in its group
SHARED_ORDER = [
    "payloads", "checkpoints", "audit", "exports", "effects",
    "console", "uploads", "keepalive",
    "outputs-objects", "outputs",
    "presigned",
]  # fmt: skip


def table(rows: list[dict[str, Any]], surfaces: dict[str, Surface]) -> str:
    lines = [
        "| surface | attack (tenant A) | cap / key | B's calls | B's calls, p50 / p99 / max ms, "
        "failures | answers >= 500 (A's cap refusals) | A's answers | Redis / disk / RSS peak MB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        s = surfaces[r["surface"]]
        refusals = ", ".join(f"{k}: {v}" for k, v in r["a_cap_refusals"].items())
        answers = ", ".join(f"{k}: {v}" for k, v in r["a_statuses"].items())
        lines.append(
            f"| {s.name} | {s.attack_text} | {s.cap_text} | {s.b_text} "
            f"| {r['b_calls']}, {r['b_p50_ms']:.0f} / {r['b_p99_ms']:.0f} / {r['b_max_ms']:.0f}, "
            f"{r['b_failures']} | {r['five_xx']}"
            + (f" ({refusals})" if refusals else "")
            + f" | {answers} | {r['redis_peak_used_memory_mb']} / {r['disk_peak_mb']} / "
            f"{r['rss_peak_mb']} |"
        )
    return "\n".join(lines)


async def _main(args: argparse.Namespace) -> list[dict[str, Any]]:
    names = list(SURFACES) if args.surface == "all" else args.surface.split(",")
    unknown = [n for n in names if n not in SURFACES]
    if unknown:
        raise SystemExit(f"unknown surface {unknown}; known: {', '.join(SURFACES)} or all")
    Payloads.idle, Payloads.slow_bodies = args.idle, args.slow_bodies
    OutputBytes.room_mb, Exports.feed = args.outputs_budget_mb, args.exports_feed
    surfaces_module.OUTPUT_QUOTA_MB = args.outputs_quota_mb
    surfaces_module.OUTPUT_OBJECTS = args.outputs_objects
    surfaces = {n: SURFACES[n]() for n in names}
    if args.shared:
        ordered = [n for n in SHARED_ORDER if n in surfaces]
        groups: dict[str, list[Surface]] = {}
        for n in ordered:
            groups.setdefault(surfaces[n].group, []).append(surfaces[n])
        plan = list(groups.values())
    else:
        plan = [[surfaces[n]] for n in names]
    rows = []
    for group in plan:
        work = tmpdir("fg-hostile-")
        try:
            for row in await run_group(group, args.seconds, args.lead, work):
                print(json.dumps(row), flush=True)
                rows.append(row)
        finally:
            if not args.keep:
                remove(work)
    print(table(rows, surfaces), file=sys.stderr)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="benchmarks.hostile",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--surface", default="payloads", help="a name, names with commas, all")
    parser.add_argument("--seconds", type=float, default=10, help="each surface's attack")
    parser.add_argument("--lead", type=float, default=1.0, help="attack before B is timed")
    parser.add_argument("--shared", action="store_true", help="one serve per group")
    parser.add_argument("--idle", type=int, default=1000, help="payloads: idle sockets")
    parser.add_argument("--slow-bodies", type=int, default=30, help="payloads: stuck bodies")
    parser.add_argument(
        "--outputs-budget-mb", type=int, default=128, help="outputs: room above the floor"
    )
    parser.add_argument(
        "--outputs-quota-mb", type=int, default=32, help="outputs: A's quotas.output_bytes"
    )
    parser.add_argument(
        "--outputs-objects", type=int, default=2000, help="outputs: A's quotas.output_objects"
    )
    parser.add_argument("--exports-feed", type=int, default=2000, help="exports: A's feed")
    parser.add_argument("--keep", action="store_true", help="keep the work dirs (logs)")
    args = parser.parse_args(argv)
    rows = asyncio.run(_main(args))
    ok = all(r["passed"] for r in rows)
    print(json.dumps({"surfaces": rows, "passed": ok}))
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
