"""The console's overview and the last chain check, from Redis (every gateway's numbers, not
one process's counters); see :mod:`gateway.store.attention` for the index they read."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

from gateway.store.attention import AttentionIndex, as_hash, attention_due, effect_key, member_parts
from gateway.store.keys import attention_hint, audit_feed, chain_check

__all__ = ["overview", "record_chain_check"]

_FEED_PAGE = 1000
_FEED_CAP = 50_000  # feed entries counted per overview (the rest: "capped")
_OPEN_CAP = 10_000  # hints verified per overview
_DUE_FIELDS = ("state", "updated_at", "deadline")  # what decides "needs a decision now"
_PROBLEMS_KEPT = 200
HOUR_MS = 3_600_000


async def overview(attention: AttentionIndex, tenant: str, *, now_ms: int) -> dict[str, Any]:
    """Counts from Redis (every gateway's, not one process's): the last hour's audited
    rejections by reason (from the tenant feed: best effort), open unknowns and overdue
    dispatches (each confirmed by its record), the last chain check."""
    by_reason: Counter[str] = Counter()
    resolutions = 0
    start, read, capped = f"{now_ms - HOUR_MS}-0", 0, False
    while True:
        rows = await attention.execute(
            "XRANGE", audit_feed(tenant), start, "+", "COUNT", _FEED_PAGE
        )
        for _, fields in rows:
            reason = as_hash(fields).get("reason", "")
            if reason.startswith("operator_resolved_"):
                resolutions += 1
            else:
                by_reason[reason] += 1
        read += len(rows)
        if len(rows) < _FEED_PAGE:
            break
        if read >= _FEED_CAP:
            capped = True
            break
        start = "(" + rows[-1][0]
    hints: list[str] = await attention.execute(
        "ZRANGEBYSCORE", attention_hint(tenant), "-inf", now_ms, "LIMIT", 0, _OPEN_CAP + 1
    )
    mine = [m for m in hints[:_OPEN_CAP] if (member_parts(m) or ("",))[0] == tenant]
    # the fields attention_due decides on: never a stored payload or result
    replies = await attention.pipelined([("HMGET", effect_key(m), *_DUE_FIELDS) for m in mine])
    hashes = [{k: v for k, v in zip(_DUE_FIELDS, r, strict=True) if v is not None} for r in replies]
    states = Counter(f[0] for h in hashes if h and (f := attention_due(h, now_ms)))
    raw = await attention.execute("GET", chain_check(tenant))
    return {
        "at_ms": now_ms,
        "rejections_last_hour": dict(sorted(by_reason.items())),
        "rejections_total_last_hour": sum(by_reason.values()),
        "resolutions_last_hour": resolutions,
        "rejections_capped": capped,
        "open_unknowns": states["unknown"],
        "overdue_dispatches": states["dispatching"],
        "open_capped": len(hints) > _OPEN_CAP,
        "last_chain_check": json.loads(raw) if raw else None,
    }


async def record_chain_check(
    attention: AttentionIndex, tenant: str, summary: dict[str, Any]
) -> None:
    """Keep the summary of a tenant's chain check (``at_ms``, ``jobs``, ``entries``,
    ``problems``: a count or a list, of which the first 200 are kept) for every gateway."""
    kept = dict(summary)
    problems = kept.get("problems")
    if isinstance(problems, list | tuple):
        kept["problems"] = list(problems[:_PROBLEMS_KEPT])
        kept["problems_total"] = len(problems)
    body = json.dumps(kept, separators=(",", ":"), default=str)
    await attention.execute("SET", chain_check(tenant), body, "PX", attention.retention_ms)
