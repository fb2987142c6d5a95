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
MULTI) and emits ``{v, at, tenant, job_id, entry, head, count, seen, kid, pid, mac}``
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
import functools
import hashlib
import hmac
import json
import os
import re
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
import structlog
from redis.exceptions import RedisError, ResponseError

from gateway.core.records import AuditCheck, chain_hash
from gateway.runtime.settings import ConfigError, Settings
from gateway.store.keys import JobKeys

__all__ = [
    "ANCHOR_FILE",
    "AnchorCheck",
    "Anchorer",
    "anchor_mac",
    "anchor_path",
    "audit_keys",
    "key_id",
    "verify",
]

log = structlog.get_logger("fencegate.audit")

ANCHOR_FILE = "audit-anchors.jsonl"
# the fields an anchor's MAC covers, in the order they are written
ANCHOR_FIELDS = ("v", "at", "tenant", "job_id", "entry", "head", "count", "seen", "kid")
PIPE_BUF = 4096
MIN_KEY_BYTES = 16
# jobs read per round when anchoring (one MULTI each, pipelined side by side)
_CHUNK = 64
_ID_RE = re.compile(r"^(\d{1,20}-\d{1,20})?$")  # a stream entry id, or none


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


def _id(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def note_audit(touched: dict[JobKeys, str], keys: JobKeys, audit_id: str) -> None:
    """Remember that a reply named this job's audit entry (the newest id per job)."""
    seen = touched.get(keys)
    if audit_id and (seen is None or _id(audit_id) > _id(seen)):
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
    process saw (``Store.audit_touched``); an entry whose reply was lost (a timeout) is
    covered the next time its job's chain is extended here.
    """

    def __init__(
        self, client: aioredis.Redis, touched: dict[JobKeys, str], path: Path, keys: Sequence[str]
    ) -> None:
        self._client = client
        self._touched = touched
        self.path = path
        self._key = keys[0] if keys else ""
        self._kid = key_id(self._key) if self._key else ""
        self._task: asyncio.Task[None] | None = None

    async def _read(self, job: JobKeys, seen: str) -> dict[str, Any] | None:
        pipe = self._client.pipeline(transaction=True)  # one slot: the job's hash tag
        pipe.hmget(job.job, "audit_head", "audit_last")
        pipe.xlen(job.audit)
        pipe.xrevrange(job.audit, count=1)
        pipe.xrange(job.audit, seen, seen)
        (head, last), count, newest, seen_rows = await pipe.execute()
        newest_id = newest[0][0] if newest else None
        if not seen_rows or not last or last != newest_id:
            log.error(
                "audit_chain_inconsistent",
                tenant=job.tenant,
                job_id=job.job_id,
                audit_last=last,
                newest_entry=newest_id,
                seen=seen,
                seen_present=bool(seen_rows),
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
                read = await asyncio.gather(*(self._read(j, seen) for j, seen in chunk))
                records += [r for r in read if r is not None]
        except (TimeoutError, RedisError, OSError) as exc:
            again()
            report = log.error if isinstance(exc, ResponseError) else log.warning  # ACL, bug
            report("audit_anchor_failed", jobs=len(jobs), detail=f"Redis: {exc}")
            return 0
        if not records:
            return 0
        for record in records:
            log.info("audit_anchor", **record)
        lines = [json.dumps(r, separators=(",", ":")) for r in records]
        try:
            await asyncio.to_thread(_append, self.path, lines)
        except OSError as exc:
            again()
            log.error("audit_anchor_write_failed", path=str(self.path), detail=str(exc))
        return len(records)

    async def _loop(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await self.anchor_once()
            except Exception:  # never let anchoring stop for good
                log.exception("audit_anchor_failed")

    def start(self, interval: float) -> None:
        self._task = asyncio.create_task(self._loop(interval))

    async def stop(self) -> None:
        """Stop the ticker and anchor what is left (at shutdown)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.anchor_once()


# -- verification -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AnchorCheck(AuditCheck):
    """What ``verify`` looked at, beyond the chains (``jobs``, ``entries``, ``broken``)."""

    keyed: bool = False
    kids: tuple[str, ...] = ()
    anchors: int = 0
    anchors_expired: int = 0
    anchor_files: tuple[str, ...] = ()
    missing_files: tuple[str, ...] = ()
    notes: list[str] = field(default_factory=list)


def _gone(entry: str, *, first: tuple[int, int] | None, now_ms: int, retention_ms: int) -> bool:
    """A missing entry is gone unless the retention may have expired its stream (after which
    a new stream may have begun: its first entry is newer than the missing one)."""
    aged = now_ms >= _id(entry)[0] + retention_ms
    return not (aged and (first is None or first > _id(entry)))


def read_anchors(paths: Iterable[Path]) -> tuple[list[dict[str, Any]], list[str], list[Path]]:
    """Anchors from anchor files or gateway logs (lines with ``event = "audit_anchor"``)."""
    anchors: list[dict[str, Any]] = []
    problems: list[str] = []
    missing: list[Path] = []
    for path in paths:
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            missing.append(path)
            continue
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                record = None
            if not isinstance(record, dict):
                # a torn or altered anchor; other text in a log is not an anchor
                if line.lstrip().startswith("{") or "audit_anchor" in line:
                    problems.append(f"{path}:{n}: unreadable anchor line")
                continue
            if "event" in record and record["event"] != "audit_anchor":
                continue  # another line of a gateway log
            ids = (record.get("entry"), record.get("seen", ""))
            if not (
                all(isinstance(record.get(k), str) for k in ("tenant", "job_id"))
                and all(isinstance(i, str) and _ID_RE.fullmatch(i) for i in ids)
            ):
                problems.append(f"{path}:{n}: not an anchor")
                continue
            record["_where"] = f"{path}:{n}"
            anchors.append(record)
    return anchors, problems, missing


async def verify(
    client: aioredis.Redis,
    *,
    keys: Sequence[str] = (),
    anchor_files: Sequence[Path] = (),
    retention_seconds: int = 604_800,
) -> AnchorCheck:
    """Recompute every job's chain (with the key(s) when given) and check every anchor.

    Detected: an entry altered, forged or re-hashed without the key (keyed chains; an
    unkeyed chain only catches accidental damage: anyone can recompute SHA-1); an entry
    missing between two others; the newest entries missing when the job hash's head was
    left alone; for every anchor: its job's stream, or the anchored entry, gone before the
    retention could have expired it, the chain up to it not verifying, ending with another
    hash or with another number of entries, and (with the key) an anchor altered.
    Not detected: entries newer than the newest anchor of their job deleted together with a
    reset of ``audit_head``/``audit_last``; an anchor line deleted from every place it went;
    a stream deleted after its retention could have expired it.
    """
    key_bytes = [k.encode() for k in keys]
    by_kid = {key_id(k): k for k in keys}
    anchors, broken, missing = read_anchors(anchor_files)
    by_stream: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for anchor in anchors:
        by_stream[JobKeys(anchor["tenant"], anchor["job_id"]).audit].append(anchor)
    seconds, micros = await client.time()
    now_ms = int(seconds) * 1000 + int(micros) // 1000
    retention_ms = retention_seconds * 1000
    jobs = entries = expired = 0
    notes: list[str] = []
    if anchors and not keys:
        notes.append("anchor MACs not checked (no key)")

    def check_mac(anchor: dict[str, Any]) -> None:
        if not keys:
            return
        where = anchor["_where"]
        key = by_kid.get(str(anchor.get("kid") or ""))
        if not anchor.get("mac"):
            broken.append(f"{where}: anchor has no MAC (written without the audit key)")
        elif key is None:
            broken.append(f"{where}: anchor keyed with an unknown key (kid {anchor.get('kid')})")
        elif not hmac.compare_digest(anchor_mac(anchor, key), str(anchor["mac"])):
            broken.append(f"{where}: anchor altered (its MAC does not match)")

    def entry_valid(items: list[tuple[str, str]], stored: str | None) -> str | None:
        """None when the entry's hash is right; else what is wrong with it."""
        if not key_bytes:
            if chain_hash(items) == stored:
                return None
            return "entry altered (or the chain is keyed: verify with its key)"
        if any(hmac.compare_digest(chain_hash(items, k), stored or "") for k in key_bytes):
            return None
        if chain_hash(items) == stored:
            return "entry hashed without the audit key (forged, or written before a key was set)"
        return "entry altered (its HMAC does not match)"

    seen: set[str] = set()
    async for stream in client.scan_iter(match="fg:{*}:audit", count=1000):
        if stream in seen:  # SCAN may return a key twice
            continue
        seen.add(stream)
        jobs += 1
        # decode_responses=True: every key, field and value is a str
        rows: list[tuple[str, dict[str, str]]] = await client.xrange(stream)  # type: ignore[assignment]
        index: dict[str, tuple[int, str | None, bool]] = {}
        prev: str | None = None
        intact = True
        for i, (entry_id, fields) in enumerate(rows):
            entries += 1
            items = [(k, v) for k, v in fields.items() if k != "hash"]
            problem = entry_valid(items, fields.get("hash"))
            if problem:
                broken.append(f"{stream} {entry_id}: {problem}")
                intact = False
            if prev is not None and fields.get("prev") != prev:
                broken.append(f"{stream} {entry_id}: previous entry missing or altered")
                intact = False
            prev = fields.get("hash")
            index[entry_id] = (i, prev, intact)
        head: str | None = await client.hget(  # type: ignore[assignment]
            stream[: -len(":audit")] + ":job", "audit_head"
        )
        if rows and head != prev:
            broken.append(f"{stream}: newest entries missing (chain head {head})")
        first = _id(rows[0][0]) if rows else None
        gone = functools.partial(_gone, first=first, now_ms=now_ms, retention_ms=retention_ms)
        for anchor in by_stream.pop(stream, []):
            check_mac(anchor)
            where, entry, seen_id = anchor["_where"], anchor["entry"], anchor.get("seen")
            if isinstance(seen_id, str) and seen_id and seen_id not in index and gone(seen_id):
                broken.append(
                    f"{stream}: entry {seen_id}, written through the gateway, missing ({where})"
                )
            if not entry:  # the chain was gone when the anchor was taken
                broken.append(f"{stream}: anchored with no chain head ({where})")
                continue
            if entry not in index:
                if gone(entry):
                    broken.append(f"{stream}: anchored entry {entry} missing ({where})")
                else:
                    expired += 1
                continue
            i, stored, upto = index[entry]
            if stored != anchor.get("head"):
                broken.append(f"{stream} {entry}: hash differs from the anchored head ({where})")
            elif not upto:
                broken.append(f"{stream} {entry}: chain up to the anchored entry broken ({where})")
            if anchor.get("count") is not None and anchor["count"] != i + 1:
                broken.append(
                    f"{stream} {entry}: {i + 1} entries up to it, {anchor['count']} anchored "
                    f"({where})"
                )
    for stream, rest in by_stream.items():
        for anchor in rest:
            check_mac(anchor)
            newest = max((anchor["entry"], anchor.get("seen") or ""), key=lambda i: _id(i or "0"))
            if not _gone(newest or "0", first=None, now_ms=now_ms, retention_ms=retention_ms):
                expired += 1
            else:
                broken.append(
                    f"{stream}: the job's audit stream is gone, anchored up to "
                    f"{newest} ({anchor['_where']})"
                )
    return AnchorCheck(
        jobs,
        entries,
        broken,
        keyed=bool(keys),
        kids=tuple(by_kid),
        anchors=len(anchors),
        anchors_expired=expired,
        anchor_files=tuple(str(p) for p in anchor_files if p not in missing),
        missing_files=tuple(str(p) for p in missing),
        notes=notes,
    )
