"""Reading jobs and the audit log: ``job``, ``audit``, ``audit verify``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gateway.cli.common import (
    EXIT_OK,
    EXIT_RUNTIME,
    cli_redis_url,
    cli_settings,
    cli_store,
    client_args,
    render_table,
)
from gateway.core.records import AuditCheck
from gateway.runtime.settings import read_secret

if TYPE_CHECKING:
    pass


def cmd_job(args: argparse.Namespace) -> int:
    from gateway.cli.job_report import job_state_lines
    from gateway.client import Scheduler

    async def run() -> dict[str, Any]:
        async with Scheduler(args.url, **client_args(args)) as sched:
            return await sched.job(args.job_id)

    job = asyncio.run(run())
    print(
        f"job {job['job_id']}: fence={job['fence']} cancelled={job['cancelled']} "
        f"lease_expires_at={job['lease_expires_at'] or '-'}"
    )
    rows = [
        [
            step,
            e["state"],
            str(e["generation"]),
            e["adapter"],
            e["operation"],
            str(e["attempts"]),
            e["updated_at"] or "-",
        ]
        for step, e in sorted(job["effects"].items())
    ]
    if rows:
        print(
            render_table(
                rows, ["step", "state", "gen", "adapter", "operation", "attempts", "updated_at"]
            )
        )
    for line in job_state_lines(job, render_table):  # completion, checkpoints, outputs
        print(line)
    return EXIT_OK


def cmd_audit_verify(args: argparse.Namespace) -> int:
    from gateway.store.anchor_check import AnchorCheck
    from gateway.store.anchors import anchor_path, audit_keys

    settings = cli_settings(args)
    keys = audit_keys(settings, read_secret)
    files = [Path(p) for p in args.anchors] if args.anchors else [anchor_path(settings)]
    url, embedded = cli_redis_url(settings)

    async def run() -> AuditCheck:
        async with cli_store(url, cluster=settings.redis.cluster) as store:
            return await store.verify_audit(
                keys=keys,
                anchor_files=files,
                retention_seconds=settings.fencing.retention_seconds,
            )

    try:
        check = asyncio.run(run())
    finally:
        if embedded is not None:
            embedded.stop()
    assert isinstance(check, AnchorCheck)
    for problem in check.broken:
        print(f"BROKEN  {problem}")
    state = "intact" if not check.broken else f"{len(check.broken)} problems"
    how = f"keyed (kid {', '.join(check.kids)})" if check.keyed else "unkeyed"
    print(f"audit chains: {check.jobs} jobs, {check.entries} entries, {state}; {how}")
    print(
        f"anchors: {check.anchors} checked ({check.anchors_expired} past retention, not "
        f"checkable) from {', '.join(check.anchor_files) or 'no file'}"
        + (f"; not found: {', '.join(check.missing_files)}" if check.missing_files else "")
    )
    for note in check.notes:
        print(f"note: {note}")
    if not check.keyed:
        print(
            "unkeyed chain: detects accidental damage only; anyone who can write Redis can "
            "re-hash altered entries (set [audit] key_env)"
        )
    print(
        "not detectable: deleting a job's entries newer than its newest anchor together with "
        "its chain head in Redis; deleting an anchor from every place it was written"
    )
    return EXIT_OK if not check.broken else EXIT_RUNTIME


def cmd_audit(args: argparse.Namespace) -> int:
    from gateway.client import Scheduler

    if args.action == "verify":
        return cmd_audit_verify(args)

    header = ["at", "job", "step", "reason", "presented", "current", "worker"]

    def row(e: dict[str, Any]) -> list[str]:
        return [
            e["at"],
            e["job_id"],
            e["step"] or "-",
            e["reason"],
            str(e["presented"]),
            str(e["current"]),
            e["worker_id"] or "-",
        ]

    async def run() -> None:
        async with Scheduler(args.url, **client_args(args)) as sched:
            page = await sched.audit(job_id=args.job, limit=args.limit)
            items = page["items"]
            print(render_table([row(e) for e in reversed(items)], header))
            newest = items[0]["id"] if items else None
            while args.follow:
                await asyncio.sleep(args.interval)
                fresh = (await sched.audit(job_id=args.job, limit=1000))["items"]
                new = [e for e in fresh if newest is None or _after(e["id"], newest)]
                for e in reversed(new):
                    print("  ".join(row(e)), flush=True)
                if new:
                    newest = new[0]["id"]

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run())
    return EXIT_OK


def _after(a: str, b: str) -> bool:
    return tuple(map(int, a.split("-"))) > tuple(map(int, b.split("-")))
