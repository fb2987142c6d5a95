"""Audit-chain checks for the console: one job's chain (the job page's badge), and a tenant's
chains in the background with progress (the chain page).

Wording matters here. Without ``[audit] key_env`` the chain is plain SHA-1: it shows the log
is *consistent* (nothing altered, dropped or reordered by accident), not who wrote it —
anyone who can write Redis can recompute it. With the key it is an HMAC chain and its heads
are anchored outside Redis: an entry altered, forged or removed without the key shows.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from gateway.core.errors import StoreUnavailable
from gateway.core.records import chain_hash
from gateway.store.console_reads import ConsoleReads

__all__ = ["ChainRuns", "Run", "check_job_chain", "honest_wording"]

log = structlog.get_logger("fencegate.console")
PROBLEMS_KEPT = 200


def honest_wording(keyed: bool) -> str:
    if keyed:
        return (
            "Keyed chain: every entry carries an HMAC with the audit key, and chain heads are "
            "anchored outside Redis. An entry altered, forged or removed by someone without "
            "the key shows here."
        )
    return (
        "Unkeyed chain: a SHA-1 hash chain shows the log is consistent (nothing altered, "
        "dropped or reordered by accident) — not who wrote it: whoever can write Redis can "
        "recompute it. Set [audit] key_env for an HMAC chain with anchors."
    )


def check_job_chain(
    rows: Sequence[tuple[str, dict[str, str]]],
    head: str | None,
    keys: Sequence[str],
    *,
    whole: bool = True,
) -> list[str]:
    """What is wrong with one job's chain (empty: consistent; with keys: keyed-valid).
    ``whole`` False: ``rows`` are the first entries of a longer chain (``head`` not checked)."""
    key_bytes = [k.encode() for k in keys]
    problems: list[str] = []
    prev: str | None = None
    for entry, fields in rows:
        items = [(k, v) for k, v in fields.items() if k != "hash"]
        stored = fields.get("hash", "")
        if key_bytes:
            ok = any(hmac.compare_digest(chain_hash(items, k), stored) for k in key_bytes)
        else:
            ok = chain_hash(items) == stored
        if not ok:
            problems.append(f"{entry}: entry altered (its hash does not match)")
        if prev is not None and fields.get("prev") != prev:
            problems.append(f"{entry}: previous entry missing or altered")
        prev = stored
    if rows and whole and head != prev:
        problems.append("newest entries missing (the chain head names another entry)")
    return problems


@dataclass
class Run:
    """One background verification of a tenant's chains (this process)."""

    started_ms: int
    jobs: int = 0
    entries: int = 0
    done: bool = False
    summary: dict[str, Any] | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def tick(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()


class ChainRuns:
    """At most one verification per tenant per process, the next no sooner than
    ``interval_seconds`` after the last started, each reading at most ``max_entries`` entries
    (:func:`gateway.store.anchor_check.verify`); the result goes to Redis."""

    def __init__(
        self,
        reads: ConsoleReads,
        *,
        keys: Sequence[str],
        anchor_file: Path,
        retention_seconds: int,
        record: Callable[[str, dict[str, Any]], Awaitable[None]],
        interval_seconds: float = 0.0,
        max_entries: int | None = None,
    ) -> None:
        self._reads = reads
        self.interval_ms = int(interval_seconds * 1000)
        self._max_entries = max_entries
        self._keys = list(keys)
        self._anchor_file = anchor_file
        self._retention = retention_seconds
        self._record = record
        self.runs: dict[str, Run] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def keyed(self) -> bool:
        return bool(self._keys)

    def next_at_ms(self, tenant: str) -> int:
        """When a new check of ``tenant`` may start (0: now)."""
        run = self.runs.get(tenant)
        return run.started_ms + self.interval_ms if run is not None else 0

    def start(self, tenant: str) -> Run:
        """A new check of ``tenant``; the running one, or the last one while it is younger
        than ``interval_seconds`` (a click costs nothing then: the page shows its result)."""
        run = self.runs.get(tenant)
        if run is not None and (not run.done or self.next_at_ms(tenant) > time.time() * 1000):
            return run
        run = self.runs[tenant] = Run(started_ms=int(time.time() * 1000))
        task = asyncio.create_task(self._verify(tenant, run))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return run

    async def _verify(self, tenant: str, run: Run) -> None:
        async def progress(jobs: int, entries: int) -> None:
            run.jobs, run.entries = jobs, entries
            run.tick()
            await asyncio.sleep(0)  # let the streams send it

        summary: dict[str, Any]
        try:
            check = await self._reads.verify_chains(
                tenant=tenant,
                keys=self._keys,
                anchor_files=[self._anchor_file],
                retention_seconds=self._retention,
                progress=progress,
                max_entries=self._max_entries,
            )
            summary = {
                "at_ms": int(time.time() * 1000),
                "jobs": check.jobs,
                "entries": check.entries,
                "problems": [_problem(p) for p in check.broken[:PROBLEMS_KEPT]],
                "problem_count": len(check.broken),
                "keyed": bool(self._keys),
                "capped": check.capped,
                "notes": list(check.notes),
            }
        except (StoreUnavailable, OSError, TimeoutError) as exc:
            summary = {"at_ms": int(time.time() * 1000), "error": f"Redis: {exc}"}
        run.summary = summary
        if "error" not in summary:
            try:
                await self._record(tenant, summary)
            except (StoreUnavailable, OSError, TimeoutError) as exc:
                log.warning("console_chain_record_failed", tenant=tenant, detail=str(exc))
        run.done = True
        run.tick()

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def _problem(text: str) -> dict[str, str]:
    """A verification finding with the job it names (``fg:{tenant/job}:audit …``)."""
    job = ""
    start, end = text.find("{"), text.find("}")
    if start != -1 and end > start:
        job = text[start + 1 : end].partition("/")[2]
    return {"job": job, "detail": text}
