"""What the console reads from Redis, shaped for its templates (read-only, bounded).

Rejections come from the tenant feed ``fg:audit:<tenant>`` (newest first, paged by its
stream ids); filters on reason, worker and job are applied here, over at most
:data:`SCAN_CAP` entries per page (the page says when it stopped early and links on). A time
window maps onto stream ids, which are times. A job's own history comes from its chained
stream ``fg:{t/j}:audit``, the authoritative copy (the feed copy is best effort).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from gateway.core.names import NAME
from gateway.core.reasons import REASONS
from gateway.store.console_reads import ConsoleReads, Entry
from gateway.store.keys import JobKeys

__all__ = [
    "Filters",
    "Row",
    "feed_after",
    "feed_page",
    "feed_top",
    "iso",
    "job_entries",
]

SCAN_CAP = 5000  # feed entries looked at for one page of filtered rows
JOB_CAP = 5000  # entries of one job's stream shown
_ID = re.compile(r"([0-9]{1,20})-([0-9]{1,20})")
_WORKER = re.compile(r"[\x21-\x7e]{1,128}")
_TIME = ("%Y-%m-%dT%H:%M:%S", "%Y-%m-%dT%H:%M", "%Y-%m-%d")


class BadFilter(ValueError):
    """A filter value the console does not accept (the message says which)."""


def iso(ms: int | None) -> str:
    """UTC, millisecond precision, ``Z``: the console's one way to write a time."""
    if not ms:
        return ""
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def entry_id(value: str | None) -> str | None:
    if value is None or value == "":
        return None
    m = _ID.fullmatch(value)
    if m is None or int(m[1]) >= 2**64 or int(m[2]) >= 2**64:
        raise BadFilter("not a stream entry id")
    return value


def _time(value: str, what: str) -> int:
    for fmt in _TIME:
        try:
            return int(datetime.strptime(value, fmt).replace(tzinfo=UTC).timestamp() * 1000)
        except ValueError:
            continue
    raise BadFilter(f"{what} must be a UTC time like 2026-12-01T07:30")


@dataclass(frozen=True, slots=True)
class Filters:
    job: str = ""
    reason: str = ""
    worker: str = ""
    since: str = ""
    until: str = ""
    since_ms: int | None = None  # the window in ms, parsed once
    until_ms: int | None = None

    @classmethod
    def parse(cls, q: Mapping[str, str]) -> Filters:
        job, reason, worker, since, until = (
            q.get(k, "").strip() for k in ("job", "reason", "worker", "since", "until")
        )
        if job and not NAME.fullmatch(job):
            raise BadFilter("job must be a job id (letters, digits, '.', '_', '-')")
        if reason and reason not in REASONS:
            raise BadFilter("reason must be one of the listed reasons")
        if worker and not _WORKER.fullmatch(worker):
            raise BadFilter("worker must be 1 to 128 printable ASCII characters")
        return cls(
            job,
            reason,
            worker,
            since,
            until,
            _time(since, "since") if since else None,
            _time(until, "until") if until else None,
        )

    def query(self, **extra: str) -> dict[str, str]:
        items = {k: getattr(self, k) for k in ("job", "reason", "worker", "since", "until")}
        return {k: v for k, v in {**items, **extra}.items() if v}

    def matches(self, row: Row) -> bool:
        return (
            (not self.job or row.job == self.job)
            and (not self.reason or row.reason == self.reason)
            and (not self.worker or row.worker == self.worker)
            and (self.since_ms is None or row.at_ms >= self.since_ms)
            and (self.until_ms is None or row.at_ms < self.until_ms)
        )


@dataclass(frozen=True, slots=True)
class Row:
    """One feed entry (a rejection or an operator resolution), fields as stored."""

    id: str
    at_ms: int
    job: str
    job_entry: str
    step: str
    reason: str
    presented: str
    current: str
    worker: str
    adapter: str

    @classmethod
    def of(cls, entry: str, f: Mapping[str, str]) -> Row:
        return cls(
            id=entry,
            at_ms=int(f.get("at") or entry.partition("-")[0] or 0),
            job=f.get("job_id", ""),
            job_entry=f.get("job_audit_id", ""),
            step=f.get("step", ""),
            reason=f.get("reason", f.get("event", "")),
            presented=f.get("presented", ""),
            current=f.get("current", ""),
            worker=f.get("worker_id", ""),
            adapter=f.get("adapter", ""),
        )

    @property
    def at(self) -> str:
        return iso(self.at_ms)

    @property
    def rejection(self) -> bool:
        return not self.reason.startswith("operator_")

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "at": self.at,
            "job_id": self.job,
            "job_entry": self.job_entry,
            "step": self.step,
            "reason": self.reason,
            "presented": int(self.presented) if self.presented.isdigit() else None,
            "current": int(self.current) if self.current.isdigit() else None,
            "worker_id": self.worker,
            "adapter": self.adapter,
        }


async def feed_top(reads: ConsoleReads, tenant: str) -> str:
    """The feed's newest entry id ("0-0" when empty): where a live page starts."""
    return await reads.feed_newest(tenant)


async def feed_page(
    reads: ConsoleReads,
    tenant: str,
    filters: Filters,
    *,
    cursor: str | None,
    limit: int,
    scan: int = SCAN_CAP,
) -> tuple[list[Row], str | None]:
    """Up to ``limit`` matching rows, newest first, older than ``cursor``; and the cursor of
    the next page (None at the end). Looks at no more than ``scan`` entries (one page on
    screen: :data:`SCAN_CAP`): a page may then be short and still have a next one."""
    until, since = filters.until_ms, filters.since_ms
    top = f"({cursor}" if cursor else (f"({until}-0" if until is not None else "+")
    bottom = f"{since}-0" if since is not None else "-"
    out: list[Row] = []
    seen = 0
    while True:
        chunk = min(500, scan - seen) + 1
        rows = await reads.feed_before(tenant, top, bottom, chunk)
        more = len(rows) == chunk
        rows = rows[: chunk - 1]
        for entry, fields in rows:
            seen += 1
            row = Row.of(entry, fields)
            if filters.matches(row):
                out.append(row)
                if len(out) == limit:
                    return out, row.id if (more or entry != rows[-1][0]) else None
        if not more:
            return out, None
        top = f"({rows[-1][0]}"
        if seen >= scan:
            return out, rows[-1][0]


async def feed_after(
    reads: ConsoleReads, tenant: str, after: str, count: int
) -> tuple[list[Entry], bool]:
    """Entries after ``after``, oldest first (at most ``count``); and whether more remain."""
    rows = await reads.feed_after(tenant, after, count + 1)
    return rows[:count], len(rows) > count


async def job_entries(reads: ConsoleReads, keys: JobKeys) -> tuple[dict[str, str], list[Entry]]:
    """The job hash and its chained audit stream (oldest first, at most :data:`JOB_CAP`; one
    more entry is read to tell a longer stream: :func:`job_chain_cut`)."""
    return await reads.job(keys, JOB_CAP + 1)
