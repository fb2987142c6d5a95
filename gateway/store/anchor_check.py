"""Checking the audit log against the anchors: which chain heads were anchored, which anchored
entries are gone (deleted newest entries an anchor covers), and the report of
``fencegate audit verify --anchors``."""

from __future__ import annotations

import functools
import hmac
import json
import re
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
import structlog

from gateway.core.records import AuditCheck, chain_hash
from gateway.store.anchors import anchor_mac, entry_order, key_id
from gateway.store.keys import JobKeys

__all__ = ["AnchorCheck", "read_anchors", "verify"]

log = structlog.get_logger("fencegate.audit")
_ID_RE = re.compile(r"^(\d{1,20}-\d{1,20})?$")  # a stream entry id, or none


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
    capped: bool = False  # stopped at max_entries: not every chain was read


PAGE = 1000  # stream entries per XRANGE


def _gone(entry: str, *, first: tuple[int, int] | None, now_ms: int, retention_ms: int) -> bool:
    """A missing entry is gone unless the retention may have expired its stream (after which
    a new stream may have begun: its first entry is newer than the missing one)."""
    aged = now_ms >= entry_order(entry)[0] + retention_ms
    return not (aged and (first is None or first > entry_order(entry)))


def read_anchors(
    paths: Iterable[Path], *, tenant: str | None = None
) -> tuple[list[dict[str, Any]], list[str], list[Path]]:
    """Anchors from anchor files or gateway logs (lines with ``event = "audit_anchor"``), read
    a line at a time (memory: the anchors kept, never the file).

    ``tenant``: that tenant's anchors only, and its view of the files (the console): a
    problem names ``anchor line <n>``, never the server's path; a line that names another
    tenant is left out, a damaged line that names none is counted in one note (the
    operator's ``fencegate audit verify --anchors`` lists them), never shown."""
    anchors: list[dict[str, Any]] = []
    problems: list[str] = []
    missing: list[Path] = []
    unattributed = 0
    for path in paths:
        try:
            handle = path.open(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            missing.append(path)
            continue
        with handle:
            for n, line in enumerate(handle, 1):
                if not line.strip():
                    continue
                where = f"{path}:{n}" if tenant is None else f"anchor line {n}"
                try:
                    record = json.loads(line)
                except ValueError:
                    record = None
                if not isinstance(record, dict):
                    # a torn or altered anchor; other text in a log is not an anchor
                    if line.lstrip().startswith("{") or "audit_anchor" in line:
                        if tenant is None:
                            problems.append(f"{where}: unreadable anchor line")
                        else:
                            unattributed += 1
                    continue
                if "event" in record and record["event"] != "audit_anchor":
                    continue  # another line of a gateway log
                if tenant is not None and record.get("tenant") != tenant:
                    if not isinstance(record.get("tenant"), str):
                        unattributed += 1
                    continue  # another tenant's anchor, sound or not
                ids = (record.get("entry"), record.get("seen", ""))
                if not (
                    all(isinstance(record.get(k), str) for k in ("tenant", "job_id"))
                    and all(isinstance(i, str) and _ID_RE.fullmatch(i) for i in ids)
                ):
                    problems.append(f"{where}: not an anchor")
                    continue
                record["_where"] = where
                anchors.append(record)
    if unattributed:
        problems.append(
            f"{unattributed} anchor line(s) unreadable or naming no tenant: they may hide "
            "an anchor of this tenant; the operator's `fencegate audit verify --anchors` "
            "lists them"
        )
    return anchors, problems, missing


async def verify(
    client: aioredis.Redis,
    *,
    keys: Sequence[str] = (),
    anchor_files: Sequence[Path] = (),
    retention_seconds: int = 604_800,
    tenant: str | None = None,
    progress: Callable[[int, int], Awaitable[None]] | None = None,
    max_entries: int | None = None,
) -> AnchorCheck:
    """Recompute every job's chain (with the key(s) when given) and check every anchor.

    ``tenant``: only that tenant's chains and anchors, and problems that name no server path
    (the console); ``progress(jobs, entries)`` is awaited after each chain. Streams are read
    in pages of :data:`PAGE` entries, keeping only the entries anchors name; ``max_entries``:
    the most one check reads over all chains (past it the check stops, says so in ``notes``
    and sets ``capped``; nothing is concluded about the chain it stopped in).

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
    anchors, broken, missing = read_anchors(anchor_files, tenant=tenant)
    by_stream: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for anchor in anchors:
        by_stream[JobKeys(anchor["tenant"], anchor["job_id"]).audit].append(anchor)
    seconds, micros = await client.time()
    now_ms = int(seconds) * 1000 + int(micros) // 1000
    retention_ms = retention_seconds * 1000
    jobs = entries = expired = 0
    capped = False
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
    # tenant names have no glob characters (gateway.core.names.NAME)
    match = "fg:{*}:audit" if tenant is None else "fg:{" + tenant + "/*}:audit"
    async for stream in client.scan_iter(match=match, count=1000):
        if stream in seen:  # SCAN may return a key twice
            continue
        seen.add(stream)
        jobs += 1
        wanted = {
            i for a in by_stream.get(stream, ()) for i in (a["entry"], a.get("seen")) if i
        }  # the entries anchors name: the only ones kept (memory: the anchors, not the chain)
        index: dict[str, tuple[int, str | None, bool]] = {}
        prev: str | None = None
        intact = True
        first: tuple[int, int] | None = None
        n, start = 0, "-"
        while True:  # the stream in pages, up to what is left of max_entries
            count = PAGE if max_entries is None else min(PAGE, max_entries - entries)
            if count <= 0:
                capped = True
                break
            # decode_responses=True: every key, field and value is a str
            page: list[tuple[str, dict[str, str]]] = await client.xrange(  # type: ignore[assignment]
                stream, min=start, count=count
            )
            for entry_id, fields in page:
                entries += 1
                if first is None:
                    first = entry_order(entry_id)
                items = [(k, v) for k, v in fields.items() if k != "hash"]
                problem = entry_valid(items, fields.get("hash"))
                if problem:
                    broken.append(f"{stream} {entry_id}: {problem}")
                    intact = False
                if prev is not None and fields.get("prev") != prev:
                    broken.append(f"{stream} {entry_id}: previous entry missing or altered")
                    intact = False
                prev = fields.get("hash")
                if entry_id in wanted:
                    index[entry_id] = (n, prev, intact)
                n += 1
            if len(page) < count:
                break
            start = "(" + page[-1][0]
        if capped:  # this chain is not read to its end: nothing more is concluded
            notes.append(
                f"stopped after {entries} entries (the bound of one check): the chains after "
                f"{stream} were not checked"
            )
            by_stream.clear()
            break
        head: str | None = await client.hget(  # type: ignore[assignment]
            stream[: -len(":audit")] + ":job", "audit_head"
        )
        if n and head != prev:
            broken.append(f"{stream}: newest entries missing (chain head {head})")
        if progress is not None:
            await progress(jobs, entries)
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
            newest = max(
                (anchor["entry"], anchor.get("seen") or ""), key=lambda i: entry_order(i or "0")
            )
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
        capped=capped,
    )
