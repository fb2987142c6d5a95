"""fencegate for a PostgreSQL job table (psycopg 3): claim a job with ``SKIP LOCKED`` and its
attempt counter, register that attempt as the job's generation in the same step, and commit
only while the attempt still holds.

::

    jobs = PostgresJobs(DSN, "http://127.0.0.1:8080", api_key=CLAIM_KEY, lease_seconds=30)
    claim = await jobs.claim(worker="w1")          # None: nothing to do
    async with jobs.hold(claim) as job:            # a FencedJob; the row's lease renewed
        await job.effect("notify", adapter="email", operation="send", payload={...})
        committed = await jobs.complete(job, claim, result={...})

The contract:

- **The claim** is one transaction: ``UPDATE … SET attempt = attempt + 1, owner, lease_until,
  state = 'running' WHERE id = (SELECT … WHERE state = 'queued' OR (state = 'running' AND
  lease_until < now()) … FOR UPDATE SKIP LOCKED) RETURNING id, attempt``; the attempt is
  registered with fencegate (a worker key with ``claims = true``) while the row is locked,
  and the transaction commits only after fencegate took it. A gateway that cannot be
  reached rolls the claim back; a registration answered ``generation_regression`` (the
  table is behind the fence: restored from a backup) rolls it back and raises; a job that
  fencegate says completed (``job_completed``: its table commit was lost) is marked
  succeeded and not handed out.
- **The lease** is the row's ``lease_until`` and the generation's ``lease_ms``; :meth:`hold`
  renews both while the body runs. A worker frozen past it loses the row to the next claim,
  whose registration makes every call of the frozen attempt stale.
- **The commit** (:meth:`complete`) completes the job in fencegate under the fence (a stale
  attempt raises :class:`~gateway.client.StaleGeneration` and changes nothing), then
  ``UPDATE … SET state = 'succeeded' WHERE id = … AND attempt = …`` (False: the row moved
  on; the result stands in fencegate either way).

Limits: the body of a superseded attempt is cancelled at its next ``await`` (the SDK's
heartbeat); code that blocks the event loop keeps running, and only its effects,
checkpoints, outputs and completion are refused. Database writes of the body's own are not
fenced by fencegate: guard them with ``WHERE attempt = …`` as :meth:`complete` does.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from gateway.client import FencedJob, JobCompleted, Scheduler

__all__ = ["Claim", "JobTable", "PostgresJobs"]


@dataclass(frozen=True, slots=True)
class JobTable:
    """The job table's name and columns (identifiers, quoted when used)."""

    name: str = "jobs"
    id: str = "job_id"
    attempt: str = "attempt"
    owner: str = "owner"
    lease_until: str = "lease_until"
    state: str = "state"

    def ids(self) -> dict[str, sql.Identifier]:
        return {
            "t": sql.Identifier(self.name),
            "id": sql.Identifier(self.id),
            "a": sql.Identifier(self.attempt),
            "o": sql.Identifier(self.owner),
            "l": sql.Identifier(self.lease_until),
            "s": sql.Identifier(self.state),
        }

    def create(self) -> sql.Composed:
        """``CREATE TABLE IF NOT EXISTS`` with the columns the helpers use."""
        return sql.SQL(
            "CREATE TABLE IF NOT EXISTS {t} ({id} text PRIMARY KEY, "
            "{a} bigint NOT NULL DEFAULT 0, {o} text, {l} timestamptz, "
            "{s} text NOT NULL DEFAULT 'queued', payload jsonb)"
        ).format(**self.ids())


@dataclass(frozen=True, slots=True)
class Claim:
    """A claimed row: its job id, its attempt (the generation) and the fencing token."""

    job_id: str
    attempt: int
    token: str
    worker: str


class PostgresJobs:
    """Claims, lease renewals and fenced commits on one job table."""

    def __init__(
        self,
        conninfo: str,
        base_url: str,
        *,
        api_key: str | None = None,
        table: JobTable | None = None,
        lease_seconds: float = 30.0,
        timeout: float = 30.0,
    ) -> None:
        if not 1.0 <= lease_seconds <= 86_400.0:
            raise ValueError("lease_seconds must be 1 … 86,400 (fencegate's lease_ms bounds)")
        self.conninfo = conninfo
        self.base_url = base_url
        self.api_key = api_key
        self.table = table or JobTable()
        self.lease_seconds = lease_seconds
        self.timeout = timeout

    async def _connect(self) -> psycopg.AsyncConnection[Any]:
        return await psycopg.AsyncConnection.connect(self.conninfo)

    async def claim(self, *, worker: str) -> Claim | None:
        """Claim the next queued job, or one whose lease ran out; None when there is none."""
        claim_sql = sql.SQL(
            "UPDATE {t} SET {a} = {a} + 1, {o} = %s, "
            "{l} = now() + make_interval(secs => %s), {s} = 'running' "
            "WHERE {id} = (SELECT {id} FROM {t} "
            "  WHERE {s} = 'queued' OR ({s} = 'running' AND {l} < now()) "
            "  ORDER BY {id} LIMIT 1 FOR UPDATE SKIP LOCKED) "
            "RETURNING {id}, {a}"
        ).format(**self.table.ids())
        async with await self._connect() as conn:
            while True:
                async with conn.transaction():
                    row = await (
                        await conn.execute(claim_sql, (worker, self.lease_seconds))
                    ).fetchone()
                    if row is None:
                        return None
                    job_id, attempt = str(row[0]), int(row[1])
                    token = await self._register(job_id, attempt)
                    if token is not None:
                        return Claim(job_id, attempt, token, worker)
                    await self._mark_succeeded(conn, job_id, attempt)
                # a job fencegate had completed: marked, committed; look for the next one

    async def _register(self, job_id: str, attempt: int) -> str | None:
        async with Scheduler(self.base_url, api_key=self.api_key, timeout=self.timeout) as fg:
            try:
                gen = await fg.register(job_id, attempt, int(self.lease_seconds * 1000))
            except JobCompleted:
                return None
            # anything else (GenerationRegression, GatewayUnreachable …) leaves this
            # transaction: the claim is rolled back
        return gen.token

    async def _mark_succeeded(
        self, conn: psycopg.AsyncConnection[Any], job_id: str, attempt: int
    ) -> bool:
        done = sql.SQL(
            "UPDATE {t} SET {s} = 'succeeded', {o} = NULL WHERE {id} = %s AND {a} = %s"
        ).format(**self.table.ids())
        cur = await conn.execute(done, (job_id, attempt))
        return cur.rowcount == 1

    async def renew(self, claim: Claim) -> bool:
        """Extend the row's lease while the attempt holds (False: it moved on)."""
        renew_sql = sql.SQL(
            "UPDATE {t} SET {l} = now() + make_interval(secs => %s) "
            "WHERE {id} = %s AND {a} = %s AND {s} = 'running'"
        ).format(**self.table.ids())
        async with await self._connect() as conn:
            cur = await conn.execute(renew_sql, (self.lease_seconds, claim.job_id, claim.attempt))
            return cur.rowcount == 1

    @contextlib.asynccontextmanager
    async def hold(self, claim: Claim, **fenced: Any) -> AsyncIterator[FencedJob]:
        """The claim's :class:`FencedJob` (heartbeats renew the generation's lease) while the
        row's lease is renewed every third of it; both stop when the block ends."""
        fenced.setdefault("heartbeat_interval", self.lease_seconds / 3)
        job = FencedJob(
            self.base_url,
            claim.job_id,
            claim.token,
            api_key=self.api_key,
            worker_id=claim.worker,
            timeout=self.timeout,
            **fenced,
        )
        renewing = asyncio.create_task(self._renew_row(claim))
        try:
            async with job:
                yield job
        finally:
            renewing.cancel()
            await asyncio.gather(renewing, return_exceptions=True)

    async def _renew_row(self, claim: Claim) -> None:
        while True:
            await asyncio.sleep(self.lease_seconds / 3)
            try:
                if not await self.renew(claim):
                    return  # the row moved on; the fence refuses this attempt from now on
            except psycopg.Error:
                continue  # the database is briefly away: the next renewal tries again

    async def complete(self, job: FencedJob, claim: Claim, *, result: Any = None) -> bool:
        """Complete the job in fencegate under the fence, then commit the row if the attempt
        still holds. Raises what the completion raises (a stale attempt: StaleGeneration)."""
        await job.complete(result=result)
        async with await self._connect() as conn:
            return await self._mark_succeeded(conn, claim.job_id, claim.attempt)
