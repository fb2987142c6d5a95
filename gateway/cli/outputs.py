"""``fencegate outputs sweep [--dry-run]``: one run of the orphan sweeper, from the shell.

It reads the same configuration as ``fencegate serve`` (Redis, ``[outputs]``), lists the
object store, and prints one line per orphan: what it deleted (or, ``--dry-run``, would
delete) and what it only counts, then a summary by reason. Safe next to running
gateways: it deletes only objects that can never be promoted (gateway.fencing.outputs_sweep).
"""

from __future__ import annotations

import argparse
import asyncio

from gateway.fencing.outputs import OutputService
from gateway.fencing.outputs_sweep import REASONS, SweepReport, sweep
from gateway.objects import build_object_store
from gateway.runtime.settings import read_secret

__all__ = ["add_parser", "cmd_outputs"]


def add_parser(parser: argparse.ArgumentParser) -> None:
    """The ``outputs`` command's subcommands, on its parser (``fencegate outputs``)."""
    outputs = parser.add_subparsers(dest="outputs_command", required=True)
    p = outputs.add_parser("sweep", help="delete orphan outputs once (see docs/outputs.md)")
    p.add_argument("--config", help="TOML config file")
    p.add_argument("--redis-url", help="Redis (default: from the config)")
    p.add_argument("--dry-run", action="store_true", help="print what would be deleted")
    p.add_argument(
        "--grace",
        type=float,
        help="seconds an orphan must be old (default: outputs.orphan_grace_seconds)",
    )
    p.set_defaults(func=cmd_outputs)


def _print(report: SweepReport, *, dry_run: bool) -> None:
    verb = "WOULD DELETE" if dry_run else "DELETED"
    gone = {o.key for o in report.deleted}
    for o in sorted(report.orphans, key=lambda o: o.key):
        if o.key in gone or (dry_run and o.deletable):
            what = verb
        elif o.deletable:
            what = "FAILED"
        else:
            what = "KEEP"
        print(f"{what:<12}  {o.reason:<10}  {o.size:>12}  {o.age_seconds:>10.0f}s  {o.key}")
    counts = report.by_reason()
    summary = ", ".join(f"{r} {counts[r][0]} ({counts[r][1]} B)" for r in REASONS if counts[r][0])
    n = sum(1 for o in report.orphans if o.deletable) if dry_run else len(report.deleted)
    print(
        f"orphans: {len(report.orphans)} ({summary or 'none'}); "
        f"{'would delete' if dry_run else 'deleted'} {n}; kept {report.kept} live objects"
        + (f"; {report.foreign} foreign keys ignored" if report.foreign else "")
        + (f"; {report.failed} deletes failed" if report.failed else "")
    )


def cmd_outputs(args: argparse.Namespace) -> int:
    from gateway.cli.common import EXIT_OK, EXIT_RUNTIME, cli_redis_url, cli_settings, cli_store

    settings = cli_settings(args)
    objects = build_object_store(settings, read_secret)
    grace = settings.outputs.orphan_grace_seconds if args.grace is None else args.grace
    url, embedded = cli_redis_url(settings)

    async def run() -> SweepReport:
        async with cli_store(url) as store:
            service = OutputService(store, objects, settings.outputs)
            return await sweep(service, grace_seconds=grace, dry_run=args.dry_run)

    try:
        report = asyncio.run(run())
    finally:
        if embedded is not None:
            embedded.stop()
    print(f"object store: {objects.where}")
    _print(report, dry_run=args.dry_run)
    return EXIT_OK if not report.failed else EXIT_RUNTIME
