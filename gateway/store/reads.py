"""What the store reads without deciding: an effect, a job, the audit log, the chain check."""

from __future__ import annotations

from typing import Any

from gateway.core.records import (
    RECORD_FIELDS,
    AuditCheck,
    AuditEntry,
    EffectRecord,
    JobView,
)
from gateway.store import durability, overview
from gateway.store.attention import AttentionIndex
from gateway.store.keys import (
    JobKeys,
    audit_feed,
)
from gateway.store.link import RedisLink

_JOB_FIELDS = ("fence", "lease_ms", "lease_exp", "cancelled")  # a job view's, of the job hash


def _optional_int(raw: str) -> int | None:
    return int(raw) if raw else None


class StoreReads:
    """Views of the store's records, on its link: nothing here writes but the console's
    chain-check summary."""

    def __init__(self, link: RedisLink, attention: AttentionIndex) -> None:
        self._link = link
        self._client = link.client
        self._attention = attention

    async def effect(self, keys: JobKeys, step: str) -> EffectRecord | None:
        # decode_responses=True: every value is a str
        values: list[str | None] = await self._link.guard(
            lambda: self._client.hmget(keys.effect(step), RECORD_FIELDS)  # type: ignore[arg-type,return-value]
        )
        return EffectRecord.from_values(values)

    async def job(self, keys: JobKeys) -> JobView | None:
        async def read() -> tuple[int, list[str | None], dict[str, EffectRecord]]:
            # decode_responses=True: every key and value is a str
            async with self._client.pipeline(transaction=False) as pipe:
                pipe.exists(keys.job)
                pipe.hmget(keys.job, _JOB_FIELDS)
                pipe.smembers(keys.steps)
                exists, job, steps = await pipe.execute()
            effects: dict[str, EffectRecord] = {}
            if steps:
                ordered = sorted(steps)
                async with self._client.pipeline(transaction=False) as pipe:
                    for step in ordered:
                        pipe.hmget(keys.effect(step), RECORD_FIELDS)  # never the payload
                    rows = await pipe.execute()
                found = (
                    (s, EffectRecord.from_values(v)) for s, v in zip(ordered, rows, strict=True)
                )
                effects = {s: r for s, r in found if r is not None}
            return exists, job, effects

        exists, values, effects = await self._link.guard(read)
        job = {f: v for f, v in zip(_JOB_FIELDS, values, strict=True) if v is not None}
        if not exists and not effects:
            return None
        lease_exp = int(job.get("lease_exp") or 0)
        return JobView(
            fence=int(job.get("fence") or 0),
            lease_ms=_optional_int(job.get("lease_ms", "")),
            lease_expires_at_ms=lease_exp or None,
            cancelled=job.get("cancelled") == "1",
            effects=effects,
        )

    async def verify_audit(self, **options: Any) -> AuditCheck:
        """Recompute every job's audit hash chain and check anchors (``fencegate audit verify``;
        ``options``: those of :func:`gateway.store.durability.verify_audit`)."""
        return await self._link.guard(lambda: durability.verify_audit(self._client, **options))

    async def audit(
        self, tenant: str, *, job_id: str | None, limit: int, cursor: str | None
    ) -> tuple[list[AuditEntry], str | None]:
        """Rejections (and resolutions) newest first; returns (entries, next cursor). A job's
        chain also holds its registrations (``event`` entries): left out here."""
        key = JobKeys(tenant, job_id).audit if job_id else audit_feed(tenant)
        end = f"({cursor}" if cursor else "+"
        entries: list[AuditEntry] = []
        more = False
        while True:

            async def read(end: str = end) -> list[tuple[str, dict[str, str]]]:
                rows = await self._client.xrevrange(key, max=end, min="-", count=limit + 1)
                return rows  # type: ignore[return-value]  # decode_responses=True: str

            rows = await self._link.guard(read)
            for i, f in rows:
                if "event" in f:
                    continue
                if len(entries) == limit:
                    more = True
                    break
                entries.append(AuditEntry.from_fields(i, f))
            if more or len(rows) <= limit:
                break
            end = f"({rows[-1][0]}"
        return entries, (entries[-1].id if more and entries else None)

    async def history(self, keys: JobKeys, *, limit: int = 10_000) -> list[dict[str, str]]:
        """Every entry of the job's audit chain, oldest first, as stored (``id`` added):
        rejections, registrations (``event``), resolutions; the chain fields included."""

        async def read() -> list[tuple[str, dict[str, str]]]:
            rows = await self._client.xrange(keys.audit, count=limit)
            return rows  # type: ignore[return-value]  # decode_responses=True: str

        return [{"id": i, **f} for i, f in await self._link.guard(read)]

    # -- "needs a decision" (gateway.store.attention) ----------------------------------

    async def attention(
        self, tenant: str, *, limit: int, after: str | None = None
    ) -> list[dict[str, Any]]:
        """The tenant's unknown steps and dispatches past their deadline, oldest first; each
        item's ``cursor`` pages on (``after``). ValueError for a malformed ``after``."""
        return await self._attention.listing(tenant, limit=limit, after=after)

    async def overview(self, tenant: str, *, now_ms: int) -> dict[str, Any]:
        """Counts for the console's overview (see :func:`gateway.store.overview.overview`)."""
        return await overview.overview(self._attention, tenant, now_ms=now_ms)

    async def record_chain_check(self, tenant: str, summary: dict[str, Any]) -> None:
        await overview.record_chain_check(self._attention, tenant, summary)

    async def reconcile_attention(self, now_ms: int | None = None) -> dict[str, int]:
        return await self._attention.reconcile(now_ms)
