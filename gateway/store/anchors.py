"""The audit chain's key, its anchors outside Redis, and what ``fencegate audit verify`` checks.

Every audit entry is chained inside the deciding script (``audit()`` in the Lua prelude):
``hash`` = HMAC-SHA1(key, the entry's "name=value" lines, ``prev`` included) with the audit
key, plain SHA-1 without one. The key comes from the environment (``[audit] key_env``), is
passed to Redis with every call and never stored there, so whoever can write Redis but has
not the key cannot alter, forge or re-hash an entry without ``verify`` noticing.

A chain alone cannot show that its *newest* entries were deleted: the head it ends with
lives in the same Redis. So the gateway anchors heads outside Redis: every
``[audit] anchor_interval_seconds`` (and at shutdown), for each job whose chain it extended
since the last anchor, it reads ``audit_head`` / ``audit_last`` and the stream's length (one
read-only script per job, a batch of jobs in one pipeline) and emits
``{v, at, tenant, job_id, entry, head, count, seen, kid, pid, mac}``
(``seen``: the newest entry id this process saw in a script's reply, so entries deleted
between the reply and the anchor are noticed too)

* as a line appended to the anchor file (``[audit] anchor_file``, default
  ``<redis.data_dir>/audit-anchors.jsonl``; O_APPEND, one ``write()`` per line, fsync'd per
  batch). Lines are far below PIPE_BUF (4096 bytes): several ``--workers`` processes append
  to the one file, each line whole, never interleaved; and
* as a structured log line (``event = "audit_anchor"``, the same fields), for a log sink the
  Redis operator cannot rewrite.

``mac`` is HMAC-SHA256(key, canonical JSON of the other anchor fields); ``kid`` names the
key (first 8 hex digits of SHA-256 of it). Without a key an anchor has neither.

:func:`verify` checks every chain and every anchor it is given; see its docstring for what
it detects and what it cannot.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import orjson
import redis.asyncio as aioredis
import structlog
from redis.exceptions import NoScriptError, RedisError, ResponseError

from gateway.runtime.logging import log_info_lines
from gateway.runtime.periodic import every
from gateway.runtime.settings import ConfigError, Settings
from gateway.store.cluster import is_cluster
from gateway.store.keys import JobKeys
from gateway.store.scripts import PlainScript

__all__ = [
    "ANCHOR_FILE",
    "Anchorer",
    "anchor_mac",
    "anchor_path",
    "audit_keys",
    "entry_order",
    "key_id",
]

log = structlog.get_logger("fencegate.audit")

ANCHOR_FILE = "audit-anchors.jsonl"
# the fields an anchor's MAC covers, in the order they are written
ANCHOR_FIELDS = ("v", "at", "tenant", "job_id", "entry", "head", "count", "seen", "kid")
PIPE_BUF = 4096
MIN_KEY_BYTES = 16
# jobs read per round trip when anchoring (see Anchorer._snapshots)
_CHUNK = 256
SNAPSHOT = PlainScript.load("anchor-snapshots-2n")  # jobs' chains, each read in one step


def _consistent(snap: Sequence[Any]) -> bool:
    """A chain's snapshot (``anchor-snapshots-2n``'s reply) holds the entry last seen here, and its
    head names its newest."""
    _, last, _, newest, seen_present = snap
    return bool(seen_present and last and last == newest)


def audit_keys(settings: Settings, secret: Callable[[str, str], str]) -> list[str]:
    """The audit key(s) from ``[audit] key_env``: comma-separated, the first keys new entries
    and anchors, all of them verify. Empty: an unkeyed chain."""
    if not settings.audit.key_env:
        return []
    raw = secret(settings.audit.key_env, "audit.key_env")
    keys = [k.strip() for k in raw.split(",") if k.strip()]
    if not keys or any(len(k.encode()) < MIN_KEY_BYTES for k in keys):
        raise ConfigError(
            f"audit.key_env: every key in {settings.audit.key_env} must be at least "
            f"{MIN_KEY_BYTES} bytes (generate one: python -c 'import secrets; "
            "print(secrets.token_urlsafe(32))')"
        )
    return keys


def entry_order(entry_id: str) -> tuple[int, int]:
    """A stream entry id (``<ms>-<seq>``, or ``<ms>``) as the pair it is ordered by."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def note_audit(touched: dict[JobKeys, str], keys: JobKeys, audit_id: str) -> None:
    """Remember that a reply named this job's audit entry (the newest id per job)."""
    seen = touched.get(keys)
    if audit_id and (seen is None or entry_order(audit_id) > entry_order(seen)):
        touched[keys] = audit_id


def anchor_path(settings: Settings) -> Path:
    return Path(settings.audit.anchor_file or Path(settings.redis.data_dir) / ANCHOR_FILE)


def key_id(key: str) -> str:
    """A key's public name: the first 8 hex digits of its SHA-256."""
    return hashlib.sha256(key.encode()).hexdigest()[:8]


def anchor_mac(record: dict[str, Any], key: str) -> str:
    body = json.dumps(
        {k: record.get(k) for k in ANCHOR_FIELDS}, sort_keys=True, separators=(",", ":")
    )
    return hmac.new(key.encode(), body.encode(), hashlib.sha256).hexdigest()


def _append(path: Path, lines: Sequence[str]) -> None:
    """Append whole lines (one write each, O_APPEND) and fsync them."""
    created = not path.exists()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        for line in lines:
            data = line.encode() + b"\n"
            if len(data) > PIPE_BUF:  # pragma: no cover - names are at most 128 characters
                raise OSError(f"anchor line of {len(data)} bytes exceeds {PIPE_BUF}")
            if os.write(fd, data) != len(data):  # pragma: no cover - a full disk
                raise OSError("short write to the anchor file")
        os.fsync(fd)
    finally:
        os.close(fd)
    if created:  # the new file's directory entry must survive a crash too
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


class Anchorer:
    """Emits the heads of the chains this process extended, at intervals and at shutdown.

    ``touched`` is the store's set of jobs whose audit stream got an entry in a reply this
    process saw (``RedisLink.audit_touched``); an entry whose reply was lost (a timeout) is
    covered the next time its job's chain is extended here.
    """

    def __init__(
        self, client: aioredis.Redis, touched: dict[JobKeys, str], path: Path, keys: Sequence[str]
    ) -> None:
        self._client = client
        self._cluster = is_cluster(client)
        self._touched = touched
        self.path = path
        self._key = keys[0] if keys else ""
        self._kid = key_id(self._key) if self._key else ""
        self._task: asyncio.Task[None] | None = None

    async def _snapshots(self, jobs: Sequence[tuple[JobKeys, str]]) -> list[list[Any]]:
        """Each job's chain head, length, newest entry and whether the entry last seen here is
        there, for a whole chunk of jobs in one round trip (``anchor-snapshots-2n``: one
        consistent snapshot per chain). On a standalone Redis the chunk is one script call;
        on a Cluster one call per job (its keys in the job's slot) in a plain pipeline, split
        per node by redis-py.

        Never a transaction: redis-py's RedisCluster runs each command queued on a
        transaction pipeline in a new thread with its own event loop and joins it, and after
        a failover (the client marked for re-initialisation) that thread waits on the main
        loop's connections forever and the join blocks the whole gateway. Nor one reply per
        read: reading four commands' replies (and MULTI's) per job was most of a tick's cost;
        nor a call per job on a standalone Redis: redis-py's packing and parsing of each was
        most of what was left (the anchoring was ~13 % of a stale call's CPU)."""
        if self._cluster:  # EVAL: redis-py refuses EVALSHA in cluster pipelines
            pipe = self._client.pipeline(transaction=False)
            for job, seen in jobs:
                pipe.eval(SNAPSHOT.source, 2, job.job, job.audit, seen)
            return list(await pipe.execute())
        keys = [key for job, _ in jobs for key in (job.job, job.audit)]
        seen_ids = [s for _, s in jobs]
        try:
            flat = await self._client.evalsha(SNAPSHOT.sha, len(keys), *keys, *seen_ids)
        except NoScriptError:
            flat = await self._client.eval(SNAPSHOT.source, len(keys), *keys, *seen_ids)
        return [flat[i : i + 5] for i in range(0, len(flat), 5)]

    async def _records(self, jobs: Sequence[tuple[JobKeys, str]]) -> list[dict[str, Any]]:
        snapshots = await self._snapshots(jobs)
        return [
            self._record(job, seen, snap) for (job, seen), snap in zip(jobs, snapshots, strict=True)
        ]

    def _record(self, job: JobKeys, seen: str, snap: list[Any]) -> dict[str, Any]:
        head, last, count, newest_id, seen_present = snap
        if not _consistent(snap):
            log.error(
                "audit_chain_inconsistent",
                tenant=job.tenant,
                job_id=job.job_id,
                audit_last=last,
                newest_entry=newest_id,
                seen=seen,
                seen_present=bool(seen_present),
                detail="the job's audit stream lacks an entry this gateway wrote, or its head "
                "does not name its newest entry: altered in Redis? (anchored as found)",
            )
        record: dict[str, Any] = {
            "v": 1,
            "at": int(time.time() * 1000),
            "tenant": job.tenant,
            "job_id": job.job_id,
            "entry": last or newest_id or "",
            "head": head or "",
            "count": int(count),
            "seen": seen,
            "kid": self._kid,
            "pid": os.getpid(),  # which gateway process (not covered by the MAC)
        }
        if self._key:
            record["mac"] = anchor_mac(record, self._key)
        return record

    async def anchor_once(self) -> int:
        """Anchor every job touched since the last round; returns how many were anchored."""
        jobs = list(self._touched.items())
        self._touched.clear()
        records: list[dict[str, Any]] = []

        def again() -> None:  # next round (keeping a newer id noted meanwhile)
            for job, seen in jobs:
                note_audit(self._touched, job, seen)

        try:
            for i in range(0, len(jobs), _CHUNK):
                chunk = jobs[i : i + _CHUNK]
                records += await self._records(chunk)
        except (TimeoutError, RedisError, OSError) as exc:
            again()
            report = log.error if isinstance(exc, ResponseError) else log.warning  # ACL, bug
            report("audit_anchor_failed", jobs=len(jobs), detail=f"Redis: {exc}")
            return 0
        if not records:
            return 0
        # buffered with the request lines: one write for the batch, not one per job
        log_info_lines("audit_anchor", ({**record} for record in records))
        # orjson's text is the stdlib's compact one here: string fields are names and ids
        # (ASCII, nothing to escape), the rest integers
        lines = [orjson.dumps(r).decode() for r in records]
        try:
            await asyncio.to_thread(_append, self.path, lines)
        except OSError as exc:
            again()
            log.error("audit_anchor_write_failed", path=str(self.path), detail=str(exc))
        return len(records)

    def start(self, interval: float) -> None:
        """Anchor every ``interval`` seconds (the shared loop: a failed pass is logged,
        ``periodic_tick_failed`` with ``ticker=anchor``, and the next one runs)."""
        self._task = asyncio.create_task(every(lambda: interval, self.anchor_once, name="anchor"))

    async def stop(self) -> None:
        """Stop the ticker and anchor what is left (at shutdown)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.anchor_once()


# -- verification -------------------------------------------------------------------------
