"""What the console reads from Redis (read-only, bounded by its callers).

The tenant feed ``fg:audit:<tenant>`` (newest first for a page, oldest first for a live tail)
and a job's hash with its chained audit stream ``fg:{t/j}:audit``, on the gateway's own
client (its pool, its timeouts). Redis not answering is ``StoreUnavailable``; every call maps
Redis's errors in one place (:mod:`gateway.store.failures`). The console shapes the rows
(:mod:`gateway.console.data`); its shared state (logouts, login throttling) is
:mod:`gateway.store.consolestate`'s.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from gateway.store.anchor_check import AnchorCheck, verify
from gateway.store.failures import redis_errors
from gateway.store.keys import JobKeys, audit_feed

__all__ = ["ConsoleReads", "Entry"]

Entry = tuple[str, dict[str, str]]  # a stream entry: its id and its fields


def _pairs(value: Any) -> dict[str, str]:
    """A reply that is a dict already, or a flat [field, value, …] list."""
    if isinstance(value, Mapping):
        return {str(k): str(v) for k, v in value.items()}
    return dict(zip(value[::2], value[1::2], strict=True))


def _entries(rows: Any) -> list[Entry]:
    return [(str(row[0]), _pairs(row[1])) for row in rows]


class ConsoleReads:
    """The console's reads, on the gateway's client (the store builds it:
    :attr:`gateway.store.store.Store.console_reads`)."""

    def __init__(self, client: Any) -> None:
        self._client = client

    async def feed_newest(self, tenant: str) -> str:
        """The feed's newest entry id ("0-0" when empty)."""
        with redis_errors():
            rows = await self._client.xrevrange(audit_feed(tenant), "+", "-", count=1)
        return str(rows[0][0]) if rows else "0-0"

    async def feed_before(self, tenant: str, top: str, bottom: str, count: int) -> list[Entry]:
        """Up to ``count`` entries from ``top`` down to ``bottom``, newest first (stream id
        bounds as XREVRANGE takes them: ``(`` excludes)."""
        with redis_errors():
            rows = await self._client.xrevrange(audit_feed(tenant), top, bottom, count=count)
        return _entries(rows)

    async def feed_after(self, tenant: str, after: str, count: int) -> list[Entry]:
        """Up to ``count`` entries after the id ``after`` (excluded), oldest first."""
        with redis_errors():
            rows = await self._client.xrange(audit_feed(tenant), f"({after}", "+", count=count)
        return _entries(rows)

    async def job(self, keys: JobKeys, count: int) -> tuple[dict[str, str], list[Entry]]:
        """The job hash and the first ``count`` entries of its chained audit stream."""
        client = self._client
        with redis_errors():
            job = await client.hgetall(keys.job)
            rows = await client.xrange(keys.audit, "-", "+", count=count)
        return _pairs(job), _entries(rows)

    async def verify_chains(
        self,
        *,
        tenant: str,
        keys: list[str],
        anchor_files: list[Any],
        retention_seconds: int,
        progress: Callable[[int, int], Awaitable[None]],
        max_entries: int | None,
    ) -> AnchorCheck:
        """The tenant's chain check (:func:`gateway.store.anchor_check.verify`)."""
        with redis_errors():
            return await verify(
                self._client,
                keys=keys,
                anchor_files=anchor_files,
                retention_seconds=retention_seconds,
                tenant=tenant,
                progress=progress,
                max_entries=max_entries,
            )
