"""What the store reads without deciding: an effect, a job, the audit log, the chain check."""

from __future__ import annotations

from typing import Any

from gateway.core.records import (
    AuditCheck,
    AuditEntry,
    EffectRecord,
    JobView,
)
from gateway.store import durability
from gateway.store.base import StoreBase
from gateway.store.keys import (
    JobKeys,
    audit_feed,
)
from gateway.store.scripts import _optional_int


class StoreReads(StoreBase):
    # -- views ---------------------------------------------------------------

    async def effect(self, keys: JobKeys, step: str) -> EffectRecord | None:
        h: dict[str, str] = await self._guard(lambda: self._client.hgetall(keys.effect(step)))  # type: ignore[arg-type,return-value]
        return EffectRecord.from_hash(h) if h else None

    async def job(self, keys: JobKeys) -> JobView | None:
        async def read() -> tuple[dict[str, str], dict[str, EffectRecord]]:
            # decode_responses=True: every key and value is a str
            async with self._client.pipeline(transaction=False) as pipe:
                pipe.hgetall(keys.job)
                pipe.smembers(keys.steps)
                job, steps = await pipe.execute()
            effects: dict[str, EffectRecord] = {}
            if steps:
                ordered = sorted(steps)
                async with self._client.pipeline(transaction=False) as pipe:
                    for step in ordered:
                        pipe.hgetall(keys.effect(step))
                    hashes = await pipe.execute()
                effects = {
                    s: EffectRecord.from_hash(h) for s, h in zip(ordered, hashes, strict=True) if h
                }
            return job, effects

        job, effects = await self._guard(read)
        if not job and not effects:
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
        return await self._guard(lambda: durability.verify_audit(self._client, **options))

    async def audit(
        self, tenant: str, *, job_id: str | None, limit: int, cursor: str | None
    ) -> tuple[list[AuditEntry], str | None]:
        """Rejections newest first; returns (entries, next cursor)."""
        key = JobKeys(tenant, job_id).audit if job_id else audit_feed(tenant)
        end = f"({cursor}" if cursor else "+"

        async def read() -> list[tuple[str, dict[str, str]]]:
            rows = await self._client.xrevrange(key, max=end, min="-", count=limit + 1)
            return rows  # type: ignore[return-value]  # decode_responses=True: str

        rows = await self._guard(read)
        entries = [AuditEntry.from_fields(i, f) for i, f in rows[:limit]]
        next_cursor = entries[-1].id if len(rows) > limit else None
        return entries, next_cursor
